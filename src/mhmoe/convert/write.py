"""Write a planned conversion: shards streamed byte for byte into a temporary folder, checked, renamed into place.

The weights are copied byte for byte, shard by shard (same shard names, same index), without building the model:
memory stays far below one shard (`os.copy_file_range` where the kernel has it). A calibrated recipe then rewrites the
shards once (`write_converted`): heads permuted, and the "fitted" router's weights (the only tensors a recipe adds)
filled in. The output is written to a temporary directory next to `output_dir`, its safetensors headers re-read and
compared with the plan, every file flushed to disk, and the folder renamed at the end (`commit`), so a failed or
interrupted conversion leaves nothing at `output_dir` (and hidden folders that the next conversion to it removes:
`_plumbing.checkpoint_files.recover_output_dir`); an existing non-empty `output_dir` is only replaced with `overwrite`,
and is never missing meanwhile. Besides the weights and config, only the generation config, tokenizer and chat
template files are copied (`_plumbing.checkpoint_files.side_files`: never code); the modeling code, `auto_map` and a
model card are added as `export_pretrained` adds them, so the output loads with `trust_remote_code=True` where mhmoe
is not installed.
"""

from __future__ import annotations

import json
import os
import struct
from concurrent.futures import ThreadPoolExecutor

from .._plumbing.checkpoint_files import (
    SAFE_INDEX_NAME,
    check_writable,
    copy_side_file,
    fsync,
    overlapping,
    recover_output_dir,
    replace_dir,
)
from .errors import ConversionError
from .heads import permute_checkpoint
from .plan import ConversionPlan, ShardPlan, read_shard

_COPY_CHUNK = 64 * 1024 * 1024


def _copy_range(src_fd: int, dst_fd: int, offset: int, count: int) -> None:
    """Copy `count` bytes at `offset` of src to dst's current position, in the kernel when it can (no user memory)."""
    position = offset
    end = offset + count
    use_kernel = hasattr(os, "copy_file_range")
    while position < end:
        chunk = min(_COPY_CHUNK, end - position)
        if use_kernel:
            try:
                done = os.copy_file_range(src_fd, dst_fd, chunk, position)
            except OSError:  # other file systems / kernels: fall back to read + write
                use_kernel = False
                continue
            if done == 0:
                raise ConversionError("unexpected end of a source shard while copying (was it modified meanwhile?)")
        else:
            data = os.pread(src_fd, chunk, position)
            if not data:
                raise ConversionError("unexpected end of a source shard while copying (was it modified meanwhile?)")
            os.write(dst_fd, data)  # regular files: complete writes
            done = len(data)
        position += done


