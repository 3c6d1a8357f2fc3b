"""Mixture-of-Head attention (MoH), one package for every model that routes its attention heads: MHMoE's attention,
MoH-LLaMA and the Llama-family models `apply_moh` patches.

- `moh_attention.py`: the attention forward with per-head gates, `add_head_router`, `MoHAttentionMixin`;
- `head_routers.py`: the routers, one class per `moh_router` name (`HEAD_ROUTERS`), and straight-through gates;
- `moh_config.py`: the moh_* fields and their checks; `moh_losses.py`: the balance loss (eq. 7);
- `head_skipping.py`: when attention is computed for the active heads only (the op: `ops/head_sparse_attention/`);
  `moh_parallel.py`: the router under tensor parallelism;
- `fused_decoding.py`: the decoding step on the CPU (one GEMV for queries, keys, values and the router's scores).

Import from the module files (`from ..moh.head_routers import MoHRouter`): exported checkpoints flatten them.
"""
