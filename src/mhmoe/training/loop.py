"""mhmoe-train: pre-train or fine-tune MHMoE / MoH-Llama causal LMs with Accelerate (and PEFT LoRA).

The project's one training loop. Runs as-is on one device, and unchanged under `accelerate launch` (DDP, FSDP,
DeepSpeed) on many; see docs/training.md. From Python: `train(TrainArguments(...))` or `train({...})`.

Data order. Every epoch is a seeded permutation of the packed blocks (seed + epoch). Optimizer step g of an epoch takes
the G = per_device_batch × accumulation × processes blocks [g·G, (g+1)·G) of it, cut into micro-batches m = 0 …
accumulation·processes − 1; process r runs micro-batches a·processes + r (a = accumulation step). So one process
accumulation 2 sees exactly the micro-batches of two processes without accumulation, and a resumed run continues at
block g·G of the same permutation: both reproduce the other run's losses.

Stages (torchtitan-style: `train` → `train_step` → `forward_backward_step`), sharing one `TrainRun`:
`setup_accelerator` → `setup_tokenizer` → `build_data` → `build_model` → `build_optimizer` → `prepare_output_dir`
→ `resume` → `train_loop` (`train_step` per optimizer step, `evaluate` and `save_checkpoint` on their schedules)
→ `save_final`. Where each part lives in this package: arguments and their checks `arguments.py`, the setup stages
`prepare.py`, what the stages share `state.py`, checkpoints and resuming `checkpoints.py`, the output folder and the final
save `outputs.py`, metrics and the loss plot `metrics.py`, the command line `cli.py`.
"""

from __future__ import annotations

import math
import os
import shutil
import time
from typing import Any

import torch

from .arguments import (
    TrainingError,
    TrainingStopped,
    _coerce_args,
    _read,
    check_arguments,
    check_required,
    load_config,
    supported_model_types,
)
from .checkpoints import resume, save_checkpoint, wait_for_checkpoint
from .lock import OutputDirLock, OutputDirLocked
from .metrics import _label_count, _loss_fields, _token_nll_sum
from .metrics import validate as _evaluate  # looked up at call time: tests interrupt a run here
from .outputs import check_output_contents, check_output_dir, check_output_location, prepare_output_dir, save_final
from .prepare import (
    build_data,
    build_dataset_data,
    build_model,
    build_optimizer,
    dataset_format,
    setup_accelerator,
    setup_tokenizer,
    tokenizer_texts,
)
from .sources import load_source
from .state import TrainResult, TrainRun
from .throughput import Throughput, flops_per_token, peak_flops
from .trackers import end_trackers, setup_trackers


def train(args, model=None, tokenizer=None, on_log=None, reference_eval=None) -> TrainResult:
    """Train as `mhmoe-train` does. `args`: `TrainArguments`, a dict or an argparse Namespace of its fields.

    `model` / `tokenizer` may be given as objects (then `model_name_or_path` is not needed; without a tokenizer, one is
    trained on the data); otherwise they are loaded or built from `model_name_or_path`. Every input problem raises
    `TrainingError` before training starts. `on_log(record)` is called (main process) with every metrics record.
    `reference_eval(model) -> context manager`: before the first step (of a fresh run), validate once inside it and log
    the result as `reference_eval_loss` / `reference_eval_ppl` at step 0 (`mhmoe.convert` uses it to measure the
    dense parent: the converted MoH model with every head active).

    The output folder is locked for the run (`lock.py`): a second run on it raises `OutputDirLocked`. Training stopped
    by repeated non-finite losses raises `TrainingStopped` (the checkpoints written so far stay).
    """
    args = _coerce_args(args)
    check_required(args, model_given=model is not None)
    created = _first_missing_folder(args.output_dir)  # what this run creates, removed again on an input problem
    lock = None
    try:  # the checks of check_before_training, with the lock taken before the folder's contents are judged
        check_arguments(args, model is not None)
        check_output_location(args, model is not None)
        lock = _lock_output_dir(args.output_dir)
        check_output_contents(args)
        return _train(args, model, tokenizer, on_log, reference_eval)
    except TrainingError as e:
        if created and not isinstance(e, (OutputDirLocked, TrainingStopped)):
            shutil.rmtree(created, ignore_errors=True)  # an input problem stopped it: leave nothing behind
        raise
    finally:
        if lock is not None:
            lock.release()


def _first_missing_folder(path: str) -> str | None:
    """The outermost folder of `path` that does not exist yet (None: `path` exists)."""
    path, missing = os.path.abspath(path), None
    while not os.path.exists(path):
        missing, parent = path, os.path.dirname(path)
        if parent == path:
            break
        path = parent
    return missing


