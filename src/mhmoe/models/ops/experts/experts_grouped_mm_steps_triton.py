"""The grouped_mm experts' steps between and after the GEMMs, fused for CUDA (`experts_grouped_mm.py` uses them on
CUDA tensors with SiLU; its PyTorch code is the reference they are tested against, under TRITON_INTERPRET=1).

Why: on an H200 (benchmarks/results/gpu_moe-nvidia-h200-939cae8, the h=3 block's fwd+bwd at 32K tokens) these steps
took most of the block's GPU time: PyTorch's silu and mul on the strided gate and up halves of the (S, 2I) gate/up
buffer run its generic (non-vectorised) elementwise kernel (~3.5 ms of 11.5), and the routing weights' products went
through batched GEMMs of 1×3 and 1×I operands (`bmm`, ~1.2 ms). Each kernel here reads and writes every element once.

Shape legend (as in experts_grouped_mm.py): S assignments in expert order, I = moe_intermediate_size, N routed rows,
K = num_experts_per_tok, W row width.
- `swiglu`: (S, 2I) gate/up -> (S, I) silu(gate)·up, into any (S, I) view (the gate half itself included).
- `swiglu_backward`: from gate/up and d(silu(gate)·up) (S, I) unweighted, and the assignments' routing weights (S,):
  d gate/up (S, 2I) weighted (may be written over gate/up itself), weight·silu(gate)·up (S, I) recomputed for the down
  projection's weight gradient (the weight folded in here, so d expert output stays unweighted), and
  <d(silu(gate)·up), silu(gate)·up> (S,) fp32, the routing weights' gradient.
- `combine_slots`: out[n] = Σ_k weight[n, k] · rows[slot_pos[n·K + k]] in slot order, fp32 accumulation, dropped slots 0
  (never read); without weights, the plain sum (the input gradient's gather over each row's K slots).
All arithmetic in fp32, stored in the tensors' dtype. Imports without triton: the kernels stay plain functions.
"""

import torch

from ..triton_compat import HAS_TRITON, tl, triton  # noqa: F401  (HAS_TRITON: re-exported)
from ..triton_compat import jit as _jit


@_jit
def _swiglu_kernel(
    gate_up_ptr, out_ptr, rows, inter, stride_gu, stride_out, BLOCK_S: tl.constexpr, BLOCK_I: tl.constexpr
):
    r = tl.program_id(0) * BLOCK_S + tl.arange(0, BLOCK_S)
    c = tl.program_id(1) * BLOCK_I + tl.arange(0, BLOCK_I)
    mask = (r < rows)[:, None] & (c < inter)[None, :]
    src = gate_up_ptr + r[:, None].to(tl.int64) * stride_gu + c[None, :]
    gate = tl.load(src, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(src + inter, mask=mask, other=0.0).to(tl.float32)
    hidden = gate * tl.sigmoid(gate) * up
    tl.store(
        out_ptr + r[:, None].to(tl.int64) * stride_out + c[None, :], hidden.to(out_ptr.dtype.element_ty), mask=mask
    )


@_jit
def _swiglu_backward_kernel(
    gate_up_ptr,
    grad_hidden_ptr,
    weights_ptr,
    grad_gate_up_ptr,
    hidden_ptr,
    dot_ptr,
    rows,
    inter,
    stride_gu,
    WRITE_GRAD: tl.constexpr,
    WRITE_HIDDEN: tl.constexpr,
    WRITE_DOT: tl.constexpr,
    BLOCK_S: tl.constexpr,
    BLOCK_I: tl.constexpr,
):
    """Rows of BLOCK_S assignments, their I columns in BLOCK_I chunks (the dot product needs the whole row)."""
    r = tl.program_id(0) * BLOCK_S + tl.arange(0, BLOCK_S)
    row_ok = r < rows
    weight = tl.load(weights_ptr + r, mask=row_ok, other=0.0).to(tl.float32)
    dot = tl.zeros((BLOCK_S,), dtype=tl.float32)
    start = 0
    while start < inter:  # `while`: Triton 3.6's interpreter takes no range() bound from an argument
        c = start + tl.arange(0, BLOCK_I)
        mask = row_ok[:, None] & (c < inter)[None, :]
        gu = r[:, None].to(tl.int64) * stride_gu + c[None, :]
        dense = r[:, None].to(tl.int64) * inter + c[None, :]
        gate = tl.load(gate_up_ptr + gu, mask=mask, other=0.0).to(tl.float32)
        up = tl.load(gate_up_ptr + gu + inter, mask=mask, other=0.0).to(tl.float32)
        grad = tl.load(grad_hidden_ptr + dense, mask=mask, other=0.0).to(tl.float32)  # unweighted
        sig = tl.sigmoid(gate)
        act = gate * sig
        if WRITE_DOT or WRITE_HIDDEN:
            hidden = act * up
            if WRITE_DOT:
                dot += tl.sum(grad * hidden, axis=1)
            if WRITE_HIDDEN:  # weighted: what the down projection's weight gradient takes (d out unweighted)
                tl.store(hidden_ptr + dense, (hidden * weight[:, None]).to(hidden_ptr.dtype.element_ty), mask=mask)
        if WRITE_GRAD:  # same elements as read above, by this program only: may overwrite gate/up
            grad = grad * weight[:, None]
            grad_gate = grad * up * sig * (1.0 + gate * (1.0 - sig))
            tl.store(grad_gate_up_ptr + gu, grad_gate.to(grad_gate_up_ptr.dtype.element_ty), mask=mask)
            tl.store(grad_gate_up_ptr + gu + inter, (grad * act).to(grad_gate_up_ptr.dtype.element_ty), mask=mask)
        start += BLOCK_I
    if WRITE_DOT:
        tl.store(dot_ptr + r, dot, mask=row_ok)


@_jit
def _combine_kernel(
    rows_ptr,
    slot_pos_ptr,
    dropped_ptr,
    weights_ptr,
    out_ptr,
    num_rows,
    width,
    stride_rows,
    TOP_K: tl.constexpr,
    WEIGHTED: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_W: tl.constexpr,
):
    n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    c = tl.program_id(1) * BLOCK_W + tl.arange(0, BLOCK_W)
    n_ok = n < num_rows
    c_ok = c < width
    acc = tl.zeros((BLOCK_N, BLOCK_W), dtype=tl.float32)
    for k in range(TOP_K):  # slot order: the same sum every run
        slot = n.to(tl.int64) * TOP_K + k
        kept = n_ok & (tl.load(dropped_ptr + slot, mask=n_ok, other=1) == 0)
        pos = tl.load(slot_pos_ptr + slot, mask=kept, other=0)
        row = tl.load(rows_ptr + pos[:, None] * stride_rows + c[None, :], mask=kept[:, None] & c_ok[None, :], other=0.0)
        if WEIGHTED:
            row = row.to(tl.float32) * tl.load(weights_ptr + slot, mask=kept, other=0.0).to(tl.float32)[:, None]
        acc += row.to(tl.float32)
    out = out_ptr + n[:, None].to(tl.int64) * width + c[None, :]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=n_ok[:, None] & c_ok[None, :])


