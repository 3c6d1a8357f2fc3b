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
→ `save_final`. The arguments and the checks that run before training live in `train_args.py`, metrics and the loss
plot in `train_metrics.py`.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import shutil
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

import mhmoe  # noqa: F401  (registers the model types and PEFT defaults)

from .data import order_by_similarity, tokenize_and_pack, train_tokenizer
from .train_args import (  # noqa: F401  (re-exported: `from mhmoe.train import ...` keeps working)
    CHECKPOINT_PREFIX, DENSE_PARENT_TYPES, METRICS_FILE, PARAMETER_SETTINGS, PLOT_FILE, RUN_OUTPUTS, STATE_FILE,
    SUMMARY_FILE, TrainArguments, TrainingError, _coerce_args, _list_checkpoints, _read, _remove_run_outputs,
    check_arguments, load_config, supported_model_types,
)
from .train_metrics import (  # noqa: F401  (re-exported)
    _loss_fields, _other_router_probs, _read_metrics, _token_nll_sum, load_summary, plot_metrics,
)
from .train_metrics import validate as _evaluate  # looked up at call time: tests interrupt a run here


@dataclass
class TrainResult:
    output_dir: str
    global_step: int
    history: list[dict]  # every metrics record written (train and eval), this run
    final_eval: dict | None
    model: Any = None  # the unwrapped trained model (a PeftModel with --lora)
    tokenizer: Any = None


@dataclass
class TrainRun:
    """What the stages share: filled in by the setup stages, then advanced by the loop."""

    args: TrainArguments
    accelerator: Any
    config: Any
    from_scratch: bool
    on_log: Callable[[dict], None] | None = None
    tokenizer: Any = None
    # data and batch geometry (build_data)
    train_blocks: torch.Tensor | None = None  # (blocks, block_size) token ids
    val_blocks: torch.Tensor | None = None
    block_size: int = 0
    global_blocks: int = 0  # blocks per optimizer step: micro-batch × accumulation × processes
    steps_per_epoch: int = 0
    total_steps: int = 0
    # model and optimisation (build_model, build_optimizer)
    model: Any = None
    optimizer: Any = None
    scheduler: Any = None
    forward_kwargs: dict = field(default_factory=dict)
    trainable: int = 0
    total_params: int = 0
    # progress
    start_step: int = 0
    loss_names: list[str] | None = None  # the extra *_loss outputs, in the order the step sums them
    permutation: tuple[int, torch.Tensor] | None = None  # (epoch, its block order)
    history: list[dict] = field(default_factory=list)

    @property
    def is_main(self) -> bool:
        return self.accelerator.is_main_process

    @property
    def world(self) -> int:
        return self.accelerator.num_processes

    @property
    def metrics_path(self) -> str:
        return os.path.join(self.args.output_dir, METRICS_FILE)

    def log(self, record: dict) -> None:
        self.history.append(record)
        if self.is_main:
            with open(self.metrics_path, "a") as f:
                f.write(json.dumps(record) + "\n")
            if self.on_log is not None:
                self.on_log(record)


def _moe_forward_kwargs(config, aux_loss: bool) -> dict:
    """Ask for router logits (and so the aux losses) from models that have them."""
    if aux_loss and hasattr(config, "output_router_logits"):
        return {"output_router_logits": True}
    return {}



def _num_trainable(model) -> tuple[int, int]:
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    return trainable, sum(p.numel() for p in model.parameters())


def _optimizer_groups(model, weight_decay: float) -> list[dict]:
    decay, no_decay = [], []
    for name, param in model.named_parameters():
        if not param.requires_grad:
            continue
        (decay if param.dim() >= 2 and "norm" not in name.lower() else no_decay).append(param)
    groups = [{"params": decay, "weight_decay": weight_decay}]
    if no_decay:
        groups.append({"params": no_decay, "weight_decay": 0.0})
    return groups



def reset_accelerate_state() -> None:
    """Forget Accelerate's process-wide state (its singletons), so that several `train()` calls can run one after the
    other in one process, each with its own Accelerator (the demos do). Not for use under `accelerate launch`."""
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()



