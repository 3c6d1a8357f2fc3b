"""Experts on torch's grouped GEMM (`grouped_gemm.py`) with a hand-written backward: the "grouped_mm" backend of the
experts op (`backends.py`), the default. On CUDA with SiLU the steps around the GEMMs (act(gate)·up, its backward, the
slots' weighted sum) are fused Triton kernels (`experts_grouped_mm_steps_triton.py`); the PyTorch code here is what
they are tested against and what runs everywhere else. In traced graphs (torch.compile, torch.export) the experts
are `_traced_experts_forward`'s differentiable ops, or on CUDA with SiLU this file's eager code as a custom op (end of
the file).

Shape legend: N routed rows (tokens × moe_heads sub-tokens), W row width (hidden_size // moe_heads), E experts,
K = num_experts_per_tok, S = N·K assignments, I = moe_intermediate_size. Expert weights are 3-D like Transformers'
v5 MoE models: `gate_up_proj` (E, 2I, W) and `down_proj` (E, W, I). Expert id E marks a dropped assignment.
"""

import contextlib
import logging
import os
import threading

import torch

from .experts_grouped_mm_steps_triton import HAS_TRITON, combine_slots, swiglu, swiglu_backward
from .grouped_gemm import autocast_dtype, grouped_mm, traced_grouped_mm

logger = logging.getLogger(__name__)


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


def is_silu(act_fn) -> bool:
    return isinstance(act_fn, torch.nn.SiLU) or type(act_fn).__name__ == "SiLUActivation"


# The fused steps (experts_grouped_mm_steps_triton.py) run on CUDA tensors with SiLU; tests set this to run them on CPU
# under TRITON_INTERPRET=1 against the PyTorch code below.
STEPS_KERNELS_ON_CPU = False
STEPS_FAILED: dict[str, str] = {}  # {"experts.grouped_mm_steps": reason}: a fused step failed; PyTorch's from then on


def _steps_kernels(tensor: torch.Tensor, act_fn) -> bool:
    """Whether act(gate)·up, its backward and the slots' weighted sum take the fused Triton kernels."""
    return HAS_TRITON and not STEPS_FAILED and is_silu(act_fn) and (tensor.is_cuda or STEPS_KERNELS_ON_CPU)


UNFUSED = object()  # what `_fused` returns when the fused step did not run


def _fused(step, *args, **kwargs):
    """A fused step's result, or UNFUSED when its kernel fails (e.g. on a GPU Triton cannot compile for; such errors
    come before the kernel writes anything): logged once and recorded (`backends.fallbacks()`), and the PyTorch steps
    run from then on. The steps are chosen by default, so, like the other default kernels, a failure must not stop
    training."""
    try:
        return step(*args, **kwargs)
    except Exception as error:
        if not STEPS_FAILED:
            STEPS_FAILED["experts.grouped_mm_steps"] = f"{type(error).__name__}: {error}"
            logger.warning(
                "the grouped_mm experts' fused Triton steps failed (%s: %s); the PyTorch steps run instead",
                type(error).__name__,
                error,
            )
        return UNFUSED


