"""What the command lines read from a user's folder: never its code, never a file through a link out of it, and each
file as it was when it was checked.

Code: Transformers imports the Python files a folder's `config.json` or `tokenizer_config.json` names in an `auto_map`
when asked to (`trust_remote_code=True`), and asks on the terminal when not told either way. Every `from_pretrained`
in mhmoe passes `trust_remote_code` explicitly (False unless the user passed `--trust_remote_code`;
tests/_plumbing/test_trust.py reads the source for it), and `load_tokenizer` / `load_config` turn Transformers' refusal
into one line saying which folder needs code and how to allow it.

Links: a checkpoint folder whose files are symbolic links to files outside it (`vocab.txt -> /etc/passwd`) would make
a command read, copy, re-save and upload those files. A link is followed only when it stays inside the folder, or when
the folder is a snapshot of the active Hugging Face cache (`hub_cache`: `HF_HUB_CACHE` as the environment says now),
at or below `<cache>/models--<org>--<name>/snapshots/<revision>`, and the link leads into that same repo's `blobs/`
(how the cache stores its files). A `models--x/blobs/` path anywhere else, or another repo's blobs, is a link out.
`check_links` refuses a folder holding a link out, in one line, before anything reads it.

Checked once, then read: a check by path and a later read by path let a file be swapped for a link in between.
`pinned(folder, ...)` opens each file the commands read once (the top-level files, and in `SUBFOLDERS` the chat
templates and the conversion record), checks what was opened on the descriptor (the real path the kernel opened, by
the rule above; a regular file) and puts that very file into a private temporary folder (mode 0700) under the same
names: a hard link to the opened file; where none can be made (another file system), a symbolic link to the
descriptor, kept open (`/proc/<pid>/fd/<n>`, Linux); else a copy read from the descriptor. The commands read the pinned
folder, and their errors name the user's folder (`Pinned.rename`). Python files are pinned only for a caller that
trusts the folder's code. The pinned folder is removed when its `with` block ends, when the object loaded from it is
garbage (`Pinned.keep_with`: a tokenizer re-reads its vocabulary file when saved), or at exit; one a killed process
left is removed by the next command that pins a folder (`_sweep`: its lock is free). A string that is not a local
folder (a Hub repo id) passes through unchanged.
"""

from __future__ import annotations

import contextlib
import errno
import glob
import os
import shutil
import stat
import tempfile
import weakref

_CODE_REFUSED = "trust_remote_code=True"  # in Transformers' ValueError when a folder's code would be needed
# what the commands read from subfolders of an input folder: {subfolder: the suffix of its files}
SUBFOLDERS = {"additional_chat_templates": ".jinja", "converted": ".json"}
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".h5", ".msgpack", ".gguf", ".onnx")
try:
    import fcntl
except ImportError:  # Windows
    fcntl = None

_FDS = "/proc/self/fd"  # where Linux names the files a process has open
_PREFIX = "mhmoe-pinned-"  # the private folders in the temporary directory
_LIVE: dict[str, str] = {}  # the real path of each pinned folder alive: the user's folder it holds
_KEPT: list = []  # pins kept for objects that cannot be weakly referenced: until exit


def code_refusal(
    error: Exception, path, what: str, flag: str = "--trust_remote_code", read: str | None = None
) -> str | None:
    """One line for Transformers' refusal to load `path` without running its code; None for any other error. `read`:
    where the folder's files are read (its pinned copy; default `path`)."""
    if not isinstance(error, ValueError) or _CODE_REFUSED not in str(error):
        return None
    found = _code_named(read or path).items()
    named = "; ".join(f"{name}'s auto_map names {', '.join(files)}" for name, files in found)
    return (
        f"the {what} in {path} needs the folder's own Python code, which is never run unless you pass {flag} "
        f"(only for folders you trust){': ' + named if named else ''}"
    )


def _code_named(path) -> dict[str, list[str]]:
    """{file: [module files]} named by the `auto_map` of the folder's tokenizer_config.json and config.json."""
    import json

    found = {}
    for name in ("tokenizer_config.json", "config.json"):
        try:
            with open(os.path.join(path, name), encoding="utf-8") as f:
                auto_map = json.load(f).get("auto_map") or {}
        except (OSError, ValueError, AttributeError):
            continue
        references = [r for v in auto_map.values() for r in (v if isinstance(v, list) else [v]) if isinstance(r, str)]
        modules = sorted({r.split("--")[-1].rsplit(".", 1)[0] + ".py" for r in references})
        if modules:
            found[name] = modules
    return found