def train(args, model=None, tokenizer=None, on_log=None, reference_eval=None) -> TrainResult:
    """Train as `mhmoe-train` does. `args`: `TrainArguments`, a dict or an argparse Namespace of its fields.

    `model` / `tokenizer` may be given as objects (then `model_name_or_path` is not needed; without a tokenizer, one is
    trained on the data); otherwise they are loaded or built from `model_name_or_path`. Every input problem raises
    `TrainingError` before training starts. `on_log(record)` is called (main process) with every metrics record.
    `reference_eval(model) -> context manager`: before the first step (of a fresh run), validate once inside it and log
    the result as `reference_eval_loss` / `reference_eval_ppl` at step 0 (`mhmoe.convert` uses it to measure the
    dense parent: the converted MoH model with every head active).
    """
    args = _coerce_args(args)
    created = not os.path.exists(args.output_dir)
    try:
        return _train(args, model, tokenizer, on_log, reference_eval)
    except TrainingError:
        if created:  # an input problem stopped it before training: leave nothing behind
            shutil.rmtree(args.output_dir, ignore_errors=True)
        raise



def _train(args, model, tokenizer, on_log, reference_eval) -> TrainResult:
    check_arguments(args, model_given=model is not None)
    if model is None:
        config, from_scratch = load_config(args)
    else:
        config, from_scratch = model.config, False
        if args.config_overrides:
            raise TrainingError("--config_overrides applies to models loaded here, not to a model object")
        if config.model_type not in supported_model_types():
            raise TrainingError(f"model_type {config.model_type!r} is not supported by mhmoe-train")
    run = TrainRun(args, setup_accelerator(args), config, from_scratch, on_log)
    train_docs = _read(args.train_file, args.text_field)
    if not train_docs:
        raise TrainingError(f"no text in --train_file {' '.join(args.train_file)}")
    setup_tokenizer(run, tokenizer, train_docs)
    build_data(run, train_docs, reference_eval is not None)
    build_model(run, model)
    build_optimizer(run)
    prepare_output_dir(run)
    resume(run)
    final_eval = train_loop(run, reference_eval)
    unwrapped = save_final(run, final_eval)
    return TrainResult(args.output_dir, run.total_steps, run.history, final_eval, unwrapped, run.tokenizer)


# --------------------------------------------------------------------------------------------------------------------
# setup stages


def setup_accelerator(args: TrainArguments):
    from accelerate import Accelerator, DistributedDataParallelKwargs

    accelerator = Accelerator(
        gradient_accumulation_steps=args.gradient_accumulation_steps,
        mixed_precision=args.mixed_precision,
        step_scheduler_with_optimizer=False,
        kwargs_handlers=[DistributedDataParallelKwargs(find_unused_parameters=args.ddp_find_unused_parameters)],
    )
    fsdp_requested = os.environ.get("ACCELERATE_USE_FSDP", "false").lower() == "true"
    if fsdp_requested and accelerator.distributed_type.value != "FSDP":
        accelerator.print(  # Accelerate enables FSDP only for accelerator devices (MULTI_GPU, ...), never MULTI_CPU
            f"warning: FSDP was requested but Accelerate runs {accelerator.distributed_type.value} here (FSDP needs "
            "GPUs or other accelerators; on CPU it falls back to plain data parallelism)"
        )
    return accelerator


