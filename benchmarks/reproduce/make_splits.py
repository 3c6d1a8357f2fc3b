#!/usr/bin/env python
"""Write train / validation / test JSONL splits by document from folders of reStructuredText sources (*.rst.txt).

Each file is one document; its split is fixed by a hash of "LABEL/relative path" (about 90 / 5 / 5),
so the split does not depend on file order or on the other documents. Writes OUT/{train,validation,test}.jsonl and
manifest.json (packages, documents, words and SHA-256 per split) atomically (a temporary folder renamed at the end).
Called by scripts/get_corpus.sh.
"""

import argparse
import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path

SPLITS = (("train", 90), ("validation", 5), ("test", 5))  # percent
MIN_WORDS = 20  # skip stubs (index pages, a bare title)


def split_of(name: str) -> str:
    bucket = int(hashlib.sha256(name.encode()).hexdigest(), 16) % 100
    for split, percent in SPLITS:
        if bucket < percent:
            return split
        bucket -= percent
    raise AssertionError("unreachable")


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--source", action="append", required=True, help="LABEL=FOLDER of *.rst.txt files")
    parser.add_argument("--debs", help="lines 'package version sha256 bytes' recorded in the manifest")
    parser.add_argument("--out", required=True)
    args = parser.parse_args(argv)

    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}-", dir=out.parent))
    try:
        files = {split: open(tmp / f"{split}.jsonl", "w", encoding="utf-8") for split, _ in SPLITS}
        stats = {split: {"documents": 0, "words": 0} for split, _ in SPLITS}
        for source in args.source:
            label, _, folder = source.partition("=")
            if not folder:
                parser.error(f"--source takes LABEL=FOLDER, got {source!r}")
            root = Path(folder)
            paths = sorted(root.rglob("*.rst.txt"))
            if not paths:
                parser.error(f"no *.rst.txt files under {root}")
            for path in paths:
                text = path.read_text(encoding="utf-8", errors="replace").strip()
                words = len(text.split())
                if words < MIN_WORDS:
                    continue
                split = split_of(f"{label}/{path.relative_to(root)}")
                files[split].write(json.dumps({"text": text}) + "\n")
                stats[split]["documents"] += 1
                stats[split]["words"] += words
        for f in files.values():
            f.close()
        for split, _ in SPLITS:
            stats[split]["sha256"] = hashlib.sha256((tmp / f"{split}.jsonl").read_bytes()).hexdigest()
        packages = []
        if args.debs:
            for line in Path(args.debs).read_text().splitlines():
                name, version, sha, size = line.split()
                packages.append({"package": name, "version": version, "sha256": sha, "bytes": int(size)})
        manifest = {
            "packages": packages,
            "splits": stats,
            "split_rule": "sha256(path) % 100: <90 train, <95 validation, else test",
            "min_words": MIN_WORDS,
        }
        (tmp / "manifest.json").write_text(json.dumps(manifest, indent=2) + "\n")
        if out.exists():
            shutil.rmtree(out)
        os.replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    for split, _ in SPLITS:
        print(f"{split:10s} {stats[split]['documents']:6d} documents {stats[split]['words']:9,d} words")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
