"""Checkpoints of a training run: `checkpoint-N` folders in the output folder, written every --save_steps and
resumed with --resume_from_checkpoint (a folder, or "latest").

A checkpoint is `Accelerator.save_state` (model, optimizer, scheduler, RNG states), the tokenizer, what makes the
folder load with `from_pretrained` (config.json and generation_config.json; with --lora the adapter files), the state
file `train_state.json`, and last its manifest (`manifest.py`: every file's size and SHA-256). Complete or absent:
everything is written into a hidden `.checkpoint-N.tmp` folder, every file is flushed to disk while it is hashed, the
manifest is written, and only then is the folder renamed to `checkpoint-N`. A kill at any moment leaves either the
previous checkpoints alone or the new one complete; the next run removes the hidden leftovers. Resuming verifies the
manifest (a flipped byte, a truncated, empty or missing file, a step that disagrees with the folder's name are refused
in one line naming the file); `latest` takes the newest checkpoint that verifies and says which newer ones it skipped
and why. A checkpoint is accepted only with a manifest that verifies. The one exception is a checkpoint provably
written before manifests existed (its state file lacks every key written since, `MANIFEST_ERA_KEYS`): it resumes,
unverified and with a one-line warning, only when named explicitly; `latest` skips it. An RNG state file that does
not load is refused by name (`--resume_without_rng_state` goes on without it).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import sys
from concurrent.futures import ThreadPoolExecutor

from .._plumbing.checkpoint_files import fsync, load_error_words, write_json_atomic
from .arguments import TrainArguments, TrainingError, recorded_args
from .manifest import MANIFEST_FILE, ManifestError, Sealer, read_manifest, verify
from .metrics import PLOT_FILE, plot_metrics
from .state import TrainRun
from .streaming import load_stream_state, save_stream_state

STATE_FILE = "train_state.json"
CHECKPOINT_PREFIX = "checkpoint-"
TEMPORARY_SUFFIX = ".tmp"  # `.checkpoint-N.tmp`: a checkpoint being written (hidden: never listed as a checkpoint)
RNG_STATE_FILE = "random_states_{}.pkl"  # Accelerate's RNG_STATE_NAME, one per process
# settings that decide which parameters train: a checkpoint resumes only with the same ones
PARAMETER_SETTINGS = ("lora", "lora_r", "lora_target_modules", "lora_experts", "lora_routers")
SETTINGS_BEFORE = {"lora_routers": False}  # what a checkpoint saved before a setting existed did
# state-file keys written only by an mhmoe that also writes manifests (metrics_records came with the manifest, in
# 79da767; "sealed" is written from now on): such a checkpoint without its manifest has lost it
MANIFEST_ERA_KEYS = ("sealed", "metrics_records")


def _warn(message: str) -> None:
    print(f"mhmoe-train: warning: {message}", file=sys.stderr, flush=True)


def read_state(path: str) -> dict:
    """The state file of checkpoint folder `path`; raises `TrainingError` saying why the checkpoint is not complete.
    Cheap (no hashing): `verify_checkpoint` also checks every file against the manifest."""
    state_path = os.path.join(path, STATE_FILE)
    if not os.path.isfile(state_path):
        raise TrainingError(f"{path} is not a complete checkpoint (no {STATE_FILE})")
    try:
        with open(state_path) as f:
            state = json.load(f)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        size = os.path.getsize(state_path)
        what = "is empty" if size == 0 else f"is not valid JSON ({e})"
        raise TrainingError(f"{path} is not a complete checkpoint ({STATE_FILE} {what})") from None
    step = state.get("step") if isinstance(state, dict) else None
    if not isinstance(step, int) or isinstance(step, bool):
        raise TrainingError(f"{path} is not a complete checkpoint ({STATE_FILE} has no step)")
    named = re.fullmatch(CHECKPOINT_PREFIX + r"(\d+)", os.path.basename(os.path.abspath(path)))
    if step < 0 or (named and int(named.group(1)) != step):
        expected = f"{int(named.group(1))}, as the folder's name says" if named else "a step >= 0"
        raise TrainingError(
            f"{state_path} says step {step}, not {expected}: the state file was edited or belongs to another checkpoint"
        )
    return state


def verify_checkpoint(path: str, named: bool = False) -> dict:
    """`read_state`, then every file against the checkpoint's manifest; returns the state. Without a manifest, only a
    checkpoint provably written before manifests existed passes, only when `named` explicitly, with a warning."""
    state = read_state(path)
    try:
        manifest = read_manifest(path)
        if manifest is None:
            return _without_manifest(path, state, named)
        verify(path, manifest)
    except ManifestError as e:
        raise TrainingError(f"{path} is damaged: {e}") from None
    return state


def _without_manifest(path: str, state: dict, named: bool) -> dict:
    if any(key in state for key in MANIFEST_ERA_KEYS):  # this mhmoe wrote a manifest; it is gone
        raise ManifestError(
            f"its {MANIFEST_FILE} is missing, though its {STATE_FILE} shows an mhmoe that writes one saved it: the "
            "files cannot be verified"
        )
    if not named:
        raise TrainingError(
            f"{path} has no {MANIFEST_FILE} (written before mhmoe verified checkpoints): it is resumed, unverified, "
            "only when named explicitly (--resume_from_checkpoint FOLDER)"
        )
    _warn(f"{path} has no {MANIFEST_FILE} (written by an mhmoe from before manifests): its files cannot be verified")
    return state


def list_checkpoints(directory: str, complete: bool = True) -> list[tuple[int, str]]:
    """(step, path) of the checkpoint-N folders, oldest first; `complete`: only those whose state file reads back."""
    if not os.path.isdir(directory):
        return []
    found = []
    for name in os.listdir(directory):
        match = re.fullmatch(CHECKPOINT_PREFIX + r"(\d+)", name)
        path = os.path.join(directory, name)
        if match and os.path.isdir(path):
            if complete:
                try:
                    read_state(path)
                except TrainingError:
                    continue
            found.append((int(match.group(1)), path))
    return sorted(found)


def resolve_checkpoint(checkpoint: str, output_dir: str) -> str:
    """The checkpoint folder to resume: `checkpoint` itself once it verifies, or for "latest" the newest checkpoint
    in `output_dir` that verifies (the newer ones skipped are named, with the reason)."""
    if checkpoint == "latest":
        skipped = []
        for _, path in reversed(list_checkpoints(output_dir, complete=False)):
            try:
                verify_checkpoint(path)
            except TrainingError as e:
                skipped.append(str(e))
                continue
            for reason in skipped:
                _warn(f"--resume_from_checkpoint latest: skipping {reason}")
            if skipped:
                _warn(f"--resume_from_checkpoint latest: resuming from {path}, the newest checkpoint that verifies")
            return path
        detail = f" ({'; '.join(skipped)})" if skipped else ""
        raise TrainingError(f"--resume_from_checkpoint latest: no complete checkpoint in {output_dir}{detail}")
    if not os.path.isdir(checkpoint):
        raise TrainingError(f"--resume_from_checkpoint {checkpoint}: no such folder (or 'latest')")
    from .._plumbing.trust import check_links

    check_links(checkpoint, TrainingError, "--resume_from_checkpoint")
    try:
        verify_checkpoint(checkpoint, named=True)
    except TrainingError as e:
        raise TrainingError(
            f"--resume_from_checkpoint: {e}; resume from another checkpoint (`latest` takes the "
            "newest one that verifies)"
        ) from None
    return checkpoint


def check_rng_states(path: str, processes: int, allow_missing: bool) -> None:
    """Every process's RNG state file of checkpoint `path` loads (as Accelerate loads it: `weights_only`); Accelerate
    itself would skip an unreadable one silently, and the resumed run would draw other random numbers."""
    from accelerate.utils.other import load

    for index in range(processes):
        file = os.path.join(path, RNG_STATE_FILE.format(index))
        try:
            states = load(file)
            if not isinstance(states, dict) or "torch_manual_seed" not in states:
                raise ValueError("no torch RNG state in it")
        except Exception as e:  # missing, truncated (EOFError, RuntimeError, UnpicklingError) or not a state dict
            if allow_missing:
                _warn(
                    f"{file} does not load ({type(e).__name__}); resuming without it as --resume_without_rng_state "
                    "asks (random draws such as router jitter will differ from the interrupted run)"
                )
                continue
            raise TrainingError(
                f"the RNG state {file} does not load ({load_error_words(e)}): the checkpoint is damaged; resume from "
                "another checkpoint, or pass --resume_without_rng_state to go on with fresh random states"
            ) from None


def check_resume(args: TrainArguments) -> None:
    """--resume_from_checkpoint names a complete checkpoint (resolved in place: "latest" becomes its folder) saved with
    the same trained parameters, whose RNG states load."""
    args.resume_from_checkpoint = resolve_checkpoint(args.resume_from_checkpoint, args.output_dir)
    state = read_state(args.resume_from_checkpoint)
    saved = state.get("args", {})
    if saved.get("lora"):
        saved = {**SETTINGS_BEFORE, **saved}
    settings = PARAMETER_SETTINGS if saved.get("lora") or args.lora else ("lora",)  # the rest only matter with LoRA
    changed = [
        f"--{key} {saved[key]!r} -> {getattr(args, key)!r}"
        for key in settings
        if key in saved and saved[key] != getattr(args, key)
    ]
    if changed:  # the saved optimizer state belongs to another set of trained parameters
        raise TrainingError(
            f"{args.resume_from_checkpoint} was saved with other trained parameters ({'; '.join(changed)}): "
            "resume with the same settings, or start a new run"
        )
    check_rng_states(args.resume_from_checkpoint, int(state.get("num_processes", 1)), args.resume_without_rng_state)


# --------------------------------------------------------------------------------------------------------------------
# writing


def remove_dir_atomic(path: str) -> None:
    """Rename a folder to a hidden temporary name, then delete it: a kill midway never leaves a half-deleted
    `checkpoint-N` that still looks like a checkpoint."""
    parent, name = os.path.split(os.path.abspath(path))
    doomed = os.path.join(parent, f".{name}{TEMPORARY_SUFFIX}-delete")
    shutil.rmtree(doomed, ignore_errors=True)
    os.replace(path, doomed)
    shutil.rmtree(doomed, ignore_errors=True)


def remove_stale_temporaries(directory: str) -> list[str]:
    """Remove what killed runs left mid-write in `directory` (hidden `.checkpoint-N.tmp*` folders, `*.tmp-PID`
    files); returns their names. Only call it while holding the output-folder lock."""
    removed = []
    if not os.path.isdir(directory):
        return removed
    for name in sorted(os.listdir(directory)):
        path = os.path.join(directory, name)
        checkpoint_leftover = name.startswith("." + CHECKPOINT_PREFIX) and TEMPORARY_SUFFIX in name
        file_leftover = re.search(re.escape(TEMPORARY_SUFFIX) + r"-\d+$", name) and os.path.isfile(path)
        if checkpoint_leftover and os.path.isdir(path):
            shutil.rmtree(path, ignore_errors=True)
            removed.append(name)
        elif file_leftover:
            os.remove(path)
            removed.append(name)
    return removed


def _write_loadable(run: TrainRun, folder: str) -> None:
    """What makes a checkpoint folder load with `from_pretrained` (and evaluate, export) beside Accelerate's
    model.safetensors: config.json and generation_config.json; with --lora the adapter (adapter_config.json,
    adapter_model.safetensors: load it over the base model, e.g. `mhmoe-eval --model_args pretrained=BASE,peft=DIR`)."""
    model = run.accelerator.unwrap_model(run.model)
    if run.args.lora:
        model.save_pretrained(folder)
        return
    if not os.path.isfile(os.path.join(folder, "model.safetensors")):  # sharded states (FSDP): not a model folder
        return
    config = model.config
    if not config.architectures:
        config.architectures = [type(model).__name__]
    config.save_pretrained(folder)
    if getattr(model, "generation_config", None) is not None:
        model.generation_config.save_pretrained(folder)


def save_checkpoint(run: TrainRun, step: int) -> None:
    """`Accelerator.save_state` + tokenizer + config + the state file into a hidden temporary folder; then, in a
    background thread while training goes on, every file flushed and hashed into the manifest and the folder renamed
    to `checkpoint-{step}` (see the module docstring). `wait_for_checkpoint` waits for it (the next checkpoint, the
    final save and the end of `train` do)."""
    args, accelerator = run.args, run.accelerator
    wait_for_checkpoint(run)
    final = os.path.join(args.output_dir, f"{CHECKPOINT_PREFIX}{step}")
    temporary = os.path.join(args.output_dir, f".{CHECKPOINT_PREFIX}{step}{TEMPORARY_SUFFIX}")
    sealer = None
    if run.is_main:
        shutil.rmtree(temporary, ignore_errors=True)
        os.makedirs(temporary)
        sealer = Sealer(temporary)  # hashes and flushes each file in the background once it is written
    accelerator.wait_for_everyone()
    try:
        with sealer.hashing_writes() if sealer is not None else contextlib.nullcontext():
            accelerator.save_state(temporary)
        if run.stream is not None:  # each process's position in its share of the stream
            save_stream_state(run.stream, temporary, accelerator.process_index)
        accelerator.wait_for_everyone()  # every process's files are written
        if run.is_main:
            run.tokenizer.save_pretrained(temporary)
            _write_loadable(run, temporary)
            state = {
                "step": step,
                "total_steps": run.total_steps,
                "global_batch_blocks": run.global_blocks,
                "block_size": run.block_size,
                "seed": args.seed,
                "num_train_blocks": None if run.train_blocks is None else len(run.train_blocks),
                "tokens_seen": run.tokens_seen,
                "num_processes": run.world,
                "metrics_records": run.metrics_records,
                "sealed": True,  # a manifest is written: without it this checkpoint is refused
                "args": recorded_args(args),
            }
            with open(os.path.join(temporary, STATE_FILE), "w") as f:
                json.dump(state, f, indent=2)
            if args.plot:
                plot_metrics(run.metrics_path, os.path.join(args.output_dir, PLOT_FILE))
            run.pending_checkpoint = _COMPLETER.submit(_complete, sealer, temporary, final, args)
    except BaseException:  # a full disk, a file size limit, Ctrl-C: no half-written hidden folder left behind
        if sealer is not None and run.pending_checkpoint is None:
            sealer.close()
            shutil.rmtree(temporary, ignore_errors=True)
        raise
    accelerator.wait_for_everyone()


def _complete(sealer: Sealer, temporary: str, final: str, args: TrainArguments) -> None:
    """The background half of a checkpoint: the manifest written last, the folder renamed into place, the oldest
    checkpoints beyond --save_total_limit removed."""
    try:
        sealer.finish()  # every file flushed and hashed, the manifest written last: the completion marker
        if os.path.isdir(final):  # a checkpoint of the same step from before a resume: replaced whole
            remove_dir_atomic(final)
        os.replace(temporary, final)
    except BaseException:  # (the manifest could not be written): the incomplete folder goes
        shutil.rmtree(temporary, ignore_errors=True)
        raise
    fsync(args.output_dir)
    if args.save_total_limit:
        for _, old in list_checkpoints(args.output_dir, complete=False)[: -args.save_total_limit]:
            remove_dir_atomic(old)


_COMPLETER = ThreadPoolExecutor(max_workers=1, thread_name_prefix="mhmoe-checkpoint")


def wait_for_checkpoint(run: TrainRun) -> None:
    """Wait until the checkpoint being completed in the background is in place; its error, if any, is raised here."""
    pending, run.pending_checkpoint = run.pending_checkpoint, None
    if pending is not None:
        pending.result()


# --------------------------------------------------------------------------------------------------------------------
# resuming


def resume(run: TrainRun) -> None:
    """Load a checkpoint's state (model, optimizer, scheduler, RNG) and keep the metrics logged up to it."""
    args = run.args
    saved = {}
    if args.resume_from_checkpoint:
        saved = read_state(args.resume_from_checkpoint)
        for key, now in (
            ("global_batch_blocks", run.global_blocks),
            ("block_size", run.block_size),
            ("seed", args.seed),
            ("num_train_blocks", None if run.train_blocks is None else len(run.train_blocks)),
        ):
            if saved.get(key) != now:
                run.accelerator.print(
                    f"warning: {key} was {saved.get(key)} in {args.resume_from_checkpoint}, now {now}: the resumed run "
                    "will not see the same data order as the interrupted one"
                )
        try:
            run.accelerator.load_state(args.resume_from_checkpoint)
        except Exception as e:  # a checkpoint from before manifests with a damaged file
            raise TrainingError(
                f"--resume_from_checkpoint: {args.resume_from_checkpoint} does not load ({load_error_words(e)}); "
                "resume from another checkpoint"
            ) from None
        if run.stream is not None:
            load_stream_state(run.stream, args.resume_from_checkpoint, run.accelerator.process_index)
        run.start_step = saved["step"]
        # real tokens trained so far (a checkpoint from before it was saved: every row full)
        run.tokens_seen = saved.get("tokens_seen", run.start_step * run.global_blocks * run.block_size)
        if run.start_step > run.total_steps:
            raise TrainingError(
                f"{args.resume_from_checkpoint} is at step {run.start_step}, past the {run.total_steps} steps of this "
                "run: pass a --max_steps of at least that step, or resume from an earlier checkpoint"
            )
        saved_total = saved.get("total_steps")
        if saved_total is not None and saved_total != run.total_steps:
            _continue_schedule(run, saved_total)
    if run.is_main:  # keep the metrics logged up to the checkpoint; drop those of what will be redone
        from .metrics import keep_metrics_up_to

        run.metrics_records = keep_metrics_up_to(run.metrics_path, run.start_step, saved.get("metrics_records"))
    run.accelerator.wait_for_everyone()


