"""MoH head routers: per token, the gate of every attention head. Each router is a class registered under the name
`moh_router` gives it (`@head_router("name")`); nothing else names it. Adding one: a subclass of `MoHRouter` here
(its `scores`, and `config_problems` for fields of its own) and its test; `HEAD_ROUTERS` is the table the configs
check and the models build from.

Shape legend: B batch, T tokens, d hidden size, H heads, hd head_dim, S shared heads (always on, the first S),
R = H - S routed heads, K routed heads active per token.

Every router scores the R routed heads, (B, T, R) fp32 logits; the gates are then the paper's: the top-K
probabilities renormalised over the K and ×K (0 on the others), shared heads 1. With `straight_through` the forward
gates are exactly 0/1 (selected or not) and the backward a straight-through estimator, so the router (or, for the
parameter-free routers, the query projection through the norms) keeps learning: True takes the soft gates' gradient
(this library's); "scores" the raw softmax score of every routed head, selected or not (eq. 9-10 read with g_i the
softmax score of every routed head: the converter's default); "selected_scores" the raw softmax scores of the selected
heads only (eq. 9-10 read with g_i = 0 on unselected heads, as eq. 5 defines the gates). Both score modes are for the
routers with `score_straight_through`; docs/conversion.md compares the estimators.

Head thresholds (`moh_head_thresholds`, one per layer; `mhmoe-convert --head_budget threshold`): instead of the top-K,
a routed head is on for a token when its score exceeds the layer's threshold, so a token takes as many heads as its
scores pass (0 to R); K is then the average the threshold was calibrated to on calibration text, not a per-token
count. Only with straight-through (0/1) gates; the backward of True is then that of sigmoid(score - threshold) on the
selected heads.
"""

import math

import torch
import torch.nn.functional as F
from torch import nn
from transformers import initialization as init

from ..ops.backends import l2_head_gates, routing_backend
from ..ops.head_router.head_router_naive import L2_STD_MIN, l2_scores  # the "l2" scores: one definition

HEAD_ROUTERS: dict[str, type["MoHRouter"]] = {}  # moh_router -> router class


def head_router(name: str):
    """Class decorator: register a `MoHRouter` subclass as `moh_router=name`."""

    def register(cls: type["MoHRouter"]) -> type["MoHRouter"]:
        cls.name = name
        HEAD_ROUTERS[name] = cls
        return cls

    return register


def layer_active_heads(config, layer_idx: int | None) -> int:
    """Routed heads active per token in layer `layer_idx`: its entry of `moh_active_heads_per_layer` when set (per-layer
    head budgets, `mhmoe-convert --head_budget calibrated`), else the uniform `moh_active_heads`."""
    per_layer = getattr(config, "moh_active_heads_per_layer", None)
    if per_layer is None:
        return config.moh_active_heads
    if layer_idx is None:
        raise ValueError("moh_active_heads_per_layer is set: the head router needs its layer's index (layer_idx)")
    return per_layer[layer_idx]


def layer_head_threshold(config, layer_idx: int | None) -> float | None:
    """Layer `layer_idx`'s routing threshold (its entry of `moh_head_thresholds`; None: the top-K)."""
    thresholds = getattr(config, "moh_head_thresholds", None)
    if thresholds is None:
        return None
    if layer_idx is None:
        raise ValueError("moh_head_thresholds is set: the head router needs its layer's index (layer_idx)")
    return thresholds[layer_idx]


