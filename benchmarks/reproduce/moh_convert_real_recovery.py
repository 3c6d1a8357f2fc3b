"""The `tune` stage of moh_convert_real.py: continue-tuning the converted SmolLM2 against a dense control (issue 31).

Every run takes the same tokens with the same settings: the dense parent with `mhmoe-train` (the converter's
continue-tuning defaults written out as flags, so that both command lines build the same `TrainArguments`), the MoH
conversion with `mhmoe-convert --train_file` (LM loss) and with `--distill`. Each model is then evaluated on the
Python-docs validation text (the tuning text's domain, held out) and on two texts of other domains than the calibration
and tuning texts (both Python docs): the GPL-3 licence and Debian package descriptions.

    python benchmarks/reproduce/run.py moh_convert_real --stage tune --gguf_dir <gguf_dir> --workdir <workdir> \\
        --runs dense lm distill --budgets 7/9 --seeds 0

One (run, budget, seed) already in the results is not run again: a study goes in short commands, one run each.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import moh_convert_real as real
import torch

BATCH, WARMUP = 4, 2  # blocks per step, warmup steps (the earlier tune stage's)
RUNS = {"dense": "parent tuned", "lm": "MoH tuned", "distill": "MoH distilled"}
TEXTS = {  # key -> what the results call it
    "python_docs": "Python docs (held out)",
    "gpl3": "GPL-3 licence",
    "packages": "package descriptions",
}
DPKG_STATUS = "/var/lib/dpkg/status"
TEXT_SOURCES = {
    "python_docs": "the last topics of Python's pydoc_data.topics (the tuning text's validation file)",
    "gpl3": "the GNU GPL version 3 (Debian's common-licenses copy), from its start",
    "packages": "the Description fields of the Debian packages installed on the machine (dpkg status), sorted by "
    "package name, from the first",
}


def package_descriptions(status: str) -> str:
    """The installed packages' descriptions from a dpkg status file's text: per package "name: synopsis" and the long
    description as prose (its " ." lines as paragraph breaks), sorted by package name."""
    entries = {}
    for stanza in status.split("\n\n"):
        name, lines, describing = None, [], False
        for line in stanza.splitlines():
            if line.startswith("Package:"):
                name = line.split(":", 1)[1].strip()
            elif line.startswith("Description:"):
                lines, describing = [line.split(":", 1)[1].strip()], True
            elif describing and line.startswith(" "):
                lines.append("" if line.strip() == "." else line[1:])
            else:
                describing = False
        if name and lines:
            entries[name] = f"{name}: {lines[0]}\n" + "\n".join(lines[1:])
    return "\n\n".join(entries[name].strip() for name in sorted(entries))


def eval_texts(tokenizer, args) -> dict[str, torch.Tensor]:
    """{text key: blocks of 256 token ids}: the Python-docs validation text of the tuning split (`--tune_eval_blocks`
    blocks), and `--eval_blocks` blocks of each other-domain text."""
    ids, _ = real.split_text(args.tune_eval_blocks, tokenizer)
    texts = {
        "gpl3": Path(real.GPL3).read_text(),
        "packages": package_descriptions(Path(DPKG_STATUS).read_text()),
    }
    blocks = {"python_docs": torch.tensor(ids).view(-1, real.BLOCK)}
    for key, text in texts.items():
        other = tokenizer(text, add_special_tokens=False)["input_ids"][: args.eval_blocks * real.BLOCK]
        if len(other) < real.BLOCK:
            raise SystemExit(f"{TEXTS[key]}: only {len(other)} tokens, fewer than one block of {real.BLOCK}")
        blocks[key] = torch.tensor(other[: len(other) // real.BLOCK * real.BLOCK]).view(-1, real.BLOCK)
    return blocks


def tuning_flags(data: Path, args, seed: int) -> list[str]:
    """The continue-tuning flags both command lines take (data, batch, steps, schedule, seed)."""
    return [
        "--train_file",
        str(data / "train.txt"),
        "--validation_file",
        str(data / "validation.txt"),
        "--block_size",
        str(real.BLOCK),
        "--per_device_train_batch_size",
        str(BATCH),
        "--per_device_eval_batch_size",
        str(BATCH),
        "--max_steps",
        str(args.tune_steps),
        "--eval_steps",
        str(args.tune_eval_every),
        "--learning_rate",
        str(args.tune_lr),
        "--min_learning_rate",
        str(args.tune_lr / 10),
        "--warmup_steps",
        str(WARMUP),
        "--seed",
        str(seed),
        "--disable_tqdm",
        "--plot",
        "False",
    ]


def dense_argv(source: str, out: Path, data: Path, args, seed: int) -> list[str]:
    """mhmoe-train on the dense parent: the tuning flags plus the converter's continue-tuning defaults that
    mhmoe-train's own defaults differ from (recipe.py), written out."""
    from mhmoe.convert.recipe import CONTINUE_TUNING_DEFAULTS

    flags = tuning_flags(data, args, seed)
    given = {flag[2:] for flag in flags if flag.startswith("--")}
    recipe = [(f"--{k}", str(v)) for k, v in CONTINUE_TUNING_DEFAULTS.items() if k not in given]
    return [
        "--model_name_or_path",
        source,
        "--output_dir",
        str(out),
        "--overwrite_output_dir",
        *flags,
        *(part for pair in recipe for part in pair),
    ]


