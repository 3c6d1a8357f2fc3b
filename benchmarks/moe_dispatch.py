"""What the MoE blocks ask of a GPU, counted on CPU: device operations, Triton launches, host syncs and bytes moved.

A GPU block whose kernels are small is bound by how many it launches (each costs the host ~5-20 µs in PyTorch's
dispatcher, a Triton launch more) and by the bytes its elementwise and gather steps move, not by its FLOPs. This
script runs the blocks of benchmarks/gpu_moe.py (d=768: Transformers' Mixtral block E=8 k=1, our SMoE, MH-MoE h=3
E=96 k=3; bf16, as on the GPU: torch's grouped GEMM takes bf16 on CPU too) under a `TorchDispatchMode` that records
every aten operation below autograd, which is where a GPU kernel would be launched:

- device ops: operations that launch work (views, `empty` and `detach` launch nothing and are left out);
- host syncs: operations that read a device value on the host (`_local_scalar_dense`, `nonzero`, `unique`, ...);
- bytes: the tensors each device op reads and writes (inputs whole, an overestimate for gathers), scaled to
  `--scale_tokens` tokens (bytes grow with the tokens; the weights' do not, and are counted once);
- Triton launches: the routing kernels' launches, counted by wrapping them (with `--triton`, under TRITON_INTERPRET=1
  and MHMOE_ROUTING_BACKEND=triton, the path the GPU takes; else the PyTorch reference, the path under torch.compile),
  and with `--fused_steps` the grouped_mm experts' fused steps (SwiGLU, its backward, the slots' sum), which run on
  CUDA only; each launch adds the bytes of the tensors it is given (read or written once) to the bytes moved.

Per part of the h=3 forward (`_gpu_moe_parts.block_parts`) and for the whole forward and forward+backward of each block.

    TRITON_INTERPRET=1 MHMOE_ROUTING_BACKEND=triton PYTHONPATH=src python benchmarks/moe_dispatch.py --triton [--fused_steps]
"""

from __future__ import annotations

import argparse
import collections
import json
import sys
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _gpu_moe_parts  # noqa: E402
import gpu_moe  # noqa: E402

NO_LAUNCH = {
    "empty",
    "empty_strided",
    "new_empty",
    "new_empty_strided",
    "detach",
    "alias",
    "lift_fresh",
    "_unsafe_view",
    "sym_size",
    "sym_stride",
    "sym_numel",
    "sym_storage_offset",
    "is_same_size",
    "_has_compatible_shallow_copy_type",
    "resize_",
    "empty_like",
    "promote_types",
    "result_type",
}
HOST_SYNC = {"_local_scalar_dense", "nonzero", "unique", "_unique2", "masked_select", "repeat_interleave", "item"}


class Counter(TorchDispatchMode):
    paused = False  # inside a Triton launch: the interpreter's own host copies are no device work

    def __init__(self):
        super().__init__()
        self.ops, self.syncs, self.bytes = collections.Counter(), collections.Counter(), collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if Counter.paused:
            return out
        name = func.overloadpacket.__name__
        if name in HOST_SYNC:
            self.syncs[name] += 1
        if func.is_view or name in NO_LAUNCH:
            return out
        self.ops[name] += 1
        tensors = [t for t in torch.utils._pytree.tree_leaves((args, kwargs, out)) if isinstance(t, torch.Tensor)]
        self.bytes[name] += sum(t.numel() * t.element_size() for t in tensors)
        return out


TRITON_KERNELS = {  # module -> the kernels counted (launches, and the bytes of the tensors each launch is given)
    "mhmoe.models.ops.routing.routing_triton": (
        "_softmax_topk_kernel",
        "_softmax_topk_backward_kernel",
        "_block_histogram_kernel",
        "_scan_counts_kernel",
        "_stable_scatter_kernel",
    ),
    "mhmoe.models.ops.experts.experts_grouped_mm_steps_triton": (
        "_swiglu_kernel",
        "_swiglu_backward_kernel",
        "_combine_kernel",
    ),
    "mhmoe.models.ops.head_sparse_attention.head_sparse_attention_triton": (  # head_sparse_ops.py
        "_row_lists_kernel",
        "_key_block_bounds_kernel",
        "_forward_kernel",
        "_dq_kernel",
        "_dkdv_kernel",
    ),
}


class TritonLaunches:
    """Count the launches of the Triton kernels (module globals replaced by counting proxies while inside), and add
    the bytes of the tensors each launch is given to `counter` (each read or written once: a kernel's traffic)."""

    def __init__(self, counter: Counter):
        self.count = collections.Counter()
        self._saved = []
        self._counter = counter

    def __enter__(self):
        import importlib

        for module_name, names in TRITON_KERNELS.items():
            module = importlib.import_module(module_name)
            for name in names:
                kernel = getattr(module, name, None)
                if kernel is None:  # not at this commit (a count of an earlier one)
                    continue
                self._saved.append((module, name, kernel))
                setattr(module, name, self._proxy(kernel, name))
        return self

    def _proxy(self, kernel, label):
        launches, counter = self.count, self._counter

        class Proxy:
            def __getitem__(self, grid):
                launches[label] += 1
                launch = kernel[grid]

                def run(*args, **kwargs):
                    tensors = [a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)]
                    counter.bytes[f"triton {label.strip('_')}"] += sum(t.numel() * t.element_size() for t in tensors)
                    Counter.paused = True
                    try:
                        return launch(*args, **kwargs)
                    finally:
                        Counter.paused = False

                return run

        return Proxy()

    def __exit__(self, *exc):
        for module, name, kernel in self._saved:
            setattr(module, name, kernel)


