"""Fine-tuning data paths of `mhmoe-train --dataset`, measured on this machine.

`python benchmarks/sft.py packing`: chat SFT with packed rows (the default) against one example per row padded per
batch, on question/answer conversations made from the Python docs' topics (a tiny MH-MoE model, CPU). Both runs train
the same conversations for one epoch; the cell is real (not padding) tokens per second, median over the logged steps
after the first, and the rows each needs. Runs alternate (packed, padded, packed, ...) over --rounds, so a drift in the
machine's load falls on both; the ratio is the median of per-round ratios.

`python benchmarks/sft.py memory`: the peak resident memory of a `--streaming` run over a generated JSONL of
--gigabytes (default 2; written once under --workdir), against the same run over a file a hundredth of its size: a
stream reads and tokenizes as it trains, so the peak does not grow with the file. Each run's peak RSS is its
`ru_maxrss`, read by a fresh parent process.

Results, with the commands that produced them: benchmarks/results/sft_packing.txt, benchmarks/results/sft_memory.txt.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MODEL = dict(
    model_type="mhmoe", vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
    num_attention_heads=4, max_position_embeddings=512, decoder_sparse_step=2, num_experts=8, num_experts_per_tok=2,
    moe_intermediate_size=64, moe_heads=2,
)  # fmt: skip
CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def _env() -> dict:
    return dict(os.environ, HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", PYTHONPATH=os.path.join(ROOT, "src"))


def _workspace(workdir: str) -> dict:
    """A config, a ChatML tokenizer trained on the Python docs and a chat dataset made from them."""
    import pydoc_data.topics

    from mhmoe.training.data import train_tokenizer

    os.makedirs(workdir, exist_ok=True)
    topics = pydoc_data.topics.topics
    paths = {
        k: os.path.join(workdir, n) for k, n in (("config", "config.json"), ("tok", "tok"), ("chat", "chat.jsonl"))
    }
    with open(paths["config"], "w") as f:
        json.dump(MODEL, f)
    tokenizer = train_tokenizer([topics[k] for k in sorted(topics)], 500, 512)
    tokenizer.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    tokenizer.chat_template = CHATML
    tokenizer.save_pretrained(paths["tok"])
    with open(paths["chat"], "w") as f:
        for key in sorted(topics):  # answers of every length: the first 1 to 12 lines of the topic's text
            lines = [line for line in topics[key].strip().splitlines() if line.strip()]
            answer = "\n".join(lines[: 1 + len(key) % 12])[:1200]
            messages = [
                {"role": "user", "content": f"Explain {key} in Python."},
                {"role": "assistant", "content": answer},
            ]
            f.write(json.dumps({"messages": messages}) + "\n")
    return paths


def _train(paths: dict, out: str, extra: list[str]) -> list[dict]:
    command = [
        sys.executable, "-m", "mhmoe.training", "--model_name_or_path", paths["config"], "--tokenizer_name_or_path",
        paths["tok"], "--dataset", paths["chat"], "--output_dir", out, "--overwrite_output_dir", "--block_size", "512",
        "--per_device_train_batch_size", "4", "--disable_tqdm", "--no_plot", *extra,
    ]  # fmt: skip
    subprocess.run(command, check=True, env=_env(), stdout=subprocess.DEVNULL)
    with open(os.path.join(out, "metrics.jsonl")) as f:
        return [r for r in map(json.loads, f) if "loss" in r]


def packing(args) -> None:
    paths = _workspace(args.workdir)
    cells: dict[str, list] = {"packed": [], "padded": []}
    ratios = []
    for round_ in range(args.rounds):
        rates = {}
        order = ("packed", "padded") if round_ % 2 == 0 else ("padded", "packed")
        for name in order:
            flags = ["--packing", "false"] if name == "padded" else []
            records = _train(paths, os.path.join(args.workdir, name), flags + ["--max_steps", str(args.steps)])
            rates[name] = statistics.median(r["tokens_per_second"] for r in records[1:])
            cells[name].append((rates[name], records[-1]["tokens"]))
        ratios.append(rates["packed"] / rates["padded"])
        print(f"round {round_ + 1}: packed {rates['packed']:.0f} real tok/s, padded {rates['padded']:.0f}", flush=True)
    from transformers import AutoTokenizer

    from mhmoe.training.formats import CHAT, Encoder
    from mhmoe.training.packing import pack_examples

    encoder = Encoder(AutoTokenizer.from_pretrained(paths["tok"]), CHAT)
    examples = [encoder(json.loads(line), n) for n, line in enumerate(open(paths["chat"]), start=1)]
    real = sum(min(len(e.input_ids), 512) for e in examples)
    for name, packed in (("packed", True), ("padded", False)):
        blocks, _ = pack_examples(examples, 512, 0, packed)
        rows = len(blocks)
        padded_width = sum(
            int(blocks.lengths[i : i + 4].max()) * len(blocks.lengths[i : i + 4]) for i in range(0, rows, 4)
        )
        print(
            f"{name}: {rows} rows for {len(examples)} conversations ({real:,} real tokens; "
            f"{real / (rows * 512 if packed else padded_width):.1%} of the computed positions are real), "
            f"median {statistics.median(c[0] for c in cells[name]):.0f} real tokens/s"
        )
    print(f"packed / padded real tokens per second: median x{statistics.median(ratios):.3f} "
          f"(rounds: {', '.join(f'{r:.3f}' for r in ratios)})")  # fmt: skip


def _write_jsonl(path: str, size: int) -> None:
    """Text records from the Python docs, each numbered (so no two are equal), until the file holds `size` bytes."""
    import pydoc_data.topics

    texts = [t for _, t in sorted(pydoc_data.topics.topics.items())]
    written, n = 0, 0
    with open(path, "w") as f:
        while written < size:
            line = json.dumps({"text": f"[{n}] " + texts[n % len(texts)]}) + "\n"
            f.write(line)
            written, n = written + len(line), n + 1


# runs a command in a fresh parent and prints the command's peak RSS in KiB (its ru_maxrss: each run its own maximum)
_PEAK = [
    sys.executable,
    "-c",
    "import resource, subprocess, sys; subprocess.run(sys.argv[1:], check=True, stdout=subprocess.DEVNULL); "
    "print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)",
]


def memory(args) -> None:
    paths = _workspace(args.workdir)
    rows = []
    for label, size in (("large", int(args.gigabytes * 2**30)), ("small", int(args.gigabytes * 2**30 / 100))):
        data = os.path.join(args.workdir, f"text_{label}.jsonl")
        if not os.path.isfile(data) or os.path.getsize(data) < size:
            _write_jsonl(data, size)
        out = os.path.join(args.workdir, f"stream_{label}")
        command = [
            sys.executable, "-m", "mhmoe.training", "--model_name_or_path", paths["config"], "--tokenizer_name_or_path",
            paths["tok"], "--dataset", data, "--streaming", "--max_steps", str(args.steps), "--output_dir", out,
            "--overwrite_output_dir", "--block_size", "256", "--per_device_train_batch_size", "8", "--disable_tqdm",
            "--no_plot", "--save_steps", str(args.steps),
        ]  # fmt: skip
        started = time.time()
        peak_kb = int(subprocess.run(_PEAK + command, check=True, env=_env(), capture_output=True, text=True).stdout)
        with open(os.path.join(out, f"checkpoint-{args.steps}", "stream_state_0.json")) as f:
            state = json.load(f)
        rows.append((label, os.path.getsize(data), peak_kb * 1024, state["index"], time.time() - started))
    for label, size, peak, examples, seconds in rows:
        print(f"{label}: {size / 2**30:.2f} GiB JSONL, {args.steps} steps, {examples:,} records read, "
              f"peak RSS {peak / 2**30:.2f} GiB, {seconds:.0f} s")  # fmt: skip
    print(f"peak RSS under 1.5 GiB over the {args.gigabytes:g} GiB file: {rows[0][2] < 1.5 * 2**30}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("job", choices=["packing", "memory"])
    parser.add_argument("--workdir", default=os.path.join(tempfile.gettempdir(), "mhmoe-sft-bench"))
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=None, help="optimizer steps per run (packing 30, memory 200)")
    parser.add_argument("--gigabytes", type=float, default=2.0)
    args = parser.parse_args()
    args.steps = args.steps or (30 if args.job == "packing" else 200)
    packing(args) if args.job == "packing" else memory(args)


if __name__ == "__main__":
    main()
