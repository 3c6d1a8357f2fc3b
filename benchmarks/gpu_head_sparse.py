"""Head-sparse attention on a GPU: the Triton kernels (ops/head_sparse_attention) vs PyTorch SDPA over all heads.

Prefill at 4k and 16k tokens (batch 1, bf16, causal), forward and forward + backward, for two layer shapes:
SmolLM2-135M (9 heads of 64, 3 key/value heads; 3 shared + 4 or 2 of 6 routed) and LLaMA-3-8B (32 heads of 128,
8 key/value heads; the paper's 16 shared + 8 of 16 routed = 75%, and 16 + 4 = 62.5%). Routed heads are drawn
uniformly per token. Each cell: the median over `--repeats` CUDA-event timings (after a warm-up call, which also
compiles the kernels), the ratio kernel / SDPA beside the ideal (the active pairs' share of the attention FLOPs) and
the goal (ideal + 10 points). Before timing, a small odd shape checks the kernels against the reference
(head_sparse_attention_naive.py), outputs and gradients.

    python benchmarks/gpu_head_sparse.py [--tokens 4096 16384] [--repeats 20] [--out DIR]

Needs a CUDA GPU and triton; prints a Markdown table and, with --out, writes gpu_head_sparse.json there.
"""

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from mhmoe.models.ops.head_sparse_attention.head_sparse_attention_naive import head_sparse_attention_naive
from mhmoe.models.ops.head_sparse_attention.head_sparse_attention_triton import head_sparse_attention_triton

SHAPES = {  # name -> (heads, kv heads, head_dim, shared, {setting: routed active})
    "SmolLM2-135M": (9, 3, 64, 3, {"7/9": 4, "5/9": 2}),
    "LLaMA-3-8B": (32, 8, 128, 16, {"75%": 8, "62.5%": 4}),
}


def draw_gates(tokens, heads, shared, active, device):
    gates = torch.zeros(1, tokens, heads, device=device)
    gates[..., :shared] = 1
    pick = torch.rand(1, tokens, heads - shared, device=device).argsort(-1)[..., :active] + shared
    return gates.scatter(-1, pick, 1.0)


def check(device) -> float:
    """Largest difference of the kernels from the reference on an odd shape (bf16 inputs, fp32 reference)."""
    torch.manual_seed(0)
    batch, heads, kv_heads, tokens, head_dim = 2, 6, 2, 97, 40
    query = torch.randn(batch, tokens, heads, head_dim, device=device).transpose(1, 2)
    key, value = (torch.randn(batch, kv_heads, tokens, head_dim, device=device) for _ in range(2))
    gates = (torch.rand(batch, tokens, heads, device=device) < 0.6).float()
    worst = 0.0
    leaves = [x.to(torch.bfloat16).requires_grad_() for x in (query, key, value)]
    ref_leaves = [x.detach().float().requires_grad_() for x in leaves]
    got = head_sparse_attention_triton(*leaves, gates, head_dim**-0.5)
    want = head_sparse_attention_naive(*ref_leaves, gates, head_dim**-0.5)
    grad = torch.randn_like(want)
    got.backward(grad.to(got.dtype))
    want.backward(grad)
    worst = max(worst, (got.float() - want).abs().max().item())
    for leaf, ref in zip(leaves, ref_leaves):
        worst = max(worst, (leaf.grad.float() - ref.grad).abs().max().item())
    return worst


def cuda_time(fn, repeats) -> float:
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, nargs="+", default=[4096, 16384])
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("needs a CUDA GPU", file=sys.stderr)
        return 77
    device = "cuda"
    started = time.time()
    worst = check(device)
    print(
        f"{torch.cuda.get_device_name()}, torch {torch.__version__}; kernels vs reference (bf16): max |Δ| {worst:.3g}"
    )
    rows = []
    print("| shape | tokens | active | pass | SDPA ms | kernel ms | kernel / SDPA | ideal | goal |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for name, (heads, kv_heads, head_dim, shared, settings) in SHAPES.items():
        for tokens in args.tokens:
            query = torch.randn(1, tokens, heads, head_dim, device=device, dtype=torch.bfloat16).transpose(1, 2)
            key, value = (
                torch.randn(1, kv_heads, tokens, head_dim, device=device, dtype=torch.bfloat16) for _ in range(2)
            )
            grad = torch.randn(1, tokens, heads, head_dim, device=device, dtype=torch.bfloat16)
            for setting, active in settings.items():
                gates = draw_gates(tokens, heads, shared, active, device)
                ideal = (shared + active) / heads
                for mode in ("forward", "forward+backward"):

                    def run(fn):
                        if mode == "forward":
                            with torch.no_grad():
                                return fn(query, key, value)
                        leaves = [x.detach().requires_grad_() for x in (query, key, value)]
                        fn(*leaves).backward(grad)

                    def sdpa(q, k, v):
                        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True).transpose(1, 2)

                    def kernel(q, k, v):
                        return head_sparse_attention_triton(q, k, v, gates, head_dim**-0.5)

                    dense_ms = cuda_time(lambda: run(sdpa), args.repeats)
                    sparse_ms = cuda_time(lambda: run(kernel), args.repeats)
                    row = dict(
                        shape=name,
                        tokens=tokens,
                        active=setting,
                        mode=mode,
                        sdpa_ms=dense_ms,
                        kernel_ms=sparse_ms,
                        ratio=sparse_ms / dense_ms,
                        ideal=ideal,
                        goal=ideal + 0.10,
                    )
                    rows.append(row)
                    print(
                        f"| {name} | {tokens} | {setting} | {mode} | {dense_ms:.3f} | {sparse_ms:.3f} | "
                        f"**{row['ratio']:.2f}** | {ideal:.2f} | {row['goal']:.2f} |",
                        flush=True,
                    )
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "gpu_head_sparse.json").write_text(
            json.dumps(
                {
                    "device": torch.cuda.get_device_name(),
                    "torch": torch.__version__,
                    "check_max_abs_diff": worst,
                    "rows": rows,
                    "seconds": round(time.time() - started, 1),
                },
                indent=2,
            )
            + "\n"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
