"""Routing in Triton: fp32 softmax + top-k + renormalisation in one kernel, and a stable counting sort (Switch capacity
ranks, the expert-sorted permutation) in two kernels around a small scan, with no atomics: deterministic.

Same contract as `routing_naive.py` (its `route` and `sort_by_expert`), which the tests compare against under
TRITON_INTERPRET=1. Shape legend: N rows, E experts, K = top_k (1..8), S = N·K assignments, B bins of the counting
sort (E, or E + 1 with the dropped sentinel), BLOCK_* tile sizes (powers of two; E and B are padded up to one).

Counting sort, for ids in [0, B), in three launches: each of P programs takes CHUNKS·BLOCK consecutive ids and (1)
counts them per bin, a one-hot (BLOCK, B) tile at a time; (2) one program scans the (P, B) table, first over
programs for the bins' totals, then again to give each (program, bin) its first place in the sorted order (bin start
+ the bin's ids in earlier programs) and writes the bins' counts and ends; (3) each id's place is its (program, bin)
base plus the equal ids before it in the program (a cumulative sum over the one-hot tile, carried across chunks).
Stable by construction: ties keep their input order. The scan is a kernel because the (P, B) table's cumulative sum
over its outer dimension is a serial loop per bin in PyTorch's CUDA scan (1.75 ms of the h=3 block's fwd+bwd at 32K
tokens on an H200, benchmarks/results/gpu_moe-nvidia-h200-939cae8); P is kept small by looping CHUNKS tiles.

NaN or inf logits never give an expert id outside [0, E) (on a GPU such an id would make the later kernels read and
write out of bounds, an asynchronous error no fallback can catch): a row whose softmax is NaN takes the lowest ids,
with NaN weights. bf16/fp16 logits are loaded as they are and computed in fp32.

In traced graphs (torch.compile, torch.export) the kernels run as `torch.library` custom ops
(`torch.ops.mhmoe.softmax_topk` with its backward op, `torch.ops.mhmoe.counting_sort`; end of this file): one opaque
node each, so that a compiled block runs them, not the traced reference, and CUDA graphs can capture them.

This file must import without triton (exported checkpoints load on torch + transformers alone): the kernels are then
plain functions that are never launched, and `HAS_TRITON` is False.
"""

import logging

import torch

from ..triton_compat import HAS_TRITON, interpreting, tl, triton  # noqa: F401  (HAS_TRITON: re-exported)
from ..triton_compat import jit as _jit
from .routing_naive import expert_capacity, renormalises, route_weights_backward
from .routing_naive import route as reference_route

MAX_TOP_K = 8


@_jit
def _softmax_rows(logits_ptr, num_rows, num_experts, stride_row, BLOCK_N: tl.constexpr, BLOCK_E: tl.constexpr):
    """The program's BLOCK_N rows of logits -> fp32 softmax (BLOCK_N, BLOCK_E); padding columns get probability 0."""
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    cols = tl.arange(0, BLOCK_E)
    row_ok = rows < num_rows
    col_ok = cols < num_experts
    offs = rows[:, None].to(tl.int64) * stride_row + cols[None, :]
    x = tl.load(logits_ptr + offs, mask=row_ok[:, None] & col_ok[None, :], other=0.0).to(tl.float32)
    x = tl.where(col_ok[None, :], x, float("-inf"))  # padding columns: probability 0, never chosen
    e = tl.exp(x - tl.max(x, axis=1)[:, None])
    return rows, cols, row_ok, col_ok, e / tl.sum(e, axis=1)[:, None]


