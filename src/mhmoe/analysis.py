"""Head and expert load statistics, and heat-maps of them (the MoH paper's Fig. 3).

`head_load(model, batches)` -> (layers, H) tensor: per MoH layer and head, the fraction of (non-padding) tokens that
activate the head (shared heads: 1; each layer's routed heads sum to moh_active_heads).
`expert_load(model, batches)` -> (MoE layers, E) tensor: per MoE layer and expert, the fraction of routed rows
(tokens × moe_heads sub-tokens) whose top-k includes the expert (each layer sums to num_experts_per_tok; capacity
drops are not subtracted: this is the router's choice).
`plot_load(load, path)` writes a PNG heat-map: layers × heads/experts for one tensor, or, for a dict {name: load}
(e.g. one per task or category, as in Fig. 3), names × heads of one layer.
"""

from collections.abc import Iterable, Mapping

import torch

from .models.mhmoe.moh import head_selection


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
    shared, active = config.moh_shared_heads, config.moh_active_heads
    counts, tokens = None, 0.0
    for router_logits, mask in _router_outputs(model, batches, "moh_router_logits"):
        layer_counts = torch.stack(
            [(head_selection(logits, active) * mask[..., None]).sum(dim=(0, 1)).cpu() for logits in router_logits]
        )  # (layers, R)
        counts = layer_counts if counts is None else counts + layer_counts
        tokens += float(mask.sum())
    if counts is None:
        raise ValueError("head_load needs at least one batch")
    routed = counts / tokens
    return torch.cat([torch.ones(routed.shape[0], shared), routed], dim=-1)


def expert_counts(router_logits, top_k: int, row_mask: torch.Tensor | None = None) -> torch.Tensor:
    """(MoE layers, E) how many routed rows (those where `row_mask` (N,) is nonzero, default all) have each expert
    among their top-k, picked as the router picks them (softmax in fp32, top-k). Stays on the logits' device."""
    counts = []
    for logits in router_logits:  # (N, E)
        chosen = head_selection(logits, top_k)  # the same top-k selection as a MoH head router's
        if row_mask is not None:
            chosen = chosen * row_mask[:, None].to(chosen)
        counts.append(chosen.sum(dim=0))
    return torch.stack(counts)


def expert_load(model, batches: Iterable) -> torch.Tensor:
    """(MoE layers, E) selection frequency of every expert over `batches` (MHMoE models; sub-tokens of padding
    tokens excluded)."""
    config = model.config
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
    from .extras import require

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


__all__ = ["expert_counts", "expert_load", "head_load", "plot_load"]