def load_tokenizer(
    path,
    error: type[Exception],
    trust_remote_code: bool = False,
    what: str = "tokenizer",
    flag: str = "--trust_remote_code",
    **kwargs,
):
    """`AutoTokenizer.from_pretrained(path, trust_remote_code=...)` of the folder's files as `pinned` checks them (kept
    while the tokenizer lives). Raises `error` in one line for broken files (`tokenizer_files`), a tokenizer that needs
    the folder's code without `trust_remote_code`, and any other failure to load."""
    from transformers import AutoTokenizer

    from .tokenizer_files import load_failure, tokenizer_problem

    source = pinned(path, error, f"{what} folder", code=trust_remote_code, weights=False)
    with source.renaming():
        problem = tokenizer_problem(source.path)
        if problem:
            raise error(problem)
        try:
            tokenizer = AutoTokenizer.from_pretrained(source.path, trust_remote_code=trust_remote_code, **kwargs)
        except Exception as e:  # Transformers' and the tokenizers library's errors, in one line
            raise error(code_refusal(e, path, what, flag, read=source.path) or load_failure(source.path, e)) from None
    return source.keep_with(tokenizer)


def load_config(
    path, error: type[Exception], trust_remote_code: bool = False, flag: str = "--trust_remote_code", **kwargs
):
    """`AutoConfig.from_pretrained(path, trust_remote_code=...)` of the folder's files as `pinned` checks them,
    refusing a config that needs code in one line."""
    from transformers import AutoConfig

    with pinned(path, error, "config folder", code=trust_remote_code, weights=False) as source:
        try:
            return AutoConfig.from_pretrained(source.path, trust_remote_code=trust_remote_code, **kwargs)
        except ValueError as e:
            message = code_refusal(e, path, "config", flag, read=source.path)
            if message is None:
                raise
            raise error(message) from None


def hub_cache() -> str:
    """The Hugging Face hub cache in use, with the environment read now (as `huggingface_hub.constants.HF_HUB_CACHE`
    reads it at import): HF_HUB_CACHE, HUGGINGFACE_HUB_CACHE, HF_HOME/hub, XDG_CACHE_HOME/huggingface/hub, else
    huggingface_hub's own value (~/.cache/huggingface/hub)."""
    env = os.environ.get
    cache = env("HF_HUB_CACHE") or env("HUGGINGFACE_HUB_CACHE")
    if not cache and (env("HF_HOME") or env("XDG_CACHE_HOME")):
        cache = os.path.join(env("HF_HOME") or os.path.join(env("XDG_CACHE_HOME"), "huggingface"), "hub")
    if not cache:
        from huggingface_hub import constants

        cache = constants.HF_HUB_CACHE
    return os.path.expandvars(os.path.expanduser(cache))


def _hub_repo(root: str) -> str | None:
    """`<cache>/models--<X>` when the real folder `root` is at or below `<cache>/models--<X>/snapshots/<revision>` of
    the active cache (`hub_cache`); None otherwise."""
    cache = os.path.realpath(hub_cache())
    if not root.startswith(cache + os.sep):
        return None
    parts = root[len(cache) + 1 :].split(os.sep)
    if len(parts) >= 3 and parts[0].startswith("models--") and parts[1] == "snapshots" and parts[2]:
        return os.path.join(cache, parts[0])
    return None


def _allowed(real: str, root: str) -> bool:
    """Whether a file whose real path is `real` may be read for the folder whose real path is `root`: it is inside
    the folder, or the folder is a cache snapshot and the file a blob of the same repo."""
    if real == root or real.startswith(root + os.sep):
        return True
    repo = _hub_repo(root)
    return repo is not None and os.path.dirname(real) == os.path.join(repo, "blobs")


def link_allowed(path: str, folder: str) -> bool:
    """Whether the symbolic link `path` in `folder` may be followed: it stays inside the folder, or `folder` is a
    snapshot of the active Hugging Face cache and the link leads into its own repo's `blobs/` (the module docstring).
    Everything in a folder `pinned` made was checked already."""
    root = os.path.realpath(folder)
    return root in _LIVE or _allowed(os.path.realpath(path), root)


def links_out(folder: str, limit: int = 1000) -> list[str]:
    """Relative paths of the symbolic links in `folder` (at any depth; linked folders are not entered) that lead out
    of it (`link_allowed`)."""
    found = []
    if os.path.realpath(folder) in _LIVE:
        return found
    for root, dirs, files in os.walk(folder):
        for name in dirs + files:
            path = os.path.join(root, name)
            if os.path.islink(path) and not link_allowed(path, folder):
                found.append(os.path.relpath(path, folder))
                if len(found) >= limit:
                    return found
    return found


def _refusal(what: str, folder: str, found: list[tuple[str, str]]) -> str:
    """The one line refusing `folder` for its links out: [(relative name, where it leads)]."""
    shown = ", ".join(f"{name} -> {real}" for name, real in found[:3])
    more = f" and {len(found) - 3} more" if len(found) > 3 else ""
    return (
        f"{what} {folder} holds symbolic links out of the folder ({shown}{more}); nothing is read through "
        "them: copy the files into the folder if you mean to use them, or remove the links"
    )


