"""Head and expert load statistics, and heat-maps of them (the MoH paper's Fig. 3): every load counter of the library.

`head_load(model, batches)` -> (layers, H) tensor: per MoH layer and head, the fraction of (non-padding) tokens that
activate the head (shared heads: 1; each layer's routed heads sum to its budget: moh_active_heads, or the layer's
entry of moh_active_heads_per_layer; with moh_head_thresholds, on average over the calibration text, not per token).
`expert_load(model, batches)` -> (MoE layers, E) tensor: per MoE layer and expert, the fraction of routed rows
(tokens × moe_heads sub-tokens) whose top-k includes the expert (each layer sums to num_experts_per_tok; capacity
drops are not subtracted: this is the router's choice).
`RoutingStatistics(model)`: forward hooks counting expert assignments (after capacity) and activated heads over real
tokens while a model runs (mhmoe-eval adds them to lm-eval results).
`count_assignments` is the one counter of expert assignments that all of these use.
`plot_load(load, path)` writes a PNG heat-map: layers × heads/experts for one tensor, or, for a dict {name: load}
(e.g. one per task or category, as in Fig. 3), names × heads of one layer.
"""

import contextlib
import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from functools import partial

import torch
from transformers import PreTrainedModel

from ..models.mhmoe.router_types import block_class
from ..models.mhmoe.sparse_moe import MHMoETopKRouter
from ..models.moh.head_routers import MoHRouter, topk_mask


def _as_inputs(batch) -> dict:
    if isinstance(batch, torch.Tensor):
        return {"input_ids": batch}
    return {key: batch[key] for key in ("input_ids", "attention_mask") if key in batch}


def _router_outputs(model, batches: Iterable, field: str):
    """Yield (router logits per layer, (B, T) mask) for each batch, in eval mode without gradients."""
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            for batch in batches:
                inputs = _as_inputs(batch)
                device = next(model.parameters()).device
                inputs = {key: value.to(device) for key, value in inputs.items()}
                outputs = model(**inputs, output_router_logits=True, use_cache=False)
                logits = getattr(outputs, field, None)
                if not logits:
                    raise ValueError(f"{type(model).__name__} returned no {field}: is it a model with that routing?")
                mask = inputs.get("attention_mask")
                if mask is None:
                    mask = torch.ones(inputs["input_ids"].shape, device=device)
                yield logits, mask.float()
    finally:
        model.train(was_training)


def head_load(model, batches: Iterable) -> torch.Tensor:
    """(MoH layers, H) selection frequency of every attention head over `batches` (tensors of input ids, or dicts with
    input_ids and optionally attention_mask; padding is excluded). Works for MHMoE models with MoH, MoH-LLaMA and
    models patched with `apply_moh`."""
    config = model.config
    shared = config.moh_shared_heads
    active = getattr(config, "moh_active_heads_per_layer", None) or [config.moh_active_heads] * config.num_hidden_layers
    thresholds = getattr(config, "moh_head_thresholds", None) or [None] * config.num_hidden_layers
    counts, tokens = None, 0.0
    for router_logits, mask in _router_outputs(model, batches, "moh_router_logits"):
        layer_counts = torch.stack(
            [
                (topk_mask(logits, k, t) * mask[..., None]).sum(dim=(0, 1)).cpu()
                for logits, k, t in zip(router_logits, active, thresholds, strict=True)
            ]
        )  # (layers, R)
        counts = layer_counts if counts is None else counts + layer_counts
        tokens += float(mask.sum())
    if counts is None:
        raise ValueError("head_load needs at least one batch")
    routed = counts / tokens
    return torch.cat([torch.ones(routed.shape[0], shared), routed], dim=-1)


def count_assignments(experts: torch.Tensor, num_experts: int, row_mask: torch.Tensor | None = None) -> torch.Tensor:
    """(N, K) expert ids, E marking an assignment dropped over capacity -> (E + 1,) int64 assignments per expert (the
    last entry: dropped), over the rows where `row_mask` (N,) is nonzero (default all). Stays on the ids' device."""
    if row_mask is not None:
        experts = experts[row_mask.to(experts.device).bool()]
    return torch.bincount(experts.reshape(-1), minlength=num_experts + 1)[: num_experts + 1]


def expert_counts(router_logits, top_k: int, row_mask: torch.Tensor | None = None) -> torch.Tensor:
    """(MoE layers, E) how many routed rows (those where `row_mask` (N,) is nonzero, default all) have each expert
    among their top-k, picked as the router picks them (softmax in fp32, top-k; capacity not applied)."""
    counts = []
    for logits in router_logits:  # (N, E)
        chosen = torch.topk(torch.softmax(logits.float(), dim=-1), top_k, dim=-1).indices  # (N, K)
        counts.append(count_assignments(chosen, logits.shape[-1], row_mask)[:-1])
    return torch.stack(counts)


