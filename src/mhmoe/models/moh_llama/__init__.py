from .configuration_moh_llama import MoHLlamaConfig
from .modeling_moh_llama import MoHCausalLMOutputWithPast, MoHLlamaForCausalLM, MoHLlamaModel, MoHLlamaPreTrainedModel

__all__ = [
    "MoHCausalLMOutputWithPast", "MoHLlamaConfig", "MoHLlamaForCausalLM", "MoHLlamaModel", "MoHLlamaPreTrainedModel",
]  # fmt: skip
