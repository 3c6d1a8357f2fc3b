"""Continue-tune a converted model with mhmoe.training, and draw its recovery curve (the MoH paper's Fig. 2).

`convert_and_continue_tune(args, tune)` converts into OUTPUT_DIR/converted (main process; skipped when resuming), then
trains it with `mhmoe.training` into OUTPUT_DIR on every process, with the recipe's continue-tuning defaults (recipe.py),
periodic validation, the dense parent's perplexity (all heads on) at step 0, and a recovery curve (perplexity vs
training tokens: recovery_curve.csv / .png, recovery_summary.json), which the model card then states.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import time

from transformers.utils import CONFIG_NAME

from .._plumbing.checkpoint_files import replace_dir, temporary_dir_next_to, write_json_atomic
from ..hub.cards import RECOVERY_RECORD
from .arguments import ConvertArguments, _continue_tune_arguments_class
from .conversion import convert
from .errors import ConversionError
from .recipe import head_split
from .verify import all_heads_active
from .write import check_paths, output_state

CONVERTED_SUBDIR = "converted"
DISTILL_RECORD = "distillation.json"
RECOVERY_CSV = "recovery_curve.csv"
RECOVERY_PNG = "recovery_curve.png"


def continue_tune_arguments(**values):
    return _continue_tune_arguments_class()(**values)


def _check_converted(converted: str, args: ConvertArguments) -> None:
    """A resumed run's converted model must be the one these arguments would make."""
    config_path = os.path.join(converted, CONFIG_NAME)
    if not os.path.isfile(config_path):
        raise ConversionError(f"--resume_from_checkpoint: no converted model in {converted}")
    with open(config_path) as f:
        config = json.load(f)
    shared_heads, _ = args.head_counts()
    want = head_split(
        config["num_attention_heads"], args.shared_heads_ratio, args.active_heads_ratio, shared_heads, args.active_heads
    )
    got = (config.get("moh_shared_heads"), config.get("moh_active_heads"))
    if config.get("model_type") != "moh_llama" or got != want:
        raise ConversionError(
            f"--resume_from_checkpoint: {converted} holds {got[0]} shared + {got[1]} routed active heads, but the "
            f"ratios ask for {want[0]} + {want[1]}"
        )


def _convert_for_tuning(args: ConvertArguments, tune, progress: bool):
    """Main process: the training arguments checked, then the conversion into OUTPUT_DIR/converted (atomically: the
    whole OUTPUT_DIR appears at once). Returns the ConversionReport."""
    from ..training.arguments import TrainArguments
    from ..training.loop import check_before_training

    out = args.output_dir
    converted = os.path.join(out, CONVERTED_SUBDIR)
    check_paths(args.input_dir, out)
    output_state(out, args.overwrite)
    # the training arguments are checked before the conversion, which may take long
    check_before_training(
        TrainArguments(
            model_name_or_path=converted,
            output_dir=out,
            **dataclasses.asdict(tune),
            overwrite_output_dir=args.overwrite,
        ),
        model_given=True,
    )
    if args.distill:  # its settings are checked before the conversion too
        from .distill import Distillation

        Distillation(args.distill_temperature, args.distill_weight)
    temporary = temporary_dir_next_to(out)
    try:
        options = {**args.conversion_options(), "overwrite": False}
        report = convert(args.input_dir, os.path.join(temporary, CONVERTED_SUBDIR), progress=progress, **options)
        report.output_dir = converted
        print(report.format(), flush=True)
        output_state(out, args.overwrite)
        replace_dir(temporary, out)
    except BaseException:
        shutil.rmtree(temporary, ignore_errors=True)
        raise
    return report


