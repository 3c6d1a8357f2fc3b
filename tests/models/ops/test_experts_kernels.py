"""The Triton experts kernels (ops/experts/experts_triton.py) against the PyTorch reference (experts_naive.py, itself
checked against the model's `eager` loop), under TRITON_INTERPRET=1 (tests/conftest.py): outputs and gradients on odd
widths, E ∈ {1, 3, 7, 40}, K ∈ {1, 2, 3, 8}, experts without rows, every row on one expert, dropped assignments, the
split-K weight gradient, bf16; the `torch.library` op (opcheck, torch.compile); a whole model running them through
Transformers' experts registry. The CUDA tests (TF32 and IEEE fp32, bf16, autotuned tiles) skip without a GPU."""

import pytest
import torch
import torch.nn.functional as F
from torch.library import opcheck

from mhmoe.models.mhmoe.configuration_mhmoe import MHMoEConfig
from mhmoe.models.mhmoe.experts import MHMoEExperts, eager_experts_forward
from mhmoe.models.ops import backends
from mhmoe.models.ops.experts import experts_naive, experts_triton
from mhmoe.models.ops.routing.routing_naive import sort_by_expert

from .spread_model import spread_model

pytestmark = pytest.mark.skipif(not experts_triton.HAS_TRITON, reason="triton is not installed")

CASES = [  # (N, W, I, E, K, drop fraction)
    (37, 5, 7, 13, 3, 0.0),
    (37, 8, 16, 13, 3, 0.3),
    (29, 24, 40, 3, 2, 0.0),
    (20, 16, 16, 1, 1, 0.0),
    (23, 12, 20, 7, 1, 0.2),
    (11, 16, 24, 40, 8, 0.0),
]


def _problem(num_rows, width, inter, num_experts, top_k, drop, seed=0):
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(num_rows, width, generator=generator)
    gate_up = torch.randn(num_experts, 2 * inter, width, generator=generator) * 0.5
    down = torch.randn(num_experts, width, inter, generator=generator) * 0.5
    index = torch.stack([torch.randperm(num_experts, generator=generator)[:top_k] for _ in range(num_rows)])
    weights = torch.rand(num_rows, top_k, generator=generator)
    dropped = torch.rand(num_rows, top_k, generator=generator) < drop
    return x, index.masked_fill(dropped, num_experts), weights.masked_fill(dropped, 0.0), gate_up, down


CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (the GPU-only kernel checks)")


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
    config = MHMoEConfig(
        hidden_size=16,
        moe_heads=2,
        num_attention_heads=1,
        head_dim=2,
        num_experts=7,
        num_experts_per_tok=3,
        moe_intermediate_size=12,
    )
    experts = MHMoEExperts(config)
    x, index, weights, gate_up, down = _problem(19, 8, 12, 7, 3, 0.3, seed=5)
    with torch.no_grad():
        experts.gate_up_proj.copy_(gate_up)
        experts.down_proj.copy_(down)
        want = eager_experts_forward(experts, x, index, weights)
    torch.testing.assert_close(experts_naive.experts_forward(x, index, weights, gate_up, down, F.silu), want)


GRAD_CASES = [(37, 5, 7, 13, 3, 0.0), (37, 8, 16, 13, 3, 0.3), (20, 16, 16, 1, 1, 0.0), (11, 16, 24, 40, 8, 0.0)]


def _outputs_and_grads(forward, problem, dtype=None):
    """forward's output and the gradients of the rows, routing weights, gate_up_proj and down_proj of a fixed
    weighted sum of the output; the tensors (not the routing) cast to `dtype` first."""
    index = problem[1]
    x, weights, gate_up, down = (t.to(dtype or t.dtype).clone().requires_grad_() for t in (problem[0], *problem[2:]))
    out = forward(x, index, weights, gate_up, down)
    (out.float() * torch.linspace(-1, 1, out.numel(), device=out.device).view_as(out)).sum().backward()
    return [out.detach(), x.grad, weights.grad, gate_up.grad, down.grad]


NAMES = ("out", "d_x", "d_weights", "d_gate_up", "d_down")


