"""MoH's decoding step on the CPU: one token per sequence, without autograd, in as few ops as its arithmetic allows.

Why: a decoding step of a small model on the CPU costs as much in per-op dispatch as in arithmetic, and the router's
few ops per layer (scores, top-K, gates, the multiply) made MoH decoding of SmolLM2-135M ×0.90–0.93 its parent's speed
(benchmarks/results/moh_head_sparse.md, the run at b922794; ×0.97–0.99 with this step, the runs at c391b2e and
97fc1ed). This step makes the same computation in fewer ops than the parent's own attention does:

- one GEMV for the queries, keys, values and (for a router that scores with a matrix, the learned one) the router's
  scores, over a cached concatenation of the projections' weights (`fused_projection`: one more copy of q/k/v's
  weights in memory, rebuilt when a weight changes; `attention.moh_fused_decoding = False` turns the step off);
- RoPE once over the queries and keys together;
- the top-K of the few rows picked on the host from one read of the scores (`host_hard_gates`; a tie between the K-th
  and the next score falls back to `torch.topk`);
- GQA packed into one SDPA call (a key/value head's query heads as its query rows) and the gates applied in the one
  multiply that makes o_proj's input.

It equals `attention_forward`'s masked path (tested: logits and greedy tokens), for straight-through (0/1) gates.

Shape legend: B batch, d hidden size, H query heads, Hkv key/value heads, g = H / Hkv, hd head_dim, R routed heads,
L cached keys (this token included).
"""

import torch
import torch.nn.functional as F
from torch import nn
from transformers.models.llama.modeling_llama import rotate_half

HOST_ROWS = 16  # up to this many tokens per step the top-K is picked on the host (a batch of decoded sequences)
GATE_ROWS_CACHED = 1024  # gate rows kept per router (one per selection seen; C(R, K) can be large)

# Each line below runs in every layer of every decoding step: module attributes are read from `_modules` and
# `_parameters` (nn.Module.__getattr__ costs ~1 µs a read), the cheapest refusals first.


def fused_decoding_projection(
    module, hidden_states, position_embeddings, attention_mask, cache, sliding_window, kwargs
) -> tuple[torch.Tensor, torch.Tensor | None, bool] | None:
    """`fused_projection(module)` when `attention_forward` can take `fused_decoding_step` for this call, else None:
    a decoding step (one new token per sequence, a cache) on the CPU without autograd, sdpa, straight-through gates of
    which some can be 0, plain nn.Linear projections holding every head, RoPE over the whole head, no sliding window,
    nothing recording the router's output, and the module's defaults (`moh_fused_decoding` True; `moh_head_skipping`
    True: a backend named there, or False for the masked path, is what runs)."""
    if hidden_states.shape[1] != 1 or cache is None or torch.is_grad_enabled() or not hidden_states.is_cpu:
        return None
    router = module._modules["head_router"]
    settings = module.__dict__
    if not settings.get("moh_fused_decoding", True) or settings.get("moh_head_skipping", True) is not True:
        return None  # turned off, or a head-skipping backend / the masked path asked for by name
    if not router.straight_through:
        return None
    if router.shared_heads + router.active_heads >= router.num_heads:  # every head on: the parent's computation
        return None
    if sliding_window is not None or kwargs.get("output_attentions") or (module.training and module.attention_dropout):
        return None
    if router._forward_hooks or router._forward_pre_hooks or nn.modules.module._global_forward_hooks:
        return None  # output capturing (the router logits) hooks the router's forward: let it run
    if attention_mask is not None and not (isinstance(attention_mask, torch.Tensor) and attention_mask.dim() == 4):
        return None
    if position_embeddings[0].shape[-1] != module.head_dim:  # partial rotary
        return None
    if module.config._attn_implementation != "sdpa":
        return None
    return fused_projection(module)


