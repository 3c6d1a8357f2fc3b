"""mhmoe-train: pre-train or fine-tune MHMoE / MoH-Llama causal LMs with Accelerate (and PEFT LoRA).

The project's one training loop. Runs as-is on one device, and unchanged under `accelerate launch` (DDP, FSDP,
DeepSpeed) on many; see docs/training.md. From Python: `train(TrainArguments(...))` or `train({...})`.

Data order. Every epoch is a seeded permutation of the packed blocks (seed + epoch). Optimizer step g of an epoch takes
the G = per_device_batch × accumulation × processes blocks [g·G, (g+1)·G) of it, cut into micro-batches m = 0 …
accumulation·processes − 1; process r runs micro-batches a·processes + r (a = accumulation step). So one process
accumulation 2 sees exactly the micro-batches of two processes without accumulation, and a resumed run continues at
block g·G of the same permutation: both reproduce the other run's losses.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re
import shutil
import sys
import time
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from transformers.utils import SAFE_WEIGHTS_INDEX_NAME, SAFE_WEIGHTS_NAME

import mhmoe  # noqa: F401  (registers the model types and PEFT defaults)

from .analysis import expert_counts
from .checkpoint_files import overlapping, weight_files
from .data import order_by_similarity, read_files, tokenize_and_pack, train_tokenizer

METRICS_FILE = "metrics.jsonl"
PLOT_FILE = "loss_curve.png"
STATE_FILE = "train_state.json"
SUMMARY_FILE = "train_summary.json"
# settings that decide which parameters train: a checkpoint resumes only with the same ones
PARAMETER_SETTINGS = ("lora", "lora_r", "lora_target_modules", "lora_experts")
# what a finished run leaves in --output_dir (besides the tokenizer): refused without --overwrite_output_dir
RUN_OUTPUTS = (SAFE_WEIGHTS_NAME, SAFE_WEIGHTS_INDEX_NAME, "adapter_model.safetensors", "adapter_config.json",
               SUMMARY_FILE)  # fmt: skip
CHECKPOINT_PREFIX = "checkpoint-"


class TrainingError(ValueError):
    """A problem with the arguments, the model or the data, found before training starts."""


@dataclass
class TrainArguments:
    """Arguments of `mhmoe-train` (each field is a `--flag`)."""

    model_name_or_path: str = field(
        default=None,
        metadata={"help": "A checkpoint directory (fine-tune; from_pretrained) or a config JSON (train from scratch)."},
    )
    output_dir: str = field(default=None, metadata={"help": "Where checkpoints, metrics and the final model go."})
    train_file: list[str] = field(default=None, metadata={"help": "Training text (.txt: one document per file) or "
                                                                    "JSONL (.jsonl/.json: one document per record)."})
    validation_file: list[str] | None = field(default=None, metadata={"help": "Validation text/JSONL file(s)."})
    validation_split_percentage: float = field(
        default=0.0, metadata={"help": "Without --validation_file: hold out this %% of the training blocks."}
    )
    text_field: str = field(default="text", metadata={"help": "JSONL field holding the text."})
    tokenizer_name_or_path: str | None = field(
        default=None,
        metadata={"help": "Tokenizer directory. Default: the checkpoint's; for a config JSON, a byte-level BPE "
                          "tokenizer trained on the training data (saved with the model)."},
    )
    tokenizer_vocab_size: int | None = field(
        default=None, metadata={"help": "Vocabulary size of a tokenizer trained here (default: the config's)."}
    )
    config_overrides: str | None = field(
        default=None, metadata={"help": "Comma-separated key=value config changes, e.g. 'router_aux_loss_coef=0.02'."}
    )
    block_size: int | None = field(
        default=None, metadata={"help": "Tokens per packed block (default: min(1024, max_position_embeddings))."}
    )
    max_steps: int = field(default=-1, metadata={"help": "Optimizer steps; overrides --num_train_epochs when > 0."})
    num_train_epochs: float = field(default=1.0, metadata={"help": "Epochs over the training blocks."})
    per_device_train_batch_size: int = 8
    per_device_eval_batch_size: int = 8
    gradient_accumulation_steps: int = 1
    learning_rate: float = 3e-4
    weight_decay: float = field(default=0.01, metadata={"help": "AdamW decay (not on biases, norms, 1-D params)."})
    adam_beta1: float = 0.9
    adam_beta2: float = 0.95
    adam_epsilon: float = 1e-8
    lr_scheduler_type: str = field(
        default="cosine",
        metadata={"help": "cosine, linear, constant, constant_with_warmup, ... (transformers.get_scheduler)."},
    )
    min_learning_rate: float = field(
        default=0.0,
        metadata={"help": "Final learning rate of the cosine schedule (cosine decays to it instead of 0; e.g. the MoH "
                          "paper's continue-tuning: 2e-5 -> 1e-6)."},
    )
    warmup_steps: int = 0
    warmup_ratio: float = field(default=0.0, metadata={"help": "Warmup as a fraction of the steps (if no steps)."})
    max_grad_norm: float = field(default=1.0, metadata={"help": "Gradient clipping (0: off)."})
    mixed_precision: str | None = field(
        default=None,
        metadata={"help": "no, bf16 or fp16 (default: Accelerate's config / environment, else no).",
                  "choices": ["no", "bf16", "fp16"]},
    )
    gradient_checkpointing: bool = False
    aux_loss: bool = field(
        default=True, metadata={"help": "Ask MoE models for router logits so their aux losses are trained/logged."}
    )
    seed: int = 42
    logging_steps: int = field(default=1, metadata={"help": "Write a metrics line every N optimizer steps."})
    eval_steps: int = field(default=0, metadata={"help": "Validate every N steps (0: only at the end)."})
    eval_at_start: bool = field(
        default=False, metadata={"help": "Also validate before the first step (logged as step 0, tokens 0)."}
    )
    save_steps: int = field(default=0, metadata={"help": "Accelerator.save_state every N steps (0: never)."})
    save_total_limit: int | None = field(default=None, metadata={"help": "Keep only the newest N checkpoints."})
    resume_from_checkpoint: str | None = field(
        default=None, metadata={"help": "A checkpoint-N directory, or 'latest' (the newest in --output_dir)."}
    )
    overwrite_output_dir: bool = field(
        default=False,
        metadata={"help": "Start afresh in an output_dir that holds checkpoints or a finished run (deletes them once "
                          "every input is checked)."},  # fmt: skip
    )
    lora: bool = field(default=False, metadata={"help": "Train LoRA adapters (PEFT) instead of all weights."})
    lora_r: int = 8
    lora_alpha: int = 16
    lora_dropout: float = field(default=0.0, metadata={"help": "Must be 0 when experts are adapted."})
    lora_target_modules: list[str] | None = field(
        default=None, metadata={"help": "nn.Linear names (default: PEFT's table for the model type: q/k/v/o_proj)."}
    )
    lora_experts: bool = field(
        default=True, metadata={"help": "Also LoRA the 3-D expert weights (PEFT target_parameters)."}
    )
    merge_lora: bool = field(default=False, metadata={"help": "Also save the merged model in output_dir/merged."})
    ddp_find_unused_parameters: bool = False
    disable_tqdm: bool = False
    plot: bool = field(default=True, metadata={"help": "Write loss_curve.png (matplotlib)."})
    similarity_batching: bool = field(default=False, metadata={"help": "Order training documents so neighbours are "
                                      "similar before packing (Lory's batching; mhmoe.data.order_by_similarity)."})


@dataclass
class TrainResult:
    output_dir: str
    global_step: int
    history: list[dict]  # every metrics record written (train and eval), this run
    final_eval: dict | None
    model: Any = None  # the unwrapped trained model (a PeftModel with --lora)
    tokenizer: Any = None


# --------------------------------------------------------------------------------------------------------------------
# checks that run before anything is trained


# Dense models of the LLaMA family: the parents that mhmoe.conversion turns into MoH (the MoH paper's first stage
# continue-tunes the dense model on the new data before converting it, §4.4).
DENSE_PARENT_TYPES = ("llama", "mistral", "qwen2")


def supported_model_types() -> list[str]:
    """Model types this script trains: mhmoe, moh_llama once it is registered with AutoConfig, and the dense
    LLaMA-family parents (llama, mistral, qwen2)."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    return [t for t in ("mhmoe", "moh_llama", *DENSE_PARENT_TYPES) if t in CONFIG_MAPPING]


