"""The grouped GEMM's implementations and its choice of one (ops/experts/grouped_gemm.py): torch's kernel, the tiled batched matmul that
never reads the routing on the host (CUDA operands the kernel refuses, e.g. fp32), the per-group loop (CPU only); and
the experts under autocast (operands cast once, the GEMMs in bf16, fp32 gradients for the fp32 master weights).

References are independent: fp64 per-group matmuls written here, and the fp32 experts outside autocast."""

import pytest
import torch

from mhmoe.models.mhmoe.configuration_mhmoe import MHMoEConfig
from mhmoe.models.mhmoe.experts import MHMoEExperts, eager_experts_forward, grouped_experts_forward
from mhmoe.models.mhmoe.modeling_mhmoe import MHMoEForCausalLM
from mhmoe.models.ops.experts import experts_grouped_mm
from mhmoe.models.ops.experts.grouped_gemm import choose_grouped_mm_path, grouped_mm, grouped_mm_path, tiled_grouped_mm


def _groups(counts, seed=0):
    """offsets (E,) int32 for these group sizes; rows past the last offset (dropped assignments) stay garbage."""
    offsets = torch.tensor(counts).cumsum(0).to(torch.int32)
    return offsets, int(offsets[-1])


def _reference_3d(a, b, offsets):
    out = torch.zeros(a.shape[0], b.shape[-1], dtype=torch.float64)
    start = 0
    for e, end in enumerate(offsets.tolist()):
        out[start:end] = a[start:end].double() @ b[e].double()
        start = end
    return out


def _reference_2d(a, b, offsets):
    out = torch.zeros(len(offsets), a.shape[0], b.shape[-1], dtype=torch.float64)
    start = 0
    for e, end in enumerate(offsets.tolist()):
        out[e] = a[:, start:end].double() @ b[start:end].double()
        start = end
    return out


@pytest.mark.parametrize("tile", [4, 16, 128])
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_tiled_matches_per_group_matmuls(tile, dtype, tol):
    counts = [5, 0, 17, 1, 0, 33, 4]  # empty groups, groups smaller and larger than a tile
    offsets, kept = _groups(counts)
    rows = kept + 6  # 6 dropped rows past offsets[-1]
    g = torch.Generator().manual_seed(0)
    a = torch.randn(rows, 9, generator=g).to(dtype)
    b = torch.randn(len(counts), 9, 11, generator=g).to(dtype)
    out = tiled_grouped_mm(a, b, offsets, tile)
    assert out.shape == (rows, 11) and out.dtype == dtype
    ref = _reference_3d(a, b, offsets)
    torch.testing.assert_close(out[:kept].double(), ref[:kept], rtol=tol, atol=tol * 3)
    assert not out[kept:].any()  # dropped rows are never computed (zeros here)

    grad = torch.randn(rows, 11, generator=g).to(dtype)
    weight_grad = tiled_grouped_mm(a.t(), grad, offsets, tile)  # (in, S) @ (S, out) -> (E, in, out)
    assert weight_grad.shape == (len(counts), 9, 11)
    torch.testing.assert_close(weight_grad.double(), _reference_2d(a.t(), grad, offsets), rtol=tol, atol=tol * 10)
    assert not weight_grad[1].any() and not weight_grad[4].any()  # empty groups: 0


def test_every_path_agrees_through_the_dispatch():
    offsets, kept = _groups([3, 0, 8, 5])
    g = torch.Generator().manual_seed(1)
    a, b = torch.randn(kept, 8, generator=g), torch.randn(4, 8, 16, generator=g)
    results = {path: grouped_mm(a, b, offsets, path=path) for path in ("kernel", "tiled", "loop")}
    for path, out in results.items():
        torch.testing.assert_close(out.double(), _reference_3d(a, b, offsets), rtol=1e-5, atol=1e-5, msg=path)


def test_tiled_path_reads_nothing_on_the_host():
    """Traced whole (fullgraph) by Dynamo: any .tolist()/.item() on the offsets would break the graph and fail. The
    per-group loop, which does read them, fails the same check (so the check can fail)."""
    offsets, kept = _groups([3, 0, 8, 5])
    a, b = torch.randn(kept, 8), torch.randn(4, 8, 16)
    torch._dynamo.reset()
    tiled = torch.compile(lambda a, b, o: grouped_mm(a, b, o, path="tiled"), fullgraph=True, backend="eager")
    torch.testing.assert_close(tiled(a, b, offsets), grouped_mm(a, b, offsets, path="loop"))
    loop = torch.compile(lambda a, b, o: grouped_mm(a, b, o, path="loop"), fullgraph=True, backend="eager")
    with pytest.raises(torch._dynamo.exc.TorchDynamoException):  # a graph break on the host read
        loop(a, b, offsets)
    torch._dynamo.reset()


