"""Experts in plain PyTorch: a loop over the experts that received rows, the reference of `experts_triton.py` (and
the "naive" backend of the experts op in `backends.py`, which `experts_implementation="eager"` runs).

Shape legend: N routed rows, W row width, E experts, K experts per row, I expert inner width. Weights as in
Transformers v5 MoE models: `gate_up_proj` (E, 2I, W), `down_proj` (E, W, I). Expert id E marks a dropped assignment
(it contributes nothing).
"""

import torch
import torch.nn.functional as F


def experts_forward(
    hidden_states: torch.Tensor,
    top_k_index: torch.Tensor,
    top_k_weights: torch.Tensor,
    gate_up_proj: torch.Tensor,
    down_proj: torch.Tensor,
    act_fn=F.silu,
) -> torch.Tensor:
    """(N, W) rows -> (N, W): Σ_k weight[n, k] · down[e](act(gate[e] x) · up[e] x) with e = top_k_index[n, k]."""
    num_experts = gate_up_proj.shape[0]
    out = torch.zeros_like(hidden_states, dtype=torch.promote_types(hidden_states.dtype, torch.float32))
    for expert in range(num_experts):
        row, slot = torch.where(top_k_index == expert)
        if row.numel() == 0:
            continue
        gate, up = F.linear(hidden_states[row], gate_up_proj[expert]).chunk(2, dim=-1)
        expert_out = F.linear(act_fn(gate) * up, down_proj[expert])
        out.index_add_(0, row, expert_out.to(out.dtype) * top_k_weights[row, slot, None].to(out.dtype))
    return out.to(hidden_states.dtype)
