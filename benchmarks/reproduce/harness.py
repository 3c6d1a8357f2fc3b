"""Shared part of the reproduction runs: data, tokenizer, one training run per (cell, seed), results JSON, Markdown
tables and plots. Every run goes through `mhmoe.training` (the library's one training loop).

Data: `data/corpus/{train,validation}.jsonl` written by `scripts/get_corpus.sh` (Debian's Python 3.11 and Linux 6.1
documentation sources, split by document) when present; otherwise (and always with --quick) the standard library's
`pydoc_data.topics` (every 10th topic held out). The BPE tokenizer is trained on the training split only.
"""

from __future__ import annotations

import json
import platform
import statistics
import subprocess
import time
from pathlib import Path

import torch

import mhmoe
from mhmoe import MHMoEForCausalLM, moe_layer_cost
from mhmoe.convert.recovery_demo import write_corpus
from mhmoe.training import reset_accelerate_state, train
from mhmoe.training.data import read_files, train_tokenizer

REPO = Path(__file__).resolve().parents[2]
CORPUS = REPO / "data" / "corpus"
RESULTS = REPO / "benchmarks" / "results"


VALIDATION_CHARS = {"quick": 20_000, "cpu": 120_000, "cpu_long": 120_000, "gpu": 4_000_000}  # evaluated per point
TRAIN_CHARS = {"quick": None, "cpu": 6_000_000, "cpu_long": 6_000_000, "gpu": None}  # None: the whole split


def data_files(scale_name: str, workdir: Path) -> tuple[str, str, str]:
    """(train, validation, name of the data) for this run. The validation file is the first documents of the split,
    up to VALIDATION_CHARS characters (the same documents for every cell and seed)."""
    if scale_name != "quick" and (CORPUS / "train.jsonl").is_file() and (CORPUS / "validation.jsonl").is_file():
        name = "Debian documentation sources (python3.11-doc, linux-doc-6.1), split by document"
        train_file, val_file = str(CORPUS / "train.jsonl"), str(CORPUS / "validation.jsonl")
    else:
        train_file, val_file = write_corpus(str(workdir / "data"))
        name = "pydoc_data.topics (Python standard library; every 10th topic held out)"
    val_file, val_chars = _first_documents(val_file, VALIDATION_CHARS[scale_name], workdir / "validation-subset.jsonl")
    train_file, train_chars = _first_documents(train_file, TRAIN_CHARS[scale_name], workdir / "train-subset.jsonl")
    return train_file, val_file, (f"{name}; training text: the first {train_chars:,} characters of the training split; "
                                  f"validation: the first {val_chars:,} characters of the held-out split")  # fmt: skip


def _first_documents(path: str, max_chars: int | None, out: Path) -> tuple[str, int]:
    """The first documents of `path` up to `max_chars` characters, as a JSONL file (the same for every cell and seed)."""
    documents, total = [], 0
    for text in read_files([path]):
        if max_chars is not None and total >= max_chars:
            break
        documents.append(text)
        total += len(text)
    out.write_text("".join(json.dumps({"text": text}) + "\n" for text in documents))
    return str(out), total


def tokenizer_for(train_file: str, vocab_size: int, block_size: int, workdir: Path):
    """A byte-level BPE trained on the training split only, saved once per run of the script."""
    from transformers import AutoTokenizer

    path = workdir / f"tokenizer-{vocab_size}"
    if not (path / "tokenizer.json").is_file():
        train_tokenizer(read_files([train_file]), vocab_size, block_size).save_pretrained(path)
    return AutoTokenizer.from_pretrained(path)


def parity(config) -> dict:
    """Total parameters and activated multiply-adds per token: one MoE layer (`moe_layer_cost`) and the whole model."""
    model = MHMoEForCausalLM(config)
    total = sum(p.numel() for p in model.parameters())
    out = {"parameters": total}
    if config.decoder_sparse_step:
        cost = moe_layer_cost(config)
        moe_layers = sum(map(config.is_moe_layer, range(config.num_hidden_layers)))
        out.update(moe_layer_params=cost.params, moe_layer_macs_per_token=cost.macs_per_token, moe_layers=moe_layers)
    return out


