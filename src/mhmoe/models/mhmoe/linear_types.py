"""`linear_type`: how an MHMoE model builds its decoder projections and routed experts. `LINEAR_TYPES` maps the name to
a class with `linear(config, in_features, out_features, bias, role, sublayer_in)`, `experts(config)` and
`config_problems(config)` (its own fields, in words). What the rest of mhmoe needs to know about a kind, the class says
too, and callers ask `linear_class(config)` instead of naming it: `card_rows(config)` (the model card's rows for it),
`export_transform(config)` (what an export does to the model before writing it, or None), `training_refusal(config)`
(why LoRA cannot train such a model, in words, or None) and `official_fields` (the official MH-MoE code's conventions
for it, `matching.conventions_fields`). A new kind is a class and an entry here.

Roles (`bitnet.QUANTIZED_ROLES`): "attention" (q/k/v/o), "ffn" (dense MLPs and the shared expert), "experts",
"head_merge" (MH-MoE's head and merge layers). `sublayer_in`: an input projection of its sub-layer (q/k/v, gate/up).
"""

from torch import nn

from .bitnet import BitNetB158
from .experts import MHMoEExperts


class Linear:
    """`linear_type="linear"`: `nn.Linear` projections and full-precision SwiGLU experts (`experts.MHMoEExperts`)."""

    @staticmethod
    def linear(
        config, in_features: int, out_features: int, bias: bool = False, role: str = "attention", sublayer_in=False
    ) -> nn.Module:
        return nn.Linear(in_features, out_features, bias=bias)

    @staticmethod
    def experts(config) -> nn.Module:
        return MHMoEExperts(config)

    @staticmethod
    def config_problems(config) -> list[str]:
        return []

    official_fields = {}  # the official code's conventions add nothing for full-precision projections

    @staticmethod
    def card_rows(config) -> list[tuple[str, str]]:
        return []

    @staticmethod
    def export_transform(config):
        """None: an export writes the weights as they are."""
        return None

    @staticmethod
    def training_refusal(config):
        """None: its weights train."""
        return None


LINEAR_TYPES = {"linear": Linear, "bitnet_b158": BitNetB158}


def linear_class(config) -> type:
    """The class of `config.linear_type` (`config`: a config or its dict); `Linear` for a config without that field
    (another model's, MoH-LLaMA's) or a name not registered (`linear_type_problems` refuses it when the config is
    built)."""
    name = config.get("linear_type") if isinstance(config, dict) else getattr(config, "linear_type", None)
    return LINEAR_TYPES.get(name, Linear)


def make_linear(
    config, in_features: int, out_features: int, bias: bool = False, role: str = "attention", sublayer_in=False
) -> nn.Module:
    """The decoder projection of `role` that `config.linear_type` builds (`sublayer_in`: q/k/v or gate/up)."""
    return LINEAR_TYPES[config.linear_type].linear(config, in_features, out_features, bias, role, sublayer_in)


def make_experts(config) -> nn.Module:
    """The routed experts of a top-k MoE block that `config.linear_type` builds."""
    return LINEAR_TYPES[config.linear_type].experts(config)


def linear_type_problems(config) -> list[str]:
    """`linear_type` and every kind's own fields, in words."""
    problems = []
    if config.linear_type not in LINEAR_TYPES:
        problems.append(f"linear_type must be one of {tuple(LINEAR_TYPES)}, got {config.linear_type!r}")
    for kind in LINEAR_TYPES.values():
        problems += kind.config_problems(config)
    return problems


__all__ = ["LINEAR_TYPES", "Linear", "linear_class", "linear_type_problems", "make_experts", "make_linear"]
