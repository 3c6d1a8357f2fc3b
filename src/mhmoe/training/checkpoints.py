"""Checkpoints of a training run: `checkpoint-N` folders in the output folder, written every --save_steps and
resumed with --resume_from_checkpoint (a folder, or "latest").

A checkpoint is `Accelerator.save_state` (model, optimizer, scheduler, RNG states) plus the tokenizer and the state file
`train_state.json`, written last: a folder without it is incomplete (a crash while saving) and never resumed.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import shutil

from .arguments import TrainArguments, TrainingError
from .metrics import PLOT_FILE, _read_metrics, plot_metrics
from .state import TrainRun

STATE_FILE = "train_state.json"
CHECKPOINT_PREFIX = "checkpoint-"
# settings that decide which parameters train: a checkpoint resumes only with the same ones
PARAMETER_SETTINGS = ("lora", "lora_r", "lora_target_modules", "lora_experts")


def list_checkpoints(directory: str, complete: bool = True) -> list[tuple[int, str]]:
    """(step, path) of the checkpoint-N folders, oldest first; `complete`: only those whose state file was written."""
    if not os.path.isdir(directory):
        return []
    found = []
    for name in os.listdir(directory):
        match = re.fullmatch(CHECKPOINT_PREFIX + r"(\d+)", name)
        path = os.path.join(directory, name)
        if match and os.path.isdir(path) and (not complete or os.path.isfile(os.path.join(path, STATE_FILE))):
            found.append((int(match.group(1)), path))
    return sorted(found)


def resolve_checkpoint(checkpoint: str, output_dir: str) -> str:
    if checkpoint == "latest":
        found = list_checkpoints(output_dir)
        if not found:
            raise TrainingError(f"--resume_from_checkpoint latest: no complete checkpoint in {output_dir}")
        return found[-1][1]
    if not os.path.isfile(os.path.join(checkpoint, STATE_FILE)):
        raise TrainingError(f"--resume_from_checkpoint {checkpoint!r} is not a complete checkpoint (no {STATE_FILE})")
    return checkpoint


def check_resume(args: TrainArguments) -> None:
    """--resume_from_checkpoint names a complete checkpoint (resolved in place: "latest" becomes its folder) saved with
    the same trained parameters."""
    args.resume_from_checkpoint = resolve_checkpoint(args.resume_from_checkpoint, args.output_dir)
    with open(os.path.join(args.resume_from_checkpoint, STATE_FILE)) as f:
        saved = json.load(f).get("args", {})
    changed = [f"--{key} {saved[key]!r} -> {getattr(args, key)!r}" for key in PARAMETER_SETTINGS
               if key in saved and saved[key] != getattr(args, key)]  # fmt: skip
    if changed:  # the saved optimizer state belongs to another set of trained parameters
        raise TrainingError(
            f"{args.resume_from_checkpoint} was saved with other trained parameters ({'; '.join(changed)}): "
            "resume with the same settings, or start a new run"
        )


def save_checkpoint(run: TrainRun, step: int) -> None:
    """`Accelerator.save_state` + tokenizer + the state file (written last: it marks the checkpoint complete)."""
    args = run.args
    path = os.path.join(args.output_dir, f"{CHECKPOINT_PREFIX}{step}")
    run.accelerator.save_state(path)
    if run.is_main:
        run.tokenizer.save_pretrained(path)
        state = {"step": step, "total_steps": run.total_steps, "global_batch_blocks": run.global_blocks,
                 "block_size": run.block_size, "seed": args.seed, "num_train_blocks": len(run.train_blocks),
                 "num_processes": run.world, "args": dataclasses.asdict(args)}  # fmt: skip
        with open(os.path.join(path, STATE_FILE), "w") as f:
            json.dump(state, f, indent=2)
        if args.save_total_limit:
            for _, old in list_checkpoints(args.output_dir)[: -args.save_total_limit]:
                shutil.rmtree(old, ignore_errors=True)
        if args.plot:
            plot_metrics(run.metrics_path, os.path.join(args.output_dir, PLOT_FILE))
    run.accelerator.wait_for_everyone()


def resume(run: TrainRun) -> None:
    """Load a checkpoint's state (model, optimizer, scheduler, RNG) and keep the metrics up to its step."""
    args = run.args
    if args.resume_from_checkpoint:
        with open(os.path.join(args.resume_from_checkpoint, STATE_FILE)) as f:
            saved = json.load(f)
        for key, now in (("global_batch_blocks", run.global_blocks), ("block_size", run.block_size),
                         ("seed", args.seed), ("num_train_blocks", len(run.train_blocks))):  # fmt: skip
            if saved.get(key) != now:
                run.accelerator.print(
                    f"warning: {key} was {saved.get(key)} in {args.resume_from_checkpoint}, now {now}: the resumed run "
                    "will not see the same data order as the interrupted one"
                )
        run.accelerator.load_state(args.resume_from_checkpoint)
        run.start_step = saved["step"]
        if run.start_step >= run.total_steps:
            raise TrainingError(
                f"{args.resume_from_checkpoint} is at step {run.start_step} >= total steps {run.total_steps}"
            )
    if run.is_main:  # keep the metrics up to the resumed step; drop those of steps that will be redone
        kept = _read_metrics(run.metrics_path) if run.start_step else []
        with open(run.metrics_path, "w") as f:
            f.writelines(json.dumps(r) + "\n" for r in kept if r.get("step", 0) <= run.start_step)


__all__ = ["CHECKPOINT_PREFIX", "PARAMETER_SETTINGS", "STATE_FILE", "check_resume", "list_checkpoints",
           "resolve_checkpoint", "resume", "save_checkpoint"]  # fmt: skip
