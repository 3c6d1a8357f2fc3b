"""Training metrics: the losses a step reports, validation NLL sums, load summaries, metrics.jsonl and the loss plot."""

from __future__ import annotations

import json
import math
import os

import torch
import torch.nn.functional as F

from ..evaluation.analysis import expert_counts

METRICS_FILE = "metrics.jsonl"
PLOT_FILE = "loss_curve.png"


def _loss_fields(output) -> dict[str, torch.Tensor]:
    """The output's `*_loss` tensors other than `loss` (aux_loss, z_loss, moh_aux_loss, ...), unweighted."""
    return {
        key: value
        for key, value in output.items()
        if key.endswith("_loss") and key != "loss" and isinstance(value, torch.Tensor) and value.numel() == 1
    }


def _token_nll_sum(logits: torch.Tensor, labels: torch.Tensor, rows=None) -> torch.Tensor:
    """Σ next-token NLL over (B, T) rows (only `rows`, default all) at the labels that are not -100, row by row so at
    most one row of fp32 logits exists at a time."""
    total = logits.new_zeros((), dtype=torch.float32)
    for row in range(logits.shape[0]) if rows is None else rows:
        total = total + F.cross_entropy(logits[row, :-1].float(), labels[row, 1:], ignore_index=-100, reduction="sum")
    return total


def _label_count(labels: torch.Tensor, rows=None) -> torch.Tensor:
    """Next-token predictions that count (labels not -100, the first position has none) in (B, T) `labels`."""
    shifted = labels[:, 1:] if rows is None else labels[rows, 1:]
    return (shifted != -100).sum()


def _other_router_probs(output) -> dict[str, list[torch.Tensor]]:
    """Mean routing probability per head/expert for extra `*_router_logits` outputs (e.g. MoH head routers)."""
    found = {}
    for key, value in output.items():
        if key.endswith("router_logits") and key != "router_logits" and isinstance(value, (tuple, list)) and value:
            found[key] = [torch.softmax(v.float().reshape(-1, v.shape[-1]), -1).sum(0) for v in value]
    return found


def load_summary(fractions: list[list[float]]) -> dict:
    """Imbalance of per-layer load fractions: max_e(f_e)·E (1 = perfectly balanced), averaged and worst over layers."""
    ratios = [max(layer) * len(layer) for layer in fractions]
    return {"mean_max_over_uniform": sum(ratios) / len(ratios), "worst_max_over_uniform": max(ratios)}


def _read_metrics(path: str) -> list[dict]:
    """The records of metrics.jsonl; a last line cut short by a kill mid-write is left out."""
    if not os.path.isfile(path):
        return []
    with open(path) as f:
        lines = [line for line in f.read().split("\n") if line.strip()]
    records = []
    for number, line in enumerate(lines, start=1):
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            if number < len(lines):
                raise ValueError(f"{path}, line {number}: not valid JSON") from None
    return records


