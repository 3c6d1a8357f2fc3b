"""benchmarks/studies/moh_mixed_calibration.py on a small stand-in corpus: Python-docs pieces (the converter's default text, in
order) and kernel-document pieces in turn, only kernel documents, CHARS characters; no kernel documents is refused."""

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks" / "studies"))

import moh_mixed_calibration as mixed  # noqa: E402


def _corpus(folder: Path, texts: list[str]) -> Path:
    folder.mkdir()
    (folder / "train.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    return folder


def test_pieces_alternate_between_python_docs_and_kernel_documents(tmp_path):
    from mhmoe.convert.calibrate import default_calibration_text

    kernel = [f".. SPDX-License-Identifier: GPL-2.0\n\ndriver {i} " + "k" * 4000 for i in range(3)]
    other = ["A Python tutorial page. " + "p" * 4000, "Notes on the kernel of a field. " + "q" * 100]
    corpus = _corpus(tmp_path / "corpus", [kernel[0], other[0], kernel[1], other[1], kernel[2]])
    text = mixed.mixed_text(corpus)
    pieces = text.split("\n\n.. SPDX")  # each kernel piece starts with its SPDX line
    python = default_calibration_text(mixed.CHARS)
    assert text.startswith(python[: mixed.PIECE] + "\n\n" + kernel[0][: mixed.PIECE])
    assert len(text) >= mixed.CHARS and len(pieces) > 10
    kernel_pieces = [p for p in text.split("\n\n") if p.startswith(".. SPDX")]
    assert {p.split("\n\n")[0] for p in kernel_pieces} <= {".. SPDX-License-Identifier: GPL-2.0"}
    assert "p" * 50 not in text  # the tutorial page is left out ...
    assert "q" * 50 in text  # ... and a page naming "kernel" early is taken (the filter is by words, not source)
    assert python[5 * mixed.PIECE : 6 * mixed.PIECE] in text  # the sixth Python piece, in order


def test_a_corpus_without_kernel_documents_is_refused(tmp_path):
    corpus = _corpus(tmp_path / "corpus", ["A Python tutorial page."])
    with pytest.raises(SystemExit, match="no Linux kernel documents"):
        mixed.mixed_text(corpus)
