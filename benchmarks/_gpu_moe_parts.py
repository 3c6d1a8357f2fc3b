"""Where the MH-MoE h=3 block's GPU time goes: the `parts` and `compiled` sections of benchmarks/gpu_moe.py.

parts      the h=3 block's forward cut into the steps `experts.grouped_experts_forward` and the block run (no grad, bf16):
           head layer, router GEMM (fp32), route (softmax + top-k), sort by expert (with the slots' positions: free
           from the counting sort, an `index_copy_` after PyTorch's), gather of the
           rows, gate/up grouped GEMM, act·up, down grouped GEMM, combine (gather the K slots, weight, sum), merge
           layer; each timed alone, eagerly and replayed from a CUDA graph (the device's time without the host's
           launch cost), beside the whole block forward and forward+backward. Then one profiled forward+backward of
           the h=3, SMoE and Mixtral blocks: GPU kernels launched, the GPU's busy time against the wall time, host
           syncs (torch.cuda.set_sync_debug_mode), and the largest kernels; and at a quarter of the tokens each
           block's fwd+bwd wall time (no profiler) against its GPU busy time: whether the host is the limit there.
compiled   fwd+bwd of Transformers' Mixtral block, our SMoE and h=3 blocks under torch.compile (default, and
           "reduce-overhead": CUDA graphs) against eager, interleaved; with the compile time of each.

The steps follow `experts_grouped_mm._experts_forward` and `MHMoESparseMoeBlock.forward` as they are at the commit recorded in the
results file; a step that fails (say, a helper renamed) is recorded with its error and the others still run.
"""

from __future__ import annotations

import collections
import time
import warnings

import torch
import torch.nn.functional as F


def _graphed(fn, device):
    """fn captured in a CUDA graph (after a warm-up on a side stream): a function replaying it; None on CPU."""
    if device.type != "cuda":
        return None
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph.replay


