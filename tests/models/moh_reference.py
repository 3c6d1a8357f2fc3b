"""The reference the MoH attention paths are tested against (test-only: not shipped in the model layer).

Shape legend: B batch, T query tokens, L key/value tokens, d hidden size, H query heads, Hkv key/value heads,
hd head_dim.
"""

import torch
from torch import nn


def masked_heads_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    gates: torch.Tensor,
    o_proj: nn.Linear,
    scaling: float,
) -> torch.Tensor:
    """MoH attention as the paper defines it: every head computed (eager), output multiplied by the gates, o_proj."""
    groups = query.shape[1] // key.shape[1]
    key = key.repeat_interleave(groups, dim=1)
    value = value.repeat_interleave(groups, dim=1)
    scores = torch.matmul(query, key.transpose(2, 3)) * scaling  # (B, H, T, L)
    if attention_mask is not None:
        mask = attention_mask[..., : key.shape[2]]
        if mask.dtype == torch.bool:
            mask = torch.zeros(mask.shape, dtype=query.dtype).masked_fill(~mask, torch.finfo(query.dtype).min)
        scores = scores + mask
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(query.dtype)
    heads_out = torch.matmul(probs, value).transpose(1, 2)  # (B, T, H, hd)
    heads_out = heads_out * gates.to(query.dtype)[..., None]
    return o_proj(heads_out.reshape(*heads_out.shape[:2], -1))
