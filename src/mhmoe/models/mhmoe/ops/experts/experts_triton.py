"""Experts in Triton (scattermoe-style): gather -> grouped GEMM with act(gate)·up fused -> grouped GEMM written straight
to each assignment's slot; the K slots of a row are then weighted and summed in fp32 (one bmm, fixed order).

Forward: two launches over tiles of BLOCK_M expert-sorted rows (a tile never spans two experts; tile -> expert is
found in the kernel from the cumulative tile counts, so the grid has a static size, S/BLOCK_M + E, and nothing syncs
with the host). No padded copies of the rows and no (S, 2I) gate/up buffer: only act(gate)·up (S, I) goes through
memory. Each slot is written once (no atomics): deterministic. Dropped assignments (id E) sort last, fall in no tile,
and their slots stay 0.
Backward: gate/up recomputed by a grouped GEMM ((S, 2I) in the backward only), d act·up and d rows by grouped GEMMs,
the expert weight gradients by a per-expert reduction kernel (no atomics), the SiLU derivative and the row gathers in
PyTorch; d rows summed over each row's K slots by a gather (deterministic).

Status: SiLU only; fp32 inputs use TF32 in `tl.dot` on a GPU. Tested against `experts_naive.py` (outputs and every
gradient) under TRITON_INTERPRET=1 in fp32; never run on a GPU here. Not a default: `triton_experts_forward` is a
Transformers experts function a user registers (`ExpertsInterface.register("mhmoe_triton", ...)`).

Imports without triton (exported checkpoints): the kernels are then plain functions, never launched.
"""


import torch

from ..routing.routing_triton import sort_by_expert

from ..triton_compat import HAS_TRITON, interpreting, tl, triton  # noqa: F401  (HAS_TRITON: re-exported)
from ..triton_compat import jit as _jit


@_jit
def _tile_rows(tile_ends_ptr, offsets_ptr, num_experts, BLOCK_M: tl.constexpr, BLOCK_E: tl.constexpr):
    """This program's expert and its BLOCK_M sorted rows (and which of them are real)."""
    tile = tl.program_id(0)
    experts = tl.arange(0, BLOCK_E)
    tile_ends = tl.load(tile_ends_ptr + experts, mask=experts < num_experts, other=2**30)
    expert = tl.sum((tile_ends <= tile).to(tl.int32))  # experts whose tiles all come before this one
    valid = expert < num_experts  # past the last tile: no rows
    expert = tl.minimum(expert, num_experts - 1)
    previous = tl.maximum(expert - 1, 0)
    first_tile = tl.where(expert > 0, tl.load(tile_ends_ptr + previous), 0)
    row_begin = tl.where(expert > 0, tl.load(offsets_ptr + previous), 0)
    row_end = tl.where(valid, tl.load(offsets_ptr + expert), 0)
    rows = row_begin + (tile - first_tile) * BLOCK_M + tl.arange(0, BLOCK_M)
    return expert, rows, rows < row_end


@_jit
def _gate_up_kernel(
    x_ptr, order_ptr, tile_ends_ptr, offsets_ptr, w_ptr, h_ptr, num_experts, width, inter, top_k,
    stride_x, stride_we, stride_wo, stride_wi,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_E: tl.constexpr,
):  # fmt: skip
    """h[rows, cols] = silu(x[src] @ gate[e]ᵀ) · (x[src] @ up[e]ᵀ) for one tile of rows and BLOCK_N inner columns."""
    expert, rows, row_ok = _tile_rows(tile_ends_ptr, offsets_ptr, num_experts, BLOCK_M, BLOCK_E)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < inter
    src = tl.load(order_ptr + rows, mask=row_ok, other=0) // top_k  # the routed row of each assignment
    w_base = w_ptr + expert.to(tl.int64) * stride_we
    acc_gate = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, width, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_ok = ks < width
        a = tl.load(x_ptr + src[:, None].to(tl.int64) * stride_x + ks[None, :], mask=row_ok[:, None] & k_ok[None, :],
                    other=0.0)  # fmt: skip
        w_mask = k_ok[:, None] & col_ok[None, :]
        gate = tl.load(w_base + cols[None, :] * stride_wo + ks[:, None] * stride_wi, mask=w_mask, other=0.0)
        up = tl.load(w_base + (inter + cols[None, :]) * stride_wo + ks[:, None] * stride_wi, mask=w_mask, other=0.0)
        acc_gate = tl.dot(a, gate, acc_gate)
        acc_up = tl.dot(a, up, acc_up)
    hidden = acc_gate * tl.sigmoid(acc_gate) * acc_up
    tl.store(h_ptr + rows[:, None].to(tl.int64) * inter + cols[None, :], hidden.to(h_ptr.dtype.element_ty),
             mask=row_ok[:, None] & col_ok[None, :])  # fmt: skip


