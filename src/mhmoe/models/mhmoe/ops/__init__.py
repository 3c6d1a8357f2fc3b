"""Ops with a plain-PyTorch reference (`<op>_naive.py`) beside their kernels (`<op>_triton.py`), one folder per op.

The model calls each op through its dispatch point (`routing.py` for routing). Import names from the module files
(`from .ops.routing.routing_naive import route`), never through these `__init__.py` files: exported checkpoints
flatten the module files into one folder by file name.
"""