def _activation(act_fn, gate: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """act_fn(gate), into `out` when given (a buffer the caller no longer needs; may alias nothing but `out`)."""
    if is_silu(act_fn):
        return torch.ops.aten.silu(gate) if out is None else torch.ops.aten.silu.out(gate, out=out)
    act = act_fn(gate)
    return act if out is None else out.copy_(act)


def _activation_backward(act_fn, gate: torch.Tensor, grad: torch.Tensor, out: torch.Tensor) -> None:
    """out = grad · act_fn'(gate); `out` may be `gate` itself (elementwise, same positions)."""
    if is_silu(act_fn):
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
    """The forward computation; returns (N, W) output and, `for_backward`, the tensors the backward needs: gate/up
    (None with `RECOMPUTE_GATE_UP`) and each sorted assignment's routed row.

    Without a backward to come, act(gate)·up is computed in place in gate_up's gate half (no (S, I) allocation).
    """
    top_k = top_k_weights.shape[-1]
    inter = down_proj.shape[-1]
    source_rows = order // top_k  # (S_kept,) the routed row of each sorted assignment

    rows = _select_rows(hidden_states, source_rows).to(gate_up_proj.dtype)  # (S_kept, W)
    num_kept = rows.shape[0]
    buffer = BUFFER_POOL.take(num_kept, 2 * inter, rows)
    gate_up = grouped_mm(rows, gate_up_proj.transpose(1, 2), offsets, out=buffer)  # (S_kept, 2I)
    gate, up = gate_up[:, :inter], gate_up[:, inter:]
    hidden = UNFUSED
    if _steps_kernels(rows, act_fn):  # one pass over gate/up; without a backward to come, into the gate half
        hidden = _fused(swiglu, gate_up, out=None if for_backward else gate)  # (S_kept, I)
    if hidden is UNFUSED and for_backward:  # gate and up are kept: act(gate)·up to a new buffer, act recomputed later
        hidden = _activation(act_fn, gate, out=BUFFER_POOL.take(num_kept, inter, rows))
        hidden = hidden.mul_(up) if hidden.data_ptr() != gate.data_ptr() else hidden * up  # (S_kept, I)
    elif hidden is UNFUSED:
        hidden = _activation(act_fn, gate, out=gate).mul_(up)  # (S_kept, I) view, row stride 2I
    expert_out = grouped_mm(
        hidden, down_proj.transpose(1, 2), offsets, out=BUFFER_POOL.take(num_kept, rows.shape[1], rows)
    )  # (S_kept, W)
    if not for_backward:
        BUFFER_POOL.give(buffer, rows)  # dead: act(gate)·up and the rows have been read
    elif rows.data_ptr() != hidden_states.data_ptr():
        # not kept for the backward, which gathers the rows again and recomputes act(gate)·up: of the (S, W + 3I)
        # per-assignment intermediates only gate_up (S, 2I) stays alive until the backward
        BUFFER_POOL.give(rows, hidden)

    out = UNFUSED
    if _steps_kernels(expert_out, act_fn):
        out = _fused(combine_slots, expert_out, slot_pos, dropped, top_k_weights, top_k, hidden_states.dtype)
    if out is UNFUSED:
        slots = _gather_slots(expert_out, slot_pos, dropped).view(top_k_weights.shape[0], top_k, -1)  # (N, K, W)
        acc = _accumulation_dtype(slots, top_k_weights)  # low precision summed in fp32, like eager
        out = torch.bmm(top_k_weights.to(acc).unsqueeze(1), slots.to(acc)).squeeze(1)  # (N, W): Σ_k weight·slot
        BUFFER_POOL.give(slots)  # the backward gets d routing weights without them (see _GroupedExperts)
    BUFFER_POOL.give(expert_out)
    if not for_backward:
        return out.to(hidden_states.dtype), ()
    if RECOMPUTE_GATE_UP:
        BUFFER_POOL.give(buffer if buffer is not None else gate_up)
        return out.to(hidden_states.dtype), (None, source_rows)
    return out.to(hidden_states.dtype), (gate_up, source_rows)


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
        out, (gate_up, source_rows) = _experts_forward(
            hidden_states, top_k_weights, gate_up_proj, down_proj, act_fn, order, offsets, slot_pos, dropped, True
        )
        ctx.save_for_backward(gate_up, hidden_states, top_k_weights, gate_up_proj, down_proj)
        ctx.index = (order, offsets, slot_pos, dropped, source_rows)
        ctx.act_fn = act_fn
        return out

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_out):
        gate_up, hidden_states, top_k_weights, gate_up_proj, down_proj = ctx.saved_tensors
        order, offsets, slot_pos, dropped, source_rows = ctx.index  # source_rows (S_kept,): each one's routed row
        need_x, need_weights, need_gate_up, need_down = ctx.needs_input_grad[:4]
        top_k = top_k_weights.shape[1]
        inter = down_proj.shape[-1]
        grad_x = grad_weights = grad_gate_up_proj = grad_down = None
        if not (need_x or need_weights or need_gate_up or need_down):
            return grad_x, grad_weights, grad_gate_up_proj, grad_down, None, None, None, None, None
        rows = None
        overwrite = _may_overwrite_saved_tensors() and not getattr(ctx, "keep_saved", False)
        if gate_up is None:  # RECOMPUTE_GATE_UP: nothing was kept; a buffer of this backward's, free to overwrite
            rows = _select_rows(hidden_states, source_rows).to(gate_up_proj.dtype)  # (S_kept, W)
            buffer = BUFFER_POOL.take(rows.shape[0], 2 * inter, rows)
            gate_up = grouped_mm(rows, gate_up_proj.transpose(1, 2), offsets, out=buffer)  # (S_kept, 2I)
            overwrite = True
        dtype = gate_up.dtype
        num_kept = gate_up.shape[0]
        gate, up = gate_up[:, :inter], gate_up[:, inter:]
        grad_sorted = _select_rows(grad_out.to(dtype), source_rows)  # (S_kept, W) d expert output, unweighted
        buffer = BUFFER_POOL.take(num_kept, inter, grad_sorted)
        grad_hidden = grouped_mm(grad_sorted, down_proj, offsets, out=buffer)  # (S_kept, I), unweighted
        if _steps_kernels(gate_up, ctx.act_fn):
            grads = _fused_backward(ctx, gate_up, grad_hidden, grad_sorted, rows, overwrite)
            if grads is not UNFUSED:
                return grads
        weights_sorted = top_k_weights.reshape(-1).index_select(0, order)[:, None].to(dtype)  # (S_kept, 1)
        hidden = None  # act(gate)·up, recomputed (the forward did not keep it) into a buffer of this backward's
        if need_down or need_weights:
            hidden = _activation(ctx.act_fn, gate, out=BUFFER_POOL.take(num_kept, inter, gate_up))
            hidden = hidden.mul_(up) if hidden.data_ptr() != gate.data_ptr() else hidden * up  # (S_kept, I)
        if need_weights:
            # d weight[n, k] = <d out[n], expert output of slot (n, k)> = <d out[n] · down[e], act·up> (the expert
            # output itself is not kept); 0 for dropped slots
            per_assignment = torch.bmm(grad_hidden.unsqueeze(1), hidden.unsqueeze(2)).view(-1)  # (S_kept,)
            grad_weights = _routing_weights_grad(per_assignment, slot_pos, dropped, top_k_weights)
        grad_expert_out = grad_sorted.mul_(weights_sorted)  # (S_kept, W) weighted
        grad_hidden.mul_(weights_sorted)  # (S_kept, I) weighted: d (act·up)
        if need_down:
            grad_down = grouped_mm(grad_expert_out.t(), hidden, offsets)  # (E, W, I)
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
                grad_gate_up_proj = grouped_mm(grad_gate_up.t(), rows, offsets)  # (E, 2I, W)
            if need_x:
                pooled = BUFFER_POOL.take(*grad_expert_out.shape, grad_expert_out)
                grad_rows = grouped_mm(grad_gate_up, gate_up_proj, offsets, out=pooled)  # (S_kept, W)
                grad_slots = _gather_slots(grad_rows, slot_pos, dropped)  # (N·K, W)
                grad_x = _sum_slots(grad_slots, top_k).to(hidden_states.dtype)
                BUFFER_POOL.give(grad_rows, grad_slots if grad_x.data_ptr() != grad_slots.data_ptr() else None)
            BUFFER_POOL.give(grad_act)
        BUFFER_POOL.give(rows, grad_hidden, grad_expert_out, hidden)
        if overwrite:  # the graph no longer needs its saved buffer
            BUFFER_POOL.give(gate_up)
        return grad_x, grad_weights, grad_gate_up_proj, grad_down, None, None, None, None, None