@_jit
def _down_scatter_kernel(
    h_ptr, order_ptr, tile_ends_ptr, offsets_ptr, w_ptr, slots_ptr, num_experts, width, inter,
    stride_we, stride_wo, stride_wi,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_E: tl.constexpr,
):  # fmt: skip
    """slots[order[rows], cols] = (h[rows] @ down[e]ᵀ)[:, cols]: each assignment's expert output, in its own slot."""
    expert, rows, row_ok = _tile_rows(tile_ends_ptr, offsets_ptr, num_experts, BLOCK_M, BLOCK_E)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < width
    w_base = w_ptr + expert.to(tl.int64) * stride_we
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, inter, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_ok = ks < inter
        a = tl.load(h_ptr + rows[:, None].to(tl.int64) * inter + ks[None, :], mask=row_ok[:, None] & k_ok[None, :],
                    other=0.0)  # fmt: skip
        w = tl.load(w_base + cols[None, :] * stride_wo + ks[:, None] * stride_wi, mask=k_ok[:, None] & col_ok[None, :],
                    other=0.0)  # fmt: skip
        acc = tl.dot(a, w, acc)
    slot = tl.load(order_ptr + rows, mask=row_ok, other=0)
    out = slots_ptr + slot[:, None].to(tl.int64) * width + cols[None, :]
    tl.store(out, acc, mask=row_ok[:, None] & col_ok[None, :])


@_jit
def _grouped_gemm_kernel(
    a_ptr, tile_ends_ptr, offsets_ptr, b_ptr, c_ptr, num_experts, inner, cols_total,
    stride_am, stride_be, stride_bk, stride_bn,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_E: tl.constexpr,
):  # fmt: skip
    """c[rows] = a[rows] @ b[e] for one tile of expert-sorted rows; b[e] is read through strides (transposes free)."""
    expert, rows, row_ok = _tile_rows(tile_ends_ptr, offsets_ptr, num_experts, BLOCK_M, BLOCK_E)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < cols_total
    b_base = b_ptr + expert.to(tl.int64) * stride_be
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, inner, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_ok = ks < inner
        a = tl.load(a_ptr + rows[:, None].to(tl.int64) * stride_am + ks[None, :],
                    mask=row_ok[:, None] & k_ok[None, :], other=0.0)  # fmt: skip
        b = tl.load(b_base + ks[:, None] * stride_bk + cols[None, :] * stride_bn, mask=k_ok[:, None] & col_ok[None, :],
                    other=0.0)  # fmt: skip
        acc = tl.dot(a, b, acc)
    tl.store(c_ptr + rows[:, None].to(tl.int64) * cols_total + cols[None, :], acc.to(c_ptr.dtype.element_ty),
             mask=row_ok[:, None] & col_ok[None, :])  # fmt: skip


@_jit
def _weight_grad_kernel(
    g_ptr, a_ptr, offsets_ptr, out_ptr, g_cols, a_cols, stride_gm, stride_am,
    BLOCK_M: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_A: tl.constexpr,
):  # fmt: skip
    """out[e] (G, A) = Σ over expert e's sorted rows of g[row]ᵀ a[row]; 0 for an expert without rows."""
    expert = tl.program_id(0)
    g_idx = tl.program_id(1) * BLOCK_G + tl.arange(0, BLOCK_G)
    a_idx = tl.program_id(2) * BLOCK_A + tl.arange(0, BLOCK_A)
    row_begin = tl.where(expert > 0, tl.load(offsets_ptr + tl.maximum(expert - 1, 0)), 0)
    row_end = tl.load(offsets_ptr + expert)
    acc = tl.zeros((BLOCK_G, BLOCK_A), dtype=tl.float32)
    for r0 in range(row_begin, row_end, BLOCK_M):
        rows = r0 + tl.arange(0, BLOCK_M)
        ok = rows < row_end
        g = tl.load(g_ptr + rows[None, :].to(tl.int64) * stride_gm + g_idx[:, None],
                    mask=ok[None, :] & (g_idx < g_cols)[:, None], other=0.0)  # fmt: skip
        a = tl.load(a_ptr + rows[:, None].to(tl.int64) * stride_am + a_idx[None, :],
                    mask=ok[:, None] & (a_idx < a_cols)[None, :], other=0.0)  # fmt: skip
        acc = tl.dot(g, a, acc)
    out = out_ptr + expert.to(tl.int64) * g_cols * a_cols + g_idx[:, None] * a_cols + a_idx[None, :]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=(g_idx < g_cols)[:, None] & (a_idx < a_cols)[None, :])


