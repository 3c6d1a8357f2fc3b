"""GPU speed of the MoE layers, a whole-model training step and the routing kernel, bf16 on CUDA (issue #13).

One run per configuration, every number a ratio to a reference measured in the same run:

  blocks   d ∈ {768, 2048}, tokens ∈ {8k, 32k}, fwd and fwd+bwd, times relative to Transformers' Mixtral block
           (`grouped_mm`, E=8 k=1 f≈8d/3): our SMoE block (same shapes), MH-MoE h=2 and h=3 (`matched_to_smoe`:
           same activated FLOPs and parameters), a dense SwiGLU MLP of the same FLOPs, and on CUDA the h=3 block on the
           Triton experts kernels (`ours_h3_triton`: `triton_experts_forward`, registered as "mhmoe_triton")
  model    training-step tokens/s (forward, backward, AdamW step) of MH-MoE h=3, SMoE and dense models, d=768
  routing  16k sub-tokens × 96 experts, top-3: the Triton kernels (`routing_triton.route` + `sort_by_expert`) against
           the PyTorch reference, in µs
  gemm     the h=3 block's expert GEMMs (`grouped_experts_forward`, forward) in TFLOP/s against one dense bf16 GEMM
           of the same FLOPs

Usage:
  python benchmarks/gpu_moe.py [--hidden 768 2048] [--tokens 8192 32768] [--repeats 20]
      writes benchmarks/results/gpu_moe-<device>-<commit>.json and prints the tables
  python benchmarks/gpu_moe.py --table
      rewrites the table in benchmarks/README.md from every benchmarks/results/gpu_moe-*.json
  python benchmarks/gpu_moe.py --smoke
      tiny shapes on CPU in fp32 with the torch routing backend: checks that the script runs, records nothing
Without CUDA (and without --smoke / --table) it prints that no GPU is available and exits 0.
"""

import argparse
import copy
import json
import platform
import re
import statistics
import subprocess
import time
from pathlib import Path

import torch
from transformers.integrations.moe import ExpertsInterface
from transformers.models.mixtral.configuration_mixtral import MixtralConfig
from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock

from mhmoe import MHMoEConfig, MHMoEForCausalLM
from mhmoe.models.mhmoe.modeling_mhmoe import MHMoEMLP, MHMoESparseMoeBlock
from mhmoe.models.mhmoe.moe import grouped_experts_forward
from mhmoe.models.mhmoe.ops.experts import experts_triton
from mhmoe.models.mhmoe.ops.routing import routing_naive, routing_triton

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results"
README = HERE / "README.md"
TABLE_START, TABLE_END = "<!-- gpu_moe table start -->", "<!-- gpu_moe table end -->"


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


def smoe_intermediate(hidden: int) -> int:
    return 2048 if hidden == 768 else 128 * round(8 * hidden / 3 / 128)


