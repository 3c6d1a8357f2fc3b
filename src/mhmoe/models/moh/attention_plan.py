"""Which path a MoH attention call takes: `plan_attention`, the one place that decides, per call.

| path             | what runs                                                       | where                           |
| "plain"          | the parent's attention (no head router: MoH off)                | moh_attention.attention_forward |
| "masked"         | every head computed by the attention backend, times the gates   | moh_attention.attention_forward |
| "head_sparse"    | only the active (token, head) pairs: `ops/backends.head_sparse_attention` (backend: the op's   |
|                  | default, or the one `moh_head_skipping` names)                  | head_skipping.py, ops/          |
| "fused_decoding" | the CPU decoding step (one GEMV for q/k/v and the router)       | fused_decoding.py               |

The config asks (two fields, read from the module's config; the same on every layer):
- `moh_head_skipping`: True (the default: the head-sparse op where it pays, `head_skipping.head_sparse_pays`, on the
  CPU; its Triton kernels are not chosen by default until a GPU benchmark shows them ahead), False (always masked),
  or a backend name, "naive" | "cpu" | "flex" | "triton" (the op on that backend wherever the op applies);
- `moh_fused_decoding`: True (the default: the CPU decoding step where it applies) or False.
A traced graph (torch.compile, torch.export) always takes the masked path: the head-sparse op and the decoding step
choose heads on the host, which a graph cannot hold.
"""

from typing import NamedTuple

import torch
from torch import nn

from .fused_decoding import FusedProjection, fused_projection
from .head_skipping import head_sparse_pays

HEAD_SPARSE_MASK_BACKENDS = ("eager", "sdpa")  # attention backends whose masks are None or 4-D tensors


class AttentionPlan(NamedTuple):
    path: str  # "plain" | "masked" | "head_sparse" | "fused_decoding"
    backend: str | None = None  # head_sparse: the op's backend (None: its default)
    projection: FusedProjection | None = None  # fused_decoding: the module's cached weights


PLAIN, MASKED, HEAD_SPARSE = AttentionPlan("plain"), AttentionPlan("masked"), AttentionPlan("head_sparse")


def plan_attention(
    module, hidden_states, position_embeddings, attention_mask, cache, sliding_window, kwargs
) -> AttentionPlan:
    """The path of one call of `attention_forward` (the table above). It runs in every layer of every decoding step:
    the cheapest refusals come first and module attributes are read from `__dict__` / `_modules`."""
    router = module._modules.get("head_router")
    if router is None:
        return PLAIN
    if torch.compiler.is_compiling() or router.shared_heads + router.active_heads >= router.num_heads:
        return MASKED  # traced, or every head active: nothing to skip
    settings = module.config.__dict__
    asked = settings.get("moh_head_skipping", True)
    if asked is False or kwargs.get("output_attentions") or (module.training and module.attention_dropout > 0):
        return MASKED
    if attention_mask is not None and not (isinstance(attention_mask, torch.Tensor) and attention_mask.dim() == 4):
        return MASKED  # flex's BlockMask, flash's packing: the op takes a 4-D mask or none
    if router.__dict__.get("tensor_parallel"):  # this rank holds some heads (moh_parallel.py)
        return MASKED
    if asked is True and settings.get("moh_fused_decoding", True):
        projection = _fused_decoding(module, router, hidden_states, position_embeddings, cache, sliding_window)
        if projection is not None:
            return AttentionPlan("fused_decoding", projection=projection)
    if asked is True and not hidden_states.is_cpu:
        return MASKED
    needs_grad = _needs_grad(module, router, hidden_states)
    if asked is True:
        kv_heads = router.num_heads // module.num_key_value_groups
        inference = attention_mask is None and not needs_grad
        if not head_sparse_pays(router, hidden_states.shape[1], kv_heads, inference):
            return MASKED
    if router.straight_through == "scores" and needs_grad:
        return MASKED  # its gradient needs every routed head's attention
    if module.config._attn_implementation not in HEAD_SPARSE_MASK_BACKENDS:
        return MASKED
    return HEAD_SPARSE if asked is True else AttentionPlan("head_sparse", asked)


def _fused_decoding(module, router, hidden_states, position_embeddings, cache, sliding_window):
    """The module's `FusedProjection` when the call is a decoding step the fused step computes: one new token per
    sequence with a cache, on the CPU without autograd, straight-through gates (some can be 0), sdpa, no sliding window,
    RoPE over the whole head, nothing hooking the router (output capturing records its logits), plain nn.Linear
    projections holding every head (`fused_projection`); else None."""
    if hidden_states.shape[1] != 1 or cache is None or torch.is_grad_enabled() or not hidden_states.is_cpu:
        return None
    if not router.straight_through or sliding_window is not None:
        return None
    if router._forward_hooks or router._forward_pre_hooks or nn.modules.module._global_forward_hooks:
        return None
    if position_embeddings[0].shape[-1] != module.head_dim or module.config._attn_implementation != "sdpa":
        return None
    return fused_projection(module)


def _needs_grad(module, router, hidden_states) -> bool:
    """Whether the queries or the gates will require grad: autograd on and the input, q_proj or the router trainable."""
    if not torch.is_grad_enabled():
        return False
    if hidden_states.requires_grad:
        return True
    return any(p.requires_grad for p in module._modules["q_proj"].parameters()) or any(
        p.requires_grad for p in router.parameters()
    )


__all__ = ["AttentionPlan", "plan_attention"]
