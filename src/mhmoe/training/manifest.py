"""A checkpoint's manifest: the size and SHA-256 of every file in it, written last, checked before resuming.

`Sealer(folder)` hashes (from the page cache) and flushes to disk every file Accelerate writes into a checkpoint folder
in background threads, each as soon as it is written, beside the writing of the next; `finish()` adds the files
written otherwise and writes `manifest.json` atomically: the last file written, the checkpoint's completion marker.
mhmoe-train calls `finish()` in a background thread while training goes on (`checkpoints.save_checkpoint`;
benchmarks/studies/checkpoint_hash.py measures what the manifest adds to a checkpoint). `verify(folder)` reads every listed
file back and raises `ManifestError` naming the first that is missing, not a regular file, of another size or
another hash (a flipped byte, a truncated or emptied file).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
from concurrent.futures import ThreadPoolExecutor

from .._plumbing.checkpoint_files import fsync, write_json_atomic

MANIFEST_FILE = "manifest.json"
FORMAT = 1
_CHUNK = 4 * 1024 * 1024


class ManifestError(ValueError):
    """A checkpoint folder that does not match its manifest, with the file and the reason in words."""


def sha256_file(path: str) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            digest.update(chunk)  # releases the GIL on large chunks: runs beside the flushes
    return digest.hexdigest()


def _files(folder: str) -> list[str]:
    """Relative paths of the files under `folder` (sorted), the manifest itself left out."""
    found = []
    for root, dirs, names in os.walk(folder):
        dirs.sort()
        for name in names:
            relative = os.path.relpath(os.path.join(root, name), folder)
            if relative != MANIFEST_FILE:
                found.append(relative.replace(os.sep, "/"))
    return sorted(found)


class Sealer:
    """Seal a checkpoint folder while it is being written. Create it before the folder's first file is written and
    write the files inside `hashing_writes()` (Accelerate's `save_state`): each file Accelerate writes is hashed and
    flushed in background threads as soon as it is closed, beside the writing of the next (hashlib and fsync release
    the GIL). `finish()` hashes and flushes what was written otherwise (tokenizer, config, state file), waits for the
    background work and writes the manifest (flushed, atomically), then flushes the folders."""

    def __init__(self, folder: str):
        self.folder = folder
        self._hashes: dict[str, object] = {}  # relative path -> Future of its SHA-256
        self._flushes = []
        self._hash_pool = ThreadPoolExecutor(max_workers=2)  # two files at once: the model and the optimizer state
        self._flush_pool = ThreadPoolExecutor(max_workers=1)

    def _relative(self, path: str) -> str:
        return os.path.relpath(os.path.abspath(path), os.path.abspath(self.folder)).replace(os.sep, "/")

    def add(self, path: str) -> None:
        """Start hashing and flushing the finished file `path` (inside the folder) in the background."""
        relative = self._relative(path)
        if relative not in self._hashes and os.path.isfile(path):
            self._hashes[relative] = self._hash_pool.submit(sha256_file, path)
            self._flushes.append(self._flush_pool.submit(fsync, path))

    @contextlib.contextmanager
    def hashing_writes(self):
        """Inside: every file Accelerate's `save` writes into the folder is handed to `add` once written."""
        try:
            import accelerate.checkpointing as checkpointing
        except ImportError:
            yield
            return
        original = getattr(checkpointing, "save", None)
        if original is None:  # another Accelerate: the files are hashed by finish()
            yield
            return

        def save_then_hash(obj, f, *args, **kwargs):
            original(obj, f, *args, **kwargs)
            if isinstance(f, (str, os.PathLike)) and not self._relative(os.fspath(f)).startswith(".."):
                self.add(os.fspath(f))

        checkpointing.save = save_then_hash
        try:
            yield
        finally:
            checkpointing.save = original

    def finish(self) -> dict:
        try:
            for relative in _files(self.folder):
                self.add(os.path.join(self.folder, *relative.split("/")))
            digests = {relative: future.result() for relative, future in self._hashes.items()}
            for flush in self._flushes:
                flush.result()
        finally:
            self.close()
        entries = {
            relative: {
                "size": os.path.getsize(os.path.join(self.folder, *relative.split("/"))),
                "sha256": digests[relative],
            }
            for relative in sorted(digests)
        }
        manifest = {"format": FORMAT, "files": entries}
        write_json_atomic(os.path.join(self.folder, MANIFEST_FILE), manifest)
        for root, _, _ in os.walk(self.folder):
            fsync(root)
        return manifest

    def close(self) -> None:
        self._hash_pool.shutdown(wait=True)
        self._flush_pool.shutdown(wait=True)


def read_manifest(folder: str) -> dict | None:
    """The manifest of `folder`; None when it has none (lost, or a checkpoint from before manifests). Raises `ManifestError` when
    it does not read back."""
    path = os.path.join(folder, MANIFEST_FILE)
    if not os.path.lexists(path):
        return None
    if os.path.islink(path) or not os.path.isfile(path):
        raise ManifestError(f"{path} is not a regular file")
    try:
        with open(path, encoding="utf-8") as f:
            manifest = json.load(f)
    except (OSError, ValueError) as e:
        what = "is empty" if os.path.getsize(path) == 0 else f"is not valid JSON ({e})"
        raise ManifestError(f"{path} {what}") from None
    files = manifest.get("files") if isinstance(manifest, dict) else None
    if not isinstance(files, dict) or not all(
        isinstance(v, dict) and isinstance(v.get("size"), int) and isinstance(v.get("sha256"), str)
        for v in files.values()
    ):
        raise ManifestError(f"{path} lists no files with sizes and hashes")
    return manifest


def verify(folder: str, manifest: dict | None = None) -> None:
    """Every file the manifest lists is a regular file of its size and SHA-256; raises `ManifestError` naming the
    first that is not."""
    manifest = manifest if manifest is not None else read_manifest(folder)
    if manifest is None:
        raise ManifestError(f"{os.path.join(folder, MANIFEST_FILE)} is missing")
    for relative, entry in sorted(manifest["files"].items()):
        path = os.path.join(folder, *relative.split("/"))
        if os.path.islink(path) or (os.path.lexists(path) and not os.path.isfile(path)):
            raise ManifestError(f"{path} is not a regular file")
        if not os.path.exists(path):
            raise ManifestError(f"{path} is missing")
        size = os.path.getsize(path)
        if size != entry["size"]:
            what = "empty" if size == 0 else "truncated" if size < entry["size"] else "longer than written"
            raise ManifestError(f"{path} is {what} ({size} bytes; {entry['size']} were written)")
        if sha256_file(path) != entry["sha256"]:
            raise ManifestError(
                f"{path} has changed since it was written (its SHA-256 differs from the manifest's: "
                "flipped bytes or a damaged disk)"
            )


__all__ = ["MANIFEST_FILE", "ManifestError", "Sealer", "read_manifest", "sha256_file", "verify"]
