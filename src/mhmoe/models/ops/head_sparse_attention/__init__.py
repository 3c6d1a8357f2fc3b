"""Head-sparse attention for MoH: attention computed only for the active (token, head) pairs (see
head_sparse_attention_naive.py, head_sparse_attention_cpu.py and head_sparse_attention_triton.py)."""
