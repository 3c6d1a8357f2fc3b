"""What MoH's head-sparse attention (the Triton path) asks of the host, counted on CPU: PyTorch operators that launch
work, Triton launches and host syncs of one forward and one backward call (`moe_dispatch.py`'s counters, the kernels
run by TRITON_INTERPRET=1). At 4K tokens the GPU path is bound by its launches (benchmarks/README.md, the 2026-11-27b
window), so this count is what a change to the host path moves before any GPU times it. The gates are straight-through
0/1 ones that carry a gradient, as in training (the CPU-only 0/1 check of `apply_gates` then does not run).

    TRITON_INTERPRET=1 PYTHONPATH=src python benchmarks/studies/head_sparse_ops.py
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/
import moe_dispatch  # noqa: E402

from mhmoe.models.ops.head_sparse_attention.head_sparse_attention_triton import head_sparse_attention_triton  # noqa: E402


def counts(batch=1, tokens=64, heads=9, kv_heads=3, head_dim=64, active=7 / 9, seed=0) -> dict:
    """{"forward" | "backward": {"device_ops", "triton_launches", "host_syncs", "ops"}} of one call (SmolLM2's heads by
    default: 9 query heads of 64, 3 key/value heads)."""
    generator = torch.Generator().manual_seed(seed)
    query = torch.randn(batch, heads, tokens, head_dim, generator=generator, requires_grad=True)
    key, value = (torch.randn(batch, kv_heads, tokens, head_dim, generator=generator, requires_grad=True) for _ in "kv")
    gates = (torch.rand(batch, tokens, heads, generator=generator) < active).float().requires_grad_()
    result = {}

    def forward():
        result["out"] = head_sparse_attention_triton(query, key, value, gates, head_dim**-0.5)

    def backward():
        result["out"].sum().backward()

    for name, fn in (("forward", forward), ("backward", backward)):
        counter, launches = moe_dispatch._count(fn)
        result[name] = {
            "device_ops": sum(counter.ops.values()),
            "triton_launches": sum(launches.count.values()),
            "host_syncs": sum(counter.syncs.values()),
            "ops": dict(counter.ops.most_common()),
            "launches": dict(launches.count),
        }
    del result["out"]
    return result


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=64, help="tokens run here (the counts do not depend on it)")
    args = parser.parse_args(argv)
    import _provenance

    git = _provenance.git_state()
    print(f"commit {git['commit']}{' (dirty)' if git['dirty'] else ''}, torch {torch.__version__}")
    for name, cell in counts(tokens=args.tokens).items():
        print(
            f"{name:9s} ops {cell['device_ops']:3d}  triton {cell['triton_launches']}  syncs {cell['host_syncs']}  "
            f"{cell['ops']}  {cell['launches']}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
