"""Checkpoints verify themselves (manifest of every file's size and SHA-256, written last): damage is refused in one
line naming the file and `latest` falls back to the newest checkpoint that verifies, ending with the uninterrupted
run's weights; every checkpoint-N loads with `from_pretrained`, exports and evaluates; after a stop at any record,
the resumed run's metrics.jsonl holds each record once."""

import json
import shutil

import pytest

from mhmoe.training import TrainingError
from mhmoe.training.checkpoints import MANIFEST_ERA_KEYS, resolve_checkpoint
from mhmoe.training.cli import main
from mhmoe.training.manifest import MANIFEST_FILE
from tests.training.test_loop import _args, train

STEPS = 4


def _common(corpus, config_json, tokenizer_dir, **overrides):
    return dict(
        model_name_or_path=config_json,
        tokenizer_name_or_path=tokenizer_dir,
        train_file=[corpus["tiny"]],
        validation_file=[corpus["val"]],
        max_steps=STEPS,
        save_steps=2,
        eval_steps=2,
        **overrides,
    )


@pytest.fixture(scope="module")
def finished(tmp_path_factory, corpus, config_json, tokenizer_dir):
    """An uninterrupted run of 4 steps with checkpoints at 2 and 4."""
    out = tmp_path_factory.mktemp("integrity") / "run"
    train(_args(out, **_common(corpus, config_json, tokenizer_dir)))
    return out


def _records(folder):
    """metrics.jsonl without the wall-clock fields."""
    with open(folder / "metrics.jsonl") as f:
        return [
            {k: v for k, v in json.loads(line).items() if k not in ("elapsed_s", "tokens_per_second", "mfu")}
            for line in f
        ]


def _flip(path, offset=200):
    data = bytearray(path.read_bytes())
    data[offset] ^= 0x01
    path.write_bytes(bytes(data))


DAMAGE = {  # what is done to checkpoint-4, and the words of the refusal
    "flipped byte in optimizer.bin": (
        lambda c: _flip(c / "optimizer.bin"),
        r"optimizer.bin has changed since it was written \(its SHA-256 differs",
    ),
    "truncated optimizer.bin": (
        lambda c: (c / "optimizer.bin").write_bytes((c / "optimizer.bin").read_bytes()[:999]),
        r"optimizer.bin is truncated \(999 bytes; \d+ were written\)",
    ),
    "empty optimizer.bin": (lambda c: (c / "optimizer.bin").write_bytes(b""), r"optimizer.bin is empty \(0 bytes"),
    "garbage model file": (
        lambda c: (c / "model.safetensors").write_bytes(b"\x07" * (c / "model.safetensors").stat().st_size),
        r"model.safetensors has changed since it was written",
    ),
    "missing model file": (lambda c: (c / "model.safetensors").unlink(), r"model.safetensors is missing"),
    "missing manifest entry file": (lambda c: (c / "scheduler.bin").unlink(), r"scheduler.bin is missing"),
    "step 14 in checkpoint-4": (
        lambda c: (c / "train_state.json").write_text(
            json.dumps({**json.loads((c / "train_state.json").read_text()), "step": 14})
        ),
        r"train_state.json says step 14, not 4, as the folder's name says",
    ),
    "step -3": (
        lambda c: (c / "train_state.json").write_text(
            json.dumps({**json.loads((c / "train_state.json").read_text()), "step": -3})
        ),
        r"train_state.json says step -3, not 4",
    ),
}


