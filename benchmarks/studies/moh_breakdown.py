"""Diagnostic: where the time of a skipped-heads decode step goes, at one context length.

Same layer and head draws as benchmarks/moh_attention.py (d=4096, 32 heads of 128, 16 shared + 8 of 16 routed heads
active, batch 1, one query token, fp32, 1 thread). Timed one call at a time, each on the next of 4 layers with their
own weights and KV caches (so the data comes from memory and the code paths stay warm, as in a model):

- the attention proper: sdpa over all heads in one call, over the active heads' runs (one call per run of consecutive
  heads), and over the same number of heads in one call (what the runs would cost without per-call set-up);
- `o_proj`: the full product, the runs' products on the head-major weight, and the same number of head rows in one
  product;
- the whole `skipped_heads_attention` call and MHA (sdpa + `o_proj`).

Usage: python benchmarks/studies/moh_breakdown.py [--context 512] [--rounds 30]
"""

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from mhmoe.models.moh.head_skipping import _head_major_weight
from mhmoe.models.ops.head_sparse_attention.head_sparse_attention_naive import runs as _runs

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: moh_attention.py
from moh_attention import draw_gates, settings, skipped_heads_attention  # noqa: E402


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--context", type=int, default=512)
    parser.add_argument("--rounds", type=int, default=30)
    args = parser.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    d, heads, head_dim, length = 4096, 32, 128, args.context
    shared, active = settings(heads)["75%"]
    num_active = shared + active
    layers = []
    for _ in range(4):
        o_proj = torch.nn.Linear(d, d, bias=False)
        layers.append(
            {
                "o_proj": o_proj,
                "weight_t": _head_major_weight(o_proj),
                "x": torch.randn(1, d),
                "key": torch.randn(1, heads, length, head_dim),
                "value": torch.randn(1, heads, length, head_dim),
                "query": torch.randn(1, heads, 1, head_dim),
            }
        )

    def sdpa(layer, start, end):
        q, k, v = (layer[name][:, start:end] for name in ("query", "key", "value"))
        return F.scaled_dot_product_attention(q, k, v)

    def o_proj_rows(layer, start, end, acc=None):
        rows = layer["x"][:, start * head_dim : end * head_dim]
        block = layer["weight_t"][start * head_dim : end * head_dim]
        return torch.mm(rows, block) if acc is None else torch.addmm(acc, rows, block)

    def o_proj_runs(layer, runs):
        acc = None
        for start, end in runs:
            acc = o_proj_rows(layer, start, end, acc)

    def skip(layer, gates):
        q, k, v = layer["query"], layer["key"], layer["value"]
        return skipped_heads_attention(q, k, v, None, gates, layer["o_proj"], head_dim**-0.5)

    cases = {
        "sdpa, all 32 heads, 1 call": lambda layer, runs, gates: sdpa(layer, 0, heads),
        "sdpa, active heads, 1 call per run": lambda layer, runs, gates: [sdpa(layer, s, e) for s, e in runs],
        "sdpa, as many heads, 1 call": lambda layer, runs, gates: sdpa(layer, 0, num_active),
        "o_proj, all heads (F.linear)": lambda layer, runs, gates: layer["o_proj"](layer["x"]),
        "o_proj, active heads, 1 GEMV per run": lambda layer, runs, gates: o_proj_runs(layer, runs),
        "o_proj, as many heads, 1 GEMV": lambda layer, runs, gates: o_proj_rows(layer, 0, num_active),
        "MHA core (sdpa + o_proj)": lambda layer, runs, gates: layer["o_proj"](
            sdpa(layer, 0, heads).transpose(1, 2).reshape(1, -1)
        ),
        "skipped_heads_attention": lambda layer, runs, gates: skip(layer, gates),
    }
    times = {name: [] for name in cases}
    run_counts = []
    with torch.no_grad():
        for _ in range(args.rounds):
            gates = draw_gates(heads, shared, active)
            runs = _runs(gates[0, 0].nonzero().flatten().tolist())
            run_counts.append(len(runs))
            for index, (name, fn) in enumerate(cases.items()):
                layer = layers[index % len(layers)]  # used 4 calls ago: its data is out of the caches
                start = time.perf_counter()
                fn(layer, runs, gates)
                times[name].append(time.perf_counter() - start)
    median = {name: statistics.median(t) * 1e3 for name, t in times.items()}
    print(
        f"torch {torch.__version__}, 1 thread, fp32, context {length}, {num_active} of {heads} heads active in "
        f"{statistics.mean(run_counts):.1f} runs on average; median ms of {args.rounds} calls, 4 layers in turn"
    )
    for name, ms in median.items():
        print(f"  {name:40s} {ms:6.3f}")
    print(
        f"attention: runs/all {median['sdpa, active heads, 1 call per run'] / median['sdpa, all 32 heads, 1 call']:.2f}, "
        f"one call/all {median['sdpa, as many heads, 1 call'] / median['sdpa, all 32 heads, 1 call']:.2f}; "
        f"o_proj: runs/all {median['o_proj, active heads, 1 GEMV per run'] / median['o_proj, all heads (F.linear)']:.2f}, "
        f"one GEMV/all {median['o_proj, as many heads, 1 GEMV'] / median['o_proj, all heads (F.linear)']:.2f}; "
        f"core: skip/MHA {median['skipped_heads_attention'] / median['MHA core (sdpa + o_proj)']:.2f}"
    )


if __name__ == "__main__":
    main()
