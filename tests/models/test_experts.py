"""`grouped_mm` experts (sorted rows, grouped GEMMs, hand-written backward) against the `eager` per-expert loop.

Shapes are odd on purpose (W=5, I=7, E=13, K=3, N=37; some experts get no row) so that torch's grouped GEMM kernel
refuses them and the per-group fallback runs; an aligned variant (W=8, I=16) runs the kernel itself.
"""

import pytest
import torch

from mhmoe.models.mhmoe.configuration_mhmoe import MHMoEConfig
from mhmoe.models.mhmoe.experts import (
    MHMOE_EXPERTS_FUNCTIONS,
    MHMoEExperts,
    eager_experts_forward,
    grouped_experts_forward,
)
from mhmoe.models.mhmoe.sparse_moe import MHMoESparseMoeBlock
from mhmoe.models.ops import backends
from mhmoe.models.ops.backends import route, sort_by_expert
from mhmoe.models.ops.experts import experts_grouped_mm, grouped_gemm

EMPTY_EXPERTS = (4, 11, 12)  # never routed to


def _experts(width, inter, num_experts, top_k, dtype, act="silu", seed=0):
    config = MHMoEConfig(
        hidden_size=2 * width,
        moe_heads=2,
        num_attention_heads=1,
        head_dim=2,
        num_experts=num_experts,
        num_experts_per_tok=top_k,
        moe_intermediate_size=inter,
        hidden_act=act,
    )
    config._experts_implementation = "grouped_mm"
    experts = MHMoEExperts(config).to(dtype)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in experts.parameters():
            param.copy_(torch.randn(param.shape, generator=generator, dtype=dtype) * 0.5)
    return experts


def _routing(num_rows, num_experts, top_k, drop_fraction, dtype, seed=1):
    """Distinct experts per row avoiding EMPTY_EXPERTS; a `drop_fraction` of slots get sentinel E and weight 0."""
    generator = torch.Generator().manual_seed(seed)
    allowed = torch.tensor([e for e in range(num_experts) if e not in EMPTY_EXPERTS])
    index = torch.stack([allowed[torch.randperm(len(allowed), generator=generator)[:top_k]] for _ in range(num_rows)])
    weights = torch.rand(num_rows, top_k, generator=generator, dtype=dtype)
    dropped = torch.rand(num_rows, top_k, generator=generator) < drop_fraction
    if drop_fraction > 0:
        dropped[0] = True  # one row loses every slot
    return index.masked_fill(dropped, num_experts), weights, dropped


def _run(forward, experts, hidden, index, weights, dropped, grad_out):
    """Output and gradients w.r.t. (input, routing weights, gate_up_proj, down_proj)."""
    hidden = hidden.detach().requires_grad_()
    weights = weights.detach().requires_grad_()
    experts.zero_grad(set_to_none=True)
    out = forward(experts, hidden, index, weights.masked_fill(dropped, 0.0))
    out.backward(grad_out)
    return out.detach(), hidden.grad, weights.grad, experts.gate_up_proj.grad, experts.down_proj.grad


CASES = {
    # name: (W, I, E, K, N, dtype, rtol/atol)
    "odd-fp64": (5, 7, 13, 3, 37, torch.float64, 1e-10),
    "odd-fp32": (5, 7, 13, 3, 37, torch.float32, 1e-5),
    "aligned-fp32": (8, 16, 13, 3, 37, torch.float32, 1e-5),
    "aligned-top1-fp32": (8, 16, 13, 1, 37, torch.float32, 1e-5),
}


