"""The model layer: runs on torch and Transformers alone (exported checkpoints ship its files, flattened by name).

- `ops/`: the ops, each a naive reference beside its kernels, and `ops/backends.py`, the one place that picks which
  runs (and records the kernels that failed);
- `moh/`: Mixture-of-Head attention (attention, head routers, balance loss), shared by every model family;
- `mhmoe/`: the MHMoE family (config, modeling, the MoE blocks and their variants, parity arithmetic);
- `moh_llama/`: the MoH-LLaMA family (Llama's classes with MoH attention) and `apply_moh`;
- `causal_lm.py` (the causal-LM forward and router losses of every family), `cache_naming.py`, `config_checks.py`.

docs/architecture.md draws the layers and how to add a router, an experts kind or a kernel.
"""
