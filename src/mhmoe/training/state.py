"""`TrainRun`, what the training stages share, and `TrainResult`, what `train()` returns."""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from .arguments import TrainArguments
from .metrics import METRICS_FILE
from .packing import Blocks


@dataclass
class TrainResult:
    output_dir: str
    global_step: int
    history: list[dict]  # every metrics record written (train and eval), this run
    final_eval: dict | None
    model: Any = None  # the unwrapped trained model (a PeftModel with --lora)
    tokenizer: Any = None


@dataclass
class TrainRun:
    """What the stages share: filled in by the setup stages, then advanced by the loop."""

    args: TrainArguments
    accelerator: Any
    config: Any
    from_scratch: bool
    on_log: Callable[[dict], None] | None = None
    tokenizer: Any = None
    # data and batch geometry (build_data / build_dataset_data)
    train_blocks: Blocks | None = None  # (blocks, block_size) rows; None with --streaming
    val_blocks: Blocks | None = None
    stream: Any = None  # --streaming: this process's RowStream (streaming.py)
    data_format: str = "text"  # text | messages | prompt-completion (formats.py)
    block_size: int = 0
    global_blocks: int = 0  # blocks per optimizer step: micro-batch × accumulation × processes
    steps_per_epoch: int = 0
    total_steps: int = 0
    # model and optimisation (build_model, build_optimizer)
    model: Any = None
    optimizer: Any = None
    scheduler: Any = None
    forward_kwargs: dict = field(default_factory=dict)
    trainable: int = 0
    total_params: int = 0
    # progress
    start_step: int = 0
    loss_names: list[str] | None = None  # the extra *_loss outputs, in the order the step sums them
    permutation: tuple[int, torch.Tensor] | None = None  # (epoch, its block order)
    history: list[dict] = field(default_factory=list)
    tokens_seen: int = 0  # real (not padding) tokens trained on, all processes, since step 0
    throughput: Any = None  # throughput.Throughput: tokens/s and MFU in the log records
    trackers: bool = False  # Accelerate's trackers are on (--report_to)
    metrics_records: int = 0  # records in metrics.jsonl (earlier runs' included): checkpoints keep the count
    pending_checkpoint: Any = None  # a Future: the checkpoint being completed in the background (checkpoints.py)

    @property
    def is_main(self) -> bool:
        return self.accelerator.is_main_process

    @property
    def world(self) -> int:
        return self.accelerator.num_processes

    @property
    def metrics_path(self) -> str:
        return os.path.join(self.args.output_dir, METRICS_FILE)

    def log(self, record: dict) -> None:
        self.history.append(record)
        self.metrics_records += 1
        if self.is_main:
            with open(self.metrics_path, "a") as f:
                f.write(json.dumps(record) + "\n")
            if self.on_log is not None:
                self.on_log(record)
        if self.trackers:  # numbers only (the load lists stay in metrics.jsonl)
            scalars = {k: v for k, v in record.items() if isinstance(v, (int, float)) and k != "step"}
            self.accelerator.log(scalars, step=record.get("step"))


__all__ = ["TrainResult", "TrainRun"]
