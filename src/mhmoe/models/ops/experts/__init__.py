"""Fine-grained SwiGLU experts on routed rows: experts_naive.py (the reference), experts_grouped_mm.py, experts_triton.py."""
