"""MoE layer speed on CPU, side by side: MHMoE's block vs Transformers' Mixtral block vs a dense SwiGLU MLP.

All candidates have the same activated FLOPs per token (d=768; the FLOPs-parity paper's Section 3 configs):

  hf_smoe_grouped  MixtralSparseMoeBlock E=8 k=1 f=2048, `grouped_mm` experts   (the reference: ratio 1.00)
  hf_smoe_eager    same block, `eager` experts (a Python loop over experts)
  dense            SwiGLU MLP f=2048
  ours_smoe        MHMoESparseMoeBlock E=8 k=1 f=2048, moe_heads=1, no head/merge layer
  ours_h2          MHMoESparseMoeBlock h=2 E=40 k=2 f=768, head + merge layers
  ours_h3          MHMoESparseMoeBlock h=3 E=96 k=3 f=512, head + merge layers

fp32, `torch.set_num_threads(2)` (`--threads`). Each round times every candidate once, in a rotated order, on the same input
(fresh random weights, normal std 0.02; routing is near-uniform, as at initialisation). A candidate's time is its
median over rounds; its ratio is the median over rounds of (its time / hf_smoe_grouped's time in the same round),
so slow drifts of a shared machine cancel. "fwd" runs under `torch.no_grad()`; "fwd+bwd" runs forward with an input
that requires grad and backpropagates a fixed random output gradient (weights and input get gradients).

Usage: python benchmarks/moe_layer.py [--tokens 256 2048] [--repeats 7] [--quick]
"""

import argparse
import os
import platform
import statistics
import time

import torch
from torch import nn
from transformers.models.mixtral.configuration_mixtral import MixtralConfig
from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock

from mhmoe.models.mhmoe.configuration_mhmoe import MHMoEConfig
from mhmoe.models.mhmoe.parity import moe_layer_cost
from mhmoe.models.mhmoe.sparse_moe import MHMoEMLP, MHMoESparseMoeBlock

D = 768
REFERENCE = "hf_smoe_grouped"


def _init(module: nn.Module, seed: int) -> nn.Module:
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in module.parameters():
            param.copy_(torch.randn(param.shape, generator=generator) * 0.02)
    return module


def _mixtral(implementation: str) -> MixtralSparseMoeBlock:
    config = MixtralConfig(hidden_size=D, num_local_experts=8, num_experts_per_tok=1, intermediate_size=2048)
    config._experts_implementation = implementation
    return MixtralSparseMoeBlock(config)


def _ours(moe_heads: int, num_experts: int, top_k: int, intermediate: int) -> MHMoESparseMoeBlock:
    config = MHMoEConfig(
        hidden_size=D,
        num_experts=num_experts,
        num_experts_per_tok=top_k,
        moe_intermediate_size=intermediate,
        moe_heads=moe_heads,
        norm_topk_prob="always",  # Mixtral's convention (it renormalises at k = 1 too), so ours_smoe == Mixtral
    )
    config._experts_implementation = "grouped_mm"
    return MHMoESparseMoeBlock(config)


def build_candidates() -> dict[str, nn.Module]:
    dense_config = MHMoEConfig(hidden_size=D, intermediate_size=2048, decoder_sparse_step=0)
    candidates = {
        REFERENCE: _mixtral("grouped_mm"),
        "hf_smoe_eager": _mixtral("eager"),
        "dense": MHMoEMLP(dense_config, 2048),
        "ours_smoe": _ours(1, 8, 1, 2048),
        "ours_h2": _ours(2, 40, 2, 768),
        "ours_h3": _ours(3, 96, 3, 512),
    }
    for seed, module in enumerate(candidates.values()):
        _init(module, seed)
    # Both Mixtral blocks carry the same weights, so they must agree.
    candidates["hf_smoe_eager"].load_state_dict(candidates[REFERENCE].state_dict())
    return candidates


def activated_macs_per_token(module: nn.Module) -> int:
    """Multiply-accumulates per token of the expert, head and merge matmuls (router excluded)."""
    if isinstance(module, MHMoESparseMoeBlock):
        config = module.experts.config
        return moe_layer_cost(config).macs_per_token - config.hidden_size * config.num_experts
    if isinstance(module, MixtralSparseMoeBlock):
        experts = module.experts
        return 3 * experts.hidden_dim * experts.intermediate_dim * module.top_k
    return sum(layer.weight.numel() for layer in (module.gate_proj, module.up_proj, module.down_proj))


def sanity_checks(candidates: dict[str, nn.Module], x: torch.Tensor) -> None:
    """Cheap correctness checks before timing."""
    macs = {name: activated_macs_per_token(module) for name, module in candidates.items()}
    assert len(set(macs.values())) == 1, f"activated FLOPs differ: {macs}"
    with torch.no_grad():
        reference = candidates[REFERENCE](x)
        eager = candidates["hf_smoe_eager"](x)
        torch.testing.assert_close(eager, reference, rtol=1e-5, atol=1e-6)
        # Our SMoE block holds exactly Mixtral's parameters (same names and shapes) and must give its output.
        ours = _ours(1, 8, 1, 2048)
        ours.load_state_dict(candidates[REFERENCE].state_dict())
        torch.testing.assert_close(ours(x), reference, rtol=1e-5, atol=1e-6)


