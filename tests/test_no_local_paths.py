"""No local paths in what the command lines write into their output folders (records name files relative to the output
folder or by their Hub id), nor in the committed results (benchmarks/results/). A local path is anything under this
run's temporary folder or the repository, or an absolute path starting /tmp, /home, /root, /work, /Users or /mnt."""

import json
import re
from pathlib import Path

import pytest

from tests.convert.test_convert import _llama_dir
from tests.hub.test_trust import _run

REPO = Path(__file__).resolve().parents[1]
BINARY = (".safetensors", ".bin", ".pkl", ".png", ".pt", ".gguf", ".lock")
_ABSOLUTE = re.compile(r"(?<![\w.:/-])/(?:tmp|home|root|work|Users|mnt)/[^\s\"'`)\]]+")


def local_paths(folder: Path, also=()) -> dict[str, list[str]]:
    """{file relative to `folder`: the local paths in it}, text files only."""
    needles = [str(p) for p in (*also, REPO) if str(p) not in ("/", "")]
    found = {}
    for path in sorted(folder.rglob("*")):
        if not path.is_file() or path.name.endswith(BINARY):
            continue
        try:
            text = path.read_text(encoding="utf-8")
        except UnicodeDecodeError:
            continue
        hits = sorted({n for n in needles if n in text} | set(_ABSOLUTE.findall(text)))
        if hits:
            found[str(path.relative_to(folder))] = hits[:3]
    return found


def test_the_scanner_finds_local_paths(tmp_path):
    (tmp_path / "a.json").write_text(json.dumps({"args": {"train_file": ["/home/me/data/train.jsonl"]}}))
    (tmp_path / "b.md").write_text(f"made from `{tmp_path / 'x'}`; see https://hf.co/org/name and eval_tasks/README.md")
    (tmp_path / "c.txt").write_text("relative/path and https://example.org/tmp/x only")
    assert local_paths(tmp_path, [tmp_path]) == {
        "a.json": ["/home/me/data/train.jsonl"],
        "b.md": sorted({str(tmp_path), str(tmp_path / "x")}),
    }


def test_no_command_writes_a_local_path_into_its_output(tmp_path, tokenizer_dir, corpus):
    """Fresh outputs of mhmoe-train (checkpoints, summary, card), mhmoe-convert (with continue-tuning: conversion
    record, recovery curve, checkpoints), mhmoe-export and mhmoe-eval (--output_path with --log_samples), each given
    absolute paths for every input."""
    source = _llama_dir(tmp_path / "inputs" / "Tiny-Llama", tokenizer_dir)
    outputs = tmp_path / "outputs"
    common = [
        "--train_file",
        corpus["tiny"],
        "--validation_file",
        corpus["val"],
        "--block_size",
        "16",
        "--per_device_train_batch_size",
        "2",
        "--max_steps",
        "2",
        "--save_steps",
        "1",
        "--eval_steps",
        "1",
        "--warmup_steps",
        "1",
        "--disable_tqdm",
    ]
    commands = [
        ("mhmoe-convert", ["--input_dir", str(source), "--output_dir", str(outputs / "convert"), *common]),
        (
            "mhmoe-train",
            [
                "--model_name_or_path",
                str(outputs / "convert"),
                "--tokenizer_name_or_path",
                tokenizer_dir,
                "--output_dir",
                str(outputs / "train"),
                *common,
            ],
        ),
        ("mhmoe-export", [str(outputs / "train"), str(outputs / "export")]),
        (
            "mhmoe-eval",
            [
                "--model_args",
                f"pretrained={outputs / 'train' / 'checkpoint-1'}",
                "--tasks",
                "mhmoe_ppl_wikipedia",
                "--metadata",
                json.dumps({"wikipedia_path": corpus["val"]}),
                "--limit",
                "2",
                "--output_path",
                str(outputs / "eval"),
                "--log_samples",
            ],
        ),
    ]
    for command, argv in commands:
        assert _run(command, argv) == 0, command
    for name in ("convert", "train", "export", "eval"):
        assert list((outputs / name).rglob("*.json")), name  # each wrote its records
    assert (outputs / "train" / "checkpoint-1" / "train_state.json").is_file()
    summary = json.loads((outputs / "train" / "train_summary.json").read_text())
    assert summary["args"]["output_dir"] == "." and summary["args"]["train_file"] == ["tiny.jsonl"]
    assert local_paths(outputs, [tmp_path, Path(corpus["root"]), Path(tokenizer_dir)]) == {}


RESULTS = REPO / "benchmarks" / "results"
# the committed results whose commands or records still name local paths (issue 32; their commands and `merged_from`
# records are being rewritten with the reproduction scripts): each file is its own test, so a fixed one shows as
# XPASS and leaves this list
KNOWN_LOCAL_PATHS = {
    "gpu_moe-nvidia-h200-60178f3/gpu_moe.log",
    "gpu_moe-nvidia-h200-60178f3/gpu_run.log",
    "gpu_moe-nvidia-h200-60178f3/reproduce.log",
    "moh_convert_real.json",
    "moh_convert_real.md",
    "reproduce_bitnet_table3_cpu.json",
    "reproduce_bitnet_table3_cpu_long.json",
    "reproduce_lory_comparison_cpu.json",
    "reproduce_lory_comparison_cpu_long.json",
    "reproduce_mhmoe_ablation_cpu.json",
    "reproduce_mhmoe_ablation_cpu_long.json",
    "reproduce_mhmoe_capacity_cpu.json",
    "reproduce_mhmoe_capacity_cpu_long.json",
    "reproduce_mhmoe_table1_cpu_long.json",
    "reproduce_mhmoe_table2_cpu.json",
    "reproduce_mhmoe_table2_cpu_long.json",
    "reproduce_moh_fig2_cpu.json",
    "reproduce_moh_fig2_cpu_long.json",
}


@pytest.mark.parametrize(
    "name",
    sorted(str(p.relative_to(RESULTS)) for p in RESULTS.rglob("*") if p.is_file() and not p.name.endswith(BINARY)),
)
def test_committed_results_name_no_local_path(name, request):
    if name in KNOWN_LOCAL_PATHS:
        request.applymarker(pytest.mark.xfail(reason="known: local paths in this committed result", strict=False))
    path = RESULTS / name
    assert local_paths(path.parent).get(path.name) is None, local_paths(path.parent).get(path.name)
