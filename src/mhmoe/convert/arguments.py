"""`mhmoe-convert`'s own arguments, and the continue-tuning flags it takes from mhmoe-train (its `TrainArguments` with
the recipe's defaults, `_continue_tune_arguments_class`). Importing this module imports neither torch nor Transformers:
the command line parses its arguments before those."""

from __future__ import annotations

import dataclasses
import functools
import typing
from dataclasses import dataclass, field

from .recipe import ACTIVE_HEADS_RATIO, AUX_LOSS_COEF, CONTINUE_TUNING_DEFAULTS, SHARED_HEADS_RATIO


@dataclass
class ConvertArguments:
    """The conversion (`convert_llama_to_moh.py` also takes every continue-tuning flag of mhmoe-train)."""

    input_dir: str = field(default=None, metadata={"help": "Dense llama / mistral / qwen2 checkpoint (safetensors)."})
    output_dir: str = field(
        default=None,
        metadata={"help": "Where the moh_llama checkpoint goes. With --train_file: the continue-tuned model, metrics, "
                          "checkpoints and recovery curve; the converted (untuned) model is in OUTPUT_DIR/converted."},
    )
    shared_heads_ratio: float = field(
        default=SHARED_HEADS_RATIO, metadata={"help": "Fraction of heads shared (the first ones)."}
    )
    active_heads_ratio: float = field(
        default=ACTIVE_HEADS_RATIO,
        metadata={"help": "Fraction of ALL heads active per token (shared + routed), e.g. 0.75."},
    )
    moh_aux_loss_coef: float = field(
        default=AUX_LOSS_COEF, metadata={"help": "β of the MoH load-balance loss (eq. 7)."}
    )
    overwrite: bool = field(default=False, metadata={"help": "Replace a non-empty --output_dir."})
    skip_logit_check: bool = field(
        default=False,
        metadata={"help": "Skip loading source and converted model to compare logits (for models too large for this "
                          "machine's memory); names, dtypes and shapes are still checked."},
    )
    probe_file: str | None = field(default=None, metadata={"help": "Text for the probe batch of the logit check."})


_NOT_CONTINUE_TUNING = ("model_name_or_path", "output_dir", "overwrite_output_dir", "config_overrides",
                        "tokenizer_vocab_size")  # fmt: skip


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
