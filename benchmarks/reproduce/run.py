#!/usr/bin/env python
"""Reproduce the papers' tables in miniature, one command per table (results: benchmarks/results/reproduce_*.{json,md,png}).

    python benchmarks/reproduce/run.py mhmoe_table1 [--scale cpu|cpu_long|gpu|gpu_slice] [--seeds 0 1] [--quick]
    python benchmarks/reproduce/run.py mhmoe_table1 --cells smoe mhmoe_h3 --seeds 0 --out DIR [--deadline MINUTES]
        [--seed_from SOURCE ...] [--bundle FILE] [--probe_file FILE ...] [--started EPOCH]
    python benchmarks/reproduce/run.py mhmoe_table1 --merge SOURCE [SOURCE ...] [--out RESULTS]
    python benchmarks/reproduce/run.py moh_fig2 [--scale cpu|cpu_long|gpu] [--seeds 0 1] [--quick]
    python benchmarks/reproduce/run.py moh_convert_real --stage zero_shot|cli|tune|other_text|report
        (moh_convert_real.py; other_text: the zero-shot recipes on text of another domain, the GPL-3 licence)
    python benchmarks/reproduce/run.py --list

Tables: see `tables.py` (cells and scales) and `harness.py` (data, training, results). `--quick` is the CI smoke run:
tiny models, a few steps, the standard-library corpus, results under --out (default: a temporary directory).

Chunked runs (a GPU window of short commands): runs go seed by seed, the cells in the order `--cells` gives (seed 0
of every cell before any seed 1); every (cell, seed) is written to `DIR/runs/<table>_<scale>/` the moment it finishes
(atomically, with its provenance), and `--bundle FILE` rewrites one file with every finished run after each. Runs
already there, or in `--seed_from` bundles/tables/folders (same table, scale and steps), are skipped. With `--deadline
MINUTES` (from `--started`, default the command's start) no run starts whose estimate does not fit: the slowest
finished run of the cell on this device and precision, else a `--probe_file` of it, else a short probe here. After the
runs, the table (JSON, Markdown, plot, cards) is built from every run in DIR; `--merge SOURCE...` builds it from
folders, bundles and results tables without training (runs of different lengths are refused).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import harness  # noqa: E402
import tables  # noqa: E402

RUN_FORMAT = "mhmoe-reproduce-run/1"
FIG2_SCALES = {
    "quick": dict(
        vocab_size=320,
        hidden_size=32,
        intermediate_size=64,
        num_layers=2,
        num_heads=8,
        num_key_value_heads=4,
        block_size=32,
        batch_size=4,
        dense_steps=6,
        tune_steps=4,
        tune_warmup=1,  # within the 4 steps (mhmoe-train refuses a warmup longer than the run)
        eval_steps=2,
    ),
    "cpu": dict(
        vocab_size=2048,
        hidden_size=96,
        intermediate_size=256,
        num_layers=4,
        num_heads=8,
        num_key_value_heads=4,
        block_size=64,
        batch_size=8,
        dense_steps=400,
        tune_steps=150,
        eval_steps=25,
        dense_lr=2e-3,
        tune_lr=5e-4,
        tune_min_lr=5e-5,
    ),
    "cpu_long": dict(
        vocab_size=2048,
        hidden_size=96,
        intermediate_size=256,
        num_layers=4,
        num_heads=8,
        num_key_value_heads=4,
        block_size=64,
        batch_size=8,
        dense_steps=2000,
        tune_steps=600,
        eval_steps=50,
        dense_lr=2e-3,
        tune_lr=5e-4,
        tune_min_lr=5e-5,
    ),
    "gpu": dict(
        vocab_size=8192,
        hidden_size=512,
        intermediate_size=1376,
        num_layers=8,
        num_heads=8,
        num_key_value_heads=8,
        block_size=512,
        batch_size=32,
        dense_steps=3000,
        tune_steps=600,
        eval_steps=50,
        dense_lr=1e-3,
        tune_lr=2e-4,
        tune_min_lr=2e-5,
    ),
}


def cell_id(name: str) -> str:
    """The command-line name of a cell: "MH-MoE h=3" -> mhmoe_h3, "Fine-grained SMoE" -> finegrained_smoe."""
    return re.sub(r"[^a-z0-9]+", "_", name.lower().replace("-", "").replace("=", "")).strip("_")


def select_cells(table: str, scale: dict, wanted: list[str] | None) -> dict:
    """{cell name: config} of the table: in table order, or restricted to `wanted` (ids or names) in the order given
    (the priority of a chunked run); unknown names end the command with the list of valid ones."""
    build, _ = tables.TABLES[table]
    cells = build(scale)
    if not wanted:
        return cells
    by_id = {cell_id(name): name for name in cells}
    unknown = [w for w in wanted if w not in by_id and w not in cells]
    if unknown:
        raise SystemExit(
            f"error: {table} has no cell {', '.join(map(repr, unknown))}; its cells: "
            f"{', '.join(f'{i} ({n})' for i, n in by_id.items())}"
        )
    names = dict.fromkeys(by_id.get(w, w) for w in wanted)  # ordered, duplicates once
    return {name: cells[name] for name in names}


def run_path(out: Path, table: str, scale_name: str, name: str, seed: int) -> Path:
    return out / "runs" / f"{table}_{scale_name}" / f"{cell_id(name)}_seed{seed}.json"


def read_run(path: Path) -> dict | None:
    """A finished run's file, or None when it is absent or not a complete run record (then it is run again)."""
    try:
        record = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return record if record.get("format") == RUN_FORMAT and "run" in record else None


