"""PEFT's default target modules for model types "mhmoe" and "moh_llama", registered without importing PEFT.

PEFT finds the modules to adapt when a config names none (`get_peft_model(model, LoraConfig(r=8))`) in per-model-type
tables in `peft.utils.constants`. `import mhmoe` must not import PEFT (an optional extra, seconds to import), so
`install()` (called by `import mhmoe`) fills the tables at once when that module is already imported and otherwise puts
a one-shot finder on `sys.meta_path` that fills them right after PEFT first imports it. The defaults are therefore in
place whichever of mhmoe and peft is imported first. `mhmoe.peft` (LoRA configs for the experts) fills them too.
"""

from __future__ import annotations

import importlib.abc
import sys

ATTENTION_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj"]
MODEL_TYPES = ("mhmoe", "moh_llama")
CONSTANTS_MODULE = "peft.utils.constants"
_LORA_TABLE = "TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING"


def add_default_targets(constants) -> None:
    """Add mhmoe and moh_llama to the default-target tables of `constants` (PEFT's `peft.utils.constants` module).

    Idempotent; an existing entry is never overridden. LoRA gets the attention projections; every other PEFT method
    table that knows "llama" gets Llama's entry (both models use Llama's module names for attention, dense MLPs and
    the shared expert).
    """
    for name in dir(constants):
        table = getattr(constants, name)
        if not (name.startswith("TRANSFORMERS_MODELS_TO_") and isinstance(table, dict) and "llama" in table):
            continue
        if not (name.endswith("_TARGET_MODULES_MAPPING") or name.endswith("_FEEDFORWARD_MODULES_MAPPING")):
            continue
        for model_type in MODEL_TYPES:
            table.setdefault(model_type, list(ATTENTION_TARGETS) if name == _LORA_TABLE else table["llama"])


class _AfterPeftConstants(importlib.abc.MetaPathFinder):
    """Finds nothing itself: when `peft.utils.constants` is first imported, it takes the spec the other finders give
    and runs `add_default_targets` on the module right after the module's own code."""

    def find_spec(self, fullname, path, target=None):
        if fullname != CONSTANTS_MODULE:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None:
                break
        else:
            return None
        if spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        exec_module = spec.loader.exec_module

        def exec_then_register(module):
            exec_module(module)
            add_default_targets(module)
            _uninstall_finder()

        spec.loader.exec_module = exec_then_register  # this spec's loader instance only
        return spec


def _uninstall_finder() -> None:
    # Only from exec_module: removing a finder while the import system iterates sys.meta_path would skip another one.
    sys.meta_path[:] = [finder for finder in sys.meta_path if not isinstance(finder, _AfterPeftConstants)]


def install() -> None:
    """Register the defaults now if PEFT's tables are loaded, else as soon as PEFT loads them."""
    constants = sys.modules.get(CONSTANTS_MODULE)
    if constants is not None:
        add_default_targets(constants)
    elif not any(isinstance(finder, _AfterPeftConstants) for finder in sys.meta_path):
        sys.meta_path.insert(0, _AfterPeftConstants())


__all__ = ["ATTENTION_TARGETS", "MODEL_TYPES", "add_default_targets", "install"]
