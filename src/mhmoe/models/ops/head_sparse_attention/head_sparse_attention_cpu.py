"""Head-sparse attention in PyTorch (the CPU path): attention only for the active (token, head) pairs, equal to
`head_sparse_attention_naive.py` (the contract and the shape legend are there).

Prefill and training (more than DECODE_MAX_TOKENS query tokens). The T query tokens are cut into chunks of C tokens;
a row is one active (token, head) pair. The rows of key/value head g (those of its G query heads, in token order)
all attend to g's keys, so g's heads act as extra query rows: no K/V copy, every K/V read shared. A chunk's rows see
(a) every key before the chunk (the prefix) and (b) the chunk's own keys up to their position (the diagonal block):
- (a) the chunk's active rows against the prefix in unmasked flash-attention calls, one per span of chunks with at
  least LARGE_QUERY_ROWS rows where the rows allow (the kernel's efficient large query blocks) plus one per later
  chunk of a span for the span's keys before it: all batch rows and key/value heads padded into one call where that
  costs little (`_SpanPlan`, `_span_prefix`), else one (batch row, key/value head) at a time (`_segment_prefix`);
- (b) one causal call for every chunk and head at once (C × C blocks). It computes the inactive rows of the diagonal
  blocks too (a C / T share of the dense work) but needs no mask, no padding and no gather;
- the two are merged by their log-sum-exp and scattered back to (B, T, H, hd).
A key/value head whose query heads are active on at least DENSE_SHARE of the tokens (MoH's shared heads: all) is plain
causal attention over all its heads, its inactive pairs zeroed: one causal flash call, cut into two even halves when
the kernel's threads would share it unevenly (`_causal_flash`); not with a cache, a mask or a window. With a 4-D
attention mask or an effective sliding window, each (key/value head, chunk) is instead one masked call over the keys
its rows can see (the mask gathered for those rows). Short prefills (under SHORT_TOKENS) take such masked calls too,
one per (batch row, key/value head) over all its rows (`_segment_mask` gathers them from a cached causal mask), for
the key/value heads active on less than SHORT_DENSE_SHARE of their pairs; the others run dense.
The backward is flash attention's: each call's gradients from the merged output and log-sum-exp (so the calls'
gradients add up to the gradient of the whole), summed into g's key/value gradients and scattered back to the rows.
An inactive pair costs nothing outside the diagonal blocks, in either pass.

Decoding (a few query tokens): one attention call per run of consecutive key/value heads that an active pair needs,
the G query heads of a key/value head packed as its query rows (as Transformers' `pack_gqa`): each K/V read once, no
Python loop over rows or heads, and a key/value head that no active pair needs is never read. Inactive heads inside a
needed key/value head are computed and zeroed: with GQA their K/V reads are shared, and the arithmetic is small.

The flash calls are torch's CPU kernel (`aten._scaled_dot_product_flash_attention_for_cpu`, which
`scaled_dot_product_attention` runs on CPU, and its backward; it also returns the log-sum-exp); on other devices an
eager computation stands in (CUDA has the Triton kernel). Runs on torch alone: exported checkpoints can ship it.
"""

import functools
import math

import torch
import torch.nn.functional as F

from .head_sparse_attention_naive import additive_mask, apply_gates, check_inputs, runs, visible_keys

DECODE_MAX_TOKENS = 16  # up to this many query tokens: the decode path