def check_arguments(args: TrainArguments, model_given: bool = False) -> None:
    for name in ("output_dir", "train_file") if model_given else ("model_name_or_path", "output_dir", "train_file"):
        if not getattr(args, name):
            raise TrainingError(f"--{name} is required")
    if isinstance(args.train_file, str):
        args.train_file = [args.train_file]
    if isinstance(args.validation_file, str):
        args.validation_file = [args.validation_file]
    if isinstance(args.lora_target_modules, str):
        args.lora_target_modules = [args.lora_target_modules]
    positive = ("per_device_train_batch_size", "per_device_eval_batch_size", "gradient_accumulation_steps",
                "logging_steps", "lora_r")  # fmt: skip
    for name in positive:
        if getattr(args, name) < 1:
            raise TrainingError(f"--{name} must be >= 1, got {getattr(args, name)}")
    if args.block_size is not None and args.block_size < 2:
        raise TrainingError(f"--block_size must be >= 2, got {args.block_size}")
    if args.max_steps <= 0 and args.num_train_epochs <= 0:
        raise TrainingError("set --max_steps > 0 or --num_train_epochs > 0")
    if args.learning_rate <= 0 or args.max_grad_norm < 0 or args.warmup_steps < 0:
        raise TrainingError("--learning_rate must be > 0, --max_grad_norm and --warmup_steps >= 0")
    if not 0 <= args.validation_split_percentage < 100 or not 0 <= args.warmup_ratio < 1:
        raise TrainingError("--validation_split_percentage must be in [0, 100) and --warmup_ratio in [0, 1)")
    if args.save_total_limit is not None and args.save_total_limit < 1:
        raise TrainingError(f"--save_total_limit must be >= 1, got {args.save_total_limit}")
    from transformers import SchedulerType

    if args.lr_scheduler_type not in {s.value for s in SchedulerType}:
        choices = ", ".join(s.value for s in SchedulerType)
        raise TrainingError(f"unknown --lr_scheduler_type {args.lr_scheduler_type!r} (one of: {choices})")
    if args.save_steps < 0 or args.eval_steps < 0 or args.logging_steps < 1:
        raise TrainingError(
            f"--save_steps and --eval_steps must be >= 0 (0: never / only at the end) and --logging_steps >= 1, got "
            f"{args.save_steps}, {args.eval_steps} and {args.logging_steps}"
        )
    if args.min_learning_rate < 0 or args.min_learning_rate >= args.learning_rate:
        raise TrainingError(
            f"--min_learning_rate must be >= 0 and < --learning_rate ({args.learning_rate}), "
            f"got {args.min_learning_rate}"
        )
    if args.min_learning_rate > 0 and args.lr_scheduler_type not in ("cosine", "cosine_with_min_lr"):
        raise TrainingError(f"--min_learning_rate applies to the cosine schedule, not {args.lr_scheduler_type!r}")
    if args.lr_scheduler_type == "cosine_with_min_lr" and args.min_learning_rate == 0:
        raise TrainingError("--lr_scheduler_type cosine_with_min_lr needs --min_learning_rate > 0")
    for path in [*args.train_file, *(args.validation_file or [])]:
        if not os.path.isfile(path):
            raise TrainingError(f"data file not found: {path}")
    if not model_given and not os.path.exists(args.model_name_or_path):
        raise TrainingError(
            f"--model_name_or_path {args.model_name_or_path!r} does not exist (give a local checkpoint directory or a "
            "config JSON; nothing is downloaded)"
        )
    if args.tokenizer_name_or_path is not None and not os.path.isdir(args.tokenizer_name_or_path):
        raise TrainingError(f"--tokenizer_name_or_path {args.tokenizer_name_or_path!r} is not a directory")
    _check_writable(args.output_dir)
    if not model_given and os.path.isdir(args.model_name_or_path) and (
        os.path.realpath(args.model_name_or_path) == os.path.realpath(args.output_dir)
        or (args.overwrite_output_dir and overlapping(args.model_name_or_path, args.output_dir))
    ):
        raise TrainingError(
            f"--output_dir {args.output_dir!r} would replace or delete the model being trained "
            f"({args.model_name_or_path}); choose another --output_dir"
        )
    if args.resume_from_checkpoint:
        args.resume_from_checkpoint = _resolve_checkpoint(args.resume_from_checkpoint, args.output_dir)
        with open(os.path.join(args.resume_from_checkpoint, STATE_FILE)) as f:
            saved = json.load(f).get("args", {})
        changed = [f"--{key} {saved[key]!r} -> {getattr(args, key)!r}" for key in PARAMETER_SETTINGS
                   if key in saved and saved[key] != getattr(args, key)]  # fmt: skip
        if changed:  # the saved optimizer state belongs to another set of trained parameters
            raise TrainingError(
                f"{args.resume_from_checkpoint} was saved with other trained parameters ({'; '.join(changed)}): "
                "resume with the same settings, or start a new run"
            )
    elif not args.overwrite_output_dir:
        if _list_checkpoints(args.output_dir):
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
        raise TrainingError(f"--output_dir {directory!r} is not writable ({existing} does not take new files)")


