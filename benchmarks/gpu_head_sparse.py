"""Head-sparse attention on a GPU: the Triton kernels (ops/head_sparse_attention) and the FlexAttention design
(`head_sparse_attention_flex.py`: each head's active rows packed, one compiled FlexAttention call) vs PyTorch SDPA
over all heads.

Sections, in this order, each written to `--out DIR/gpu_head_sparse.json` (atomically) as soon as it has something,
so a run cut at its limit (scripts/gpu_run.sh: `HS_SECONDS`, 45 s) keeps what it measured:

  check  a small odd shape: the kernels, and the flex design, against the reference (head_sparse_attention_naive.py),
         outputs and gradients (bf16 inputs, fp32 reference): the largest difference of each
  table  prefill at 4k and 16k tokens (batch 1, bf16, causal), forward and forward + backward, for two layer shapes:
         SmolLM2-135M (9 heads of 64, 3 key/value heads; 3 shared + 4 or 2 of 6 routed) and LLaMA-3-8B (32 heads of
         128, 8 key/value heads; the paper's 16 shared + 8 of 16 routed = 75%, and 16 + 4 = 62.5%). Routed heads are
         drawn uniformly per token. Each cell: the median over `--repeats` CUDA-event timings (after a warm-up call,
         which also compiles the kernels), the ratio kernel / SDPA beside the ideal (the active pairs' share of the
         attention FLOPs) and the goal (ideal + 10 points). Written after every cell.
  flex   the table's cells for the FlexAttention design: its time and ratio to SDPA beside the kernels' ratio from
         the table (the first call of a cell compiles, in the warm-up). A section of its own, after the table, so that
         a run cut at its limit keeps the table. Off CUDA forward only (FlexAttention has no CPU backward).
  parts  where the time goes, for LLaMA-3-8B 16384 75% and SmolLM2 4096 7/9, forward and forward + backward: one
         torch.profiler run of `--profile_steps` calls each of the kernels and of SDPA: GPU time per kernel (per
         call), grouped into parts (the Triton row lists, key-block bounds, forward, dQ + delta and dK/dV kernels;
         fills; the gates; PyTorch's own ops by kind), the GPU's busy time against the
         host's wall time (timed without the profiler: a wall time far above the busy time says the host is the
         limit), the host syncs of one call (torch.cuda.set_sync_debug_mode) and the host time per operator.
         Written after every profile.
  tiles  the forward of LLaMA-3-8B 16384 75% and SmolLM2 16384 7/9 at the launcher's tiles and two alternatives
         each (rows × keys per tile, warps, stages; `TILED`, the most telling first: a cut run keeps those): which
         to make the default. Written after every config.

    python benchmarks/gpu_head_sparse.py [--tokens 4096 16384] [--repeats 20] [--out DIR] [--sections ...]
    TRITON_INTERPRET=1 python benchmarks/gpu_head_sparse.py --smoke --out DIR   # tiny shapes on CPU: the script runs

Needs a CUDA GPU and triton (or --smoke); prints Markdown tables. A section that fails is recorded under "errors"
(exit 1) and the next one still runs. The JSON is headed by the device, commit (from git,
or on a GPU machine from scripts/gpu_run.sh's pack: benchmarks/_provenance.py), versions and precision
(gpu_moe.provenance).
"""

import argparse
import collections
import re
import statistics
import sys
import time
import warnings
from pathlib import Path

import torch
import torch.nn.functional as F

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import gpu_moe  # noqa: E402  (provenance and the atomic JSON writer, shared with the MoE benchmark)

from mhmoe.models.ops.head_sparse_attention import head_sparse_attention_triton as hs  # noqa: E402
from mhmoe.models.ops.head_sparse_attention.head_sparse_attention_flex import head_sparse_attention_flex  # noqa: E402
from mhmoe.models.ops.head_sparse_attention.head_sparse_attention_naive import head_sparse_attention_naive  # noqa: E402

