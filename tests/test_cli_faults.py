"""What goes wrong outside the program, in every command line: a file size limit (`ulimit -f`, errno 27) and a full
disk (errno 28, a real small tmpfs) are one line with exit status 1; Ctrl-C is one line saying how to go on (exit
status 130)."""

import json
import os
import resource
import signal
import subprocess
import sys
import time

import pytest

from tests._plumbing.test_trust import _run
from tests.convert.test_convert import _llama_dir
from tests.convert.test_outputs import _env, _in_private_mount

COMMANDS = ["mhmoe-train", "mhmoe-convert", "mhmoe-export", "mhmoe-eval"]


@pytest.fixture(scope="module")
def inputs(tmp_path_factory, tokenizer_dir, corpus):
    """A dense Llama (mhmoe-convert's input) and its MoH conversion (the other commands'), and each command's argv
    writing into OUT (mhmoe-eval: its results)."""
    from mhmoe.convert import convert

    root = tmp_path_factory.mktemp("faults")
    llama = _llama_dir(root / "llama", tokenizer_dir)
    convert(str(llama), str(root / "moh"), verify_logits=False, progress=False, recipe="paper")
    moh = str(root / "moh")

    def argv(command: str, out: str) -> list[str]:
        return {
            "mhmoe-train": [
                "--model_name_or_path",
                moh,
                "--train_file",
                corpus["tiny"],
                "--output_dir",
                out,
                "--max_steps",
                "2",
                "--save_steps",
                "1",
                "--block_size",
                "16",
                "--disable_tqdm",
                "--no_plot",
            ],
            "mhmoe-convert": [
                "--input_dir",
                str(llama),
                "--output_dir",
                out,
                "--skip_logit_check",
                "--recipe",
                "paper",
                "--disable_tqdm",
            ],
            "mhmoe-export": [moh, out],
            "mhmoe-eval": [
                "--model_args",
                f"pretrained={moh}",
                "--tasks",
                "mhmoe_ppl_wikipedia",
                "--metadata",
                json.dumps({"wikipedia_path": corpus["val"]}),
                "--limit",
                "1",
                "--output_path",
                out,
            ],
        }[command]

    return argv


@pytest.mark.parametrize("command", COMMANDS)
def test_file_size_limit_is_one_line(inputs, tmp_path, capsys, command):
    """Under `ulimit -f` (here this process's RLIMIT_FSIZE, lowered for the command): the first write past it fails
    with EFBIG (Python ignores SIGXFSZ), told in one line, exit status 1."""
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (2048, hard))
    sys.dont_write_bytecode, writes_bytecode = True, sys.dont_write_bytecode  # (see NO_BYTECODE_UNDER_FSIZE)
    try:
        status = _run(command, inputs(command, str(tmp_path / "out")))
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
        sys.dont_write_bytecode = writes_bytecode
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.startswith(f"{command}: ")]
    assert status == 1 and len(lines) == 1 and "Traceback" not in err, err[-3000:]
    assert (
        lines[0].startswith(f"{command}: error: cannot write ")
        and "a file grew past the largest file allowed" in lines[0]
        and "ulimit -f" in lines[0]
    ), lines
    hidden = [str(p) for p in tmp_path.rglob(".*") if p.name != ".mhmoe-train.lock"]  # a half-written folder
    results = [str(p) for p in tmp_path.rglob("results*.json")]  # a results file cut short
    assert not hidden and not results, (command, hidden, results)


