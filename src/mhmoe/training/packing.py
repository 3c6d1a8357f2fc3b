"""Examples into fixed-size rows (`Blocks`) for the training loop.

Shape legend: N rows, S = block_size tokens per row.

- Language modelling (`text`): every example + EOS, concatenated and cut into rows of S (the remainder that does not
  fill a row is dropped), as Transformers' `run_clm.py` groups texts; every token is trained.
- Chat and prompt-completion, packed (the default): examples are laid into rows in order, each whole (one longer than
  S is cut to S), a new row when the next does not fit; the rest of a row is padding. Each example's `position_ids`
  start at 0, which is what Transformers' masks read as packed sequences (`masking_utils.find_packed_sequence_indices`):
  no token attends across examples, as if each ran alone (tests/training/test_packing.py checks the logits). Labels
  are -100 on untrained tokens, on the padding and on each example's first token (no token before it to predict it).
- Unpacked (`--packing false`): one example per row, right-padded; a batch is cut to its longest row (padded per
  batch). `benchmarks/sft.py packing` measures both (results/sft_packing.txt): on a tiny model on CPU the real tokens
  per second are the same within noise (x0.98); packing is the default because every batch then has one shape and
  nearly the same token count (steady memory and step time, no recompilation), and its padding does not grow with the
  spread of the examples' lengths (there: 24% of the positions against 35%).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import torch

from .formats import Example

IGNORE = -100  # Transformers' ignore_index


@dataclass
class Blocks:
    """N training rows. `labels` None: the rows themselves (language modelling); `position_ids` None: 0..S-1 in every
    row; `lengths[i]`: real (not padding) tokens of row i; `ragged`: rows are single right-padded examples (a batch is
    cut to its longest)."""

    input_ids: torch.Tensor  # (N, S) int64
    labels: torch.Tensor | None = None  # (N, S) int64, -100 where not trained
    position_ids: torch.Tensor | None = None  # (N, S) int64
    lengths: torch.Tensor | None = None  # (N,) int64
    ragged: bool = False

    def __len__(self) -> int:
        return self.input_ids.shape[0]

    @property
    def block_size(self) -> int:
        return self.input_ids.shape[1]

    def real_tokens(self, index: torch.Tensor) -> int:
        """Real (not padding) tokens in rows `index` (a 1-D tensor of row numbers)."""
        if self.lengths is None:
            return len(index) * self.block_size
        return int(self.lengths[index].sum())

    def batch(self, index, device=None) -> dict[str, torch.Tensor]:
        """The model inputs of rows `index`: input_ids, labels, and position_ids for packed examples."""
        input_ids = self.input_ids[index]
        labels = input_ids if self.labels is None else self.labels[index]
        position_ids = None if self.position_ids is None else self.position_ids[index]
        if self.ragged:  # padded per batch: cut to the longest row
            width = int(self.lengths[index].max())
            input_ids, labels, position_ids = (t[:, :width] for t in (input_ids, labels, position_ids))
        out = {"input_ids": input_ids, "labels": labels}
        if position_ids is not None and not self.ragged:
            out["position_ids"] = position_ids
        return {k: v.to(device) for k, v in out.items()} if device is not None else out


def pack_text(examples: Iterable[Example], block_size: int) -> Blocks:
    """Language modelling rows: the examples' tokens concatenated and cut into rows of `block_size`."""
    ids: list[int] = []
    for example in examples:
        ids.extend(example.input_ids)
    rows = len(ids) // block_size
    return Blocks(torch.tensor(ids[: rows * block_size], dtype=torch.long).view(rows, block_size))


class TextPacker:
    """`pack_text` over a stream: rows of `block_size` as they fill; `carry` (the tokens of an unfinished row) is the
    packer's whole state (a checkpoint stores it)."""

    def __init__(self, block_size: int, carry: list[int] | None = None):
        self.block_size, self.carry = block_size, list(carry or [])

    def add(self, example: Example) -> Iterator[dict]:
        self.carry.extend(example.input_ids)
        while len(self.carry) >= self.block_size:
            row, self.carry = self.carry[: self.block_size], self.carry[self.block_size :]
            yield {"input_ids": row, "length": self.block_size}


class ExamplePacker:
    """Chat / prompt-completion rows (packed or one example per row) as they fill; `pending` (the examples of the
    unfinished row) is its state."""

    def __init__(self, block_size: int, pad_id: int, packing: bool = True, pending: list | None = None):
        self.block_size, self.pad_id, self.packing = block_size, pad_id, packing
        self.pending: list[Example] = [Example(*p) for p in pending or []]
        self.truncated = 0  # examples cut to block_size
        self.dropped = 0  # examples left with no trained token after the cut

    def state(self) -> list:
        return [[e.input_ids, e.trained] for e in self.pending]

    def add(self, example: Example) -> Iterator[dict]:
        if len(example.input_ids) > self.block_size:
            self.truncated += 1
            example = Example(example.input_ids[: self.block_size], example.trained[: self.block_size])
        if not any(example.trained[1:]):  # nothing left to predict: a NaN loss on a batch of only such rows
            self.dropped += 1
            return
        used = sum(len(e.input_ids) for e in self.pending)
        if self.pending and (not self.packing or used + len(example.input_ids) > self.block_size):
            yield self._flush()
        self.pending.append(example)

    def finish(self) -> Iterator[dict]:
        if self.pending:
            yield self._flush()

    def _flush(self) -> dict:
        pending, self.pending = self.pending, []
        return _row([e.input_ids for e in pending], [e.trained for e in pending], self.block_size, self.pad_id)


def _row(pieces: list[list[int]], trained: list[list[bool]], size: int, pad_id: int) -> dict:
    """One row of `size` from examples `pieces`: ids, labels, position ids and its real length. An example's first
    token is never a label: nothing before it in its own sequence predicts it."""
    ids, labels, positions = [], [], []
    for piece, mask in zip(pieces, trained):
        ids += piece
        positions += range(len(piece))
        labels += [t if m and i else IGNORE for i, (t, m) in enumerate(zip(piece, mask))]
    length = len(ids)
    pad = size - length
    return {
        "input_ids": ids + [pad_id] * pad,
        "labels": labels + [IGNORE] * pad,
        "position_ids": positions + list(range(pad)),
        "length": length,
    }


def stack_rows(rows: list[dict], ragged: bool, text: bool) -> Blocks:
    """`Blocks` from the rows the packers yield (text rows need no labels or positions)."""
    if not rows:
        return Blocks(torch.zeros(0, 0, dtype=torch.long))
    input_ids = torch.tensor([r["input_ids"] for r in rows], dtype=torch.long)
    if text:
        return Blocks(input_ids)
    return Blocks(
        input_ids,
        torch.tensor([r["labels"] for r in rows], dtype=torch.long),
        torch.tensor([r["position_ids"] for r in rows], dtype=torch.long),
        torch.tensor([r["length"] for r in rows], dtype=torch.long),
        ragged=ragged,
    )


def pack_examples(examples: Iterable[Example], block_size: int, pad_id: int, packing: bool) -> tuple[Blocks, dict]:
    """Chat / prompt-completion rows from all `examples`; returns (blocks, {"truncated": n, "dropped": n})."""
    packer = ExamplePacker(block_size, pad_id, packing)
    rows = [row for example in examples for row in packer.add(example)]
    rows += list(packer.finish())
    return stack_rows(rows, ragged=not packing, text=False), {"truncated": packer.truncated, "dropped": packer.dropped}


__all__ = ["IGNORE", "Blocks", "ExamplePacker", "TextPacker", "pack_examples", "pack_text", "stack_rows"]
