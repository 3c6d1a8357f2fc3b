"""Checkpoint folders on disk, shared by the converter (`mhmoe.convert`) and the exporter (`mhmoe.hub.export`).

Reading: the model type a config.json names, the safetensors weight files of a folder (one file, or shards named by an index) and their headers. Pickle
checkpoints are refused, never unpickled. Writing: a folder is built in a temporary directory next to its target,
flushed to disk and renamed into place at the end, so a failed or interrupted write leaves nothing behind.

The readers raise `error` (the caller's own `ValueError` subclass, `CheckpointError` by default) with the reason in
words.
"""

from __future__ import annotations

import json
import os
import shutil
import struct
import tempfile

from transformers.utils import SAFE_WEIGHTS_NAME
from transformers.utils import SAFE_WEIGHTS_INDEX_NAME as SAFE_INDEX_NAME

PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl", ".pickle")
_MAX_HEADER = 100 * 1024 * 1024


class CheckpointError(ValueError):
    """A checkpoint folder refused, with the reason in words."""


def read_header(path: str, error: type[ValueError] = CheckpointError) -> tuple[dict, int]:
    """(header dict, data start offset) of a safetensors file, checked with safetensors' own reader first."""
    from safetensors import safe_open

    try:
        with safe_open(path, framework="pt") as f:
            f.keys()
    except Exception as e:  # SafetensorError: truncated, extended or corrupt
        raise error(f"{path} is not a complete safetensors file ({e}); truncated or corrupt download?") from None
    with open(path, "rb") as f:
        (length,) = struct.unpack("<Q", f.read(8))
        if length > _MAX_HEADER:
            raise error(f"{path}: safetensors header of {length} bytes is implausible")
        header = json.loads(f.read(length))
    return header, 8 + length


def read_model_type(config_path: str, error: type[ValueError] = CheckpointError) -> str | None:
    """The `model_type` a checkpoint's config.json names (None when it names none), read without Transformers."""
    try:
        with open(config_path) as f:
            return json.load(f).get("model_type")
    except (json.JSONDecodeError, UnicodeDecodeError, AttributeError) as e:
        raise error(f"{config_path}: not a valid config JSON ({e})") from None


def weight_files(input_dir: str, error: type[ValueError] = CheckpointError) -> tuple[list[str], dict | None]:
    """(shard file names, index weight_map or None). Refuses pickle-only and missing checkpoints."""
    index_path = os.path.join(input_dir, SAFE_INDEX_NAME)
    names = sorted(os.listdir(input_dir))
    if os.path.isfile(index_path):
        try:
            with open(index_path) as f:
                weight_map = json.load(f)["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError) as e:
            raise error(f"{index_path} is not a valid safetensors index ({e})") from None
        shards = sorted(set(weight_map.values()))
        missing = [s for s in shards if not os.path.isfile(os.path.join(input_dir, s))]
        if missing:
            raise error(
                f"{len(missing)} shard(s) named by {SAFE_INDEX_NAME} are missing from {input_dir}: "
                f"{', '.join(missing[:5])}"
            )
        for shard in shards:
            if os.path.basename(shard) != shard or not shard.endswith(".safetensors"):
                raise error(f"{SAFE_INDEX_NAME} names {shard!r}, not a .safetensors file in {input_dir}")
        return shards, weight_map
    if os.path.isfile(os.path.join(input_dir, SAFE_WEIGHTS_NAME)):
        return [SAFE_WEIGHTS_NAME], None
    pickles = [n for n in names if n.endswith(PICKLE_SUFFIXES)]
    if pickles or os.path.isdir(os.path.join(input_dir, "original")):
        shown = ", ".join(pickles[:3]) or "original/"
        raise error(
            f"{input_dir} holds only pickle checkpoints ({shown}); they are never unpickled here (loading a pickle can "
            "run arbitrary code). Convert them to safetensors first, e.g. load them once in a trusted environment and "
            "save_pretrained(..., safe_serialization=True)"
        )
    loose = [n for n in names if n.endswith(".safetensors")]
    if loose:
        raise error(
            f"{input_dir} has safetensors shards ({', '.join(loose[:3])}) but neither {SAFE_WEIGHTS_NAME} nor "
            f"{SAFE_INDEX_NAME}: the index file is missing"
        )
    raise error(f"no weights in {input_dir} (expected {SAFE_WEIGHTS_NAME} or {SAFE_INDEX_NAME})")


def overlapping(a: str, b: str) -> bool:
    """Whether the directories `a` and `b` are the same, or one lies inside the other (symbolic links resolved)."""
    a, b = os.path.realpath(a), os.path.realpath(b)
    return a == b or a.startswith(b + os.sep) or b.startswith(a + os.sep)


def fsync(path: str) -> None:
    """Flush a written file (or a directory's entries) to disk: the output is renamed into place only when durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def temporary_dir_next_to(output_dir: str) -> str:
    """A new empty directory beside `output_dir` (same file system, so the final rename is atomic)."""
    parent = os.path.dirname(os.path.abspath(output_dir))
    os.makedirs(parent, exist_ok=True)
    temporary = tempfile.mkdtemp(prefix=f".{os.path.basename(os.path.abspath(output_dir))}.tmp-", dir=parent)
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(temporary, 0o777 & ~umask)  # mkdtemp makes it private; the result is an ordinary directory
    return temporary


def replace_dir(temporary: str, output_dir: str) -> None:
    """Move the finished `temporary` to `output_dir`, replacing what is there (only the rename is not atomic when an
    old directory exists: it is moved aside first and removed after)."""
    if os.path.isdir(output_dir):
        old = tempfile.mkdtemp(prefix=f".{os.path.basename(os.path.abspath(output_dir))}.old-",
                               dir=os.path.dirname(os.path.abspath(output_dir)))  # fmt: skip
        os.rmdir(old)
        os.replace(output_dir, old)
        os.replace(temporary, output_dir)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.replace(temporary, output_dir)
