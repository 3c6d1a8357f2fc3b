"""Shared part of the reproduction runs: data, tokenizer, one training run per (cell, seed), results JSON, Markdown
tables and plots. Every run goes through `mhmoe.training` (the library's one training loop).

Data: `data/corpus/{train,validation}.jsonl` written by `scripts/get_corpus.sh` (Debian's Python 3.11 and Linux 6.1
documentation sources, split by document) when present; otherwise (and always with --quick) the standard library's
`pydoc_data.topics` (every 10th topic held out). The BPE tokenizer is trained on the training split only.
At the `gpu` scale the fallback corpus is refused (`CorpusMissing`): a GPU run without `data/corpus` would measure
nothing worth the window.

Everything derived from the data (the subsets, the tokenizer, the packed blocks) is cached once per output folder
(`<out>/cache/`), keyed by content hashes, so that the runs of one folder (and reruns into it) share them.
"""

from __future__ import annotations

import contextlib
import datetime
import hashlib
import json
import os
import platform
import statistics
import sys
import tempfile
import time
import warnings
from pathlib import Path

import torch

import mhmoe
from mhmoe import MHMoEForCausalLM, moe_layer_cost
from mhmoe.recovery_demo import write_corpus
from mhmoe.training import reset_accelerate_state, train
from mhmoe.training.data import read_files, train_tokenizer

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: _provenance.py
import _provenance  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
CORPUS = REPO / "data" / "corpus"
RESULTS = REPO / "benchmarks" / "results"


VALIDATION_CHARS = {
    "quick": 20_000,
    "cpu": 120_000,
    "cpu_long": 120_000,
    "gpu": 4_000_000,
    "gpu_slice": 1_000_000,
}  # evaluated per point
TRAIN_CHARS = {"quick": None, "cpu": 6_000_000, "cpu_long": 6_000_000, "gpu": None, "gpu_slice": None}  # None: all


class CorpusMissing(SystemExit):
    """The gpu scale without data/corpus: a one-line message saying how to provide it."""


def data_files(scale_name: str, workdir: Path) -> tuple[str, str, str]:
    """(train, validation, name of the data) for this run. The validation file is the first documents of the split,
    up to VALIDATION_CHARS characters (the same documents for every cell and seed). The subsets are written once into
    `workdir` and reused when their source has not changed."""
    workdir.mkdir(parents=True, exist_ok=True)
    if scale_name != "quick" and (CORPUS / "train.jsonl").is_file() and (CORPUS / "validation.jsonl").is_file():
        name = "Debian documentation sources (python3.11-doc, linux-doc-6.1), split by document"
        train_file, val_file = str(CORPUS / "train.jsonl"), str(CORPUS / "validation.jsonl")
    elif scale_name.startswith("gpu"):
        raise CorpusMissing(
            f"error: the gpu scale needs the corpus at {CORPUS}/{{train,validation}}.jsonl and it is not there (the "
            "pydoc_data fallback is too small to measure anything at this scale): run `bash scripts/get_corpus.sh` on "
            "a machine with network access, then carry data/corpus to the GPU machine (it is git-ignored: name it in "
            'the run\'s carry list, e.g. carry=["data/corpus"])'
        )
    else:
        train_file, val_file = write_corpus(str(workdir / "data"))
        name = "pydoc_data.topics (Python standard library; every 10th topic held out)"
    val_file, val_chars = _first_documents(val_file, VALIDATION_CHARS[scale_name], workdir / "validation-subset.jsonl")
    train_file, train_chars = _first_documents(train_file, TRAIN_CHARS[scale_name], workdir / "train-subset.jsonl")
    return (
        train_file,
        val_file,
        (
            f"{name}; training text: the first {train_chars:,} characters of the training split; "
            f"validation: the first {val_chars:,} characters of the held-out split"
        ),
    )


