"""Compile every Triton kernel of ops/ for a GPU architecture on a machine without one: Triton's ahead-of-time path
(`triton.compile` of an `ASTSource` for a `GPUTarget`) runs the whole NVIDIA pipeline, TTIR -> TTGIR -> LLVM -> PTX
-> cubin with the ptxas triton ships, so what the interpreter never sees (GPU code generation, layouts, pipelining,
shared memory) is checked. It needs TRITON_INTERPRET unset (interpreted kernels cannot compile): run it as

    env -u TRITON_INTERPRET PYTHONPATH=src python -m tests.models.ops.gpu_compile [--arch 90 80] [--all-configs]

Prints each kernel's shared memory; exits 1 if one fails to compile, 77 if this triton has no NVIDIA backend.
`--all-configs` compiles the experts kernels at every autotune config, bf16 and fp32, and fails if the early prune
(`_fitting`) keeps a config needing more shared memory than the target has. Used by test_gpu_compile.py.
"""

import argparse
import os
import sys

SHARED_MEMORY = {80: 163 * 1024, 90: 227 * 1024}  # bytes a block may use: A100, H100


def _kernels(dtype: str, tile: dict, precision: str = "tf32"):
    """(name, jit function, signature, constexprs) of every kernel, operands in `dtype` ("fp32" | "bf16")."""
    from mhmoe.models.ops.experts import experts_grouped_mm_steps_triton as st
    from mhmoe.models.ops.experts import experts_triton as ex
    from mhmoe.models.ops.head_router import head_router_triton as hr
    from mhmoe.models.ops.routing import routing_triton as rt

    p, i32 = f"*{dtype}", "i32"
    experts = dict(tile, UPCAST=False, PRECISION=precision)
    return [
        (
            "routing.softmax_topk",
            rt._softmax_topk_kernel,
            dict(logits_ptr=p, weights_ptr="*fp32", experts_ptr="*i64", num_rows=i32, num_experts=i32, stride_row=i32),
            dict(TOP_K=3, RENORM=True, BLOCK_K=4, BLOCK_N=16, BLOCK_E=128),
        ),
        (
            "routing.softmax_topk_backward",
            rt._softmax_topk_backward_kernel,
            dict(
                logits_ptr=p,
                experts_ptr="*i64",
                grad_weights_ptr="*fp32",
                grad_logits_ptr=p,
                num_rows=i32,
                num_experts=i32,
                stride_row=i32,
            ),
            dict(TOP_K=3, RENORM=True, BLOCK_N=16, BLOCK_E=128),
        ),
        (
            "routing.block_histogram",
            rt._block_histogram_kernel,
            dict(ids_ptr="*i64", counts_ptr="*i32", num_ids=i32, num_bins=i32),
            dict(BLOCK=32, BLOCK_B=128, CHUNKS=8),
        ),
        (
            "routing.scan_counts",
            rt._scan_counts_kernel,
            dict(
                counts_ptr="*i32",
                base_ptr="*i64",
                bin_counts_ptr="*i64",
                ends_ptr="*i32",
                num_programs=i32,
                num_bins=i32,
            ),
            dict(BLOCK_P=32, BLOCK_B=128),
        ),
        (
            "routing.stable_scatter",
            rt._stable_scatter_kernel,
            dict(ids_ptr="*i64", base_ptr="*i64", pos_ptr="*i64", order_ptr="*i64", num_ids=i32, num_bins=i32),
            dict(WRITE_ORDER=True, BLOCK=32, BLOCK_B=128, CHUNKS=8),
        ),
        (
            "head_router.l2_head_gates",
            hr._l2_head_gates_kernel,
            dict(
                q_ptr=p,
                gates_ptr="*fp32",
                logits_ptr="*fp32",
                index_ptr="*i64",
                num_rows=i32,
                stride_row=i32,
                stride_head=i32,
                shared=i32,
                routed=i32,
                head_dim=i32,
                std_min="fp32",
            ),
            dict(ACTIVE=4, STRAIGHT=False, BLOCK_M=8, BLOCK_R=16, BLOCK_D=64, BLOCK_K=4, BLOCK_S=4),
        ),
        (
            "experts.gate_up",
            ex._gate_up_kernel,
            dict(
                x_ptr=p,
                order_ptr="*i64",
                offsets_ptr="*i32",
                w_ptr=p,
                h_ptr=p,
                num_experts=i32,
                width=i32,
                inter=i32,
                top_k=i32,
                stride_x=i32,
                stride_we=i32,
                stride_wo=i32,
                stride_wi=i32,
            ),
            dict(experts, BLOCK_E=128),
        ),
        (
            "experts.down_scatter",
            ex._down_scatter_kernel,
            dict(
                h_ptr=p,
                order_ptr="*i64",
                offsets_ptr="*i32",
                w_ptr=p,
                slots_ptr="*fp32",
                num_experts=i32,
                width=i32,
                inter=i32,
                stride_we=i32,
                stride_wo=i32,
                stride_wi=i32,
            ),
            dict(experts, BLOCK_E=128),
        ),
        (
            "experts.grouped_gemm",
            ex._grouped_gemm_kernel,
            dict(
                a_ptr=p,
                offsets_ptr="*i32",
                b_ptr=p,
                c_ptr="*fp32",
                num_experts=i32,
                inner=i32,
                cols_total=i32,
                stride_am=i32,
                stride_be=i32,
                stride_bk=i32,
                stride_bn=i32,
            ),
            dict(experts, BLOCK_E=128),
        ),
        (
            "experts.weight_grad",
            ex._weight_grad_kernel,
            dict(
                g_ptr=p,
                a_ptr=p,
                offsets_ptr="*i32",
                out_ptr="*fp32",
                num_experts=i32,
                num_splits=i32,
                g_cols=i32,
                a_cols=i32,
                stride_gm=i32,
                stride_am=i32,
            ),
            experts,
        ),
        (
            "experts.swiglu",
            st._swiglu_kernel,
            dict(gate_up_ptr=p, out_ptr=p, rows=i32, inter=i32, stride_gu=i32, stride_out=i32),
            dict(BLOCK_S=32, BLOCK_I=128),
        ),
        (
            "experts.swiglu_backward",
            st._swiglu_backward_kernel,
            dict(
                gate_up_ptr=p,
                grad_hidden_ptr=p,
                weights_ptr="*fp32",
                grad_gate_up_ptr=p,
                hidden_ptr=p,
                dot_ptr="*fp32",
                rows=i32,
                inter=i32,
                stride_gu=i32,
            ),
            dict(WRITE_GRAD=True, WRITE_HIDDEN=True, WRITE_DOT=True, BLOCK_S=16, BLOCK_I=128),
        ),
        (
            "experts.combine_slots",
            st._combine_kernel,
            dict(
                rows_ptr=p,
                slot_pos_ptr="*i64",
                dropped_ptr="*u8",
                weights_ptr="*fp32",
                out_ptr=p,
                num_rows=i32,
                width=i32,
                stride_rows=i32,
            ),
            dict(TOP_K=3, WEIGHTED=True, BLOCK_N=16, BLOCK_W=128),
        ),
    ]