def _remove_run_outputs(output_dir: str) -> None:
    """--overwrite_output_dir: what an earlier run left (checkpoints, metrics, final weights and summary)."""
    for _, path in _list_checkpoints(output_dir, complete=False):  # also those a crash left half-written
        shutil.rmtree(path)
    for name in (METRICS_FILE, *RUN_OUTPUTS):
        if os.path.isfile(os.path.join(output_dir, name)):
            os.remove(os.path.join(output_dir, name))


def _list_checkpoints(directory: str, complete: bool = True) -> list[tuple[int, str]]:
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


def _resolve_checkpoint(checkpoint: str, output_dir: str) -> str:
    if checkpoint == "latest":
        found = _list_checkpoints(output_dir)
        if not found:
            raise TrainingError(f"--resume_from_checkpoint latest: no complete checkpoint in {output_dir}")
        return found[-1][1]
    if not os.path.isfile(os.path.join(checkpoint, STATE_FILE)):
        raise TrainingError(f"--resume_from_checkpoint {checkpoint!r} is not a complete checkpoint (no {STATE_FILE})")
    return checkpoint


def _read(paths: list[str], text_field: str) -> list[str]:
    try:
        return read_files(paths, text_field)
    except (OSError, ValueError) as e:
        raise TrainingError(str(e)) from None


