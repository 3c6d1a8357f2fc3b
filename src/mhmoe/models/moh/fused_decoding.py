"""MoH's decoding step on the CPU: one token per sequence, without autograd, in as few ops as its arithmetic allows.

Why: a decoding step of a small model on the CPU costs as much in per-op dispatch as in arithmetic, and the router's
few ops per layer (scores, top-K, gates, the multiply) made MoH decoding of SmolLM2-135M ×0.90–0.93 its parent's speed
(benchmarks/results/moh_head_sparse.md, the run at b922794; ×0.97–0.99 with the fused step, the runs at c391b2e and
97fc1ed). This step makes the same computation in fewer ops than the parent's own attention does:

- one GEMV for the keys, values, the router's scores (for a router that scores with a matrix, the learned one) and
  the queries, over a cached concatenation of the projections' weights (`fused_projection`: one more copy of their
  weights in memory, rebuilt when a weight changes; the config's `moh_fused_decoding = False` turns the step off;
  `attention_plan.py` decides when it runs);
- the top-K of the few rows picked on the host from one read of the scores (`host_hard_gates`; a tie between the K-th
  and the next score falls back to `torch.topk`);
- RoPE once over the queries and keys together;
- the attention through `ops/backends.head_sparse_decode` (torch's SDPA): its own GQA (`enable_gqa`, Transformers'
  choice without a mask: faster than packing on the CPU, ~40 µs a layer at 4,096 keys here), or with a mask GQA packed
  (a key/value head's query heads as its query rows).

Head-sparse (`FusedProjection.skips_heads`: an fp32 model with a plain o_proj): the step reads only the active heads'
columns of o_proj and only the key/value heads an active head needs: by runs of them, one SDPA call each, where the
ones skipped between runs hold at least the CPU policy's `decode_split_min_skipped_keys` keys, else the span from the
first to the last. When the router scores the hidden states (`skips_queries`: the learned router, the converter's
fitted one) the queries are not needed to route, so it reads only the active heads' rows of q_proj too (the
parameter-free routers score every query).
Decoding is memory-bound: those are the bytes MoH can save per token. The weights are read as contiguous blocks per
run of consecutive active heads (`step_plan`, cached per selection: views of q_proj's weight and of a head-major copy
of o_proj's). Otherwise (bf16, a LoRA'd or hooked o_proj) the gates multiply every head's output before the whole
o_proj.

It equals `attention_forward`'s masked path (tested: logits and greedy tokens), for straight-through (0/1) gates.

Shape legend: B batch, d hidden size, H query heads, Hkv key/value heads, g = H / Hkv, hd head_dim, R routed heads,
L cached keys (this token included), n the query heads of the attended key/value heads.
"""

from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn
from transformers.models.llama.modeling_llama import rotate_half

from ..ops.backends import head_sparse_decode
from ..ops.head_sparse_attention.head_sparse_attention_cpu_policy import DEFAULT_CPU_POLICY
from ..ops.head_sparse_attention.head_sparse_attention_naive import runs as _runs
from .head_skipping import _head_major_weight

HOST_ROWS = 16  # up to this many tokens per step the top-K is picked on the host (a batch of decoded sequences)
GATE_ROWS_CACHED = 1024  # gate rows (and step plans) kept per router (one per selection seen; C(R, K) can be large)

# Each line below runs in every layer of every decoding step: module attributes are read from `_modules` and
# `_parameters` (nn.Module.__getattr__ costs ~1 µs a read), the cheapest refusals first.


class StepPlan(NamedTuple):
    """What a head-sparse step reads for one set of active heads: the query heads [first, last) of the key/value heads
    [first // g, last // g) (whole GQA groups, from the first to the last group an active head needs), their query
    pieces when it skips queries ((width, q_proj weight rows, bias rows), weight None for a run of inactive heads:
    zeros), the o_proj runs ((start, end) columns of the attended heads, the head-major o_proj rows they meet), and
    the runs of key/value heads an active head needs, relative to first // g (None when they are one run), with the
    number of key/value heads between them that none needs."""

    first: int
    last: int
    query_pieces: tuple
    output_runs: tuple
    kv_runs: tuple | None
    skipped_kv_heads: int