def write_run(path: Path, record: dict) -> None:
    harness.atomic_write_text(path, json.dumps(record, indent=2) + "\n")


def run_records(source: Path, name: str) -> list[dict]:
    """Every finished run of table `name` that `source` holds: a folder (its runs/<table>_<scale>/ files, run bundles
    runs_<table>_<scale>.json and results tables reproduce_<table>_<scale>.json), a run bundle, or a results table
    (one-piece or merged: each run with its cell's config, parity and the table's data)."""
    if source.is_dir():
        records = [r for path in sorted((source / "runs").glob(f"{name}_*/*_seed*.json")) if (r := read_run(path))]
        for path in sorted(source.glob(f"runs_{name}_*.json")) + sorted(source.glob(f"reproduce_{name}_*.json")):
            records += run_records(path, name)
        return [r for r in records if r["table"] == name]
    try:
        data = json.loads(source.read_text())
    except (OSError, ValueError) as error:
        raise SystemExit(f"error: cannot read runs from {source}: {error}") from None
    if data.get("format") == BUNDLE_FORMAT:
        return [r for r in data["runs"] if r.get("format") == RUN_FORMAT and r["table"] == name]
    return table_runs(data, name, source.name)


BUNDLE_FORMAT = "mhmoe-reproduce-runs/1"


def bundle_path(out: Path, table: str, scale_name: str) -> Path:
    return out / f"runs_{table}_{scale_name}.json"


def write_bundle(path: Path, table: str, scale_name: str, runs: list[dict]) -> None:
    """Every finished run of (table, scale) in one file, rewritten atomically after each run: what a GPU machine
    returns (one file whatever the number of runs), and what a rerun elsewhere is seeded from (`--seed_from`)."""
    bundle = {
        "format": BUNDLE_FORMAT,
        "table": table,
        "scale_name": scale_name,
        "written_utc": harness.utc_now(),
        **harness.git_state(),
        "runs": runs,
    }
    harness.atomic_write_text(path, json.dumps(bundle, indent=1) + "\n")