def _parse_overrides(text: str | None) -> dict:
    if not text:
        return {}
    overrides = {}
    for item in text.split(","):
        if "=" not in item:
            raise TrainingError(f"--config_overrides: expected key=value, got {item!r}")
        key, value = (s.strip() for s in item.split("=", 1))
        try:
            overrides[key] = json.loads(value)
        except json.JSONDecodeError:
            overrides[key] = value
    return overrides


# --------------------------------------------------------------------------------------------------------------------
# model, tokenizer and data


def load_config(args: TrainArguments):
    """(config, from_scratch). Refuses unknown model types with the list of supported ones."""
    from transformers import AutoConfig

    path = args.model_name_or_path
    from_scratch = os.path.isfile(path)
    if from_scratch:
        try:
            with open(path) as f:
                fields = json.load(f)
        except json.JSONDecodeError as e:
            raise TrainingError(f"{path}: not a valid config JSON ({e})") from None
        model_type = fields.pop("model_type", None) if isinstance(fields, dict) else None
    else:
        config_file = os.path.join(path, "config.json")
        if not os.path.isfile(config_file):
            raise TrainingError(f"{path} is not a checkpoint directory (no config.json)")
        try:
            with open(config_file) as f:
                model_type = json.load(f).get("model_type")
        except (json.JSONDecodeError, AttributeError) as e:
            raise TrainingError(f"{config_file}: not a valid config JSON ({e})") from None
        try:
            weight_files(path, TrainingError)  # safetensors only; pickles are refused, never unpickled
        except TrainingError as e:
            raise TrainingError(f"--model_name_or_path: {e}") from None
    supported = supported_model_types()
    if model_type not in supported:
        raise TrainingError(
            f"model_type {model_type!r} in {path} is not supported by mhmoe-train (supported: {', '.join(supported)})"
        )
    overrides = _parse_overrides(args.config_overrides)
    template = AutoConfig.for_model(model_type)
    unknown = sorted(key for key in overrides if not hasattr(template, key))
    if unknown:  # a config takes any key silently: a typo would train with the default and save the typo
        raise TrainingError(f"--config_overrides: {', '.join(unknown)} is not a {model_type} config field")
    try:
        if from_scratch:
            config = AutoConfig.for_model(model_type, **{**fields, **overrides})
        else:
            config = AutoConfig.from_pretrained(path, **overrides)
    except (TypeError, ValueError) as e:
        raise TrainingError(f"invalid config {path}: {e}") from None
    return config, from_scratch


def _moe_forward_kwargs(config, aux_loss: bool) -> dict:
    """Ask for router logits (and so the aux losses) from models that have them."""
    if aux_loss and hasattr(config, "output_router_logits"):
        return {"output_router_logits": True}
    return {}


def _loss_fields(output) -> dict[str, torch.Tensor]:
    """The output's `*_loss` tensors other than `loss` (aux_loss, z_loss, moh_aux_loss, ...), unweighted."""
    return {
        key: value
        for key, value in output.items()
        if key.endswith("_loss") and key != "loss" and isinstance(value, torch.Tensor) and value.numel() == 1
    }


def _token_nll_sum(logits: torch.Tensor, input_ids: torch.Tensor, rows=None) -> torch.Tensor:
    """Σ next-token NLL over (B, T) blocks (only `rows`, default all), row by row so at most one row of fp32 logits
    exists at a time."""
    total = logits.new_zeros((), dtype=torch.float32)
    for row in range(logits.shape[0]) if rows is None else rows:
        total = total + F.cross_entropy(logits[row, :-1].float(), input_ids[row, 1:], reduction="sum")
    return total


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


# --------------------------------------------------------------------------------------------------------------------
# statistics


def _other_router_probs(output) -> dict[str, list[torch.Tensor]]:
    """Mean routing probability per head/expert for extra `*_router_logits` outputs (e.g. MoH head routers)."""
    found = {}
    for key, value in output.items():
        if key.endswith("router_logits") and key != "router_logits" and isinstance(value, (tuple, list)) and value:
            found[key] = [torch.softmax(v.float().reshape(-1, v.shape[-1]), -1).sum(0) for v in value]
    return found


def load_summary(fractions: list[list[float]]) -> dict:
    """Imbalance of per-layer load fractions: max_e(f_e)·E (1 = perfectly balanced), averaged and worst over layers."""
    ratios = [max(layer) * len(layer) for layer in fractions]
    return {"mean_max_over_uniform": sum(ratios) / len(ratios), "worst_max_over_uniform": max(ratios)}


# --------------------------------------------------------------------------------------------------------------------
# metrics file and plot


