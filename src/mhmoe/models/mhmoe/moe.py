"""Expert computation and router losses for MHMoE.

Shape legend: N routed rows (tokens × moe_heads sub-tokens), W row width (hidden_size // moe_heads), E experts,
K = num_experts_per_tok, S = N·K assignments, I = moe_intermediate_size. Expert weights are 3-D like Transformers'
v5 MoE models: `gate_up_proj` (E, 2I, W) and `down_proj` (E, W, I). Expert id E marks a dropped assignment.
"""

import torch
import torch.nn.functional as F
from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS, ExpertsInterface

from .routing import sort_by_expert


def _grouped_mm(x: torch.Tensor, weight_t: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """(S, in) rows grouped by `offsets` times per-group (E, in, out) weights -> (S, out).

    Uses torch's grouped GEMM where it exists; otherwise one matmul per non-empty group (a correct fallback).
    """
    x = x.to(weight_t.dtype)
    grouped = getattr(torch.nn.functional, "grouped_mm", None) or getattr(torch, "_grouped_mm", None)
    # the kernels need 16-byte aligned rows and pointers (and SM80+ on CUDA)
    aligned = all(n * x.element_size() % 16 == 0 for n in (x.shape[-1], *weight_t.shape[-2:]))
    aligned = aligned and x.data_ptr() % 16 == 0 and weight_t.data_ptr() % 16 == 0
    if grouped is not None and aligned and not (x.is_cuda and torch.cuda.get_device_capability(x.device) < (8, 0)):
        return grouped(x, weight_t, offs=offsets)
    out = x.new_empty(x.shape[0], weight_t.shape[-1])
    start = 0
    for expert, end in enumerate(offsets.tolist()):
        if end > start:
            out[start:end] = x[start:end] @ weight_t[expert]
        start = end
    return out


def grouped_experts_forward(
    self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
) -> torch.Tensor:
    """Sort assignments by expert, two grouped GEMMs, weight, and sum each row's K outputs (deterministic)."""
    num_rows, top_k = top_k_index.shape
    order, offsets = sort_by_expert(top_k_index, self.num_experts)  # (S,), (E,)
    if top_k_index.max() >= self.num_experts:  # capacity dropped some assignments: compute only the kept ones
        order = order[: int(offsets[-1])]
    rows = hidden_states[order // top_k]  # (S_kept, W)
    gate, up = _grouped_mm(rows, self.gate_up_proj.transpose(1, 2), offsets).chunk(2, dim=-1)  # (S_kept, I) each
    expert_out = _grouped_mm(self.act_fn(gate) * up, self.down_proj.transpose(1, 2), offsets)  # (S_kept, W)
    expert_out = expert_out * top_k_weights.reshape(-1)[order, None].to(expert_out.dtype)
    out = expert_out.new_zeros(num_rows * top_k, expert_out.shape[-1])
    out = out.index_copy(0, order, expert_out)  # back to (row, slot) order; dropped slots stay 0
    return out.view(num_rows, top_k, -1).sum(dim=1).to(hidden_states.dtype)  # (N, W)


def _drop_sentinels(experts_forward):
    """Adapt a Transformers experts function (no dropped-assignment sentinel) to capacity routing."""

    def forward(self, hidden_states, top_k_index, top_k_weights):
        dropped = top_k_index >= self.num_experts
        top_k_index = top_k_index.masked_fill(dropped, 0)
        top_k_weights = top_k_weights.masked_fill(dropped, 0.0)
        return experts_forward(self, hidden_states, top_k_index, top_k_weights)

    return forward


class MHMoEExpertsInterface(ExpertsInterface):
    """Transformers' experts interface with `grouped_mm` backed by `grouped_experts_forward` (capacity-aware)."""

    _global_mapping = {
        **{name: _drop_sentinels(fn) for name, fn in ALL_EXPERTS_FUNCTIONS._global_mapping.items()},
        "grouped_mm": grouped_experts_forward,
    }


MHMOE_EXPERTS_FUNCTIONS = MHMoEExpertsInterface()


def eager_experts_forward(
    self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
) -> torch.Tensor:
    """Reference: a loop over the experts that received rows (the `eager` implementation)."""
    out = torch.zeros_like(hidden_states, dtype=torch.float32)
    for expert in top_k_index.unique().tolist():
        if expert >= self.num_experts:
            continue
        row, slot = torch.where(top_k_index == expert)
        gate, up = F.linear(hidden_states[row], self.gate_up_proj[expert]).chunk(2, dim=-1)
        expert_out = F.linear(self.act_fn(gate) * up, self.down_proj[expert])
        out.index_add_(0, row, expert_out.float() * top_k_weights[row, slot, None].float())
    return out.to(hidden_states.dtype)


def _rows_mask(attention_mask: torch.Tensor | None, num_rows: int, moe_heads: int) -> torch.Tensor | None:
    """The (N,) float mask of real (non-padding) rows: the (B, T) attention mask expanded ×moe_heads, token-major.

    During cached decoding the mask covers past tokens too; only the last T columns belong to these rows.
    """
    if attention_mask is None or attention_mask.dim() != 2:
        return None
    tokens = num_rows // moe_heads
    seq = tokens // attention_mask.shape[0]
    mask = attention_mask[:, -seq:].reshape(-1)
    return mask.repeat_interleave(moe_heads).float()


def load_balancing_loss(
    router_logits: tuple[torch.Tensor, ...],
    num_experts: int,
    top_k: int,
    attention_mask: torch.Tensor | None = None,
    moe_heads: int = 1,
    mode: str = "per_layer",
) -> torch.Tensor:
    """Switch/GShard load-balancing loss E·Σ_e f_e·P_e over routed rows, padding excluded.

    f_e: fraction of top-k assignments to expert e; P_e: mean router probability of e. `per_layer` averages the loss of
    each layer; `mixtral` pools f and P over all layers first, exactly as Transformers' Mixtral does.
    """
    counts_sum, probs_sum, rows_sum, losses = 0.0, 0.0, 0.0, []
    for logits in router_logits:
        probs = torch.softmax(logits.float(), dim=-1)  # (N, E)
        selected = torch.topk(probs, top_k, dim=-1).indices  # (N, K)
        mask = _rows_mask(attention_mask, probs.shape[0], moe_heads)
        mask = probs.new_ones(probs.shape[0]) if mask is None else mask.to(probs.device)  # (N,)
        counts = probs.new_zeros(num_experts).scatter_add_(0, selected.reshape(-1), mask.repeat_interleave(top_k))
        prob_sum, rows = (probs * mask[:, None]).sum(0), mask.sum()  # (E,), ()
        losses.append(num_experts * torch.sum((counts / rows) * (prob_sum / rows)))
        counts_sum, probs_sum, rows_sum = counts_sum + counts, probs_sum + prob_sum, rows_sum + rows
    if mode == "mixtral":
        return num_experts * torch.sum((counts_sum / rows_sum) * (probs_sum / rows_sum))
    return torch.stack(losses).mean()


def router_z_loss(
    router_logits: tuple[torch.Tensor, ...], attention_mask: torch.Tensor | None = None, moe_heads: int = 1
) -> torch.Tensor:
    """ST-MoE router z-loss: mean over real rows of logsumexp(logits)², averaged over layers."""
    losses = []
    for logits in router_logits:
        z = torch.logsumexp(logits.float(), dim=-1).pow(2)  # (N,)
        mask = _rows_mask(attention_mask, z.shape[0], moe_heads)
        losses.append(z.mean() if mask is None else (z * mask.to(z.device)).sum() / mask.sum())
    return torch.stack(losses).mean()
