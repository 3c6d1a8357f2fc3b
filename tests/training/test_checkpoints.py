"""Checkpoints and the output folder under faults, in process: damaged checkpoints skipped by name, damaged RNG
states refused by name, metrics never lost, one writer per folder, a changed run length, non-finite losses, and
what interrupted runs leave behind. (Killed subprocesses: test_faults.py.)"""

import json
import math
import os

import pytest
import torch

from mhmoe.training import TrainingError
from mhmoe.training.arguments import TrainingStopped
from mhmoe.training.checkpoints import read_state, resolve_checkpoint
from mhmoe.training.lock import OutputDirLock, OutputDirLocked
from mhmoe.training.manifest import Sealer
from mhmoe.training.metrics import _read_metrics, keep_metrics_up_to
from tests.training.test_checkpoint_integrity import _as_before_manifests
from tests.training.test_loop import _args, _records, train


def _common(corpus, config_json, tokenizer_dir, **overrides):
    return dict(
        dict(
            model_name_or_path=config_json,
            tokenizer_name_or_path=tokenizer_dir,
            train_file=[corpus["tiny"]],
            config_overrides="router_jitter_noise=0.2",
        ),
        **overrides,
    )


def _state(folder, step):
    folder.mkdir(parents=True)
    (folder / "train_state.json").write_text(json.dumps({"step": step, "sealed": True}))
    Sealer(str(folder)).finish()  # its manifest, as every checkpoint has


def test_latest_skips_damaged_checkpoints_by_name(tmp_path, capsys):
    _state(tmp_path / "checkpoint-2", 2)
    _state(tmp_path / "checkpoint-4", 4)
    (tmp_path / "checkpoint-4" / "train_state.json").write_text("")  # killed mid-write by an older version
    _state(tmp_path / "checkpoint-6", 6)
    (tmp_path / "checkpoint-6" / "train_state.json").write_text('{"step": 6, "total')
    (tmp_path / "checkpoint-8").mkdir()  # no state file at all
    assert resolve_checkpoint("latest", str(tmp_path)) == str(tmp_path / "checkpoint-2")
    err = capsys.readouterr().err
    assert f"skipping {tmp_path / 'checkpoint-4'} is not a complete checkpoint (train_state.json is empty)" in err
    six = tmp_path / "checkpoint-6"
    assert f"skipping {six} is not a complete checkpoint (train_state.json is not valid JSON" in err
    assert f"skipping {tmp_path / 'checkpoint-8'} is not a complete checkpoint (no train_state.json)" in err
    with pytest.raises(TrainingError, match=r"train_state.json is empty"):
        read_state(str(tmp_path / "checkpoint-4"))
    (tmp_path / "checkpoint-2" / "train_state.json").write_text("")
    with pytest.raises(TrainingError, match=r"no complete checkpoint in .*train_state.json is empty"):
        resolve_checkpoint("latest", str(tmp_path))


def test_metrics_are_never_lost(tmp_path, monkeypatch):
    path = str(tmp_path / "metrics.jsonl")
    lines = [json.dumps({"step": s, "loss": 1.0 / s}) for s in (1, 2, 3, 4)]
    (tmp_path / "metrics.jsonl").write_text("\n".join(lines) + '\n{"step": 5, "lo')  # a kill mid-append
    assert [r["step"] for r in _read_metrics(path)] == [1, 2, 3, 4]
    before = (tmp_path / "metrics.jsonl").read_text()

    def killed(*args):
        raise KeyboardInterrupt  # the process dies before the rename

    monkeypatch.setattr(os, "replace", killed)
    with pytest.raises(KeyboardInterrupt):
        keep_metrics_up_to(path, 2)
    assert (tmp_path / "metrics.jsonl").read_text() == before  # the log is untouched until the rename
    monkeypatch.undo()
    keep_metrics_up_to(path, 2)
    assert [r["step"] for r in _read_metrics(path)] == [1, 2]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["metrics.jsonl"]