def measure_throughput(model, scale: dict, repeats: int = 3) -> dict:
    """Training (forward + backward) and inference (forward, no gradient) tokens/s of `model` on one random batch of
    the scale's shape: median of `repeats` timed calls after one warm-up, in this process, on this machine."""
    ids = torch.randint(3, scale["vocab"], (scale["batch"], scale["block"]))
    tokens = ids.numel()

    def median_seconds(step) -> float:
        times = []
        for _ in range(repeats + 1):
            started = time.perf_counter()
            step()
            times.append(time.perf_counter() - started)
        return statistics.median(times[1:])

    def train_step():
        model(input_ids=ids, labels=ids, use_cache=False).loss.backward()
        model.zero_grad(set_to_none=True)

    def inference_step():
        with torch.no_grad():
            model(input_ids=ids, use_cache=False)

    model.train()
    train = median_seconds(train_step)
    model.eval()
    return {"train_tokens_per_second": round(tokens / train, 1),
            "inference_tokens_per_second": round(tokens / median_seconds(inference_step), 1)}  # fmt: skip


def run_cell(config, seed: int, scale: dict, files: tuple[str, str], tokenizer, workdir: Path,
             throughput: bool = False) -> dict:  # fmt: skip
    """Train one (config, seed) from scratch; validation perplexity at half and at the end of training (and, with
    `throughput`, the trained model's training and inference tokens/s)."""
    steps = scale["steps"]
    torch.manual_seed(seed)
    config.bos_token_id, config.eos_token_id = tokenizer.bos_token_id, tokenizer.eos_token_id
    model = MHMoEForCausalLM(config)
    reset_accelerate_state()
    started = time.time()
    result = train(dict(
        output_dir=str(workdir / "run"), train_file=[files[0]], validation_file=[files[1]],
        block_size=scale["block"], per_device_train_batch_size=scale["batch"], per_device_eval_batch_size=16,
        max_steps=steps, learning_rate=scale["lr"], warmup_steps=max(1, steps // 20), min_learning_rate=scale["lr"] / 10,
        eval_steps=max(1, steps // 2), seed=seed, overwrite_output_dir=True, plot=False, disable_tqdm=True,
    ), model=model, tokenizer=tokenizer)  # fmt: skip
    seconds = time.time() - started
    evals = [r for r in result.history if "eval_ppl" in r]
    train_tokens = steps * scale["batch"] * scale["block"]
    return {
        "seed": seed, "steps": steps, "tokens": train_tokens, "seconds": round(seconds, 1),
        "tokens_per_second": round(train_tokens / seconds, 1),
        "eval": [{"step": r["step"], "tokens": r["tokens"], "ppl": r["eval_ppl"]} for r in evals],
        "final_train_loss": next((r["lm_loss"] for r in reversed(result.history) if "lm_loss" in r), None),
        **(measure_throughput(result.model, scale) if throughput else {}),
    }  # fmt: skip


def environment() -> dict:
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True,
                                check=True).stdout.strip()  # fmt: skip
    except (OSError, subprocess.CalledProcessError):
        commit = None
    if torch.cuda.is_available():
        device = torch.cuda.get_device_name()
    else:
        device = f"CPU ({platform.machine()}, {torch.get_num_threads()} threads)"
    import transformers

    return {"commit": commit, "device": device, "torch": torch.__version__, "transformers": transformers.__version__,
            "mhmoe": mhmoe.__version__}  # fmt: skip


def summarise(cell: dict) -> dict:
    """Mean and spread (min-max, and sample std with 2+ seeds) of the two validation points over seeds."""
    points = {}
    for index, label in ((0, "mid"), (-1, "final")):
        values = [run["eval"][index]["ppl"] for run in cell["runs"] if run["eval"]]
        if values:
            points[label] = {"mean": statistics.fmean(values), "min": min(values), "max": max(values),
                             "std": statistics.stdev(values) if len(values) > 1 else 0.0,
                             "tokens": cell["runs"][0]["eval"][index]["tokens"]}  # fmt: skip
    return points


def write_results(name: str, title: str, cells: dict, meta: dict, out_dir: Path) -> Path:
    """benchmarks/results/reproduce_<name>.json, .md (table) and .png (validation curves)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    for cell in cells.values():
        cell["summary"] = summarise(cell)
    data = {"table": name, "title": title, **meta, "cells": cells}
    path = out_dir / f"reproduce_{name}_{meta['scale_name']}.json"  # one file per table and scale: scales are kept
    path.write_text(json.dumps(data, indent=2) + "\n")
    path.with_suffix(".md").write_text(markdown_table(data))
    plot_curves(data, path.with_suffix(".png"))
    write_cards(data, out_dir)
    return path


def _fmt(point: dict | None) -> str:
    if not point:
        return "-"
    return f"{point['mean']:.2f} ({point['min']:.2f}–{point['max']:.2f})"


def markdown_table(data: dict) -> str:
    """The table printed from the results JSON: perplexity mean (min–max over seeds) at both points, parity."""
    cells = data["cells"]
    first = next(iter(cells.values()))["summary"]
    mid, final = (first.get(k, {}).get("tokens") for k in ("mid", "final"))
    lines = [
        f"### {data['title']}",
        "",
        f"Data: {data['data']}; scale `{data['scale_name']}`; seeds {data['seeds']}; device {data['device']}; "
        f"commit {data['commit']}. Validation perplexity, mean (min–max) over seeds.",
        "",
        f"| model | ppl @ {mid:,} tokens | ppl @ {final:,} tokens | params | MoE layer params | MoE layer MACs/token |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    speed = "train_tokens_per_second" in next(iter(cells.values()))["runs"][0]
    if speed:  # measured per cell in the same run (`measure_throughput`); the machine may be shared: noisy
        lines[-2] += " train tokens/s | inference tokens/s |"
        lines[-1] += " --- | --- |"
    for name, cell in cells.items():
        p = cell["parity"]
        line = (f"| {name} | {_fmt(cell['summary'].get('mid'))} | {_fmt(cell['summary'].get('final'))} | "
                f"{p['parameters']:,} | {p.get('moe_layer_params', 0):,} | {p.get('moe_layer_macs_per_token', 0):,} |")
        if speed:
            line += "".join(f" {statistics.median(run[key] for run in cell['runs']):,.0f} |"
                            for key in ("train_tokens_per_second", "inference_tokens_per_second"))  # fmt: skip
        lines.append(line)
    return "\n".join(lines) + "\n"


def plot_curves(data: dict, path: Path) -> None:
    """Validation perplexity against training tokens, one line per cell (mean over seeds, min-max band)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for name, cell in data["cells"].items():
        runs = [run["eval"] for run in cell["runs"] if run["eval"]]
        tokens = [point["tokens"] for point in runs[0]]
        values = [[run[i]["ppl"] for run in runs] for i in range(len(tokens))]
        ax.plot(tokens, [statistics.fmean(v) for v in values], "o-", label=name)
        ax.fill_between(tokens, [min(v) for v in values], [max(v) for v in values], alpha=0.15)
    _save_plot(fig, ax, "training tokens", data["title"], path)


def _save_plot(fig, ax, xlabel: str, title: str, path: Path, legend_size: int = 8) -> None:
    """Validation perplexity (log scale) against `xlabel`, saved as PNG."""
    import matplotlib.pyplot as plt

    ax.set_xlabel(xlabel)
    ax.set_ylabel("validation perplexity")
    ax.set_yscale("log")
    ax.set_title(title, fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=legend_size)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def fig2_markdown(data: dict) -> str:
    """Fig. 2 as a table: the dense parent, the converted model before / after continue-tuning, the dense control."""
    lines = [
        f"### {data['title']}",
        "",
        f"Data: {data['data']}; scale `{data['scale_name']}`; seeds {data['seeds']}; device {data['device']}; "
        f"commit {data['commit']}. Validation perplexity per seed.",
        "",
        "| seed | dense parent | MoH converted, before tuning | MoH after tuning (× dense) | dense control, same extra "
        "steps | MoH / control | continue-tuning tokens |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for seed, run in zip(data["seeds"], data["runs"]):
        lines.append(
            f"| {seed} | {run['dense_ppl']:.2f} | {run['moh_ppl_before_tuning']:.2f} | "
            f"{run['moh_ppl_after_tuning']:.2f} (×{run['moh_over_dense']:.3f}) | {run['dense_continued_ppl']:.2f} | "
            f"×{run['moh_ppl_after_tuning'] / run['dense_continued_ppl']:.3f} | {run['tune_tokens']:,} |"
        )
    return "\n".join(lines) + "\n"


def plot_fig2(data: dict, path: Path) -> None:
    """Recovery curves: validation perplexity of the converted MoH model and of the dense control against
    continue-tuning tokens, with the dense parent as a horizontal line (one colour per seed)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for i, (seed, run) in enumerate(zip(data["seeds"], data["runs"])):
        colour = f"C{i}"
        for (label, curve), style in zip(run["curves"].items(), ("o-", "s--")):
            ax.plot([p["tokens"] for p in curve], [p["ppl"] for p in curve], style, color=colour, markersize=3,
                    label=f"{label}, seed {seed}")  # fmt: skip
        ax.axhline(run["dense_ppl"], color=colour, linestyle=":", linewidth=1, label=f"dense parent, seed {seed}")
    _save_plot(fig, ax, "continue-tuning tokens", data["title"], path, legend_size=7)


def _slug(text: str) -> str:
    return "".join(c if c.isalnum() else "-" for c in text.lower()).strip("-").replace("--", "-")


def write_cards(data: dict, out_dir: Path) -> list[Path]:
    """One model card per cell (`mhmoe.hub.cards.model_card`, filled from the results): cards/<table>_<scale>/<cell>.md."""
    from mhmoe import MHMoEConfig
    from mhmoe.hub.cards import model_card

    folder = out_dir / "cards" / f"{data['table']}_{data['scale_name']}"
    folder.mkdir(parents=True, exist_ok=True)
    paths = []
    for name, cell in data["cells"].items():
        final = cell["summary"]["final"]
        seeds = len(cell["runs"])
        training = (
            f"Trained from scratch with `mhmoe.training` for the reproduction table \"{data['title']}\" "
            f"(benchmarks/reproduce, scale `{data['scale_name']}`): {cell['runs'][0]['steps']} steps, "
            f"{cell['runs'][0]['tokens']:,} tokens of {data['data']}; {seeds} seeds ({', '.join(map(str, data['seeds']))}),"
            f" validation perplexity {final['mean']:.2f} (min {final['min']:.2f}, max {final['max']:.2f}); device "
            f"{data['device']}, commit {data['commit']}."
        )
        results = [{"dataset_name": "held-out documentation (reproduction validation split)", "dataset_type": "text",
                    "dataset_split": "validation", "metric_type": "perplexity", "metric_value": round(final["mean"], 4),
                    "metric_name": f"validation perplexity, mean of {seeds} seeds"}]  # fmt: skip
        card = model_card(MHMoEConfig(**cell["config"]), model_name=f"mhmoe-reproduce-{_slug(name)}",
                          parameters=cell["parity"]["parameters"], results=results, training=training,
                          remote_code=False, versions=data)  # fmt: skip
        path = folder / f"{_slug(name)}.md"
        path.write_text(str(card) + "\n")
        paths.append(path)
    return paths


def rewrite_outputs(path: Path) -> None:
    """The Markdown table, plot and model cards of a results JSON, written again from it (no training)."""
    data = json.loads(path.read_text())
    if data["table"] == "moh_fig2":
        path.with_suffix(".md").write_text(fig2_markdown(data))
        plot_fig2(data, path.with_suffix(".png"))
        return
    path.with_suffix(".md").write_text(markdown_table(data))
    plot_curves(data, path.with_suffix(".png"))
    write_cards(data, path.parent)
