"""Deprecated: the converter is the package `mhmoe.convert` (one module per stage; `mhmoe-convert` is
`mhmoe.convert.cli:main`). This module re-exports its public names for one release."""

import sys
import warnings

from .convert import (  # noqa: F401
    CONTINUE_TUNING_DEFAULTS, CONVERTED_SUBDIR, DROPPED_TENSOR_SUFFIXES, FLOAT_DTYPES, RECORD_NAME, RECOVERY_CSV,
    RECOVERY_PNG, SOURCE_MODEL_TYPES, ConversionError, ConversionPlan, ConversionReport, ConvertArguments, ShardPlan,
    TensorEntry, all_heads_active, build_parser, continue_tune_arguments, convert, convert_and_continue_tune,
    format_recovery, head_split, main, plan_conversion, recovery_curve, verify_conversion,
)

warnings.warn(
    "mhmoe.conversion is deprecated and will be removed in the next release: import from mhmoe.convert",
    DeprecationWarning,
    stacklevel=2,
)

if __name__ == "__main__":
    main(sys.argv[1:])
