"""Ctrl-C inside an import or a finalizer is held until it has finished, then raised (`_plumbing/interrupts.py`)."""

import os
import signal
import subprocess
import sys
import textwrap

import pytest

SCRIPT = textwrap.dedent(
    """
    import os, signal, sys, time, weakref
    from mhmoe._plumbing import interrupts

    interrupts.install()
    finished = []

    def finalizer():
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(0.2)  # the handler runs here, inside the finalizer
        finished.append(True)

    class Owner:
        def __del__(self):
            finalizer()

    owner = Owner()
    if sys.argv[1] == "weakref.finalize":
        weakref.finalize(owner, finalizer)
        owner.__class__ = type("Plain", (), {})  # only the finalize object calls finalizer
    try:
        del owner  # runs the finalizer: an interrupt raised inside it would be printed as "Exception ignored" and lost
        time.sleep(2)
    except KeyboardInterrupt:
        print("interrupted after the finalizer" if finished else "interrupted inside the finalizer")
    else:
        print("interrupt lost")
    """
)


@pytest.mark.skipif(not hasattr(signal, "SIGALRM"), reason="the held interrupt is retried by SIGALRM (POSIX)")
@pytest.mark.parametrize("finalizer", ["__del__", "weakref.finalize"])
def test_interrupt_inside_a_finalizer_is_raised_after_it(finalizer):
    done = subprocess.run(
        [sys.executable, "-c", SCRIPT, finalizer],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "PYTHONWARNINGS": "ignore"},
        # xdist workers ignore SIGINT and children inherit that (install() then rightly leaves Python's handler)
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    assert done.stdout.strip() == "interrupted after the finalizer", (done.stdout, done.stderr[-2000:])
    assert "Exception ignored" not in done.stderr, done.stderr[-2000:]


EXIT_WHILE_HELD = textwrap.dedent(
    """
    import importlib.abc, os, signal, sys, time
    from mhmoe._plumbing.cli import run

    class Loader(importlib.abc.Loader):  # an import that takes a moment and gets Ctrl-C in the middle
        def create_module(self, spec):
            return None

        def exec_module(self, module):
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(0.01)  # held here (inside an import) and retried every 50 ms

    class Finder(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path, target=None):
            if name == "slow_module":
                return importlib.util.spec_from_loader(name, Loader())

    sys.meta_path.insert(0, Finder())
    import mhmoe._plumbing.cli as cli, importlib.util, types

    def main(argv):
        import slow_module  # noqa: F401
        raise SystemExit(2)  # refused right after the import, before the held interrupt's retry comes

    sys.modules["fake_command"] = types.SimpleNamespace(main=main)
    cli.COMMANDS["mhmoe-fake"] = ("fake_command", ())
    try:
        run("mhmoe-fake", [])
    except SystemExit as e:
        print(signal.getitimer(signal.ITIMER_REAL)[0], signal.getsignal(signal.SIGALRM) is signal.SIG_DFL)
        raise
    """
)


@pytest.mark.skipif(not hasattr(signal, "SIGALRM"), reason="the held interrupt is retried by SIGALRM (POSIX)")
def test_a_command_that_ends_while_an_interrupt_is_held_exits_with_its_own_status():
    """Ctrl-C inside an import, then the command ends (a refusal) before the held interrupt is retried: the retry
    timer is stopped as the command ends. Left running, its SIGALRM comes while the interpreter tears down, after
    Python's handlers are gone: with torch loaded (a teardown of seconds) the process was killed, 'Alarm clock', status
    142 (`mhmoe-export /missing out`, Ctrl-C inside `import torch`)."""
    done = subprocess.run(
        [sys.executable, "-c", EXIT_WHILE_HELD],
        capture_output=True,
        text=True,
        timeout=120,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),  # (see the test above)
    )
    assert done.returncode == 2 and done.stdout.split() == ["0.0", "False"], (done.returncode, done.stdout, done.stderr)
