"""GPU checks and speed of the MoE layers, a whole-model training step and the routing kernels, on CUDA (issue #23).

Sections, in this order, each written to `--out DIR/gpu_moe.json` (atomically) the moment it finishes, so a run killed
at its time limit still leaves what it measured:

  checks   every kernel against its PyTorch reference, forward and backward, bf16 and fp32: the routing kernels
           (route, sort_by_expert; NaN logits give in-range ids), the MoH head-router kernel, the Triton experts
           (outputs and every gradient) and the grouped GEMM's paths (ops/experts/grouped_gemm.py: torch's kernel,
           the tiled no-host-sync path);
           max abs / relative errors and pass/fail at the dtype's tolerance (fp32 tl.dot runs as TF32: 1e-2 relative)
  blocks   fwd and fwd+bwd times of MoE blocks relative to Transformers' Mixtral block (`grouped_mm`, E=8 k=1
           f≈8d/3), bf16: our SMoE block (same shapes), MH-MoE h=2 and h=3 (`matched_to_smoe`), a dense SwiGLU MLP of
           the same FLOPs, and the h=3 block on the Triton experts (`ours_h3_triton`)
  model    a whole training step (forward, backward, AdamW) of MH-MoE h=3 and SMoE (and dense) at equal activated
           FLOPs, bf16 autocast with fp32 master weights as the reproduction trains: tokens/s and peak memory
           (`torch.cuda.max_memory_allocated`); h=3 also with `experts_grouped_mm.RECOMPUTE_GATE_UP` (gate/up recomputed in the
           backward: less memory, one more grouped GEMM)
  routing  16,384 rows × 96 experts, top-3: the Triton routing kernels against the PyTorch reference, in µs
  head_router  the MoH l2 head-router kernel against its reference (16,384 tokens × 32 heads × 64), in µs
  gemm     the h=3 experts in TFLOP/s (torch grouped GEMM and the Triton experts, forward) against a dense bf16 GEMM
           of the same FLOPs

Every timing: interleaved rounds (the candidates take turns, the order rotating each round), two warm-up rounds,
medians; ratios are medians of per-round ratios. Device, commit (and dirty flag) and versions head the file.

Usage:
  python benchmarks/gpu_moe.py [--out DIR] [--hidden 768 1536] [--tokens 8192 32768] [--repeats 20] [--sections ...]
      writes DIR/gpu_moe.json (default DIR: benchmarks/results/gpu_moe-<device>-<commit>/) and prints the tables
  python benchmarks/gpu_moe.py --table [--write_table]
      prints the table of every benchmarks/results/gpu_moe*/gpu_moe.json (--write_table: also into benchmarks/README.md)
  python benchmarks/gpu_moe.py --smoke [--out DIR]
      tiny shapes on CPU (the checks under TRITON_INTERPRET=1 when set): checks that the script runs
Without CUDA (and without --smoke / --table / --write_table) it prints that no GPU is available and exits 0.
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import os
import platform
import re
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import _gpu_moe_parts  # noqa: E402
import _provenance  # noqa: E402

RESULTS = HERE / "results"
README = HERE / "README.md"
TABLE_START, TABLE_END = "<!-- gpu_moe table start -->", "<!-- gpu_moe table end -->"
SECTIONS = ("checks", "blocks", "model", "routing", "head_router", "gemm", "parts", "compiled")


# --------------------------------------------------------------------------------------------------------------------
# timing


def _timer(device: torch.device):
    """A function timing `fn()` in seconds (CUDA events on a GPU)."""
    if device.type == "cuda":

        def timed(fn):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            return start.elapsed_time(end) / 1e3

        return timed

    def timed(fn):
        start = time.perf_counter()
        fn()
        return time.perf_counter() - start

    return timed


def interleaved(candidates: dict, repeats: int, device: torch.device, reference: str | None = None) -> dict:
    """{name: fn}: `repeats` rounds after two warm-up rounds, each round every candidate once, the order rotated by one
    each round. Returns {name: {"ms": median, "ratio": median of per-round time / reference time}}."""
    timed = _timer(device)
    names = list(candidates)
    times = {name: [] for name in names}
    for round_index in range(repeats + 2):
        shift = round_index % len(names)
        for name in names[shift:] + names[:shift]:
            elapsed = timed(candidates[name])
            if round_index >= 2:
                times[name].append(elapsed)
    out = {}
    for name, values in times.items():
        out[name] = {"ms": 1e3 * statistics.median(values)}
        if reference is not None:
            out[name]["ratio"] = statistics.median(a / b for a, b in zip(values, times[reference]))
    return out


# --------------------------------------------------------------------------------------------------------------------
# checks


def _errors(name: str, got, ref, tol: float) -> dict:
    got, ref = got.detach().double(), ref.detach().double()
    abs_err = (got - ref).abs().max().item() if got.numel() else 0.0
    scale = ref.abs().max().item() if ref.numel() else 0.0
    rel = abs_err / scale if scale else abs_err
    ok = bool(math.isfinite(abs_err) and rel <= tol)
    return {"check": name, "max_abs_error": abs_err, "max_rel_error": rel, "tolerance": tol, "ok": ok}


TOLERANCE = {torch.float32: 1e-2, torch.bfloat16: 3e-2}  # fp32 dots run as TF32 in the kernels (10-bit mantissa)


def check_kernels(device: torch.device, smoke: bool) -> list[dict]:
    """Every kernel against its reference, forward and backward, bf16 and fp32 (see the module docstring)."""
    from mhmoe.models.ops.experts import experts_grouped_mm, experts_naive, experts_triton, grouped_gemm
    from mhmoe.models.ops.head_router import head_router_naive, head_router_triton
    from mhmoe.models.ops.routing import routing_naive, routing_triton

    results = []
    kernels = routing_triton.HAS_TRITON and (device.type == "cuda" or os.environ.get("TRITON_INTERPRET") == "1")

    def attempt(name, fn):
        try:
            results.extend(fn())
        except Exception as error:  # a failing kernel is a result, not the end of the benchmark
            results.append({"check": name, "ok": False, "error": f"{type(error).__name__}: {error}"[:500]})

    rows, experts, top_k, width, inter = (64, 12, 3, 16, 32) if smoke else (4096, 96, 3, 256, 512)  # E: no power of 2
    g = torch.Generator(device="cpu").manual_seed(0)
    for dtype in (torch.float32, torch.bfloat16):
        tag = str(dtype).removeprefix("torch.")
        logits = torch.randn(rows, experts, generator=g).to(device=device, dtype=dtype)

        def routing_checks(logits=logits, tag=tag):
            out = []
            ref_w, ref_e = routing_naive.route(logits, top_k, True)
            got_w, got_e = routing_triton.route(logits, top_k, True)
            out.append(_errors(f"route weights {tag}", got_w, ref_w, 1e-5))
            # ids: equal, or where they differ a tie (bf16 logits tie often): the same probabilities chosen
            probs = torch.softmax(logits.float(), dim=-1)
            same_choice = torch.equal(probs.gather(-1, got_e).sort(-1).values, probs.gather(-1, ref_e).sort(-1).values)
            out.append(
                {
                    "check": f"route ids {tag}",
                    "ok": bool(torch.equal(got_e, ref_e) or same_choice),
                    "mismatches": int((got_e != ref_e).sum()),
                    "ties_only": bool(same_choice),
                }
            )
            # the logits' gradient (the backward kernel), on the rows where both chose the same experts
            leaves = [logits.detach().clone().requires_grad_() for _ in range(2)]
            probe = torch.linspace(-1, 2, rows * top_k, device=device).view(rows, top_k)
            for leaf, route in zip(leaves, (routing_triton.route, routing_naive.route)):
                (route(leaf, top_k, True)[0] * probe).sum().backward()
            alike = (got_e == ref_e).all(-1)
            out.append(_errors(f"route logits' gradient {tag}", leaves[0].grad[alike], leaves[1].grad[alike], 1e-2))
            ref_o, ref_off = routing_naive.sort_by_expert(ref_e, experts)
            got_o, got_off, got_pos = routing_triton.sort_by_expert(ref_e, experts, positions=True)
            out.append(
                {
                    "check": f"sort_by_expert {tag}",
                    "ok": bool(
                        torch.equal(got_o, ref_o)
                        and torch.equal(got_off, ref_off)
                        and torch.equal(got_o[got_pos], torch.arange(ref_e.numel(), device=device))
                    ),
                }
            )
            # the same kernels as the custom ops traced graphs call (torch.compile): the same results, bit for bit
            op_w, op_e = torch.ops.mhmoe.softmax_topk(logits, top_k, True, True)
            op_pos, op_o, _, op_ends = torch.ops.mhmoe.counting_sort(ref_e.reshape(-1), experts + 1, True, True)
            leaf = logits.detach().clone().requires_grad_()
            (torch.ops.mhmoe.softmax_topk(leaf, top_k, True, True)[0] * probe).sum().backward()
            same = [torch.equal(op_w, got_w), torch.equal(op_e, got_e), torch.equal(leaf.grad, leaves[0].grad)]
            same += [torch.equal(op_o, got_o), torch.equal(op_pos, got_pos), torch.equal(op_ends[:experts], got_off)]
            out.append({"check": f"route and sort custom ops {tag}", "ok": all(same)})
            bad = logits.clone()
            bad[::7, :3] = float("nan")
            bad[1::7, 5] = float("inf")
            _, ids = routing_triton.route(bad, top_k, True)
            torch.cuda.synchronize() if device.type == "cuda" else None
            out.append(
                {
                    "check": f"route NaN/inf logits {tag}: ids in range",
                    "ok": bool(((ids >= 0) & (ids <= experts)).all()),
                }
            )
            return out

        if kernels:
            attempt(f"routing {tag}", routing_checks)

        def head_router_checks(dtype=dtype, tag=tag):
            heads, head_dim = (8, 16) if smoke else (32, 64)
            queries = torch.randn(rows, heads, head_dim, generator=g).to(device=device, dtype=dtype)
            out = []
            for straight_through in (False, True):
                q_ref = queries.clone().requires_grad_()
                q_got = queries.clone().requires_grad_()
                ref = head_router_naive.l2_head_gates(q_ref, 2, heads // 2, straight_through)
                got = head_router_triton.l2_head_gates_triton(q_got, 2, heads // 2, straight_through)
                out.append(_errors(f"head router gates {tag} st={straight_through}", got[0], ref[0], TOLERANCE[dtype]))
                if ref[0].requires_grad:
                    grad = torch.randn_like(ref[0])
                    (g_ref,) = torch.autograd.grad(ref[0], q_ref, grad)
                    (g_got,) = torch.autograd.grad(got[0], q_got, grad)
                    out.append(
                        _errors(f"head router d queries {tag} st={straight_through}", g_got, g_ref, TOLERANCE[dtype])
                    )
            return out

        if kernels:
            attempt(f"head router {tag}", head_router_checks)

        weights_gu = (torch.randn(experts, 2 * inter, width, generator=g) * width**-0.5).to(device=device, dtype=dtype)
        weights_dn = (torch.randn(experts, width, inter, generator=g) * inter**-0.5).to(device=device, dtype=dtype)
        hidden = torch.randn(rows, width, generator=g).to(device=device, dtype=dtype)
        route_w, route_e = routing_naive.route(logits.float(), top_k, True)
        grad_out = torch.randn(rows, width, generator=g).to(device=device, dtype=dtype)

        def run_experts(forward, hidden=hidden, route_w=route_w, route_e=route_e, grad_out=grad_out):
            leaves = [t.detach().clone().requires_grad_() for t in (hidden, route_w, weights_gu, weights_dn)]
            out = forward(*leaves)
            grads = torch.autograd.grad(out, leaves, grad_out)
            return out, grads

        def experts_checks(name, forward, dtype=dtype, tag=tag, route_e=route_e):
            """An experts op (output and all four gradients) against the fp64 reference."""
            ref_out, ref_grads = run_experts(
                lambda x, w, gu, dn: experts_naive.experts_forward(
                    x.double(), route_e, w.double(), gu.double(), dn.double()
                )
            )
            order, offsets = routing_naive.sort_by_expert(route_e, experts)
            got_out, got_grads = run_experts(lambda x, w, gu, dn: forward(x, route_e, w, gu, dn, order, offsets))
            out = [_errors(f"{name} out {tag}", got_out, ref_out, TOLERANCE[dtype])]
            for label, got, ref in zip(
                ("d rows", "d routing weights", "d gate_up_proj", "d down_proj"), got_grads, ref_grads
            ):
                out.append(_errors(f"{name} {label} {tag}", got, ref, TOLERANCE[dtype]))
            return out

        def grouped_experts(x, route_e, w, gu, dn, order, offsets):
            """The default experts op on CUDA: grouped GEMMs with the fused SwiGLU / combine steps (Triton)."""
            return experts_grouped_mm.experts_forward(x, route_e, w, gu, dn, torch.nn.SiLU(), order, offsets)

        def grouped_experts_op(x, route_e, w, gu, dn, order, offsets):
            """The same as the custom op traced graphs call on CUDA (torch.compile), its backward op included."""
            _, _, positions = routing_naive.sort_by_expert(route_e, experts, positions=True)
            dropped = route_e.reshape(-1) >= experts
            return torch.ops.mhmoe.grouped_mm_experts(x, w, gu, dn, order, offsets, positions, dropped)[0]

        if kernels:
            attempt(f"triton experts {tag}", lambda: experts_checks("triton experts", experts_triton.experts_forward))
            attempt(f"grouped_mm experts {tag}", lambda: experts_checks("grouped_mm experts", grouped_experts))
            attempt(f"grouped_mm experts op {tag}", lambda: experts_checks("grouped_mm experts op", grouped_experts_op))

        def grouped_mm_checks(dtype=dtype, tag=tag, route_e=route_e):
            order, offsets = routing_naive.sort_by_expert(route_e, experts)
            a = hidden.index_select(0, order // top_k)
            b = weights_gu.transpose(1, 2)
            ref = grouped_gemm.grouped_mm(a.double().cpu(), b.double().cpu(), offsets.cpu(), path="loop")
            out = []
            for path in ("kernel", "tiled"):
                if path == "kernel" and not grouped_gemm.kernel_accepts(a, b):
                    continue
                got = grouped_gemm.grouped_mm(a, b, offsets, path=path)
                out.append(_errors(f"moe grouped_mm {path} {tag}", got.cpu(), ref, TOLERANCE[dtype]))
            return out

        attempt(f"grouped_mm {tag}", grouped_mm_checks)
    return results


# --------------------------------------------------------------------------------------------------------------------
# speed


def smoe_intermediate(hidden: int) -> int:
    return 2048 if hidden == 768 else 128 * round(8 * hidden / 3 / 128)


def build_blocks(hidden: int, dtype, device) -> dict[str, torch.nn.Module]:
    from transformers.models.mixtral.configuration_mixtral import MixtralConfig
    from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock

    from mhmoe import MHMoEConfig, matched_to_smoe
    from mhmoe.models.mhmoe.sparse_moe import MHMoEMLP, MHMoESparseMoeBlock
    from mhmoe.models.ops.experts import experts_triton

    if hidden % 3 or hidden % 64:
        raise SystemExit(
            f"error: --hidden {hidden}: the h=3 block needs a width divisible by 3 and the "
            "attention heads of 64 (e.g. 768, 1536)"
        )
    inter = smoe_intermediate(hidden)
    mixtral = MixtralConfig(hidden_size=hidden, num_local_experts=8, num_experts_per_tok=1, intermediate_size=inter)
    mixtral._experts_implementation = "grouped_mm"
    smoe = MHMoEConfig(
        hidden_size=hidden,
        num_attention_heads=hidden // 64,
        num_experts=8,
        num_experts_per_tok=1,
        moe_intermediate_size=inter,
        moe_heads=1,
    )
    blocks = {"hf_mixtral": MixtralSparseMoeBlock(mixtral), "ours_smoe": MHMoESparseMoeBlock(smoe)}
    for heads in (2, 3):
        config = matched_to_smoe(smoe, moe_heads=heads, num_experts_per_tok=heads)
        blocks[f"ours_h{heads}"] = MHMoESparseMoeBlock(config)
    blocks["dense"] = MHMoEMLP(MHMoEConfig(hidden_size=hidden, num_attention_heads=hidden // 64), inter)
    if device.type == "cuda" and experts_triton.HAS_TRITON:
        blocks["ours_h3_triton"] = MHMoESparseMoeBlock(blocks["ours_h3"].experts.config)
    generator = torch.Generator().manual_seed(0)
    for module in blocks.values():
        with torch.no_grad():
            for param in module.parameters():
                param.copy_(torch.randn(param.shape, generator=generator) * 0.02)
        for sub in module.modules():
            if hasattr(sub, "config") and hasattr(sub.config, "_experts_implementation"):
                sub.config._experts_implementation = "grouped_mm"
        module.to(device=device, dtype=dtype)
    if "ours_h3_triton" in blocks:  # the same weights as ours_h3, on the Triton experts kernels
        triton_block = blocks["ours_h3_triton"]
        triton_block.load_state_dict(blocks["ours_h3"].state_dict())
        triton_block.experts.config = copy.copy(triton_block.experts.config)
        triton_block.experts.config._experts_implementation = "triton"  # the experts op's triton backend
    return blocks


def time_blocks(blocks, tokens, hidden, repeats, dtype, device) -> dict:
    x = torch.randn(1, tokens, hidden, device=device, dtype=dtype)
    grad = torch.randn_like(x)

    def forward(block):
        def run():
            with torch.no_grad():
                block(x)

        return run

    def forward_backward(block):
        return _gpu_moe_parts.fwd_bwd_step(block, x, grad)

    return {
        mode: interleaved({name: make(block) for name, block in blocks.items()}, repeats, device, "hf_mixtral")
        for mode, make in (("fwd", forward), ("fwd+bwd", forward_backward))
    }


def time_model(repeats, device, smoke) -> dict:
    """Training step (forward, backward, AdamW) of MH-MoE h=3, SMoE and dense at equal activated FLOPs, bf16 autocast
    with fp32 weights (the reproduction's setting): tokens/s and peak memory; interleaved rounds."""
    from mhmoe import MHMoEConfig, MHMoEForCausalLM, matched_to_smoe
    from mhmoe.models.ops.experts import experts_grouped_mm as moe

    default_recompute = moe.RECOMPUTE_GATE_UP
    hidden, layers, batch, seq = (96, 2, 2, 32) if smoke else (768, 4, 8, 2048)
    base = dict(
        vocab_size=256 if smoke else 32000,
        hidden_size=hidden,
        num_attention_heads=max(1, hidden // 64),
        num_hidden_layers=layers,
        intermediate_size=smoe_intermediate(hidden),
        max_position_embeddings=seq,
        decoder_sparse_step=1,
    )
    smoe = MHMoEConfig(**base, num_experts=8, num_experts_per_tok=1, moe_intermediate_size=smoe_intermediate(hidden))
    h3 = matched_to_smoe(smoe, moe_heads=3, num_experts_per_tok=3)
    configs = {
        "smoe": smoe,
        "mhmoe_h3": h3,
        "mhmoe_h3_recompute_gate_up": h3,
        "dense": MHMoEConfig(**{**base, "decoder_sparse_step": 0}),
    }
    ids = torch.randint(0, base["vocab_size"], (batch, seq), device=device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    steps, peaks = {}, {}
    for name, config in configs.items():
        resident = torch.cuda.memory_allocated() if device.type == "cuda" else 0  # the models built before this one
        model = MHMoEForCausalLM(config).to(device).train()
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)

        def step(model=model, optimizer=optimizer, recompute=name.endswith("recompute_gate_up")):
            moe.RECOMPUTE_GATE_UP = recompute  # the experts keep gate/up for the backward, or recompute it
            try:
                with torch.autocast(device.type, dtype=dtype, enabled=device.type == "cuda"):
                    loss = model(input_ids=ids, labels=ids, use_cache=False).loss
                loss.backward()
            finally:
                moe.RECOMPUTE_GATE_UP = default_recompute
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)

        step()  # the optimizer state exists from here on: the peak below is a steady-state step's
        if device.type == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            base_memory = torch.cuda.memory_allocated()
            step()
            torch.cuda.synchronize()
            peak = torch.cuda.max_memory_allocated()
            # every model stays allocated for the interleaved timing below: a model's own peak leaves out the ones
            # built before it (the 2026-11-26 file's peak_bytes did not: its column grew with each model)
            peaks[name] = {
                "own_peak_bytes": peak - resident,
                "peak_bytes": peak,
                "peak_above_weights_and_optimizer_bytes": peak - base_memory,
            }
        steps[name] = step
    timings = interleaved(steps, repeats, device, "smoe")
    results = {}
    for name, timing in timings.items():
        results[name] = {
            "tokens_per_s": batch * seq / (timing["ms"] / 1e3),
            "time_vs_smoe": timing["ratio"],
            **peaks.get(name, {}),
        }
    if peaks:
        for name in results:
            key = "peak_above_weights_and_optimizer_bytes"
            results[name]["activation_peak_vs_smoe"] = results[name][key] / results["smoe"][key]
            results[name]["own_peak_vs_smoe"] = results[name]["own_peak_bytes"] / results["smoe"]["own_peak_bytes"]
    return {
        "hidden": hidden,
        "layers": layers,
        "batch": batch,
        "seq": seq,
        "precision": f"autocast {dtype}",
        "models": results,
    }


def time_routing(repeats, device, smoke) -> dict:
    from mhmoe.models.ops.routing import routing_naive, routing_triton

    rows, experts, top_k = (512, 96, 3) if smoke else (16384, 96, 3)
    logits = torch.randn(rows, experts, device=device)
    candidates = {
        "torch route": lambda: routing_naive.route(logits, top_k),
        "torch route+sort": lambda: routing_naive.sort_by_expert(routing_naive.route(logits, top_k)[1], experts),
    }
    if device.type == "cuda" and routing_triton.HAS_TRITON:
        candidates["triton route"] = lambda: routing_triton.route(logits, top_k)
        candidates["triton route+sort"] = lambda: routing_triton.sort_by_expert(
            routing_triton.route(logits, top_k)[1], experts
        )
    timings = interleaved(candidates, repeats * 5, device)
    return {
        "rows": rows,
        "experts": experts,
        "top_k": top_k,
        "us": {name: 1e3 * t["ms"] for name, t in timings.items()},
    }


def time_head_router(repeats, device, smoke) -> dict:
    from mhmoe.models.ops.head_router import head_router_naive, head_router_triton

    tokens, heads, head_dim = (256, 8, 16) if smoke else (16384, 32, 64)
    queries = torch.randn(
        tokens, heads, head_dim, device=device, dtype=torch.bfloat16 if device.type == "cuda" else torch.float32
    )
    candidates = {"torch": lambda: head_router_naive.l2_head_gates(queries, 2, heads // 2)}
    if device.type == "cuda" and head_router_triton.HAS_TRITON:
        candidates["triton"] = lambda: head_router_triton.l2_head_gates_triton(queries, 2, heads // 2)
    timings = interleaved(candidates, repeats * 5, device)
    return {
        "tokens": tokens,
        "heads": heads,
        "head_dim": head_dim,
        "us": {name: 1e3 * t["ms"] for name, t in timings.items()},
    }


def time_expert_gemms(block, tokens, repeats, dtype, device) -> dict:
    """The h=3 block's experts (forward, no grad) in TFLOP/s, against a dense GEMM of equal FLOPs (a cube); interleaved:
    the experts as the block runs them (sort, gathers, two grouped GEMMs, act·up, combine), the two grouped GEMMs alone
    on sorted rows, the same two GEMMs as plain dense GEMMs of those shapes (one expert's weights for all rows: the
    cost of the shapes, K = 256 and 512, without the grouping), and the Triton experts."""
    from mhmoe.models.mhmoe.experts import grouped_experts_forward
    from mhmoe.models.ops.backends import sort_by_expert
    from mhmoe.models.ops.experts import experts_triton

    experts, gate = block.experts, block.gate
    width = experts.hidden_dim
    rows = torch.randn(tokens * block.moe_heads, width, device=device, dtype=dtype)
    with torch.no_grad():
        _, weights, index = gate(rows)
    flops = 2 * index.numel() * 3 * width * experts.intermediate_dim
    side = max(64, round((flops / 2) ** (1 / 3) / 64) * 64)  # a cube GEMM of about the same FLOPs
    a = torch.randn(side, side, device=device, dtype=dtype)

    def no_grad(fn):
        def run():
            with torch.no_grad():
                fn()

        return run

    # the two grouped GEMMs alone, on rows already sorted by expert (the GEMM's own efficiency, without the routing
    # sort, the gathers, act·up and the combine that "grouped_mm experts" includes)
    from mhmoe.models.ops.experts import grouped_gemm

    with torch.no_grad():
        order, offsets = sort_by_expert(index, experts.num_experts)
        sorted_rows = rows.index_select(0, order // index.shape[1])
        hidden = torch.randn(sorted_rows.shape[0], experts.intermediate_dim, device=device, dtype=dtype)
    gate_up_t, down_t = experts.gate_up_proj.transpose(1, 2), experts.down_proj.transpose(1, 2)
    candidates = {
        "grouped_mm experts": no_grad(lambda: grouped_experts_forward(experts, rows, index, weights)),
        "grouped GEMMs only": no_grad(
            lambda: (
                grouped_gemm.grouped_mm(sorted_rows, gate_up_t, offsets),
                grouped_gemm.grouped_mm(hidden, down_t, offsets),
            )
        ),
        "dense GEMMs, the experts' shapes": no_grad(lambda: (sorted_rows @ gate_up_t[0], hidden @ down_t[0])),
        "dense GEMM": no_grad(lambda: a @ a),
    }
    if device.type == "cuda" and experts_triton.HAS_TRITON:
        candidates["triton experts"] = no_grad(
            lambda: experts_triton.experts_forward(
                rows, index, weights, experts.gate_up_proj, experts.down_proj, order, offsets
            )
        )
    timings = interleaved(candidates, repeats, device)
    out = {"tokens": tokens, "flops": flops, "dense_side": side}
    for name, timing in timings.items():
        work = 2 * side**3 if name == "dense GEMM" else flops
        out[name] = {"ms": timing["ms"], "tflops": work / (timing["ms"] / 1e3) / 1e12}
    for name in out:
        if isinstance(out[name], dict) and name != "dense GEMM":
            out[name]["vs_dense"] = out[name]["tflops"] / out["dense GEMM"]["tflops"]
    return out


# --------------------------------------------------------------------------------------------------------------------
# provenance, output


def provenance(device: torch.device) -> dict:
    """Device, commit and dirty flag (from git, or on a GPU machine from scripts/gpu_run.sh's pack, checked against the
    files: benchmarks/_provenance.py), versions, the behaviour-changing environment and the precision settings."""
    import transformers

    import mhmoe
    from mhmoe.models.ops import backends as routing

    try:
        import triton

        triton_version = triton.__version__
    except ImportError:
        triton_version = None
    return {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else f"CPU ({platform.machine()})",
        **_provenance.git_state(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "transformers": transformers.__version__,
        "triton": triton_version,
        "mhmoe": mhmoe.__version__,
        "python": platform.python_version(),
        "env": _provenance.behaviour_env(),
        "routing_backend": routing.routing_backend(torch.empty(0, device=device))[0],
        "precision": {
            "blocks": "bf16" if device.type == "cuda" else "fp32 (smoke)",
            "model": "bf16 autocast, fp32 weights" if device.type == "cuda" else "fp32 (smoke)",
            "tf32": bool(device.type == "cuda" and torch.backends.cuda.matmul.allow_tf32),
        },
        "started_utc": _utc(),
    }


def _kernel_fallbacks() -> dict:
    """The kernels that failed and fell back to PyTorch during this run ({kernel: reason}; empty: none)."""
    from mhmoe.models.ops.backends import fallbacks

    return {name: str(reason) for name, reason in fallbacks().items()}


def _utc() -> str:
    import datetime

    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")


def write_json(path: Path, data: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    with os.fdopen(fd, "w") as f:
        f.write(json.dumps(data, indent=1) + "\n")
    os.replace(tmp, path)


def markdown(result: dict) -> str:
    """The tables of one run (whatever sections it holds)."""
    dirty = " (dirty)" if result.get("dirty") else ""
    lines = [
        f"**{result['device']}**, torch {result['torch']}, triton {result['triton']}, transformers "
        f"{result['transformers']}, commit {result['commit']}{dirty}"
    ]
    checks = result.get("checks")
    if checks is not None:
        failed = [c for c in checks if not c.get("ok")]
        lines += ["", f"Kernel checks: {len(checks) - len(failed)} of {len(checks)} within tolerance."]
        lines += [f"- FAILED {c['check']}: {c.get('error') or c.get('max_rel_error')}" for c in failed]
    if result.get("blocks"):
        names = list(result["blocks"][0]["times"]["fwd"])
        lines += [
            "",
            "| d | tokens | mode | " + " | ".join(names) + " |",
            "| --- | --- | --- | " + " | ".join("---" for _ in names) + " |",
        ]
        for run in result["blocks"]:
            for mode, cells in run["times"].items():
                row = [f"{cells[n]['ratio']:.2f}x ({cells[n]['ms']:.2f} ms)" for n in names]
                lines.append(f"| {run['hidden']} | {run['tokens']} | {mode} | " + " | ".join(row) + " |")
    if result.get("model"):
        model = result["model"]
        own = own_peaks(model["models"])
        derived = " (derived†)" if own and "own_peak_bytes" not in next(iter(model["models"].values())) else ""
        lines += [
            "",
            f"| training step, d={model['hidden']}, {model['batch']}×{model['seq']} tokens, "
            f"{model['precision']} | tokens/s | time vs SMoE | peak memory{derived} | vs SMoE | activations "
            "vs SMoE |",
            "| --- | --- | --- | --- | --- | --- |",
        ]
        for name, cells in model["models"].items():
            peak = f"{own[name] / 2**30:.2f} GiB" if own else "-"
            ratio = f"{own[name] / own['smoe']:.2f}x" if own else "-"
            act = f"{cells['activation_peak_vs_smoe']:.2f}x" if "activation_peak_vs_smoe" in cells else "-"
            lines.append(
                f"| {name} | {cells['tokens_per_s']:,.0f} | {cells['time_vs_smoe']:.2f}x | {peak} | {ratio} | {act} |"
            )
        if derived:
            lines += [
                "",
                "† This run recorded `peak_bytes` with the models built before each one still allocated "
                "(all four stay on the GPU for the interleaved timing): "
                + ", ".join(f"{n} {c['peak_bytes'] / 2**30:.2f}" for n, c in model["models"].items())
                + " GiB. A "
                "model's own peak is its step's peak above its starting memory plus the growth of the starting "
                "memory since the model before it (its own weights and optimizer state), from the same JSON.",
            ]
    for key, label in (
        ("routing", "routing, {rows} rows × {experts} experts, top-{top_k}"),
        ("head_router", "MoH head router, {tokens} tokens × {heads} heads × {head_dim}"),
    ):
        if result.get(key):
            section = result[key]
            lines += ["", f"| {label.format(**section)} | µs |", "| --- | --- |"]
            lines += [f"| {name} | {us:.1f} |" for name, us in section["us"].items()]
    if result.get("parts"):
        lines += ["", _gpu_moe_parts.markdown_parts(result["parts"])]
    if result.get("compiled"):
        lines += ["", _gpu_moe_parts.markdown_compiled(result["compiled"])]
    if result.get("gemm"):
        gemm = result["gemm"]
        lines += [
            "",
            f"| h=3 experts forward, {gemm['tokens']} tokens | ms | TFLOP/s | vs dense |",
            "| --- | --- | --- | --- |",
        ]
        for name, cells in gemm.items():
            if isinstance(cells, dict):
                vs = f"{cells['vs_dense']:.0%}" if "vs_dense" in cells else "-"
                lines.append(f"| {name} | {cells['ms']:.3f} | {cells['tflops']:.1f} | {vs} |")
    return "\n".join(lines)


def own_peaks(models: dict) -> dict:
    """{model: bytes of its own peak}: recorded (`own_peak_bytes`), or derived for files written before it was
    recorded: the step's peak above the starting memory plus the starting memory's growth since the model built before
    it (the models are built in the file's order and stay allocated)."""
    if not models or not all("peak_bytes" in cells for cells in models.values()):
        return {}
    if all("own_peak_bytes" in cells for cells in models.values()):
        return {name: cells["own_peak_bytes"] for name, cells in models.items()}
    own, previous_start = {}, 0
    for name, cells in models.items():
        start = cells["peak_bytes"] - cells["peak_above_weights_and_optimizer_bytes"]
        own[name] = cells["peak_above_weights_and_optimizer_bytes"] + start - previous_start
        previous_start = start
    return own


def table() -> str:
    """The markdown of every recorded run (benchmarks/results/gpu_moe*/gpu_moe.json), oldest first."""
    runs = [json.loads(p.read_text()) for p in sorted(RESULTS.glob("gpu_moe*/gpu_moe.json"))]
    return "\n\n".join(markdown(r) for r in runs) if runs else "No GPU run has been recorded yet."


def write_table(body: str) -> None:
    """Put `body` between benchmarks/README.md's table markers (only with --write_table: --table just prints)."""
    text = README.read_text()
    pattern = re.compile(re.escape(TABLE_START) + ".*?" + re.escape(TABLE_END), re.S)
    README.write_text(pattern.sub(lambda _: f"{TABLE_START}\n{body}\n{TABLE_END}", text))


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=None, help="folder for gpu_moe.json (written after every section)")
    parser.add_argument("--hidden", type=int, nargs="+", default=[768, 1536], help="block widths (divisible by 3·64)")
    parser.add_argument("--tokens", type=int, nargs="+", default=[8192, 32768])
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--sections", nargs="+", choices=SECTIONS, default=list(SECTIONS))
    parser.add_argument("--table", action="store_true", help="print the table of every recorded run's JSON")
    parser.add_argument("--write_table", action="store_true", help="also rewrite benchmarks/README.md's table with it")
    parser.add_argument("--smoke", action="store_true", help="tiny CPU run of the script itself")
    return parser


def main(argv=None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.table or args.write_table:
        body = table()
        print(body)
        if args.write_table:
            write_table(body)
        return 0
    if not torch.cuda.is_available() and not args.smoke:
        print("no GPU available (torch.cuda.is_available() is False): nothing measured, nothing recorded")
        return 0
    for hidden in args.hidden:
        if hidden % 192:
            parser.error(f"--hidden {hidden}: needs a multiple of 192 (h=3 sub-tokens and 64-wide attention heads)")
    device = torch.device("cpu" if args.smoke else "cuda")
    dtype = torch.float32 if args.smoke else torch.bfloat16
    if args.smoke:
        args.hidden, args.tokens, args.repeats = [192], [64], 2
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True  # fp32 matmuls as the reproduction runs them
    torch.manual_seed(0)
    result = provenance(device)
    out = args.out
    if out is None:
        slug = re.sub(r"[^A-Za-z0-9]+", "-", result["device"]).strip("-").lower()
        out = (
            Path(tempfile.mkdtemp(prefix="gpu_moe-smoke-"))
            if args.smoke
            else RESULTS / f"gpu_moe-{slug}-{result['commit']}"
        )
    path = out / "gpu_moe.json"
    # the log is committed with the results: the folder as given (--out) or relative to the checkout, no local path
    shown_out = (
        "--out"
        if args.out is not None
        else out.relative_to(HERE.parent)
        if out.is_relative_to(HERE.parent)
        else out.name
    )

    def save(section: str, started: float) -> None:
        result.setdefault("section_seconds", {})[section] = round(time.time() - started, 1)
        result["finished_utc"] = _utc()
        write_json(path, result)
        print(f"[{section}: {result['section_seconds'][section]} s, written to {path.name} in {shown_out}]", flush=True)

    for section in args.sections:
        started = time.time()
        if section == "checks":
            result["checks"] = check_kernels(device, args.smoke)
        elif section == "blocks":
            result["blocks"] = []
            for hidden in args.hidden:
                blocks = build_blocks(hidden, dtype, device)
                for tokens in args.tokens:
                    times = time_blocks(blocks, tokens, hidden, args.repeats, dtype, device)
                    result["blocks"].append({"hidden": hidden, "tokens": tokens, "times": times})
                    save(section, started)  # a partial section is kept too
                del blocks
        elif section == "model":
            result["model"] = time_model(max(3, args.repeats // 4), device, args.smoke)
        elif section == "routing":
            result["routing"] = time_routing(args.repeats, device, args.smoke)
        elif section == "head_router":
            result["head_router"] = time_head_router(args.repeats, device, args.smoke)
        elif section == "gemm":
            blocks = build_blocks(args.hidden[0], dtype, device)
            result["gemm"] = time_expert_gemms(blocks["ours_h3"], args.tokens[-1], args.repeats, dtype, device)
            del blocks
        elif section == "parts":
            result["parts"] = _gpu_moe_parts.time_parts(
                build_blocks, interleaved, args.hidden[0], args.tokens[-1], args.repeats, dtype, device
            )
        elif section == "compiled":
            result["compiled"] = _gpu_moe_parts.time_compiled(
                build_blocks,
                interleaved,
                args.hidden[0],
                args.tokens[-1],
                args.repeats,
                dtype,
                device,
                save=lambda section=section, started=started: save(section, started),
                modes=("default",) if args.smoke else ("default", "reduce-overhead"),
            )
        result["kernel_fallbacks"] = _kernel_fallbacks()
        save(section, started)
    print(markdown(result))
    if args.smoke:
        print("(smoke run on CPU: tiny shapes, not a measurement)")
    failed = [c["check"] for c in result.get("checks", []) if not c.get("ok")]
    if failed:
        print(f"kernel checks FAILED: {', '.join(failed)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
