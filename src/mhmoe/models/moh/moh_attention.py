"""Mixture-of-Head attention (MoH, Jin et al. 2024): attention heads as experts, for every model of the library
(MHMoE's attention, MoH-LLaMA, and the Llama-family models `apply_moh` patches).

Shape legend: B batch, T query tokens, L key/value tokens (cache included), d hidden size, H query heads, Hkv key/value
heads, hd head_dim, S shared heads (always on, the first S), R = H - S routed heads, K routed heads active per token.

Per token the gates g_i (B, T, H) of the head router (`head_routers.py`, chosen by `moh_router`) multiply each head's
attention output (B, T, H, hd) before `o_proj` (the paper's summation form, eq. 4), so every attention backend (eager,
sdpa, flex, flash) and GQA work unchanged. Which path a call takes is decided in one place, `attention_plan.py`: the
gated (masked) computation; attention for the active (token, head) pairs only (`head_skipping.py`: prefill, training
and decoding, through `ops/backends.head_sparse_attention`); or, for a decoding step on the CPU, `fused_decoding.py`
(one GEMV for keys, values, the router's scores and the queries; only the active heads' q_proj rows and o_proj columns
when the router scores the attention input). The balance loss is `moh_losses.py`; tensor parallelism of the router
`moh_parallel.py`.

This file runs on torch + transformers alone: exported checkpoints ship it next to the modeling file.
"""

from collections.abc import Callable

import torch
from torch import nn
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb, eager_attention_forward

from ..cache_naming import either_cache
from ..ops.backends import head_sparse_attention
from .attention_plan import plan_attention
from .fused_decoding import fused_decoding_step
from .head_routers import MoHRouter
from .moh_config import moh_enabled


def add_head_router(attention: nn.Module, config) -> nn.Module:
    """Give an attention module (Llama-style q/k/v/o projections) a MoH head router built from `config`'s moh_* fields
    (None when MoH is off). Router parameters follow the query projection's device and dtype."""
    router = None
    if moh_enabled(config):
        weight = attention.q_proj.weight
        dtype = weight.dtype if weight.is_floating_point() else None  # packed BitNet q_proj: int8 ternary weights
        router = MoHRouter.from_config(config, getattr(attention, "layer_idx", None))
        router = router.to(device=weight.device, dtype=dtype)
    attention.head_router = router
    return attention


def attention_forward(
    module: nn.Module,
    hidden_states: torch.Tensor,
    position_embeddings: tuple[torch.Tensor, torch.Tensor],
    attention_mask: torch.Tensor | None,
    cache=None,
    sliding_window: int | None = None,
    attention_interface: Callable | None = None,
    **kwargs,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The forward of a Llama-style attention module (q_proj, k_proj, v_proj, o_proj, head_dim, scaling, config,
    layer_idx, head_router): plain multi-head attention when `module.head_router` is None (no gates), else MoH gates on
    each head's output before o_proj. With all heads active and gates of exactly 1 it performs Llama's operations in
    Llama's order. `plan_attention` picks the path: the gated computation, only the active heads
    (`head_sparse_attention`, equal to it), or `fused_decoding_step` (the same computation in fewer ops).
    `attention_interface`: the backend function (default: `config._attn_implementation`'s in ALL_ATTENTION_FUNCTIONS)."""
    plan = plan_attention(module, hidden_states, position_embeddings, attention_mask, cache, sliding_window, kwargs)
    if plan.path == "fused_decoding":
        return fused_decoding_step(module, hidden_states, position_embeddings, attention_mask, cache, plan.projection)
    input_shape = hidden_states.shape[:-1]
    hidden_shape = (*input_shape, -1, module.head_dim)
    query_states = module.q_proj(hidden_states).view(hidden_shape)  # (B, T, H, hd), pre-RoPE
    gates = None
    if plan.path != "plain":
        gates, _, _ = module.head_router(hidden_states, query_states)  # (B, T, H)
    query_states = query_states.transpose(1, 2)  # (B, H, T, hd)
    key_states = module.k_proj(hidden_states).view(hidden_shape).transpose(1, 2)  # (B, Hkv, T, hd)
    value_states = module.v_proj(hidden_states).view(hidden_shape).transpose(1, 2)

    cos, sin = position_embeddings
    query_states, key_states = apply_rotary_pos_emb(query_states, key_states, cos, sin)
    query_offset = None  # the head-sparse op's first query position; None: the last T of the keys
    if cache is not None:  # every head's K/V is cached: a later token may select it
        past = cache.get_seq_length(module.layer_idx)
        key_states, value_states = cache.update(key_states, value_states, module.layer_idx)
        length = past + query_states.shape[-2]
        if attention_mask is None and key_states.shape[-2] > length:  # a static cache's prefill, keys padded to its
            query_offset = past  # full length without a mask: the queries are at past.. (with a mask, it masks)

    if plan.path == "head_sparse":
        attn_output = head_sparse_attention(
            query_states,
            key_states,
            value_states,
            gates,
            module.scaling,
            attention_mask,
            query_offset=query_offset,
            sliding_window=sliding_window,
            backend=plan.backend,
        )  # (B, T, H, hd), 0 on inactive heads
        return module.o_proj(attn_output.reshape(*input_shape, -1)), None

    if attention_interface is None:
        attention_interface = ALL_ATTENTION_FUNCTIONS.get_interface(
            module.config._attn_implementation, eager_attention_forward
        )
    if sliding_window is not None:
        kwargs["sliding_window"] = sliding_window
    attn_output, attn_weights = attention_interface(
        module,
        query_states,
        key_states,
        value_states,
        attention_mask,
        dropout=0.0 if not module.training else module.attention_dropout,
        scaling=module.scaling,
        **kwargs,
    )  # (B, T, H, hd)
    if gates is not None:
        attn_output = attn_output * gates.to(attn_output.dtype)[..., None]
    attn_output = attn_output.reshape(*input_shape, -1).contiguous()
    return module.o_proj(attn_output), attn_weights


class MoHAttentionMixin:
    """Put before a Llama-style attention class (Llama, Mistral, Qwen2) to route its heads; plain attention when the
    module has no head router."""

    def forward(
        self, hidden_states, position_embeddings=None, attention_mask=None, cache=None, past_key_values=None, **kwargs
    ):
        cache = either_cache(cache, past_key_values)  # the model passes `past_key_values` before Transformers 5.24
        if getattr(self, "head_router", None) is None:
            return super().forward(hidden_states, position_embeddings, attention_mask, cache, **kwargs)
        if hasattr(self, "sliding_window"):  # Qwen2: per layer
            sliding_window = self.sliding_window
        else:  # Mistral: from the config; Llama: none
            sliding_window = getattr(self.config, "sliding_window", None)
        return attention_forward(
            self, hidden_states, position_embeddings, attention_mask, cache, sliding_window, **kwargs
        )


__all__ = ["MoHAttentionMixin", "add_head_router", "attention_forward"]