def recipe_tag(args) -> str | None:
    """How a MoH run's conversion differs from the section's recipe (`--tune_recipe` / `--tune_head_budget`), in
    words; None: it does not (the zero-shot stage's best recipe, uniform head budgets)."""
    if args.tune_recipe is None and args.tune_head_budget == "uniform":
        return None
    return f"recipe {args.tune_recipe or 'calibrated'}, {args.tune_head_budget} head budgets"


def moh_argv(source: str, out: Path, data: Path, args, seed: int, budget: str, recipe, distill: bool) -> list[str]:
    """mhmoe-convert --train_file: the conversion at `budget` with the zero-shot stage's best recipe (or
    `--tune_recipe` as it stands, and `--tune_head_budget`), then the tuning."""
    shared, active = real.BUDGETS[budget]
    argv = real.calibrated_convert_argv(source, out, shared + active)
    if args.tune_recipe is None:
        argv += ["--shared_heads_by", recipe[0], "--moh_router", recipe[1]]
    else:
        argv[argv.index("--recipe") + 1] = args.tune_recipe
    if args.tune_head_budget != "uniform":
        argv += ["--head_budget", args.tune_head_budget]
    return [
        *argv,
        "--skip_logit_check",
        *tuning_flags(data, args, seed),
        *(["--distill", "--distill_temperature", "2.0", "--distill_weight", "0.5"] if distill else []),
    ]


def evaluate(model, blocks: dict[str, torch.Tensor]) -> dict[str, float]:
    return {key: real.perplexity(model, b)["ppl"] for key, b in blocks.items()}


def _entry(entries: list[dict], model: str, budget, seed, recipe: str | None = None) -> dict | None:
    key = (model, budget, seed, recipe)
    return next((e for e in entries if (e["model"], e.get("budget"), e.get("seed"), e.get("recipe")) == key), None)


def _put(entries: list[dict], entry: dict) -> None:
    old = _entry(entries, entry["model"], entry.get("budget"), entry.get("seed"), entry.get("recipe"))
    if old is not None:
        entries.remove(old)
    entries.append(entry)


def _curve(out: Path) -> list[dict]:
    records = map(json.loads, (out / "metrics.jsonl").read_text().splitlines())
    return [{"tokens": r["tokens"], "step": r["step"], "ppl": r["eval_ppl"]} for r in records if "eval_ppl" in r]


def write_tune_data(args, tokenizer) -> Path:
    """<workdir>/tune-data with the tuning split as files: train.txt (the topics between the calibration text and the
    held-out ones) and validation.txt (the `--tune_eval_blocks` held-out blocks)."""
    ids, train_text = real.split_text(args.tune_eval_blocks, tokenizer)
    data = Path(args.workdir) / "tune-data"
    data.mkdir(parents=True, exist_ok=True)
    (data / "train.txt").write_text(train_text)
    (data / "validation.txt").write_text(tokenizer.decode(ids))
    return data


def run_cli(main, argv: list[str]) -> float:
    """A console entry point (`mhmoe-train`'s or `mhmoe-convert`'s main) run in this process, Accelerate's state reset
    around it (exit code 0 is success); its seconds."""
    from mhmoe.training.prepare import reset_accelerate_state

    reset_accelerate_state()
    started = time.time()
    try:
        main(argv)
    except SystemExit as e:
        if e.code:
            raise
    seconds = time.time() - started
    reset_accelerate_state()
    return seconds


