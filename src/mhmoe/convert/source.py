"""The converter's reader step: what it converts, as a safetensors folder. `read_source(input_dir, output_dir, options)`
yields a `Source`: the input folder itself, or, with `options.gguf_file`, the GGUF file dequantised into a dense
checkpoint in a temporary folder beside `output_dir` (gguf.py), removed when the conversion ends. Either way the rest
of the pipeline (plan, choose heads, write, verify) reads one folder.
"""

from __future__ import annotations

import contextlib
import os
import shutil
from collections.abc import Iterator
from dataclasses import dataclass

from .._plumbing.checkpoint_files import temporary_dir_next_to
from .recipe import head_split


@dataclass(frozen=True)
class Source:
    folder: str  # the safetensors checkpoint converted: the input folder, or the GGUF file dequantised
    label: str  # what the report calls the input: the folder given, or FOLDER/FILE.gguf
    names: dict | None  # the source's public names (`hub.conversion_cards.parent_names`), when found here
    notes: list[str]  # how the source was read, first among the report's notes


@contextlib.contextmanager
def read_source(input_dir: str, output_dir: str, options) -> Iterator[Source]:
    """The `Source` of a conversion with these `ConvertOptions` (checked already)."""
    if options.gguf_file is None:
        yield Source(input_dir, input_dir, options.source_names, list(options.source_notes or []))
    else:
        with _dequantised(input_dir, output_dir, options) as source:
            yield source


@contextlib.contextmanager
def _dequantised(input_dir: str, output_dir: str, options) -> Iterator[Source]:
    """The GGUF file dequantised into a temporary folder (its head split checked first); the card and the record name
    the source by its Hub id when there is one, else by the GGUF file's name (`parent_names`), never by the temporary
    folder."""
    from ..hub.conversion_cards import parent_names
    from .gguf import check_gguf_source, dequantise_gguf, gguf_config

    gguf_file = options.gguf_file
    check_gguf_source(input_dir, gguf_file)
    heads = gguf_config(input_dir, gguf_file).num_attention_heads  # the head split is checked before dequantising
    head_split(
        heads, options.shared_heads_ratio, options.active_heads_ratio, options.shared_heads, options.active_heads
    )
    names = options.source_names or parent_names(input_dir, gguf_file, options.base_model)
    dense = temporary_dir_next_to(output_dir)
    try:
        if options.progress:
            print(f"dequantising {gguf_file} to float32 (the whole model, in memory)", flush=True)
        notes = dequantise_gguf(input_dir, gguf_file, dense)
        yield Source(dense, os.path.join(input_dir, gguf_file), names, notes)
    finally:
        shutil.rmtree(dense, ignore_errors=True)


__all__ = ["Source", "read_source"]
