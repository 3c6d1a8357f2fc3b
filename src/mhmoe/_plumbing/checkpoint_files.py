"""Checkpoint folders on disk, shared by the converter (`mhmoe.convert`) and the exporter (`mhmoe.hub.export`).

Reading: the model type a config.json names, the safetensors weight files of a folder (one file, or shards named by an
index) and their headers, and the other files a checkpoint needs (`side_files`: generation config, tokenizer, chat
template; never code, never a symbolic link out of the folder). Pickle checkpoints are refused, never unpickled.

Writing: a folder is built in a temporary directory next to its target (`.OUT.tmp-PID.HOST-XXXX`), flushed to disk and
renamed into place at the end (`replace_dir`: an existing target is swapped atomically where the kernel can, else moved
aside as `.OUT.old-PID.HOST-XXXX` first). A writer killed meanwhile leaves those hidden folders; the next writer of the
same target (`recover_output_dir`) restores the old target if it is missing and removes them, but only folders whose
name says this host made them in a process that no longer runs. `check_writable` and `os_error_message` put read-only,
permission and full-disk problems in one line.

The readers raise `error` (the caller's own `ValueError` subclass, `CheckpointError` by default) with the reason in
words.
"""

from __future__ import annotations

import errno
import hashlib
import json
import logging
import os
import re
import shutil
import socket
import struct
import tempfile

# transformers.utils' names, written out: this module is imported by the command lines before they parse arguments
# (importing transformers takes seconds); tests/_plumbing/test_checkpoint_files.py checks they agree
SAFE_WEIGHTS_NAME = "model.safetensors"
SAFE_INDEX_NAME = "model.safetensors.index.json"
CONFIG_NAME = "config.json"
GENERATION_CONFIG_NAME = "generation_config.json"

logger = logging.getLogger(__name__)

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


def check_weight_files(folder: str, error: type[ValueError] = CheckpointError) -> list[str]:
    """The safetensors weight files of `folder` (`weight_files`: pickle-only folders refused), each read back whole:
    a truncated or empty file (a download cut short) is refused by name instead of failing deep inside loading."""
    shards, _ = weight_files(folder, error)
    for shard in shards:
        file = os.path.join(folder, shard)
        header, start = read_header(file, error)
        end = max((v["data_offsets"][1] for k, v in header.items() if k != "__metadata__"), default=0)
        if os.path.getsize(file) < start + end:
            raise error(
                f"{file} is truncated ({os.path.getsize(file)} bytes, its header describes {start + end}); "
                "download or save it again"
            )
    return shards


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


def write_json_atomic(path: str, data, indent: int | None = 2) -> None:
    """Write JSON to `path` through a temporary file beside it (`PATH.tmp-PID`), flushed and renamed, the folder
    flushed too: the file is whole or absent."""
    temporary = f"{path}.tmp-{os.getpid()}"
    with open(temporary, "w") as f:
        json.dump(data, f, indent=indent)
        f.flush()
        os.fsync(f.fileno())
    os.replace(temporary, path)
    fsync(os.path.dirname(os.path.abspath(path)))


def _owner_tag() -> str:
    """`PID.HOST`: the process writing, and a hash of this machine's name (a shared file system may have writers on
    other machines, whose process ids mean nothing here)."""
    host = hashlib.sha1(socket.gethostname().encode()).hexdigest()[:8]
    return f"{os.getpid()}.{host}"


def _hidden_prefix(output_dir: str, kind: str) -> str:
    return f".{os.path.basename(os.path.abspath(output_dir))}.{kind}-{_owner_tag()}-"


def temporary_dir_next_to(output_dir: str) -> str:
    """A new empty directory beside `output_dir` (same file system, so the final rename is atomic), named
    `.OUT.tmp-PID.HOST-XXXX` so that the next writer can tell it was left by a process that is gone."""
    parent = os.path.dirname(os.path.abspath(output_dir))
    os.makedirs(parent, exist_ok=True)
    temporary = tempfile.mkdtemp(prefix=_hidden_prefix(output_dir, "tmp"), dir=parent)
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(temporary, 0o777 & ~umask)  # mkdtemp makes it private; the result is an ordinary directory
    return temporary


def _exchange(a: str, b: str) -> bool:
    """Swap the directories `a` and `b` in one step (Linux `renameat2(RENAME_EXCHANGE)`); False where the kernel, the
    C library or the file system cannot."""
    import ctypes

    try:
        libc = ctypes.CDLL(None, use_errno=True)
        renameat2 = libc.renameat2
    except (OSError, AttributeError):
        return False
    at_fdcwd, rename_exchange = -100, 2
    if renameat2(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), rename_exchange) == 0:
        return True
    code = ctypes.get_errno()
    if code in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP, errno.ENOTSUP, errno.EXDEV):
        return False
    raise OSError(code, os.strerror(code), b)