def _lock_output_dir(output_dir: str):
    """The output folder's lock, taken by the main process (RANK 0, or a run without a launcher)."""
    if os.environ.get("RANK", "0") != "0":
        return None
    os.makedirs(output_dir, exist_ok=True)
    return OutputDirLock(output_dir).acquire()


def _train(args, model, tokenizer, on_log, reference_eval) -> TrainResult:
    if model is None:
        config, from_scratch = load_config(args)
    else:
        config, from_scratch = model.config, False
        if args.config_overrides:
            raise TrainingError("--config_overrides applies to models loaded here, not to a model object")
        if config.model_type not in supported_model_types():
            raise TrainingError(f"model_type {config.model_type!r} is not supported by mhmoe-train")
    run = TrainRun(args, setup_accelerator(args), config, from_scratch, on_log)
    if args.dataset:
        source = load_source(args)
        fmt = dataset_format(run, source)
        setup_tokenizer(run, tokenizer, tokenizer_texts(source, fmt, args.text_field))
        build_dataset_data(run, source, reference_eval is not None)
    else:
        train_docs = _read(args.train_file, args.text_field)
        if not train_docs:
            raise TrainingError(f"no text in --train_file {' '.join(args.train_file)}")
        setup_tokenizer(run, tokenizer, train_docs)
        build_data(run, train_docs, reference_eval is not None)
    build_model(run, model)
    run.throughput = Throughput(
        flops_per_token(run.config, run.block_size),
        peak_flops(run.accelerator.device, run.accelerator.mixed_precision, args.peak_tflops),
        run.world,
    )
    build_optimizer(run)
    prepare_output_dir(run)
    setup_trackers(run)
    resume(run)
    try:
        final_eval = train_loop(run, reference_eval)
        unwrapped = save_final(run, final_eval)
    except BaseException:
        _finish_checkpoint_quietly(run)  # a checkpoint completing in the background is put in place first
        raise
    finally:
        end_trackers(run)
    return TrainResult(args.output_dir, run.total_steps, run.history, final_eval, unwrapped, run.tokenizer)


def _finish_checkpoint_quietly(run: TrainRun) -> None:
    """While another error stops the run: let the checkpoint being completed in the background finish (its own
    error, if any, is not the one to report)."""
    try:
        wait_for_checkpoint(run)
    except Exception:
        pass


def check_before_training(args, model_given: bool = False) -> None:
    """Every check that runs before anything is trained or written: the arguments and data files, then the output
    folder and the checkpoint to resume."""
    check_arguments(args, model_given)
    check_output_dir(args, model_given)


# --------------------------------------------------------------------------------------------------------------------
# the loop


def train_loop(run: TrainRun, reference_eval=None) -> dict | None:
    """Every optimizer step from `start_step`, with logging, periodic validation and checkpoints; returns the final
    validation record (None without validation data)."""
    from tqdm.auto import tqdm

    args, total = run.args, run.total_steps
    _print_run(run)
    progress = tqdm(
        total=total,
        initial=run.start_step,
        disable=not run.is_main or args.disable_tqdm,
        desc="training",
        dynamic_ncols=True,
    )
    if run.start_step == 0 and run.val_blocks is not None:
        evaluate_before_training(run, reference_eval)
    run.model.train()
    start_time = interval_start = time.time()
    interval_tokens = 0
    nonfinite: list[int] = []  # the steps of the current streak of non-finite losses
    for step in range(run.start_step, total):
        means, grad_norm, lr_used, tokens = train_step(run, step)
        run.tokens_seen += tokens
        interval_tokens += tokens
        done = step + 1
        if done % args.logging_steps == 0 or done == total:
            now = time.time()
            record = {"step": done, "epoch": _epoch(run, done)}
            record.update(zip(["loss", "lm_loss", *run.loss_names], means.tolist()))
            record["lr"] = lr_used
            if grad_norm is not None:
                record["grad_norm"] = float(grad_norm)
            record["tokens"] = run.tokens_seen
            record.update(run.throughput.fields(interval_tokens, now - interval_start))
            record["elapsed_s"] = round(now - start_time, 3)
            run.log(record)
            progress.set_postfix(
                loss=f"{record['loss']:.4f}", lm=f"{record['lm_loss']:.4f}", tok_s=f"{record['tokens_per_second']:.0f}"
            )
            interval_start, interval_tokens = time.time(), 0  # validation and checkpoints are not training time
        progress.update(1)
        nonfinite = _check_finite(run, done, float(means[0]), nonfinite)  # after the step's record is written
        if run.val_blocks is not None and args.eval_steps > 0 and done % args.eval_steps == 0 and done != total:
            run.log(evaluate(run, done))
            run.model.train()
            interval_start = time.time()
        if args.save_steps > 0 and done % args.save_steps == 0:
            save_checkpoint(run, done)
            interval_start = time.time()
    progress.close()
    if run.val_blocks is None:
        return None
    final_eval = evaluate(run, total)
    run.log(final_eval)
    run.accelerator.print(f"validation: loss {final_eval['eval_loss']:.4f}, perplexity {final_eval['eval_ppl']:.2f}")
    return final_eval


