"""Expert computation for MHMoE (the router losses are in losses.py).

Shape legend: N routed rows (tokens × moe_heads sub-tokens), W row width (hidden_size // moe_heads), E experts,
K = num_experts_per_tok, S = N·K assignments, I = moe_intermediate_size. Expert weights are 3-D like Transformers'
v5 MoE models: `gate_up_proj` (E, 2I, W) and `down_proj` (E, W, I). Expert id E marks a dropped assignment.
"""

import contextlib
import functools
import os
import threading

import torch
import torch.nn.functional as F
from transformers.integrations.moe import ExpertsInterface
from transformers.integrations.moe import grouped_mm_experts_forward as _TRANSFORMERS_GROUPED_MM

from .routing import sort_by_expert


_GROUPED_MM = getattr(torch.nn.functional, "grouped_mm", None) or getattr(torch, "_grouped_mm", None)


def _kernel_accepts(*tensors: torch.Tensor) -> bool:
    """Whether torch's grouped GEMM kernel takes these operands.

    It wants 16-byte aligned data and strides (odd widths such as W=5 fail), fp32/bf16/fp16 on CPU, bf16 on CUDA
    SM80+.
    """
    if _GROUPED_MM is None:
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
    """Which implementation `_grouped_mm` runs for these operands (after `a` is cast to `b`'s dtype):

    - "kernel": torch's grouped GEMM (where `_kernel_accepts` them: bf16 on CUDA SM80+; fp32/bf16/fp16 on CPU);
    - "tiled": on CUDA for anything else (fp32, so TF32 when enabled): groups cut into tiles of `GROUPED_MM_TILE`
      rows, one batched matmul over the tiles; no host sync (shapes bound by S/tile + E, not by the routing);
    - "loop": one matmul per non-empty group (reads the offsets on the host): CPU operands the kernel refuses, or an
      `out` buffer given (torch's kernel cannot write into one; only the CPU buffer pool passes one).
    """
    return choose_grouped_mm_path(a.device.type, out is None and _kernel_accepts(a, b), out is not None)


def choose_grouped_mm_path(device_type: str, kernel_takes_them: bool, into_buffer: bool) -> str:
    """The rule of `grouped_mm_path`, on plain facts: never the host-syncing loop on CUDA."""
    if kernel_takes_them and not into_buffer:
        return "kernel"
    if device_type == "cuda" and not into_buffer:
        return "tiled"
    return "loop"


GROUPED_MM_TILE = 128  # rows per tile of the "tiled" path