def _read_metrics(path: str) -> list[dict]:
    if not os.path.isfile(path):
        return []
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def plot_metrics(metrics_path: str, png_path: str) -> None:
    """Loss curve: total and LM training loss, validation loss, and the unweighted aux losses (second panel)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    records = _read_metrics(metrics_path)
    train = [r for r in records if "loss" in r]
    evals = [r for r in records if "eval_loss" in r]
    aux_keys = sorted({k for r in train for k in r if k.endswith("_loss") and k not in ("loss", "lm_loss")})
    fig, axes = plt.subplots(1, 2 if aux_keys else 1, figsize=(11 if aux_keys else 6, 4), squeeze=False)
    ax = axes[0, 0]
    if train:
        ax.plot([r["step"] for r in train], [r["loss"] for r in train], label="train loss (total)")
        ax.plot([r["step"] for r in train], [r["lm_loss"] for r in train], label="train LM loss", alpha=0.8)
    if evals:
        ax.plot([r["step"] for r in evals], [r["eval_loss"] for r in evals], "o-", label="validation LM loss")
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("loss (nats/token)")
    ax.legend()
    ax.grid(alpha=0.3)
    if aux_keys:
        ax = axes[0, 1]
        for key in aux_keys:
            points = [(r["step"], r[key]) for r in train if key in r]
            ax.plot(*zip(*points), label=key)
        ax.set_xlabel("optimizer step")
        ax.set_ylabel("aux loss (unweighted)")
        ax.legend()
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(png_path, dpi=100)
    plt.close(fig)


# --------------------------------------------------------------------------------------------------------------------
# the loop


def reset_accelerate_state() -> None:
    """Forget Accelerate's process-wide state (its singletons), so that several `train()` calls can run one after the
    other in one process, each with its own Accelerator (the demos do). Not for use under `accelerate launch`."""
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()


def _coerce_args(args) -> TrainArguments:
    if isinstance(args, TrainArguments):
        return dataclasses.replace(args)
    if not isinstance(args, dict):
        args = vars(args)
    names = {f.name for f in dataclasses.fields(TrainArguments)}
    unknown = sorted(set(args) - names)
    if unknown:
        raise TrainingError(f"unknown training arguments: {', '.join(unknown)}")
    return TrainArguments(**args)


def train(args, model=None, tokenizer=None, on_log=None, reference_eval=None) -> TrainResult:
    """Train as `mhmoe-train` does. `args`: `TrainArguments`, a dict or an argparse Namespace of its fields.

    `model` / `tokenizer` may be given as objects (then `model_name_or_path` is not needed; without a tokenizer, one is
    trained on the data); otherwise they are loaded or built from `model_name_or_path`. Every input problem raises
    `TrainingError` before training starts. `on_log(record)` is called (main process) with every metrics record.
    `reference_eval(model) -> context manager`: before the first step (of a fresh run), validate once inside it and log
    the result as `reference_eval_loss` / `reference_eval_ppl` at step 0 (`mhmoe.conversion` uses it to measure the
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
    from accelerate import Accelerator, DistributedDataParallelKwargs
    from accelerate.utils import set_seed
    from transformers import AutoModelForCausalLM, AutoTokenizer, get_scheduler

    check_arguments(args, model_given=model is not None)
    if model is None:
        config, from_scratch = load_config(args)
    else:
        config, from_scratch = model.config, False
        if args.config_overrides:
            raise TrainingError("--config_overrides applies to models loaded here, not to a model object")
        if config.model_type not in supported_model_types():
            raise TrainingError(f"model_type {config.model_type!r} is not supported by mhmoe-train")

    accelerator = Accelerator(
        gradient_accumulation_steps=args.gradient_accumulation_steps,
        mixed_precision=args.mixed_precision,
        step_scheduler_with_optimizer=False,
        kwargs_handlers=[DistributedDataParallelKwargs(find_unused_parameters=args.ddp_find_unused_parameters)],
    )
    is_main = accelerator.is_main_process
    world = accelerator.num_processes
    fsdp_requested = os.environ.get("ACCELERATE_USE_FSDP", "false").lower() == "true"
    if fsdp_requested and accelerator.distributed_type.value != "FSDP":
        accelerator.print(  # Accelerate enables FSDP only for accelerator devices (MULTI_GPU, ...), never MULTI_CPU
            f"warning: FSDP was requested but Accelerate runs {accelerator.distributed_type.value} here (FSDP needs "
            "GPUs or other accelerators; on CPU it falls back to plain data parallelism)"
        )

    # tokenizer: given, from the checkpoint being resumed, from the model directory, or trained here on main
    train_docs = _read(args.train_file, args.text_field)
    if not train_docs:
        raise TrainingError(f"no text in --train_file {' '.join(args.train_file)}")
    if tokenizer is None:
        source = args.tokenizer_name_or_path
        if source is None and args.resume_from_checkpoint and os.path.isfile(
            os.path.join(args.resume_from_checkpoint, "tokenizer_config.json")
        ):
            source = args.resume_from_checkpoint
        if source is None and not from_scratch:
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
            if is_main:
                train_tokenizer(train_docs, vocab_size, config.max_position_embeddings).save_pretrained(args.output_dir)
            accelerator.wait_for_everyone()
            tokenizer = AutoTokenizer.from_pretrained(args.output_dir)  # every process: the same files
    if len(tokenizer) > config.vocab_size:
        raise TrainingError(
            f"the tokenizer has {len(tokenizer)} tokens but the model's vocab_size is {config.vocab_size}"
        )
    if tokenizer.eos_token_id is None:
        raise TrainingError("the tokenizer has no EOS token (needed to separate packed documents)")
    if from_scratch:
        config.bos_token_id, config.eos_token_id = tokenizer.bos_token_id, tokenizer.eos_token_id

    context = config.max_position_embeddings
    block_size = args.block_size or min(1024, context)
    if block_size > context:
        raise TrainingError(f"--block_size {block_size} is larger than the model's context ({context} positions)")

    # data: packed blocks; the validation split is taken from a seeded permutation of the training blocks
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

    if val_blocks is None and (args.eval_at_start or reference_eval is not None):
        raise TrainingError("--eval_at_start (and a reference evaluation) need --validation_file or "
                            "--validation_split_percentage")

    micro = args.per_device_train_batch_size
    accumulation = args.gradient_accumulation_steps
    global_blocks = micro * accumulation * world
    steps_per_epoch = len(train_blocks) // global_blocks
    if steps_per_epoch == 0:
        raise TrainingError(
            f"{len(train_blocks)} training blocks of {block_size} tokens do not fill one global batch of "
            f"{global_blocks} blocks (per_device_train_batch_size × gradient_accumulation_steps × processes)"
        )
    if args.max_steps > 0:
        total_steps = args.max_steps
    else:
        total_steps = max(1, math.ceil(args.num_train_epochs * steps_per_epoch))
    warmup = args.warmup_steps or math.ceil(args.warmup_ratio * total_steps)

    # model
    set_seed(args.seed)
    if model is None:
        if from_scratch:
            model = AutoModelForCausalLM.from_config(config)
        else:
            try:
                model = AutoModelForCausalLM.from_pretrained(
                    args.model_name_or_path, config=config, dtype=torch.float32
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
    forward_kwargs = _moe_forward_kwargs(config, args.aux_loss)
    forward_kwargs["use_cache"] = False
    trainable, total_params = _num_trainable(model)

    # optimizer and schedule; DeepSpeed wants model and optimizer prepared together, FSDP the model first
    using_deepspeed = accelerator.state.deepspeed_plugin is not None
    if using_deepspeed:
        ds_config = accelerator.state.deepspeed_plugin.deepspeed_config
        ds_config["train_micro_batch_size_per_gpu"] = micro
        ds_config["gradient_accumulation_steps"] = accumulation
    else:
        model = accelerator.prepare(model)
    optimizer = torch.optim.AdamW(
        _optimizer_groups(model, args.weight_decay),
        lr=args.learning_rate,
        betas=(args.adam_beta1, args.adam_beta2),
        eps=args.adam_epsilon,
    )
    schedule, schedule_kwargs = args.lr_scheduler_type, None
    if args.min_learning_rate > 0:  # cosine down to the final learning rate
        schedule, schedule_kwargs = "cosine_with_min_lr", {"min_lr": args.min_learning_rate}
    scheduler = get_scheduler(schedule, optimizer, num_warmup_steps=warmup, num_training_steps=total_steps,
                              scheduler_specific_kwargs=schedule_kwargs)  # fmt: skip
    if using_deepspeed:
        model, optimizer, scheduler = accelerator.prepare(model, optimizer, scheduler)
    else:
        optimizer, scheduler = accelerator.prepare(optimizer, scheduler)

    # every input is checked: only now is an earlier run's output removed, and output_dir created
    if is_main:
        os.makedirs(args.output_dir, exist_ok=True)
        if args.overwrite_output_dir and not args.resume_from_checkpoint:
            _remove_run_outputs(args.output_dir)
    accelerator.wait_for_everyone()

    # resume
    start_step = 0
    metrics_path = os.path.join(args.output_dir, METRICS_FILE)
    if args.resume_from_checkpoint:
        with open(os.path.join(args.resume_from_checkpoint, STATE_FILE)) as f:
            saved = json.load(f)
        for key, now in (("global_batch_blocks", global_blocks), ("block_size", block_size), ("seed", args.seed),
                         ("num_train_blocks", len(train_blocks))):  # fmt: skip
            if saved.get(key) != now:
                accelerator.print(
                    f"warning: {key} was {saved.get(key)} in {args.resume_from_checkpoint}, now {now}: the resumed run "
                    "will not see the same data order as the interrupted one"
                )
        accelerator.load_state(args.resume_from_checkpoint)
        start_step = saved["step"]
        if start_step >= total_steps:
            raise TrainingError(f"{args.resume_from_checkpoint} is at step {start_step} >= total steps {total_steps}")
    if is_main:  # keep the metrics up to the resumed step; drop those of steps that will be redone
        kept = [r for r in _read_metrics(metrics_path) if r.get("step", 0) <= start_step] if start_step else []
        with open(metrics_path, "w") as f:
            f.writelines(json.dumps(r) + "\n" for r in kept)

    history: list[dict] = []

    def log(record: dict) -> None:
        history.append(record)
        if is_main:
            with open(metrics_path, "a") as f:
                f.write(json.dumps(record) + "\n")
            if on_log is not None:
                on_log(record)

    def evaluate(step: int) -> dict:
        batch_size = args.per_device_eval_batch_size
        record = _evaluate(accelerator, model, val_blocks, batch_size, config, forward_kwargs, step)
        record["tokens"] = step * global_blocks * block_size  # training tokens seen so far
        return record

    def save_checkpoint(step: int) -> None:
        path = os.path.join(args.output_dir, f"{CHECKPOINT_PREFIX}{step}")
        accelerator.save_state(path)
        if is_main:
            tokenizer.save_pretrained(path)
            state = {"step": step, "total_steps": total_steps, "global_batch_blocks": global_blocks,
                     "block_size": block_size, "seed": args.seed, "num_train_blocks": len(train_blocks),
                     "num_processes": world, "args": dataclasses.asdict(args)}  # fmt: skip
            with open(os.path.join(path, STATE_FILE), "w") as f:  # written last: marks the checkpoint complete
                json.dump(state, f, indent=2)
            if args.save_total_limit:
                for _, old in _list_checkpoints(args.output_dir)[: -args.save_total_limit]:
                    shutil.rmtree(old, ignore_errors=True)
            if args.plot:
                plot_metrics(metrics_path, os.path.join(args.output_dir, PLOT_FILE))
        accelerator.wait_for_everyone()

    accelerator.print(
        f"mhmoe-train: {config.model_type}, {trainable:,} trainable / {total_params:,} parameters; "
        f"{len(train_blocks)} blocks × {block_size} tokens, {steps_per_epoch} steps/epoch, steps {start_step} → "
        f"{total_steps}, global batch {global_blocks} blocks ({world} process(es) × {micro} × {accumulation} accum), "
        f"{accelerator.distributed_type.value}, mixed precision {accelerator.mixed_precision}"
    )
    from tqdm.auto import tqdm

    progress = tqdm(total=total_steps, initial=start_step, disable=not is_main or args.disable_tqdm,
                    desc="training", dynamic_ncols=True)  # fmt: skip
    if start_step == 0 and val_blocks is not None:
        if reference_eval is not None:  # e.g. the dense parent: a MoH model with every head active
            with reference_eval(accelerator.unwrap_model(model)):
                reference = evaluate(0)
            log({"step": 0, "tokens": 0, **{f"reference_{k}": v for k, v in reference.items() if k[:5] == "eval_"}})
            accelerator.print(f"reference validation: perplexity {reference['eval_ppl']:.2f}")
        if args.eval_at_start:
            log(evaluate(0))
            accelerator.print(f"validation before training: perplexity {history[-1]['eval_ppl']:.2f}")
    rank = accelerator.process_index
    device = accelerator.device
    model.train()
    final_eval = None
    start_time = time.time()
    permutation, permutation_epoch = None, -1
    loss_names: list[str] | None = None
    for step in range(start_step, total_steps):
        epoch, step_in_epoch = divmod(step, steps_per_epoch)
        if epoch != permutation_epoch:
            permutation = torch.randperm(len(train_blocks), generator=torch.Generator().manual_seed(args.seed + epoch))
            permutation_epoch = epoch
        sums: torch.Tensor | None = None
        grad_norm = None
        for a in range(accumulation):
            m = a * world + rank
            start = step_in_epoch * global_blocks + m * micro
            batch = train_blocks[permutation[start : start + micro]].to(device)
            with accelerator.accumulate(model):
                output = model(input_ids=batch, labels=batch, **forward_kwargs)
                accelerator.backward(output.loss)
                if accelerator.sync_gradients and args.max_grad_norm > 0:
                    grad_norm = accelerator.clip_grad_norm_(model.parameters(), args.max_grad_norm)
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
            extra = _loss_fields(output)
            if loss_names is None:
                loss_names = sorted(extra)
            with torch.no_grad():
                loss = output.loss.detach().float()
                lm_loss = _token_nll_sum(output.logits, batch) / (batch.numel() - batch.shape[0]) if extra else loss
                values = torch.stack([loss, lm_loss.float()] + [extra[k].detach().float() for k in loss_names])
            sums = values if sums is None else sums + values
        lr_used = scheduler.get_last_lr()[0]  # the rate this step's update used
        if not getattr(optimizer, "step_was_skipped", False):
            scheduler.step()
        means = accelerator.reduce(sums / accumulation, reduction="mean")
        done = step + 1
        if done % args.logging_steps == 0 or done == total_steps:
            record = {"step": done, "epoch": round(done / steps_per_epoch, 4)}
            record.update(zip(["loss", "lm_loss", *loss_names], means.tolist()))
            record["lr"] = lr_used
            if grad_norm is not None:
                record["grad_norm"] = float(grad_norm)
            record["tokens"] = done * global_blocks * block_size
            record["elapsed_s"] = round(time.time() - start_time, 3)
            log(record)
            progress.set_postfix(loss=f"{record['loss']:.4f}", lm=f"{record['lm_loss']:.4f}")
        progress.update(1)
        if val_blocks is not None and args.eval_steps > 0 and done % args.eval_steps == 0 and done != total_steps:
            log(evaluate(done))
            model.train()
        if args.save_steps > 0 and done % args.save_steps == 0:
            save_checkpoint(done)
    progress.close()

    if val_blocks is not None:
        final_eval = evaluate(total_steps)
        log(final_eval)
        accelerator.print(f"validation: loss {final_eval['eval_loss']:.4f}, perplexity {final_eval['eval_ppl']:.2f}")

    # final model: the unwrapped model (full, or the adapter with --lora), tokenizer, plot
    accelerator.wait_for_everyone()
    state_dict = accelerator.get_state_dict(model)
    unwrapped = accelerator.unwrap_model(model)
    unwrapped.save_pretrained(
        args.output_dir, is_main_process=is_main, save_function=accelerator.save, state_dict=state_dict
    )
    if is_main:
        tokenizer.save_pretrained(args.output_dir)
        if args.lora and args.merge_lora:
            import copy

            merged = copy.deepcopy(unwrapped).merge_and_unload()
            merged.save_pretrained(os.path.join(args.output_dir, "merged"))
            tokenizer.save_pretrained(os.path.join(args.output_dir, "merged"))
        if args.plot:
            plot_metrics(metrics_path, os.path.join(args.output_dir, PLOT_FILE))
        summary = {"step": total_steps, "num_processes": world, "distributed_type": accelerator.distributed_type.value,
                   "mixed_precision": accelerator.mixed_precision, "global_batch_blocks": global_blocks,
                   "block_size": block_size, "trainable_parameters": trainable, "parameters": total_params,
                   "final_eval": final_eval, "args": dataclasses.asdict(args)}  # fmt: skip
        with open(os.path.join(args.output_dir, SUMMARY_FILE), "w") as f:
            json.dump(summary, f, indent=2)
    accelerator.wait_for_everyone()
    return TrainResult(args.output_dir, total_steps, history, final_eval, unwrapped, tokenizer)


@torch.no_grad()
def _evaluate(accelerator, model, blocks, batch_size, config, forward_kwargs, step) -> dict:
    """Validation LM loss / perplexity over all blocks (sharded over processes), aux losses and routing load."""
    model.eval()
    world, rank = accelerator.num_processes, accelerator.process_index
    mine = list(range(rank, len(blocks), world))
    per_rank = math.ceil(len(blocks) / world)
    weights = [1.0] * len(mine) + [0.0] * (per_rank - len(mine))  # equal forward counts on every process (FSDP)
    mine += [0] * (per_rank - len(mine))
    device = accelerator.device
    nll = torch.zeros((), device=device)
    tokens = torch.zeros((), device=device)
    aux_sums: dict[str, torch.Tensor] = {}
    batches = torch.zeros((), device=device)
    expert_totals: torch.Tensor | None = None  # (MoE layers, E)
    other: dict[str, list[torch.Tensor]] = {}
    top_k = getattr(config, "num_experts_per_tok", None)
    for start in range(0, per_rank, batch_size):
        index = mine[start : start + batch_size]
        weight = torch.tensor(weights[start : start + batch_size], device=device)
        batch = blocks[index].to(device)
        real = weight.bool()
        output = model(input_ids=batch, **forward_kwargs)
        nll += _token_nll_sum(output.logits, batch, real.nonzero().flatten().tolist())
        tokens += real.sum() * (batch.shape[1] - 1)
        if real.any():
            batches += 1
            for key, value in _loss_fields(output).items():
                aux_sums[key] = aux_sums.get(key, torch.zeros((), device=device)) + value.float()
            router_logits = output.get("router_logits")
            if router_logits and top_k:
                rows = real.repeat_interleave(router_logits[0].shape[0] // batch.shape[0])
                counts = expert_counts(router_logits, top_k, rows)
                expert_totals = counts if expert_totals is None else expert_totals + counts
            for key, probs in _other_router_probs(output).items():
                other[key] = probs if key not in other else [o + p for o, p in zip(other[key], probs)]
    nll, tokens, batches = (accelerator.reduce(t, "sum") for t in (nll, tokens, batches))
    eval_loss = (nll / tokens).item()
    record = {"step": step, "eval_loss": eval_loss, "eval_ppl": math.exp(min(eval_loss, 50.0))}
    for key in sorted(aux_sums):
        record[f"eval_{key}"] = (accelerator.reduce(aux_sums[key], "sum") / batches).item()
    if expert_totals is not None:
        fractions = [(c / c.sum()).tolist() for c in accelerator.reduce(expert_totals, "sum")]
        record["expert_load"] = [[round(x, 5) for x in layer] for layer in fractions]
        record.update({f"expert_load_{k}": v for k, v in load_summary(fractions).items()})
    for key, probs in sorted(other.items()):
        fractions = [accelerator.reduce(p, "sum") for p in probs]
        name = key[: -len("router_logits")].rstrip("_") or key
        record[f"{name}_load"] = [[round(x, 5) for x in (p / p.sum()).tolist()] for p in fractions]
    return record


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