class Deadline:
    """Whether a run of a cell can still finish before the deadline (minutes from the command's start)."""

    def __init__(self, minutes: float | None, started: float | None = None):
        """`started`: the epoch second the deadline counts from (default now; scripts/gpu_run.sh passes its own start,
        so that its setup counts)."""
        self.started = time.time() if started is None else started
        self.end = None if minutes is None else self.started + minutes * 60

    def left(self) -> float:
        return float("inf") if self.end is None else self.end - time.time()

    def estimate(
        self,
        out: Path,
        table: str,
        scale_name: str,
        name: str,
        config,
        scale: dict,
        device: str,
        mixed_precision: str,
        probe_files: list[Path] = (),
    ) -> tuple[float, str]:
        """(seconds one run of `name` takes, how it was estimated): the slowest of its finished runs on this device
        and precision in this folder (scaled to this run's steps), else a probe file of this cell, device and
        precision (`run.py --probe`), else a throughput probe here (3 training steps of the scale's batch after one
        warm-up); a probe's time per step × steps, plus 25% for validation and setup."""
        seconds = []
        for path in sorted((out / "runs" / f"{table}_{scale_name}").glob(f"{cell_id(name)}_seed*.json")):
            record = read_run(path)
            prov = (record or {}).get("run", {}).get("provenance", {})
            if (
                record
                and prov.get("device") == device
                and prov.get("precision", {}).get("mixed_precision") == (mixed_precision)
            ):
                seconds.append(record["run"]["seconds"] * scale["steps"] / record["run"]["steps"])
        if seconds:
            return max(seconds), f"slowest of {len(seconds)} finished run(s)"
        for path in probe_files:
            try:
                probed = json.loads(Path(path).read_text())
            except (OSError, ValueError):
                continue
            cell = probed.get("cells", {}).get(name)
            if (
                cell
                and probed.get("device") == device
                and probed.get("mixed_precision") == mixed_precision
                and (probed.get("tokens_per_step") == scale["batch"] * scale["block"])
            ):
                per_step = cell["ms_per_step"] / 1e3
                return per_step * scale["steps"] * 1.25, f"{Path(path).name}: {per_step * 1000:.1f} ms/step"
        per_step = probe_step_seconds(config, scale, mixed_precision)
        return per_step * scale["steps"] * 1.25, f"probe: {per_step * 1000:.1f} ms/step"


def probe_step_seconds(
    config, scale: dict, mixed_precision: str = "no", steps: int = 3, stats: dict | None = None
) -> float:
    """Median seconds of one training step (forward, backward, AdamW) of `config` at the scale's batch, after a
    warm-up step, on the default device (random token ids: no data needed). `stats`, when given, receives the peak
    CUDA memory of the timed steps."""
    import torch

    from mhmoe import MHMoEForCausalLM

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    harness.enable_tf32()
    model = MHMoEForCausalLM(config).to(device).train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    ids = torch.randint(3, scale["vocab"], (scale["batch"], scale["block"]), device=device)
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(mixed_precision)
    times = []
    for _ in range(steps + 1):
        started = time.perf_counter()
        with torch.autocast(device.type, dtype=dtype, enabled=dtype is not None):
            loss = model(input_ids=ids, labels=ids, use_cache=False).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - started)
        if device.type == "cuda" and len(times) == 1:
            torch.cuda.reset_peak_memory_stats(device)
    if stats is not None and device.type == "cuda":
        stats["peak_memory_bytes"] = torch.cuda.max_memory_allocated(device)
    del model, optimizer
    return statistics.median(times[1:])


