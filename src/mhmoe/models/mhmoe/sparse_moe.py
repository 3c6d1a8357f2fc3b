"""The MH-MoE block with top-k routing (`router_type="topk"`), the parts every MoE block shares, and the dense SwiGLU
MLP (dense layers, shared expert).

head layer -> split each token into h sub-tokens of width W = D / h -> router: top-k experts per sub-token -> experts
(`linear_types.make_experts`: SwiGLU, or BitNet's) -> concatenate the sub-tokens -> merge layer [+ shared expert].
`moe_heads=1` without head/merge layers is a Mixtral-style sparse MoE (Mixtral's parameter names and logits).

Shape legend: B batch, T tokens, D hidden_size, h moe_heads, W = D / h, N = B·T·h routed rows, E experts,
K = num_experts_per_tok.
"""

import contextlib
import math

import torch
from torch import nn
from transformers.activations import ACT2FN

from ..ops.backends import route
from .experts import sub_token_width
from .linear_types import make_experts, make_linear
from .moe_losses import AUX_LOSS_MODES

NORM_TOPK_PROB = (True, False, "always")
CAPACITY_ROUNDINGS = ("switch", "official")  # ceil(cf·S·k/E) (Switch) | k·ceil(cf·S/E) (the official MH-MoE code)


class MHMoEMLP(nn.Module):
    """SwiGLU feed-forward with Llama's parameter names (dense layers and the shared expert)."""

    def __init__(self, config, intermediate_size: int, bias: bool = False):
        super().__init__()
        self.gate_proj = make_linear(config, config.hidden_size, intermediate_size, bias, "ffn", sublayer_in=True)
        self.up_proj = make_linear(config, config.hidden_size, intermediate_size, bias, "ffn", sublayer_in=True)
        self.down_proj = make_linear(config, intermediate_size, config.hidden_size, bias, "ffn")
        self.act_fn = ACT2FN[config.hidden_act]

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.gate_proj(hidden_states)) * self.up_proj(hidden_states))


def moe_block_parts(config) -> tuple:
    """The head layer, merge layer and shared expert (each None when the config has none) of every MoE block."""
    d, shared = config.hidden_size, config.shared_expert_intermediate_size
    bias = config.moe_layer_bias  # the official code's nn.Linear(d, d, bias=True); the papers' equations have none
    head = make_linear(config, d, d, bias=bias, role="head_merge") if config.moe_head_layer else None
    merge = make_linear(config, d, d, bias=bias, role="head_merge") if config.moe_merge_layer else None
    return head, merge, MHMoEMLP(config, shared) if shared else None


def moe_block_part_params(config) -> tuple[int, int]:
    """(head + merge layer, shared expert) weights of every MoE block (biases excluded): n·d² and 3·d·f_shared."""
    d = config.hidden_size
    head_merge = (int(bool(config.moe_head_layer)) + int(bool(config.moe_merge_layer))) * d * d
    return head_merge, 3 * d * (getattr(config, "shared_expert_intermediate_size", 0) or 0)


def moe_block_problems(config) -> list[str]:
    """The fields every MoE block reads (sub-tokens, experts, head/merge layers, shared expert), in words."""
    problems = []
    if config.decoder_sparse_step > 0:
        if config.moe_heads < 1 or config.hidden_size % config.moe_heads:
            problems.append(
                f"hidden_size ({config.hidden_size}) must be divisible by moe_heads ({config.moe_heads}); "
                "choose moe_heads among the divisors of hidden_size"
            )
        if config.num_experts < 1:
            problems.append(f"num_experts must be >= 1, got {config.num_experts}")
        if config.moe_intermediate_size < 1:
            problems.append(f"moe_intermediate_size must be >= 1, got {config.moe_intermediate_size}")
    if config.shared_expert_intermediate_size < 0:
        problems.append(
            f"shared_expert_intermediate_size must be >= 0 (0 = no shared expert), got "
            f"{config.shared_expert_intermediate_size}"
        )
    if config.moe_layer_bias and not (config.moe_head_layer or config.moe_merge_layer):
        problems.append("moe_layer_bias=True needs a head or merge layer (moe_head_layer / moe_merge_layer)")
    for name in ("router_aux_loss_coef", "router_z_loss_coef"):
        if not (getattr(config, name) >= 0 and math.isfinite(getattr(config, name))):
            problems.append(f"{name} must be a finite number >= 0, got {getattr(config, name)}")
    return problems


class MHMoETopKRouter(nn.Module):
    """Linear router computed in fp32 whatever the model dtype (Switch's selective precision)."""

    def __init__(self, config):
        super().__init__()
        self.top_k = config.num_experts_per_tok
        self.norm_topk_prob = config.norm_topk_prob
        self.capacity_factor = config.capacity_factor
        self.capacity_rounding = config.capacity_rounding
        self.routing_backend = config.routing_backend
        self.weight = nn.Parameter(torch.empty(config.num_experts, sub_token_width(config)))

    @torch.no_grad()
    def init_parameters(self, std: float) -> None:
        self.weight.normal_(mean=0.0, std=std)

    def forward(self, hidden_states: torch.Tensor):
        device = hidden_states.device.type
        # fp32 also under autocast (Accelerate's mixed precision), which would cast the linear back down
        with torch.autocast(device, enabled=False) if torch.is_autocast_enabled(device) else contextlib.nullcontext():
            router_logits = nn.functional.linear(hidden_states.float(), self.weight.float())  # (N, E)
        weights, experts = route(
            router_logits,
            self.top_k,
            self.norm_topk_prob,
            self.capacity_factor,
            self.routing_backend,
            self.capacity_rounding,
        )
        return router_logits, weights, experts


