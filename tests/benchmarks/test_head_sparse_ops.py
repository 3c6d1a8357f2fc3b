"""benchmarks/studies/head_sparse_ops.py: the head-sparse Triton path's host work, counted under the interpreter."""

import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks" / "studies"))

import head_sparse_ops  # noqa: E402

from mhmoe.models.ops.triton_compat import interpreting  # noqa: E402


@pytest.mark.skipif(not interpreting(), reason="needs TRITON_INTERPRET=1 (scripts/test.sh sets it)")
def test_the_row_lists_and_key_block_bounds_are_one_launch_each_and_nothing_waits_on_the_host():
    cell = head_sparse_ops.counts(tokens=19)
    forward, backward = cell["forward"], cell["backward"]
    assert forward["launches"] == {"_row_lists_kernel": 1, "_forward_kernel": 1}
    assert backward["launches"] == {"_dq_kernel": 1, "_key_block_bounds_kernel": 1, "_dkdv_kernel": 1}
    assert forward["host_syncs"] == backward["host_syncs"] == 0
    assert not {"cumsum", "scatter_", "repeat", "where"} & set(forward["ops"])  # the chains the kernels replaced
    assert not {"searchsorted", "stack", "clamp", "maximum"} & set(backward["ops"])
    assert forward["device_ops"] <= 6 and backward["device_ops"] <= 10
