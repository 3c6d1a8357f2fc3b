"""mhmoe: Multi-Head Mixture-of-Experts and Mixture-of-Head attention as Hugging Face Transformers models.

Importing the package registers model_types "mhmoe" and "moh_llama" with AutoConfig, AutoModel and
AutoModelForCausalLM. It imports torch and transformers (and what they import) and nothing else: training (accelerate,
peft, matplotlib), lm-eval and Triton load with the features that use them (extras "train", "eval", "triton"; see
`mhmoe.extras`).
"""

from transformers import AutoConfig, AutoModel, AutoModelForCausalLM

from .models.mhmoe import (
    MHMoEConfig,
    MHMoEForCausalLM,
    MHMoEModel,
    MHMoEPreTrainedModel,
    MoELayerCost,
    matched_moe_settings,
    moe_layer_cost,
)
from .models.moh_llama import MoHLlamaConfig, MoHLlamaForCausalLM, MoHLlamaModel
from .analysis import expert_load, head_load, plot_load
from .patch import apply_moh
from .peft_defaults import install as _install_peft_defaults

AutoConfig.register(MHMoEConfig.model_type, MHMoEConfig, exist_ok=True)
AutoModel.register(MHMoEConfig, MHMoEModel, exist_ok=True)
AutoModelForCausalLM.register(MHMoEConfig, MHMoEForCausalLM, exist_ok=True)
AutoConfig.register(MoHLlamaConfig.model_type, MoHLlamaConfig, exist_ok=True)
AutoModel.register(MoHLlamaConfig, MoHLlamaModel, exist_ok=True)
AutoModelForCausalLM.register(MoHLlamaConfig, MoHLlamaForCausalLM, exist_ok=True)

# default PEFT targets for "mhmoe" / "moh_llama", filled in when PEFT is imported (mhmoe.peft_defaults); no peft here
_install_peft_defaults()

__version__ = "0.1.0"
__all__ = [
    "MHMoEConfig", "MHMoEForCausalLM", "MHMoEModel", "MHMoEPreTrainedModel",
    "MoELayerCost", "matched_moe_settings", "moe_layer_cost",
    "MoHLlamaConfig", "MoHLlamaForCausalLM", "MoHLlamaModel", "apply_moh",
    "expert_load", "head_load", "plot_load",
]  # fmt: skip