@_jit
def _softmax_topk_kernel(
    logits_ptr,
    weights_ptr,
    experts_ptr,
    num_rows,
    num_experts,
    stride_row,
    TOP_K: tl.constexpr,
    RENORM: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_E: tl.constexpr,
):
    """BLOCK_N rows per program: (BLOCK_N, BLOCK_E) logits -> fp32 softmax -> K rounds of (max, lowest id at the max)
    -> weights (N, K) fp32 (renormalised when RENORM) and experts (N, K) int64, in descending order.

    NaN probabilities (a row with a NaN or +inf logit, or only -inf ones, is NaN throughout) rank as 0 in the
    selection, so such a row takes the lowest ids, distinct and in [0, E), with NaN weights: an id past the experts
    would make every later kernel read and write out of bounds. The ids are clamped to E - 1 besides."""
    rows, cols, row_ok, col_ok, probs = _softmax_rows(logits_ptr, num_rows, num_experts, stride_row, BLOCK_N, BLOCK_E)
    key = tl.where(col_ok[None, :], tl.where(probs == probs, probs, 0.0), -1.0)  # selection key: NaN -> 0

    kcols = tl.arange(0, BLOCK_K)
    values = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    index = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.int32)
    for j in tl.static_range(TOP_K):
        best = tl.max(key, axis=1)
        choice = tl.min(tl.where(key == best[:, None], cols[None, :], BLOCK_E), axis=1)  # ties: the lowest id
        choice = tl.minimum(choice, num_experts - 1)  # never past the experts, whatever the logits
        picked = cols[None, :] == choice[:, None]
        value = tl.sum(tl.where(picked, probs, 0.0), axis=1)  # the probability itself (NaN stays NaN)
        values = tl.where(kcols[None, :] == j, value[:, None], values)
        index = tl.where(kcols[None, :] == j, choice[:, None], index)
        key = tl.where(picked, -1.0, key)
    if RENORM:
        values = values / tl.sum(values, axis=1)[:, None]  # padding columns hold 0
    out = rows[:, None].to(tl.int64) * TOP_K + kcols[None, :]
    out_mask = row_ok[:, None] & (kcols[None, :] < TOP_K)
    tl.store(weights_ptr + out, values, mask=out_mask)
    tl.store(experts_ptr + out, index.to(tl.int64), mask=out_mask)


@_jit
def _softmax_topk_backward_kernel(
    logits_ptr,
    experts_ptr,
    grad_weights_ptr,
    grad_logits_ptr,
    num_rows,
    num_experts,
    stride_row,
    TOP_K: tl.constexpr,
    RENORM: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_E: tl.constexpr,
):
    """BLOCK_N rows per program: the logits' gradient of `_softmax_topk_kernel`'s weights, the softmax recomputed.
    Per row, with p = softmax(x), the chosen experts' p summing to S and the weights' gradient g:
    d p[e_k] = g_k (renormalised: (g_k - Σ_j g_j·p[e_j] / S) / S), 0 elsewhere; d x = p · (d p - Σ d p · p)."""
    rows, cols, row_ok, col_ok, probs = _softmax_rows(logits_ptr, num_rows, num_experts, stride_row, BLOCK_N, BLOCK_E)
    grad_probs = tl.zeros((BLOCK_N, BLOCK_E), dtype=tl.float32)  # Σ_k g_k at e_k
    chosen = tl.zeros((BLOCK_N, BLOCK_E), dtype=tl.float32)  # 1 at the chosen experts
    total = tl.zeros((BLOCK_N,), dtype=tl.float32)  # S
    weighted = tl.zeros((BLOCK_N,), dtype=tl.float32)  # Σ g_k · p[e_k]
    for k in tl.static_range(TOP_K):
        expert = tl.load(experts_ptr + rows.to(tl.int64) * TOP_K + k, mask=row_ok, other=0).to(tl.int32)
        grad = tl.load(grad_weights_ptr + rows.to(tl.int64) * TOP_K + k, mask=row_ok, other=0.0).to(tl.float32)
        picked = cols[None, :] == expert[:, None]
        prob = tl.sum(tl.where(picked, probs, 0.0), axis=1)
        grad_probs += tl.where(picked, grad[:, None], 0.0)
        chosen += picked.to(tl.float32)
        total += prob
        weighted += grad * prob
    if RENORM:
        grad_probs = (grad_probs - (weighted / total)[:, None] * chosen) / total[:, None]
    grad_logits = probs * (grad_probs - tl.sum(grad_probs * probs, axis=1)[:, None])
    out = rows[:, None].to(tl.int64) * num_experts + cols[None, :]
    tl.store(
        grad_logits_ptr + out, grad_logits.to(grad_logits_ptr.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :]
    )