class MHMoESparseMoeBlock(nn.Module):
    """head layer -> split into h sub-tokens -> top-k experts per sub-token -> concatenate -> merge layer."""

    reads_cache = False

    def __init__(self, config, layer_idx: int | None = None):
        super().__init__()
        self.moe_heads = config.moe_heads
        self.sub_token_width = sub_token_width(config)
        self.jitter_noise = config.router_jitter_noise
        head_proj, merge_proj, shared_expert = moe_block_parts(config)
        self.head_proj = head_proj  # registered in this order: head, gate, experts, merge, shared expert
        self.gate = MHMoETopKRouter(config)
        self.experts = make_experts(config)
        self.merge_proj = merge_proj
        self.shared_expert = shared_expert

    @classmethod
    def config_problems(cls, config) -> list[str]:
        """The top-k routing fields, in words (checked whatever the router_type, as a set field must be valid)."""
        problems = []
        if config.decoder_sparse_step > 0 and not 1 <= config.num_experts_per_tok <= config.num_experts:
            problems.append(
                f"num_experts_per_tok ({config.num_experts_per_tok}) must be between 1 and num_experts "
                f"({config.num_experts})"
            )
        if config.norm_topk_prob not in NORM_TOPK_PROB:
            problems.append(f"norm_topk_prob must be True, False or 'always', got {config.norm_topk_prob!r}")
        if config.router_aux_loss_mode not in AUX_LOSS_MODES:
            problems.append(
                f"router_aux_loss_mode must be one of {AUX_LOSS_MODES}, got {config.router_aux_loss_mode!r}"
            )
        if config.router_aux_loss_mode == "mixtral" and config.moe_heads != 1:
            problems.append("router_aux_loss_mode='mixtral' pools token-level statistics and needs moe_heads=1")
        noise = config.router_jitter_noise
        if not (noise >= 0 and math.isfinite(noise)):
            problems.append(f"router_jitter_noise must be a finite number >= 0, got {noise}")
        elif noise >= 1:
            problems.append(
                f"router_jitter_noise must be < 1 (inputs are scaled by U(1 - noise, 1 + noise)), got {noise}"
            )
        capacity = config.capacity_factor
        if capacity is not None and not (capacity > 0 and math.isfinite(capacity)):
            problems.append(f"capacity_factor must be a finite number > 0 or None (dropless), got {capacity}")
        if config.capacity_rounding not in CAPACITY_ROUNDINGS:
            problems.append(f"capacity_rounding must be one of {CAPACITY_ROUNDINGS}, got {config.capacity_rounding!r}")
        elif config.capacity_rounding == "official" and capacity is None:
            problems.append(
                "capacity_rounding='official' rounds a capacity, but capacity_factor is None "
                "(dropless); set capacity_factor=1.0 (the official code's) or use "
                "capacity_rounding='switch'"
            )
        return problems

    # What the rest of mhmoe asks the block kind (`router_types.block_class(config)`), so that no caller names it.
    no_expert_selection = None  # why `evaluation.expert_load` cannot count its expert selections (None: it can)

    @classmethod
    def card_rows(cls, config) -> list[tuple[str, str]]:
        """(label, text) rows the model card adds for this block kind (the MoE row already says top-k)."""
        return []

    @classmethod
    def layer_cost(cls, config) -> dict:
        """One MoE layer's parameters and per-token activated multiply-adds (`parity.MoELayerCost`'s fields): head and
        merge layers d² each, router h·(d/h)·E = d·E, experts h·k·3·(d/h)·f = 3·d·f·k, shared expert 3·d·f_shared."""
        d, h, E = config.hidden_size, config.moe_heads, config.num_experts
        k, f = config.num_experts_per_tok, config.moe_intermediate_size
        head_merge, shared = moe_block_part_params(config)
        width = d // h  # sub-token width
        router, experts = E * width, E * 3 * width * f
        return dict(
            params=head_merge + router + experts + shared,
            macs_per_token=head_merge + h * width * E + h * k * 3 * width * f + shared,
            expert_params=experts,
            head_merge_params=head_merge,
            router_params=router,
            shared_expert_params=shared,
        )

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        batch_size, seq_len, hidden_dim = hidden_states.shape
        sub_tokens = self.head_proj(hidden_states) if self.head_proj is not None else hidden_states
        sub_tokens = sub_tokens.reshape(-1, self.sub_token_width)  # (B·T·h, W), token-major
        if self.training and self.jitter_noise > 0:
            sub_tokens = sub_tokens * torch.empty_like(sub_tokens).uniform_(
                1 - self.jitter_noise, 1 + self.jitter_noise
            )
        _, weights, experts = self.gate(sub_tokens)
        out = self.experts(sub_tokens, experts, weights)  # (B·T·h, W)
        out = out.reshape(batch_size, seq_len, hidden_dim)  # concatenate each token's sub-tokens
        if self.merge_proj is not None:
            out = self.merge_proj(out)
        if self.shared_expert is not None:
            out = out + self.shared_expert(hidden_states)
        return out


__all__ = [
    "CAPACITY_ROUNDINGS",
    "NORM_TOPK_PROB",
    "MHMoEMLP",
    "MHMoESparseMoeBlock",
    "MHMoETopKRouter",
    "moe_block_part_params",
    "moe_block_parts",
    "moe_block_problems",
]