SECTIONS = ("check", "table", "flex", "parts", "tiles")
SHAPES = {  # name -> (heads, kv heads, head_dim, shared, {setting: routed active})
    "SmolLM2-135M": (9, 3, 64, 3, {"7/9": 4, "5/9": 2}),
    "LLaMA-3-8B": (32, 8, 128, 16, {"75%": 8, "62.5%": 4}),
}
SMOKE_SHAPES = {"SmolLM2-135M": (9, 3, 16, 3, {"7/9": 4}), "LLaMA-3-8B": (8, 2, 32, 4, {"75%": 2})}
PROFILED = (("LLaMA-3-8B", 16384, "75%"), ("SmolLM2-135M", 4096, "7/9"))
TILED = (  # the forward at alternatives to `tiles`: (block_m, block_n, num_warps, num_stages), the most telling first
    ("LLaMA-3-8B", 16384, "75%", (64, 64, 4, 3)),  # the tiles of the 939cae8 run: 64 rows, 4 warps
    ("SmolLM2-135M", 16384, "7/9", (128, 128, 8, 3)),  # half the loop steps at head dim 64
    ("LLaMA-3-8B", 16384, "75%", (128, 64, 8, 2)),  # two stages: two programs fit on an SM
    ("SmolLM2-135M", 16384, "7/9", (64, 64, 4, 3)),
)
PARTS = (  # kernel name pattern -> part (the first that matches)
    ("_row_lists_kernel", "triton row lists"),
    ("_key_block_bounds_kernel", "triton key-block bounds"),
    ("_forward_kernel", "triton forward"),
    ("_dq_kernel", "triton dQ + delta"),
    ("_dkdv_kernel", "triton dK/dV"),
    ("flash|fmha|attention|sdpa|cutlass", "SDPA kernels"),
    ("scan|cumsum", "cumsum"),
    ("scatter", "scatter"),
    ("searchsorted|bucketize", "searchsorted"),
    ("arange|range_factory|linspace", "arange"),
    ("fill|zero", "fills (zeros for inactive pairs / gradients)"),
    ("copy|transpose|cat|stack", "copies (contiguous, permute, stack)"),
    ("reduce|sum|all|any", "reductions (gates 0/1 check)"),
    ("elementwise|where|compare|mul|add|sub|div|clamp|ne|eq", "elementwise (active mask, gates, positions)"),
)


def draw_gates(tokens, heads, shared, active, device):
    gates = torch.zeros(1, tokens, heads, device=device)
    gates[..., :shared] = 1
    pick = torch.rand(1, tokens, heads - shared, device=device).argsort(-1)[..., :active] + shared
    return gates.scatter(-1, pick, 1.0)


def check(device, dtype, op=None) -> float:
    """Largest difference of `op` (default: the Triton kernels) from the reference on an odd shape (`dtype` inputs,
    fp32 reference), outputs and gradients; forward only off CUDA for the flex design (no CPU backward)."""
    torch.manual_seed(0)
    batch, heads, kv_heads, tokens, head_dim = 2, 6, 2, 97, 40
    query = torch.randn(batch, tokens, heads, head_dim, device=device).transpose(1, 2)
    key, value = (torch.randn(batch, kv_heads, tokens, head_dim, device=device) for _ in range(2))
    gates = (torch.rand(batch, tokens, heads, device=device) < 0.6).float()
    leaves = [x.to(dtype).requires_grad_() for x in (query, key, value)]
    ref_leaves = [x.detach().float().requires_grad_() for x in leaves]
    if op is head_sparse_attention_flex and device.type != "cuda":
        with torch.no_grad():
            got = op(*leaves, gates, head_dim**-0.5)
            want = head_sparse_attention_naive(*ref_leaves, gates, head_dim**-0.5)
        return (got.float() - want).abs().max().item()
    got = (op or hs.head_sparse_attention_triton)(*leaves, gates, head_dim**-0.5)
    want = head_sparse_attention_naive(*ref_leaves, gates, head_dim**-0.5)
    grad = torch.randn_like(want)
    got.backward(grad.to(got.dtype))
    want.backward(grad)
    worst = (got.float() - want).abs().max().item()
    for leaf, ref in zip(leaves, ref_leaves):
        worst = max(worst, (leaf.grad.float() - ref.grad).abs().max().item())
    return worst


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


def time_ms(fn, repeats, device) -> float:
    """Median time of `fn()` in ms after a warm-up call (CUDA events on a GPU)."""
    fn()
    _sync(device)
    times = []
    for _ in range(repeats):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end))
        else:
            started = time.perf_counter()
            fn()
            times.append((time.perf_counter() - started) * 1e3)
    return statistics.median(times)