def _grouped_mm(
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
        return _GROUPED_MM(a, b, offs=offsets)
    if path == "tiled":
        return _tiled_grouped_mm(a, b, offsets, GROUPED_MM_TILE)
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


def _tiled_grouped_mm(a: torch.Tensor, b: torch.Tensor, offsets: torch.Tensor, tile: int) -> torch.Tensor:
    """`_grouped_mm` as batched matmuls over tiles of rows (`_tiles`): shapes never depend on the routing, so nothing
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


class BufferPool:
    """Large CPU buffers of the expert computation, kept from one step to the next.

    glibc serves every allocation above 32 MiB with a fresh `mmap`, and each first touch of a 4 KiB page faults: for
    fine-grained experts the (S, 2I) gate/up and (S, I) buffers are that large (75 and 38 MB for the paper's h=3
    block at 2048 tokens) and faulting them in costs as much as a third of their GEMM (benchmarks/README.md). Buffers
    come back after the backward that frees the graph (or at the end of a no-grad forward) and are handed out again,
    best fit first. At most `max_bytes` are kept (env `MHMOE_CPU_BUFFER_POOL_MB`, default 2048; 0 turns the pool
    off); `clear()` releases them. Only buffers of at least `min_bytes` on CPU are pooled: smaller ones are recycled by
    the allocator anyway, and on GPUs torch's caching allocator already does this.
    """

    def __init__(self, max_bytes: int, min_bytes: int = 16 * 2**20):
        self.max_bytes, self.min_bytes = max_bytes, min_bytes
        self._free: list[torch.Tensor] = []  # flat buffers, oldest first
        self._lock = threading.Lock()

    def take(self, rows: int, cols: int, like: torch.Tensor) -> torch.Tensor | None:
        """An uninitialised (rows, cols) buffer of `like`'s dtype, or None when this size is not pooled."""
        numel = rows * cols
        if not self.max_bytes or like.device.type != "cpu" or numel * like.element_size() < self.min_bytes:
            return None
        if torch.compiler.is_compiling():  # a traced graph allocates for itself
            return None
        with self._lock:
            fits = [i for i, buf in enumerate(self._free) if buf.dtype == like.dtype and buf.numel() >= numel]
            if fits:
                best = min(fits, key=lambda i: self._free[i].numel())
                return self._free.pop(best)[:numel].view(rows, cols)
        return like.new_empty(rows, cols)

    def give(self, *tensors: torch.Tensor | None) -> None:
        """Return buffers nobody reads any more (views of a pooled buffer return the whole buffer)."""
        if torch.compiler.is_compiling():
            return
        with self._lock:
            for tensor in tensors:
                if tensor is None:
                    continue
                base = tensor if tensor._base is None else tensor._base
                if base.is_inference():  # made under torch.inference_mode(): no use outside it
                    continue
                if base.device.type == "cpu" and base.is_contiguous() and self._nbytes(base) >= self.min_bytes:
                    if all(buf.data_ptr() != base.data_ptr() for buf in self._free):
                        self._free.append(base.view(-1))
            while self._free and self.nbytes > self.max_bytes:  # oldest out first
                self._free.pop(0)

    def clear(self) -> None:
        with self._lock:
            self._free.clear()

    @property
    def nbytes(self) -> int:
        return sum(map(self._nbytes, self._free))

    @staticmethod
    def _nbytes(tensor: torch.Tensor) -> int:
        return tensor.numel() * tensor.element_size()


BUFFER_POOL = BufferPool(int(os.environ.get("MHMOE_CPU_BUFFER_POOL_MB", "2048")) * 2**20)


def _is_silu(act_fn) -> bool:
    return isinstance(act_fn, torch.nn.SiLU) or type(act_fn).__name__ == "SiLUActivation"


def _activation(act_fn, gate: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """act_fn(gate), into `out` when given (a buffer the caller no longer needs; may alias nothing but `out`)."""
    if _is_silu(act_fn):
        return torch.ops.aten.silu(gate) if out is None else torch.ops.aten.silu.out(gate, out=out)
    act = act_fn(gate)
    return act if out is None else out.copy_(act)


def _activation_backward(act_fn, gate: torch.Tensor, grad: torch.Tensor, out: torch.Tensor) -> None:
    """out = grad · act_fn'(gate); `out` may be `gate` itself (elementwise, same positions)."""
    if _is_silu(act_fn):
        torch.ops.aten.silu_backward.grad_input(grad, gate, grad_input=out)
        return
    with torch.enable_grad():
        leaf = gate.detach().requires_grad_()
        (grad_gate,) = torch.autograd.grad(act_fn(leaf), leaf, grad)
    out.copy_(grad_gate)


def _may_overwrite_saved_tensors() -> bool:
    """True inside a backward that frees the graph afterwards (no retain_graph / create_graph).

    Only then may a backward write into the tensors its forward saved: a second backward through the same graph would
    read them. Without the (private) query, answer False: always safe, only slower.
    """
    keep_graph = getattr(torch._C._autograd, "_get_current_graph_task_keep_graph", None)
    try:
        return keep_graph is not None and not keep_graph()
    except RuntimeError:  # not inside a backward
        return False


def _select_rows(x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """x.index_select(0, index), into a pooled buffer when the result is large."""
    buffer = BUFFER_POOL.take(index.shape[0], x.shape[1], x)
    return x.index_select(0, index) if buffer is None else torch.index_select(x, 0, index, out=buffer)


def _gather_slots(sorted_rows: torch.Tensor, slot_pos: torch.Tensor, dropped: torch.Tensor | None) -> torch.Tensor:
    """(S_kept, W) rows in expert order -> (N·K, W) rows in (row, slot) order; dropped slots are 0."""
    if sorted_rows.shape[0] == 0:  # every assignment dropped
        return sorted_rows.new_zeros(slot_pos.shape[0], sorted_rows.shape[1])
    slots = _select_rows(sorted_rows, slot_pos)
    if dropped is not None:
        slots.masked_fill_(dropped[:, None], 0.0)
    return slots


def _accumulation_dtype(*tensors: torch.Tensor) -> torch.dtype:
    """fp32 for low-precision inputs, else the widest input dtype."""
    dtype = torch.float32
    for t in tensors:
        dtype = torch.promote_types(dtype, t.dtype)
    return dtype


def _sum_slots(slots: torch.Tensor, top_k: int) -> torch.Tensor:
    """(N·K, W) -> (N, W): each row's K slots summed in slot order (deterministic)."""
    return slots.view(-1, top_k, slots.shape[-1]).sum(dim=1) if top_k > 1 else slots


def _experts_forward(
    hidden_states, top_k_weights, gate_up_proj, down_proj, act_fn, order, offsets, slot_pos, dropped, for_backward
):
    """The forward computation; returns (N, W) output and, `for_backward`, the tensors the backward needs.

    Without a backward to come, act(gate)·up is computed in place in gate_up's gate half (no (S, I) allocation).
    """
    top_k = top_k_weights.shape[-1]
    inter = down_proj.shape[-1]
    source_rows = order // top_k  # (S_kept,) the routed row of each sorted assignment

    rows = _select_rows(hidden_states, source_rows).to(gate_up_proj.dtype)  # (S_kept, W)
    num_kept = rows.shape[0]
    buffer = BUFFER_POOL.take(num_kept, 2 * inter, rows)
    gate_up = _grouped_mm(rows, gate_up_proj.transpose(1, 2), offsets, out=buffer)  # (S_kept, 2I)
    gate, up = gate_up[:, :inter], gate_up[:, inter:]
    if for_backward:  # gate and up are kept: act(gate)·up goes to a new buffer; act itself is recomputed later
        hidden = _activation(act_fn, gate, out=BUFFER_POOL.take(num_kept, inter, rows))
        hidden = hidden.mul_(up) if hidden.data_ptr() != gate.data_ptr() else hidden * up  # (S_kept, I)
    else:
        hidden = _activation(act_fn, gate, out=gate).mul_(up)  # (S_kept, I) view, row stride 2I
    expert_out = _grouped_mm(
        hidden, down_proj.transpose(1, 2), offsets, out=BUFFER_POOL.take(num_kept, rows.shape[1], rows)
    )  # (S_kept, W)
    if not for_backward:
        BUFFER_POOL.give(buffer, rows)  # dead: act(gate)·up and the rows have been read
    elif rows.data_ptr() != hidden_states.data_ptr():
        # not kept for the backward, which gathers the rows again and recomputes act(gate)·up: of the (S, W + 3I)
        # per-assignment intermediates only gate_up (S, 2I) stays alive until the backward
        BUFFER_POOL.give(rows, hidden)

    slots = _gather_slots(expert_out, slot_pos, dropped).view(top_k_weights.shape[0], top_k, -1)  # (N, K, W)
    BUFFER_POOL.give(expert_out)
    acc = _accumulation_dtype(slots, top_k_weights)  # low precision summed in fp32, like eager
    out = torch.bmm(top_k_weights.to(acc).unsqueeze(1), slots.to(acc)).squeeze(1)  # (N, W): Σ_k weight·slot
    BUFFER_POOL.give(slots)  # the backward gets d routing weights without them (see _GroupedExperts)
    if not for_backward:
        return out.to(hidden_states.dtype), ()
    if RECOMPUTE_GATE_UP:
        BUFFER_POOL.give(buffer if buffer is not None else gate_up)
        return out.to(hidden_states.dtype), (None,)
    return out.to(hidden_states.dtype), (gate_up,)


# Keep nothing of the experts' intermediates for the backward, not even gate/up (S, 2I): the backward recomputes it
# with one more grouped GEMM (~22% more expert FLOPs in training) for the least memory. MHMOE_RECOMPUTE_GATE_UP=1.
RECOMPUTE_GATE_UP = os.environ.get("MHMOE_RECOMPUTE_GATE_UP", "0") == "1"


class _GroupedExperts(torch.autograd.Function):
    """Expert rows gathered by expert -> gate/up grouped GEMM -> act(gate)·up -> down grouped GEMM -> weighted sum of
    each row's K slots (one bmm, in slot order: deterministic).

    Written out because autograd's generic backward spends a large share of the layer's time outside the GEMMs when
    experts are fine-grained (the S = N·K rows of width 2I outweigh a coarse SMoE's): the backward writes the gate/up
    gradient into one (S, 2I) buffer (no concatenation of two halves), gets the expert weight gradients from the
    grouped GEMM directly in the parameters' (E, 2I, W) / (E, W, I) layout (no transposed copy in AccumulateGrad), sums
    the input gradient by gathering each row's K slots (no scatter-add), and, when the graph is freed afterwards,
    reuses the dead forward buffers instead of allocating new ones.

    Memory: of the per-assignment intermediates (gathered rows (S, W), gate/up (S, 2I), act(gate)·up (S, I), expert
    outputs (S, W)) only gate/up is kept for the backward, which gathers the rows again, recomputes act(gate)·up
    (elementwise) and gets the routing weights' gradient from it (<d out · down, act·up>, no expert output needed);
    with h·k sub-token assignments (MH-MoE) these dominate the layer's saved memory (benchmarks/memory.py).
    `RECOMPUTE_GATE_UP` keeps not even gate/up (one more grouped GEMM in the backward).
    """

    @staticmethod
    def forward(ctx, hidden_states, top_k_weights, gate_up_proj, down_proj, act_fn, order, offsets, slot_pos, dropped):
        out, (gate_up,) = _experts_forward(
            hidden_states, top_k_weights, gate_up_proj, down_proj, act_fn, order, offsets, slot_pos, dropped, True
        )
        ctx.save_for_backward(gate_up, hidden_states, top_k_weights, gate_up_proj, down_proj)
        ctx.index = (order, offsets, slot_pos, dropped)
        ctx.act_fn = act_fn
        return out

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_out):
        gate_up, hidden_states, top_k_weights, gate_up_proj, down_proj = ctx.saved_tensors
        order, offsets, slot_pos, dropped = ctx.index
        need_x, need_weights, need_gate_up, need_down = ctx.needs_input_grad[:4]
        num_rows, top_k = top_k_weights.shape
        inter = down_proj.shape[-1]
        grad_x = grad_weights = grad_gate_up_proj = grad_down = None
        if not (need_x or need_weights or need_gate_up or need_down):
            return grad_x, grad_weights, grad_gate_up_proj, grad_down, None, None, None, None, None
        source_rows = order // top_k  # (S_kept,) the routed row of each sorted assignment
        rows = None
        overwrite = _may_overwrite_saved_tensors()
        if gate_up is None:  # RECOMPUTE_GATE_UP: nothing was kept; a buffer of this backward's, free to overwrite
            rows = _select_rows(hidden_states, source_rows).to(gate_up_proj.dtype)  # (S_kept, W)
            buffer = BUFFER_POOL.take(rows.shape[0], 2 * inter, rows)
            gate_up = _grouped_mm(rows, gate_up_proj.transpose(1, 2), offsets, out=buffer)  # (S_kept, 2I)
            overwrite = True
        dtype = gate_up.dtype
        num_kept = gate_up.shape[0]
        gate, up = gate_up[:, :inter], gate_up[:, inter:]
        weights_sorted = top_k_weights.reshape(-1).index_select(0, order)[:, None].to(dtype)  # (S_kept, 1)
        grad_sorted = _select_rows(grad_out.to(dtype), source_rows)  # (S_kept, W) d expert output, unweighted
        buffer = BUFFER_POOL.take(num_kept, inter, grad_sorted)
        grad_hidden = _grouped_mm(grad_sorted, down_proj, offsets, out=buffer)  # (S_kept, I), unweighted
        hidden = None  # act(gate)·up, recomputed (the forward did not keep it) into a buffer of this backward's
        if need_down or need_weights:
            hidden = _activation(ctx.act_fn, gate, out=BUFFER_POOL.take(num_kept, inter, gate_up))
            hidden = hidden.mul_(up) if hidden.data_ptr() != gate.data_ptr() else hidden * up  # (S_kept, I)
        if need_weights:
            # d weight[n, k] = <d out[n], expert output of slot (n, k)> = <d out[n] · down[e], act·up> (the expert
            # output itself is not kept); 0 for dropped slots
            per_assignment = torch.bmm(grad_hidden.unsqueeze(1), hidden.unsqueeze(2)).view(-1)  # (S_kept,)
            per_assignment.masked_fill_(dropped.index_select(0, order), 0.0)  # rows never computed: undefined
            grad_weights = top_k_weights.new_zeros(num_rows * top_k)
            grad_weights.index_copy_(0, order, per_assignment.to(grad_weights.dtype))
            grad_weights = grad_weights.view(num_rows, top_k)
        grad_expert_out = grad_sorted.mul_(weights_sorted)  # (S_kept, W) weighted
        grad_hidden.mul_(weights_sorted)  # (S_kept, I) weighted: d (act·up)
        if need_down:
            grad_down = _grouped_mm(grad_expert_out.t(), hidden, offsets)  # (E, W, I)
        if need_x or need_gate_up:
            # d gate_up = [act'(gate)·up·d hidden | act(gate)·d hidden], the activation recomputed. A fresh (S, 2I)
            # buffer costs page faults on CPU at this size, so when the graph is freed afterwards the gradient goes
            # into gate_up's own buffer (dead once read); d act goes into the recomputed hidden's buffer.
            grad_gate_up = gate_up if overwrite else torch.empty_like(gate_up)  # (S_kept, 2I)
            grad_act = grad_hidden * up if hidden is None else torch.mul(grad_hidden, up, out=hidden)  # before `up`
            _activation(ctx.act_fn, gate, out=grad_gate_up[:, inter:]).mul_(grad_hidden)  # may overwrite `up`
            _activation_backward(ctx.act_fn, gate, grad_act, grad_gate_up[:, :inter])
            if need_gate_up:
                if rows is None:
                    rows = _select_rows(hidden_states, source_rows).to(gate_up_proj.dtype)  # gathered again
                grad_gate_up_proj = _grouped_mm(grad_gate_up.t(), rows, offsets)  # (E, 2I, W)
            if need_x:
                pooled = BUFFER_POOL.take(*grad_expert_out.shape, grad_expert_out)
                grad_rows = _grouped_mm(grad_gate_up, gate_up_proj, offsets, out=pooled)  # (S_kept, W)
                grad_slots = _gather_slots(grad_rows, slot_pos, dropped)  # (N·K, W)
                grad_x = _sum_slots(grad_slots, top_k).to(hidden_states.dtype)
                BUFFER_POOL.give(grad_rows, grad_slots if grad_x.data_ptr() != grad_slots.data_ptr() else None)
            BUFFER_POOL.give(grad_act)
        BUFFER_POOL.give(rows, grad_hidden, grad_expert_out, hidden)
        if overwrite:  # the graph no longer needs its saved buffer
            BUFFER_POOL.give(gate_up)
        return grad_x, grad_weights, grad_gate_up_proj, grad_down, None, None, None, None, None


def grouped_experts_forward(
    self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
) -> torch.Tensor:
    """Sort assignments by expert, two grouped GEMMs, weight, and sum each row's K outputs (deterministic).

    Dropped assignments (expert id E) sort last, past offsets[-1]: the grouped GEMMs never compute them and their
    slots are masked to 0. Shapes do not depend on the routing (no host sync): only a capacity-routed model
    (`config.capacity_factor` set) reads offsets[-1] once in eager mode, to skip the dropped rows' gathers.
    """
    num_rows, top_k = top_k_index.shape
    num_slots = num_rows * top_k
    config = getattr(self, "config", None)
    backend = getattr(config, "routing_backend", None)
    order, offsets = sort_by_expert(top_k_index, self.num_experts, backend)  # (S,), (E,)
    dropped = top_k_index.reshape(-1) >= self.num_experts  # (S,)
    num_kept = num_slots
    if getattr(config, "capacity_factor", None) is not None and not _tracing():
        num_kept = int(offsets[-1])  # the one host sync, of capacity routing only
        order = order[:num_kept]
    # slot_pos[j]: where flat assignment j sits in `order` (dropped ones past the kept rows, or at 0: masked)
    slot_pos = order.new_zeros(num_slots) if num_kept < num_slots else order.new_empty(num_slots)
    slot_pos.index_copy_(0, order, torch.arange(order.shape[0], device=order.device))
    weights = (self.gate_up_proj, self.down_proj)
    compute = autocast_dtype(hidden_states.device)
    if compute is not None and weights[0].dtype != compute:
        # under autocast: the operands cast once (differentiably: the fp32 master weights get fp32 gradients), then
        # the grouped GEMMs run in the autocast dtype (torch's kernel for bf16), with autocast off inside
        weights = tuple(w.to(compute) for w in weights)
        hidden_states = hidden_states.to(compute)
    args = (hidden_states, top_k_weights, *weights, self.act_fn, order, offsets, slot_pos, dropped)
    with torch.autocast(hidden_states.device.type, enabled=False) if compute is not None else contextlib.nullcontext():
        if _tracing():  # torch.compile / torch.export: differentiable ops, autograd derives the backward
            return _traced_experts_forward(*args)
        if torch.is_grad_enabled() and any(t.requires_grad for t in args[:4]):
            return _GroupedExperts.apply(*args)
        return _experts_forward(*args, for_backward=False)[0]


def _tracing() -> bool:
    return torch.compiler.is_compiling()


def _traced_grouped_mm(a: torch.Tensor, b: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """`_grouped_mm` for traced graphs: torch's kernel where its fake kernel traces (bf16), else the opaque
    `mhmoe::grouped_mm` op (the same eager code, seen by the compiler as one call with static shapes)."""
    a = a.to(b.dtype)
    if _GROUPED_MM is not None and b.dtype == torch.bfloat16 and (not b.is_cuda or _kernel_accepts(b)):
        return _GROUPED_MM(a, b, offs=offsets)
    return torch.ops.mhmoe.grouped_mm(a, b, offsets)


def _traced_experts_forward(hidden_states, top_k_weights, gate_up_proj, down_proj, act_fn, order, offsets, slot_pos,
                            dropped):  # fmt: skip
    """The computation of `_experts_forward` from differentiable ops, for torch.compile / torch.export.

    Rows past offsets[-1] (dropped assignments) come out of the grouped GEMMs undefined: the gathered input rows are
    zeroed there (so their undefined gradient never reaches the input) and the output slots are masked.
    """
    num_rows, top_k = top_k_weights.shape
    dropped_sorted = dropped.index_select(0, order)[:, None]  # (S, 1)
    rows = hidden_states.index_select(0, order // top_k).masked_fill(dropped_sorted, 0.0)  # (S, W)
    gate, up = _traced_grouped_mm(rows, gate_up_proj.transpose(1, 2), offsets).chunk(2, dim=-1)  # (S, I) each
    expert_out = _traced_grouped_mm(act_fn(gate) * up, down_proj.transpose(1, 2), offsets)  # (S, W)
    slots = expert_out.index_select(0, slot_pos).masked_fill(dropped[:, None], 0.0)  # (N·K, W)
    acc = _accumulation_dtype(slots, top_k_weights)
    slots = slots.view(num_rows, top_k, -1).to(acc)  # (N, K, W)
    out = torch.bmm(top_k_weights.to(acc).unsqueeze(1), slots).squeeze(1)  # (N, W)
    return out.to(hidden_states.dtype)


def _grouped_mm_op(a: torch.Tensor, b: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    return _grouped_mm(a, b, offsets)  # always a new tensor, as a custom op must return


def _grouped_mm_backward_op(
    a: torch.Tensor, b: torch.Tensor, offsets: torch.Tensor, grad: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    return _grouped_mm(grad, b.transpose(1, 2), offsets), _grouped_mm(a.t(), grad, offsets)


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


def _drop_sentinels(experts_forward):
    """Adapt a Transformers experts function (no dropped-assignment sentinel) to capacity routing."""

    def forward(self, hidden_states, top_k_index, top_k_weights):
        dropped = top_k_index >= self.num_experts
        top_k_index = top_k_index.masked_fill(dropped, 0)
        top_k_weights = top_k_weights.masked_fill(dropped, 0.0)
        return experts_forward(self, hidden_states, top_k_index, top_k_weights)

    forward.__wrapped__ = experts_forward
    return forward


class MHMoEExpertsInterface(ExpertsInterface):
    """Transformers' experts interface, read live: a function registered with `ALL_EXPERTS_FUNCTIONS` (or
    `ExpertsInterface.register`) at any time, or a patched global entry, is what `experts_implementation=<name>` runs,
    adapted to capacity routing's dropped-assignment sentinel. Transformers' own `grouped_mm` is replaced by the
    capacity-aware `grouped_experts_forward` as long as nobody has replaced it globally; `eager` is the model's loop.
    """

    _replaces = {"grouped_mm": (_TRANSFORMERS_GROUPED_MM, grouped_experts_forward)}

    def get_interface(self, experts_implementation: str, default):
        if experts_implementation in self._local_mapping:  # set on this instance: used as is
            return self._local_mapping[experts_implementation]
        function = super().get_interface(experts_implementation, default)  # Transformers' checks and lookup
        stock, ours = self._replaces.get(experts_implementation, (None, None))
        if function is default or function is ours:
            return function
        return ours if function is stock else _adapted(function)


@functools.cache
def _adapted(function):
    return _drop_sentinels(function)


MHMOE_EXPERTS_FUNCTIONS = MHMoEExpertsInterface()


def eager_experts_forward(
    self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
) -> torch.Tensor:
    """Reference: a loop over the experts that received rows (the `eager` implementation)."""
    out = torch.zeros_like(hidden_states, dtype=torch.promote_types(hidden_states.dtype, torch.float32))
    for expert in top_k_index.unique().tolist():
        if expert >= self.num_experts:
            continue
        row, slot = torch.where(top_k_index == expert)
        gate, up = F.linear(hidden_states[row], self.gate_up_proj[expert]).chunk(2, dim=-1)
        expert_out = F.linear(self.act_fn(gate) * up, self.down_proj[expert])
        out.index_add_(0, row, expert_out.to(out.dtype) * top_k_weights[row, slot, None].to(out.dtype))
    return out.to(hidden_states.dtype)
