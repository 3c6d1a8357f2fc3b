"""A tokenizer folder's files, checked before Transformers reads them: a broken `tokenizer.json` (empty, truncated,
binary, `{}`, `{"hello": 1}`, nested past the parser's depth) or `tokenizer_config.json` is one line naming the file
and what is wrong with it, instead of a traceback from deep inside Transformers or the tokenizers library. A load that
fails anyway is one line too (`load_failure`), naming a missing vocabulary when that is the cause.

`tokenizer.json` is parsed by the tokenizers library (Rust; its parser has a depth limit, so no recursion error), the
same parser Transformers' fast tokenizers use: what passes here loads there.
"""

from __future__ import annotations

import json
import os

# files that hold a vocabulary (a fast tokenizer's tokenizer.json, or a slow tokenizer's own files)
VOCABULARY_FILES = (
    "tokenizer.json",
    "tokenizer.model",
    "spiece.model",
    "sentencepiece.bpe.model",
    "vocab.json",
    "vocab.txt",
    "tekken.json",
)


def tokenizer_problem(folder) -> str | None:
    """What is wrong with the tokenizer files of local folder `folder`, in words; None when nothing is (or when it is
    not a local folder: a Hub name is Transformers' to resolve)."""
    folder = os.fspath(folder)
    if not os.path.isdir(folder):
        return None
    names = set(os.listdir(folder))
    if "tokenizer.json" in names:
        problem = _tokenizer_json_problem(os.path.join(folder, "tokenizer.json"))
        if problem:
            return problem
    if "tokenizer_config.json" in names:
        return _json_object_problem(os.path.join(folder, "tokenizer_config.json"))
    return None


def load_failure(folder, error: BaseException) -> str:
    """One line for a tokenizer of `folder` that Transformers failed to load with `error`."""
    folder = os.fspath(folder)
    names = set(os.listdir(folder)) if os.path.isdir(folder) else set()
    if "tokenizer_config.json" in names and not names & set(VOCABULARY_FILES):
        return (
            f"the tokenizer in {folder} does not load: its tokenizer_config.json has no vocabulary beside it (no "
            f"tokenizer.json, nor any of {', '.join(VOCABULARY_FILES[1:])}); copy the tokenizer's files into the "
            "folder, or give the tokenizer's own folder"
        )
    words = str(error).strip().splitlines()[0][:200] if str(error).strip() else ""
    return f"the tokenizer in {folder} does not load ({type(error).__name__}{': ' + words if words else ''})"


def _tokenizer_json_problem(path: str) -> str | None:
    from tokenizers import Tokenizer

    if os.path.getsize(path) == 0:
        return f"{path} is empty (0 bytes): the tokenizer's file was not written completely; copy it again"
    try:
        Tokenizer.from_file(path)
    except Exception as e:  # the tokenizers library raises a bare Exception carrying serde's words
        words = str(e).strip().splitlines()[0][:200] if str(e).strip() else type(e).__name__
        return f"{path} does not load as a tokenizer ({words}): it is damaged or not a tokenizer.json; copy it again"
    return None


def _json_object_problem(path: str) -> str | None:
    try:
        with open(path, encoding="utf-8") as f:
            value = json.load(f)
    except (ValueError, RecursionError) as e:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        what = "is empty (0 bytes)" if os.path.getsize(path) == 0 else f"is not valid JSON ({str(e)[:200]})"
        return f"{path} {what}: copy the tokenizer's files again"
    if not isinstance(value, dict):
        return f"{path} holds a JSON {type(value).__name__}, not an object of tokenizer settings"
    return None


__all__ = ["VOCABULARY_FILES", "load_failure", "tokenizer_problem"]
