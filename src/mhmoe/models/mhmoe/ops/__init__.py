"""Ops with a plain-PyTorch reference (`<op>_naive.py`) beside their kernels (`<op>_triton.py`), one folder per op.

The model calls each op through its dispatch point (`routing.py` for routing). Import names from the module files
(`from .ops.routing.routing_naive import route`), never through these `__init__.py` files: exported checkpoints
flatten the module files into one folder by file name.

Kernel failures the dispatch points caught (the reference ran instead) are in `kernel_fallbacks.fallbacks()`, also
re-exported here for the benchmarks and the reproduction harness: `from mhmoe.models.mhmoe.ops import fallbacks`.
"""

from .kernel_fallbacks import fallbacks, reset_fallbacks  # noqa: F401  (for callers outside the model layer)