def block_parts(block, x) -> dict:
    """{part: fn} for the h=3 block's forward on `x` (1, T, d), inputs of each part computed once beforehand."""
    from mhmoe.models.mhmoe.experts import grouped_experts_forward
    from mhmoe.models.ops import backends as routing
    from mhmoe.models.ops.experts import experts_grouped_mm, grouped_gemm

    experts, gate = block.experts, block.gate
    k, num_experts = gate.top_k, experts.num_experts
    width = x.shape[-1] // block.moe_heads
    state = {}
    with torch.no_grad():
        state["sub"] = block.head_proj(x).reshape(-1, width)  # (N, W)
        state["logits"] = F.linear(state["sub"].float(), gate.weight.float())  # (N, E)
        state["weights"], state["index"] = routing.route(
            state["logits"], k, gate.norm_topk_prob, gate.capacity_factor, gate.routing_backend, gate.capacity_rounding
        )
        state["order"], state["offsets"], state["slot_pos"] = routing.sort_by_expert(
            state["index"], num_experts, positions=True
        )
        state["rows"] = state["sub"].index_select(0, state["order"] // k)  # (S, W)
        state["gate_up"] = grouped_gemm.grouped_mm(
            state["rows"], experts.gate_up_proj.transpose(1, 2), state["offsets"]
        )
        inter = experts.intermediate_dim
        state["hidden"] = F.silu(state["gate_up"][:, :inter]) * state["gate_up"][:, inter:]  # (S, I)
        state["expert_out"] = grouped_gemm.grouped_mm(
            state["hidden"], experts.down_proj.transpose(1, 2), state["offsets"]
        )
        state["dropped"] = state["index"].reshape(-1) >= num_experts
        state["combined"] = torch.zeros_like(x)

    # act·up and the combine as the block runs them: the fused Triton steps on CUDA (SiLU), else PyTorch's
    fused = experts_grouped_mm._steps_kernels(state["gate_up"], experts.act_fn)

    def act_up():
        if fused:
            return experts_grouped_mm.swiglu(state["gate_up"])
        return F.silu(state["gate_up"][:, :inter]) * state["gate_up"][:, inter:]

    def combine():
        if fused:
            args = (state["expert_out"], state["slot_pos"], state["dropped"], state["weights"], k, x.dtype)
            return experts_grouped_mm.combine_slots(*args)
        slots = experts_grouped_mm._gather_slots(state["expert_out"], state["slot_pos"], state["dropped"]).view(
            -1, k, width
        )
        return torch.bmm(state["weights"].float().unsqueeze(1), slots.float()).squeeze(1).to(x.dtype)

    return {
        "head layer": lambda: block.head_proj(x),
        "router GEMM (fp32)": lambda: F.linear(state["sub"].float(), gate.weight.float()),
        "route": lambda: routing.route(
            state["logits"], k, gate.norm_topk_prob, gate.capacity_factor, gate.routing_backend, gate.capacity_rounding
        ),
        "sort by expert": lambda: routing.sort_by_expert(state["index"], num_experts, positions=True),
        "gather rows": lambda: state["sub"].index_select(0, state["order"] // k),
        "gate/up grouped GEMM": lambda: grouped_gemm.grouped_mm(
            state["rows"], experts.gate_up_proj.transpose(1, 2), state["offsets"]
        ),
        "act·up": act_up,
        "down grouped GEMM": lambda: grouped_gemm.grouped_mm(
            state["hidden"], experts.down_proj.transpose(1, 2), state["offsets"]
        ),
        "combine (gather K slots, weight, sum)": combine,
        "merge layer": lambda: block.merge_proj(state["combined"]),
        "experts as the block runs them": lambda: grouped_experts_forward(
            experts, state["sub"], state["index"], state["weights"]
        ),
        "whole block forward": lambda: block(x),
    }


def fwd_bwd_step(block, x, grad):
    """A call running one forward+backward of `block` on a fresh leaf copy of `x` (its gradients cleared first)."""

    def run():
        inp = x.detach().requires_grad_()
        block.zero_grad(set_to_none=True)
        out = block(inp)
        (out[0] if isinstance(out, tuple) else out).backward(grad)

    return run


def profile_step(block, x, grad, device) -> dict:
    """One forward+backward of `block` after a warm-up: kernels launched, GPU busy µs, wall µs, host syncs, the
    largest kernels (on CPU: the aten operators run, in place of kernels)."""
    from torch.profiler import ProfilerActivity, profile

    step = fwd_bwd_step(block, x, grad)
    step()
    syncs = 0
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("warn")
        try:
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                step()
                torch.cuda.synchronize()
            syncs = sum("synchroniz" in str(w.message) for w in caught)
        finally:
            torch.cuda.set_sync_debug_mode("default")
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    started = time.perf_counter()
    with profile(activities=activities) as prof:
        step()
        if device.type == "cuda":
            torch.cuda.synchronize()
    wall_us = (time.perf_counter() - started) * 1e6
    kernels, busy = collections.Counter(), collections.Counter()
    for event in prof.events():
        on_device = event.device_type == torch.autograd.DeviceType.CUDA
        if on_device or (device.type == "cpu" and event.name.startswith("aten::")):
            kernels[event.name] += 1
            busy[event.name] += event.time_range.elapsed_us() if on_device else 0
    top = [{"kernel": name[:120], "count": kernels[name], "us": round(us, 1)} for name, us in busy.most_common(12)]
    return {
        "kernels": sum(kernels.values()),
        "gpu_busy_us": round(sum(busy.values()), 1),
        "wall_us_profiled": round(wall_us, 1),
        "host_syncs": syncs,
        "largest_kernels": top,
        "counted": "CUDA kernels" if device.type == "cuda" else "aten operators (CPU smoke run)",
    }


def time_parts(build_blocks, interleaved, hidden: int, tokens: int, repeats: int, dtype, device) -> dict:
    """The `parts` section (see the module docstring)."""
    blocks = build_blocks(hidden, dtype, device)
    block = blocks["ours_h3"]
    x = torch.randn(1, tokens, hidden, device=device, dtype=dtype)
    grad = torch.randn_like(x)
    result = {
        "hidden": hidden,
        "tokens": tokens,
        "moe_heads": block.moe_heads,
        "experts": block.experts.num_experts,
        "top_k": block.gate.top_k,
        "parts": {},
        "errors": {},
    }
    with torch.no_grad():
        parts = block_parts(block, x)
        eager, graphed = {}, {}
        for name, fn in parts.items():
            try:
                fn()  # runs at all
                eager[name] = fn
                replay = _graphed(fn, device)
                if replay is not None:
                    graphed[name] = replay
            except Exception as error:  # a failing part (or capture) is a result, not the end of the section
                result["errors"][name] = f"{type(error).__name__}: {error}"[:300]
        eager_times = interleaved(eager, repeats, device)
        graph_times = interleaved(graphed, repeats, device) if graphed else {}
    for name in parts:
        if name in eager_times:
            result["parts"][name] = {
                "eager_us": 1e3 * eager_times[name]["ms"],
                "graph_us": 1e3 * graph_times[name]["ms"] if name in graph_times else None,
            }
    step_parts = [n for n in result["parts"] if n not in ("experts as the block runs them", "whole block forward")]
    result["sum_of_parts_eager_us"] = sum(result["parts"][n]["eager_us"] for n in step_parts)

    whole = interleaved({"fwd+bwd": fwd_bwd_step(block, x, grad)}, repeats, device)
    result["whole_fwd_bwd_us"] = 1e3 * whole["fwd+bwd"]["ms"]
    result["profiles"] = {}
    for name in ("hf_mixtral", "ours_smoe", "ours_h3"):
        try:
            result["profiles"][name] = profile_step(blocks[name], x, grad, device)
        except Exception as error:
            result["errors"][f"profile {name}"] = f"{type(error).__name__}: {error}"[:300]
    try:
        result["host_bound"] = host_bound(blocks, x[:, : max(1, tokens // 4)], interleaved, repeats, device)
    except Exception as error:
        result["errors"]["host_bound"] = f"{type(error).__name__}: {error}"[:300]
    return result


def host_bound(blocks, x, interleaved, repeats, device) -> dict:
    """At a quarter of the tokens (where the 8K cells missed): each block's fwd+bwd wall time (interleaved, no
    profiler) against its GPU busy time (one profiled step). Wall far above busy: the host is the limit. On CUDA also
    the same eager block captured whole, forward and backward, in CUDA graphs (`torch.cuda.make_graphed_callables`):
    the wall time without the host's per-launch cost (a block that syncs with the host cannot be captured: its error
    is recorded). Last: capturing replaces the blocks' forward."""
    grad = torch.randn_like(x)
    names = ("hf_mixtral", "ours_smoe", "ours_h3")
    walls = interleaved({name: fwd_bwd_step(blocks[name], x, grad) for name in names}, repeats, device)
    cells, errors = {}, {}
    for name in names:
        prof = profile_step(blocks[name], x, grad, device)
        cells[name] = {
            "wall_us": 1e3 * walls[name]["ms"],
            "gpu_busy_us": prof["gpu_busy_us"],
            "kernels": prof["kernels"],
        }
    graphed = {}
    for name in names if device.type == "cuda" else ():
        try:
            sample = (x.detach().requires_grad_(),)
            graphed[name] = fwd_bwd_step(torch.cuda.make_graphed_callables(blocks[name], sample), x, grad)
            graphed[name]()  # a replay runs at all
        except Exception as error:
            errors[name] = f"{type(error).__name__}: {error}"[:300]
            graphed.pop(name, None)
    for name, timing in (interleaved(graphed, repeats, device) if graphed else {}).items():
        cells[name]["cuda_graph_wall_us"] = 1e3 * timing["ms"]
    return {"tokens": x.shape[1], "blocks": cells, "cuda_graph_errors": errors}


def time_compiled(
    build_blocks,
    interleaved,
    hidden: int,
    tokens: int,
    repeats: int,
    dtype,
    device,
    save,
    modes=("default", "reduce-overhead"),
) -> dict:
    """The `compiled` section: fwd+bwd of the Mixtral, SMoE and h=3 blocks, eager and compiled in each mode, timed
    against eager Mixtral, each compiled block's output and input gradient checked against its eager run (the largest
    difference relative to the eager values' largest, in `max_relative_error`); `save()` after each compiled block
    (compiles are slow: a cut run keeps what finished). On CPU (smoke) the compiler is Dynamo alone (backend
    "eager"): the code path, not a speed."""
    blocks = build_blocks(hidden, dtype, device)
    x = torch.randn(1, tokens, hidden, device=device, dtype=dtype)
    grad = torch.randn_like(x)
    result = {
        "hidden": hidden,
        "tokens": tokens,
        "modes": list(modes),
        "compile_seconds": {},
        "errors": {},
        "max_relative_error": {},
        "times": {},
    }

    def outputs(module) -> list[torch.Tensor]:
        """One fwd+bwd: the output and the input's gradient."""
        inp = x.detach().requires_grad_()
        out = module(inp)
        out = out[0] if isinstance(out, tuple) else out
        out.backward(grad)
        for p in module.parameters():
            p.grad = None
        return [out.detach().float(), inp.grad.float()]

    def forward_backward(module):
        def run():
            inp = x.detach().requires_grad_()
            out = module(inp)
            (out[0] if isinstance(out, tuple) else out).backward(grad)
            for p in module.parameters():
                p.grad = None

        return run

    candidates = {f"{name} eager": forward_backward(blocks[name]) for name in ("hf_mixtral", "ours_smoe", "ours_h3")}
    for mode in modes:
        for name in ("ours_h3", "hf_mixtral", "ours_smoe"):
            label = f"{name} {mode}"
            try:
                options = {"backend": "eager"} if device.type != "cuda" else {"mode": mode}
                compiled = torch.compile(blocks[name], fullgraph=False, dynamic=False, **options)
                started = time.perf_counter()
                run = forward_backward(compiled)
                for _ in range(3):  # compile, then the warm-ups reduce-overhead records its graphs in
                    run()
                if device.type == "cuda":
                    torch.cuda.synchronize()
                result["compile_seconds"][label] = round(time.perf_counter() - started, 1)
                candidates[label] = run
                pairs = zip(outputs(compiled), outputs(blocks[name]))  # the routing is deterministic: same choices
                errors = [float((a - b).abs().max() / b.abs().max().clamp_min(1e-12)) for a, b in pairs]
                result["max_relative_error"][label] = round(max(errors), 5)
            except Exception as error:
                result["errors"][label] = f"{type(error).__name__}: {error}"[:300]
            result["times"] = interleaved(candidates, repeats, device, "hf_mixtral eager")
            save()
    return result


def markdown_parts(parts: dict) -> str:
    lines = [
        f"| h=3 block forward, d={parts['hidden']}, {parts['tokens']} tokens (E={parts['experts']}, "
        f"k={parts['top_k']}): part | eager µs | CUDA-graph replay µs |",
        "| --- | --- | --- |",
    ]
    for name, cells in parts["parts"].items():
        graph = f"{cells['graph_us']:,.1f}" if cells.get("graph_us") is not None else "-"
        lines.append(f"| {name} | {cells['eager_us']:,.1f} | {graph} |")
    lines.append(f"| sum of the steps (eager) | {parts['sum_of_parts_eager_us']:,.1f} | |")
    lines.append(f"| whole block forward+backward | {parts['whole_fwd_bwd_us']:,.1f} | |")
    lines += [f"- FAILED {name}: {error}" for name, error in parts.get("errors", {}).items()]
    if parts.get("host_bound"):
        bound = parts["host_bound"]
        lines += [
            "",
            f"| fwd+bwd at {bound['tokens']} tokens | wall µs | GPU busy µs | busy / wall | kernels | "
            "CUDA-graphed wall µs |",
            "| --- | --- | --- | --- | --- | --- |",
        ]
        for name, cell in bound["blocks"].items():
            graphed = cell.get("cuda_graph_wall_us")
            lines.append(
                f"| {name} | {cell['wall_us']:,.0f} | {cell['gpu_busy_us']:,.0f} | "
                f"{cell['gpu_busy_us'] / cell['wall_us']:.0%} | {cell['kernels']} | "
                + (f"{graphed:,.0f} |" if graphed is not None else "- |")
            )
        lines += [f"- not captured: {name}: {error}" for name, error in bound.get("cuda_graph_errors", {}).items()]
    if parts.get("profiles"):
        lines += [
            "",
            "| one fwd+bwd, profiled | kernels | GPU busy µs | wall µs | host syncs | largest kernel |",
            "| --- | --- | --- | --- | --- | --- |",
        ]
        for name, prof in parts["profiles"].items():
            top = prof["largest_kernels"][0] if prof["largest_kernels"] else {}
            largest = f"{top.get('kernel', '-')[:60]} ({top.get('us', 0):,.0f} µs)" if top else "-"
            lines.append(
                f"| {name} | {prof['kernels']} | {prof['gpu_busy_us']:,.0f} | {prof['wall_us_profiled']:,.0f}"
                f" | {prof['host_syncs']} | {largest} |"
            )
    return "\n".join(lines)


def markdown_compiled(compiled: dict) -> str:
    lines = [
        f"| fwd+bwd, d={compiled['hidden']}, {compiled['tokens']} tokens | vs Mixtral eager | ms | compile s | "
        "max relative error vs eager |",
        "| --- | --- | --- | --- | --- |",
    ]
    for name, cells in compiled["times"].items():
        seconds = compiled["compile_seconds"].get(name)
        error = compiled.get("max_relative_error", {}).get(name)
        compile_s, error = ("-" if seconds is None else seconds), ("-" if error is None else f"{error:.1e}")
        lines.append(f"| {name} | {cells['ratio']:.2f}x | {cells['ms']:.2f} | {compile_s} | {error} |")
    lines += [f"- FAILED {name}: {error}" for name, error in compiled.get("errors", {}).items()]
    return "\n".join(lines)
