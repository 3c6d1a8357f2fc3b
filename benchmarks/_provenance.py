"""Where a benchmark or reproduction result came from: commit, dirty flag, and the environment switches that change
behaviour. One answer for every results file (gpu_moe.py, the reproduction harness, scripts/gpu_run.sh).

Locally the commit comes from git. On a lent GPU machine it cannot: the checkout travels without a usable `.git` (in the
2026-11-26 window its `.git` was another checkout's and reported a stale commit, dirty). So `python
benchmarks/_provenance.py pack DIR` (run by `scripts/gpu_run.sh pack`, before the window, in the checkout that travels)
writes DIR/provenance.json: the commit, whether tracked files differed from it, and a git blob hash of every file that
travels (tracked and untracked-not-ignored). On the GPU machine `MHMOE_PROVENANCE=DIR/provenance.json` makes
`git_state()` hash the files again: the commit is the packed one, `tree_verified` says whether every packed file
arrived unchanged, and a changed or missing file marks the result dirty (listed in `changed_files`). What git says on
that machine is kept as `device_git_reported`, for the record only.

    python benchmarks/_provenance.py pack DIR      # DIR/provenance.json for the tree as it is now
    python benchmarks/_provenance.py show          # the provenance a result written here would record (JSON)
"""

from __future__ import annotations

import datetime
import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PACK_ENV = "MHMOE_PROVENANCE"  # path of a provenance.json written by `pack` (scripts/gpu_run.sh exports it)
PACK_FORMAT = "mhmoe-provenance/1"
# environment variables that change what the models compute or which kernels run: recorded with every result
BEHAVIOUR_ENV_PREFIXES = ("MHMOE_", "TRITON_INTERPRET", "CUBLAS_WORKSPACE_CONFIG", "NVIDIA_TF32_OVERRIDE")


def _git(*args: str) -> str:
    return subprocess.run(["git", *args], cwd=REPO, capture_output=True, text=True, check=True).stdout.strip()


def local_git_state() -> dict:
    """{"commit", "dirty"} from git (untracked files do not count as dirty); None values without git."""
    try:
        return {
            "commit": _git("rev-parse", "--short", "HEAD"),
            "dirty": bool(_git("status", "--porcelain", "--untracked-files=no")),
        }
    except (OSError, subprocess.CalledProcessError):
        return {"commit": None, "dirty": None}


def blob_hash(path: Path) -> str:
    """Git's blob hash of a file's bytes (what `git hash-object` prints), computed without git."""
    data = path.read_bytes()
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def travelling_files() -> list[str]:
    """The files that travel to a device machine with the checkout: tracked and untracked-not-ignored."""
    return sorted(p for p in _git("ls-files", "-co", "--exclude-standard", "-z").split("\0") if p)


def pack(out_dir: Path) -> Path:
    """Write out_dir/provenance.json for the tree as it is now (see the module docstring)."""
    state = local_git_state()
    if state["commit"] is None:
        raise SystemExit("error: provenance pack needs git and a checkout (run it where the GPU call is made from)")
    files = {name: blob_hash(REPO / name) for name in travelling_files() if (REPO / name).is_file()}
    record = {
        "format": PACK_FORMAT,
        **state,
        "commit_full": _git("rev-parse", "HEAD"),
        "packed_utc": utc_now(),
        "files": files,
    }
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / "provenance.json"
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(record, indent=1, sort_keys=True) + "\n")
    os.replace(tmp, path)
    return path


def verify_pack(path: Path) -> dict:
    """The commit recorded in a pack, checked against the files here: {"commit", "dirty", "tree_verified",
    "changed_files", "commit_source", "device_git_reported"}."""
    record = json.loads(path.read_text())
    if record.get("format") != PACK_FORMAT:
        raise SystemExit(
            f"error: {path} is not a provenance pack ({PACK_FORMAT}); write it with `bash scripts/gpu_run.sh pack`"
        )
    changed = []
    for name, expected in record["files"].items():
        file = REPO / name
        if not file.is_file() or blob_hash(file) != expected:
            changed.append(name)
    return {
        "commit": record["commit"],
        "dirty": bool(record["dirty"] or changed),
        "tree_verified": not changed,
        "changed_files": changed[:50],
        "commit_source": f"packed {record['packed_utc']} "
        "(scripts/gpu_run.sh pack), every packed file's blob hash checked here",
        "device_git_reported": local_git_state(),
    }


def git_state() -> dict:
    """The commit and dirty flag for a result written now: from the pack named by $MHMOE_PROVENANCE when set (a GPU
    machine), else from git."""
    pack_path = os.environ.get(PACK_ENV)
    if pack_path:
        return verify_pack(Path(pack_path))
    return local_git_state()


def behaviour_env() -> dict:
    """The environment variables set now that change what runs (`BEHAVIOUR_ENV_PREFIXES`)."""
    return {k: v for k, v in sorted(os.environ.items()) if k.startswith(BEHAVIOUR_ENV_PREFIXES) and k != PACK_ENV}


def utc_now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["pack"] and len(argv) == 2:
        print(pack(Path(argv[1])))
        return 0
    if argv == ["show"]:
        print(json.dumps({**git_state(), "env": behaviour_env()}, indent=1))
        return 0
    print(__doc__.split("\n\n")[-1], file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
