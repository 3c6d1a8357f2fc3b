"""MoH-LLaMA: Transformers' Llama with Mixture-of-Head attention.

Everything is Llama's except the attention module, which keeps LlamaAttention's q/k/v/o projections (same state-dict
keys) and gates each head's output with a MoH head router (see `models/mhmoe/moh.py`). With the "l2" router the state
dict is exactly Llama's. With all heads active and straight-through gates the logits equal `LlamaForCausalLM`'s.
"""

from dataclasses import dataclass

import torch
from torch import nn
from transformers.cache_utils import Cache
from transformers.modeling_layers import GradientCheckpointingLayer
from transformers.modeling_outputs import CausalLMOutputWithPast
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
from transformers.processing_utils import Unpack
from transformers.utils import TransformersKwargs, can_return_tuple
from transformers.utils.output_capturing import OutputRecorder

# One source of truth for MoH (a later export step copies moh.py next to this file).
from ..mhmoe.losses import lm_logits_and_loss
from ..mhmoe.moh import MoHAttentionMixin, MoHRouter, add_head_router, moh_enabled
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


@dataclass
class MoHCausalLMOutputWithPast(CausalLMOutputWithPast):
    """Llama's causal-LM output plus the (unweighted) MoH load-balancing loss and the head-router logits."""

    moh_aux_loss: torch.FloatTensor | None = None
    moh_router_logits: tuple[torch.FloatTensor, ...] | None = None


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
    logits, loss, router_losses = lm_logits_and_loss(
        self, outputs, labels, logits_to_keep, attention_mask, output_router_logits, **kwargs
    )

    return MoHCausalLMOutputWithPast(
        loss=loss,
        moh_aux_loss=router_losses["moh_aux_loss"],
        logits=logits,
        past_key_values=outputs.past_key_values,
        hidden_states=outputs.hidden_states,
        attentions=outputs.attentions,
        moh_router_logits=outputs.get("moh_router_logits"),  # set by capture_outputs (`_can_record_outputs`)
    )


class MoHLlamaForCausalLM(MoHLlamaPreTrainedModel, LlamaForCausalLM):
    def __init__(self, config: MoHLlamaConfig):
        MoHLlamaPreTrainedModel.__init__(self, config)  # LlamaForCausalLM's body with the MoH model
        self.model = MoHLlamaModel(config)
        self.vocab_size = config.vocab_size
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.post_init()

    forward = moh_causal_lm_forward


__all__ = [
    "MoHCausalLMOutputWithPast", "MoHLlamaAttention", "MoHLlamaForCausalLM", "MoHLlamaModel",
    "MoHLlamaPreTrainedModel", "moh_causal_lm_forward",
]  # fmt: skip