def _write_shard(shard: ShardPlan, out_path: str, progress=None) -> None:
    header, offset = {}, 0
    for t in shard.tensors:
        header[t.name] = {"dtype": t.dtype, "shape": list(t.shape), "data_offsets": [offset, offset + t.nbytes]}
        offset += t.nbytes
    metadata = {str(k): str(v) for k, v in shard.metadata.items()} or {"format": "pt"}
    metadata.setdefault("format", "pt")
    header["__metadata__"] = metadata
    encoded = json.dumps(header, separators=(",", ":")).encode()
    encoded += b" " * (-len(encoded) % 8)  # the data starts 8-byte aligned
    src_fd = os.open(shard.source_path, os.O_RDONLY)
    dst_fd = os.open(out_path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    try:
        os.write(dst_fd, struct.pack("<Q", len(encoded)) + encoded)
        run_start = run_end = None
        for t in shard.tensors + [None]:  # copy maximal runs of contiguous source bytes in one go
            if t is not None and not t.added and t.start == run_end:
                run_end = t.end
                continue
            if run_start is not None and run_end > run_start:
                _copy_range(src_fd, dst_fd, run_start, run_end - run_start)
                if progress is not None:
                    progress.update(run_end - run_start)
            run_start = run_end = None
            if t is None:
                break
            if t.added:
                zeros = bytes(min(t.nbytes, _COPY_CHUNK))
                left = t.nbytes
                while left:
                    left -= os.write(dst_fd, zeros[: min(left, len(zeros))])
            else:
                run_start, run_end = t.start, t.end
    finally:
        os.close(src_fd)
        os.close(dst_fd)


def _check_written(plan: ConversionPlan, directory: str) -> None:
    """The written shards hold exactly the planned tensors (names, dtypes, shapes) and are complete."""
    for shard in plan.shards:
        written = read_shard(os.path.join(directory, shard.filename), shard.filename)
        got = {t.name: (t.dtype, t.shape) for t in written.tensors}
        want = {t.name: (t.dtype, t.shape) for t in shard.tensors}
        if got != want:
            raise ConversionError(f"written shard {shard.filename} does not match the plan")


def output_state(output_dir: str, overwrite: bool) -> bool:
    """True when output_dir exists (and may be replaced). Refuses a non-empty one without overwrite. What an earlier,
    killed conversion to output_dir left is cleaned up first (`recover_output_dir`)."""
    recover_output_dir(output_dir)
    if os.path.lexists(output_dir) and not os.path.isdir(output_dir):
        raise ConversionError(f"--output_dir {output_dir} exists and is not a directory")
    if os.path.isdir(output_dir) and os.listdir(output_dir) and not overwrite:
        raise ConversionError(f"--output_dir {output_dir} exists and is not empty; pass --overwrite to replace it")
    return os.path.isdir(output_dir)


def check_paths(input_dir: str, output_dir: str) -> None:
    if overlapping(input_dir, output_dir):
        raise ConversionError(f"--output_dir {output_dir} must not be --input_dir, inside it, or contain it")


def check_disk_space(plan: ConversionPlan, output_dir: str) -> None:
    """Room at `output_dir` for every planned byte (checked once, before calibration's minutes)."""
    check_writable(output_dir, ConversionError, needed=plan.total_bytes)  # a read-only target is not a full disk


def _write_checkpoint(plan: ConversionPlan, temporary: str, progress: bool) -> None:
    """Shards, index, config and the copied files into `temporary`; the shards' headers re-read and checked."""
    from tqdm.auto import tqdm

    bar = tqdm(
        total=plan.total_bytes, unit="B", unit_scale=True, desc="converting", disable=not progress, dynamic_ncols=True
    )
    # each shard is flushed to disk by a background thread while the next one is copied (fsync drops the GIL)
    with ThreadPoolExecutor(max_workers=1) as flusher:
        flushed = []
        for shard in plan.shards:
            path = os.path.join(temporary, shard.filename)
            _write_shard(shard, path, bar)
            flushed.append(flusher.submit(fsync, path))
        for future in flushed:
            future.result()
    bar.close()
    if plan.indexed:
        weight_map = {t.name: s.filename for s in plan.shards for t in s.tensors}
        index = {"metadata": {"total_size": plan.total_bytes}, "weight_map": dict(sorted(weight_map.items()))}
        with open(os.path.join(temporary, SAFE_INDEX_NAME), "w") as f:
            json.dump(index, f, indent=2)
    plan.config.save_pretrained(temporary)
    for name in plan.copy_files:
        note = copy_side_file(plan.input_dir, name, temporary)
        if note:
            plan.notes.append(note)
    _check_written(plan, temporary)


def _add_remote_code(temporary: str, output_dir: str) -> None:
    """The modeling code, `auto_map` and the converted model card (base model from the conversion record), as
    `export_pretrained` writes them: the folder loads with trust_remote_code=True without mhmoe."""
    from ..hub.remote_code import write_remote_code
    from ..models.moh_llama import MoHLlamaConfig

    config = MoHLlamaConfig.from_pretrained(temporary, trust_remote_code=False)
    write_remote_code(temporary, config, repo=os.path.basename(os.path.abspath(output_dir)))


def commit(temporary: str, output_dir: str, overwrite: bool) -> None:
    """Add the modeling code and card, flush the small files and the folder, then rename it into place."""
    _add_remote_code(temporary, output_dir)
    for folder, _, names in os.walk(temporary):
        for name in names:
            if not name.endswith(".safetensors"):  # small files; the shards are flushed already
                fsync(os.path.join(folder, name))
    fsync(temporary)
    output_state(output_dir, overwrite)  # still allowed (nothing appeared meanwhile)
    replace_dir(temporary, output_dir)
    fsync(os.path.dirname(os.path.abspath(output_dir)))


def write_converted(plan: ConversionPlan, choices, temporary: str, progress: bool) -> None:
    """The source's shards copied into `temporary`, then (calibrated recipes) the heads permuted and the fitted
    router's weights filled in."""
    _write_checkpoint(plan, temporary, progress)
    if choices.orders is not None or choices.tensors:
        config = plan.config
        permute_checkpoint(
            temporary,
            [s.filename for s in plan.shards],
            choices.orders,
            config.num_key_value_heads,
            config.head_dim,
            replace=choices.tensors,
        )


__all__ = ["check_disk_space", "check_paths", "commit", "output_state", "write_converted"]
