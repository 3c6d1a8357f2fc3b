"""Diagnostic: where a fwd+bwd step of the h=3 MH-MoE block and of Mixtral's SMoE block spends its CPU time.

`torch.profiler` over a few steps of the configs of benchmarks/moe_layer.py (T=2048 by default, fp32, 2 threads):
the GEMMs grouped by kind (each expert's GEMM has its own row count, shown as `n`), with their achieved GFLOP/s, and
the largest non-GEMM operators. Profiler overhead makes the totals larger than moe_layer.py's timings; compare the
two blocks with each other, not with those.

Usage: python benchmarks/studies/moe_profile.py [--tokens 2048] [--steps 5]
"""

import argparse
import collections
import sys
from pathlib import Path

import torch
from torch.profiler import profile

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: moe_layer.py
from moe_layer import D, build_candidates  # noqa: E402

FIXED = {8, 96, 256, 512, 768, 1024, 2048, 4096}  # widths and expert counts of the two configs; other sizes: row counts


def _dims(shape) -> str:
    return ",".join(str(n) if n in FIXED else "n" for n in shape)


def profile_block(module, x, grad, steps):
    def step():
        module.zero_grad(set_to_none=True)
        module(x.detach().requires_grad_()).backward(grad)

    for _ in range(2):
        step()
    with profile(record_shapes=True) as prof:
        for _ in range(steps):
            step()
    gemm_time, gemm_flops, other = collections.Counter(), collections.Counter(), collections.Counter()
    for event in prof.events():
        if event.name == "aten::mm":
            a, b = event.input_shapes[0], event.input_shapes[1]
            kind = f"[{_dims(a)}] @ [{_dims(b)}]"
            gemm_time[kind] += event.self_cpu_time_total
            gemm_flops[kind] += 2 * a[0] * a[1] * b[1]
        elif event.name.startswith("aten::") and event.self_cpu_time_total > 0:
            other[event.name] += event.self_cpu_time_total
    return gemm_time, gemm_flops, other


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--steps", type=int, default=5)
    args = parser.parse_args()
    torch.set_num_threads(2)
    candidates = build_candidates()
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(1, args.tokens, D, generator=generator)
    grad = torch.randn(1, args.tokens, D, generator=generator)
    print(f"torch {torch.__version__}, threads={torch.get_num_threads()}, fp32, T={args.tokens}, {args.steps} steps")
    for name in ("hf_smoe_grouped", "ours_h3"):
        gemm_time, gemm_flops, other = profile_block(candidates[name], x, grad, args.steps)
        per_step = {kind: t / args.steps / 1e3 for kind, t in gemm_time.items()}  # ms
        other_ms = sum(other.values()) / args.steps / 1e3
        print(f"{name}: GEMMs {sum(per_step.values()):.0f} ms/step, other operators {other_ms:.0f} ms/step")
        for kind, ms in sorted(per_step.items(), key=lambda item: -item[1]):
            if ms >= 1:
                rate = gemm_flops[kind] / (gemm_time[kind] / 1e6) / 1e9
                print(f"  {kind:28s} {ms:6.1f} ms  {rate:6.1f} GFLOP/s")
        top = ", ".join(f"{op[6:]} {t / args.steps / 1e3:.1f}" for op, t in other.most_common(6))
        print(f"  largest other operators (ms/step): {top}")


if __name__ == "__main__":
    main()
