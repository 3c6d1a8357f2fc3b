"""benchmarks/moe_layer.py keeps running: its correctness checks (equal activated FLOPs, HF eager == grouped_mm, our
SMoE block with Mixtral's weights == Mixtral) run before any timing. No time is asserted: figures belong in
benchmarks/README.md with the command that printed them."""

import sys
from pathlib import Path

from tests.fixtures.warm import cli_env

ROOT = Path(__file__).resolve().parents[2]


def test_moe_layer_benchmark_quick_run_passes_its_checks(warm):
    """`python benchmarks/moe_layer.py --quick` (forked warm: tests/fixtures/warm.py)."""
    proc = warm.run([sys.executable, str(ROOT / "benchmarks" / "moe_layer.py"), "--quick"], env=cli_env(), timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "ours_smoe with Mixtral's weights == Mixtral: ok" in proc.stdout
    rows = [line for line in proc.stdout.splitlines() if line.startswith("|     64 |")]
    assert [row.split("|")[2].strip() for row in rows] == ["fwd", "fwd+bwd"]
