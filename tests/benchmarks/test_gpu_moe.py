"""benchmarks/gpu_moe.py off the GPU: exits 0 saying so; its smoke run writes every section it ran as it goes."""

import json
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "benchmarks"))

import gpu_moe  # noqa: E402


@pytest.mark.skipif(gpu_moe.torch.cuda.is_available(), reason="this machine has a GPU")
def test_without_a_gpu_it_exits_0_saying_so(tmp_path, capsys):
    assert gpu_moe.main(["--out", str(tmp_path)]) == 0
    assert "no GPU available" in capsys.readouterr().out
    assert not any(tmp_path.iterdir())  # nothing recorded


def test_default_widths_are_valid_for_h3():
    hidden = gpu_moe.build_parser().parse_args([]).hidden
    assert hidden and all(h % 3 == 0 and (h // 3) % 64 == 0 for h in hidden)  # h=3 sub-tokens, 64-wide heads
    with pytest.raises(SystemExit, match="divisible by 3"):
        gpu_moe.build_blocks(2048, gpu_moe.torch.float32, gpu_moe.torch.device("cpu"))  # the old default


def test_smoke_run_writes_each_section(tmp_path):
    sections = ["checks", "routing", "gemm", "model", "parts", "compiled"]
    assert gpu_moe.main(["--smoke", "--out", str(tmp_path), "--sections", *sections]) == 0
    data = json.loads((tmp_path / "gpu_moe.json").read_text())
    assert set(data["section_seconds"]) == set(sections)
    parts = data["parts"]
    assert not parts["errors"], parts["errors"]  # every step of the block still exists under its name
    assert {
        "route",
        "sort by expert",
        "gate/up grouped GEMM",
        "combine (gather K slots, weight, sum)",
        "whole block forward",
    } <= set(parts["parts"])
    assert set(parts["profiles"]) == set(parts["host_bound"]["blocks"]) == {"hf_mixtral", "ours_smoe", "ours_h3"}
    assert all(c["wall_us"] > 0 and c["kernels"] > 0 for c in parts["host_bound"]["blocks"].values())
    assert all(p["kernels"] > 0 for p in parts["profiles"].values())
    assert not data["compiled"]["errors"] and "ours_h3 default" in data["compiled"]["times"]
    errors = data["compiled"]["max_relative_error"]
    assert set(errors) == {"hf_mixtral default", "ours_smoe default", "ours_h3 default"}
    assert all(e < 1e-4 for e in errors.values()), errors  # fp32 on CPU: compiled equals eager
    assert {"grouped GEMMs only", "dense GEMMs, the experts' shapes"} <= set(data["gemm"])
    assert data["kernel_fallbacks"] == {} and {"env", "precision"} <= set(data)
    assert set(data["model"]["models"]) == {"smoe", "mhmoe_h3", "mhmoe_h3_recompute_gate_up", "dense"}
    from mhmoe.models.ops.experts import experts_grouped_mm

    assert experts_grouped_mm.RECOMPUTE_GATE_UP is False  # the benchmark's toggle is put back
    assert {"device", "commit", "dirty", "torch", "transformers", "triton"} <= set(data)
    names = [c["check"] for c in data["checks"]]
    assert "moe grouped_mm tiled float32" in names and "moe grouped_mm kernel float32" in names
    assert all(c["ok"] for c in data["checks"] if c["check"].startswith("moe grouped_mm"))
    routing_checks = [c for c in data["checks"] if c["check"].startswith(("route", "sort_by_expert"))]
    assert "route logits' gradient float32" in names and all(c["ok"] for c in routing_checks), routing_checks
    assert {"route and sort custom ops float32", "grouped_mm experts op d routing weights float32"} <= set(names)
    assert all(c["ok"] for c in data["checks"] if c["check"].startswith("grouped_mm experts op")), data["checks"]
    assert "torch route" in data["routing"]["us"] and data["gemm"]["grouped_mm experts"]["tflops"] > 0


def test_a_models_own_peak_memory_leaves_out_the_models_built_before_it():
    """The 2026-11-26 file recorded peak_bytes with the earlier models still allocated (its column grew model by
    model); the table derives each model's own peak from the same file: the step's peak above its starting memory
    plus the starting memory's growth since the model before it."""
    data = json.loads((REPO / "benchmarks" / "results" / "gpu_moe-nvidia-h200-60178f3" / "gpu_moe.json").read_text())
    models = data["model"]["models"]
    own = gpu_moe.own_peaks(models)
    assert own["smoe"] == models["smoe"]["peak_bytes"]  # the first model: nothing built before it
    assert [round(own[n] / 2**30, 2) for n in models] == [10.92, 11.82, 10.7, 9.55]
    assert [round(models[n]["peak_bytes"] / 2**30, 2) for n in models] == [10.92, 14.23, 15.5, 16.75]
    recorded = {name: {**cells, "own_peak_bytes": 1.0} for name, cells in models.items()}
    assert gpu_moe.own_peaks(recorded) == dict.fromkeys(models, 1.0)  # newer files record it


def test_the_model_card_template_reports_the_committed_gpu_run():
    """model_cards/mhmoe.md's speed paragraph says what the latest window, benchmarks/results/gpu_moe-nvidia-h100-247e4e8,
    holds."""
    folder = REPO / "benchmarks" / "results" / "gpu_moe-nvidia-h100-247e4e8"
    data = json.loads((folder / "gpu_moe.json").read_text())
    probe = json.loads((folder / "probe_mhmoe_table1_gpu.json").read_text())["cells"]

    def span(values):
        return f"{min(values):.2f}–{max(values):.2f}×"

    ratios = [run["times"]["fwd+bwd"] for run in data["blocks"]]
    models = data["model"]["models"]
    own = gpu_moe.own_peaks(models)
    step = [models["mhmoe_h3"]["time_vs_smoe"], probe["MH-MoE h=3"]["ms_per_step"] / probe["SMoE"]["ms_per_step"]]
    memory = [
        own["mhmoe_h3"] / own["smoe"],
        probe["MH-MoE h=3"]["peak_memory_bytes"] / probe["SMoE"]["peak_memory_bytes"],
    ]
    text = " ".join((REPO / "model_cards" / "mhmoe.md").read_text().split())
    assert f"commit {data['commit']}" in text and data["device"] in text
    assert f"3 heads takes {span([r['ours_h3']['ratio'] for r in ratios])} the time" in text
    assert f"a plain SMoE layer {span([r['ours_smoe']['ratio'] for r in ratios])}" in text
    assert f"takes {span(step)} an SMoE's, at {span(memory)} its peak memory" in text


def test_table_prints_only_and_write_table_writes(tmp_path, monkeypatch, capsys):
    """--table prints every recorded run and writes nothing; --write_table also puts that text between the README's
    markers (and the committed README holds what it would write: not stale)."""
    committed = gpu_moe.README.read_text()
    assert gpu_moe.main(["--table"]) == 0
    printed = capsys.readouterr().out.strip()
    assert printed == gpu_moe.table() and gpu_moe.README.read_text() == committed
    assert f"{gpu_moe.TABLE_START}\n{printed}\n{gpu_moe.TABLE_END}" in committed
    readme = tmp_path / "README.md"
    readme.write_text(f"before\n{gpu_moe.TABLE_START}\nold\n{gpu_moe.TABLE_END}\nafter\n")
    monkeypatch.setattr(gpu_moe, "README", readme)
    assert gpu_moe.main(["--write_table"]) == 0
    assert readme.read_text() == f"before\n{gpu_moe.TABLE_START}\n{printed}\n{gpu_moe.TABLE_END}\nafter\n"
