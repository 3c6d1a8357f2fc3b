"""Mixture-of-Head attention (MoH, Jin et al. 2024): attention heads as experts.

Shape legend: B batch, T query tokens, L key/value tokens (cache included), d hidden size, H query heads, Hkv key/value
heads, g = H / Hkv heads per key/value head (GQA), hd head_dim, S shared heads (always on, the first S heads),
R = H - S routed heads, K routed heads active per token (top-K), A = S + K active heads per token.

Per token the gates g_i (B, T, H) multiply each head's attention output (B, T, H, hd) before `o_proj` (the paper's
summation form, eq. 4), so every attention backend (eager, sdpa, flex, flash) and GQA work unchanged.

Routers (`moh_router`):
- "learned": the paper's two-stage router (eq. 5-6). Routed gates softmax(W_r x) -> top-K -> renormalised over the K
  -> ×K; shared gates softmax(W_s x) ×S; stage weights [α1, α2] = softmax(W_h x) ×2. All three matrices start at zero,
  so every gate starts at exactly 1 (uniform) and a fresh layer with all heads active is plain multi-head attention.
- "l2": parameter-free (continue-tuning, §4.4): per token the L2 norm of each routed head's pre-RoPE query, divided by
  the per-token std of those norms (clamped), softmax, top-K; shared gates are 1. Adds no parameters, so the state
  dict stays the dense model's.
- "l2_standardized" / "l2_relative" (calibrated conversion, `mhmoe.convert`): each routed head's pre-RoPE query
  norm n_h scored against its own statistics measured on calibration text (config `moh_head_norm_mean` μ_h and
  `moh_head_norm_std` σ_h, per layer: plain lists, no parameters): (n_h - μ_h) / σ_h, or n_h / μ_h; softmax, top-K.
`moh_straight_through`: forward gates are exactly 0/1 (selected or not), the backward is a straight-through estimator,
so the router (or, for "l2", the query projection through the norms) keeps learning. True: the gradient of the soft
gates (top-K weights renormalised ×K, zero on unselected heads; this library's). "scores" (l2 router): eq. 9-10 as
written, ∂L/∂g_i^q = ∂L/∂g_i with g_i the raw softmax score of every routed head, selected or not.

Head skipping (CPU): in decoding (few query rows, no gradient) attention and the `o_proj` contribution are computed
only for each row's active heads, on views of the KV cache (never copied) and of a head-major copy of `o_proj.weight`
(kept per layer, one o_proj of memory); K/V stay cached for all heads. The result equals the masked computation
(tested). `module.moh_head_skipping = False` turns it off.

This file runs on torch + transformers alone: exported checkpoints ship it next to the modeling file.
"""

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn
from transformers import initialization as init
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb, eager_attention_forward

from .cache_naming import either_cache
from .configuration_mhmoe import CALIBRATED_MOH_ROUTERS, MOH_ROUTERS
from .routing import l2_head_gates, routing_backend
L2_STD_MIN = 1e-6  # clamp of the per-token std in the "l2" router
HEAD_SKIPPING_MAX_ROWS = 8  # head skipping loops over query rows: only for decoding-sized inputs (B·T rows)


def moh_enabled(config) -> bool:
    return getattr(config, "moh_active_heads", None) is not None