def test_path_choice():
    assert choose_grouped_mm_path("cuda", True, False) == "kernel"  # bf16 on SM80+
    assert choose_grouped_mm_path("cuda", False, False) == "tiled"  # fp32 (or unaligned) on CUDA: no host sync
    assert choose_grouped_mm_path("cpu", True, False) == "kernel"
    assert choose_grouped_mm_path("cpu", False, False) == "loop"
    assert choose_grouped_mm_path("cpu", True, True) == "loop"  # into a pooled buffer
    aligned = torch.randn(4, 8)
    assert grouped_mm_path(aligned, torch.randn(2, 8, 16)) == "kernel"
    assert grouped_mm_path(torch.randn(4, 5), torch.randn(2, 5, 7)) == "loop"  # odd widths: the kernel refuses


def _experts(dtype=torch.float32):
    config = MHMoEConfig(
        hidden_size=48,
        moe_heads=3,
        num_attention_heads=1,
        head_dim=2,
        num_experts=6,
        num_experts_per_tok=3,
        moe_intermediate_size=32,
    )
    config._experts_implementation = "grouped_mm"
    experts = MHMoEExperts(config)
    torch.manual_seed(0)
    with torch.no_grad():
        for p in experts.parameters():
            p.normal_(0, 0.3)
    return experts.to(dtype)


def test_experts_under_autocast_run_in_bf16_with_fp32_master_gradients():
    experts = _experts()
    g = torch.Generator().manual_seed(2)
    hidden = torch.randn(40, 16, generator=g)
    index = torch.stack([torch.randperm(6, generator=g)[:3] for _ in range(40)])
    weights = torch.rand(40, 3, generator=g)
    grad_out = torch.randn(40, 16, generator=g)

    def run(autocast):
        experts.zero_grad(set_to_none=True)
        x = hidden.clone().requires_grad_()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            out = grouped_experts_forward(experts, x, index, weights)
        out.float().backward(grad_out)
        return out, x.grad, experts.gate_up_proj.grad, experts.down_proj.grad

    ref = run(False)
    low = run(True)
    assert ref[0].dtype == torch.float32 and low[0].dtype == torch.bfloat16  # the GEMMs ran in bf16
    assert low[2].dtype == torch.float32 and low[3].dtype == torch.float32  # master weights: fp32 gradients
    assert low[1].dtype == torch.float32  # the input's gradient in the input's dtype
    for r, lo in zip(ref, low):
        scale = r.abs().max()
        assert (lo.float() - r).abs().max() <= 0.03 * scale  # bf16: ~3 significant digits
    rows = hidden.to(torch.bfloat16)
    assert grouped_mm_path(rows, experts.gate_up_proj.to(torch.bfloat16).transpose(1, 2)) == "kernel"


