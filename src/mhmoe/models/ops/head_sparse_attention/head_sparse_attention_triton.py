"""Head-sparse attention in Triton (the CUDA path): flash attention over lists of active query rows, forward and
backward, equal to `head_sparse_attention_naive.py` (the contract and the shape legend are there).

Rows: the active (token, head) pairs of each (batch row, key/value head) segment, in token order (the G query heads
of a key/value head share its keys, so one program's rows may mix them and every K/V tile it loads serves them all).
- forward: one program per BLOCK_M rows of a segment; online softmax over the keys those rows can see (from the
  segment's first row's window start to its last row's position, in BLOCK_N tiles), causal / window / 4-D mask per
  element; writes the output rows into (B, T, H, hd) and each row's log-sum-exp.
- backward: dQ like the forward (one program per row block, the keys in a loop); dK and dV one program per
  (segment, BLOCK_N keys), looping over the segment's rows that can see those keys (found by a binary search on the
  host, `torch.searchsorted`): every gradient written once, no atomics. delta = rowsum(dO · O) in PyTorch.
Inactive pairs are in no row list: no work, no memory traffic. The grids have a static size (row blocks: G·T /
BLOCK_M per segment, programs past a segment's end return at once), so nothing waits on the host besides the rows'
`nonzero`.

Precision: fp32 accumulation and softmax; bf16/fp16 operands go to `tl.dot` as they are, fp32 ones as IEEE fp32
(exact, slower) or TF32 when torch's own fp32 matmuls may (`torch.backends.cuda.matmul.allow_tf32`). Under
TRITON_INTERPRET=1 the dots run in fp32 (numpy has no bf16: `UPCAST`). A 4-D mask is turned into an fp32 additive
(B or 1, T, L) tensor. Compiled ahead for sm_90 by tests/models/ops/head_sparse_attention_gpu_compile.py; tested
against the reference under the interpreter; not yet run on a GPU.

Imports without triton (exported checkpoints): the kernels are then plain functions, never launched.
"""

import torch

from ..triton_compat import HAS_TRITON, interpreting, tl, triton  # noqa: F401  (HAS_TRITON: re-exported)
from ..triton_compat import jit as _jit
from .head_sparse_attention_naive import apply_gates, check_inputs


@_jit
def _rows_block(rows_t_ptr, rows_h_ptr, segments_ptr, offset, BLOCK_M: tl.constexpr):
    """This program's rows: token, head, key position (-1 past the segment's end) and whether any is real."""
    segment = tl.program_id(1)
    seg_start = tl.load(segments_ptr + segment)
    seg_end = tl.load(segments_ptr + segment + 1)
    rows = seg_start + tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    real = rows < seg_end
    tokens = tl.load(rows_t_ptr + rows, mask=real, other=0)
    heads = tl.load(rows_h_ptr + rows, mask=real, other=0)
    positions = tl.where(real, tokens + offset, -1)
    return rows, real, tokens, heads, positions


@_jit
def _load_rows(ptr, b, heads_of, tokens, dims, row_mask, stride_b, stride_h, stride_t, UPCAST: tl.constexpr):
    """(BLOCK_M, BLOCK_D) rows (b, head, token) of a (B, H, T, hd) tensor given by its strides."""
    offs = (
        b.to(tl.int64) * stride_b
        + heads_of[:, None].to(tl.int64) * stride_h
        + tokens[:, None].to(tl.int64) * stride_t
        + dims[None, :]
    )
    rows = tl.load(ptr + offs, mask=row_mask, other=0.0)
    return rows.to(tl.float32) if UPCAST else rows


@_jit
def _load_keys(k_ptr, v_ptr, kv_base, keys, stride_kl, dims, num_keys, dim_ok, UPCAST: tl.constexpr):
    """(BLOCK_N, BLOCK_D) keys and values at positions `keys` of one key/value head (0 past the end)."""
    offs = kv_base + keys[:, None].to(tl.int64) * stride_kl + dims[None, :]
    kv_mask = (keys < num_keys)[:, None] & dim_ok[None, :]
    k, v = tl.load(k_ptr + offs, mask=kv_mask, other=0.0), tl.load(v_ptr + offs, mask=kv_mask, other=0.0)
    if UPCAST:
        k, v = k.to(tl.float32), v.to(tl.float32)
    return k, v


@_jit
def _key_range(real, positions, window, BLOCK_N: tl.constexpr):
    """[low, last]: the keys a block of rows in token order can see (from the first row's window, tile-aligned)."""
    last = tl.max(positions)
    first = tl.min(tl.where(real, positions, last))
    low = first * 0
    if window > 0:
        low = tl.maximum(first - window + 1, 0) // BLOCK_N * BLOCK_N
    return low, last


