"""Routing: softmax, top-k, renormalisation, Switch capacity and the expert-sorted permutation (see routing.py)."""
