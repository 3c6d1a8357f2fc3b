"""Routing: softmax, top-k, renormalisation, Switch capacity and the expert-sorted permutation (routing_naive.py, the reference; routing_triton.py)."""