def test_full_disk_is_one_line_in_every_command(inputs, tmp_path, warm):
    """A real file system of 16 KB (a tmpfs in a private mount namespace) as the output of each command, 12 KB of it
    taken by a filler file while the command runs (what an earlier command left must not decide whether the next one
    meets a full disk): ENOSPC, told in one line naming the folder, exit status 1."""
    script = (
        "import json, os, sys\nfrom mhmoe._plumbing.cli import run\ncommand = sys.argv[1]\n"
        "argv = [a.replace('MNT_OUT', os.environ['MNT'] + '/out-' + command) for a in json.loads(sys.argv[2])]\n"
        "try:\n    run(command, argv)\nexcept SystemExit as e:\n    sys.exit(e.code)\n"
    )
    lines = []
    for command in COMMANDS:
        argv = json.dumps(inputs(command, "MNT_OUT"))
        lines.append(
            f'head -c 12288 /dev/zero > "$MNT/filler"; '
            f"""{warm.shell} -c "{script}" {command} '{argv}' 2> "{tmp_path}/{command}.err"; """
            f'echo "status {command} $?"; rm -f "$MNT/filler"'
        )
    proc = _in_private_mount("\n".join(lines), tmp_path, "16k", read_only=False)
    statuses = dict(line.split()[1:] for line in proc.stdout.splitlines() if line.startswith("status "))
    for command in COMMANDS:
        err = (tmp_path / f"{command}.err").read_text()
        found = [line for line in err.splitlines() if line.startswith(f"{command}: ")]
        assert statuses.get(command) == "1" and len(found) == 1 and "Traceback" not in err, (command, err[-3000:])
        assert found[0].startswith(f"{command}: error: not enough disk space to write ") and "/out" in found[0], found


def test_ctrl_c_in_training_says_how_to_resume(checkpoint_dir, corpus, tmp_path, warm):
    """SIGINT to a running mhmoe-train: one line naming the newest checkpoint and the flag that resumes from it, exit
    status 130; the resumed run finishes."""
    out = tmp_path / "run"
    command = [
        sys.executable,
        "-m",
        "mhmoe.training",
        "--model_name_or_path",
        checkpoint_dir,
        "--train_file",
        corpus["train"],
        "--output_dir",
        str(out),
        "--max_steps",
        "100000",
        "--save_steps",
        "1",
        "--block_size",
        "16",
        "--disable_tqdm",
        "--no_plot",
    ]
    proc = warm.popen(  # a warm child (tests/fixtures/warm.py), with Python's own SIGINT handler
        command,
        env=_env(PYTHONUNBUFFERED="1"),  # not inherited from the caller's shell: the summary line comes at once
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        for line in proc.stdout:  # the summary line: the loop starts
            if line.startswith("mhmoe-train: "):
                break
        deadline = time.monotonic() + 180
        while not list(out.glob("checkpoint-*")) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert list(out.glob("checkpoint-*")), "no checkpoint within 180 s"
    except BaseException:
        proc.kill()
        raise
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=180)
    lines = [line for line in err.splitlines() if line.startswith("mhmoe-train")]  # (Transformers' loading bar too)
    assert proc.returncode == 130 and len(lines) == 1 and "Traceback" not in err, err[-3000:]
    assert lines[0].startswith(
        "mhmoe-train: interrupted; run the same command with --resume_from_checkpoint latest "
        f"to go on from {out}/checkpoint-"
    ), lines


@pytest.mark.parametrize("tune", [False, True], ids=["convert", "convert and continue-tune"])
def test_ctrl_c_in_conversion_says_what_is_left(inputs, tmp_path, corpus, capsys, monkeypatch, tune):
    """Ctrl-C (KeyboardInterrupt) while converting leaves nothing and says so; while continue-tuning, after a
    checkpoint, it names the checkpoint and how to resume. One line, exit status 130."""
    import mhmoe.convert.write as write
    import mhmoe.training.loop as loop

    out = tmp_path / "out"
    argv = inputs("mhmoe-convert", str(out))
    if tune:
        argv += [
            "--train_file",
            corpus["tiny"],
            "--max_steps",
            "4",
            "--save_steps",
            "1",
            "--block_size",
            "16",
            "--warmup_steps",
            "1",
        ]
        real_step, calls = loop.train_step, []

        def step_then_interrupt(run, step):
            calls.append(step)
            if len(calls) == 3:
                raise KeyboardInterrupt
            return real_step(run, step)

        monkeypatch.setattr(loop, "train_step", step_then_interrupt)
    else:
        monkeypatch.setattr(write, "_check_written", lambda *a: (_ for _ in ()).throw(KeyboardInterrupt))
    status = _run("mhmoe-convert", argv)
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.startswith("mhmoe-")]  # (Transformers' loading bar too)
    assert status == 130 and len(lines) == 1 and "Traceback" not in err, err
    if tune:
        assert lines[0] == (
            "mhmoe-convert: interrupted; the continue-tuning saved checkpoint-2: run the same command "
            "with --resume_from_checkpoint latest to go on from it"
        ), lines
    else:
        assert lines[0] == f"mhmoe-convert: interrupted; nothing was written to {out}: run the same command again"
        assert not out.exists() and not [p for p in tmp_path.iterdir() if p.name.startswith(".out.")]


