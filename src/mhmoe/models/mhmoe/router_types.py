"""`router_type`: which MoE block an MHMoE model's MoE layers are. `ROUTER_TYPES` maps the name to the block class,
built as `Block(config, layer_idx)`, with `config_problems(config)` for its own fields (in words) and `reads_cache`
(whether the decoder layer passes it the key/value cache). What the rest of mhmoe needs to know about a kind, the
class says too, and callers ask `block_class(config)` instead of naming it: `card_rows(config)` (the model card's
rows for it), `layer_cost(config)` (one MoE layer's parameters and multiply-adds, `parity.moe_layer_cost`) and
`no_expert_selection` (why `evaluation.expert_load` cannot count its expert selections, or None). A new kind of MoE
block is a class and an entry here.
"""

from torch import nn

from .lory import MHLoryBlock
from .sparse_moe import MHMoESparseMoeBlock, moe_block_problems

ROUTER_TYPES = {"topk": MHMoESparseMoeBlock, "lory": MHLoryBlock}


def make_moe_block(config, layer_idx: int) -> nn.Module:
    """The MoE block of layer `layer_idx` that `config.router_type` names."""
    return ROUTER_TYPES[config.router_type](config, layer_idx)


def block_class(config) -> type[nn.Module]:
    """The block class of `config.router_type`; the top-k block's for a config without that field (another model's,
    MoH-LLaMA's) or a name not registered (`router_type_problems` refuses it when the config is built)."""
    return ROUTER_TYPES.get(getattr(config, "router_type", None), MHMoESparseMoeBlock)


def router_type_problems(config) -> list[str]:
    """`router_type`, the fields every MoE block shares and every block's own, in words."""
    problems = []
    if config.router_type not in ROUTER_TYPES:
        problems.append(f"router_type must be one of {tuple(ROUTER_TYPES)}, got {config.router_type!r}")
    problems += moe_block_problems(config)
    for block in ROUTER_TYPES.values():
        problems += block.config_problems(config)
    return problems


__all__ = ["ROUTER_TYPES", "block_class", "make_moe_block", "router_type_problems"]
