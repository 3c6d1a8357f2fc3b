"""mhmoe-train: pre-train or fine-tune MHMoE / MoH-Llama causal LMs with Accelerate (and PEFT LoRA).

The command line of the training loop (`mhmoe-train`, `python -m mhmoe.training`); see `loop.py`. The flags are
`TrainArguments`' fields, parsed before torch and Transformers are imported, so a usage error prints at once.
"""

from __future__ import annotations

from .._plumbing.arguments import hf_argument_parser, parse_or_exit
from .arguments import TrainArguments, TrainingError, TrainingStopped, check_required


def build_parser():
    return hf_argument_parser(TrainArguments, prog="mhmoe-train", description=__doc__.split("\n\n")[0])


def main(argv: list[str] | None = None) -> None:
    """Console entry point (`mhmoe-train`); usage and input errors exit with status 2 and a one-line message, a run
    stopped by non-finite losses or by a problem of the machine (a full disk) with status 1, Ctrl-C with status 130
    and one line saying how to go on."""
    parser = build_parser()
    (args,) = parse_or_exit(parser, argv)
    try:
        check_required(args)
        from .loop import train

        train(args)
    except KeyboardInterrupt:
        parser.exit(130, f"\nmhmoe-train: interrupted; {_how_to_go_on(args)}\n")
    except TrainingError as e:
        from .._plumbing.checkpoint_files import exit_status

        parser.exit(1 if isinstance(e, TrainingStopped) else exit_status(e), f"mhmoe-train: error: {e}\n")
    except Exception as e:  # full disk, file size limit, read-only, permissions: one line saying which and where
        from .._plumbing.checkpoint_files import write_error_message

        message = write_error_message(e, args.output_dir or ".")
        if message is None:
            raise
        parser.exit(1, f"mhmoe-train: error: {message}\n")
    import torch

    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


def _how_to_go_on(args) -> str:
    """After Ctrl-C: resume from the newest checkpoint, or start over."""
    import os

    from .checkpoints import list_checkpoints

    checkpoints = list_checkpoints(args.output_dir) if args.output_dir else []
    if checkpoints:
        return (
            f"run the same command with --resume_from_checkpoint latest to go on from "
            f"{os.path.join(args.output_dir, os.path.basename(checkpoints[-1][1]))}"
        )
    when = f"every {args.save_steps} steps" if args.save_steps else "none with --save_steps 0"
    return f"no checkpoint was written yet ({when}): run the same command again to start over"


__all__ = ["build_parser", "main"]