@_jit
def _scores(
    q,
    k,
    tokens,
    positions,
    keys,
    num_keys,
    window,
    mask_ptr,
    stride_mb,
    stride_mt,
    b,
    scale,
    HAS_MASK: tl.constexpr,
    PRECISION: tl.constexpr,
):
    """(BLOCK_M, BLOCK_N) scaled scores, -inf where a key is not visible (causal, window, 4-D mask)."""
    s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale
    visible = (keys[None, :] <= positions[:, None]) & (keys[None, :] < num_keys)
    if window > 0:
        visible &= keys[None, :] > positions[:, None] - window
    if HAS_MASK:
        given = tl.load(
            mask_ptr + b.to(tl.int64) * stride_mb + tokens[:, None].to(tl.int64) * stride_mt + keys[None, :],
            mask=visible,
            other=0.0,
        )
        s += given
    return tl.where(visible, s, float("-inf"))


@_jit
def _forward_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    o_ptr,
    lse_ptr,
    rows_t_ptr,
    rows_h_ptr,
    segments_ptr,
    mask_ptr,
    stride_qb,
    stride_qh,
    stride_qt,
    stride_kb,
    stride_kh,
    stride_kl,
    stride_mb,
    stride_mt,
    kv_heads,
    tokens_total,
    heads,
    head_dim,
    num_keys,
    offset,
    window,
    scale,
    HAS_MASK: tl.constexpr,
    PRECISION: tl.constexpr,
    UPCAST: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    rows, real, tokens, heads_of, positions = _rows_block(rows_t_ptr, rows_h_ptr, segments_ptr, offset, BLOCK_M)
    if tl.max(real.to(tl.int32)) == 0:
        return
    segment = tl.program_id(1)
    b, g = segment // kv_heads, segment % kv_heads
    dims = tl.arange(0, BLOCK_D)
    dim_ok = dims < head_dim
    row_mask = real[:, None] & dim_ok[None, :]
    q = _load_rows(q_ptr, b, heads_of, tokens, dims, row_mask, stride_qb, stride_qh, stride_qt, UPCAST)
    kv_base = b.to(tl.int64) * stride_kb + g.to(tl.int64) * stride_kh
    low, last = _key_range(real, positions, window, BLOCK_N)
    m_i = tl.full((BLOCK_M,), float("-inf"), tl.float32)
    l_i = tl.zeros((BLOCK_M,), tl.float32)
    acc = tl.zeros((BLOCK_M, BLOCK_D), tl.float32)
    for start in range(low, last + 1, BLOCK_N):
        keys = start + tl.arange(0, BLOCK_N)
        k, v = _load_keys(k_ptr, v_ptr, kv_base, keys, stride_kl, dims, num_keys, dim_ok, UPCAST)
        s = _scores(
            q,
            k,
            tokens,
            positions,
            keys,
            num_keys,
            window,
            mask_ptr,
            stride_mb,
            stride_mt,
            b,
            scale,
            HAS_MASK,
            PRECISION,
        )
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows that have seen no key yet
        p = tl.exp(s - m_safe[:, None])
        alpha = tl.exp(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        m_i = m_new
    l_safe = tl.where(l_i == 0.0, 1.0, l_i)
    out = acc / l_safe[:, None]
    o_offs = ((b.to(tl.int64) * tokens_total + tokens[:, None]) * heads + heads_of[:, None]) * head_dim + dims[None, :]
    tl.store(o_ptr + o_offs, out.to(o_ptr.dtype.element_ty), mask=row_mask)
    tl.store(lse_ptr + rows, m_i + tl.log(l_safe), mask=real)


@_jit
def _dq_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    do_ptr,
    lse_ptr,
    delta_ptr,
    dq_ptr,
    rows_t_ptr,
    rows_h_ptr,
    segments_ptr,
    mask_ptr,
    stride_qb,
    stride_qh,
    stride_qt,
    stride_kb,
    stride_kh,
    stride_kl,
    stride_mb,
    stride_mt,
    kv_heads,
    tokens_total,
    heads,
    head_dim,
    num_keys,
    offset,
    window,
    scale,
    HAS_MASK: tl.constexpr,
    PRECISION: tl.constexpr,
    UPCAST: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    rows, real, tokens, heads_of, positions = _rows_block(rows_t_ptr, rows_h_ptr, segments_ptr, offset, BLOCK_M)
    if tl.max(real.to(tl.int32)) == 0:
        return
    segment = tl.program_id(1)
    b, g = segment // kv_heads, segment % kv_heads
    dims = tl.arange(0, BLOCK_D)
    dim_ok = dims < head_dim
    row_mask = real[:, None] & dim_ok[None, :]
    q = _load_rows(q_ptr, b, heads_of, tokens, dims, row_mask, stride_qb, stride_qh, stride_qt, UPCAST)
    pair = (b.to(tl.int64) * tokens_total + tokens) * heads + heads_of  # (BLOCK_M,) in (B, T, H)
    do = tl.load(do_ptr + pair[:, None] * head_dim + dims[None, :], mask=row_mask, other=0.0)
    if UPCAST:
        do = do.to(tl.float32)
    lse = tl.load(lse_ptr + rows, mask=real, other=0.0)
    delta = tl.load(delta_ptr + pair, mask=real, other=0.0)
    kv_base = b.to(tl.int64) * stride_kb + g.to(tl.int64) * stride_kh
    low, last = _key_range(real, positions, window, BLOCK_N)
    dq = tl.zeros((BLOCK_M, BLOCK_D), tl.float32)
    for start in range(low, last + 1, BLOCK_N):
        keys = start + tl.arange(0, BLOCK_N)
        k, v = _load_keys(k_ptr, v_ptr, kv_base, keys, stride_kl, dims, num_keys, dim_ok, UPCAST)
        s = _scores(
            q,
            k,
            tokens,
            positions,
            keys,
            num_keys,
            window,
            mask_ptr,
            stride_mb,
            stride_mt,
            b,
            scale,
            HAS_MASK,
            PRECISION,
        )
        p = tl.exp(s - lse[:, None])  # 0 where not visible
        dp = tl.dot(do, tl.trans(v), input_precision=PRECISION)
        ds = p * (dp - delta[:, None])
        dq += tl.dot(ds.to(k.dtype), k, input_precision=PRECISION)
    tl.store(dq_ptr + pair[:, None] * head_dim + dims[None, :], (dq * scale).to(dq_ptr.dtype.element_ty), mask=row_mask)


@_jit
def _dkdv_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    do_ptr,
    lse_ptr,
    delta_ptr,
    dk_ptr,
    dv_ptr,
    rows_t_ptr,
    rows_h_ptr,
    bounds_ptr,
    mask_ptr,
    stride_qb,
    stride_qh,
    stride_qt,
    stride_kb,
    stride_kh,
    stride_kl,
    stride_mb,
    stride_mt,
    kv_heads,
    tokens_total,
    heads,
    head_dim,
    num_keys,
    offset,
    window,
    scale,
    num_key_blocks,
    HAS_MASK: tl.constexpr,
    PRECISION: tl.constexpr,
    UPCAST: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    key_block = tl.program_id(0)
    segment = tl.program_id(1)
    b, g = segment // kv_heads, segment % kv_heads
    dims = tl.arange(0, BLOCK_D)
    dim_ok = dims < head_dim
    keys = key_block * BLOCK_N + tl.arange(0, BLOCK_N)
    kv_mask = (keys < num_keys)[:, None] & dim_ok[None, :]
    k, v = _load_keys(
        k_ptr,
        v_ptr,
        b.to(tl.int64) * stride_kb + g.to(tl.int64) * stride_kh,
        keys,
        stride_kl,
        dims,
        num_keys,
        dim_ok,
        UPCAST,
    )
    dk = tl.zeros((BLOCK_N, BLOCK_D), tl.float32)
    dv = tl.zeros((BLOCK_N, BLOCK_D), tl.float32)
    bound = (segment.to(tl.int64) * num_key_blocks + key_block) * 2
    row_start = tl.load(bounds_ptr + bound)  # the segment's rows that can see one of these keys
    row_end = tl.load(bounds_ptr + bound + 1)
    for start in range(row_start, row_end, BLOCK_M):
        rows = start + tl.arange(0, BLOCK_M)
        real = rows < row_end
        tokens = tl.load(rows_t_ptr + rows, mask=real, other=0)
        heads_of = tl.load(rows_h_ptr + rows, mask=real, other=0)
        positions = tl.where(real, tokens + offset, -1)
        row_mask = real[:, None] & dim_ok[None, :]
        q = _load_rows(q_ptr, b, heads_of, tokens, dims, row_mask, stride_qb, stride_qh, stride_qt, UPCAST)
        pair = (b.to(tl.int64) * tokens_total + tokens) * heads + heads_of
        do = tl.load(do_ptr + pair[:, None] * head_dim + dims[None, :], mask=row_mask, other=0.0)
        if UPCAST:
            do = do.to(tl.float32)
        lse = tl.load(lse_ptr + rows, mask=real, other=0.0)
        delta = tl.load(delta_ptr + pair, mask=real, other=0.0)
        s = _scores(
            q,
            k,
            tokens,
            positions,
            keys,
            num_keys,
            window,
            mask_ptr,
            stride_mb,
            stride_mt,
            b,
            scale,
            HAS_MASK,
            PRECISION,
        )  # (BLOCK_M, BLOCK_N)
        p = tl.exp(s - lse[:, None])
        dv += tl.dot(tl.trans(p).to(do.dtype), do, input_precision=PRECISION)
        dp = tl.dot(do, tl.trans(v), input_precision=PRECISION)
        ds = p * (dp - delta[:, None])
        dk += tl.dot(tl.trans(ds).to(q.dtype), q, input_precision=PRECISION)
    out_offs = (segment.to(tl.int64) * num_keys + keys[:, None]) * head_dim + dims[None, :]  # (B·Hkv, L, hd)
    tl.store(dk_ptr + out_offs, (dk * scale).to(dk_ptr.dtype.element_ty), mask=kv_mask)
    tl.store(dv_ptr + out_offs, dv.to(dv_ptr.dtype.element_ty), mask=kv_mask)


# ---------------------------------------------------------------------------------------------------------------------
# launch


def _next_power_of_2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


def _upcast(dtype: torch.dtype) -> bool:
    """The interpreter cannot multiply bf16/fp16 (numpy): there the tiles are converted to fp32 after loading."""
    return interpreting() and dtype in (torch.bfloat16, torch.float16)


def _precision(dtype: torch.dtype) -> str:
    if dtype == torch.float32 and not interpreting() and torch.backends.cuda.matmul.allow_tf32:
        return "tf32"
    return "ieee"


class _Plan:
    """The row lists: `tokens`, `heads` (N,) int32 in (batch row, key/value head, token, head) order, `segments`
    (B·Hkv + 1,) int32 row offsets, `positions` (N,) int64 (key positions), and the mask as kernel arguments."""

    def __init__(self, active, kv_heads, offset, attention_mask, num_keys):
        batch, tokens, heads = active.shape
        groups = heads // kv_heads
        rows = active.view(batch, tokens, kv_heads, groups).permute(0, 2, 1, 3).nonzero()  # (N, 4): b, g, t, j
        b, g, t, j = rows.unbind(1)
        segment = b * kv_heads + g
        counts = torch.bincount(segment, minlength=batch * kv_heads)
        self.segments = torch.zeros(batch * kv_heads + 1, dtype=torch.int32, device=active.device)
        self.segments[1:] = counts.cumsum(0)
        self.tokens, self.heads = t.to(torch.int32), (g * groups + j).to(torch.int32)
        self.segment_of = segment
        self.positions = t + offset
        self.num_rows = rows.shape[0]
        self.mask, self.mask_strides = None, (0, 0)
        if attention_mask is not None:
            given = attention_mask[:, 0, :, :num_keys]
            if given.dtype == torch.bool:
                mask = torch.zeros(given.shape, dtype=torch.float32, device=given.device)
                mask = mask.masked_fill(~given, torch.finfo(torch.float32).min)
            else:
                mask = given.float().clamp_min(torch.finfo(torch.float32).min)
            self.mask = mask.contiguous()
            self.mask_strides = (self.mask.stride(0) if self.mask.shape[0] > 1 else 0, self.mask.stride(1))

    def key_block_bounds(self, num_keys, block_n, window):
        """(B·Hkv, key blocks, 2) int32: per segment and key block the rows [start, end) that can see a key of the
        block (position >= its first key, and within the window of its last key)."""
        num_blocks = -(-num_keys // block_n)
        stride = num_keys + 1
        order = self.segment_of * stride + self.positions  # non-decreasing
        segments = self.segments.shape[0] - 1
        seg = torch.arange(segments, device=order.device)[:, None] * stride
        first_key = torch.arange(num_blocks, device=order.device)[None, :] * block_n
        last_key = torch.clamp(first_key + block_n - 1, max=num_keys - 1)
        start = torch.searchsorted(order, seg + first_key)
        if window:
            end = torch.searchsorted(order, seg + torch.clamp(last_key + window, max=num_keys))
        else:
            end = torch.searchsorted(order, seg + num_keys)
        return torch.stack([start, torch.maximum(start, end)], dim=-1).to(torch.int32).contiguous()


def tiles(head_dim: int, dtype: torch.dtype, block_m: int | None = None, block_n: int | None = None):
    """(BLOCK_M, BLOCK_N, BLOCK_D): 64 × 64 tiles, 32 × 32 for fp32 beyond 64 dims (so that the pipelined tiles fit
    an H100's shared memory: checked by head_sparse_attention_gpu_compile.py)."""
    block_d = max(16, _next_power_of_2(head_dim))
    default = 32 if dtype == torch.float32 and block_d > 64 else 64
    return block_m or default, block_n or default, block_d


class _HeadSparseAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, query, key, value, active, scaling, attention_mask, offset, window, block_m, block_n):
        batch, heads, tokens, head_dim = query.shape
        kv_heads, num_keys = key.shape[1], key.shape[2]
        key, value = key.contiguous(), value.contiguous()
        if query.stride(-1) != 1:
            query = query.contiguous()
        plan = _Plan(active, kv_heads, offset, attention_mask, num_keys)
        block_m, block_n, block_d = tiles(head_dim, query.dtype, block_m, block_n)
        out = query.new_zeros(batch, tokens, heads, head_dim)
        lse = torch.empty(plan.num_rows, dtype=torch.float32, device=query.device)
        groups = heads // kv_heads
        grid = (triton.cdiv(groups * tokens, block_m), batch * kv_heads)
        args = _common_args(query, key, plan, tokens, heads, head_dim, num_keys, offset, window, scaling)
        if plan.num_rows:
            _forward_kernel[grid](
                query,
                key,
                value,
                out,
                lse,
                plan.tokens,
                plan.heads,
                plan.segments,
                _mask_arg(plan, query),
                *args,
                HAS_MASK=plan.mask is not None,
                PRECISION=_precision(query.dtype),
                UPCAST=_upcast(query.dtype),
                BLOCK_M=block_m,
                BLOCK_N=block_n,
                BLOCK_D=block_d,
            )
        ctx.save_for_backward(query, key, value, out, lse)
        ctx.plan, ctx.settings = plan, (scaling, offset, window, block_m, block_n, block_d)
        return out

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_out):
        query, key, value, out, lse = ctx.saved_tensors
        plan = ctx.plan
        scaling, offset, window, block_m, block_n, block_d = ctx.settings
        batch, heads, tokens, head_dim = query.shape
        kv_heads, num_keys = key.shape[1], key.shape[2]
        grad_out = grad_out.contiguous()
        delta = (grad_out.float() * out.float()).sum(-1)  # (B, T, H)
        grad_query = torch.zeros(batch, tokens, heads, head_dim, dtype=query.dtype, device=query.device)
        grad_key = torch.zeros_like(key)
        grad_value = torch.zeros_like(value)
        if plan.num_rows:
            args = _common_args(query, key, plan, tokens, heads, head_dim, num_keys, offset, window, scaling)
            meta = dict(
                HAS_MASK=plan.mask is not None,
                PRECISION=_precision(query.dtype),
                UPCAST=_upcast(query.dtype),
                BLOCK_M=block_m,
                BLOCK_N=block_n,
                BLOCK_D=block_d,
            )
            groups = heads // kv_heads
            mask = _mask_arg(plan, query)
            _dq_kernel[(triton.cdiv(groups * tokens, block_m), batch * kv_heads)](
                query,
                key,
                value,
                grad_out,
                lse,
                delta,
                grad_query,
                plan.tokens,
                plan.heads,
                plan.segments,
                mask,
                *args,
                **meta,
            )
            num_blocks = triton.cdiv(num_keys, block_n)
            bounds = plan.key_block_bounds(num_keys, block_n, window)
            _dkdv_kernel[(num_blocks, batch * kv_heads)](
                query,
                key,
                value,
                grad_out,
                lse,
                delta,
                grad_key,
                grad_value,
                plan.tokens,
                plan.heads,
                bounds,
                mask,
                *args,
                num_blocks,
                **meta,
            )
        return grad_query.transpose(1, 2), grad_key, grad_value, None, None, None, None, None, None, None


def _common_args(query, key, plan, tokens, heads, head_dim, num_keys, offset, window, scaling):
    return (
        query.stride(0),
        query.stride(1),
        query.stride(2),
        key.stride(0),
        key.stride(1),
        key.stride(2),
        *plan.mask_strides,
        key.shape[1],
        tokens,
        heads,
        head_dim,
        num_keys,
        offset,
        window or 0,
        scaling,
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
) -> torch.Tensor:
    """`head_sparse_attention_naive` with the kernels: (B, T, H, hd), attention of the active (token, head) pairs
    times their gates, 0 elsewhere. `block_m` / `block_n`: rows / keys per tile (powers of two, >= 16; default 64)."""
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
    out = _HeadSparseAttention.apply(
        query, key, value, active, scaling, attention_mask, offset, sliding_window, block_m, block_n
    )
    return apply_gates(out, gates, active)
