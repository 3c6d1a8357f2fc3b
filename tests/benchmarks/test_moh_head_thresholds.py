"""benchmarks/studies/moh_head_thresholds.py: the heads it counts against the gates counted by hand, on a tiny MoH-LLaMA with
thresholds (a count that varies by token) and without (exactly shared + K)."""

import sys
from pathlib import Path

import pytest
import torch

from mhmoe import MoHLlamaConfig, MoHLlamaForCausalLM
from tests.causal_lm_tester import randomise_moh_routers
from tests.models.test_moh import VOCAB, tiny_llama_fields

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks" / "studies"))

import moh_head_thresholds as bench  # noqa: E402


@pytest.mark.parametrize("thresholds", [None, [0.4, -0.3]])
def test_active_fraction_counts_the_gates_the_model_runs(thresholds):
    torch.manual_seed(0)
    config = MoHLlamaConfig(
        **tiny_llama_fields(), moh_shared_heads=3, moh_active_heads=2, moh_router="learned",
        moh_straight_through=True, moh_head_thresholds=thresholds,
    )  # fmt: skip
    model = MoHLlamaForCausalLM(config).eval()
    randomise_moh_routers(model)
    blocks = torch.randint(0, VOCAB, (5, 16), generator=torch.Generator().manual_seed(1))
    ppl, fraction = bench.active_fraction(model, blocks)
    inputs = []  # each layer's router input (the attention's input), captured apart from the routers
    hooks = [
        layer.input_layernorm.register_forward_hook(lambda m, a, out: inputs.append(out))
        for layer in model.model.layers
    ]
    with torch.no_grad():
        model(blocks)
    for hook in hooks:
        hook.remove()
    expected = []
    for layer, x in zip(model.model.layers, inputs):
        scores = x @ layer.self_attn.head_router.routed_weight.T  # (B, T, 5)
        if thresholds is None:
            routed = torch.full(scores.shape[:-1], 2.0)
        else:
            routed = (scores > layer.self_attn.head_router.threshold).sum(-1).float()
            assert routed.unique().numel() > 1  # the count varies by token
        expected.append((3 + routed.mean()) / 8)
    assert fraction == pytest.approx(float(torch.stack(expected).mean()), abs=1e-6)
    assert ppl > 1 and torch.isfinite(torch.tensor(ppl))