def _routing_weights_grad(per_assignment, slot_pos, dropped, top_k_weights):
    """(S_kept,) per-assignment d weight in expert order -> (N, K) in slot order, each slot's read at its position;
    0 for dropped slots (their rows were never computed: undefined)."""
    if per_assignment.numel() == 0:  # every assignment dropped (the order cut to no rows)
        return torch.zeros_like(top_k_weights)
    grad_weights = per_assignment.index_select(0, slot_pos).masked_fill_(dropped, 0.0)
    return grad_weights.to(top_k_weights.dtype).view(top_k_weights.shape)


def _fused_backward(ctx, gate_up, grad_hidden, grad_sorted, rows, overwrite):
    """`_GroupedExperts.backward` from d act·up on, with the fused kernels (CUDA, SiLU): act·up, d gate/up and the
    routing weights' gradient in one pass over gate/up, the input gradient's sum over slots in one gather."""
    _, hidden_states, top_k_weights, gate_up_proj, down_proj = ctx.saved_tensors
    order, offsets, slot_pos, dropped, source_rows = ctx.index
    need_x, need_weights, need_gate_up, need_down = ctx.needs_input_grad[:4]
    top_k = top_k_weights.shape[1]
    num_kept, inter = grad_hidden.shape
    grad_x = grad_weights = grad_gate_up_proj = grad_down = None
    weights_sorted = top_k_weights.reshape(-1).index_select(0, order)  # (S_kept,)
    hidden = gate_up.new_empty(num_kept, inter) if need_down else None  # weight·act(gate)·up, recomputed
    dot = torch.empty(num_kept, dtype=torch.float32, device=gate_up.device) if need_weights else None
    grad_gate_up = None
    if need_x or need_gate_up:
        grad_gate_up = gate_up if overwrite else torch.empty_like(gate_up)  # (S_kept, 2I)
    if _fused(swiglu_backward, gate_up, grad_hidden, weights_sorted, grad_gate_up, hidden, dot) is UNFUSED:
        return UNFUSED  # the kernel did not run: the PyTorch backward does (gate/up unchanged)
    if need_weights:  # d weight[n, k] = <d out[n] · down[e], act·up>
        grad_weights = _routing_weights_grad(dot, slot_pos, dropped, top_k_weights)
    if need_down:  # Σ (weight · d out)ᵀ (act·up) = Σ d outᵀ (weight · act·up): no weighted copy of d out
        grad_down = grouped_mm(grad_sorted.t(), hidden, offsets)  # (E, W, I)
    if need_gate_up:
        if rows is None:
            rows = _select_rows(hidden_states, source_rows).to(gate_up_proj.dtype)  # gathered again
        grad_gate_up_proj = grouped_mm(grad_gate_up.t(), rows, offsets)  # (E, 2I, W)
    if need_x:
        grad_rows = grouped_mm(grad_gate_up, gate_up_proj, offsets)  # (S_kept, W)
        grad_x = _fused(combine_slots, grad_rows, slot_pos, dropped, None, top_k, hidden_states.dtype)
        if grad_x is UNFUSED:
            grad_x = _sum_slots(_gather_slots(grad_rows, slot_pos, dropped), top_k).to(hidden_states.dtype)
    return grad_x, grad_weights, grad_gate_up_proj, grad_down, None, None, None, None, None