@pytest.mark.parametrize("drop_fraction", [0.0, 0.3], ids=["dropless", "capacity-dropped"])
@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("act", ["silu", "gelu"])
def test_grouped_matches_eager(case, drop_fraction, act):
    width, inter, num_experts, top_k, num_rows, dtype, tol = CASES[case]
    experts = _experts(width, inter, num_experts, top_k, dtype, act)
    index, weights, dropped = _routing(num_rows, num_experts, top_k, drop_fraction, dtype)
    generator = torch.Generator().manual_seed(2)
    hidden = torch.randn(num_rows, width, generator=generator, dtype=dtype)
    grad_out = torch.randn(num_rows, width, generator=generator, dtype=dtype)

    expected = _run(eager_experts_forward, experts, hidden, index, weights, dropped, grad_out)
    got = _run(grouped_experts_forward, experts, hidden, index, weights, dropped, grad_out)
    for name, want, have in zip(("output", "d_input", "d_weights", "d_gate_up_proj", "d_down_proj"), expected, got):
        assert have.dtype == want.dtype and have.shape == want.shape, name
        torch.testing.assert_close(have, want, rtol=tol, atol=tol, msg=lambda m, name=name: f"{name}: {m}")
    # nothing reaches empty experts or dropped slots
    for grad in got[3:]:
        assert torch.count_nonzero(grad[list(EMPTY_EXPERTS)]) == 0
    assert torch.count_nonzero(got[2][dropped]) == 0
    if drop_fraction:
        assert torch.count_nonzero(got[0][0]) == 0 and torch.count_nonzero(got[1][0]) == 0


@pytest.mark.parametrize("case", ["odd-fp32", "aligned-fp32"])
def test_kernel_and_fallback_paths_are_both_covered(case):
    width, inter, num_experts, _, _, dtype, _ = CASES[case]
    experts = _experts(width, inter, num_experts, 3, dtype)
    rows = torch.randn(10, width, dtype=dtype, generator=torch.Generator().manual_seed(0))
    takes_kernel = grouped_gemm.kernel_accepts(rows, experts.gate_up_proj.transpose(1, 2))
    assert takes_kernel == (case.startswith("aligned") and grouped_gemm.TORCH_GROUPED_MM is not None)


@pytest.mark.parametrize("may_drop", [False, True])  # True: capacity routing, the order cut to the kept (no) rows
def test_every_assignment_dropped(may_drop):
    experts = _experts(8, 16, 5, 2, torch.float32)
    hidden = torch.randn(6, 8, generator=torch.Generator().manual_seed(0)).requires_grad_()
    weights = torch.zeros(6, 2, requires_grad=True)
    index = torch.full((6, 2), 5)
    if may_drop:
        weights_ = (experts.gate_up_proj, experts.down_proj)
        out = backends.experts(hidden, index, weights, *weights_, experts.act_fn, may_drop=True)
    else:
        out = grouped_experts_forward(experts, hidden, index, weights)
    out.sum().backward()
    assert torch.count_nonzero(out) == 0 and torch.count_nonzero(hidden.grad) == 0
    assert torch.count_nonzero(experts.gate_up_proj.grad) == 0 and torch.count_nonzero(weights.grad) == 0


def test_grouped_is_deterministic_and_leaves_inputs_alone():
    experts = _experts(8, 16, 13, 3, torch.float32)
    index, weights, dropped = _routing(37, 13, 3, 0.3, torch.float32)
    generator = torch.Generator().manual_seed(4)
    hidden = torch.randn(37, 8, generator=generator)
    grad_out = torch.randn(37, 8, generator=generator)
    copies = (hidden.clone(), index.clone(), weights.clone(), grad_out.clone())
    first = _run(grouped_experts_forward, experts, hidden, index, weights, dropped, grad_out)
    second = _run(grouped_experts_forward, experts, hidden, index, weights, dropped, grad_out)
    for a, b in zip(first, second):
        assert torch.equal(a, b)
    for original, copy in zip((hidden, index, weights, grad_out), copies):
        assert torch.equal(original, copy)


def test_bf16_close_to_eager():
    _assert_bf16_close_to_eager()


