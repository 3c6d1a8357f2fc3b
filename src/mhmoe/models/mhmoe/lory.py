"""Lory (Zhong et al. 2024) and Multi-Headed Lory (the MH-Lory proposal): one merged expert per segment.

The sequence is cut into segments of `lory_segment_length` tokens. For segment s every token goes through ONE SwiGLU
expert whose parameters are the routing-weighted sum of all experts' parameters, θ_s = Σ_e w_{s,e} θ_e, with
w_s = softmax(R(mean of segment s-1's hidden states)): routing never sees the segment's own or later tokens, so the
model stays causal. Everything is differentiable (no top-k), so no load-balancing loss is added (neither the proposal
nor Lory use one; the router learns through the merged parameters).

First segment (`lory_first_segment`): it has no previous segment. "uniform" (default): its "previous mean" is the
zero vector, so the router's logits are 0 and the merge is uniform (the mean of the experts); every token's routing
stays strictly causal. "proposal": the MH-Lory proposal's code's rule (its text gives the rule only for segments with a
predecessor): the first segment is routed on its own mean and its whole expert output is computed without gradient
(no gradient reaches the router, the experts or the sub-tokens from it). A first-segment token's output then depends
on the later tokens of that segment (in the forward only), and cached decoding cannot continue an unfinished first
segment (each new token would change the routing of the tokens before it): such a call is refused.

MH-Lory (moe_heads = h > 1): the head layer projects each token, it is split into h sub-tokens of width W = D/h, and
each head p gets its own routing weights per segment from the mean of its sub-tokens:
- v1 (`lory_expert_pool="shared"`): all heads merge from one pool of E experts with one router (E, W);
- v2 (`"per_head"`): head p has its own pool of E experts and its own router, E·h experts in all.
Sub-tokens are concatenated again and projected by the merge layer, as in MH-MoE.

Cost per segment and head: the merge reads E expert parameter sets (E·3·W·I multiply-adds) once, then every token of
the segment pays one expert (3·W·I); `MHLoryBlock.layer_cost` counts both (`parity.moe_layer_cost`).

Decoding with the KV cache: the block keeps, per layer, the number of tokens seen, the running sum of the current
segment's sub-tokens and the mean of the previous segment, next to the key/value cache (`cache._mhmoe_lory`), so a
token decoded alone gets the routing the full forward gives it. Beam search's reordering of the cache reorders this
state too; a cache cropped or reused for another sequence no longer matches it and is refused in words. Padding tokens
count in the segment means (the block sees no attention mask): train on packed blocks (as `mhmoe-train` does) and
decode unpadded or right-padded batches; a left-padded batch routes its first segments on the padding too.

Shape legend: B batch, T tokens of this call, D hidden_size, h moe_heads, W = D/h, E experts per pool, P pools (1 for
v1, h for v2), I moe_intermediate_size, L segment length. This file runs on torch + transformers alone.
"""

import torch
from torch import nn
from transformers.activations import ACT2FN

from .experts import sub_token_width
from .sparse_moe import moe_block_part_params, moe_block_parts

LORY_EXPERT_POOLS = ("shared", "per_head")  # MH-Lory v1: E experts shared by the heads | v2: E per head, E·h in all
LORY_FIRST_SEGMENTS = ("uniform", "proposal")  # the first segment: uniform merge | routed on itself, no gradient


class LoryRouter(nn.Module):
    """Linear router per pool, `weight` (P·E, W), computed in fp32 on segment means."""

    def __init__(self, config):
        super().__init__()
        self.num_pools = config.moe_heads if config.lory_expert_pool == "per_head" else 1
        self.num_experts = config.num_experts
        self.weight = nn.Parameter(torch.empty(self.num_pools * self.num_experts, sub_token_width(config)))

    @torch.no_grad()
    def init_parameters(self, std: float) -> None:
        self.weight.normal_(mean=0.0, std=std)

    def forward(self, means: torch.Tensor) -> torch.Tensor:
        """means (B, h, W) -> routing weights (B, h, E) fp32 (softmax over each head's pool)."""
        weight = self.weight.float().view(self.num_pools, self.num_experts, -1)  # (P, E, W)
        logits = torch.einsum(
            "bhw,hew->bhe" if self.num_pools > 1 else "bhw,ew->bhe",
            means.float(),
            weight if self.num_pools > 1 else weight[0],
        )
        return torch.softmax(logits, dim=-1)


