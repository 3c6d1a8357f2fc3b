"""mhmoe: Multi-Head Mixture-of-Experts and Mixture-of-Head attention as Hugging Face Transformers models.

`import mhmoe` is light: it imports neither torch nor Transformers. The public names load with the module that defines
them on first use (`mhmoe.lazy`), and the model types "mhmoe" and "moh_llama" are registered with AutoConfig, AutoModel
and AutoModelForCausalLM as soon as Transformers loads those classes (`mhmoe.registration`), so
`import mhmoe; AutoModelForCausalLM.from_pretrained(path)` works in either import order. Training (accelerate, peft,
matplotlib), lm-eval and Triton load with the features that use them (extras "train", "eval", "triton"; see
`mhmoe.extras`).
"""

from typing import TYPE_CHECKING

from .lazy import lazy_exports
from .peft_defaults import install as _install_peft_defaults
from .registration import install as _install_registration
from .registration import register_auto_classes

__version__ = "0.1.0"

_EXPORTS = {
    **dict.fromkeys(("MHMoEConfig",), ".models.mhmoe.configuration_mhmoe"),
    **dict.fromkeys(("MHMoEForCausalLM", "MHMoEModel", "MHMoEPreTrainedModel"), ".models.mhmoe.modeling_mhmoe"),
    **dict.fromkeys(("MoELayerCost", "matched_moe_settings", "moe_layer_cost"), ".models.mhmoe.parity"),
    **dict.fromkeys(("MoHLlamaConfig",), ".models.moh_llama.configuration_moh_llama"),
    **dict.fromkeys(("MoHLlamaForCausalLM", "MoHLlamaModel"), ".models.moh_llama.modeling_moh_llama"),
    **dict.fromkeys(("expert_load", "head_load", "plot_load"), ".analysis"),
    "apply_moh": ".patch",
}
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)

if TYPE_CHECKING:
    from .analysis import expert_load, head_load, plot_load
    from .models.mhmoe.configuration_mhmoe import MHMoEConfig
    from .models.mhmoe.modeling_mhmoe import MHMoEForCausalLM, MHMoEModel, MHMoEPreTrainedModel
    from .models.mhmoe.parity import MoELayerCost, matched_moe_settings, moe_layer_cost
    from .models.moh_llama.configuration_moh_llama import MoHLlamaConfig
    from .models.moh_llama.modeling_moh_llama import MoHLlamaForCausalLM, MoHLlamaModel
    from .patch import apply_moh

# Auto-class registration and PEFT's default targets for "mhmoe" / "moh_llama": post-import hooks, nothing imported here
_install_registration()
_install_peft_defaults()

__all__ = [
    "MHMoEConfig", "MHMoEForCausalLM", "MHMoEModel", "MHMoEPreTrainedModel",
    "MoELayerCost", "matched_moe_settings", "moe_layer_cost",
    "MoHLlamaConfig", "MoHLlamaForCausalLM", "MoHLlamaModel", "apply_moh",
    "expert_load", "head_load", "plot_load", "register_auto_classes",
]  # fmt: skip
