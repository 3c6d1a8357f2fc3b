"""The MoH l2 head-router kernel (ops/head_router/head_router_triton.py) against its PyTorch reference
(head_router_naive.py), and that reference against the model's own l2 router (`head_routers.L2Router`): gates, router logits,
selected heads and the queries' gradient, under TRITON_INTERPRET=1 (tests/conftest.py)."""

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from mhmoe.models.moh.head_routers import HEAD_ROUTERS, l2_scores
from mhmoe.models.ops.head_router import head_router_triton
from mhmoe.models.ops.head_router.head_router_naive import l2_head_gates
from mhmoe.models.ops.head_router.head_router_triton import l2_head_gates_triton

from .spread_model import spread_model

pytestmark = pytest.mark.skipif(not head_router_triton.HAS_TRITON, reason="triton is not installed")
CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (the GPU-only kernel checks)")

CASES = [  # (M, H, S, K, hd): M not a multiple of the 8-row blocks; hd 5 and 12 not powers of two
    (37, 8, 2, 3, 12),
    (37, 8, 0, 1, 8),
    (19, 4, 2, 2, 5),
    (21, 6, 3, 1, 16),
    (13, 3, 2, 1, 4),
    (9, 16, 4, 8, 8),
]


def _grads(fn, queries, straight_through, shared, active):
    leaf = queries.clone().requires_grad_()
    gates, logits, index = fn(leaf, shared, active, straight_through)
    probe_gates = torch.linspace(-1, 1, gates.numel()).view_as(gates)
    probe_logits = torch.linspace(0.5, -0.5, logits.numel()).view_as(logits)
    ((gates * probe_gates).sum() + (logits * probe_logits).sum()).backward()
    return gates.detach(), logits.detach(), index, leaf.grad


MODES = [False, True, "scores", "selected_scores"]  # every moh_straight_through
MODE_IDS = ["soft", "straight-through", "st-scores", "st-selected-scores"]


@pytest.mark.parametrize("straight_through", MODES, ids=MODE_IDS)
@pytest.mark.parametrize("case", CASES, ids=[f"M{m}-H{h}-S{s}-K{k}-hd{d}" for m, h, s, k, d in CASES])
def test_kernel_matches_reference(case, straight_through):
    rows, heads, shared, active, head_dim = case
    queries = torch.randn(rows, heads, head_dim, generator=torch.Generator().manual_seed(rows + heads))
    kernel = _grads(
        lambda *a: l2_head_gates_triton(*a[:3], a[3], block_rows=8), queries, straight_through, shared, active
    )
    reference = _grads(l2_head_gates, queries, straight_through, shared, active)
    assert torch.equal(kernel[2], reference[2])
    for have, want in zip(kernel[:2] + kernel[3:], reference[:2] + reference[3:]):
        torch.testing.assert_close(have, want, rtol=2e-5, atol=1e-5)
    gates = kernel[0]
    assert (gates[:, :shared] == 1).all() and int((gates[:, shared:] != 0).sum()) == rows * active
    if straight_through:
        assert set(gates.unique().tolist()) <= {0.0, 1.0}


@pytest.mark.parametrize("straight_through", MODES, ids=MODE_IDS)
def test_reference_is_the_models_router(straight_through):
    """head_router_naive.l2_head_gates gives the l2 router's gates, logits, index and query gradient."""
    batch, seq, heads, shared, active, head_dim = 2, 5, 8, 2, 3, 12
    router = HEAD_ROUTERS["l2"](32, heads, shared, active, straight_through=straight_through)
    queries = torch.randn(batch, seq, heads, head_dim, generator=torch.Generator().manual_seed(0))
    leaf = queries.clone().requires_grad_()
    gates, logits, index = router(torch.randn(batch, seq, 32), leaf)
    probe = torch.linspace(-1, 1, gates.numel()).view_as(gates)
    (gates * probe).sum().backward()
    flat = queries.reshape(-1, heads, head_dim).clone().requires_grad_()
    ref_gates, ref_logits, ref_index = l2_head_gates(flat, shared, active, straight_through)
    (ref_gates * probe.reshape(-1, heads)).sum().backward()
    torch.testing.assert_close(ref_gates, gates.reshape(-1, heads))
    torch.testing.assert_close(ref_logits, logits.reshape(-1, heads - shared))
    assert torch.equal(ref_index, index.reshape(-1, active))
    torch.testing.assert_close(flat.grad, leaf.grad.reshape(-1, heads, head_dim))


