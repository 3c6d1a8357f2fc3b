"""mhmoe-train's bad command lines and bad model inputs: each one line `mhmoe-train: error: ...` with status 2 (no
traceback), usage errors before torch or Transformers is imported, and the parser loaded without Transformers equal
to HfArgumentParser imported from it."""

import json
import os
import subprocess
import sys

import pytest

import mhmoe
from mhmoe.training import TrainArguments
from mhmoe.training.cli import build_parser, main
from tests.fixtures.training import CONFIG, MOH_CONFIG, fresh_accelerate_state


def _env():
    src = os.path.dirname(os.path.dirname(os.path.abspath(mhmoe.__file__)))
    return dict(os.environ, HF_HUB_OFFLINE="1", PYTHONPATH=os.pathsep.join([src, os.environ.get("PYTHONPATH", "")]))


def _one_line_error(capsys, argv, status=2):
    fresh_accelerate_state()
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    err = capsys.readouterr().err
    assert exit_info.value.code == status, err
    lines = [line for line in err.splitlines() if line.strip() and "warning" not in line]
    assert len(lines) == 1 and lines[0].startswith("mhmoe-train: error: "), err
    assert "Traceback" not in err
    return lines[0]


@pytest.mark.parametrize(
    "argv, words",
    [
        ([], "--model_name_or_path, --output_dir, --train_file (or --dataset) are required"),
        (["--model_name_or_path", "m", "--train_file", "t"], "--output_dir is required"),
        (["--bogus", "1"], "unrecognized arguments: --bogus 1"),
        (["--max_steps", "ten"], "argument --max_steps/--max-steps: invalid int value: 'ten'"),
    ],
)
def test_usage_errors_are_one_line_before_heavy_imports(argv, words):
    """In a fresh interpreter: the message, status 2, and neither torch nor transformers imported by then."""
    code = (
        "import sys\nfrom mhmoe._plumbing.cli import run\ntry:\n    run('mhmoe-train', sys.argv[1:])\n"
        "finally:\n    print('heavy:', 'torch' in sys.modules, 'transformers' in sys.modules)\n"
    )
    proc = subprocess.run([sys.executable, "-c", code, *argv], env=_env(), capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2
    assert proc.stderr.strip() == f"mhmoe-train: error: {words} (see mhmoe-train --help)", proc.stderr
    assert "heavy: False False" in proc.stdout


def _bad_inputs(tmp_path, corpus, checkpoint_dir):
    def config(name, fields):
        path = tmp_path / name
        path.write_text(json.dumps(fields))
        return str(path)

    truncated, empty = tmp_path / "truncated", tmp_path / "empty"
    for folder in (truncated, empty):
        folder.mkdir()
        for name in os.listdir(checkpoint_dir):
            if name != "model.safetensors":
                (folder / name).write_bytes((open(os.path.join(checkpoint_dir, name), "rb")).read())
    weights = open(os.path.join(checkpoint_dir, "model.safetensors"), "rb").read()
    (truncated / "model.safetensors").write_bytes(weights[: len(weights) // 2])
    (empty / "model.safetensors").write_bytes(b"")
    return {
        "string for a number in the config": (
            config("s.json", {**CONFIG, "hidden_size": "32"}),
            [],
            r"invalid config .*hidden_size",
        ),
        "string for a number in --config_overrides": (
            config("ok.json", CONFIG),
            ["--config_overrides", "num_experts=four"],
            r"invalid config .*num_experts",
        ),
        "moh_active_heads too large": (
            config("moh.json", {**MOH_CONFIG, "moh_shared_heads": 2, "moh_active_heads": 3}),
            [],
            r"moh_shared_heads \+ moh_active_heads \(2 \+ 3\) must be <= "
            r"num_attention_heads \(4\)",
        ),
        "typo in a config key": (
            config("typo.json", {**CONFIG, "num_expert": 8}),
            [],
            r"'num_expert' \(did you mean 'num_experts'\?\) is not a mhmoe config field",
        ),
        "heads do not divide hidden size": (
            config("heads.json", {**CONFIG, "num_attention_heads": 5, "num_key_value_heads": 5}),
            [],
            r"hidden_size \(32\) is not a multiple of num_attention_heads \(5\)",
        ),
        "negative rope_theta": (
            config("theta.json", {**CONFIG, "rope_theta": -1.0}),
            [],
            r"rope_theta \(rope_parameters' base wavelength\) must be a finite number > 0, got -1.0",
        ),
        "unknown rope type": (
            config("rope.json", {**CONFIG, "rope_scaling": {"rope_type": "bogus", "factor": 2.0}}),
            [],
            r"rope_type must be one of \('default', .*\), got 'bogus'",
        ),
        "rope type without its keys": (
            config("linear.json", {**CONFIG, "rope_scaling": {"rope_type": "linear"}}),
            [],
            r"Missing required keys in `rope_parameters` for 'rope_type'='linear': \{'factor'\}",
        ),
        "bos_token_id outside the vocabulary": (
            config("bos.json", {**CONFIG, "bos_token_id": 5000}),
            [],
            r"bos_token_id \(5000\) must lie in the vocabulary: 0 to 319 \(vocab_size 320\)",
        ),
        "eos_token_id outside the vocabulary": (
            config("eos.json", {**CONFIG, "eos_token_id": [2, -4]}),
            [],
            r"eos_token_id \(\[2, -4\]\) must lie in the vocabulary",
        ),
        "more heads than channels": (
            config("many_heads.json", {**CONFIG, "num_attention_heads": 2**40, "num_key_value_heads": 2**40}),
            [],
            r"num_attention_heads \(1099511627776\) must be <= hidden_size \(32\)",
        ),
        "truncated weights": (str(truncated), [], r"truncated.*model.safetensors is not a complete safetensors file"),
        "empty weights": (str(empty), [], r"empty.*model.safetensors is not a complete safetensors file"),
        "nan learning rate": (
            str(checkpoint_dir),
            ["--learning_rate", "nan"],
            r"--learning_rate nan: must be a finite number",
        ),
    }


CASES = [
    "string for a number in the config",
    "string for a number in --config_overrides",
    "moh_active_heads too large",
    "typo in a config key",
    "heads do not divide hidden size",
    "negative rope_theta",
    "unknown rope type",
    "rope type without its keys",
    "bos_token_id outside the vocabulary",
    "eos_token_id outside the vocabulary",
    "more heads than channels",
    "truncated weights",
    "empty weights",
    "nan learning rate",
]


@pytest.mark.parametrize("case", CASES)
def test_bad_model_inputs_are_one_line(tmp_path, corpus, checkpoint_dir, tokenizer_dir, moh_llama_type, case, capsys):
    import re

    if case == "moh_active_heads too large" and moh_llama_type != "real":
        pytest.skip("needs the real moh_llama")
    model, extra, words = _bad_inputs(tmp_path, corpus, checkpoint_dir)[case]
    out = tmp_path / "out"
    line = _one_line_error(
        capsys,
        [
            "--model_name_or_path",
            model,
            "--tokenizer_name_or_path",
            tokenizer_dir,
            "--train_file",
            corpus["tiny"],
            "--output_dir",
            str(out),
            "--max_steps",
            "1",
            "--block_size",
            "16",
            "--disable_tqdm",
            "--no_plot",
            *extra,
        ],
    )
    assert re.search(words, line), line
    assert not out.exists()


@pytest.mark.parametrize(
    "argv",
    [
        ["--output_dir", "o", "--train_file", "a", "b", "--max_steps", "3", "--learning_rate", "1e-4"],
        [
            "--output-dir",
            "o",
            "--plot",
            "false",
            "--no_aux_loss",
            "--lora",
            "--lora_target_modules",
            "q_proj",
            "v_proj",
        ],
        ["--mixed_precision", "bf16", "--gradient_checkpointing", "true", "--save_total_limit", "2", "--no-plot"],
        ["--resume_from_checkpoint", "latest", "--tokenizer_vocab_size", "300", "--num_train_epochs", "0.5"],
    ],
)
def test_light_parser_matches_hf_argument_parser(argv):
    from transformers import HfArgumentParser

    (expected,) = HfArgumentParser(TrainArguments).parse_args_into_dataclasses(args=argv)
    got = build_parser().parse_args(argv)
    assert TrainArguments(**vars(got)) == expected


def test_help_lists_every_field(capsys):
    import dataclasses

    with pytest.raises(SystemExit) as exit_info:
        main(["--help"])
    assert exit_info.value.code == 0
    out = capsys.readouterr().out
    for field in dataclasses.fields(TrainArguments):
        assert f"--{field.name}" in out


def test_second_writer_on_the_command_line(tmp_path, corpus, checkpoint_dir, capsys):
    from mhmoe.training.lock import OutputDirLock

    out = tmp_path / "out"
    out.mkdir()
    lock = OutputDirLock(str(out)).acquire()
    try:
        line = _one_line_error(
            capsys,
            [
                "--model_name_or_path",
                checkpoint_dir,
                "--train_file",
                corpus["tiny"],
                "--output_dir",
                str(out),
                "--max_steps",
                "1",
            ],
        )
    finally:
        lock.release()
    assert (
        line == f"mhmoe-train: error: another mhmoe-train is writing to {out} (process {os.getpid()}): wait for "
        "it to finish, or choose another --output_dir"
    )


@pytest.mark.parametrize(
    "extra, words",
    [
        (["--seed", "-1"], "--seed -1: must be in [0, 2**32 - 1] (numpy's seed range)"),
        (["--seed", str(2**70)], f"--seed {2**70}: must be in [0, 2**32 - 1]"),
        (["--adam_beta1", "1.5"], "--adam_beta1 1.5: must be in [0, 1)"),
        (["--adam_beta2", "-0.1"], "--adam_beta2 -0.1: must be in [0, 1)"),
        (["--weight_decay", "-0.1"], "--weight_decay -0.1: must be >= 0"),
        (["--adam_epsilon=-1e-8"], "--adam_epsilon -1e-08: must be >= 0"),
        (["--merge_lora"], "--merge_lora merges the LoRA adapters into the model: give --lora too"),
        (
            ["--warmup_steps", "100", "--max_steps", "2"],
            "--warmup_steps 100 is more than the run's --max_steps 2: the "
            "learning rate would never reach --learning_rate; give at most 2",
        ),
        (
            ["--warmup_steps", "100", "--max_steps", "-1", "--num_train_epochs", "1"],
            "--warmup_steps 100 is more than the run's 12 steps (--num_train_epochs 1)",
        ),
    ],
)
def test_bad_training_values_are_one_line(tmp_path, corpus, checkpoint_dir, capsys, extra, words):
    """Values torch, numpy or the schedule would take with a traceback (or silently): one line naming the value and
    what is allowed, status 2, nothing written."""
    out = tmp_path / "out"
    line = _one_line_error(
        capsys,
        [
            "--model_name_or_path",
            checkpoint_dir,
            "--train_file",
            corpus["tiny"],
            "--output_dir",
            str(out),
            "--max_steps",
            "1",
            "--block_size",
            "16",
            "--per_device_train_batch_size",
            "2",
            "--disable_tqdm",
            "--no_plot",
            *extra,
        ],
    )
    assert line == f"mhmoe-train: error: {words}" or line.startswith(f"mhmoe-train: error: {words}"), line
    assert not out.exists()


def test_a_config_too_large_for_the_machine_is_one_line(tmp_path, corpus, tokenizer_dir, capsys):
    """vocab_size 10**12: refused before any weight is allocated (the size is counted on the meta device)."""
    config = tmp_path / "huge.json"
    config.write_text(json.dumps({**CONFIG, "vocab_size": 10**12}))
    line = _one_line_error(
        capsys,
        [
            "--model_name_or_path",
            str(config),
            "--tokenizer_name_or_path",
            tokenizer_dir,
            "--train_file",
            corpus["tiny"],
            "--output_dir",
            str(tmp_path / "out"),
            "--max_steps",
            "1",
            "--block_size",
            "16",
            "--disable_tqdm",
            "--no_plot",
        ],
    )
    assert (
        line.startswith("mhmoe-train: error: the config makes a model of 64,000,000,016,096 parameters")
        and "more than this machine's" in line
        and "vocab_size=1000000000000" in line
    ), line


@pytest.mark.parametrize(
    "values, words",
    [
        ({"max_steps": "2"}, "training argument max_steps='2': must be an integer, not str"),
        ({"learning_rate": "3e-4"}, "training argument learning_rate='3e-4': must be a number, not str"),
        ({"lora": "yes"}, "training argument lora='yes': must be true or false, not str"),
        ({"train_file": [1]}, "training argument train_file=[1]: must be a list of strings, not list"),
    ],
)
def test_python_api_refuses_wrong_types_in_one_line(tmp_path, corpus, checkpoint_dir, values, words):
    from mhmoe.training import train

    args = {
        "model_name_or_path": checkpoint_dir,
        "train_file": [corpus["tiny"]],
        "output_dir": str(tmp_path / "o"),
        **values,
    }
    with pytest.raises(TypeError) as error:
        train(args)
    assert str(error.value) == words
