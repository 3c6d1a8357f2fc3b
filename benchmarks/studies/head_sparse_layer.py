"""Head-sparse attention (ops/head_sparse_attention, the CPU path) vs dense SDPA over all heads, side by side, on CPU.

One attention layer of SmolLM2-135M (9 query heads of 64, 3 key/value heads: GQA groups of 3), fp32, 2 threads:

- `dense`  : what the parent model runs, Transformers' sdpa path: `scaled_dot_product_attention` over every head
             (`is_causal`, `enable_gqa` in prefill; the query heads packed per key/value head in decoding).
- `sparse` : `head_sparse_attention_cpu`: attention only for the active (token, head) pairs, times their gates.

Active heads per token: the 3 shared heads (one whole key/value group, as the converter's "important shared" recipe
and the paper's "first shared" both give here) + K of the 6 routed heads, drawn uniformly per token (7/9: K = 4,
5/9: K = 2). Prefill: causal attention over T tokens, forward (inference) and forward + backward (training; the
gradients of query, key and value). Decoding: one query token over a cache of L tokens.

Every round runs each candidate once, in a rotated order, on the same inputs; a cell is the median over rounds of the
per-round time ratio sparse / dense (< 1: faster) and, beside it, the ideal ratio: the share of the dense work that
the active pairs are, from the shapes and the drawn gates. `flops` counts the score and value products over the keys
each pair sees (causal); `bytes` the tensors read and written once: the active pairs' query and output rows and the
K/V of every key/value head some active pair needs (with GQA a key/value head is needed while any of its query heads
is). Prefill is compute-bound (its ideal is the flops share), decoding memory-bound (the bytes share). Before timing,
each cell checks sparse == dense × gates (and the gradients in training).

    python benchmarks/studies/head_sparse_layer.py [--tokens 512 2048 4096] [--batch 1 4] [--rounds 7] [--quick]
"""

import argparse
import statistics
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from mhmoe.models.ops.head_sparse_attention.head_sparse_attention_cpu import head_sparse_attention_cpu

HEADS, KV_HEADS, HEAD_DIM, SHARED = 9, 3, 64, 3  # SmolLM2-135M: hidden 576, 30 layers
SETTINGS = {"7/9": 4, "5/9": 2}  # routed heads active of 6


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, nargs="+", default=[512, 2048, 4096], help="prefill lengths")
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 4])
    parser.add_argument("--contexts", type=int, nargs="+", default=[512, 4096], help="decoding: cache lengths")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--no-backward", action="store_true", help="skip forward + backward")
    parser.add_argument("--quick", action="store_true", help="T=128 and a 256-token cache, batch 1, 2 rounds (CI)")
    return parser.parse_args()


def draw_gates(batch: int, tokens: int, active_routed: int, generator) -> torch.Tensor:
    """(B, T, H) 0/1 gates: the shared heads and `active_routed` of the routed ones, uniformly per token."""
    gates = torch.zeros(batch, tokens, HEADS)
    gates[..., :SHARED] = 1
    pick = torch.rand(batch, tokens, HEADS - SHARED, generator=generator).argsort(-1)[..., :active_routed]
    return gates.scatter(-1, pick + SHARED, 1.0)


def ideal(gates: torch.Tensor, num_keys: int) -> tuple[float, float]:
    """(flops share, bytes share) of the active pairs' work in the dense work (see the module docstring)."""
    batch, tokens, heads = gates.shape
    active = gates != 0
    keys_seen = torch.arange(num_keys - tokens, num_keys) + 1.0  # causal: keys each query token sees
    flops = float((active.float() * keys_seen[None, :, None]).sum() / (keys_seen.sum() * batch * heads))
    groups = heads // KV_HEADS
    needed = active.view(batch, tokens, KV_HEADS, groups).any(-1).any(1)  # (B, Hkv): K/V read for this row
    row_bytes = 2 * active.sum().item()  # query + output rows of the active pairs
    kv_bytes = 2 * num_keys * needed.sum().item()  # K and V of the needed key/value heads
    dense_bytes = 2 * batch * tokens * heads + 2 * num_keys * batch * KV_HEADS
    return flops, (row_bytes + kv_bytes) / dense_bytes


def dense_prefill(query, key, value):
    return F.scaled_dot_product_attention(query, key, value, is_causal=True, enable_gqa=True).transpose(1, 2)


