"""Compile the head-sparse attention Triton kernels for a GPU architecture on a machine without one (Triton's
ahead-of-time pipeline down to a cubin, as `gpu_compile.py` does for the other kernels): bf16 and fp32 (IEEE, TF32)
operands, with and without a 4-D mask, head dims 64 and 128, at the tiles the launcher picks (`tiles`). Needs
TRITON_INTERPRET unset:

    env -u TRITON_INTERPRET PYTHONPATH=src python -m tests.models.ops.head_sparse_attention_gpu_compile [--arch 90]

Prints each kernel's shared memory; exits 1 if one fails to compile, 77 if this triton has no NVIDIA backend.
"""

import argparse
import os
import sys

from .gpu_compile import SHARED_MEMORY, _compile


def _kernels(dtype: str, precision: str, has_mask: bool, head_dim: int):
    """(name, jit function, signature, constexprs) of the three kernels, operands in `dtype`."""
    from mhmoe.models.ops.head_sparse_attention import head_sparse_attention_triton as hs

    p, i32, f32 = f"*{dtype}", "i32", "*fp32"
    rows = dict(rows_t_ptr="*i32", rows_h_ptr="*i32")
    strides = {
        name: i32
        for name in (
            "stride_qb",
            "stride_qh",
            "stride_qt",
            "stride_kb",
            "stride_kh",
            "stride_kl",
            "stride_mb",
            "stride_mt",
        )
    }
    sizes = dict(
        kv_heads=i32, tokens_total=i32, heads=i32, head_dim=i32, num_keys=i32, offset=i32, window=i32, scale="fp32"
    )
    import torch

    block_m, block_n, block_d = hs.tiles(head_dim, torch.float32 if dtype == "fp32" else torch.bfloat16)
    meta = dict(HAS_MASK=has_mask, PRECISION=precision, UPCAST=False, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_D=block_d)
    return [
        (
            "head_sparse_attention.forward",
            hs._forward_kernel,
            dict(
                q_ptr=p,
                k_ptr=p,
                v_ptr=p,
                o_ptr=p,
                lse_ptr=f32,
                **rows,
                segments_ptr="*i32",
                mask_ptr=f32,
                **strides,
                **sizes,
            ),
            meta,
        ),
        (
            "head_sparse_attention.dq",
            hs._dq_kernel,
            dict(
                q_ptr=p,
                k_ptr=p,
                v_ptr=p,
                do_ptr=p,
                lse_ptr=f32,
                delta_ptr=f32,
                dq_ptr=p,
                **rows,
                segments_ptr="*i32",
                mask_ptr=f32,
                **strides,
                **sizes,
            ),
            meta,
        ),
        (
            "head_sparse_attention.dkdv",
            hs._dkdv_kernel,
            dict(
                q_ptr=p,
                k_ptr=p,
                v_ptr=p,
                do_ptr=p,
                lse_ptr=f32,
                delta_ptr=f32,
                dk_ptr=p,
                dv_ptr=p,
                **rows,
                bounds_ptr="*i32",
                mask_ptr=f32,
                **strides,
                **sizes,
                num_key_blocks=i32,
            ),
            meta,
        ),
    ]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arch", type=int, nargs="+", default=[90], choices=sorted(SHARED_MEMORY))
    args = parser.parse_args(argv)
    if os.environ.get("TRITON_INTERPRET", "0") == "1":
        print("unset TRITON_INTERPRET: interpreted kernels cannot be compiled", file=sys.stderr)
        return 2
    try:
        import triton  # noqa: F401
        from triton.backends import backends
    except ImportError as error:
        print(f"no triton: {error}", file=sys.stderr)
        return 77
    if "nvidia" not in backends:
        print("this triton has no NVIDIA backend", file=sys.stderr)
        return 77
    failures = 0
    for arch in args.arch:
        for dtype, precision in (("bf16", "ieee"), ("fp32", "ieee"), ("fp32", "tf32")):
            for has_mask in (False, True):
                for head_dim in (64, 128):
                    for name, fn, signature, constexprs in _kernels(dtype, precision, has_mask, head_dim):
                        label = f"sm_{arch} {dtype} {precision} mask={has_mask} hd={head_dim} {name}"
                        try:
                            shared = _compile(fn, signature, constexprs, arch)
                        except Exception as error:  # report every kernel, then fail
                            failures += 1
                            print(f"{label}: FAILED {type(error).__name__}: {error}")
                            continue
                        fits = shared <= SHARED_MEMORY[arch]
                        failures += int(not fits)
                        print(f"{label}: shared {shared} B" + ("" if fits else " (more than the GPU has)"))
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
