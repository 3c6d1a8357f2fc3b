"""`mhmoe-convert` / `python -m mhmoe.convert` / conversion/convert_llama_to_moh.py: the arguments and `main()`.

Converts (conversion.py); with `--train_file` or `--dataset` also continue-tunes (continue_tune.py), taking every continue-tuning flag of
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
        f"{GATES} gates; the router fitted on calibration text when the source has a tokenizer, else the paper's "
        f"{ROUTER}: --recipe); with --train_file or --dataset, continue-tune it with mhmoe-train (paper stage-2 "
        f"defaults: {continue_tuning_words()}).",
    )


def main(argv: list[str] | None = None) -> None:
    """Console entry point; refusals exit with status 2 and a one-line message, nothing left at --output_dir; a full
    disk or another problem of the machine with status 1; Ctrl-C with status 130 and one line saying how to go on."""
    import sys

    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    args, tune = parse_or_exit(parser, argv)
    if not args.input_dir or not args.output_dir:
        parser.error("--input_dir and --output_dir are required")
    _fit_recipe_warmup(tune, argv)
    if int(os.environ.get("RANK", "0")) == 0:  # at once: loading torch and Transformers takes seconds
        print(f"{parser.prog}: {args.input_dir} -> {args.output_dir}: loading torch and Transformers", flush=True)

    from .._plumbing.checkpoint_files import exit_status, write_error_message
    from ..training.arguments import TrainingError

    try:
        from .continue_tune import convert_and_continue_tune
        from .conversion import convert

        if _tunes(tune):
            convert_and_continue_tune(args, tune, progress=not tune.disable_tqdm)
        else:
            if tune.resume_from_checkpoint:
                raise ConversionError(
                    "--resume_from_checkpoint continues a continue-tuning run: give --train_file or --dataset"
                )
            if int(os.environ.get("RANK", "0")) > 0:  # launched with several processes: one converts
                return
            if args.distill:
                raise ConversionError("--distill continue-tunes: give --train_file or --dataset")
            report = convert(
                args.input_dir, args.output_dir, progress=not tune.disable_tqdm, **args.conversion_options()
            )
            print(report.format(), flush=True)
    except KeyboardInterrupt:
        parser.exit(130, f"\n{parser.prog}: interrupted; {_how_to_go_on(args, tune)}\n")
    except (ConversionError, TrainingError) as e:
        parser.exit(exit_status(e), f"{parser.prog}: error: {e}\n")
    except Exception as e:  # full disk, file size limit, read-only, permissions: one line saying which and where
        message = write_error_message(e, args.output_dir)
        if message is None:
            raise
        parser.exit(1, f"{parser.prog}: error: {message}\n")
    import torch

    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


def _tunes(tune) -> bool:
    """Whether the command continue-tunes: it names training data."""
    return bool(tune.train_file or tune.dataset)


def _fit_recipe_warmup(tune, argv: list[str]) -> None:
    """The recipe's warmup (50 steps) in a continue-tuning run of fewer steps, when --warmup_steps was not given: a
    tenth of the steps instead, said in a note (mhmoe-train refuses a warmup longer than the run)."""
    from .recipe import CONTINUE_TUNING_DEFAULTS

    given = any(a.split("=")[0] in ("--warmup_steps", "--warmup-steps") for a in argv)
    default = CONTINUE_TUNING_DEFAULTS["warmup_steps"]
    if _tunes(tune) and not given and 0 < tune.max_steps < tune.warmup_steps == default:
        import sys

        print(
            f"mhmoe-convert: note: the recipe's {tune.warmup_steps} warmup steps are more than --max_steps "
            f"{tune.max_steps}: warming up for {tune.max_steps // 10} (give --warmup_steps to choose)",
            file=sys.stderr,
        )
        tune.warmup_steps = tune.max_steps // 10


def _how_to_go_on(args, tune) -> str:
    """After Ctrl-C: nothing was written (a conversion writes its folder whole at the end), or the continue-tuning
    run resumes from its newest checkpoint."""
    from ..training.checkpoints import list_checkpoints

    checkpoints = list_checkpoints(args.output_dir) if _tunes(tune) else []
    if checkpoints:
        return (
            f"the continue-tuning saved {os.path.basename(checkpoints[-1][1])}: run the same command with "
            "--resume_from_checkpoint latest to go on from it"
        )
    if _tunes(tune) and os.path.isdir(os.path.join(args.output_dir, "converted")):
        return (
            f"the converted model is in {os.path.join(args.output_dir, 'converted')}, no checkpoint yet "
            "(--save_steps): run the same command with --overwrite to start over"
        )
    return f"nothing was written to {args.output_dir}: run the same command again"


__all__ = ["build_parser", "main"]
