"""Fine-grained SwiGLU experts on routed rows (see experts_naive.py and experts_triton.py)."""