def build_blocks(hidden: int, dtype, device) -> dict[str, torch.nn.Module]:
    inter = smoe_intermediate(hidden)
    mixtral = MixtralConfig(hidden_size=hidden, num_local_experts=8, num_experts_per_tok=1, intermediate_size=inter)
    mixtral._experts_implementation = "grouped_mm"
    smoe = MHMoEConfig(hidden_size=hidden, num_attention_heads=hidden // 64, num_experts=8, num_experts_per_tok=1,
                       moe_intermediate_size=inter, moe_heads=1)  # fmt: skip
    blocks = {"hf_mixtral": MixtralSparseMoeBlock(mixtral), "ours_smoe": MHMoESparseMoeBlock(smoe)}
    for heads in (2, 3):
        config = MHMoEConfig.matched_to_smoe(smoe, moe_heads=heads, num_experts_per_tok=heads)
        blocks[f"ours_h{heads}"] = MHMoESparseMoeBlock(config)
    blocks["dense"] = MHMoEMLP(MHMoEConfig(hidden_size=hidden, num_attention_heads=hidden // 64), inter)
    if device.type == "cuda" and experts_triton.HAS_TRITON:
        ExpertsInterface.register("mhmoe_triton", experts_triton.triton_experts_forward)
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
        triton_block.experts.config._experts_implementation = "mhmoe_triton"
    return blocks


def time_blocks(blocks, tokens, hidden, repeats, dtype, device) -> dict:
    timed = _timer(device)
    x = torch.randn(1, tokens, hidden, device=device, dtype=dtype)
    grad = torch.randn_like(x)
    out = {}
    for mode in ("fwd", "fwd+bwd"):
        times = {name: [] for name in blocks}
        for round_idx in range(repeats + 2):  # two warm-up rounds
            names = list(blocks)
            shift = round_idx % len(names)
            for name in names[shift:] + names[:shift]:
                block = blocks[name]
                if mode == "fwd":
                    with torch.no_grad():
                        elapsed = timed(lambda: block(x))
                else:
                    inp = x.detach().requires_grad_()
                    block.zero_grad(set_to_none=True)
                    elapsed = timed(lambda: block(inp).backward(grad))
                if round_idx >= 2:
                    times[name].append(elapsed)
        reference = times["hf_mixtral"]
        out[mode] = {name: {"ms": 1e3 * statistics.median(t),
                            "ratio": statistics.median(a / b for a, b in zip(t, reference))}
                     for name, t in times.items()}  # fmt: skip
    return out


def time_model(repeats, dtype, device, smoke) -> dict:
    """Training-step tokens/s, MH-MoE h=3 / SMoE / dense at equal activated FLOPs (d=768, 4 layers, 4 × 2048)."""
    timed = _timer(device)
    hidden, layers, batch, seq = (96, 2, 2, 32) if smoke else (768, 4, 4, 2048)
    base = dict(vocab_size=32000 if not smoke else 256, hidden_size=hidden, num_attention_heads=max(1, hidden // 64),
                num_hidden_layers=layers, intermediate_size=smoe_intermediate(hidden), max_position_embeddings=seq)
    smoe = MHMoEConfig(**base, num_experts=8, num_experts_per_tok=1, moe_intermediate_size=smoe_intermediate(hidden))
    configs = {"smoe": smoe, "mhmoe_h3": MHMoEConfig.matched_to_smoe(smoe, moe_heads=3, num_experts_per_tok=3),
               "dense": MHMoEConfig(**base, decoder_sparse_step=0)}  # fmt: skip
    ids = torch.randint(0, base["vocab_size"], (batch, seq), device=device)
    results = {}
    for name, config in configs.items():
        model = MHMoEForCausalLM(config).to(device=device, dtype=dtype).train()
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)

        def step(model=model, optimizer=optimizer):
            model(input_ids=ids, labels=ids).loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)

        times = [timed(step) for _ in range(repeats + 2)][2:]
        results[name] = {"tokens_per_s": batch * seq / statistics.median(times)}
        del model, optimizer
    for name in results:
        results[name]["ratio_to_smoe"] = results["smoe"]["tokens_per_s"] / results[name]["tokens_per_s"]
    return results


def time_routing(repeats, device, smoke) -> dict:
    rows, experts, top_k = (512, 96, 3) if smoke else (16384, 96, 3)
    logits = torch.randn(rows, experts, device=device)
    timed = _timer(device)
    runs = {"torch": (routing_naive.route, routing_naive.sort_by_expert)}
    if device.type == "cuda" and routing_triton.HAS_TRITON:
        runs["triton"] = (routing_triton.route, routing_triton.sort_by_expert)
    out = {}
    for name, (route, sort) in runs.items():
        route_times, all_times = [], []
        for _ in range(repeats * 5 + 5):
            route_times.append(timed(lambda: route(logits, top_k)))
            all_times.append(timed(lambda: sort(route(logits, top_k)[1], experts)))
        out[name] = {"route_us": 1e6 * statistics.median(route_times[5:]),
                     "route_and_sort_us": 1e6 * statistics.median(all_times[5:])}  # fmt: skip
    return {"rows": rows, "experts": experts, "top_k": top_k, **out}


def time_expert_gemms(block, tokens, repeats, dtype, device) -> dict:
    """The h=3 block's expert computation (forward, no grad) in TFLOP/s against a dense GEMM of equal FLOPs."""
    timed = _timer(device)
    experts, gate = block.experts, block.gate
    width = experts.hidden_dim
    rows = torch.randn(tokens * block.moe_heads, width, device=device, dtype=dtype)
    with torch.no_grad():
        _, weights, index = gate(rows)
        flops = 2 * index.numel() * 3 * width * experts.intermediate_dim
        grouped = [timed(lambda: grouped_experts_forward(experts, rows, index, weights)) for _ in range(repeats + 2)]
        side = round((flops / 2) ** (1 / 3) / 64) * 64  # a cube GEMM of about the same FLOPs
        a = torch.randn(side, side, device=device, dtype=dtype)
        dense = [timed(lambda: a @ a) for _ in range(repeats + 2)]
    grouped_tflops = flops / statistics.median(grouped[2:]) / 1e12
    dense_tflops = 2 * side**3 / statistics.median(dense[2:]) / 1e12
    return {"tokens": tokens, "expert_tflops": grouped_tflops, "dense_tflops": dense_tflops,
            "ratio": grouped_tflops / dense_tflops}  # fmt: skip


def _commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=HERE, capture_output=True, text=True,
                              check=True).stdout.strip()  # fmt: skip
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def markdown(result: dict) -> str:
    """The tables of one run (header line: device, versions, commit)."""
    lines = [f"**{result['device']}**, torch {result['torch']}, triton {result['triton']}, commit {result['commit']}, "
             f"{result['dtype']}", "",
             "| d | tokens | mode | " + " | ".join(result["block_names"]) + " |",
             "| --- | --- | --- | " + " | ".join("---" for _ in result["block_names"]) + " |"]  # fmt: skip
    for run in result["blocks"]:
        for mode, cells in run["times"].items():
            row = [f"{cells[n]['ratio']:.2f}x ({cells[n]['ms']:.2f} ms)" for n in result["block_names"]]
            lines.append(f"| {run['hidden']} | {run['tokens']} | {mode} | " + " | ".join(row) + " |")
    lines += ["", "| model (training step) | tokens/s | time vs SMoE |", "| --- | --- | --- |"]
    for name, cells in result["model"].items():
        lines.append(f"| {name} | {cells['tokens_per_s']:,.0f} | {cells['ratio_to_smoe']:.2f}x |")
    routing = result["routing"]
    lines += ["", f"| routing, {routing['rows']} rows × {routing['experts']} experts, top-{routing['top_k']} | route "
              "(µs) | route + sort (µs) |", "| --- | --- | --- |"]  # fmt: skip
    for name in ("torch", "triton"):
        if name in routing:
            lines.append(f"| {name} | {routing[name]['route_us']:.1f} | {routing[name]['route_and_sort_us']:.1f} |")
    gemm = result["gemm"]
    lines += ["", f"Expert GEMMs (h=3 block, {gemm['tokens']} tokens, forward): {gemm['expert_tflops']:.1f} TFLOP/s, "
              f"dense GEMM {gemm['dense_tflops']:.1f} TFLOP/s: {100 * gemm['ratio']:.0f}%."]  # fmt: skip
    return "\n".join(lines)


