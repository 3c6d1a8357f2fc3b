"""Head-sparse attention, plain PyTorch reference: every head computed, inactive (token, head) outputs zeroed.

The contract shared by `head_sparse_attention_cpu.py` (CPU) and `head_sparse_attention_triton.py` (CUDA), which
compute attention only for the active pairs and must equal this function:

    query (B, H, T, hd) post-RoPE, key/value (B, Hkv, L, hd) (the cache included), gates (B, T, H): a (token, head)
    pair is active where its gate is non-zero. Returns (B, T, H, hd): each active pair's attention output times its
    gate, 0 for inactive pairs (ready to flatten for `o_proj`).

Shape legend: B batch, H query heads, Hkv key/value heads, G = H / Hkv heads per key/value head (GQA), T query tokens,
L keys (cache included; a static cache's unused slots too), hd head_dim.

Which keys a query sees: query row t sits at key position `query_offset + t` (default L - T: the queries are the last
T keys, as with a dynamic cache or no cache; a static cache passes its cache position) and sees the keys at positions
<= its own (causal), within the last `sliding_window` positions when given, and where `attention_mask` allows:
a 4-D eager (additive float) or sdpa (boolean, True = visible) mask (B or 1, 1, T, >= L), as Transformers builds
them. The mask must not open a key after the query's position (causal language models never do).

A query row that sees no key at all (a left-padding position) has no defined output: masked softmax over nothing.
Transformers' eager path then averages every value, these functions give 0 (sdpa's choice); both are ignored by the
loss. Tests compare rows that see at least one key.

Gradients: with respect to query, key, value and the active gates, those of the masked computation
(tests/models/moh_reference.py). An inactive pair contributes nothing, so its gate gets no gradient here, where the
masked computation gives it <d out, attention>: only the "scores" straight-through estimator (eq. 9-10, every routed
head's raw score) reads that, and it needs the inactive heads' attention, i.e. the dense path.
"""

import torch


def runs(ids: list[int]) -> list[tuple[int, int]]:
    """Sorted ids -> maximal runs [start, end) of consecutive ids (heads, key/value heads)."""
    found = []
    for i in ids:
        if found and found[-1][1] == i:
            found[-1][1] = i + 1
        else:
            found.append([i, i + 1])
    return [tuple(run) for run in found]


def visible_keys(
    num_queries: int,
    num_keys: int,
    query_offset: int | None = None,
    sliding_window: int | None = None,
    device=None,
) -> torch.Tensor:
    """(T, L) bool: which keys each query row sees by position alone (causal, optional sliding window)."""
    offset = num_keys - num_queries if query_offset is None else query_offset
    query_pos = torch.arange(num_queries, device=device)[:, None] + offset
    key_pos = torch.arange(num_keys, device=device)[None, :]
    visible = key_pos <= query_pos
    if sliding_window is not None:
        visible &= key_pos > query_pos - sliding_window
    return visible


def additive_mask(
    attention_mask: torch.Tensor | None, visible: torch.Tensor, num_keys: int, dtype: torch.dtype
) -> torch.Tensor:
    """(B or 1, 1, T, L) additive mask in `dtype`: 0 where a key is visible, the dtype's minimum elsewhere (as
    Transformers' eager attention); a float `attention_mask`'s own values are added where `visible`."""
    minimum = torch.finfo(dtype).min
    mask = torch.zeros(visible.shape, dtype=dtype, device=visible.device).masked_fill(~visible, minimum)[None, None]
    if attention_mask is None:
        return mask
    attention_mask = attention_mask[..., :num_keys]
    if attention_mask.dtype == torch.bool:
        return mask.masked_fill(~attention_mask, minimum)
    return (mask + attention_mask.to(dtype)).clamp_min(minimum)


def check_inputs(query, key, value, gates, attention_mask, query_offset) -> None:
    """One-line errors for shapes that do not fit the contract."""
    if query.dim() != 4 or key.dim() != 4 or key.shape != value.shape:
        raise ValueError(
            f"need query (B, H, T, hd) and key/value (B, Hkv, L, hd) of equal shapes, got query "
            f"{tuple(query.shape)}, key {tuple(key.shape)}, value {tuple(value.shape)}"
        )
    batch, heads, tokens, head_dim = query.shape
    if key.shape[0] != batch or key.shape[3] != head_dim or heads % key.shape[1]:
        raise ValueError(
            f"key/value {tuple(key.shape)} do not fit query {tuple(query.shape)}: same batch and "
            "head_dim, and the query heads a multiple of the key/value heads"
        )
    if gates.shape != (batch, tokens, heads):
        raise ValueError(f"gates must be (B, T, H) = {(batch, tokens, heads)}, got {tuple(gates.shape)}")
    offset = key.shape[2] - tokens if query_offset is None else query_offset
    if offset < 0 or offset + tokens > key.shape[2]:
        raise ValueError(
            f"queries at positions {offset}..{offset + tokens - 1} do not fit {key.shape[2]} keys "
            "(query_offset: the first query's position in the cache)"
        )
    if attention_mask is not None and (
        attention_mask.dim() != 4
        or attention_mask.shape[2] != tokens
        or attention_mask.shape[0] not in (1, batch)
        or attention_mask.shape[3] < key.shape[2]
    ):
        raise ValueError(
            f"attention_mask must be 4-D (B or 1, 1, T, >= L) = (.., 1, {tokens}, >= {key.shape[2]}), "
            f"got {tuple(attention_mask.shape)}"
        )


def apply_gates(out: torch.Tensor, gates: torch.Tensor, active: torch.Tensor, zeroed: bool = True) -> torch.Tensor:
    """out (B, T, H, hd) times the gates; an inactive gate never gets a gradient. When `zeroed` (out is already 0 on
    the inactive pairs) it is skipped where it changes nothing and passes no gradient: 0/1 gates without gradient
    (straight-through gates at inference)."""
    if (
        zeroed
        and not gates.requires_grad
        and not torch.compiler.is_compiling()
        and bool(((gates == 0) | (gates == 1)).all())
    ):
        return out
    return out * gates.masked_fill(~active, 0).to(out.dtype)[..., None]


def head_sparse_attention_naive(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    gates: torch.Tensor,
    scaling: float,
    attention_mask: torch.Tensor | None = None,
    query_offset: int | None = None,
    sliding_window: int | None = None,
) -> torch.Tensor:
    """Eager attention over every head (as tests/models/moh_reference.py, softmax in fp32), times the gates, 0 on
    inactive pairs: (B, T, H, hd). See the module docstring for the contract."""
    check_inputs(query, key, value, gates, attention_mask, query_offset)
    tokens, num_keys = query.shape[2], key.shape[2]
    groups = query.shape[1] // key.shape[1]
    key = key.repeat_interleave(groups, dim=1)
    value = value.repeat_interleave(groups, dim=1)
    visible = visible_keys(tokens, num_keys, query_offset, sliding_window, query.device)
    mask = additive_mask(attention_mask, visible, num_keys, query.dtype)
    scores = torch.matmul(query, key.transpose(2, 3)) * scaling + mask  # (B, H, T, L)
    probs = torch.softmax(scores, dim=-1, dtype=torch.promote_types(query.dtype, torch.float32)).to(query.dtype)
    heads_out = torch.matmul(probs, value).transpose(1, 2)  # (B, T, H, hd)
    active = gates != 0
    return heads_out * gates.masked_fill(~active, 0).to(query.dtype)[..., None]  # (no skipping: the reference)