@pytest.mark.parametrize("damage", list(DAMAGE))
def test_damaged_checkpoint_is_refused_by_name_and_latest_falls_back(
    finished, tmp_path, corpus, config_json, tokenizer_dir, capsys, damage
):
    """The named checkpoint is refused in one line naming the damaged file (exit 2); `latest` skips it, saying which
    file and why, resumes from checkpoint-2 and ends with the uninterrupted run's weights and records."""
    out = tmp_path / "run"
    shutil.copytree(finished, out)
    (out / "train_summary.json").unlink()  # stopped after its last checkpoint, before the final save
    (out / "model.safetensors").unlink()
    change, words = DAMAGE[damage]
    change(out / "checkpoint-4")
    capsys.readouterr()
    common = _common(corpus, config_json, tokenizer_dir)
    argv = [
        "--model_name_or_path",
        config_json,
        "--tokenizer_name_or_path",
        tokenizer_dir,
        "--train_file",
        corpus["tiny"],
        "--validation_file",
        corpus["val"],
        "--output_dir",
        str(out),
        "--max_steps",
        str(STEPS),
        "--save_steps",
        "2",
        "--eval_steps",
        "2",
        "--block_size",
        "16",
        "--per_device_train_batch_size",
        "2",
        "--learning_rate",
        "3e-3",
        "--warmup_steps",
        "1",
        "--seed",
        "0",
        "--disable_tqdm",
        "--no_plot",
        "--resume_from_checkpoint",
        str(out / "checkpoint-4"),
    ]
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert exit_info.value.code == 2 and line.startswith("mhmoe-train: error: --resume_from_checkpoint: "), line
    assert str(out / "checkpoint-4") in line
    import re

    assert re.search(words, line), line

    train(_args(out, resume_from_checkpoint="latest", **common))
    err = capsys.readouterr().err
    assert re.search(r"skipping .*checkpoint-4.*" + words, err), err
    assert f"resuming from {out / 'checkpoint-2'}, the newest checkpoint that verifies" in err
    assert (out / "model.safetensors").read_bytes() == (finished / "model.safetensors").read_bytes()
    assert _records(out) == _records(finished)


def test_manifest_lists_every_file_and_is_written_last(finished):
    checkpoint = finished / "checkpoint-4"
    manifest = json.loads((checkpoint / MANIFEST_FILE).read_text())
    files = {p.relative_to(checkpoint).as_posix() for p in checkpoint.rglob("*") if p.is_file()}
    assert set(manifest["files"]) == files - {MANIFEST_FILE}
    assert {
        "model.safetensors",
        "optimizer.bin",
        "scheduler.bin",
        "random_states_0.pkl",
        "train_state.json",
        "config.json",
        "tokenizer.json",
    } <= set(manifest["files"])
    import hashlib

    for name, entry in manifest["files"].items():
        data = (checkpoint / name).read_bytes()
        assert entry == {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}, name


def _as_before_manifests(checkpoint) -> None:
    """Make `checkpoint` look as an mhmoe from before manifests wrote it: no manifest, no key written since."""
    (checkpoint / MANIFEST_FILE).unlink()
    state = json.loads((checkpoint / "train_state.json").read_text())
    for key in MANIFEST_ERA_KEYS:
        state.pop(key, None)
    (checkpoint / "train_state.json").write_text(json.dumps(state))


def test_a_checkpoint_that_lost_its_manifest_is_refused(finished, tmp_path, corpus, config_json, tokenizer_dir):
    """Its state file says a manifest-writing mhmoe saved it: a deleted manifest plus a flipped weight byte is refused
    by name and by `latest` (which falls back to the older checkpoint), never trained on."""
    out = tmp_path / "run"
    shutil.copytree(finished, out)
    for name in ("train_summary.json", "model.safetensors"):
        (out / name).unlink()
    newest = out / "checkpoint-4"
    (newest / MANIFEST_FILE).unlink()
    weights = newest / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-10] ^= 0xFF
    weights.write_bytes(bytes(data))
    common = _common(corpus, config_json, tokenizer_dir)
    with pytest.raises(TrainingError, match=r"checkpoint-4 is damaged: its manifest.json is missing, though"):
        train(_args(out, resume_from_checkpoint=str(newest), **common))
    assert resolve_checkpoint("latest", str(out)) == str(out / "checkpoint-2")


