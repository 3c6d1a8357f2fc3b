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
    stopped by non-finite losses or by a problem of the machine (a full disk) with status 1."""
    parser = build_parser()
    (args,) = parse_or_exit(parser, argv)
    try:
        check_required(args)
        from .loop import train

        train(args)
    except TrainingError as e:
        parser.exit(1 if isinstance(e, TrainingStopped) else 2, f"mhmoe-train: error: {e}\n")
    except Exception as e:  # full disk, file size limit, read-only, permissions: one line saying which and where
        from .._plumbing.checkpoint_files import write_error_message

        message = write_error_message(e, args.output_dir or ".")
        if message is None:
            raise
        parser.exit(1, f"mhmoe-train: error: {message}\n")
    import torch

    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


__all__ = ["build_parser", "main"]
