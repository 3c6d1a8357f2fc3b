"""Ctrl-C in the command lines: never inside an import, always one line.

Python turns SIGINT into a KeyboardInterrupt raised at whatever bytecode runs next. Raised inside `import torch` (C
code calling back into Python), it leaves torch half-initialised, and C code that sees the error may swallow it: the
command then goes on and fails later with nonsense (`SystemError: bad call flags`, `cannot import name 'nn' from
partially initialized module 'torch'`). `install()` replaces the handler: an interrupt that arrives while an import is
running (an importlib frame on the stack) is held, and raised as soon as the import has finished (a timer checks every
50 ms). So is one that arrives inside a finalizer (a `__del__` method or a `weakref.finalize` callback): Python
prints an exception raised there as "Exception ignored", drops it and goes on, so the interrupt would be lost and the
command would run to its end (a plain weakref callback is not recognised). At any other moment it is raised at once,
as before. Each command's `main` then turns the KeyboardInterrupt into its one line and exit status 130 (`report`).

POSIX only (the timer is SIGALRM); elsewhere Python's own handler stays.
"""

from __future__ import annotations

import atexit
import os
import signal
import sys

EXIT_STATUS = 130  # 128 + SIGINT, what a shell reports for a command killed by Ctrl-C
_RETRY_S = 0.05
_held = False


def _must_hold(frame) -> bool:
    """Whether an interrupt raised at `frame` would be lost or would break state: inside an import or a finalizer."""
    while frame is not None:
        code = frame.f_code
        if code.co_filename.startswith("<frozen importlib") or code.co_name == "__del__":
            return True
        if code.co_name == "__call__" and os.path.basename(code.co_filename) == "weakref.py":  # weakref.finalize
            return True
        frame = frame.f_back
    return False


def _on_interrupt(signum, frame) -> None:
    global _held
    if _must_hold(frame):
        _held = True
        signal.setitimer(signal.ITIMER_REAL, _RETRY_S)
        return
    _held = False
    raise KeyboardInterrupt


def _on_timer(signum, frame) -> None:
    if _held:
        _on_interrupt(signal.SIGINT, frame)


def disarm() -> None:
    """Stop retrying a held interrupt: the command is ending with its own status. Left running, the timer's SIGALRM
    would come while the interpreter tears down (seconds with torch loaded), after Python's handlers are gone, and
    kill the process ('Alarm clock', status 142)."""
    global _held
    _held = False
    if hasattr(signal, "setitimer"):
        signal.setitimer(signal.ITIMER_REAL, 0)


def install() -> None:
    """Hold Ctrl-C until the running import finishes (module docstring); a no-op where SIGINT is ignored (a background
    job), off the main thread, or without SIGALRM."""
    if not hasattr(signal, "SIGALRM") or signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
        return
    try:
        signal.signal(signal.SIGALRM, _on_timer)
        signal.signal(signal.SIGINT, _on_interrupt)
    except ValueError:  # not the main thread: leave Python's handler
        return
    atexit.unregister(disarm)  # install() may run twice
    atexit.register(disarm)  # a program that ends while an interrupt is held


def install_in_console_script() -> None:
    """`install()` when this process is one of mhmoe's console scripts (`mhmoe-train`, ...: `sys.argv[0]`), called
    first thing in `import mhmoe`, so that the rest of mhmoe's imports are covered too; a program that imports mhmoe as
    a library keeps its own handlers."""
    argv = getattr(sys, "argv", None) or [""]
    if os.path.basename(argv[0]).startswith("mhmoe-"):
        install()


def report(command: str, what: str) -> None:
    """The one line after Ctrl-C (`command: interrupted; what`), then exit status 130."""
    print(f"\n{command}: interrupted; {what}", file=sys.stderr, flush=True)
    raise SystemExit(EXIT_STATUS)


__all__ = ["EXIT_STATUS", "disarm", "install", "install_in_console_script", "report"]
