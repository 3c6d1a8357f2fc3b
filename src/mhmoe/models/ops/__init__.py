"""Ops: per op a folder with its plain-PyTorch reference (`<op>_naive.py`) beside its kernels (`<op>_triton.py`; the
experts also `experts_grouped_mm.py` on torch's grouped GEMM, `grouped_gemm.py`), and `backends.py`, the one place
that chooses which runs and records the kernels that failed (`backends.fallbacks()`).

The models call the functions of `backends.py`, never a kernel file. Import names from the module files
(`from ..ops.backends import route`), never through these `__init__.py` files: exported checkpoints flatten the module
files into one folder by file name.
"""
