"""MoH-LLaMA: Transformers' Llama with Mixture-of-Head attention.

Everything is Llama's except the attention module, which keeps LlamaAttention's q/k/v/o projections (same state-dict
keys) and gates each head's output with a MoH head router (see `models/mhmoe/moh.py`). With the "l2" router the state
dict is exactly Llama's. With all heads active and straight-through gates the logits equal `LlamaForCausalLM`'s.
"""

from dataclasses import dataclass

import torch
from transformers.cache_utils import Cache
from transformers.generation import GenerationMixin
from transformers.modeling_outputs import CausalLMOutputWithPast
from transformers.models.llama.modeling_llama import (
    LlamaAttention,
    LlamaDecoderLayer,
    LlamaForCausalLM,
    LlamaModel,
    LlamaPreTrainedModel,
)
from transformers.processing_utils import Unpack
from transformers.utils import TransformersKwargs, can_return_tuple
from transformers.utils.output_capturing import _CAN_RECORD_REGISTRY, OutputRecorder

# One source of truth for MoH (a later export step copies moh.py next to this file).
from ..mhmoe.moh import MoHAttentionMixin, MoHRouter, add_head_router, add_moh_aux_loss, moh_enabled
from ..mhmoe.configuration_mhmoe import refuse_auto_class_registration
from ..mhmoe.moh_parallel import MoHHeadRouterParallel  # noqa: F401  (registers the "moh_head_router" TP style)
from .configuration_moh_llama import MoHLlamaConfig


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
            module.reset_parameters()


@dataclass
class MoHCausalLMOutputWithPast(CausalLMOutputWithPast):
    """Llama's causal-LM output plus the (unweighted) MoH load-balancing loss and the head-router logits."""

    moh_aux_loss: torch.FloatTensor | None = None
    moh_router_logits: tuple[torch.FloatTensor, ...] | None = None


class MoHLlamaModel(MoHLlamaPreTrainedModel, LlamaModel):
    """LlamaModel whose decoder layers are MoHLlamaDecoderLayer (built by Llama, their attention routed in place)."""

    def __init__(self, config: MoHLlamaConfig):
        config.validate_architecture()  # again: fields may have been set after the config was built
        super().__init__(config)
        for layer in self.layers:
            route_heads(layer)


@can_return_tuple
def moh_causal_lm_forward(
    self,
    input_ids: torch.LongTensor | None = None,
    attention_mask: torch.Tensor | None = None,
    position_ids: torch.LongTensor | None = None,
    past_key_values: Cache | None = None,
    inputs_embeds: torch.Tensor | None = None,
    labels: torch.LongTensor | None = None,
    use_cache: bool | None = None,
    output_router_logits: bool | None = None,
    logits_to_keep: int | torch.Tensor = 0,
    **kwargs: Unpack[TransformersKwargs],
) -> MoHCausalLMOutputWithPast:
    """Llama's causal-LM forward plus MoH: with `output_router_logits` (argument or config) it returns the head
    load-balancing loss `moh_aux_loss` (eq. 7) and, when `labels` are given, adds it ×`moh_aux_loss_coef` to the loss.
    Shared by MoHLlamaForCausalLM and the Mistral/Qwen2 models `mhmoe.apply_moh` patches."""
    config = self.config
    if output_router_logits is None:
        output_router_logits = getattr(config, "output_router_logits", False)
    if moh_enabled(config):
        kwargs.setdefault("output_moh_router_logits", output_router_logits)
    outputs = self.model(
        input_ids=input_ids,
        attention_mask=attention_mask,
        position_ids=position_ids,
        past_key_values=past_key_values,
        inputs_embeds=inputs_embeds,
        use_cache=use_cache,
        **kwargs,
    )
    hidden_states = outputs.last_hidden_state
    slice_indices = slice(-logits_to_keep, None) if isinstance(logits_to_keep, int) else logits_to_keep
    logits = self.lm_head(hidden_states[:, slice_indices, :])

    loss = None
    if labels is not None:
        loss = self.loss_function(logits=logits, labels=labels, vocab_size=config.vocab_size, **kwargs)
    moh_router_logits = outputs.get("moh_router_logits")  # set by capture_outputs (`_can_record_outputs`)
    loss, moh_aux_loss = add_moh_aux_loss(loss, moh_router_logits if output_router_logits else None, config,
                                          attention_mask)  # fmt: skip

    return MoHCausalLMOutputWithPast(
        loss=loss,
        moh_aux_loss=moh_aux_loss,
        logits=logits,
        past_key_values=outputs.past_key_values,
        hidden_states=outputs.hidden_states,
        attentions=outputs.attentions,
        moh_router_logits=moh_router_logits,
    )


class MoHLlamaForCausalLM(MoHLlamaPreTrainedModel, LlamaForCausalLM, GenerationMixin):
    """LlamaForCausalLM around a MoHLlamaModel, with the MoH losses in its forward."""

    def __init__(self, config: MoHLlamaConfig):
        config.validate_architecture()
        super().__init__(config)  # LlamaForCausalLM builds a LlamaModel: made a MoHLlamaModel in place
        self.model.__class__ = MoHLlamaModel
        _CAN_RECORD_REGISTRY[self.model] = MoHLlamaModel._can_record_outputs
        for layer in self.model.layers:
            route_heads(layer)

    forward = moh_causal_lm_forward


__all__ = [
    "MoHCausalLMOutputWithPast", "MoHLlamaAttention", "MoHLlamaForCausalLM", "MoHLlamaModel",
    "MoHLlamaPreTrainedModel", "moh_causal_lm_forward",
]  # fmt: skip
