"""The output folder of a training run: checked before training (writable, not the model, no earlier run unless
resuming or overwriting), prepared once every input is checked, and the final save (model, tokenizer, loss plot, run
summary)."""

from __future__ import annotations

import os
import shutil

from transformers.utils import SAFE_WEIGHTS_INDEX_NAME, SAFE_WEIGHTS_NAME

from .._plumbing.checkpoint_files import machine_error, nearest_folder, overlapping, size_words
from .arguments import TrainArguments, TrainingError, recorded_args
from .checkpoints import (
    check_resume,
    list_checkpoints,
    remove_stale_temporaries,
    wait_for_checkpoint,
    write_json_atomic,
)
from .metrics import METRICS_FILE, PLOT_FILE, plot_metrics
from .state import TrainRun

SUMMARY_FILE = "train_summary.json"
# what a finished run leaves in --output_dir (besides the tokenizer): refused without --overwrite_output_dir
RUN_OUTPUTS = (
    SAFE_WEIGHTS_NAME,
    SAFE_WEIGHTS_INDEX_NAME,
    "adapter_model.safetensors",
    "adapter_config.json",
    SUMMARY_FILE,
)


def check_output_dir(args: TrainArguments, model_given: bool) -> None:
    """The output directory is writable, is not the model, and holds no earlier run unless resuming or overwriting."""
    check_output_location(args, model_given)
    check_output_contents(args)


def check_output_location(args: TrainArguments, model_given: bool) -> None:
    """Before anything is created there (the lock file): writable, and not the model being trained."""
    _check_writable(args.output_dir)
    if (
        not model_given
        and os.path.isdir(args.model_name_or_path)
        and (
            os.path.realpath(args.model_name_or_path) == os.path.realpath(args.output_dir)
            or (args.overwrite_output_dir and overlapping(args.model_name_or_path, args.output_dir))
        )
    ):
        raise TrainingError(
            f"--output_dir {args.output_dir!r} would replace or delete the model being trained "
            f"({args.model_name_or_path}); choose another --output_dir"
        )


def check_output_contents(args: TrainArguments) -> None:
    """With the folder's lock held: no link out of the folder, the checkpoint to resume, or no earlier run unless
    overwriting."""
    from .._plumbing.trust import check_links

    check_links(args.output_dir, TrainingError, "--output_dir")
    if args.resume_from_checkpoint:
        check_resume(args)
    elif not args.overwrite_output_dir:
        if list_checkpoints(args.output_dir):
            raise TrainingError(
                f"{args.output_dir} already holds checkpoints: pass --resume_from_checkpoint latest to continue, or "
                "--overwrite_output_dir to start afresh"
            )
        finished = [name for name in RUN_OUTPUTS if os.path.isfile(os.path.join(args.output_dir, name))]
        if finished:
            raise TrainingError(
                f"{args.output_dir} already holds a finished run ({', '.join(finished)}): pass --overwrite_output_dir "
                "to replace it, or choose another --output_dir"
            )


def _check_writable(directory: str) -> None:
    """Without creating anything: a directory, or a path whose nearest existing parent takes new entries."""
    if os.path.exists(directory) and not os.path.isdir(directory):
        raise TrainingError(f"--output_dir {directory!r} is a file, not a directory")
    existing = os.path.abspath(directory)
    while not os.path.exists(existing):
        existing = os.path.dirname(existing)
    if not os.path.isdir(existing) or not os.access(existing, os.W_OK | os.X_OK):
        from .._plumbing.checkpoint_files import machine_error

        raise machine_error(
            TrainingError, f"--output_dir {directory!r} is not writable ({existing} does not take new files)"
        )


def _run_outputs(output_dir: str) -> tuple[list[str], list[str]]:
    """What an earlier run left: (checkpoint folders, also those a crash left half-written; files: metrics, final
    weights and summary)."""
    folders = [path for _, path in list_checkpoints(output_dir, complete=False)]
    files = [os.path.join(output_dir, name) for name in (METRICS_FILE, *RUN_OUTPUTS)]
    return folders, [path for path in files if os.path.isfile(path)]