def routed_gates(router_logits: torch.Tensor, active_heads: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(B, T, R) logits -> soft routed gates (B, T, R) fp32 (top-K probs renormalised over the K, ×K; 0 elsewhere) and
    the selected routed heads (B, T, K). Uniform probabilities give gate 1 on every selected head."""
    probs = torch.softmax(router_logits.float(), dim=-1)
    weights, index = torch.topk(probs, active_heads, dim=-1)
    weights = weights / weights.sum(dim=-1, keepdim=True) * active_heads
    return torch.zeros_like(probs).scatter(-1, index, weights), index


def l2_router_logits(routed_queries: torch.Tensor) -> torch.Tensor:
    """(B, T, R, hd) pre-RoPE queries of the routed heads -> (B, T, R) fp32 scores: each head's L2 norm divided by the
    per-token std of the R norms (clamped at L2_STD_MIN)."""
    return l2_scores(routed_queries.float().norm(dim=-1))


def l2_scores(norms: torch.Tensor) -> torch.Tensor:
    """(B, T, R) fp32 query norms of the routed heads -> the "l2" router's (B, T, R) scores."""
    std = norms.std(dim=-1, keepdim=True, correction=1 if norms.shape[-1] > 1 else 0)
    return norms / std.clamp_min(L2_STD_MIN)


def straight_through(soft: torch.Tensor, hard: torch.Tensor) -> torch.Tensor:
    """Forward value exactly `hard`, gradient of `soft` (eq. 10)."""
    return hard + (soft - soft.detach())


class MoHRouter(nn.Module):
    """Per-token head gates. forward(hidden (B, T, d), pre-RoPE queries (B, T, H, hd)) returns
    `gates` (B, T, H) fp32, `router_logits` (B, T, R) fp32 (recorded for the load-balancing loss and head statistics)
    and `routed_index` (B, T, K)."""

    def __init__(
        self,
        hidden_size: int,
        num_heads: int,
        shared_heads: int,
        active_heads: int,
        router: str = "learned",
        straight_through: bool = False,
        head_norm_stats: tuple[list[float], list[float]] | None = None,
    ):
        super().__init__()
        if router not in MOH_ROUTERS:
            raise ValueError(f"moh_router must be one of {MOH_ROUTERS}, got {router!r}")
        self.num_heads = num_heads
        self.shared_heads = shared_heads
        self.routed_heads = num_heads - shared_heads
        self.active_heads = active_heads
        self.router = router
        self.straight_through = straight_through
        self.routed_weight = self.shared_weight = self.stage_weight = None
        # calibrated routers: mean and std of each head's query norm, plain lists (not in the state dict; models are
        # built on the meta device when loaded), made a (2, H) tensor on the queries' device on first use
        self.head_norm_stats = head_norm_stats
        self._head_norm_tensor = None
        if router in CALIBRATED_MOH_ROUTERS and self.head_norm_stats is None:
            raise ValueError(f"moh_router {router!r} needs per-head query-norm statistics (head_norm_stats)")
        if router == "learned":
            self.routed_weight = nn.Parameter(torch.zeros(self.routed_heads, hidden_size))  # W_r
            if shared_heads > 1:  # softmax over a single shared head is 1: no W_s needed
                self.shared_weight = nn.Parameter(torch.zeros(shared_heads, hidden_size))  # W_s
            if shared_heads > 0:
                self.stage_weight = nn.Parameter(torch.zeros(2, hidden_size))  # W_h

    @classmethod
    def from_config(cls, config, layer_idx: int | None = None) -> "MoHRouter":
        stats = None
        if config.moh_router in CALIBRATED_MOH_ROUTERS:
            stats = (config.moh_head_norm_mean[layer_idx], config.moh_head_norm_std[layer_idx])
        router = cls(
            config.hidden_size,
            config.num_attention_heads,
            config.moh_shared_heads,
            config.moh_active_heads,
            config.moh_router,
            config.moh_straight_through,
            stats,
        )
        router.routing_backend = getattr(config, "routing_backend", None)  # "torch" | "triton" | None: by device
        return router

    def reset_parameters(self):
        """Zero router weights: uniform probabilities, every gate exactly 1 at the start."""
        for param in (self.routed_weight, self.shared_weight, self.stage_weight):
            if param is not None:
                init.zeros_(param)

    def calibrated_scores(self, norms: torch.Tensor) -> torch.Tensor:
        """(B, T, R) fp32 query norms of the routed heads -> the calibrated routers' (B, T, R) scores."""
        stats = self._head_norm_tensor
        if stats is None or stats.device != norms.device:
            stats = self._head_norm_tensor = torch.tensor(self.head_norm_stats, dtype=torch.float32, device=norms.device)
        mean, std = stats[0, self.shared_heads :], stats[1, self.shared_heads :]
        if self.router == "l2_relative":
            return norms / mean
        return (norms - mean) / std

    def extra_repr(self) -> str:
        return (
            f"heads={self.num_heads}, shared={self.shared_heads}, active_routed={self.active_heads}, "
            f"router={self.router!r}, straight_through={self.straight_through}"
        )

    def forward(self, hidden_states: torch.Tensor, query_states: torch.Tensor, head_norms: torch.Tensor | None = None):
        """`head_norms` (B, T, H): the "l2" router's query norms of every head, when `query_states` holds only some
        heads (tensor parallelism gathers them: `moh_parallel.py`)."""
        shared = self.shared_heads
        backend = getattr(self, "routing_backend", None)
        # the fused kernel reads the queries' own heads: not with tensor parallelism's gathered `head_norms`
        scores_ste = self.straight_through == "scores"  # eq. 9-10 on the raw scores: the torch path computes it
        if (self.router == "l2" and head_norms is None and not scores_ste
                and routing_backend(query_states, backend)[0] == "triton"):  # fmt: skip
            return l2_head_gates(query_states, shared, self.active_heads, self.straight_through, backend)
        if self.router == "learned":
            x = hidden_states.float()
            router_logits = F.linear(x, self.routed_weight.float())  # (B, T, R)
        elif self.head_norm_stats is not None:
            norms = head_norms if head_norms is not None else query_states.float().norm(dim=-1)
            router_logits = self.calibrated_scores(norms[..., shared:])
        elif head_norms is not None:
            router_logits = l2_scores(head_norms[..., shared:])
        else:
            router_logits = l2_router_logits(query_states[..., shared:, :])
        routed_soft, routed_index = routed_gates(router_logits, self.active_heads)  # (B, T, R), (B, T, K)
        shared_soft = routed_soft.new_ones(*routed_soft.shape[:-1], shared)  # (B, T, S)
        if self.stage_weight is not None:
            if self.shared_weight is not None:
                shared_soft = torch.softmax(F.linear(x, self.shared_weight.float()), dim=-1) * shared
            stage = torch.softmax(F.linear(x, self.stage_weight.float()), dim=-1) * 2  # (B, T, 2): α1, α2
            shared_soft = shared_soft * stage[..., :1]
            routed_soft = routed_soft * stage[..., 1:]
        gates = torch.cat([shared_soft, routed_soft], dim=-1)  # (B, T, H)
        if self.straight_through:
            hard = torch.zeros_like(routed_soft).scatter(-1, routed_index, 1.0)
            hard = torch.cat([torch.ones_like(shared_soft), hard], dim=-1)
            if scores_ste:  # the raw softmax scores of the routed heads carry the gradient; shared gates are 1
                scores = torch.softmax(router_logits.float(), dim=-1)
                gates = torch.cat([torch.ones_like(shared_soft), scores], dim=-1)
            gates = straight_through(gates, hard)
        return gates, router_logits, routed_index


def add_head_router(attention: nn.Module, config) -> nn.Module:
    """Give an attention module (Llama-style q/k/v/o projections) a MoH head router built from `config`'s moh_* fields
    (None when MoH is off). Router parameters follow the query projection's device and dtype."""
    router = None
    if moh_enabled(config):
        weight = attention.q_proj.weight
        dtype = weight.dtype if weight.is_floating_point() else None  # packed BitNet q_proj: int8 ternary weights
        router = MoHRouter.from_config(config, getattr(attention, "layer_idx", None))
        router = router.to(device=weight.device, dtype=dtype)
    attention.head_router = router
    attention.moh_head_skipping = True
    return attention


def attention_forward(
    module: nn.Module,
    hidden_states: torch.Tensor,
    position_embeddings: tuple[torch.Tensor, torch.Tensor],
    attention_mask: torch.Tensor | None,
    cache=None,
    sliding_window: int | None = None,
    attention_interface: Callable | None = None,
    **kwargs,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The forward of a Llama-style attention module (q_proj, k_proj, v_proj, o_proj, head_dim, scaling, config,
    layer_idx, head_router): plain multi-head attention when `module.head_router` is None (no gates), else MoH gates on
    each head's output before o_proj. With all heads active and gates of exactly 1 it performs Llama's operations in
    Llama's order. CPU decoding takes the head-skipping fast path (`skipped_heads_attention`), which equals the gated
    computation. `attention_interface`: the backend function (default: `config._attn_implementation`'s in
    ALL_ATTENTION_FUNCTIONS)."""
    input_shape = hidden_states.shape[:-1]
    hidden_shape = (*input_shape, -1, module.head_dim)
    query_states = module.q_proj(hidden_states).view(hidden_shape)  # (B, T, H, hd), pre-RoPE
    gates = None
    if module.head_router is not None:
        gates, _, _ = module.head_router(hidden_states, query_states)  # (B, T, H)
    query_states = query_states.transpose(1, 2)  # (B, H, T, hd)
    key_states = module.k_proj(hidden_states).view(hidden_shape).transpose(1, 2)  # (B, Hkv, T, hd)
    value_states = module.v_proj(hidden_states).view(hidden_shape).transpose(1, 2)

    cos, sin = position_embeddings
    query_states, key_states = apply_rotary_pos_emb(query_states, key_states, cos, sin)
    if cache is not None:  # every head's K/V is cached: a later token may select it
        key_states, value_states = cache.update(key_states, value_states, module.layer_idx)

    if gates is not None and _use_head_skipping(module, query_states, attention_mask, gates, kwargs):
        out = skipped_heads_attention(
            query_states, key_states, value_states, attention_mask, gates, module.o_proj, module.scaling
        )
        return out, None

    if attention_interface is None:
        attention_interface = ALL_ATTENTION_FUNCTIONS.get_interface(
            module.config._attn_implementation, eager_attention_forward
        )
    if sliding_window is not None:
        kwargs["sliding_window"] = sliding_window
    attn_output, attn_weights = attention_interface(
        module,
        query_states,
        key_states,
        value_states,
        attention_mask,
        dropout=0.0 if not module.training else module.attention_dropout,
        scaling=module.scaling,
        **kwargs,
    )  # (B, T, H, hd)
    if gates is not None:
        attn_output = attn_output * gates.to(attn_output.dtype)[..., None]
    attn_output = attn_output.reshape(*input_shape, -1).contiguous()
    return module.o_proj(attn_output), attn_weights


class MoHAttentionMixin:
    """Put before a Llama-style attention class (Llama, Mistral, Qwen2) to route its heads; plain attention when the
    module has no head router."""

    def forward(self, hidden_states, position_embeddings=None, attention_mask=None, cache=None, past_key_values=None,
                **kwargs):  # fmt: skip
        cache = either_cache(cache, past_key_values)  # the model passes `past_key_values` before Transformers 5.24
        if getattr(self, "head_router", None) is None:
            return super().forward(hidden_states, position_embeddings, attention_mask, cache, **kwargs)
        if hasattr(self, "sliding_window"):  # Qwen2: per layer
            sliding_window = self.sliding_window
        else:  # Mistral: from the config; Llama: none
            sliding_window = getattr(self.config, "sliding_window", None)
        return attention_forward(
            self, hidden_states, position_embeddings, attention_mask, cache, sliding_window, **kwargs
        )


# ---------------------------------------------------------------------------------------------------------------------
# Head skipping


def _use_head_skipping(module, query_states, attention_mask, gates, kwargs) -> bool:
    router = module.head_router
    if not getattr(module, "moh_head_skipping", True) or torch.compiler.is_compiling():
        return False
    if type(module.o_proj) is not nn.Linear:  # BitNet's o_proj quantises its input: no per-head split of its weight
        return False
    if query_states.device.type != "cpu":  # measured on CPU only; on GPUs one fused kernel over all heads may win
        return False
    if router.shared_heads + router.active_heads >= router.num_heads:  # every head is active: nothing to skip
        return False
    if query_states.shape[1] != router.num_heads:  # tensor parallel: this rank holds some heads (sharded o_proj)
        return False
    if gates.requires_grad or (module.training and module.attention_dropout > 0) or kwargs.get("output_attentions"):
        return False
    batch, _, seq, _ = query_states.shape
    if batch * seq > HEAD_SKIPPING_MAX_ROWS:
        return False
    if attention_mask is None:  # no mask: every cached key is visible, which holds for a single query token
        return seq == 1
    return isinstance(attention_mask, torch.Tensor) and attention_mask.dim() == 4  # eager/sdpa masks; flex: masked


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
    "MOH_ROUTERS", "MoHAttentionMixin", "MoHRouter", "add_head_router", "attention_forward", "l2_router_logits",
    "l2_scores", "masked_heads_attention", "moh_enabled", "routed_gates", "skipped_heads_attention", "straight_through",
]  # fmt: skip
