"""benchmarks/moe_layer.py keeps running: its correctness checks (equal activated FLOPs, HF eager == grouped_mm, our
SMoE block with Mixtral's weights == Mixtral) run before any timing. No time is asserted: figures belong in
benchmarks/README.md with the command that printed them."""

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_moe_layer_benchmark_quick_run_passes_its_checks():
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src"), "HF_HUB_OFFLINE": "1"}
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "moe_layer.py"), "--quick"],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "ours_smoe with Mixtral's weights == Mixtral: ok" in proc.stdout
    rows = [line for line in proc.stdout.splitlines() if line.startswith("|     64 |")]
    assert [row.split("|")[2].strip() for row in rows] == ["fwd", "fwd+bwd"]