def _distilled_model(args: ConvertArguments, train_args):
    """With --distill: the converted model (float32) with its dense parent's distillation hook (distill.py), and the
    Distillation; else (None, None): mhmoe.training loads the model itself."""
    if not args.distill:
        return None, None
    import torch

    from ..models.moh_llama import MoHLlamaForCausalLM
    from .distill import Distillation

    distillation = Distillation(args.distill_temperature, args.distill_weight)
    model = MoHLlamaForCausalLM.from_pretrained(
        train_args.model_name_or_path, dtype=torch.float32, trust_remote_code=False
    )
    distillation.attach(model)
    return model, distillation


def _tune(args: ConvertArguments, tune, state):
    """Every process: mhmoe.training on OUTPUT_DIR/converted; the recovery curve on the main process."""
    from ..training.arguments import TrainArguments, TrainingError
    from ..training.loop import train

    out = args.output_dir
    train_args = TrainArguments(
        model_name_or_path=os.path.join(out, CONVERTED_SUBDIR), output_dir=out, **dataclasses.asdict(tune)
    )
    validated = (
        bool(train_args.validation_file or train_args.validation_split) or train_args.validation_split_percentage > 0
    )
    if not validated:
        train_args.eval_at_start = False
        state.print(
            "note: no --validation_file / --validation_split_percentage (--validation_split with --dataset): no perplexity, no recovery curve"
        )
    model, distillation = _distilled_model(args, train_args)
    started = time.time()
    try:
        result = train(train_args, model=model, reference_eval=all_heads_active if validated else None)
    except TrainingError:  # an input problem found before training (e.g. in the data): no half-done output
        if not tune.resume_from_checkpoint and state.is_main_process:
            shutil.rmtree(out, ignore_errors=True)
        raise
    summary = None
    if distillation is not None and state.is_main_process:
        record = {**distillation.record(), "train_seconds": round(time.time() - started, 3)}
        with open(os.path.join(out, DISTILL_RECORD), "w") as f:
            json.dump(record, f, indent=2)
    if state.is_main_process and validated:
        summary = recovery_curve(out)
        if summary is not None:
            print(format_recovery(summary), flush=True)
            write_json_atomic(os.path.join(out, RECOVERY_RECORD), summary)
            _cards_with_recovery(out, result.model)
    return result, summary


def _cards_with_recovery(out: str, model) -> None:
    """The cards training's final save wrote (OUTPUT_DIR's; OUTPUT_DIR/merged's with --merge_lora) rendered again now
    that recovery_summary.json is there, so that their Training section gives the parent's, the untuned and the tuned
    perplexity. Each card is replaced whole (a temporary file renamed); one mhmoe did not write (PEFT's) is kept."""
    from ..hub.cards import folder_records
    from ..training.outputs import _rewrite_card

    training = folder_records(out).get("training")
    _rewrite_card(out, model, training)
    merged = os.path.join(out, "merged")
    if hasattr(model, "get_base_model") and os.path.isdir(merged):  # a PeftModel: its merged copy's card
        _rewrite_card(merged, model.get_base_model(), training, out)


def convert_and_continue_tune(args: ConvertArguments, tune, progress: bool = True) -> dict:
    """Convert into OUTPUT_DIR/converted (main process; skipped when resuming), then continue-tune with mhmoe.training into
    OUTPUT_DIR (every process). Returns {"conversion": ConversionReport | None, "train": TrainResult,
    "recovery": summary | None}."""
    from accelerate import PartialState
    from accelerate.utils import broadcast_object_list, parse_flag_from_env

    if isinstance(tune, dict):
        tune = continue_tune_arguments(**tune)
    state = PartialState(cpu=parse_flag_from_env("ACCELERATE_USE_CPU"))  # as the Accelerator in mhmoe.training will
    report, failure = None, None
    if state.is_main_process:
        try:
            if tune.resume_from_checkpoint:
                _check_converted(os.path.join(args.output_dir, CONVERTED_SUBDIR), args)
            else:
                report = _convert_for_tuning(args, tune, progress)
        except Exception as e:  # told to every process before it is raised here, so that none waits forever
            failure = e
    if state.num_processes > 1:
        box = [None if failure is None else f"{type(failure).__name__}: {failure}"]
        broadcast_object_list(box, from_process=0)
        if box[0] is not None and failure is None:
            raise ConversionError(f"the main process failed: {box[0]}")
    if failure is not None:
        raise failure

    result, summary = _tune(args, tune, state)
    state.wait_for_everyone()
    return {"conversion": report, "train": result, "recovery": summary}


