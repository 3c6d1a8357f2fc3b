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
