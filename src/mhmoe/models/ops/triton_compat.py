"""The kernels' shared Triton import guard. Exported checkpoints carry this file: without triton installed
`HAS_TRITON` is False and the `@jit` functions stay plain Python, never launched (the PyTorch references run)."""

import os
import types

try:
    import triton
    import triton.language as tl
except ImportError:  # torch-only install
    triton = None
    tl = types.SimpleNamespace(constexpr=int)

HAS_TRITON = triton is not None


def jit(fn):
    return triton.jit(fn) if HAS_TRITON else fn


def interpreting() -> bool:
    """Kernels take CPU tensors only under the Triton interpreter (TRITON_INTERPRET=1, set before they import)."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"