def test_model_training_step_under_bf16_autocast_close_to_fp32():
    config = MHMoEConfig(
        vocab_size=64,
        hidden_size=48,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_experts=6,
        num_experts_per_tok=3,
        moe_heads=3,
        moe_intermediate_size=32,
        decoder_sparse_step=1,
        max_position_embeddings=32,
    )
    torch.manual_seed(0)
    model = MHMoEForCausalLM(config)
    ids = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(3))

    def step(autocast):
        model.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        return loss.detach().float(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    loss32, grads32 = step(False)
    loss16, grads16 = step(True)
    assert abs(loss16 - loss32) < 0.02 * loss32
    assert grads16.keys() == grads32.keys()
    expert_grads = [n for n in grads32 if "experts.gate_up_proj" in n]
    assert expert_grads
    for name in expert_grads:
        assert grads16[name].dtype == torch.float32
        cos = torch.nn.functional.cosine_similarity(grads16[name].flatten(), grads32[name].flatten(), dim=0)
        assert cos > 0.98, name


def test_bitnet_grouped_linear_under_autocast_and_tiled():
    """BitNet's grouped linear: under autocast one cast and torch's kernel in bf16 (close to fp32 at bf16 tolerance,
    fp32 gradient for the fp32 weight); the tiled path it takes on CUDA matches the per-expert loop, gradients too."""
    from mhmoe.models.mhmoe import bitnet

    offsets, kept = _groups([4, 0, 9, 3])
    g = torch.Generator().manual_seed(4)
    rows = torch.randn(kept, 16, generator=g)
    weight = (torch.randn(4, 32, 16, generator=g) * 0.3).requires_grad_()
    probe = torch.randn(kept, 32, generator=g)  # a dense upstream gradient (an expanded one trips torch's kernel)
    ref = bitnet._grouped_linear(rows, weight, offsets)
    (ref_grad,) = torch.autograd.grad(ref, weight, probe)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        low = bitnet._grouped_linear(rows, weight, offsets)
    (low_grad,) = torch.autograd.grad(low, weight, probe.to(low.dtype))
    assert low.dtype == torch.bfloat16 and low_grad.dtype == torch.float32
    assert (low.float() - ref).abs().max() <= 0.02 * ref.abs().max()
    assert (low_grad - ref_grad).abs().max() <= 0.02 * ref_grad.abs().max()

    tiled = tiled_grouped_mm(rows, weight.transpose(1, 2), offsets, 4)
    (tiled_grad,) = torch.autograd.grad(tiled, weight, probe)  # the tiled path is differentiable as it stands
    torch.testing.assert_close(tiled, ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(tiled_grad, ref_grad, rtol=1e-5, atol=1e-5)


def test_models_import_and_run_without_transformers_tensor_parallel_styles():
    """An older Transformers (the GPU image's) lacks `transformers.distributed.parallel_utils`: the models still import
    and run; only the MoH head router's TP style is not registered. Fresh interpreter, the name removed first."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    code = """
import json, sys
import transformers.distributed.parallel_utils as parallel_utils
import transformers.distributed.tensor_parallel, transformers.modeling_utils  # Transformers' own users, loaded first
del parallel_utils.ALL_PARALLEL_STYLES  # as in a Transformers without it: `from ... import` it raises ImportError
import torch
from mhmoe import MHMoEConfig, MHMoEForCausalLM
from mhmoe.models.moh import moh_parallel
config = MHMoEConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                     num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16, moe_heads=2, moh_shared_heads=2,
                     moh_active_heads=1)
loss = MHMoEForCausalLM(config)(input_ids=torch.tensor([[1, 5, 9, 2]]), labels=torch.tensor([[1, 5, 9, 2]])).loss
print(json.dumps({"styles": moh_parallel.ALL_PARALLEL_STYLES is None, "loss": float(loss)}))
"""
    src = Path(__file__).resolve().parents[2] / "src"
    env = {**os.environ, "PYTHONPATH": str(src), "HF_HUB_OFFLINE": "1"}
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["styles"] and result["loss"] > 0


@pytest.mark.parametrize("recompute", [False, True], ids=["keep-gate_up", "recompute-gate_up"])
def test_experts_keep_at_most_gate_up_and_match_eager(monkeypatch, recompute):
    """The backward recomputes the gathered rows, act(gate)·up and the routing weights' gradient (no expert outputs
    kept); with RECOMPUTE_GATE_UP not even gate/up. Gradients equal the eager loop's either way."""
    monkeypatch.setattr(experts_grouped_mm, "RECOMPUTE_GATE_UP", recompute)
    experts = _experts()
    g = torch.Generator().manual_seed(5)
    hidden = torch.randn(40, 16, generator=g)
    index = torch.stack([torch.randperm(6, generator=g)[:3] for _ in range(40)])
    index[0, 1] = 6  # one dropped assignment (capacity sentinel)
    weights = torch.rand(40, 3, generator=g).masked_fill(index == 6, 0.0)
    grad_out = torch.randn(40, 16, generator=g)
    results = []
    for forward in (eager_experts_forward, grouped_experts_forward):
        experts.zero_grad(set_to_none=True)
        x, w = hidden.clone().requires_grad_(), weights.clone().requires_grad_()
        out = forward(experts, x, index, w)
        if forward is grouped_experts_forward:
            inter = experts.gate_up_proj.shape[1]
            big = [t for t in out.grad_fn.saved_tensors if t is not None and t.dim() == 2 and t.shape[-1] == inter]
            assert len(big) == (0 if recompute else 1)  # (S, 2I) gate/up, or nothing
        out.backward(grad_out)
        results.append((out, x.grad, w.grad, experts.gate_up_proj.grad, experts.down_proj.grad))
    for want, have in zip(*results):
        torch.testing.assert_close(have, want, rtol=1e-5, atol=1e-5)
    assert results[1][2][0, 1] == 0  # the dropped slot's weight gets no gradient
