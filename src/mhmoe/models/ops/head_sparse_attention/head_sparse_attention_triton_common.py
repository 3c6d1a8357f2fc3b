"""The Triton pieces both passes of head-sparse attention share (`head_sparse_attention_triton.py` says what they
compute): a row block's row ids, masks and loads, the scores of a key tile, and which key tiles a row block sees."""

import math

from ..triton_compat import jit as _jit
from ..triton_compat import tl

LOG2E = math.log2(math.e)  # scores are kept in base 2: exp(x) = exp2(x · log2(e))


@_jit
def _rows(rows_ptr, row_ids, real, g, groups, offset):
    """Token, query head and key position (-1 where not real) of the rows `row_ids` (flat slots) of segment g."""
    flat = tl.load(rows_ptr + row_ids, mask=real, other=0)  # t · G + j
    tokens = flat // groups
    heads = g * groups + flat % groups
    return tokens, heads, tl.where(real, tokens + offset, -1)


@_jit
def _row_mask(real, dim_ok, EVEN_D: tl.constexpr):
    """(BLOCK, 1) or (BLOCK, BLOCK_D): the real rows, and the head dims when BLOCK_D pads them."""
    if EVEN_D:
        return real[:, None]
    else:
        return real[:, None] & dim_ok[None, :]


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
def _load_pairs(ptr, pair, dims, row_mask, head_dim, UPCAST: tl.constexpr):
    """(BLOCK_M, BLOCK_D) rows `pair` of a contiguous (B, T, H, hd) tensor."""
    rows = tl.load(ptr + pair[:, None] * head_dim + dims[None, :], mask=row_mask, other=0.0)
    return rows.to(tl.float32) if UPCAST else rows


@_jit
def _load_keys(
    k_seg,
    v_seg,
    kv_offs,
    start,
    stride_kl,
    num_keys,
    dim_ok,
    MASKED: tl.constexpr,
    EVEN_D: tl.constexpr,
    UPCAST: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    """(BLOCK_N, BLOCK_D) keys and values from position `start` of one key/value head (0 past the end). Unmasked
    tiles lie inside the keys: their loads check nothing (unless the head dim is not a power of two)."""
    offs = start * stride_kl + kv_offs
    if MASKED:
        kv_mask = _row_mask((start + tl.arange(0, BLOCK_N)) < num_keys, dim_ok, EVEN_D)
        k, v = tl.load(k_seg + offs, mask=kv_mask, other=0.0), tl.load(v_seg + offs, mask=kv_mask, other=0.0)
    elif EVEN_D:
        k, v = tl.load(k_seg + offs), tl.load(v_seg + offs)
    else:
        k, v = (
            tl.load(k_seg + offs, mask=dim_ok[None, :], other=0.0),
            tl.load(v_seg + offs, mask=dim_ok[None, :], other=0.0),
        )
    if UPCAST:
        k, v = k.to(tl.float32), v.to(tl.float32)
    return k, v


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
    qk_scale,
    MASKED: tl.constexpr,
    HAS_MASK: tl.constexpr,
    PRECISION: tl.constexpr,
):
    """(BLOCK_M, BLOCK_N) scores in base 2; masked tiles: -inf where a key is not visible (causal, window, 4-D mask)."""
    s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * qk_scale
    if MASKED:
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
        s = tl.where(visible, s, float("-inf"))
    return s


@_jit
def _key_tiles(real, positions, num_keys, window, CAUSAL_ONLY: tl.constexpr, BLOCK_N: tl.constexpr):
    """A block of rows in token order: keys [0, full_end) are whole tiles every row sees (causal only: they run
    unmasked; 0 otherwise), [low, last] the tiles some row sees, masked per element (from the first row's window)."""
    last = tl.max(positions)
    first = tl.min(tl.where(real, positions, last))
    if CAUSAL_ONLY:
        full_end = tl.minimum(first + 1, num_keys) // BLOCK_N * BLOCK_N
        low = full_end
    else:
        full_end = first * 0
        low = full_end
        if window > 0:
            low = tl.maximum(first - window + 1, 0) // BLOCK_N * BLOCK_N
    return full_end, low, last