def _next_power_of_2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


class _Plan:
    """Tiles of BLOCK_M expert-sorted rows: `tile_ends` (E,) cumulative tile counts and a static grid bound."""

    def __init__(self, order, offsets, num_experts, block_m, block_n, block_k):
        counts = torch.diff(offsets.to(torch.int64), prepend=offsets.new_zeros(1))  # (E,) rows per expert
        self.tile_ends = torch.cumsum(torch.div(counts + block_m - 1, block_m, rounding_mode="floor"), 0).int()
        self.grid_tiles = -(-order.numel() // block_m) + num_experts  # static bound on Σ_e ceil(count_e / BLOCK_M)
        self.order, self.offsets, self.num_experts = order, offsets, num_experts
        self.blocks = dict(BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, BLOCK_E=_next_power_of_2(num_experts))

    def gemm(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        """(S, inner) sorted rows @ b[e] (E, inner, cols) per expert -> (S, cols), 0 past offsets[-1]."""
        inner, cols = b.shape[1:]
        out = torch.zeros(a.shape[0], cols, dtype=a.dtype, device=a.device)
        if a.shape[0]:
            grid = (self.grid_tiles, -(-cols // self.blocks["BLOCK_N"]))
            _grouped_gemm_kernel[grid](a, self.tile_ends, self.offsets, b, out, self.num_experts, inner, cols,
                                       a.stride(0), *b.stride(), **self.blocks)  # fmt: skip
        return out

    def weight_grad(self, g: torch.Tensor, a: torch.Tensor) -> torch.Tensor:
        """(S, G) and (S, A) sorted rows -> (E, G, A): per expert, Σ over its rows of g[row]ᵀ a[row]."""
        out = torch.empty(self.num_experts, g.shape[1], a.shape[1], dtype=torch.float32, device=a.device)
        block = self.blocks["BLOCK_N"]
        grid = (self.num_experts, -(-g.shape[1] // block), -(-a.shape[1] // block))
        _weight_grad_kernel[grid](g, a, self.offsets, out, g.shape[1], a.shape[1], g.stride(0), a.stride(0),
                                  BLOCK_M=self.blocks["BLOCK_M"], BLOCK_G=block, BLOCK_A=block)  # fmt: skip
        return out


class _TritonExperts(torch.autograd.Function):
    """slots (N·K, W) fp32 = each assignment's unweighted expert output (0 for dropped ones). The forward is the
    fused kernels; the backward recomputes gate/up with a grouped GEMM and runs grouped GEMMs and per-expert weight
    gradients as kernels, the SiLU derivative and the gathers in PyTorch."""

    @staticmethod
    def forward(ctx, hidden_states, gate_up_proj, down_proj, order, offsets, top_k, blocks):
        plan = _Plan(order, offsets, gate_up_proj.shape[0], *blocks)
        width, inter = hidden_states.shape[1], down_proj.shape[-1]
        x = hidden_states.to(gate_up_proj.dtype).contiguous()
        hidden = torch.empty(order.numel(), inter, dtype=x.dtype, device=x.device)  # (S, I) act(gate)·up, sorted
        slots = torch.zeros(order.numel(), width, dtype=torch.float32, device=x.device)  # (N·K, W)
        if order.numel():
            _gate_up_kernel[(plan.grid_tiles, -(-inter // blocks[1]))](
                x, order, plan.tile_ends, offsets, gate_up_proj, hidden, plan.num_experts, width, inter, top_k,
                x.stride(0), *gate_up_proj.stride(), **plan.blocks,
            )  # fmt: skip
            _down_scatter_kernel[(plan.grid_tiles, -(-width // blocks[1]))](
                hidden, order, plan.tile_ends, offsets, down_proj, slots, plan.num_experts, width, inter,
                *down_proj.stride(), **plan.blocks,
            )  # fmt: skip
        ctx.save_for_backward(hidden_states, gate_up_proj, down_proj, order, offsets)
        ctx.top_k, ctx.blocks = top_k, blocks
        return slots

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_slots):
        hidden_states, gate_up_proj, down_proj, order, offsets = ctx.saved_tensors
        plan = _Plan(order, offsets, gate_up_proj.shape[0], *ctx.blocks)
        dtype, inter = gate_up_proj.dtype, down_proj.shape[-1]
        rows = hidden_states.to(dtype).index_select(0, order // ctx.top_k)  # (S, W)
        gate, up = plan.gemm(rows, gate_up_proj.transpose(1, 2)).float().split(inter, dim=-1)  # (S, I) each
        act = torch.nn.functional.silu(gate)
        grad_rows_out = grad_slots.index_select(0, order).to(dtype)  # (S, W), d expert output in sorted order
        grad_hidden = plan.gemm(grad_rows_out, down_proj).float()  # (S, I)
        sig = torch.sigmoid(gate)
        grad_gate = grad_hidden * up * sig * (1 + gate * (1 - sig))  # silu'(g) = σ(g)(1 + g(1 - σ(g)))
        grad_gate_up = torch.cat([grad_gate, grad_hidden * act], dim=-1).to(dtype)  # (S, 2I)
        grad_down = plan.weight_grad(grad_rows_out, (act * up).to(dtype)).to(down_proj.dtype)  # (E, W, I)
        grad_gate_up_proj = plan.weight_grad(grad_gate_up, rows).to(gate_up_proj.dtype)  # (E, 2I, W)
        grad_sorted = plan.gemm(grad_gate_up, gate_up_proj).float()  # (S, W), 0 for dropped rows
        slot_pos = torch.empty_like(order).index_copy_(0, order, torch.arange(order.numel(), device=order.device))
        grad_x = grad_sorted.index_select(0, slot_pos).view(-1, ctx.top_k, grad_sorted.shape[1]).sum(1)
        return grad_x.to(hidden_states.dtype), grad_gate_up_proj, grad_down, None, None, None, None


def experts_forward(
    hidden_states: torch.Tensor,
    top_k_index: torch.Tensor,
    top_k_weights: torch.Tensor,
    gate_up_proj: torch.Tensor,
    down_proj: torch.Tensor,
    order: torch.Tensor,
    offsets: torch.Tensor,
    block_m: int = 16,
    block_n: int = 32,
    block_k: int = 32,
) -> torch.Tensor:
    """`experts_naive.experts_forward` (SiLU) with the kernels, differentiable in the rows, the routing weights and
    both expert weights. `order`, `offsets` from `sort_by_expert(top_k_index, E)`. Returns (N, W) in hidden_states'
    dtype; the K weighted slots of a row are summed in fp32 (one bmm, fixed order)."""
    if not HAS_TRITON:
        raise ImportError("the triton experts kernels need triton: `pip install triton`")
    if not hidden_states.is_cuda and not interpreting():
        raise ValueError("the triton experts kernels run on CUDA tensors (or under TRITON_INTERPRET=1)")
    num_rows, top_k = top_k_index.shape
    blocks = (block_m, block_n, block_k)
    slots = _TritonExperts.apply(hidden_states, gate_up_proj, down_proj, order, offsets, top_k, blocks)
    slots = slots.view(num_rows, top_k, -1)  # (N, K, W) fp32
    out = torch.bmm(top_k_weights.float().unsqueeze(1), slots).squeeze(1)  # (N, W): Σ_k weight·slot
    return out.to(hidden_states.dtype)


def triton_experts_forward(self, hidden_states, top_k_index, top_k_weights):
    """A Transformers experts function (`self` has num_experts, gate_up_proj, down_proj, act_fn): register it with
    `ExpertsInterface.register("mhmoe_triton", triton_experts_forward)` and choose it with
    `experts_implementation="mhmoe_triton"`. SiLU experts only."""
    act = getattr(self, "act_fn", None)
    if not (isinstance(act, torch.nn.SiLU) or type(act).__name__ == "SiLUActivation"):
        raise ValueError(f"the triton experts kernels implement SiLU experts only, got {type(act).__name__}")
    order, offsets = sort_by_expert(top_k_index, self.num_experts)
    return experts_forward(hidden_states, top_k_index, top_k_weights, self.gate_up_proj, self.down_proj, order,
                           offsets)  # fmt: skip
