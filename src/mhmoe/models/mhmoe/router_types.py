"""`router_type`: which MoE block an MHMoE model's MoE layers are. `ROUTER_TYPES` maps the name to the block class,
built as `Block(config, layer_idx)`, with `config_problems(config)` for its own fields (in words) and `reads_cache`
(whether the decoder layer passes it the key/value cache). A new kind of MoE block is a class and an entry here.
"""

from torch import nn

from .lory import MHLoryBlock
from .sparse_moe import MHMoESparseMoeBlock, moe_block_problems

ROUTER_TYPES = {"topk": MHMoESparseMoeBlock, "lory": MHLoryBlock}


def make_moe_block(config, layer_idx: int) -> nn.Module:
    """The MoE block of layer `layer_idx` that `config.router_type` names."""
    return ROUTER_TYPES[config.router_type](config, layer_idx)


def router_type_problems(config) -> list[str]:
    """`router_type`, the fields every MoE block shares and every block's own, in words."""
    problems = []
    if config.router_type not in ROUTER_TYPES:
        problems.append(f"router_type must be one of {tuple(ROUTER_TYPES)}, got {config.router_type!r}")
    problems += moe_block_problems(config)
    for block in ROUTER_TYPES.values():
        problems += block.config_problems(config)
    return problems


__all__ = ["ROUTER_TYPES", "make_moe_block", "router_type_problems"]
