"""Head-sparse attention in PyTorch (the CPU path): attention only for the active (token, head) pairs, equal to
`head_sparse_attention_naive.py` (the contract and the shape legend are there). Every threshold is a field of
`CpuHeadSparsePolicy` (`head_sparse_attention_cpu_policy.py`: one crossover per path, with the measurement that set it).

Decoding (up to `decode_max_tokens` query tokens): one attention call per run of consecutive key/value heads that an
active pair needs, the G query heads of a key/value head packed as its query rows (as Transformers' `pack_gqa`): each
K/V read once, and a key/value head that no active pair needs is never read. Inactive heads inside a needed key/value
head are computed and zeroed (their K/V reads are shared, the arithmetic is small).

Prefill and training take one of three paths per key/value head g (a row: one active (token, head) pair; g's rows, of
its G query heads in token order, all attend to g's keys: no K/V copy):
- dense: g's query heads active on at least `dense_share` of the tokens (MoH's shared heads: all), no cache, mask or
  window: one causal flash call over all its heads, its inactive pairs zeroed;
- chunked (no mask or window): the T query tokens in chunks of C (`chunk_tokens`); each (batch row, g, chunk)'s rows
  in one unmasked call against the keys before the chunk, every chunk's diagonal C × C block in one causal call for all
  sparse heads at once (computing the blocks' inactive rows too, a C / T share of the dense work, but no mask, padding
  or gather), the two merged by their log-sum-exp;
- masked rows (a 4-D mask or an effective sliding window, or a short prefill under `short_tokens` for the key/value
  heads active on less than `short_dense_share` of their pairs): one masked call per (batch row, g, chunk) over the
  keys its rows can see (one chunk per sequence in short prefills); the mask gathered for those rows.
The backward is flash attention's: each call's gradients from the merged output and log-sum-exp (the calls' gradients
add up to the whole's), summed into g's key/value gradients and scattered back to the rows. An inactive pair costs
nothing outside the diagonal blocks, in either pass.

The flash calls are torch's private CPU kernel (`aten._scaled_dot_product_flash_attention_for_cpu` and its backward,
which `scaled_dot_product_attention` runs on CPU): no public op returns the log-sum-exp the merges need. What it buys:
the op's prefill on SmolLM2-135M layer shapes (batch 1, 5/9 heads, fp32, 2 threads) ×2.8 faster at 2,048 tokens and
×5.8 at 4,096 than with an eager matmul-logsumexp stand-in (benchmarks/results/head_sparse_cpu_paths.md). On other
devices a prefill is the naive reference (CUDA has the Triton kernels). Runs on torch alone: checkpoints can ship it.
"""

import functools
from typing import NamedTuple

import torch
import torch.nn.functional as F

from .head_sparse_attention_cpu_policy import DEFAULT_CPU_POLICY, CpuHeadSparsePolicy
from .head_sparse_attention_naive import additive_mask, apply_gates, check_inputs, runs, visible_keys
from .head_sparse_attention_naive import head_sparse_attention_naive as _reference


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
    policy: CpuHeadSparsePolicy | None = None,
) -> torch.Tensor:
    """(B, T, H, hd): attention of the active (token, head) pairs times their gates, 0 elsewhere (see the module
    docstring and head_sparse_attention_naive.py). `chunk_size`: query tokens per chunk (default the policy's
    `chunk_tokens`); `policy`: the thresholds (default `DEFAULT_CPU_POLICY`)."""
    policy = policy or DEFAULT_CPU_POLICY
    check_inputs(query, key, value, gates, attention_mask, query_offset)
    tokens, num_keys = query.shape[2], key.shape[2]
    offset = num_keys - tokens if query_offset is None else query_offset
    if sliding_window is not None and sliding_window > offset + tokens - 1:
        sliding_window = None  # the window holds every key: no effect
    if tokens <= policy.decode_max_tokens:
        return _decode(query, key, value, gates, scaling, attention_mask, offset, sliding_window)
    if query.device.type != "cpu":  # no CPU flash kernel
        return _reference(query, key, value, gates, scaling, attention_mask, offset, sliding_window)
    active = gates != 0
    call = _plan(query, key, active, scaling, attention_mask, offset, sliding_window, chunk_size, policy)
    return apply_gates(_HeadSparsePrefill.apply(query, key, value, active, call), gates, active)


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
# prefill and training: which path each key/value head takes


