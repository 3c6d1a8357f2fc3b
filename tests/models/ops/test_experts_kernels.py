"""The Triton experts kernels (ops/experts/experts_triton.py) against the PyTorch reference (experts_naive.py, itself
checked against the model's `eager` loop), under TRITON_INTERPRET=1 (tests/conftest.py): outputs and gradients on odd
widths, E ∈ {1, 3, 7, 40}, K ∈ {1, 2, 3, 8}, experts without rows, every row on one expert, dropped assignments; and a
whole model running them through Transformers' experts registry."""

import pytest
import torch
import torch.nn.functional as F

from mhmoe.models.mhmoe.configuration_mhmoe import MHMoEConfig
from mhmoe.models.mhmoe.modeling_mhmoe import MHMoEExperts
from mhmoe.models.mhmoe.moe import eager_experts_forward
from mhmoe.models.mhmoe.ops.experts import experts_naive, experts_triton
from mhmoe.models.mhmoe.ops.routing.routing_naive import sort_by_expert

from .spread_model import spread_model

pytestmark = pytest.mark.skipif(not experts_triton.HAS_TRITON, reason="triton is not installed")

CASES = [  # (N, W, I, E, K, drop fraction)
    (37, 5, 7, 13, 3, 0.0), (37, 8, 16, 13, 3, 0.3), (29, 24, 40, 3, 2, 0.0), (20, 16, 16, 1, 1, 0.0),
    (23, 12, 20, 7, 1, 0.2), (11, 16, 24, 40, 8, 0.0),
]  # fmt: skip


def _problem(num_rows, width, inter, num_experts, top_k, drop, seed=0):
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(num_rows, width, generator=generator)
    gate_up = torch.randn(num_experts, 2 * inter, width, generator=generator) * 0.5
    down = torch.randn(num_experts, width, inter, generator=generator) * 0.5
    index = torch.stack([torch.randperm(num_experts, generator=generator)[:top_k] for _ in range(num_rows)])
    weights = torch.rand(num_rows, top_k, generator=generator)
    dropped = torch.rand(num_rows, top_k, generator=generator) < drop
    return x, index.masked_fill(dropped, num_experts), weights.masked_fill(dropped, 0.0), gate_up, down


def _kernel(x, index, weights, gate_up, down, **blocks):
    order, offsets = sort_by_expert(index, gate_up.shape[0])
    with torch.no_grad():
        return experts_triton.experts_forward(x, index, weights, gate_up, down, order, offsets, **blocks)


@pytest.mark.parametrize("case", CASES, ids=[f"N{n}-W{w}-I{i}-E{e}-K{k}-drop{d}" for n, w, i, e, k, d in CASES])
def test_forward_matches_reference(case):
    x, index, weights, gate_up, down = _problem(*case)
    expected = experts_naive.experts_forward(x, index, weights, gate_up, down)
    torch.testing.assert_close(_kernel(x, index, weights, gate_up, down), expected, rtol=1e-5, atol=1e-5)
    if case[-1]:  # a row whose every slot is dropped gets 0
        everything_dropped = (index == case[3]).all(dim=1)
        assert torch.count_nonzero(_kernel(x, index, weights, gate_up, down)[everything_dropped]) == 0


def test_every_row_on_one_expert_and_block_sizes():
    x, index, weights, gate_up, down = _problem(45, 16, 24, 5, 2, 0.0, seed=3)
    index[:, 0] = 4  # every row's first choice is expert 4; the second choices avoid it
    index[:, 1] = torch.arange(45) % 4
    expected = experts_naive.experts_forward(x, index, weights, gate_up, down)
    for blocks in (dict(block_m=16, block_n=16, block_k=16), dict(block_m=32, block_n=32, block_k=16)):
        torch.testing.assert_close(_kernel(x, index, weights, gate_up, down, **blocks), expected, rtol=1e-5, atol=1e-5)


def test_reference_is_the_models_eager_loop():
    config = MHMoEConfig(hidden_size=16, moe_heads=2, num_attention_heads=1, head_dim=2, num_experts=7,
                         num_experts_per_tok=3, moe_intermediate_size=12)  # fmt: skip
    experts = MHMoEExperts(config)
    x, index, weights, gate_up, down = _problem(19, 8, 12, 7, 3, 0.3, seed=5)
    with torch.no_grad():
        experts.gate_up_proj.copy_(gate_up)
        experts.down_proj.copy_(down)
        want = eager_experts_forward(experts, x, index, weights)
    torch.testing.assert_close(experts_naive.experts_forward(x, index, weights, gate_up, down, F.silu), want)


GRAD_CASES = [(37, 5, 7, 13, 3, 0.0), (37, 8, 16, 13, 3, 0.3), (20, 16, 16, 1, 1, 0.0), (11, 16, 24, 40, 8, 0.0)]


@pytest.mark.parametrize("case", GRAD_CASES, ids=[f"N{n}-E{e}-K{k}-drop{d}" for n, w, i, e, k, d in GRAD_CASES])
def test_gradients_match_reference(case):
    """Output and the gradients of the rows, routing weights, gate_up_proj and down_proj."""
    problem = _problem(*case, seed=7)
    index = problem[1]
    order, offsets = sort_by_expert(index, case[3])
    results = []
    for forward in (lambda *a: experts_triton.experts_forward(*a, order, offsets), experts_naive.experts_forward):
        x, weights, gate_up, down = (t.clone().requires_grad_() for t in (problem[0], *problem[2:]))
        out = forward(x, index, weights, gate_up, down)
        (out * torch.linspace(-1, 1, out.numel()).view_as(out)).sum().backward()
        results.append([out.detach(), x.grad, weights.grad, gate_up.grad, down.grad])
    for name, have, want in zip(("out", "d_x", "d_weights", "d_gate_up", "d_down"), *results):
        torch.testing.assert_close(have, want, rtol=1e-5, atol=2e-5, msg=lambda m, name=name: f"{name}: {m}")


def test_model_through_the_experts_registry(monkeypatch):
    """Registered with Transformers' experts interface, the kernels run a whole MH-MoE model (h=2, capacity drops)
    with the `grouped_mm` path's logits and gradients."""
    from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS


    config = MHMoEConfig(vocab_size=37, hidden_size=32, intermediate_size=32, num_hidden_layers=2,
                         num_attention_heads=2, moe_heads=2, num_experts=6, num_experts_per_tok=2,
                         moe_intermediate_size=16, capacity_factor=0.75)  # fmt: skip
    model = spread_model(config)
    ids = torch.randint(0, 37, (2, 7), generator=torch.Generator().manual_seed(3))
    calls = []
    forward = experts_triton.triton_experts_forward
    monkeypatch.setitem(ALL_EXPERTS_FUNCTIONS._global_mapping, "mhmoe_triton",
                        lambda *a: calls.append(1) or forward(*a))  # fmt: skip
    results = []
    for implementation in ("grouped_mm", "mhmoe_triton"):
        model.set_experts_implementation(implementation)
        model.zero_grad(set_to_none=True)
        out = model(input_ids=ids, labels=ids)
        out.loss.backward()
        results.append([out.logits, out.loss] + [p.grad for p in model.parameters()])
    assert len(calls) == 2
    for have, want in zip(results[1], results[0]):
        torch.testing.assert_close(have, want, rtol=1e-5, atol=1e-5)
