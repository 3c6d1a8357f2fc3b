"""Head-sparse attention in Triton (the CUDA path): flash attention over lists of active query rows, forward and
backward, equal to `head_sparse_attention_naive.py` (the contract and the shape legend are there).

Rows: the active (token, head) pairs of each (batch row, key/value head) segment, in token order (the G query heads
of a key/value head share its keys, so one program's rows may mix them and every K/V tile it loads serves them all).
Each segment owns a fixed slice of G·T row slots (`_Plan`): built by one kernel on the device (a scan per segment; no
`nonzero`, no `bincount`), so nothing waits on the host; a program past its segment's count returns at once.
- forward: one program per BLOCK_M rows of a segment; online softmax (base 2: log2(e) folded into the scale, `exp2`)
  over the keys those rows can see, in BLOCK_N tiles. Causal attention without a window or a 4-D mask (prefill, the
  case that matters for speed) splits the loop: the tiles every row of the block sees whole run without any mask
  (no per-element compare, no bounds check on the loads); only the last one or two tiles (the block's diagonal) are
  masked per element. A window or a 4-D mask masks every tile. Writes the output rows into (B, T, H, hd) and each
  row's log-sum-exp (base 2).
- backward: dQ like the forward (one program per row block, the keys in a loop; it also computes each row's
  delta = rowsum(dO · O)); dK and dV one program per (segment, BLOCK_N keys), looping over the segment's rows that
  can see those keys (found before by `_key_block_bounds_kernel`, binary searches in the rows' sorted positions; the
  rows that see the whole key block, causal only, without a per-element mask): every gradient written once, no atomics.
Inactive pairs are in no row list: no work, no memory traffic. On a GPU the gates are always multiplied in (no
host sync for the 0/1 test `apply_gates` makes elsewhere).

Tiles (`tiles`): forward on bf16/fp16 128 rows × 64 keys, 8 warps, 3 stages (so that each K/V tile serves twice the
rows it did at 64); backward 64 × 64, 4 warps; fp32 as before (64 × 64, 32 × 32 beyond 64 dims). Run on an H100 at
commit 247e4e8: correct, and 1.08–1.75× the time of SDPA over all heads at 16K tokens, 2.0–8.5× at 4K, where the
host's ~21 launches per forward dominated (benchmarks/results/gpu_moe-nvidia-h100-247e4e8/gpu_head_sparse.json); the
row lists and the key-block bounds have been one launch each since, not yet timed.

Precision: fp32 accumulation and softmax; bf16/fp16 operands go to `tl.dot` as they are, fp32 ones as IEEE fp32
(exact, slower) or TF32 when torch's own fp32 matmuls may (`torch.backends.cuda.matmul.allow_tf32`). Under
TRITON_INTERPRET=1 the dots run in fp32 (numpy has no bf16: `UPCAST`). A 4-D mask is turned into an fp32 additive
(B or 1, T, L) tensor in base-2 units. Compiled ahead for sm_90 by tests/models/ops/head_sparse_attention_gpu_compile.py;
tested against the reference under the interpreter.

Imports without triton (exported checkpoints): the kernels are then plain functions, never launched.
"""

from typing import NamedTuple

import torch

from ..triton_compat import HAS_TRITON, interpreting, tl, triton  # noqa: F401  (HAS_TRITON: re-exported)
from ..triton_compat import jit as _jit
from .head_sparse_attention_naive import apply_gates, check_inputs
from .head_sparse_attention_triton_backward import _dkdv_kernel, _dq_kernel
from .head_sparse_attention_triton_common import LOG2E
from .head_sparse_attention_triton_forward import _forward_kernel

# ---------------------------------------------------------------------------------------------------------------------
# launch


