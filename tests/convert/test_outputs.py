"""What the converter reads from its input folder and what it leaves behind: only the files a checkpoint needs (never
code, never a link out of the folder), a self-contained output (modeling code, auto_map, converted card), one-line
errors (unknown flags, NaN weights, read-only and full disks), and SIGKILL at random moments: the rerun ends with
the uninterrupted result and nothing else beside it."""

import json
import os
import random
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from mhmoe.convert import ConversionError, convert, main
from tests.convert.test_convert import TINY, _leftovers, _llama_dir
from tests.fixtures.warm import cli_env

FAST_CLI = """
import sys, time
start = time.perf_counter()
from {module} import main
try:
    main({argv!r})
except SystemExit as e:
    code = e.code
print(code, time.perf_counter() - start, sorted(m for m in ("torch", "transformers") if m in sys.modules))
"""


_env = cli_env


# ------------------------------------------------------------------------------------------------ one-line errors


@pytest.mark.parametrize(
    "module, argv, message",
    [
        (
            "mhmoe.convert.cli",
            ["--input_dir", "a", "--output_dir", "b", "--bogus", "1"],
            "mhmoe-convert: error: unrecognized arguments: --bogus 1 (see mhmoe-convert --help)",
        ),
        ("mhmoe.convert.cli", [], "mhmoe-convert: error: --input_dir and --output_dir are required"),
        (
            "mhmoe.convert.cli",
            ["--max_steps", "x"],
            "mhmoe-convert: error: argument --max_steps/--max-steps: invalid int",
        ),
        ("mhmoe.hub.cli", ["only_one"], "mhmoe-export: error: the following arguments are required: out_dir"),
        ("mhmoe.evaluation.cli", ["--bogus"], "mhmoe-eval: error: unrecognized arguments: --bogus"),
    ],
)
def test_usage_errors_are_one_line_before_heavy_imports(module, argv, message):
    """A usage error ends with status 2 and one line, before torch or Transformers is imported (they take seconds:
    the whole command measured here is well under a second on an idle machine)."""
    proc = subprocess.run(
        [sys.executable, "-c", FAST_CLI.format(module=module, argv=argv)],
        env=_env(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    code, seconds, heavy = proc.stdout.split(" ", 2)
    assert code == "2" and heavy.strip() == "[]", (proc.stdout, proc.stderr[-2000:])
    assert message in proc.stderr and "Traceback" not in proc.stderr, proc.stderr
    if module == "mhmoe.convert.cli":  # the usage block of 60 flags is not printed
        assert proc.stderr.strip().count("\n") == 0, proc.stderr
    print(f"{module} {argv}: {float(seconds):.2f} s")


def test_fast_parser_is_transformers_own():
    """The parser built without importing Transformers parses like transformers.HfArgumentParser."""
    from transformers import HfArgumentParser

    from mhmoe.convert.arguments import ConvertArguments, _continue_tune_arguments_class
    from mhmoe.convert.cli import build_parser

    argv = [
        "--input_dir",
        "in",
        "--output_dir",
        "out",
        "--overwrite",
        "--no_aux_loss",
        "--train_file",
        "a",
        "b",
        "--max_steps",
        "7",
        "--learning_rate",
        "1e-4",
        "--mixed_precision",
        "bf16",
        "--lora",
        "true",
    ]
    fast = build_parser()
    assert type(fast).__module__ == "mhmoe._plumbing._hf_argparser"  # loaded from transformers' file directly
    reference = HfArgumentParser((ConvertArguments, _continue_tune_arguments_class()))
    assert fast.parse_args_into_dataclasses(argv) == reference.parse_args_into_dataclasses(argv)


def test_nan_source_weights_are_named(tmp_path, capsys):
    """A source with NaN weights: refused naming the tensor (not "logits differ by nan"), nothing written."""
    source = _llama_dir(tmp_path / "llama")
    weights = load_file(source / "model.safetensors")
    weights["model.layers.1.mlp.up_proj.weight"][3, 5] = float("nan")
    save_file(weights, source / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ConversionError, match=r"NaN or inf values in 1 tensor\(s\) \(model.layers.1.mlp.up_proj"):
        convert(str(source), str(tmp_path / "out"), progress=False)
    with pytest.raises(SystemExit):
        main(["--input_dir", str(source), "--output_dir", str(tmp_path / "out"), "--disable_tqdm"])
    err = capsys.readouterr().err
    assert "has NaN or inf values" in err and "differ by nan" not in err
    assert not (tmp_path / "out").exists() and _leftovers(tmp_path, "out") == []


# ------------------------------------------------------------------------------------- what is read and written


def _plant(source: Path, outside: Path) -> None:
    """Code, an auto_map naming it, a link inside the folder, extra files and chat templates (a link out of the folder
    is refused whole: tests/_plumbing/test_trust.py)."""
    marker = outside / "PLANTED_CODE_RAN"
    (source / "evil_tokenizer.py").write_text(
        f"open({str(marker)!r}, 'w').close()\nfrom transformers import PreTrainedTokenizerFast\n"
        "class EvilTokenizer(PreTrainedTokenizerFast):\n    pass\n"
    )
    config = json.loads((source / "tokenizer_config.json").read_text())
    config["auto_map"] = {"AutoTokenizer": [None, "evil_tokenizer.EvilTokenizer"]}
    (source / "tokenizer_config.json").write_text(json.dumps(config))
    (source / "extra").mkdir()
    (source / "extra" / "merges_real.txt").write_text("#version: 0.2\n")
    os.symlink("extra/merges_real.txt", source / "merges.txt")  # a link that stays inside: copied as a file
    (source / "chat_template.jinja").write_text("{% for m in messages %}{{ m['content'] }}{% endfor %}")
    (source / "additional_chat_templates").mkdir()
    (source / "additional_chat_templates" / "tools.jinja").write_text("{{ tools }}")
    (source / "notes.txt").write_text("not a checkpoint file")
    (source / "run.sh").write_text("rm -rf /\n")


def test_only_checkpoint_files_are_copied(tmp_path, tokenizer_dir, capsys):
    """Weights, config, generation config, tokenizer and chat templates; never code (nor an auto_map naming it), nothing
    else; the notes say what was left."""
    from transformers import AutoTokenizer

    from mhmoe import MoHLlamaConfig
    from mhmoe.hub.remote_code import auto_classes, modeling_sources

    source = _llama_dir(tmp_path / "llama", tokenizer_dir)
    _plant(source, tmp_path)
    out = tmp_path / "moh"
    main(["--input_dir", str(source), "--output_dir", str(out), "--skip_logit_check", "--disable_tqdm"])
    printed = capsys.readouterr().out

    ours = set(modeling_sources(auto_classes(MoHLlamaConfig()).values()))
    files = {str(p.relative_to(out)) for p in out.rglob("*") if p.is_file()}
    assert {f for f in files if f.endswith(".py")} == ours  # the exported modeling code only
    assert files - ours == {
        "README.md",
        "config.json",
        "generation_config.json",
        "model.safetensors",
        "moh_conversion.json",
        "tokenizer.json",
        "tokenizer_config.json",
        "chat_template.jinja",
        "merges.txt",
        "additional_chat_templates/tools.jinja",
    }
    assert not any(p.is_symlink() for p in out.rglob("*"))
    assert (out / "merges.txt").read_text() == "#version: 0.2\n"
    assert "auto_map" not in json.loads((out / "tokenizer_config.json").read_text())
    assert "evil_tokenizer.py" in printed and "run.sh" in printed and "dropped auto_map" in printed

    AutoTokenizer.from_pretrained(out, trust_remote_code=True)  # the output's own code only
    assert not (tmp_path / "PLANTED_CODE_RAN").exists()


def test_planted_code_never_runs_even_when_answering_yes(tmp_path, tokenizer_dir, warm):
    """mhmoe-convert and mhmoe-export read user folders with trust_remote_code=False: with `y` on stdin (Transformers'
    prompt answered yes) the planted tokenizer code is still not run."""
    source = _llama_dir(tmp_path / "llama", tokenizer_dir)
    _plant(source, tmp_path)
    converted = tmp_path / "moh"
    for cmd in (
        ["-m", "mhmoe.convert", "--input_dir", source, "--output_dir", converted, "--disable_tqdm"],
        ["-m", "mhmoe.hub", converted, tmp_path / "exported"],
    ):
        if cmd[1] == "mhmoe.hub":  # a converted model whose folder was tampered with afterwards
            shutil.copy(source / "evil_tokenizer.py", converted)
            shutil.copy(source / "tokenizer_config.json", converted)
        proc = warm.run([sys.executable, *map(str, cmd)], input="y\ny\n", env=_env(), timeout=300)
        assert proc.returncode == 0, proc.stderr[-3000:]
        assert not (tmp_path / "PLANTED_CODE_RAN").exists(), cmd
    exported = tmp_path / "exported"
    assert not (exported / "evil_tokenizer.py").exists()
    assert "auto_map" not in json.loads((exported / "tokenizer_config.json").read_text())


def test_conversion_record_names_a_hub_snapshot_by_its_repo_id(tmp_path, tokenizer_dir):
    """A source in the Hugging Face cache (`models--org--name/snapshots/REV`): moh_conversion.json and the card name it
    `org/name`, in the converted folder and in its export, and no local path is in either."""
    from mhmoe.hub.export import export_pretrained

    source = _llama_dir(tmp_path / "hub" / "models--org--Tiny-Llama" / "snapshots" / "0123abcd", tokenizer_dir)
    out = tmp_path / "moh"
    convert(str(source), str(out), verify_logits=False, progress=False)
    export_pretrained(str(out), str(tmp_path / "exported"))
    for folder in (out, tmp_path / "exported"):
        record = (folder / "moh_conversion.json").read_text()
        assert json.loads(record)["input_dir"] == "org/Tiny-Llama" and str(tmp_path) not in record
        card = (folder / "README.md").read_text()
        assert "base_model: org/Tiny-Llama" in card and str(tmp_path) not in card


def test_output_is_self_contained_with_the_converted_card(tmp_path, tokenizer_dir, warm_blocked):
    """Like save_pretrained's folders: modeling code + auto_map (it loads with trust_remote_code=True where mhmoe
    cannot be imported, computing what mhmoe's own class computes), and the converted card naming the base model (the
    Hub id, never a local folder's name or path: this one has none); mhmoe-export of it keeps the card kind and the
    conversion record."""
    from mhmoe import MoHLlamaForCausalLM
    from mhmoe.hub.export import export_pretrained
    from mhmoe.hub.remote_code import check_exported_code
    from tests.fixtures.remote_code import load_without_mhmoe

    source = _llama_dir(tmp_path / "Tiny-Llama-3", tokenizer_dir)
    out = tmp_path / "moh"
    convert(str(source), str(out), verify_logits=False, progress=False)
    config = json.loads((out / "config.json").read_text())
    assert set(config["auto_map"]) == {"AutoConfig", "AutoModel", "AutoModelForCausalLM"}
    assert check_exported_code(out)
    card = (out / "README.md").read_text()
    assert "base_model" not in card.split("---")[1] and "Converted from a local dense checkpoint" in card
    assert "Tiny-Llama-3" not in card and str(tmp_path) not in card and "{{" not in card  # no Hub id: unnamed
    assert 'AutoTokenizer.from_pretrained("moh", trust_remote_code=True)' in card

    exported = tmp_path / "exported"
    export_pretrained(str(out), str(exported))
    card = (exported / "README.md").read_text()
    assert "Converted from a local dense checkpoint" in card and "Tiny-Llama-3" not in card
    assert (exported / "moh_conversion.json").read_bytes() == (out / "moh_conversion.json").read_bytes()
    record = json.loads((out / "moh_conversion.json").read_text())  # published with the model: names, not paths
    assert (record["input_dir"], record["base_model"], record["output_dir"]) == (None, None, "moh")
    assert str(tmp_path) not in (out / "moh_conversion.json").read_text()

    ids = torch.randint(0, TINY["vocab_size"], (2, 12), generator=torch.Generator().manual_seed(0))
    remote = load_without_mhmoe(warm_blocked, {"converted": out}, ids, ids[:1, :4], tmp_path)
    with torch.no_grad():
        local = MoHLlamaForCausalLM.from_pretrained(out).eval()(ids).logits
    torch.testing.assert_close(remote["converted.logits"], local)


# ----------------------------------------------------------------------------------------------- disk problems


def _in_private_mount(script: str, tmp_path: Path, size: str, read_only: bool) -> subprocess.CompletedProcess:
    """Run `script` (shell, $MNT a fresh tmpfs of `size`) in a user + mount namespace: a real small or read-only file
    system without root. Skips where unprivileged namespaces are not available. In the script, `warm.shell` in place
    of `python` runs the command in a warm child that joins the namespace (tests/fixtures/warm.py)."""
    mnt = tmp_path / "mnt"
    mnt.mkdir(parents=True)
    probe = ["unshare", "-rm", "sh", "-c", f'mount -t tmpfs -o size=64k tmpfs "{mnt}" && mount -o remount,ro "{mnt}"']
    if shutil.which("unshare") is None or subprocess.run(probe, capture_output=True).returncode != 0:
        pytest.skip("no user/mount namespaces with tmpfs here (unshare -rm)")
    remount = f'mount -o remount,ro "{mnt}"; ' if read_only else ""
    shell = f'set -e; mount -t tmpfs -o size={size} tmpfs "{mnt}"; {remount}export MNT="{mnt}"; set +e; {script}'
    return subprocess.run(
        ["unshare", "-rm", "sh", "-c", shell], env=_env(), capture_output=True, text=True, timeout=300
    )


def test_read_only_target_is_not_a_full_disk(tmp_path, warm):
    source = _llama_dir(tmp_path / "llama")
    for name, command in (
        (
            "convert",
            f'{warm.shell} -m mhmoe.convert --input_dir "{source}" --output_dir '
            '"$MNT/out" --skip_logit_check --disable_tqdm',
        ),
        ("export", f'{warm.shell} -m mhmoe.hub "{source}" "$MNT/out"'),
    ):
        proc = _in_private_mount(command, tmp_path / name, "1m", read_only=True)
        assert proc.returncode == 1, proc.stderr[-2000:]  # a problem of the machine, not of the arguments
        (line,) = proc.stderr.strip().splitlines()
        assert "read-only file system" in line and "/out" in line and "disk space" not in line, line


def test_disk_full_while_writing_is_one_line(tmp_path, warm):
    """A real file system too small for the modeling code written after the weights: ENOSPC in the middle of the
    write, reported in one line with the target, nothing left on the disk."""
    source = _llama_dir(tmp_path / "llama")
    weights = (source / "model.safetensors").stat().st_size
    size = (weights // 4096 + 3) * 4096  # the weights and config fit, the modeling code (~100 KB) does not
    script = (
        f'{warm.shell} -m mhmoe.convert --input_dir "{source}" --output_dir "$MNT/out" --skip_logit_check '
        '--disable_tqdm; echo "status $?"; ls -A "$MNT"'
    )
    proc = _in_private_mount(script, tmp_path / "convert", str(size), read_only=False)
    (line,) = proc.stderr.strip().splitlines()
    assert line.startswith("mhmoe-convert: error: not enough disk space to write") and "/out" in line, line
    assert proc.stdout.strip().splitlines()[-1] == "status 1", proc.stdout  # and `ls -A` printed nothing after

    convert(str(source), str(tmp_path / "moh"), verify_logits=False, progress=False)  # mhmoe-export, the same
    script = f'{warm.shell} -m mhmoe.hub "{tmp_path / "moh"}" "$MNT/out"; echo "status $?"; ls -A "$MNT"'
    proc = _in_private_mount(script, tmp_path / "export", str(size), read_only=False)
    (line,) = proc.stderr.strip().splitlines()
    assert line.startswith("mhmoe-export: error: not enough disk space to write") and "/out" in line, line
    assert proc.stdout.strip().splitlines()[-1] == "status 1", proc.stdout


# ------------------------------------------------------------------------------------------------ fault injection


def _snapshot(folder: Path) -> dict:
    """Every file's bytes; the conversion record without its timings (the whole run's, the calibration's and the
    held-out perplexity's)."""
    files = {}
    for p in sorted(folder.rglob("*")):
        if p.is_file():
            data = p.read_bytes()
            if p.name == "moh_conversion.json":
                record = json.loads(data)
                record.pop("seconds")
                record.get("calibration", {}).pop("seconds", None)
                record.get("heldout", {}).pop("seconds", None)
                data = json.dumps(record, sort_keys=True).encode()
            files[str(p.relative_to(folder))] = data
    return files


def test_random_kills_then_rerun_gives_the_uninterrupted_result(tmp_path, tokenizer_dir, warm):
    """SIGKILL a conversion (12 shards, tokenizer, logit check) at stratified random moments, first into a new folder,
    then with --overwrite over a finished one: the target is never half-written, nor missing once it existed, and
    a rerun ends with the bytes of an uninterrupted run and nothing else in the parent folder. Each conversion is a
    warm child (tests/fixtures/warm.py), so the moments fall in the conversion, not in the imports."""
    source = _llama_dir(tmp_path / "llama", tokenizer_dir, shard_size="8KB")
    parent = tmp_path / "outputs"
    parent.mkdir()
    out = parent / "moh"
    argv = ["--input_dir", str(source), "--output_dir", str(out), "--disable_tqdm", "--overwrite"]

    def run(kill_after=None):
        """(exit code, seconds, seconds until the temporary folder appeared)"""
        child = warm.popen(
            [sys.executable, "-m", "mhmoe.convert", *argv],
            env=cli_env(),
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        begin, appeared = time.perf_counter(), None
        while child.poll() is None and (kill_after is None or time.perf_counter() - begin < kill_after):
            if appeared is None and any(p.name.startswith(".moh.tmp-") for p in parent.iterdir()):
                appeared = time.perf_counter() - begin
            time.sleep(0.002)
        if child.poll() is None:
            child.kill()
        return child.wait(60), time.perf_counter() - begin, appeared

    code, seconds, appeared = run()
    assert code == 0 and appeared is not None
    reference = _snapshot(out)
    assert len([f for f in reference if f.endswith(".safetensors")]) > 5 and "README.md" in reference
    print(f"uninterrupted: {seconds:.2f} s, temporary folder from {appeared:.2f} s")
    shutil.rmtree(out)

    rng = random.Random(0)
    stray_seen = 0
    for phase in ("new", "overwrite"):
        kills = 6
        for i in range(kills):  # one kill in each sixth of the run's duration
            code, _, _ = run(kill_after=seconds * (i + rng.random()) / kills)
            if phase == "overwrite":
                assert out.is_dir(), f"{phase} kill {i}: the target went missing"
            if out.exists():  # once there, always complete: the old or the new conversion, never a mix
                assert _snapshot(out) == reference, f"{phase} kill {i}: half-written output"
            stray_seen += any(p.name.startswith(".moh.") for p in parent.iterdir())
            print(
                f"{phase} kill {i}: exit {code}, output {'complete' if out.exists() else 'absent'}, "
                f"{sorted(p.name for p in parent.iterdir())}"
            )
        assert run()[0] == 0  # the rerun
        assert _snapshot(out) == reference
        assert sorted(p.name for p in parent.iterdir()) == ["moh"]
    assert stray_seen, "no kill landed inside the write: the test did not exercise the cleanup"


def test_export_of_a_continue_tuned_model_names_base_and_training(tmp_path, tokenizer_dir, corpus):
    """OUT of `mhmoe-convert --train_file`: the exported card is the converted one (base model from
    OUT/converted/moh_conversion.json, kept in the export) with the Training section from train_summary.json."""
    from mhmoe.hub.export import export_pretrained

    source = _llama_dir(tmp_path / "Tiny-Llama", tokenizer_dir)
    out = tmp_path / "tuned"
    main(
        [
            "--input_dir",
            str(source),
            "--output_dir",
            str(out),
            "--train_file",
            corpus["train"],
            "--block_size",
            "16",
            "--per_device_train_batch_size",
            "2",
            "--max_steps",
            "1",
            "--disable_tqdm",
        ]
    )
    export_pretrained(str(out), str(tmp_path / "exported"))
    card = (tmp_path / "exported" / "README.md").read_text()
    assert "Converted from a local dense checkpoint" in card and "Trained with `mhmoe-train` for 1 step (" in card
    record = (out / "converted" / "moh_conversion.json").read_bytes()
    assert (tmp_path / "exported" / "moh_conversion.json").read_bytes() == record


# --------------------------------------------------------------------------------------------- values, head counts


def _huge_heads(source: Path) -> None:
    config = json.loads((source / "config.json").read_text())
    (source / "config.json").write_text(
        json.dumps({**config, "num_attention_heads": 2**40, "num_key_value_heads": 2**40})
    )


def _negative_rope_theta(source: Path) -> None:
    """Llama's config takes it (and the model trains to NaN); the moh_llama config it would become refuses it."""
    config = json.loads((source / "config.json").read_text())
    (source / "config.json").write_text(
        json.dumps({**config, "rope_parameters": {"rope_type": "default", "rope_theta": -10000.0}})
    )


@pytest.mark.parametrize(
    "flags, change, words",
    [
        (["--active_heads_ratio", "nan"], None, "--active_heads_ratio must be a finite number, got nan"),
        (["--moh_aux_loss_coef=-1"], None, "--moh_aux_loss_coef must be >= 0 \\(0: no balance loss\\), got -1"),
        (["--moh_aux_loss_coef", "nan"], None, "--moh_aux_loss_coef must be a finite number, got nan"),
        (
            [],
            _huge_heads,
            "invalid llama config .*: .*The hidden size \\(32\\) is not a multiple of the number of "
            "attention heads \\(1099511627776\\)",
        ),
        (
            [],
            _negative_rope_theta,
            "the source config does not make a valid moh_llama config: .*rope_theta .* must be a finite number > 0, "
            "got -10000.0",
        ),
        (["--probe_file", "EMPTY"], None, "--probe_file .*empty.txt holds no text"),
        (["--shared_heads", "x"], None, "--shared_heads 'x': give a number of heads \\(e.g. --shared_heads 3\\)"),
        (
            ["--shared_heads_ratio", "0.3"],
            None,
            "shared ratio 0.3 and active ratio 0.75 give no whole number of heads of "
            "8: 2.4 shared, 6 active \\(use multiples of 1/8, or counts: "
            "--shared_heads N --active_heads M\\)",
        ),
        (
            ["--shared_heads_ratio", "1/0"],
            None,
            "argument --shared_heads_ratio/--shared-heads-ratio: invalid Ratio value",
        ),
    ],
)
def test_bad_conversion_values_are_one_line(tmp_path, capsys, flags, change, words):
    """Values that gave tracebacks (NaN ratio, negative or NaN β, a config of 2**40 heads) or were taken silently (an
    empty probe file): one line naming the value and what is allowed, status 2, nothing written."""
    import re

    source = _llama_dir(tmp_path / "llama")
    if change is not None:
        change(source)
    (tmp_path / "empty.txt").write_text("\n  \n")
    flags = [str(tmp_path / "empty.txt") if f == "EMPTY" else f for f in flags]
    capsys.readouterr()  # (writing the source)
    with pytest.raises(SystemExit) as exit_info:
        main(["--input_dir", str(source), "--output_dir", str(tmp_path / "out"), "--disable_tqdm", *flags])
    err = capsys.readouterr().err.strip()
    assert exit_info.value.code == 2 and len(err.splitlines()) == 1 and "Traceback" not in err, err
    assert re.search(words, err), err
    assert not (tmp_path / "out").exists()


def test_head_counts_and_fractions(tmp_path, capsys):
    """`--shared_heads 2 --active_heads 6`, `--shared_heads_ratio 1/4 --active_heads_ratio 3/4` and 0.25 / 0.75 make the
    same model (8 heads: 2 shared + 4 of 6 routed); `--shared_heads first`, the flag's earlier meaning, still chooses
    the shared heads, with a note."""
    source = _llama_dir(tmp_path / "llama")
    for name, flags in (
        ("counts", ["--shared_heads", "2", "--active_heads", "6"]),
        ("fractions", ["--shared_heads_ratio", "1/4", "--active_heads_ratio", "3/4"]),
        ("decimals", ["--shared_heads_ratio", "0.25", "--active_heads_ratio", "0.75"]),
        ("legacy", ["--shared_heads", "first", "--recipe", "paper", "--shared_heads_ratio", "0.25"]),
    ):
        main(
            [
                "--input_dir",
                str(source),
                "--output_dir",
                str(tmp_path / name),
                "--disable_tqdm",
                "--skip_logit_check",
                *flags,
            ]
        )
        config = json.loads((tmp_path / name / "config.json").read_text())
        assert (config["moh_shared_heads"], config["moh_active_heads"]) == (2, 4), name
    err = capsys.readouterr().err
    assert "--shared_heads first is now --shared_heads_by first" in err


@pytest.mark.parametrize(
    "options, error, words",
    [
        (dict(shared_heads_ratio="0.5"), TypeError, "--shared_heads_ratio must be a number, not str ('0.5')"),
        (dict(shared_heads_ratio=None), TypeError, "--shared_heads_ratio must be a number, not NoneType (None)"),
        (dict(shared_heads_ratio=float("inf")), ValueError, "--shared_heads_ratio must be a finite number, got inf"),
        (dict(moh_aux_loss_coef=-1), ValueError, "--moh_aux_loss_coef must be >= 0 (0: no balance loss), got -1"),
        (dict(shared_heads="3", active_heads=6), TypeError, "--shared_heads must be a whole number of heads, not str"),
    ],
)
def test_python_api_refuses_bad_values_in_one_line(tmp_path, options, error, words):
    source = _llama_dir(tmp_path / "llama")
    with pytest.raises(error) as raised:
        convert(str(source), str(tmp_path / "out"), progress=False, **options)
    assert str(raised.value).startswith(words) and "\n" not in str(raised.value)
    assert not (tmp_path / "out").exists()


def test_progress_is_shown_at_once(tmp_path):
    """The first line comes before torch and Transformers are imported (they take seconds)."""
    source = _llama_dir(tmp_path / "llama")
    code = (
        "import sys, time\nfrom mhmoe.convert.cli import main\nstart = time.perf_counter()\n"
        "sys.stdout.write = (lambda write: lambda text: (write(f'{time.perf_counter() - start:.3f} ' + text) if "
        "text.strip() else write(text)))(sys.stdout.write)\n"
        f"main(['--input_dir', {str(source)!r}, '--output_dir', {str(tmp_path / 'out')!r}, '--disable_tqdm', "
        "'--skip_logit_check'])\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], env=_env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    first = proc.stdout.splitlines()[0]
    seconds, text = first.split(" ", 1)
    assert text.startswith("mhmoe-convert: ") and "loading torch and Transformers" in text, first
    assert float(seconds) < 2.0, first