def write_table() -> None:
    runs = [json.loads(p.read_text()) for p in sorted(RESULTS.glob("gpu_moe-*.json"))]
    body = "\n\n".join(markdown(r) for r in runs) if runs else "No GPU run has been recorded yet."
    text = README.read_text()
    pattern = re.compile(re.escape(TABLE_START) + ".*?" + re.escape(TABLE_END), re.S)
    README.write_text(pattern.sub(lambda _: f"{TABLE_START}\n{body}\n{TABLE_END}", text))
    print(body)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hidden", type=int, nargs="+", default=[768, 2048])
    parser.add_argument("--tokens", type=int, nargs="+", default=[8192, 32768])
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--table", action="store_true", help="rewrite benchmarks/README.md's table from the JSON")
    parser.add_argument("--smoke", action="store_true", help="tiny CPU run of the script itself; records nothing")
    args = parser.parse_args()
    if args.table:
        write_table()
        return
    if not torch.cuda.is_available() and not args.smoke:
        print("no GPU available (torch.cuda.is_available() is False): nothing measured, nothing recorded")
        return
    device = torch.device("cpu" if args.smoke else "cuda")
    dtype = torch.float32 if args.smoke else torch.bfloat16
    if args.smoke:
        args.hidden, args.tokens, args.repeats = [96], [64], 2
    torch.manual_seed(0)
    result = {"device": torch.cuda.get_device_name() if device.type == "cuda" else platform.processor() or "cpu",
              "torch": torch.__version__, "triton": getattr(routing_triton.triton, "__version__", None),
              "commit": _commit(), "dtype": str(dtype).removeprefix("torch."), "blocks": []}  # fmt: skip
    for hidden in args.hidden:
        blocks = build_blocks(hidden, dtype, device)
        result["block_names"] = list(blocks)
        for tokens in args.tokens:
            times = time_blocks(blocks, tokens, hidden, args.repeats, dtype, device)
            result["blocks"].append({"hidden": hidden, "tokens": tokens, "times": times})
        if hidden == args.hidden[0]:
            result["gemm"] = time_expert_gemms(blocks["ours_h3"], args.tokens[-1], args.repeats, dtype, device)
        del blocks
    result["model"] = time_model(max(3, args.repeats // 4), dtype, device, args.smoke)
    result["routing"] = time_routing(args.repeats, device, args.smoke)
    print(markdown(result))
    if args.smoke:
        print("(smoke run on CPU: nothing recorded)")
        return
    RESULTS.mkdir(exist_ok=True)
    slug = re.sub(r"[^A-Za-z0-9]+", "-", result["device"]).strip("-").lower()
    path = RESULTS / f"gpu_moe-{slug}-{result['commit']}.json"
    path.write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {path}; `python benchmarks/gpu_moe.py --table` puts it into benchmarks/README.md")


if __name__ == "__main__":
    main()