def fused_projection(module) -> tuple[torch.Tensor, torch.Tensor | None, bool] | None:
    """(weight ((H + 2·Hkv)·hd [+ R], d), bias or None, whether the router's scores are its last R rows): q_proj,
    k_proj and v_proj [and the router's score matrix] concatenated, cached on the module (not in the state dict) and
    rebuilt whenever one of them changes (training, loading, `.to()`: a new tensor or an in-place update; an edit
    through `.data` bypasses the version counter and is not seen). None when a projection is not a plain
    nn.Linear (LoRA, BitNet, quantised) or is offloaded (Accelerate's hooks, weights off the CPU), or q_proj holds only
    some heads (tensor parallelism).

    The router's matrix is fused when it scores the hidden states linearly (`score_weight`) in an fp32 model: it
    scores in fp32 in every other path, so in bf16 it scores on its own."""
    modules = module._modules
    projections = (modules["q_proj"], modules["k_proj"], modules["v_proj"])
    if any(type(projection) is not nn.Linear or "_hf_hook" in projection.__dict__ for projection in projections):
        return None  # LoRA, BitNet, quantised layers; Accelerate's offloading hooks (weights loaded in forward)
    weights = [projection._parameters["weight"] for projection in projections]
    if not all(weight.is_cpu for weight in weights):
        return None
    biases = [projection._parameters["bias"] for projection in projections]
    score_weight = modules["head_router"].score_weight() if weights[0].dtype == torch.float32 else None
    tensors = (*weights, *biases, score_weight)
    cached = module.__dict__.get("_moh_fused_projection")
    if cached is not None and all(
        a is b and (a is None or a._version == version) for a, b, version in zip(tensors, *cached[0])
    ):
        return cached[1]
    if weights[0].shape[0] != modules["head_router"].num_heads * module.head_dim:
        return None
    weight = torch.cat([w.detach() for w in (*weights, score_weight) if w is not None])
    bias = None
    if any(b is not None for b in biases):
        rows = [w.new_zeros(w.shape[0]) if b is None else b.detach() for w, b in zip(weights, biases)]
        bias = torch.cat(rows + ([weight.new_zeros(score_weight.shape[0])] if score_weight is not None else []))
    versions = tuple(None if t is None else t._version for t in tensors)
    module._moh_fused_projection = ((tensors, versions), (weight, bias, score_weight is not None))
    return weight, bias, score_weight is not None


def host_hard_gates(router, logits: torch.Tensor, dtype: torch.dtype) -> torch.Tensor | None:
    """(N, R) scores -> (N, H) 0/1 gates in `dtype` (shared heads 1, each row's top-K routed heads 1, or those above
    the router's threshold), picked on the host from one read of the scores; None when a row's K-th and (K+1)-th
    scores tie (`torch.topk` then decides, as in every other path). Gate rows are cached per selection."""
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
            row = torch.zeros(1, router.num_heads, dtype=dtype)
            row[0, :shared] = 1.0
            row[0, [shared + head for head in key[1:]]] = 1.0
            cache[key] = row
        rows.append(row)
    return rows[0] if len(rows) == 1 else torch.cat(rows)


def fused_decoding_step(module, hidden_states, position_embeddings, attention_mask, cache, projection):
    """The attention output (B, 1, d) of a decoding step and None (no attention weights), equal to the masked path
    of `attention_forward` with the router's straight-through gates. `projection`: `fused_decoding_projection`'s."""
    modules = module._modules
    router, head_dim = modules["head_router"], module.head_dim
    batch, _, hidden = hidden_states.shape
    weight, bias, fused_scores = projection
    heads, kv_heads = router.num_heads, modules["k_proj"].out_features // head_dim
    projected = F.linear(hidden_states.view(batch, hidden), weight, bias)  # (B, (H + 2Hkv)·hd [+ R])
    qk_width, v_end = (heads + kv_heads) * head_dim, (heads + 2 * kv_heads) * head_dim
    if fused_scores:
        logits = projected[:, v_end:]  # (B, R)
    else:  # the parameter-free routers score the pre-RoPE queries
        queries = projected[:, : heads * head_dim].view(batch, 1, heads, head_dim)
        logits = router.scores(hidden_states, queries, None).view(batch, -1)
    gates = host_hard_gates(router, logits, hidden_states.dtype) if batch <= HOST_ROWS else None
    if gates is None:
        gates = router.hard_gates(logits.view(batch, 1, -1))[0].view(batch, heads).to(hidden_states.dtype)

    cos, sin = position_embeddings  # (B or 1, 1, hd)
    qk = projected[:, :qk_width].view(batch, heads + kv_heads, head_dim)
    qk = qk * cos.view(-1, 1, head_dim) + rotate_half(qk) * sin.view(-1, 1, head_dim)  # RoPE once for q and k
    keys = qk[:, heads:].view(batch, kv_heads, 1, head_dim)
    values = projected[:, qk_width:v_end].view(batch, kv_heads, 1, head_dim)
    keys, values = cache.update(keys, values, module.layer_idx)  # (B, Hkv, L, hd)
    queries = qk[:, :heads].view(batch, kv_heads, heads // kv_heads, head_dim)  # GQA packed: (B, Hkv, g, hd)
    attended = F.scaled_dot_product_attention(queries, keys, values, attn_mask=attention_mask, scale=module.scaling)
    attended = attended.reshape(batch, heads, head_dim) * gates.view(batch, heads, 1)  # (B, H, hd)
    return modules["o_proj"](attended.view(batch, 1, heads * head_dim)), None


__all__ = ["fused_decoding_projection", "fused_decoding_step", "fused_projection", "host_hard_gates"]