def stage_tune(args, results: dict, driver: str) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from mhmoe.convert import main as convert_main
    from mhmoe.models.moh_llama import MoHLlamaForCausalLM
    from mhmoe.training.cli import main as train_main

    source = real.dense_dir(args)
    tokenizer = AutoTokenizer.from_pretrained(source)
    data = write_tune_data(args, tokenizer)
    blocks = eval_texts(tokenizer, args)
    recipe = real.best_recipe(results) if args.tune_shared == "best" else (args.tune_shared, args.tune_router)
    if "runs" not in results.get("tune", {}):  # the earlier stage (no dense control) is replaced
        results["tune"] = {"untuned": [], "runs": []}
    tune = results["tune"]
    tune["texts"] = {
        key: {"name": TEXTS[key], "source": TEXT_SOURCES[key], "tokens": b.numel()} for key, b in blocks.items()
    }
    tune["settings"] = {
        "steps": args.tune_steps,
        "batch": BATCH,
        "block": real.BLOCK,
        "lr": args.tune_lr,
        "min_lr": args.tune_lr / 10,
        "warmup": WARMUP,
    }
    tune["recipe"] = {"shared_heads_by": recipe[0], "moh_router": recipe[1]}
    if _entry(tune["untuned"], "parent", None, None) is None:
        parent = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32).eval()
        _put(tune["untuned"], {"model": "parent", "budget": None, "seed": None, "ppl": evaluate(parent, blocks)})
        print(f"parent (untuned): {tune['untuned'][-1]['ppl']}", flush=True)
        del parent
        real.save(results)
    for seed in args.seeds:
        for budget in args.budgets:
            for run in args.runs:
                run_budget = None if run == "dense" else budget
                tag = None if run == "dense" else recipe_tag(args)
                if _entry(tune["runs"], RUNS[run], run_budget, seed, tag) is not None:
                    what = " ".join(filter(None, (RUNS[run], run_budget, tag)))
                    print(f"{what} seed {seed}: already in the results", flush=True)
                    continue
                name = "dense" if run == "dense" else f"moh-{budget.replace('/', 'of')}-{run}"
                name += "" if tag is None else f"-{args.tune_recipe or 'calibrated'}-{args.tune_head_budget}"
                out = Path(args.workdir) / "tune" / f"seed{seed}" / name
                if run == "dense":
                    argv, program = dense_argv(source, out, data, args, seed), "mhmoe-train"
                else:
                    argv = moh_argv(source, out, data, args, seed, budget, recipe, run == "distill")
                    program = "mhmoe-convert"
                seconds = run_cli(train_main if run == "dense" else convert_main, argv)
                loader = AutoModelForCausalLM if run == "dense" else MoHLlamaForCausalLM
                model = loader.from_pretrained(str(out), dtype=torch.float32).eval()
                entry = {
                    "model": RUNS[run],
                    "budget": run_budget,
                    "seed": seed,
                    **({} if tag is None else {"recipe": tag}),
                    "command": real.typed_command(argv, args, program),
                    "driver": driver,
                    "commit": results["environment"]["commit"],
                    "seconds": round(seconds, 1),
                    "curve": _curve(out),
                    "ppl": evaluate(model, blocks),
                    "sample": real.sample(model, tokenizer),
                }
                if run == "distill":
                    entry["distillation"] = json.loads((out / "distillation.json").read_text())
                del model
                print(f"{RUNS[run]} {run_budget or ''} seed {seed} ({seconds:.0f} s): {entry['ppl']}", flush=True)
                _put(tune["runs"], entry)
                if run != "dense" and _entry(tune["untuned"], "MoH zero-shot", budget, None, tag) is None:
                    converted = MoHLlamaForCausalLM.from_pretrained(str(out / "converted"), dtype=torch.float32)
                    ppl = evaluate(converted.eval(), blocks)
                    untuned = {"model": "MoH zero-shot", "budget": budget, "seed": None, "ppl": ppl}
                    _put(tune["untuned"], {**untuned, **({} if tag is None else {"recipe": tag})})
                    print(f"MoH zero-shot {budget} {tag or ''}: {ppl}", flush=True)
                    del converted
                real.save(results)
    import moh_convert_real_report as report

    for r in report.goal_rows(tune):
        seeds = ", ".join(f"seed {s} ×{v:.3f}" for s, v in sorted(r["ratios"].items()))
        print(f"{r['label']} / parent tuned on {TEXTS[r['text']]}: {seeds}; {report.goal_words(r)}")
