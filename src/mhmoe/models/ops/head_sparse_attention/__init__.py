"""Head-sparse attention for MoH: attention computed only for the active (token, head) pairs (see
head_sparse_attention_naive.py, the reference; head_sparse_attention_cpu.py; head_sparse_attention_triton.py, the CUDA
path's plan, launches and autograd op, with its kernels in head_sparse_attention_triton_forward.py and _backward.py and
the pieces they share in _common.py)."""