def experts_forward(
    hidden_states: torch.Tensor,
    top_k_index: torch.Tensor,
    top_k_weights: torch.Tensor,
    gate_up_proj: torch.Tensor,
    down_proj: torch.Tensor,
    act_fn,
    order: torch.Tensor,
    offsets: torch.Tensor,
    may_drop: bool = False,
    positions: torch.Tensor | None = None,
) -> torch.Tensor:
    """Rows (N, W) in expert order (`order` (S,), `offsets` (E,) from `sort_by_expert`) -> two grouped GEMMs ->
    weighted sum of each row's K outputs (deterministic) -> (N, W).

    Dropped assignments (expert id E) sort last, past offsets[-1]: the grouped GEMMs never compute them and their
    slots are masked to 0. Shapes do not depend on the routing (no host sync): only with `may_drop` (capacity routing)
    offsets[-1] is read once in eager mode, to skip the dropped rows' gathers. `positions` (S,): where each assignment
    sits in `order` (`sort_by_expert(..., positions=True)`), else computed here.
    """
    num_rows, top_k = top_k_index.shape
    num_slots = num_rows * top_k
    dropped = top_k_index.reshape(-1) >= gate_up_proj.shape[0]  # (S,)
    num_kept = num_slots
    if may_drop and not _tracing():
        num_kept = int(offsets[-1])  # the one host sync, of capacity routing only
        order = order[:num_kept]
    # slot_pos[j]: where flat assignment j sits in `order` (dropped ones past the kept rows, or at 0 once the order is
    # cut to the kept rows: masked)
    slot_pos = positions
    if positions is None or num_kept < num_slots:
        slot_pos = order.new_zeros(num_slots) if num_kept < num_slots else order.new_empty(num_slots)
        slot_pos.index_copy_(0, order, torch.arange(order.shape[0], device=order.device))
    weights = (gate_up_proj, down_proj)
    compute = autocast_dtype(hidden_states.device)
    if compute is not None and weights[0].dtype != compute:
        # under autocast: the operands cast once (differentiably: the fp32 master weights get fp32 gradients), then
        # the grouped GEMMs run in the autocast dtype (torch's kernel for bf16), with autocast off inside
        weights = tuple(w.to(compute) for w in weights)
        hidden_states = hidden_states.to(compute)
    args = (hidden_states, top_k_weights, *weights, act_fn, order, offsets, slot_pos, dropped)
    with torch.autocast(hidden_states.device.type, enabled=False) if compute is not None else contextlib.nullcontext():
        if _tracing() and _op_in_graphs(hidden_states, act_fn):  # the eager code as one opaque op (below)
            out, _ = torch.ops.mhmoe.grouped_mm_experts(*args[:4], *args[5:])
            return out
        if _tracing():  # torch.compile / torch.export: differentiable ops, autograd derives the backward
            return _traced_experts_forward(*args)
        if torch.is_grad_enabled() and any(t.requires_grad for t in args[:4]):
            return _GroupedExperts.apply(*args)
        return _experts_forward(*args, for_backward=False)[0]


