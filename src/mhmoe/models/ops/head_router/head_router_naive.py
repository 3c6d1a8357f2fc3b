"""The MoH "l2" head router in plain PyTorch: the reference of `head_router_triton.py`.

The same computation as the l2 router, `moh/head_routers.L2Router` (tested equal): per token, the L2 norm of each routed head's
pre-RoPE query, divided by the per-token std of those norms (clamped at L2_STD_MIN), softmax, top-K, the K weights
renormalised and ×K; shared heads gate 1. With `straight_through` the forward gates are exactly 0/1 and the backward
a straight-through estimator (`STRAIGHT_THROUGH`): True the soft gates' gradient, "scores" the raw softmax score of
every routed head (eq. 9-10 as written), "selected_scores" the raw softmax scores of the selected heads only.
Shape legend: M tokens (B·T), H heads, S shared heads (the first S), R = H - S routed heads,
K routed heads active per token, hd head_dim.
"""

import torch

L2_STD_MIN = 1e-6
STRAIGHT_THROUGH = (False, True, "scores", "selected_scores")  # moh_straight_through: what the 0/1 gates' backward is


def is_one_of(value, choices) -> bool:
    """Whether `value` is one of `choices` (True, False or strings): the booleans by identity, so 1 is not True."""
    return any(value is choice or (isinstance(choice, str) and value == choice) for choice in choices)


def check_straight_through(straight_through) -> None:
    """Refuse a `straight_through` that is none of `STRAIGHT_THROUGH` (a typo would otherwise act as True)."""
    if not is_one_of(straight_through, STRAIGHT_THROUGH):
        raise ValueError(f"straight_through must be one of {STRAIGHT_THROUGH}, got {straight_through!r}")


def l2_scores(norms: torch.Tensor) -> torch.Tensor:
    """(..., R) fp32 query norms of the routed heads -> the "l2" router's (..., R) scores: each norm divided by the
    per-token std of the R norms (clamped at L2_STD_MIN). The one definition: the router module uses it too."""
    std = norms.std(dim=-1, keepdim=True, correction=1 if norms.shape[-1] > 1 else 0)
    return norms / std.clamp_min(L2_STD_MIN)


def l2_head_gates(
    queries: torch.Tensor, shared_heads: int, active_heads: int, straight_through: bool | str = False
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """queries (M, H, hd) -> gates (M, H) fp32, router logits (M, R) fp32, selected routed heads (M, K) int64."""
    check_straight_through(straight_through)
    logits = l2_scores(queries[:, shared_heads:].float().norm(dim=-1))  # (M, R)
    probs = torch.softmax(logits, dim=-1)
    weights, index = torch.topk(probs, active_heads, dim=-1)  # (M, K)
    weights = weights / weights.sum(dim=-1, keepdim=True) * active_heads
    soft = torch.zeros_like(probs).scatter(-1, index, weights)  # (M, R)
    if straight_through:
        hard = torch.zeros_like(probs).scatter(-1, index, 1.0)
        if straight_through == "scores":  # every routed head's raw softmax score carries the gradient
            soft = probs
        elif straight_through == "selected_scores":  # only the selected heads' raw scores
            soft = probs * hard
        soft = hard + (soft - soft.detach())
    shared = soft.new_ones(soft.shape[0], shared_heads)
    return torch.cat([shared, soft], dim=-1), logits, index
