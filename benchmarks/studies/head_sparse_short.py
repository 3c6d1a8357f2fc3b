"""Short prefills in the CPU head-sparse op (`ops/head_sparse_attention/head_sparse_attention_cpu.py`): where its
masked rows pay, measured side by side on CPU (fp32) at SmolLM2-135M's attention shapes (9 heads of 64 on 3 key/value
heads, the first 3 heads shared), with gates drawn like a top-K router's (the shared heads always, K of the 6 routed
heads per token, uniformly).

1. By length: the op's time over the parent's (SDPA over every head, causal) for its short path (a sparse key/value
   head as masked rows, one call per batch row: the CPU policy's `short_tokens`) and its chunked path, at K = 2 (5/9 of the heads)
   and K = 4 (7/9). They set `short_tokens` (short below, chunked from there) and the models' dispatch where at most
   40% of the routed heads are active (the policy's `few_active_tokens`: the short path from 384 tokens, the chunked
   path from 1,024).
2. By density: one key/value head whose 3 heads are active at density d (the others inactive), batch 1: that head
   as masked rows against the same head as causal attention over its 3 heads (`SHORT_DENSE_SHARE`).

Each round runs every candidate once, in a rotated order (`gpu_moe.interleaved`, after two warm-up rounds); a
ratio is the median over rounds of the per-round time ratio.

    python benchmarks/studies/head_sparse_short.py [--rounds 9] [--threads 2]
"""

import argparse
import dataclasses
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

from mhmoe.models.ops.head_sparse_attention import head_sparse_attention_cpu as cpu_path
from mhmoe.models.ops.head_sparse_attention.head_sparse_attention_cpu_policy import DEFAULT_CPU_POLICY

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/
import gpu_moe  # noqa: E402  (the interleaved timing loop, shared with the other benchmarks)
from head_sparse_layer import HEAD_DIM, HEADS, KV_HEADS, draw_gates  # noqa: E402  (SmolLM2's shapes, top-K gates)

LENGTHS = (256, 384, 512, 768, 1024, 1536, 2048)
DENSITIES = (0.2, 0.3, 0.4, 0.5, 0.6, 0.7)


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--threads", type=int, default=2)
    return parser.parse_args()


def inputs(batch: int, tokens: int, generator: torch.Generator):
    """Query (B, H, T, hd) as the model has it (a transposed (B, T, H, hd) tensor), key and value (B, Hkv, T, hd)."""
    query = torch.randn(batch, tokens, HEADS, HEAD_DIM, generator=generator).transpose(1, 2)
    key = torch.randn(batch, KV_HEADS, tokens, HEAD_DIM, generator=generator)
    value = torch.randn(batch, KV_HEADS, tokens, HEAD_DIM, generator=generator)
    return query, key, value


def density_gates(tokens: int, density: float, generator: torch.Generator) -> torch.Tensor:
    """(1, T, H) 0/1: key/value head 1's heads each active with probability `density`, the others' never (so that
    the op's time is that head's)."""
    gates = torch.zeros(1, tokens, HEADS)
    gates[..., 3:6] = (torch.rand(1, tokens, 3, generator=generator) < density).float()
    return gates


def op(query, key, value, gates, short_tokens: int, dense_share: float = DEFAULT_CPU_POLICY.short_dense_share):
    policy = dataclasses.replace(DEFAULT_CPU_POLICY, short_tokens=short_tokens, short_dense_share=dense_share)
    return cpu_path.head_sparse_attention_cpu(query, key, value, gates, HEAD_DIM**-0.5, policy=policy)


def main() -> None:
    args = parse_args()
    torch.set_num_threads(args.threads)
    generator = torch.Generator().manual_seed(0)
    cpu = torch.device("cpu")
    print(f"torch {torch.__version__}, {args.threads} threads, fp32; median of {args.rounds} rotated rounds")
    print(f"\n1. time / the parent's (SDPA over all {HEADS} heads); K of the 6 routed heads active per token")
    print("| tokens | batch | K | parent ms | short path | chunked path |")
    print("| --- | --- | --- | --- | --- | --- |")
    with torch.no_grad():
        for tokens in LENGTHS:
            for batch in (1, 4):
                query, key, value = inputs(batch, tokens, generator)
                for active in (2, 4):
                    gates = draw_gates(batch, tokens, active, generator)
                    cells = gpu_moe.interleaved(
                        {
                            "parent": lambda: F.scaled_dot_product_attention(
                                query, key, value, is_causal=True, enable_gqa=True
                            ),
                            "short": lambda: op(query, key, value, gates, 10**9),
                            "chunked": lambda: op(query, key, value, gates, 0),
                        },
                        args.rounds,
                        cpu,
                        reference="parent",
                    )
                    print(
                        f"| {tokens} | {batch} | {active} | {cells['parent']['ms']:.2f} | "
                        f"{cells['short']['ratio']:.3f} | {cells['chunked']['ratio']:.3f} |"
                    )
        print("\n2. batch 1, one key/value head at density d: as masked rows, time / as causal attention")
        print("| tokens | " + " | ".join(f"d = {density}" for density in DENSITIES) + " |")
        print("| --- |" + " --- |" * len(DENSITIES))
        for tokens in (384, 512, 768):
            query, key, value = inputs(1, tokens, generator)
            ratios = []
            for density in DENSITIES:
                gates = density_gates(tokens, density, generator)
                measured = float(gates[..., 3:6].mean())
                cells = gpu_moe.interleaved(
                    {
                        "causal": lambda: op(query, key, value, gates, 10**9, measured - 1e-6),
                        "masked rows": lambda: op(query, key, value, gates, 10**9, measured + 1e-6),
                    },
                    3 * args.rounds,
                    cpu,
                    reference="causal",
                )
                ratios.append(cells["masked rows"]["ratio"])
            print(f"| {tokens} | " + " | ".join(f"{ratio:.3f}" for ratio in ratios) + " |")


if __name__ == "__main__":
    main()
