"""PEFT's default target modules for model types "mhmoe" and "moh_llama", registered without importing PEFT.

PEFT finds the modules to adapt when a config names none (`get_peft_model(model, LoraConfig(r=8))`) in per-model-type
tables in `peft.utils.constants`. `import mhmoe` must not import PEFT (an optional extra, seconds to import), so
`install()` (called by `import mhmoe`) fills the tables at once when that module is already imported and otherwise
right after PEFT first imports it (a post-import hook, `import_hooks.py`). The defaults are therefore in
place whichever of mhmoe and peft is imported first.
"""

from __future__ import annotations

from .import_hooks import when_imported

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


def install() -> None:
    """Register the defaults now if PEFT's tables are loaded, else as soon as PEFT loads them."""
    when_imported(CONSTANTS_MODULE, add_default_targets)


__all__ = ["ATTENTION_TARGETS", "MODEL_TYPES", "add_default_targets", "install"]
