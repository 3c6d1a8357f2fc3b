"""MHMoE: a LLaMA-style decoder whose feed-forward is a dense SwiGLU MLP or a Multi-Head MoE block.

Configured dense it has exactly `LlamaForCausalLM`'s parameters; configured as plain SMoE (moe_heads=1, no head/merge
layer, no shared expert) exactly `MixtralForCausalLM`'s. Shape legend: B batch, T tokens, D hidden_size,
h moe_heads, W = D / h sub-token width, N = B·T·h routed rows, E experts, K experts per row.
"""

import contextlib
from dataclasses import dataclass

import torch
from torch import nn
from transformers.activations import ACT2FN
from transformers.cache_utils import Cache, DynamicCache
from transformers.generation import GenerationMixin
from transformers.integrations import use_experts_implementation
from transformers.masking_utils import create_causal_mask, create_sliding_window_causal_mask
from transformers.modeling_layers import GradientCheckpointingLayer
from transformers.modeling_outputs import MoeModelOutputWithPast
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS, PreTrainedModel
from transformers.models.llama.modeling_llama import LlamaRMSNorm, LlamaRotaryEmbedding, eager_attention_forward
from transformers.processing_utils import Unpack
from transformers.utils import TransformersKwargs
from transformers.utils.generic import merge_with_config_defaults
from transformers.utils.output_capturing import OutputRecorder, capture_outputs

from .bitnet import BitNetExperts, ffn_input_norm, is_quantized, make_linear
from .cache_naming import CACHE, CACHE_NAMES, either_cache
from .configuration_mhmoe import MHMoEConfig
from .causal_lm import MHMoECausalLMOutputWithPast, causal_lm_forward, causal_lm_forward_returning  # noqa: F401
from .lory import LoryExperts, LoryRouter, MHLoryBlock
from .moe import MHMOE_EXPERTS_FUNCTIONS, eager_experts_forward
from .moh import MoHRouter, add_head_router, attention_forward
from .publish import SelfContainedSaveMixin
from .moh_parallel import MoHHeadRouterParallel  # noqa: F401  (registers the "moh_head_router" TP style)
from .routing import route


class MHMoERMSNorm(LlamaRMSNorm):
    pass


class MHMoEMLP(nn.Module):
    """SwiGLU feed-forward with Llama's parameter names (dense layers and the shared expert)."""

    def __init__(self, config: MHMoEConfig, intermediate_size: int, bias: bool = False):
        super().__init__()
        norm = ffn_input_norm(config)  # False: only the sub-layer norm before down (the official BitNet FFN)
        self.gate_proj = make_linear(config, config.hidden_size, intermediate_size, bias, "ffn", input_norm=norm)
        self.up_proj = make_linear(config, config.hidden_size, intermediate_size, bias, "ffn", input_norm=norm)
        self.down_proj = make_linear(config, intermediate_size, config.hidden_size, bias, "ffn")
        self.act_fn = ACT2FN[config.hidden_act]

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.gate_proj(hidden_states)) * self.up_proj(hidden_states))


@use_experts_implementation(experts_interface=MHMOE_EXPERTS_FUNCTIONS)
class MHMoEExperts(nn.Module):
    """`num_experts` SwiGLU experts on sub-tokens of width W, stored as 3-D parameters like Mixtral's."""

    def __init__(self, config: MHMoEConfig):
        super().__init__()
        self.num_experts = config.num_experts
        self.hidden_dim = config.hidden_size // config.moe_heads
        self.intermediate_dim = config.moe_intermediate_size
        self.gate_up_proj = nn.Parameter(torch.empty(self.num_experts, 2 * self.intermediate_dim, self.hidden_dim))
        self.down_proj = nn.Parameter(torch.empty(self.num_experts, self.hidden_dim, self.intermediate_dim))
        self.act_fn = ACT2FN[config.hidden_act]

    def forward(self, hidden_states, top_k_index, top_k_weights):  # `eager`; `grouped_mm` is the default
        return eager_experts_forward(self, hidden_states, top_k_index, top_k_weights)


