"""Parallel plans that follow the config.

Transformers reads `config.base_model_tp_plan` / `config.base_model_ep_plan` when it builds a model's plans
(`init_parallel_plans`), and its `test_tp_plan_matches_params` requires every rule to name a module or parameter the
model has. One MHMoE config class covers dense, MoE, MH-MoE and MoH models, so a static plan would list modules a given
config does not build (`mlp.gate_proj` when every layer is MoE, `self_attn.head_router` without MoH, ...).
`ConfigPlan` keeps the full plan on the class (documentation, `ALL_PARALLEL_STYLES` checks) and gives a config
instance only the rules for the modules its model has.
"""

from collections.abc import Callable

# Parallel plans (Transformers' `DistributedConfig(tp_size=..., ep_size=...)`), Mixtral's plus MH-MoE's own layers.
# The expert router (`mlp.gate`) is replicated, as in Mixtral; so are the norms. See docs/training.md.
MHMOE_TP_PLAN = {
    "layers.*.self_attn.q_proj": "colwise",
    "layers.*.self_attn.k_proj": "colwise",
    "layers.*.self_attn.v_proj": "colwise",
    "layers.*.self_attn.o_proj": "rowwise",
    "layers.*.self_attn.head_router": "moh_head_router",  # MoH: gathers the (B, T, H) head scores (moh_parallel.py)
    "layers.*.mlp.gate_proj": "colwise",  # dense layers
    "layers.*.mlp.up_proj": "colwise",
    "layers.*.mlp.down_proj": "rowwise",
    "layers.*.mlp.shared_expert.gate_proj": "colwise",
    "layers.*.mlp.shared_expert.up_proj": "colwise",
    "layers.*.mlp.shared_expert.down_proj": "rowwise",
    "layers.*.mlp.head_proj": "colwise_gather_output",  # the router needs whole sub-tokens on every rank
    "layers.*.mlp.merge_proj": "rowwise_split_input",
    "layers.*.mlp.experts.gate_up_proj": "packed_colwise",  # each rank: a slice of every expert's inner width
    "layers.*.mlp.experts.down_proj": "rowwise",
    "layers.*.mlp.experts": "moe_tp_experts",
}
# Whole experts per rank; sub-tokens (B·T·h rows of width d/h) are what is dispatched to them.
MHMOE_EP_PLAN = {
    "layers.*.mlp.experts.gate_up_proj": "grouped_gemm",
    "layers.*.mlp.experts.down_proj": "grouped_gemm",
    "layers.*.mlp.experts": "ep_dispatch_experts",
}


class ConfigPlan:
    """Descriptor: `ConfigClass.plan` is every rule; `config.plan` only the rules `keep(config, rule)` accepts."""

    def __init__(self, rules: dict, keep: Callable[[object, str], bool]):
        self.rules = dict(rules)
        self.keep = keep

    def __get__(self, config, owner=None) -> dict:
        if config is None:
            return dict(self.rules)
        return {rule: style for rule, style in self.rules.items() if self.keep(config, rule)}


def _layer_module(rule: str) -> str:
    """`layers.*.mlp.experts.down_proj` -> `mlp.experts.down_proj`."""
    return rule.split(".", 2)[2] if rule.startswith("layers.*.") else rule


def mhmoe_has_module(config, rule: str) -> bool:
    """Whether an MHMoE model built from `config` has the module or parameter that plan `rule` names."""
    module = _layer_module(rule)
    layers = range(config.num_hidden_layers)
    any_moe = any(config.is_moe_layer(i) for i in layers)
    any_dense = not all(config.is_moe_layer(i) for i in layers)
    if module == "self_attn.head_router":
        return getattr(config, "moh_active_heads", None) is not None
    if module.startswith("mlp.shared_expert."):
        return any_moe and config.shared_expert_intermediate_size > 0
    if module == "mlp.head_proj":
        return any_moe and bool(config.moe_head_layer)
    if module == "mlp.merge_proj":
        return any_moe and bool(config.moe_merge_layer)
    if module.startswith("mlp.experts") or module == "mlp.gate":
        return any_moe
    if module in ("mlp.gate_proj", "mlp.up_proj", "mlp.down_proj"):
        return any_dense
    return True


def moh_has_module(config, rule: str) -> bool:
    """Llama's modules are always there; the MoH head router only with MoH on."""
    if _layer_module(rule) == "self_attn.head_router":
        return getattr(config, "moh_active_heads", None) is not None
    return True


__all__ = ["MHMOE_EP_PLAN", "MHMOE_TP_PLAN", "ConfigPlan", "mhmoe_has_module", "moh_has_module"]