def test_damaged_rng_state_is_refused_by_name(tmp_path, corpus, config_json, tokenizer_dir, capsys):
    out = tmp_path / "run"
    common = _common(corpus, config_json, tokenizer_dir, max_steps=4, save_steps=2)
    reference = train(_args(tmp_path / "reference", **common))
    train(_args(out, **common))
    (out / "train_summary.json").unlink()
    for name in ("checkpoint-4",):
        import shutil

        shutil.rmtree(out / name)
    rng = out / "checkpoint-2" / "random_states_0.pkl"
    rng.write_bytes(rng.read_bytes()[:100])  # truncated
    with pytest.raises(
        TrainingError,
        match=r"no complete checkpoint .*checkpoint-2 is damaged: .*random_states_0.pkl "
        r"is truncated \(100 bytes; \d+ were written\)",
    ):
        train(_args(out, resume_from_checkpoint="latest", **common))
    _as_before_manifests(out / "checkpoint-2")  # as an older mhmoe wrote it: the RNG check finds it
    named = str(out / "checkpoint-2")
    with pytest.raises(
        TrainingError,
        match=r"the RNG state .*checkpoint-2/random_states_0.pkl does not load .*"
        r"--resume_without_rng_state",
    ):
        train(_args(out, resume_from_checkpoint=named, **common))
    assert (out / "checkpoint-2").is_dir()  # nothing removed
    resumed = train(_args(out, resume_from_checkpoint=named, resume_without_rng_state=True, **common))
    assert "random_states_0.pkl does not load" in capsys.readouterr().err
    assert [r["step"] for r in _records(out)] == [1, 2, 3, 4]
    assert math.isfinite(resumed.history[-1]["loss"])
    # other random draws (router jitter) after the resume: the losses may differ from the uninterrupted run's
    assert [r["step"] for r in reference.history] == [1, 2, 3, 4]


def test_a_second_writer_is_refused(tmp_path, corpus, config_json, tokenizer_dir):
    out = tmp_path / "run"
    out.mkdir()
    lock = OutputDirLock(str(out)).acquire()  # another run holds the folder
    try:
        words = rf"another mhmoe-train is writing to {out} \(process {os.getpid()}\)"
        with pytest.raises(OutputDirLocked, match=words):
            train(_args(out, **_common(corpus, config_json, tokenizer_dir)))
        assert out.is_dir() and not (out / "metrics.jsonl").exists()
    finally:
        lock.release()
    train(_args(out, **_common(corpus, config_json, tokenizer_dir)))  # free again
    assert (out / "train_summary.json").is_file()


def test_a_second_writer_hears_of_the_lock_not_of_the_first_runs_checkpoints(
    tmp_path, corpus, config_json, tokenizer_dir
):
    out = tmp_path / "run"
    train(_args(out, save_steps=1, **_common(corpus, config_json, tokenizer_dir)))
    lock = OutputDirLock(str(out)).acquire()  # the first run still going
    try:
        with pytest.raises(OutputDirLocked, match="another mhmoe-train is writing to"):
            train(_args(out, **_common(corpus, config_json, tokenizer_dir)))
    finally:
        lock.release()


def test_new_folder_of_a_locked_out_run_is_not_deleted(tmp_path, corpus, config_json, tokenizer_dir, monkeypatch):
    """A run that found its output folder missing, then lost the lock to a run that created it meanwhile, must not
    delete that folder (as it deletes a folder it created itself when an input is wrong)."""
    import mhmoe.training.loop as loop

    out = tmp_path / "new"
    holder = {}
    real_check = loop.check_output_location

    def winner_starts_meanwhile(*args, **kwargs):
        real_check(*args, **kwargs)
        out.mkdir()
        holder["lock"] = OutputDirLock(str(out)).acquire()
        (out / "winner.txt").write_text("x")

    monkeypatch.setattr(loop, "check_output_location", winner_starts_meanwhile)
    try:
        with pytest.raises(OutputDirLocked):
            train(_args(out, **_common(corpus, config_json, tokenizer_dir)))
    finally:
        holder["lock"].release()
    assert (out / "winner.txt").is_file()


def test_longer_run_on_resume_warns_and_follows_the_new_schedule(tmp_path, corpus, config_json, tokenizer_dir, capsys):
    """Resume a finished 4-step cosine run with --max_steps 8: the next update uses the 8-step schedule's rate at step
    5 (not the old schedule's 0.0 followed by a jump), with a warning saying so."""
    common = _common(corpus, config_json, tokenizer_dir, save_steps=4, warmup_steps=1)
    long = train(_args(tmp_path / "long", max_steps=8, **common))
    out = tmp_path / "run"
    short = train(_args(out, max_steps=4, **common))
    assert short.history[-1]["lr"] > 0
    capsys.readouterr()
    train(_args(out, max_steps=8, resume_from_checkpoint="latest", **common))
    assert "was saved by a run of 4 steps, this run has 8" in capsys.readouterr().out
    lrs = {r["step"]: r["lr"] for r in _records(out)}
    expected = {r["step"]: r["lr"] for r in long.history if "lr" in r}
    assert lrs[5] > 0
    for step in (5, 6, 7, 8):
        assert lrs[step] == pytest.approx(expected[step], rel=1e-9)