def setup_tokenizer(run: TrainRun, tokenizer, train_docs: list[str]) -> None:
    """The tokenizer: given, from the checkpoint being resumed, from the model directory, or trained here on main."""
    from transformers import AutoTokenizer

    args, config = run.args, run.config
    if tokenizer is None:
        source = args.tokenizer_name_or_path
        if source is None and args.resume_from_checkpoint and os.path.isfile(
            os.path.join(args.resume_from_checkpoint, "tokenizer_config.json")
        ):
            source = args.resume_from_checkpoint
        if source is None and not run.from_scratch:
            source = args.model_name_or_path
        if source is not None:
            try:
                tokenizer = AutoTokenizer.from_pretrained(source)
            except (OSError, ValueError) as e:
                raise TrainingError(f"no tokenizer could be loaded from {source} ({e}); pass --tokenizer_name_or_path")
        else:
            vocab_size = args.tokenizer_vocab_size or config.vocab_size
            if not 259 <= vocab_size <= config.vocab_size:
                raise TrainingError(
                    f"a tokenizer trained here needs 259 <= vocab size <= the model's vocab_size "
                    f"({config.vocab_size}), got {vocab_size}"
                )
            if run.is_main:
                train_tokenizer(train_docs, vocab_size, config.max_position_embeddings).save_pretrained(args.output_dir)
            run.accelerator.wait_for_everyone()
            tokenizer = AutoTokenizer.from_pretrained(args.output_dir)  # every process: the same files
    if len(tokenizer) > config.vocab_size:
        raise TrainingError(
            f"the tokenizer has {len(tokenizer)} tokens but the model's vocab_size is {config.vocab_size}"
        )
    if tokenizer.eos_token_id is None:
        raise TrainingError("the tokenizer has no EOS token (needed to separate packed documents)")
    if run.from_scratch:
        config.bos_token_id, config.eos_token_id = tokenizer.bos_token_id, tokenizer.eos_token_id
    run.tokenizer = tokenizer


def build_data(run: TrainRun, train_docs: list[str], reference_eval: bool) -> None:
    """Packed training and validation blocks (the validation split comes from a seeded permutation of the training
    blocks), the batch geometry and the number of steps."""
    args, tokenizer = run.args, run.tokenizer
    context = run.config.max_position_embeddings
    block_size = run.block_size = args.block_size or min(1024, context)
    if block_size > context:
        raise TrainingError(f"--block_size {block_size} is larger than the model's context ({context} positions)")
    train_docs = order_by_similarity(train_docs) if args.similarity_batching else train_docs
    train_blocks = tokenize_and_pack(train_docs, tokenizer, block_size)
    if len(train_blocks) == 0:
        raise TrainingError(f"--train_file holds fewer than block_size={block_size} tokens: no training block")
    val_blocks = None
    if args.validation_file:
        val_docs = _read(args.validation_file, args.text_field)
        val_blocks = tokenize_and_pack(val_docs, tokenizer, block_size) if val_docs else train_blocks[:0]
        if len(val_blocks) == 0:
            raise TrainingError(f"--validation_file holds fewer than block_size={block_size} tokens: no block")
    elif args.validation_split_percentage > 0:
        held_out = max(1, int(len(train_blocks) * args.validation_split_percentage / 100))
        if held_out >= len(train_blocks):
            raise TrainingError("--validation_split_percentage leaves no training block")
        order = torch.randperm(len(train_blocks), generator=torch.Generator().manual_seed(args.seed))
        val_blocks, train_blocks = train_blocks[order[:held_out]], train_blocks[order[held_out:]]
    if val_blocks is None and (args.eval_at_start or reference_eval):
        raise TrainingError("--eval_at_start (and a reference evaluation) need --validation_file or "
                            "--validation_split_percentage")  # fmt: skip
    run.train_blocks, run.val_blocks = train_blocks, val_blocks

    run.global_blocks = args.per_device_train_batch_size * args.gradient_accumulation_steps * run.world
    run.steps_per_epoch = len(train_blocks) // run.global_blocks
    if run.steps_per_epoch == 0:
        raise TrainingError(
            f"{len(train_blocks)} training blocks of {block_size} tokens do not fill one global batch of "
            f"{run.global_blocks} blocks (per_device_train_batch_size × gradient_accumulation_steps × processes)"
        )
    if args.max_steps > 0:
        run.total_steps = args.max_steps
    else:
        run.total_steps = max(1, math.ceil(args.num_train_epochs * run.steps_per_epoch))


