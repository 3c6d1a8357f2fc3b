"""Shared checkpoint-folder helpers: weight discovery, header reading, atomic folder replacement."""

import json
import os

import pytest
import torch
from safetensors.torch import save_file

from mhmoe.hub.checkpoint_files import (
    SAFE_INDEX_NAME, CheckpointError, overlapping, read_header, replace_dir, temporary_dir_next_to, weight_files,
)


class _CallerError(ValueError):
    pass


def _save(path, **tensors):
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(path))


def test_weight_files_single_and_sharded(tmp_path):
    single = tmp_path / "single"
    single.mkdir()
    _save(single / "model.safetensors", w=torch.zeros(2))
    assert weight_files(str(single)) == (["model.safetensors"], None)

    sharded = tmp_path / "sharded"
    sharded.mkdir()
    _save(sharded / "b.safetensors", y=torch.zeros(1))
    _save(sharded / "a.safetensors", x=torch.zeros(1))
    weight_map = {"x": "a.safetensors", "y": "b.safetensors"}
    (sharded / SAFE_INDEX_NAME).write_text(json.dumps({"weight_map": weight_map}))
    assert weight_files(str(sharded)) == (["a.safetensors", "b.safetensors"], weight_map)


@pytest.mark.parametrize(
    "files, message",
    [
        ({"pytorch_model.bin": b"not unpickled"}, "never unpickled"),
        ({"a.safetensors": None}, "index file is missing"),
        ({SAFE_INDEX_NAME: b'{"weight_map": {"x": "gone.safetensors"}}'}, "missing from"),
        ({SAFE_INDEX_NAME: b'{"weight_map": {"x": "w.bin"}}', "w.bin": b"x"}, "not a .safetensors file in"),
        ({SAFE_INDEX_NAME: b"{broken"}, "not a valid safetensors index"),
        ({}, "no weights in"),
    ],
)
def test_weight_files_refusals_raise_the_callers_error(tmp_path, files, message):
    for name, content in files.items():
        if content is None:
            _save(tmp_path / name, x=torch.zeros(1))
        else:
            (tmp_path / name).write_bytes(content)
    with pytest.raises(_CallerError, match=message):
        weight_files(str(tmp_path), _CallerError)
    with pytest.raises(CheckpointError, match=message):  # the default
        weight_files(str(tmp_path))


def test_read_header_matches_safetensors_and_refuses_truncation(tmp_path):
    path = tmp_path / "m.safetensors"
    _save(path, w=torch.arange(6, dtype=torch.float32).view(2, 3))
    header, start = read_header(str(path))
    assert header["w"]["shape"] == [2, 3] and header["w"]["dtype"] == "F32"
    data = path.read_bytes()
    begin, end = header["w"]["data_offsets"]
    assert torch.equal(torch.frombuffer(bytearray(data[start + begin : start + end]), dtype=torch.float32),
                       torch.arange(6, dtype=torch.float32))  # fmt: skip
    path.write_bytes(data[:-4])
    with pytest.raises(_CallerError, match="not a complete safetensors file"):
        read_header(str(path), _CallerError)


def test_overlapping_resolves_links(tmp_path):
    (tmp_path / "a" / "inner").mkdir(parents=True)
    (tmp_path / "b").mkdir()
    os.symlink(tmp_path / "a", tmp_path / "link")
    assert overlapping(str(tmp_path / "a"), str(tmp_path / "link"))
    assert overlapping(str(tmp_path / "a"), str(tmp_path / "link" / "inner"))
    assert overlapping(str(tmp_path / "a" / "inner"), str(tmp_path / "a"))
    assert not overlapping(str(tmp_path / "a"), str(tmp_path / "b"))
    assert not overlapping(str(tmp_path / "a"), str(tmp_path / "ab"))  # a prefix of the name is not a parent


@pytest.mark.parametrize("existing", [False, True])
def test_temporary_dir_then_replace(tmp_path, existing):
    target = tmp_path / "out"
    if existing:
        target.mkdir()
        (target / "old.txt").write_text("old")
    temporary = temporary_dir_next_to(str(target))
    assert os.path.dirname(temporary) == str(tmp_path) and os.listdir(temporary) == []
    umask = os.umask(0)
    os.umask(umask)
    assert os.stat(temporary).st_mode & 0o777 == 0o777 & ~umask  # an ordinary directory, not mkdtemp's private one
    (tmp_path / os.path.basename(temporary) / "new.txt").write_text("new")
    replace_dir(temporary, str(target))
    assert sorted(os.listdir(target)) == ["new.txt"]
    assert sorted(os.listdir(tmp_path)) == ["out"]  # neither the temporary nor the old folder is left behind


def test_read_model_type(tmp_path):
    from mhmoe.hub.checkpoint_files import read_model_type

    good, none, broken, listed = (tmp_path / name for name in ("good.json", "none.json", "broken.json", "list.json"))
    good.write_text('{"model_type": "llama", "hidden_size": 8}')
    none.write_text("{}")
    broken.write_text("{not json")
    listed.write_text("[1, 2]")
    assert read_model_type(str(good)) == "llama"
    assert read_model_type(str(none)) is None
    for path in (broken, listed):
        with pytest.raises(CheckpointError, match=f"{path.name}: not a valid config JSON"):
            read_model_type(str(path))
