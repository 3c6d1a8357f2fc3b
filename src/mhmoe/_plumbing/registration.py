"""mhmoe's model types in Transformers' Auto classes, registered when Transformers loads them.

`import mhmoe` registers nothing at once (that would import torch and Transformers' model code, seconds): it asks for
post-import hooks (`import_hooks.py`). The config classes are registered with `AutoConfig` right after Transformers
first imports `transformers.models.auto.configuration_auto`, the model classes with `AutoModel` and
`AutoModelForCausalLM` right after `transformers.models.auto.modeling_auto`, each as soon as the transformers and
mhmoe imports under way have finished; when Transformers had loaded them before `import mhmoe`, at `import mhmoe`. So
`import mhmoe` followed by `AutoConfig` / `AutoModelForCausalLM.from_pretrained(path)`, in either order, finds them.
`register_auto_classes()` registers everything now. The classes are named here as strings (`MODEL_TYPES`), as
Transformers' own Auto tables name theirs, and imported only when registered.

Why post-import hooks. Registering needs the classes themselves (`AutoModel.register` checks `config_class`), and
Transformers offers no lazy registration or entry point. The alternatives, measured with
`python benchmarks/import_time.py --registration` (benchmarks/README.md, CPU time of a fresh interpreter):
- eager registration of the config classes, model classes later: `configuration_auto` and the config module import
  torch, and the model classes would still need a hook: `import mhmoe` +3.9 s over `import transformers`, no simpler;
- eager registration of everything: +4.0 s (what `import mhmoe` cost before, 2.85 s on an idle machine);
- Transformers' `_LazyModule` for mhmoe's names: solves lazy names (as `lazy.py` does, 0.02 s) at the price of
  importing transformers (0.8 s), and registers nothing;
- the hooks: 0.02 s, nothing imported, registration exactly when the Auto classes exist.
Failure modes the hooks are tested against (tests/_plumbing/test_registration.py, test_import_hooks.py): a fresh
interpreter per import order (mhmoe first, the Auto classes first, mhmoe then a Llama model, mhmoe's modeling module
first: the last two import the Auto classes mid-import), spawn-based multiprocessing (workers re-import the main
module, and unpickling a config imports mhmoe), `importlib.reload(mhmoe)` before and after the Auto classes load (one
finder, each hook once), and pytest-xdist workers. Not covered: modules loaded by a loader shared between modules (a
zip archive; `import_hooks.py`), where `register_auto_classes()` is the way.
"""

from __future__ import annotations

import importlib
from types import ModuleType

from .import_hooks import when_imported

CONFIGURATION_AUTO = "transformers.models.auto.configuration_auto"
MODELING_AUTO = "transformers.models.auto.modeling_auto"

# What mhmoe registers, by name (as Transformers' own Auto tables name their classes): model type -> (module, class)
# of the config, and of the classes for AutoModel and AutoModelForCausalLM.
MODEL_TYPES = {
    "mhmoe": {
        "AutoConfig": ("mhmoe.models.mhmoe.configuration_mhmoe", "MHMoEConfig"),
        "AutoModel": ("mhmoe.models.mhmoe.modeling_mhmoe", "MHMoEModel"),
        "AutoModelForCausalLM": ("mhmoe.models.mhmoe.modeling_mhmoe", "MHMoEForCausalLM"),
    },
    "moh_llama": {
        "AutoConfig": ("mhmoe.models.moh_llama.configuration_moh_llama", "MoHLlamaConfig"),
        "AutoModel": ("mhmoe.models.moh_llama.modeling_moh_llama", "MoHLlamaModel"),
        "AutoModelForCausalLM": ("mhmoe.models.moh_llama.modeling_moh_llama", "MoHLlamaForCausalLM"),
    },
}


def _load(auto_name: str) -> dict[str, type]:
    """{model_type: the class registered with `auto_name`}, importing the modules that define them."""
    classes = {}
    for model_type, names in MODEL_TYPES.items():
        module, name = names[auto_name]
        classes[model_type] = getattr(importlib.import_module(module), name)
    return classes


def config_classes() -> dict[str, type]:
    """{model_type: config class} of mhmoe's model types."""
    return _load("AutoConfig")


def model_classes() -> dict[type, dict[str, type]]:
    """{config class: {"AutoModel": base model class, "AutoModelForCausalLM": causal-LM class}}."""
    configs, bases, causal_lms = _load("AutoConfig"), _load("AutoModel"), _load("AutoModelForCausalLM")
    return {
        configs[model_type]: {"AutoModel": bases[model_type], "AutoModelForCausalLM": causal_lms[model_type]}
        for model_type in MODEL_TYPES
    }


def register_configs(configuration_auto: ModuleType | None = None) -> None:
    """`AutoConfig.register` for every mhmoe model type (idempotent)."""
    if configuration_auto is None:
        from transformers.models.auto import configuration_auto
    for model_type, config_class in config_classes().items():
        configuration_auto.AutoConfig.register(model_type, config_class, exist_ok=True)


def register_models(modeling_auto: ModuleType | None = None) -> None:
    """`AutoModel.register` and `AutoModelForCausalLM.register` for every mhmoe model type (idempotent)."""
    if modeling_auto is None:
        from transformers.models.auto import modeling_auto
    for config_class, classes in model_classes().items():
        for auto_name, model_class in classes.items():
            getattr(modeling_auto, auto_name).register(config_class, model_class, exist_ok=True)


def register_auto_classes() -> None:
    """Register mhmoe's config and model classes with the Auto classes now (imports torch and the model code)."""
    register_configs()
    register_models()


def install() -> None:
    """Register with the Auto classes as soon as Transformers has loaded them (now, if it has)."""
    when_imported(CONFIGURATION_AUTO, register_configs, after_imports_finish=True)
    when_imported(MODELING_AUTO, register_models, after_imports_finish=True)


__all__ = [
    "MODEL_TYPES",
    "config_classes",
    "install",
    "model_classes",
    "register_auto_classes",
    "register_configs",
    "register_models",
]
