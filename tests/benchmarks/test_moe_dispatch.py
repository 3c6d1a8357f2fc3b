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
    # the Triton routing's three kernels (softmax+top-k, histogram, scatter), only when asked for; Mixtral has none
    launches = blocks["ours_smoe"]["fwd"]["triton_launches"]
    assert launches == (3 if triton else 0) and blocks["hf_mixtral"]["fwd"]["triton_launches"] == 0
    # the h=3 block moves more bytes than Mixtral's at the same width (its per-assignment intermediates)
    assert blocks["ours_h3"]["fwd+bwd"]["gb_moved_at_scale"] > blocks["hf_mixtral"]["fwd+bwd"]["gb_moved_at_scale"]
    parts = data["h3_forward_parts"]
    assert "_grouped_mm" in parts["gate/up grouped GEMM"]["ops"] and "mm" in parts["head layer"]["ops"]
    assert parts["route"]["triton_launches"] == (1 if triton else 0)
    assert parts["whole block forward"]["device_ops"] == blocks["ours_h3"]["fwd"]["device_ops"]
    assert "h=3 forward, by part:" in capsys.readouterr().out
