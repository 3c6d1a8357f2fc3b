"""benchmarks/gpu_head_sparse.py off the GPU: its smoke run (tiny shapes, the kernels under TRITON_INTERPRET=1)
writes the provenance header and every section: the table, the flex design's
cells, the profiled parts (operators found by name), the tile alternatives."""

import json
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")
REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "benchmarks"))

import gpu_head_sparse  # noqa: E402


@pytest.mark.skipif(not gpu_head_sparse.hs.interpreting(), reason="needs TRITON_INTERPRET=1 (scripts/test.sh sets it)")
def test_smoke_run_writes_every_section_with_provenance(tmp_path):
    assert gpu_head_sparse.main(["--smoke", "--out", str(tmp_path)]) == 0
    data = json.loads((tmp_path / "gpu_head_sparse.json").read_text())
    assert "errors" not in data
    assert {"device", "commit", "dirty", "env", "torch", "triton", "transformers", "precision", "tiles"} <= set(data)
    assert data["precision"]["operands"] == "float32" and set(data["section_seconds"]) == set(gpu_head_sparse.SECTIONS)
    assert data["check_max_abs_diff"] < 1e-4 and data["check_flex_max_abs_diff"] < 1e-4
    assert [(r["shape"], r["mode"]) for r in data["rows"]] == [
        (shape, mode) for shape in gpu_head_sparse.SMOKE_SHAPES for mode in ("forward", "forward+backward")
    ]
    assert all(r["kernel_ms"] > 0 and r["sdpa_ms"] > 0 for r in data["rows"])
    # the flex design's cells: forward only on CPU (FlexAttention has no CPU backward)
    assert [(r["shape"], r["mode"]) for r in data["flex_rows"]] == [
        (s, "forward") for s in gpu_head_sparse.SMOKE_SHAPES
    ]
    assert all(r["flex_ms"] > 0 and r["ratio"] > 0 for r in data["flex_rows"])
    forward, backward = data["parts"]
    assert forward["mode"] == "forward" and backward["mode"] == "forward+backward"
    for record in (forward, backward):
        assert record["kernel"]["wall_us"] > 0 and record["sdpa"]["wall_us"] > 0
        # the row lists are one Triton launch (not seen by the CPU profiler): no PyTorch cumsum / scatter / nonzero
        assert not {"cumsum", "scatter"} & set(record["kernel"]["parts_us"])
        # (not aten::is_nonzero, a bool of a tensor: the CPU-only check of 0/1 gates, which can rank here under load)
        assert not any(k["kernel"] == "aten::nonzero" for k in record["kernel"]["kernels_us"])
    assert "searchsorted" not in backward["kernel"]["parts_us"]  # the key-block bounds: one Triton launch
    configs = data["tile_configs"]
    assert [c["default"] for c in configs] == [True, False] and all("ratio" in c for c in configs)


@pytest.mark.skipif(not gpu_head_sparse.hs.interpreting(), reason="needs TRITON_INTERPRET=1 (scripts/test.sh sets it)")
def test_a_failing_section_is_recorded_and_the_header_written_first(tmp_path, monkeypatch):
    def broken(device, dtype):
        raise RuntimeError("no kernel today")

    monkeypatch.setattr(gpu_head_sparse, "check", broken)
    assert gpu_head_sparse.main(["--smoke", "--out", str(tmp_path), "--sections", "check"]) == 1
    data = json.loads((tmp_path / "gpu_head_sparse.json").read_text())
    assert data["errors"] == {"check": "RuntimeError: no kernel today"} and "commit" in data