def _block(width: int, cap: int = 128) -> int:
    return max(16, min(cap, triton.next_power_of_2(width)))


def swiglu(gate_up: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """(S, 2I) -> (S, I) silu(gate)·up, into `out` (any (S, I) view with unit column stride, gate_up's gate half
    included) or a new contiguous tensor."""
    rows, inter = gate_up.shape[0], gate_up.shape[1] // 2
    if out is None:
        out = gate_up.new_empty(rows, inter)
    if rows and inter:
        block_i = _block(inter)
        block_s = max(1, 4096 // block_i)
        grid = (triton.cdiv(rows, block_s), triton.cdiv(inter, block_i))
        _swiglu_kernel[grid](
            gate_up, out, rows, inter, gate_up.stride(0), out.stride(0), BLOCK_S=block_s, BLOCK_I=block_i
        )
    return out


def swiglu_backward(
    gate_up: torch.Tensor,
    grad_hidden: torch.Tensor,
    weights: torch.Tensor,
    grad_gate_up: torch.Tensor | None,
    hidden: torch.Tensor | None,
    dot: torch.Tensor | None,
) -> None:
    """Writes whichever of `grad_gate_up` (S, 2I: may be `gate_up` itself), `hidden` (S, I: weight·act·up) and `dot`
    (S,) fp32 is given; `grad_hidden` (S, I) contiguous and unweighted, `weights` (S,) the assignments' routing
    weights."""
    rows, inter = grad_hidden.shape
    if not rows or not inter:
        if dot is not None:
            dot.zero_()
        return
    block_i = _block(inter)
    block_s = max(1, 2048 // block_i)
    dummy = grad_hidden  # pointers of outputs not written are never read
    _swiglu_backward_kernel[(triton.cdiv(rows, block_s),)](
        gate_up,
        grad_hidden,
        weights,
        dummy if grad_gate_up is None else grad_gate_up,
        dummy if hidden is None else hidden,
        dummy if dot is None else dot,
        rows,
        inter,
        gate_up.stride(0),
        WRITE_GRAD=grad_gate_up is not None,
        WRITE_HIDDEN=hidden is not None,
        WRITE_DOT=dot is not None,
        BLOCK_S=block_s,
        BLOCK_I=block_i,
    )


def combine_slots(
    rows: torch.Tensor,
    slot_pos: torch.Tensor,
    dropped: torch.Tensor,
    weights: torch.Tensor | None,
    top_k: int,
    dtype: torch.dtype,
) -> torch.Tensor:
    """(S_kept, W) rows in expert order -> (N, W) in `dtype`: each row's K slots (slot_pos (N·K,), dropped (N·K,)
    bool), times `weights` (N, K) when given, summed in slot order in fp32."""
    num_slots, width = slot_pos.shape[0], rows.shape[1]
    num_rows = num_slots // top_k
    out = torch.empty(num_rows, width, dtype=dtype, device=rows.device)
    if not num_rows or not width:
        return out
    block_w = _block(width)
    block_n = max(1, 2048 // block_w)
    grid = (triton.cdiv(num_rows, block_n), triton.cdiv(width, block_w))
    _combine_kernel[grid](
        rows,
        slot_pos,
        dropped.view(torch.uint8),
        rows if weights is None else weights.reshape(-1),
        out,
        num_rows,
        width,
        rows.stride(0),
        TOP_K=top_k,
        WEIGHTED=weights is not None,
        BLOCK_N=block_n,
        BLOCK_W=block_w,
    )
    return out
