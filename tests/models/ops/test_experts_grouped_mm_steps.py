"""The grouped_mm experts' fused CUDA steps (ops/experts/experts_grouped_mm_steps_triton.py) under TRITON_INTERPRET=1
(tests/conftest.py): each kernel against its PyTorch formula on odd shapes, and the whole grouped_mm experts op run
with them (forced on CPU) against the model's `eager` per-expert loop: outputs and all four gradients, dropless and
dropped, K = 1 and 3, frozen experts, a backward that keeps the graph, recomputed gate/up, inference, bf16."""

import pytest
import torch
import torch.nn.functional as F

from mhmoe.models.mhmoe.experts import eager_experts_forward, grouped_experts_forward
from mhmoe.models.ops.experts import experts_grouped_mm
from mhmoe.models.ops.experts import experts_grouped_mm_steps_triton as steps

from ..test_experts import _assert_bf16_close_to_eager, _experts, _routing, _run

pytestmark = pytest.mark.skipif(not steps.HAS_TRITON, reason="triton is not installed")


@pytest.fixture
def fused(monkeypatch):
    """Force the fused steps on CPU and count the kernels' calls; none of them may have failed (a failure would
    quietly run the PyTorch steps instead)."""
    monkeypatch.setattr(experts_grouped_mm, "STEPS_KERNELS_ON_CPU", True)
    calls = []
    for name in ("swiglu", "swiglu_backward", "combine_slots"):
        original = getattr(experts_grouped_mm, name)
        counted = lambda *a, _f=original, _n=name, **k: calls.append(_n) or _f(*a, **k)  # noqa: E731
        monkeypatch.setattr(experts_grouped_mm, name, counted)
    yield calls
    assert not experts_grouped_mm.STEPS_FAILED


def test_a_failing_fused_step_runs_the_pytorch_steps_and_is_recorded(monkeypatch, caplog):
    """A fused kernel that fails (a GPU Triton cannot compile for) must not stop training: warned once, recorded in
    `backends.fallbacks()`, the PyTorch steps run from then on, forward and backward, with the same results."""
    from mhmoe.models.ops import backends

    monkeypatch.setattr(experts_grouped_mm, "STEPS_KERNELS_ON_CPU", True)
    experts = _experts(8, 16, 13, 3, torch.float32)
    index, weights, dropped = _routing(37, 13, 3, 0.3, torch.float32)
    generator = torch.Generator().manual_seed(7)
    hidden, grad_out = torch.randn(37, 8, generator=generator), torch.randn(37, 8, generator=generator)
    expected = _run(eager_experts_forward, experts, hidden, index, weights, dropped, grad_out)

    def broken(*args, **kwargs):
        raise RuntimeError("no kernel for this GPU")

    for step in ("swiglu", "combine_slots", "swiglu_backward"):  # each step failing first, alone
        monkeypatch.setattr(experts_grouped_mm, step, broken)
        backends.reset_fallbacks()
        with caplog.at_level("WARNING"):
            got = _run(grouped_experts_forward, experts, hidden, index, weights, dropped, grad_out)
        for have, want in zip(got, expected):
            torch.testing.assert_close(have, want, rtol=1e-5, atol=1e-5)
        assert backends.fallbacks() == {"experts.grouped_mm_steps": "RuntimeError: no kernel for this GPU"}
        assert caplog.text.count("fused Triton steps failed") == 1
        caplog.clear()
        monkeypatch.undo()
        monkeypatch.setattr(experts_grouped_mm, "STEPS_KERNELS_ON_CPU", True)
    backends.reset_fallbacks()
    assert not experts_grouped_mm.STEPS_FAILED


@pytest.mark.parametrize("rows, inter", [(37, 7), (5, 130), (1, 1)])
def test_swiglu_and_its_backward_match_the_formula(rows, inter):
    generator = torch.Generator().manual_seed(rows)
    gate_up = torch.randn(rows, 2 * inter, generator=generator)
    grad_hidden = torch.randn(rows, inter, generator=generator)
    weights = torch.rand(rows, generator=generator)
    gate, up = gate_up[:, :inter], gate_up[:, inter:]
    leaf = gate_up.clone().requires_grad_()
    want_hidden = F.silu(leaf[:, :inter]) * leaf[:, inter:]
    (want_grad,) = torch.autograd.grad(want_hidden, leaf, grad_hidden * weights[:, None])
    torch.testing.assert_close(steps.swiglu(gate_up), want_hidden.detach())
    hidden, dot = torch.empty(rows, inter), torch.empty(rows)
    grad_gate_up = gate_up.clone()  # written over itself, as the backward does when the graph is freed
    steps.swiglu_backward(grad_gate_up, grad_hidden, weights, grad_gate_up, hidden, dot)
    torch.testing.assert_close(grad_gate_up, want_grad)
    torch.testing.assert_close(hidden, F.silu(gate) * up * weights[:, None])  # weighted: for d down_proj
    torch.testing.assert_close(dot, (grad_hidden * F.silu(gate) * up).sum(1))
    in_place = gate_up.clone()  # into the gate half (row stride 2I), as the inference forward does
    steps.swiglu(in_place, out=in_place[:, :inter])
    torch.testing.assert_close(in_place[:, :inter], want_hidden.detach())
    torch.testing.assert_close(in_place[:, inter:], up)  # the up half untouched