def _time_once(module: nn.Module, x: torch.Tensor, grad: torch.Tensor, backward: bool) -> float:
    if backward:
        module.zero_grad(set_to_none=True)
        inp = x.detach().requires_grad_()
        start = time.perf_counter()
        module(inp).backward(grad)
        return time.perf_counter() - start
    with torch.no_grad():
        start = time.perf_counter()
        module(x)
        return time.perf_counter() - start


def run(tokens: int, repeats: int, candidates: dict[str, nn.Module], warmup: int = 1) -> dict:
    generator = torch.Generator().manual_seed(1000 + tokens)
    x = torch.randn(1, tokens, D, generator=generator)
    grad = torch.randn(1, tokens, D, generator=generator)
    x_copy = x.clone()
    sanity_checks(candidates, x)
    names = list(candidates)
    results = {}
    for mode, backward in (("fwd", False), ("fwd+bwd", True)):
        for module in candidates.values():
            module.train(backward)
        times = {name: [] for name in names}
        for round_idx in range(warmup + repeats):
            shift = round_idx % len(names)
            for name in names[shift:] + names[:shift]:  # rotate who goes first
                elapsed = _time_once(candidates[name], x, grad, backward)
                if round_idx >= warmup:
                    times[name].append(elapsed)
        ratios = {
            name: statistics.median(t / r for t, r in zip(times[name], times[REFERENCE], strict=True)) for name in names
        }
        results[mode] = {name: (statistics.median(times[name]), ratios[name]) for name in names}
    # Every candidate saw the same, unmodified input.
    assert torch.equal(x, x_copy), "a candidate modified its input in place"
    return results


def _load() -> str:
    return "/".join(f"{value:.2f}" for value in os.getloadavg())


def profile(name: str, tokens: int, candidates: dict[str, nn.Module], rows: int = 12) -> None:
    """Print where one candidate's fwd+bwd spends its time: torch.profiler's CPU ops over 3 calls (after 2 warm-ups),
    by self time. Two trees' tables side by side show which ops a change added or made slower."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    generator = torch.Generator().manual_seed(1000 + tokens)  # the timed run's input
    x = torch.randn(1, tokens, D, generator=generator)
    grad = torch.randn(1, tokens, D, generator=generator)
    module = candidates[name].train()
    for _ in range(2):
        _time_once(module, x, grad, backward=True)
    with torch_profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(3):
            _time_once(module, x, grad, backward=True)
    print(f"{name}, {tokens} tokens, fwd+bwd x3, CPU ops by self time:")
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=rows, max_name_column_width=40))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, nargs="+", default=[256, 2048], help="tokens per call (batch 1)")
    parser.add_argument("--repeats", type=int, default=7, help="timed rounds per (tokens, mode)")
    parser.add_argument(
        "--quick", action="store_true", help="smoke run: 64 tokens, 1 round (checks and table; no figure)"
    )
    parser.add_argument("--threads", type=int, default=2, help="torch threads (the dev machine has 2 cores)")
    parser.add_argument(
        "--profile", metavar="NAME", help="instead of timing: profile one candidate's fwd+bwd (e.g. ours_h3)"
    )
    args = parser.parse_args()
    if args.quick:
        args.tokens, args.repeats = [64], 1

    load_start = _load()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    candidates = build_candidates()
    if args.profile:
        if args.profile not in candidates:
            parser.error(f"--profile {args.profile}: not a candidate; choose one of {', '.join(candidates)}")
        for tokens in args.tokens:
            profile(args.profile, tokens, candidates)
        return
    print(
        f"torch {torch.__version__}, {platform.processor() or platform.machine()}, threads={torch.get_num_threads()}, "
        f"fp32, d={D}, activated MACs/token={activated_macs_per_token(candidates[REFERENCE]):,}, repeats={args.repeats}"
    )
    print("sanity: same input for all, HF eager == HF grouped_mm, ours_smoe with Mixtral's weights == Mixtral: ok")
    header = f"| {'tokens':>6} | {'mode':<7} | " + " | ".join(f"{name:>15}" for name in candidates) + " |"
    rule = "|" + "|".join("-" * len(cell) for cell in header.split("|")[1:-1]) + "|"
    print(header)
    print(rule)
    start = time.perf_counter()
    for tokens in args.tokens:
        results = run(tokens, args.repeats, candidates)
        for mode, row in results.items():
            cells = [f"{1e3 * t:8.1f}ms {r:4.2f}x" for t, r in row.values()]
            print(f"| {tokens:>6} | {mode:<7} | " + " | ".join(f"{cell:>15}" for cell in cells) + " |", flush=True)
    print(f"cells: median time, median per-round ratio to {REFERENCE}; total {time.perf_counter() - start:.0f} s")
    print(f"load average (1/5/15 min) at start {load_start}, at end {_load()}: the machine has {os.cpu_count()} cores")


if __name__ == "__main__":
    main()
