"""MoH-LLaMA: Transformers' Llama with Mixture-of-Head attention.

Everything is Llama's except the attention module, which keeps LlamaAttention's q/k/v/o projections (same state-dict
keys) and gates each head's output with a MoH head router (the MoH package, `models/moh/`). With the "l2" router the state
dict is exactly Llama's. With all heads active and straight-through gates the logits equal `LlamaForCausalLM`'s.
"""

import torch
from transformers.generation import GenerationMixin
from transformers.models.llama.modeling_llama import (
    LlamaAttention,
    LlamaDecoderLayer,
    LlamaForCausalLM,
    LlamaModel,
    LlamaPreTrainedModel,
)
from transformers.utils.output_capturing import _CAN_RECORD_REGISTRY, OutputRecorder

from ..causal_lm import MoHCausalLMOutputWithPast, causal_lm_forward
from ..moh.head_routers import MoHRouter
from ..moh.moh_attention import MoHAttentionMixin, add_head_router
from ..moh.moh_parallel import MoHHeadRouterParallel  # noqa: F401  (registers the "moh_head_router" TP style)
from .configuration_moh_llama import MoHLlamaConfig, refuse_auto_class_registration


class MoHLlamaAttention(MoHAttentionMixin, LlamaAttention):
    """LlamaAttention whose heads are gated per token by `head_router` (plain LlamaAttention when MoH is off)."""

    def __init__(self, config: MoHLlamaConfig, layer_idx: int):
        super().__init__(config, layer_idx)
        add_head_router(self, config)


class MoHLlamaDecoderLayer(LlamaDecoderLayer):
    """LlamaDecoderLayer whose attention routes its heads."""

    def __init__(self, config: MoHLlamaConfig, layer_idx: int):
        super().__init__(config, layer_idx)
        route_heads(self)


def route_heads(layer: LlamaDecoderLayer) -> None:
    """Make a Llama decoder layer MoH in place: its LlamaAttention (weights and hooks kept) becomes a
    MoHLlamaAttention with a head router built from the layer's config (none when MoH is off)."""
    attention = layer.self_attn
    attention.__class__ = MoHLlamaAttention
    add_head_router(attention, attention.config)
    layer.__class__ = MoHLlamaDecoderLayer


class MoHLlamaPreTrainedModel(LlamaPreTrainedModel):
    config: MoHLlamaConfig
    config_class = MoHLlamaConfig
    _no_split_modules = ["MoHLlamaDecoderLayer", "LlamaDecoderLayer"]
    _can_record_outputs = {
        **LlamaPreTrainedModel._can_record_outputs,
        "moh_router_logits": OutputRecorder(MoHRouter, index=1),
    }

    @classmethod
    def register_for_auto_class(cls, auto_class="AutoModel"):
        refuse_auto_class_registration(cls)
        super().register_for_auto_class(auto_class)

    @torch.no_grad()
    def _init_weights(self, module):
        super()._init_weights(module)
        if isinstance(module, MoHRouter):
            module.init_parameters()


class MoHLlamaModel(MoHLlamaPreTrainedModel, LlamaModel):
    """LlamaModel whose decoder layers are MoHLlamaDecoderLayer (built by Llama, their attention routed in place)."""

    def __init__(self, config: MoHLlamaConfig):
        config.validate_architecture()  # again: fields may have been set after the config was built
        super().__init__(config)
        for layer in self.layers:
            route_heads(layer)


class MoHLlamaForCausalLM(MoHLlamaPreTrainedModel, LlamaForCausalLM, GenerationMixin):
    """LlamaForCausalLM around a MoHLlamaModel, with the MoH losses in its forward."""

    def __init__(self, config: MoHLlamaConfig):
        config.validate_architecture()
        super().__init__(config)  # LlamaForCausalLM builds a LlamaModel: made a MoHLlamaModel in place
        self.model.__class__ = MoHLlamaModel
        _CAN_RECORD_REGISTRY[self.model] = MoHLlamaModel._can_record_outputs
        for layer in self.model.layers:
            route_heads(layer)

    forward = causal_lm_forward  # Llama's causal-LM forward plus the MoH balance loss (models/causal_lm.py)


__all__ = [
    "MoHCausalLMOutputWithPast",
    "MoHLlamaAttention",
    "MoHLlamaForCausalLM",
    "MoHLlamaModel",
    "MoHLlamaPreTrainedModel",
]