def _first_documents(path: str, max_chars: int | None, out: Path) -> tuple[str, int]:
    """The first documents of `path` up to `max_chars` characters, as a JSONL file (the same for every cell and seed);
    written atomically, and only when its content changes (the cached tokenizer and blocks key on it)."""
    documents, total = [], 0
    for text in read_files([path]):
        if max_chars is not None and total >= max_chars:
            break
        documents.append(text)
        total += len(text)
    content = "".join(json.dumps({"text": text}) + "\n" for text in documents)
    if not out.is_file() or out.read_text() != content:
        atomic_write_text(out, content)
    return str(out), total


def atomic_write_text(path: Path, text: str) -> None:
    """Write `path` whole or not at all: a temporary file in the same folder, then a rename."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def file_sha256(path: str | Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def tokenizer_for(train_file: str, vocab_size: int, block_size: int, workdir: Path):
    """A byte-level BPE trained on the training split only, saved once per output folder (keyed by the training
    text's hash and the vocabulary size)."""
    from transformers import AutoTokenizer

    path = workdir / f"tokenizer-{vocab_size}-{file_sha256(train_file)[:16]}"
    if not (path / "tokenizer.json").is_file():
        tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}.", dir=workdir))
        train_tokenizer(read_files([train_file]), vocab_size, block_size).save_pretrained(tmp)
        try:
            os.replace(tmp, path)
        except OSError:  # another process put it there first
            import shutil

            shutil.rmtree(tmp, ignore_errors=True)
    return AutoTokenizer.from_pretrained(path)


def tokenizer_sha256(tokenizer) -> str:
    """SHA-256 of the tokenizer's serialised vocabulary and merges (recorded with each run)."""
    return hashlib.sha256(tokenizer.backend_tokenizer.to_str().encode()).hexdigest()


@contextlib.contextmanager
def cached_packing(cache_dir: Path, tokenizer):
    """Inside: `mhmoe.training`'s packing of documents into blocks (`tokenize_and_pack`, called by its setup) is
    memoised in `cache_dir` as safetensors keyed by (documents, tokenizer, block size), so the runs of one output folder
    tokenize the corpus once. Only the name the training's setup module looks up is replaced, for the duration of the
    block; if that module no longer has it, nothing is cached (and nothing breaks)."""
    from safetensors.torch import load_file, save_file

    import mhmoe.training.prepare as setup_module

    original = getattr(setup_module, "tokenize_and_pack", None)
    if original is None:
        yield
        return
    tokenizer_hash = tokenizer_sha256(tokenizer)

    def packed(documents, tok, block_size):
        if tok is not tokenizer:
            return original(documents, tok, block_size)
        digest = hashlib.sha256(f"{tokenizer_hash}|{block_size}|{len(documents)}|".encode())
        for document in documents:
            digest.update(document.encode())
            digest.update(b"\0")
        path = cache_dir / f"blocks-{digest.hexdigest()[:24]}.safetensors"
        if path.is_file():
            return load_file(path)["blocks"]
        blocks = original(documents, tok, block_size)
        cache_dir.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=cache_dir)
        os.close(fd)
        save_file({"blocks": blocks.contiguous()}, tmp)
        os.replace(tmp, path)
        return blocks

    setup_module.tokenize_and_pack = packed
    try:
        yield
    finally:
        setup_module.tokenize_and_pack = original


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


def measure_throughput(model, scale: dict, mixed_precision: str = "no", repeats: int = 3) -> dict:
    """Training (forward + backward) and inference (forward, no gradient) tokens/s of `model` on one random batch of
    the scale's shape: median of `repeats` timed calls after one warm-up, in this process, on this machine."""
    device = next(model.parameters()).device
    ids = torch.randint(3, scale["vocab"], (scale["batch"], scale["block"]), device=device)
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(mixed_precision)
    autocast = torch.autocast(device.type, dtype=dtype, enabled=dtype is not None)
    tokens = ids.numel()

    def median_seconds(step) -> float:
        times = []
        for _ in range(repeats + 1):
            started = time.perf_counter()
            with autocast:
                step()
            if device.type == "cuda":
                torch.cuda.synchronize(device)
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
    return {
        "train_tokens_per_second": round(tokens / train, 1),
        "inference_tokens_per_second": round(tokens / median_seconds(inference_step), 1),
    }