@_jit
def _block_histogram_kernel(
    ids_ptr, counts_ptr, num_ids, num_bins, BLOCK: tl.constexpr, BLOCK_B: tl.constexpr, CHUNKS: tl.constexpr
):
    """counts[program, b] = number of ids equal to b among the program's CHUNKS·BLOCK ids."""
    pid = tl.program_id(0)
    bins = tl.arange(0, BLOCK_B)
    counts = tl.zeros((BLOCK_B,), dtype=tl.int32)
    for chunk in range(CHUNKS):
        offs = (pid.to(tl.int64) * CHUNKS + chunk) * BLOCK + tl.arange(0, BLOCK)
        ids = tl.load(ids_ptr + offs, mask=offs < num_ids, other=BLOCK_B).to(tl.int32)  # past the end: in no bin
        counts += tl.sum((ids[:, None] == bins[None, :]).to(tl.int32), axis=0)
    tl.store(counts_ptr + pid.to(tl.int64) * num_bins + bins, counts, mask=bins < num_bins)


@_jit
def _scan_counts_kernel(
    counts_ptr, base_ptr, bin_counts_ptr, ends_ptr, num_programs, num_bins, BLOCK_P: tl.constexpr, BLOCK_B: tl.constexpr
):
    """One program: bin_counts[b] = Σ_p counts[p, b]; ends[b] = Σ_{b' <= b} bin_counts[b'] (int32);
    base[p, b] = (bin b's start) + Σ_{p' < p} counts[p', b]."""
    bins = tl.arange(0, BLOCK_B)
    bin_ok = bins < num_bins
    totals = tl.zeros((BLOCK_B,), dtype=tl.int64)
    start = 0
    while start < num_programs:  # (P, B) -> (B,) totals; `while`: Triton 3.6's interpreter takes no range() bound
        progs = start + tl.arange(0, BLOCK_P)
        offs = progs[:, None].to(tl.int64) * num_bins + bins[None, :]
        tile = tl.load(counts_ptr + offs, mask=(progs < num_programs)[:, None] & bin_ok[None, :], other=0)
        totals += tl.sum(tile.to(tl.int64), axis=0)
        start += BLOCK_P
    ends = tl.cumsum(totals, axis=0)
    tl.store(bin_counts_ptr + bins, totals, mask=bin_ok)
    tl.store(ends_ptr + bins, ends.to(tl.int32), mask=bin_ok)
    running = ends - totals  # (B,) bin starts, then moved past each program's ids
    start = 0
    while start < num_programs:  # exclusive scan over programs, per bin
        progs = start + tl.arange(0, BLOCK_P)
        offs = progs[:, None].to(tl.int64) * num_bins + bins[None, :]
        mask = (progs < num_programs)[:, None] & bin_ok[None, :]
        tile = tl.load(counts_ptr + offs, mask=mask, other=0).to(tl.int64)
        tl.store(base_ptr + offs, tl.cumsum(tile, axis=0) - tile + running[None, :], mask=mask)
        running += tl.sum(tile, axis=0)
        start += BLOCK_P