def _continue_schedule(run: TrainRun, saved_total: int) -> None:
    """The run length changed on resume: the optimizer's learning rate is the old schedule's at the checkpoint (0 at
    the end of a cosine); set it to the new schedule's value at this step, so the next update uses the new schedule
    instead of the old rate and a jump one step later."""
    scheduler = getattr(run.scheduler, "scheduler", run.scheduler)  # Accelerate's wrapper -> the LambdaLR
    old = [group["lr"] for group in scheduler.optimizer.param_groups]
    lambdas = getattr(scheduler, "lr_lambdas", None)
    if lambdas is not None:
        new = [base * rate(scheduler.last_epoch) for rate, base in zip(lambdas, scheduler.base_lrs)]
        for group, lr in zip(scheduler.optimizer.param_groups, new):
            group["lr"] = lr
        scheduler._last_lr = list(new)
    else:
        new = old
    run.accelerator.print(
        f"warning: {run.args.resume_from_checkpoint} was saved by a run of {saved_total} steps, this run has "
        f"{run.total_steps}: the learning-rate schedule (warmup and decay) now follows {run.total_steps} steps; at "
        f"step {run.start_step} the rate goes from {old[0]:.3g} to {new[0]:.3g}"
    )


__all__ = [
    "CHECKPOINT_PREFIX",
    "PARAMETER_SETTINGS",
    "STATE_FILE",
    "check_resume",
    "list_checkpoints",
    "read_state",
    "remove_stale_temporaries",
    "resolve_checkpoint",
    "resume",
    "save_checkpoint",
    "verify_checkpoint",
    "wait_for_checkpoint",
    "write_json_atomic",
]