@pytest.mark.parametrize("case", GRAD_CASES, ids=[f"N{n}-E{e}-K{k}-drop{d}" for n, w, i, e, k, d in GRAD_CASES])
def test_gradients_match_reference(case):
    """Output and the gradients of the rows, routing weights, gate_up_proj and down_proj (autotuned path: under the
    interpreter its single config)."""
    problem = _problem(*case, seed=7)
    order, offsets = sort_by_expert(problem[1], case[3])
    have = _outputs_and_grads(lambda *a: experts_triton.experts_forward(*a, order, offsets), problem)
    want = _outputs_and_grads(experts_naive.experts_forward, problem)
    for name, h, w in zip(NAMES, have, want):
        torch.testing.assert_close(h, w, rtol=1e-5, atol=2e-5, msg=lambda m, name=name: f"{name}: {m}")


@pytest.mark.parametrize("num_splits", [1, 3, 5])
def test_split_weight_gradient(num_splits):
    """The weight gradient cut into chunks of each expert's rows (16-row steps): an expert with 86 rows (6 steps, the
    last short: 3 splits cut it evenly, 5 into 2+2+2 steps and two empty chunks), experts with 8 to 24
    rows (one or two steps: the other chunks empty) or none, dropped rows; odd widths."""
    x, index, weights, gate_up, down = _problem(90, 7, 11, 6, 2, 0.1, seed=9)
    index[:85, 0] = 2  # expert 2 gets most rows
    index[:85, 1] = torch.where(index[:85, 1] == 2, 6, index[:85, 1])  # keep a row's experts distinct (6 = dropped)
    index[index == 4] = 6  # expert 4 gets none
    problem = (x, index, weights.masked_fill(index == 6, 0.0), gate_up, down)
    order, offsets = sort_by_expert(index, 6)
    assert int(offsets[2] - offsets[1]) == 86 and int(offsets[4] - offsets[3]) == 0
    blocks = dict(block_m=16, block_n=16, block_k=16, num_splits=num_splits)
    have = _outputs_and_grads(lambda *a: experts_triton.experts_forward(*a, order, offsets, **blocks), problem)
    want = _outputs_and_grads(experts_naive.experts_forward, problem)
    for name, h, w in zip(NAMES, have, want):
        torch.testing.assert_close(h, w, rtol=1e-5, atol=2e-5, msg=lambda m, name=name: f"{name}: {m}")
    assert not have[4][4].any() and not have[3][4].any()  # the expert without rows gets zero weight gradients


def test_default_num_splits():
    assert experts_triton.default_num_splits(1000, 8, 64, 128) == 1  # ~125 rows per expert: one chunk
    assert experts_triton.default_num_splits(8 * 1536, 8, 64, 128) == 3
    assert experts_triton.default_num_splits(8 * 10**5, 8, 64, 128) == 4  # at most 4
    assert experts_triton.default_num_splits(96 * 4096, 96, 1024, 1024) == 1  # partial sums would pass 256 MiB


def test_bf16():
    """bf16 rows and weights: loaded and stored as bf16, multiplied in fp32 (the interpreter cannot multiply bf16;
    a GPU multiplies bf16 with fp32 accumulation), act·up kept in bf16 between the GEMMs as the reference's bf16
    `F.linear`s do. Checked against the fp32 reference on the same (bf16-rounded) values: no further from it than
    the reference run in bf16 is (within 1.5× + 2⁻⁸ of the output's scale), and at bf16 tolerance."""
    problem = _problem(37, 24, 40, 7, 3, 0.2, seed=2)
    problem = tuple(t.bfloat16().float() if t.is_floating_point() else t for t in problem)
    order, offsets = sort_by_expert(problem[1], 7)
    truth = _outputs_and_grads(experts_naive.experts_forward, problem)
    kernel = _outputs_and_grads(lambda *a: experts_triton.experts_forward(*a, order, offsets), problem, torch.bfloat16)
    naive = _outputs_and_grads(experts_naive.experts_forward, problem, torch.bfloat16)
    assert kernel[0].dtype == torch.bfloat16 and all(g.dtype == torch.bfloat16 for g in kernel[1:])
    for name, k, n, t in zip(NAMES, kernel, naive, truth):
        scale = float(t.abs().max())
        kernel_error, naive_error = float((k.float() - t).abs().max()), float((n.float() - t).abs().max())
        assert kernel_error <= 1.5 * naive_error + scale / 256, (name, kernel_error, naive_error, scale)
        torch.testing.assert_close(
            k.float(), t, rtol=1.6e-2, atol=2e-2 * scale, msg=lambda m, name=name: f"{name}: {m}"
        )