def _check_finite(run: TrainRun, done: int, loss: float, streak: list[int]) -> list[int]:
    """Count consecutive steps whose (all-process mean) loss is NaN or infinite; stop after --max_nonfinite_steps."""
    if math.isfinite(loss):
        return []
    streak = [*streak, done]
    limit = run.args.max_nonfinite_steps
    if limit and len(streak) >= limit:
        raise TrainingStopped(
            f"training stopped: the loss was {loss} at {len(streak)} steps in a row (steps {streak[0]}-{streak[-1]}); "
            "the weights, the data or the learning rate are broken (check --model_name_or_path, lower "
            "--learning_rate, or use --mixed_precision no); --max_nonfinite_steps sets the limit (0: never stop)"
        )
    return streak


def _epoch(run: TrainRun, done: int) -> float:
    """Epochs so far: steps over steps per epoch; a stream's own pass count (epochs finished + share of none)."""
    if run.stream is not None:
        return run.stream.epoch
    return round(done / run.steps_per_epoch, 4)


def _data_words(run: TrainRun) -> str:
    """The data part of the run's summary line: format, rows, packing."""
    args = run.args
    if args.dataset:
        what = {"text": "text (language modelling)", "messages": "chat", "prompt-completion": "prompt-completion"}
        loss = ""
        if run.data_format != "text":
            loss = ", loss on every token" if args.loss_on_prompt else ", loss on the assistant/completion tokens"
            loss += ", packed (examples kept apart)" if args.packing else ", one example per row, padded per batch"
        rows = "streamed rows" if run.stream is not None else f"{len(run.train_blocks)} rows"
        return f"{run.data_format} records ({what[run.data_format]}{loss}) from {args.dataset}; {rows}"
    return f"{len(run.train_blocks)} blocks"


def _print_run(run: TrainRun) -> None:
    args, accelerator = run.args, run.accelerator
    accelerator.print(
        f"mhmoe-train: {_model_words(run.config)}, {run.trainable:,} trainable / {run.total_params:,} parameters; "
        f"{_data_words(run)} × {run.block_size} tokens, {run.steps_per_epoch} steps/epoch, steps "
        f"{run.start_step} → {run.total_steps}, global batch {run.global_blocks} blocks ({run.world} process(es) × "
        f"{args.per_device_train_batch_size} × {args.gradient_accumulation_steps} accum), {_distribution(run)}, "
        f"mixed precision {accelerator.mixed_precision}",
        flush=True,  # the run's first line, also when stdout is a pipe (a log, a supervisor)
    )


def _model_words(config) -> str:
    """The model type, and for MH-MoE which layers route (decoder_sparse_step=0 builds no MoE layer: said aloud)."""
    if not hasattr(config, "is_moe_layer"):
        return config.model_type
    layers = config.num_hidden_layers
    moe = sum(config.is_moe_layer(i) for i in range(layers))
    if moe == 0:
        return f"{config.model_type} (dense: decoder_sparse_step={config.decoder_sparse_step}, no MoE layer)"
    return f"{config.model_type} (MoE in {moe} of {layers} layers)"


def _distribution(run: TrainRun) -> str:
    """How the run is spread, in words (Accelerate says "NO" for a single process)."""
    kind = run.accelerator.distributed_type.value
    return f"single process on {run.accelerator.device.type}" if kind == "NO" else kind


def _epoch_permutation(run: TrainRun, epoch: int) -> torch.Tensor:
    """The seeded order of the training blocks in `epoch` (seed + epoch), computed once per epoch."""
    if run.permutation is None or run.permutation[0] != epoch:
        generator = torch.Generator().manual_seed(run.args.seed + epoch)
        run.permutation = (epoch, torch.randperm(len(run.train_blocks), generator=generator))
    return run.permutation[1]


