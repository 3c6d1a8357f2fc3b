"""Grouped GEMM over row groups (one group per expert), the primitive of the experts' grouped_mm path and of BitNet's
quantised experts: torch's grouped GEMM kernel where it takes the operands, else a tiled batched matmul (CUDA, no host
sync) or one matmul per group (CPU).

Shape legend: S rows sorted by group, E groups (experts), in/out the matrix widths; `offsets` (E,) int32 are the
groups' cumulative ends, the layout `torch._grouped_mm` takes.
"""

import torch

TORCH_GROUPED_MM = getattr(torch.nn.functional, "grouped_mm", None) or getattr(torch, "_grouped_mm", None)


def kernel_accepts(*tensors: torch.Tensor) -> bool:
    """Whether torch's grouped GEMM kernel takes these operands.

    It wants 16-byte aligned data and strides (odd widths such as W=5 fail), fp32/bf16/fp16 on CPU, bf16 on CUDA
    SM80+.
    """
    if TORCH_GROUPED_MM is None:
        return False
    for t in tensors:
        if t.dtype not in (torch.float32, torch.bfloat16, torch.float16):
            return False
        if t.is_cuda and (t.dtype != torch.bfloat16 or torch.cuda.get_device_capability(t.device) < (8, 0)):
            return False
        size = t.element_size()
        if t.data_ptr() % 16 or any(stride != 1 and stride * size % 16 for stride in t.stride()):
            return False
    return True


def grouped_mm_path(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor | None = None) -> str:
    """Which implementation `grouped_mm` runs for these operands (after `a` is cast to `b`'s dtype):

    - "kernel": torch's grouped GEMM (where `kernel_accepts` them: bf16 on CUDA SM80+; fp32/bf16/fp16 on CPU);
    - "tiled": on CUDA for anything else (fp32, so TF32 when enabled): groups cut into tiles of `GROUPED_MM_TILE`
      rows, one batched matmul over the tiles; no host sync (shapes bound by S/tile + E, not by the routing);
    - "loop": one matmul per non-empty group (reads the offsets on the host): CPU operands the kernel refuses, or an
      `out` buffer given (torch's kernel cannot write into one; only the CPU buffer pool passes one).
    """
    return choose_grouped_mm_path(a.device.type, out is None and kernel_accepts(a, b), out is not None)


def choose_grouped_mm_path(device_type: str, kernel_takes_them: bool, into_buffer: bool) -> str:
    """The rule of `grouped_mm_path`, on plain facts: never the host-syncing loop on CUDA."""
    if kernel_takes_them and not into_buffer:
        return "kernel"
    if device_type == "cuda" and not into_buffer:
        return "tiled"
    return "loop"


GROUPED_MM_TILE = 128  # rows per tile of the "tiled" path


def grouped_mm(
    a: torch.Tensor, b: torch.Tensor, offsets: torch.Tensor, out: torch.Tensor | None = None, path: str | None = None
) -> torch.Tensor:
    """Grouped GEMM over row groups ending at `offsets` (E,) int32.

    a (S, in) @ b (E, in, out) -> (S, out): rows of group e times b[e]. Rows from offsets[-1] on are not computed
        (torch's kernel leaves them uninitialised; callers pass only kept rows).
    a (in, S) @ b (S, out) -> (E, in, out): per group e, a[:, group] @ b[group] (a weight gradient); 0 for an
        empty group.
    `path` (default `grouped_mm_path`): torch's kernel where it takes the operands (any strides that are 16-byte
    multiples, so transposed views of the 3-D expert weights go in without a copy); on CUDA otherwise the tiled batched
    matmul (no host sync); on CPU otherwise, or when `out` (S, out) is given, one matmul per non-empty group.
    """
    if a.dtype != b.dtype:
        a = a.to(b.dtype)
    path = path or grouped_mm_path(a, b, out)
    if path == "kernel":
        return TORCH_GROUPED_MM(a, b, offs=offsets)
    if path == "tiled":
        return tiled_grouped_mm(a, b, offsets, GROUPED_MM_TILE)
    ends = offsets.tolist()
    starts = [0] + ends[:-1]
    if b.dim() == 3:
        out = a.new_zeros(a.shape[0], b.shape[-1]) if out is None else out
        for expert, (start, end) in enumerate(zip(starts, ends)):
            if end > start:
                torch.mm(a[start:end], b[expert], out=out[start:end])
        return out
    out = a.new_zeros(len(ends), a.shape[0], b.shape[-1])
    for expert, (start, end) in enumerate(zip(starts, ends)):
        if end > start:
            torch.mm(a[:, start:end], b[start:end], out=out[expert])
    return out


