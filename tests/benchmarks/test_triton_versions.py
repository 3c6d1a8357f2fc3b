"""The kernels under the GPU image's Triton (3.6.0) as well as the dev pin's (3.9.0).

Under Triton 3.6.0's CPU interpreter every routing, head-router and grouped_mm-steps kernel test of tests/models/ops/
passes; the 18 tests of tests/models/ops/test_experts_kernels.py that launch the experts kernels and the 13 of
test_head_sparse_attention.py that launch the head-sparse attention kernels fail, all with one interpreter limitation:
3.6.0's interpreter turns a scalar used as a Python index (a `range()` bound) into an int with `int(handle.data)`
(triton/runtime/interpreter.py), which NumPy 2 refuses for a shape-(1,) array ("only 0-dimensional arrays can be
converted to Python scalars"); 3.9.0 squeezes it first. Scalars computed in a kernel are such arrays (the experts
kernels bound their K loops with `range(0, tl.where(valid, width, 0), BLOCK_K)`: no loop in a tile without rows; the
head-sparse kernels their key loops with the rows' positions), and so are a kernel's integer arguments; the routing
scan and the grouped_mm steps loop with `while`, which the interpreter runs (a loop around `tl.dot` stays a `range()`
loop: Triton pipelines only those). Compiled for a GPU there is no interpreter: the GPU check covers them, and did for
the experts kernels (the H200 runs under Triton 3.6.0 below). Measured at f40da3d with a throwaway venv (`python -m
venv /tmp/tri36`, `pip install --no-deps triton==3.6.0`, this venv's packages on its path, `TRITON_INTERPRET=1
PYTHONPATH=src /tmp/tri36/bin/python -m pytest tests/models/ops`: 171 passed, 31 failed, 8 skipped);
tests/models/ops/test_gpu_compile.py (every kernel compiled for sm_90 down to a cubin) passes under 3.6.0 as well.
"""

import inspect
import json
import os
from pathlib import Path

import pytest

triton = pytest.importorskip("triton")
import triton.language as tl  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
GPU_RUN = REPO / "benchmarks" / "results" / "gpu_moe-nvidia-h200-60178f3" / "gpu_moe.json"


def _interpreter_squeezes_indices() -> bool:
    """Whether this Triton's interpreter squeezes a scalar tensor before int() (3.9.0 does, 3.6.0 does not)."""
    from triton.runtime import interpreter

    source = inspect.getsource(interpreter)
    return "int(self.handle.data.squeeze())" in source or "int(self.handle.data))" not in source


@triton.jit
def _loop_to_where_bound(out_ptr, n, valid_flag):
    """The experts kernels' loop shape: a K loop whose bound is a `tl.where` of scalars."""
    acc = 0
    for _ in range(0, tl.where(valid_flag != 0, n, 0), 1):
        acc += 1
    tl.store(out_ptr, acc)


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="the interpreter's (scripts/test.sh sets it)")
def test_a_where_bounded_loop_runs_in_this_interpreter_or_fails_as_documented():
    import torch

    out = torch.zeros(1, dtype=torch.int32)
    if _interpreter_squeezes_indices():  # the dev pin: the experts kernels' interpreter tests run
        _loop_to_where_bound[(1,)](out, 5, 1)
        assert out.item() == 5
        _loop_to_where_bound[(1,)](out, 5, 0)
        assert out.item() == 0
    else:  # Triton 3.6.0: the documented limitation, nothing else
        from triton.runtime.errors import InterpreterError

        with pytest.raises(InterpreterError, match="only 0-dimensional arrays can be converted to Python scalars"):
            _loop_to_where_bound[(1,)](out, 5, 1)


def test_the_gpu_check_under_triton_3_6_covers_the_experts_kernels():
    """The kernels the 3.6.0 interpreter cannot run passed their checks compiled on a GPU under Triton 3.6.0."""
    data = json.loads(GPU_RUN.read_text())
    assert data["triton"] == "3.6.0" and data["device"] == "NVIDIA H200"
    experts = {c["check"]: c["ok"] for c in data["checks"] if c["check"].startswith("triton experts")}
    assert len(experts) == 10 and all(experts.values())  # output and four gradients, fp32 and bf16
    assert all(c["ok"] for c in data["checks"]) and len(data["checks"]) == 29