class _Call(NamedTuple):
    """One prefill call's settings: `dense` runs (start, end, whether some of their pairs are inactive) of key/value
    heads on the dense path; `sparse` the others, as chunked rows or (`masked`) as masked rows in chunks of `chunk`."""

    scaling: float
    attention_mask: torch.Tensor | None
    offset: int
    sliding_window: int | None
    chunk: int
    masked: bool
    dense: list
    sparse: list
    policy: CpuHeadSparsePolicy


def _plan(query, key, active, scaling, attention_mask, offset, sliding_window, chunk, policy) -> _Call:
    batch, heads, tokens, _ = query.shape
    kv_heads = key.shape[1]
    share = active.view(batch, tokens, kv_heads, heads // kv_heads).float().mean(dim=(0, 1, 3)).tolist()  # (Hkv,)
    general = attention_mask is not None or sliding_window is not None
    short = not general and offset == 0 and tokens < policy.short_tokens
    full = [s >= (policy.short_dense_share if short else policy.dense_share) for s in share]
    if general or offset != 0:
        full = [False] * kv_heads  # plain causal attention only without a cache, a mask or a window
    chunk = chunk or policy.chunk_tokens(tokens)
    if short or (general and sliding_window is None and tokens < policy.short_tokens):
        chunk = tokens  # one segment per (batch row, key/value head): masked rows
    dense = [(s, e, any(share[g] < 1 for g in range(s, e))) for s, e in runs([g for g in range(kv_heads) if full[g]])]
    sparse = [g for g in range(kv_heads) if not full[g]]
    masked = general or chunk >= tokens
    return _Call(scaling, attention_mask, offset, sliding_window, chunk, masked, dense, sparse, policy)


# ---------------------------------------------------------------------------------------------------------------------
# flash attention with its log-sum-exp


def _flash(query, key, value, mask, scaling, causal=False):
    """Flash attention that also returns the log-sum-exp: query (N, Hq, n, hd), key/value (N, Hk, m, hd) with Hk
    dividing Hq (GQA), mask additive (N, 1, n, m) or None -> output (N, Hq, n, hd), lse (N, Hq, n)."""
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        query, key, value, is_causal=causal, attn_mask=mask, scale=scaling
    )


def _flash_backward(grad, query, key, value, out, lse, mask, scaling, causal=False):
    """Gradients (query, key, value) of a `_flash` call, from its rows' merged output and log-sum-exp."""
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
        grad, query, key, value, out, lse, 0.0, causal, attn_mask=mask, scale=scaling
    )


def _merge(out_a, lse_a, out_b, lse_b):
    """Two attention results (..., n, hd) with log-sum-exps (..., n) over disjoint key sets -> the result over their
    union (lse -inf: no keys). The weight of a is exp(lse_a - lse) = sigmoid(lse_a - lse_b)."""
    weight = torch.sigmoid(lse_a - lse_b)[..., None].to(out_a.dtype)
    return torch.lerp(out_b, out_a, weight), torch.logaddexp(lse_a, lse_b)


# ---------------------------------------------------------------------------------------------------------------------
# the dense path


def _dense_forward(query, key, value, active, call, out):
    """The dense runs' causal calls, written into `out` (B, T, H, hd); their (output, lse) for the backward."""
    groups, tokens = query.shape[1] // key.shape[1], query.shape[2]
    results = []
    for start, end, partial in call.dense:
        heads = slice(start * groups, end * groups)
        k, v = key[:, start:end, :tokens], value[:, start:end, :tokens]
        o, lse = _flash(query[:, heads], k, v, None, call.scaling, causal=True)  # (B, n·G, T, hd), (B, n·G, T)
        out[:, :, heads] = o.transpose(1, 2)
        if partial:  # the inactive pairs: 0
            out[:, :, heads].masked_fill_(~active[:, :, heads, None], 0)
        results.append((o, lse))
    return results


