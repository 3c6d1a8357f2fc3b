"""Two properties of torch's CPU flash-attention kernel that the CPU head-sparse op
(`ops/head_sparse_attention/head_sparse_attention_cpu.py`) is built around, measured side by side on CPU (fp32):

1. Query blocks: calls with fewer than 768 query rows run 32- or 64-row query blocks, from 768 rows 256-row blocks.
   Time per query-key pair of an unmasked call (one batch row, 2 key/value heads, 3,072 keys, head_dim 64) for
   several row counts, as a ratio to 768 rows (`LARGE_QUERY_ROWS`, the op's prefix calls span chunks to reach it).
2. Thread balance: the kernel gives each thread a contiguous share of its (batch row, head, query block) items, and
   a causal item costs in proportion to its position. One key/value head with 3 query heads (SmolLM2-135M's shared
   group at batch 1) as one causal call, against `_causal_flash` (two equal halves and a merge), and against 2 of
   those query heads alone (an even split) scaled by 3/2.
3. Diagonal blocks: the op's chunks of C tokens attend to their own keys in C × C causal blocks (every head of a
   sparse key/value head), on the kernel's small query blocks. Useful GFLOP/s (4·hd per visible query-key pair) of
   those calls at batch 4 and 4,096 tokens for C = 64, 128, 256, against one causal call over the whole sequence (the
   parent's) and one unmasked call with 768 query rows.

Each round runs every candidate once, in a rotated order (`gpu_moe.interleaved`, after two warm-up rounds); a
ratio is the median over rounds of the per-round time ratio.

    python benchmarks/studies/cpu_flash_blocks.py [--tokens 4096] [--rounds 9] [--threads 2]
"""

import argparse
import sys
from pathlib import Path

import torch

from mhmoe.models.ops.head_sparse_attention.head_sparse_attention_cpu import _causal_flash

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/
import gpu_moe  # noqa: E402  (the interleaved timing loop, shared with the other benchmarks)

FLASH = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
ROWS = (256, 533, 767, 768, 1066, 1536)  # 533 and 1066: one and two 256-token chunks of 3 heads at 7/9 active


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=4096, help="causal calls: sequence length")
    parser.add_argument("--keys", type=int, default=3072, help="unmasked calls: keys")
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--threads", type=int, default=2)
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    torch.set_num_threads(args.threads)
    generator = torch.Generator().manual_seed(0)
    key = torch.randn(1, 2, args.keys, 64, generator=generator)
    queries = {rows: torch.randn(1, 2, rows, 64, generator=generator) for rows in ROWS}
    cpu = torch.device("cpu")
    cells = gpu_moe.interleaved(
        {rows: (lambda q=q: FLASH(q, key, key)) for rows, q in queries.items()}, args.rounds, cpu, reference=768
    )
    print(f"torch {torch.__version__}, {args.threads} threads, fp32; median of {args.rounds} rotated rounds")
    print(f"unmasked calls, {args.keys} keys: time per query-key pair / that of 768 query rows")
    print("| query rows | " + " | ".join(str(rows) for rows in ROWS) + " |")
    print("| --- |" + " --- |" * len(ROWS))
    print("| ratio | " + " | ".join(f"{cells[rows]['ratio'] * 768 / rows:.3f}" for rows in ROWS) + " |")

    tokens = args.tokens
    query = torch.randn(1, tokens, 9, 64, generator=generator).transpose(1, 2)[:, :3]  # (1, 3, T, 64), strided
    key = torch.randn(1, tokens, 3, 64, generator=generator).transpose(1, 2)[:, :1]
    cells = gpu_moe.interleaved(
        {
            "one causal call": lambda: FLASH(query, key, key, is_causal=True),
            "_causal_flash (halves)": lambda: _causal_flash(query, key, key, 0.125),
            "2 of the 3 query heads": lambda: FLASH(query[:, :2], key, key, is_causal=True),
        },
        args.rounds,
        cpu,
        reference="one causal call",
    )
    cells["2 of the 3 query heads × 3/2"] = {
        name: 1.5 * value for name, value in cells.pop("2 of the 3 query heads").items()
    }
    print(f"\ncausal attention, 1 key/value head with 3 query heads, {tokens} tokens: time / one causal call's")
    print("| call | ms | ratio |")
    print("| --- | --- | --- |")
    for name, cell in cells.items():
        print(f"| {name} | {cell['ms']:.1f} | {cell['ratio']:.3f} |")

    batch, head_dim = 4, 64
    query = torch.randn(batch, 3, tokens, head_dim, generator=generator)
    key = torch.randn(batch, 1, tokens, head_dim, generator=generator)
    pairs = {"whole sequence, causal": batch * 3 * tokens * (tokens + 1) / 2}
    calls = {"whole sequence, causal": lambda: FLASH(query, key, key, is_causal=True)}
    for chunk in (256, 128, 64):
        blocks = tokens // chunk

        def diagonal(chunk=chunk, blocks=blocks):  # (B·nc, 3, C, hd) against (B·nc, 1, C, hd), causal
            q = query.view(batch, 3, blocks, chunk, head_dim).transpose(1, 2).flatten(0, 1)
            k = key.view(batch, 1, blocks, chunk, head_dim).transpose(1, 2).flatten(0, 1)
            return FLASH(q, k, k, is_causal=True)

        calls[f"diagonal blocks, C = {chunk}"] = diagonal
        pairs[f"diagonal blocks, C = {chunk}"] = batch * 3 * blocks * chunk * (chunk + 1) / 2
    rows = query[:, :, :768]
    calls["768 query rows, unmasked"] = lambda: FLASH(rows, key, key)
    pairs["768 query rows, unmasked"] = batch * 3 * 768 * tokens
    cells = gpu_moe.interleaved(calls, args.rounds, cpu)
    print(f"\ncausal blocks, batch {batch}, 1 key/value head with 3 query heads, {tokens} tokens: useful GFLOP/s")
    print("| call | ms | GFLOP/s |")
    print("| --- | --- | --- |")
    for name, cell in cells.items():
        print(f"| {name} | {cell['ms']:.2f} | {4 * head_dim * pairs[name] / cell['ms'] / 1e6:.0f} |")


if __name__ == "__main__":
    main()
