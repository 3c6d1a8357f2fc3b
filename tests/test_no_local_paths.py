"""No local paths in what the command lines write into their output folders (records name files relative to the output
folder or by their Hub id), nor in the committed results (benchmarks/results/). A local path is anything under this
run's temporary folder or the repository, or an absolute path starting /tmp, /home, /root, /work, /Users or /mnt."""

import json
import re
from pathlib import Path

import pytest

from tests._plumbing.test_trust import _run
from tests.convert.test_convert import _llama_dir

REPO = Path(__file__).resolve().parents[1]
BINARY = (".safetensors", ".bin", ".pkl", ".png", ".pt", ".gguf", ".lock")
# "<checkout>/work/x" or "$OUT/tmp" is a placeholder's folder, not a local path
_ABSOLUTE = re.compile(r"(?<![\w.:/>$}-])/(?:tmp|home|root|work|Users|mnt)/[^\s\"'`)\]]+")


def file_local_paths(path: Path, also=()) -> list[str]:
    """The local paths in a text file (none in a binary one): under `also` or the repository, or absolute."""
    if path.name.endswith(BINARY):
        return []
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError:
        return []
    needles = [str(p) for p in (*also, REPO) if str(p) not in ("/", "")]
    return sorted({n for n in needles if n in text} | set(_ABSOLUTE.findall(text)))[:3]


def local_paths(folder: Path, also=()) -> dict[str, list[str]]:
    """{file relative to `folder`: the local paths in it}, text files only."""
    found = {}
    for path in sorted(folder.rglob("*")):
        if path.is_file() and (hits := file_local_paths(path, also)):
            found[str(path.relative_to(folder))] = hits
    return found


def test_the_scanner_finds_local_paths(tmp_path):
    (tmp_path / "a.json").write_text(json.dumps({"args": {"train_file": ["/home/me/data/train.jsonl"]}}))
    (tmp_path / "b.md").write_text(f"made from `{tmp_path / 'x'}`; see https://hf.co/org/name and eval_tasks/README.md")
    (tmp_path / "c.txt").write_text("relative/path and https://example.org/tmp/x only")
    (tmp_path / "d.md").write_text("mhmoe-convert --input_dir <gguf_dir> --output_dir <checkout>/work/out; $OUT/tmp")
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


@pytest.mark.parametrize(
    "name",
    sorted(str(p.relative_to(RESULTS)) for p in RESULTS.rglob("*") if p.is_file() and not p.name.endswith(BINARY)),
)
def test_committed_results_name_no_local_path(name):
    """Commands as a user would type them, folders as placeholders (<checkout>, <output_dir>, $OUT) or names."""
    assert file_local_paths(RESULTS / name) == []


def test_docs_and_scripts_name_no_local_path():
    """Commands in the docs and docstrings as a user would type them (placeholders such as <workdir>, <old_tree>),
    scripts without machine-specific defaults: every text file of benchmarks/, docs/, scripts/, eval_tasks/, src/
    and the top-level Markdown files."""
    files = [
        p
        for folder in ("benchmarks", "docs", "scripts", "eval_tasks", "src")
        for p in (REPO / folder).rglob("*")
        if p.is_file() and RESULTS not in p.parents and "egg-info" not in str(p) and "__pycache__" not in str(p)
    ]
    files += list(REPO.glob("*.md"))
    assert len(files) > 100  # the walk sees the tree
    found = {str(p.relative_to(REPO)): hits for p in files if (hits := file_local_paths(p))}
    assert found == {}, found
