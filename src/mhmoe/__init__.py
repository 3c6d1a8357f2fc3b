"""mhmoe: Multi-Head Mixture-of-Experts and Mixture-of-Head attention as Hugging Face Transformers models.

The house, from the bottom up: `_plumbing` (lazy names, registration, extras, console scripts, checkpoint files;
imports nothing of mhmoe), `models` (the model layer: runs on torch and Transformers alone), then the four jobs a user
comes for: `hub` (publish: export with the modeling code, cards), `evaluation` (lm-eval, routing statistics),
`training` (the training loop), `convert` (dense LLaMA -> MoH), and `demo`, `recovery_demo` (end to end). Arrows only go
down; tests/test_layering.py checks it. docs/architecture.md is the map.

`import mhmoe` is light: it imports neither torch nor Transformers. The public names load with the module that defines
them on first use (`_plumbing.lazy`). Two things happen at `import mhmoe`, both below: the model types "mhmoe" and
"moh_llama" are registered with AutoConfig, AutoModel and AutoModelForCausalLM as soon as Transformers loads those
classes (`_plumbing.registration` says why it waits for them), so `import mhmoe; AutoModelForCausalLM.from_pretrained
(path)` works in either import order; and PEFT learns the models' default LoRA targets when it loads
(`_plumbing.peft_defaults`). Training (accelerate, peft, matplotlib), lm-eval and Triton load with the features that
use them (extras "train", "eval", "triton"; see `_plumbing.extras`).

`save_pretrained` / `push_to_hub` are Transformers' own (the folder loads where mhmoe is installed); a folder that
loads with `trust_remote_code=True` without mhmoe is written by `mhmoe.hub.export_pretrained` / `mhmoe-export`.
"""

from typing import TYPE_CHECKING

from ._plumbing import interrupts as _interrupts

_interrupts.install_in_console_script()  # first: Ctrl-C while the rest of mhmoe imports is held (a no-op in a library)

from ._plumbing.lazy import lazy_exports  # noqa: E402
from ._plumbing.peft_defaults import install as _install_peft_defaults  # noqa: E402
from ._plumbing.registration import install as _install_registration  # noqa: E402
from ._plumbing.registration import register_auto_classes  # noqa: E402
from ._plumbing.version import __version__ as __version__  # noqa: E402

_EXPORTS = {
    **dict.fromkeys(("MHMoEConfig",), ".models.mhmoe.configuration_mhmoe"),
    **dict.fromkeys(("MHMoEForCausalLM", "MHMoEModel", "MHMoEPreTrainedModel"), ".models.mhmoe.modeling_mhmoe"),
    **dict.fromkeys(("MoELayerCost", "matched_moe_settings", "moe_layer_cost"), ".models.mhmoe.parity"),
    **dict.fromkeys(("from_llama_config", "from_mixtral_config", "matched_to_smoe"), ".models.mhmoe.matching"),
    **dict.fromkeys(("MoHLlamaConfig",), ".models.moh_llama.configuration_moh_llama"),
    **dict.fromkeys(("MoHLlamaForCausalLM", "MoHLlamaModel"), ".models.moh_llama.modeling_moh_llama"),
    "apply_moh": ".models.moh_llama.patch",
    **dict.fromkeys(("expert_load", "head_load", "plot_load"), ".evaluation.analysis"),
}
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)

if TYPE_CHECKING:
    from .evaluation.analysis import expert_load, head_load, plot_load
    from .models.mhmoe.configuration_mhmoe import MHMoEConfig
    from .models.mhmoe.matching import from_llama_config, from_mixtral_config, matched_to_smoe
    from .models.mhmoe.modeling_mhmoe import MHMoEForCausalLM, MHMoEModel, MHMoEPreTrainedModel
    from .models.mhmoe.parity import MoELayerCost, matched_moe_settings, moe_layer_cost
    from .models.moh_llama.configuration_moh_llama import MoHLlamaConfig
    from .models.moh_llama.modeling_moh_llama import MoHLlamaForCausalLM, MoHLlamaModel
    from .models.moh_llama.patch import apply_moh

# The Auto classes learn "mhmoe" and "moh_llama", and PEFT their default LoRA targets, as soon as Transformers / PEFT
# load those tables (post-import hooks: nothing is imported here).
_install_registration()
_install_peft_defaults()

__all__ = [
    "MHMoEConfig",
    "MHMoEForCausalLM",
    "MHMoEModel",
    "MHMoEPreTrainedModel",
    "MoELayerCost",
    "matched_moe_settings",
    "moe_layer_cost",
    "from_llama_config",
    "from_mixtral_config",
    "matched_to_smoe",
    "MoHLlamaConfig",
    "MoHLlamaForCausalLM",
    "MoHLlamaModel",
    "apply_moh",
    "expert_load",
    "head_load",
    "plot_load",
    "register_auto_classes",
]
