"""MoH-LLaMA configuration: a LlamaConfig with the Mixture-of-Head attention fields."""

from huggingface_hub.dataclasses import strict
from transformers.models.llama.configuration_llama import LlamaConfig

from ..config_checks import (
    CheckedOverrides,
    check_keyword_arguments,
    raise_problems,
    rope_problems,
    size_problems,
    token_id_problems,
)
from ..mhmoe.plans import ConfigPlan, moh_has_module
from ..moh.moh_config import MoHConfigFields, moh_config_problems


def refuse_auto_class_registration(cls: type) -> None:
    """moh_llama's files import the shared MoH package from outside their folder, which Transformers' `save_pretrained`
    cannot copy after `register_for_auto_class`; the exported copies (flattened imports, loaded as
    `transformers_modules...`) register normally."""
    if cls.__module__.startswith("mhmoe."):
        raise ValueError(
            f"{cls.__name__}.register_for_auto_class: Transformers cannot copy moh_llama's modeling code, which shares "
            "files with the MoH package. Export with `mhmoe.hub.export_pretrained(model, save_directory)` or "
            "`mhmoe-export SRC_DIR OUT_DIR` instead: it writes the code and the auto_map for AutoConfig, AutoModel and "
            "AutoModelForCausalLM (and `push_to_hub=` uploads the folder)"
        )


LEGACY_SIGMA = "moh_head_norm_std"  # moh_head_norm_sigma's name in configs saved before 0.1.0


@strict
class MoHLlamaConfig(CheckedOverrides, LlamaConfig, MoHConfigFields):
    r"""`LlamaConfig` plus Mixture-of-Head attention.

    The first `moh_shared_heads` heads of every layer are always on; per token the router activates
    `moh_active_heads` of the other heads. Defaults follow the paper's continue-tuning recipe for LLaMA3 (§4.4):
    the parameter-free `"l2"` router (pre-RoPE query norms) with straight-through 0/1 gates, which adds no parameters,
    so a dense Llama checkpoint loads as is:
    `MoHLlamaForCausalLM.from_pretrained(llama_dir, moh_shared_heads=16, moh_active_heads=8)`.
    `moh_router="learned"` adds the two-stage router of eq. 5-6 (zero-initialised: every gate starts at 1).
    `moh_aux_loss_coef` weights the head load-balancing loss (eq. 7) when `output_router_logits` is on.
    The calibrated routers (`models/moh/head_routers.py`) score each routed head's query norm against its own
    calibration statistics `moh_head_norm_mean` / `moh_head_norm_sigma` (per layer, per head: plain lists, no
    parameters), measured by `mhmoe-convert --calibration_file`. (`moh_head_norm_sigma` was `moh_head_norm_std`, a name
    Transformers' tests read as an initialisation std; configs saved with it load as before.)
    """

    model_type = "moh_llama"
    # Llama's plan plus the MoH head router, which gathers the (B, T, H) head scores across ranks (moh_parallel.py);
    # a config without MoH gives no head-router rule (plans.py)
    base_model_tp_plan = ConfigPlan(
        {**LlamaConfig.base_model_tp_plan, "layers.*.self_attn.head_router": "moh_head_router"}, moh_has_module
    )

    output_router_logits: bool = False

    def __post_init__(self, **kwargs):
        legacy = kwargs.pop(LEGACY_SIGMA, None)  # a config saved before the rename
        if legacy is not None and self.moh_head_norm_sigma is None:
            self.moh_head_norm_sigma = legacy
        check_keyword_arguments(type(self), kwargs)
        raise_problems(self, size_problems(self))  # LlamaConfig divides by num_attention_heads
        super().__post_init__(**kwargs)
        self.validate_architecture()  # a ValueError (from the strict validators: huggingface_hub's own error class)

    def validate_architecture(self):
        super().validate_architecture()
        raise_problems(self, size_problems(self) + rope_problems(self) + token_id_problems(self))
        raise_problems(self, moh_config_problems(self))

    @classmethod
    def register_for_auto_class(cls, auto_class="AutoConfig"):
        refuse_auto_class_registration(cls)
        super().register_for_auto_class(auto_class)


__all__ = ["MoHLlamaConfig", "refuse_auto_class_registration"]