class FusedProjection(NamedTuple):
    """A module's cached weights for the step. `weight` ([H·hd unless skips_queries] + 2·Hkv·hd [+ R], d): queries
    (all of them when the router reads them), keys, values [and the router's scores, when `scores_fused`]."""

    weight: torch.Tensor
    bias: torch.Tensor | None
    scores_fused: bool
    skips_heads: bool  # o_proj's columns and the key/value heads of the active heads only
    skips_queries: bool  # and q_proj's rows of the active heads only
    kv_heads: int
    query_weight: torch.Tensor | None  # q_proj's (H·hd, d), for the active heads' rows (skips_queries)
    query_bias: torch.Tensor | None
    output_weight: torch.Tensor | None  # o_proj's, head-major (H·hd, d) (skips_heads)
    output_bias: torch.Tensor | None
    plans: dict  # active heads -> StepPlan


def _plain_linear(projection: nn.Module) -> bool:
    """An nn.Linear the step can read the weights of: not LoRA, BitNet or quantised (a subclass or wrapper), not
    offloaded by Accelerate's hooks (weights loaded in forward), on the CPU."""
    return type(projection) is nn.Linear and "_hf_hook" not in projection.__dict__ and projection.weight.is_cpu


def fused_projection(module) -> FusedProjection | None:
    """The module's `FusedProjection`, cached on the module (not in the state dict) and rebuilt whenever a projection
    or the router's score matrix changes (training, loading, `.to()`: a new tensor or an in-place update; an edit
    through `.data` bypasses the version counter and is not seen). None when q_proj, k_proj or v_proj is not a plain
    nn.Linear (`_plain_linear`) or q_proj holds only some heads (tensor parallelism).

    The router's matrix is fused when it scores the hidden states linearly (`score_weight`) in an fp32 model: it
    scores in fp32 in every other path, so in bf16 it scores on its own. The step is head-sparse (`skips_heads`) in
    an fp32 model whose o_proj is a plain nn.Linear without hooks: it then sums o_proj's blocks in another order,
    which only fp32 leaves equal to the masked path to rounding; it skips the queries too (`skips_queries`) when the
    router's matrix is fused."""
    modules = module._modules
    router, o_proj = modules["head_router"], modules["o_proj"]
    projections = (modules["q_proj"], modules["k_proj"], modules["v_proj"])
    if not all(_plain_linear(projection) for projection in projections):
        return None
    weights = [projection._parameters["weight"] for projection in projections]
    biases = [projection._parameters["bias"] for projection in projections]
    score_weight = router.score_weight() if weights[0].dtype == torch.float32 else None
    hooked = o_proj._forward_hooks or o_proj._forward_pre_hooks  # checked every step: hooks come and go
    skips_heads = weights[0].dtype == torch.float32 and _plain_linear(o_proj) and not hooked
    skips_queries = skips_heads and score_weight is not None
    tensors = (*weights, *biases, score_weight, o_proj._parameters["weight"] if skips_heads else None)
    cached = module.__dict__.get("_moh_fused_projection")
    if (
        cached is not None
        and cached[1].skips_heads == skips_heads
        and all(a is b and (a is None or a._version == version) for a, b, version in zip(tensors, *cached[0]))
    ):
        return cached[1]
    head_dim, heads = module.head_dim, router.num_heads
    if weights[0].shape[0] != heads * head_dim:
        return None
    fused = weights[1:] if skips_queries else weights  # the queries come per active head when the step skips them
    fused_biases = biases[1:] if skips_queries else biases
    weight = torch.cat([w.detach() for w in (*fused, score_weight) if w is not None])
    bias = None
    if any(b is not None for b in fused_biases):
        rows = [w.new_zeros(w.shape[0]) if b is None else b.detach() for w, b in zip(fused, fused_biases)]
        bias = torch.cat(rows + ([weight.new_zeros(score_weight.shape[0])] if score_weight is not None else []))
    query_bias = None if biases[0] is None else biases[0].detach()
    output_bias = None if o_proj.bias is None else o_proj.bias.detach()
    projection = FusedProjection(
        weight,
        bias,
        score_weight is not None,
        skips_heads,
        skips_queries,
        weights[1].shape[0] // head_dim,
        weights[0].detach() if skips_queries else None,
        query_bias if skips_queries else None,
        _head_major_weight(o_proj) if skips_heads else None,
        output_bias if skips_heads else None,
        {},
    )
    versions = tuple(None if t is None else t._version for t in tensors)
    module._moh_fused_projection = ((tensors, versions), projection)
    return projection


