"""The MoH "l2" head router: per-token gates from the routed heads' query norms (see head_router_naive.py)."""
