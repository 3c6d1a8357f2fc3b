"""MHMoE: a LLaMA-style decoder whose feed-forward is a dense SwiGLU MLP or a Multi-Head MoE block.

Configured dense it has exactly `LlamaForCausalLM`'s parameters; configured as plain SMoE (moe_heads=1, no head/merge
layer, no shared expert) exactly `MixtralForCausalLM`'s. Shape legend: B batch, T tokens, D hidden_size,
h moe_heads, W = D / h sub-token width, N = B·T·h routed rows, E experts, K experts per row.
"""

from dataclasses import dataclass

import torch
from torch import nn
from transformers.cache_utils import Cache, DynamicCache
from transformers.generation import GenerationMixin
from transformers.masking_utils import create_causal_mask, create_sliding_window_causal_mask
from transformers.modeling_layers import GradientCheckpointingLayer
from transformers.modeling_outputs import MoeModelOutputWithPast
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS, PreTrainedModel
from transformers.models.llama.modeling_llama import LlamaRMSNorm, LlamaRotaryEmbedding, eager_attention_forward
from transformers.processing_utils import Unpack
from transformers.utils import TransformersKwargs
from transformers.utils.generic import merge_with_config_defaults
from transformers.utils.output_capturing import OutputRecorder, capture_outputs

from ..cache_naming import CACHE, CACHE_NAMES, either_cache
from ..causal_lm import MHMoECausalLMOutputWithPast, causal_lm_forward_returning
from ..moh.head_routers import MoHRouter
from ..moh.moh_attention import add_head_router, attention_forward
from ..moh.moh_parallel import MoHHeadRouterParallel  # noqa: F401  (registers the "moh_head_router" TP style)
from .configuration_mhmoe import MHMoEConfig
from .experts import LIBRARY_EXPERTS_IMPLEMENTATIONS
from .linear_types import make_linear
from .router_types import make_moe_block
from .sparse_moe import MHMoEMLP, MHMoETopKRouter


class MHMoERMSNorm(LlamaRMSNorm):
    pass


