"""Routing in plain PyTorch: the reference every routing kernel is tested against, and the CPU default.

Shape legend: N routed rows (tokens × moe_heads sub-tokens, token-major), E experts, K = num_experts_per_tok,
S = N·K (row, expert) assignments. A dropped assignment (over capacity) carries the sentinel expert id E and weight 0.
Every shape here is static (no bincount, no host sync): torch.compile and torch.export trace it whole.
"""

import math

import torch


def route(
    router_logits: torch.Tensor,
    top_k: int,
    norm_topk_prob: bool | str = True,
    capacity_factor: float | None = None,
    capacity_rounding: str = "switch",
) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax in fp32, top-k, optional renormalisation and capacity (`expert_capacity`).

    `norm_topk_prob`: True renormalises the K weights to sum to 1 when K > 1 and keeps the raw probability at K = 1
    (a renormalised top-1 gate is p/p = 1 and the router would get no gradient from the LM loss); "always"
    renormalises at every K (Transformers' Mixtral); False never (the official MH-MoE code and the paper's eq. 3).
    Returns `weights` (N, K) fp32 and `experts` (N, K) int64; dropped assignments get expert E and weight 0.
    """
    num_rows, num_experts = router_logits.shape
    probs = torch.softmax(router_logits.float(), dim=-1)  # (N, E)
    weights, experts = torch.topk(probs, top_k, dim=-1)  # (N, K)
    if renormalises(norm_topk_prob, top_k):
        weights = weights / weights.sum(dim=-1, keepdim=True)
    if capacity_factor is not None:
        kept = within_capacity(
            experts, num_experts, expert_capacity(capacity_factor, num_rows, top_k, num_experts, capacity_rounding)
        )
        experts = torch.where(kept, experts, num_experts)
        weights = weights * kept
    return weights, experts


def renormalises(norm_topk_prob: bool | str, top_k: int) -> bool:
    """Whether `route` renormalises the top-k weights (see its docstring)."""
    return norm_topk_prob == "always" or (norm_topk_prob is True and top_k > 1)


def route_weights_backward(
    router_logits: torch.Tensor, experts: torch.Tensor, grad_weights: torch.Tensor, renormalise: bool
) -> torch.Tensor:
    """The logits' gradient (N, E), in their dtype, of `route`'s weights (no capacity) given `experts` (N, K) and the
    weights' gradient (N, K), in closed form: p = softmax(x); the chosen p sum to S; d p[e_k] = g_k (renormalised:
    (g_k - Σ_j g_j·p[e_j] / S) / S), 0 elsewhere; d x = p · (d p - Σ d p · p). What autograd gives through `route`
    (tested); the kernels' backward reference inside traced graphs."""
    probs = torch.softmax(router_logits.float(), dim=-1)  # (N, E)
    grad = grad_weights.float()
    chosen = probs.gather(1, experts)  # (N, K)
    if renormalise:
        total = chosen.sum(dim=-1, keepdim=True)
        grad = (grad - (grad * chosen).sum(dim=-1, keepdim=True) / total) / total
    grad_probs = torch.zeros_like(probs).scatter_add_(1, experts, grad)  # (N, E)
    return (probs * (grad_probs - (grad_probs * probs).sum(dim=-1, keepdim=True))).to(router_logits.dtype)


def expert_capacity(
    capacity_factor: float, num_rows: int, top_k: int, num_experts: int, rounding: str = "switch"
) -> int:
    """Assignments each expert may take. "switch": ceil(capacity_factor · N · K / E) (Switch Transformer);
    "official": K · ceil(capacity_factor · N / E) (the official MH-MoE TopkGate's K · ceil(N / E) at factor 1)."""
    if rounding == "official":
        return top_k * math.ceil(capacity_factor * num_rows / num_experts)
    if rounding != "switch":
        raise ValueError(f"capacity rounding must be 'switch' or 'official', got {rounding!r}")
    return math.ceil(capacity_factor * num_rows * top_k / num_experts)


def within_capacity(experts: torch.Tensor, num_experts: int, capacity: int) -> torch.Tensor:
    """(N, K) bool: the assignment is among the first `capacity` of its expert.

    Priority goes by choice rank first (every row's top-1 before any top-2, as in GShard), then by row order.
    """
    num_rows, top_k = experts.shape
    flat = experts.t().reshape(-1)  # (K·N,) slot-major: priority order
    sorted_experts, order = torch.sort(flat, stable=True)
    starts = torch.searchsorted(sorted_experts, torch.arange(num_experts, device=flat.device))  # (E,) first positions
    rank_sorted = torch.arange(flat.numel(), device=flat.device) - starts[sorted_experts]
    rank = torch.empty_like(rank_sorted)
    rank[order] = rank_sorted
    return (rank < capacity).view(top_k, num_rows).t()


def sort_by_expert(experts: torch.Tensor, num_experts: int, positions: bool = False) -> tuple[torch.Tensor, ...]:
    """Group assignments by expert.

    `experts` (N, K) with ids in [0, E] (E = dropped). Returns `order` (S,) indices into the flattened (N·K)
    assignments, sorted by expert with dropped ones last, stable (ties keep (row, slot) order), and `offsets` (E,)
    int32 cumulative end of each expert's group (offsets[-1] = number of kept assignments), the layout
    `torch._grouped_mm` takes. With `positions`, also the inverse permutation (S,) int64: where each assignment sits
    in `order` (the kernel's sort has it for free).
    """
    flat = experts.reshape(-1)
    sorted_experts, order = torch.sort(flat, stable=True)
    ends = torch.searchsorted(sorted_experts, torch.arange(num_experts, device=flat.device), right=True)
    if not positions:
        return order, ends.to(torch.int32)
    inverse = torch.empty_like(order).index_copy_(0, order, torch.arange(order.shape[0], device=order.device))
    return order, ends.to(torch.int32), inverse
