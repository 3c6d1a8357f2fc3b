"""Experts in Triton (scattermoe-style): gather -> grouped GEMM with act(gate)·up fused -> grouped GEMM written straight
to each assignment's slot; the K slots of a row are then weighted and summed in fp32 (one bmm, fixed order).

Forward: two launches over tiles of BLOCK_M expert-sorted rows (a tile never spans two experts; each program finds
its expert and rows from the (E,) offsets, so the grid has a static size, S/BLOCK_M + E, nothing syncs with the host
and BLOCK_M can be tuned). No padded copies of the rows and no (S, 2I) gate/up buffer: only act(gate)·up (S, I) goes
through memory. Each slot is written once (no atomics): deterministic. Dropped assignments (id E) sort last, fall in
no tile, and their slots stay 0.
Backward: gate/up recomputed by a grouped GEMM ((S, 2I) in the backward only), d act·up and d rows by grouped GEMMs,
the expert weight gradients by a split-K kernel (each expert's rows cut into `num_splits` chunks, one program per
(expert, chunk, output tile), the chunks' partial sums added in a fixed order: parallel over an expert's rows, no
atomics), the SiLU derivative and the row gathers in PyTorch; d rows summed over each row's K slots by a gather.

Tiles: on a GPU every kernel is autotuned (`triton.autotune`, keyed on its widths and dtype) over 7 configs:
BLOCK_M ∈ {64, 128} row tiles (and 32 for small inputs), BLOCK_N ∈ {64, 128}, BLOCK_K ∈ {32, 64}, num_warps ∈ {4, 8},
num_stages ∈ {3, 4}, less those whose pipelined tiles would not fit in shared memory (fp32); the first call at each
shape compiles and times them all (seconds per kernel). `block_m`/`block_n`/`block_k` pin one tile instead. Under
TRITON_INTERPRET=1 (tests on CPU) the config list is a single 32×32×32 tile, which the autotuner runs without
benchmarking (it would need a GPU to time).
Precision: bf16/fp16 operands go to `tl.dot` as they are (fp32 accumulation); fp32 operands run as TF32 when torch's
own fp32 matmuls may (`torch.backends.cuda.matmul.allow_tf32`), as IEEE fp32 otherwise. The interpreter cannot
multiply bf16 (numpy has no bf16): there the tiles are loaded and stored in their dtype and converted to fp32 for the
dot.

`torch.ops.mhmoe.triton_experts` (and its backward op) is the `torch.library` custom op of the kernels, with fake
(meta) implementations and autograd registered: `torch.compile` (tested with `fullgraph=True`, aot_eager) and
`torch.export` trace `experts_forward` whole, the op one opaque node of the graph.

Status: SiLU only. Tested against `experts_naive.py` (outputs and every gradient, fp32 and bf16) under
TRITON_INTERPRET=1, and on an H200 (benchmarks/README.md, `gpu_moe.py` checks). The "triton" backend of the experts
op (`backends.py`), chosen with `experts_implementation="triton"`; not the default: on the H200 the h=3 block's
forward is 1.41x Mixtral's against 1.48x on torch's grouped GEMM, but forward+backward 3.38x against 2.48x at 32K tokens
(`gpu_moe.py`, `ours_h3_triton`).

Imports without triton (exported checkpoints): the kernels are then plain functions, never launched.
"""

import torch

from ..triton_compat import HAS_TRITON, interpreting, tl, triton  # noqa: F401  (HAS_TRITON: re-exported)
from ..triton_compat import jit as _jit


