"""The MoH "l2" head router in Triton: query norms, their std, softmax, top-K and the gates (shared heads on,
straight-through optional) in one launch; the backward recomputes the PyTorch reference (`head_router_naive.py`) and
differentiates it. Every straight-through mode has the same forward (exactly 0/1 gates: the kernel's STRAIGHT), so the
backward's recomputation with the mode itself gives each mode's own gradient ("scores", "selected_scores" included). The l2 router (`moh/head_routers.py`) calls it through `backends.l2_head_gates` on the triton backend.
Tested against the reference under TRITON_INTERPRET=1 (fp32 and bf16 queries); never run on a GPU here. NaN or inf
queries never give a head index out of range: a row with NaN logits takes the lowest routed heads, with NaN gates.
Shape legend as in head_router_naive.py; BLOCK_* are powers of two (R, hd, K padded up).

Imports without triton (exported checkpoints): the kernel is then a plain function, never launched.
"""

import torch

from ..triton_compat import HAS_TRITON, interpreting, tl, triton  # noqa: F401  (HAS_TRITON: re-exported)
from ..triton_compat import jit as _jit
from .head_router_naive import L2_STD_MIN, check_straight_through, l2_head_gates


@_jit
def _l2_head_gates_kernel(
    q_ptr,
    gates_ptr,
    logits_ptr,
    index_ptr,
    num_rows,
    stride_row,
    stride_head,
    shared,
    routed,
    head_dim,
    std_min,
    ACTIVE: tl.constexpr,
    STRAIGHT: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_S: tl.constexpr,
):
    pid = tl.program_id(0)
    rows = pid * BLOCK_M + tl.arange(0, BLOCK_M)
    heads = tl.arange(0, BLOCK_R)
    dims = tl.arange(0, BLOCK_D)
    row_ok = rows < num_rows
    head_ok = heads < routed
    offs = (
        rows[:, None, None].to(tl.int64) * stride_row
        + (shared + heads)[None, :, None] * stride_head
        + dims[None, None, :]
    )
    mask = row_ok[:, None, None] & head_ok[None, :, None] & (dims < head_dim)[None, None, :]
    q = tl.load(q_ptr + offs, mask=mask, other=0.0).to(tl.float32)  # (BLOCK_M, BLOCK_R, BLOCK_D)
    norms = tl.sqrt(tl.sum(q * q, axis=2))  # (BLOCK_M, BLOCK_R)
    mean = tl.sum(norms, axis=1) / routed
    centred = tl.where(head_ok[None, :], norms - mean[:, None], 0.0)
    var = tl.sum(centred * centred, axis=1) / tl.maximum(routed - 1, 1)  # correction 1 (0 for a single head)
    logits = norms / tl.maximum(tl.sqrt(var), std_min, propagate_nan=tl.PropagateNan.ALL)[:, None]  # NaN as clamp_min
    out = rows[:, None].to(tl.int64) * routed + heads[None, :]
    tl.store(logits_ptr + out, logits, mask=row_ok[:, None] & head_ok[None, :])

    x = tl.where(head_ok[None, :], logits, float("-inf"))
    e = tl.exp(x - tl.max(x, axis=1)[:, None])
    probs = e / tl.sum(e, axis=1)[:, None]
    # selection key: a NaN probability (NaN or inf queries make the whole row NaN) ranks as 0, so such a row takes the
    # lowest heads, distinct and in range, and its gates are NaN as the reference's; the index is clamped besides
    key = tl.where(head_ok[None, :], tl.where(probs == probs, probs, 0.0), -1.0)
    kcols = tl.arange(0, BLOCK_K)
    index = tl.zeros((BLOCK_M, BLOCK_K), dtype=tl.int32)
    chosen = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)  # the selected heads' probabilities, 0 elsewhere
    picked = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.int32)  # 1 on the selected heads
    total = tl.zeros((BLOCK_M,), dtype=tl.float32)
    for j in tl.static_range(ACTIVE):
        best = tl.max(key, axis=1)
        choice = tl.min(tl.where(key == best[:, None], heads[None, :], BLOCK_R), axis=1)  # ties: the lowest head
        choice = tl.minimum(choice, routed - 1)
        this = heads[None, :] == choice[:, None]
        value = tl.sum(tl.where(this, probs, 0.0), axis=1)
        index = tl.where(kcols[None, :] == j, choice[:, None], index)
        chosen = tl.where(this, value[:, None], chosen)
        picked = tl.where(this, 1, picked)
        total += value
        key = tl.where(this, -1.0, key)
    if STRAIGHT:  # exactly 1 on the selected heads (NaN in a NaN row, as the reference's hard + (soft - soft))
        gates = tl.where(picked > 0, tl.where(total == total, 1.0, float("nan"))[:, None], 0.0)
    else:
        gates = tl.where(picked > 0, chosen / total[:, None] * ACTIVE, 0.0)
    num_heads = shared + routed
    gate_rows = rows[:, None].to(tl.int64) * num_heads
    tl.store(gates_ptr + gate_rows + shared + heads[None, :], gates, mask=row_ok[:, None] & head_ok[None, :])
    shared_cols = tl.arange(0, BLOCK_S)
    ones = tl.full((BLOCK_M, BLOCK_S), 1.0, tl.float32)
    tl.store(gates_ptr + gate_rows + shared_cols[None, :], ones, mask=row_ok[:, None] & (shared_cols < shared)[None, :])
    tl.store(
        index_ptr + rows[:, None].to(tl.int64) * ACTIVE + kcols[None, :],
        index.to(tl.int64),
        mask=row_ok[:, None] & (kcols < ACTIVE)[None, :],
    )