def recovery_curve(output_dir: str, threshold: float = 1.05) -> dict | None:
    """Write recovery_curve.csv / .png (validation perplexity vs training tokens, the dense parent as reference, like
    the MoH paper's Fig. 2) from a continue-tuning run's metrics.jsonl, and return a summary (None without
    validation records)."""
    from ..training.metrics import METRICS_FILE, _read_metrics

    records = _read_metrics(os.path.join(output_dir, METRICS_FILE))
    references = [r["reference_eval_ppl"] for r in records if "reference_eval_ppl" in r]
    dense = references[-1] if references else None
    by_step = {r["step"]: r for r in records if "eval_ppl" in r}
    if not by_step:
        return None
    rows = [by_step[step] for step in sorted(by_step)]
    with open(os.path.join(output_dir, RECOVERY_CSV), "w") as f:
        f.write("step,tokens,eval_loss,eval_ppl,dense_ppl,ppl_over_dense\n")
        for r in rows:
            ratio = r["eval_ppl"] / dense if dense else float("nan")
            f.write(
                f"{r['step']},{r.get('tokens', '')},{r['eval_loss']:.6f},{r['eval_ppl']:.6f},"
                f"{dense if dense else ''},{ratio:.6f}\n"
            )
    _plot_recovery(rows, dense, threshold, os.path.join(output_dir, RECOVERY_PNG))
    summary = {
        "dense_ppl": dense,
        "start_ppl": rows[0]["eval_ppl"] if rows[0]["step"] == 0 else None,
        "final_ppl": rows[-1]["eval_ppl"],
        "final_tokens": rows[-1].get("tokens"),
        "final_step": rows[-1]["step"],
        "threshold": threshold,
    }
    if dense:
        summary["final_ratio"] = rows[-1]["eval_ppl"] / dense
        summary["recovered"] = summary["final_ratio"] <= threshold
        within = [r.get("tokens") for r in rows if r["eval_ppl"] <= threshold * dense and r["step"] > 0]
        summary["tokens_to_recover"] = within[0] if within else None
    return summary


def _plot_recovery(rows: list[dict], dense: float | None, threshold: float, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.5, 4))
    tokens = [r.get("tokens", r["step"]) for r in rows]
    ax.plot(tokens, [r["eval_ppl"] for r in rows], "o-", label="MoH (continue-tuned)")
    if dense:
        ax.axhline(dense, color="k", label=f"dense parent ({dense:.2f})")
        ax.axhline(dense * threshold, color="k", ls="--", alpha=0.6, label=f"{threshold:g} × dense")
    ax.set_xlabel("continue-tuning tokens")
    ax.set_ylabel("validation perplexity")
    ax.set_title("Recovery of the converted MoH model")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def format_recovery(summary: dict) -> str:
    if summary.get("dense_ppl") is None:
        return f"recovery: validation perplexity {summary['final_ppl']:.3f} after {summary['final_tokens']} tokens"
    dense = summary["dense_ppl"]
    parts = [f"recovery: dense parent perplexity {dense:.3f}"]
    if summary.get("start_ppl") is not None:
        parts.append(f"converted, before tuning {summary['start_ppl']:.3f} (×{summary['start_ppl'] / dense:.3f})")
    parts.append(f"after {summary['final_tokens']:,} tokens {summary['final_ppl']:.3f} (×{summary['final_ratio']:.3f})")
    recovered = summary["tokens_to_recover"]
    parts.append(
        f"within {summary['threshold']:g}× from {recovered:,} tokens"
        if recovered is not None
        else f"not within {summary['threshold']:g}× yet"
    )
    return "; ".join(parts)