def build_model(run: TrainRun, model) -> None:
    """The model (given, built from a config JSON, or loaded), gradient checkpointing and LoRA adapters."""
    from accelerate.utils import set_seed
    from transformers import AutoModelForCausalLM

    args = run.args
    set_seed(args.seed)
    if model is None:
        if run.from_scratch:
            model = AutoModelForCausalLM.from_config(run.config)
        else:
            try:
                model = AutoModelForCausalLM.from_pretrained(
                    args.model_name_or_path, config=run.config, dtype=torch.float32
                )
            except RuntimeError as e:  # weights whose shapes the (overridden) config does not have
                first = str(e).strip().splitlines()[0]
                raise TrainingError(f"the weights in {args.model_name_or_path} do not fit its config (a "
                                    f"--config_overrides that changes shapes?): {first}") from None  # fmt: skip
    if args.gradient_checkpointing:
        if hasattr(model, "activation_checkpointing_enable"):  # the v5 name
            model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
        else:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if args.lora:
        from peft import get_peft_model

        from .peft import lora_config

        try:
            peft_config = lora_config(
                model, r=args.lora_r, lora_alpha=args.lora_alpha, lora_dropout=args.lora_dropout,
                target_modules=args.lora_target_modules, experts=args.lora_experts,
            )  # fmt: skip
            model = get_peft_model(model, peft_config)
        except ValueError as e:
            raise TrainingError(f"LoRA: {e}") from None
    run.forward_kwargs = {**_moe_forward_kwargs(run.config, args.aux_loss), "use_cache": False}
    run.trainable, run.total_params = _num_trainable(model)
    run.model = model


def build_optimizer(run: TrainRun) -> None:
    """AdamW and the schedule, prepared by Accelerate: DeepSpeed wants model and optimizer prepared together, FSDP the
    model first."""
    from transformers import get_scheduler

    args, accelerator = run.args, run.accelerator
    using_deepspeed = accelerator.state.deepspeed_plugin is not None
    if using_deepspeed:
        ds_config = accelerator.state.deepspeed_plugin.deepspeed_config
        ds_config["train_micro_batch_size_per_gpu"] = args.per_device_train_batch_size
        ds_config["gradient_accumulation_steps"] = args.gradient_accumulation_steps
    else:
        run.model = accelerator.prepare(run.model)
    optimizer = torch.optim.AdamW(
        _optimizer_groups(run.model, args.weight_decay),
        lr=args.learning_rate,
        betas=(args.adam_beta1, args.adam_beta2),
        eps=args.adam_epsilon,
    )
    schedule, schedule_kwargs = args.lr_scheduler_type, None
    if args.min_learning_rate > 0:  # cosine down to the final learning rate
        schedule, schedule_kwargs = "cosine_with_min_lr", {"min_lr": args.min_learning_rate}
    warmup = args.warmup_steps or math.ceil(args.warmup_ratio * run.total_steps)
    scheduler = get_scheduler(schedule, optimizer, num_warmup_steps=warmup, num_training_steps=run.total_steps,
                              scheduler_specific_kwargs=schedule_kwargs)  # fmt: skip
    if using_deepspeed:
        run.model, run.optimizer, run.scheduler = accelerator.prepare(run.model, optimizer, scheduler)
    else:
        run.optimizer, run.scheduler = accelerator.prepare(optimizer, scheduler)


def prepare_output_dir(run: TrainRun) -> None:
    """Every input is checked: only now is an earlier run's output removed, and output_dir created."""
    args = run.args
    if run.is_main:
        os.makedirs(args.output_dir, exist_ok=True)
        if args.overwrite_output_dir and not args.resume_from_checkpoint:
            _remove_run_outputs(args.output_dir)
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


# --------------------------------------------------------------------------------------------------------------------
# the loop