def keep_metrics_up_to(path: str, step: int, records: int | None = None) -> int:
    """On resume: keep what was logged up to the checkpoint being resumed (what was logged after it, to be redone,
    goes), without ever leaving a shorter or missing log behind: the kept records go to a temporary file that replaces
    metrics.jsonl in one rename. `records`: how many records the log held when the checkpoint was written (its state
    file says); the first that many are kept, so a record logged after the checkpoint of the same step (the final
    validation) is not kept twice. Without it, the records of steps up to `step`. Returns the number kept."""
    if not os.path.isfile(path):
        if step == 0:
            return 0
        kept = []
    else:
        kept = _read_metrics(path)
        if records is not None and records <= len(kept):
            kept = kept[:records]
        else:
            kept = [r for r in kept if step and r.get("step", 0) <= step]
    temporary = f"{path}.tmp-{os.getpid()}"
    with open(temporary, "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in kept)
        f.flush()
        os.fsync(f.fileno())
    os.replace(temporary, path)
    return len(kept)


def plot_metrics(metrics_path: str, png_path: str) -> None:
    """Loss curve: total and LM training loss, validation loss, and the unweighted aux losses (second panel)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    records = _read_metrics(metrics_path)
    train = [r for r in records if "loss" in r]
    evals = [r for r in records if "eval_loss" in r]
    aux_keys = sorted({k for r in train for k in r if k.endswith("_loss") and k not in ("loss", "lm_loss")})
    fig, axes = plt.subplots(1, 2 if aux_keys else 1, figsize=(11 if aux_keys else 6, 4), squeeze=False)
    ax = axes[0, 0]
    if train:
        ax.plot([r["step"] for r in train], [r["loss"] for r in train], label="train loss (total)")
        ax.plot([r["step"] for r in train], [r["lm_loss"] for r in train], label="train LM loss", alpha=0.8)
    if evals:
        ax.plot([r["step"] for r in evals], [r["eval_loss"] for r in evals], "o-", label="validation LM loss")
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("loss (nats/token)")
    ax.legend()
    ax.grid(alpha=0.3)
    if aux_keys:
        ax = axes[0, 1]
        for key in aux_keys:
            points = [(r["step"], r[key]) for r in train if key in r]
            ax.plot(*zip(*points), label=key)
        ax.set_xlabel("optimizer step")
        ax.set_ylabel("aux loss (unweighted)")
        ax.legend()
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(png_path, dpi=100)
    plt.close(fig)


@torch.no_grad()
def validate(accelerator, model, blocks, batch_size, config, forward_kwargs, step) -> dict:
    """Validation LM loss / perplexity over all blocks (sharded over processes), aux losses and routing load."""
    model.eval()
    world, rank = accelerator.num_processes, accelerator.process_index
    mine = list(range(rank, len(blocks), world))
    per_rank = math.ceil(len(blocks) / world)
    weights = [1.0] * len(mine) + [0.0] * (per_rank - len(mine))  # equal forward counts on every process (FSDP)
    mine += [0] * (per_rank - len(mine))
    device = accelerator.device
    nll = torch.zeros((), device=device)
    tokens = torch.zeros((), device=device)
    aux_sums: dict[str, torch.Tensor] = {}
    batches = torch.zeros((), device=device)
    expert_totals: torch.Tensor | None = None  # (MoE layers, E)
    other: dict[str, list[torch.Tensor]] = {}
    top_k = getattr(config, "num_experts_per_tok", None)
    for start in range(0, per_rank, batch_size):
        index = mine[start : start + batch_size]
        weight = torch.tensor(weights[start : start + batch_size], device=device)
        batch = blocks.batch(torch.tensor(index), device)
        labels = batch.pop("labels")
        real = weight.bool()
        real_rows = real.nonzero().flatten().tolist()
        output = model(**batch, **forward_kwargs)
        nll += _token_nll_sum(output.logits, labels, real_rows)
        tokens += _label_count(labels, real_rows)
        if real.any():
            batches += 1
            for key, value in _loss_fields(output).items():
                aux_sums[key] = aux_sums.get(key, torch.zeros((), device=device)) + value.float()
            router_logits = output.get("router_logits")
            if router_logits and top_k:
                rows = real.repeat_interleave(router_logits[0].shape[0] // labels.shape[0])
                counts = expert_counts(router_logits, top_k, rows)
                expert_totals = counts if expert_totals is None else expert_totals + counts
            for key, probs in _other_router_probs(output).items():
                other[key] = probs if key not in other else [o + p for o, p in zip(other[key], probs)]
    nll, tokens, batches = (accelerator.reduce(t, "sum") for t in (nll, tokens, batches))
    eval_loss = (nll / tokens).item()
    record = {"step": step, "eval_loss": eval_loss, "eval_ppl": math.exp(min(eval_loss, 50.0))}
    for key in sorted(aux_sums):
        record[f"eval_{key}"] = (accelerator.reduce(aux_sums[key], "sum") / batches).item()
    if expert_totals is not None:
        fractions = [(c / c.sum()).tolist() for c in accelerator.reduce(expert_totals, "sum")]
        record["expert_load"] = [[round(x, 5) for x in layer] for layer in fractions]
        record.update({f"expert_load_{k}": v for k, v in load_summary(fractions).items()})
    for key, probs in sorted(other.items()):
        fractions = [accelerator.reduce(p, "sum") for p in probs]
        name = key[: -len("router_logits")].rstrip("_") or key
        record[f"{name}_load"] = [[round(x, 5) for x in (p / p.sum()).tolist()] for p in fractions]
    return record