def test_a_checkpoint_from_before_manifests_resumes_only_when_named(
    finished, tmp_path, corpus, config_json, tokenizer_dir, capsys
):
    """Provably older (no manifest, no later key): `latest` skips it; named, it resumes unverified with a warning, and
    a file that does not load is one line."""
    out = tmp_path / "run"
    shutil.copytree(finished, out)
    for name in ("train_summary.json", "model.safetensors", "checkpoint-4"):
        (shutil.rmtree if (out / name).is_dir() else (out / name).unlink)(out / name)
    old = out / "checkpoint-2"
    _as_before_manifests(old)
    common = _common(corpus, config_json, tokenizer_dir)
    with pytest.raises(TrainingError, match=r"no complete checkpoint .*only when named explicitly"):
        train(_args(out, resume_from_checkpoint="latest", **common))
    (old / "optimizer.bin").write_bytes(b"")
    with pytest.raises(TrainingError, match=r"checkpoint-2 does not load \(\w+Error(: .*)?\); resume from another"):
        train(_args(out, resume_from_checkpoint=str(old), **common))
    assert f"{old} has no manifest.json (written by an mhmoe from before manifests)" in capsys.readouterr().err


def test_every_checkpoint_loads_exports_and_evaluates(finished, tmp_path, corpus):
    """checkpoint-N is a model folder too: `from_pretrained` gives the run's model at that step (the final model at
    the last step), `mhmoe-export` exports it and `mhmoe-eval` evaluates it."""
    import torch
    from transformers import AutoModelForCausalLM

    from mhmoe.evaluation import cli as eval_cli
    from mhmoe.hub.export import export_pretrained

    ids = torch.randint(0, 300, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        final = AutoModelForCausalLM.from_pretrained(finished, trust_remote_code=False).eval()(ids).logits
        at_4 = AutoModelForCausalLM.from_pretrained(finished / "checkpoint-4", trust_remote_code=False).eval()
        at_2 = AutoModelForCausalLM.from_pretrained(finished / "checkpoint-2", trust_remote_code=False).eval()
        assert torch.equal(at_4(ids).logits, final) and not torch.equal(at_2(ids).logits, final)
    exported = export_pretrained(str(finished / "checkpoint-2"), tmp_path / "exported")
    weights = (finished / "checkpoint-2" / "model.safetensors").read_bytes()
    assert (exported / "model.safetensors").read_bytes() == weights
    eval_cli.main(
        [
            "--model_args",
            f"pretrained={finished / 'checkpoint-2'}",
            "--tasks",
            "mhmoe_ppl_wikipedia",
            "--metadata",
            json.dumps({"wikipedia_path": corpus["val"]}),
            "--limit",
            "1",
            "--batch_size",
            "2",
        ]
    )


def test_each_record_once_after_a_stop_at_any_record(
    finished, tmp_path, corpus, config_json, tokenizer_dir, monkeypatch
):
    """Stop the run right after its k-th metrics record for every k (the last: the final validation, printed as
    `validation: loss` before the final save), resume with `latest`: each record is in metrics.jsonl once, as in the
    uninterrupted run. --save_steps divides --max_steps, the case that kept the last validation twice."""
    from mhmoe.training.state import TrainRun

    reference = _records(finished)
    real_log = TrainRun.log
    common = _common(corpus, config_json, tokenizer_dir)
    for k in range(1, len(reference) + 1):
        out = tmp_path / f"stop-{k}"
        written = []

        def log_then_stop(run, record):
            real_log(run, record)
            written.append(record)
            if len(written) == k:
                raise KeyboardInterrupt  # what the disk holds is what a kill at this moment leaves

        monkeypatch.setattr(TrainRun, "log", log_then_stop)
        with pytest.raises(KeyboardInterrupt):
            train(_args(out, **common))
        monkeypatch.setattr(TrainRun, "log", real_log)
        resume = "latest" if list(out.glob("checkpoint-*")) else None
        train(_args(out, resume_from_checkpoint=resume, **common))
        assert _records(out) == reference, k
