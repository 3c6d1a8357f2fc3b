"""A MoH decoding step's attention (the CPU decoding step, `models/moh/fused_decoding.py`): one new query token per
sequence for the query heads of some key/value heads, through torch's SDPA, reading only the key/value heads asked for.

Shape legend: B batch, n attended query heads (g per key/value head, whole GQA groups), m = n / g their key/value heads,
L cached keys, hd head_dim. Runs on torch alone: exported checkpoints ship it.
"""

import torch
import torch.nn.functional as F


def head_sparse_decode_sdpa(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    scaling: float,
    attention_mask: torch.Tensor | None = None,
    kv_runs: tuple | None = None,
) -> torch.Tensor:
    """query (B, n, hd), key/value (B, m, L, hd) -> (B, n, hd). `kv_runs`: None (one call over the m key/value heads)
    or the runs ((start, end), ...) of those to read, one call each: the heads of the others are 0 (and must be unused
    by the caller: their gates are 0). `attention_mask`: None or (B, 1, 1, L) additive/boolean."""
    if kv_runs is None:
        return _attend(query, key, value, scaling, attention_mask)
    groups = query.shape[1] // key.shape[1]
    out = query.new_zeros(query.shape)
    for start, end in kv_runs:  # (B, (end - start)·g, hd) each
        heads = slice(start * groups, end * groups)
        out[:, heads] = _attend(query[:, heads], key[:, start:end], value[:, start:end], scaling, attention_mask)
    return out


def _attend(query, key, value, scaling, attention_mask):
    batch, heads, head_dim = query.shape
    if attention_mask is None:  # SDPA's own GQA (as Transformers' sdpa path): faster than packing without a mask
        queries = query.view(batch, heads, 1, head_dim)  # (B, n, 1, hd)
        attended = F.scaled_dot_product_attention(queries, key, value, scale=scaling, enable_gqa=True)
    else:  # GQA packed (a key/value head's query heads as its query rows), the mask broadcast over them
        queries = query.reshape(batch, key.shape[1], heads // key.shape[1], head_dim)  # (B, m, g, hd)
        attended = F.scaled_dot_product_attention(queries, key, value, attn_mask=attention_mask, scale=scaling)
    return attended.reshape(batch, heads, head_dim)