def _tiles(offsets: torch.Tensor, num_rows: int, tile: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Each group's rows cut into tiles of `tile` rows, on the device, with a static number of tiles T = S // tile + E
    (an upper bound of Σ ceil(count_e / tile)): (expert of each tile (T,), E past the used tiles; row of each tile slot
    (T, tile); whether that slot is a real row (T, tile))."""
    num_experts = offsets.shape[0]
    ends = offsets.long()
    starts = torch.cat([ends.new_zeros(1), ends[:-1]])
    tiles_per_group = (ends - starts + tile - 1) // tile  # (E,)
    tile_ends = torch.cumsum(tiles_per_group, 0)  # (E,)
    num_tiles = num_rows // tile + num_experts
    index = torch.arange(num_tiles, device=offsets.device)
    expert = torch.searchsorted(tile_ends, index, right=True)  # (T,) E for unused tiles
    safe = expert.clamp(max=num_experts - 1)
    first_tile = tile_ends.index_select(0, safe) - tiles_per_group.index_select(0, safe)
    row_start = starts.index_select(0, safe) + (index - first_tile) * tile  # (T,)
    rows = row_start[:, None] + torch.arange(tile, device=offsets.device)  # (T, tile)
    valid = (rows < ends.index_select(0, safe)[:, None]) & (expert < num_experts)[:, None]
    return expert, rows.masked_fill(~valid, 0), valid


def tiled_grouped_mm(a: torch.Tensor, b: torch.Tensor, offsets: torch.Tensor, tile: int) -> torch.Tensor:
    """`grouped_mm` as batched matmuls over tiles of rows (`_tiles`): shapes never depend on the routing, so nothing
    waits for the device. Costs up to E·tile padded rows and a (T, in, out) gather of the weights per call."""
    num_experts = offsets.shape[0]
    if b.dim() == 3:  # (S, in) @ (E, in, out)
        num_rows = a.shape[0]
        expert, rows, valid = _tiles(offsets, num_rows, tile)
        lhs = a.index_select(0, rows.reshape(-1)).view(*rows.shape, a.shape[1]) * valid[..., None]  # (T, tile, in)
        weights = b.index_select(0, expert.clamp(max=num_experts - 1))  # (T, in, out)
        products = torch.bmm(lhs, weights)  # (T, tile, out)
        target = rows.masked_fill(~valid, num_rows).reshape(-1)  # padded slots land on a spare row
        out = a.new_zeros(num_rows + 1, b.shape[-1])
        out.index_copy_(0, target, products.reshape(-1, b.shape[-1]))
        return out[:num_rows]
    num_rows = a.shape[1]  # (in, S) @ (S, out) -> (E, in, out)
    expert, rows, valid = _tiles(offsets, num_rows, tile)
    flat = rows.reshape(-1)
    lhs = (a.t().index_select(0, flat).view(*rows.shape, a.shape[0]) * valid[..., None]).transpose(1, 2)
    rhs = b.index_select(0, flat).view(*rows.shape, b.shape[1]) * valid[..., None]  # (T, tile, out)
    per_tile = torch.bmm(lhs, rhs)  # (T, in, out)
    out = a.new_zeros(num_experts + 1, a.shape[0], b.shape[1])
    out.index_add_(0, expert, per_tile)
    return out[:num_experts]


def autocast_dtype(device: torch.device) -> torch.dtype | None:
    """The dtype autocast computes matmuls in on `device`'s type right now, or None outside autocast."""
    device_type = device.type if device.type in ("cuda", "cpu", "xpu", "mps") else None
    if device_type is None or not torch.is_autocast_enabled(device_type):
        return None
    return torch.get_autocast_dtype(device_type)


def traced_grouped_mm(a: torch.Tensor, b: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """`grouped_mm` for traced graphs: torch's kernel where its fake kernel traces (bf16), else the opaque
    `mhmoe::grouped_mm` op (the same eager code, seen by the compiler as one call with static shapes)."""
    a = a.to(b.dtype)
    if TORCH_GROUPED_MM is not None and b.dtype == torch.bfloat16 and (not b.is_cuda or kernel_accepts(b)):
        return TORCH_GROUPED_MM(a, b, offs=offsets)
    return torch.ops.mhmoe.grouped_mm(a, b, offsets)


def _grouped_mm_op(a: torch.Tensor, b: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    return grouped_mm(a, b, offsets)  # always a new tensor, as a custom op must return


def _grouped_mm_backward_op(
    a: torch.Tensor, b: torch.Tensor, offsets: torch.Tensor, grad: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    return grouped_mm(grad, b.transpose(1, 2), offsets), grouped_mm(a.t(), grad, offsets)


def _register_grouped_mm_op() -> None:
    """`torch.ops.mhmoe.grouped_mm(a (S, in), b (E, in, out), offsets (E,)) -> (S, out)` with its backward, opaque
    to the compiler (it cannot trace the per-group loop). Registered once per process: an exported checkpoint's copy
    of this file finds the op already there."""
    if hasattr(torch.ops.mhmoe, "grouped_mm"):
        return
    forward = torch.library.custom_op("mhmoe::grouped_mm", _grouped_mm_op, mutates_args=())
    backward = torch.library.custom_op("mhmoe::grouped_mm_backward", _grouped_mm_backward_op, mutates_args=())

    @forward.register_fake
    def _(a, b, offsets):
        return a.new_empty(a.shape[0], b.shape[-1])

    @backward.register_fake
    def _(a, b, offsets, grad):
        return torch.empty_like(a), b.new_empty(b.shape)

    def setup_context(ctx, inputs, output):
        ctx.save_for_backward(*inputs)

    def grad_fn(ctx, grad):
        a, b, offsets = ctx.saved_tensors
        grad_a, grad_b = torch.ops.mhmoe.grouped_mm_backward(a, b, offsets, grad)
        return grad_a, grad_b, None

    forward.register_autograd(grad_fn, setup_context=setup_context)


_register_grouped_mm_op()
