"""mhmoe-train's arguments, their checks (values, data files) and the model config they name. Each problem raises
`TrainingError` with the fix in words; the output folder and the checkpoint to resume are checked in `outputs.py` and
`checkpoints.py`."""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re
from dataclasses import dataclass, field

# Light on purpose: the command line parses these arguments before torch and Transformers are imported (cli.py).


class TrainingError(ValueError):
    """A problem with the arguments, the model or the data, found before training starts."""


class TrainingStopped(TrainingError):
    """Training started and was stopped (e.g. by repeated non-finite losses); what it saved so far stays."""


@dataclass
class TrainArguments:
    """Arguments of `mhmoe-train` (each field is a `--flag`)."""

    model_name_or_path: str = field(
        default=None,
        metadata={"help": "A checkpoint directory (fine-tune; from_pretrained) or a config JSON (train from scratch)."},
    )
    output_dir: str = field(default=None, metadata={"help": "Where checkpoints, metrics and the final model go."})
    train_file: list[str] = field(
        default=None,
        metadata={
            "help": "Training text (.txt: one document per file) or JSONL (.jsonl/.json: one document per record)."
        },
    )
    validation_file: list[str] | None = field(default=None, metadata={"help": "Validation text/JSONL file(s)."})
    dataset: str | None = field(
        default=None,
        metadata={
            "help": "Instead of --train_file: any source the `datasets` library reads: a data file (json, jsonl, csv, "
            "parquet, arrow, txt), a folder of them, a save_to_disk folder or a Hub dataset name. Records are "
            "'text' (language modelling), 'messages' (chat) or 'prompt' + 'completion' (training/formats.py)."
        },
    )
    dataset_config: str | None = field(default=None, metadata={"help": "The --dataset's configuration name."})
    dataset_split: str = field(default="train", metadata={"help": "The --dataset split to train on."})
    validation_split: str | None = field(
        default=None,
        metadata={
            "help": "With --dataset: a split name (e.g. validation), or a percentage held out of the training "
            "examples (e.g. 5%%)."
        },
    )
    streaming: bool = field(
        default=False,
        metadata={
            "help": "Read --dataset as a stream (larger than memory): tokenised on the fly, split across processes, "
            "resumed at the next example. Needs --max_steps."
        },
    )
    max_eval_samples: int | None = field(
        default=None,
        metadata={"help": "Validate on at most this many examples (default: all; 1000 with --streaming)."},
    )
    chat_template: str | None = field(
        default=None, metadata={"help": "A Jinja chat template file, used instead of the tokenizer's (and saved)."}
    )
    loss_on_prompt: bool = field(
        default=False,
        metadata={
            "help": "Chat and prompt-completion data: train on every token, not only the assistant's / completion's."
        },
    )
    packing: bool = field(
        default=True,
        metadata={
            "help": "Chat and prompt-completion data: pack several examples per row, kept apart (per-example "
            "position_ids, no attention across them); false: one example per row, padded per batch."
        },
    )
    validation_split_percentage: float = field(
        default=0.0, metadata={"help": "Without --validation_file: hold out this %% of the training blocks."}
    )
    text_field: str = field(default="text", metadata={"help": "JSONL field holding the text."})
    tokenizer_name_or_path: str | None = field(
        default=None,
        metadata={
            "help": "Tokenizer directory. Default: the checkpoint's; for a config JSON, a byte-level BPE "
            "tokenizer trained on the training data (saved with the model)."
        },
    )
    trust_remote_code: bool = field(
        default=False,
        metadata={
            "help": "Let Transformers run the Python code a tokenizer folder names in its auto_map (only for "
            "folders you trust; off: such a tokenizer is refused). The model's code is always mhmoe's or "
            "Transformers' own."
        },
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
        metadata={
            "help": "Final learning rate of the cosine schedule (cosine decays to it instead of 0; e.g. the MoH "
            "paper's continue-tuning: 2e-5 -> 1e-6)."
        },
    )
    warmup_steps: int = 0
    warmup_ratio: float = field(default=0.0, metadata={"help": "Warmup as a fraction of the steps (if no steps)."})
    max_grad_norm: float = field(default=1.0, metadata={"help": "Gradient clipping (0: off)."})
    mixed_precision: str | None = field(
        default=None,
        metadata={
            "help": "no, bf16 or fp16 (default: Accelerate's config / environment, else no).",
            "choices": ["no", "bf16", "fp16"],
        },
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
        default=None,
        metadata={
            "help": "A checkpoint-N directory, or 'latest' (the newest one in --output_dir whose "
            "files match its manifest; damaged newer ones are skipped and named)."
        },
    )
    resume_without_rng_state: bool = field(
        default=False,
        metadata={
            "help": "Resume even if the checkpoint's RNG state files do not load (random draws "
            "such as router jitter then differ from the interrupted run)."
        },
    )
    max_nonfinite_steps: int = field(
        default=3,
        metadata={"help": "Stop with an error after this many steps in a row with a NaN/inf loss (0: never)."},
    )
    overwrite_output_dir: bool = field(
        default=False,
        metadata={
            "help": "Start afresh in an output_dir that holds checkpoints or a finished run (deletes them once "
            "every input is checked)."
        },
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
    lora_routers: bool = field(
        default=True,
        metadata={"help": "Train MoH head routers with parameters (learned, fitted) in full beside the adapters."},
    )
    merge_lora: bool = field(default=False, metadata={"help": "Also save the merged model in output_dir/merged."})
    ddp_find_unused_parameters: bool = False
    disable_tqdm: bool = False
    report_to: str = field(
        default="none",
        metadata={
            "help": "Experiment trackers, through Accelerate: tensorboard, wandb, trackio, mlflow, a comma-separated "
            "list, all (those installed) or none. Offline by default (wandb offline, mlflow and trackio in output_dir). "
            "metrics.jsonl is always written."
        },
    )
    run_name: str | None = field(
        default=None, metadata={"help": "The run's name in the trackers (default: output_dir's)."}
    )
    peak_tflops: float | None = field(
        default=None,
        metadata={
            "help": "The device's peak TFLOP/s for the logged MFU (default: a table of common GPUs; none on CPU, so no "
            "MFU there unless given)."
        },
    )
    plot: bool = field(default=True, metadata={"help": "Write loss_curve.png (matplotlib)."})
    similarity_batching: bool = field(
        default=False,
        metadata={
            "help": "Order training documents so neighbours are "
            "similar before packing (Lory's batching; mhmoe.training.data.order_by_similarity)."
        },
    )


# --------------------------------------------------------------------------------------------------------------------
# checks that run before anything is trained


# Dense models of the LLaMA family: the parents that mhmoe.convert turns into MoH (the MoH paper's first stage
# continue-tunes the dense model on the new data before converting it, §4.4).
DENSE_PARENT_TYPES = ("llama", "mistral", "qwen2")


def supported_model_types() -> list[str]:
    """Model types this script trains: mhmoe, moh_llama once it is registered with AutoConfig, and the dense
    LLaMA-family parents (llama, mistral, qwen2)."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    return [t for t in ("mhmoe", "moh_llama", *DENSE_PARENT_TYPES) if t in CONFIG_MAPPING]


def check_required(args: TrainArguments, model_given: bool = False) -> None:
    names = ("output_dir",) if model_given else ("model_name_or_path", "output_dir")
    missing = [f"--{name}" for name in names if not getattr(args, name)]
    if not args.train_file and not args.dataset:
        missing.append("--train_file (or --dataset)")
    if missing:
        raise TrainingError(
            f"{', '.join(missing)} {'is' if len(missing) == 1 else 'are'} required (see mhmoe-train --help)"
        )


FLOAT_ARGUMENTS = (
    "learning_rate",
    "min_learning_rate",
    "weight_decay",
    "adam_beta1",
    "adam_beta2",
    "adam_epsilon",
    "max_grad_norm",
    "warmup_ratio",
    "num_train_epochs",
    "validation_split_percentage",
    "lora_dropout",
)


def _check_sizes(args: TrainArguments) -> None:
    """Counts, sizes and ranges: batch sizes, steps, block size, rates, shares."""
    positive = (
        "per_device_train_batch_size",
        "per_device_eval_batch_size",
        "gradient_accumulation_steps",
        "logging_steps",
        "lora_r",
    )
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


def check_arguments(args: TrainArguments, model_given: bool = False) -> None:
    check_required(args, model_given)
    not_finite = [
        f"--{name} {getattr(args, name)}" for name in FLOAT_ARGUMENTS if not math.isfinite(getattr(args, name))
    ]
    if not_finite:  # NaN passes every comparison below (nan <= 0 is False) and would train on NaN
        raise TrainingError(f"{', '.join(not_finite)}: must be a finite number")
    if not 0 <= args.seed < 2**32:  # what numpy's seed (set_seed) takes
        raise TrainingError(f"--seed {args.seed}: must be in [0, 2**32 - 1] (numpy's seed range)")
    for name in ("adam_beta1", "adam_beta2"):
        if not 0 <= getattr(args, name) < 1:
            raise TrainingError(f"--{name} {getattr(args, name)}: must be in [0, 1)")
    for name in ("adam_epsilon", "weight_decay"):
        if getattr(args, name) < 0:
            raise TrainingError(f"--{name} {getattr(args, name)}: must be >= 0")
    if args.merge_lora and not args.lora:
        raise TrainingError(
            "--merge_lora merges the LoRA adapters into the model: give --lora too (or leave --merge_lora out)"
        )
    if args.max_steps > 0 and args.warmup_steps > args.max_steps:
        raise TrainingError(
            f"--warmup_steps {args.warmup_steps} is more than the run's --max_steps {args.max_steps}: "
            f"the learning rate would never reach --learning_rate; give at most {args.max_steps} "
            "(or --warmup_ratio)"
        )
    if args.max_nonfinite_steps < 0:
        raise TrainingError(f"--max_nonfinite_steps must be >= 0 (0: never stop), got {args.max_nonfinite_steps}")
    if isinstance(args.train_file, str):
        args.train_file = [args.train_file]
    if isinstance(args.validation_file, str):
        args.validation_file = [args.validation_file]
    if isinstance(args.lora_target_modules, str):
        args.lora_target_modules = [args.lora_target_modules]
    _check_sizes(args)
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
    check_data_arguments(args)
    for path in [*(args.train_file or []), *(args.validation_file or [])]:
        if not os.path.isfile(path):
            raise TrainingError(f"data file not found: {path}")
    if not model_given and not os.path.exists(args.model_name_or_path):
        raise TrainingError(
            f"--model_name_or_path {args.model_name_or_path!r} does not exist (give a local checkpoint directory or a "
            "config JSON; nothing is downloaded)"
        )
    if args.tokenizer_name_or_path is not None and not os.path.isdir(args.tokenizer_name_or_path):
        raise TrainingError(f"--tokenizer_name_or_path {args.tokenizer_name_or_path!r} is not a directory")
    from .._plumbing.trust import check_links

    if not model_given:
        check_links(args.model_name_or_path, TrainingError, "--model_name_or_path")
    if args.tokenizer_name_or_path is not None:
        check_links(args.tokenizer_name_or_path, TrainingError, "--tokenizer_name_or_path")


TRACKERS = ("tensorboard", "wandb", "trackio", "mlflow")
_PERCENT = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*%\s*$")


def validation_percentage(split: str | None) -> float | None:
    """ "5%" -> 5.0; a split name -> None."""
    match = _PERCENT.match(split or "")
    if not match:
        return None
    value = float(match.group(1))
    if not 0 < value < 100:
        raise TrainingError(f"--validation_split {split!r}: a percentage must be above 0% and below 100%")
    return value


def report_to(args: TrainArguments) -> list[str]:
    """--report_to as a list of tracker names ("all": those installed; "none": [])."""
    names = [n.strip().lower() for n in (args.report_to or "none").split(",") if n.strip()]
    if names in (["none"], []):
        return []
    if names == ["all"]:
        import importlib.util

        return [n for n in TRACKERS if importlib.util.find_spec(n) is not None]
    unknown = [n for n in names if n not in TRACKERS]
    if unknown:
        raise TrainingError(
            f"--report_to {args.report_to!r}: unknown tracker {', '.join(unknown)} (one or more of "
            f"{', '.join(TRACKERS)}, comma-separated; all; or none)"
        )
    return names


def check_data_arguments(args: TrainArguments) -> None:
    """The data flags fit together: --train_file or --dataset, the flags each takes, streaming's needs."""
    if args.train_file and args.dataset:
        raise TrainingError("give --dataset or --train_file, not both")
    if args.dataset:
        if args.validation_file or args.validation_split_percentage:
            raise TrainingError(
                "with --dataset, the validation data is --validation_split (a split name, or a percentage such as 5%), "
                "not --validation_file / --validation_split_percentage"
            )
        if args.similarity_batching:
            raise TrainingError("--similarity_batching orders --train_file documents; it does not apply to --dataset")
    else:
        given = [f"--{n}" for n in ("dataset_config", "validation_split", "chat_template") if getattr(args, n)]
        given += ["--streaming"] if args.streaming else []
        if given:
            raise TrainingError(f"{', '.join(given)} apply to --dataset; --train_file reads plain text and JSONL text")
    if args.streaming and args.max_steps <= 0:
        raise TrainingError("--streaming needs --max_steps (a stream's length is not known before it is read)")
    if args.max_eval_samples is not None and args.max_eval_samples < 1:
        raise TrainingError(f"--max_eval_samples must be >= 1, got {args.max_eval_samples}")
    if args.peak_tflops is not None and not (math.isfinite(args.peak_tflops) and args.peak_tflops > 0):
        raise TrainingError(
            f"--peak_tflops must be a positive number (the device's peak TFLOP/s), got {args.peak_tflops}"
        )
    if args.chat_template is not None and not os.path.isfile(args.chat_template):
        raise TrainingError(f"--chat_template {args.chat_template}: no such file (a Jinja template file)")
    if args.validation_split:
        validation_percentage(args.validation_split)  # a bad percentage fails here
    report_to(args)


def _read(paths: list[str], text_field: str) -> list[str]:
    from .data import read_files  # imports torch: not at module level, so that command lines parse first

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
# the model config


def load_config(args: TrainArguments):
    """(config, from_scratch). Refuses unknown model types with the list of supported ones, unknown config keys by
    name, values of the wrong type and invalid combinations in one line each, and damaged weight files."""
    from transformers import AutoConfig

    from .._plumbing.checkpoint_files import read_model_type
    from .._plumbing.trust import load_config as load_pretrained_config
    from .._plumbing.trust import pinned

    path = args.model_name_or_path
    from_scratch = os.path.isfile(path)
    if from_scratch:
        try:
            with open(path) as f:
                fields = json.load(f)
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise TrainingError(f"{path}: not a valid config JSON ({e})") from None
        if not isinstance(fields, dict):
            raise TrainingError(f"{path}: a config JSON is an object of config fields, not a {type(fields).__name__}")
        model_type = fields.pop("model_type", None)
    else:
        config_file = os.path.join(path, "config.json")
        if not os.path.isfile(config_file):
            raise TrainingError(f"{path} is not a checkpoint directory (no config.json)")
        with pinned(path, TrainingError, "--model_name_or_path") as source:  # its files as checked, never a link out
            model_type = read_model_type(os.path.join(source.path, "config.json"), TrainingError)
            _check_weight_files(source.path)
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
    if from_scratch:  # rope_theta: the legacy key (Llama's config.json) Transformers moves into rope_parameters
        unknown = sorted(key for key in fields if not hasattr(template, key) and key != "rope_theta")
        if unknown:
            raise TrainingError(
                f"{path}: {_unknown_keys(unknown, template)} not a {model_type} config field; fix the "
                "name or remove it (a config keeps unknown keys silently and trains with the default)"
            )
    try:
        if from_scratch:
            config = AutoConfig.for_model(model_type, **{**fields, **overrides})
        else:  # mhmoe's own classes
            config = load_pretrained_config(path, TrainingError, trust_remote_code=False, **overrides)
    except Exception as e:  # ValueError/TypeError, huggingface_hub's StrictDataclass*Error (not ValueErrors)
        if isinstance(e, TrainingError):
            raise
        if not isinstance(e, (TypeError, ValueError)) and type(e).__module__.split(".")[0] != "huggingface_hub":
            raise
        where = f"{path} with --config_overrides" if overrides else path
        raise TrainingError(f"invalid config {where}: {_one_line(e)}") from None
    return config, from_scratch


def _unknown_keys(keys: list[str], template) -> str:
    import difflib

    fields = [f.name for f in dataclasses.fields(template)] if dataclasses.is_dataclass(template) else []
    named = []
    for key in keys:
        close = difflib.get_close_matches(key, fields, n=1, cutoff=0.8)
        named.append(f"{key!r}" + (f" (did you mean {close[0]!r}?)" if close else ""))
    return ", ".join(named) + (" is" if len(keys) == 1 else " are")


def _one_line(error: Exception) -> str:
    """An exception's message on one line (huggingface_hub's validation errors span several, with the cause last)."""
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    cause = getattr(error, "__cause__", None)
    if cause is not None and str(cause).strip() and str(cause).strip() not in " ".join(lines):
        lines.append(str(cause).strip().splitlines()[0])
    return " ".join(lines) or type(error).__name__


def _check_weight_files(path: str) -> None:
    """Each safetensors file reads back whole (a truncated or empty download would fail deep inside from_pretrained)."""
    from .._plumbing.checkpoint_files import check_weight_files

    try:
        check_weight_files(path, TrainingError)  # safetensors only; pickles are refused, never unpickled
    except TrainingError as e:
        raise TrainingError(f"--model_name_or_path: {e}") from None


PATH_ARGUMENTS = (
    "model_name_or_path",
    "output_dir",
    "train_file",
    "validation_file",
    "dataset",
    "chat_template",
    "tokenizer_name_or_path",
    "resume_from_checkpoint",
)


def recorded_args(args: TrainArguments) -> dict:
    """The arguments as the run's records keep them (train_state.json, train_summary.json): a path inside the output
    folder relative to it, any other path by its name only; never a machine's local path."""
    values = dataclasses.asdict(args)
    output_dir = os.path.abspath(args.output_dir)

    def public(path):
        if not isinstance(path, str) or path == "latest":
            return path
        full = os.path.abspath(path)
        if full == output_dir or full.startswith(output_dir + os.sep):
            return os.path.relpath(full, output_dir)
        return os.path.basename(full)

    for key in PATH_ARGUMENTS:
        value = values[key]
        if key == "dataset" and value and not os.path.exists(value):
            continue  # a Hub dataset name, kept whole
        values[key] = [public(p) for p in value] if isinstance(value, list) else public(value)
    return values


def _coerce_args(args) -> TrainArguments:
    """`args` (TrainArguments, a dict or a Namespace of its fields) as a new TrainArguments; unknown names raise
    `TrainingError`, values of the wrong type `TypeError`, each in one line."""
    if isinstance(args, TrainArguments):
        args = dataclasses.replace(args)
        _check_types({f.name: getattr(args, f.name) for f in dataclasses.fields(TrainArguments)})
        return args
    if not isinstance(args, dict):
        args = vars(args)
    names = {f.name for f in dataclasses.fields(TrainArguments)}
    unknown = sorted(set(args) - names)
    if unknown:
        raise TrainingError(f"unknown training arguments: {', '.join(unknown)}")
    _check_types(args)
    return TrainArguments(**args)


_TYPE_WORDS = {int: "an integer", float: "a number", bool: "true or false", str: "a string"}


def _check_types(values: dict) -> None:
    """Each value has its field's type (an int for an int, a number for a float, ...; None where the default is
    None): `train({"max_steps": "2"})` is refused in one line instead of failing later with another error."""
    import types
    import typing

    hints = typing.get_type_hints(TrainArguments)
    defaults = {f.name: f.default for f in dataclasses.fields(TrainArguments)}
    for name, value in values.items():
        hint = hints[name]
        options = typing.get_args(hint) if typing.get_origin(hint) in (typing.Union, types.UnionType) else (hint,)
        if value is None and (type(None) in options or defaults[name] is None):
            continue
        for option in options:
            if typing.get_origin(option) is list:
                if isinstance(value, str) or (isinstance(value, list) and all(isinstance(v, str) for v in value)):
                    break
            elif option is float and isinstance(value, (int, float)) and not isinstance(value, bool):
                break
            elif option is int and isinstance(value, int) and not isinstance(value, bool):
                break
            elif option in (bool, str) and isinstance(value, option):
                break
        else:
            wanted = " or ".join(
                _TYPE_WORDS.get(o, "a list of strings" if typing.get_origin(o) is list else "None") for o in options
            )
            raise TypeError(f"training argument {name}={value!r}: must be {wanted}, not {type(value).__name__}")


__all__ = [
    "DENSE_PARENT_TYPES",
    "TrainArguments",
    "TrainingError",
    "TrainingStopped",
    "check_arguments",
    "check_data_arguments",
    "check_required",
    "report_to",
    "load_config",
    "recorded_args",
    "supported_model_types",
    "validation_percentage",
]
