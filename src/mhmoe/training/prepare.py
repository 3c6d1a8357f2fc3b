"""The setup stages of a training run, in order: `setup_accelerator` → `setup_tokenizer` → `build_data` →
`build_model` → `build_optimizer`. Each fills in its part of the `TrainRun` and refuses bad input with
`TrainingError` before anything is trained."""

from __future__ import annotations

import math
import os

import torch

from .arguments import TrainArguments, TrainingError, _read
from .data import order_by_similarity, tokenize_and_pack, train_tokenizer
from .packing import Blocks
from .state import TrainRun


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


def setup_accelerator(args: TrainArguments):
    from accelerate import Accelerator, DistributedDataParallelKwargs

    from .trackers import tracker_settings

    accelerator = Accelerator(
        gradient_accumulation_steps=args.gradient_accumulation_steps,
        mixed_precision=args.mixed_precision,
        step_scheduler_with_optimizer=False,
        kwargs_handlers=[DistributedDataParallelKwargs(find_unused_parameters=args.ddp_find_unused_parameters)],
        **tracker_settings(args),
    )
    fsdp_requested = os.environ.get("ACCELERATE_USE_FSDP", "false").lower() == "true"
    if fsdp_requested and accelerator.distributed_type.value != "FSDP":
        accelerator.print(  # Accelerate enables FSDP only for accelerator devices (MULTI_GPU, ...), never MULTI_CPU
            f"warning: FSDP was requested but Accelerate runs {accelerator.distributed_type.value} here (FSDP needs "
            "GPUs or other accelerators; on CPU it falls back to plain data parallelism)"
        )
    return accelerator


def setup_tokenizer(run: TrainRun, tokenizer, train_docs) -> None:
    """The tokenizer: given, from the checkpoint being resumed, from the model directory, or trained here on main."""
    from .._plumbing.trust import load_tokenizer

    args, config = run.args, run.config
    if tokenizer is None:
        source = args.tokenizer_name_or_path
        if (
            source is None
            and args.resume_from_checkpoint
            and os.path.isfile(os.path.join(args.resume_from_checkpoint, "tokenizer_config.json"))
        ):
            source = args.resume_from_checkpoint
        if source is None and not run.from_scratch:
            source = args.model_name_or_path
        if source is not None:
            try:
                tokenizer = load_tokenizer(source, TrainingError, args.trust_remote_code)
            except (OSError, ValueError) as e:
                if isinstance(e, TrainingError):
                    raise
                first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
                raise TrainingError(
                    f"no tokenizer could be loaded from {source} ({first}); pass --tokenizer_name_or_path"
                ) from None
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
            tokenizer = load_tokenizer(args.output_dir, TrainingError)  # every process: the same files
    if len(tokenizer) > config.vocab_size:
        raise TrainingError(
            f"the tokenizer has {len(tokenizer)} tokens but the model's vocab_size is {config.vocab_size}"
        )
    if tokenizer.eos_token_id is None:
        raise TrainingError("the tokenizer has no EOS token (needed to separate packed documents)")
    if run.from_scratch:
        config.bos_token_id, config.eos_token_id = tokenizer.bos_token_id, tokenizer.eos_token_id
    run.tokenizer = tokenizer


def _block_size(run: TrainRun) -> int:
    context = run.config.max_position_embeddings
    block_size = run.block_size = run.args.block_size or min(1024, context)
    if block_size > context:
        raise TrainingError(f"--block_size {block_size} is larger than the model's context ({context} positions)")
    return block_size


def build_data(run: TrainRun, train_docs: list[str], reference_eval: bool) -> None:
    """--train_file: packed training and validation blocks (the validation split comes from a seeded permutation of
    the training blocks), the batch geometry and the number of steps."""
    args, tokenizer = run.args, run.tokenizer
    block_size = _block_size(run)
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
    run.train_blocks = Blocks(train_blocks)
    run.val_blocks = None if val_blocks is None else Blocks(val_blocks)
    _batch_geometry(run, len(train_blocks), reference_eval)


