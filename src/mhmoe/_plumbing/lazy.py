"""Module-level `__getattr__` / `__dir__` (PEP 562) that import a package's exports on first use.

`import mhmoe` must not import torch or Transformers' model code; a package lists where each public name lives and the
module defining it is imported the first time the name is read (`mhmoe.MHMoEConfig`, `from mhmoe import apply_moh`).
Type checkers and IDEs read the same names from the package's `if TYPE_CHECKING:` imports.
"""

from __future__ import annotations

import importlib
import sys


def lazy_exports(package: str, exports: dict[str, str]):
    """(`__getattr__`, `__dir__`) for package `package`: `exports` maps each public name to the module, relative to
    `package`, that defines it; a submodule of the package is imported when read as an attribute, as after an import."""

    def __getattr__(name: str):
        if name in exports:
            value = getattr(importlib.import_module(exports[name], package), name)
        elif not name.startswith("__"):
            try:
                value = importlib.import_module(f".{name}", package)
            except ModuleNotFoundError as e:
                if e.name != f"{package}.{name}":
                    raise
                raise AttributeError(f"module {package!r} has no attribute {name!r}") from None
        else:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        setattr(sys.modules[package], name, value)  # later reads skip __getattr__
        return value

    def __dir__() -> list[str]:
        return sorted(set(vars(sys.modules[package])) | set(exports))

    return __getattr__, __dir__


__all__ = ["lazy_exports"]
