"""Head skipping: MoH attention computed only for the active (token, head) pairs, the fast path of
`moh_attention.attention_forward` in prefill, training and decoding.

`attention_plan.plan_attention` decides whether a call takes it (by default only where it pays: `head_sparse_pays`);
the work is `ops/backends.head_sparse_attention`: the CPU path on CPU (torch's flash kernel on the active rows per
key/value head; decoding packed per key/value head), the Triton kernels on CUDA when asked
(`moh_head_skipping="triton"`; off the CPU the default is the masked path), the naive reference when asked. Its output
(B, T, H, hd) goes to the full `o_proj` (inactive heads are 0). It equals the masked computation (every head, times
the gates: tests/models/moh_reference.py), outputs and gradients. The config's `moh_head_skipping`: True (default
backend where it pays), False (every head computed and masked: any attention backend) or a backend name ("naive",
"cpu", "triton": always).

Shape legend: B batch, T query tokens, L key/value tokens (cache included), d hidden size, H query heads, Hkv
key/value heads, hd head_dim.
"""

import functools

import torch
from torch import nn

from ..ops.head_sparse_attention.head_sparse_attention_cpu_policy import DEFAULT_CPU_POLICY, CpuHeadSparsePolicy


def head_sparse_pays(
    router, tokens: int, kv_heads: int, inference: bool = False, policy: CpuHeadSparsePolicy | None = None
) -> bool:
    """Whether the default backend's head-sparse op is worth its bookkeeping for `tokens` query tokens, by the CPU
    policy's thresholds (default `DEFAULT_CPU_POLICY`; its `prefill_min_tokens`, `few_active_share` and
    `few_active_tokens`, with the measurements that set them): long prefills; with `inference` (no backward, no mask)
    some shorter ones where few routed heads are active; decoding (up to its `decode_max_tokens`) only when some
    key/value head may be needed by no active head."""
    policy = policy or DEFAULT_CPU_POLICY
    if tokens >= policy.prefill_min_tokens:
        return True
    if inference and router.threshold is None and router.active_heads <= policy.few_active_share * router.routed_heads:
        low, high, chunked = policy.few_active_tokens
        if low <= tokens < high or tokens >= chunked:
            return True
    return tokens <= policy.decode_max_tokens and kv_heads_skippable(router, kv_heads)


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
    "head_sparse_pays",
    "kv_heads_skippable",
]