def _batch_geometry(run: TrainRun, rows: int | None, reference_eval: bool) -> None:
    """Blocks per optimizer step, steps per epoch and the run's length (`rows` None: a stream of unknown length)."""
    args = run.args
    if run.val_blocks is None and (args.eval_at_start or reference_eval):
        raise TrainingError(
            "--eval_at_start (and a reference evaluation) need --validation_file or --validation_split_percentage "
            "(with --dataset: --validation_split)"
        )
    run.global_blocks = args.per_device_train_batch_size * args.gradient_accumulation_steps * run.world
    if rows is None:  # streaming: --max_steps is required; an "epoch" is the stream's own
        run.steps_per_epoch = run.total_steps = args.max_steps
        return
    run.steps_per_epoch = rows // run.global_blocks
    if run.steps_per_epoch == 0:
        raise TrainingError(
            f"{rows} training blocks of {run.block_size} tokens do not fill one global batch of "
            f"{run.global_blocks} blocks (per_device_train_batch_size × gradient_accumulation_steps × processes)"
        )
    if args.max_steps > 0:
        run.total_steps = args.max_steps
    else:
        run.total_steps = max(1, math.ceil(args.num_train_epochs * run.steps_per_epoch))
        if args.warmup_steps > run.total_steps:
            raise TrainingError(
                f"--warmup_steps {args.warmup_steps} is more than the run's {run.total_steps} steps "
                f"(--num_train_epochs {args.num_train_epochs:g}): the learning rate would never reach "
                f"--learning_rate; give at most {run.total_steps} (or --warmup_ratio)"
            )


# --------------------------------------------------------------------------------------------------------------------
# --dataset


def dataset_format(run: TrainRun, source) -> str:
    """The record format of the training split (its first record's fields)."""
    from .formats import detect_format
    from .sources import first_record

    args = run.args
    record = first_record(source.train, source.name, args.dataset_split)
    run.data_format = detect_format(record.keys(), args.text_field)
    return run.data_format


def tokenizer_texts(source, fmt: str, text_field: str, limit: int = 100_000):
    """Texts to train a tokenizer on (a config JSON without a tokenizer): the first `limit` records' text."""
    from .formats import TEXT

    if fmt != TEXT:
        raise TrainingError(
            f"{fmt} records need a tokenizer with a chat template: pass --tokenizer_name_or_path (a tokenizer trained "
            "here from scratch has none)"
        )
    from .sources import iter_records

    for index, record in iter_records(source.train, source.name):
        if index >= limit:
            return
        text = record.get(text_field)
        if isinstance(text, str) and text.strip():
            yield text


def build_dataset_data(run: TrainRun, source, reference_eval: bool) -> None:
    """--dataset: the examples encoded in their format (formats.py) and packed into rows (packing.py); with
    --streaming, a `RowStream` that does the same on the fly. Validation rows are built up front."""
    from tqdm.auto import tqdm

    from .formats import TEXT, Encoder, load_chat_template
    from .sources import held_out, iter_records

    args, tokenizer = run.args, run.tokenizer
    block_size = _block_size(run)
    template = load_chat_template(args.chat_template)
    if template is not None:
        tokenizer.chat_template = template  # saved with the tokenizer: the trained model keeps it
    encoder = Encoder(tokenizer, run.data_format, args.text_field, args.loss_on_prompt)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    text = run.data_format == TEXT
    limit = args.max_eval_samples or (1000 if source.streaming else None)
    val_examples = None
    if source.validation is not None:
        val_examples = _encode(source.validation, source.name, encoder, limit=limit)
    elif source.held_out and source.streaming:
        val_examples = _encode(source.train, source.name, encoder, source.held_out, keep=True, limit=limit)
    if source.streaming:
        from .streaming import RowStream, split_for_process

        if source.held_out and run.world > 1:  # each process numbers its own share: the held-out rule would differ
            raise TrainingError(
                f"--validation_split {args.validation_split} with --streaming on {run.world} processes: a percentage "
                "is held out by example number, which each process counts in its own share; give a split name "
                "(e.g. --validation_split validation)"
            )

        dataset = split_for_process(source.train, run.accelerator.process_index, run.world)
        run.stream = RowStream(dataset, encoder, block_size, pad_id, args.packing, source.held_out, source.name)
    else:
        records = tqdm(
            iter_records(source.train, source.name),
            total=len(source.train),
            desc="tokenizing",
            disable=not run.is_main or args.disable_tqdm,
            leave=False,
        )
        train_examples, held = [], []
        for index, record in records:
            is_held = source.held_out and held_out(index, source.held_out)
            (held if is_held else train_examples).append(encoder(record, index + 1))
        if source.held_out:
            val_examples = held[:limit] if limit else held
        run.train_blocks = _pack(train_examples, text, block_size, pad_id, args.packing, run, "training")
    if val_examples is not None:
        run.val_blocks = _pack(val_examples, text, block_size, pad_id, args.packing, run, "validation")
    _batch_geometry(run, None if source.streaming else len(run.train_blocks), reference_eval)


