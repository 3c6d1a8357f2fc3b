"""The Triton routing kernels (ops/routing/routing_triton.py) against the PyTorch reference (routing_naive.py), run
under TRITON_INTERPRET=1 (tests/conftest.py): outputs and router gradients on awkward shapes, ties, one expert taking
every row, capacity overflow, hypothesis properties, the backend switch, and a whole model forced onto the kernels.

Small blocks (`block_rows`, `block`) split even small inputs over several programs with a ragged last one; the
interpreter costs ~2 ms per program, so every case stays at a few launches of a few programs.
"""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from mhmoe import MHMoEConfig
from mhmoe.models.ops import backends as routing
from mhmoe.models.ops.routing import routing_naive, routing_triton

from .spread_model import spread_model

pytestmark = pytest.mark.skipif(not routing_triton.HAS_TRITON, reason="triton is not installed")
CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (the GPU-only kernel checks)")

SHAPES = [  # (N, E, K): N not a multiple of the blocks used below
    (37, 1, 1),
    (37, 3, 1),
    (37, 3, 2),
    (50, 7, 3),
    (29, 40, 2),
    (45, 40, 8),
    (33, 96, 3),
    (21, 96, 8),
    (1, 3, 3),
]


def _logits(num_rows, num_experts, seed=0, scale=2.0):
    return torch.randn(num_rows, num_experts, generator=torch.Generator().manual_seed(seed)) * scale


def _both(logits, top_k, norm=True, capacity=None, block_rows=8, block=16):
    """(kernel, reference) results: weights, experts and the logits' gradient of a fixed weighted sum of weights."""
    results = []
    for kernel in (True, False):
        leaf = logits.detach().clone().requires_grad_()
        if kernel:
            weights, experts = routing_triton.route(leaf, top_k, norm, capacity, block_rows=block_rows, block=block)
        else:
            weights, experts = routing_naive.route(leaf, top_k, norm, capacity)
        probe = torch.linspace(-1, 2, weights.numel()).view_as(weights)
        (weights * probe).sum().backward()
        results.append((weights.detach(), experts, leaf.grad))
    return results


@pytest.mark.parametrize("norm", [True, False])
def test_router_backward_takes_strided_logits_and_an_expanded_gradient(norm):
    """The backward kernel reads the logits by row stride (a transposed leaf: its last stride is not 1) and an
    expanded gradient of the weights (stride 0 across rows), and matches the reference's."""
    grads = []
    for route in (routing_triton.route, routing_naive.route):
        leaf = _logits(7, 19, seed=3).t().contiguous().requires_grad_()  # (19, 7)
        weights, _ = route(leaf.t(), 3, norm)  # (7, 19) logits with strides (1, 7)
        (weights * torch.tensor([1.0, -2.0, 3.0])).sum().backward()  # d weights: the row broadcast, stride (0, 1)
        grads.append(leaf.grad)
    torch.testing.assert_close(grads[0], grads[1], rtol=1e-5, atol=1e-6)
    assert grads[0].abs().sum() > 0