def dense_decode(query, key, value):
    """Transformers' sdpa decoding path for GQA (`pack_gqa`): the G query heads as rows of their key/value head."""
    batch = query.shape[0]
    packed = query.reshape(batch, KV_HEADS, HEADS // KV_HEADS, HEAD_DIM)
    out = F.scaled_dot_product_attention(packed, key, value)
    return out.reshape(batch, HEADS, 1, HEAD_DIM).transpose(1, 2)


def time_cell(candidates: dict, rounds: int) -> dict[str, float]:
    """Interleaved rounds (rotated order, one warm-up round); median per-round ratio to `dense`."""
    names = list(candidates)
    times = {name: [] for name in names}
    for round_index in range(rounds + 1):
        order = names[round_index % len(names) :] + names[: round_index % len(names)]
        for name in order:
            start = time.perf_counter()
            candidates[name]()
            times[name].append(time.perf_counter() - start)
    ratios = [s / d for s, d in zip(times["sparse"][1:], times["dense"][1:])]
    return {
        "dense_ms": statistics.median(times["dense"][1:]) * 1e3,
        "sparse_ms": statistics.median(times["sparse"][1:]) * 1e3,
        "ratio": statistics.median(ratios),
    }


def prefill_cell(batch, tokens, setting, backward, rounds, generator):
    query = torch.randn(batch, tokens, HEADS, HEAD_DIM, generator=generator).transpose(1, 2)  # as after RoPE
    key = torch.randn(batch, KV_HEADS, tokens, HEAD_DIM, generator=generator)
    value = torch.randn(batch, KV_HEADS, tokens, HEAD_DIM, generator=generator)
    gates = draw_gates(batch, tokens, SETTINGS[setting], generator)
    scaling = HEAD_DIM**-0.5
    grad = torch.randn(batch, tokens, HEADS, HEAD_DIM, generator=generator)

    def run(fn, check=False):
        if not backward:
            with torch.no_grad():
                return fn(query, key, value)
        leaves = [x.detach().requires_grad_() for x in (query, key, value)]
        out = fn(*leaves)
        out.backward(grad)
        return [out.detach()] + [leaf.grad for leaf in leaves]

    def dense(q, k, v):
        return dense_prefill(q, k, v)

    def sparse(q, k, v):
        return head_sparse_attention_cpu(q, k, v, gates, scaling)

    want = run(lambda q, k, v: dense(q, k, v) * gates[..., None])
    got = run(sparse)
    for have, expected in zip(got if backward else [got], want if backward else [want]):
        torch.testing.assert_close(have, expected, rtol=1e-4, atol=1e-4)
    cell = time_cell({"dense": lambda: run(dense), "sparse": lambda: run(sparse)}, rounds)
    return cell, ideal(gates, tokens)


def decode_cell(batch, context, setting, rounds, generator):
    query = torch.randn(batch, 1, HEADS, HEAD_DIM, generator=generator).transpose(1, 2)
    key = torch.randn(batch, KV_HEADS, context, HEAD_DIM, generator=generator)
    value = torch.randn(batch, KV_HEADS, context, HEAD_DIM, generator=generator)
    steps = [draw_gates(batch, 1, SETTINGS[setting], generator) for _ in range(64)]  # a new draw per step
    scaling = HEAD_DIM**-0.5
    state = {"step": 0}

    def sparse():
        gates = steps[state["step"] % len(steps)]
        state["step"] += 1
        return head_sparse_attention_cpu(query, key, value, gates, scaling)

    with torch.no_grad():
        for gates in steps[:4]:
            got = head_sparse_attention_cpu(query, key, value, gates, scaling)
            torch.testing.assert_close(got, dense_decode(query, key, value) * gates[..., None], rtol=1e-4, atol=1e-4)
        # 16 decode steps per timed call: single steps are ~0.1 ms
        cell = time_cell(
            {
                "dense": lambda: [dense_decode(query, key, value) for _ in range(16)],
                "sparse": lambda: [sparse() for _ in range(16)],
            },
            rounds,
        )
    shares = [ideal(gates, context) for gates in steps]
    return cell, tuple(statistics.mean(share[i] for share in shares) for i in range(2))


def load_average() -> str:
    """The 1/5/15-minute load averages (the machine is shared: a busy one makes every timing meaningless)."""
    return "/".join(Path("/proc/loadavg").read_text().split()[:3]) if Path("/proc/loadavg").exists() else "?"


def main():
    args = parse_args()
    if args.quick:
        args.tokens, args.batch, args.contexts, args.rounds = [128], [1], [256], 2
    torch.set_num_threads(args.threads)
    generator = torch.Generator().manual_seed(0)
    print(
        f"torch {torch.__version__}, {args.threads} threads, fp32; {HEADS} heads of {HEAD_DIM}, {KV_HEADS} key/value "
        f"heads, {SHARED} shared; median of {args.rounds} interleaved rounds; load average {load_average()}"
    )
    print("| pass | batch | tokens | active | dense ms | sparse ms | sparse / dense | ideal (flops) | ideal (bytes) |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    start = time.perf_counter()
    passes = ["forward"] + ([] if args.no_backward else ["forward+backward"])
    for mode in passes:
        for batch in args.batch:
            for tokens in args.tokens:
                for setting in SETTINGS:
                    cell, (flops, nbytes) = prefill_cell(
                        batch, tokens, setting, mode != "forward", args.rounds, generator
                    )
                    print(
                        f"| prefill {mode} | {batch} | {tokens} | {setting} | {cell['dense_ms']:.1f} | "
                        f"{cell['sparse_ms']:.1f} | **{cell['ratio']:.2f}** | {flops:.2f} | {nbytes:.2f} |",
                        flush=True,
                    )
    for batch in args.batch[:1]:
        for context in args.contexts:
            for setting in SETTINGS:
                cell, (flops, nbytes) = decode_cell(batch, context, setting, args.rounds, generator)
                print(
                    f"| decode (16 steps) | {batch} | 1 over {context} | {setting} | {cell['dense_ms']:.2f} | "
                    f"{cell['sparse_ms']:.2f} | **{cell['ratio']:.2f}** | {flops:.2f} | {nbytes:.2f} |",
                    flush=True,
                )
    print(f"total {time.perf_counter() - start:.0f} s; load average at the end {load_average()} (2 cores)")


if __name__ == "__main__":
    main()
