"""`mhmoe-convert` / conversion/convert_llama_to_moh.py: the arguments and `main()`.

Converts (write.py); with `--train_file` also continue-tunes (continue_tune.py), taking every continue-tuning flag of
mhmoe-train with the recipe's defaults (recipe.py). Works under `accelerate launch` with several processes.
"""

from __future__ import annotations

import os

from .arguments import ConvertArguments
from .continue_tune import _continue_tune_arguments_class, convert_and_continue_tune
from .errors import ConversionError
from .recipe import GATES, ROUTER, continue_tuning_words
from .write import convert


def build_parser():
    from transformers import HfArgumentParser

    return HfArgumentParser(
        (ConvertArguments, _continue_tune_arguments_class()),
        description="Convert a dense LLaMA / Mistral / Qwen2 checkpoint into MoH-LLaMA (Mixture-of-Head attention, "
        f"{ROUTER} router, {GATES} gates); with --train_file, continue-tune it with mhmoe-train (paper stage-2 "
        f"defaults: {continue_tuning_words()}).",
    )


def main(argv: list[str] | None = None) -> None:
    """Console entry point; refusals exit with status 2 and a one-line message, nothing left at --output_dir."""
    from ..training.arguments import TrainingError

    parser = build_parser()
    args, tune = parser.parse_args_into_dataclasses(args=argv)
    try:
        if not args.input_dir or not args.output_dir:
            raise ConversionError("--input_dir and --output_dir are required")
        if tune.train_file:
            convert_and_continue_tune(args, tune, progress=not tune.disable_tqdm)
        else:
            if tune.resume_from_checkpoint:
                raise ConversionError("--resume_from_checkpoint continues a continue-tuning run: give --train_file")
            if int(os.environ.get("RANK", "0")) > 0:  # launched with several processes: one converts
                return
            if args.distill:
                raise ConversionError("--distill continue-tunes: give --train_file")
            report = convert(args.input_dir, args.output_dir, progress=not tune.disable_tqdm,
                             **args.conversion_options())  # fmt: skip
            print(report.format(), flush=True)
    except (ConversionError, TrainingError) as e:
        parser.exit(2, f"{parser.prog}: error: {e}\n")
    import torch

    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


__all__ = ["build_parser", "main"]
