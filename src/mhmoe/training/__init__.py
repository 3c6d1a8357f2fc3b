"""Training: the one training loop (`train`, `mhmoe-train`) with Accelerate and PEFT, cut into named stages.

`loop.py` is the loop and the order of its stages; `prepare.py` the setup stages, `state.py` what they share,
`checkpoints.py` checkpoints and resuming, `outputs.py` the output folder and the final save, `arguments.py` the
arguments and their checks, `metrics.py` metrics and the loss plot, `data.py` text files, tokenizer and packed blocks,
`sources.py` / `formats.py` / `packing.py` / `streaming.py` the `--dataset` path (any `datasets` source; text, chat and
prompt-completion records; rows; streams), `throughput.py` tokens/s and MFU, `trackers.py` `--report_to`,
`sft_trainer.py` TRL's SFTTrainer with mhmoe's auxiliary losses, `peft.py` LoRA (attention and the 3-D expert
weights), `cli.py` the command line.
"""

from typing import TYPE_CHECKING

from .._plumbing.lazy import lazy_exports

__getattr__, __dir__ = lazy_exports(
    __name__,
    {
        **dict.fromkeys(("TrainArguments", "TrainingError"), ".arguments"),
        **dict.fromkeys(("TrainResult", "train"), ".loop"),
        "reset_accelerate_state": ".prepare",
        "main": ".cli",
    },
)

if TYPE_CHECKING:
    from .arguments import TrainArguments, TrainingError
    from .cli import main
    from .loop import TrainResult, train
    from .prepare import reset_accelerate_state

__all__ = ["TrainArguments", "TrainResult", "TrainingError", "main", "reset_accelerate_state", "train"]