def train_loop(run: TrainRun, reference_eval=None) -> dict | None:
    """Every optimizer step from `start_step`, with logging, periodic validation and checkpoints; returns the final
    validation record (None without validation data)."""
    from tqdm.auto import tqdm

    args, total = run.args, run.total_steps
    _print_run(run)
    progress = tqdm(total=total, initial=run.start_step, disable=not run.is_main or args.disable_tqdm,
                    desc="training", dynamic_ncols=True)  # fmt: skip
    if run.start_step == 0 and run.val_blocks is not None:
        evaluate_before_training(run, reference_eval)
    run.model.train()
    start_time = time.time()
    for step in range(run.start_step, total):
        means, grad_norm, lr_used = train_step(run, step)
        done = step + 1
        if done % args.logging_steps == 0 or done == total:
            record = {"step": done, "epoch": round(done / run.steps_per_epoch, 4)}
            record.update(zip(["loss", "lm_loss", *run.loss_names], means.tolist()))
            record["lr"] = lr_used
            if grad_norm is not None:
                record["grad_norm"] = float(grad_norm)
            record["tokens"] = done * run.global_blocks * run.block_size
            record["elapsed_s"] = round(time.time() - start_time, 3)
            run.log(record)
            progress.set_postfix(loss=f"{record['loss']:.4f}", lm=f"{record['lm_loss']:.4f}")
        progress.update(1)
        if run.val_blocks is not None and args.eval_steps > 0 and done % args.eval_steps == 0 and done != total:
            run.log(evaluate(run, done))
            run.model.train()
        if args.save_steps > 0 and done % args.save_steps == 0:
            save_checkpoint(run, done)
    progress.close()
    if run.val_blocks is None:
        return None
    final_eval = evaluate(run, total)
    run.log(final_eval)
    run.accelerator.print(f"validation: loss {final_eval['eval_loss']:.4f}, perplexity {final_eval['eval_ppl']:.2f}")
    return final_eval


def _print_run(run: TrainRun) -> None:
    args, accelerator = run.args, run.accelerator
    accelerator.print(
        f"mhmoe-train: {run.config.model_type}, {run.trainable:,} trainable / {run.total_params:,} parameters; "
        f"{len(run.train_blocks)} blocks × {run.block_size} tokens, {run.steps_per_epoch} steps/epoch, steps "
        f"{run.start_step} → {run.total_steps}, global batch {run.global_blocks} blocks ({run.world} process(es) × "
        f"{args.per_device_train_batch_size} × {args.gradient_accumulation_steps} accum), "
        f"{accelerator.distributed_type.value}, mixed precision {accelerator.mixed_precision}"
    )


def _epoch_permutation(run: TrainRun, epoch: int) -> torch.Tensor:
    """The seeded order of the training blocks in `epoch` (seed + epoch), computed once per epoch."""
    if run.permutation is None or run.permutation[0] != epoch:
        generator = torch.Generator().manual_seed(run.args.seed + epoch)
        run.permutation = (epoch, torch.randperm(len(run.train_blocks), generator=generator))
    return run.permutation[1]


def train_step(run: TrainRun, step: int) -> tuple[torch.Tensor, Any, float]:
    """One optimizer step over this process's micro-batches (see the module docstring for the data order).

    Returns the losses [loss, lm_loss, *loss_names] averaged over micro-batches and processes, the gradient norm before
    clipping (None when not clipped) and the learning rate the update used."""
    args, accelerator = run.args, run.accelerator
    accumulation, micro = args.gradient_accumulation_steps, args.per_device_train_batch_size
    epoch, step_in_epoch = divmod(step, run.steps_per_epoch)
    permutation = _epoch_permutation(run, epoch)
    sums, grad_norm = None, None
    for a in range(accumulation):
        m = a * run.world + accelerator.process_index
        start = step_in_epoch * run.global_blocks + m * micro
        batch = run.train_blocks[permutation[start : start + micro]].to(accelerator.device)
        values, norm = forward_backward_step(run, batch)
        grad_norm = norm if norm is not None else grad_norm
        sums = values if sums is None else sums + values
    lr_used = run.scheduler.get_last_lr()[0]  # the rate this step's update used
    if not getattr(run.optimizer, "step_was_skipped", False):
        run.scheduler.step()
    return accelerator.reduce(sums / accumulation, reduction="mean"), grad_norm, lr_used