def probe(name: str, scale_name: str, wanted: list[str] | None, steps: int, out: Path, mixed_precision: str) -> Path:
    """Training throughput of the selected cells (`probe_step_seconds` over `steps` steps, random ids), written to
    out/probe_<table>_<scale>.json with the provenance of the machine."""
    scale = tables.SCALES[scale_name]
    tokens = scale["batch"] * scale["block"]
    import torch

    from mhmoe.models.ops import backends as routing

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    result = {
        "table": name,
        "scale_name": scale_name,
        "steps": steps,
        "tokens_per_step": tokens,
        "mixed_precision": mixed_precision,
        **harness.git_state(),
        "device": harness.device_name(),
        "versions": harness.versions(),
        "env": harness._provenance.behaviour_env(),
        "routing_backend": routing.routing_backend(torch.empty(0, device=device))[0],
        "started_utc": harness.utc_now(),
        "cells": {},
    }
    path = out / f"probe_{name}_{scale_name}.json"
    for cell, config in select_cells(name, scale, wanted).items():
        stats: dict = {}
        seconds = probe_step_seconds(config, scale, mixed_precision, steps, stats)
        result["cells"][cell] = {
            "ms_per_step": 1e3 * seconds,
            "tokens_per_second": tokens / seconds,
            "run_seconds_estimate": seconds * scale["steps"],
            **stats,
        }
        print(
            f"probe {name} | {cell}: {1e3 * seconds:.1f} ms/step, {tokens / seconds:,.0f} tokens/s, a full run "
            f"({scale['steps']} steps) ~{seconds * scale['steps'] / 60:.1f} min",
            flush=True,
        )
        result["finished_utc"] = harness.utc_now()
        result["kernel_fallbacks"] = harness.kernel_fallbacks() or {}
        harness.atomic_write_text(path, json.dumps(result, indent=2) + "\n")
    return path