SPARSE = [CASES[0], CASES[3], CASES[5]]  # K < R and R >= 3 (with R = 2 the l2 scores do not depend on the queries)


@pytest.mark.parametrize("case", SPARSE, ids=[f"M{m}-H{h}-S{s}-K{k}-hd{d}" for m, h, s, k, d in SPARSE])
def test_kernel_straight_through_modes_have_their_own_gradients(case):
    """The straight-through modes share the kernel's forward (0/1 gates) and differ in the gradient: the kernel's
    queries' gradient under each mode is the reference's under that mode, and no two modes give the same one (the kernel
    once took "scores" for True). The gates alone are probed here, the logits' own gradient is the same in all."""
    rows, heads, shared, active, head_dim = case
    queries = torch.randn(rows, heads, head_dim, generator=torch.Generator().manual_seed(rows))
    probe = torch.randn(rows, heads, generator=torch.Generator().manual_seed(1))
    grads = {}
    for mode in MODES[1:]:
        for name, fn in (("kernel", lambda *a: l2_head_gates_triton(*a, block_rows=8)), ("reference", l2_head_gates)):
            leaf = queries.clone().requires_grad_()
            gates, _, _ = fn(leaf, shared, active, mode)
            assert set(gates.unique().tolist()) <= {0.0, 1.0}
            (gates * probe).sum().backward()
            grads[name, mode] = leaf.grad
        torch.testing.assert_close(grads["kernel", mode], grads["reference", mode], rtol=2e-5, atol=1e-6)
    for i, a in enumerate(MODES[1:]):
        for b in MODES[i + 2 :]:
            difference = (grads["kernel", a] - grads["kernel", b]).abs().max()
            assert difference > 1e-3 * grads["kernel", a].abs().max(), (a, b)


def test_ties_go_to_the_lowest_head_and_bad_arguments():
    queries = torch.ones(3, 6, 4)  # every routed head has the same norm
    gates, _, index = l2_head_gates_triton(queries, 2, 2)
    assert index.tolist() == [[0, 1]] * 3 and gates[:, 2:4].eq(1).all() and gates[:, 4:].eq(0).all()
    with pytest.raises(ValueError, match="active_heads"):
        l2_head_gates_triton(queries, 2, 5)
    for fn in (l2_head_gates_triton, l2_head_gates):  # a misspelt mode would otherwise act as True
        with pytest.raises(ValueError, match="straight_through must be one of"):
            fn(queries, 2, 2, "score")


