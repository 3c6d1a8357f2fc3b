"""Compile the head-sparse attention Triton kernels for a GPU architecture on a machine without one (Triton's
ahead-of-time pipeline down to a cubin, as `gpu_compile.py` does for the other kernels): bf16 and fp32 (IEEE, TF32)
operands, with and without a 4-D mask, head dims 64 and 128, at the tiles, warps and stages the launcher picks (`tiles`), and the
kernels that build the row lists and the key-block bounds. Needs
TRITON_INTERPRET unset:

    env -u TRITON_INTERPRET PYTHONPATH=src python -m tests.models.ops.head_sparse_attention_gpu_compile [--arch 90]

Each kernel is compiled with the arguments a prefill launch marks as multiples of 16 (`_aligned`: the loads then
vectorise and the K/V loops pipeline, as on the GPU; without the marks the forward's loads are neither, and the shared
memory printed is far below the launch's). Prints each kernel's shared memory; exits 1 if one fails to compile, 77 if this triton has no NVIDIA backend.

`--cells suite` (what the test suite compiles): every bf16 cell, the fp32 cells with a mask (the variant with every
branch and the most shared memory: the causal-only variant's code is checked in bf16), and of the slow fp32-IEEE cells
only head dim 128. From a cold Triton cache the whole matrix took 310 s on a 2-core dev machine (2026-12-02), 205 s of it the 12
IEEE kernels (ptxas on FMA loops; their tiles are the TF32 cells').
"""

import argparse
import os
import sys

from .gpu_compile import SHARED_MEMORY, _compile


def _kernels(dtype: str, precision: str, has_mask: bool, head_dim: int):
    """(name, jit function, signature, constexprs, tiles) of the three kernels, operands in `dtype`: without a mask
    the causal-only variant (unmasked inner tiles), with one the variant that masks every tile."""
    import torch

    from mhmoe.models.ops.head_sparse_attention import head_sparse_attention_triton as hs

    p, i32, f32 = f"*{dtype}", "i32", "*fp32"
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
        kv_heads=i32,
        groups=i32,
        tokens_total=i32,
        heads=i32,
        head_dim=i32,
        num_keys=i32,
        offset=i32,
        window=i32,
    )
    torch_dtype = torch.float32 if dtype == "fp32" else torch.bfloat16
    kernels = []
    for name, fn, pointers, scales, backward in (
        ("forward", hs._forward_kernel, ("q", "k", "v", "o", "lse"), ("qk_scale",), False),
        ("dq", hs._dq_kernel, ("q", "k", "v", "o", "do", "lse", "delta", "dq"), ("scale", "qk_scale"), True),
        ("dkdv", hs._dkdv_kernel, ("q", "k", "v", "do", "lse", "delta", "dk", "dv"), ("scale", "qk_scale"), True),
    ):
        tile = hs.tiles(head_dim, torch_dtype, backward=backward)
        signature = {f"{x}_ptr": f32 if x in ("lse", "delta") else p for x in pointers}
        signature["rows_ptr"] = "*i32"
        signature["bounds_ptr" if name == "dkdv" else "counts_ptr"] = "*i32"
        signature.update(mask_ptr=f32, **strides, **sizes, **{x: "fp32" for x in scales})
        if name == "dkdv":
            signature["num_key_blocks"] = i32
        meta = dict(
            HAS_MASK=has_mask,
            CAUSAL_ONLY=not has_mask,
            PRECISION=precision,
            UPCAST=False,
            BLOCK_M=tile.block_m,
            BLOCK_N=tile.block_n,
            BLOCK_D=tile.block_d,
            EVEN_D=tile.block_d == head_dim,
        )
        kernels.append((f"head_sparse_attention.{name}", fn, signature, meta, tile))
    return kernels


def _plan_kernels():
    """(name, jit function, signature, constexprs) of the kernels that build the row lists and the backward's
    key-block bounds (no operands: once)."""
    from mhmoe.models.ops.head_sparse_attention import head_sparse_attention_triton as hs

    rows = dict(active_ptr="*u8", rows_ptr="*i32", positions_ptr="*i32", counts_ptr="*i32")
    rows.update(tokens="i32", kv_heads="i32", groups="i32", offset="i32")
    bounds = dict(positions_ptr="*i32", bounds_ptr="*i32", capacity="i32", num_keys="i32", num_key_blocks="i32")
    bounds.update(window="i32", steps="i32")
    return [("head_sparse_attention.row_lists", hs._row_lists_kernel, rows, dict(BLOCK=hs._Plan.MAX_BLOCK))] + [
        (
            f"head_sparse_attention.key_block_bounds causal_only={causal_only}",
            hs._key_block_bounds_kernel,
            bounds,
            dict(CAUSAL_ONLY=causal_only, BLOCK_N=64, BLOCK_K=128),
        )
        for causal_only in (True, False)
    ]


CELLS = [  # (dtype, precision, has_mask, head_dim)
    (dtype, precision, has_mask, head_dim)
    for dtype, precision in (("bf16", "ieee"), ("fp32", "ieee"), ("fp32", "tf32"))
    for has_mask in (False, True)
    for head_dim in (64, 128)
]
SUITE_CELLS = [  # the docstring's `--cells suite`
    (dtype, precision, has_mask, head_dim)
    for dtype, precision, has_mask, head_dim in CELLS
    if dtype == "bf16" or (has_mask and (precision == "tf32" or head_dim == 128))
]


def _aligned(signature: dict) -> list[str]:
    """The arguments a prefill launch marks as multiples of 16 (aligned tensors, strides and sizes of the benchmark's
    shapes: head dims 64 and 128, 4K/16K tokens): the pointers, strides, head dim, tokens and keys."""
    sizes = ("tokens_total", "head_dim", "num_keys")
    return [
        name
        for name, kind in signature.items()
        if kind.startswith("*") or name.startswith("stride_q") or name.startswith("stride_k") or name in sizes
    ]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arch", type=int, nargs="+", default=[90], choices=sorted(SHARED_MEMORY))
    parser.add_argument("--cells", choices=["all", "suite"], default="all", help="suite: the test suite's (docstring)")
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
        for name, fn, signature, constexprs in _plan_kernels():
            try:
                shared = _compile(fn, signature, constexprs, arch, 4, 1, [n for n in signature if n.endswith("_ptr")])
                print(f"sm_{arch} {name}: shared {shared} B")
            except Exception as error:
                failures += 1
                print(f"sm_{arch} {name}: FAILED {type(error).__name__}: {error}")
        for dtype, precision, has_mask, head_dim in CELLS if args.cells == "all" else SUITE_CELLS:
            for name, fn, signature, constexprs, tile in _kernels(dtype, precision, has_mask, head_dim):
                label = (
                    f"sm_{arch} {dtype} {precision} mask={has_mask} hd={head_dim} {name} "
                    f"{tile.block_m}x{tile.block_n} warps={tile.num_warps} stages={tile.num_stages}"
                )
                try:
                    shared = _compile(
                        fn, signature, constexprs, arch, tile.num_warps, tile.num_stages, _aligned(signature)
                    )
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
