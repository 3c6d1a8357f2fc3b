"""FLOPs and parameter parity between sparse MoE and MH-MoE layers (arithmetic; each block kind counts its own layer,
`layer_cost` in sparse_moe.py and lory.py, which `moe_layer_cost` asks for).

Shape legend: d = hidden_size, h = moe_heads, E = num_experts, k = num_experts_per_tok, f = moe_intermediate_size.

A SwiGLU expert on width w has 3·w·f weights and costs 3·w·f multiply-adds per routed (sub-)token. One MH-MoE layer
per token: head and merge layers d² each, router h·(d/h)·E = d·E, experts h·k·3·(d/h)·f = 3·d·f·k, shared expert
3·d·f_shared. The paper's eq. (8), f_mh = f_moe − d/k, is exact only for k=1 and 2-matrix FFNs; for SwiGLU the
leading-term FLOPs equation is 2d² + 3·d·f_mh·k_mh = 3·d·f_moe·k_moe (its Section 3 settings follow it).

Lory / MH-Lory (`router_type="lory"`, segment length L, P expert pools: 1 shared (v1) or h, one per head (v2)):
experts P·E·3·(d/h)·f and router P·E·(d/h) parameters; per token one merged expert per sub-token, h·3·(d/h)·f = 3·d·f;
per segment each head's router on the segment mean (E·d/h) and its merge Σ_e w_e θ_e, which reads all E of its pool's
expert parameter sets: h·E·3·(d/h)·f = 3·d·f·E multiply-adds, i.e. E× the expert parameters one head uses. The per-token
cost counts that merge spread over the L tokens of the segment. BitNet b1.58 changes no count (same shapes; its
per-projection norms and scales are excluded like the other norms).
"""

from dataclasses import dataclass


@dataclass(frozen=True)
class MoELayerCost:
    """Parameters and per-token activated multiply-adds of one MoE layer (biases and norms excluded)."""

    params: int
    macs_per_token: int
    expert_params: int
    head_merge_params: int
    router_params: int
    shared_expert_params: int
    merge_macs_per_segment: int = 0  # Lory: routing on the segment means and merging the experts, once per segment

    @property
    def flops_per_token(self) -> int:
        return 2 * self.macs_per_token


def moe_layer_cost(config) -> MoELayerCost:
    """Cost of one MoE layer of `config` (an `MHMoEConfig` or anything with the same fields), as its block kind counts
    it (`layer_cost` of `router_types.block_class(config)`); Lory's per-segment merge is included in `macs_per_token`
    as merge_macs_per_segment / lory_segment_length (rounded)."""
    from .router_types import block_class  # the block classes import torch; this module's arithmetic does not

    return MoELayerCost(**block_class(config).layer_cost(config))


def matched_moe_settings(
    hidden_size: int,
    smoe_intermediate_size: int,
    smoe_num_experts: int,
    smoe_top_k: int,
    moe_heads: int,
    top_k: int,
    round_experts_to: int = 8,
    smoe_head_and_merge: int = 0,
    smoe_moe_heads: int = 1,
    head_and_merge: int = 2,
) -> tuple[int, int]:
    """Solve for the MH-MoE (moe_intermediate_size, num_experts) matching an SMoE layer (leading terms).

    FLOPs:  n_s·d² + 3·d·f_s·k_s       = n·d² + 3·d·f·k     (n_s, n: head/merge layers; an SMoE has n_s = 0)
    params: n_s·d² + 3·(d/h_s)·f_s·E_s = n·d² + 3·(d/h)·f·E  (h_s: the source's moe_heads, 1 for an SMoE)
    f is rounded to the nearest integer, E to the nearest multiple of `round_experts_to` (at least `top_k`).
    """
    d, h = hidden_size, moe_heads
    for heads in (h, smoe_moe_heads):
        if heads < 1 or d % heads:
            raise ValueError(f"hidden_size ({d}) must be divisible by moe_heads ({heads})")
    if top_k < 1 or round_experts_to < 1:
        raise ValueError(f"top_k ({top_k}) and round_experts_to ({round_experts_to}) must be >= 1")
    smoe_macs = smoe_head_and_merge * d * d + 3 * d * smoe_intermediate_size * smoe_top_k
    intermediate = round((smoe_macs - head_and_merge * d * d) / (3 * d * top_k))
    if intermediate < 1:
        raise ValueError(
            f"the head and merge layers alone ({head_and_merge}·d² = {head_and_merge * d * d} multiply-adds) exceed "
            f"the SMoE layer's activated cost ({smoe_macs}); use a larger SMoE intermediate size or top-k"
        )
    smoe_params = smoe_head_and_merge * d * d + 3 * (d // smoe_moe_heads) * smoe_intermediate_size * smoe_num_experts
    exact_experts = (smoe_params - head_and_merge * d * d) / (3 * (d // h) * intermediate)
    experts = max(round(exact_experts / round_experts_to) * round_experts_to, round_experts_to)
    while experts < top_k:
        experts += round_experts_to
    return intermediate, experts
