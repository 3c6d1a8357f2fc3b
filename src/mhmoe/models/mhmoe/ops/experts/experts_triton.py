"""Experts in Triton, forward only (scattermoe-style): gather -> grouped GEMM with act(gate)·up fused -> grouped GEMM
with the routing weight fused, written straight to each assignment's slot -> the K slots of a row summed.

Two launches over tiles of BLOCK_M expert-sorted rows (a tile never spans two experts; tile -> expert is found in the
kernel from the cumulative tile counts, so the grid has a static size, S/BLOCK_M + E, and nothing syncs with the host).
No padded copies of the rows and no (S, 2I) gate/up buffer: only act(gate)·up (S, I) goes through memory. Each slot
is written once (no atomics) and the K slots are summed in a fixed order: deterministic. Dropped assignments (id E)
sort last, fall in no tile, and their slots stay 0.

Status: forward only, SiLU only; fp32 inputs use TF32 in `tl.dot` on a GPU. Tested against `experts_naive.py` under
TRITON_INTERPRET=1 (fp32); never run on a GPU here and not used by the model (no `experts_implementation` selects
it). A backward (the weight gradients as grouped GEMMs over the same tiles, the input gradient through the same
gather) is still to be written.

Imports without triton (exported checkpoints): the kernels are then plain functions, never launched.
"""

import os
import types

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # torch-only install
    triton = None
    tl = types.SimpleNamespace(constexpr=int)

HAS_TRITON = triton is not None


def _jit(fn):
    return triton.jit(fn) if HAS_TRITON else fn


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
    h_ptr, order_ptr, tile_ends_ptr, offsets_ptr, w_ptr, weights_ptr, slots_ptr, num_experts, width, inter,
    stride_we, stride_wo, stride_wi,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_E: tl.constexpr,
):  # fmt: skip
    """slots[order[rows], cols] = weight · (h[rows] @ down[e]ᵀ)[:, cols]: each assignment's weighted expert output."""
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
    weight = tl.load(weights_ptr + slot, mask=row_ok, other=0.0).to(tl.float32)
    tl.store(slots_ptr + slot[:, None].to(tl.int64) * width + cols[None, :], acc * weight[:, None],
             mask=row_ok[:, None] & col_ok[None, :])  # fmt: skip


def _next_power_of_2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


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
    """`experts_naive.experts_forward` (SiLU) with the kernels, no autograd. `order`, `offsets` from
    `routing.sort_by_expert(top_k_index, E)`. Returns (N, W) in hidden_states' dtype (fp32 accumulation)."""
    if not HAS_TRITON:
        raise ImportError("the triton experts kernels need triton: `pip install triton`")
    if not hidden_states.is_cuda and os.environ.get("TRITON_INTERPRET", "0") != "1":
        raise ValueError("the triton experts kernels run on CUDA tensors (or under TRITON_INTERPRET=1)")
    inputs = (hidden_states, top_k_weights, gate_up_proj, down_proj)
    if torch.is_grad_enabled() and any(t.requires_grad for t in inputs):
        raise NotImplementedError("the triton experts kernels have no backward yet: use them under torch.no_grad()")
    num_rows, top_k = top_k_index.shape
    num_experts, _, width = gate_up_proj.shape
    inter = down_proj.shape[-1]
    x = hidden_states.to(gate_up_proj.dtype).contiguous()
    counts = torch.diff(offsets.to(torch.int64), prepend=offsets.new_zeros(1))  # (E,) rows per expert
    tiles = torch.div(counts + block_m - 1, block_m, rounding_mode="floor")
    tile_ends = torch.cumsum(tiles, 0).to(torch.int32)  # (E,)
    grid_tiles = -(-order.numel() // block_m) + num_experts  # static bound on Σ_e ceil(count_e / BLOCK_M)
    hidden = torch.empty(order.numel(), inter, dtype=x.dtype, device=x.device)  # (S, I) act(gate)·up, sorted
    slots = torch.zeros(num_rows * top_k, width, dtype=torch.float32, device=x.device)  # weighted, (row, slot)
    weights = top_k_weights.reshape(-1).float().contiguous()
    blocks = dict(BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, BLOCK_E=_next_power_of_2(num_experts))
    if order.numel():
        _gate_up_kernel[(grid_tiles, -(-inter // block_n))](
            x, order, tile_ends, offsets, gate_up_proj, hidden, num_experts, width, inter, top_k, x.stride(0),
            *gate_up_proj.stride(), **blocks,
        )  # fmt: skip
        _down_scatter_kernel[(grid_tiles, -(-width // block_n))](
            hidden, order, tile_ends, offsets, down_proj, weights, slots, num_experts, width, inter,
            *down_proj.stride(), **blocks,
        )  # fmt: skip
    return slots.view(num_rows, top_k, width).sum(dim=1).to(hidden_states.dtype)