class Cell:
    """One layer shape at one length and active setting: the inputs, and steps for SDPA and for the kernels."""

    def __init__(self, shape, tokens, setting, device, dtype, shapes=SHAPES):
        heads, kv_heads, head_dim, shared, settings = shapes[shape]
        self.head_dim = head_dim
        self.query = torch.randn(1, tokens, heads, head_dim, device=device, dtype=dtype).transpose(1, 2)
        self.key, self.value = (
            torch.randn(1, kv_heads, tokens, head_dim, device=device, dtype=dtype) for _ in range(2)
        )
        self.grad = torch.randn(1, tokens, heads, head_dim, device=device, dtype=dtype)
        self.gates = draw_gates(tokens, heads, shared, settings[setting], device)
        self.ideal = (shared + settings[setting]) / heads

    def sdpa(self, q, k, v):
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True).transpose(1, 2)

    def kernel(self, q, k, v, **tiles):
        return hs.head_sparse_attention_triton(q, k, v, self.gates, self.head_dim**-0.5, **tiles)

    def flex(self, q, k, v):
        return head_sparse_attention_flex(q, k, v, self.gates, self.head_dim**-0.5)

    def step(self, fn, mode):
        """A zero-argument call of `fn` (`sdpa` or `kernel`): forward without grad, or forward + backward."""

        def run():
            if mode == "forward":
                with torch.no_grad():
                    return fn(self.query, self.key, self.value)
            leaves = [x.detach().requires_grad_() for x in (self.query, self.key, self.value)]
            fn(*leaves).backward(self.grad)

        return run


def table_cells(shapes, token_counts, device, dtype):
    """Every (shape, tokens, active setting) cell of the table, one at a time (each holds its own inputs)."""
    for name, shape in shapes.items():
        for tokens in token_counts:
            for setting in shape[4]:
                yield Cell(name, tokens, setting, device, dtype, shapes), name, tokens, setting


def _part(kernel_name: str) -> str:
    for pattern, part in PARTS:
        if re.search(pattern, kernel_name, re.I):
            return part
    return "other"


def profile(step, steps, device) -> dict:
    """`steps` calls of `step` (after a warm-up), timed on the host, then again under torch.profiler: per call, the
    host's wall time (without and with the profiler), the host syncs of one call, the GPU time of each kernel and of
    each part, the GPU's busy time (kernel time summed), and the host time of the operators (on CPU, the smoke run:
    the operators' own time in place of kernels)."""
    from torch.profiler import ProfilerActivity, profile

    step()
    _sync(device)
    started = time.perf_counter()
    for _ in range(steps):
        step()
    _sync(device)
    plain_wall_us = (time.perf_counter() - started) * 1e6 / steps
    syncs = 0
    if device.type == "cuda":  # the host syncs one call makes (a `nonzero`, an `.item()`, a bool of a tensor)
        torch.cuda.set_sync_debug_mode("warn")
        try:
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                step()
            syncs = sum("synchroniz" in str(w.message) for w in caught)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        _sync(device)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities) as prof:
        started = time.perf_counter()
        for _ in range(steps):
            step()
        _sync(device)
        wall_us = (time.perf_counter() - started) * 1e6 / steps
    kernel_us, kernel_count, host_us = collections.Counter(), collections.Counter(), collections.Counter()
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            kernel_us[event.name] += event.time_range.elapsed_us() / steps
            kernel_count[event.name] += 1
        elif event.name.startswith("aten::") or "launch" in event.name.lower() or "Synchronize" in event.name:
            host_us[event.name] += event.self_cpu_time_total / steps
    if device.type != "cuda":  # the smoke run: the operators stand in for kernels
        kernel_us = collections.Counter({name: us for name, us in host_us.items() if name.startswith("aten::")})
        kernel_count = collections.Counter({name: steps for name in kernel_us})
    parts = collections.Counter()
    for name, us in kernel_us.items():
        parts[_part(name)] += us
    busy = sum(kernel_us.values())
    return {
        "wall_us": round(plain_wall_us, 1),
        "wall_us_profiled": round(wall_us, 1),
        "host_syncs": syncs,
        "gpu_busy_us": round(busy, 1),
        "busy_share": round(busy / wall_us, 3) if wall_us else None,
        "kernels_per_call": round(sum(kernel_count.values()) / steps, 1),
        "parts_us": {part: round(us, 1) for part, us in parts.most_common()},
        "kernels_us": [
            {"kernel": name[:140], "part": _part(name), "us": round(us, 1), "per_call": kernel_count[name] / steps}
            for name, us in kernel_us.most_common(14)
        ],
        "host_ops_us": [{"op": name[:80], "us": round(us, 1)} for name, us in host_us.most_common(12)],
        "counted": "CUDA kernels" if device.type == "cuda" else "aten operators (CPU smoke run)",
    }


def table_row(row) -> str:
    return (
        f"| {row['shape']} | {row['tokens']} | {row['active']} | {row['mode']} | {row['sdpa_ms']:.3f} | "
        f"{row['kernel_ms']:.3f} | **{row['ratio']:.2f}** | {row['ideal']:.2f} | {row['goal']:.2f} |"
    )


