"""The MoH "l2" head router in plain PyTorch: the reference of `head_router_triton.py`.

The same computation as the l2 router, `moh/head_routers.L2Router` (tested equal): per token, the L2 norm of each routed head's
pre-RoPE query, divided by the per-token std of those norms (clamped at L2_STD_MIN), softmax, top-K, the K weights
renormalised and ×K; shared heads gate 1. With `straight_through` the forward gates are exactly 0/1 and the gradient
is the soft gates'. Shape legend: M tokens (B·T), H heads, S shared heads (the first S), R = H - S routed heads,
K routed heads active per token, hd head_dim.
"""

import torch

L2_STD_MIN = 1e-6


def l2_head_gates(
    queries: torch.Tensor, shared_heads: int, active_heads: int, straight_through: bool = False
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """queries (M, H, hd) -> gates (M, H) fp32, router logits (M, R) fp32, selected routed heads (M, K) int64."""
    norms = queries[:, shared_heads:].float().norm(dim=-1)  # (M, R)
    routed = norms.shape[-1]
    std = norms.std(dim=-1, keepdim=True, correction=1 if routed > 1 else 0)
    logits = norms / std.clamp_min(L2_STD_MIN)
    probs = torch.softmax(logits, dim=-1)
    weights, index = torch.topk(probs, active_heads, dim=-1)  # (M, K)
    weights = weights / weights.sum(dim=-1, keepdim=True) * active_heads
    soft = torch.zeros_like(probs).scatter(-1, index, weights)  # (M, R)
    if straight_through:
        hard = torch.zeros_like(probs).scatter(-1, index, 1.0)
        soft = hard + (soft - soft.detach())
    shared = soft.new_ones(soft.shape[0], shared_heads)
    return torch.cat([shared, soft], dim=-1), logits, index
