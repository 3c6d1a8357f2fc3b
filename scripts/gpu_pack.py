"""What a GPU window carries besides the checkout, and how big the transfer is (scripts/gpu_run.sh pack / setup).

The device tool sends the tracked and untracked-not-ignored files of the checkout plus the carried paths, 64 MiB in
all; this project keeps every call under `PAYLOAD_LIMIT_MIB` (48). What is carried is only what the GPU image lacks:

  .gpu_wheels/   the Transformers wheel at the dev/CI pin (the image has 5.17; the project needs >=5.23):
                 `bash scripts/gpu_wheels.sh`, at most `CARRY_BUDGET_MIB[".gpu_wheels"]`
  .gpu_pack/     written by `pack`, at most `CARRY_BUDGET_MIB[".gpu_pack"]`:
                 provenance.json    the commit and a blob hash of every travelling file (benchmarks/_provenance.py)
                 corpus/            the corpus splits the GPU scales read (training and validation, not the test
                                    split), xz-compressed (33 + 2.7 MB -> ~7.5 MB), with their SHA-256 in manifest.json
                 seed/              optional, put there by hand: run bundles and probe files returned by an earlier
                                    call (`run.py --seed_from` / `--probe_file` read them), kept across packs

`unpack` (run by `gpu_run.sh setup` on the device) writes data/corpus/ back from the pack, byte for byte (checked).

    python scripts/gpu_pack.py pack [--corpus data/corpus] [--out .gpu_pack]
    python scripts/gpu_pack.py unpack [--pack .gpu_pack] [--corpus data/corpus]
    python scripts/gpu_pack.py payload [CARRIED ...]     # MiB that a call carrying CARRIED would send
"""

from __future__ import annotations

import argparse
import hashlib
import json
import lzma
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))  # benchmarks/_provenance.py
import _provenance  # noqa: E402

REPO = _provenance.REPO
PAYLOAD_LIMIT_MIB = 48  # the device tool's limit is 64 MiB; the rest is margin for files added later
CARRY = (".gpu_wheels", ".gpu_pack")  # what both calls of a window carry (benchmarks/README.md, "One GPU window")
CARRY_BUDGET_MIB = {".gpu_wheels": 14, ".gpu_pack": 10}  # the most each may hold: checked by pack and the tests
CORPUS_SPLITS = ("train", "validation")  # what the gpu scales read (harness.data_files); the test split stays home
MIB = 2**20


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def tree_bytes(root: Path = REPO) -> int:
    """Bytes of the files that travel with the checkout: tracked and untracked-not-ignored (a symbolic link as a link),
    and a shared/ folder where the checkout has one, as the device tool counts them."""
    listed = (
        subprocess.run(
            ["git", "ls-files", "-co", "--exclude-standard", "-z"], cwd=root, capture_output=True, check=True
        )
        .stdout.decode()
        .split("\0")
    )
    names = {name for name in listed if name}
    if (root / "shared").is_dir():
        names |= {str(p.relative_to(root)) for p in (root / "shared").rglob("*")}
    return sum(
        (root / name).lstat().st_size for name in names if os.path.lexists(root / name) and not (root / name).is_dir()
    )


def path_bytes(path: Path) -> int:
    """Bytes under a carried path (every file, links as links)."""
    if not os.path.lexists(path):
        return 0
    if path.is_file() or path.is_symlink():
        return path.lstat().st_size
    return sum(p.lstat().st_size for p in path.rglob("*") if not p.is_dir() or p.is_symlink())


def payload_bytes(carried: list[str], root: Path = REPO) -> dict:
    """{"tree": bytes, carried path: bytes, ..., "total": bytes} of one device call."""
    sizes = {"tree": tree_bytes(root), **{name: path_bytes(root / name) for name in carried}}
    return {**sizes, "total": sum(sizes.values())}


def _compress(source: Path, target: Path) -> None:
    tmp = target.with_name(f".{target.name}.tmp")
    with open(source, "rb") as f, lzma.open(tmp, "wb", preset=6) as out:
        shutil.copyfileobj(f, out, 1 << 20)
    os.replace(tmp, target)


