"""MoH-LLaMA: `MoHLlamaConfig` and the models; loaded on first use (`mhmoe._plumbing.lazy`)."""

from typing import TYPE_CHECKING

from ..._plumbing.lazy import lazy_exports

__getattr__, __dir__ = lazy_exports(
    __name__,
    {
        "MoHLlamaConfig": ".configuration_moh_llama",
        **dict.fromkeys(
            ("MoHCausalLMOutputWithPast", "MoHLlamaForCausalLM", "MoHLlamaModel", "MoHLlamaPreTrainedModel"),
            ".modeling_moh_llama",
        ),
    },
)

if TYPE_CHECKING:
    from .configuration_moh_llama import MoHLlamaConfig
    from .modeling_moh_llama import (
        MoHCausalLMOutputWithPast,
        MoHLlamaForCausalLM,
        MoHLlamaModel,
        MoHLlamaPreTrainedModel,
    )

__all__ = [
    "MoHCausalLMOutputWithPast",
    "MoHLlamaConfig",
    "MoHLlamaForCausalLM",
    "MoHLlamaModel",
    "MoHLlamaPreTrainedModel",
]