class MHMoETopKRouter(nn.Module):
    """Linear router computed in fp32 whatever the model dtype (Switch's selective precision)."""

    def __init__(self, config: MHMoEConfig):
        super().__init__()
        self.top_k = config.num_experts_per_tok
        self.norm_topk_prob = config.norm_topk_prob
        self.capacity_factor = config.capacity_factor
        self.capacity_rounding = config.capacity_rounding
        self.routing_backend = config.routing_backend
        self.weight = nn.Parameter(torch.empty(config.num_experts, config.hidden_size // config.moe_heads))

    def forward(self, hidden_states: torch.Tensor):
        device = hidden_states.device.type
        # fp32 also under autocast (Accelerate's mixed precision), which would cast the linear back down
        with torch.autocast(device, enabled=False) if torch.is_autocast_enabled(device) else contextlib.nullcontext():
            router_logits = nn.functional.linear(hidden_states.float(), self.weight.float())  # (N, E)
        weights, experts = route(
            router_logits, self.top_k, self.norm_topk_prob, self.capacity_factor, self.routing_backend,
            self.capacity_rounding,
        )  # fmt: skip
        return router_logits, weights, experts


def moe_block_parts(config: MHMoEConfig) -> tuple:
    """The head layer, merge layer and shared expert (each None when the config has none) of an MH-MoE or Lory block."""
    d, shared = config.hidden_size, config.shared_expert_intermediate_size
    bias = config.moe_layer_bias  # the official code's nn.Linear(d, d, bias=True); the papers' equations have none
    head = make_linear(config, d, d, bias=bias, role="head_merge") if config.moe_head_layer else None
    merge = make_linear(config, d, d, bias=bias, role="head_merge") if config.moe_merge_layer else None
    return head, merge, MHMoEMLP(config, shared) if shared else None


class MHMoESparseMoeBlock(nn.Module):
    """head layer -> split into h sub-tokens -> top-k experts per sub-token -> concatenate -> merge layer."""

    def __init__(self, config: MHMoEConfig):
        super().__init__()
        self.moe_heads = config.moe_heads
        self.jitter_noise = config.router_jitter_noise
        head_proj, merge_proj, shared_expert = moe_block_parts(config)
        self.head_proj = head_proj  # registered in this order: head, gate, experts, merge, shared expert
        self.gate = MHMoETopKRouter(config)
        self.experts = BitNetExperts(config) if is_quantized(config, expert=True) else MHMoEExperts(config)
        self.merge_proj = merge_proj
        self.shared_expert = shared_expert

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        batch_size, seq_len, hidden_dim = hidden_states.shape
        sub_tokens = self.head_proj(hidden_states) if self.head_proj is not None else hidden_states
        sub_tokens = sub_tokens.reshape(-1, hidden_dim // self.moe_heads)  # (B·T·h, W), token-major
        if self.training and self.jitter_noise > 0:
            sub_tokens = sub_tokens * torch.empty_like(sub_tokens).uniform_(1 - self.jitter_noise, 1 + self.jitter_noise)
        _, weights, experts = self.gate(sub_tokens)
        out = self.experts(sub_tokens, experts, weights)  # (B·T·h, W)
        out = out.reshape(batch_size, seq_len, hidden_dim)  # concatenate each token's sub-tokens
        if self.merge_proj is not None:
            out = self.merge_proj(out)
        if self.shared_expert is not None:
            out = out + self.shared_expert(hidden_states)
        return out


class MHMoEAttention(nn.Module):
    """Multi-head attention with GQA, RoPE and an optional sliding window; backends via ALL_ATTENTION_FUNCTIONS.
    With moh_* set, Mixture-of-Head attention: a head router gates each head's output before o_proj (the forward is
    `moh.attention_forward`, shared with MoH-Llama and the patched Llama-family models)."""

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
        self.q_proj = make_linear(config, config.hidden_size, q_dim, bias=config.attention_bias)
        self.k_proj = make_linear(config, config.hidden_size, kv_dim, bias=config.attention_bias)
        self.v_proj = make_linear(config, config.hidden_size, kv_dim, bias=config.attention_bias)
        self.o_proj = make_linear(config, q_dim, config.hidden_size, bias=config.attention_bias)
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
            self, hidden_states, position_embeddings, attention_mask, either_cache(cache, past_key_values),
            self.config.sliding_window,
            attention_interface=attention_interface, **kwargs,
        )  # fmt: skip


class MHMoEDecoderLayer(GradientCheckpointingLayer):
    def __init__(self, config: MHMoEConfig, layer_idx: int):
        super().__init__()
        self.hidden_size = config.hidden_size
        self.self_attn = MHMoEAttention(config, layer_idx)
        if config.is_moe_layer(layer_idx) and config.router_type == "lory":  # lory.py: one merged expert per segment
            self.mlp = MHLoryBlock(config, layer_idx, *moe_block_parts(config))
        elif config.is_moe_layer(layer_idx):
            self.mlp = MHMoESparseMoeBlock(config)
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
        mlp_kwargs = {"cache": cache} if isinstance(self.mlp, MHLoryBlock) else {}
        return hidden_states + self.mlp(self.post_attention_layernorm(hidden_states), **mlp_kwargs)


class MHMoEPreTrainedModel(SelfContainedSaveMixin, PreTrainedModel):
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
        std = self.config.initializer_range
        if isinstance(module, MHMoEExperts):
            module.gate_up_proj.normal_(mean=0.0, std=std)
            module.down_proj.normal_(mean=0.0, std=std)
        elif isinstance(module, MHMoETopKRouter):
            module.weight.normal_(mean=0.0, std=std)
        elif isinstance(module, MoHRouter):
            module.reset_parameters()
        elif isinstance(module, (BitNetExperts, LoryExperts, LoryRouter)):
            module.reset_parameters(std)


@dataclass
class MHMoEModelOutputWithPast(MoeModelOutputWithPast):
    """Mixtral's output plus the MoH head-router logits, one (B, T, R) tensor per MoH layer (`output_router_logits`)."""

    moh_router_logits: tuple[torch.FloatTensor, ...] | None = None


class MHMoEModel(MHMoEPreTrainedModel):
    def __init__(self, config: MHMoEConfig):
        config.check_combinations()  # again: fields may have been set after the config was built
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
    # base model -> LM head -> LM + router losses (causal_lm.py), annotated `-> MHMoECausalLMOutputWithPast`
    forward = causal_lm_forward_returning(MHMoECausalLMOutputWithPast)


__all__ = ["MHMoEForCausalLM", "MHMoEModel", "MHMoEPreTrainedModel"]
