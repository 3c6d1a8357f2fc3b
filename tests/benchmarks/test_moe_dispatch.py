"""benchmarks/moe_dispatch.py: the CPU counts that the GPU fix plan (benchmarks/README.md) is measured by still run on
the blocks of gpu_moe.py and count what they claim to (tiny width: d=192, the smallest the h=3 block accepts)."""

import json
import os
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "benchmarks"))

import moe_dispatch  # noqa: E402


@pytest.mark.parametrize("triton", [False, True], ids=["torch-routing", "triton-routing"])
def test_counts_per_block_and_per_part(tmp_path, capsys, triton):
    if triton and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.fail("the Triton routing count needs TRITON_INTERPRET=1 (scripts/test.sh sets it)")
    out = tmp_path / "counts.json"
    args = ["--hidden", "192", "--tokens", "16", "--scale_tokens", "64", "--json", str(out)]
    assert moe_dispatch.main(args + (["--triton"] if triton else [])) == 0
    data = json.loads(out.read_text())
    assert data["routing"] == ("triton" if triton else "torch") and data["commit"] and data["dirty"] is not None
    blocks = data["blocks"]
    for name in ("hf_mixtral", "ours_smoe", "ours_h3"):
        fwd, both = blocks[name]["fwd"], blocks[name]["fwd+bwd"]
        assert 0 < fwd["device_ops"] < both["device_ops"] and 0 < fwd["gb_moved_at_scale"] < both["gb_moved_at_scale"]
        assert both["host_syncs"] == 0, (name, both["ops"])  # dropless routing and dispatch never read the device
    # the Triton routing's four kernels (softmax+top-k, histogram, scan, scatter), only when asked for; Mixtral has none
    launches = blocks["ours_smoe"]["fwd"]["triton_launches"]
    assert launches == (4 if triton else 0) and blocks["hf_mixtral"]["fwd"]["triton_launches"] == 0
    # the h=3 block moves more bytes than Mixtral's at the same width (its per-assignment intermediates)
    assert blocks["ours_h3"]["fwd+bwd"]["gb_moved_at_scale"] > blocks["hf_mixtral"]["fwd+bwd"]["gb_moved_at_scale"]
    parts = data["h3_forward_parts"]
    assert "_grouped_mm" in parts["gate/up grouped GEMM"]["ops"] and "mm" in parts["head layer"]["ops"]
    assert parts["route"]["triton_launches"] == (1 if triton else 0)
    assert parts["whole block forward"]["device_ops"] == blocks["ours_h3"]["fwd"]["device_ops"]
    assert "h=3 forward, by part:" in capsys.readouterr().out


def test_fused_steps_count_their_launches_and_move_fewer_bytes(tmp_path):
    """--fused_steps (the grouped_mm experts' CUDA steps, run here in the interpreter): 2 launches in a forward
    (SwiGLU, the slots' sum), 4 in a forward+backward, each counted with the bytes it is given; the h=3 block's
    forward+backward then launches fewer PyTorch operations and moves fewer bytes than with the PyTorch steps."""
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.fail("the fused steps on CPU need TRITON_INTERPRET=1 (scripts/test.sh sets it)")
    from mhmoe.models.ops.experts import experts_grouped_mm

    args = ["--hidden", "192", "--tokens", "16", "--scale_tokens", "64"]
    counts = {}
    for fused in (False, True):
        out = tmp_path / f"{fused}.json"
        try:
            assert moe_dispatch.main([*args, "--json", str(out)] + (["--fused_steps"] if fused else [])) == 0
        finally:
            experts_grouped_mm.STEPS_KERNELS_ON_CPU = False
        counts[fused] = json.loads(out.read_text())["blocks"]["ours_h3"]
    plain, fused = counts[False], counts[True]
    assert (plain["fwd"]["triton_launches"], fused["fwd"]["triton_launches"]) == (0, 2)
    assert fused["fwd+bwd"]["triton_launches"] == 4 and fused["fwd+bwd"]["gb_by_op"]["triton swiglu_backward_kernel"]
    assert fused["fwd+bwd"]["device_ops"] < plain["fwd+bwd"]["device_ops"]
    assert fused["fwd+bwd"]["gb_moved_at_scale"] < plain["fwd+bwd"]["gb_moved_at_scale"]