def check_links(folder, error: type[Exception], what: str) -> None:
    """Refuse, in one line, a folder holding symbolic links out of it (`links_out`): nothing is read through them."""
    folder = os.fspath(folder)
    if not os.path.isdir(folder):
        return
    found = links_out(folder)
    if found:
        raise error(_refusal(what, folder, [(n, os.path.realpath(os.path.join(folder, n))) for n in found]))


class Pinned:
    """The files of a user's folder as `pinned` opened and checked them: read them from `path` (the user's `folder`
    itself when it is not a local folder). A context manager: on leaving, errors name `folder` instead of `path` and
    the pinned folder is removed."""

    def __init__(self, folder: str, path: str, fds: list[int] | None = None):
        self.folder, self.path = folder, path
        self._release = None
        if path != folder:
            _LIVE[os.path.realpath(path)] = folder
            self._release = weakref.finalize(self, _release, path, fds if fds is not None else [])

    def close(self) -> None:
        """Remove the pinned folder (and close the descriptors it holds open)."""
        if self._release is not None:
            self._release()

    def keep_with(self, obj):
        """Keep the pinned folder while `obj` (what was loaded from it) lives; returns `obj`."""
        try:
            weakref.finalize(obj, self.close)
        except TypeError:  # not weakly referenceable: kept until exit
            _KEPT.append(self)
        return obj

    def rename(self, error: BaseException) -> None:
        """`error`'s message (its string arguments, an OSError's file names) names the user's folder, not the pinned
        one; changed in place."""
        if self.path == self.folder:
            return

        def named(value):
            return value.replace(self.path, self.folder) if isinstance(value, str) else value

        error.args = tuple(named(a) for a in error.args)
        if isinstance(error, OSError):
            error.filename, error.filename2 = named(error.filename), named(error.filename2)

    @contextlib.contextmanager
    def renaming(self):
        """A block whose errors name the user's folder; on an error the pinned folder is removed."""
        try:
            yield self
        except BaseException as e:
            self.rename(e)
            self.close()
            raise

    def __enter__(self) -> Pinned:
        return self

    def __exit__(self, kind, error, traceback) -> None:
        if error is not None:
            self.rename(error)
        self.close()


def _release(path: str, fds: list[int]) -> None:
    _LIVE.pop(os.path.realpath(path), None)
    shutil.rmtree(os.path.dirname(path), ignore_errors=True)
    for fd in fds:  # the folder's lock last
        with contextlib.suppress(OSError):
            os.close(fd)


def _private_folder(fds: list[int]) -> str:
    """A new private (0700) temporary folder, locked (`flock`) while this process lives: `_sweep` removes those whose
    process is gone (a killed command's pinned files, whose hard links would keep deleted files on disk)."""
    _sweep()
    making = os.path.realpath(tempfile.mkdtemp(prefix="mhmoe-pinning-"))
    if fcntl is None:  # Windows: not swept
        return making
    lock = os.open(os.path.join(making, ".lock"), os.O_CREAT | os.O_RDWR | getattr(os, "O_CLOEXEC", 0), 0o600)
    fds.append(lock)
    fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    top = os.path.join(os.path.dirname(making), _PREFIX + os.path.basename(making).removeprefix("mhmoe-pinning-"))
    os.rename(making, top)  # visible to `_sweep` only once locked
    return top


def _sweep() -> None:
    """Remove the pinned folders of processes gone: those whose lock can be taken."""
    if fcntl is None:
        return
    for top in glob.glob(os.path.join(glob.escape(tempfile.gettempdir()), _PREFIX + "*")):
        try:
            lock = os.open(os.path.join(top, ".lock"), os.O_RDWR | getattr(os, "O_CLOEXEC", 0))
        except OSError:  # another user's, or being removed
            continue
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)  # held by a live process (this one too): refused
            shutil.rmtree(top, ignore_errors=True)
        except OSError:
            pass
        finally:
            os.close(lock)


def pinned(folder, error: type[Exception], what: str, code: bool = False, weights=True) -> Pinned:
    """The files of `folder` the commands read (top-level files; the `SUBFOLDERS` files), each opened once, checked on
    its descriptor and placed in a private temporary folder (the module docstring). `code`: Python files too (the
    caller trusts the folder's code); `weights`: every weight file (True), none (False: a tokenizer's or config's
    folder), or those named (a GGUF file). Refuses, in one line naming the user's folder (`error`, "`what` FOLDER
    holds symbolic links out of the folder (...)"), a link out, and a file it cannot read. A string that is not a
    local folder, and a folder pinned already, pass through unchanged."""
    folder = os.fspath(folder)
    if not os.path.isdir(folder) or os.path.realpath(folder) in _LIVE:
        source = Pinned(folder, folder)
        source.folder = _LIVE.get(os.path.realpath(folder), folder)  # pinned already: the folder the files came from
        return source
    check_links(folder, error, what)
    root = os.path.realpath(folder)
    fds: list[int] = []
    path = os.path.join(_private_folder(fds), os.path.basename(os.path.abspath(folder)) or "folder")
    os.mkdir(path, 0o700)
    pin = Pinned(folder, path, fds)

    def refused(link: tuple[str, str] | None, why: str | None = None) -> Exception:
        return error(why or _refusal(what, folder, [link]))

    with pin.renaming():
        for relative in _wanted(folder, code, weights):
            _pin_file(folder, root, relative, path, fds, refused)
    return pin


