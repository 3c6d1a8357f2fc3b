#!/usr/bin/env python
"""Reproduce the papers' tables in miniature, one command per table (results: benchmarks/results/reproduce_*.{json,md,png}).

    python benchmarks/reproduce/run.py mhmoe_table1 [--scale cpu|gpu] [--seeds 0 1] [--quick]
    python benchmarks/reproduce/run.py moh_fig2 [--quick]
    python benchmarks/reproduce/run.py moh_convert_real --stage zero_shot|cli|tune|report   (moh_convert_real.py)
    python benchmarks/reproduce/run.py --list

Tables: see `tables.py` (cells and scales) and `harness.py` (data, training, results). `--quick` is the CI smoke run:
tiny models, a few steps, the standard-library corpus, results under --out (default: a temporary directory).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import harness  # noqa: E402
import tables  # noqa: E402

FIG2_SCALES = {
    "quick": dict(vocab_size=320, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=8,
                  num_key_value_heads=4, block_size=32, batch_size=4, dense_steps=6, tune_steps=4, eval_steps=2),
    "cpu": dict(vocab_size=2048, hidden_size=96, intermediate_size=256, num_layers=4, num_heads=8,
                num_key_value_heads=4, block_size=64, batch_size=8, dense_steps=400, tune_steps=150, eval_steps=25,
                dense_lr=2e-3, tune_lr=5e-4, tune_min_lr=5e-5),
    "cpu_long": dict(vocab_size=2048, hidden_size=96, intermediate_size=256, num_layers=4, num_heads=8,
                     num_key_value_heads=4, block_size=64, batch_size=8, dense_steps=2000, tune_steps=600,
                     eval_steps=50, dense_lr=2e-3, tune_lr=5e-4, tune_min_lr=5e-5),
    "gpu": dict(vocab_size=8192, hidden_size=512, intermediate_size=1376, num_layers=8, num_heads=8,
                num_key_value_heads=8, block_size=512, batch_size=32, dense_steps=3000, tune_steps=600, eval_steps=50,
                dense_lr=1e-3, tune_lr=2e-4, tune_min_lr=2e-5),
}  # fmt: skip


def run_table(name: str, scale_name: str, seeds: list[int], out_dir: Path, workdir: Path) -> Path:
    build, title = tables.TABLES[name]
    scale = tables.SCALES[scale_name]
    train_file, val_file, data_name = harness.data_files(scale_name, workdir)
    tokenizer = harness.tokenizer_for(train_file, scale["vocab"], scale["block"], workdir)
    cells = {}
    for cell_name, config in build(scale).items():
        cells[cell_name] = {"config": config.to_diff_dict(), "parity": harness.parity(config), "runs": []}
        for seed in seeds:
            run = harness.run_cell(config, seed, scale, (train_file, val_file), tokenizer, workdir,
                                   throughput=name in tables.THROUGHPUT_TABLES)  # fmt: skip
            cells[cell_name]["runs"].append(run)
            final = run["eval"][-1]["ppl"] if run["eval"] else float("nan")
            print(f"{name} | {cell_name} | seed {seed}: ppl {final:.2f} ({run['seconds']} s) | "
                  f"params {cells[cell_name]['parity']['parameters']:,}", flush=True)
    meta = {"data": data_name, "scale_name": scale_name, "scale": scale, "seeds": seeds, **harness.environment()}
    path = harness.write_results(name, title, cells, meta, out_dir)
    print(harness.markdown_table(json.loads(path.read_text())))
    return path


def run_fig2(scale_name: str, seeds: list[int], out_dir: Path, workdir: Path) -> Path:
    """MoH Fig. 2: dense LLaMA -> MoH at 75% heads with the converter (l2 router, straight-through), continue-tuned,
    against the dense parent and a dense control trained the same extra steps."""
    from mhmoe.convert.recovery_demo import run_recovery_demo

    train_file, val_file, data_name = harness.data_files(scale_name, workdir)
    runs = []
    for seed in seeds:
        run_dir = workdir / f"fig2-seed{seed}"
        result = run_recovery_demo(str(run_dir), seed=seed, data_files=(train_file, val_file),
                                   **FIG2_SCALES[scale_name])  # fmt: skip
        curves = {}
        for label, sub in (("MoH 75% (converted)", "moh"), ("dense control", "dense_continued")):
            records = [json.loads(line) for line in (run_dir / sub / "metrics.jsonl").read_text().splitlines()]
            curves[label] = [{"tokens": r["tokens"], "ppl": r["eval_ppl"]} for r in records if "eval_ppl" in r]
        result["curves"] = curves
        runs.append(result)
        print(f"moh_fig2 | seed {seed}: dense {result['dense_ppl']:.2f}, MoH converted "
              f"{result['moh_ppl_before_tuning']:.2f} -> {result['moh_ppl_after_tuning']:.2f}, control "
              f"{result['dense_continued_ppl']:.2f}", flush=True)
    out_dir.mkdir(parents=True, exist_ok=True)
    data = {"table": "moh_fig2", "title": "MoH Fig. 2: dense LLaMA -> MoH (75% heads), continue-tuned",
            "data": data_name, "scale_name": scale_name, "scale": FIG2_SCALES[scale_name], "seeds": seeds,
            **harness.environment(), "runs": runs}  # fmt: skip
    path = out_dir / f"reproduce_moh_fig2_{scale_name}.json"
    path.write_text(json.dumps(data, indent=2) + "\n")
    path.with_suffix(".md").write_text(harness.fig2_markdown(data))
    harness.plot_fig2(data, path.with_suffix(".png"))
    print(harness.fig2_markdown(data))
    return path


def main(argv=None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["moh_convert_real"]:  # a real pretrained model, not a miniature table: its own script
        import moh_convert_real

        return moh_convert_real.main(argv[1:])
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("table", nargs="?", choices=[*tables.TABLES, "moh_fig2"])
    parser.add_argument("--scale", choices=[s for s in tables.SCALES if s != "quick"], default="cpu")
    parser.add_argument("--quick", action="store_true", help="CI smoke run: tiny models, a few steps")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    parser.add_argument("--out", type=Path, default=None, help="results folder (default: benchmarks/results)")
    parser.add_argument("--list", action="store_true", help="list the tables and exit")
    parser.add_argument("--cards", action="store_true", help="regenerate the tables, plots and model cards from the "
                        "committed results JSON (no training)")  # fmt: skip
    args = parser.parse_args(argv)
    if args.cards:
        for path in sorted((args.out or harness.RESULTS).glob("reproduce_*.json")):
            harness.rewrite_outputs(path)
        return
    if args.list or not args.table:
        for name, (_, title) in tables.TABLES.items():
            print(f"{name:16s} {title}")
        print(f"{'moh_fig2':16s} MoH Fig. 2: dense LLaMA -> MoH recovery, continue-tuned, with a dense control")
        print(f"{'moh_convert_real':16s} SmolLM2-135M-Instruct (GGUF) -> MoH: head recipes zero-shot, recovery")
        return
    if len(args.seeds) < 2 and not args.quick:
        parser.error("use at least 2 seeds per cell (--seeds 0 1)")
    scale = "quick" if args.quick else args.scale
    with tempfile.TemporaryDirectory(prefix="mhmoe-reproduce-") as tmp:
        out = args.out or (Path(tmp) / "results" if args.quick else harness.RESULTS)
        if args.table == "moh_fig2":
            run_fig2(scale, args.seeds, out, Path(tmp))
        else:
            run_table(args.table, scale, args.seeds, out, Path(tmp))


if __name__ == "__main__":
    main()