@pytest.mark.filterwarnings("ignore:invalid value encountered")  # numpy under the interpreter, on NaN
@pytest.mark.parametrize("straight_through", [False, True], ids=["soft", "straight-through"])
def test_nan_and_inf_queries_give_in_range_heads(straight_through):
    """NaN or inf in a routed head's query makes the row's norms' std, and so its logits, NaN: the kernel then takes
    the lowest routed heads (distinct, in range: an index past them would read and write out of bounds on a GPU) with
    NaN gates there, as the reference's NaN gates on its own (unspecified) choice; every other row is the reference's.
    NaN in a shared head does not touch routing."""
    rows, heads, shared, active, head_dim = 19, 7, 2, 3, 5
    queries = torch.randn(rows, heads, head_dim, generator=torch.Generator().manual_seed(4))
    queries[1, 3, 2] = float("nan")
    queries[4, 6] = float("inf")
    queries[6, 2:, 0] = float("-inf")
    queries[8] = float("nan")
    queries[10, 0, 1] = float("nan")  # shared head only: the row routes normally
    gates, logits, index = l2_head_gates_triton(queries, shared, active, straight_through, block_rows=8)
    ref_gates, ref_logits, ref_index = l2_head_gates(queries, shared, active, straight_through)
    bad = ref_logits.isnan().any(-1)
    assert bad.tolist() == [i in (1, 4, 6, 8) for i in range(rows)]
    assert ((index >= 0) & (index < heads - shared)).all()
    assert all(len(set(row)) == active for row in index.tolist())
    assert torch.equal(index[bad], torch.arange(active).expand(int(bad.sum()), active))
    assert torch.equal(index[~bad], ref_index[~bad])
    torch.testing.assert_close(logits, ref_logits, rtol=2e-5, atol=1e-5, equal_nan=True)
    torch.testing.assert_close(gates[~bad], ref_gates[~bad], rtol=2e-5, atol=1e-5)
    for have in (gates[bad], ref_gates[bad]):  # shared heads 1; NaN on the K selected routed heads; 0 elsewhere
        assert (have[:, :shared] == 1).all()
        assert have[:, shared:].isnan().sum(-1).tolist() == [active] * int(bad.sum())
        assert (have[:, shared:].nan_to_num(1.0) == 1).sum(-1).tolist() == [active] * int(bad.sum())
    assert gates[bad][:, shared:].isnan().eq(F.one_hot(index[bad], heads - shared).sum(1).bool()).all()


