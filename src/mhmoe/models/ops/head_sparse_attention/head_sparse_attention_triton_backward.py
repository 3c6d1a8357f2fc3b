"""The backward kernels of head-sparse attention in Triton: dQ (with each row's delta) one program per row block, dK
and dV one program per (segment, key block) over the rows that see it (`head_sparse_attention_triton.py`)."""

from ..triton_compat import jit as _jit
from ..triton_compat import tl
from .head_sparse_attention_triton_common import (
    _key_tiles,
    _load_keys,
    _load_pairs,
    _load_rows,
    _row_mask,
    _rows,
    _scores,
)


@_jit
def _dq_tile(
    dq,
    q,
    do,
    lse,
    delta,
    k_seg,
    v_seg,
    kv_offs,
    start,
    stride_kl,
    num_keys,
    dim_ok,
    tokens,
    positions,
    window,
    mask_ptr,
    stride_mb,
    stride_mt,
    b,
    qk_scale,
    MASKED: tl.constexpr,
    HAS_MASK: tl.constexpr,
    PRECISION: tl.constexpr,
    EVEN_D: tl.constexpr,
    UPCAST: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    k, v = _load_keys(k_seg, v_seg, kv_offs, start, stride_kl, num_keys, dim_ok, MASKED, EVEN_D, UPCAST, BLOCK_N)
    keys = start + tl.arange(0, BLOCK_N)
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
        qk_scale,
        MASKED,
        HAS_MASK,
        PRECISION,
    )
    p = tl.exp2(s - lse[:, None])  # 0 where not visible
    dp = tl.dot(do, tl.trans(v), input_precision=PRECISION)
    ds = p * (dp - delta[:, None])
    return dq + tl.dot(ds.to(k.dtype), k, input_precision=PRECISION)


@_jit
def _dq_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    o_ptr,
    do_ptr,
    lse_ptr,
    delta_ptr,
    dq_ptr,
    rows_ptr,
    counts_ptr,
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
    groups,
    tokens_total,
    heads,
    head_dim,
    num_keys,
    offset,
    window,
    scale,
    qk_scale,
    HAS_MASK: tl.constexpr,
    CAUSAL_ONLY: tl.constexpr,
    PRECISION: tl.constexpr,
    UPCAST: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    EVEN_D: tl.constexpr,
):
    """dQ of a block of rows, and their delta = rowsum(dO · O) (stored for the dK/dV kernel)."""
    segment = tl.program_id(1)
    count = tl.load(counts_ptr + segment)
    if tl.program_id(0) * BLOCK_M >= count:
        return
    b, g = segment // kv_heads, segment % kv_heads
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    real = rows < count
    row_ids = segment * groups * tokens_total + rows
    tokens, heads_of, positions = _rows(rows_ptr, row_ids, real, g, groups, offset)
    dims = tl.arange(0, BLOCK_D)
    dim_ok = dims < head_dim
    row_mask = _row_mask(real, dim_ok, EVEN_D)
    q = _load_rows(q_ptr, b, heads_of, tokens, dims, row_mask, stride_qb, stride_qh, stride_qt, UPCAST)
    pair = (b.to(tl.int64) * tokens_total + tokens) * heads + heads_of  # (BLOCK_M,) in (B, T, H)
    do = _load_pairs(do_ptr, pair, dims, row_mask, head_dim, UPCAST)
    o = _load_pairs(o_ptr, pair, dims, row_mask, head_dim, UPCAST)
    delta = tl.sum(do.to(tl.float32) * o.to(tl.float32), axis=1)
    tl.store(delta_ptr + row_ids, delta, mask=real)
    lse = tl.load(lse_ptr + row_ids, mask=real, other=0.0)
    kv_base = b.to(tl.int64) * stride_kb + g.to(tl.int64) * stride_kh
    k_seg, v_seg = k_ptr + kv_base, v_ptr + kv_base
    kv_offs = tl.arange(0, BLOCK_N)[:, None] * stride_kl + dims[None, :]
    full_end, low, last = _key_tiles(real, positions, num_keys, window, CAUSAL_ONLY, BLOCK_N)
    dq = tl.zeros((BLOCK_M, BLOCK_D), tl.float32)
    for phase in tl.static_range(2):  # 0: keys [0, full_end), unmasked; 1: keys [low, last], masked
        if phase == 0:
            lo, hi = 0, full_end
        else:
            lo, hi = low, last + 1
        for start in range(lo, hi, BLOCK_N):
            dq = _dq_tile(
                dq,
                q,
                do,
                lse,
                delta,
                k_seg,
                v_seg,
                kv_offs,
                start,
                stride_kl,
                num_keys,
                dim_ok,
                tokens,
                positions,
                window,
                mask_ptr,
                stride_mb,
                stride_mt,
                b,
                qk_scale,
                phase == 1,
                HAS_MASK,
                PRECISION,
                EVEN_D,
                UPCAST,
                BLOCK_N,
            )
    tl.store(dq_ptr + pair[:, None] * head_dim + dims[None, :], (dq * scale).to(dq_ptr.dtype.element_ty), mask=row_mask)


@_jit
def _dkdv_row_ranges(bounds_ptr, segment, key_block, num_key_blocks, CAUSAL_ONLY: tl.constexpr):
    """The segment's rows that can see one of the key block's keys, [start, end), and `full`: from there on (causal
    only) they see every key of the block; without causal-only attention every row is masked (full = end)."""
    bound = (segment.to(tl.int64) * num_key_blocks + key_block) * 3
    row_start = tl.load(bounds_ptr + bound)
    row_end = tl.load(bounds_ptr + bound + 2)
    row_full = row_end
    if CAUSAL_ONLY:
        row_full = tl.load(bounds_ptr + bound + 1)
    return row_start, row_full, row_end