def _dense_backward(grad_out, query, key, value, active, call, results, grads):
    grad_query, grad_key, grad_value = grads
    groups, tokens = query.shape[1] // key.shape[1], query.shape[2]
    for (start, end, partial), (o, lse) in zip(call.dense, results):
        heads = slice(start * groups, end * groups)
        grad_heads = grad_out[:, :, heads]
        if partial:  # the zeroed outputs pass no gradient
            grad_heads = grad_heads.masked_fill(~active[:, :, heads, None], 0)
        k, v = key[:, start:end, :tokens], value[:, start:end, :tokens]
        dq, dk, dv = _flash_backward(
            grad_heads.transpose(1, 2), query[:, heads], k, v, o, lse, None, call.scaling, True
        )
        grad_query[:, :, heads] = dq.transpose(1, 2)
        grad_key[:, start:end, :tokens] += dk
        grad_value[:, start:end, :tokens] += dv


# ---------------------------------------------------------------------------------------------------------------------
# the sparse key/value heads' rows: chunked or masked


class _Rows:
    """The active rows of the key/value heads in `call.sparse`, in (batch, key/value head, token, head) order.

    `index` (N,) flat positions (b·T + t)·H + h in the (B·T·H) rows of a (B, T, H, hd) tensor; `tokens` (N,);
    `segments`: per (batch row, key/value head, chunk) with rows, (b, g, c, first row, end row); `diagonal` (N,) each
    row's place in the diagonal blocks of the sparse heads, (B·nc, C, Hs) in that order: the layout of the CPU kernel's
    output and log-sum-exp, so that their rows are gathered without a copy."""

    def __init__(self, active, kv_heads, call):
        batch, tokens, heads = active.shape
        groups, sparse, chunk = heads // kv_heads, call.sparse, call.chunk
        self.num_chunks = num_chunks = -(-tokens // chunk)
        chosen = torch.tensor(sparse, device=active.device)
        by_group = active.view(batch, tokens, kv_heads, groups).permute(0, 2, 1, 3).index_select(1, chosen)
        b, local, t, j = by_group.nonzero().unbind(1)  # (N,) each, in that order; local: among `sparse`
        self.tokens = t
        self.index = (b * tokens + t) * heads + chosen[local] * groups + j
        chunk_of = torch.div(t, chunk, rounding_mode="floor")
        segment = (b * len(sparse) + local) * num_chunks + chunk_of
        counts = torch.bincount(segment, minlength=batch * len(sparse) * num_chunks).tolist()
        self.segments, start = [], 0
        for flat, count in enumerate(counts):
            if count:
                bg, c = divmod(flat, num_chunks)
                self.segments.append((bg // len(sparse), sparse[bg % len(sparse)], c, start, start + count))
                start += count
        self.diagonal = ((b * num_chunks + chunk_of) * chunk + t % chunk) * len(sparse) * groups + local * groups + j

    def calls(self, call, dtype):
        """Per segment (b, g, first row, end row, first key, end key, additive mask or None): its rows' one flash call
        (chunked: the keys before its chunk, unmasked; masked rows: the keys they can see, masked)."""
        for b, g, c, start, end in self.segments:
            if not call.masked:
                if call.offset + c * call.chunk:
                    yield b, g, start, end, 0, call.offset + c * call.chunk, None
                continue
            first, last = call.offset + int(self.tokens[start]), call.offset + int(self.tokens[end - 1])
            low = 0 if call.sliding_window is None else max(0, first - call.sliding_window + 1)
            yield b, g, start, end, low, last + 1, _segment_mask(self.tokens[start:end], b, low, last + 1, call, dtype)


class _HeadSparsePrefill(torch.autograd.Function):
    @staticmethod
    def forward(ctx, query, key, value, active, call):
        batch, heads, tokens, head_dim = query.shape
        out = query.new_zeros(batch, tokens, heads, head_dim)
        dense = _dense_forward(query, key, value, active, call, out)
        rows, results = _Rows(active, key.shape[1], call) if call.sparse else None, None
        if rows is not None and rows.index.numel():
            q_rows = query.transpose(1, 2).reshape(-1, head_dim).index_select(0, rows.index)  # (N, hd)
            results = _rows_forward(query, q_rows, key, value, rows, call)
            out.view(-1, head_dim).index_copy_(0, rows.index, results[0])
        ctx.save_for_backward(query, key, value, active)
        ctx.call, ctx.rows, ctx.results, ctx.dense = call, rows, results, dense
        return out

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_out):
        query, key, value, active = ctx.saved_tensors
        call, rows = ctx.call, ctx.rows
        batch, heads, tokens, head_dim = query.shape
        grad_query = query.new_zeros(batch, tokens, heads, head_dim)
        grad_key, grad_value = torch.zeros_like(key), torch.zeros_like(value)
        _dense_backward(grad_out, query, key, value, active, call, ctx.dense, (grad_query, grad_key, grad_value))
        if ctx.results is not None:
            q_rows = query.transpose(1, 2).reshape(-1, head_dim).index_select(0, rows.index)
            go_rows = grad_out.reshape(-1, head_dim).index_select(0, rows.index)
            grads = (torch.zeros_like(q_rows), grad_key, grad_value)
            _rows_backward(go_rows, query, q_rows, key, value, *ctx.results, rows, call, grads)
            grad_query.view(-1, head_dim).index_copy_(0, rows.index, grads[0])
        return grad_query.transpose(1, 2), grad_key, grad_value, None, None


def _one_head(*tensors):
    """(n, ...) row tensors -> (1, 1, n, ...): one batch row, one head, for `_flash`."""
    return [x[None, None] for x in tensors]


def _rows_forward(query, q_rows, key, value, rows, call):
    """The rows' output (N, hd) and log-sum-exp (N,): their segments' calls, and (chunked) the diagonal blocks."""
    o_rows = torch.zeros_like(q_rows)  # no keys yet: output 0, lse -inf (what `_merge` adds to)
    lse_rows = q_rows.new_full(q_rows.shape[:1], float("-inf"), dtype=torch.promote_types(q_rows.dtype, torch.float32))
    for b, g, start, end, low, high, mask in rows.calls(call, q_rows.dtype):
        o, lse = _flash(*_one_head(q_rows[start:end], key[b, g, low:high], value[b, g, low:high]), mask, call.scaling)
        o_rows[start:end], lse_rows[start:end] = o[0, 0], lse[0, 0]
    if call.masked:
        return o_rows, lse_rows
    o_diag, lse_diag = _flash(*_diagonal_blocks(query, key, value, rows, call), None, call.scaling, causal=True)
    # (B·nc, Hs, C, hd), (B·nc, Hs, C), stored as (B·nc, C, Hs, ...) by the CPU kernel
    o_diag = o_diag.transpose(1, 2).reshape(-1, q_rows.shape[-1]).index_select(0, rows.diagonal)
    lse_diag = lse_diag.transpose(1, 2).reshape(-1).index_select(0, rows.diagonal)
    return _merge(o_rows, lse_rows, o_diag, lse_diag)


def _rows_backward(go_rows, query, q_rows, key, value, o_rows, lse_rows, rows, call, grads):
    dq_rows, grad_key, grad_value = grads
    for b, g, start, end, low, high, mask in rows.calls(call, q_rows.dtype):
        k, v = key[b, g, low:high], value[b, g, low:high]
        pieces = _one_head(go_rows[start:end], q_rows[start:end], k, v, o_rows[start:end], lse_rows[start:end])
        dq, dk, dv = _flash_backward(*pieces, mask, call.scaling)
        dq_rows[start:end] += dq[0, 0]
        grad_key[b, g, low:high] += dk[0, 0]
        grad_value[b, g, low:high] += dv[0, 0]
    if not call.masked:
        _diagonal_backward(go_rows, query, key, value, o_rows, lse_rows, rows, call, grads)


def _diagonal_blocks(query, key, value, rows, call):
    """The sparse key/value heads' queries (B·nc, Hs, C, hd) and keys/values (B·nc, Hkv_s, C, hd) cut into diagonal
    blocks (views where the strides allow, else copies; zero-padded to nc·C tokens)."""
    sparse, offset, tokens = call.sparse, call.offset, query.shape[2]
    groups = query.shape[1] // key.shape[1]
    pad = rows.num_chunks * call.chunk - tokens
    if sparse == list(range(sparse[0], sparse[-1] + 1)):  # one run: slices, no copy
        q_sel = query[:, sparse[0] * groups : (sparse[-1] + 1) * groups]
        k_sel, v_sel = (x[:, sparse[0] : sparse[-1] + 1, offset : offset + tokens] for x in (key, value))
    else:
        chosen = torch.tensor(sparse, device=query.device)
        head_ids = (chosen[:, None] * groups + torch.arange(groups, device=query.device)).flatten()
        q_sel = query.index_select(1, head_ids)
        k_sel, v_sel = (x[:, :, offset : offset + tokens].index_select(1, chosen) for x in (key, value))

    def blocks(x):  # (B, n, T, hd) -> (B·nc, n, C, hd)
        x = F.pad(x, (0, 0, 0, pad)) if pad else x
        return x.unflatten(2, (rows.num_chunks, call.chunk)).transpose(1, 2).flatten(0, 1)

    return blocks(q_sel), blocks(k_sel), blocks(v_sel)


def _diagonal_backward(go_rows, query, key, value, o_rows, lse_rows, rows, call, grads):
    """The diagonal call's gradients: its active rows with their merged output and lse, the inactive ones with no
    gradient and an lse that makes their probabilities 0."""
    dq_rows, grad_key, grad_value = grads
    batch, _, tokens, head_dim = query.shape
    blocks = _diagonal_blocks(query, key, value, rows, call)
    shape = (blocks[0].shape[0], blocks[0].shape[2], blocks[0].shape[1])  # (B·nc, C, Hs): `rows.diagonal`'s order
    grad_blocks = go_rows.new_zeros(*shape, head_dim).view(-1, head_dim).index_copy_(0, rows.diagonal, go_rows)
    out_blocks = torch.zeros_like(grad_blocks).index_copy_(0, rows.diagonal, o_rows)
    lse_blocks = lse_rows.new_full(shape, torch.finfo(lse_rows.dtype).max)
    lse_blocks.view(-1).index_copy_(0, rows.diagonal, lse_rows)
    grad_blocks, out_blocks = (x.view(*shape, head_dim).transpose(1, 2) for x in (grad_blocks, out_blocks))
    dq, dk, dv = _flash_backward(
        grad_blocks, *blocks, out_blocks, lse_blocks.transpose(1, 2), None, call.scaling, causal=True
    )  # (B·nc, Hs, C, hd)
    dq_rows += dq.transpose(1, 2).reshape(-1, head_dim).index_select(0, rows.diagonal)
    chosen = torch.tensor(call.sparse, device=query.device)

    def unblock(x):  # (B·nc, Hkv_s, C, hd) -> (B, Hkv_s, T, hd)
        x = x.view(batch, rows.num_chunks, len(call.sparse), call.chunk, head_dim)
        return x.transpose(1, 2).reshape(batch, len(call.sparse), -1, head_dim)[:, :, :tokens]

    grad_key[:, :, call.offset : call.offset + tokens].index_add_(1, chosen, unblock(dk))
    grad_value[:, :, call.offset : call.offset + tokens].index_add_(1, chosen, unblock(dv))


# ---------------------------------------------------------------------------------------------------------------------
# masked rows


@functools.lru_cache(maxsize=4)
def _causal_additive(size: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """(size, size) additive causal mask: row p hides the keys after p (dtype's minimum). Cached: the layers of a
    short prefill all gather their rows from the same one."""
    return torch.full((size, size), torch.finfo(dtype).min, dtype=dtype, device=device).triu_(1)


def _segment_mask(tokens, b, low, high, call, dtype):
    """(1, 1, n, m) additive mask of a segment's rows (their `tokens`) over keys [low, high): causal, window, the 4-D
    mask's rows."""
    attention_mask, offset, window = call.attention_mask, call.offset, call.sliding_window
    size = offset + call.chunk  # without a mask or window: masked rows in one chunk (every token)
    if attention_mask is None and window is None and size <= call.policy.causal_mask_cache_tokens:  # one gather
        return _causal_additive(size, dtype, tokens.device)[:, low:high].index_select(0, tokens + offset)[None, None]
    positions = tokens[:, None] + offset
    keys = torch.arange(low, high, device=tokens.device)[None, :]
    hidden = keys > positions
    if window is not None:
        hidden |= keys <= positions - window
    minimum = torch.finfo(dtype).min
    mask = hidden.to(dtype).mul_(minimum)  # 2 passes over (n, m) (visible: -0.0, which adds nothing)
    if attention_mask is not None:
        given = attention_mask[b if attention_mask.shape[0] > 1 else 0, 0].index_select(0, tokens)[:, low:high]
        if given.dtype == torch.bool:
            mask.masked_fill_(~given, minimum)
        else:
            mask = (mask + given.to(dtype)).clamp_min(minimum)
    return mask[None, None]