def expert_load(model, batches: Iterable) -> torch.Tensor:
    """(MoE layers, E) selection frequency of every expert over `batches` (MHMoE models; sub-tokens of padding
    tokens excluded)."""
    config = model.config
    why = block_class(config).no_expert_selection  # e.g. Lory's: it merges the experts
    if why:
        raise ValueError(f"expert_load counts top-k expert selections; {why}")
    top_k, moe_heads = config.num_experts_per_tok, getattr(config, "moe_heads", 1)
    counts, rows = None, 0.0
    for router_logits, mask in _router_outputs(model, batches, "router_logits"):
        row_mask = mask.reshape(-1).repeat_interleave(moe_heads)  # (B·T·h,), token-major like the MoE block
        layer_counts = expert_counts(router_logits, top_k, row_mask).cpu()
        counts = layer_counts if counts is None else counts + layer_counts
        rows += float(row_mask.sum())
    if counts is None:
        raise ValueError("expert_load needs at least one batch")
    return counts / rows


def _is_moe_router(module: torch.nn.Module) -> bool:
    # MHMoE's router, and Transformers v5 MoE routers (Mixtral, Qwen-MoE, ...) returning (logits, scores, indices)
    return isinstance(module, MHMoETopKRouter) or type(module).__name__.endswith("TopKRouter")


def _root_model(model: torch.nn.Module) -> torch.nn.Module:
    """The outermost Transformers model (inside a PEFT wrapper, for instance): its forward sees the real inputs."""
    return next((m for m in model.modules() if isinstance(m, PreTrainedModel)), model)


@dataclass
class _LayerCounts:
    counts: torch.Tensor  # (E + 1,) assignments per expert; the last entry counts dropped (over capacity) ones
    rows: int = 0  # routed rows (sub-tokens) seen


@dataclass
class _HeadCounts:
    active: int = 0
    total: int = 0
    num_heads: int = 0


