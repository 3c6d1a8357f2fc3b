"""The forward kernel of head-sparse attention in Triton: online softmax over the key tiles each row block sees
(`head_sparse_attention_triton.py` says how the loop splits and what it writes)."""

from ..triton_compat import jit as _jit
from ..triton_compat import tl
from .head_sparse_attention_triton_common import _key_tiles, _load_keys, _load_rows, _row_mask, _rows, _scores


@_jit
def _forward_tile(
    acc,
    m_i,
    l_i,
    q,
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
    """One step of the online softmax over the keys from `start`."""
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
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    if MASKED:
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows that have seen no key yet
    else:
        m_safe = m_new
    p = tl.exp2(s - m_safe[:, None])
    alpha = tl.exp2(m_i - m_safe)
    l_i = l_i * alpha + tl.sum(p, axis=1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
    return acc, m_new, l_i


@_jit
def _forward_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    o_ptr,
    lse_ptr,
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
    segment = tl.program_id(1)
    count = tl.load(counts_ptr + segment)
    if tl.program_id(0) * BLOCK_M >= count:  # past the segment's rows (the grid is sized for every head active)
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
    kv_base = b.to(tl.int64) * stride_kb + g.to(tl.int64) * stride_kh
    k_seg, v_seg = k_ptr + kv_base, v_ptr + kv_base
    kv_offs = tl.arange(0, BLOCK_N)[:, None] * stride_kl + dims[None, :]
    full_end, low, last = _key_tiles(real, positions, num_keys, window, CAUSAL_ONLY, BLOCK_N)
    m_i = tl.full((BLOCK_M,), float("-inf"), tl.float32)
    l_i = tl.zeros((BLOCK_M,), tl.float32)
    acc = tl.zeros((BLOCK_M, BLOCK_D), tl.float32)
    for phase in tl.static_range(2):  # 0: keys [0, full_end), unmasked; 1: keys [low, last], masked
        if phase == 0:
            lo, hi = 0, full_end
        else:
            lo, hi = low, last + 1
        for start in range(lo, hi, BLOCK_N):
            acc, m_i, l_i = _forward_tile(
                acc,
                m_i,
                l_i,
                q,
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
    l_safe = tl.where(l_i == 0.0, 1.0, l_i)
    out = acc / l_safe[:, None]
    o_offs = ((b.to(tl.int64) * tokens_total + tokens[:, None]) * heads + heads_of[:, None]) * head_dim + dims[None, :]
    tl.store(o_ptr + o_offs, out.to(o_ptr.dtype.element_ty), mask=row_mask)
    tl.store(lse_ptr + row_ids, m_i + tl.log2(l_safe), mask=real)
