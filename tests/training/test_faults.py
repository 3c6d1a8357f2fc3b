"""Fault injection: `mhmoe-train` SIGKILLed at random moments (mid-step, mid-checkpoint, mid-validation, mid-final-save),
resumed each time with `--resume_from_checkpoint latest`, ends with exactly the weights and metrics records (each
once) of an uninterrupted run, and leaves no half-written folder or temporary file behind."""

import json
import random
import shutil
import signal
import subprocess
import sys
import time

import pytest
import torch

from tests.fixtures.warm import cli_env

STEPS = 12


def _command(config_json, tokenizer_dir, corpus, out, *extra):
    return [
        sys.executable,
        "-m",
        "mhmoe.training",
        "--model_name_or_path",
        config_json,
        "--tokenizer_name_or_path",
        tokenizer_dir,
        "--train_file",
        corpus["tiny"],
        "--output_dir",
        str(out),
        "--block_size",
        "16",
        "--per_device_train_batch_size",
        "2",
        "--learning_rate",
        "3e-3",
        "--warmup_steps",
        "1",
        "--max_steps",
        str(STEPS),
        "--save_steps",
        "1",
        "--save_total_limit",
        "2",
        "--config_overrides",
        "router_jitter_noise=0.2",
        "--seed",
        "0",
        "--disable_tqdm",
        "--no_plot",
        "--validation_file",
        corpus["val"],
        "--eval_steps",
        "4",
        *extra,
    ]


def _env():
    return cli_env(PYTHONUNBUFFERED="1")


def _losses(out):
    with open(out / "metrics.jsonl") as f:
        return [(r["step"], r["loss"], r["lr"]) for r in map(json.loads, f) if "loss" in r]


def _records(out):
    """Every record (training steps and validations) without its wall-clock field."""
    with open(out / "metrics.jsonl") as f:
        return [
            {k: v for k, v in json.loads(line).items() if k not in ("elapsed_s", "tokens_per_second", "mfu")}
            for line in f
        ]


def _start(warm, command, env):
    """Start a run (a warm child: tests/fixtures/warm.py) and return once it prints its summary line, right before the
    first step (setup takes seconds, the 12 tiny steps with their checkpoints well under one)."""
    proc = warm.popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    for line in proc.stdout:
        if line.startswith(b"mhmoe-train: "):
            break
    return proc, time.time()


def test_random_kills_resume_to_the_uninterrupted_result(tmp_path, corpus, config_json, tokenizer_dir, warm):
    from safetensors.torch import load_file

    env = _env()
    reference = tmp_path / "reference"
    proc, started = _start(warm, _command(config_json, tokenizer_dir, corpus, reference), env)
    while not (reference / "train_summary.json").exists() and proc.poll() is None:
        time.sleep(0.005)
    training_seconds = time.time() - started  # the steps, checkpoints and final save: the window the kills aim at
    assert proc.wait(timeout=120) == 0, proc.stderr.read()[-3000:]

    out, rng, kills, resumes, moments = tmp_path / "run", random.Random(0), 0, 0, []
    while kills < 3:
        done = max((int(p.name.split("-")[1]) for p in out.glob("checkpoint-*")), default=0)
        resume = done > 0
        proc, started = _start(
            warm,
            _command(
                config_json, tokenizer_dir, corpus, out, *(["--resume_from_checkpoint", "latest"] if resume else [])
            ),
            env,
        )
        resumes += resume
        time.sleep(rng.uniform(0, 0.9 * training_seconds * (STEPS - done + 1) / STEPS))  # within what is left
        if proc.poll() is not None:  # finished before the kill
            assert proc.returncode == 0, proc.stderr.read()[-3000:]
            if kills == 0 and len(moments) < 5:  # this run was faster than the reference's: start over
                shutil.rmtree(out)
                moments.append("finished before the first kill")
                continue
            break
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        if kills == 0 and (out / "train_summary.json").exists() and len(moments) < 5:  # killed while exiting
            shutil.rmtree(out)
            moments.append("finished before the first kill (killed while exiting)")
            continue
        kills += 1
        moments.append(sorted(p.name for p in out.iterdir()))
        if (out / "train_summary.json").exists():
            break
    if not (out / "train_summary.json").exists():
        final = warm.run(
            _command(config_json, tokenizer_dir, corpus, out, "--resume_from_checkpoint", "latest"),
            env=env,
            timeout=120,
        )
        assert final.returncode == 0, final.stderr[-3000:]
        resumes += 1
    assert kills >= 1 and resumes >= 1, moments

    assert _records(out) == _records(reference)  # every step and validation once, same values, exactly
    assert [s for s, _, _ in _losses(out)] == list(range(1, STEPS + 1))
    expected, got = load_file(reference / "model.safetensors"), load_file(out / "model.safetensors")
    assert expected.keys() == got.keys()
    for key in expected:
        assert torch.equal(expected[key], got[key]), key
    leftovers = [p.name for p in out.iterdir() if ".tmp" in p.name]
    assert not leftovers, leftovers
    assert sorted(p.name for p in out.glob("checkpoint-*")) == [f"checkpoint-{STEPS - 1}", f"checkpoint-{STEPS}"]


@pytest.mark.parametrize("moment", ["state file", "final save"])
def test_kill_at_exact_moments(tmp_path, corpus, config_json, tokenizer_dir, moment, capsys):
    """The two moments the field report named, made exact (in process): a checkpoint whose state file is empty (a kill
    during its write by an older version) is skipped by name; a run killed after its last checkpoint, before the final
    save, finishes that save on resume."""
    from tests.training.test_loop import _args, _records, train

    common = dict(
        model_name_or_path=config_json,
        tokenizer_name_or_path=tokenizer_dir,
        train_file=[corpus["tiny"]],
        max_steps=4,
        save_steps=2,
        config_overrides="router_jitter_noise=0.2",
    )
    out = tmp_path / "run"
    train(_args(out, **common))
    weights = (out / "model.safetensors").read_bytes()
    if moment == "state file":
        (out / "checkpoint-4" / "train_state.json").write_text("")
    (out / "model.safetensors").unlink()
    (out / "train_summary.json").unlink()
    capsys.readouterr()
    train(_args(out, resume_from_checkpoint="latest", **common))
    if moment == "state file":
        assert (
            f"skipping {out / 'checkpoint-4'} is not a complete checkpoint (train_state.json is empty)"
            in capsys.readouterr().err
        )
    assert (out / "model.safetensors").read_bytes() == weights
    assert [r["step"] for r in _records(out)] == [1, 2, 3, 4]