def run_cells(
    name: str,
    scale_name: str,
    seeds: list[int],
    out: Path,
    wanted: list[str] | None = None,
    deadline: Deadline | None = None,
    mixed_precision: str = "no",
    eval_every: int | None = None,
    steps: int | None = None,
    seed_from: list[Path] = (),
    bundle: Path | None = None,
    probe_files: list[Path] = (),
) -> bool:
    """Train every selected (cell, seed) not yet in `out`: seed by seed, the cells in the order given (`wanted`, else
    table order), so that a deadline leaves seed 0 of every cell before any seed 1. Each run file is written as it
    finishes; `steps` overrides the scale's training steps (each run file records the scale it ran). `seed_from`:
    run bundles, results tables or folders whose finished runs of this table, scale and steps count as done (copied
    into `out`); `bundle`: a file rewritten after every run with all of them (`write_bundle`). Returns False when
    the deadline stopped it before every run was done."""
    _, title = tables.TABLES[name]
    scale = dict(tables.SCALES[scale_name], **({"steps": steps} if steps else {}))
    deadline = deadline or Deadline(None)
    cells = select_cells(name, scale, wanted)
    folder = out / "runs" / f"{name}_{scale_name}"
    for source in seed_from:
        for record in run_records(Path(source), name):
            path = run_path(out, name, scale_name, record["cell"], record["run"]["seed"])
            if record["scale_name"] == scale_name and record["scale"]["steps"] == scale["steps"] and not path.exists():
                write_run(path, record)
                print(f"{name} | {record['cell']} | seed {record['run']['seed']}: finished run taken from {source}")
    finished = {}
    for path in sorted(folder.glob("*_seed*.json")):
        record = read_run(path)
        if record is None:
            continue
        if record["scale"]["steps"] != scale["steps"]:
            raise SystemExit(
                f"error: {path} is a run of {record['scale']['steps']} steps and this command trains "
                f"{scale['steps']}: a table mixes no training lengths; use another --out"
            )
        finished[(record["cell"], record["run"]["seed"])] = record

    def save_bundle():
        if bundle is not None:
            records = [read_run(path) for path in sorted(folder.glob("*_seed*.json"))]
            write_bundle(bundle, name, scale_name, [r for r in records if r])

    save_bundle()
    todo = [(cell, seed) for seed in seeds for cell in cells if (cell, seed) not in finished]
    for cell, seed in [(c, s) for s in seeds for c in cells if (c, s) in finished]:
        print(f"{name} | {cell} | seed {seed}: already in {run_path(out, name, scale_name, cell, seed)}, skipped")
    if not todo:
        return True
    cache = out / "cache"
    train_file, val_file, data_name = harness.data_files(scale_name, cache)
    tokenizer = harness.tokenizer_for(train_file, scale["vocab"], scale["block"], cache)
    corpus = {
        "train_sha256": harness.file_sha256(train_file),
        "validation_sha256": harness.file_sha256(val_file),
        "tokenizer_sha256": harness.tokenizer_sha256(tokenizer),
    }
    device = harness.device_name()
    eval_steps = eval_every or (scale["steps"] // 2 if scale_name == "quick" else max(1, scale["steps"] // 10))
    for index, (cell, seed) in enumerate(todo):
        config = cells[cell]
        if deadline.end is not None:
            needed, how = deadline.estimate(
                out, name, scale_name, cell, config, scale, device, mixed_precision, probe_files
            )
            if needed > deadline.left():
                left = ", ".join(f"{c} seed {s}" for c, s in todo[index:])
                print(
                    f"deadline: not starting {cell} seed {seed}: it needs ~{needed:.0f} s ({how}) and "
                    f"{max(0.0, deadline.left()):.0f} s are left. Not run: {left}. Rerun the same command to go on "
                    f"(finished runs are skipped).",
                    flush=True,
                )
                return False
        git = harness.git_state()
        run = harness.run_cell(
            config,
            seed,
            scale,
            (train_file, val_file),
            tokenizer,
            cache,
            throughput=name in tables.THROUGHPUT_TABLES,
            mixed_precision=mixed_precision,
            eval_steps=eval_steps,
        )
        run["provenance"] = {**git, **run["provenance"], "corpus": corpus}
        record = {
            "format": RUN_FORMAT,
            "table": name,
            "title": title,
            "scale_name": scale_name,
            "scale": scale,
            "cell": cell,
            "cell_id": cell_id(cell),
            "data": data_name,
            "config": full_config(config),
            "parity": harness.parity(config),
            "run": run,
        }
        path = run_path(out, name, scale_name, cell, seed)
        write_run(path, record)
        save_bundle()
        final = run["eval"][-1]["ppl"] if run["eval"] else float("nan")
        print(
            f"{name} | {cell} | seed {seed}: ppl {final:.2f} ({run['seconds']} s) | "
            f"params {record['parity']['parameters']:,} -> {os.path.relpath(path, out)} in --out",
            flush=True,
        )
    return True


def full_config(config) -> dict:
    """Every field of the cell's config (defaults too: a later default change must not change what a record says ran),
    without the keys a config rebuilds itself."""
    skip = ("model_type", "transformers_version", "architectures", "auto_map")
    return {key: value for key, value in config.to_dict().items() if key not in skip}


def table_runs(data: dict, name: str, origin: str) -> list[dict]:
    """Run records from a results table (`reproduce_<table>_<scale>.json`, one-piece or merged): each run with its
    cell's config and parity, the table's data, and the provenance it recorded (commit, device, versions; the table's
    own where an older run has none)."""
    if data.get("table") != name or "cells" not in data:
        return []
    versions = {k: data[k] for k in ("torch", "transformers", "mhmoe") if data.get(k)}
    provenance = {"commit": data.get("commit"), "device": data.get("device"), "from": origin, "versions": versions}
    records = []
    for cell, entry in data["cells"].items():
        for run in entry["runs"]:
            run = {**run, "provenance": {**provenance, **run.get("provenance", {})}}
            records.append(
                {
                    "format": RUN_FORMAT,
                    "table": name,
                    "scale_name": data["scale_name"],
                    "scale": data["scale"],
                    "cell": cell,
                    "data": data["data"],
                    "config": entry["config"],
                    "parity": entry["parity"],
                    "run": run,
                }
            )
    return records


def source_name(path: Path) -> str:
    """How a merge records where its runs came from: the path inside this repository, else only the last two parts
    (never a local absolute path)."""
    path = Path(path).resolve()
    try:
        return path.relative_to(harness.REPO).as_posix()
    except ValueError:
        return "/".join(path.parts[-2:]) + " (outside the repository)"


def merge(name: str, sources: list[Path], out: Path) -> list[Path]:
    """The table JSON, Markdown, plot and cards of `name` from the finished runs in `sources` (folders, run bundles or
    results tables, see `run_records`; one table per scale found; a (cell, seed) present in several is taken from the
    first). Cells in table order, seeds in order."""
    _, title = tables.TABLES[name]
    records: dict[str, dict] = {}  # scale -> {(cell, seed): record}
    for source in sources:
        for record in run_records(Path(source), name):
            records.setdefault(record["scale_name"], {}).setdefault((record["cell"], record["run"]["seed"]), record)
    if not records:
        raise SystemExit(f"error: no finished runs of {name} in {', '.join(map(str, sources))}")
    paths = []
    for scale_name, runs in sorted(records.items()):
        lengths = sorted({r["scale"]["steps"] for r in runs.values()})
        if len(lengths) > 1:
            raise SystemExit(
                f"error: the {scale_name} runs of {name} in {', '.join(map(str, sources))} trained "
                f"different numbers of steps ({lengths}): merge each length into its own folder"
            )
        order = list(tables.TABLES[name][0](tables.SCALES[scale_name]))
        cells = {}

        def position(item):
            (cell, seed), _ = item
            return (order.index(cell) if cell in order else len(order), seed)

        for (cell, _), record in sorted(runs.items(), key=position):
            entry = cells.setdefault(cell, {"config": record["config"], "parity": record["parity"], "runs": []})
            entry["runs"].append(record["run"])
        first = next(iter(runs.values()))
        seeds = sorted({seed for _, seed in runs})
        provenances = [r["run"].get("provenance", {}) for r in runs.values()]
        commits = sorted({f"{p.get('commit')}{'-dirty' if p.get('dirty') else ''}" for p in provenances})
        devices = sorted({p.get("device", "?") for p in provenances})
        data_names = sorted({r["data"] for r in runs.values()})
        meta = {
            "data": "; ".join(data_names),
            "scale_name": scale_name,
            "scale": first["scale"],
            "seeds": seeds,
            "commit": ", ".join(commits),
            "device": ", ".join(devices),
            "torch": first["run"].get("provenance", {}).get("versions", {}).get("torch"),
            "transformers": first["run"].get("provenance", {}).get("versions", {}).get("transformers"),
            "mhmoe": first["run"].get("provenance", {}).get("versions", {}).get("mhmoe"),
            "merged_from": [source_name(s) for s in sources],
        }
        path = harness.write_results(name, title, cells, meta, out)
        print(harness.markdown_table(json.loads(path.read_text())))
        paths.append(path)
    return paths


def conversion_settings(folder: Path) -> dict:
    """What the converted model computes, from its config.json: the head router, its straight-through mode (the
    MoH paper's eq. 9-10 on the raw scores, "scores", or the soft top-K gates' gradient, True), the head split and
    the balance loss weight; with the recipe from moh_conversion.json."""
    config = json.loads((folder / "config.json").read_text())
    keys = (
        "moh_router",
        "moh_straight_through",
        "moh_shared_heads",
        "moh_active_heads",
        "moh_aux_loss_coef",
        "num_attention_heads",
        "num_key_value_heads",
    )
    settings = {key: config.get(key) for key in keys}
    for record in (folder / "moh_conversion.json", folder / "converted" / "moh_conversion.json"):
        if record.is_file():  # the converter's record: beside the tuned model, or in its converted/ start point
            settings["recipe"] = json.loads(record.read_text()).get("recipe")
            break
    return settings


def run_fig2(scale_name: str, seeds: list[int], out_dir: Path, workdir: Path) -> Path:
    """MoH Fig. 2: dense LLaMA -> MoH at 75% heads with the converter (l2 router, straight-through), continue-tuned,
    against the dense parent and a dense control trained the same extra steps."""
    from mhmoe.recovery_demo import run_recovery_demo

    train_file, val_file, data_name = harness.data_files(scale_name, workdir)
    runs = []
    for seed in seeds:
        run_dir = workdir / f"fig2-seed{seed}"
        result = run_recovery_demo(
            str(run_dir), seed=seed, data_files=(train_file, val_file), **FIG2_SCALES[scale_name]
        )
        curves = {}
        for label, sub in (("MoH 75% (converted)", "moh"), ("dense control", "dense_continued")):
            records = [json.loads(line) for line in (run_dir / sub / "metrics.jsonl").read_text().splitlines()]
            curves[label] = [{"tokens": r["tokens"], "ppl": r["eval_ppl"]} for r in records if "eval_ppl" in r]
        result["curves"] = curves
        result.pop("workdir", None)  # a temporary folder of this machine, removed after the run
        result["conversion"] = conversion_settings(run_dir / "moh")
        runs.append(result)
        print(
            f"moh_fig2 | seed {seed}: dense {result['dense_ppl']:.2f}, MoH converted "
            f"{result['moh_ppl_before_tuning']:.2f} -> {result['moh_ppl_after_tuning']:.2f}, control "
            f"{result['dense_continued_ppl']:.2f}",
            flush=True,
        )
    out_dir.mkdir(parents=True, exist_ok=True)
    data = {
        "table": "moh_fig2",
        "title": "MoH Fig. 2: dense LLaMA -> MoH (75% heads), continue-tuned",
        "data": data_name,
        "scale_name": scale_name,
        "scale": FIG2_SCALES[scale_name],
        "seeds": seeds,
        **harness.environment(),
        "runs": runs,
    }
    path = out_dir / f"reproduce_moh_fig2_{scale_name}.json"
    path.write_text(json.dumps(data, indent=2) + "\n")
    path.with_suffix(".md").write_text(harness.fig2_markdown(data))
    harness.plot_fig2(data, path.with_suffix(".png"))
    print(harness.fig2_markdown(data))
    return path


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["moh_convert_real"]:  # a real pretrained model, not a miniature table: its own script
        import moh_convert_real
        import moh_convert_real_recovery  # its tune stage (it imports moh_convert_real, never the other way round)

        return moh_convert_real.main(argv[1:], stage_tune=moh_convert_real_recovery.stage_tune)
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("table", nargs="?", choices=[*tables.TABLES, "moh_fig2"])
    parser.add_argument("--scale", choices=[s for s in tables.SCALES if s != "quick"], default="cpu")
    parser.add_argument("--quick", action="store_true", help="CI smoke run: tiny models, a few steps")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    parser.add_argument(
        "--cells", nargs="+", default=None, help="only these cells (ids such as smoe mhmoe_h3, or names)"
    )
    parser.add_argument("--out", type=Path, default=None, help="results folder (default: benchmarks/results)")
    parser.add_argument(
        "--deadline",
        type=float,
        default=None,
        metavar="MINUTES",
        help="start no run that would not finish within MINUTES of the command's start",
    )
    parser.add_argument(
        "--mixed_precision",
        choices=["no", "bf16", "fp16"],
        default=None,
        help="training precision (default: bf16 at the gpu scale, else no)",
    )
    parser.add_argument(
        "--eval_every",
        type=int,
        default=None,
        metavar="STEPS",
        help="validate every STEPS steps (default: a tenth of training; half with --quick)",
    )
    parser.add_argument(
        "--steps",
        type=int,
        default=None,
        metavar="N",
        help="train N steps instead of the scale's (recorded in each run file's scale)",
    )
    parser.add_argument(
        "--merge",
        type=Path,
        nargs="+",
        default=None,
        metavar="SOURCE",
        help="build the table from the finished runs in SOURCE... (folders, run bundles, results "
        "tables; no training); written to --out, default the first folder",
    )
    parser.add_argument(
        "--seed_from",
        type=Path,
        nargs="+",
        default=[],
        metavar="SOURCE",
        help="finished runs (run bundles, results tables, folders) of this table, scale and steps to "
        "count as done: copied into --out and skipped",
    )
    parser.add_argument(
        "--bundle",
        type=Path,
        default=None,
        metavar="FILE",
        help="rewrite FILE after every finished run with all of them (one file to bring back)",
    )
    parser.add_argument(
        "--probe_file",
        type=Path,
        nargs="+",
        default=[],
        metavar="FILE",
        help="--probe results to estimate run times from (--deadline) where device and precision match",
    )
    parser.add_argument(
        "--started",
        type=float,
        default=None,
        metavar="EPOCH",
        help="the time --deadline counts from (default: the command's start)",
    )
    parser.add_argument(
        "--no_merge",
        action="store_true",
        help="after the runs, build no table (the run files and --bundle hold them; --merge later)",
    )
    parser.add_argument(
        "--probe",
        type=int,
        default=None,
        metavar="STEPS",
        help="only measure training tokens/s of the selected cells over STEPS steps (random ids) into "
        "--out/probe_<table>_<scale>.json",
    )
    parser.add_argument("--list", action="store_true", help="list the tables and exit")
    parser.add_argument(
        "--cards",
        action="store_true",
        help="regenerate the tables, plots and model cards from the committed results JSON (no training)",
    )
    args = parser.parse_args(argv)
    if args.cards:
        for path in sorted((args.out or harness.RESULTS).glob("reproduce_*.json")):
            harness.rewrite_outputs(path)
        return 0
    if args.list or not args.table:
        for name, (build, title) in tables.TABLES.items():
            print(f"{name:16s} {title}")
            print(f"{'':16s} cells: {' '.join(cell_id(c) for c in build(tables.SCALES['quick']))}")
        print(f"{'moh_fig2':16s} MoH Fig. 2: dense LLaMA -> MoH recovery, continue-tuned, with a dense control")
        print(f"{'moh_convert_real':16s} SmolLM2-135M-Instruct (GGUF) -> MoH: zero-shot recipes, other text, recovery")
        return 0
    if args.table == "moh_fig2" and args.scale not in FIG2_SCALES:
        parser.error(f"moh_fig2 has the scales {', '.join(s for s in FIG2_SCALES if s != 'quick')}, not {args.scale}")
    if args.merge:
        if args.table == "moh_fig2":
            parser.error("--merge builds the tables of tables.py; moh_fig2 writes its results in one run")
        folders = [m for m in args.merge if m.is_dir()]
        if args.out is None and not folders:
            parser.error("--merge of files only: say where the table goes with --out")
        merge(args.table, args.merge, args.out or folders[0])
        return 0
    scale = "quick" if args.quick else args.scale
    mixed_precision = args.mixed_precision or ("bf16" if scale.startswith("gpu") else "no")
    if args.probe:
        probe(args.table, scale, args.cells, args.probe, args.out or harness.RESULTS, mixed_precision)
        return 0
    if len(args.seeds) < 2 and not args.quick and not args.cells:
        parser.error("use at least 2 seeds per cell (--seeds 0 1), or pick --cells for a partial run")
    deadline = Deadline(args.deadline, args.started)
    with tempfile.TemporaryDirectory(prefix="mhmoe-reproduce-") as tmp:
        out = args.out or (Path(tmp) / "results" if args.quick else harness.RESULTS)
        if args.table == "moh_fig2":
            run_fig2(scale, args.seeds, out, Path(tmp))
            return 0
        finished = run_cells(
            args.table,
            scale,
            args.seeds,
            out,
            args.cells,
            deadline,
            mixed_precision,
            args.eval_every,
            args.steps,
            args.seed_from,
            args.bundle,
            args.probe_file,
        )
        if not args.no_merge:
            merge(args.table, [out], out)
        if not finished:
            print("stopped at the deadline; the table above holds the runs finished so far")
    return 0


if __name__ == "__main__":
    sys.exit(main())
