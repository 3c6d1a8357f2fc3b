#!/usr/bin/env python
"""A calibration text of two domains for `mhmoe-convert --calibration_file` (issue 31: recovery on text of another
domain): Python's documentation (the converter's default calibration text) interleaved with Linux kernel documentation
(from `scripts/get_corpus.sh`'s corpus), 3,000 characters of each in turn.

    bash scripts/get_corpus.sh <corpus>
    python benchmarks/studies/moh_mixed_calibration.py --corpus <corpus> --out <workdir>/mixed.txt

The Linux documents are the corpus's training documents that start with an SPDX licence line or name the kernel in
their first 2,000 characters, every k-th of them (about 60), each's first 3,000 characters; the Python pieces are the
default calibration text's in order. The converter takes the first `--calibration_tokens` tokens of the file: 8,192
tokens of SmolLM2's tokenizer are its first 33,297 characters (6 Python pieces, 5 kernel ones), 16,384 its first
64,605. Neither domain is the GPL-3 licence text nor the Debian package descriptions the recovery table evaluates on
(the SPDX lines name licences, e.g. "GPL-2.0", in one line each). Prints the text's SHA-256, which
`moh_conversion.json` records for a conversion calibrated on it.
"""

from __future__ import annotations

import argparse
import hashlib
import json
from pathlib import Path

CHARS = 160_000  # in all: more than the converter reads at 16,384 tokens (about 3.8 characters a token)
PIECE = 3_000
LINUX_DOCUMENTS = 60


def linux_documents(corpus: Path) -> list[str]:
    """About LINUX_DOCUMENTS kernel documents of the corpus's training split, spread over it."""
    texts = [json.loads(line)["text"] for line in (corpus / "train.jsonl").open(encoding="utf-8")]
    kernel = [t for t in texts if t.startswith(".. SPDX") or "kernel" in t[:2000].lower()]
    if not kernel:
        raise SystemExit(f"{corpus}/train.jsonl holds no Linux kernel documents: run scripts/get_corpus.sh")
    return kernel[:: max(1, len(kernel) // LINUX_DOCUMENTS)]


def mixed_text(corpus: Path, chars: int = CHARS) -> str:
    """Python-docs and kernel-docs pieces in turn until `chars` characters, joined by blank lines."""
    from mhmoe.convert.calibrate import default_calibration_text

    python, linux = default_calibration_text(chars), linux_documents(corpus)
    pieces, i = [], 0
    while sum(map(len, pieces)) < chars:
        pieces += [python[i * PIECE : (i + 1) * PIECE], linux[i % len(linux)][:PIECE]]
        i += 1
    return "\n\n".join(pieces)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--corpus", default="data/corpus", help="scripts/get_corpus.sh's output folder")
    parser.add_argument("--out", required=True, help="the calibration text file to write")
    parser.add_argument(
        "--chars",
        type=int,
        default=CHARS,
        help="characters in all (the converter reads the first --calibration_tokens tokens)",
    )
    args = parser.parse_args(argv)
    text = mixed_text(Path(args.corpus), args.chars)
    Path(args.out).write_text(text, encoding="utf-8")
    print(f"wrote {args.out}: {len(text):,} characters, SHA-256 {hashlib.sha256(text.encode()).hexdigest()}")


if __name__ == "__main__":
    main()
