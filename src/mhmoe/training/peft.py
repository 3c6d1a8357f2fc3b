"""PEFT integration: default LoRA targets for mhmoe / moh_llama and LoRA on the 3-D expert weights.

Default target modules for model types "mhmoe" and "moh_llama" are in PEFT's per-model-type tables as soon as both
mhmoe and peft are imported, in either order (`mhmoe._plumbing.peft_defaults`; `import mhmoe` itself does not import PEFT), so
`get_peft_model(model, LoraConfig(r=8))` works without naming targets. The LoRA default is every attention projection
(q/k/v/o_proj; moh_llama has Llama's names).

Experts are stored as 3-D parameters (`mlp.experts.gate_up_proj` (E, 2I, W), `mlp.experts.down_proj` (E, W, I)),
which `target_modules` cannot reach: PEFT adapts them through `target_parameters` (its `ParamWrapper`: one rank-r
LoRA per expert, no dropout, no DoRA, the delta rebuilt every forward). PEFT has no per-model-type table for
`target_parameters`, so `lora_config(model)` below adds them: it is what `mhmoe-train --lora` uses.

MoH head routers (`self_attn.head_router`, the learned and fitted routers' W_r, W_s, W_h) are parameters outside any
Linear: with `routers=True` they train in full beside the adapters (PEFT's `modules_to_save`; a few rows of
`hidden_size` per layer), saved in the adapter and merged back; a frozen router could not adapt its routing.
"""

from __future__ import annotations

from .._plumbing.extras import require

require("train", "peft", feature="mhmoe.training.peft")

from peft import LoraConfig
from peft.utils import constants as _constants

from .._plumbing.peft_defaults import ATTENTION_TARGETS, MODEL_TYPES

EXPERT_PARAMETERS = ("gate_up_proj", "down_proj")


def expert_target_parameters(model) -> list[str]:
    """The `target_parameters` suffixes that reach the 3-D expert weights of `model` ([] when it has no experts)."""
    suffixes = set()
    for module_name, module in model.named_modules():
        for param_name, param in module.named_parameters(recurse=False):
            if param_name in EXPERT_PARAMETERS and param.dim() == 3:
                suffixes.add(f"{module_name.rsplit('.', 1)[-1]}.{param_name}")
    return sorted(suffixes)


def router_modules(model) -> list[str]:
    """The `modules_to_save` names of `model`'s MoH head routers that have parameters ([] for parameter-free ones)."""
    return sorted(
        {
            name.rsplit(".", 1)[-1]
            for name, module in model.named_modules()
            if name.endswith("self_attn.head_router") and any(True for _ in module.parameters(recurse=False))
        }
    )


def lora_config(
    model,
    r: int = 8,
    lora_alpha: int = 16,
    lora_dropout: float = 0.0,
    target_modules: list[str] | str | None = None,
    experts: bool = True,
    routers: bool = True,
    **kwargs,
) -> LoraConfig:
    """A `LoraConfig` for an mhmoe / moh_llama model: attention projections (or `target_modules`) and, with
    `experts=True`, every expert's `gate_up_proj` and `down_proj` through PEFT's `target_parameters`; with
    `routers=True`, the MoH head routers with parameters trained in full (`modules_to_save`).
    BitNet models: LoRA trains full-precision adapters beside the quantised projections (PEFT wraps `BitLinear` as a
    Linear; expert deltas join the latent weights before quantisation); packed exports are refused."""
    from ..models.mhmoe.linear_types import linear_class

    config = getattr(model, "config", None)
    refusal = linear_class(config).training_refusal(config)  # e.g. a packed BitNet export's
    if refusal:
        raise ValueError(refusal)
    if isinstance(target_modules, (list, tuple)):  # names given by hand: each must name a module of this model
        modules = dict(model.named_modules())
        names = {name.rsplit(".", 1)[-1] for name in modules}
        missing = [name for name in target_modules if name not in names]
        if missing:
            linear = sorted({n.rsplit(".", 1)[-1] for n, m in modules.items() if type(m).__name__ == "Linear"})
            raise ValueError(f"target_modules {missing} match no module of this model; its linear layers: {linear}")
    if target_modules is None:
        model_type = getattr(getattr(model, "config", None), "model_type", None)
        target_modules = _constants.TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING.get(model_type)
        if target_modules is None:
            target_modules = list(ATTENTION_TARGETS)
    target_parameters = expert_target_parameters(model) if experts else []
    if target_parameters and lora_dropout:
        raise ValueError(
            f"lora_dropout={lora_dropout}: PEFT's LoRA on expert parameters (target_parameters) has no dropout; use "
            "lora_dropout=0 or leave the experts out"
        )
    trained_in_full = router_modules(model) if routers else []
    if trained_in_full:
        kwargs["modules_to_save"] = sorted({*(kwargs.get("modules_to_save") or ()), *trained_in_full})
    return LoraConfig(
        r=r,
        lora_alpha=lora_alpha,
        lora_dropout=lora_dropout,
        target_modules=target_modules,
        target_parameters=target_parameters or None,
        task_type="CAUSAL_LM",
        **kwargs,
    )


__all__ = ["ATTENTION_TARGETS", "MODEL_TYPES", "expert_target_parameters", "lora_config", "router_modules"]