class MHMoEAttention(nn.Module):
    """Multi-head attention with GQA, RoPE and an optional sliding window; backends via ALL_ATTENTION_FUNCTIONS.
    With moh_* set, Mixture-of-Head attention: a head router gates each head's output before o_proj (the forward is
    `moh_attention.attention_forward`, shared with MoH-Llama and the patched Llama-family models)."""

    def __init__(self, config: MHMoEConfig, layer_idx: int):
        super().__init__()
        self.config = config
        self.layer_idx = layer_idx
        self.head_dim = config.head_dim
        self.num_key_value_groups = config.num_attention_heads // config.num_key_value_heads
        self.scaling = self.head_dim**-0.5
        self.attention_dropout = config.attention_dropout
        self.is_causal = True
        q_dim, kv_dim = config.num_attention_heads * self.head_dim, config.num_key_value_heads * self.head_dim
        bias = config.attention_bias
        self.q_proj = make_linear(config, config.hidden_size, q_dim, bias=bias, sublayer_in=True)
        self.k_proj = make_linear(config, config.hidden_size, kv_dim, bias=bias, sublayer_in=True)
        self.v_proj = make_linear(config, config.hidden_size, kv_dim, bias=bias, sublayer_in=True)
        self.o_proj = make_linear(config, q_dim, config.hidden_size, bias=bias)
        add_head_router(self, config)  # self.head_router: None unless MoH

    def forward(
        self,
        hidden_states: torch.Tensor,
        position_embeddings: tuple[torch.Tensor, torch.Tensor],
        attention_mask: torch.Tensor | None,
        cache: Cache | None = None,
        past_key_values: Cache | None = None,  # the cache's name before Transformers 5.24 (cache_naming.py)
        **kwargs: Unpack[TransformersKwargs],
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        attention_interface = ALL_ATTENTION_FUNCTIONS.get_interface(
            self.config._attn_implementation, eager_attention_forward
        )  # the backend (eager, sdpa, flex, flash, or one a user registered)
        return attention_forward(
            self,
            hidden_states,
            position_embeddings,
            attention_mask,
            either_cache(cache, past_key_values),
            self.config.sliding_window,
            attention_interface=attention_interface,
            **kwargs,
        )


class MHMoEDecoderLayer(GradientCheckpointingLayer):
    def __init__(self, config: MHMoEConfig, layer_idx: int):
        super().__init__()
        self.hidden_size = config.hidden_size
        self.self_attn = MHMoEAttention(config, layer_idx)
        if config.is_moe_layer(layer_idx):
            self.mlp = make_moe_block(config, layer_idx)  # the block `router_type` names (router_types.py)
        else:
            self.mlp = MHMoEMLP(config, config.intermediate_size, bias=config.mlp_bias)
        self.input_layernorm = MHMoERMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = MHMoERMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def forward(
        self,
        hidden_states: torch.Tensor,
        position_embeddings: tuple[torch.Tensor, torch.Tensor] | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        cache: Cache | None = None,
        past_key_values: Cache | None = None,  # the cache's name before Transformers 5.24 (cache_naming.py)
        **kwargs: Unpack[TransformersKwargs],
    ) -> torch.Tensor:
        cache = either_cache(cache, past_key_values)
        residual = hidden_states
        hidden_states, _ = self.self_attn(
            hidden_states=self.input_layernorm(hidden_states),
            position_embeddings=position_embeddings,
            attention_mask=attention_mask,
            position_ids=position_ids,
            cache=cache,
            **kwargs,
        )
        hidden_states = residual + hidden_states
        mlp_kwargs = {"cache": cache} if getattr(self.mlp, "reads_cache", False) else {}
        return hidden_states + self.mlp(self.post_attention_layernorm(hidden_states), **mlp_kwargs)


class MHMoEPreTrainedModel(PreTrainedModel):
    config: MHMoEConfig
    base_model_prefix = "model"
    supports_gradient_checkpointing = True
    _no_split_modules = ["MHMoEDecoderLayer"]
    _skip_keys_device_placement = list(CACHE_NAMES)
    _supports_flash_attn = True
    _supports_sdpa = True
    _supports_flex_attn = True
    _supports_attention_backend = True
    _can_compile_fullgraph = True  # static-shape routing and dispatch (tests/models/test_compile_export.py)
    _can_record_outputs = {
        "router_logits": OutputRecorder(MHMoETopKRouter, index=0),
        "moh_router_logits": OutputRecorder(MoHRouter, index=1),
        "hidden_states": MHMoEDecoderLayer,
        "attentions": MHMoEAttention,
    }

    @torch.no_grad()
    def _init_weights(self, module):
        super()._init_weights(module)
        if hasattr(module, "init_parameters"):  # the library's experts and routers, which Transformers does not know
            module.init_parameters(self.config.initializer_range)

    @classmethod
    def _can_set_experts_implementation(cls) -> bool:
        """The experts dispatch through Transformers' experts interface (`experts.MHMoEExperts`); Transformers' own
        check looks for `@use_experts_implementation` in this file's source only."""
        return True

    def get_correct_experts_implementation(self, requested_experts: str | None) -> str:
        """Transformers' choice, plus the experts backends only this library has ("triton": `ops/backends.py`)."""
        if requested_experts in LIBRARY_EXPERTS_IMPLEMENTATIONS:
            return requested_experts
        return super().get_correct_experts_implementation(requested_experts)


@dataclass
class MHMoEModelOutputWithPast(MoeModelOutputWithPast):
    """Mixtral's output plus the MoH head-router logits, one (B, T, R) tensor per MoH layer (`output_router_logits`)."""

    moh_router_logits: tuple[torch.FloatTensor, ...] | None = None


class MHMoEModel(MHMoEPreTrainedModel):
    def __init__(self, config: MHMoEConfig):
        config.validate_architecture()  # again: fields may have been set after the config was built
        super().__init__(config)
        self.padding_idx = config.pad_token_id
        self.vocab_size = config.vocab_size
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size, self.padding_idx)
        self.layers = nn.ModuleList([MHMoEDecoderLayer(config, i) for i in range(config.num_hidden_layers)])
        self.norm = MHMoERMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.rotary_emb = LlamaRotaryEmbedding(config=config)
        self.gradient_checkpointing = False
        self.post_init()

    @merge_with_config_defaults
    @capture_outputs
    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        cache: Cache | None = None,
        inputs_embeds: torch.Tensor | None = None,
        use_cache: bool | None = None,
        past_key_values: Cache | None = None,  # the cache's name before Transformers 5.24 (cache_naming.py)
        **kwargs: Unpack[TransformersKwargs],
    ) -> MHMoEModelOutputWithPast:
        if (input_ids is None) ^ (inputs_embeds is not None):
            raise ValueError("You must specify exactly one of input_ids or inputs_embeds")
        cache = either_cache(cache, past_key_values)
        if use_cache and cache is None:
            cache = DynamicCache(config=self.config)
        if inputs_embeds is None:
            inputs_embeds = self.embed_tokens(input_ids)
        if position_ids is None:
            past_seen_tokens = cache.get_seq_length() if cache is not None else 0
            position_ids = torch.arange(inputs_embeds.shape[1], device=inputs_embeds.device) + past_seen_tokens
            position_ids = position_ids.unsqueeze(0)

        mask_function = create_causal_mask if self.config.sliding_window is None else create_sliding_window_causal_mask
        causal_mask = mask_function(
            config=self.config,
            inputs_embeds=inputs_embeds,
            attention_mask=attention_mask,
            position_ids=position_ids,
            **{CACHE: cache},
        )
        hidden_states = inputs_embeds
        position_embeddings = self.rotary_emb(hidden_states, position_ids=position_ids)
        for decoder_layer in self.layers[: self.config.num_hidden_layers]:
            hidden_states = decoder_layer(
                hidden_states,
                attention_mask=causal_mask,
                position_ids=position_ids,
                cache=cache,
                use_cache=use_cache,
                position_embeddings=position_embeddings,
                **kwargs,
            )
        return MHMoEModelOutputWithPast(last_hidden_state=self.norm(hidden_states), **{CACHE: cache})


class MHMoEForCausalLM(MHMoEPreTrainedModel, GenerationMixin):
    _tied_weights_keys = {"lm_head.weight": "model.embed_tokens.weight"}
    _tp_plan = {"lm_head": "colwise_gather_output"}
    _pp_plan = {"lm_head": (["hidden_states"], ["logits"])}

    def __init__(self, config: MHMoEConfig):
        super().__init__(config)
        self.model = MHMoEModel(config)
        self.vocab_size = config.vocab_size
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.post_init()

    causal_lm_output_class = MHMoECausalLMOutputWithPast
    # base model -> LM head -> LM + router losses (models/causal_lm.py), annotated `-> MHMoECausalLMOutputWithPast`
    forward = causal_lm_forward_returning(MHMoECausalLMOutputWithPast)


__all__ = ["MHMoEForCausalLM", "MHMoEModel", "MHMoEPreTrainedModel"]