class LoryExperts(nn.Module):
    """P·E SwiGLU experts on width W, 3-D like `MHMoEExperts` (`gate_up_proj` (P·E, 2I, W), `down_proj` (P·E, W, I))."""

    def __init__(self, config):
        super().__init__()
        self.num_pools = config.moe_heads if config.lory_expert_pool == "per_head" else 1
        self.num_experts = config.num_experts
        self.hidden_dim = sub_token_width(config)
        self.intermediate_dim = config.moe_intermediate_size
        total = self.num_pools * self.num_experts
        self.gate_up_proj = nn.Parameter(torch.empty(total, 2 * self.intermediate_dim, self.hidden_dim))
        self.down_proj = nn.Parameter(torch.empty(total, self.hidden_dim, self.intermediate_dim))
        self.act_fn = ACT2FN[config.hidden_act]

    @torch.no_grad()
    def init_parameters(self, std: float) -> None:
        self.gate_up_proj.normal_(mean=0.0, std=std)
        self.down_proj.normal_(mean=0.0, std=std)

    def merged(self, routing: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """routing (B, h, E) -> per (batch row, head) merged weights: gate_up (B, h, 2I, W), down (B, h, W, I)."""
        routing = routing.to(self.gate_up_proj.dtype)
        merged = []
        for param in (self.gate_up_proj, self.down_proj):
            pools = param.view(self.num_pools, self.num_experts, *param.shape[1:])  # (P, E, out, in)
            if self.num_pools > 1:  # v2: head p merges its own pool
                merged.append(torch.einsum("bhe,heoi->bhoi", routing, pools))
            else:  # v1 / Lory: every head merges the one pool with its own weights
                merged.append(torch.einsum("bhe,eoi->bhoi", routing, pools[0]))
        return merged[0], merged[1]

    def forward(self, sub_tokens: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor) -> torch.Tensor:
        """sub_tokens (B, n, h, W) of one segment through its merged expert -> (B, n, h, W)."""
        gate, up = torch.einsum("bnhw,bhow->bnho", sub_tokens, gate_up).chunk(2, dim=-1)  # (B, n, h, I) each
        return torch.einsum("bnhi,bhoi->bnho", self.act_fn(gate) * up, down)


class MHLoryBlock(nn.Module):
    """`router_type="lory"`: head layer -> h sub-tokens -> per segment and head one merged expert (routed on the
    previous segment) -> concatenate -> merge layer [+ shared expert]. Parameter names follow `MHMoESparseMoeBlock`."""

    reads_cache = True  # the segment state lives next to the key/value cache

    def __init__(self, config, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.moe_heads = config.moe_heads
        self.segment_length = config.lory_segment_length
        self.first_segment = config.lory_first_segment
        head_proj, merge_proj, shared_expert = moe_block_parts(config)
        self.head_proj = head_proj
        self.gate = LoryRouter(config)
        self.experts = LoryExperts(config)
        self.merge_proj = merge_proj
        self.shared_expert = shared_expert

    @classmethod
    def config_problems(cls, config) -> list[str]:
        """The lory_* fields, and what Lory does not combine with when chosen, in words."""
        problems, lory = [], config.router_type == "lory"
        if config.lory_expert_pool not in LORY_EXPERT_POOLS:
            problems.append(
                f"lory_expert_pool must be one of {LORY_EXPERT_POOLS} ('shared': MH-Lory v1; 'per_head': "
                f"v2), got {config.lory_expert_pool!r}"
            )
        if config.lory_first_segment not in LORY_FIRST_SEGMENTS:
            problems.append(
                f"lory_first_segment must be one of {LORY_FIRST_SEGMENTS} ('uniform': a uniform merge; 'proposal': "
                f"routed on its own mean without gradient), got {config.lory_first_segment!r}"
            )
        if not config.lory_segment_length >= 1:
            problems.append(f"lory_segment_length must be >= 1 tokens, got {config.lory_segment_length}")
        if lory and config.capacity_factor is not None:
            problems.append(
                "capacity_factor applies to top-k routing; router_type='lory' merges all experts (use None)"
            )
        if lory and config.router_jitter_noise:
            problems.append("router_jitter_noise applies to top-k routing; use 0 with router_type='lory'")
        if lory and config.linear_type != "linear":
            problems.append(
                f"router_type='lory' with linear_type={config.linear_type!r} is not supported (quantising "
                "merged experts is not defined by either paper); choose one"
            )
        return problems

    # What the rest of mhmoe asks the block kind (`router_types.block_class(config)`), so that no caller names it.
    no_expert_selection = (  # why `evaluation.expert_load` cannot count its expert selections
        "a Lory model (router_type='lory') selects no experts: each segment merges all experts with soft weights, so "
        "there is no selection frequency to count"
    )

    @classmethod
    def card_rows(cls, config) -> list[tuple[str, str]]:
        """The model card's "Lory routing" row (the MoE row's top-k does not apply)."""
        pools = "one pool per head (MH-Lory v2)" if config.lory_expert_pool == "per_head" else "one shared pool"
        proposal = getattr(config, "lory_first_segment", "uniform") == "proposal"
        first = " (the first on itself, without gradient)" if proposal else ""
        return [
            (
                "Lory routing",
                f"all experts merged into one per {config.lory_segment_length}-token segment, "
                f"routed on the previous segment{first}; {pools}",
            )
        ]

    @classmethod
    def layer_cost(cls, config) -> dict:
        """One MoE layer's parameters and per-token activated multiply-adds (`parity.MoELayerCost`'s fields): P pools
        of E experts (P·E·3·W·I) and routers (P·E·W); per token one merged expert per sub-token (3·D·I); per segment
        each head's router on its mean and its merge of E experts (h·E·W + h·E·3·W·I, `merge_macs_per_segment`),
        spread over the L tokens of the segment in `macs_per_token` (rounded)."""
        d, h, E, f = config.hidden_size, config.moe_heads, config.num_experts, config.moe_intermediate_size
        pools = h if config.lory_expert_pool == "per_head" else 1
        width = d // h
        head_merge, shared = moe_block_part_params(config)
        per_segment = h * E * width + h * E * 3 * width * f  # each head: router on its mean, merge of E experts
        per_token = head_merge + h * 3 * width * f + shared  # one merged expert per sub-token
        return dict(
            params=head_merge + pools * E * width + pools * E * 3 * width * f + shared,
            macs_per_token=per_token + round(per_segment / config.lory_segment_length),
            expert_params=pools * E * 3 * width * f,
            head_merge_params=head_merge,
            router_params=pools * E * width,
            shared_expert_params=shared,
            merge_macs_per_segment=per_segment,
        )

    def forward(self, hidden_states: torch.Tensor, cache=None) -> torch.Tensor:
        batch_size, seq_len, hidden_dim = hidden_states.shape
        sub_tokens = self.head_proj(hidden_states) if self.head_proj is not None else hidden_states
        sub_tokens = sub_tokens.view(batch_size, seq_len, self.moe_heads, -1)  # (B, T, h, W)
        seen, prev_mean, current_sum = self._state(cache, sub_tokens)
        length, outputs, start = self.segment_length, [], 0
        proposal = self.first_segment == "proposal"
        if proposal and 0 < seen < length:
            raise ValueError(
                f"lory_first_segment='proposal' routes the first segment on its own mean, which every new token "
                f"changes: a cache cannot continue it ({seen} of its {length} tokens seen); prefill at least "
                "lory_segment_length tokens, generate with use_cache=False, or use lory_first_segment='uniform'"
            )
        while start < seq_len:  # one merged expert per segment touched by this call
            in_segment = (seen + start) % length  # tokens of this segment seen before
            end = min(seq_len, start + length - in_segment)
            piece = sub_tokens[:, start:end]  # (B, n, h, W)
            if proposal and seen + start == 0:  # the first segment, routed on its own mean, without gradient
                with torch.no_grad():
                    gate_up, down = self.experts.merged(self.gate(piece.float().mean(dim=1)))
                    outputs.append(self.experts(piece, gate_up, down))
            else:
                gate_up, down = self.experts.merged(self.gate(prev_mean))
                outputs.append(self.experts(piece, gate_up, down))
            current_sum = current_sum + piece.float().sum(dim=1)  # (B, h, W)
            if (seen + end) % length == 0:  # segment complete: its mean routes the next one
                prev_mean, current_sum = current_sum / length, torch.zeros_like(current_sum)
            start = end
        if cache is not None:
            cache._mhmoe_lory[self.layer_idx] = (seen + seq_len, prev_mean, current_sum)
        out = torch.cat(outputs, dim=1).reshape(batch_size, seq_len, hidden_dim)  # concatenate the sub-tokens
        if self.merge_proj is not None:
            out = self.merge_proj(out)
        if self.shared_expert is not None:
            out = out + self.shared_expert(hidden_states)
        return out

    def _state(self, cache, sub_tokens: torch.Tensor):
        """(tokens seen before this call, previous segment's mean (B, h, W) fp32, current segment's sum so far)."""
        batch_size, seq_len, heads, width = sub_tokens.shape
        zeros = sub_tokens.new_zeros(batch_size, heads, width, dtype=torch.float32)
        if cache is None:
            return 0, zeros, zeros
        states = getattr(cache, "_mhmoe_lory", None)
        if states is None:
            states = cache._mhmoe_lory = {}
            _follow_beam_reordering(cache, states)
        seen, prev_mean, current_sum = states.get(self.layer_idx, (0, zeros, zeros))
        cached = cache.get_seq_length(self.layer_idx)  # attention already added this call's tokens
        if cached != seen + seq_len or prev_mean.shape[0] != batch_size:
            raise ValueError(
                f"router_type='lory' keeps per-segment routing state next to the KV cache: layer {self.layer_idx} has "
                f"routed {seen} tokens, but the cache holds {cached} after this call's {seq_len} (batch "
                f"{prev_mean.shape[0]} vs {batch_size}). Cropping the cache (assisted decoding) or reusing it for "
                "another sequence is not supported with Lory; generate with a fresh cache"
            )
        return seen, prev_mean, current_sum


def _follow_beam_reordering(cache, states: dict) -> None:
    """Beam search reorders the cache's batch rows (`cache.reorder_cache(beam_idx)`): reorder the Lory state alike."""
    reorder = cache.reorder_cache

    def reorder_cache(beam_idx: torch.LongTensor) -> None:
        reorder(beam_idx)
        for layer, (seen, prev_mean, current_sum) in list(states.items()):
            index = beam_idx.to(prev_mean.device)
            states[layer] = (seen, prev_mean.index_select(0, index), current_sum.index_select(0, index))

    cache.reorder_cache = reorder_cache


__all__ = ["LORY_EXPERT_POOLS", "LORY_FIRST_SEGMENTS", "LoryExperts", "LoryRouter", "MHLoryBlock"]