def host_hard_gates(router, logits: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, tuple] | None:
    """(N, R) scores -> (N, H) 0/1 gates in `dtype` (shared heads 1, each row's top-K routed heads 1, or those above
    the router's threshold) and the heads on in any row (sorted ids), picked on the host from one read of the scores;
    None when a row's K-th and (K+1)-th scores tie (`torch.topk` then decides, as in every other path). Gate rows are
    cached per selection."""
    routed, active, shared, threshold = router.routed_heads, router.active_heads, router.shared_heads, router.threshold
    cache = router.__dict__.setdefault("_host_gate_rows", {})
    rows = []
    for scores in logits.tolist():
        if threshold is not None:  # the heads scoring above the layer's threshold
            key = (dtype, *(head for head in range(routed) if scores[head] > threshold))
        else:
            order = sorted(range(routed), key=scores.__getitem__, reverse=True)
            if active and scores[order[active - 1]] == scores[order[active]]:
                return None
            key = (dtype, *sorted(order[:active]))
        row = cache.get(key)
        if row is None:
            if len(cache) >= GATE_ROWS_CACHED:
                cache.clear()
            heads = (*range(shared), *(shared + head for head in key[1:]))
            gates = torch.zeros(1, router.num_heads, dtype=dtype)
            gates[0, list(heads)] = 1.0
            row = cache[key] = (gates, heads)
        rows.append(row)
    if len(rows) == 1:
        return rows[0]
    heads = tuple(sorted(set().union(*(row[1] for row in rows))))
    return torch.cat([row[0] for row in rows]), heads