@settings(max_examples=15, deadline=None, derandomize=True)
@given(
    rows=st.integers(1, 40),
    routed=st.integers(1, 12),
    shared=st.integers(0, 4),
    head_dim=st.integers(1, 20),
    active=st.integers(1, 12),
    straight_through=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_properties(rows, routed, shared, head_dim, active, straight_through, seed):
    active = min(active, routed)
    queries = torch.randn(rows, shared + routed, head_dim, generator=torch.Generator().manual_seed(seed))
    gates, logits, index = l2_head_gates_triton(queries, shared, active, straight_through, block_rows=16)
    ref_gates, ref_logits, ref_index = l2_head_gates(queries, shared, active, straight_through)
    assert torch.equal(index, ref_index)
    # logits = norms / std(norms): the kernel's and torch's fp32 sums round differently, by ~eps·|norm|, which moves
    # the std by ~eps·|norm|/std relative. Near-equal norms (2 routed heads, a small std) amplify that: 4e-5 relative
    # was seen at |norm|/std = 500. The tolerance follows that conditioning (it is 2e-5 for well-spread norms).
    norms = queries[:, shared:].norm(dim=-1)
    std = norms.std(dim=-1, correction=1 if routed > 1 else 0).clamp_min(1e-6)
    tol = 2e-5 + 8 * torch.finfo(torch.float32).eps * float((norms.amax(-1) / std).max())
    torch.testing.assert_close(logits, ref_logits, rtol=tol, atol=1e-5)
    torch.testing.assert_close(gates, ref_gates, rtol=tol, atol=1e-5)


@pytest.mark.parametrize("straight_through", [False, True], ids=["soft", "straight-through"])
def test_bf16_queries(straight_through):
    """bf16 queries: loaded as bf16, every sum in fp32 (as the reference's `.float()`): the reference's fp32 outputs
    at fp32 tolerance; the queries' gradient comes back in bf16, at bf16 tolerance."""
    rows, heads, shared, active, head_dim = 37, 8, 2, 3, 12
    queries = torch.randn(rows, heads, head_dim, generator=torch.Generator().manual_seed(11)).bfloat16()
    kernel = _grads(
        lambda *a: l2_head_gates_triton(*a[:3], a[3], block_rows=8), queries, straight_through, shared, active
    )
    reference = _grads(l2_head_gates, queries, straight_through, shared, active)
    assert torch.equal(kernel[2], reference[2])
    assert kernel[0].dtype == kernel[1].dtype == torch.float32 and kernel[3].dtype == torch.bfloat16
    for have, want in zip(kernel[:2], reference[:2]):
        torch.testing.assert_close(have, want, rtol=2e-5, atol=1e-5)
    torch.testing.assert_close(kernel[3], reference[3], rtol=1.6e-2, atol=1e-2)


@pytest.mark.parametrize("straight_through", MODES, ids=MODE_IDS)
def test_model_forced_onto_the_kernel_matches_torch(straight_through, monkeypatch):
    """An MHMoE model with MoH l2 routing: routing_backend="triton" (head router and expert routing on the kernels)
    gives the torch path's logits, losses and gradients, and the head-router kernel really ran."""
    from mhmoe import MHMoEConfig
    from mhmoe.models.ops import backends

    monkeypatch.delenv(backends.ROUTING_BACKEND_ENV, raising=False)
    config = MHMoEConfig(
        vocab_size=41,
        hidden_size=32,
        intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        moe_heads=2,
        num_experts=5,
        num_experts_per_tok=2,
        moe_intermediate_size=16,
        moh_shared_heads=1,
        moh_active_heads=2,
        moh_router="l2",
        moh_straight_through=straight_through,
        output_router_logits=True,
    )
    model = spread_model(config)
    ids = torch.randint(0, 41, (2, 7), generator=torch.Generator().manual_seed(2))
    calls = []
    kernels = backends.IMPLEMENTATIONS["head_router.l2_head_gates"]
    original = kernels["triton"]
    monkeypatch.setitem(kernels, "triton", lambda *a: calls.append(1) or original(*a))
    results = []
    for backend in ("torch", "triton"):
        for module in model.modules():
            if hasattr(module, "routing_backend"):
                module.routing_backend = backend
        model.zero_grad(set_to_none=True)
        out = model(input_ids=ids, labels=ids)
        out.loss.backward()
        results.append([out.logits, out.loss, out.moh_aux_loss] + [p.grad for p in model.parameters()])
    assert len(calls) == 2  # one per layer, on the triton pass
    for have, want in zip(results[1], results[0]):
        torch.testing.assert_close(have, want, rtol=1e-5, atol=1e-5)


def test_gathered_head_norms_win_over_the_kernel():
    """Tensor parallelism hands the l2 router the gathered norms of every head (`head_norms`) while `query_states`
    holds only this rank's heads: on the triton backend too, the router must route on `head_norms`."""
    heads, shared, active = 6, 2, 2
    router = HEAD_ROUTERS["l2"](32, heads, shared, active)
    generator = torch.Generator().manual_seed(7)
    local_queries = torch.randn(2, 5, heads, 8, generator=generator)  # this rank's queries: other norms
    head_norms = torch.rand(2, 5, heads, generator=generator) * 3 + 0.1  # every head's, gathered
    results = []
    for backend in ("torch", "triton"):
        router.routing_backend = backend
        results.append(router(torch.zeros(2, 5, 32), local_queries, head_norms=head_norms))
    for have, want in zip(results[1], results[0]):
        torch.testing.assert_close(have, want)
    torch.testing.assert_close(results[1][1], l2_scores(head_norms[..., shared:]))  # routed on the gathered norms


@CUDA
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda_kernel_matches_reference(dtype):
    """On the GPU (8192 tokens, 16 heads of 64, 4 shared, top-4; a few NaN rows): the reference's selection and gates
    (no dot products: fp32 tolerance), in-range heads in the NaN rows after a synchronize."""
    queries = torch.randn(8192, 16, 64, generator=torch.Generator().manual_seed(3)).to(dtype)
    queries[::1000, 7, 0] = float("nan")
    gates, logits, index = l2_head_gates_triton(queries.cuda(), 4, 4)
    torch.cuda.synchronize()
    ref_gates, ref_logits, ref_index = l2_head_gates(queries, 4, 4)
    bad = ref_logits.isnan().any(-1)
    assert int(bad.sum()) == 9 and ((index >= 0) & (index < 12)).all()
    assert torch.equal(index.cpu()[~bad], ref_index[~bad])
    torch.testing.assert_close(logits.cpu(), ref_logits, rtol=1e-4, atol=1e-5, equal_nan=True)
    torch.testing.assert_close(gates.cpu()[~bad], ref_gates[~bad], rtol=1e-4, atol=1e-5)