def routed_gates(router_logits: torch.Tensor, active_heads: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(B, T, R) logits -> soft routed gates (B, T, R) fp32 (top-K probs renormalised over the K, ×K; 0 elsewhere) and
    the selected routed heads (B, T, K). Uniform probabilities give gate 1 on every selected head."""
    probs = torch.softmax(router_logits.float(), dim=-1)
    weights, index = torch.topk(probs, active_heads, dim=-1)
    weights = weights / weights.sum(dim=-1, keepdim=True) * active_heads
    return torch.zeros_like(probs).scatter(-1, index, weights), index


def topk_mask(router_logits: torch.Tensor, top_k: int, threshold: float | None = None) -> torch.Tensor:
    """(..., R) logits -> (..., R) fp32 0/1: the heads each row selects, as the routers select (fp32 softmax, top-k;
    with a `threshold`, the scores above it). Shared by the MoH balance loss and the head-load statistics."""
    if threshold is not None:
        return (router_logits.float() > threshold).float()
    probs = torch.softmax(router_logits.float(), dim=-1)
    index = torch.topk(probs, top_k, dim=-1).indices
    return torch.zeros_like(probs).scatter(-1, index, 1.0)


def routed_query_norms(query_states: torch.Tensor, shared_heads: int) -> torch.Tensor:
    """(B, T, H, hd) pre-RoPE queries -> (B, T, R) fp32 L2 norms of the routed heads' queries (computed in fp32; the
    op itself, not the Python wrapper of `Tensor.norm`: it runs once per layer and decoding step)."""
    return torch.linalg.vector_norm(query_states[..., shared_heads:, :].float(), dim=-1)  # float(): also from fp64


def straight_through(soft: torch.Tensor, hard: torch.Tensor) -> torch.Tensor:
    """Forward value exactly `hard`, gradient of `soft` (eq. 10)."""
    return hard + (soft - soft.detach())


class MoHRouter(nn.Module):
    """Per-token head gates. forward(hidden (B, T, d), pre-RoPE queries (B, T, H, hd)) returns `gates` (B, T, H) fp32,
    `router_logits` (B, T, R) fp32 (recorded for the balance loss and head statistics) and `routed_index` (B, T, K)
    (None with a threshold: a token's count of heads varies).
    `head_norms` (B, T, H): every head's query norm, given when `query_states` holds only some heads (tensor
    parallelism gathers them for the routers that `reads_query_norms`: `moh_parallel.py`)."""

    name: str = ""
    reads_query_norms = False  # scores from the routed heads' pre-RoPE query norms
    score_straight_through = False  # moh_straight_through="scores" / "selected_scores" defined (parameter-free)

    def __init__(
        self,
        hidden_size: int,
        num_heads: int,
        shared_heads: int,
        active_heads: int,
        straight_through: bool | str = False,
        head_norm_stats=None,
    ):
        super().__init__()
        self.num_heads = num_heads
        self.shared_heads = shared_heads
        self.routed_heads = num_heads - shared_heads
        self.active_heads = active_heads
        self.straight_through = straight_through
        self.routing_backend = None  # "torch" | "triton" | None: by device (ops/backends.py)
        self.threshold = None  # moh_head_thresholds' entry: a score threshold instead of the top-K
        self._shared_gate_row = None  # shared_gate_row's cache

    @classmethod
    def from_config(cls, config, layer_idx: int | None = None) -> "MoHRouter":
        """The router `config.moh_router` names, for layer `layer_idx`."""
        router_class = HEAD_ROUTERS[config.moh_router]
        router = router_class(
            config.hidden_size,
            config.num_attention_heads,
            config.moh_shared_heads,
            layer_active_heads(config, layer_idx),
            config.moh_straight_through,
            router_class.layer_statistics(config, layer_idx),
        )
        router.routing_backend = getattr(config, "routing_backend", None)
        router.threshold = layer_head_threshold(config, layer_idx)
        return router

    @classmethod
    def config_problems(cls, config) -> list[str]:
        """What is wrong with the config's fields of this router, in words (checked when it is the one chosen)."""
        return []

    @classmethod
    def layer_statistics(cls, config, layer_idx: int | None):
        """What the router reads from the config for layer `layer_idx` besides the head counts (None: nothing)."""
        return None

    def init_parameters(self, std: float | None = None):
        """Weights that start every gate at exactly 1, whatever `std` (none for the parameter-free routers)."""

    def scores(self, hidden_states: torch.Tensor, query_states: torch.Tensor, head_norms: torch.Tensor | None):
        """(B, T, R) fp32 logits of the routed heads."""
        raise NotImplementedError

    def score_weight(self) -> torch.Tensor | None:
        """The (R, d) matrix W with scores = x Wᵀ when the router scores the hidden states linearly (the decoding
        step fuses it with the query/key/value projections: `fused_decoding.py`); None otherwise."""
        return None

    def hard_gates(self, router_logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The straight-through gates' forward value alone (no gradient to build: inference): shared heads 1, the
        top-K routed heads 1, others 0. The top-K of the logits are the top-K of their softmax (monotone): the heads
        `routed_gates` selects. Three ops after the scores: in decoding the router runs once per layer and token, and
        each op costs about as much as a short step's attention. With a threshold: the heads scoring above it (no
        index: None)."""
        if self.threshold is not None:
            on = (router_logits > self.threshold).to(router_logits.dtype)  # (B, T, R): 0..R heads per token
            shared = router_logits.new_ones(*router_logits.shape[:-1], self.shared_heads)
            return torch.cat([shared, on], dim=-1), router_logits, None
        index = torch.topk(router_logits, self.active_heads, dim=-1).indices  # (B, T, K)
        base = self.shared_gate_row(router_logits).expand(*router_logits.shape[:-1], self.num_heads)  # (B, T, H)
        return base.scatter(-1, index + self.shared_heads, 1.0), router_logits, index

    def shared_gate_row(self, like: torch.Tensor) -> torch.Tensor:
        """(H,) 1 on the shared heads, 0 on the routed ones, in `like`'s dtype and device (cached: not a buffer, so
        not in the state dict)."""
        row = getattr(self, "_shared_gate_row", None)
        if row is None or row.device != like.device or row.dtype != like.dtype:
            row = torch.zeros(self.num_heads, dtype=like.dtype, device=like.device)
            row[: self.shared_heads] = 1.0
            self._shared_gate_row = row
        return row

    def weigh_stages(self, hidden_states: torch.Tensor, shared_soft: torch.Tensor, routed_soft: torch.Tensor):
        """(shared gates (B, T, S), routed gates (B, T, R)) after any weighting of the two (the learned router's)."""
        return shared_soft, routed_soft

    def extra_repr(self) -> str:
        active = self.active_heads
        if self.threshold is not None:
            active = f"{active} (average), threshold={self.threshold:g}"
        return (
            f"heads={self.num_heads}, shared={self.shared_heads}, active_routed={active}, "
            f"router={self.name!r}, straight_through={self.straight_through}"
        )

    def forward(self, hidden_states: torch.Tensor, query_states: torch.Tensor, head_norms: torch.Tensor | None = None):
        router_logits = self.scores(hidden_states, query_states, head_norms)  # (B, T, R)
        if self.straight_through and not torch.is_grad_enabled():
            return self.hard_gates(router_logits)
        if self.threshold is None:
            routed_soft, routed_index = routed_gates(router_logits, self.active_heads)  # (B, T, R), (B, T, K)
        else:  # sigmoid(score - threshold) on the heads above it, 0 on the others (whose attention the head-sparse
            # paths never compute), as the top-K's renormalised weights give the unselected heads no gradient either
            routed_index, above = None, (router_logits > self.threshold).float()  # (B, T, R)
            routed_soft = torch.sigmoid(router_logits - self.threshold) * above
        shared_soft = routed_soft.new_ones(*routed_soft.shape[:-1], self.shared_heads)  # (B, T, S)
        shared_soft, routed_soft = self.weigh_stages(hidden_states, shared_soft, routed_soft)
        gates = torch.cat([shared_soft, routed_soft], dim=-1)  # (B, T, H)
        if self.straight_through:
            hard = above if routed_index is None else torch.zeros_like(routed_soft).scatter(-1, routed_index, 1.0)
            hard = torch.cat([torch.ones_like(shared_soft), hard], dim=-1)
            if self.straight_through in ("scores", "selected_scores"):  # raw softmax scores carry the gradient
                scores = torch.softmax(router_logits.float(), dim=-1)  # (B, T, R)
                if self.straight_through == "selected_scores":  # of the selected heads only
                    scores = scores * hard[..., self.shared_heads :]
                gates = torch.cat([torch.ones_like(shared_soft), scores], dim=-1)
            gates = straight_through(gates, hard)
        return gates, router_logits, routed_index


@head_router("learned")
class LearnedRouter(MoHRouter):
    """The paper's two-stage router (eq. 5-6): routed gates from softmax(W_r x), shared gates softmax(W_s x) ×S, stage
    weights [α1, α2] = softmax(W_h x) ×2. All three matrices start at zero, so every gate starts at exactly 1 (uniform)
    and a fresh layer with all heads active is plain multi-head attention."""

    def __init__(
        self, hidden_size, num_heads, shared_heads, active_heads, straight_through=False, head_norm_stats=None
    ):
        super().__init__(hidden_size, num_heads, shared_heads, active_heads, straight_through)
        self.routed_weight = nn.Parameter(torch.zeros(self.routed_heads, hidden_size))  # W_r
        self.shared_weight = self.stage_weight = None
        if shared_heads > 1:  # softmax over a single shared head is 1: no W_s needed
            self.shared_weight = nn.Parameter(torch.zeros(shared_heads, hidden_size))  # W_s
        if shared_heads > 0:
            self.stage_weight = nn.Parameter(torch.zeros(2, hidden_size))  # W_h

    def init_parameters(self, std: float | None = None):
        for param in (self.routed_weight, self.shared_weight, self.stage_weight):
            if param is not None:
                init.zeros_(param)

    def scores(self, hidden_states, query_states, head_norms):
        return F.linear(hidden_states.float(), self.routed_weight.float())  # (B, T, R)

    def score_weight(self):
        return self._parameters["routed_weight"]

    def weigh_stages(self, hidden_states, shared_soft, routed_soft):
        if self.stage_weight is None:
            return shared_soft, routed_soft
        x = hidden_states.float()
        if self.shared_weight is not None:
            shared_soft = torch.softmax(F.linear(x, self.shared_weight.float()), dim=-1) * self.shared_heads
        stage = torch.softmax(F.linear(x, self.stage_weight.float()), dim=-1) * 2  # (B, T, 2): α1, α2
        return shared_soft * stage[..., :1], routed_soft * stage[..., 1:]


@head_router("l2")
class L2Router(MoHRouter):
    """Parameter-free (continue-tuning, §4.4): per token the L2 norm of each routed head's pre-RoPE query, divided by
    the per-token std of those norms (clamped), softmax, top-K; shared gates are 1. Adds no parameters, so the state
    dict stays the dense model's. On the triton routing backend one fused kernel computes the gates
    (`ops/head_router/`)."""

    reads_query_norms = True
    score_straight_through = True

    def scores(self, hidden_states, query_states, head_norms):
        if head_norms is not None:
            return l2_scores(head_norms[..., self.shared_heads :])
        return l2_scores(routed_query_norms(query_states, self.shared_heads))

    def forward(self, hidden_states, query_states, head_norms=None):
        # the fused kernel reads the queries' own heads (not tensor parallelism's gathered norms); every
        # straight-through mode runs on it, with the reference's gradient (ops/head_router/head_router_triton.py)
        if (
            head_norms is None
            and self.threshold is None
            and routing_backend(query_states, self.routing_backend)[0] == "triton"
        ):
            return l2_head_gates(
                query_states, self.shared_heads, self.active_heads, self.straight_through, self.routing_backend
            )
        return super().forward(hidden_states, query_states, head_norms)


class CalibratedRouter(MoHRouter):
    """Routed heads scored against their own query-norm statistics measured on calibration text (config
    `moh_head_norm_mean` μ_h and `moh_head_norm_sigma` σ_h, per layer and head: plain lists, no parameters; measured by
    `mhmoe-convert --calibration_file`)."""

    reads_query_norms = True
    score_straight_through = True

    def __init__(
        self, hidden_size, num_heads, shared_heads, active_heads, straight_through=False, head_norm_stats=None
    ):
        super().__init__(hidden_size, num_heads, shared_heads, active_heads, straight_through)
        if head_norm_stats is None:
            raise ValueError(f"moh_router {self.name!r} needs per-head query-norm statistics (head_norm_stats)")
        # not in the state dict (models are built on the meta device when loaded): tensors on first use
        self.head_norm_stats = head_norm_stats
        self._routed_statistics = None

    @classmethod
    def layer_statistics(cls, config, layer_idx):
        return config.moh_head_norm_mean[layer_idx], config.moh_head_norm_sigma[layer_idx]

    @classmethod
    def config_problems(cls, config) -> list[str]:
        """The statistics: present, (layers × heads), finite and > 0."""
        mean, std = getattr(config, "moh_head_norm_mean", None), getattr(config, "moh_head_norm_sigma", None)
        if mean is None or std is None:
            return [
                f"moh_router {cls.name!r} needs moh_head_norm_mean and moh_head_norm_sigma (per layer, per head "
                "query-norm statistics, measured by mhmoe-convert --calibration_file)"
            ]
        shape = (getattr(config, "num_hidden_layers", None), config.num_attention_heads)
        for name, rows in (("moh_head_norm_mean", mean), ("moh_head_norm_sigma", std)):
            if len(rows) != shape[0] or any(len(row) != shape[1] for row in rows):
                return [f"{name} must be a list of {shape[0]} layers × {shape[1]} heads"]
        if any(not (value > 0 and math.isfinite(value)) for row in (*mean, *std) for value in row):
            return ["moh_head_norm_mean and moh_head_norm_sigma must be finite and > 0"]
        return []

    def statistics(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """(μ, σ) of the routed heads, (R,) fp32 each, on `device`."""
        cached = self._routed_statistics
        if cached is None or cached[0].device != device:
            stats = torch.tensor(self.head_norm_stats, dtype=torch.float32, device=device)[:, self.shared_heads :]
            cached = self._routed_statistics = (stats[0].contiguous(), stats[1].contiguous())
        return cached

    def scores(self, hidden_states, query_states, head_norms):
        if head_norms is not None:
            return self.calibrated(head_norms[..., self.shared_heads :])
        return self.calibrated(routed_query_norms(query_states, self.shared_heads))

    def calibrated(self, norms: torch.Tensor) -> torch.Tensor:
        """(B, T, R) fp32 query norms of the routed heads -> (B, T, R) scores."""
        raise NotImplementedError


@head_router("l2_standardized")
class L2StandardizedRouter(CalibratedRouter):
    """(n_h - μ_h) / σ_h: each routed head's query norm standardised by its own calibration statistics."""

    def calibrated(self, norms):
        mean, std = self.statistics(norms.device)
        return (norms - mean) / std


@head_router("l2_relative")
class L2RelativeRouter(CalibratedRouter):
    """n_h / μ_h: each routed head's query norm relative to its calibration mean."""

    def calibrated(self, norms):
        mean, _ = self.statistics(norms.device)
        return norms / mean


__all__ = [
    "HEAD_ROUTERS",
    "L2_STD_MIN",
    "MoHRouter",
    "head_router",
    "l2_scores",
    "layer_active_heads",
    "layer_head_threshold",
    "routed_gates",
    "straight_through",
    "topk_mask",
]