def _remove_run_outputs(output_dir: str) -> None:
    """--overwrite_output_dir: what an earlier run left."""
    folders, files = _run_outputs(output_dir)
    for path in folders:
        shutil.rmtree(path)
    for path in files:
        os.remove(path)


def check_disk_space(run: TrainRun) -> None:
    """Before anything is removed or written: the disk holds what the run will write (an estimate from the model:
    the final model or adapter, and the checkpoints alive at once, each the weights plus AdamW's two moments of the
    trainable ones), counting the space that --overwrite_output_dir frees. Refused when not even the final save and
    one checkpoint fit (the run could only fail, after its training time is spent); a warning when the later
    checkpoints do not (a run may be stopped early, or old checkpoints removed while it runs)."""
    args = run.args
    params = list(run.accelerator.unwrap_model(run.model).parameters())
    weights = sum(p.numel() * p.element_size() for p in params)
    trainable = sum(p.numel() * p.element_size() for p in params if p.requires_grad)
    final = trainable + (weights if args.merge_lora else 0) if args.lora else weights
    checkpoint = weights + 2 * trainable + (trainable if args.lora else 0)  # save_state (+ the adapter with LoRA)
    existing = list_checkpoints(args.output_dir) if args.resume_from_checkpoint else []
    saves = 0
    if args.save_steps:
        done = existing[-1][0] if existing else 0
        saves = run.total_steps // args.save_steps - done // args.save_steps
    if args.save_total_limit:  # the newest is written before the oldest goes
        saves = max(0, min(saves, args.save_total_limit + 1 - len(existing)))
    free = shutil.disk_usage(nearest_folder(args.output_dir)).free
    if args.overwrite_output_dir and not args.resume_from_checkpoint:
        free += _run_outputs_bytes(args.output_dir)
    first = final + min(saves, 1) * checkpoint
    kind = "adapter" if args.lora else "model"
    if first > free:
        what = f"the final {kind} ({size_words(final)})"
        if saves:
            what += f" and a checkpoint ({size_words(checkpoint)}: weights and optimizer state)"
        raise machine_error(
            TrainingError,
            f"not enough disk space to write {args.output_dir}: {what} need {size_words(first)}, {size_words(free)} "
            "free; free some space or choose another --output_dir",
        )
    if final + saves * checkpoint > free:
        fits = (free - final) // checkpoint
        run.accelerator.print(
            f"mhmoe-train: warning: {args.output_dir} has room for {fits} of this run's {saves} checkpoints "
            f"({size_words(checkpoint)} each) beside the final {kind} ({size_words(free)} free); keep fewer "
            "(--save_total_limit), save less often (--save_steps) or free space before the disk fills"
        )


def _run_outputs_bytes(output_dir: str) -> int:
    """Bytes of what `_remove_run_outputs` would remove."""
    folders, files = _run_outputs(output_dir)
    for folder in folders:
        files += [os.path.join(root, name) for root, _, names in os.walk(folder) for name in names]
    return sum(os.path.getsize(path) for path in files)


def prepare_output_dir(run: TrainRun) -> None:
    """Every input is checked: only now is an earlier run's output removed, and output_dir created."""
    args = run.args
    check_disk_space(run)
    if run.is_main:
        os.makedirs(args.output_dir, exist_ok=True)
        removed = remove_stale_temporaries(args.output_dir)  # this run holds the folder's lock: they are no one's
        if removed:
            run.accelerator.print(f"removed what interrupted runs left half-written: {', '.join(removed)}")
        if args.overwrite_output_dir and not args.resume_from_checkpoint:
            _remove_run_outputs(args.output_dir)
    run.accelerator.wait_for_everyone()


def _is_mhmoe_card(path: str) -> bool:
    """A README.md written by mhmoe's cards: YAML metadata whose tags include `mhmoe`."""
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except (OSError, UnicodeDecodeError):
        return False
    metadata = text.split("---", 2)[1] if text.startswith("---") and text.count("---") >= 2 else ""
    return "\n- mhmoe\n" in metadata


