"""mhmoe-train: pre-train or fine-tune MHMoE / MoH-Llama causal LMs with Accelerate (and PEFT LoRA).

The command line of the training loop (`mhmoe-train`, `python -m mhmoe.training`); see `loop.py`.
"""

from __future__ import annotations

import torch

from .arguments import TrainArguments, TrainingError
from .loop import train


def build_parser():
    from transformers import HfArgumentParser

    return HfArgumentParser(TrainArguments, prog="mhmoe-train", description=__doc__.split("\n\n")[0])


def main(argv: list[str] | None = None) -> None:
    """Console entry point (`mhmoe-train`); input errors exit with status 2 and a one-line message."""
    parser = build_parser()
    (args,) = parser.parse_args_into_dataclasses(args=argv)
    try:
        train(args)
    except TrainingError as e:
        parser.exit(2, f"mhmoe-train: error: {e}\n")
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


__all__ = ["build_parser", "main"]