def _assert_bf16_close_to_eager():
    """The grouped experts in bf16 against eager; returns the inputs (hidden, index, weights, dropped, grad_out)."""
    experts = _experts(8, 16, 13, 3, torch.bfloat16)
    index, weights, dropped = _routing(37, 13, 3, 0.0, torch.float32)
    generator = torch.Generator().manual_seed(3)
    hidden = torch.randn(37, 8, dtype=torch.bfloat16, generator=generator)
    grad_out = torch.randn(37, 8, dtype=torch.bfloat16, generator=generator)
    expected = _run(eager_experts_forward, experts, hidden, index, weights, dropped, grad_out)
    got = _run(grouped_experts_forward, experts, hidden, index, weights, dropped, grad_out)
    for want, have in zip(expected, got):
        assert have.dtype == want.dtype
        # bf16 roundings happen in different places (grouped GEMM vs per-expert linear): compare to the tensor's scale
        assert (have.float() - want.float()).abs().max() <= 3e-2 * want.float().abs().max()
    return hidden, index, weights, dropped, grad_out


def test_frozen_experts_only_input_grads():
    """With expert weights frozen (e.g. LoRA elsewhere) only the input and routing weights get gradients."""
    experts = _experts(8, 16, 13, 3, torch.float32).requires_grad_(False)
    index, weights, dropped = _routing(37, 13, 3, 0.0, torch.float32)
    hidden = torch.randn(37, 8, generator=torch.Generator().manual_seed(5)).requires_grad_()
    weights.requires_grad_()
    grouped_experts_forward(experts, hidden, index, weights).sum().backward()
    reference_hidden = hidden.detach().requires_grad_()
    reference_weights = weights.detach().requires_grad_()
    eager_experts_forward(experts, reference_hidden, index, reference_weights).sum().backward()
    torch.testing.assert_close(hidden.grad, reference_hidden.grad)
    torch.testing.assert_close(weights.grad, reference_weights.grad)


def _random_block(config: MHMoEConfig) -> MHMoESparseMoeBlock:
    """An MH-MoE block with N(0, 0.3) weights (seed 0), large enough for the routing to depend on the input."""
    torch.manual_seed(0)
    block = MHMoESparseMoeBlock(config)
    with torch.no_grad():
        for param in block.parameters():
            param.normal_(0, 0.3)
    return block


def _block_run(block, x, implementation: str, use_reentrant: bool | None = None, call=None) -> list[torch.Tensor]:
    """Output, input gradient and parameter gradients of sum(out²) with the given experts implementation; through
    torch.utils.checkpoint when `use_reentrant` is given, through `call` (e.g. the compiled block) when that is."""
    block.experts.config._experts_implementation = implementation
    block.zero_grad(set_to_none=True)
    inp = x.clone().requires_grad_()
    if use_reentrant is None:
        out = (block if call is None else call)(inp)
    else:
        out = torch.utils.checkpoint.checkpoint(block, inp, use_reentrant=use_reentrant)
    out.square().sum().backward()
    return [out.detach(), inp.grad] + [p.grad for p in block.parameters()]


def _h3_block() -> MHMoESparseMoeBlock:
    """A small h=3 block (width 24, 7 experts, top-3) with random weights."""
    config = MHMoEConfig(
        hidden_size=24,
        num_attention_heads=2,
        num_experts=7,
        num_experts_per_tok=3,
        moe_intermediate_size=16,
        moe_heads=3,
    )
    return _random_block(config)