@_jit
def _row_lists_kernel(
    active_ptr, rows_ptr, positions_ptr, counts_ptr, tokens, kv_heads, groups, offset, BLOCK: tl.constexpr
):
    """One program per segment s = (batch row b, key/value head h), its G·T slots scanned in token order: the n-th
    active pair (token t, head h·G + j) gets rows[s·G·T + n] = t·G + j and positions[s·G·T + n] = t + offset;
    counts[s] = how many; the positions past the count are int32's max (after every key: the slots stay sorted).
    `active` (B, T, H) uint8, contiguous."""
    segment = tl.program_id(0)
    heads = kv_heads * groups
    capacity = groups * tokens
    base = segment.to(tl.int64) * capacity
    first_head = (segment % kv_heads) * groups
    batch_row = (segment // kv_heads).to(tl.int64)
    count = 0
    start = 0
    while start < capacity:  # `while`: Triton 3.6's interpreter takes no range() bound from an argument
        slots = start + tl.arange(0, BLOCK)  # t·G + j
        valid = slots < capacity
        token = slots // groups
        flags = tl.load(
            active_ptr + (batch_row * tokens + token) * heads + first_head + slots % groups, mask=valid, other=0
        ).to(tl.int32)
        place = base + count + tl.cumsum(flags, axis=0) - 1
        keep = valid & (flags != 0)
        tl.store(rows_ptr + place, slots, mask=keep)
        tl.store(positions_ptr + place, token + offset, mask=keep)
        count += tl.sum(flags, axis=0)
        start += BLOCK
    tl.store(counts_ptr + segment, count)
    start = count
    while start < capacity:
        slots = start + tl.arange(0, BLOCK)
        tl.store(positions_ptr + base + slots, 2147483647, mask=slots < capacity)
        start += BLOCK


@_jit
def _first_at_or_after(positions_ptr, capacity, values, steps):
    """(K,) the first slot whose position is >= each value (`capacity` if none): a binary search per lane over a
    segment's sorted positions, `steps` >= bit length of `capacity` rounds (a lane that has converged stays)."""
    low = values * 0
    high = low + capacity
    step = 0
    while step < steps:
        searching = low < high
        mid = (low + high) // 2
        below = tl.load(positions_ptr + mid, mask=searching, other=0) < values
        low = tl.where(searching & below, mid + 1, low)
        high = tl.where(searching & ~below, mid, high)
        step += 1
    return low


@_jit
def _key_block_bounds_kernel(
    positions_ptr,
    bounds_ptr,
    capacity,
    num_keys,
    num_key_blocks,
    window,
    steps,
    CAUSAL_ONLY: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """bounds[s, kb] = (start, full, end) for BLOCK_K key blocks of segment s: `_Plan.key_block_bounds`."""
    segment = tl.program_id(1)
    blocks = tl.program_id(0) * BLOCK_K + tl.arange(0, BLOCK_K)
    first_key = blocks * BLOCK_N
    positions = positions_ptr + segment.to(tl.int64) * capacity
    start = _first_at_or_after(positions, capacity, first_key, steps)
    reach = first_key * 0 + num_keys
    if window > 0:
        reach = tl.minimum(tl.minimum(first_key + BLOCK_N - 1, num_keys - 1) + window, num_keys)
    end = tl.maximum(start, _first_at_or_after(positions, capacity, reach, steps))
    full = end
    if CAUSAL_ONLY:  # a partial block: masked
        full = tl.minimum(
            tl.maximum(_first_at_or_after(positions, capacity, first_key + BLOCK_N - 1, steps), start), end
        )
    out = bounds_ptr + (segment.to(tl.int64) * num_key_blocks + blocks) * 3
    valid = blocks < num_key_blocks
    tl.store(out, start, mask=valid)
    tl.store(out + 1, full, mask=valid)
    tl.store(out + 2, end, mask=valid)


def _next_power_of_2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


def _upcast(dtype: torch.dtype) -> bool:
    """The interpreter cannot multiply bf16/fp16 (numpy): there the tiles are converted to fp32 after loading."""
    return interpreting() and dtype in (torch.bfloat16, torch.float16)


def _precision(dtype: torch.dtype) -> str:
    if dtype == torch.float32 and not interpreting() and torch.backends.cuda.matmul.allow_tf32:
        return "tf32"
    return "ieee"


class Tiles(NamedTuple):
    block_m: int
    block_n: int
    block_d: int
    num_warps: int
    num_stages: int


def tiles(
    head_dim: int,
    dtype: torch.dtype,
    block_m: int | None = None,
    block_n: int | None = None,
    backward: bool = False,
    num_warps: int | None = None,
    num_stages: int | None = None,
) -> Tiles:
    """The forward's (or the backward's) tiles and launch settings. bf16/fp16 forward up to 128 dims: 128 rows × 64
    keys, 8 warps, 3 stages (each K/V tile loaded serves 128 rows, the tile flash-attention kernels use on an H100);
    everything else 64 × 64 with 4 warps, 32 × 32 for fp32 beyond 64 dims (so that the pipelined tiles fit an H100's
    shared memory: checked by head_sparse_attention_gpu_compile.py). Not tuned on a GPU yet."""
    block_d = max(16, _next_power_of_2(head_dim))
    wide = not backward and dtype in (torch.bfloat16, torch.float16) and block_d <= 128
    default_m = 128 if wide else 32 if dtype == torch.float32 and block_d > 64 else 64
    default_n = 32 if dtype == torch.float32 and block_d > 64 else 64
    return Tiles(
        block_m or default_m,
        block_n or default_n,
        block_d,
        num_warps or (8 if (block_m or default_m) >= 128 else 4),
        num_stages or 3,
    )


class _Plan:
    """The row lists, built on the device by one launch (`_row_lists_kernel`), no host sync. Segment s = (batch row,
    key/value head) owns the slots [s·G·T, (s+1)·G·T) of `rows` (int32): its first `counts[s]` hold t·G + j of its
    active pairs (token t, head j of the group) in token order; the slots past the count are never read. `positions`
    (segments, G·T) int32: each slot's key position, past the count after every key (for the backward's key-block
    bounds). The log-sum-exp and delta of a row live in the same slot. Also the mask as kernel arguments (additive,
    fp32, base 2)."""

    MAX_BLOCK = 4096  # slots per step of a segment's scan

    def __init__(self, active, kv_heads, attention_mask, num_keys, offset):
        batch, tokens, heads = active.shape
        groups = heads // kv_heads
        segments, capacity = batch * kv_heads, groups * tokens
        device = active.device
        self.rows = torch.empty(segments * capacity, dtype=torch.int32, device=device)
        self.positions = torch.empty(segments, capacity, dtype=torch.int32, device=device)
        self.counts = torch.empty(segments, dtype=torch.int32, device=device)
        block = min(self.MAX_BLOCK, max(16, _next_power_of_2(capacity)))
        _row_lists_kernel[(segments,)](
            active.contiguous().view(torch.uint8),
            self.rows,
            self.positions,
            self.counts,
            tokens,
            kv_heads,
            groups,
            offset,
            BLOCK=block,
        )
        self.segments, self.groups, self.capacity = segments, groups, capacity
        self.mask, self.mask_strides = None, (0, 0)
        if attention_mask is not None:
            given = attention_mask[:, 0, :, :num_keys]
            minimum = torch.finfo(torch.float32).min
            if given.dtype == torch.bool:
                mask = torch.zeros(given.shape, dtype=torch.float32, device=given.device).masked_fill(~given, minimum)
            else:
                mask = (given.float() * LOG2E).clamp_min(minimum)
            self.mask = mask.contiguous()
            self.mask_strides = (self.mask.stride(0) if self.mask.shape[0] > 1 else 0, self.mask.stride(1))

    def key_block_bounds(self, num_keys, block_n, window):
        """(segments, key blocks, 3) int32: per segment and key block the rows [start, end) that can see a key of the
        block (position >= its first key, and within the window of its last key), and `full`: from there on (start <=
        full <= end) the rows see every key of the block (position >= its last key; without a window only; with one,
        full = end). One launch (`_key_block_bounds_kernel`): binary searches in the sorted positions."""
        num_blocks = -(-num_keys // block_n)
        bounds = torch.empty(self.segments, num_blocks, 3, dtype=torch.int32, device=self.positions.device)
        block_k = min(128, max(16, _next_power_of_2(num_blocks)))  # at least 16 lanes, as every tile here
        _key_block_bounds_kernel[(triton.cdiv(num_blocks, block_k), self.segments)](
            self.positions,
            bounds,
            self.capacity,
            num_keys,
            num_blocks,
            window or 0,
            self.capacity.bit_length(),
            CAUSAL_ONLY=not window,
            BLOCK_N=block_n,
            BLOCK_K=block_k,
        )
        return bounds


class _HeadSparseAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, query, key, value, active, scaling, attention_mask, offset, window, settings):
        batch, heads, tokens, head_dim = query.shape
        kv_heads, num_keys = key.shape[1], key.shape[2]
        key, value = key.contiguous(), value.contiguous()
        if query.stride(-1) != 1:
            query = query.contiguous()
        plan = _Plan(active, kv_heads, attention_mask, num_keys, offset)
        tile = tiles(head_dim, query.dtype, **settings)
        out = query.new_zeros(batch, tokens, heads, head_dim)
        lse = torch.empty(plan.rows.shape[0], dtype=torch.float32, device=query.device)
        _forward_kernel[(triton.cdiv(plan.capacity, tile.block_m), plan.segments)](
            query,
            key,
            value,
            out,
            lse,
            plan.rows,
            plan.counts,
            _mask_arg(plan, query),
            *_common_args(query, key, plan, tokens, heads, head_dim, num_keys, offset, window),
            scaling * LOG2E,
            **_meta(plan, query, window, tile, head_dim),
        )
        ctx.save_for_backward(query, key, value, out, lse)
        ctx.plan, ctx.settings = plan, (scaling, offset, window, settings)
        return out

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_out):
        query, key, value, out, lse = ctx.saved_tensors
        plan = ctx.plan
        scaling, offset, window, settings = ctx.settings
        batch, heads, tokens, head_dim = query.shape
        num_keys = key.shape[2]
        grad_out = grad_out.contiguous()
        tile = tiles(head_dim, query.dtype, backward=True, **settings)
        delta = torch.empty_like(lse)  # written by the dQ kernel
        grad_query = torch.zeros(batch, tokens, heads, head_dim, dtype=query.dtype, device=query.device)
        grad_key = torch.empty_like(key)  # every key written by the dK/dV kernel
        grad_value = torch.empty_like(value)
        args = _common_args(query, key, plan, tokens, heads, head_dim, num_keys, offset, window)
        meta = _meta(plan, query, window, tile, head_dim)
        mask = _mask_arg(plan, query)
        _dq_kernel[(triton.cdiv(plan.capacity, tile.block_m), plan.segments)](
            query,
            key,
            value,
            out,
            grad_out,
            lse,
            delta,
            grad_query,
            plan.rows,
            plan.counts,
            mask,
            *args,
            scaling,
            scaling * LOG2E,
            **meta,
        )
        num_blocks = triton.cdiv(num_keys, tile.block_n)
        bounds = plan.key_block_bounds(num_keys, tile.block_n, window)
        _dkdv_kernel[(num_blocks, plan.segments)](
            query,
            key,
            value,
            grad_out,
            lse,
            delta,
            grad_key,
            grad_value,
            plan.rows,
            bounds,
            mask,
            *args,
            scaling,
            scaling * LOG2E,
            num_blocks,
            **meta,
        )
        return grad_query.transpose(1, 2), grad_key, grad_value, None, None, None, None, None, None


def _common_args(query, key, plan, tokens, heads, head_dim, num_keys, offset, window):
    return (
        query.stride(0),
        query.stride(1),
        query.stride(2),
        key.stride(0),
        key.stride(1),
        key.stride(2),
        *plan.mask_strides,
        key.shape[1],
        plan.groups,
        tokens,
        heads,
        head_dim,
        num_keys,
        offset,
        window or 0,
    )


def _meta(plan, query, window, tile, head_dim):
    return dict(
        HAS_MASK=plan.mask is not None,
        CAUSAL_ONLY=plan.mask is None and not window,
        PRECISION=_precision(query.dtype),
        UPCAST=_upcast(query.dtype),
        BLOCK_M=tile.block_m,
        BLOCK_N=tile.block_n,
        BLOCK_D=tile.block_d,
        EVEN_D=tile.block_d == head_dim,
        num_warps=tile.num_warps,
        num_stages=tile.num_stages,
    )


def _mask_arg(plan, query):
    return plan.mask if plan.mask is not None else query  # any pointer: never read without HAS_MASK


def head_sparse_attention_triton(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    gates: torch.Tensor,
    scaling: float,
    attention_mask: torch.Tensor | None = None,
    query_offset: int | None = None,
    sliding_window: int | None = None,
    block_m: int | None = None,
    block_n: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
) -> torch.Tensor:
    """`head_sparse_attention_naive` with the kernels: (B, T, H, hd), attention of the active (token, head) pairs
    times their gates, 0 elsewhere. `block_m` / `block_n` (rows / keys per tile: powers of two, >= 16), `num_warps`,
    `num_stages`: override `tiles`' choice, forward and backward."""
    if not HAS_TRITON:
        raise ImportError("the triton head-sparse attention kernels need triton: `pip install triton`")
    if not query.is_cuda and not interpreting():
        raise ValueError("the triton head-sparse attention kernels run on CUDA tensors (or under TRITON_INTERPRET=1)")
    check_inputs(query, key, value, gates, attention_mask, query_offset)
    tokens, num_keys = query.shape[2], key.shape[2]
    offset = num_keys - tokens if query_offset is None else query_offset
    if sliding_window is not None and sliding_window > offset + tokens - 1:
        sliding_window = None
    active = gates != 0
    settings = dict(block_m=block_m, block_n=block_n, num_warps=num_warps, num_stages=num_stages)
    out = _HeadSparseAttention.apply(
        query, key, value, active, scaling, attention_mask, offset, sliding_window, settings
    )
    # on a GPU the 0/1 test by which `apply_gates` may skip the multiply reads a bool back: a host sync per call,
    # which stops the host from queueing ahead; the multiply (by exact 0s and 1s: the same values) costs one pass
    return apply_gates(out, gates, active, zeroed=not out.is_cuda)
