"""Post-import hooks: run a function right after another package first imports one of its modules.

`import mhmoe` stays light (no torch, no Transformers model code), yet mhmoe fills tables owned by other packages as
soon as those exist: Transformers' Auto classes (`registration.py`) and PEFT's default targets
(`peft_defaults.py`). `when_imported(name, hook)` calls `hook(module)` at once when module `name` is imported and
otherwise right after the import system first runs it: a finder at the front of `sys.meta_path` finds nothing itself;
it takes the spec the other finders give and wraps that spec's `exec_module`.

A hook that imports code must not run while a module it needs is still half-executed. Transformers imports its Auto
classes from inside `transformers.modeling_layers`, that is in the middle of importing almost any model (Llama
included), and registering mhmoe's model classes imports mhmoe's modeling code, which needs `modeling_layers` and
Llama's modeling file complete. Hooks given `after_imports_finish=True` therefore wait until no import of a
transformers or mhmoe module is running any more (imports of other packages that are under way, a user's module or
PEFT, do not hold them back): while installed, the finder also wraps those modules' `exec_module` to count them, per
thread. The finder removes itself once no hook is left waiting. Modules loaded by a loader shared between modules (from
a zip archive) are neither hooked nor counted; wheels install as files.
"""

from __future__ import annotations

import importlib.abc
import sys
import threading
from collections.abc import Callable
from types import ModuleType

Hook = Callable[[ModuleType], None]
TRACKED_PACKAGES = ("transformers", "mhmoe")  # imports of these hold back hooks with after_imports_finish=True

_waiting: dict[str, list[tuple[Hook, bool]]] = {}  # module name -> hooks to run once it is imported
_ready: list[tuple[Hook, ModuleType]] = []  # imported, waiting for the tracked imports in progress to finish
_thread = threading.local()  # .depth: tracked imports executing in this thread (hooks running count as one)


def _depth() -> int:
    return getattr(_thread, "depth", 0)


def when_imported(name: str, hook: Hook, *, after_imports_finish: bool = False) -> None:
    """Call `hook(module)` once module `name` is imported: now if it already is, else right after it first runs.

    `after_imports_finish=True`: also wait until no transformers or mhmoe module is half-executed (see the module
    docstring); for hooks that import such modules themselves.
    """
    module = sys.modules.get(name)
    if module is not None:
        _ready.append((hook, module))
        _run_ready()
        return
    hooks = _waiting.setdefault(name, [])
    if (hook, after_imports_finish) not in hooks:  # asked again (importlib.reload(mhmoe)): once is enough
        hooks.append((hook, after_imports_finish))
    if not any(isinstance(finder, _PostImportFinder) for finder in sys.meta_path):
        sys.meta_path.insert(0, _PostImportFinder())


def pending() -> list[str]:
    """Names of the modules whose hooks have not run yet."""
    return sorted(_waiting) + [module.__name__ for _, module in _ready]


def _run_ready() -> None:
    if _depth():  # a tracked import is half-done, or hooks are running further up this thread's stack
        return
    _thread.depth = 1
    try:
        while _ready:
            hook, module = _ready.pop(0)
            hook(module)
    finally:
        _thread.depth = 0


class _PostImportFinder(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname, path, target=None):
        if fullname not in _waiting and fullname.split(".")[0] not in TRACKED_PACKAGES:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None:
                break
        else:
            return None
        loader = spec.loader
        # Patch only a loader made for this one module (file and extension loaders carry its name): a shared one (a
        # class for built-in and frozen modules, a zipimporter) would run this module's hooks for others.
        if getattr(loader, "name", None) != fullname or not hasattr(loader, "exec_module"):
            return spec
        exec_module = loader.exec_module

        def exec_then_hooks(module):
            _thread.depth = _depth() + 1
            try:
                exec_module(module)
            finally:
                _thread.depth -= 1
            for hook, after_imports_finish in _waiting.pop(fullname, ()):
                if after_imports_finish:
                    _ready.append((hook, module))
                else:
                    hook(module)
            _run_ready()
            if not _waiting and not _ready:
                _uninstall()

        loader.exec_module = exec_then_hooks  # this spec's loader instance only
        return spec


def _uninstall() -> None:
    # Only from exec_module: removing a finder while the import system iterates sys.meta_path would skip another one.
    sys.meta_path[:] = [finder for finder in sys.meta_path if not isinstance(finder, _PostImportFinder)]


__all__ = ["TRACKED_PACKAGES", "pending", "when_imported"]