def _remove(path: str) -> None:
    if os.path.islink(path) or not os.path.isdir(path):
        os.unlink(path)
    else:
        shutil.rmtree(path, ignore_errors=True)


def replace_dir(temporary: str, output_dir: str) -> None:
    """Move the finished `temporary` to `output_dir`, replacing what is there. An existing directory is swapped with
    the new one in one step where the kernel can (`_exchange`), so `output_dir` is never missing; elsewhere it is moved
    aside to `.OUT.old-PID.HOST-XXXX` first, and a crash between the two renames is undone by the next writer
    (`recover_output_dir` puts the old folder back). The old contents are removed after."""
    if not os.path.isdir(output_dir):
        os.replace(temporary, output_dir)
        return
    if _exchange(temporary, output_dir):
        _remove(temporary)  # now the old folder; a crash here leaves a stale .tmp- folder the next writer removes
        return
    old = tempfile.mkdtemp(prefix=_hidden_prefix(output_dir, "old"), dir=os.path.dirname(os.path.abspath(output_dir)))
    os.rmdir(old)
    os.replace(output_dir, old)
    os.replace(temporary, output_dir)
    _remove(old)


def _process_gone(pid: int) -> bool:
    """Whether process `pid` of this machine has ended (a zombie has). Never on Windows, where os.kill(pid, 0) would
    stop the process instead of probing it: nothing is cleaned up there."""
    if pid == os.getpid() or os.name == "nt":
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:  # another user's: running
        return False
    try:
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state in ("Z", "X")


def stale_dirs(output_dir: str) -> tuple[list[str], list[str]]:
    """(temporary folders, moved-aside old folders) next to `output_dir` that writers of it on this machine left when
    they were killed: named `.OUT.tmp-PID.HOST-XXXX` / `.OUT.old-PID.HOST-XXXX` with this host's hash and the id of a
    process that has ended. Newest first."""
    parent = os.path.dirname(os.path.abspath(output_dir))
    base = os.path.basename(os.path.abspath(output_dir))
    host = _owner_tag().split(".", 1)[1]
    pattern = re.compile(rf"\.{re.escape(base)}\.(tmp|old)-(\d+)\.{host}-\w+")
    found: dict[str, list[tuple[float, str]]] = {"tmp": [], "old": []}
    try:
        names = os.listdir(parent)
    except OSError:
        return [], []
    for name in names:
        match = pattern.fullmatch(name)
        if match and _process_gone(int(match.group(2))):
            path = os.path.join(parent, name)
            try:
                found[match.group(1)].append((os.lstat(path).st_mtime, path))
            except FileNotFoundError:  # removed meanwhile by another writer
                continue
    return tuple([p for _, p in sorted(found[kind], reverse=True)] for kind in ("tmp", "old"))


def recover_output_dir(output_dir: str) -> list[str]:
    """Undo what killed writers of `output_dir` left (`stale_dirs`): the old folder put back if `output_dir` is
    missing (a kill between the two renames of `replace_dir`), every other stale folder removed. Folders of running
    processes, of other machines and of other programs are left alone. Returns what was done, in words."""
    temporaries, olds = stale_dirs(output_dir)
    done = []
    if olds and not os.path.lexists(output_dir):
        try:
            os.rename(olds[0], output_dir)
            done.append(
                f"restored {output_dir} from {os.path.basename(olds.pop(0))}, which an interrupted "
                "replacement had moved aside"
            )
        except FileNotFoundError:  # another writer restored it meanwhile
            olds.pop(0)
    for path in temporaries + olds:
        _remove(path)
        if not os.path.lexists(path):
            done.append(f"removed {os.path.basename(path)}, left by an interrupted writer")
    unowned = _unowned_leftovers(output_dir)
    if unowned:
        done.append(
            f"left alone: {', '.join(unowned)} (no owner in the name: from an older mhmoe or another program; "
            "remove by hand if nothing is writing there)"
        )
    for line in done:
        logger.warning("%s", line)
    return done


def _unowned_leftovers(output_dir: str) -> list[str]:
    """Hidden `.OUT.tmp-XXXXXXXX` / `.OUT.old-XXXXXXXX` folders without an owner in the name (earlier mhmoe versions
    named them so): they cannot be proved stale, so they are only named."""
    parent = os.path.dirname(os.path.abspath(output_dir))
    pattern = re.compile(rf"\.{re.escape(os.path.basename(os.path.abspath(output_dir)))}\.(tmp|old)-[a-z0-9_]{{8}}")
    try:
        return sorted(n for n in os.listdir(parent) if pattern.fullmatch(n))
    except OSError:
        return []