def _encode(dataset, name: str, encoder, percentage: float = 0.0, keep: bool = False, limit: int | None = None):
    """Encoded examples of `dataset` (with `percentage`: only the held-out ones when `keep`), at most `limit`."""
    from .sources import held_out, iter_records

    examples = []
    for index, record in iter_records(dataset, name):
        if limit is not None and len(examples) >= limit:
            break
        if percentage and held_out(index, percentage) != keep:
            continue
        examples.append(encoder(record, index + 1))
    return examples


def _pack(examples: list, text: bool, block_size: int, pad_id: int, packing: bool, run: TrainRun, split: str):
    """Rows of `examples`; refuses a split that gives none and says what was cut or dropped."""
    from .packing import pack_examples, pack_text

    if text:
        blocks, stats = pack_text(examples, block_size), {}
    else:
        blocks, stats = pack_examples(examples, block_size, pad_id, packing)
    if len(blocks) == 0:
        what = f"fewer than block_size={block_size} tokens" if text else "no example with a trained token"
        raise TrainingError(f"the {split} split of --dataset holds {what}: no {split} row")
    if stats.get("truncated") or stats.get("dropped"):
        run.accelerator.print(
            f"mhmoe-train: {split}: {stats['truncated']} of {len(examples)} examples were longer than --block_size "
            f"{block_size} and were cut; {stats['dropped']} had no trained token left and were left out"
        )
    return blocks


def build_model(run: TrainRun, model) -> None:
    """The model (given, built from a config JSON, or loaded), gradient checkpointing and LoRA adapters."""
    from accelerate.utils import set_seed
    from transformers import AutoModelForCausalLM

    from .._plumbing.trust import pinned

    args = run.args
    set_seed(args.seed)
    if model is None:
        if run.from_scratch:
            _check_fits_in_memory(run.config)
            model = AutoModelForCausalLM.from_config(run.config, trust_remote_code=False)
        else:
            try:  # mhmoe's or Transformers' own classes, never the folder's code; its files as checked
                with pinned(args.model_name_or_path, TrainingError, "--model_name_or_path") as source:
                    model = AutoModelForCausalLM.from_pretrained(
                        source.path, config=run.config, dtype=torch.float32, trust_remote_code=False
                    )
            except RuntimeError as e:  # weights whose shapes the (overridden) config does not have
                first = str(e).strip().splitlines()[0]
                raise TrainingError(
                    f"the weights in {args.model_name_or_path} do not fit its config (a "
                    f"--config_overrides that changes shapes?): {first}"
                ) from None
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
                model,
                r=args.lora_r,
                lora_alpha=args.lora_alpha,
                lora_dropout=args.lora_dropout,
                target_modules=args.lora_target_modules,
                experts=args.lora_experts,
                routers=args.lora_routers,
            )
            model = get_peft_model(model, peft_config)
        except ValueError as e:
            raise TrainingError(f"LoRA: {e}") from None
    run.forward_kwargs = {**_moe_forward_kwargs(run.config, args.aux_loss), "use_cache": False}
    run.trainable, run.total_params = _num_trainable(model)
    run.model = model


SIZE_FIELDS = (
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_experts",
    "moe_intermediate_size",
)


def _check_fits_in_memory(config) -> None:
    """A model built from a config must fit in this machine's memory: its parameters are counted on the meta device
    first (a vocab_size of 10**12 would otherwise fail deep inside the allocator)."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        parameters = sum(
            p.numel() for p in AutoModelForCausalLM.from_config(config, trust_remote_code=False).parameters()
        )
    try:
        memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):  # not on this platform
        return
    if 4 * parameters > memory:
        sizes = ", ".join(f"{k}={getattr(config, k)}" for k in SIZE_FIELDS if getattr(config, k, None) is not None)
        raise TrainingError(
            f"the config makes a model of {parameters:,} parameters ({4 * parameters / 1e9:,.1f} GB in "
            f"float32, about 4x that to train), more than this machine's {memory / 1e9:.1f} GB of "
            f"memory; check its sizes ({sizes})"
        )


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
    scheduler = get_scheduler(
        schedule,
        optimizer,
        num_warmup_steps=warmup,
        num_training_steps=run.total_steps,
        scheduler_specific_kwargs=schedule_kwargs,
    )
    if using_deepspeed:
        run.model, run.optimizer, run.scheduler = accelerator.prepare(run.model, optimizer, scheduler)
    else:
        run.optimizer, run.scheduler = accelerator.prepare(optimizer, scheduler)


__all__ = [
    "build_data",
    "build_dataset_data",
    "build_model",
    "dataset_format",
    "build_optimizer",
    "reset_accelerate_state",
    "setup_accelerator",
    "setup_tokenizer",
]