@pytest.mark.parametrize("norm", [True, "always", False])
@pytest.mark.parametrize("shape", SHAPES, ids=[f"N{n}-E{e}-K{k}" for n, e, k in SHAPES])
def test_route_matches_reference(shape, norm):
    num_rows, num_experts, top_k = shape
    (weights, experts, grad), (ref_weights, ref_experts, ref_grad) = _both(_logits(*shape[:2]), top_k, norm)
    assert experts.dtype == torch.int64 and weights.dtype == torch.float32
    assert torch.equal(experts, ref_experts)
    torch.testing.assert_close(weights, ref_weights, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(grad, ref_grad, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("shape", [(50, 7, 3), (33, 96, 3), (45, 40, 8)], ids=["E7-K3", "E96-K3", "E40-K8"])
def test_bf16_logits(shape):
    """bf16 logits (a bf16 router): loaded as bf16, softmax and top-k in fp32 as the reference's `.float()`, so the
    reference's fp32 weights at fp32 tolerance; the logits' gradient comes back in bf16, at bf16 tolerance. bf16
    rounding makes ties common: the kernel takes the lowest tied id (a stable descending sort's order), `torch.topk`
    any of them, so the experts are checked against the stable sort, the gradients where both chose alike."""
    num_rows, num_experts, top_k = shape
    logits = _logits(num_rows, num_experts, seed=13).bfloat16()
    (weights, experts, grad), (ref_weights, ref_experts, ref_grad) = _both(logits, top_k)
    assert weights.dtype == torch.float32 and grad.dtype == torch.bfloat16
    stable = torch.sort(torch.softmax(logits.float(), -1), dim=-1, descending=True, stable=True).indices[:, :top_k]
    assert torch.equal(experts, stable)
    torch.testing.assert_close(weights, ref_weights, rtol=1e-6, atol=1e-6)
    alike = (experts == ref_experts).all(-1)
    assert alike.float().mean() > 0.5
    torch.testing.assert_close(grad[alike], ref_grad[alike], rtol=1.6e-2, atol=1e-3)


@pytest.mark.parametrize("capacity", [0.25, 0.5, 1.0, 2.0])
@pytest.mark.parametrize("shape", [(50, 7, 3), (45, 40, 8), (37, 3, 1)], ids=["E7-K3", "E40-K8", "E3-K1"])
def test_capacity_matches_reference(shape, capacity):
    num_rows, num_experts, top_k = shape
    (weights, experts, grad), (ref_weights, ref_experts, ref_grad) = _both(
        _logits(*shape[:2], seed=3), top_k, capacity=capacity
    )
    assert torch.equal(experts, ref_experts)
    torch.testing.assert_close(weights, ref_weights, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(grad, ref_grad, rtol=1e-5, atol=1e-6)
    if capacity <= 0.5:
        assert (experts == num_experts).any()  # some assignments were dropped


def test_every_row_on_one_expert_overflows_in_priority_order():
    """All rows prefer expert 2: with capacity c only the first c rows keep it (row order); the rest are dropped."""
    logits = _logits(40, 7, seed=4, scale=0.1)
    logits[:, 2] += 20.0
    capacity = routing_naive.expert_capacity(0.5, 40, 2, 7)  # 6
    (weights, experts, _), (ref_weights, ref_experts, _) = _both(logits, 2, capacity=0.5)
    assert torch.equal(experts, ref_experts)
    torch.testing.assert_close(weights, ref_weights)
    assert (experts[:capacity, 0] == 2).all() and (experts[capacity:, 0] == 7).all()
    assert (weights[capacity:, 0] == 0).all()
    (_, dropless, _), _ = _both(logits, 2)
    assert (dropless[:, 0] == 2).all()


@pytest.mark.parametrize("top_k", [1, 2, 3])
def test_ties_go_to_the_lowest_expert_id(top_k):
    """Equal logits: the kernel takes the lowest ids (a stable descending sort's order); the weights are the
    reference's (equal values are interchangeable)."""
    logits = torch.tensor([[0.0, 1.0, 1.0, 1.0, 0.5], [2.0, 2.0, 2.0, 2.0, 2.0], [0.0, 3.0, 0.0, 3.0, 3.0]])
    weights, experts = routing_triton.route(logits, top_k, block_rows=2)
    stable = torch.sort(torch.softmax(logits, -1), dim=-1, descending=True, stable=True).indices[:, :top_k]
    assert torch.equal(experts, stable)
    ref_weights, _ = routing_naive.route(logits, top_k)
    torch.testing.assert_close(weights, ref_weights)


def _poisoned_logits(num_rows=24, num_experts=11):
    """Logits with NaN and ±inf in some rows. A NaN or +inf logit, or a row of -inf only, makes the row's softmax NaN
    throughout (in the reference too); -inf next to finite logits is a probability of 0 and routes normally."""
    logits = _logits(num_rows, num_experts, seed=9)
    nan, inf = float("nan"), float("inf")
    logits[1, 4] = nan
    logits[3] = nan
    logits[5, 0] = inf
    logits[7, [2, 9]] = inf
    logits[9] = -inf
    logits[11, :5] = -inf  # finite row: experts 0-4 have probability 0
    logits[13, 3] = -inf
    logits[15, 6], logits[15, 7] = nan, -inf
    logits[17, 10] = -inf
    return logits


@pytest.mark.filterwarnings("ignore:invalid value encountered")  # numpy under the interpreter, on NaN
@pytest.mark.parametrize("top_k", [1, 3, 6])
@pytest.mark.parametrize("capacity", [None, 0.5])
def test_nan_and_inf_logits_give_in_range_experts(top_k, capacity):
    """An expert id past the experts would make the later kernels read and write out of bounds on a GPU (an
    asynchronous illegal-address error, not an exception the fallback could catch). Rows whose softmax is NaN take
    the lowest ids (distinct, in range) with NaN weights, where `torch.topk` in the reference takes distinct in-range
    ids in an unspecified order (also NaN weights); every other row is the reference's, its gradient too."""
    logits = _poisoned_logits()
    num_rows, num_experts = logits.shape
    (weights, experts, grad), (ref_weights, ref_experts, ref_grad) = _both(logits, top_k, capacity=capacity)
    bad = torch.softmax(logits, -1).isnan().any(-1)
    assert bad.tolist() == [i in (1, 3, 5, 7, 9, 15) for i in range(num_rows)]
    assert ((experts >= 0) & (experts <= num_experts)).all()
    kept = experts < num_experts
    for row in range(num_rows):  # kept ids distinct within a row
        assert len(set(experts[row][kept[row]].tolist())) == int(kept[row].sum())
    if capacity is None:
        assert kept.all() and (ref_experts < num_experts).all()
        assert torch.equal(experts[bad], torch.arange(top_k).expand(int(bad.sum()), top_k))
        assert torch.equal(experts[~bad], ref_experts[~bad])
        torch.testing.assert_close(weights[~bad], ref_weights[~bad], rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(grad[~bad], ref_grad[~bad], rtol=1e-5, atol=1e-6)
        assert weights[bad].isnan().all() and ref_weights[bad].isnan().all()
    else:  # the reference's NaN rows take other experts' places: only the contract holds
        cap = routing_naive.expert_capacity(capacity, num_rows, top_k, num_experts)
        assert int(torch.bincount(experts[kept], minlength=num_experts).max()) <= cap
    order, offsets = routing_triton.sort_by_expert(experts, num_experts, block=16)
    assert int(offsets[-1]) == int(kept.sum()) and sorted(order.tolist()) == list(range(experts.numel()))


@pytest.mark.parametrize("chunks", [1, 3])
@pytest.mark.parametrize("num_bins", [1, 2, 8, 41, 97])
def test_counting_sort_is_a_stable_sort(num_bins, chunks):
    """Against torch's stable sort, with one or several one-hot tiles per program (the place carried across them).
    1,500 ids in tiles of 16: 94 programs (or 32), more than the scan kernel takes in one tile at 97 bins (32)."""
    ids = torch.randint(0, num_bins, (1500,), generator=torch.Generator().manual_seed(num_bins))
    pos, order, counts = routing_triton.counting_sort(ids, num_bins, block=16, chunks=chunks)
    expected = torch.sort(ids, stable=True).indices
    assert torch.equal(order, expected)
    assert torch.equal(pos[order], torch.arange(1500))  # pos is the inverse permutation
    assert torch.equal(counts, torch.bincount(ids, minlength=num_bins))


@pytest.mark.parametrize("drop", [0.0, 0.4])
def test_sort_by_expert_matches_reference(drop):
    num_experts = 13
    generator = torch.Generator().manual_seed(5)
    experts = torch.randint(0, num_experts, (61, 3), generator=generator)
    experts = experts.masked_fill(torch.rand(61, 3, generator=generator) < drop, num_experts)  # dropped sentinel E
    order, offsets = routing_triton.sort_by_expert(experts, num_experts, block=16)
    ref_order, ref_offsets = routing_naive.sort_by_expert(experts, num_experts)
    assert order.dtype == ref_order.dtype and offsets.dtype == ref_offsets.dtype == torch.int32
    assert torch.equal(order, ref_order) and torch.equal(offsets, ref_offsets)
    # with positions: where each assignment sits in `order` (its inverse permutation), from both sorts
    *same, positions = routing_triton.sort_by_expert(experts, num_experts, block=16, positions=True)
    *ref_same, ref_positions = routing_naive.sort_by_expert(experts, num_experts, positions=True)
    assert all(torch.equal(a, b) for a, b in zip(same + ref_same, (order, offsets) * 2))
    assert torch.equal(positions, ref_positions) and positions.dtype == torch.int64
    assert torch.equal(order[positions], torch.arange(experts.numel()))


def test_empty_input_and_bad_arguments():
    weights, experts = routing_triton.route(torch.zeros(0, 5), 2, capacity_factor=1.0)
    assert weights.shape == experts.shape == (0, 2)
    order, offsets = routing_triton.sort_by_expert(experts, 5)
    assert order.numel() == 0 and offsets.tolist() == [0] * 5
    with pytest.raises(ValueError, match="top_k <= min"):
        routing_triton.route(torch.zeros(4, 12), 9)
    with pytest.raises(ValueError, match="top_k <= min"):
        routing_triton.route(torch.zeros(4, 3), 4)


@settings(max_examples=20, deadline=None)
@given(
    num_rows=st.integers(1, 70),
    num_experts=st.integers(1, 100),
    top_k=st.integers(1, 8),
    capacity=st.one_of(st.none(), st.floats(0.1, 2.0)),
    norm=st.sampled_from([True, "always", False]),
    seed=st.integers(0, 2**16),
)
def test_route_properties(num_rows, num_experts, top_k, capacity, norm, seed):
    """Continuous random logits (no ties): the kernel's experts are the reference's and its weights within fp32
    tolerance, at any shape, with and without capacity."""
    top_k = min(top_k, num_experts)
    logits = _logits(num_rows, num_experts, seed=seed)
    weights, experts = routing_triton.route(logits, top_k, norm, capacity, block_rows=16, block=64)
    ref_weights, ref_experts = routing_naive.route(logits, top_k, norm, capacity)
    assert torch.equal(experts, ref_experts)
    torch.testing.assert_close(weights, ref_weights, rtol=1e-6, atol=1e-6)
    kept = experts < num_experts
    if capacity is not None:  # no expert over capacity, and dropped slots weigh nothing
        cap = routing_naive.expert_capacity(capacity, num_rows, top_k, num_experts)
        assert int(torch.bincount(experts[kept], minlength=num_experts).max()) <= cap
        assert not weights[~kept].any()


@settings(max_examples=20, deadline=None)
@given(
    ids=st.lists(st.integers(0, 9), min_size=1, max_size=150),
    block=st.sampled_from([16, 32, 128]),
    chunks=st.sampled_from([1, 2, 5]),
)
def test_counting_sort_properties(ids, block, chunks):
    ids = torch.tensor(ids)
    pos, order, counts = routing_triton.counting_sort(ids, 10, block=block, chunks=chunks)
    assert torch.equal(order, torch.sort(ids, stable=True).indices)
    assert torch.equal(order[pos], torch.arange(len(ids)))
    assert int(counts.sum()) == len(ids)


def test_backend_switch(monkeypatch):
    logits = _logits(9, 5)
    calls = []
    monkeypatch.setitem(
        routing.IMPLEMENTATIONS["routing.route"],
        "triton",
        lambda *args: calls.append("triton") or routing_triton.route(*args),
    )
    monkeypatch.delenv(routing.ROUTING_BACKEND_ENV, raising=False)
    routing.route(logits, 2)
    assert calls == []  # CPU default: the reference
    routing.route(logits, 2, backend="triton")
    assert calls == ["triton"]
    monkeypatch.setenv(routing.ROUTING_BACKEND_ENV, "torch")  # the environment overrides the config
    routing.route(logits, 2, backend="triton")
    assert calls == ["triton"]
    monkeypatch.setenv(routing.ROUTING_BACKEND_ENV, "cuda")
    with pytest.raises(ValueError, match="MHMOE_ROUTING_BACKEND must be one of"):
        routing.route(logits, 2)
    with pytest.raises(ValueError, match="routing_backend must be one of"):
        MHMoEConfig(routing_backend="cuda")


def test_a_failing_kernel_is_logged_once_recorded_and_replaced(monkeypatch, caplog):
    """The automatic choice (CUDA tensors; simulated here) runs the reference when a kernel raises, logs the reason
    once at WARNING, records it in `fallbacks()` and keeps every routing op on PyTorch until `reset_fallbacks()`; a
    forced backend raises instead."""
    from mhmoe.models.ops.backends import fallbacks, reset_fallbacks

    def broken(*args):
        calls.append("triton")
        raise RuntimeError("no kernel image is available for execution on the device")

    calls = []
    monkeypatch.setitem(routing.IMPLEMENTATIONS["routing.route"], "triton", broken)
    monkeypatch.setattr(routing.torch.Tensor, "is_cuda", property(lambda self: True))  # the automatic choice
    monkeypatch.delenv(routing.ROUTING_BACKEND_ENV, raising=False)
    reset_fallbacks()
    logits = _logits(9, 5)
    try:
        with caplog.at_level("WARNING", logger="mhmoe.models.ops.backends"):
            for _ in range(3):
                weights, experts = routing.route(logits, 2)
        ref_weights, ref_experts = routing_naive.route(logits, 2)
        assert torch.equal(experts, ref_experts) and torch.equal(weights, ref_weights)
        assert calls == ["triton"]  # then PyTorch: the failure switched the automatic choice
        assert routing.routing_backend(logits) == ("torch", False)
        reason = "RuntimeError: no kernel image is available for execution on the device"
        assert fallbacks() == {"routing.route": reason}
        records = [r for r in caplog.records if r.levelname == "WARNING"]
        assert len(records) == 1 and reason in records[0].getMessage()
        assert "routing.route" in records[0].getMessage() and routing.ROUTING_BACKEND_ENV in records[0].getMessage()
        with pytest.raises(RuntimeError, match="no kernel image"):
            routing.route(logits, 2, backend="triton")  # forced: the error is raised, not hidden
        reset_fallbacks()
        assert fallbacks() == {} and routing.routing_backend(logits) == ("triton", False)
        assert fallbacks() is not fallbacks()  # a copy: callers cannot change the record
    finally:
        reset_fallbacks()


@pytest.mark.parametrize("capacity_factor", [None, 0.5])
def test_model_forced_onto_the_kernels_matches_torch(capacity_factor, monkeypatch):
    """A whole MH-MoE model (h=3, E=7, top-3) with routing_backend="triton" gives the torch path's logits, losses and
    gradients; the kernels really ran (route and sort)."""
    monkeypatch.delenv(routing.ROUTING_BACKEND_ENV, raising=False)
    config = MHMoEConfig(
        vocab_size=53,
        hidden_size=24,
        intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        moe_heads=3,
        num_experts=7,
        num_experts_per_tok=3,
        moe_intermediate_size=16,
        capacity_factor=capacity_factor,
        output_router_logits=True,
    )
    model = spread_model(config)
    ids = torch.randint(0, 53, (2, 9), generator=torch.Generator().manual_seed(1))
    calls = []
    for name in ("routing.route", "routing.sort_by_expert"):
        original = routing.IMPLEMENTATIONS[name]["triton"]
        monkeypatch.setitem(
            routing.IMPLEMENTATIONS[name],
            "triton",
            lambda *a, original=original, name=name, **kw: calls.append(name) or original(*a, **kw),
        )

    results = []
    for backend in ("torch", "triton"):
        model.config.routing_backend = backend
        for layer in model.model.layers:
            layer.mlp.gate.routing_backend = backend
        model.zero_grad(set_to_none=True)
        out = model(input_ids=ids, labels=ids)
        out.loss.backward()
        results.append([out.logits, out.loss, out.aux_loss] + [p.grad for p in model.parameters()])
    assert calls.count("routing.route") == 2 and calls.count("routing.sort_by_expert") == 2
    for have, want in zip(results[1], results[0]):
        torch.testing.assert_close(have, want, rtol=1e-5, atol=1e-5)


@CUDA
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda_route_and_sort_at_scale(dtype):
    """On the GPU, at the benchmark's size (16,384 rows × 96 experts, top-3, with capacity): the reference's weights
    and experts (ties by the stable order, bf16 making them common), the sort's permutation and offsets. No dot
    products here: fp32 is fp32 on the GPU too."""
    logits = _logits(16384, 96, seed=21).to(dtype).cuda()
    for capacity in (None, 1.0):
        weights, experts = routing_triton.route(logits, 3, capacity_factor=capacity)
        ref_weights, ref_experts = routing_naive.route(logits.cpu(), 3, capacity_factor=capacity)
        torch.cuda.synchronize()
        if capacity is None:
            stable = torch.sort(torch.softmax(logits.float().cpu(), -1), dim=-1, descending=True, stable=True)
            assert torch.equal(experts.cpu(), stable.indices[:, :3])
            torch.testing.assert_close(weights.cpu(), ref_weights, rtol=1e-5, atol=1e-6)
        order, offsets = routing_triton.sort_by_expert(experts, 96)
        ref_order, ref_offsets = routing_naive.sort_by_expert(experts.cpu(), 96)
        assert torch.equal(order.cpu(), ref_order) and torch.equal(offsets.cpu(), ref_offsets)


@CUDA
def test_cuda_nan_logits_stay_in_range():
    """The GPU pitfall itself: NaN/inf logits through the kernels, then a synchronize (an out-of-range id would show
    as an asynchronous illegal-address error here) and the ids checked."""
    logits = _poisoned_logits(4099, 11).cuda()
    weights, experts = routing_triton.route(logits, 3, capacity_factor=1.0)
    order, offsets = routing_triton.sort_by_expert(experts, 11)
    torch.cuda.synchronize()
    assert ((experts >= 0) & (experts <= 11)).all() and int(offsets[-1]) == int((experts < 11).sum())


@pytest.mark.parametrize("shape", [(37, 7, 3), (21, 96, 8), (1, 3, 1)])
def test_custom_ops_pass_opcheck(shape):
    """The kernels' torch.library forms (what traced graphs call): schema, fake implementations (shapes, dtypes),
    autograd registration and dispatch, checked by torch.library.opcheck on odd shapes; and their results are the
    eager kernels'."""
    num_rows, num_experts, top_k = shape
    logits = _logits(num_rows, num_experts).requires_grad_()
    for renormalise in (True, False):
        torch.library.opcheck(torch.ops.mhmoe.softmax_topk, (logits, top_k, renormalise, True))
        weights, experts = torch.ops.mhmoe.softmax_topk(logits, top_k, renormalise, True)
        expected = routing_triton.softmax_topk(logits, top_k, renormalise)
        torch.testing.assert_close(weights, expected[0])
        assert torch.equal(experts, expected[1])
        grad = torch.linspace(-1, 1, weights.numel()).view_as(weights)
        args = (logits.detach(), experts, grad, renormalise, True)
        torch.library.opcheck(torch.ops.mhmoe.softmax_topk_backward, args)
        (want,) = torch.autograd.grad(expected[0], logits, grad)
        torch.testing.assert_close(torch.ops.mhmoe.softmax_topk_backward(*args), want)
    ids = torch.randint(0, num_experts + 1, (num_rows * top_k,), generator=torch.Generator().manual_seed(1))
    for write_order in (True, False):
        torch.library.opcheck(torch.ops.mhmoe.counting_sort, (ids, num_experts + 1, write_order, True))
        pos, order, counts, ends = torch.ops.mhmoe.counting_sort(ids, num_experts + 1, write_order, True)
        want = routing_triton.counting_sort(ids, num_experts + 1, write_order)
        assert torch.equal(pos, want[0]) and torch.equal(counts, want[2])
        assert torch.equal(order, want[1]) if write_order else order.numel() == 0
        assert torch.equal(ends, counts.cumsum(0).to(torch.int32))


def test_a_kernel_failing_inside_a_traced_graph_falls_back_in_its_op(monkeypatch, caplog):
    """A graph cannot swap a kernel out once traced: a custom op whose kernel raises runs the reference in its body
    (strict=False: the kernel was chosen by default), logs it once, records it in `fallbacks()` (which stops eager calls
    choosing the kernels by default) and gives the reference's results; strict=True (the kernel was asked for) raises."""
    from mhmoe.models.ops.backends import fallbacks, reset_fallbacks

    def broken(*args, **kwargs):
        raise RuntimeError("out of resources: shared memory")

    for name in ("_softmax_topk_forward", "_softmax_topk_backward", "_counting_sort"):
        monkeypatch.setattr(routing_triton, name, broken)
    logits, grad = _logits(11, 6), torch.randn(11, 2)
    ids = torch.randint(0, 7, (22,), generator=torch.Generator().manual_seed(2))
    reset_fallbacks()
    try:
        with pytest.raises(RuntimeError, match="out of resources"):
            torch.ops.mhmoe.softmax_topk(logits, 2, True, True)
        assert fallbacks() == {}
        with caplog.at_level("WARNING", logger=routing_triton.__name__):
            for _ in range(2):
                weights, experts = torch.ops.mhmoe.softmax_topk(logits, 2, True, False)
                grad_logits = torch.ops.mhmoe.softmax_topk_backward(logits, experts, grad, True, False)
                pos, order, counts, ends = torch.ops.mhmoe.counting_sort(ids, 7, True, False)
        ref_weights, ref_experts = routing_naive.route(logits, 2)
        assert torch.equal(experts, ref_experts) and torch.equal(weights, ref_weights)
        ref_grad = routing_naive.route_weights_backward(logits, experts, grad, True)
        assert torch.equal(grad_logits, ref_grad)
        ref_order, ref_ends, ref_pos = routing_naive.sort_by_expert(ids, 6, positions=True)
        assert torch.equal(order, ref_order) and torch.equal(pos, ref_pos) and torch.equal(ends[:6], ref_ends)
        assert torch.equal(counts, torch.bincount(ids, minlength=7))
        assert set(fallbacks()) == {"routing.route", "routing.sort_by_expert"}
        warnings = [r for r in caplog.records if r.levelname == "WARNING"]
        assert len(warnings) == 2 and all("out of resources" in r.getMessage() for r in warnings)
    finally:
        reset_fallbacks()
    assert fallbacks() == {}