def _assert_all_close(got: list[torch.Tensor], want: list[torch.Tensor]) -> None:
    assert len(got) == len(want)
    for have, expected in zip(got, want):
        torch.testing.assert_close(have, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("capacity_factor", [None, 0.5])
def test_block_dispatch_grouped_vs_eager(capacity_factor):
    """The MH-MoE block (h=2, routing.route with and without capacity drops) gives the same output both ways."""
    config = MHMoEConfig(
        hidden_size=16,
        num_attention_heads=2,
        num_experts=6,
        num_experts_per_tok=2,
        moe_intermediate_size=12,
        moe_heads=2,
        capacity_factor=capacity_factor,
    )
    block = _random_block(config)
    x = torch.randn(2, 9, 16)
    _assert_all_close(_block_run(block, x, "grouped_mm"), _block_run(block, x, "eager"))


def test_sort_by_expert_contract():
    experts = torch.tensor([[2, 0], [5, 2], [1, 5], [2, 3]])  # 5 = dropped (E=5)
    order, offsets = sort_by_expert(experts, 5)
    flat = experts.reshape(-1)
    assert order.dtype == torch.int64 and offsets.dtype == torch.int32
    assert flat[order].tolist() == [0, 1, 2, 2, 2, 3, 5, 5]
    assert order.tolist()[:6] == [1, 4, 0, 3, 6, 7]  # stable: ties keep (row, slot) order
    assert offsets.tolist() == [1, 2, 5, 6, 6]


def test_route_contract():
    logits = torch.randn(40, 6, generator=torch.Generator().manual_seed(0))
    weights, experts = route(logits, 2, capacity_factor=0.5)
    assert weights.dtype == torch.float32 and experts.dtype == torch.int64
    dropped = experts == 6
    assert dropped.any() and torch.count_nonzero(weights[dropped]) == 0
    kept_counts = torch.bincount(experts[~dropped], minlength=6)
    assert int(kept_counts.max()) <= 14  # ceil(0.5 * 40 * 2 / 6)


@pytest.mark.parametrize("act", ["silu", "gelu"])
def test_retain_graph_backward_twice(act):
    """The backward reuses forward buffers only when the graph is freed; with retain_graph a second pass still works."""
    experts = _experts(8, 16, 13, 3, torch.float32, act)
    index, weights, dropped = _routing(37, 13, 3, 0.3, torch.float32)
    generator = torch.Generator().manual_seed(6)
    hidden = torch.randn(37, 8, generator=generator)
    grad_out = torch.randn(37, 8, generator=generator)
    expected = _run(eager_experts_forward, experts, hidden, index, weights, dropped, grad_out)

    inp = hidden.clone().requires_grad_()
    experts.zero_grad(set_to_none=True)
    out = grouped_experts_forward(experts, inp, index, weights.masked_fill(dropped, 0.0))
    out.backward(grad_out, retain_graph=True)
    first = (inp.grad.clone(), experts.gate_up_proj.grad.clone(), experts.down_proj.grad.clone())
    out.backward(grad_out)  # frees the graph: this pass may reuse the saved buffers
    second = (inp.grad, experts.gate_up_proj.grad, experts.down_proj.grad)
    for want, one, two in zip((expected[1], expected[3], expected[4]), first, second):
        torch.testing.assert_close(one, want, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(two, 2 * want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("pooled", [False, True], ids=["no-pool", "pool"])
@pytest.mark.parametrize("use_reentrant", [False, True])
def test_block_under_gradient_checkpointing(use_reentrant, pooled, request):
    """Recomputed forwards (HF gradient checkpointing) feed the buffer-reusing backward correctly, also when every
    buffer comes from the pool (the checkpointed forward's buffers are dropped or given back, the recomputed ones
    are used by the backward)."""
    if pooled:
        request.getfixturevalue("pool")
    block = _h3_block()
    x = torch.randn(2, 5, 24)
    expected = _block_run(block, x, "eager")
    for _ in range(2):  # the second checkpointed step runs on the first one's (pooled) buffers
        _assert_all_close(_block_run(block, x, "grouped_mm", use_reentrant), expected)


def _compiled_graph_targets(block, x, expected) -> list:
    """Two steps of the block compiled whole (fullgraph, aot_eager) against `expected` (eager's output and gradients;
    None where eager computes no gradient): the node targets of the one graph traced."""
    from torch._dynamo.backends.registry import lookup_backend

    graphs = []

    def backend(graph_module, example_inputs):
        graphs.append(graph_module)
        return lookup_backend("aot_eager")(graph_module, example_inputs)

    torch._dynamo.reset()
    compiled = torch.compile(block, backend=backend, fullgraph=True)
    try:
        for _ in range(2):
            got = _block_run(block, x, "grouped_mm", call=compiled)
            assert [g is None for g in got] == [g is None for g in expected]
            _assert_all_close([g for g in got if g is not None], [g for g in expected if g is not None])
    finally:
        torch._dynamo.reset()
    assert len(graphs) == 1
    return [node.target for node in graphs[0].graph.nodes]


@pytest.mark.parametrize("routing", ["torch", "triton"])
@pytest.mark.parametrize("capacity_factor", [None, 0.5], ids=["dropless", "capacity"])
def test_block_under_torch_compile(pool, capacity_factor, routing, monkeypatch):
    """torch.compile(fullgraph=True): routing and dispatch have static shapes (no host sync, no graph break), the
    grouped GEMMs are one opaque op each, nothing is pooled inside the graph, and output and gradients are eager's on
    the first (tracing) step and the next, with and without capacity drops. With the Triton routing (the interpreter
    here) the graph holds its custom ops: the softmax/top-k and one counting sort per sort (two with capacity)."""
    from mhmoe.models.ops.routing.routing_triton import HAS_TRITON

    if routing == "triton" and not HAS_TRITON:
        pytest.skip("triton is not installed")
    monkeypatch.setenv(backends.ROUTING_BACKEND_ENV, routing)
    block = _h3_block()
    block.gate.capacity_factor = capacity_factor
    x = torch.randn(2, 5, 24)
    targets = _compiled_graph_targets(block, x, _block_run(block, x, "eager"))
    assert torch._C._nn.linear in targets and targets.count(torch.ops.mhmoe.grouped_mm) == 2
    routing_ops = [targets.count(torch.ops.mhmoe.softmax_topk), targets.count(torch.ops.mhmoe.counting_sort)]
    assert routing_ops == ([0, 0] if routing == "torch" else [1, 1 if capacity_factor is None else 2])
    assert not pool._free


@pytest.mark.parametrize("frozen", [False, True], ids=["trained", "frozen-experts"])
@pytest.mark.parametrize("capacity_factor", [None, 0.5], ids=["dropless", "capacity"])
def test_block_under_torch_compile_runs_the_experts_op(capacity_factor, frozen, monkeypatch):
    """On CUDA with SiLU a traced graph runs the eager experts (hand-written backward, fused steps) as one custom op
    and its backward as another, instead of traced differentiable ops. Forced here on CPU: a full-graph compiled block
    gives eager's output and gradients on two steps, with and without capacity drops and with the expert weights
    frozen (their gradients not computed), and its graph holds the op once."""
    monkeypatch.setattr(experts_grouped_mm, "_op_in_graphs", lambda hidden, act: experts_grouped_mm.is_silu(act))
    block = _h3_block()
    block.gate.capacity_factor = capacity_factor
    block.experts.requires_grad_(not frozen)
    x = torch.randn(2, 5, 24)
    targets = _compiled_graph_targets(block, x, _block_run(block, x, "eager"))
    assert targets.count(torch.ops.mhmoe.grouped_mm_experts) == 1 and torch.ops.mhmoe.grouped_mm not in targets


@pytest.mark.parametrize("shape", [(7, 5, 3, 2, 12), (11, 8, 4, 1, 6)])
def test_experts_op_passes_opcheck(shape):
    """torch.library.opcheck of the experts op and its backward op (schema, fake shapes and dtypes, autograd
    registration) on odd shapes; the backward op leaves out the gradients not needed. Without dropped assignments:
    gate/up's rows past offsets[-1] (dropped ones) are never computed, so the saved output differs from call to call
    there (the compiled block's test covers drops)."""
    num_rows, width, num_experts, top_k, inter = shape
    generator = torch.Generator().manual_seed(num_rows)
    index = torch.rand(num_rows, num_experts, generator=generator).topk(top_k, dim=-1).indices
    weights = torch.rand(num_rows, top_k, generator=generator).requires_grad_()
    hidden = torch.randn(num_rows, width, generator=generator).requires_grad_()
    gate_up = (torch.randn(num_experts, 2 * inter, width, generator=generator) / 4).requires_grad_()
    down = (torch.randn(num_experts, width, inter, generator=generator) / 4).requires_grad_()
    order, offsets, positions = sort_by_expert(index, num_experts, positions=True)
    dropped = index.reshape(-1) >= num_experts
    args = (hidden, weights, gate_up, down, order, offsets, positions, dropped)
    torch.library.opcheck(torch.ops.mhmoe.grouped_mm_experts, args)
    out, saved = torch.ops.mhmoe.grouped_mm_experts(*args)
    grad = torch.randn_like(out)
    for needs in ([True] * 4, [True, False, False, True]):
        backward_args = (grad, saved.detach(), *(a.detach() for a in args), needs)
        torch.library.opcheck(torch.ops.mhmoe.grouped_mm_experts_backward, backward_args)
        grads = torch.ops.mhmoe.grouped_mm_experts_backward(*backward_args)
        assert [g.numel() > 0 for g in grads] == needs


def test_bf16_block_under_torch_compile():
    """bf16 in a traced graph takes torch's grouped GEMM directly (its fake kernel traces bf16): fullgraph compile,
    output and gradients close to eager bf16."""
    block = _h3_block().to(torch.bfloat16)
    x = torch.randn(2, 5, 24, dtype=torch.bfloat16)
    expected = _block_run(block, x, "eager")
    torch._dynamo.reset()
    try:
        got = _block_run(block, x, "grouped_mm", call=torch.compile(block, backend="aot_eager", fullgraph=True))
    finally:
        torch._dynamo.reset()
    for have, want in zip(got, expected):
        assert have.dtype == want.dtype == torch.bfloat16
        assert (have.float() - want.float()).abs().max() <= 3e-2 * want.float().abs().max()


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("act", ["silu", "gelu"])
def test_inference_path_matches_eager(case, act):
    """Without autograd the forward works in place (no act buffer); same output as eager and as the training path."""
    width, inter, num_experts, top_k, num_rows, dtype, tol = CASES[case]
    experts = _experts(width, inter, num_experts, top_k, dtype, act)
    index, weights, dropped = _routing(num_rows, num_experts, top_k, 0.3, dtype)
    weights = weights.masked_fill(dropped, 0.0)
    hidden = torch.randn(num_rows, width, dtype=dtype, generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        expected = eager_experts_forward(experts, hidden, index, weights)
        got = grouped_experts_forward(experts, hidden, index, weights)
    training_path = grouped_experts_forward(experts, hidden, index, weights)
    assert training_path.requires_grad
    torch.testing.assert_close(got, expected, rtol=tol, atol=tol)
    torch.testing.assert_close(got, training_path.detach(), rtol=tol, atol=tol)


@pytest.fixture
def pool(monkeypatch):
    """A fresh buffer pool that takes buffers of any size (the real one skips those under 16 MiB: tiny tests)."""
    fresh = experts_grouped_mm.BufferPool(max_bytes=2**30, min_bytes=0)
    monkeypatch.setattr(experts_grouped_mm, "BUFFER_POOL", fresh)
    return fresh


def _pooled(pool) -> set[int]:
    return {buf.data_ptr() for buf in pool._free}


@pytest.mark.parametrize("drop_fraction", [0.0, 0.3], ids=["dropless", "capacity-dropped"])
@pytest.mark.parametrize("act", ["silu", "gelu"])
@pytest.mark.parametrize("top_k", [1, 3])
def test_pooled_buffers_are_reused_and_results_unchanged(pool, act, drop_fraction, top_k):
    """Steps that reuse the previous step's (stale) buffers give eager's outputs and gradients every time."""
    width, inter, num_experts, _, num_rows, dtype, tol = CASES["aligned-fp32"]
    experts = _experts(width, inter, num_experts, top_k, dtype, act)
    index, weights, dropped = _routing(num_rows, num_experts, top_k, drop_fraction, dtype)
    generator = torch.Generator().manual_seed(8)
    first_step = None
    for _ in range(3):
        hidden = torch.randn(num_rows, width, generator=generator, dtype=dtype)
        grad_out = torch.randn(num_rows, width, generator=generator, dtype=dtype)
        expected = _run(eager_experts_forward, experts, hidden, index, weights, dropped, grad_out)
        got = _run(grouped_experts_forward, experts, hidden, index, weights, dropped, grad_out)
        for want, have in zip(expected, got):
            torch.testing.assert_close(have, want, rtol=tol, atol=tol)
        # every buffer comes back after the backward, and from the second step on the same memory is used again
        first_step = first_step or _pooled(pool)
        assert len(first_step) >= 3 and _pooled(pool) == first_step
        # gradients handed to autograd are never pooled (top_k=1: d input is the gathered slots themselves)
        assert not {t.data_ptr() for t in got[1:]} & _pooled(pool)


def test_pool_keeps_buffers_while_a_graph_needs_them(pool):
    """retain_graph keeps the saved buffers out of the pool; two graphs alive at once never share a buffer."""
    experts = _experts(8, 16, 13, 3, torch.float32)
    index, weights, dropped = _routing(37, 13, 3, 0.0, torch.float32)
    generator = torch.Generator().manual_seed(9)
    inputs = [torch.randn(37, 8, generator=generator) for _ in range(2)]
    grad_out = torch.randn(37, 8, generator=generator)
    expected = [_run(eager_experts_forward, experts, x, index, weights, dropped, grad_out)[1] for x in inputs]

    leaves = [x.clone().requires_grad_() for x in inputs]
    outs = [grouped_experts_forward(experts, leaf, index, weights) for leaf in leaves]  # two graphs alive
    params = {p.data_ptr() for p in experts.parameters()}
    saved = [
        {t.data_ptr() for t in out.grad_fn.saved_tensors if t.numel() > 37 * 3} - params - {leaf.data_ptr()}
        for out, leaf in zip(outs, leaves)
    ]
    assert len(saved[0]) == 1 and not saved[0] & saved[1]  # gate_up (the rest is recomputed): one per graph
    outs[0].backward(grad_out, retain_graph=True)
    assert not (saved[0] | saved[1]) & _pooled(pool)  # both graphs still hold theirs
    outs[1].backward(grad_out)  # may reuse graph 0's backward buffers, never its saved ones
    assert saved[1] <= _pooled(pool) and not saved[0] & _pooled(pool)
    outs[0].backward(grad_out)  # second pass through the retained graph, which is then freed
    assert saved[0] <= _pooled(pool)
    torch.testing.assert_close(leaves[1].grad, expected[1], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(leaves[0].grad, 2 * expected[0], rtol=1e-5, atol=1e-5)


def test_pool_in_inference_and_its_limits(pool):
    experts = _experts(8, 16, 13, 3, torch.float32)
    index, weights, _ = _routing(37, 13, 3, 0.0, torch.float32)
    hidden = torch.randn(37, 8, generator=torch.Generator().manual_seed(10))
    with torch.no_grad():
        first = grouped_experts_forward(experts, hidden, index, weights)
        buffers = _pooled(pool)  # the no-grad forward gives its buffers back at the end
        second = grouped_experts_forward(experts, hidden, index, weights)
        expected = eager_experts_forward(experts, hidden, index, weights)
    torch.testing.assert_close(first, expected, rtol=1e-5, atol=1e-5)
    assert torch.equal(first, second) and len(buffers) >= 3 and _pooled(pool) == buffers

    buffer = pool._free[0]
    pool.give(buffer)  # already pooled: not kept twice
    assert _pooled(pool) == buffers and len(pool._free) == len(buffers)
    pool.max_bytes = pool.nbytes  # full: a new buffer pushes the oldest out
    pool.give(torch.empty(4))
    assert buffer.data_ptr() not in _pooled(pool) and pool._free[-1].numel() == 4
    pool.clear()
    assert pool.nbytes == 0
    pool.max_bytes = 0  # off
    assert pool.take(3, 4, hidden) is None


def test_pool_and_inference_mode(pool):
    """Buffers made under torch.inference_mode() are not pooled (they cannot be written outside it); pooled ordinary
    buffers serve inference_mode forwards, with the right result."""
    experts = _experts(8, 16, 13, 3, torch.float32)
    index, weights, dropped = _routing(37, 13, 3, 0.0, torch.float32)
    generator = torch.Generator().manual_seed(11)
    hidden, grad_out = torch.randn(37, 8, generator=generator), torch.randn(37, 8, generator=generator)
    expected = _run(eager_experts_forward, experts, hidden, index, weights, dropped, grad_out)
    pool.clear()
    with torch.inference_mode():
        grouped_experts_forward(experts, hidden, index, weights)
    assert pool.nbytes == 0
    got = _run(grouped_experts_forward, experts, hidden, index, weights, dropped, grad_out)  # training still works
    for want, have in zip(expected, got):
        torch.testing.assert_close(have, want, rtol=1e-5, atol=1e-5)
    buffers = _pooled(pool)
    with torch.inference_mode():
        out = grouped_experts_forward(experts, hidden, index, weights)
    torch.testing.assert_close(out, expected[0], rtol=1e-5, atol=1e-5)
    assert _pooled(pool) == buffers and not any(buf.is_inference() for buf in pool._free)


def _registry_model(capacity_factor=None):
    from mhmoe import MHMoEForCausalLM

    config = MHMoEConfig(
        vocab_size=31,
        hidden_size=16,
        intermediate_size=16,
        num_hidden_layers=1,
        num_attention_heads=2,
        moe_heads=2,
        num_experts=5,
        num_experts_per_tok=2,
        moe_intermediate_size=8,
        capacity_factor=capacity_factor,
    )
    torch.manual_seed(0)
    model = MHMoEForCausalLM(config).eval()
    with torch.no_grad():
        for param in model.parameters():
            param.normal_(0, 0.3)
    return model


def _spy(calls):
    def experts_forward(self, hidden_states, top_k_index, top_k_weights):
        calls.append(top_k_index.clone())
        return eager_experts_forward(self, hidden_states, top_k_index, top_k_weights)

    return experts_forward


@pytest.mark.parametrize("capacity_factor", [None, 0.5])
def test_globally_registered_experts_function_reaches_mhmoe(monkeypatch, capacity_factor):
    """A function registered with Transformers' global experts interface after mhmoe was imported (as a Hub kernel
    registers itself) runs when chosen by name; capacity drops reach it as weight-0 slots on a real expert id."""
    from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS

    model = _registry_model(capacity_factor)
    ids = torch.randint(0, 31, (2, 6), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = model(ids).logits
        calls = []
        monkeypatch.setitem(ALL_EXPERTS_FUNCTIONS._global_mapping, "user_experts", _spy(calls))
        model.set_experts_implementation("user_experts")
        got = model(ids).logits
    assert len(calls) == 1 and int(calls[0].max()) < 5
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


def test_patched_global_grouped_mm_is_seen(monkeypatch):
    """Ours replaces Transformers' stock `grouped_mm`; a global replacement of it (a test's patch, a user's kernel)
    wins; `eager` stays the model's loop."""
    from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS

    interface = MHMOE_EXPERTS_FUNCTIONS
    assert interface.get_interface("grouped_mm", None) is grouped_experts_forward
    assert interface.get_interface("eager", eager_experts_forward) is eager_experts_forward
    model = _registry_model()
    assert model.config._experts_implementation == "grouped_mm"
    ids = torch.randint(0, 31, (1, 4), generator=torch.Generator().manual_seed(1))
    calls = []
    monkeypatch.setitem(ALL_EXPERTS_FUNCTIONS._global_mapping, "grouped_mm", _spy(calls))
    with torch.no_grad():
        model(ids)
    assert len(calls) == 1
    with pytest.raises(KeyError, match="not a valid experts implementation"):
        interface.get_interface("no_such_experts", None)
