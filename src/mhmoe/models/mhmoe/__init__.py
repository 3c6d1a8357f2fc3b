from .configuration_mhmoe import MHMoEConfig
from .modeling_mhmoe import MHMoEForCausalLM, MHMoEModel, MHMoEPreTrainedModel
from .parity import MoELayerCost, matched_moe_settings, moe_layer_cost

__all__ = [
    "MHMoEConfig", "MHMoEForCausalLM", "MHMoEModel", "MHMoEPreTrainedModel",
    "MoELayerCost", "matched_moe_settings", "moe_layer_cost",
]  # fmt: skip
