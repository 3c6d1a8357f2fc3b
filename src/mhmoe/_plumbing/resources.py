"""Data folders the code reads at run time: `eval_tasks/` (lm-eval suites and their Python helpers) and
`model_cards/` (model-card templates); and `examples/` (Accelerate configs), shipped for users.

Each folder lives once in git, at the top of the repository. A wheel (or sdist) built by setup.py carries a copy at
`mhmoe/_data/<name>/`; a checkout or an editable install reads the top-level folder in place. `data_dir(name)` returns
whichever this installation has; `data_dirs(name, env)` puts the folder an environment variable names first.
"""

from __future__ import annotations

import os
from pathlib import Path

_PACKAGE = Path(__file__).resolve().parents[1]  # src/mhmoe/_plumbing/resources.py -> src/mhmoe


def data_dir(name: str) -> Path | None:
    """The folder `name` ("eval_tasks", "model_cards", "examples") shipped with mhmoe: `mhmoe/_data/<name>` in an installed
    wheel, `<repository>/<name>` from a checkout or an editable install; None when this installation has none."""
    if not name or Path(name).name != name:
        raise ValueError(f"data_dir takes a top-level folder name such as 'eval_tasks', not {name!r}")
    packaged = _PACKAGE / "_data" / name
    if packaged.is_dir():
        return packaged
    root = _PACKAGE.parents[1]  # <repository>/src/mhmoe -> <repository>
    in_checkout = root / name
    if (root / "pyproject.toml").is_file() and in_checkout.is_dir():
        return in_checkout
    return None


def data_dirs(name: str, env: str) -> list[Path]:
    """Where to look for folder `name`, in order: the folder $`env` names (when set), then `data_dir(name)`."""
    candidates = [Path(os.environ[env])] if os.environ.get(env) else []
    shipped = data_dir(name)
    return candidates + ([shipped] if shipped is not None else [])


__all__ = ["data_dir", "data_dirs"]
