"""The console scripts (`[project.scripts]` in pyproject.toml): each runs its module's `main()`.

Before importing the module, a command checks for the extras it always needs (`mhmoe-eval` needs lm-eval at import),
and a missing optional dependency met later (peft for `mhmoe-train --lora`, accelerate for `mhmoe-convert
--train_file`, matplotlib for plots) becomes one line naming the extra to install, with exit status 2, instead of a
traceback. `python -m mhmoe.<job>` (training, convert, evaluation, hub; and `mhmoe.demo`) runs the same `main()`
without these checks. Ctrl-C is held while an import runs (`interrupts`), and is one line with exit status 130 at any
moment: each command's `main` says what is left; before it does, "nothing was done".
"""

from __future__ import annotations

import importlib
import sys

from . import interrupts
from .extras import MissingExtraError, extra_of, missing_extra_message, require

COMMANDS = {  # console script: (module whose main() it runs, extras the command always needs)
    "mhmoe-convert": ("mhmoe.convert.cli", ()),
    "mhmoe-demo": ("mhmoe.demo", ("train", "eval")),
    "mhmoe-eval": ("mhmoe.evaluation.cli", ("eval",)),
    "mhmoe-export": ("mhmoe.hub.cli", ()),
    "mhmoe-train": ("mhmoe.training.cli", ("train",)),
}


def run(command: str, argv: list[str] | None = None) -> None:
    """Run console script `command` with `argv` (default: sys.argv[1:])."""
    module, extras = COMMANDS[command]
    interrupts.install()  # Ctrl-C never lands inside an import (torch's, half-initialised, would swallow it)
    try:
        for extra in extras:
            require(extra, feature=command)
        main = importlib.import_module(module).main
        main(argv)  # its return value (the demo's summary) is not an exit status
    except ModuleNotFoundError as e:
        if extra_of(e.name) is None:
            raise
        message = str(e) if isinstance(e, MissingExtraError) else missing_extra_message(e.name, command)
        print(f"{command}: error: {message}", file=sys.stderr)
        raise SystemExit(2) from None
    except KeyboardInterrupt:  # before the command's own main says what is left: while importing or parsing
        interrupts.report(command, "nothing was done")
    finally:
        interrupts.disarm()  # the command ended first: an interrupt still held changes nothing now


def convert() -> None:
    run("mhmoe-convert")


def demo() -> None:
    run("mhmoe-demo")


def evaluate() -> None:
    run("mhmoe-eval")


def export() -> None:
    run("mhmoe-export")


def train() -> None:
    run("mhmoe-train")