def forward_backward_step(run: TrainRun, batch: torch.Tensor) -> tuple[torch.Tensor, Any]:
    """Forward, backward and (on the last micro-batch of a step) clip + optimizer update for one micro-batch.

    Returns the detached losses [loss, lm_loss, *loss_names] (lm_loss is the LM part alone when router losses are
    added) and the gradient norm when it was clipped here."""
    accelerator, model, optimizer = run.accelerator, run.model, run.optimizer
    grad_norm = None
    with accelerator.accumulate(model):
        output = model(input_ids=batch, labels=batch, **run.forward_kwargs)
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
        lm_loss = _token_nll_sum(output.logits, batch) / (batch.numel() - batch.shape[0]) if extra else loss
        values = torch.stack([loss, lm_loss.float()] + [extra[k].detach().float() for k in run.loss_names])
    return values, grad_norm


# --------------------------------------------------------------------------------------------------------------------
# evaluation and saving


def evaluate(run: TrainRun, step: int) -> dict:
    """Validation record at `step`: LM loss / perplexity, aux losses, routing load, training tokens seen so far."""
    record = _evaluate(run.accelerator, run.model, run.val_blocks, run.args.per_device_eval_batch_size, run.config,
                       run.forward_kwargs, step)  # fmt: skip
    record["tokens"] = step * run.global_blocks * run.block_size
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
            for _, old in _list_checkpoints(args.output_dir)[: -args.save_total_limit]:
                shutil.rmtree(old, ignore_errors=True)
        if args.plot:
            plot_metrics(run.metrics_path, os.path.join(args.output_dir, PLOT_FILE))
    run.accelerator.wait_for_everyone()


def save_final(run: TrainRun, final_eval: dict | None):
    """The unwrapped model (full, or the adapter with --lora; merged too with --merge_lora), tokenizer, loss plot and
    run summary. Returns the unwrapped model."""
    args, accelerator = run.args, run.accelerator
    accelerator.wait_for_everyone()
    state_dict = accelerator.get_state_dict(run.model)
    unwrapped = accelerator.unwrap_model(run.model)
    unwrapped.save_pretrained(
        args.output_dir, is_main_process=run.is_main, save_function=accelerator.save, state_dict=state_dict
    )
    if run.is_main:
        run.tokenizer.save_pretrained(args.output_dir)
        if args.lora and args.merge_lora:
            import copy

            merged = copy.deepcopy(unwrapped).merge_and_unload()
            merged.save_pretrained(os.path.join(args.output_dir, "merged"))
            run.tokenizer.save_pretrained(os.path.join(args.output_dir, "merged"))
        if args.plot:
            plot_metrics(run.metrics_path, os.path.join(args.output_dir, PLOT_FILE))
        summary = {"step": run.total_steps, "num_processes": run.world,
                   "distributed_type": accelerator.distributed_type.value,
                   "mixed_precision": accelerator.mixed_precision, "global_batch_blocks": run.global_blocks,
                   "block_size": run.block_size, "trainable_parameters": run.trainable, "parameters": run.total_params,
                   "final_eval": final_eval, "args": dataclasses.asdict(args)}  # fmt: skip
        with open(os.path.join(args.output_dir, SUMMARY_FILE), "w") as f:
            json.dump(summary, f, indent=2)
    accelerator.wait_for_everyone()
    return unwrapped


def build_parser():
    from transformers import HfArgumentParser

    return HfArgumentParser(TrainArguments, prog="mhmoe-train", description=__doc__.split("\n\n")[0])


def main(argv: list[str] | None = None) -> None:
    """Console entry point (`mhmoe-train`); input errors exit with status 2 and a one-line message."""
    parser = build_parser()
    (args,) = parser.parse_args_into_dataclasses(args=argv)
    try:
        train(args)
    except TrainingError as e:
        parser.exit(2, f"mhmoe-train: error: {e}\n")
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1:])
