"""Head skipping: MoH attention computed only for the active (token, head) pairs, the fast path of
`moh_attention.attention_forward` in prefill, training and decoding.

`head_skipping_backend` decides whether a call takes it (by default only where it pays: `head_sparse_pays`); the
work is `ops/backends.head_sparse_attention`: the CPU path on CPU (torch's flash kernel on the active rows per
key/value head; decoding packed per key/value head), the Triton kernels on CUDA when asked
(`moh_head_skipping="triton"`; off the CPU the default is the masked path), the naive reference when asked. Its output
(B, T, H, hd) goes to the full `o_proj` (inactive heads are 0). It equals the masked computation (every head, times
the gates: tests/models/moh_reference.py), outputs and gradients. `module.moh_head_skipping`: True (default backend where it
pays), False (every head computed and masked: any attention backend) or a backend name ("naive", "cpu", "triton":
always).

Shape legend: B batch, T query tokens, L key/value tokens (cache included), d hidden size, H query heads, Hkv
key/value heads, hd head_dim.
"""

import functools

import torch
from torch import nn

from ..ops.head_sparse_attention.head_sparse_attention_cpu import DECODE_MAX_TOKENS  # the op's decode path

HEAD_SPARSE_MASK_BACKENDS = ("eager", "sdpa")  # attention backends whose masks are None or 4-D tensors
# Where the head-sparse op pays on CPU (benchmarks/head_sparse_layer.py: one SmolLM2-135M layer, 7/9 and 5/9 heads).
# Below PREFILL_MIN_TOKENS query tokens the attention of the inactive heads is a small share of a layer's work and the
# op's bookkeeping costs more than it saves: the masked path runs (the parent's attention, then the gates). Except in
# inference without a mask where at most FEW_ACTIVE_SHARE of the routed heads are active (top-K): there the op pays
# from FEW_ACTIVE_TOKENS[0] to [1] (its short path: masked rows) and from FEW_ACTIVE_TOKENS[2] (its chunked path); in
# between, the parent's kernel switches to its large query blocks and the op's lead at batch 1 is a few percent of the
# attention at best (benchmarks/head_sparse_short.py), within what its gates and bookkeeping cost on a real model. Decoding (up to DECODE_MAX_TOKENS) takes the op only where a key/value head can
# go unread by every active head.
PREFILL_MIN_TOKENS = 2048
FEW_ACTIVE_SHARE = 0.4
FEW_ACTIVE_TOKENS = (384, 768, 1024)


def head_skipping_backend(module, query_states, attention_mask, gates, kwargs) -> str | None | bool:
    """Whether `attention_forward` computes only the active heads, and with which backend: False (every head computed
    and masked), None (the default backend of `ops/backends.py`) or a backend name. It runs in every layer of every
    decoding step: the default's cheap refusals (device, `head_sparse_pays`) come before the config is read."""
    asked = getattr(module, "moh_head_skipping", True)
    if asked is False or torch.compiler.is_compiling():  # traced graphs take the dense path (the op reads the gates)
        return False
    router = module.head_router
    if router.shared_heads + router.active_heads >= router.num_heads:  # every head is active: nothing to skip
        return False
    if query_states.shape[1] != router.num_heads:  # tensor parallel: this rank holds some heads
        return False
    if asked is True:
        # off by default off the CPU: the CPU path calls torch's CPU flash kernel, and the Triton kernels are not in
        # `ops/backends.AUTOMATIC` until a GPU benchmark shows them ahead (benchmarks/gpu_head_sparse.py); ask for
        # moh_head_skipping="triton" to use them
        if query_states.device.type != "cpu":
            return False
        kv_heads = router.num_heads // module.num_key_value_groups
        inference = attention_mask is None and not (query_states.requires_grad or gates.requires_grad)  # no backward
        if not head_sparse_pays(router, query_states.shape[2], kv_heads, inference):
            return False
    if (module.training and module.attention_dropout > 0) or kwargs.get("output_attentions"):
        return False
    if gates.requires_grad and router.straight_through == "scores":  # needs every routed head's attention
        return False
    if module.config._attn_implementation not in HEAD_SPARSE_MASK_BACKENDS:  # flex BlockMask, flash's packing, ...
        return False
    if attention_mask is not None and not (isinstance(attention_mask, torch.Tensor) and attention_mask.dim() == 4):
        return False
    return None if asked is True else asked  # a backend asked for by name runs everywhere


def head_sparse_pays(router, tokens: int, kv_heads: int, inference: bool = False) -> bool:
    """Whether the default backend's head-sparse op is worth its bookkeeping for `tokens` query tokens (see
    PREFILL_MIN_TOKENS): long prefills; with `inference` (no backward, no mask) some shorter ones where few routed
    heads are active; decoding only when some key/value head may be needed by no active head."""
    if tokens >= PREFILL_MIN_TOKENS:
        return True
    if inference and router.threshold is None and router.active_heads <= FEW_ACTIVE_SHARE * router.routed_heads:
        low, high, chunked = FEW_ACTIVE_TOKENS
        if low <= tokens < high or tokens >= chunked:
            return True
    return tokens <= DECODE_MAX_TOKENS and kv_heads_skippable(router, kv_heads)


def kv_heads_skippable(router, kv_heads: int) -> bool:
    """Whether a token's active heads can leave a key/value head unread: a GQA group with no shared head (the first S)
    and at least K routed heads outside it (else every top-K selection takes one of its heads; with a threshold a token
    can take none of them)."""
    active = 0 if router.threshold is not None else router.active_heads
    return _kv_heads_skippable(router.num_heads, router.shared_heads, active, kv_heads)


@functools.lru_cache(maxsize=256)
def _kv_heads_skippable(num_heads: int, shared_heads: int, active_heads: int, kv_heads: int) -> bool:
    groups, routed_heads = num_heads // kv_heads, num_heads - shared_heads
    for first in range(0, num_heads, groups):
        routed_inside = min(groups, max(0, first + groups - shared_heads))
        if first >= shared_heads and routed_heads - routed_inside >= active_heads:
            return True
    return False


def _head_major_weight(o_proj: nn.Linear) -> torch.Tensor:
    """o_proj.weight transposed and contiguous, (H·hd, d), cached on the module (not in the state dict).

    Each head's o_proj input columns become a contiguous block of rows, which a vector-matrix product streams through;
    the column slices of the (d, H·hd) weight are strided and cost more than the full product on CPU. The copy costs
    one o_proj weight per layer of memory and is rebuilt whenever the weight changes (training, loading, `.to()`).
    """
    weight = o_proj.weight
    stamp = (weight.data_ptr(), weight._version, weight.dtype, weight.device)
    cached = getattr(o_proj, "_moh_head_major", None)
    if cached is None or cached[0] != stamp:
        cached = (stamp, weight.detach().t().contiguous())
        o_proj._moh_head_major = cached
    return cached[1]


__all__ = [
    "head_skipping_backend",
    "head_sparse_pays",
    "kv_heads_skippable",
]