def test_custom_op_opcheck():
    """`torch.ops.mhmoe.triton_experts`: schema, fake (meta) implementation, autograd registration and AOT dispatch
    with dynamic shapes, as `torch.library.opcheck` checks them (the kernels run under the interpreter)."""
    x, index, weights, gate_up, down = _problem(7, 8, 16, 3, 2, 0.2, seed=4)
    order, offsets = sort_by_expert(index, 3)
    args = (x.requires_grad_(), gate_up.requires_grad_(), down.requires_grad_(), order, offsets, 2, [], 2)
    opcheck(torch.ops.mhmoe.triton_experts.default, args)
    grad = torch.randn(order.numel(), 8)
    opcheck(
        torch.ops.mhmoe.triton_experts_backward.default,
        (grad, x.detach(), gate_up.detach(), down.detach(), order, offsets, 2, [], 0),
    )


def test_torch_compile_and_export_trace_the_op():
    """torch.compile (aot_eager, fullgraph: no graph break) of the experts forward and backward gives the eager
    results, its fake implementation giving the shapes; torch.export of a module routing with the (traceable)
    reference sort holds the op as one node and runs it."""
    import torch._dynamo

    problem = _problem(19, 8, 12, 5, 2, 0.2, seed=6)
    order, offsets = sort_by_expert(problem[1], 5)

    def forward(x, index, weights, gate_up, down):
        return experts_triton.experts_forward(x, index, weights, gate_up, down, order, offsets)

    torch._dynamo.reset()
    compiled = torch.compile(forward, backend="aot_eager", fullgraph=True)
    have = _outputs_and_grads(compiled, problem)
    want = _outputs_and_grads(forward, problem)
    for name, h, w in zip(NAMES, have, want):
        torch.testing.assert_close(h, w, rtol=1e-6, atol=1e-6, msg=lambda m, name=name: f"{name}: {m}")
    torch._dynamo.reset()

    class Experts(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.gate_up, self.down = torch.nn.Parameter(problem[3]), torch.nn.Parameter(problem[4])

        def forward(self, x, index, weights):
            order, offsets = sort_by_expert(index, 5)
            return experts_triton.experts_forward(x, index, weights, self.gate_up, self.down, order, offsets)

    exported = torch.export.export(Experts(), problem[:3])
    assert "torch.ops.mhmoe.triton_experts.default" in exported.graph_module.code
    torch.testing.assert_close(exported.module()(*problem[:3]), want[0], rtol=1e-6, atol=1e-6)


def test_tile_configs():
    """On a GPU the autotuner chooses among 64- and 128-row tiles (and 32 for small inputs) with num_warps and
    num_stages; under the interpreter the list is one tile (the autotuner then runs it without benchmarking, which
    would need a GPU), and pinned tiles bypass it."""
    configs = experts_triton._configs()
    assert len(configs) == 1 and configs[0].kwargs == dict(BLOCK_M=32, BLOCK_N=32, BLOCK_K=32)
    assert experts_triton._gate_up_tuned.configs == configs
    import mhmoe.models.ops.experts.experts_triton as module

    original = module.interpreting
    module.interpreting = lambda: False
    try:
        gpu = experts_triton._configs()
    finally:
        module.interpreting = original
    assert {c.kwargs["BLOCK_M"] for c in gpu} >= {64, 128} and {c.kwargs["BLOCK_N"] for c in gpu} >= {64, 128}
    assert {c.num_warps for c in gpu} == {4, 8} and {c.num_stages for c in gpu} >= {3, 4}
    fits = {
        dtype: experts_triton._fitting(gpu, {"x": torch.empty(0, dtype=dtype), "width": 64})
        for dtype in (torch.bfloat16, torch.float32)
    }
    big = {"BLOCK_M": 128, "BLOCK_N": 128, "BLOCK_K": 64}  # 3 stages × 24K elements: 144 KiB in bf16, 288 in fp32
    assert big in [c.kwargs for c in fits[torch.bfloat16]] and big not in [c.kwargs for c in fits[torch.float32]]
    assert len(fits[torch.bfloat16]) == len(gpu) and 0 < len(fits[torch.float32]) < len(gpu)
    with pytest.raises(ValueError, match="block_m, block_n and block_k together"):
        experts_triton.experts_forward(
            *_problem(5, 8, 8, 2, 1, 0.0), *sort_by_expert(torch.zeros(5, 1).long(), 2), block_m=16
        )


def _cuda_problem(dtype, seed=0):
    """A GPU-sized problem (2048 rows, W=256, I=384, E=16, K=2, 10% dropped) on CUDA, and its fp64 CPU truth."""
    problem = _problem(2048, 256, 384, 16, 2, 0.1, seed=seed)
    problem = tuple(t.to(dtype).to(torch.float64) if t.is_floating_point() else t for t in problem)  # dtype-exact
    truth = _outputs_and_grads(experts_naive.experts_forward, problem)
    cuda = tuple(t.cuda() for t in problem)
    return cuda, truth


@CUDA
@pytest.mark.parametrize("tf32", [True, False], ids=["tf32", "ieee"])
def test_cuda_fp32(tf32, monkeypatch):
    """fp32 on the GPU (autotuned tiles): TF32 in `tl.dot` when torch allows it for its own matmuls — 10-bit
    mantissas, ~2⁻¹¹ relative per product, so 5e-3 of the output's scale; IEEE fp32 otherwise, at fp32 tolerance."""
    monkeypatch.setattr(torch.backends.cuda.matmul, "allow_tf32", tf32)
    problem, truth = _cuda_problem(torch.float32)
    order, offsets = sort_by_expert(problem[1], 16)
    have = _outputs_and_grads(lambda *a: experts_triton.experts_forward(*a, order, offsets), problem, torch.float32)
    for name, h, t in zip(NAMES, have, truth):
        scale = float(t.abs().max())
        tol = 5e-3 if tf32 else 2e-5
        torch.testing.assert_close(
            h.double().cpu(), t, rtol=tol, atol=tol * scale, msg=lambda m, name=name: f"{name}: {m}"
        )


@CUDA
def test_cuda_bf16():
    """bf16 on the GPU (tensor-core dots, fp32 accumulation, autotuned tiles) at bf16 tolerance of the fp64 truth."""
    problem, truth = _cuda_problem(torch.bfloat16, seed=1)
    order, offsets = sort_by_expert(problem[1], 16)
    have = _outputs_and_grads(lambda *a: experts_triton.experts_forward(*a, order, offsets), problem, torch.bfloat16)
    for name, h, t in zip(NAMES, have, truth):
        scale = float(t.abs().max())
        torch.testing.assert_close(
            h.double().cpu(), t, rtol=2e-2, atol=2e-2 * scale, msg=lambda m, name=name: f"{name}: {m}"
        )


def test_model_with_experts_implementation_triton(monkeypatch):
    """`experts_implementation="triton"` (the experts op's triton backend, ops/backends.py) runs a whole MH-MoE model
    (h=2, capacity drops) with the `grouped_mm` path's logits and gradients."""
    config = MHMoEConfig(
        vocab_size=37,
        hidden_size=32,
        intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        moe_heads=2,
        num_experts=6,
        num_experts_per_tok=2,
        moe_intermediate_size=16,
        capacity_factor=0.75,
    )
    model = spread_model(config)
    ids = torch.randint(0, 37, (2, 7), generator=torch.Generator().manual_seed(3))
    calls = []
    forward = backends.IMPLEMENTATIONS["experts"]["triton"]
    monkeypatch.setitem(backends.IMPLEMENTATIONS["experts"], "triton", lambda *a: calls.append(1) or forward(*a))
    results = []
    for implementation in ("grouped_mm", "triton"):
        model.set_experts_implementation(implementation)
        assert model.config._experts_implementation == implementation
        model.zero_grad(set_to_none=True)
        out = model(input_ids=ids, labels=ids)
        out.loss.backward()
        results.append([out.logits, out.loss] + [p.grad for p in model.parameters()])
    assert len(calls) == 2
    for have, want in zip(results[1], results[0]):
        torch.testing.assert_close(have, want, rtol=1e-5, atol=1e-5)
