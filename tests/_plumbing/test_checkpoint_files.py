"""Shared checkpoint-folder helpers: weight discovery, header reading, atomic folder replacement."""

import json
import os

import pytest
import torch
from safetensors.torch import save_file

from mhmoe._plumbing.checkpoint_files import (
    SAFE_INDEX_NAME,
    CheckpointError,
    overlapping,
    read_header,
    replace_dir,
    temporary_dir_next_to,
    weight_files,
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
    assert torch.equal(
        torch.frombuffer(bytearray(data[start + begin : start + end]), dtype=torch.float32),
        torch.arange(6, dtype=torch.float32),
    )
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
    from mhmoe._plumbing.checkpoint_files import read_model_type

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


# ------------------------------------------------------------------ interrupted writers, read-only and full targets


def test_file_names_are_transformers_own():
    """checkpoint_files writes the names out (the command lines import it before Transformers); they must agree."""
    import transformers.utils as tu

    from mhmoe._plumbing import checkpoint_files as cf

    assert (cf.SAFE_WEIGHTS_NAME, cf.SAFE_INDEX_NAME, cf.CONFIG_NAME, cf.GENERATION_CONFIG_NAME) == (
        tu.SAFE_WEIGHTS_NAME,
        tu.SAFE_WEIGHTS_INDEX_NAME,
        tu.CONFIG_NAME,
        tu.GENERATION_CONFIG_NAME,
    )


def _dead_pid() -> int:
    import subprocess
    import sys

    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()  # reaped: the id names no process now
    return proc.pid


def _folder(path, content="x"):
    path.mkdir()
    (path / "f.txt").write_text(content)
    return path


def test_stale_folders_of_killed_writers_only(tmp_path):
    """Only hidden folders of this target that name this host and a process that has ended are removed; a running
    writer's, another machine's, another target's, and an older mhmoe's (no owner in the name) stay."""
    from mhmoe._plumbing.checkpoint_files import _owner_tag, recover_output_dir, stale_dirs

    host = _owner_tag().split(".", 1)[1]
    dead = _dead_pid()
    other_host = "0" * 8 if host != "0" * 8 else "1" * 8
    stale = _folder(tmp_path / f".out.tmp-{dead}.{host}-abc123_x")
    kept = [
        _folder(tmp_path / f".out.tmp-{os.getpid()}.{host}-running"),  # a writer that still runs
        _folder(tmp_path / f".out.tmp-{dead}.{other_host}-elsewhere"),  # made on another machine
        _folder(tmp_path / f".other.tmp-{dead}.{host}-another"),  # another target's
        _folder(tmp_path / ".out.tmp-k3j4l5m6"),  # no owner in the name
        _folder(tmp_path / f"out.tmp-{dead}.{host}-visible"),  # not hidden: not ours
    ]
    assert stale_dirs(str(tmp_path / "out")) == ([str(stale)], [])
    done = recover_output_dir(str(tmp_path / "out"))
    assert len(done) == 2 and done[0].startswith(f"removed {stale.name}") and not stale.exists()
    assert done[1].startswith("left alone: .out.tmp-k3j4l5m6 (no owner in the name")  # named, not removed
    assert all(p.exists() for p in kept) and not (tmp_path / "out").exists()


def test_interrupted_replacement_is_restored(tmp_path):
    """A writer killed between the two renames of the non-atomic replacement: the next one puts the old folder back
    (and, when the new one made it into place, removes the old copy)."""
    from mhmoe._plumbing.checkpoint_files import _owner_tag, recover_output_dir

    host = _owner_tag().split(".", 1)[1]
    dead = _dead_pid()
    _folder(tmp_path / f".out.old-{dead}.{host}-aside", "old")
    _folder(tmp_path / f".out.tmp-{dead}.{host}-new", "new")
    done = recover_output_dir(str(tmp_path / "out"))
    assert (tmp_path / "out" / "f.txt").read_text() == "old" and sorted(os.listdir(tmp_path)) == ["out"]
    assert done[0].startswith(f"restored {tmp_path / 'out'}")

    _folder(tmp_path / f".out.old-{dead}.{host}-aside2", "older")  # the new folder is in place: the old goes
    recover_output_dir(str(tmp_path / "out"))
    assert (tmp_path / "out" / "f.txt").read_text() == "old" and sorted(os.listdir(tmp_path)) == ["out"]


_KILLED_BETWEEN_RENAMES = """
import os, sys
import mhmoe._plumbing.checkpoint_files as cf
cf._exchange = lambda a, b: False  # a file system without RENAME_EXCHANGE
calls = []
real_replace = os.replace
def replace(a, b):
    calls.append(1)
    if len(calls) == 2:  # the old folder is aside, the new one not yet in place: killed here
        os._exit(9)
    real_replace(a, b)
os.replace = replace
temporary = cf.temporary_dir_next_to(sys.argv[1])
open(os.path.join(temporary, "f.txt"), "w").write("new")
cf.replace_dir(temporary, sys.argv[1])
"""


@pytest.mark.parametrize("exchange", [True, False])
def test_overwrite_never_loses_the_target(tmp_path, exchange, monkeypatch):
    """replace_dir swaps in one step where it can; without RENAME_EXCHANGE a process killed between its two renames
    leaves the old folder aside, and the next writer restores it."""
    import subprocess
    import sys

    import mhmoe._plumbing.checkpoint_files as cf

    out = _folder(tmp_path / "out", "old")
    if exchange:
        calls = []
        real = cf._exchange
        monkeypatch.setattr(cf, "_exchange", lambda a, b: calls.append(1) or real(a, b))
        temporary = cf.temporary_dir_next_to(str(out))
        (tmp_path / os.path.basename(temporary) / "f.txt").write_text("new")
        cf.replace_dir(temporary, str(out))
        assert calls and (out / "f.txt").read_text() == "new" and sorted(os.listdir(tmp_path)) == ["out"]
        return
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    proc = subprocess.run(
        [sys.executable, "-c", _KILLED_BETWEEN_RENAMES, str(out)], env=env, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 9, proc.stderr[-2000:]
    assert not out.exists() and len(os.listdir(tmp_path)) == 2  # .out.old-... and .out.tmp-... (the new one)
    cf.recover_output_dir(str(out))
    assert (out / "f.txt").read_text() == "old" and sorted(os.listdir(tmp_path)) == ["out"]


def test_os_error_message_says_which_and_where(tmp_path):
    import errno

    from mhmoe._plumbing.checkpoint_files import os_error_message

    out = str(tmp_path / "out")
    full = os_error_message(OSError(errno.ENOSPC, "No space left on device"), out)
    assert full.startswith(f"not enough disk space to write {out}")
    ro = os_error_message(OSError(errno.EROFS, "Read-only file system", str(tmp_path / "x")), out)
    assert "read-only file system" in ro and str(tmp_path / "x") in ro and "disk space" not in ro
    denied = os_error_message(PermissionError(errno.EACCES, "Permission denied", out), out)
    assert "permission denied" in denied and "disk space" not in denied
    assert os_error_message(OSError(errno.EIO, "I/O error"), out) is None


def test_side_files_follow_links_only_inside_or_into_a_hub_cache(tmp_path, monkeypatch):
    """A snapshot of the active Hugging Face cache links every file into its repo's blobs/: those are copied; a link
    anywhere else out of the folder is not, nor code or other files. The card's base model is the cache's repo id."""
    from mhmoe._plumbing.checkpoint_files import side_files
    from mhmoe.hub.cards import base_model_name

    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    repo = tmp_path / "hub" / "models--org--Tiny-Llama"
    snapshot = repo / "snapshots" / "0123abcd"
    (repo / "blobs").mkdir(parents=True)
    snapshot.mkdir(parents=True)
    for name in ("tokenizer.json", "generation_config.json", "config.json", "modeling_x.py"):
        (repo / "blobs" / name.upper()).write_text("{}")
        os.symlink(f"../../blobs/{name.upper()}", snapshot / name)
    (tmp_path / "secret").write_text("key")
    os.symlink(tmp_path / "secret", snapshot / "tokenizer_config.json")
    copy, notes = side_files(str(snapshot))
    assert copy == ["generation_config.json", "tokenizer.json"]
    assert notes == [
        "not copied, symbolic links out of the folder: tokenizer_config.json",
        "not copied (not a weight, config, tokenizer or chat template file): modeling_x.py",
    ]
    assert (
        base_model_name(str(snapshot)) == "org/Tiny-Llama" and base_model_name(str(tmp_path / "x" / "Mine")) == "Mine"
    )


def test_torch_save_on_a_full_disk_is_told_as_a_full_disk(tmp_path):
    """torch.save's zip writer loses the error number on a full disk (`RuntimeError: ... unexpected pos ...`, not an
    OSError): on a real 64 KB tmpfs, a checkpoint too large for it is still told as a full disk."""
    import sys

    from tests.convert.test_outputs import _in_private_mount

    script = (
        "import os, torch\n"
        "from mhmoe._plumbing.checkpoint_files import write_error_message\n"
        "out = os.environ['MNT'] + '/ckpt'\n"
        "os.makedirs(out)\n"
        "try:\n"
        "    torch.save({'w': torch.zeros(100_000)}, out + '/optimizer.bin')\n"
        "except Exception as e:\n"
        "    print('raised', type(e).__name__)\n"
        "    print('message', write_error_message(e, out))\n"
    )
    (tmp_path / "save.py").write_text(script)
    proc = _in_private_mount(f'{sys.executable} "{tmp_path / "save.py"}"', tmp_path, "64k", read_only=False)
    lines = dict(line.split(" ", 1) for line in proc.stdout.splitlines() if line.startswith(("raised", "message")))
    assert "raised" in lines, proc.stdout + proc.stderr[-2000:]
    assert lines["message"].startswith("not enough disk space to write "), lines