def machine_error(error: type[ValueError], message: str) -> ValueError:
    """`error(message)` marked as a problem of the machine (full disk, read-only, permissions), not of the command's
    arguments: the command lines exit with status 1 for it (`exit_status`), 2 for the others."""
    problem = error(message)
    problem.exit_status = 1
    return problem


def exit_status(error: BaseException) -> int:
    """1 for a problem of the machine (`machine_error`), 2 for a refused argument or input."""
    return getattr(error, "exit_status", 2)


def size_words(size: int) -> str:
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if size >= scale:
            return f"{size / scale:.1f} {unit}"
    return f"{size} bytes"


def nearest_folder(path: str) -> str:
    """`path` if it is a folder, else its nearest parent that is (where a folder to be made there would live)."""
    folder = os.path.abspath(path)
    while not os.path.isdir(folder) and os.path.dirname(folder) != folder:
        folder = os.path.dirname(folder)
    return folder


def check_writable(output_dir: str, error: type[ValueError] = CheckpointError, needed: int | None = None) -> None:
    """Refuse, in one line, an `output_dir` that cannot be written: on a read-only file system, in a folder this user
    may not add to (where it and its temporary folder are made), or (`needed` bytes) on a file system with less free
    space. Raised as `machine_error`s."""
    existing = nearest_folder(os.path.dirname(os.path.abspath(output_dir)))
    if hasattr(os, "statvfs") and os.statvfs(existing).f_flag & os.ST_RDONLY:
        raise machine_error(
            error, f"cannot write {output_dir}: {existing} is on a read-only file system; choose another output folder"
        )
    if not os.access(existing, os.W_OK | os.X_OK):
        raise machine_error(
            error,
            f"cannot write {output_dir}: permission denied in {existing} (this user may not "
            "create files there); choose another output folder or fix its permissions",
        )
    free = shutil.disk_usage(existing).free
    if needed is not None and needed > free:
        raise machine_error(
            error,
            f"not enough disk space to write {output_dir}: {size_words(needed)} needed, "
            f"{size_words(free)} free in {existing}; free some space or choose another "
            "folder",
        )


def os_error_message(e: OSError, output_dir: str) -> str | None:
    """One line saying which problem an OSError met while writing `output_dir` is (full disk or quota, a file size
    limit, read-only file system, permission) and where; None for other errors."""
    where = getattr(e, "filename2", None) or e.filename or output_dir  # a copy or rename: filename2 is the target
    detail = f"{e.strerror or e} at {where}" if where != output_dir else f"{e.strerror or e}"
    if e.errno in (errno.ENOSPC, errno.EDQUOT):
        return f"not enough disk space to write {output_dir} ({detail}); free some space or choose another folder"
    if e.errno == errno.EFBIG:
        return (
            f"cannot write {output_dir}: a file grew past the largest file allowed ({detail}; the file system's "
            "limit or this shell's `ulimit -f`); raise the limit or choose another folder"
        )
    if e.errno == errno.EROFS:
        return f"cannot write {output_dir}: read-only file system ({detail}); choose another folder"
    if e.errno in (errno.EACCES, errno.EPERM):
        return f"cannot write {output_dir}: permission denied ({detail}); choose another folder or fix its permissions"
    return None


_WRITE_FAILED = re.compile(
    r"iostream error|file write failed|PytorchStreamWriter failed|Error while serializing|unexpected pos"
)  # (torch's zip writer on a full disk: "RuntimeError: ... unexpected pos ...")


def load_error_words(e: BaseException) -> str:
    """The first line of a load failure, for a one-line message. torch's refusal of a pickle holding more than tensors
    (`weights_only`) is said in our words: its advice to load with `weights_only=False` (which runs the file's code) is
    never repeated."""
    text = str(e).strip()
    if "Weights only load failed" in text:
        return "it holds Python objects other than tensors and plain data, which are never unpickled here"
    return f"{type(e).__name__}: {text.splitlines()[0][:200]}" if text else type(e).__name__