def _compile(
    fn, signature: dict, constexprs: dict, arch: int, num_warps: int = 4, num_stages: int = 3, divisible=()
) -> int:
    """Shared memory (bytes) of the kernel compiled down to a cubin for sm_<arch>. `divisible`: the arguments to mark
    as multiples of 16 (what a launch marks for 16-byte-aligned tensors and integers divisible by 16: with it the
    loads vectorise and the loops pipeline as they will on the GPU, so the shared memory is the launch's)."""
    import triton
    from triton.backends.compiler import GPUTarget

    attrs = {(fn.arg_names.index(name),): [["tt.divisibility", 16]] for name in divisible}
    signature = dict(signature, **{name: "constexpr" for name in constexprs})
    source = triton.compiler.ASTSource(fn=fn, signature=signature, constexprs=constexprs, attrs=attrs)
    options = dict(num_warps=num_warps, num_stages=num_stages)
    return triton.compile(source, target=GPUTarget("cuda", arch, 32), options=options).metadata.shared


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arch", type=int, nargs="+", default=[90], choices=sorted(SHARED_MEMORY))
    parser.add_argument("--all-configs", action="store_true")
    args = parser.parse_args(argv)
    if os.environ.get("TRITON_INTERPRET", "0") == "1":
        print("unset TRITON_INTERPRET: interpreted kernels cannot be compiled", file=sys.stderr)
        return 2
    try:
        import torch
        import triton  # noqa: F401
        from triton.backends import backends
    except ImportError as error:
        print(f"no triton: {error}", file=sys.stderr)
        return 77
    if "nvidia" not in backends:
        print("this triton has no NVIDIA backend", file=sys.stderr)
        return 77
    from mhmoe.models.ops.experts import experts_triton as ex

    failures = 0
    for arch in args.arch:
        jobs = [("bf16", k) for k in _kernels("bf16", dict(BLOCK_M=64, BLOCK_N=64, BLOCK_K=32))]
        jobs += [
            ("fp32", k)
            for k in _kernels("fp32", dict(BLOCK_M=64, BLOCK_N=64, BLOCK_K=32), "ieee")
            if k[0] == "experts.grouped_gemm"
        ]
        for dtype, (name, fn, signature, constexprs) in jobs:
            try:
                shared = _compile(fn, signature, constexprs, arch)
                print(f"sm_{arch} {dtype} {name}: shared {shared} B")
            except Exception as error:  # report every kernel, then fail
                failures += 1
                print(f"sm_{arch} {dtype} {name}: FAILED {type(error).__name__}: {error}")
        if not args.all_configs:
            continue
        for dtype, torch_dtype in (("bf16", torch.bfloat16), ("fp32", torch.float32)):
            kept = ex._fitting(ex._configs(), {"x": torch.empty(0, dtype=torch_dtype)})
            for config in ex._configs():
                tile = dict(config.kwargs)
                for name, fn, signature, constexprs in _kernels(dtype, tile)[4:]:
                    try:
                        shared = _compile(fn, signature, constexprs, arch, config.num_warps, config.num_stages)
                    except Exception as error:
                        failures += 1
                        print(f"sm_{arch} {dtype} {name} {config}: FAILED {type(error).__name__}: {error}")
                        continue
                    fits = shared <= SHARED_MEMORY[arch]
                    failures += int(config in kept and not fits)  # the prune let through a config that cannot run
                    note = ("" if fits else " (more than the GPU has)") + ("" if config in kept else ", pruned")
                    print(
                        f"sm_{arch} {dtype} {name} {tile} w{config.num_warps} s{config.num_stages}: shared {shared} B"
                        f"{note}"
                    )
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
