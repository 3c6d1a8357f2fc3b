"""Router losses against their formulas: the official MH-MoE convention, padding-only batches."""

import pytest
import torch

from mhmoe.models.mhmoe.moe_losses import load_balancing_loss
from mhmoe.models.moh.moh_losses import moh_load_balancing_loss


def naive_gshard_top1_sum(router_logits, num_experts, row_mask):
    """The official MH-MoE (fairseq / Tutel GShard) loss: per layer E·Σ_e me_e·ce_e over real rows, me the mean gate
    probability and ce the fraction of rows whose top-1 is e; summed over layers."""
    total = 0.0
    for logits in router_logits:
        rows = [r for r in range(logits.shape[0]) if row_mask[r]]
        me = [0.0] * num_experts
        ce = [0.0] * num_experts
        for r in rows:
            probs = torch.softmax(logits[r].double(), -1).tolist()
            top1 = max(range(num_experts), key=lambda e: probs[e])
            ce[top1] += 1 / len(rows)
            for e in range(num_experts):
                me[e] += probs[e] / len(rows)
        total += num_experts * sum(m * c for m, c in zip(me, ce))
    return total


@pytest.mark.parametrize("top_k", [1, 3])
def test_top1_sum_mode_is_the_official_convention(top_k):
    logits = tuple(torch.randn(4 * 5 * 2, 7) * 2 for _ in range(3))  # 3 layers, B=4, T=5, moe_heads=2
    mask = (torch.rand(4, 5) > 0.3).long()
    row_mask = mask.reshape(-1).repeat_interleave(2).tolist()
    got = load_balancing_loss(logits, 7, top_k, mask, moe_heads=2, mode="top1_sum")
    assert got.item() == pytest.approx(naive_gshard_top1_sum(logits, 7, row_mask), rel=1e-5)
    # the default averages the L=3 layers and counts all k assignments: about L/k times smaller here
    per_layer = load_balancing_loss(logits, 7, top_k, mask, moe_heads=2, mode="per_layer")
    assert got.item() > 2 * per_layer.item() / top_k


def test_moh_balance_loss_of_a_padding_only_batch_is_zero():
    logits = (torch.randn(2, 4, 5, requires_grad=True),)
    loss = moh_load_balancing_loss(logits, 2, torch.zeros(2, 4, dtype=torch.long))
    assert loss.item() == 0.0
    loss.backward()
    assert torch.isfinite(logits[0].grad).all()
    moe = load_balancing_loss((torch.randn(8, 4),), 4, 2, torch.zeros(2, 4, dtype=torch.long))
    assert moe.item() == 0.0
