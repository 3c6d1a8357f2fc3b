"""Broken tokenizer files are named in one line before Transformers reads them (_plumbing/tokenizer_files.py), and what
passes the check loads."""

import re
import shutil

import pytest

from mhmoe._plumbing.tokenizer_files import load_failure, tokenizer_problem

BROKEN_TOKENIZER_JSON = {
    "empty": (b"", r"tokenizer.json is empty \(0 bytes\)"),
    "truncated": (None, r"tokenizer.json does not load as a tokenizer \(EOF while parsing"),
    "binary": (
        bytes(range(256)) * 8,
        r"tokenizer.json does not load as a tokenizer \(stream did not contain valid UTF-8",
    ),
    "empty object": (b"{}", r"tokenizer.json does not load as a tokenizer \(.*missing"),
    "another object": (b'{"hello": 1}', r"tokenizer.json does not load as a tokenizer"),
    "deeply nested": (b'{"model": ' + b"[" * 100_000 + b"]" * 100_000 + b"}", r"does not load as a tokenizer"),
}


@pytest.mark.parametrize("case", BROKEN_TOKENIZER_JSON)
def test_a_broken_tokenizer_json_is_named(tmp_path, tokenizer_dir, case):
    folder = tmp_path / "tok"
    shutil.copytree(tokenizer_dir, folder)
    content, words = BROKEN_TOKENIZER_JSON[case]
    whole = (folder / "tokenizer.json").read_bytes()
    (folder / "tokenizer.json").write_bytes(whole[: len(whole) // 2] if content is None else content)
    problem = tokenizer_problem(folder)
    assert problem is not None and "\n" not in problem and str(folder / "tokenizer.json") in problem, problem
    assert re.search(words, problem), problem


@pytest.mark.parametrize("content", [b"", b"[1, 2]", b"{" * 100_000, b"\xff\xfe"])
def test_a_broken_tokenizer_config_is_named(tmp_path, tokenizer_dir, content):
    folder = tmp_path / "tok"
    shutil.copytree(tokenizer_dir, folder)
    (folder / "tokenizer_config.json").write_bytes(content)
    problem = tokenizer_problem(folder)
    assert problem is not None and "\n" not in problem and "tokenizer_config.json" in problem, problem


def test_a_good_folder_passes_and_loads(tokenizer_dir):
    from transformers import AutoTokenizer

    assert tokenizer_problem(tokenizer_dir) is None
    assert AutoTokenizer.from_pretrained(tokenizer_dir)("hello").input_ids  # what passes loads
    assert tokenizer_problem("org/a-hub-name") is None  # not a local folder: Transformers resolves it


def test_a_config_without_a_vocabulary_is_explained(tmp_path, tokenizer_dir):
    """tokenizer_config.json alone: Transformers' failure is told as the missing vocabulary, in one line."""
    from transformers import AutoTokenizer

    folder = tmp_path / "tok"
    folder.mkdir()
    shutil.copy(f"{tokenizer_dir}/tokenizer_config.json", folder)
    assert tokenizer_problem(folder) is None  # the files present are sound
    with pytest.raises(Exception) as info:
        AutoTokenizer.from_pretrained(folder)
    message = load_failure(folder, info.value)
    assert "has no vocabulary beside it" in message and "\n" not in message, message