def _count(fn):
    with Counter() as counter, TritonLaunches(counter) as triton_launches:
        fn()
    return counter, triton_launches


def count(make, tokens: int, scale_tokens: int) -> dict:
    """Counts of `make(tokens)()`; bytes extrapolated to `scale_tokens` from runs at `tokens` and 2·`tokens` (they grow
    linearly with the tokens; the weights' share is the constant term)."""
    counter, triton_launches = _count(make(tokens))
    double, _ = _count(make(2 * tokens))
    moved, moved2 = sum(counter.bytes.values()), sum(double.bytes.values())
    scaled = moved + (moved2 - moved) * (scale_tokens - tokens) / tokens
    by_op = {
        op: round((b + (double.bytes[op] - b) * (scale_tokens - tokens) / tokens) / 1e9, 3)
        for op, b in counter.bytes.items()
    }
    return {
        "device_ops": sum(counter.ops.values()),
        "triton_launches": sum(triton_launches.count.values()),
        "host_syncs": sum(counter.syncs.values()),
        "gb_moved_at_scale": round(scaled / 1e9, 3),
        "ops": dict(counter.ops.most_common()),
        "gb_by_op": dict(sorted(by_op.items(), key=lambda item: -item[1])),
    }


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--hidden", type=int, default=768)
    parser.add_argument("--tokens", type=int, default=1024, help="tokens run here (counts do not depend on it)")
    parser.add_argument("--scale_tokens", type=int, default=32768, help="tokens the bytes are scaled to")
    parser.add_argument("--triton", action="store_true", help="the routing kernels (needs TRITON_INTERPRET=1)")
    parser.add_argument(
        "--fused_steps",
        action="store_true",
        help="the grouped_mm experts' fused steps, as on CUDA (experts_grouped_mm_steps_triton; TRITON_INTERPRET=1)",
    )
    parser.add_argument("--json", type=Path, default=None, help="also write the counts here")
    args = parser.parse_args(argv)
    torch.manual_seed(0)
    if args.fused_steps:
        from mhmoe.models.ops.experts import experts_grouped_mm

        experts_grouped_mm.STEPS_KERNELS_ON_CPU = True
    blocks = gpu_moe.build_blocks(args.hidden, torch.bfloat16, torch.device("cpu"))
    if args.triton:
        for block in blocks.values():
            if hasattr(block, "gate") and hasattr(block.gate, "routing_backend"):
                block.gate.routing_backend = "triton"
                block.experts.config.routing_backend = "triton"
    inputs = {t: torch.randn(1, t, args.hidden, dtype=torch.bfloat16) for t in (args.tokens, 2 * args.tokens)}
    result = {
        "hidden": args.hidden,
        "tokens_run": args.tokens,
        "bytes_scaled_to_tokens": args.scale_tokens,
        "routing": "triton" if args.triton else "torch",
        "fused_steps": args.fused_steps,
        "blocks": {},
        "h3_forward_parts": {},
    }

    def forward(block):
        def make(tokens):
            def run():
                with torch.no_grad():
                    block(inputs[tokens])

            return run

        return make

    def forward_backward(block):
        def make(tokens):
            def run():
                block.zero_grad(set_to_none=True)  # no gradient accumulation counted
                inp = inputs[tokens].detach().requires_grad_()
                out = block(inp)
                (out[0] if isinstance(out, tuple) else out).backward(torch.ones_like(inp))

            return run

        return make

    for name in ("hf_mixtral", "ours_smoe", "ours_h3"):
        block = blocks[name]
        result["blocks"][name] = {
            "fwd": count(forward(block), args.tokens, args.scale_tokens),
            "fwd+bwd": count(forward_backward(block), args.tokens, args.scale_tokens),
        }
    with torch.no_grad():
        parts = {t: _gpu_moe_parts.block_parts(blocks["ours_h3"], x) for t, x in inputs.items()}
    for name in parts[args.tokens]:

        def make(tokens, name=name):
            def run():
                with torch.no_grad():
                    parts[tokens][name]()

            return run

        result["h3_forward_parts"][name] = count(make, args.tokens, args.scale_tokens)
    import _provenance

    git = _provenance.git_state()
    result.update(commit=git["commit"], dirty=git["dirty"], torch=torch.__version__)
    print(f"commit {git['commit']}{' (dirty)' if git['dirty'] else ''}, torch {torch.__version__}")
    print(
        f"d={args.hidden}, routing {result['routing']}, fused steps {'on' if args.fused_steps else 'off'}; device ops (ops that launch work), Triton launches, host "
        f"syncs, GB moved at {args.scale_tokens} tokens (approximate)"
    )
    for name, modes in result["blocks"].items():
        for mode, c in modes.items():
            print(
                f"{name:10s} {mode:8s} ops {c['device_ops']:4d}  triton {c['triton_launches']:2d}  syncs "
                f"{c['host_syncs']}  GB {c['gb_moved_at_scale']:.2f}"
            )
    for name in ("hf_mixtral", "ours_h3"):
        top = result["blocks"][name]["fwd+bwd"]["gb_by_op"]
        print(f"{name} fwd+bwd, GB by operation: " + ", ".join(f"{op} {gb:.2f}" for op, gb in list(top.items())[:8]))
    print("h=3 forward, by part:")
    for name, c in result["h3_forward_parts"].items():
        ops = ", ".join(f"{op}×{n}" if n > 1 else op for op, n in c["ops"].items())
        print(
            f"  {name:40s} ops {c['device_ops']:3d}  triton {c['triton_launches']}  syncs {c['host_syncs']}  "
            f"GB {c['gb_moved_at_scale']:.2f}  [{ops}]"
        )
    if args.json:
        args.json.write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