def pack(corpus: Path, out: Path) -> Path:
    """Write `out` (see the module docstring): provenance.json always, corpus/ when `corpus` holds the splits (a split
    whose SHA-256 is unchanged is not compressed again), seed/ left as it is. Refuses a pack over its budget."""
    out.mkdir(parents=True, exist_ok=True)
    _provenance.pack(out)
    target = out / "corpus"
    if all((corpus / f"{split}.jsonl").is_file() for split in CORPUS_SPLITS):
        target.mkdir(exist_ok=True)
        manifest_path = target / "manifest.json"
        old = json.loads(manifest_path.read_text()) if manifest_path.is_file() else {}
        manifest = {"format": "mhmoe-gpu-corpus/1", "splits": {}}
        if (corpus / "manifest.json").is_file():
            manifest["source_manifest"] = json.loads((corpus / "manifest.json").read_text())
        for split in CORPUS_SPLITS:
            source = corpus / f"{split}.jsonl"
            digest = _sha256(source)
            packed = target / f"{split}.jsonl.xz"
            if old.get("splits", {}).get(split, {}).get("sha256") != digest or not packed.is_file():
                _compress(source, packed)
            manifest["splits"][split] = {
                "sha256": digest,
                "bytes": source.stat().st_size,
                "packed_bytes": packed.stat().st_size,
            }
        tmp = manifest_path.with_name(".manifest.json.tmp")
        tmp.write_text(json.dumps(manifest, indent=1) + "\n")
        os.replace(tmp, manifest_path)
    else:
        print(
            f"gpu_pack: no corpus at {corpus} (bash scripts/get_corpus.sh): the pack has none, so the reproduction "
            "stage will be skipped on the GPU machine",
            file=sys.stderr,
        )
    size = path_bytes(out)
    if size > CARRY_BUDGET_MIB[".gpu_pack"] * MIB:
        raise SystemExit(
            f"error: {out} holds {size / MIB:.1f} MiB, over its budget of "
            f"{CARRY_BUDGET_MIB['.gpu_pack']} MiB (gpu_pack.CARRY_BUDGET_MIB): remove what seed/ does "
            "not need"
        )
    return out


def unpack(pack_dir: Path, corpus: Path) -> bool:
    """data/corpus/ from the pack (checked against the manifest's SHA-256); False when the pack holds no corpus."""
    manifest_path = pack_dir / "corpus" / "manifest.json"
    if not manifest_path.is_file():
        return False
    manifest = json.loads(manifest_path.read_text())
    corpus.mkdir(parents=True, exist_ok=True)
    for split, entry in manifest["splits"].items():
        target = corpus / f"{split}.jsonl"
        if target.is_file() and _sha256(target) == entry["sha256"]:
            continue
        fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", dir=corpus)
        with os.fdopen(fd, "wb") as out, lzma.open(pack_dir / "corpus" / f"{split}.jsonl.xz", "rb") as f:
            shutil.copyfileobj(f, out, 1 << 20)
        if _sha256(Path(tmp)) != entry["sha256"]:
            os.unlink(tmp)
            raise SystemExit(f"error: {split}.jsonl from {pack_dir} does not match its SHA-256: pack it again")
        os.replace(tmp, target)
    if "source_manifest" in manifest:
        (corpus / "manifest.json").write_text(json.dumps(manifest["source_manifest"], indent=1) + "\n")
    return True


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("pack")
    p.add_argument("--corpus", type=Path, default=REPO / "data" / "corpus")
    p.add_argument("--out", type=Path, default=REPO / ".gpu_pack")
    u = sub.add_parser("unpack")
    u.add_argument("--pack", type=Path, default=REPO / ".gpu_pack")
    u.add_argument("--corpus", type=Path, default=REPO / "data" / "corpus")
    s = sub.add_parser("payload")
    s.add_argument("carried", nargs="*", default=list(CARRY))
    args = parser.parse_args(argv)
    if args.command == "pack":
        print(f"gpu_pack: wrote {pack(args.corpus, args.out)}")
        args = parser.parse_args(["payload"])
    if args.command == "unpack":
        print("gpu_pack: data/corpus from the pack" if unpack(args.pack, args.corpus) else "gpu_pack: no corpus packed")
        return 0
    sizes = payload_bytes(args.carried)
    parts = ", ".join(f"{name} {size / MIB:.1f}" for name, size in sizes.items() if name != "total")
    print(f"gpu_pack: payload {sizes['total'] / MIB:.1f} MiB ({parts}; limit {PAYLOAD_LIMIT_MIB} MiB)")
    if sizes["total"] > PAYLOAD_LIMIT_MIB * MIB:
        print(
            f"error: over {PAYLOAD_LIMIT_MIB} MiB: the device tool would refuse the call or leave no margin",
            file=sys.stderr,
        )
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