@_jit
def _tile_rows(offsets_ptr, num_experts, BLOCK_M: tl.constexpr, BLOCK_E: tl.constexpr):
    """This program's expert, its BLOCK_M sorted rows and which of them are real, from the (E,) row offsets: expert e
    owns ceil(rows_e / BLOCK_M) consecutive tiles. Tiles past the last expert's get no rows."""
    tile = tl.program_id(0)
    experts = tl.arange(0, BLOCK_E)
    real = experts < num_experts
    ends = tl.load(offsets_ptr + experts, mask=real, other=0)
    starts = tl.load(offsets_ptr + experts - 1, mask=real & (experts > 0), other=0)
    tiles = tl.where(real, (ends - starts + BLOCK_M - 1) // BLOCK_M, 0)
    tile_ends = tl.where(real, tl.cumsum(tiles, axis=0), 2**30)
    expert = tl.sum((tile_ends <= tile).to(tl.int32))  # experts whose tiles all come before this one
    valid = expert < num_experts
    this = experts == expert
    first_tile = tl.sum(tl.where(this, tile_ends - tiles, 0))
    row_begin = tl.sum(tl.where(this, starts, 0))
    row_end = tl.where(valid, tl.sum(tl.where(this, ends, 0)), 0)
    rows = row_begin + (tile - first_tile) * BLOCK_M + tl.arange(0, BLOCK_M)
    return tl.minimum(expert, num_experts - 1), rows, rows < row_end, valid


@_jit
def _gate_up_kernel(
    x_ptr,
    order_ptr,
    offsets_ptr,
    w_ptr,
    h_ptr,
    num_experts,
    width,
    inter,
    top_k,
    stride_x,
    stride_we,
    stride_wo,
    stride_wi,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_E: tl.constexpr,
    UPCAST: tl.constexpr,
    PRECISION: tl.constexpr,
):
    """h[rows, cols] = silu(x[src] @ gate[e]ᵀ) · (x[src] @ up[e]ᵀ) for one tile of rows and BLOCK_N inner columns."""
    expert, rows, row_ok, valid = _tile_rows(offsets_ptr, num_experts, BLOCK_M, BLOCK_E)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < inter
    src = tl.load(order_ptr + rows, mask=row_ok, other=0) // top_k  # the routed row of each assignment
    w_base = w_ptr + expert.to(tl.int64) * stride_we
    acc_gate = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, tl.where(valid, width, 0), BLOCK_K):  # no loop at all in a tile without rows
        ks = k0 + tl.arange(0, BLOCK_K)
        k_ok = ks < width
        a = tl.load(
            x_ptr + src[:, None].to(tl.int64) * stride_x + ks[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0
        )
        w_mask = k_ok[:, None] & col_ok[None, :]
        gate = tl.load(w_base + cols[None, :] * stride_wo + ks[:, None] * stride_wi, mask=w_mask, other=0.0)
        up = tl.load(w_base + (inter + cols[None, :]) * stride_wo + ks[:, None] * stride_wi, mask=w_mask, other=0.0)
        if UPCAST:
            a, gate, up = a.to(tl.float32), gate.to(tl.float32), up.to(tl.float32)
        acc_gate = tl.dot(a, gate, acc_gate, input_precision=PRECISION)
        acc_up = tl.dot(a, up, acc_up, input_precision=PRECISION)
    hidden = acc_gate * tl.sigmoid(acc_gate) * acc_up
    tl.store(
        h_ptr + rows[:, None].to(tl.int64) * inter + cols[None, :],
        hidden.to(h_ptr.dtype.element_ty),
        mask=row_ok[:, None] & col_ok[None, :],
    )


@_jit
def _down_scatter_kernel(
    h_ptr,
    order_ptr,
    offsets_ptr,
    w_ptr,
    slots_ptr,
    num_experts,
    width,
    inter,
    stride_we,
    stride_wo,
    stride_wi,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_E: tl.constexpr,
    UPCAST: tl.constexpr,
    PRECISION: tl.constexpr,
):
    """slots[order[rows], cols] = (h[rows] @ down[e]ᵀ)[:, cols]: each assignment's expert output, in its own slot."""
    expert, rows, row_ok, valid = _tile_rows(offsets_ptr, num_experts, BLOCK_M, BLOCK_E)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < width
    w_base = w_ptr + expert.to(tl.int64) * stride_we
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, tl.where(valid, inter, 0), BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_ok = ks < inter
        a = tl.load(
            h_ptr + rows[:, None].to(tl.int64) * inter + ks[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0
        )
        w = tl.load(
            w_base + cols[None, :] * stride_wo + ks[:, None] * stride_wi,
            mask=k_ok[:, None] & col_ok[None, :],
            other=0.0,
        )
        if UPCAST:
            a, w = a.to(tl.float32), w.to(tl.float32)
        acc = tl.dot(a, w, acc, input_precision=PRECISION)
    slot = tl.load(order_ptr + rows, mask=row_ok, other=0)
    out = slots_ptr + slot[:, None].to(tl.int64) * width + cols[None, :]
    tl.store(out, acc, mask=row_ok[:, None] & col_ok[None, :])


@_jit
def _grouped_gemm_kernel(
    a_ptr,
    offsets_ptr,
    b_ptr,
    c_ptr,
    num_experts,
    inner,
    cols_total,
    stride_am,
    stride_be,
    stride_bk,
    stride_bn,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_E: tl.constexpr,
    UPCAST: tl.constexpr,
    PRECISION: tl.constexpr,
):
    """c[rows] = a[rows] @ b[e] for one tile of expert-sorted rows; b[e] is read through strides (transposes free)."""
    expert, rows, row_ok, valid = _tile_rows(offsets_ptr, num_experts, BLOCK_M, BLOCK_E)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < cols_total
    b_base = b_ptr + expert.to(tl.int64) * stride_be
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, tl.where(valid, inner, 0), BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_ok = ks < inner
        a = tl.load(
            a_ptr + rows[:, None].to(tl.int64) * stride_am + ks[None, :],
            mask=row_ok[:, None] & k_ok[None, :],
            other=0.0,
        )
        b = tl.load(
            b_base + ks[:, None] * stride_bk + cols[None, :] * stride_bn,
            mask=k_ok[:, None] & col_ok[None, :],
            other=0.0,
        )
        if UPCAST:
            a, b = a.to(tl.float32), b.to(tl.float32)
        acc = tl.dot(a, b, acc, input_precision=PRECISION)
    tl.store(
        c_ptr + rows[:, None].to(tl.int64) * cols_total + cols[None, :],
        acc.to(c_ptr.dtype.element_ty),
        mask=row_ok[:, None] & col_ok[None, :],
    )


@_jit
def _weight_grad_kernel(
    g_ptr,
    a_ptr,
    offsets_ptr,
    out_ptr,
    num_experts,
    num_splits,
    g_cols,
    a_cols,
    stride_gm,
    stride_am,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    UPCAST: tl.constexpr,
    PRECISION: tl.constexpr,
):
    """out[split, e] (G, A) = Σ over chunk `split` of expert e's sorted rows of g[row]ᵀ a[row]: a (BLOCK_M, BLOCK_N)
    output tile per program, BLOCK_K rows per step; the expert's rows are cut into `num_splits` chunks of whole
    BLOCK_K steps (empty chunks, and experts without rows, give 0)."""
    expert = tl.program_id(0) // num_splits
    split = tl.program_id(0) % num_splits
    g_idx = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    a_idx = tl.program_id(2) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_begin = tl.where(expert > 0, tl.load(offsets_ptr + tl.maximum(expert - 1, 0)), 0)
    row_end = tl.load(offsets_ptr + expert)
    steps = (row_end - row_begin + BLOCK_K - 1) // BLOCK_K
    chunk = (steps + num_splits - 1) // num_splits * BLOCK_K
    start = row_begin + split * chunk
    stop = tl.minimum(start + chunk, row_end)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for r0 in range(start, stop, BLOCK_K):
        rows = r0 + tl.arange(0, BLOCK_K)
        ok = rows < stop
        g = tl.load(
            g_ptr + rows[None, :].to(tl.int64) * stride_gm + g_idx[:, None],
            mask=ok[None, :] & (g_idx < g_cols)[:, None],
            other=0.0,
        )
        a = tl.load(
            a_ptr + rows[:, None].to(tl.int64) * stride_am + a_idx[None, :],
            mask=ok[:, None] & (a_idx < a_cols)[None, :],
            other=0.0,
        )
        if UPCAST:
            g, a = g.to(tl.float32), a.to(tl.float32)
        acc = tl.dot(g, a, acc, input_precision=PRECISION)
    base = (split * num_experts + expert).to(tl.int64) * g_cols * a_cols
    out = out_ptr + base + g_idx[:, None] * a_cols + a_idx[None, :]
    tl.store(out, acc, mask=(g_idx < g_cols)[:, None] & (a_idx < a_cols)[None, :])


def _next_power_of_2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


def _configs() -> list:
    """The autotuner's tiles: one under the interpreter (no benchmarking: it would need a GPU to time)."""
    if not HAS_TRITON:
        return []
    if interpreting():
        return [triton.Config({"BLOCK_M": 32, "BLOCK_N": 32, "BLOCK_K": 32}, num_warps=4, num_stages=1)]
    tiles = [  # (BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages)
        (64, 64, 32, 4, 3),
        (64, 128, 32, 4, 4),
        (128, 64, 32, 4, 4),
        (128, 128, 32, 8, 3),
        (64, 128, 64, 4, 3),
        (128, 128, 64, 8, 3),
        (32, 64, 32, 4, 4),
    ]
    return [
        triton.Config({"BLOCK_M": m, "BLOCK_N": n, "BLOCK_K": k}, num_warps=w, num_stages=st)
        for m, n, k, w, st in tiles
    ]


SHARED_MEMORY_BUDGET = 160 * 1024  # bytes of pipelined operand tiles a config may ask for (A100: 164 KiB, H100: 227)


def _fitting(configs, named_args, **kwargs):
    """The autotuner's early prune: drop tiles whose pipelined operand buffers (num_stages × the A tile and up to two
    B tiles) would pass SHARED_MEMORY_BUDGET for these operands' dtype (fp32 tiles are twice bf16's): they could not
    compile. The smallest config stays if none fits."""
    size = next(v.element_size() for v in named_args.values() if isinstance(v, torch.Tensor))

    def need(c):
        m, n, k = c.kwargs["BLOCK_M"], c.kwargs["BLOCK_N"], c.kwargs["BLOCK_K"]
        return c.num_stages * (m * k + 2 * k * n) * size

    return [c for c in configs if need(c) <= SHARED_MEMORY_BUDGET] or [min(configs, key=need)]


def _autotuned(kernel, key: list[str]):
    if not HAS_TRITON:
        return kernel
    return triton.autotune(configs=_configs(), key=key, prune_configs_by={"early_config_prune": _fitting})(kernel)


_gate_up_tuned = _autotuned(_gate_up_kernel, ["width", "inter"])
_down_scatter_tuned = _autotuned(_down_scatter_kernel, ["width", "inter"])
_grouped_gemm_tuned = _autotuned(_grouped_gemm_kernel, ["inner", "cols_total"])
_weight_grad_tuned = _autotuned(_weight_grad_kernel, ["g_cols", "a_cols"])


def _dot_precision(dtype: torch.dtype) -> str:
    """TF32 for fp32 operands where torch lets its own fp32 matmuls use it, IEEE fp32 otherwise (bf16/fp16 operands
    ignore it)."""
    return "tf32" if dtype != torch.float32 or torch.backends.cuda.matmul.allow_tf32 else "ieee"


def _launch(kernel, tuned, blocks: list[int], grid, *args, **constexprs) -> None:
    """`tuned` (autotuned) when `blocks` is empty, else `kernel` with the tile (BLOCK_M, BLOCK_N, BLOCK_K) given;
    `grid(meta)` from the tile."""
    constexprs.update(UPCAST=interpreting(), PRECISION=_dot_precision(args[0].dtype))
    if not blocks:
        tuned[grid](*args, **constexprs)
        return
    tile = dict(BLOCK_M=blocks[0], BLOCK_N=blocks[1], BLOCK_K=blocks[2])
    kernel[grid(tile)](*args, **tile, **constexprs)


def default_num_splits(rows: int, num_experts: int, g_cols: int, a_cols: int) -> int:
    """Chunks of an expert's rows in the weight-gradient kernel: one more per 512 rows an expert gets on average (at
    most 4), while the fp32 partial sums stay under 256 MiB."""
    partial_bytes = num_experts * g_cols * a_cols * 4
    return max(1, min(4, rows // max(1, 512 * num_experts), (256 << 20) // max(1, partial_bytes)))


class _Plan:
    """Tiles of BLOCK_M expert-sorted rows for the grouped kernels; a static grid bound Σ_e ceil(rows_e / BLOCK_M) <=
    ceil(S / BLOCK_M) + E."""

    def __init__(self, order, offsets, num_experts, blocks, num_splits):
        self.order, self.offsets, self.num_experts = order, offsets, num_experts
        self.blocks, self.num_splits, self.block_e = list(blocks), num_splits, _next_power_of_2(num_experts)

    def grid(self, rows: int, cols: int):
        return lambda meta: (triton.cdiv(rows, meta["BLOCK_M"]) + self.num_experts, triton.cdiv(cols, meta["BLOCK_N"]))

    def gemm(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        """(S, inner) sorted rows @ b[e] (E, inner, cols) per expert -> (S, cols) fp32 (the accumulator, not rounded to
        the operands' dtype), 0 past offsets[-1]."""
        inner, cols = b.shape[1:]
        out = torch.zeros(a.shape[0], cols, dtype=torch.float32, device=a.device)
        if a.shape[0]:
            _launch(
                _grouped_gemm_kernel,
                _grouped_gemm_tuned,
                self.blocks,
                self.grid(a.shape[0], cols),
                a,
                self.offsets,
                b,
                out,
                self.num_experts,
                inner,
                cols,
                a.stride(0),
                *b.stride(),
                BLOCK_E=self.block_e,
            )
        return out

    def weight_grad(self, g: torch.Tensor, a: torch.Tensor) -> torch.Tensor:
        """(S, G) and (S, A) sorted rows -> (E, G, A) fp32: per expert, Σ over its rows of g[row]ᵀ a[row]."""
        num_experts, g_cols, a_cols = self.num_experts, g.shape[1], a.shape[1]
        splits = self.num_splits or default_num_splits(g.shape[0], num_experts, g_cols, a_cols)
        out = torch.empty(splits, num_experts, g_cols, a_cols, dtype=torch.float32, device=a.device)

        def grid(meta):
            return num_experts * splits, triton.cdiv(g_cols, meta["BLOCK_M"]), triton.cdiv(a_cols, meta["BLOCK_N"])

        _launch(
            _weight_grad_kernel,
            _weight_grad_tuned,
            self.blocks,
            grid,
            g,
            a,
            self.offsets,
            out,
            num_experts,
            splits,
            g_cols,
            a_cols,
            g.stride(0),
            a.stride(0),
        )
        return out[0] if splits == 1 else out.sum(0)  # the chunks' partial sums, in a fixed order


def _experts_op(
    hidden_states: torch.Tensor,
    gate_up_proj: torch.Tensor,
    down_proj: torch.Tensor,
    order: torch.Tensor,
    offsets: torch.Tensor,
    top_k: int,
    blocks: list[int],
    num_splits: int,
) -> torch.Tensor:
    """slots (N·K, W) fp32 = each assignment's unweighted expert output (0 for dropped ones): the fused kernels."""
    plan = _Plan(order, offsets, gate_up_proj.shape[0], blocks, num_splits)
    width, inter = hidden_states.shape[1], down_proj.shape[-1]
    x = hidden_states.to(gate_up_proj.dtype).contiguous()
    hidden = torch.empty(order.numel(), inter, dtype=x.dtype, device=x.device)  # (S, I) act(gate)·up, sorted
    slots = torch.zeros(order.numel(), width, dtype=torch.float32, device=x.device)  # (N·K, W)
    if order.numel():
        _launch(
            _gate_up_kernel,
            _gate_up_tuned,
            plan.blocks,
            plan.grid(order.numel(), inter),
            x,
            order,
            offsets,
            gate_up_proj,
            hidden,
            plan.num_experts,
            width,
            inter,
            top_k,
            x.stride(0),
            *gate_up_proj.stride(),
            BLOCK_E=plan.block_e,
        )
        _launch(
            _down_scatter_kernel,
            _down_scatter_tuned,
            plan.blocks,
            plan.grid(order.numel(), width),
            hidden,
            order,
            offsets,
            down_proj,
            slots,
            plan.num_experts,
            width,
            inter,
            *down_proj.stride(),
            BLOCK_E=plan.block_e,
        )
    return slots


def _experts_backward_op(
    grad_slots: torch.Tensor,
    hidden_states: torch.Tensor,
    gate_up_proj: torch.Tensor,
    down_proj: torch.Tensor,
    order: torch.Tensor,
    offsets: torch.Tensor,
    top_k: int,
    blocks: list[int],
    num_splits: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients of the rows, gate_up_proj and down_proj: gate/up recomputed with a grouped GEMM; grouped GEMMs and
    the split-K weight gradients as kernels; the SiLU derivative and the gathers in PyTorch."""
    plan = _Plan(order, offsets, gate_up_proj.shape[0], blocks, num_splits)
    dtype, inter = gate_up_proj.dtype, down_proj.shape[-1]
    rows = hidden_states.to(dtype).index_select(0, order // top_k)  # (S, W)
    gate, up = plan.gemm(rows, gate_up_proj.transpose(1, 2)).split(inter, dim=-1)  # (S, I) fp32 each
    act = torch.nn.functional.silu(gate)
    grad_rows_out = grad_slots.index_select(0, order).to(dtype).contiguous()  # (S, W), d expert output, sorted
    grad_hidden = plan.gemm(grad_rows_out, down_proj)  # (S, I) fp32
    sig = torch.sigmoid(gate)
    grad_gate = grad_hidden * up * sig * (1 + gate * (1 - sig))  # silu'(g) = σ(g)(1 + g(1 - σ(g)))
    grad_gate_up = torch.cat([grad_gate, grad_hidden * act], dim=-1).to(dtype)  # (S, 2I)
    grad_down = plan.weight_grad(grad_rows_out, (act * up).to(dtype)).to(down_proj.dtype)  # (E, W, I)
    grad_gate_up_proj = plan.weight_grad(grad_gate_up, rows).to(gate_up_proj.dtype)  # (E, 2I, W)
    grad_sorted = plan.gemm(grad_gate_up, gate_up_proj)  # (S, W) fp32, 0 for dropped rows
    slot_pos = torch.empty_like(order).index_copy_(0, order, torch.arange(order.numel(), device=order.device))
    grad_x = grad_sorted.index_select(0, slot_pos).view(-1, top_k, grad_sorted.shape[1]).sum(1)
    return grad_x.to(hidden_states.dtype), grad_gate_up_proj, grad_down


def _register_ops() -> None:
    """`torch.ops.mhmoe.triton_experts(hidden_states, gate_up_proj, down_proj, order, offsets, top_k, blocks,
    num_splits) -> slots` and its backward op, with fake implementations and autograd. Once per process."""
    if hasattr(torch.ops.mhmoe, "triton_experts"):
        return
    forward = torch.library.custom_op("mhmoe::triton_experts", _experts_op, mutates_args=())
    backward = torch.library.custom_op("mhmoe::triton_experts_backward", _experts_backward_op, mutates_args=())

    @forward.register_fake
    def _(hidden_states, gate_up_proj, down_proj, order, offsets, top_k, blocks, num_splits):
        return hidden_states.new_empty(order.shape[0], hidden_states.shape[1], dtype=torch.float32)

    @backward.register_fake
    def _(grad_slots, hidden_states, gate_up_proj, down_proj, order, offsets, top_k, blocks, num_splits):
        return (
            hidden_states.new_empty(hidden_states.shape),
            gate_up_proj.new_empty(gate_up_proj.shape),
            down_proj.new_empty(down_proj.shape),
        )  # contiguous, as the kernels' gradients

    def setup_context(ctx, inputs, output):
        hidden_states, gate_up_proj, down_proj, order, offsets, top_k, blocks, num_splits = inputs
        ctx.save_for_backward(hidden_states, gate_up_proj, down_proj, order, offsets)
        ctx.settings = (top_k, blocks, num_splits)

    def grad_fn(ctx, grad_slots):
        grads = torch.ops.mhmoe.triton_experts_backward(grad_slots.contiguous(), *ctx.saved_tensors, *ctx.settings)
        return *grads, None, None, None, None, None

    forward.register_autograd(grad_fn, setup_context=setup_context)


_register_ops()


def experts_forward(
    hidden_states: torch.Tensor,
    top_k_index: torch.Tensor,
    top_k_weights: torch.Tensor,
    gate_up_proj: torch.Tensor,
    down_proj: torch.Tensor,
    order: torch.Tensor,
    offsets: torch.Tensor,
    block_m: int | None = None,
    block_n: int | None = None,
    block_k: int | None = None,
    num_splits: int | None = None,
) -> torch.Tensor:
    """`experts_naive.experts_forward` (SiLU) with the kernels, differentiable in the rows, the routing weights and
    both expert weights. `order`, `offsets` from `sort_by_expert(top_k_index, E)`. Returns (N, W) in hidden_states'
    dtype; the K weighted slots of a row are summed in fp32 (one bmm, fixed order).

    Tiles autotuned unless `block_m`, `block_n`, `block_k` (powers of two, >= 16) pin one; `num_splits` chunks of
    each expert's rows in the weight gradient (default: `default_num_splits`)."""
    if not HAS_TRITON:
        raise ImportError("the triton experts kernels need triton: `pip install triton`")
    if not hidden_states.is_cuda and not interpreting():
        raise ValueError("the triton experts kernels run on CUDA tensors (or under TRITON_INTERPRET=1)")
    pinned = [block_m, block_n, block_k]
    if any(b is not None for b in pinned) and not all(b is not None for b in pinned):
        raise ValueError(f"give block_m, block_n and block_k together (or none: autotuned), got {pinned}")
    num_rows, top_k = top_k_index.shape
    blocks = [] if block_m is None else pinned
    slots = torch.ops.mhmoe.triton_experts(
        hidden_states, gate_up_proj, down_proj, order, offsets, top_k, blocks, num_splits or 0
    )
    slots = slots.view(num_rows, top_k, -1)  # (N, K, W) fp32
    out = torch.bmm(top_k_weights.float().unsqueeze(1), slots).squeeze(1)  # (N, W): Σ_k weight·slot
    return out.to(hidden_states.dtype)
