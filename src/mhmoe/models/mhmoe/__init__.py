"""MH-MoE: `MHMoEConfig`, the models, the parity helpers and the configs built to match another model; loaded on first
use (`mhmoe._plumbing.lazy`)."""

from typing import TYPE_CHECKING

from ..._plumbing.lazy import lazy_exports

__getattr__, __dir__ = lazy_exports(
    __name__,
    {
        "MHMoEConfig": ".configuration_mhmoe",
        **dict.fromkeys(("MHMoEForCausalLM", "MHMoEModel", "MHMoEPreTrainedModel"), ".modeling_mhmoe"),
        **dict.fromkeys(("MoELayerCost", "matched_moe_settings", "moe_layer_cost"), ".parity"),
        **dict.fromkeys(
            ("conventions_fields", "from_llama_config", "from_mixtral_config", "matched_to_smoe"), ".matching"
        ),
    },
)

if TYPE_CHECKING:
    from .configuration_mhmoe import MHMoEConfig
    from .matching import conventions_fields, from_llama_config, from_mixtral_config, matched_to_smoe
    from .modeling_mhmoe import MHMoEForCausalLM, MHMoEModel, MHMoEPreTrainedModel
    from .parity import MoELayerCost, matched_moe_settings, moe_layer_cost

__all__ = [
    "MHMoEConfig",
    "MHMoEForCausalLM",
    "MHMoEModel",
    "MHMoEPreTrainedModel",
    "MoELayerCost",
    "matched_moe_settings",
    "moe_layer_cost",
    "conventions_fields",
    "from_llama_config",
    "from_mixtral_config",
    "matched_to_smoe",
]