def flex_row(row, kernel_ratio) -> str:
    kernel = "–" if kernel_ratio is None else f"{kernel_ratio:.2f}"
    return (
        f"| {row['shape']} | {row['tokens']} | {row['active']} | {row['mode']} | {row['sdpa_ms']:.3f} | "
        f"{row['flex_ms']:.3f} | **{row['ratio']:.2f}** | {kernel} | {row['ideal']:.2f} | {row['goal']:.2f} |"
    )


def parts_lines(record) -> list[str]:
    kernel, sdpa = record["kernel"], record["sdpa"]
    lines = [
        f"{record['shape']} {record['tokens']} {record['active']} {record['mode']}: kernels {kernel['wall_us']:.0f} µs "
        f"wall / {kernel['gpu_busy_us']:.0f} µs GPU busy ({kernel['kernels_per_call']:g} kernels, "
        f"{kernel['host_syncs']} host syncs); SDPA "
        f"{sdpa['wall_us']:.0f} / {sdpa['gpu_busy_us']:.0f} µs"
    ]
    lines += [f"    {part}: {us:.1f} µs" for part, us in kernel["parts_us"].items()]
    return lines


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, nargs="+", default=[4096, 16384])
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--profile_steps", type=int, default=3)
    parser.add_argument("--sections", nargs="+", choices=SECTIONS, default=list(SECTIONS))
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--smoke", action="store_true", help="tiny shapes on CPU under TRITON_INTERPRET=1")
    args = parser.parse_args(argv)
    shapes, profiled, tiled = SHAPES, PROFILED, TILED
    if args.smoke:
        if not hs.interpreting():
            parser.error("--smoke runs the kernels on CPU: set TRITON_INTERPRET=1 before python starts")
        device, dtype = torch.device("cpu"), torch.float32
        shapes, args.tokens, args.repeats, args.profile_steps = SMOKE_SHAPES, [40], 1, 1
        profiled = (("LLaMA-3-8B", 40, "75%"),)
        tiled = (("LLaMA-3-8B", 40, "75%", (16, 16, 4, 3)),)
    elif not torch.cuda.is_available():
        print("needs a CUDA GPU (or --smoke under TRITON_INTERPRET=1)", file=sys.stderr)
        return 77
    else:
        device, dtype = torch.device("cuda"), torch.bfloat16
    started = time.time()
    result = gpu_moe.provenance(device)
    result["precision"] = {
        "operands": str(dtype).removeprefix("torch."),
        "accumulation": "fp32 (tl.dot and the softmax)",
        "tf32": result["precision"]["tf32"],
    }
    result["tiles"] = {  # what the launcher picks for these head dims (`tiles`), forward and backward
        f"hd={hd} {pass_}": hs.tiles(hd, dtype, backward=pass_ == "backward")._asdict()
        for hd in sorted({shape[2] for shape in shapes.values()})
        for pass_ in ("forward", "backward")
    }
    path = None if args.out is None else args.out / "gpu_head_sparse.json"

    def save(section=None):
        if section is not None:
            result.setdefault("section_seconds", {})[section] = round(time.time() - section_started, 1)
        result["seconds"] = round(time.time() - started, 1)
        result["finished_utc"] = gpu_moe._utc()
        if path is not None:
            gpu_moe.write_json(path, result)

    save()  # the header first: a run that stops early still says where it ran

    for section in args.sections:
        section_started = time.time()
        try:  # a section that fails (a kernel that does not compile here, say) is recorded; the next still runs
            if section == "check":
                result["check_max_abs_diff"] = check(device, dtype)
                result["check_flex_max_abs_diff"] = check(device, dtype, head_sparse_attention_flex)
                print(
                    f"{result['device']}, torch {result['torch']}, triton {result['triton']}; vs reference "
                    f"({result['precision']['operands']}): kernels max |Δ| {result['check_max_abs_diff']:.3g}, "
                    f"flex {result['check_flex_max_abs_diff']:.3g}",
                    flush=True,
                )
            elif section == "table":
                result["rows"] = []
                print("| shape | tokens | active | pass | SDPA ms | kernel ms | kernel / SDPA | ideal | goal |")
                print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |", flush=True)
                for cell, name, tokens, setting in table_cells(shapes, args.tokens, device, dtype):
                    for mode in ("forward", "forward+backward"):
                        dense_ms = time_ms(cell.step(cell.sdpa, mode), args.repeats, device)
                        sparse_ms = time_ms(cell.step(cell.kernel, mode), args.repeats, device)
                        row = dict(
                            shape=name,
                            tokens=tokens,
                            active=setting,
                            mode=mode,
                            sdpa_ms=dense_ms,
                            kernel_ms=sparse_ms,
                            ratio=sparse_ms / dense_ms,
                            ideal=cell.ideal,
                            goal=cell.ideal + 0.10,
                        )
                        result["rows"].append(row)
                        print(table_row(row), flush=True)
                        save(section)
                    del cell
            elif section == "flex":
                result["flex_rows"] = []
                kernel = {(r["shape"], r["tokens"], r["active"], r["mode"]): r["ratio"] for r in result.get("rows", [])}
                print(
                    "| shape | tokens | active | pass | SDPA ms | flex ms | flex / SDPA | kernel / SDPA | ideal | goal |"
                )
                print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |", flush=True)
                modes = ("forward", "forward+backward") if device.type == "cuda" else ("forward",)
                for cell, name, tokens, setting in table_cells(shapes, args.tokens, device, dtype):
                    for mode in modes:
                        dense_ms = time_ms(cell.step(cell.sdpa, mode), args.repeats, device)
                        flex_ms = time_ms(cell.step(cell.flex, mode), args.repeats, device)
                        row = dict(shape=name, tokens=tokens, active=setting, mode=mode, sdpa_ms=dense_ms)
                        row.update(flex_ms=flex_ms, ratio=flex_ms / dense_ms, ideal=cell.ideal)
                        row["goal"] = cell.ideal + 0.10
                        result["flex_rows"].append(row)
                        print(flex_row(row, kernel.get((name, tokens, setting, mode))), flush=True)
                        save(section)
                    del cell
            elif section == "parts":
                result["parts"] = []
                for name, tokens, setting in profiled:
                    cell = Cell(name, tokens, setting, device, dtype, shapes)
                    for mode in ("forward", "forward+backward"):
                        record = dict(shape=name, tokens=tokens, active=setting, mode=mode)
                        for label, fn in (("kernel", cell.kernel), ("sdpa", cell.sdpa)):
                            record[label] = profile(cell.step(fn, mode), args.profile_steps, device)
                        result["parts"].append(record)
                        print("\n".join(parts_lines(record)), flush=True)
                        save(section)
                    del cell
            elif section == "tiles":
                result["tile_configs"] = []
                cells = {}  # shape -> (cell, SDPA ms); each shape's default tiles timed first, as the reference
                for name, tokens, setting, config in tiled:
                    if name not in cells:
                        cell = Cell(name, tokens, setting, device, dtype, shapes)
                        cells[name] = cell, time_ms(cell.step(cell.sdpa, "forward"), args.repeats, device)
                        default = hs.tiles(cell.head_dim, dtype)
                        configs = [(default.block_m, default.block_n, default.num_warps, default.num_stages), config]
                    else:
                        configs = [config]
                    cell, dense_ms = cells[name]
                    for index, (block_m, block_n, num_warps, num_stages) in enumerate(configs):
                        tiles = dict(block_m=block_m, block_n=block_n, num_warps=num_warps, num_stages=num_stages)
                        record = dict(shape=name, tokens=tokens, active=setting, mode="forward", **tiles)
                        record["default"] = len(configs) == 2 and index == 0
                        try:
                            ms = time_ms(
                                cell.step(lambda q, k, v: cell.kernel(q, k, v, **tiles), "forward"),
                                args.repeats,
                                device,
                            )
                            record.update(kernel_ms=ms, sdpa_ms=dense_ms, ratio=ms / dense_ms)
                        except Exception as error:  # a config that does not compile or fit: recorded, the others run
                            record["error"] = f"{type(error).__name__}: {str(error)[:300]}"
                        result["tile_configs"].append(record)
                        shown = f"{record['ratio']:.2f} of SDPA" if "ratio" in record else record["error"]
                        print(
                            f"tiles {name} {tokens} {setting} forward {block_m}x{block_n} warps={num_warps} "
                            f"stages={num_stages}{' (default)' if record['default'] else ''}: {shown}",
                            flush=True,
                        )
                        save(section)
                del cells
        except Exception as error:
            result.setdefault("errors", {})[section] = f"{type(error).__name__}: {str(error)[:500]}"
            print(f"{section}: FAILED {result['errors'][section]}", flush=True)
        save(section)
    if args.smoke:
        print("(smoke run on CPU: tiny shapes, not a measurement)")
    return 1 if result.get("errors") else 0


if __name__ == "__main__":
    sys.exit(main())
