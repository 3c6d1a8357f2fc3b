"""Head skipping: MoH attention computed only for the active (token, head) pairs, the fast path of
`moh_attention.attention_forward` in prefill, training and decoding.

`head_skipping_backend` decides whether a call takes it (by default only where it pays: `head_sparse_pays`); the
work is `ops/backends.head_sparse_attention`: the CPU path on CPU (torch's flash kernel on the active rows per
key/value head; decoding packed per key/value head), the Triton kernels on CUDA when asked
(`moh_head_skipping="triton"`; off the CPU the default is the masked path), the naive reference when asked. Its output
(B, T, H, hd) goes to the full `o_proj` (inactive heads are 0). It equals the masked computation
(`masked_heads_attention`, tested), outputs and gradients. `module.moh_head_skipping`: True (default backend where it
pays), False (every head computed and masked: any attention backend) or a backend name ("naive", "cpu", "triton":
always).

`skipped_heads_attention` is the earlier CPU decoding loop (per query row, runs of active heads, each with its block of
`o_proj`), kept for the benchmarks that compare against it (benchmarks/moh_attention.py, moh_breakdown.py).

Shape legend: B batch, T query tokens, L key/value tokens (cache included), d hidden size, H query heads, Hkv
key/value heads, hd head_dim.
"""

import functools

import torch
import torch.nn.functional as F
from torch import nn

HEAD_SPARSE_MASK_BACKENDS = ("eager", "sdpa")  # attention backends whose masks are None or 4-D tensors
# Where the head-sparse op pays on CPU (benchmarks/head_sparse_layer.py: one SmolLM2-135M layer, 7/9 and 5/9 heads).
# Below PREFILL_MIN_TOKENS query tokens the attention of the inactive heads is a small share of a layer's work and the
# op's bookkeeping costs more than it saves: the masked path runs (the parent's attention, then the gates). Except in
# inference without a mask where at most FEW_ACTIVE_SHARE of the routed heads are active (top-K): there the op pays
# from FEW_ACTIVE_TOKENS[0] to [1] (its short path: masked rows) and from FEW_ACTIVE_TOKENS[2] (its chunked path); in
# between, the parent's kernel switches to its large query blocks and the op's lead at batch 1 is a few percent of the
# attention at best (benchmarks/head_sparse_short.py), within what its gates and bookkeeping cost on a real model. Decoding (up to DECODE_MAX_TOKENS) takes the op only where a key/value head can
# go unread by every active head.
PREFILL_MIN_TOKENS = 2048
FEW_ACTIVE_SHARE = 0.4
FEW_ACTIVE_TOKENS = (384, 768, 1024)
DECODE_MAX_TOKENS = 16


def head_skipping_backend(module, query_states, attention_mask, gates, kwargs) -> str | None | bool:
    """Whether `attention_forward` computes only the active heads, and with which backend: False (every head computed
    and masked), None (the default backend of `ops/backends.py`) or a backend name. It runs in every layer of every
    decoding step: the default's cheap refusals (device, `head_sparse_pays`) come before the config is read."""
    asked = getattr(module, "moh_head_skipping", True)
    if asked is False or torch.compiler.is_compiling():  # traced graphs take the dense path (the op reads the gates)
        return False
    router = module.head_router
    if router.shared_heads + router.active_heads >= router.num_heads:  # every head is active: nothing to skip
        return False
    if query_states.shape[1] != router.num_heads:  # tensor parallel: this rank holds some heads
        return False
    if asked is True:
        # off by default off the CPU: the CPU path calls torch's CPU flash kernel, and the Triton kernels are not in
        # `ops/backends.AUTOMATIC` until a GPU benchmark shows them ahead (benchmarks/gpu_head_sparse.py); ask for
        # moh_head_skipping="triton" to use them
        if query_states.device.type != "cpu":
            return False
        kv_heads = router.num_heads // module.num_key_value_groups
        inference = attention_mask is None and not (query_states.requires_grad or gates.requires_grad)  # no backward
        if not head_sparse_pays(router, query_states.shape[2], kv_heads, inference):
            return False
    if (module.training and module.attention_dropout > 0) or kwargs.get("output_attentions"):
        return False
    if gates.requires_grad and router.straight_through == "scores":  # needs every routed head's attention
        return False
    if module.config._attn_implementation not in HEAD_SPARSE_MASK_BACKENDS:  # flex BlockMask, flash's packing, ...
        return False
    if attention_mask is not None and not (isinstance(attention_mask, torch.Tensor) and attention_mask.dim() == 4):
        return False
    return None if asked is True else asked  # a backend asked for by name runs everywhere


