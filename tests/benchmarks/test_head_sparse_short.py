"""The gates of benchmarks/studies/head_sparse_short.py (its own and head_sparse_layer.py's top-K ones) and
benchmarks/studies/moh_prefill_bound.py's attention timer."""

import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks" / "studies"))

import head_sparse_layer  # noqa: E402
import head_sparse_short  # noqa: E402
import moh_prefill_bound  # noqa: E402


def test_top_k_gates_are_the_shared_heads_and_k_routed_heads_per_token():
    gates = head_sparse_layer.draw_gates(2, 50, 2, torch.Generator().manual_seed(0))
    assert gates.shape == (2, 50, 9) and set(gates.unique().tolist()) == {0.0, 1.0}
    assert (gates[..., :3] == 1).all() and (gates[..., 3:].sum(-1) == 2).all()
    assert len({tuple(row.tolist()) for row in gates[0, :, 3:]}) > 1  # drawn per token


def test_density_gates_keep_one_key_value_head_at_the_density():
    gates = head_sparse_short.density_gates(4000, 0.3, torch.Generator().manual_seed(0))
    assert (gates[..., :3] == 0).all() and (gates[..., 6:] == 0).all()
    assert abs(float(gates[..., 3:6].mean()) - 0.3) < 0.02


def test_parent_attention_timer_times_its_sdpa_calls_and_restores_sdpa():
    sdpa = F.scaled_dot_product_attention
    query = torch.randn(1, 2, 64, 8)

    def model(x, fail=False):
        F.scaled_dot_product_attention(x, x, x, is_causal=True)
        F.scaled_dot_product_attention(x, x, x, is_causal=True)
        if fail:
            raise RuntimeError("boom")
        return x

    timed = moh_prefill_bound.TimedAttention(model)
    assert timed(query) is query and len(timed.seconds) == 1 and timed.seconds[0] > 0
    with pytest.raises(RuntimeError):
        timed(query, fail=True)
    assert F.scaled_dot_product_attention is sdpa and len(timed.seconds) == 2