@dataclass
class RoutingStatistics:
    """Forward hooks that count, over real (non-padding) tokens, expert assignments of every MoE router and
    activated heads of every module exposing MoH head gates. `summary()` turns the counts into statistics."""

    model: torch.nn.Module
    enabled: bool = True
    moe: dict = field(default_factory=dict)
    heads: dict = field(default_factory=dict)

    def __post_init__(self):
        self._valid: torch.Tensor | None = None  # (B*T,) bool: real tokens of the current forward
        self.pending_lengths: list[int] | None = None  # real lengths of the next right-padded batch
        root = _root_model(self.model)
        self._handles = [root.register_forward_pre_hook(self._on_model_call, with_kwargs=True)]
        self.router_names, self.head_gate_names = [], []
        for name, module in root.named_modules():
            if _is_moe_router(module):
                self.router_names.append(name)
                self._handles.append(module.register_forward_hook(partial(self._on_router, name)))
            elif isinstance(module, MoHRouter):
                self.head_gate_names.append(name)
                self._handles.append(module.register_forward_hook(partial(self._on_head_gates, name)))

    # hooks ----------------------------------------------------------------------------------------------------------
    def _on_model_call(self, module, args, kwargs):
        lengths, self.pending_lengths = self.pending_lengths, None
        ids = kwargs.get("input_ids", args[0] if args else None)
        embeds = kwargs.get("inputs_embeds")
        ref = ids if ids is not None else embeds
        if ref is None or ref.dim() < 2:
            self._valid = None
            return
        batch, seq = ref.shape[:2]
        mask = kwargs.get("attention_mask")
        if torch.is_tensor(mask) and mask.dim() == 2 and mask.shape[0] == batch and mask.shape[1] >= seq:
            valid = mask[:, -seq:].bool()  # cached decoding: the mask covers the past too
        elif lengths is not None and len(lengths) == batch:
            valid = torch.arange(seq, device=ref.device)[None, :] < torch.tensor(lengths, device=ref.device)[:, None]
        else:
            valid = None
        self._valid = None if valid is None else valid.reshape(-1)

    def _row_mask(self, rows: int) -> torch.Tensor | None:
        """(rows,) bool mask of real rows, rows being tokens x (sub-tokens per token), token-major; None = all."""
        if self._valid is None or rows % self._valid.numel():
            return None
        return self._valid.repeat_interleave(rows // self._valid.numel())

    def _on_router(self, name, module, args, output):
        if not self.enabled or not (isinstance(output, tuple) and len(output) >= 3):
            return
        logits, experts = output[0], output[-1]
        if not (torch.is_tensor(experts) and experts.dim() == 2 and not experts.is_floating_point()):
            return
        valid = self._row_mask(experts.shape[0])
        counts = count_assignments(experts, logits.shape[-1], valid)
        layer = self.moe.get(name)
        if layer is None:
            layer = self.moe[name] = _LayerCounts(torch.zeros_like(counts))
        layer.counts += counts
        layer.rows += experts.shape[0] if valid is None else int(valid.sum())

    def _on_head_gates(self, name, module, args, output):
        gates = output[0]  # (B, T, H): 0 for a head the token does not use
        if not self.enabled or not torch.is_tensor(gates) or gates.dim() < 2:
            return
        num_heads = gates.shape[-1]
        gates = gates.reshape(-1, num_heads)
        valid = self._row_mask(gates.shape[0])
        if valid is not None:
            gates = gates[valid.to(gates.device)]
        layer = self.heads.setdefault(name, _HeadCounts(num_heads=num_heads))
        layer.active += int((gates != 0).sum())
        layer.total += gates.numel()

    # control --------------------------------------------------------------------------------------------------------
    @contextlib.contextmanager
    def paused(self):
        enabled, self.enabled = self.enabled, False
        try:
            yield
        finally:
            self.enabled = enabled

    def reset(self):
        self.moe.clear()
        self.heads.clear()

    def remove(self):
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    # results --------------------------------------------------------------------------------------------------------
    def summary(self) -> dict:
        """Statistics of everything counted since the last `reset()`.

        Per MoE layer, with f_e the fraction of (kept) assignments that went to expert e among E experts:
        `load_entropy` = -sum f_e ln f_e (nats), `load_entropy_normalized` = that / ln E (1 = perfectly balanced),
        `max_load_ratio` = E * max f_e (1 = balanced, E = everything on one expert), `dropped_fraction` (capacity).
        The top-level `expert_*` values are the unweighted means over MoE layers. `activated_heads_pct` is the mean
        over MoH layers of 100 * (nonzero head gates) / (tokens * heads).
        """
        out: dict = {"moe_layers": 0, "moh_layers": 0}
        per_layer = {}
        for name, layer in self.moe.items():
            counts = layer.counts.double().cpu()
            kept, dropped = counts[:-1], float(counts[-1])
            total = float(kept.sum())
            if total == 0:
                continue
            frac = kept / total
            nonzero = frac[frac > 0]
            entropy = float(-(nonzero * nonzero.log()).sum())
            num_experts = frac.numel()
            per_layer[name] = {
                "num_experts": num_experts,
                "routed_rows": layer.rows,
                "assignments": int(total),
                "load_entropy": entropy,
                "load_entropy_normalized": entropy / math.log(num_experts) if num_experts > 1 else 1.0,
                "max_load_ratio": float(frac.max()) * num_experts,
                "dropped_fraction": dropped / (total + dropped),
                "expert_load": [float(f) for f in frac],
            }
        if per_layer:
            layers = list(per_layer.values())
            mean = lambda key: sum(layer[key] for layer in layers) / len(layers)  # noqa: E731
            out.update(
                moe_layers=len(layers),
                expert_load_entropy=mean("load_entropy"),
                expert_load_entropy_normalized=mean("load_entropy_normalized"),
                expert_max_load_ratio=mean("max_load_ratio"),
                expert_dropped_fraction=mean("dropped_fraction"),
                routed_rows=sum(layer["routed_rows"] for layer in layers),
                moe_per_layer=per_layer,
            )
        head_layers = {
            name: {"num_heads": c.num_heads, "activated_heads_pct": 100.0 * c.active / c.total}
            for name, c in self.heads.items()
            if c.total
        }
        if head_layers:
            out.update(
                moh_layers=len(head_layers),
                activated_heads_pct=sum(v["activated_heads_pct"] for v in head_layers.values()) / len(head_layers),
                moh_per_layer=head_layers,
            )
        return out


def plot_load(
    load: torch.Tensor | Mapping[str, torch.Tensor],
    path: str,
    title: str | None = None,
    layer: int = -1,
    unit: str = "head",
) -> str:
    """Write a PNG heat-map of `load` to `path` and return `path`.

    A (layers, units) tensor is drawn as layers × units; a dict {name: (layers, units) tensor} as names × units of
    `layer` (default: the last, as in the paper's Fig. 3). `unit` labels the x axis ("head" or "expert")."""
    from .._plumbing.extras import require

    require("train", "matplotlib", feature="plot_load")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    if isinstance(load, Mapping):
        names = list(load)
        data = torch.stack([torch.as_tensor(load[name], dtype=torch.float32)[layer] for name in names])
        row_labels, ylabel = names, None
        layer_index = layer % next(iter(load.values())).shape[0]
        title = title or f"{unit} load, layer {layer_index}"
    else:
        data = torch.as_tensor(load, dtype=torch.float32)
        row_labels, ylabel = [str(i) for i in range(data.shape[0])], "layer"
        title = title or f"{unit} load per layer"
    rows, cols = data.shape
    fig, ax = plt.subplots(figsize=(max(4.0, 0.35 * cols + 2), max(2.5, 0.35 * rows + 1.5)))
    image = ax.imshow(data.numpy(), aspect="auto", cmap="viridis", vmin=0.0, vmax=max(1.0, float(data.max())))
    ax.set_xticks(range(cols), [str(i) for i in range(cols)], fontsize=7)
    ax.set_yticks(range(rows), row_labels, fontsize=7)
    ax.set_xlabel(unit)
    if ylabel:
        ax.set_ylabel(ylabel)
    ax.set_title(title)
    fig.colorbar(image, ax=ax, label="selection frequency")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


__all__ = ["RoutingStatistics", "count_assignments", "expert_counts", "expert_load", "head_load", "plot_load"]
