"""Convert a dense LLaMA-family checkpoint into MoH-LLaMA, and continue-tune it (the MoH paper's §4.4 / App. B.2).

One module per stage:

* conversion.py     `convert`: the pipeline read → plan → choose heads → write → verify → record, and its report
* options.py        `ConvertOptions` (convert's keyword arguments, checked) and `SpeedSettings` (--measure_speed)
* recipe.py         the paper's recipe, every default once: head split ratios, l2 router, straight-through gates,
                    balance-loss β, continue-tuning optimizer and schedule; `head_split`
* source.py         the reader step: the input folder, or a GGUF file dequantised into a temporary folder (gguf.py)
* plan.py           reading and checking the source checkpoint (config, index, shard headers) into a ConversionPlan
* calibrate.py      `choose_heads`: heads measured on calibration text, the shared heads, router and head budgets
                    chosen (routers.py: the converter's routers and shared-head choices, one table each; heads.py,
                    head_budget.py)
* write.py          shards streamed byte for byte into a temporary folder, checked, renamed at the end
* verify.py         the converted model with every head active must give the source's logits (heldout.py: the
                    held-out perplexity)
* continue_tune.py  continue-tuning through mhmoe.training, and the recovery curve (paper Fig. 2)
* arguments.py      `ConvertArguments`, the converter's own flags, and the continue-tuning flags taken from mhmoe-train
* cli.py            `mhmoe-convert` / `python -m mhmoe.convert` / conversion/convert_llama_to_moh.py: `main`

Elsewhere: `--measure_speed`'s timing is `mhmoe.evaluation.conversion_speed`, the end-to-end recovery demo (a dense
parent trained here, converted, continue-tuned, compared) `mhmoe.recovery_demo`.

`convert(input_dir, output_dir)` turns a Transformers checkpoint of model_type llama, mistral or qwen2 (safetensors,
one file or shards + index) into a `moh_llama` checkpoint; `convert_and_continue_tune(args, tune)` also trains it. The
names below load with their module on first use.
"""

from typing import TYPE_CHECKING

from .._plumbing.lazy import lazy_exports

_EXPORTS = {
    "ConvertArguments": ".arguments",
    **dict.fromkeys(("build_parser", "main"), ".cli"),
    **dict.fromkeys(
        (
            "CONVERTED_SUBDIR",
            "RECOVERY_CSV",
            "RECOVERY_PNG",
            "continue_tune_arguments",
            "convert_and_continue_tune",
            "format_recovery",
            "recovery_curve",
        ),
        ".continue_tune",
    ),
    "ConversionError": ".errors",
    **dict.fromkeys(
        (
            "DROPPED_TENSOR_SUFFIXES",
            "FLOAT_DTYPES",
            "RECORD_NAME",
            "SOURCE_MODEL_TYPES",
            "ConversionPlan",
            "ShardPlan",
            "TensorEntry",
            "plan_conversion",
        ),
        ".plan",
    ),
    **dict.fromkeys(("CONTINUE_TUNING_DEFAULTS", "head_split"), ".recipe"),
    **dict.fromkeys(("all_heads_active", "verify_conversion"), ".verify"),
    **dict.fromkeys(("ConversionReport", "convert"), ".conversion"),
}
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)

if TYPE_CHECKING:
    from .arguments import ConvertArguments
    from .cli import build_parser, main
    from .continue_tune import (
        CONVERTED_SUBDIR,
        RECOVERY_CSV,
        RECOVERY_PNG,
        continue_tune_arguments,
        convert_and_continue_tune,
        format_recovery,
        recovery_curve,
    )
    from .conversion import ConversionReport, convert
    from .errors import ConversionError
    from .plan import (
        DROPPED_TENSOR_SUFFIXES,
        FLOAT_DTYPES,
        RECORD_NAME,
        SOURCE_MODEL_TYPES,
        ConversionPlan,
        ShardPlan,
        TensorEntry,
        plan_conversion,
    )
    from .recipe import CONTINUE_TUNING_DEFAULTS, head_split
    from .verify import all_heads_active, verify_conversion

__all__ = [
    "CONTINUE_TUNING_DEFAULTS",
    "CONVERTED_SUBDIR",
    "DROPPED_TENSOR_SUFFIXES",
    "FLOAT_DTYPES",
    "RECORD_NAME",
    "RECOVERY_CSV",
    "RECOVERY_PNG",
    "SOURCE_MODEL_TYPES",
    "ConversionError",
    "ConversionPlan",
    "ConversionReport",
    "ConvertArguments",
    "ShardPlan",
    "TensorEntry",
    "all_heads_active",
    "build_parser",
    "continue_tune_arguments",
    "convert",
    "convert_and_continue_tune",
    "format_recovery",
    "head_split",
    "main",
    "plan_conversion",
    "recovery_curve",
    "verify_conversion",
]
