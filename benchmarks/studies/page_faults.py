"""Diagnostic: how much of the fine-grained MoE layer's CPU time is page faults on freshly allocated tensors.

1. Minor page faults (and user/system CPU time) per fwd+bwd step of Mixtral's SMoE block and of our h=3 MH-MoE block
   (the configs of benchmarks/moe_layer.py, T=2048, fp32, 2 threads).
2. The h=3 gate/up grouped GEMM (S=18432 rows of width 256, 96 experts, out 1024) and Mixtral's (2048 rows of width 768,
   8 experts, out 4096): `torch._grouped_mm` (allocates its output) against the same products written by one
   `torch.mm(out=...)` per expert into a buffer that was already touched (no page faults; what the layer does with its
   buffer pool, `BufferPool` in src/mhmoe/models/ops/experts/experts_grouped_mm.py).

Usage: python benchmarks/studies/page_faults.py
"""

import resource
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: moe_layer.py
from moe_layer import build_candidates  # noqa: E402


def faults_per_step(module, x, grad, steps=3):
    def step():
        module.zero_grad(set_to_none=True)
        module(x.detach().requires_grad_()).backward(grad)

    step()
    step()
    before = resource.getrusage(resource.RUSAGE_SELF)
    for _ in range(steps):
        step()
    after = resource.getrusage(resource.RUSAGE_SELF)
    mib = (after.ru_minflt - before.ru_minflt) / steps * resource.getpagesize() / 2**20
    user = (after.ru_utime - before.ru_utime) / steps * 1e3
    system = (after.ru_stime - before.ru_stime) / steps * 1e3
    return mib, user, system


def gemm_case(rows, width, experts, out_features, repeats=7):
    per = rows // experts
    offsets = torch.arange(per, rows + 1, per, dtype=torch.int32)
    x = torch.randn(rows, width)
    weight_t = torch.randn(experts, out_features, width).transpose(1, 2)  # (E, in, out) view of (E, out, in)
    buffer = torch.zeros(rows, out_features)

    def grouped():
        return torch._grouped_mm(x, weight_t, offs=offsets)

    def loop_into_touched_buffer():
        for e in range(experts):
            torch.mm(x[e * per : (e + 1) * per], weight_t[e], out=buffer[e * per : (e + 1) * per])

    times = {"grouped_mm (fresh output)": [], "mm per expert into touched buffer": []}
    for _ in range(repeats + 1):
        for name, fn in zip(times, (grouped, loop_into_touched_buffer)):
            start = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - start)
    flops = 2 * rows * width * out_features
    return {name: (statistics.median(t[1:]), flops / statistics.median(t[1:]) / 1e9) for name, t in times.items()}


def main():
    torch.set_num_threads(2)
    candidates = build_candidates()
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(1, 2048, 768, generator=generator)
    grad = torch.randn(1, 2048, 768, generator=generator)
    print(f"torch {torch.__version__}, threads={torch.get_num_threads()}, fp32, T=2048")
    for name in ("hf_smoe_grouped", "ours_h3"):
        mib, user, system = faults_per_step(candidates[name], x, grad)
        print(
            f"{name:16s} fwd+bwd: minor page faults {mib:5.0f} MiB/step, "
            f"CPU user {user:5.0f} ms, system {system:4.0f} ms"
        )
    for label, shape in (("h=3 gate/up", (18432, 256, 96, 1024)), ("Mixtral gate/up", (2048, 768, 8, 4096))):
        for name, (seconds, gflops) in gemm_case(*shape).items():
            print(f"{label:16s} {name:34s} {seconds * 1e3:6.1f} ms {gflops:6.1f} GFLOP/s")


if __name__ == "__main__":
    main()