def _maps_torch(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/maps") as f:
            return "libtorch" in f.read()
    except OSError:
        return False


def _interrupt_inside_import_torch(proc) -> None:
    """SIGINT as soon as the process maps libtorch: `import torch` is running, and goes on for seconds after."""
    deadline = time.monotonic() + 120
    while not _maps_torch(proc.pid) and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.002)
    proc.send_signal(signal.SIGINT)


def _console_script(command: str) -> str:
    """The installed console script (beside this interpreter)."""
    return os.path.join(os.path.dirname(sys.executable), command)


@pytest.fixture(scope="module")
def warm_seconds(inputs, tmp_path_factory, warm):
    """Each command's duration from a warm start, uninterrupted (mhmoe-train: its 2-step run): the clock of the Ctrl-C
    moments after the imports, so that they fall where they are meant to on a fast machine and on a slow one."""
    root, seconds = tmp_path_factory.mktemp("timed"), {}
    for command in COMMANDS:
        script = _console_script(command)
        start = time.perf_counter()
        done = warm.run([script, *inputs(command, str(root / command))], env=_env(), timeout=300)
        seconds[command] = time.perf_counter() - start
        assert done.returncode == 0, done.stderr[-3000:]
    return seconds


@pytest.mark.skipif(not os.path.isdir("/proc/self"), reason="reads /proc/PID/maps to find the moment torch imports")
@pytest.mark.parametrize("moment", ["importing torch", "at 10%", "at 50%"])
def test_ctrl_c_at_any_moment_is_one_line(inputs, tmp_path, moment, warm, warm_seconds):
    """SIGINT to every console script at several moments (inside `import torch`; at 10% and at 50% of the command's
    own uninterrupted run after its imports: early in its work and halfway through it): one line
    `COMMAND: interrupted; ...`, exit status 130, no traceback, nothing half-written (no hidden temporary folder; an
    output folder, if there is one, is complete). A command that finished first exits 0. (Only the interpreter's own
    start, before mhmoe's first line runs, is out of reach.) The moments after the imports are counted from a warm
    start (tests/fixtures/warm.py: the imports done), so they fall in the command's own work."""
    procs, started = {}, {}
    for command in COMMANDS:
        out = tmp_path / f"out-{command}"
        argv = inputs(command, str(out))
        if command == "mhmoe-train":
            argv[argv.index("--max_steps") + 1] = "100000"  # still training when the last signal comes
        script = _console_script(command)
        how = dict(env=_env(PYTHONUNBUFFERED="1"), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        if moment == "importing torch":
            # SIGINT at its default in the child: an ignored SIGINT is inherited through exec, and some library run
            # earlier in the same pytest process may have set it so (Python then installs no handler)
            default = lambda: signal.signal(signal.SIGINT, signal.SIG_DFL)  # noqa: E731
            procs[command] = subprocess.Popen([script, *argv], preexec_fn=default, **how)
            _interrupt_inside_import_torch(procs[command])
        else:
            procs[command], started[command] = warm.popen([script, *argv], **how), time.perf_counter()
    if moment != "importing torch":
        fraction = float(moment.split()[1].rstrip("%")) / 100
        for command in sorted(procs, key=lambda c: started[c] + fraction * warm_seconds[c]):
            time.sleep(max(0.0, started[command] + fraction * warm_seconds[command] - time.perf_counter()))
            procs[command].send_signal(signal.SIGINT)
    interrupted = 0
    for command, proc in procs.items():
        _, err = proc.communicate(timeout=300)
        lines = [line for line in err.splitlines() if line.startswith(f"{command}: ")]
        print(moment, command, proc.returncode, lines)
        assert "Traceback" not in err and proc.returncode in (0, 130), (command, moment, proc.returncode, err[-3000:])
        if proc.returncode == 130:
            interrupted += 1
            assert len(lines) == 1 and lines[0].startswith(f"{command}: interrupted; "), (command, err[-3000:])
        leftovers = [p.name for p in tmp_path.iterdir() if p.name.startswith(".")]
        assert not leftovers, (command, leftovers)
        out = tmp_path / f"out-{command}"
        if out.is_dir() and command in ("mhmoe-convert", "mhmoe-export"):  # renamed into place only when complete
            assert (out / "config.json").is_file() and (out / "model.safetensors").is_file(), sorted(os.listdir(out))
    assert interrupted >= 3, moment  # (one may finish first, when this run is quicker than the timed one)


BROKEN_TOKENIZERS = {  # what a careless copy or a hostile folder holds instead of a tokenizer
    "truncated": lambda folder: (folder / "tokenizer.json").write_bytes((folder / "tokenizer.json").read_bytes()[:99]),
    "binary": lambda folder: (folder / "tokenizer.json").write_bytes(bytes(range(256)) * 4),
    "empty object": lambda folder: (folder / "tokenizer.json").write_text("{}"),
    "another object": lambda folder: (folder / "tokenizer.json").write_text('{"hello": 1}'),
    "empty": lambda folder: (folder / "tokenizer.json").write_bytes(b""),
    "deeply nested": lambda folder: (folder / "tokenizer.json").write_text(
        '{"model": ' + "[" * 50_000 + "]" * 50_000 + "}"
    ),
    "config not an object": lambda folder: (folder / "tokenizer_config.json").write_text("[1]"),
    "config without a vocabulary": lambda folder: (folder / "tokenizer.json").unlink(),
}


@pytest.mark.parametrize("case", BROKEN_TOKENIZERS)
def test_a_broken_tokenizer_is_one_line_in_every_command(inputs, tmp_path, capsys, case):
    """The model folder's tokenizer files broken: mhmoe-export, mhmoe-eval and mhmoe-train (and mhmoe-convert, whose
    calibration reads the source's tokenizer) stop with one line naming the folder or the file, exit status 2, no
    traceback, nothing written."""
    import shutil

    moh = inputs("mhmoe-export", "unused")[0]
    for command in COMMANDS:
        source = inputs(command, "unused")
        given = source[source.index("--input_dir") + 1] if command == "mhmoe-convert" else moh
        broken = tmp_path / f"broken-{command}"
        shutil.copytree(given, broken)
        BROKEN_TOKENIZERS[case](broken)
        out = tmp_path / f"out-{command}"
        argv = [a.replace(given, str(broken)) for a in inputs(command, str(out))]
        if command == "mhmoe-convert":
            argv[argv.index("--recipe") + 1] = "fitted"  # calibration tokenizes text with the source's tokenizer
        status = _run(command, argv)
        err = capsys.readouterr().err
        lines = [line for line in err.splitlines() if line.startswith(f"{command}: ")]
        assert status == 2 and len(lines) == 1 and "Traceback" not in err, (command, status, err[-3000:])
        assert lines[0].startswith(f"{command}: error: ") and str(broken) in lines[0], (command, lines)
        assert not out.exists() or command == "mhmoe-train" and not any(out.iterdir()), (command, list(out.iterdir()))