def _tracing() -> bool:
    return torch.compiler.is_compiling()


def _traced_experts_forward(
    hidden_states, top_k_weights, gate_up_proj, down_proj, act_fn, order, offsets, slot_pos, dropped
):
    """The computation of `_experts_forward` from differentiable ops, for torch.compile / torch.export.

    Rows past offsets[-1] (dropped assignments) come out of the grouped GEMMs undefined: the gathered input rows are
    zeroed there (so their undefined gradient never reaches the input) and the output slots are masked.
    """
    num_rows, top_k = top_k_weights.shape
    dropped_sorted = dropped.index_select(0, order)[:, None]  # (S, 1)
    rows = hidden_states.index_select(0, order // top_k).masked_fill(dropped_sorted, 0.0)  # (S, W)
    gate, up = traced_grouped_mm(rows, gate_up_proj.transpose(1, 2), offsets).chunk(2, dim=-1)  # (S, I) each
    expert_out = traced_grouped_mm(act_fn(gate) * up, down_proj.transpose(1, 2), offsets)  # (S, W)
    slots = expert_out.index_select(0, slot_pos).masked_fill(dropped[:, None], 0.0)  # (N·K, W)
    acc = _accumulation_dtype(slots, top_k_weights)
    slots = slots.view(num_rows, top_k, -1).to(acc)  # (N, K, W)
    out = torch.bmm(top_k_weights.to(acc).unsqueeze(1), slots).squeeze(1)  # (N, W)
    return out.to(hidden_states.dtype)


# In traced graphs on CUDA with SiLU, the eager code above (its backward and fused steps included) runs as two
# `torch.library` custom ops instead of `_traced_experts_forward`'s differentiable ops: a compiled block then runs the
# same kernels as eager, and CUDA graphs can capture them. The forward op also returns gate/up (S, 2I) for the backward
# op (empty under RECOMPUTE_GATE_UP); the backward op never writes into it (an op's inputs are read-only). On CPU
# graphs keep the traced form: the op bodies would take buffers from the CPU pool, which graphs must not hold.


def _op_in_graphs(hidden_states: torch.Tensor, act_fn) -> bool:
    return hidden_states.is_cuda and is_silu(act_fn)


class _OpContext:
    """What `_GroupedExperts.backward` reads from its autograd context, for the backward op."""

    keep_saved = True  # never overwrite gate/up: an op input

    def __init__(self, saved_tensors, index, needs_input_grad):
        self.saved_tensors, self.index, self.needs_input_grad = saved_tensors, index, needs_input_grad
        self.act_fn = torch.nn.SiLU()


def _experts_op(
    hidden_states: torch.Tensor,
    top_k_weights: torch.Tensor,
    gate_up_proj: torch.Tensor,
    down_proj: torch.Tensor,
    order: torch.Tensor,
    offsets: torch.Tensor,
    slot_pos: torch.Tensor,
    dropped: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    args = (hidden_states, top_k_weights, gate_up_proj, down_proj, torch.nn.SiLU(), order, offsets, slot_pos, dropped)
    out, (gate_up, _) = _experts_forward(*args, for_backward=True)
    return out, gate_up if gate_up is not None else out.new_empty(0)


def _experts_backward_op(
    grad_out: torch.Tensor,
    gate_up: torch.Tensor,
    hidden_states: torch.Tensor,
    top_k_weights: torch.Tensor,
    gate_up_proj: torch.Tensor,
    down_proj: torch.Tensor,
    order: torch.Tensor,
    offsets: torch.Tensor,
    slot_pos: torch.Tensor,
    dropped: torch.Tensor,
    needs: list[bool],
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    saved = (None if RECOMPUTE_GATE_UP else gate_up, hidden_states, top_k_weights, gate_up_proj, down_proj)
    index = (order, offsets, slot_pos, dropped, order // top_k_weights.shape[1])  # as `_GroupedExperts.forward`'s
    grads = _GroupedExperts.backward(_OpContext(saved, index, needs), grad_out)[:4]
    inputs = (hidden_states, top_k_weights, gate_up_proj, down_proj)
    return tuple(g if g is not None else x.new_empty(0) for g, x in zip(grads, inputs))  # an op returns tensors


def _register_experts_op() -> None:
    """`torch.ops.mhmoe.grouped_mm_experts(hidden_states, top_k_weights, gate_up_proj, down_proj, order, offsets,
    slot_pos, dropped) -> (out, gate_up)` with its backward op, fake implementations and autograd. Once per process."""
    if hasattr(torch.ops.mhmoe, "grouped_mm_experts"):
        return
    forward = torch.library.custom_op("mhmoe::grouped_mm_experts", _experts_op, mutates_args=())
    backward = torch.library.custom_op("mhmoe::grouped_mm_experts_backward", _experts_backward_op, mutates_args=())

    @forward.register_fake
    def _(hidden_states, top_k_weights, gate_up_proj, down_proj, order, offsets, slot_pos, dropped):
        gate_up_rows = 0 if RECOMPUTE_GATE_UP else order.shape[0]
        return (
            hidden_states.new_empty(hidden_states.shape),
            gate_up_proj.new_empty(gate_up_rows, gate_up_proj.shape[1]),
        )

    @backward.register_fake
    def _(
        grad_out,
        gate_up,
        hidden_states,
        top_k_weights,
        gate_up_proj,
        down_proj,
        order,
        offsets,
        slot_pos,
        dropped,
        needs,
    ):
        inputs = (hidden_states, top_k_weights, gate_up_proj, down_proj)
        return tuple(x.new_empty(x.shape if need else (0,)) for x, need in zip(inputs, needs))

    def setup_context(ctx, inputs, output):
        ctx.mark_non_differentiable(output[1])
        ctx.save_for_backward(output[1], *inputs)

    def grad_fn(ctx, grad_out, _):
        needs = list(ctx.needs_input_grad[:4])
        grads = torch.ops.mhmoe.grouped_mm_experts_backward(grad_out.contiguous(), *ctx.saved_tensors, needs)
        return *(g if need else None for g, need in zip(grads, needs)), None, None, None, None

    forward.register_autograd(grad_fn, setup_context=setup_context)


_register_experts_op()