def step_plan(projection: FusedProjection, heads_on: tuple, heads: int, head_dim: int) -> StepPlan:
    """The `StepPlan` of a head-sparse step whose active heads are `heads_on` (sorted, not empty), cached."""
    plan = projection.plans.get(heads_on)
    if plan is not None:
        return plan
    groups = heads // projection.kv_heads
    first, last = heads_on[0] // groups * groups, (heads_on[-1] // groups + 1) * groups
    pieces, outputs, done = [], [], first
    query_weight, query_bias, output_weight = projection.query_weight, projection.query_bias, projection.output_weight
    for start, end in _runs(list(heads_on)):
        rows = slice(start * head_dim, end * head_dim)
        outputs.append(((start - first) * head_dim, (end - first) * head_dim, output_weight[rows]))
        if query_weight is not None:  # else the router read every query: none to plan
            if start > done:
                pieces.append(((start - done) * head_dim, None, None))
            bias = None if query_bias is None else query_bias[rows]
            pieces.append(((end - start) * head_dim, query_weight[rows], bias))
            done = end
    if query_weight is not None and last > done:
        pieces.append(((last - done) * head_dim, None, None))
    needed = sorted({head // groups - first // groups for head in heads_on})  # key/value heads, from the span's first
    kv_runs = tuple(_runs(needed))
    skipped = needed[-1] + 1 - len(needed)
    if len(projection.plans) >= GATE_ROWS_CACHED:
        projection.plans.clear()
    plan = StepPlan(first, last, tuple(pieces), tuple(outputs), kv_runs if len(kv_runs) > 1 else None, skipped)
    projection.plans[heads_on] = plan
    return plan


def fused_decoding_step(module, hidden_states, position_embeddings, attention_mask, cache, projection):
    """The attention output (B, 1, d) of a decoding step and None (no attention weights), equal to the masked path
    of `attention_forward` with the router's straight-through gates. `projection`: the plan's (`attention_plan.py`)."""
    modules = module._modules
    router, head_dim = modules["head_router"], module.head_dim
    batch, _, hidden = hidden_states.shape
    x = hidden_states.view(batch, hidden)
    heads, kv_heads, skips = router.num_heads, projection.kv_heads, projection.skips_heads
    projected = F.linear(x, projection.weight, projection.bias)  # (B, [H·hd +] 2Hkv·hd [+ R])
    q_width = 0 if projection.skips_queries else heads * head_dim
    k_end, v_end = q_width + kv_heads * head_dim, q_width + 2 * kv_heads * head_dim
    if projection.scores_fused:
        logits = projected[:, v_end:]  # (B, R)
    else:  # bf16 scores in fp32 on their own; the parameter-free routers score the pre-RoPE queries
        queries = projected[:, :q_width].view(batch, 1, heads, head_dim)
        logits = router.scores(hidden_states, queries, None).view(batch, -1)
    picked = host_hard_gates(router, logits, hidden_states.dtype) if batch <= HOST_ROWS else None
    if picked is None:
        gates = router.hard_gates(logits.view(batch, 1, -1))[0].view(batch, heads).to(hidden_states.dtype)
        heads_on, weighted = tuple(range(heads)), True
    else:  # one sequence: the heads read are its active heads, no multiply needed
        (gates, heads_on), weighted = picked, batch > 1 or not skips
    if skips and not heads_on:  # a threshold that passes no head and no shared heads: head 0, gated to 0
        heads_on, weighted = (0,), True

    cos, sin = position_embeddings  # (B or 1, 1, hd)
    first, last, computed = 0, heads, heads  # the attended query heads [first, last); queries computed
    if skips:
        plan = step_plan(projection, heads_on, heads, head_dim)
        first, last = plan.first, plan.last
    if projection.skips_queries:  # the active heads' queries (zeros for the inactive ones between them), the keys
        parts = [F.linear(x, w, b) if w is not None else x.new_zeros(batch, width) for width, w, b in plan.query_pieces]
        qk, computed = torch.cat([*parts, projected[:, :k_end]], dim=1), last - first
    else:  # every query (the router read them), the keys
        qk = projected[:, :k_end]
    qk = qk.view(batch, computed + kv_heads, head_dim)
    qk = qk * cos.view(-1, 1, head_dim) + rotate_half(qk) * sin.view(-1, 1, head_dim)  # RoPE once for q and k
    keys = qk[:, computed:].view(batch, kv_heads, 1, head_dim)
    values = projected[:, k_end:v_end].view(batch, kv_heads, 1, head_dim)
    keys, values = cache.update(keys, values, module.layer_idx)  # (B, Hkv, L, hd): every head's, for later tokens
    groups, query_heads = heads // kv_heads, last - first
    if query_heads < heads:  # the key/value heads of the attended groups only
        keys, values = keys[:, first // groups : last // groups], values[:, first // groups : last // groups]
    offset = 0 if projection.skips_queries else first  # where the attended heads' queries start
    kv_runs = None  # by runs of key/value heads where the ones skipped between them hold enough keys
    split_keys = DEFAULT_CPU_POLICY.decode_split_min_skipped_keys
    if skips and plan.kv_runs is not None and plan.skipped_kv_heads * keys.shape[-2] >= split_keys:
        kv_runs = plan.kv_runs
    queries = qk[:, offset : offset + query_heads]  # (B, n, hd)
    attended = head_sparse_decode(queries, keys, values, module.scaling, attention_mask, kv_runs)
    if weighted:
        attended = attended * gates[:, first:last, None]
    if not skips:
        return modules["o_proj"](attended.view(batch, 1, heads * head_dim)), None
    attended = attended.view(batch, query_heads * head_dim)
    output = projection.output_bias
    for start, end, weight in plan.output_runs:  # o_proj's blocks of the active heads: ((end - start), d) each
        block = attended[:, start:end]
        output = torch.mm(block, weight) if output is None else torch.addmm(output, block, weight)
    return output.view(batch, 1, hidden), None


__all__ = [
    "FusedProjection",
    "StepPlan",
    "fused_decoding_step",
    "fused_projection",
    "host_hard_gates",
    "step_plan",
]