@_jit
def _stable_scatter_kernel(
    ids_ptr,
    base_ptr,
    pos_ptr,
    order_ptr,
    num_ids,
    num_bins,
    WRITE_ORDER: tl.constexpr,
    BLOCK: tl.constexpr,
    BLOCK_B: tl.constexpr,
    CHUNKS: tl.constexpr,
):
    """pos[i] = base[program, ids[i]] + (equal ids before i in the program); order[pos[i]] = i when WRITE_ORDER."""
    pid = tl.program_id(0)
    bins = tl.arange(0, BLOCK_B)
    place = tl.load(base_ptr + pid.to(tl.int64) * num_bins + bins, mask=bins < num_bins, other=0)  # (B,) next place
    for chunk in range(CHUNKS):
        offs = (pid.to(tl.int64) * CHUNKS + chunk) * BLOCK + tl.arange(0, BLOCK)
        valid = offs < num_ids
        ids = tl.load(ids_ptr + offs, mask=valid, other=BLOCK_B).to(tl.int32)
        onehot = (ids[:, None] == bins[None, :]).to(tl.int32)  # (BLOCK, BLOCK_B); no bin past the end
        rank = tl.sum(tl.cumsum(onehot, axis=0) * onehot, axis=1) - 1  # equal ids before, in the chunk
        pos = tl.sum(onehot.to(tl.int64) * place[None, :], axis=1) + rank
        tl.store(pos_ptr + offs, pos, mask=valid)
        if WRITE_ORDER:
            tl.store(order_ptr + pos, offs, mask=valid)
        place += tl.sum(onehot, axis=0)


def _next_power_of_2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


def _check(tensor: torch.Tensor) -> None:
    if not HAS_TRITON:
        raise ImportError("the triton routing backend needs triton: `pip install triton`, or use the torch backend")
    if not tensor.is_cuda and not interpreting():
        raise ValueError(
            f"the triton routing kernels run on CUDA tensors (got a {tensor.device.type} tensor); on CPU "
            "use the torch backend, or set TRITON_INTERPRET=1 before importing triton (slow, for tests)"
        )