def run_cell(
    config,
    seed: int,
    scale: dict,
    files: tuple[str, str],
    tokenizer,
    workdir: Path,
    throughput: bool = False,
    mixed_precision: str = "no",
    eval_steps: int | None = None,
) -> dict:
    """Train one (config, seed) from scratch; validation perplexity every `eval_steps` (default: half and end of
    training) and, with `throughput`, the trained model's training and inference tokens/s. Returns the run record with
    its provenance (`run["provenance"]`)."""
    steps = scale["steps"]
    enable_tf32()
    reset_kernel_fallbacks()  # each run's record is its own (and kernels that failed before are tried again)
    torch.manual_seed(seed)
    config.bos_token_id, config.eos_token_id = tokenizer.bos_token_id, tokenizer.eos_token_id
    model = MHMoEForCausalLM(config)
    reset_accelerate_state()
    started, started_utc = time.time(), utc_now()
    output_dir = Path(tempfile.mkdtemp(prefix="run-", dir=workdir))  # the training's own folder, removed after
    try:
        with cached_packing(workdir, tokenizer), recording_kernel_messages() as caught:
            result = train(
                dict(
                    output_dir=str(output_dir),
                    train_file=[files[0]],
                    validation_file=[files[1]],
                    block_size=scale["block"],
                    per_device_train_batch_size=scale["batch"],
                    per_device_eval_batch_size=16,
                    max_steps=steps,
                    learning_rate=scale["lr"],
                    warmup_steps=max(1, steps // 20),
                    min_learning_rate=scale["lr"] / 10,
                    eval_steps=eval_steps or max(1, steps // 2),
                    seed=seed,
                    overwrite_output_dir=True,
                    plot=False,
                    disable_tqdm=True,
                    mixed_precision=mixed_precision,
                ),
                model=model,
                tokenizer=tokenizer,
            )
            seconds = time.time() - started
            speed = measure_throughput(result.model, scale, mixed_precision) if throughput else {}
    finally:
        import shutil

        shutil.rmtree(output_dir, ignore_errors=True)
    evals = [r for r in result.history if "eval_ppl" in r]
    train_tokens = steps * scale["batch"] * scale["block"]
    device = next(result.model.parameters()).device
    return {
        "seed": seed,
        "steps": steps,
        "tokens": train_tokens,
        "seconds": round(seconds, 1),
        "tokens_per_second": round(train_tokens / seconds, 1),
        "eval": [{"step": r["step"], "tokens": r["tokens"], "ppl": r["eval_ppl"]} for r in evals],
        "final_train_loss": next((r["lm_loss"] for r in reversed(result.history) if "lm_loss" in r), None),
        **speed,
        "provenance": {
            "started_utc": started_utc,
            "finished_utc": utc_now(),
            "device": device_name(device),
            "precision": precision(mixed_precision, device, next(result.model.parameters()).dtype),
            **kernel_provenance(config, device, caught),
            "env": _provenance.behaviour_env(),
        },
    }


_KERNEL_WORDS = ("triton", "kernel", "fallback", "falling back")


@contextlib.contextmanager
def recording_kernel_messages():
    """Inside: the text of every warning (`warnings`) and every WARNING-or-worse log record of the `mhmoe` loggers
    that mentions a kernel or a fallback is appended to the yielded list; everything is still shown as usual."""
    import logging

    seen: list[str] = []

    def keep(text: str) -> None:
        if any(word in text.lower() for word in _KERNEL_WORDS):
            seen.append(text)

    class Handler(logging.Handler):
        def emit(self, record):
            keep(record.getMessage())

    handler = Handler(level=logging.WARNING)
    logger = logging.getLogger("mhmoe")
    with warnings.catch_warnings():
        original = warnings.showwarning

        def show(message, category, filename, lineno, file=None, line=None):
            keep(str(message))
            original(message, category, filename, lineno, file, line)

        warnings.showwarning = show
        logger.addHandler(handler)
        try:
            yield seen
        finally:
            logger.removeHandler(handler)


def utc_now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")


def enable_tf32() -> None:
    """fp32 matmuls and convolutions on CUDA run as TF32 (the reproduction's fp32 parts: optimizer math aside, the
    matmuls that autocast leaves in fp32). No effect on CPU."""
    if not torch.cuda.is_available():
        return
    try:
        torch.backends.cuda.matmul.fp32_precision = "tf32"
        torch.backends.cudnn.conv.fp32_precision = "tf32"
    except AttributeError:  # torch before the fp32_precision API
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True


def precision(mixed_precision: str, device: torch.device, param_dtype: torch.dtype) -> dict:
    tf32 = None
    if device.type == "cuda":
        tf32 = getattr(torch.backends.cuda.matmul, "fp32_precision", None) == "tf32" or bool(
            torch.backends.cuda.matmul.allow_tf32
        )
    return {"mixed_precision": mixed_precision, "parameters": str(param_dtype).replace("torch.", ""), "tf32": tf32}


def device_name(device: torch.device | None = None) -> str:
    if device is None:
        device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"CPU ({platform.machine()}, {torch.get_num_threads()} threads)"


def kernel_fallbacks() -> dict | None:
    """HOOK for the kernels' failure record (issue 23, point 3): {kernel: reason} for the kernels that failed and fell
    back to their PyTorch reference since the last reset. Reads `mhmoe.models.ops.backends.fallbacks()` when the ops
    expose it; None when they do not (then only the warnings and log
    records caught during the run and routing's automatic-choice flag say whether a fallback happened)."""
    import importlib

    for module_name in ("mhmoe.models.ops.backends",):
        try:
            module = importlib.import_module(module_name)
        except ImportError:
            continue
        for attribute in ("kernel_fallbacks", "fallbacks"):
            record = getattr(module, attribute, None)
            if record is not None:
                record = record() if callable(record) else record
                return json.loads(json.dumps(record, default=str))
    return None


def reset_kernel_fallbacks() -> None:
    """HOOK: forget the kernels' failure record before a run, where the ops offer `reset_fallbacks()`."""
    import importlib

    try:
        module = importlib.import_module("mhmoe.models.ops.backends")
    except ImportError:
        return
    reset = getattr(module, "reset_fallbacks", None)
    if reset is not None:
        reset()


def kernel_provenance(config, device: torch.device, caught=()) -> dict:
    """The routing backend this run actually used on `device`, whether the automatic kernel choice failed over to
    torch, the kernel warnings raised during the run, the experts implementation and the library versions."""
    from mhmoe.models.ops import backends as routing

    probe = torch.empty(0, device=device)
    backend, forced = routing.routing_backend(probe, getattr(config, "routing_backend", None))
    auto_failed = bool(getattr(routing, "_auto_triton_failed", False))
    kernel_warnings = sorted(set(caught))
    fallbacks = kernel_fallbacks()
    return {
        "routing_backend": "torch" if auto_failed and not forced else backend,
        "routing_backend_forced": forced,
        "kernel_fallback": auto_failed or bool(kernel_warnings) or bool(fallbacks),
        "kernel_warnings": kernel_warnings,
        "kernel_fallback_record": fallbacks,
        "experts_implementation": getattr(config, "_experts_implementation", None) or "grouped_mm",
        "versions": versions(),
    }


def versions() -> dict:
    import transformers

    try:
        import triton

        triton_version = triton.__version__
    except ImportError:
        triton_version = None
    return {
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "triton": triton_version,
        "mhmoe": mhmoe.__version__,
        "python": platform.python_version(),
        "cuda": torch.version.cuda,
    }


def git_state() -> dict:
    """The commit and whether tracked files differ from it (untracked files are not counted): from git, or on a GPU
    machine from the provenance pack that scripts/gpu_run.sh names (benchmarks/_provenance.py)."""
    return _provenance.git_state()


def environment() -> dict:
    git = git_state()
    return {
        "commit": git["commit"],
        "dirty": git["dirty"],
        "device": device_name(),
        **{k: v for k, v in versions().items() if k in ("torch", "transformers", "mhmoe")},
        "env": _provenance.behaviour_env(),
    }


def summarise(cell: dict) -> dict:
    """Mean and spread (min-max, and sample std with 2+ seeds) of the two validation points over seeds."""
    points = {}
    evals = [run["eval"] for run in cell["runs"] if run["eval"]]
    if not evals:
        return points
    half = evals[0][-1]["step"] / 2  # with a curve (validation every N steps) the point nearest half of training
    mid_index = min(range(len(evals[0])), key=lambda i: (abs(evals[0][i]["step"] - half), i))
    for index, label in ((mid_index, "mid"), (-1, "final")):
        values = [run["eval"][index]["ppl"] for run in cell["runs"] if run["eval"]]
        if values:
            points[label] = {
                "mean": statistics.fmean(values),
                "min": min(values),
                "max": max(values),
                "std": statistics.stdev(values) if len(values) > 1 else 0.0,
                "tokens": cell["runs"][0]["eval"][index]["tokens"],
            }
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
        line = (
            f"| {name} | {_fmt(cell['summary'].get('mid'))} | {_fmt(cell['summary'].get('final'))} | "
            f"{p['parameters']:,} | {p.get('moe_layer_params', 0):,} | {p.get('moe_layer_macs_per_token', 0):,} |"
        )
        if speed:
            line += "".join(
                f" {statistics.median(run[key] for run in cell['runs']):,.0f} |"
                for key in ("train_tokens_per_second", "inference_tokens_per_second")
            )
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
            ax.plot(
                [p["tokens"] for p in curve],
                [p["ppl"] for p in curve],
                style,
                color=colour,
                markersize=3,
                label=f"{label}, seed {seed}",
            )
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
        seeds = [run["seed"] for run in cell["runs"]]  # this cell's own runs and commits, not the table's
        commits = ", ".join(
            dict.fromkeys(run.get("provenance", {}).get("commit") or data["commit"] for run in cell["runs"])
        )
        ppl = (
            f"validation perplexity {final['mean']:.2f} (min {final['min']:.2f}, max {final['max']:.2f})"
            if len(seeds) > 1
            else f"validation perplexity {final['mean']:.2f}"
        )
        training = (
            f'Trained from scratch with `mhmoe.training` for the reproduction table "{data["title"]}" '
            f"(benchmarks/reproduce, scale `{data['scale_name']}`): {cell['runs'][0]['steps']} steps, "
            f"{cell['runs'][0]['tokens']:,} tokens of {data['data']}; {len(seeds)} seed{'s' if len(seeds) > 1 else ''} "
            f"({', '.join(map(str, seeds))}), {ppl}; device {data['device']}, commit {commits}."
        )
        if not data["device"].startswith("CPU"):  # a GPU run: its speed is worth saying (on CPU it is not a speed)
            speed = statistics.median(run["tokens_per_second"] for run in cell["runs"])
            training += (
                f" Training throughput on that device: {speed:,.0f} tokens/s (median over seeds of each run's "
                "tokens over its wall time, validation and checkpoint writing included)."
            )
        results = [
            {
                "dataset_name": "held-out documentation (reproduction validation split)",
                "dataset_type": "text",
                "dataset_split": "validation",
                "metric_type": "perplexity",
                "metric_value": round(final["mean"], 4),
                "metric_name": f"validation perplexity, mean of {seeds} seeds",
            }
        ]
        # the versions the runs used (older results record Transformers' only in each config), never the running ones
        made_with = {
            "mhmoe": data.get("mhmoe"),
            "transformers": data.get("transformers") or cell["config"].get("transformers_version"),
        }
        card = model_card(
            MHMoEConfig(**cell["config"]),
            model_name=f"mhmoe-reproduce-{_slug(name)}",
            parameters=cell["parity"]["parameters"],
            results=results,
            training=training,
            remote_code=False,
            versions={k: v for k, v in made_with.items() if v},
        )
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
