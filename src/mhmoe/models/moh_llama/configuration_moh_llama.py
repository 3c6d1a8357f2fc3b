"""MoH-LLaMA configuration: a LlamaConfig with the Mixture-of-Head attention fields."""

from huggingface_hub.dataclasses import strict
from transformers.models.llama.configuration_llama import LlamaConfig

# One source of truth for the moh_* validation (a later export step copies it next to this file).
from ..mhmoe.configuration_mhmoe import OverridesBeforeChecks, moh_config_problems, refuse_auto_class_registration
from ..mhmoe.plans import ConfigPlan, moh_has_module


@strict
class MoHLlamaConfig(OverridesBeforeChecks, LlamaConfig):
    r"""`LlamaConfig` plus Mixture-of-Head attention.

    The first `moh_shared_heads` heads of every layer are always on; per token the router activates
    `moh_active_heads` of the other heads. Defaults follow the paper's continue-tuning recipe for LLaMA3 (§4.4):
    the parameter-free `"l2"` router (pre-RoPE query norms) with straight-through 0/1 gates, which adds no parameters,
    so a dense Llama checkpoint loads as is:
    `MoHLlamaForCausalLM.from_pretrained(llama_dir, moh_shared_heads=16, moh_active_heads=8)`.
    `moh_router="learned"` adds the two-stage router of eq. 5-6 (zero-initialised: every gate starts at 1).
    `moh_aux_loss_coef` weights the head load-balancing loss (eq. 7) when `output_router_logits` is on.
    `moh_router="l2_standardized"` / `"l2_relative"` score each routed head's query norm against its own calibration
    statistics `moh_head_norm_mean` / `moh_head_norm_std` (per layer, per head: plain lists, no parameters), measured
    by `mhmoe-convert --calibration_file`.
    """

    model_type = "moh_llama"
    # Llama's plan plus the MoH head router, which gathers the (B, T, H) head scores across ranks (moh_parallel.py);
    # a config without MoH gives no head-router rule (plans.py)
    base_model_tp_plan = ConfigPlan(
        {**LlamaConfig.base_model_tp_plan, "layers.*.self_attn.head_router": "moh_head_router"}, moh_has_module
    )

    moh_shared_heads: int | None = None
    moh_active_heads: int | None = None
    moh_router: str = "l2"
    moh_straight_through: bool | str = True  # True | False | "scores" (eq. 9-10, l2 router): see MHMoEConfig
    moh_aux_loss_coef: float | int = 0.01
    output_router_logits: bool = False
    moh_head_norm_mean: list | None = None
    moh_head_norm_std: list | None = None

    def validate_architecture(self):
        super().validate_architecture()
        problems = moh_config_problems(self)
        if problems:
            raise ValueError("Invalid MoHLlamaConfig: " + "; ".join(problems) + ".")

    @classmethod
    def register_for_auto_class(cls, auto_class="AutoConfig"):
        refuse_auto_class_registration(cls)
        super().register_for_auto_class(auto_class)


__all__ = ["MoHLlamaConfig"]