def head_sparse_pays(router, tokens: int, kv_heads: int, inference: bool = False) -> bool:
    """Whether the default backend's head-sparse op is worth its bookkeeping for `tokens` query tokens (see
    PREFILL_MIN_TOKENS): long prefills; with `inference` (no backward, no mask) some shorter ones where few routed
    heads are active; decoding only when some key/value head may be needed by no active head."""
    if tokens >= PREFILL_MIN_TOKENS:
        return True
    if inference and router.threshold is None and router.active_heads <= FEW_ACTIVE_SHARE * router.routed_heads:
        low, high, chunked = FEW_ACTIVE_TOKENS
        if low <= tokens < high or tokens >= chunked:
            return True
    return tokens <= DECODE_MAX_TOKENS and kv_heads_skippable(router, kv_heads)


def kv_heads_skippable(router, kv_heads: int) -> bool:
    """Whether a token's active heads can leave a key/value head unread: a GQA group with no shared head (the first S)
    and at least K routed heads outside it (else every top-K selection takes one of its heads; with a threshold a token
    can take none of them)."""
    active = 0 if router.threshold is not None else router.active_heads
    return _kv_heads_skippable(router.num_heads, router.shared_heads, active, kv_heads)


@functools.lru_cache(maxsize=256)
def _kv_heads_skippable(num_heads: int, shared_heads: int, active_heads: int, kv_heads: int) -> bool:
    groups, routed_heads = num_heads // kv_heads, num_heads - shared_heads
    for first in range(0, num_heads, groups):
        routed_inside = min(groups, max(0, first + groups - shared_heads))
        if first >= shared_heads and routed_heads - routed_inside >= active_heads:
            return True
    return False


def _runs(heads: list[int]) -> list[tuple[int, int]]:
    """Sorted head ids -> maximal runs [start, end) of consecutive ids."""
    runs, start = [], heads[0]
    for prev, head in zip(heads, heads[1:]):
        if head != prev + 1:
            runs.append((start, prev + 1))
            start = head
    runs.append((start, heads[-1] + 1))
    return runs


def _pieces(start: int, end: int, groups: int) -> list[tuple[int, int, int, int]]:
    """Split a run of query heads [start, end) into pieces (q0, q1, kv0, kv1) that attend to one contiguous block of
    key/value heads: whole GQA groups together, a partial group on its own."""
    if groups == 1:
        return [(start, end, start, end)]
    pieces, head = [], start
    while head < end:
        group = head // groups
        if head % groups == 0 and head + groups <= end:
            whole = (end - head) // groups
            pieces.append((head, head + whole * groups, group, group + whole))
            head += whole * groups
        else:
            stop = min(end, (group + 1) * groups)
            pieces.append((head, stop, group, group + 1))
            head = stop
    return pieces


def _mask_row(attention_mask: torch.Tensor | None, b: int, t: int, length: int) -> torch.Tensor | None:
    """Row (b, t) of a 4-D eager (additive float) or sdpa (boolean) mask, shaped (1, 1, 1, length) for sdpa."""
    if attention_mask is None:
        return None
    return attention_mask[b if attention_mask.shape[0] > 1 else 0, 0, t, :length].view(1, 1, 1, length)


def _head_major_weight(o_proj: nn.Linear) -> torch.Tensor:
    """o_proj.weight transposed and contiguous, (H·hd, d), cached on the module (not in the state dict).

    Each head's o_proj input columns become a contiguous block of rows, which a vector-matrix product streams through;
    the column slices of the (d, H·hd) weight are strided and cost more than the full product on CPU. The copy costs
    one o_proj weight per layer of memory and is rebuilt whenever the weight changes (training, loading, `.to()`).
    """
    weight = o_proj.weight
    stamp = (weight.data_ptr(), weight._version, weight.dtype, weight.device)
    cached = getattr(o_proj, "_moh_head_major", None)
    if cached is None or cached[0] != stamp:
        cached = (stamp, weight.detach().t().contiguous())
        o_proj._moh_head_major = cached
    return cached[1]


