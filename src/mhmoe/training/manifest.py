"""A checkpoint's manifest: the size and SHA-256 of every file in it, written last, checked before resuming.

`seal(folder)` flushes every file of a finished checkpoint folder to disk and hashes it at the same time (the hashes
are computed from the page cache while the disk flush waits on the device; benchmarks/checkpoint_hash.py measures what
this adds to a checkpoint), then writes `manifest.json` atomically: the last file written, the checkpoint's
completion marker. `verify(folder)` reads every listed file back and raises `ManifestError` naming the first that is
missing, not a regular file, of another size or another hash (a flipped byte, a truncated or emptied file).
"""

from __future__ import annotations

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


def seal(folder: str) -> dict:
    """Flush every file under `folder` to disk while hashing it, then write the manifest (flushed, atomically) and
    flush the folders. Returns the manifest."""
    files = _files(folder)
    paths = [os.path.join(folder, *relative.split("/")) for relative in files]
    with ThreadPoolExecutor(max_workers=1) as flusher:  # the disk flushes in the background, the hashes here
        flushed = flusher.submit(lambda: [fsync(path) for path in paths])
        entries = {
            relative: {"size": os.path.getsize(path), "sha256": sha256_file(path)}
            for relative, path in zip(files, paths)
        }
        flushed.result()
    manifest = {"format": FORMAT, "files": entries}
    write_json_atomic(os.path.join(folder, MANIFEST_FILE), manifest)
    for root, _, _ in os.walk(folder):
        fsync(root)
    return manifest


def read_manifest(folder: str) -> dict | None:
    """The manifest of `folder`; None when it has none (a checkpoint of an older mhmoe). Raises `ManifestError` when
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


__all__ = ["MANIFEST_FILE", "ManifestError", "read_manifest", "seal", "sha256_file", "verify"]