def _write_remote_code(folder: str, model) -> None:
    """An mhmoe model's folder made loadable with `trust_remote_code=True` where mhmoe is not installed: its modeling
    code, `auto_map` and a model card (`hub.remote_code.write_remote_code`). A PEFT adapter's folder is left as is."""
    if type(model).__module__.startswith("mhmoe."):
        from ..hub.remote_code import write_remote_code

        write_remote_code(folder, model.config)


def _rewrite_card(folder: str, model, training: str, records_dir: str | None = None) -> None:
    """The model card (README.md) that `_write_remote_code` wrote into `folder` (or an earlier, interrupted or
    overwritten, save), rendered again now that the tokenizer is there, with `training` (from the run's summary) as
    its Training section and the conversion record in `records_dir` (default `folder`). A card that mhmoe did not
    write (a PEFT adapter's, the user's own) is kept."""
    card_path = os.path.join(folder, "README.md")
    if not type(model).__module__.startswith("mhmoe.") or not _is_mhmoe_card(card_path):
        return
    from pathlib import Path

    from ..hub.remote_code import auto_classes, render_model_card

    card = render_model_card(
        model.config,
        auto_classes(model.config),
        Path(folder),
        Path(folder).resolve().name,
        records_dir=records_dir,
        training=training,
    )
    temporary = f"{card_path}.tmp-{os.getpid()}"
    with open(temporary, "w", encoding="utf-8") as f:
        f.write(card)
    os.replace(temporary, card_path)


def save_final(run: TrainRun, final_eval: dict | None):
    """The unwrapped model (full, or the adapter with --lora; merged too with --merge_lora), tokenizer, loss plot and
    run summary. Returns the unwrapped model."""
    args, accelerator = run.args, run.accelerator
    wait_for_checkpoint(run)  # the last checkpoint is in place before the final save
    accelerator.wait_for_everyone()
    state_dict = accelerator.get_state_dict(run.model)
    unwrapped = accelerator.unwrap_model(run.model)
    unwrapped.save_pretrained(
        args.output_dir, is_main_process=run.is_main, save_function=accelerator.save, state_dict=state_dict
    )
    if run.is_main:
        _write_remote_code(args.output_dir, unwrapped)
        run.tokenizer.save_pretrained(args.output_dir)
        if args.lora and args.merge_lora:
            import copy

            merged = copy.deepcopy(unwrapped).merge_and_unload()
            merged.save_pretrained(os.path.join(args.output_dir, "merged"))
            _write_remote_code(os.path.join(args.output_dir, "merged"), merged)
            run.tokenizer.save_pretrained(os.path.join(args.output_dir, "merged"))
        if args.plot:
            plot_metrics(run.metrics_path, os.path.join(args.output_dir, PLOT_FILE))
        summary = {
            "step": run.total_steps,
            "num_processes": run.world,
            "distributed_type": accelerator.distributed_type.value,
            "mixed_precision": accelerator.mixed_precision,
            "global_batch_blocks": run.global_blocks,
            "block_size": run.block_size,
            "tokens_seen": run.tokens_seen,
            "data_format": run.data_format,
            "trainable_parameters": run.trainable,
            "parameters": run.total_params,
            "final_eval": final_eval,
            "args": recorded_args(args),
        }
        # the card was written before the tokenizer and the summary existed: again, with both
        from ..hub.cards import training_text

        _rewrite_card(args.output_dir, unwrapped, training_text(summary))
        if args.lora and args.merge_lora:
            _rewrite_card(os.path.join(args.output_dir, "merged"), merged, training_text(summary), args.output_dir)
        write_json_atomic(os.path.join(args.output_dir, SUMMARY_FILE), summary)  # written last: the run finished
    accelerator.wait_for_everyone()
    return unwrapped


__all__ = [
    "RUN_OUTPUTS",
    "SUMMARY_FILE",
    "check_output_contents",
    "check_output_dir",
    "check_output_location",
    "prepare_output_dir",
    "save_final",
]