def counting_sort(
    ids: torch.Tensor, num_bins: int, write_order: bool = True, block: int | None = None, chunks: int | None = None
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """Stable counting sort of `ids` (S,) with values in [0, num_bins).

    Returns `pos` (S,) int64, each id's place in sorted order (the inverse permutation), `order` (S,) int64 with
    ids[order] sorted (None unless `write_order`), and `bin_counts` (num_bins,) int64. `block` ids per one-hot tile,
    `chunks` tiles per program (default: enough programs to fill a GPU, at most 32 tiles each).
    """
    pos, order, bin_counts, _ = _counting_sort(ids, num_bins, write_order, block, chunks)
    return pos, order, bin_counts


def _counting_sort(ids, num_bins, write_order, block, chunks):
    """`counting_sort`, plus the bins' ends (num_bins,) int32 (the inclusive cumulative sum of their counts)."""
    _check(ids)
    ids = ids.reshape(-1).contiguous()
    num_ids, device = ids.numel(), ids.device
    block_b = _next_power_of_2(num_bins)
    if block is None:  # one-hot tiles of ~4k entries on a GPU; large ones under the interpreter (per-program cost)
        block = max(16, (2**16 if interpreting() else 2**12) // block_b)
    num_tiles = -(-num_ids // block)
    if chunks is None:  # ~512 programs at most (a few per SM), at most 32 tiles each
        chunks = 1 if interpreting() else min(32, _next_power_of_2(-(-num_tiles // 512)))
    num_programs = -(-num_tiles // chunks)
    pos = torch.empty(num_ids, dtype=torch.int64, device=device)
    order = torch.empty(num_ids, dtype=torch.int64, device=device) if write_order else None
    bin_counts = torch.empty(num_bins, dtype=torch.int64, device=device)
    ends = torch.empty(num_bins, dtype=torch.int32, device=device)
    if num_ids == 0:
        return pos, order, bin_counts.zero_(), ends.zero_()
    counts = torch.empty(num_programs, num_bins, dtype=torch.int32, device=device)
    base = torch.empty(num_programs, num_bins, dtype=torch.int64, device=device)
    grid = (num_programs,)
    _block_histogram_kernel[grid](ids, counts, num_ids, num_bins, BLOCK=block, BLOCK_B=block_b, CHUNKS=chunks)
    block_p = max(1, min(_next_power_of_2(num_programs), 4096 // block_b))
    _scan_counts_kernel[(1,)](counts, base, bin_counts, ends, num_programs, num_bins, BLOCK_P=block_p, BLOCK_B=block_b)
    _stable_scatter_kernel[grid](
        ids,
        base,
        pos,
        order if write_order else pos,
        num_ids,
        num_bins,
        WRITE_ORDER=write_order,
        BLOCK=block,
        BLOCK_B=block_b,
        CHUNKS=chunks,
    )
    return pos, order, bin_counts, ends


def softmax_topk(
    router_logits: torch.Tensor, top_k: int, renormalise: bool, block_rows: int | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(N, E) logits -> weights (N, K) fp32 (renormalised when `renormalise`), experts (N, K) int64; one launch.
    Differentiable in the weights (the backward, the softmax / renormalisation Jacobian, is one launch too)."""
    _check(router_logits)
    num_rows, num_experts = router_logits.shape
    if not 1 <= top_k <= min(MAX_TOP_K, num_experts):
        raise ValueError(
            f"the triton routing kernel takes 1 <= top_k <= min({MAX_TOP_K}, num_experts), got top_k="
            f"{top_k} with {num_experts} experts; use the torch backend"
        )
    return _SoftmaxTopK.apply(router_logits, top_k, renormalise, block_rows)


def _rows_per_program(block_e: int) -> int:
    """Rows per program of the softmax kernels (forward and backward): (rows, BLOCK_E) tiles of ~2k entries on a GPU,
    large ones under the interpreter (per-program cost)."""
    return max(1, (2**14 if interpreting() else 2**11) // block_e)


def _softmax_topk_forward(logits, top_k, renormalise, block_rows):
    logits = logits if logits.stride(-1) == 1 else logits.contiguous()
    num_rows, num_experts = logits.shape
    weights = torch.empty(num_rows, top_k, dtype=torch.float32, device=logits.device)
    experts = torch.empty(num_rows, top_k, dtype=torch.int64, device=logits.device)
    block_e = _next_power_of_2(num_experts)
    if block_rows is None:
        block_rows = _rows_per_program(block_e)
    if num_rows:
        _softmax_topk_kernel[(-(-num_rows // block_rows),)](
            logits,
            weights,
            experts,
            num_rows,
            num_experts,
            logits.stride(0),
            TOP_K=top_k,
            RENORM=renormalise,
            BLOCK_K=_next_power_of_2(top_k),
            BLOCK_N=block_rows,
            BLOCK_E=block_e,
        )
    return weights, experts


class _SoftmaxTopK(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, top_k, renormalise, block_rows):
        weights, experts = _softmax_topk_forward(logits, top_k, renormalise, block_rows)
        ctx.mark_non_differentiable(experts)
        ctx.save_for_backward(logits, experts)
        ctx.renormalise = renormalise
        return weights, experts

    @staticmethod
    def backward(ctx, grad_weights, _):
        logits, experts = ctx.saved_tensors  # the softmax is recomputed rather than kept
        return _softmax_topk_backward(logits, experts, grad_weights, ctx.renormalise), None, None, None


def _softmax_topk_backward(logits, experts, grad_weights, renormalise):
    """The logits' gradient (N, E), in the logits' dtype, of `_softmax_topk_forward`'s weights: one launch."""
    logits = logits if logits.stride(-1) == 1 else logits.contiguous()
    num_rows, num_experts = logits.shape
    grad_logits = torch.empty(num_rows, num_experts, dtype=logits.dtype, device=logits.device)
    block_e = _next_power_of_2(num_experts)
    block_rows = _rows_per_program(block_e)
    if num_rows:
        _softmax_topk_backward_kernel[(-(-num_rows // block_rows),)](
            logits,
            experts,
            grad_weights.contiguous(),
            grad_logits,
            num_rows,
            num_experts,
            logits.stride(0),
            TOP_K=experts.shape[1],
            RENORM=renormalise,
            BLOCK_N=block_rows,
            BLOCK_E=block_e,
        )
    return grad_logits


def route(
    router_logits: torch.Tensor,
    top_k: int,
    norm_topk_prob: bool | str = True,
    capacity_factor: float | None = None,
    block_rows: int | None = None,
    block: int | None = None,
    capacity_rounding: str = "switch",
    strict: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`routing_naive.route` with the kernels: the same weights (fp32 tolerance) and, without ties, the same experts
    (ties go to the lowest expert id). In a traced graph the kernels run as the custom ops below; `strict=False`
    (the kernel was not asked for) lets them fall back to the reference there instead of raising."""
    num_rows, num_experts = router_logits.shape
    renormalise = renormalises(norm_topk_prob, top_k)
    if not torch.compiler.is_compiling():
        weights, experts = softmax_topk(router_logits, top_k, renormalise, block_rows)
    elif not strict and not 1 <= top_k <= min(MAX_TOP_K, num_experts):  # beyond the kernel: the reference, traced
        return reference_route(router_logits, top_k, norm_topk_prob, capacity_factor, capacity_rounding)
    else:
        weights, experts = torch.ops.mhmoe.softmax_topk(router_logits, top_k, renormalise, strict)
    if capacity_factor is not None:
        capacity = expert_capacity(capacity_factor, num_rows, top_k, num_experts, capacity_rounding)
        flat = experts.t().reshape(-1)  # (K·N,) slot-major: priority order
        pos, _, counts, ends = _sort(flat, num_experts, False, block, strict)
        rank = pos - (ends - counts)[flat]  # place among the expert's assignments
        kept = (rank < capacity).view(top_k, num_rows).t()
        experts = torch.where(kept, experts, num_experts)
        weights = weights * kept
    return weights, experts


def sort_by_expert(
    experts: torch.Tensor, num_experts: int, block: int | None = None, positions: bool = False, strict: bool = True
) -> tuple[torch.Tensor, ...]:
    """`routing_naive.sort_by_expert` with the counting sort: `order` (S,) int64 (dropped id E last, stable),
    `offsets` (E,) int32 and, with `positions`, the inverse permutation (S,) int64 (the sort's own `pos`).
    `strict`: as in `route`."""
    pos, order, _, ends = _sort(experts.reshape(-1), num_experts + 1, True, block, strict)
    return (order, ends[:num_experts], pos) if positions else (order, ends[:num_experts])


def _sort(ids, num_bins, write_order, block, strict):
    """`_counting_sort` eagerly; its custom op in a traced graph (`block` is then the default)."""
    if torch.compiler.is_compiling():
        return torch.ops.mhmoe.counting_sort(ids, num_bins, write_order, strict)
    return _counting_sort(ids, num_bins, write_order, block, None)


# The kernels inside traced graphs (torch.compile, torch.export): `torch.library` custom ops, opaque nodes with fake
# (meta) implementations and autograd, so that a compiled MH-MoE block runs these kernels (and CUDA graphs can capture
# them) instead of the traced reference. Eager calls keep the direct path above (a custom op's dispatch costs host
# time). A kernel that fails inside a graph cannot be swapped out at trace time: with `strict=False` the op body runs
# the reference in its place, says so once and records it in `TRACED_FAILED` (`backends.fallbacks()` reads it).

TRACED_FAILED: dict[str, str] = {}  # op -> the reason its kernel first failed inside a traced graph
logger = logging.getLogger(__name__)


def _kernel_or_reference(op: str, strict: bool, kernel, reference):
    """`kernel()`; when it raises and not `strict` (or failed before), `reference()` (recorded once)."""
    if strict or op not in TRACED_FAILED:
        try:
            return kernel()
        except Exception as error:
            if strict:
                raise
            TRACED_FAILED[op] = f"{type(error).__name__}: {error}"
            logger.warning("the %s kernel failed in a traced graph (%s); the PyTorch reference runs instead", op, error)
    return reference()


def _softmax_topk_op(
    logits: torch.Tensor, top_k: int, renormalise: bool, strict: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    def kernel():
        _check(logits)
        return _softmax_topk_forward(logits, top_k, renormalise, None)

    def reference():
        return reference_route(logits, top_k, "always" if renormalise else False)

    return _kernel_or_reference("routing.route", strict, kernel, reference)


def _softmax_topk_backward_op(
    logits: torch.Tensor, experts: torch.Tensor, grad_weights: torch.Tensor, renormalise: bool, strict: bool
) -> torch.Tensor:
    def kernel():
        _check(logits)
        return _softmax_topk_backward(logits, experts, grad_weights, renormalise)

    def reference():
        return route_weights_backward(logits, experts, grad_weights, renormalise)

    return _kernel_or_reference("routing.route", strict, kernel, reference)


def _counting_sort_op(
    ids: torch.Tensor, num_bins: int, write_order: bool, strict: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    def kernel():
        pos, order, counts, ends = _counting_sort(ids, num_bins, write_order, None, None)
        return pos, order if write_order else pos.new_empty(0), counts, ends  # an op returns tensors only

    def reference():
        order = torch.sort(ids.reshape(-1), stable=True).indices  # (S,)
        pos = torch.empty_like(order).index_copy_(0, order, torch.arange(order.numel(), device=order.device))
        counts = torch.bincount(ids.reshape(-1), minlength=num_bins)
        return pos, order if write_order else pos.new_empty(0), counts, counts.cumsum(0).to(torch.int32)

    return _kernel_or_reference("routing.sort_by_expert", strict, kernel, reference)


def _register_ops() -> None:
    """`torch.ops.mhmoe.softmax_topk(logits, top_k, renormalise, strict) -> (weights, experts)` with autograd (its
    backward `softmax_topk_backward` an op too) and `torch.ops.mhmoe.counting_sort(ids, num_bins, write_order,
    strict) -> (pos, order, counts, ends)` (`order` empty unless written). Once per process: an exported
    checkpoint's copy of this file finds them registered."""
    if hasattr(torch.ops.mhmoe, "softmax_topk"):
        return
    forward = torch.library.custom_op("mhmoe::softmax_topk", _softmax_topk_op, mutates_args=())
    backward = torch.library.custom_op("mhmoe::softmax_topk_backward", _softmax_topk_backward_op, mutates_args=())
    sort = torch.library.custom_op("mhmoe::counting_sort", _counting_sort_op, mutates_args=())

    @forward.register_fake
    def _(logits, top_k, renormalise, strict):
        rows = logits.shape[0]
        return logits.new_empty(rows, top_k, dtype=torch.float32), logits.new_empty(rows, top_k, dtype=torch.int64)

    @backward.register_fake
    def _(logits, experts, grad_weights, renormalise, strict):
        return logits.new_empty(logits.shape)

    @sort.register_fake
    def _(ids, num_bins, write_order, strict):
        size = ids.numel()
        return (
            ids.new_empty(size, dtype=torch.int64),
            ids.new_empty(size if write_order else 0, dtype=torch.int64),
            ids.new_empty(num_bins, dtype=torch.int64),
            ids.new_empty(num_bins, dtype=torch.int32),
        )

    def setup_context(ctx, inputs, output):
        logits, _, renormalise, strict = inputs
        ctx.mark_non_differentiable(output[1])
        ctx.save_for_backward(logits, output[1])
        ctx.settings = (renormalise, strict)

    def grad_fn(ctx, grad_weights, _):
        logits, experts = ctx.saved_tensors
        grad = torch.ops.mhmoe.softmax_topk_backward(logits, experts, grad_weights.contiguous(), *ctx.settings)
        return grad, None, None, None

    forward.register_autograd(grad_fn, setup_context=setup_context)


_register_ops()