def write_error_message(e: BaseException, output_dir: str) -> str | None:
    """`os_error_message` for any error met while writing `output_dir`: an OSError, safetensors' SafetensorError
    (`... (os error 28)`), or torch.save's RuntimeError (which loses the error number: a full disk or a file size
    limit is then told from the file system's free space and this process's limit). None for other errors."""
    if isinstance(e, OSError):
        return os_error_message(e, output_dir)
    text = str(e)
    match = re.search(r"os error (\d+)", text)
    if match:
        code = int(match.group(1))
        return os_error_message(OSError(code, os.strerror(code)), output_dir)
    if not _WRITE_FAILED.search(text):
        return None
    existing = nearest_folder(output_dir)
    free = shutil.disk_usage(existing).free
    if free < 64 * 1024 * 1024:
        return os_error_message(OSError(errno.ENOSPC, f"{os.strerror(errno.ENOSPC)}: {free:,} bytes free"), output_dir)
    try:
        import resource

        limited = resource.getrlimit(resource.RLIMIT_FSIZE)[0] != resource.RLIM_INFINITY
    except ImportError:  # Windows
        limited = False
    if limited:
        return os_error_message(OSError(errno.EFBIG, os.strerror(errno.EFBIG)), output_dir)
    first = text.strip().splitlines()[0] if text.strip() else type(e).__name__
    return f"writing {output_dir} failed ({first}); is the disk full or damaged?"


# ---------------------------------------------------------------------------------- the files beside the weights

# what a checkpoint needs besides weights and config.json: copied from a source folder as they are (never code)
SIDE_FILES = (
    GENERATION_CONFIG_NAME,
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "tokenizer.model",
    "spiece.model",
    "sentencepiece.bpe.model",
    "vocab.json",
    "merges.txt",
    "vocab.txt",
    "chat_template.jinja",
    "chat_template.json",
)
SIDE_FOLDERS = {"additional_chat_templates": ".jinja"}  # folder: the suffix of the files copied from it
_CODE_KEYS = ("auto_map",)  # tokenizer_config.json keys that make Transformers import code named by the folder


def side_files(input_dir: str) -> tuple[list[str], list[str]]:
    """(relative paths of the files to copy beside the weights, notes on what was not copied and why).

    Only `SIDE_FILES` and the chat templates of `SIDE_FOLDERS`, as regular files (a symbolic link only when it stays in
    the folder, or leads from a snapshot of the active Hugging Face cache into its own repo's blobs/:
    `trust.link_allowed`). Never code (`*.py`) or anything else. The commands copy them from the folder's pinned copy
    (`trust.pinned`: the files as checked), never by the path checked here."""
    from .trust import link_allowed

    copy, links, other = [], [], []
    for name in sorted(os.listdir(input_dir)):
        path = os.path.join(input_dir, name)
        candidates = []
        if name in SIDE_FILES:
            candidates = [name]
        elif name in SIDE_FOLDERS and os.path.isdir(path) and not os.path.islink(path):
            candidates = [f"{name}/{n}" for n in sorted(os.listdir(path)) if n.endswith(SIDE_FOLDERS[name])]
        elif (
            not name.startswith(".")
            and not name.endswith((".safetensors", *PICKLE_SUFFIXES))
            and name not in (CONFIG_NAME, SAFE_INDEX_NAME, "README.md")
        ):
            other.append(name + ("/" if os.path.isdir(path) else ""))
        for relative in candidates:
            full = os.path.join(input_dir, relative)
            if os.path.islink(full) and not link_allowed(full, input_dir):
                links.append(relative)
            elif os.path.isfile(full):
                copy.append(relative)
    notes = []
    if links:
        notes.append(f"not copied, symbolic links out of the folder: {', '.join(links)}")
    if other:
        notes.append(f"not copied (not a weight, config, tokenizer or chat template file): {', '.join(other)}")
    return copy, notes


def drop_code_references(source: str, target: str | None = None) -> list[str]:
    """Write tokenizer_config.json `source` to `target` (default: in place) without the keys that make Transformers
    import code named by the folder (`auto_map`); returns the keys dropped (nothing is written when none)."""
    try:
        with open(source, encoding="utf-8") as f:
            config = json.load(f)
    except (json.JSONDecodeError, UnicodeDecodeError):
        return []
    if not isinstance(config, dict):
        return []
    dropped = [key for key in _CODE_KEYS if config.pop(key, None) is not None]
    if dropped:
        with open(target or source, "w", encoding="utf-8") as f:
            json.dump(config, f, indent=2, ensure_ascii=False)
            f.write("\n")
    return dropped


def copy_side_file(input_dir: str, relative: str, output_dir: str) -> str | None:
    """Copy one file of `side_files`; tokenizer_config.json loses an `auto_map` (it would make Transformers import code
    named by the folder, which is never copied). Returns a note when something was dropped."""
    source, target = os.path.join(input_dir, relative), os.path.join(output_dir, relative)
    os.makedirs(os.path.dirname(target), exist_ok=True)
    if relative == "tokenizer_config.json":
        dropped = drop_code_references(source, target)
        if dropped:
            return f"dropped {', '.join(dropped)} from tokenizer_config.json (custom tokenizer code is not copied)"
    shutil.copyfile(source, target)
    return None