def chunk_tokens(tokens: int) -> int:
    """Query tokens per chunk: about T / 8, 64 to 256 (the diagonal blocks, C / T of the dense work, are computed for
    every head of a sparse key/value head; each chunk costs one call per key/value head)."""
    return max(64, min(256, 1 << max(0, (tokens // 8).bit_length() - 1)))


def head_sparse_attention_cpu(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    gates: torch.Tensor,
    scaling: float,
    attention_mask: torch.Tensor | None = None,
    query_offset: int | None = None,
    sliding_window: int | None = None,
    chunk_size: int | None = None,
) -> torch.Tensor:
    """(B, T, H, hd): attention of the active (token, head) pairs times their gates, 0 elsewhere (see the module
    docstring and head_sparse_attention_naive.py). `chunk_size`: query tokens per chunk (default `chunk_tokens`)."""
    check_inputs(query, key, value, gates, attention_mask, query_offset)
    tokens, num_keys = query.shape[2], key.shape[2]
    offset = num_keys - tokens if query_offset is None else query_offset
    if sliding_window is not None and sliding_window > offset + tokens - 1:
        sliding_window = None  # the window holds every key: no effect
    if tokens <= DECODE_MAX_TOKENS:
        return _decode(query, key, value, gates, scaling, attention_mask, offset, sliding_window)
    active = gates != 0
    out = _prefill(
        query, key, value, active, scaling, attention_mask, offset, sliding_window, chunk_size or chunk_tokens(tokens)
    )
    return apply_gates(out, gates, active)


# ---------------------------------------------------------------------------------------------------------------------
# decoding


def _decode(query, key, value, gates, scaling, attention_mask, offset, sliding_window):
    """Few ops (each costs about as much as a short decoding step's attention): which key/value heads are needed, one
    attention call per run of them, the gates' multiply (which zeroes the inactive heads computed alongside)."""
    batch, heads, tokens, head_dim = query.shape
    kv_heads, num_keys = key.shape[1], key.shape[2]
    groups = heads // kv_heads
    needed = gates.view(batch, tokens, kv_heads, groups).ne(0).any(dim=(0, 1, 3)).tolist()  # (Hkv,)
    mask = None  # additive (B or 1, 1, G·T, L): packed row j·T + t is token t's
    if attention_mask is not None or sliding_window is not None or tokens > 1 or offset != num_keys - 1:
        visible = visible_keys(tokens, num_keys, offset, sliding_window, query.device)
        mask = additive_mask(attention_mask, visible, num_keys, query.dtype).repeat(1, 1, groups, 1)
    packed = query.reshape(batch, kv_heads, groups * tokens, head_dim)  # (B, Hkv, G·T, hd)
    if all(needed):  # one call
        out = F.scaled_dot_product_attention(packed, key, value, attn_mask=mask, scale=scaling)
        out = out.view(batch, heads, tokens, head_dim).transpose(1, 2)
    else:
        out = query.new_zeros(batch, tokens, heads, head_dim)
        for start, end in runs([g for g in range(kv_heads) if needed[g]]):
            part = F.scaled_dot_product_attention(
                packed[:, start:end], key[:, start:end], value[:, start:end], attn_mask=mask, scale=scaling
            )  # (B, n, G·T, hd)
            out[:, :, start * groups : end * groups] = part.view(batch, -1, tokens, head_dim).transpose(1, 2)
    if gates.requires_grad:  # an inactive gate gets no gradient
        gates = gates.masked_fill(gates == 0, 0)
    return out * gates.to(out.dtype)[..., None]


# ---------------------------------------------------------------------------------------------------------------------
# prefill and training


DENSE_SHARE = 0.8  # a key/value head whose query heads are active on this share of the tokens runs dense
# Short prefills (under SHORT_TOKENS query tokens; no cache, mask or window): a key/value head active on less than
# SHORT_DENSE_SHARE of its (token, head) pairs runs as masked rows, one call per batch row over the keys up to its last
# active row: R·L query-key pairs (R active rows, L keys) where its causal attention computes about G·L²/2, on the
# kernel's small query blocks at these lengths; the others run dense (benchmarks/head_sparse_short.py)
SHORT_TOKENS = 768
SHORT_DENSE_SHARE = 0.5


def _prefill(query, key, value, active, scaling, attention_mask, offset, sliding_window, chunk):
    batch, heads, tokens, head_dim = query.shape
    kv_heads = key.shape[1]
    groups = heads // kv_heads
    general = attention_mask is not None or sliding_window is not None
    short = not general and offset == 0 and tokens < SHORT_TOKENS
    share = active.view(batch, tokens, kv_heads, groups).float().mean(dim=(0, 1, 3)).tolist()  # (Hkv,)
    full = [value >= (SHORT_DENSE_SHARE if short else DENSE_SHARE) for value in share]
    if general or offset != 0:
        full = [False] * kv_heads  # plain causal attention only without a cache, a mask or a window
    if short or (general and sliding_window is None and tokens < SHORT_TOKENS):
        chunk = tokens  # one segment per (batch row, key/value head): masked rows
    dense = [  # runs (start, end, whether some of their pairs are inactive)
        (start, end, any(share[g] < 1 for g in range(start, end)))
        for start, end in runs([g for g in range(kv_heads) if full[g]])
    ]
    sparse = [g for g in range(kv_heads) if not full[g]]
    return _HeadSparsePrefill.apply(
        query, key, value, active, scaling, attention_mask, offset, sliding_window, chunk, sparse, dense
    )


def _cpu_kernel(tensor: torch.Tensor) -> bool:
    """Whether torch's CPU flash-attention kernel takes `tensor` (else the eager stand-in runs)."""
    return tensor.device.type == "cpu"


def _flash(query, key, value, mask, scaling, causal=False):
    """Flash attention that also returns the log-sum-exp: query (N, Hq, n, hd), key/value (N, Hk, m, hd) with Hk
    dividing Hq (GQA), mask additive (N, 1, n, m) or None -> output (N, Hq, n, hd), lse (N, Hq, n)."""
    if _cpu_kernel(query):
        return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            query, key, value, is_causal=causal, attn_mask=mask, scale=scaling
        )
    key, value = _repeat_kv(key, query), _repeat_kv(value, query)
    scores = _eager_scores(query, key, mask, scaling, causal)  # fp32 (fp64 for fp64 inputs)
    lse = torch.logsumexp(scores, dim=-1)
    return torch.matmul(torch.exp(scores - lse[..., None]), value.to(scores.dtype)).to(value.dtype), lse


BALANCE_MIN_TOKENS = 256  # below this a causal call is short and its halves' extra merge would cost more


def _causal_flash(query, key, value, scaling):
    """`_flash(..., causal=True)` for query (B, Hq, T, hd) and key/value (B, Hk, T, hd), with the work split evenly
    over the CPU kernel's threads.

    The kernel hands each thread a contiguous share of the (batch row, head, query block) items, and a causal item
    costs in proportion to its block's position. With an odd number of (batch row, key/value head) pairs one pair's
    blocks are split between two threads, its cheap first half to one and its costly second half to the other, and
    the call waits for the busier thread (MoH's shared key/value head at batch 1: benchmarks/cpu_flash_blocks.py).
    Here each pair is cut into two equal causal halves instead, queries [0, h) on keys [0, h) and queries [h, T) on
    keys [h, T), called as one batch of 2·B equal items, and the second half's queries also attend to keys [0, h) (one
    unmasked call, even by construction), merged by log-sum-exp. Same work, same result up to rounding."""
    batch, _, tokens, _ = query.shape
    threads = torch.get_num_threads()
    if not _cpu_kernel(query) or threads == 1 or tokens < BALANCE_MIN_TOKENS or (batch * key.shape[1]) % 2 == 0:
        return _flash(query, key, value, None, scaling, causal=True)
    half = tokens // 2
    rest = tokens - half  # = half, or half + 1 for odd T: the first half then gets one padding row and key at its end

    def halves(x):  # (B, n, T, hd) -> (2B, n, rest, hd): batch row 2b is b's [0, half), 2b + 1 its [half, T)
        if rest > half:  # odd T: the first half gets one padding row and key at its end (a copy)
            x = torch.cat([F.pad(x[:, :, :half], (0, 0, 0, 1)), x[:, :, half:]], dim=2)
        return x.unflatten(2, (2, rest)).transpose(1, 2).flatten(0, 1)  # even T: a view (the query is (B, T, H, hd))

    q_h, k_h, v_h = (halves(x) for x in (query, key, value))
    o_halves, lse_halves = _flash(q_h, k_h, v_h, None, scaling, causal=True)  # (2B, n, rest, hd), (2B, n, rest)
    o_prefix, lse_prefix = _flash(query[:, :, half:], key[:, :, :half], value[:, :, :half], None, scaling)
    o_second, lse_second = _merge(o_prefix, lse_prefix, o_halves[1::2], lse_halves[1::2])
    out = torch.cat([o_halves[0::2, :, :half], o_second], dim=2)
    return out, torch.cat([lse_halves[0::2, :, :half], lse_second], dim=2)


def _flash_backward(grad, query, key, value, out, lse, mask, scaling, causal=False):
    """Gradients (query, key, value) of a `_flash` call, from its rows' merged output and log-sum-exp."""
    if _cpu_kernel(query):
        return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            grad, query, key, value, out, lse, 0.0, causal, attn_mask=mask, scale=scaling
        )
    groups = query.shape[1] // key.shape[1]
    dtype = _compute_dtype(query)
    key_r, value_r = _repeat_kv(key, query).to(dtype), _repeat_kv(value, query).to(dtype)
    probs = torch.exp(_eager_scores(query, key_r, mask, scaling, causal) - lse[..., None].to(dtype))
    grad_f = grad.to(dtype)
    delta = (grad_f * out.to(dtype)).sum(-1, keepdim=True)
    grad_scores = probs * (torch.matmul(grad_f, value_r.transpose(-1, -2)) - delta) * scaling
    grad_query = torch.matmul(grad_scores, key_r)
    grad_key = torch.matmul(grad_scores.transpose(-1, -2), query.to(dtype))
    grad_value = torch.matmul(probs.transpose(-1, -2), grad_f)
    if groups > 1:  # sum over each key/value head's query heads
        grad_key = grad_key.unflatten(1, (-1, groups)).sum(2)
        grad_value = grad_value.unflatten(1, (-1, groups)).sum(2)
    return grad_query.to(query.dtype), grad_key.to(key.dtype), grad_value.to(value.dtype)


def _one_head(*tensors):
    """(n, ...) row tensors -> (1, 1, n, ...): one batch row, one head, for `_flash`."""
    return [x[None, None] for x in tensors]


def _repeat_kv(x, query):
    groups = query.shape[1] // x.shape[1]
    return x.repeat_interleave(groups, dim=1) if groups > 1 else x


def _compute_dtype(tensor):
    return torch.promote_types(tensor.dtype, torch.float32)


def _eager_scores(query, key, mask, scaling, causal):
    dtype = _compute_dtype(query)
    scores = torch.matmul(query.to(dtype), key.to(dtype).transpose(-1, -2)) * scaling
    if causal:
        n, m = scores.shape[-2:]
        scores = scores.masked_fill(torch.ones(n, m, dtype=torch.bool, device=scores.device).triu(1), float("-inf"))
    return scores if mask is None else scores + mask.to(dtype)


class _Rows:
    """The active rows of the key/value heads in `sparse`, in (batch, key/value head, token, head) order.

    `index` (N,) flat positions (b·T + t)·H + h in the (B·T·H) rows of a (B, T, H, hd) tensor; `tokens` (N,);
    `segments`: per (batch row, key/value head, chunk) with rows, (b, g, c, first row, end row); `diagonal` (N,) each
    row's place in the diagonal blocks of the sparse heads, (B·nc, C, Hs) in that order: the layout of the CPU
    kernel's output and log-sum-exp, so that their rows are gathered without a copy. When the sparse key/value heads
    are one run and padding costs little, `padded` (N,) places each row in a (B, Hkv_s, nc, R) layout (R: the most
    rows of a (batch row, key/value head) in a chunk), so that one call per chunk covers every batch row and key/value
    head (the backward's prefix calls); `spans` the same for the forward's calls per span of chunks (`_SpanPlan`).
    Without `layouts` (the masked calls of a mask, a window or one chunk) only `index`, `tokens` and `segments`."""

    PADDING_LIMIT = 1.25  # padded rows / rows above which the prefix calls go per (batch row, key/value head)

    def __init__(self, active, kv_heads, sparse, chunk, layouts=True):
        batch, tokens, heads = active.shape
        groups = heads // kv_heads
        device = active.device
        self.chunk = chunk
        self.num_chunks = num_chunks = -(-tokens // chunk)
        chosen = torch.tensor(sparse, device=device)
        by_group = active.view(batch, tokens, kv_heads, groups).permute(0, 2, 1, 3).index_select(1, chosen)
        rows = by_group.nonzero()  # (N, 4): b, g (among `sparse`), t, j in that order
        b, local, t, j = rows.unbind(1)
        g = chosen[local]
        self.tokens = t
        self.index = (b * tokens + t) * heads + g * groups + j
        chunk_of = torch.div(t, chunk, rounding_mode="floor")
        segment = (b * len(sparse) + local) * num_chunks + chunk_of
        counts = torch.bincount(segment, minlength=batch * len(sparse) * num_chunks)
        count_list = counts.tolist()
        self.segments, start = [], 0
        for flat, count in enumerate(count_list):
            if count:
                bg, c = divmod(flat, num_chunks)
                b_, g_ = divmod(bg, len(sparse))
                self.segments.append((b_, sparse[g_], c, start, start + count))
                start += count
        self.padded, self.spans, self.width = None, None, max(count_list, default=0)
        if not layouts:  # the masked calls (a mask, a window or one chunk) need the segments only
            return
        self.diagonal = ((b * num_chunks + chunk_of) * chunk + t % chunk) * len(sparse) * groups + local * groups + j
        starts = counts.cumsum(0) - counts  # each segment's first row
        one_run = sparse == list(range(sparse[0], sparse[-1] + 1))
        if rows.shape[0] and one_run and self.width * len(count_list) <= self.PADDING_LIMIT * rows.shape[0]:
            slot = torch.arange(rows.shape[0], device=device) - starts[segment]
            self.padded = segment * self.width + slot
            self.padded_shape = (batch, len(sparse), num_chunks, self.width)
        if rows.shape[0] and one_run:
            pairs = batch * len(sparse)
            by_pair = (counts.view(pairs, num_chunks), starts.view(pairs, num_chunks))
            self.spans = _SpanPlan(*by_pair, segment, chunk_of, chunk, batch)
            if self.spans.padded_rows > self.PADDING_LIMIT * rows.shape[0]:
                self.spans = None

    @functools.cached_property
    def last_token(self) -> int:
        """The last row's token (the masked calls' masks reach its position)."""
        return int(self.tokens.max())


class _HeadSparsePrefill(torch.autograd.Function):
    @staticmethod
    def forward(ctx, query, key, value, active, scaling, attention_mask, offset, sliding_window, chunk, sparse, dense):
        batch, heads, tokens, head_dim = query.shape
        kv_heads = key.shape[1]
        groups = heads // kv_heads
        out = query.new_zeros(batch, tokens, heads, head_dim)
        dense_results = []
        for start, end, partial in dense:  # key/value heads whose query heads are (nearly) all active: causal
            o, lse = _causal_flash(
                query[:, start * groups : end * groups],
                key[:, start:end, :tokens],
                value[:, start:end, :tokens],
                scaling,
            )  # (B, n·G, T, hd), (B, n·G, T)
            heads_slice = slice(start * groups, end * groups)
            out[:, :, heads_slice] = o.transpose(1, 2)
            if partial:  # the inactive pairs: 0
                out[:, :, heads_slice].masked_fill_(~active[:, :, heads_slice, None], 0)
            dense_results.append((o, lse))
        general = attention_mask is not None or sliding_window is not None or chunk >= tokens  # masked rows
        rows = _Rows(active, kv_heads, sparse, chunk, layouts=not general) if sparse else None
        settings = (scaling, attention_mask, offset, sliding_window, sparse, general)
        results = None
        if rows is not None and rows.index.numel():
            q_rows = query.transpose(1, 2).reshape(-1, head_dim).index_select(0, rows.index)  # (N, hd)
            if general:
                results = _general_forward(q_rows, key, value, rows, settings)
            else:
                results = _causal_forward(query, q_rows, key, value, rows, settings)
            out.view(-1, head_dim).index_copy_(0, rows.index, results[0])
        ctx.save_for_backward(query, key, value, active)
        ctx.rows, ctx.settings, ctx.results, ctx.dense = rows, settings, results, (dense, dense_results)
        return out

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_out):
        query, key, value, active = ctx.saved_tensors
        rows, settings = ctx.rows, ctx.settings
        batch, heads, tokens, head_dim = query.shape
        groups = heads // key.shape[1]
        grad_query = query.new_zeros(batch, tokens, heads, head_dim)
        grad_key, grad_value = torch.zeros_like(key), torch.zeros_like(value)
        for (start, end, partial), (o, lse) in zip(*ctx.dense):
            heads_slice = slice(start * groups, end * groups)
            grad_heads = grad_out[:, :, heads_slice]
            if partial:  # the zeroed outputs pass no gradient
                grad_heads = grad_heads.masked_fill(~active[:, :, heads_slice, None], 0)
            dq, dk, dv = _flash_backward(
                grad_heads.transpose(1, 2),
                query[:, heads_slice],
                key[:, start:end, :tokens],
                value[:, start:end, :tokens],
                o,
                lse,
                None,
                settings[0],
                causal=True,
            )
            grad_query[:, :, heads_slice] = dq.transpose(1, 2)
            grad_key[:, start:end, :tokens] += dk
            grad_value[:, start:end, :tokens] += dv
        if ctx.results is not None:
            q_rows = query.transpose(1, 2).reshape(-1, head_dim).index_select(0, rows.index)
            go_rows = grad_out.reshape(-1, head_dim).index_select(0, rows.index)
            grads = (torch.zeros_like(q_rows), grad_key, grad_value)
            if settings[-1]:
                _general_backward(go_rows, q_rows, key, value, *ctx.results, rows, settings, grads)
            else:
                _causal_backward(go_rows, query, q_rows, key, value, *ctx.results, rows, settings, grads)
            grad_query.view(-1, head_dim).index_copy_(0, rows.index, grads[0])
        return grad_query.transpose(1, 2), grad_key, grad_value, None, None, None, None, None, None, None, None


# the causal case: prefix calls per (batch row, key/value head, chunk) + one call for the diagonal blocks


def _diagonal_blocks(query, key, value, rows, settings):
    """The sparse key/value heads' queries (B·nc, Hs, C, hd) and keys/values (B·nc, Hkv_s, C, hd) cut into diagonal
    blocks (views where the strides allow, else copies; zero-padded to nc·C tokens)."""
    _, _, offset, _, sparse, _ = settings
    tokens = query.shape[2]
    groups = query.shape[1] // key.shape[1]
    chunk, num_chunks = rows.chunk, rows.num_chunks
    pad = num_chunks * chunk - tokens
    if sparse == list(range(sparse[0], sparse[-1] + 1)):  # one run: slices, no copy
        q_sel = query[:, sparse[0] * groups : (sparse[-1] + 1) * groups]
        k_sel, v_sel = (x[:, sparse[0] : sparse[-1] + 1, offset : offset + tokens] for x in (key, value))
    else:
        chosen = torch.tensor(sparse, device=query.device)
        head_ids = (chosen[:, None] * groups + torch.arange(groups, device=query.device)).flatten()
        q_sel = query.index_select(1, head_ids)
        k_sel, v_sel = (x[:, :, offset : offset + tokens].index_select(1, chosen) for x in (key, value))

    def blocks(x):  # (B, n, T, hd) -> (B·nc, n, C, hd)
        if pad:
            x = F.pad(x, (0, 0, 0, pad))
        return x.unflatten(2, (num_chunks, chunk)).transpose(1, 2).flatten(0, 1)

    return blocks(q_sel), blocks(k_sel), blocks(v_sel)


def _merge(out_a, lse_a, out_b, lse_b):
    """Two attention results (..., n, hd) with log-sum-exps (..., n) over disjoint key sets -> the result over their
    union (lse -inf: no keys). The weight of a is exp(lse_a - lse) = sigmoid(lse_a - lse_b)."""
    weight = torch.sigmoid(lse_a - lse_b)[..., None].to(out_a.dtype)
    return torch.lerp(out_b, out_a, weight), torch.logaddexp(lse_a, lse_b)


def _scatter_rows(rows_tensor, index, shape, fill=0.0):
    """(N, ...) rows into a new `shape` tensor at `index` (flat over its leading dims), `fill` elsewhere."""
    flat = rows_tensor.new_full((math.prod(shape), *rows_tensor.shape[1:]), fill)
    return flat.index_copy_(0, index, rows_tensor).view(*shape, *rows_tensor.shape[1:])


LARGE_QUERY_ROWS = 768  # from this many query rows a call runs on torch's CPU kernel's large query blocks (256 rows,
# less time per query-key pair than the 32- or 64-row blocks of shorter calls: benchmarks/cpu_flash_blocks.py)
SPAN_MAX_TOKENS = 1024  # query tokens per prefix call at most (the keys between its chunks take calls of their own)


# a call per key/value head (padded over the batch rows only) when that pads to this share of the joint call's rows
# or less: with an even batch its query blocks still split evenly over 2 threads; with an odd one they may not
SPLIT_GAIN = {"even batch": 0.95, "odd batch": 0.75}


class _SpanPlan:
    """Where the forward's prefix calls put each row (one run of sparse key/value heads). Rows are in (batch row b,
    key/value head g, chunk c) segments; consecutive chunks form spans of s chunks (s·R̄ ≥ LARGE_QUERY_ROWS for R̄ the
    mean rows of a segment, s·C ≤ SPAN_MAX_TOKENS), and a span's rows of one (b, g) are consecutive.

    - Span calls: span j's rows against the keys before the span. `big` (N,) each row's place in the calls' padded
      rows, laid end to end.
    - Chunk calls: a chunk after a span's first, against the span's keys before the chunk. `later` (M,) the rows in
      such chunks, `small` (M,) their places.
    Each call takes every (b, g), padded to the most rows any has, as (B, Hkv_s, w), or, when the key/value heads'
    densities differ (`SPLIT_GAIN`), one call per key/value head padded over the batch rows only, (B, 1, w_g).
    `calls` / `small_calls`: (first padded row, g0, g1, w, unit)."""

    def __init__(self, counts, first_row, segment, chunk_of, chunk, batch):
        pairs, num_chunks = counts.shape  # (B·Hkv_s, nc) rows per segment, and (first_row) the first of each
        rows = segment.shape[0]
        span = -(-LARGE_QUERY_ROWS * pairs * num_chunks // rows)  # chunks for s·R̄ ≥ LARGE_QUERY_ROWS
        self.span = span = max(1, min(SPAN_MAX_TOKENS // chunk, span, num_chunks))
        self.chunk, self.num_spans = chunk, -(-num_chunks // span)
        self.batch, self.kv_heads = batch, pairs // batch
        self.split_gain = SPLIT_GAIN["even batch" if batch % 2 == 0 else "odd batch"]
        row_id = torch.arange(rows, device=counts.device)
        pair = torch.div(segment, num_chunks, rounding_mode="floor")
        span_of = torch.div(chunk_of, span, rounding_mode="floor")
        per_span = F.pad(counts, (0, self.num_spans * span - num_chunks)).view(pairs, self.num_spans, span).sum(-1)
        self.calls, base, self.padded_rows = self._layout(per_span, range(self.num_spans))
        self.big = base[pair, span_of] + row_id - first_row[pair, span_of * span]
        later = chunk_of % span != 0
        self.later = row_id[later]
        self.small_calls, base, self.small_rows = self._layout(counts, [c for c in range(num_chunks) if c % span])
        c = chunk_of[later]
        self.small = base[pair[later], c] + self.later - first_row[pair[later], c]

    def _layout(self, counts, units):
        """Calls for `units` (columns of counts (B·Hkv_s, U)): their list, the first padded row of each (b, g) and
        unit (B·Hkv_s, U), and the padded rows in all."""
        batch, kv_heads = self.batch, self.kv_heads
        by_pair = counts.view(batch, kv_heads, -1)
        joint, per_head = by_pair.amax((0, 1)).tolist(), by_pair.amax(0).tolist()  # (U,), (Hkv_s, U)
        base = torch.zeros(batch, kv_heads, counts.shape[1], dtype=torch.long, device=counts.device)
        calls, total = [], 0
        for unit in units:
            widths = [per_head[g][unit] for g in range(kv_heads)]
            if kv_heads > 1 and sum(widths) <= self.split_gain * kv_heads * joint[unit]:
                for g, width in enumerate(widths):
                    base[:, g, unit] = total + torch.arange(batch, device=counts.device) * width
                    calls.append((total, g, g + 1, width, unit))
                    total += batch * width
            else:
                width = joint[unit]
                base[:, :, unit] = total + torch.arange(batch * kv_heads, device=counts.device).view(batch, -1) * width
                calls.append((total, 0, kv_heads, width, unit))
                total += batch * kv_heads * width
        return calls, base.view(batch * kv_heads, -1), total


def _no_keys(rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention results of (n, hd) query rows that have seen no key yet: output 0, lse -inf (what `_merge` adds to)."""
    return torch.zeros_like(rows), rows.new_full(rows.shape[:1], float("-inf"), dtype=_compute_dtype(rows))


def _span_prefix(q_rows, key, value, plan, offset, scaling):
    """Each row's attention to the keys before its chunk (chunk c: keys [0, offset + c·C)): rows (N, hd) -> output
    (N, hd) and lse (N,) (-inf: no keys), by `plan`'s calls (`_SpanPlan`: one call per span of chunks, with at least
    LARGE_QUERY_ROWS rows where the rows allow, so that torch's CPU kernel runs its efficient large query blocks;
    then each later chunk of a span against the span's keys before it, merged by log-sum-exp). key/value: the sparse
    key/value heads' (B, Hkv_s, L, hd)."""
    batch, _, _, head_dim = key.shape
    chunk, span = plan.chunk, plan.span

    def run(q_padded, calls, keys_of):  # padded rows (P, hd) -> output, lse (P,)
        out, lse = _no_keys(q_padded)
        for start, g0, g1, width, unit in calls:
            low, high = keys_of(unit)
            if width and high > low:
                rows = slice(start, start + batch * (g1 - g0) * width)
                o, o_lse = _flash(
                    q_padded[rows].view(batch, g1 - g0, width, head_dim),
                    key[:, g0:g1, low:high],
                    value[:, g0:g1, low:high],
                    None,
                    scaling,
                )  # (B, g1 - g0, w, hd), (B, g1 - g0, w)
                out[rows], lse[rows] = o.reshape(-1, head_dim), o_lse.reshape(-1)
        return out, lse

    q_big = _scatter_rows(q_rows, plan.big, (plan.padded_rows,))
    o_big, lse_big = run(q_big, plan.calls, lambda j: (0, offset + j * span * chunk))
    o_rows, lse_rows = o_big.index_select(0, plan.big), lse_big.index_select(0, plan.big)
    if plan.later.numel():
        q_small = _scatter_rows(q_rows.index_select(0, plan.later), plan.small, (plan.small_rows,))
        o_small, lse_small = run(
            q_small, plan.small_calls, lambda c: (offset + c // span * span * chunk, offset + c * chunk)
        )
        o_later, lse_later = _merge(
            o_rows.index_select(0, plan.later),
            lse_rows.index_select(0, plan.later),
            o_small.index_select(0, plan.small),
            lse_small.index_select(0, plan.small),
        )
        o_rows.index_copy_(0, plan.later, o_later)
        lse_rows.index_copy_(0, plan.later, lse_later)
    return o_rows, lse_rows


def _causal_forward(query, q_rows, key, value, rows, settings):
    scaling, _, offset, _, sparse, _ = settings
    head_dim = query.shape[-1]
    o_diag, lse_diag = _flash(*_diagonal_blocks(query, key, value, rows, settings), None, scaling, causal=True)
    # (B·nc, Hs, C, hd), (B·nc, Hs, C), stored as (B·nc, C, Hs, ...) by the CPU kernel
    o_diag = o_diag.transpose(1, 2).reshape(-1, head_dim).index_select(0, rows.diagonal)
    lse_diag = lse_diag.transpose(1, 2).reshape(-1).index_select(0, rows.diagonal)
    if rows.spans is not None:  # (B, Hkv_s, w) rows of every batch row and key/value head per call
        g0, g1 = sparse[0], sparse[-1] + 1
        o_prefix, lse_prefix = _span_prefix(q_rows, key[:, g0:g1], value[:, g0:g1], rows.spans, offset, scaling)
    else:
        o_prefix, lse_prefix = _segment_prefix(q_rows, key, value, rows, offset, scaling)
    return _merge(o_prefix, lse_prefix, o_diag, lse_diag)


def _segment_prefix(q_rows, key, value, rows, offset, scaling):
    """`_span_prefix` without padding, one (batch row, key/value head) at a time (when padding them together would
    cost too much: their densities differ): that pair's rows of a span of chunks (s chunks: s × its mean rows per chunk
    ≥ LARGE_QUERY_ROWS, s·C ≤ SPAN_MAX_TOKENS) in one call to the keys before the span, then each later chunk of the
    span to the span's keys before it."""
    chunk = rows.chunk
    o_prefix, lse_prefix = _no_keys(q_rows)
    pairs = {}
    for segment in rows.segments:  # in (batch row, key/value head, chunk) order
        pairs.setdefault(segment[:2], []).append(segment)
    for (b, g), segments in pairs.items():
        mean = (segments[-1][4] - segments[0][3]) / rows.num_chunks
        span = max(1, min(SPAN_MAX_TOKENS // chunk, math.ceil(LARGE_QUERY_ROWS / mean)))
        for first in range(0, rows.num_chunks, span):
            inside = [segment for segment in segments if first <= segment[2] < first + span]
            if not inside:
                continue
            keys = offset + first * chunk  # before the span
            if keys:
                start, end = inside[0][3], inside[-1][4]
                o, lse = _flash(*_one_head(q_rows[start:end], key[b, g, :keys], value[b, g, :keys]), None, scaling)
                o_prefix[start:end], lse_prefix[start:end] = o[0, 0], lse[0, 0]
            for _, _, c, start, end in inside:
                if c > first:
                    high = offset + c * chunk
                    o, lse = _flash(
                        *_one_head(q_rows[start:end], key[b, g, keys:high], value[b, g, keys:high]), None, scaling
                    )
                    o_prefix[start:end], lse_prefix[start:end] = _merge(
                        o_prefix[start:end], lse_prefix[start:end], o[0, 0], lse[0, 0]
                    )
    return o_prefix, lse_prefix


def _causal_backward(go_rows, query, q_rows, key, value, o_rows, lse_rows, rows, settings, grads):
    scaling, _, offset, _, sparse, _ = settings
    dq_rows, grad_key, grad_value = grads
    batch, heads, tokens, head_dim = query.shape
    if rows.padded is not None:
        g0, g1 = sparse[0], sparse[-1] + 1
        shape = rows.padded_shape
        q_padded = _scatter_rows(q_rows, rows.padded, shape)
        go_padded = _scatter_rows(go_rows, rows.padded, shape)
        o_padded = _scatter_rows(o_rows, rows.padded, shape)
        lse_padded = _scatter_rows(lse_rows, rows.padded, shape, torch.finfo(lse_rows.dtype).max)  # padding: p = 0
        dqs = []
        for c in range(rows.num_chunks):
            prefix = offset + c * rows.chunk
            if not prefix:
                dqs.append(torch.zeros_like(q_padded[:, :, c]))
                continue
            dq, dk, dv = _flash_backward(
                go_padded[:, :, c],
                q_padded[:, :, c],
                key[:, g0:g1, :prefix],
                value[:, g0:g1, :prefix],
                o_padded[:, :, c],
                lse_padded[:, :, c],
                None,
                scaling,
            )
            dqs.append(dq)
            grad_key[:, g0:g1, :prefix] += dk
            grad_value[:, g0:g1, :prefix] += dv
        dq_rows += torch.stack(dqs, dim=2).view(-1, head_dim).index_select(0, rows.padded)
    for b, g, c, start, end in rows.segments if rows.padded is None else ():
        prefix = offset + c * rows.chunk
        if prefix:
            dq, dk, dv = _flash_backward(
                *_one_head(
                    go_rows[start:end],
                    q_rows[start:end],
                    key[b, g, :prefix],
                    value[b, g, :prefix],
                    o_rows[start:end],
                    lse_rows[start:end],
                ),
                None,
                scaling,
            )
            dq_rows[start:end] += dq[0, 0]
            grad_key[b, g, :prefix] += dk[0, 0]
            grad_value[b, g, :prefix] += dv[0, 0]
    blocks = _diagonal_blocks(query, key, value, rows, settings)
    num_blocks, block_heads, chunk = blocks[0].shape[:3]
    shape = (num_blocks, chunk, block_heads)  # the rows' order of `rows.diagonal`
    # the diagonal call's rows: the active ones with their merged output and lse, the inactive ones with no gradient
    # and an lse that makes their probabilities 0
    grad_blocks = go_rows.new_zeros(*shape, head_dim).view(-1, head_dim).index_copy_(0, rows.diagonal, go_rows)
    out_blocks = torch.zeros_like(grad_blocks).index_copy_(0, rows.diagonal, o_rows)
    lse_blocks = lse_rows.new_full(shape, torch.finfo(lse_rows.dtype).max)
    lse_blocks.view(-1).index_copy_(0, rows.diagonal, lse_rows)
    grad_blocks, out_blocks = (x.view(*shape, head_dim).transpose(1, 2) for x in (grad_blocks, out_blocks))
    dq, dk, dv = _flash_backward(
        grad_blocks, *blocks, out_blocks, lse_blocks.transpose(1, 2), None, scaling, causal=True
    )  # (B·nc, Hs, C, hd)
    dq_rows += dq.transpose(1, 2).reshape(-1, head_dim).index_select(0, rows.diagonal)
    chosen = torch.tensor(sparse, device=query.device)

    def unblock(x):  # (B·nc, Hkv_s, C, hd) -> (B, Hkv_s, T, hd)
        x = x.view(batch, rows.num_chunks, len(sparse), rows.chunk, head_dim)
        return x.transpose(1, 2).reshape(batch, len(sparse), -1, head_dim)[:, :, :tokens]

    grad_key[:, :, offset : offset + tokens].index_add_(1, chosen, unblock(dk))
    grad_value[:, :, offset : offset + tokens].index_add_(1, chosen, unblock(dv))


# the general case (a 4-D mask or a sliding window): one masked call per (batch row, key/value head, chunk)


def _key_range(rows, start, end, settings):
    _, _, offset, sliding_window, _, _ = settings
    first, last = offset + int(rows.tokens[start]), offset + int(rows.tokens[end - 1])
    low = 0 if sliding_window is None else max(0, first - sliding_window + 1)
    return low, last + 1


CAUSAL_MASK_CACHE_TOKENS = 1024  # causal masks up to this many keys are built once and gathered from (4 MB in fp32)


@functools.lru_cache(maxsize=4)
def _causal_additive(size: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """(size, size) additive causal mask: row p hides the keys after p (dtype's minimum). Cached: the layers of a
    short prefill all gather their rows from the same one."""
    return torch.full((size, size), torch.finfo(dtype).min, dtype=dtype, device=device).triu_(1)


def _segment_mask(rows, b, start, end, low, high, settings, dtype):
    """(1, 1, n, m) additive mask of a segment's rows over keys [low, high): causal, window, the 4-D mask's rows."""
    _, attention_mask, offset, sliding_window, _, _ = settings
    device = rows.tokens.device
    tokens = rows.tokens[start:end]
    size = offset + rows.last_token + 1  # positions up to the last row's
    if attention_mask is None and sliding_window is None and size <= CAUSAL_MASK_CACHE_TOKENS:  # one gather
        return _causal_additive(size, dtype, device)[:, low:high].index_select(0, tokens + offset)[None, None]
    positions = tokens[:, None] + offset
    keys = torch.arange(low, high, device=device)[None, :]
    hidden = keys > positions
    if sliding_window is not None:
        hidden |= keys <= positions - sliding_window
    minimum = torch.finfo(dtype).min
    mask = hidden.to(dtype).mul_(minimum)  # 2 passes over (n, m) (visible: -0.0, which adds nothing)
    if attention_mask is not None:
        given = attention_mask[b if attention_mask.shape[0] > 1 else 0, 0].index_select(0, tokens)[:, low:high]
        if given.dtype == torch.bool:
            mask.masked_fill_(~given, minimum)
        else:
            mask = (mask + given.to(dtype)).clamp_min(minimum)
    return mask[None, None]


def _general_forward(q_rows, key, value, rows, settings):
    scaling = settings[0]
    o_rows = torch.empty_like(q_rows)
    lse_rows = None
    for b, g, _, start, end in rows.segments:
        low, high = _key_range(rows, start, end, settings)
        mask = _segment_mask(rows, b, start, end, low, high, settings, q_rows.dtype)
        o, lse = _flash(*_one_head(q_rows[start:end], key[b, g, low:high], value[b, g, low:high]), mask, scaling)
        if lse_rows is None:
            lse_rows = lse.new_empty(q_rows.shape[0])
        o_rows[start:end], lse_rows[start:end] = o[0, 0], lse[0, 0]
    return o_rows, lse_rows


def _general_backward(go_rows, q_rows, key, value, o_rows, lse_rows, rows, settings, grads):
    scaling = settings[0]
    dq_rows, grad_key, grad_value = grads
    for b, g, _, start, end in rows.segments:
        low, high = _key_range(rows, start, end, settings)
        mask = _segment_mask(rows, b, start, end, low, high, settings, q_rows.dtype)
        dq, dk, dv = _flash_backward(
            *_one_head(
                go_rows[start:end],
                q_rows[start:end],
                key[b, g, low:high],
                value[b, g, low:high],
                o_rows[start:end],
                lse_rows[start:end],
            ),
            mask,
            scaling,
        )
        dq_rows[start:end] = dq[0, 0]
        grad_key[b, g, low:high] += dk[0, 0]
        grad_value[b, g, low:high] += dv[0, 0]
