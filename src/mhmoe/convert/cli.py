"""`mhmoe-convert` / `python -m mhmoe.convert` / scripts/convert_llama_to_moh.py: the arguments and `main()`.

Converts (write.py); with `--train_file` also continue-tunes (continue_tune.py), taking every continue-tuning flag of
mhmoe-train with the recipe's defaults (recipe.py). Works under `accelerate launch` with several processes. The
arguments are parsed before torch and Transformers are imported (`mhmoe._plumbing.arguments`), so a usage error or
`--help` prints at once.
"""

from __future__ import annotations

import os

from .._plumbing.arguments import hf_argument_parser, parse_or_exit
from .arguments import ConvertArguments, _continue_tune_arguments_class
from .errors import ConversionError
from .recipe import GATES, ROUTER, continue_tuning_words


def build_parser():
    return hf_argument_parser(
        (ConvertArguments, _continue_tune_arguments_class()),
        prog="mhmoe-convert",
        description="Convert a dense LLaMA / Mistral / Qwen2 checkpoint into MoH-LLaMA (Mixture-of-Head attention, "
        f"{ROUTER} router, {GATES} gates); with --train_file, continue-tune it with mhmoe-train (paper stage-2 "
        f"defaults: {continue_tuning_words()}).",
    )


def main(argv: list[str] | None = None) -> None:
    """Console entry point; refusals exit with status 2 and a one-line message, nothing left at --output_dir."""
    parser = build_parser()
    args, tune = parse_or_exit(parser, argv)
    if not args.input_dir or not args.output_dir:
        parser.error("--input_dir and --output_dir are required")

    from .._plumbing.checkpoint_files import write_error_message
    from ..training.arguments import TrainingError
    from .continue_tune import convert_and_continue_tune
    from .conversion import convert

    try:
        if tune.train_file:
            convert_and_continue_tune(args, tune, progress=not tune.disable_tqdm)
        else:
            if tune.resume_from_checkpoint:
                raise ConversionError("--resume_from_checkpoint continues a continue-tuning run: give --train_file")
            if int(os.environ.get("RANK", "0")) > 0:  # launched with several processes: one converts
                return
            if args.distill:
                raise ConversionError("--distill continue-tunes: give --train_file")
            report = convert(
                args.input_dir, args.output_dir, progress=not tune.disable_tqdm, **args.conversion_options()
            )
            print(report.format(), flush=True)
    except (ConversionError, TrainingError) as e:
        parser.exit(2, f"{parser.prog}: error: {e}\n")
    except Exception as e:  # full disk, file size limit, read-only, permissions: one line saying which and where
        message = write_error_message(e, args.output_dir)
        if message is None:
            raise
        parser.exit(1, f"{parser.prog}: error: {message}\n")
    import torch

    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


__all__ = ["build_parser", "main"]
