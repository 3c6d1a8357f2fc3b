"""`mhmoe-train --streaming`: training rows read, tokenised and packed on the fly from an `IterableDataset`.

Each process reads its own share (`datasets.distributed.split_dataset_by_node`: whole shards when the shards divide
evenly among the processes, else every world_size-th example) and takes `per_device_train_batch_size` rows per
micro-batch, in stream order (a stream is not shuffled: shuffle the data before, or use a map-style dataset). When the
stream ends it starts again (the next epoch) until --max_steps.

Exact resume. A checkpoint stores, per process (`stream_state_{rank}.json`), the dataset's own position
(`IterableDataset.state_dict()`: shard and example), the packer's unfinished row, the rows packed but not yet trained
on, the epoch and the example index: the resumed run trains on exactly the rows the interrupted one would have
(tests/training/test_streaming.py compares the losses step by step). Memory stays that of a few rows
(benchmarks/streaming_memory.py).
"""

from __future__ import annotations

import json
import os

from .arguments import TrainingError
from .formats import TEXT
from .packing import Blocks, ExamplePacker, TextPacker, stack_rows
from .sources import held_out, reading_error

STREAM_STATE_FILE = "stream_state_{}.json"


class RowStream:
    """One process's training rows from a streamed dataset, in order, with a state that resumes it exactly."""

    def __init__(
        self, dataset, encoder, block_size: int, pad_id: int, packing: bool, percentage: float = 0.0, name: str = ""
    ):
        self.dataset, self.encoder, self.percentage, self.name = dataset, encoder, percentage, name
        self.text = encoder.format == TEXT
        self.block_size, self.pad_id, self.packing = block_size, pad_id, packing
        self.packer = self._packer()
        self.epoch, self.index, self.ready = 0, 0, []
        self._iterator, self._rows_this_epoch, self._whole_epoch = None, 0, True

    def _packer(self, state=None):
        if self.text:
            return TextPacker(self.block_size, state)
        return ExamplePacker(self.block_size, self.pad_id, self.packing, state)

    def take(self, rows: int) -> Blocks:
        """The next `rows` rows."""
        return stack_rows(
            [self._next_row() for _ in range(rows)], ragged=not (self.text or self.packing), text=self.text
        )

    def _next_row(self) -> dict:
        while not self.ready:
            if self._iterator is None:
                self.dataset.set_epoch(self.epoch)
                self._iterator, self._rows_this_epoch = iter(self.dataset), 0
                self._whole_epoch = self.index == 0  # not resumed mid-epoch
            try:
                record = next(self._iterator)
            except StopIteration:
                self._end_of_epoch()
                continue
            except Exception as e:  # a line the reader cannot parse, far into the stream
                raise reading_error(self.name, self.index, e) from None
            index, self.index = self.index, self.index + 1
            if self.percentage and held_out(index, self.percentage):
                continue  # a validation example
            self._add(self.packer.add(self.encoder(record, index + 1)))
        return self.ready.pop(0)

    def _add(self, rows) -> None:
        rows = list(rows)
        self.ready.extend(rows)
        self._rows_this_epoch += len(rows)

    def _end_of_epoch(self) -> None:
        """The stream ended: the unfinished row goes out (examples; text carries on into the next epoch) and the
        stream starts again. An epoch that gave no row at all would loop for ever: refused."""
        if not self.text:
            self._add(self.packer.finish())
        if not self._rows_this_epoch and self._whole_epoch:
            raise TrainingError(
                "the streamed dataset gives no training row in a whole pass (an empty split or share, or fewer "
                f"tokens than one block of {self.block_size})"
            )
        self.epoch, self.index, self._iterator = self.epoch + 1, 0, None

    def state_dict(self) -> dict:
        packer = self.packer.carry if self.text else self.packer.state()
        dataset = self.dataset.state_dict() if self._iterator is not None or self.index else None
        return {"epoch": self.epoch, "index": self.index, "ready": self.ready, "packer": packer, "dataset": dataset}

    def load_state_dict(self, state: dict) -> None:
        self.epoch, self.index, self.ready = state["epoch"], state["index"], list(state["ready"])
        self.packer = self._packer(state["packer"])
        if state.get("dataset") is not None:
            self.dataset.load_state_dict(state["dataset"])
        self._iterator = None


def save_stream_state(stream: RowStream, folder: str, rank: int) -> None:
    with open(os.path.join(folder, STREAM_STATE_FILE.format(rank)), "w") as f:
        json.dump(stream.state_dict(), f)


def load_stream_state(stream: RowStream, folder: str, rank: int) -> None:
    """The position a checkpoint saved for process `rank`; refused in one line when missing or unreadable."""
    path = os.path.join(folder, STREAM_STATE_FILE.format(rank))
    try:
        with open(path) as f:
            state = json.load(f)
        stream.load_state_dict(state)
    except FileNotFoundError:
        raise TrainingError(
            f"{folder} has no {os.path.basename(path)}: it was not saved by a --streaming run with this many "
            "processes, so the stream's position is unknown; resume with the settings it was saved with"
        ) from None
    except (ValueError, KeyError, TypeError) as e:
        raise TrainingError(f"{path} does not load ({e}): the checkpoint is damaged") from None


def split_for_process(dataset, rank: int, world: int):
    """This process's share of a streamed dataset."""
    if world == 1:
        return dataset
    from datasets.distributed import split_dataset_by_node

    return split_dataset_by_node(dataset, rank=rank, world_size=world)


__all__ = ["STREAM_STATE_FILE", "RowStream", "load_stream_state", "save_stream_state", "split_for_process"]
