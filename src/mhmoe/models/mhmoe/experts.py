"""The SwiGLU experts of an MH-MoE block (`linear_type="linear"`), stored like Mixtral's, and how Transformers'
`experts_implementation` reaches the library's experts op (`ops/backends.py`).

Shape legend: N routed rows (tokens × moe_heads sub-tokens), W = hidden_size // moe_heads, E experts, K experts per
row, I = moe_intermediate_size. Weights `gate_up_proj` (E, 2I, W), `down_proj` (E, W, I). Expert id E marks an
assignment dropped by capacity routing.
"""

import functools

import torch
from torch import nn
from transformers.activations import ACT2FN
from transformers.integrations import use_experts_implementation
from transformers.integrations.moe import ExpertsInterface
from transformers.integrations.moe import grouped_mm_experts_forward as _TRANSFORMERS_GROUPED_MM

from ..ops.backends import EXPERTS_BACKENDS, experts


def sub_token_width(config) -> int:
    """W: the width of the sub-tokens an MoE block routes, hidden_size // moe_heads (the experts' and routers' input)."""
    return config.hidden_size // config.moe_heads


# experts_implementation values that only this library knows (Transformers' own table has the others)
LIBRARY_EXPERTS_IMPLEMENTATIONS = ("triton",)


def _library_forward(implementation: str):
    """The experts function of `experts_implementation=implementation`: the experts op on that backend."""

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor):
        config = getattr(self, "config", None)
        return experts(
            hidden_states,
            top_k_index,
            top_k_weights,
            self.gate_up_proj,
            self.down_proj,
            self.act_fn,
            backend=EXPERTS_BACKENDS[implementation],
            routing_backend=getattr(config, "routing_backend", None),
            may_drop=getattr(config, "capacity_factor", None) is not None,
        )

    forward.__name__ = f"{implementation}_experts_forward"
    return forward


# experts_implementation -> the experts function of the library's experts op ("eager" is the module's own forward)
LIBRARY_EXPERTS_FUNCTIONS = {name: _library_forward(name) for name in ("grouped_mm", *LIBRARY_EXPERTS_IMPLEMENTATIONS)}
grouped_experts_forward = LIBRARY_EXPERTS_FUNCTIONS["grouped_mm"]


def eager_experts_forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor):
    """The "eager" experts implementation: the experts op's naive reference, a loop over the experts."""
    return experts(
        hidden_states, top_k_index, top_k_weights, self.gate_up_proj, self.down_proj, self.act_fn, backend="naive"
    )


def _drop_sentinels(experts_forward):
    """Adapt a Transformers experts function (no dropped-assignment sentinel) to capacity routing."""

    def forward(self, hidden_states, top_k_index, top_k_weights):
        dropped = top_k_index >= self.num_experts
        top_k_index = top_k_index.masked_fill(dropped, 0)
        top_k_weights = top_k_weights.masked_fill(dropped, 0.0)
        return experts_forward(self, hidden_states, top_k_index, top_k_weights)

    forward.__wrapped__ = experts_forward
    return forward


@functools.cache
def _adapted(function):
    return _drop_sentinels(function)


class MHMoEExpertsInterface(ExpertsInterface):
    """Transformers' experts interface, read live, for MH-MoE's experts: "eager" is the naive loop, "grouped_mm" and
    "triton" the library's experts op on that backend (capacity-aware), and any other function registered with
    `ALL_EXPERTS_FUNCTIONS` (or `ExpertsInterface.register`) at any time, or a patched global entry, runs as
    Transformers runs it, adapted to capacity routing's dropped-assignment sentinel. A user's global replacement of
    "grouped_mm" is what runs."""

    def get_interface(self, experts_implementation: str, default):
        if experts_implementation in self._local_mapping:  # set on this instance: used as is
            return self._local_mapping[experts_implementation]
        if experts_implementation in LIBRARY_EXPERTS_IMPLEMENTATIONS:
            return LIBRARY_EXPERTS_FUNCTIONS[experts_implementation]
        function = super().get_interface(experts_implementation, default)  # Transformers' checks and lookup
        if function is default:
            return function
        if experts_implementation == "grouped_mm" and function is _TRANSFORMERS_GROUPED_MM:
            return grouped_experts_forward
        return _adapted(function)


MHMOE_EXPERTS_FUNCTIONS = MHMoEExpertsInterface()


@use_experts_implementation(experts_interface=MHMOE_EXPERTS_FUNCTIONS)
class MHMoEExperts(nn.Module):
    """`num_experts` SwiGLU experts on sub-tokens of width W, stored as 3-D parameters like Mixtral's."""

    def __init__(self, config):
        super().__init__()
        self.num_experts = config.num_experts
        self.hidden_dim = sub_token_width(config)
        self.intermediate_dim = config.moe_intermediate_size
        self.gate_up_proj = nn.Parameter(torch.empty(self.num_experts, 2 * self.intermediate_dim, self.hidden_dim))
        self.down_proj = nn.Parameter(torch.empty(self.num_experts, self.hidden_dim, self.intermediate_dim))
        self.act_fn = ACT2FN[config.hidden_act]

    @torch.no_grad()
    def init_parameters(self, std: float) -> None:
        self.gate_up_proj.normal_(mean=0.0, std=std)
        self.down_proj.normal_(mean=0.0, std=std)

    def forward(self, hidden_states, top_k_index, top_k_weights):  # "eager"; "grouped_mm" is the default
        return eager_experts_forward(self, hidden_states, top_k_index, top_k_weights)


__all__ = [
    "LIBRARY_EXPERTS_FUNCTIONS",
    "LIBRARY_EXPERTS_IMPLEMENTATIONS",
    "MHMOE_EXPERTS_FUNCTIONS",
    "MHMoEExperts",
    "MHMoEExpertsInterface",
    "eager_experts_forward",
    "grouped_experts_forward",
    "sub_token_width",
]