def skipped_heads_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    gates: torch.Tensor,
    o_proj: nn.Linear,
    scaling: float,
) -> torch.Tensor:
    """Attention + o_proj for the active heads only.

    query (B, H, T, hd) post-RoPE, key/value (B, Hkv, L, hd), gates (B, T, H) with 0 on inactive heads. Returns
    (B, T, d) = o_proj(concat_h gates_h · attention_h). Per query row, the active heads are split into runs of
    consecutive heads; each run attends on a view of the cache (one `scaled_dot_product_attention` per run and GQA
    block: a block's query heads act as query positions of its key/value head) and adds its o_proj contribution from
    a block of the head-major o_proj weight (`_head_major_weight`), so the work and the memory reads scale with the
    active heads. The cache is never copied.
    """
    batch, heads, seq, head_dim = query.shape
    groups = heads // key.shape[1]
    length = key.shape[2]
    weight_t = _head_major_weight(o_proj)  # (H·hd, d)
    gates = gates.to(query.dtype)
    gate_values = gates.tolist()  # one host read; the per-row head lists below are plain Python
    rows = []
    for b in range(batch):
        key_b, value_b = key[b : b + 1], value[b : b + 1]  # (1, Hkv, L, hd)
        for t in range(seq):
            mask = _mask_row(attention_mask, b, t, length)
            query_row = query[b, :, t]  # (H, hd)
            row_gates = gate_values[b][t]
            active = [head for head, gate in enumerate(row_gates) if gate != 0.0]
            weighted = any(row_gates[head] != 1.0 for head in active)  # straight-through gates are 1: no multiply
            acc = o_proj.bias
            for start, end in _runs(active):
                parts = []
                for q0, q1, kv0, kv1 in _pieces(start, end, groups):
                    q = query_row[q0:q1].view(1, kv1 - kv0, -1, head_dim)  # (1, m, n/m, hd)
                    attended = F.scaled_dot_product_attention(
                        q, key_b[:, kv0:kv1], value_b[:, kv0:kv1], attn_mask=mask, scale=scaling
                    )  # on views of the cache: (1, m, L, hd)
                    parts.append(attended.view(-1, head_dim))
                heads_out = parts[0] if len(parts) == 1 else torch.cat(parts)  # (end - start, hd)
                if weighted:
                    heads_out = heads_out * gates[b, t, start:end, None]
                heads_out = heads_out.view(1, -1)
                block = weight_t[start * head_dim : end * head_dim]  # contiguous view: ((end - start)·hd, d)
                acc = torch.mm(heads_out, block) if acc is None else torch.addmm(acc, heads_out, block)
            rows.append(acc.view(-1))
    return (rows[0] if len(rows) == 1 else torch.stack(rows)).view(batch, seq, -1)


def masked_heads_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    gates: torch.Tensor,
    o_proj: nn.Linear,
    scaling: float,
) -> torch.Tensor:
    """Reference for `skipped_heads_attention`: every head computed (eager), output multiplied by the gates, o_proj."""
    groups = query.shape[1] // key.shape[1]
    key = key.repeat_interleave(groups, dim=1)
    value = value.repeat_interleave(groups, dim=1)
    scores = torch.matmul(query, key.transpose(2, 3)) * scaling  # (B, H, T, L)
    if attention_mask is not None:
        mask = attention_mask[..., : key.shape[2]]
        if mask.dtype == torch.bool:
            mask = torch.zeros(mask.shape, dtype=query.dtype).masked_fill(~mask, torch.finfo(query.dtype).min)
        scores = scores + mask
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(query.dtype)
    heads_out = torch.matmul(probs, value).transpose(1, 2)  # (B, T, H, hd)
    heads_out = heads_out * gates.to(query.dtype)[..., None]
    return o_proj(heads_out.reshape(*heads_out.shape[:2], -1))


__all__ = [
    "head_skipping_backend",
    "head_sparse_pays",
    "kv_heads_skippable",
    "masked_heads_attention",
    "skipped_heads_attention",
]
