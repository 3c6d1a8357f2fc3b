"""The warm launcher (tests/fixtures/warm.py) behaves as `subprocess` does for what the end-to-end tests observe."""

import os
import resource
import shutil
import signal
import subprocess
import sys
import time

import pytest

from tests.fixtures.warm import cli_env

REPORT = "import os, sys\nprint(sys.argv, os.getcwd(), os.environ.get('ASKED'), sys.stdin.read())\nsys.exit(3)"


def test_argv_folder_environment_streams_and_status(warm, tmp_path):
    done = warm.run([sys.executable, "-c", REPORT, "a", "b"], env=cli_env(ASKED="yes"), cwd=tmp_path, input="in")
    assert done.returncode == 3 and done.stderr == ""
    assert done.stdout == f"['-c', 'a', 'b'] {tmp_path} yes in\n"
    done = warm.run([sys.executable, "-m", "mhmoe.hub", "--bogus"], env=cli_env())  # python -m, argparse's refusal
    assert done.returncode == 2 and "mhmoe-export: error: the following arguments are required" in done.stderr
    done = warm.run(["mhmoe-export", "--help"], env=cli_env())  # a console script
    assert done.returncode == 0 and done.stdout.startswith("usage: mhmoe-export")


def test_signals_reach_the_child_and_its_own_handler(warm):
    code = "import time\ntry:\n    time.sleep(60)\nexcept KeyboardInterrupt:\n    print('interrupted')\n    raise SystemExit(130)"
    proc = warm.popen([sys.executable, "-c", code], env=cli_env(), stdout=subprocess.PIPE, text=True)
    time.sleep(0.3)
    proc.send_signal(signal.SIGINT)
    assert proc.wait(30) == 130 and proc.stdout.read() == "interrupted\n"
    proc = warm.popen([sys.executable, "-c", "raise SystemExit(7)"], env=cli_env())
    deadline = time.monotonic() + 30
    while proc.poll() is None and time.monotonic() < deadline:  # poll alone sees the exit (a busy-wait loop's form)
        time.sleep(0.01)
    assert proc.returncode == 7
    proc = warm.popen([sys.executable, "-c", "import time; time.sleep(60)"], env=cli_env())
    assert proc.poll() is None
    proc.kill()
    assert proc.wait(30) == -signal.SIGKILL


def test_file_size_limit_and_refused_import_time_settings(warm, tmp_path):
    code = f"open({str(tmp_path / 'big')!r}, 'wb').write(bytes(100_000))"
    done = warm.run(
        [sys.executable, "-c", code], env=cli_env(), rlimits={"RLIMIT_FSIZE": (4096, resource.RLIM_INFINITY)}
    )
    assert done.returncode == 1 and "File too large" in done.stderr
    with pytest.raises(ValueError, match="HF_HOME"):  # read when huggingface_hub is imported: the fork cannot change it
        warm.run([sys.executable, "-c", "pass"], env=cli_env(HF_HOME=str(tmp_path)))


def test_shell_client_inside_a_private_mount(warm, tmp_path):
    """`warm.shell` in a shell script: the child runs in the script's user + mount namespace (it sees the tmpfs), with
    the script's descriptors; its status is the client's."""
    if shutil.which("unshare") is None or subprocess.run(["unshare", "-rm", "true"]).returncode != 0:
        pytest.skip("no user/mount namespaces here (unshare -rm)")
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    script = (
        f'mount -t tmpfs -o size=16k tmpfs "{mnt}" && echo mounted > "{mnt}/f" && '
        f"{warm.shell} -c \"import os, sys; print(open('{mnt}/f').read().strip(), os.getpid() != $$); sys.exit(4)\"; "
        'echo "status $?"'
    )
    done = subprocess.run(["unshare", "-rm", "sh", "-c", script], env=cli_env(), capture_output=True, text=True)
    assert done.stdout.split() == ["mounted", "True", "status", "4"], (done.stdout, done.stderr)
    assert not os.listdir(mnt)  # the mount was the namespace's only


def test_executable_runs_as_python_for_a_script_that_takes_its_interpreter_from_a_variable(warm, tmp_path):
    """`warm.executable(folder)` in place of `python`: a heredoc program (`python -`), the status, `timeout`'s SIGTERM
    passed on to the child, and a form the server does not run (`--version`) as a fresh interpreter."""
    python = warm.executable(tmp_path)
    script = (
        f"\"$PY\" - a b <<'EOF'\nimport os, sys\nprint(sys.argv, os.getpid() != {os.getpid()})\nsys.exit(5)\nEOF\n"
        'echo "status $?"\n'
        f"timeout 1 \"$PY\" -c \"import os, time; open('{tmp_path}/pid', 'w').write(str(os.getpid())); time.sleep(60)\"; "
        'echo "timeout $?"\n'
        '"$PY" --version\n'
    )
    started = time.monotonic()
    done = subprocess.run(["sh", "-c", script], env=cli_env(PY=str(python)), capture_output=True, text=True)
    assert done.stdout.split("\n")[:3] == ["['-', 'a', 'b'] True", "status 5", "timeout 124"], done.stderr
    assert done.stdout.split("\n")[3].startswith("Python 3.") and time.monotonic() - started < 30
    time.sleep(0.2)  # (the server reaps its children every few ms)
    with pytest.raises(ProcessLookupError):  # the child got the SIGTERM: it is not left sleeping
        os.kill(int((tmp_path / "pid").read_text()), 0)
