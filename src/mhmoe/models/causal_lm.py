"""The causal-LM forward shared by MHMoEForCausalLM, MoHLlamaForCausalLM and the Llama-family models `apply_moh`
patches: base model → LM head → LM loss + router losses (`add_router_losses`: the MoE routers' `mhmoe/moe_losses.py`,
the MoH head routers' `moh/moh_losses.py`), and the output classes.

This file runs on torch + transformers alone: exported checkpoints ship it next to the modeling file.
"""

import types
from dataclasses import dataclass

import torch
from transformers.cache_utils import Cache
from transformers.modeling_outputs import CausalLMOutputWithPast, MoeCausalLMOutputWithPast
from transformers.processing_utils import Unpack
from transformers.utils import TransformersKwargs, can_return_tuple

from .cache_naming import CACHE, either_cache
from .mhmoe.moe_losses import load_balancing_loss, router_z_loss
from .moh.moh_config import moh_enabled
from .moh.moh_losses import moh_load_balancing_loss


@dataclass
class MoHCausalLMOutputWithPast(CausalLMOutputWithPast):
    """Llama's causal-LM output plus the (unweighted) MoH load-balancing loss and the head-router logits."""

    moh_aux_loss: torch.FloatTensor | None = None
    moh_router_logits: tuple[torch.FloatTensor, ...] | None = None


@dataclass
class MHMoECausalLMOutputWithPast(MoeCausalLMOutputWithPast):
    """Mixtral's output plus the router z-loss and the MoH head load-balancing loss (both unweighted, kept apart so
    training can log them) and the MoH head-router logits."""

    z_loss: torch.FloatTensor | None = None
    moh_aux_loss: torch.FloatTensor | None = None
    moh_router_logits: tuple[torch.FloatTensor, ...] | None = None


def add_router_losses(loss, config, attention_mask=None, router_logits=None, moh_router_logits=None):
    """(`loss` + the weighted router losses, {"aux_loss", "z_loss", "moh_aux_loss"} unweighted).

    From the MoE routers' logits: `aux_loss` (×`router_aux_loss_coef`) and `z_loss` (×`router_z_loss_coef`); from the
    MoH head routers' logits: `moh_aux_loss` (×`moh_aux_loss_coef`). A loss whose logits are not given (not requested,
    or no such layer) is None; `loss` None (no labels) stays None.
    """
    losses = {"aux_loss": None, "z_loss": None, "moh_aux_loss": None}
    coefficients = {}
    if router_logits:
        losses["aux_loss"] = load_balancing_loss(
            router_logits,
            config.num_experts,
            config.num_experts_per_tok,
            attention_mask,
            config.moe_heads,
            config.router_aux_loss_mode,
        )
        losses["z_loss"] = router_z_loss(router_logits, attention_mask, config.moe_heads)
        coefficients.update(aux_loss=config.router_aux_loss_coef, z_loss=config.router_z_loss_coef)
    if moh_router_logits:
        active = getattr(config, "moh_active_heads_per_layer", None) or config.moh_active_heads
        thresholds = getattr(config, "moh_head_thresholds", None)
        losses["moh_aux_loss"] = moh_load_balancing_loss(moh_router_logits, active, attention_mask, thresholds)
        coefficients["moh_aux_loss"] = config.moh_aux_loss_coef
    if loss is not None:
        for name, coefficient in coefficients.items():
            loss = loss + coefficient * losses[name].to(loss.device)
    return loss, losses


def _causal_lm_forward(
    self,
    input_ids: torch.LongTensor | None = None,
    attention_mask: torch.Tensor | None = None,
    position_ids: torch.LongTensor | None = None,
    cache: Cache | None = None,
    inputs_embeds: torch.Tensor | None = None,
    labels: torch.LongTensor | None = None,
    use_cache: bool | None = None,
    output_router_logits: bool | None = None,
    logits_to_keep: int | torch.Tensor = 0,
    past_key_values: Cache | None = None,
    **kwargs: Unpack[TransformersKwargs],
):
    """Causal LM forward. With `output_router_logits` (argument or config) it returns the unweighted router losses the
    model has (MoE: `aux_loss`, `z_loss`; MoH: `moh_aux_loss`) and, when `labels` are given, adds them to the LM loss
    weighted by `router_aux_loss_coef`, `router_z_loss_coef` and `moh_aux_loss_coef`. The output class is the model
    class's `causal_lm_output_class` (default `MoHCausalLMOutputWithPast`). The key/value cache comes as `cache` or as
    `past_key_values` (its name before Transformers 5.24) and is returned under the installed version's name."""
    config = self.config
    if output_router_logits is None:
        output_router_logits = getattr(config, "output_router_logits", False)
    if moh_enabled(config):
        kwargs.setdefault("output_moh_router_logits", output_router_logits)
    if "router_logits" in getattr(self.model, "_can_record_outputs", {}):  # a base model with MoE routers
        kwargs["output_router_logits"] = output_router_logits
    outputs = self.model(
        input_ids=input_ids,
        attention_mask=attention_mask,
        position_ids=position_ids,
        inputs_embeds=inputs_embeds,
        use_cache=use_cache,
        **{CACHE: either_cache(cache, past_key_values)},
        **kwargs,
    )
    slice_indices = slice(-logits_to_keep, None) if isinstance(logits_to_keep, int) else logits_to_keep
    logits = self.lm_head(outputs.last_hidden_state[:, slice_indices, :])
    loss = None
    if labels is not None:
        loss = self.loss_function(logits=logits, labels=labels, vocab_size=config.vocab_size, **kwargs)
    # router logits are recorded by capture_outputs (`_can_record_outputs`) when requested
    router_logits = (outputs.get("router_logits"), outputs.get("moh_router_logits"))
    loss, router_losses = add_router_losses(
        loss, config, attention_mask, *(router_logits if output_router_logits else ())
    )
    output_class = getattr(self, "causal_lm_output_class", MoHCausalLMOutputWithPast)
    fields = {
        "loss": loss,
        **router_losses,
        "logits": logits,
        CACHE: outputs.get(CACHE),
        "hidden_states": outputs.hidden_states,
        "attentions": outputs.attentions,
        "router_logits": router_logits[0],
        "moh_router_logits": router_logits[1],
    }
    names = output_class.__dataclass_fields__  # (not dataclasses.fields(): torch.compile cannot trace it)
    return output_class(**{name: value for name, value in fields.items() if name in names})


def causal_lm_forward_returning(output_class: type):
    """The causal-LM forward annotated `-> output_class`, for a model class whose `causal_lm_output_class` it is.

    Transformers reads `forward.__annotations__["return"]` (e.g. its MoE tests look for `router_logits` in the output
    class), so each model class gets its own copy of the function with its own output class as the annotation."""
    inner = _causal_lm_forward
    forward = types.FunctionType(
        inner.__code__, inner.__globals__, inner.__name__, inner.__defaults__, inner.__closure__
    )
    forward.__kwdefaults__ = inner.__kwdefaults__
    forward.__doc__, forward.__qualname__, forward.__module__ = inner.__doc__, inner.__qualname__, inner.__module__
    forward.__annotations__ = {**inner.__annotations__, "return": output_class}
    return can_return_tuple(forward)  # functools.wraps: the wrapper carries the same annotations


causal_lm_forward = causal_lm_forward_returning(MoHCausalLMOutputWithPast)  # MoH-Llama and the patched families

__all__ = [
    "MHMoECausalLMOutputWithPast",
    "MoHCausalLMOutputWithPast",
    "add_router_losses",
    "causal_lm_forward",
    "causal_lm_forward_returning",
]