def _next_power_of_2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


def _launch(queries, shared_heads, active_heads, straight_through, block_rows):
    num_rows, num_heads, head_dim = queries.shape
    routed = num_heads - shared_heads
    queries = queries if queries.stride(-1) == 1 else queries.contiguous()
    device = queries.device
    gates = torch.empty(num_rows, num_heads, dtype=torch.float32, device=device)
    logits = torch.empty(num_rows, routed, dtype=torch.float32, device=device)
    index = torch.empty(num_rows, active_heads, dtype=torch.int64, device=device)
    block_r, block_d = _next_power_of_2(routed), _next_power_of_2(head_dim)
    if block_rows is None:
        budget = 2**16 if interpreting() else 2**13
        block_rows = max(1, budget // (block_r * block_d))
    if num_rows:
        _l2_head_gates_kernel[(-(-num_rows // block_rows),)](
            queries,
            gates,
            logits,
            index,
            num_rows,
            queries.stride(0),
            queries.stride(1),
            shared_heads,
            routed,
            head_dim,
            L2_STD_MIN,
            ACTIVE=active_heads,
            STRAIGHT=bool(straight_through),  # every mode's forward: 0/1 (the modes differ in the backward only)
            BLOCK_M=block_rows,
            BLOCK_R=block_r,
            BLOCK_D=block_d,
            BLOCK_K=_next_power_of_2(active_heads),
            BLOCK_S=_next_power_of_2(max(shared_heads, 1)),
        )
    return gates, logits, index


class _L2HeadGates(torch.autograd.Function):
    @staticmethod
    def forward(ctx, queries, shared_heads, active_heads, straight_through, block_rows):
        gates, logits, index = _launch(queries, shared_heads, active_heads, straight_through, block_rows)
        ctx.mark_non_differentiable(index)
        ctx.save_for_backward(queries)
        ctx.settings = (shared_heads, active_heads, straight_through)
        return gates, logits, index

    @staticmethod
    def backward(ctx, grad_gates, grad_logits, _):
        (queries,) = ctx.saved_tensors
        with torch.enable_grad():  # recompute the reference and differentiate it (same selection without ties)
            leaf = queries.detach().requires_grad_()
            gates, logits, _ = l2_head_gates(leaf, *ctx.settings)
            (grad,) = torch.autograd.grad((gates, logits), leaf, (grad_gates, grad_logits), allow_unused=True)
        return (torch.zeros_like(queries) if grad is None else grad), None, None, None, None


def l2_head_gates_triton(
    queries: torch.Tensor,
    shared_heads: int,
    active_heads: int,
    straight_through: bool | str = False,
    block_rows: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`head_router_naive.l2_head_gates` with the kernel: queries (M, H, hd) -> gates (M, H), logits (M, R), index
    (M, K); ties between routed heads go to the lowest head. `straight_through`: any mode of the reference's
    `STRAIGHT_THROUGH`, with the reference's gradient."""
    check_straight_through(straight_through)
    if not HAS_TRITON:
        raise ImportError("the triton head-router kernel needs triton: `pip install triton`")
    if not queries.is_cuda and not interpreting():
        raise ValueError("the triton head-router kernel runs on CUDA tensors (or under TRITON_INTERPRET=1)")
    num_heads = queries.shape[1]
    if not 0 <= shared_heads < num_heads or not 1 <= active_heads <= num_heads - shared_heads:
        raise ValueError(
            f"need 0 <= shared_heads < heads and 1 <= active_heads <= routed heads, got shared_heads="
            f"{shared_heads}, active_heads={active_heads} of {num_heads} heads"
        )
    return _L2HeadGates.apply(queries, shared_heads, active_heads, straight_through, block_rows)
