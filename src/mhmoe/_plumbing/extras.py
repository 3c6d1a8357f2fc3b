"""Optional dependencies, grouped as the extras of pyproject.toml, and the error that names the extra to install.

`import mhmoe` and the models need only torch and transformers (plus safetensors, tokenizers, tqdm). Training, PEFT,
plots, lm-eval and Triton kernels come with extras: `pip install "mhmoe[train]"`, `"mhmoe[eval]"`, `"mhmoe[triton]"`.
"""

from __future__ import annotations

import importlib.util

# extra -> {top-level module: distribution name on PyPI}; keep in step with [project.optional-dependencies]
EXTRAS = {
    "train": {"accelerate": "accelerate", "peft": "peft", "matplotlib": "matplotlib", "datasets": "datasets"},
    "eval": {"lm_eval": "lm-eval"},
    "triton": {"triton": "triton"},
    "gguf": {"gguf": "gguf"},
}


class MissingExtraError(ModuleNotFoundError):
    """An optional dependency is not installed; the message names the extra that installs it."""


def extra_of(module: str | None) -> str | None:
    """The extra that provides top-level module `module` (or a submodule of it); None for anything else."""
    top = (module or "").split(".")[0]
    return next((extra for extra, modules in EXTRAS.items() if top in modules), None)


def missing_extra_message(module: str, feature: str | None = None, extra: str | None = None) -> str:
    """'<feature> needs <distribution>, which is not installed: pip install "mhmoe[<extra>]"' (`extra`: the extra
    that provides `module`, looked up when not given)."""
    extra = extra or extra_of(module)
    top = module.split(".")[0]
    dist = EXTRAS.get(extra, {}).get(top, top)
    return f'{feature or "this"} needs {dist}, which is not installed: pip install "mhmoe[{extra}]"'


def require(extra: str, *modules: str, feature: str | None = None) -> None:
    """Raise `MissingExtraError` naming `extra` unless every one of `modules` (default: all of the extra's) can be
    imported. Looks the modules up without importing them."""
    if extra not in EXTRAS:
        raise ValueError(f"unknown extra {extra!r}; the extras are {sorted(EXTRAS)}")
    for module in modules or tuple(EXTRAS[extra]):
        if importlib.util.find_spec(module) is None:
            raise MissingExtraError(missing_extra_message(module, feature, extra), name=module)


__all__ = ["EXTRAS", "MissingExtraError", "extra_of", "missing_extra_message", "require"]
