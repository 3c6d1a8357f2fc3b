"""The MoE routers' losses (the MoH balance loss is `moh/moh_losses.py`; `causal_lm.add_router_losses` weights them
all into the training loss):

- `load_balancing_loss`: Switch/GShard balance of the MoE routers over routed rows (sub-tokens), padding excluded,
  in the conventions of `router_aux_loss_mode` (`AUX_LOSS_MODES`);
- `router_z_loss`: ST-MoE router z-loss.

Shape legend: N routed rows (tokens × moe_heads, token-major), E experts, K experts per row.

This file runs on torch alone: exported checkpoints ship it next to the modeling file.
"""

import torch

AUX_LOSS_MODES = ("per_layer", "mixtral", "top1_sum")


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
    each layer; `mixtral` pools f and P over all layers first, exactly as Transformers' Mixtral does; `top1_sum` counts
    only each row's top-1 expert in f and sums the layers' losses (the official MH-MoE code's GShard convention).
    """
    counted = 1 if mode == "top1_sum" else top_k
    counts_sum, probs_sum, rows_sum, losses = 0.0, 0.0, 0.0, []
    for logits in router_logits:
        probs = torch.softmax(logits.float(), dim=-1)  # (N, E)
        selected = torch.topk(probs, counted, dim=-1).indices  # (N, K) or (N, 1)
        mask = _rows_mask(attention_mask, probs.shape[0], moe_heads)
        mask = probs.new_ones(probs.shape[0]) if mask is None else mask.to(probs.device)  # (N,)
        counts = probs.new_zeros(num_experts).scatter_add_(0, selected.reshape(-1), mask.repeat_interleave(counted))
        prob_sum, rows = (probs * mask[:, None]).sum(0), mask.sum().clamp(min=1)  # (E,), (): 0 with no real rows
        losses.append(num_experts * torch.sum((counts / rows) * (prob_sum / rows)))
        counts_sum, probs_sum, rows_sum = counts_sum + counts, probs_sum + prob_sum, rows_sum + rows
    if mode == "mixtral":
        return num_experts * torch.sum((counts_sum / rows_sum) * (probs_sum / rows_sum))
    return torch.stack(losses).sum() if mode == "top1_sum" else torch.stack(losses).mean()


def router_z_loss(
    router_logits: tuple[torch.Tensor, ...], attention_mask: torch.Tensor | None = None, moe_heads: int = 1
) -> torch.Tensor:
    """ST-MoE router z-loss: mean over real rows of logsumexp(logits)², averaged over layers."""
    losses = []
    for logits in router_logits:
        z = torch.logsumexp(logits.float(), dim=-1).pow(2)  # (N,)
        mask = _rows_mask(attention_mask, z.shape[0], moe_heads)
        losses.append(z.mean() if mask is None else (z * mask.to(z.device)).sum() / mask.sum().clamp(min=1))
    return torch.stack(losses).mean()


__all__ = ["AUX_LOSS_MODES", "load_balancing_loss", "router_z_loss"]