def _micro_batch(run: TrainRun, step: int, a: int) -> tuple[dict, int]:
    """This process's micro-batch `a` of optimizer step `step` (the module docstring's data order; a stream's next
    rows) on the device, and its real tokens."""
    micro = run.args.per_device_train_batch_size
    if run.stream is not None:
        blocks = run.stream.take(micro)
        return blocks.batch(slice(None), run.accelerator.device), blocks.real_tokens(torch.arange(len(blocks)))
    epoch, step_in_epoch = divmod(step, run.steps_per_epoch)
    m = a * run.world + run.accelerator.process_index
    start = step_in_epoch * run.global_blocks + m * micro
    index = _epoch_permutation(run, epoch)[start : start + micro]
    return run.train_blocks.batch(index, run.accelerator.device), run.train_blocks.real_tokens(index)


def train_step(run: TrainRun, step: int) -> tuple[torch.Tensor, Any, float, int]:
    """One optimizer step over this process's micro-batches (see the module docstring for the data order).

    Returns the losses [loss, lm_loss, *loss_names] averaged over micro-batches and processes, the gradient norm before
    clipping (None when not clipped), the learning rate the update used and the real tokens trained (all processes)."""
    accelerator = run.accelerator
    accumulation = run.args.gradient_accumulation_steps
    sums, grad_norm, tokens = None, None, 0
    for a in range(accumulation):
        batch, real = _micro_batch(run, step, a)
        tokens += real
        values, norm = forward_backward_step(run, batch)
        grad_norm = norm if norm is not None else grad_norm
        sums = values if sums is None else sums + values
    lr_used = run.scheduler.get_last_lr()[0]  # the rate this step's update used
    if not getattr(run.optimizer, "step_was_skipped", False):
        run.scheduler.step()
    counts = torch.tensor([float(tokens)], device=accelerator.device)
    tokens = int(accelerator.reduce(counts, reduction="sum").item()) if run.world > 1 else tokens
    return accelerator.reduce(sums / accumulation, reduction="mean"), grad_norm, lr_used, tokens


def forward_backward_step(run: TrainRun, batch: dict) -> tuple[torch.Tensor, Any]:
    """Forward, backward and (on the last micro-batch of a step) clip + optimizer update for one micro-batch
    (`batch`: input_ids, labels and, for packed examples, position_ids).

    Returns the detached losses [loss, lm_loss, *loss_names] (lm_loss is the LM part alone when router losses are
    added) and the gradient norm when it was clipped here."""
    accelerator, model, optimizer = run.accelerator, run.model, run.optimizer
    grad_norm = None
    with accelerator.accumulate(model):
        output = model(**batch, **run.forward_kwargs)
        accelerator.backward(output.loss)
        if accelerator.sync_gradients and run.args.max_grad_norm > 0:
            grad_norm = accelerator.clip_grad_norm_(model.parameters(), run.args.max_grad_norm)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    extra = _loss_fields(output)
    if run.loss_names is None:
        run.loss_names = sorted(extra)
    with torch.no_grad():
        loss = output.loss.detach().float()
        if extra:
            labels = batch["labels"]
            lm_loss = _token_nll_sum(output.logits, labels) / _label_count(labels)
        else:
            lm_loss = loss
        values = torch.stack([loss, lm_loss.float()] + [extra[k].detach().float() for k in run.loss_names])
    return values, grad_norm


# --------------------------------------------------------------------------------------------------------------------
# evaluation


def evaluate(run: TrainRun, step: int) -> dict:
    """Validation record at `step`: LM loss / perplexity, aux losses, routing load, training tokens seen so far."""
    record = _evaluate(
        run.accelerator,
        run.model,
        run.val_blocks,
        run.args.per_device_eval_batch_size,
        run.config,
        run.forward_kwargs,
        step,
    )
    record["tokens"] = run.tokens_seen
    return record


def evaluate_before_training(run: TrainRun, reference_eval=None) -> None:
    """Step-0 validation: the reference model (e.g. the dense parent: a MoH model with every head active) inside
    `reference_eval`, and with --eval_at_start the model itself."""
    if reference_eval is not None:
        with reference_eval(run.accelerator.unwrap_model(run.model)):
            reference = evaluate(run, 0)
        run.log({"step": 0, "tokens": 0, **{f"reference_{k}": v for k, v in reference.items() if k[:5] == "eval_"}})
        run.accelerator.print(f"reference validation: perplexity {reference['eval_ppl']:.2f}")
    if run.args.eval_at_start:
        run.log(evaluate(run, 0))
        run.accelerator.print(f"validation before training: perplexity {run.history[-1]['eval_ppl']:.2f}")


__all__ = [
    "TrainResult",
    "TrainRun",
    "TrainingError",
    "TrainingStopped",
    "check_before_training",
    "evaluate",
    "forward_backward_step",
    "train",
    "train_loop",
    "train_step",
]