def _wanted(folder: str, code: bool, weights) -> list[str]:
    """The relative paths `pinned` opens: every top-level name (what is no regular file is skipped) but code and
    weights unless asked for, and the files of `SUBFOLDERS` with their suffix."""
    found = []
    for name in sorted(os.listdir(folder)):
        full = os.path.join(folder, name)
        weight = name.endswith(WEIGHT_SUFFIXES) and not (weights is True or (weights and name in weights))
        if name in SUBFOLDERS and os.path.isdir(full):
            found += [f"{name}/{n}" for n in sorted(os.listdir(full)) if n.endswith(SUBFOLDERS[name])]
        elif (code or not name.endswith(".py")) and not weight:
            found.append(name)
    return found


def _pin_file(folder: str, root: str, relative: str, target: str, fds: list[int], refused) -> None:
    """Open `folder/relative` once; refuse (`refused((relative, real path))`) a file opened out of the folder, or one
    that cannot be read (`refused(None, why)`); put a regular file at `target/relative` (`_place`)."""
    source = os.path.join(folder, relative)
    flags = os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0) | getattr(os, "O_BINARY", 0)
    try:
        if not stat.S_ISREG(os.stat(source).st_mode):  # a folder, FIFO or device is not opened (checked again below)
            return
        fd = os.open(source, flags)  # O_NONBLOCK: a FIFO swapped in does not block; it is no regular file
    except OSError as e:
        if e.errno in (errno.ENOENT, errno.ELOOP, errno.ENXIO):  # gone since listed, a dangling link, a socket
            return
        raise refused(None, f"cannot read {source}: {e.strerror or e}") from None
    kept = False
    try:
        info = os.fstat(fd)
        real = _opened(fd, source, info)
        if real is None or not _allowed(real, root):
            raise refused((relative, real or os.path.realpath(source)))
        if stat.S_ISREG(info.st_mode):
            destination = os.path.join(target, relative)
            os.makedirs(os.path.dirname(destination), mode=0o700, exist_ok=True)
            kept = _place(fd, real, info, destination)
    finally:
        if kept:
            fds.append(fd)
        else:
            os.close(fd)


def _opened(fd: int, source: str, info: os.stat_result) -> str | None:
    """The real path of the file open as `fd`: as the kernel names it (Linux), else the real path of `source` while
    that is still the file opened; None when it cannot be told."""
    with contextlib.suppress(OSError):
        return os.readlink(f"{_FDS}/{fd}")
    real = os.path.realpath(source)
    try:
        return real if os.path.samestat(os.stat(real), info) else None
    except OSError:
        return None


def _place(fd: int, real: str, info: os.stat_result, destination: str) -> bool:
    """Put the file open as `fd` at `destination`: a hard link to it, else (Linux) a symbolic link to its descriptor
    (True: keep `fd` open), else a copy read from the descriptor."""
    with contextlib.suppress(OSError):  # the inode opened, whatever the path says now (not every kernel allows it)
        os.link(f"{_FDS}/{fd}", destination, follow_symlinks=True)
        return False
    with contextlib.suppress(OSError, NotImplementedError):  # by path: kept only when it is the inode opened
        os.link(real, destination, follow_symlinks=False)
        if os.path.samestat(os.lstat(destination), info):
            return False
        os.unlink(destination)  # `real` was replaced meanwhile
    if os.path.isdir(_FDS):  # another file system, hard links refused (EPERM): the descriptor itself, kept open
        with contextlib.suppress(OSError):
            os.symlink(f"/proc/{os.getpid()}/fd/{fd}", destination)
            return True
    with os.fdopen(fd, "rb", closefd=False) as data, open(destination, "wb") as copy:
        data.seek(0)
        shutil.copyfileobj(data, copy, 1 << 20)
    return False


__all__ = [
    "SUBFOLDERS",
    "WEIGHT_SUFFIXES",
    "Pinned",
    "check_links",
    "code_refusal",
    "hub_cache",
    "link_allowed",
    "links_out",
    "load_config",
    "load_tokenizer",
    "pinned",
]
