"""`mhmoe-convert`'s own arguments, and the continue-tuning flags it takes from mhmoe-train (its `TrainArguments` with
the recipe's defaults, `_continue_tune_arguments_class`). Importing this module imports neither torch nor Transformers:
the command line parses its arguments before those."""

from __future__ import annotations

import dataclasses
import functools
import typing
from dataclasses import dataclass, field

from .calibrate import CALIBRATION_TOKENS, DEFAULT_RECIPE, HEAD_BUDGETS, RECIPES, SHARED_CHOICES
from .options import SPEED_NEW_TOKENS, SPEED_ROUNDS, SPEED_TOKENS
from .recipe import ACTIVE_HEADS_RATIO, AUX_LOSS_COEF, CONTINUE_TUNING_DEFAULTS, SHARED_HEADS_RATIO
from .routers import ROUTERS, router_help


class Ratio(float):
    """A fraction on the command line: a decimal (0.75) or a quotient (7/9)."""

    def __new__(cls, value):
        if isinstance(value, str) and "/" in value:
            from fractions import Fraction

            try:
                value = float(Fraction(value.strip()))
            except (ValueError, ZeroDivisionError):
                raise ValueError(f"not a fraction: {value!r}") from None
        return super().__new__(cls, value)


@dataclass
class ConvertArguments:
    """The conversion (`convert_llama_to_moh.py` also takes every continue-tuning flag of mhmoe-train)."""

    input_dir: str = field(default=None, metadata={"help": "Dense llama / mistral / qwen2 checkpoint (safetensors)."})
    output_dir: str = field(
        default=None,
        metadata={
            "help": "Where the moh_llama checkpoint goes. With --train_file or --dataset: the continue-tuned model, metrics, "
            "checkpoints and recovery curve; the converted (untuned) model is in OUTPUT_DIR/converted."
        },
    )
    shared_heads_ratio: Ratio = field(
        default=SHARED_HEADS_RATIO,
        metadata={
            "help": "Fraction of each layer's heads that are shared (always on), e.g. 0.5 or 1/3; which heads: "
            "--shared_heads_by (the recipe's choice by default)."
        },
    )
    active_heads_ratio: Ratio = field(
        default=ACTIVE_HEADS_RATIO,
        metadata={"help": "Fraction of ALL heads active per token (shared + routed), e.g. 0.75 or 7/9."},
    )
    shared_heads: str | None = field(
        default=None,
        metadata={"help": "Shared heads per layer as a count, e.g. 3 (of 9), instead of --shared_heads_ratio."},
    )
    active_heads: int | None = field(
        default=None,
        metadata={
            "help": "Heads active per token per layer as a count (shared + routed), e.g. 7 (of 9), instead of "
            "--active_heads_ratio."
        },
    )
    moh_aux_loss_coef: float = field(
        default=AUX_LOSS_COEF, metadata={"help": "β of the MoH load-balance loss (eq. 7)."}
    )
    overwrite: bool = field(default=False, metadata={"help": "Replace a non-empty --output_dir."})
    skip_logit_check: bool = field(
        default=False,
        metadata={
            "help": "Skip loading source and converted model to compare logits (for models too large for this "
            "machine's memory); names, dtypes and shapes are still checked."
        },
    )
    probe_file: str | None = field(default=None, metadata={"help": "Text for the probe batch of the logit check."})
    base_model: str | None = field(
        default=None,
        metadata={
            "help": "The source's Hugging Face Hub id (ORG/NAME), which the model card's base_model and "
            "moh_conversion.json name it by. Default: the repo id of a Hugging Face cache snapshot, or a Hub id in "
            "the source's config.json (_name_or_path); else the --gguf_file name, else none (a local folder's "
            "name or path is never published)."
        },
    )
    gguf_file: str | None = field(
        default=None,
        metadata={
            "help": "Convert this GGUF file inside --input_dir (LLaMA family; dequantised to float32 through "
            "Transformers' GGUF support; needs pip install 'mhmoe[gguf]')."
        },
    )
    recipe: str = field(
        default=DEFAULT_RECIPE,
        metadata={
            "help": "How shared heads and the routed-head score are chosen: 'paper' (first heads shared, l2 "
            "router, weights copied as they are), 'calibrated' (the heads that contribute most on "
            "--calibration_file shared, heads permuted within their key/value groups; l2_relative "
            "router: query norm over its calibration mean), 'fitted' (the same shared heads; the paper's learned "
            "router with its weights fitted on --calibration_file: a ridge regression of each head's log "
            "contribution on the attention input) or 'auto' (fitted when the source has a tokenizer, else "
            "paper).",
            "choices": ["auto", *RECIPES],
        },
    )
    shared_heads_by: str | None = field(
        default=None,
        metadata={
            "help": "Override the recipe's choice of shared heads: 'first' (the paper) or 'importance' (the "
            "heads that contribute most on calibration text).",
            "choices": list(SHARED_CHOICES),
        },
    )
    moh_router: str | None = field(
        default=None,
        metadata={
            "help": f"Override the recipe's routed-head score: {router_help()}.",
            "choices": list(ROUTERS),
        },
    )
    head_budget: str = field(
        default="uniform",
        metadata={
            "help": "Routed heads active per token in each layer: 'uniform' (the same in every layer) or "
            "'calibrated' (measured on --calibration_file: layers whose restriction changes the model's predictions "
            "more get more heads, the same total, each layer within 1 and its routed heads; recorded in config.json) or "
            "'threshold' (the calibrated budgets as each layer's average: a token takes the routed heads whose score "
            "exceeds the layer's threshold, set on the calibration text).",
            "choices": list(HEAD_BUDGETS),
        },
    )
    calibration_file: str | None = field(
        default=None,
        metadata={
            "help": "Calibration text (plain text, or JSONL with a 'text' field) for calibrated recipes, which read "
            "its first --calibration_tokens tokens; the next tokens (up to 4,096, at least a quarter of a short "
            "text) are held out for the held-out perplexity against the parent in the report, moh_conversion.json "
            "and the card. Default: Python's own documentation (pydoc_data.topics)."
        },
    )
    calibration_tokens: int = field(
        default=CALIBRATION_TOKENS,
        metadata={"help": "Tokens of calibration text used (blocks of 256; fewer when the text is short)."},
    )
    trust_remote_code: bool = field(
        default=False,
        metadata={
            "help": "Let Transformers run the Python code the source's tokenizer names in its auto_map (for "
            "calibration and the logit check; only for folders you trust). Off: such a tokenizer is "
            "refused. The code is never copied into the output."
        },
    )
    measure_speed: bool = field(
        default=False,
        metadata={
            "help": "After the conversion is verified, time it against its parent on this machine (prefill of "
            "--speed_tokens tokens, greedy decoding of --speed_new_tokens after them, interleaved rounds) and state "
            "the speed ratios in moh_conversion.json and the card. Costs both models in memory at once and, for a "
            "135M model on 2 CPU threads, about a minute; the figures are this machine's and noisy "
            "(benchmarks/moh_head_sparse.py is the repeatable benchmark)."
        },
    )
    speed_tokens: int = field(
        default=SPEED_TOKENS,
        metadata={"help": "--measure_speed: prompt tokens (capped by the calibration text and the model's positions)."},
    )
    speed_new_tokens: int = field(
        default=SPEED_NEW_TOKENS, metadata={"help": "--measure_speed: greedy tokens decoded."}
    )
    speed_rounds: int = field(
        default=SPEED_ROUNDS,
        metadata={"help": "--measure_speed: rounds per cell (more for prefills under 5 s a model, up to 5×)."},
    )
    distill: bool = field(
        default=False,
        metadata={
            "help": "Continue-tune against the dense parent's logits (KL at --distill_temperature mixed with "
            "the LM loss by --distill_weight); the parent is a frozen copy on the same device."
        },
    )
    distill_temperature: float = field(default=2.0, metadata={"help": "Temperature T of the distillation KL."})
    distill_weight: float = field(
        default=0.5, metadata={"help": "loss = weight × T² × KL(parent || model) + (1 − weight) × LM loss."}
    )

    def head_counts(self) -> tuple[int | None, str | None]:
        """(--shared_heads as a count, the shared-head choice): `--shared_heads first|importance`, its earlier
        meaning, is still taken as --shared_heads_by (with a note)."""
        from .errors import ConversionError

        value, choice = self.shared_heads, self.shared_heads_by
        if value is None or str(value).isdigit():
            return (None if value is None else int(value)), choice
        if value in SHARED_CHOICES and choice in (None, value):
            import sys

            print(
                f"mhmoe-convert: note: --shared_heads {value} is now --shared_heads_by {value} (--shared_heads "
                "counts the shared heads)",
                file=sys.stderr,
            )
            return None, value
        raise ConversionError(
            f"--shared_heads {value!r}: give a number of heads (e.g. --shared_heads 3); which heads "
            f"are shared is --shared_heads_by ({', '.join(SHARED_CHOICES)})"
        )

    def conversion_options(self) -> dict:
        """The keyword arguments of `convert` these arguments give (besides input and output folders)."""
        from .calibrate import head_recipe
        from .options import SpeedSettings
        from .verify import read_probe

        shared_heads, shared_heads_by = self.head_counts()
        speed = SpeedSettings(self.speed_tokens, self.speed_new_tokens, self.speed_rounds)  # checked even when off
        return dict(
            shared_heads_ratio=self.shared_heads_ratio,
            active_heads_ratio=self.active_heads_ratio,
            shared_heads=shared_heads,
            active_heads=self.active_heads,
            overwrite=self.overwrite,
            verify_logits=not self.skip_logit_check,
            probe_text=read_probe(self.probe_file),
            moh_aux_loss_coef=self.moh_aux_loss_coef,
            gguf_file=self.gguf_file,
            recipe=head_recipe(self.recipe, shared_heads_by, self.moh_router),
            calibration_file=self.calibration_file,
            calibration_tokens=self.calibration_tokens,
            base_model=self.base_model,
            trust_remote_code=self.trust_remote_code,
            head_budget=self.head_budget,
            speed=speed if self.measure_speed else None,
        )


_NOT_CONTINUE_TUNING = (
    "model_name_or_path",
    "output_dir",
    "overwrite_output_dir",
    "config_overrides",
    "tokenizer_vocab_size",
    "trust_remote_code",
)


@functools.cache
def _continue_tune_arguments_class():
    """mhmoe-train's TrainArguments without the model/output fields (set by the converter), paper defaults; built on
    first use (it imports mhmoe.training)."""
    from ..training.arguments import TrainArguments

    hints = typing.get_type_hints(TrainArguments)
    fields = []
    for f in dataclasses.fields(TrainArguments):
        if f.name in _NOT_CONTINUE_TUNING:
            continue
        default = CONTINUE_TUNING_DEFAULTS.get(f.name, f.default)
        fields.append((f.name, hints[f.name], field(default=default, metadata=f.metadata)))
    return dataclasses.make_dataclass("ContinueTuneArguments", fields)


__all__ = ["ConvertArguments"]
