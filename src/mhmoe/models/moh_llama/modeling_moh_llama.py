"""MoH-LLaMA: Transformers' Llama with Mixture-of-Head attention.

Everything is Llama's except the attention module, which keeps LlamaAttention's q/k/v/o projections (same state-dict
keys) and gates each head's output with a MoH head router (see `models/mhmoe/moh.py`). With the "l2" router the state
dict is exactly Llama's. With all heads active and straight-through gates the logits equal `LlamaForCausalLM`'s.
"""

import torch
from torch import nn
from transformers.modeling_layers import GradientCheckpointingLayer
from transformers.models.llama.modeling_llama import (
    LlamaAttention,
    LlamaDecoderLayer,
    LlamaForCausalLM,
    LlamaMLP,
    LlamaModel,
    LlamaPreTrainedModel,
    LlamaRMSNorm,
    LlamaRotaryEmbedding,
)
from transformers.utils.output_capturing import OutputRecorder

# One source of truth for MoH (a later export step copies moh.py next to this file).
from ..mhmoe.causal_lm import MoHCausalLMOutputWithPast, causal_lm_forward
from ..mhmoe.moh import MoHAttentionMixin, MoHRouter, add_head_router
from ..mhmoe.configuration_mhmoe import refuse_auto_class_registration
from .configuration_moh_llama import MoHLlamaConfig


class MoHLlamaAttention(MoHAttentionMixin, LlamaAttention):
    """LlamaAttention whose heads are gated per token by `head_router` (plain LlamaAttention when MoH is off)."""

    def __init__(self, config: MoHLlamaConfig, layer_idx: int):
        super().__init__(config, layer_idx)
        add_head_router(self, config)


class MoHLlamaDecoderLayer(LlamaDecoderLayer):
    def __init__(self, config: MoHLlamaConfig, layer_idx: int):
        GradientCheckpointingLayer.__init__(self)  # LlamaDecoderLayer's body with the MoH attention
        self.hidden_size = config.hidden_size
        self.self_attn = MoHLlamaAttention(config=config, layer_idx=layer_idx)
        self.mlp = LlamaMLP(config)
        self.input_layernorm = LlamaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = LlamaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)


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


class MoHLlamaModel(MoHLlamaPreTrainedModel, LlamaModel):
    def __init__(self, config: MoHLlamaConfig):
        config.validate_architecture()  # again: fields may have been set after the config was built
        MoHLlamaPreTrainedModel.__init__(self, config)  # LlamaModel's body with MoH decoder layers
        self.padding_idx = config.pad_token_id
        self.vocab_size = config.vocab_size
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size, self.padding_idx)
        self.layers = nn.ModuleList(
            [MoHLlamaDecoderLayer(config, layer_idx) for layer_idx in range(config.num_hidden_layers)]
        )
        self.norm = LlamaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.rotary_emb = LlamaRotaryEmbedding(config=config)
        self.gradient_checkpointing = False
        self.post_init()


moh_causal_lm_forward = causal_lm_forward  # the former name, kept for one release


class MoHLlamaForCausalLM(MoHLlamaPreTrainedModel, LlamaForCausalLM):
    def __init__(self, config: MoHLlamaConfig):
        MoHLlamaPreTrainedModel.__init__(self, config)  # LlamaForCausalLM's body with the MoH model
        self.model = MoHLlamaModel(config)
        self.vocab_size = config.vocab_size
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.post_init()

    forward = causal_lm_forward  # Llama's causal-LM forward plus the MoH balance loss (models/mhmoe/causal_lm.py)


__all__ = [
    "MoHCausalLMOutputWithPast", "MoHLlamaAttention", "MoHLlamaForCausalLM", "MoHLlamaModel",
    "MoHLlamaPreTrainedModel", "moh_causal_lm_forward",
]  # fmt: skip