@_jit
def _dkdv_rows(
    k,
    v,
    keys,
    row_start,
    row_full,
    row_end,
    segment_slots,
    b,
    g,
    q_ptr,
    do_ptr,
    lse_ptr,
    delta_ptr,
    rows_ptr,
    mask_ptr,
    stride_qb,
    stride_qh,
    stride_qt,
    stride_mb,
    stride_mt,
    groups,
    tokens_total,
    heads,
    head_dim,
    num_keys,
    offset,
    window,
    qk_scale,
    dims,
    dim_ok,
    HAS_MASK: tl.constexpr,
    PRECISION: tl.constexpr,
    UPCAST: tl.constexpr,
    EVEN_D: tl.constexpr,
    BLOCK_M: tl.constexpr,
):
    """dK and dV of one key block, accumulated over the rows [row_start, row_end) of its segment in two phases: rows
    [row_start, row_full) see part of the block (masked per element), rows [row_full, row_end) all of it (unmasked).
    Rows past a phase's end load zeros: q = dO = 0, so they add nothing."""
    dk = tl.zeros(k.shape, tl.float32)
    dv = tl.zeros(k.shape, tl.float32)
    for phase in tl.static_range(2):
        if phase == 0:
            lo, hi = row_start, row_full
        else:
            lo, hi = row_full, row_end
        for start in range(lo, hi, BLOCK_M):
            rows = start + tl.arange(0, BLOCK_M)
            real = rows < hi
            row_ids = segment_slots + rows
            tokens, heads_of, positions = _rows(rows_ptr, row_ids, real, g, groups, offset)
            row_mask = _row_mask(real, dim_ok, EVEN_D)
            q = _load_rows(q_ptr, b, heads_of, tokens, dims, row_mask, stride_qb, stride_qh, stride_qt, UPCAST)
            pair = (b.to(tl.int64) * tokens_total + tokens) * heads + heads_of
            do = _load_pairs(do_ptr, pair, dims, row_mask, head_dim, UPCAST)
            lse = tl.load(lse_ptr + row_ids, mask=real, other=0.0)
            delta = tl.load(delta_ptr + row_ids, mask=real, other=0.0)
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
                qk_scale,
                phase == 0,
                HAS_MASK,
                PRECISION,
            )  # (BLOCK_M, BLOCK_N)
            p = tl.exp2(s - lse[:, None])
            dv += tl.dot(tl.trans(p).to(do.dtype), do, input_precision=PRECISION)
            dp = tl.dot(do, tl.trans(v), input_precision=PRECISION)
            ds = p * (dp - delta[:, None])
            dk += tl.dot(tl.trans(ds).to(q.dtype), q, input_precision=PRECISION)
    return dk, dv


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
    rows_ptr,
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
    groups,
    tokens_total,
    heads,
    head_dim,
    num_keys,
    offset,
    window,
    scale,
    qk_scale,
    num_key_blocks,
    HAS_MASK: tl.constexpr,
    CAUSAL_ONLY: tl.constexpr,
    PRECISION: tl.constexpr,
    UPCAST: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    EVEN_D: tl.constexpr,
):
    key_block = tl.program_id(0)
    segment = tl.program_id(1)
    b, g = segment // kv_heads, segment % kv_heads
    dims = tl.arange(0, BLOCK_D)
    dim_ok = dims < head_dim
    start = key_block * BLOCK_N
    keys = start + tl.arange(0, BLOCK_N)
    kv_mask = _row_mask(keys < num_keys, dim_ok, EVEN_D)
    kv_base = b.to(tl.int64) * stride_kb + g.to(tl.int64) * stride_kh
    k_seg, v_seg = k_ptr + kv_base, v_ptr + kv_base
    kv_offs = tl.arange(0, BLOCK_N)[:, None] * stride_kl + dims[None, :]
    k, v = _load_keys(k_seg, v_seg, kv_offs, start, stride_kl, num_keys, dim_ok, True, EVEN_D, UPCAST, BLOCK_N)
    row_start, row_full, row_end = _dkdv_row_ranges(bounds_ptr, segment, key_block, num_key_blocks, CAUSAL_ONLY)
    dk, dv = _dkdv_rows(
        k,
        v,
        keys,
        row_start,
        row_full,
        row_end,
        segment * groups * tokens_total,
        b,
        g,
        q_ptr,
        do_ptr,
        lse_ptr,
        delta_ptr,
        rows_ptr,
        mask_ptr,
        stride_qb,
        stride_qh,
        stride_qt,
        stride_mb,
        stride_mt,
        groups,
        tokens_total,
        heads,
        head_dim,
        num_keys,
        offset,
        window,
        qk_scale,
        dims,
        dim_ok,
        HAS_MASK,
        PRECISION,
        UPCAST,
        EVEN_D,
        BLOCK_M,
    )
    out_offs = (segment.to(tl.int64) * num_keys + keys[:, None]) * head_dim + dims[None, :]  # (B·Hkv, L, hd)
    tl.store(dk_ptr + out_offs, (dk * scale).to(dk_ptr.dtype.element_ty), mask=kv_mask)
    tl.store(dv_ptr + out_offs, dv.to(dv_ptr.dtype.element_ty), mask=kv_mask)