@pytest.mark.parametrize("top_k, width", [(3, 5), (1, 130), (8, 16)])
def test_combine_matches_the_weighted_gather(top_k, width):
    generator = torch.Generator().manual_seed(top_k)
    num_rows, num_kept = 23, 40
    rows = torch.randn(num_kept, width, generator=generator)
    rows[-1] = float("nan")  # a row that only dropped slots point at: never read
    slot_pos = torch.randint(0, num_kept - 1, (num_rows * top_k,), generator=generator)
    dropped = torch.rand(num_rows * top_k, generator=generator) < 0.3
    slot_pos[dropped] = num_kept - 1
    weights = torch.rand(num_rows, top_k, generator=generator)
    slots = rows[slot_pos].masked_fill(dropped[:, None], 0.0).view(num_rows, top_k, width)
    got = steps.combine_slots(rows, slot_pos, dropped, weights, top_k, torch.float32)
    torch.testing.assert_close(got, (weights[..., None] * slots).sum(1))
    unweighted = steps.combine_slots(
        rows, slot_pos, dropped, None, top_k, torch.float64
    )  # summed in fp32, stored as fp64
    assert unweighted.dtype == torch.float64
    torch.testing.assert_close(unweighted, slots.double().sum(1), rtol=1e-6, atol=1e-6)


CASES = {  # name: (W, I, E, K, N)
    "odd": (5, 7, 13, 3, 37),
    "aligned": (8, 16, 13, 3, 37),
    "top1": (8, 16, 13, 1, 37),
}


@pytest.mark.parametrize("drop_fraction", [0.0, 0.3], ids=["dropless", "dropped"])
@pytest.mark.parametrize("case", list(CASES))
def test_fused_steps_match_eager(fused, case, drop_fraction):
    width, inter, num_experts, top_k, num_rows = CASES[case]
    experts = _experts(width, inter, num_experts, top_k, torch.float32)
    index, weights, dropped = _routing(num_rows, num_experts, top_k, drop_fraction, torch.float32)
    generator = torch.Generator().manual_seed(2)
    hidden = torch.randn(num_rows, width, generator=generator)
    grad_out = torch.randn(num_rows, width, generator=generator)
    expected = _run(eager_experts_forward, experts, hidden, index, weights, dropped, grad_out)
    got = _run(grouped_experts_forward, experts, hidden, index, weights, dropped, grad_out)
    assert fused == ["swiglu", "combine_slots", "swiglu_backward", "combine_slots"]
    for name, want, have in zip(("output", "d_input", "d_weights", "d_gate_up_proj", "d_down_proj"), expected, got):
        torch.testing.assert_close(have, want, rtol=1e-5, atol=1e-5, msg=lambda m, name=name: f"{name}: {m}")
    assert torch.count_nonzero(got[2][dropped]) == 0


@pytest.mark.parametrize("recompute", [False, True])
def test_fused_steps_keep_graph_recompute_frozen_and_inference(fused, monkeypatch, recompute):
    monkeypatch.setattr(experts_grouped_mm, "RECOMPUTE_GATE_UP", recompute)
    experts = _experts(8, 16, 13, 3, torch.float32)
    index, weights, _ = _routing(37, 13, 3, 0.3, torch.float32)
    hidden = torch.randn(37, 8, generator=torch.Generator().manual_seed(6))

    def grads(forward, twice=False):
        x, w = hidden.clone().requires_grad_(), weights.clone().requires_grad_()
        experts.zero_grad(set_to_none=True)
        out = forward(experts, x, index, w)
        out.square().sum().backward(retain_graph=twice)
        if twice:  # the graph kept: the backward must not have overwritten what the forward saved
            out.square().sum().backward()
        return out.detach(), x.grad, w.grad, experts.gate_up_proj.grad, experts.down_proj.grad

    for twice in (False, True):
        for have, want in zip(grads(grouped_experts_forward, twice), grads(eager_experts_forward, twice)):
            torch.testing.assert_close(have, want, rtol=1e-5, atol=1e-5)
    experts.requires_grad_(False)  # frozen experts: only the input and routing weights need gradients
    for have, want in zip(grads(grouped_experts_forward)[:3], grads(eager_experts_forward)[:3]):
        torch.testing.assert_close(have, want, rtol=1e-5, atol=1e-5)
    fused.clear()
    with torch.no_grad():  # inference: act·up written into gate/up's gate half
        got = grouped_experts_forward(experts, hidden, index, weights)
    assert fused == ["swiglu", "combine_slots"]
    torch.testing.assert_close(got, eager_experts_forward(experts, hidden, index, weights), rtol=1e-5, atol=1e-5)


def test_fused_steps_in_bf16_and_only_for_silu(fused):
    hidden, index, weights, dropped, grad_out = _assert_bf16_close_to_eager()
    assert "swiglu_backward" in fused
    fused.clear()
    gelu = _experts(8, 16, 13, 3, torch.float32, act="gelu")
    _run(grouped_experts_forward, gelu, hidden.float(), index, weights, dropped, grad_out.float())
    assert fused == []  # another activation: the PyTorch steps