def test_non_finite_losses_stop_training(tmp_path, corpus, checkpoint_dir, tokenizer_dir):
    from mhmoe import MHMoEForCausalLM

    broken = tmp_path / "broken"
    model = MHMoEForCausalLM.from_pretrained(checkpoint_dir)
    with torch.no_grad():
        model.model.embed_tokens.weight.fill_(float("nan"))
    model.save_pretrained(broken)
    common = dict(
        model_name_or_path=str(broken), tokenizer_name_or_path=tokenizer_dir, train_file=[corpus["tiny"]], max_steps=6
    )
    out = tmp_path / "run"
    with pytest.raises(TrainingStopped, match=r"the loss was nan at 3 steps in a row \(steps 1-3\)"):
        train(_args(out, **common))
    assert [r["step"] for r in _records(out)] == [1, 2, 3] and not (out / "model.safetensors").exists()
    result = train(_args(tmp_path / "anyway", max_nonfinite_steps=0, **common))
    assert len(result.history) == 6 and all(math.isnan(r["loss"]) for r in result.history)


def test_leftovers_of_interrupted_runs_are_removed(tmp_path, corpus, config_json, tokenizer_dir):
    out = tmp_path / "run"
    common = _common(corpus, config_json, tokenizer_dir, save_steps=1)
    train(_args(out, max_steps=2, **common))
    (out / ".checkpoint-3.tmp").mkdir()
    (out / ".checkpoint-3.tmp" / "model.safetensors").write_bytes(b"half")
    (out / ".checkpoint-1.tmp-delete").mkdir()
    (out / "metrics.jsonl.tmp-12345").write_text("{}")
    (out / "train_summary.json.tmp-999").write_text("{")
    train(_args(out, max_steps=3, resume_from_checkpoint="latest", **common))
    assert not [p.name for p in out.iterdir() if ".tmp" in p.name]
    assert sorted(p.name for p in out.glob("checkpoint-*")) == ["checkpoint-1", "checkpoint-2", "checkpoint-3"]


def test_an_input_problem_after_the_lock_leaves_no_folder(tmp_path, corpus, config_json, tokenizer_dir):
    """The lock file needs the folder; a problem found once it is taken still leaves nothing, parents included."""
    out = tmp_path / "a" / "b" / "out"
    with pytest.raises(TrainingError, match="no complete checkpoint"):
        train(_args(out, resume_from_checkpoint="latest", **_common(corpus, config_json, tokenizer_dir)))
    assert not (tmp_path / "a").exists()


def test_resuming_past_the_run_length_is_refused_in_words(tmp_path, corpus, config_json, tokenizer_dir):
    out = tmp_path / "run"
    common = _common(corpus, config_json, tokenizer_dir, save_steps=4)
    train(_args(out, max_steps=4, **common))
    with pytest.raises(
        TrainingError,
        match=r"checkpoint-4 is at step 4, past the 2 steps of this run: pass a "
        r"--max_steps of at least that step",
    ):
        train(_args(out, max_steps=2, resume_from_checkpoint="latest", **common))
    assert (out / "checkpoint-4" / "train_state.json").is_file()


def test_an_rng_state_holding_code_is_refused_without_torchs_advice(tmp_path):
    """A pickle that would call a function on loading (os.system) is refused in our words: never the advice to load it
    with weights_only=False, which would run it."""
    import os as os_module
    import pickle

    from mhmoe.training.checkpoints import check_rng_states

    (tmp_path / "random_states_0.pkl").write_bytes(pickle.dumps({"torch_manual_seed": 0, "run": os_module.system}))
    with pytest.raises(TrainingError) as info:
        check_rng_states(str(tmp_path), 1, allow_missing=False)
    message = str(info.value)
    assert "never unpickled" in message and "weights_only" not in message and "\n" not in message, message
