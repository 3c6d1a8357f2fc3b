"""The MoH paper's head load-balancing loss (eq. 7) over the routed heads; `causal_lm.add_router_losses` weights it
by `moh_aux_loss_coef`. Shape legend: MoH router logits (B, T, R) with R routed heads, K active per token.

This file runs on torch alone: exported checkpoints ship it next to the modeling file.
"""

from collections.abc import Sequence

import torch

from .head_routers import topk_mask


def moh_load_balancing_loss(
    router_logits: tuple[torch.Tensor, ...],
    active_heads: int | Sequence[int],
    attention_mask: torch.Tensor | None = None,
    thresholds: Sequence[float | None] | None = None,
) -> torch.Tensor:
    """Eq. 7 over the routed heads, averaged over MoH layers: R·Σ_i f_i·P_i with f_i the fraction of (non-padding)
    tokens that select routed head i and P_i its mean router probability. Perfect balance gives K. `active_heads`: K,
    or one K per layer (per-layer head budgets); `thresholds`: the layers' `moh_head_thresholds` (f_i then counts the
    tokens whose score passes it)."""
    losses = []
    per_layer = [active_heads] * len(router_logits) if isinstance(active_heads, int) else active_heads
    thresholds = thresholds or [None] * len(router_logits)
    for logits, layer_active, threshold in zip(router_logits, per_layer, thresholds, strict=True):
        batch, seq, routed = logits.shape
        probs = torch.softmax(logits.float(), dim=-1)
        selected = topk_mask(logits, layer_active, threshold)
        if attention_mask is not None and attention_mask.dim() == 2:
            mask = attention_mask[:, -seq:].to(probs.device, probs.dtype)  # decoding: the mask covers past tokens too
        else:
            mask = probs.new_ones(batch, seq)
        tokens = mask.sum().clamp(min=1)  # 0 (not NaN) for a batch of padding only
        f = (selected * mask[..., None]).sum(dim=(0, 1)) / tokens
        p = (probs * mask[..., None]).sum(dim=(0, 1)) / tokens
        losses.append(routed * torch.sum(f * p))
    return torch.stack(losses).mean()


__all__ = ["moh_load_balancing_loss"]
