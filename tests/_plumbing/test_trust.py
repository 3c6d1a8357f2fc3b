"""No command line runs an input folder's code unless --trust_remote_code is passed, and none reads, copies or uploads
a file through a symbolic link out of an input folder (src/mhmoe/_plumbing/trust.py)."""

import ast
import builtins
import json
import os
from pathlib import Path

import pytest

import mhmoe
from tests.convert.test_convert import _llama_dir

SRC = Path(mhmoe.__file__).resolve().parent
MARKER = "PLANTED_CODE_RAN"


def test_every_from_pretrained_in_src_says_whether_code_may_run():
    """Every `*.from_pretrained(...)` (AutoConfig, AutoTokenizer, the model classes) and `*.from_config(...)` call of
    the package passes `trust_remote_code` explicitly: none falls back to Transformers' default, which asks y/N on the
    terminal and runs the folder's code on `y`."""
    calls, missing = 0, []
    for path in sorted(SRC.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if not isinstance(node, ast.Call):
                continue
            method = getattr(node.func, "attr", None)
            receiver = getattr(getattr(node.func, "value", None), "id", "")  # our own classes' from_config load nothing
            if method == "from_pretrained" or (method == "from_config" and receiver.startswith("Auto")):
                calls += 1
                if not any(k.arg == "trust_remote_code" for k in node.keywords):
                    missing.append(f"{path.relative_to(SRC)}:{node.lineno}")
    assert calls >= 12, calls  # the walk sees the package's calls
    assert not missing, missing


def _plant_code(folder: Path, marker: Path, tokenizer: bool) -> None:
    """Python files that create `marker` when imported, named by config.json's auto_map and (with `tokenizer`) by
    tokenizer_config.json's, whose tokenizer class exists nowhere else."""
    for name in ("configuration_evil", "modeling_evil", "tokenization_evil"):
        (folder / f"{name}.py").write_text(f"open({str(marker)!r}, 'w').close()\n")
    config = json.loads((folder / "config.json").read_text())
    config["auto_map"] = {
        "AutoConfig": "configuration_evil.EvilConfig",
        "AutoModelForCausalLM": "modeling_evil.EvilForCausalLM",
    }
    (folder / "config.json").write_text(json.dumps(config))
    if tokenizer:
        config = json.loads((folder / "tokenizer_config.json").read_text())
        config.update(tokenizer_class="EvilTokenizer", auto_map={"AutoTokenizer": [None, "tokenization_evil.Evil"]})
        (folder / "tokenizer_config.json").write_text(json.dumps(config))


@pytest.fixture(scope="module")
def folders(tmp_path_factory, tokenizer_dir):
    """A dense Llama (what mhmoe-convert reads) and its MoH conversion (what the other commands read)."""
    from mhmoe.convert import convert

    root = tmp_path_factory.mktemp("trust")
    llama = _llama_dir(root / "llama", tokenizer_dir)
    convert(str(llama), str(root / "moh"), verify_logits=False, progress=False, recipe="paper")
    return {"llama": llama, "moh": root / "moh"}


def _commands(source: dict, out: Path, corpus) -> dict:
    """argv of each command line reading its input folder (the Llama for mhmoe-convert, the MoH model otherwise)."""
    metadata = json.dumps({"wikipedia_path": corpus["val"]})
    return {
        "mhmoe-train": [
            "--model_name_or_path",
            str(source["moh"]),
            "--train_file",
            corpus["tiny"],
            "--output_dir",
            str(out),
            "--max_steps",
            "1",
            "--block_size",
            "16",
            "--disable_tqdm",
            "--no_plot",
        ],
        "mhmoe-convert": ["--input_dir", str(source["llama"]), "--output_dir", str(out), "--disable_tqdm"],
        "mhmoe-export": [str(source["moh"]), str(out)],
        "mhmoe-eval": [
            "--model_args",
            f"pretrained={source['moh']}",
            "--tasks",
            "mhmoe_ppl_wikipedia",
            "--metadata",
            metadata,
            "--limit",
            "1",
            "--batch_size",
            "2",
        ],
    }


def _run(command: str, argv: list[str]):
    """Run a command line in this process (as its console script does), returning its exit status."""
    from mhmoe._plumbing.cli import run

    try:
        run(command, argv)
    except SystemExit as e:
        return e.code
    return 0


@pytest.mark.parametrize("tokenizer_code", [True, False], ids=["tokenizer and config code", "config code"])
@pytest.mark.parametrize("command", ["mhmoe-train", "mhmoe-convert", "mhmoe-export", "mhmoe-eval"])
def test_no_command_runs_a_folders_code(folders, tmp_path, corpus, monkeypatch, capsys, command, tokenizer_code):
    """Input folders whose config.json and tokenizer_config.json name code that leaves a marker file, with `y` typed
    at every prompt: the code never runs, no prompt is shown; a tokenizer that exists only as code is refused in one
    line naming the flag that allows it, a config's code is not needed (the model type is mhmoe's or Transformers')."""
    import shutil

    source = {name: tmp_path / name for name in folders}
    for name, folder in folders.items():
        shutil.copytree(folder, source[name])
        _plant_code(source[name], tmp_path / MARKER, tokenizer_code)
    prompts = []
    monkeypatch.setattr(builtins, "input", lambda *a: prompts.append(a) or "y")
    out = tmp_path / "out"
    status = _run(command, _commands(source, out, corpus)[command])
    err = capsys.readouterr().err
    assert not (tmp_path / MARKER).exists() and not prompts
    if tokenizer_code:
        lines = [line for line in err.splitlines() if line.startswith(f"{command}: ")]
        assert status == 2 and len(lines) == 1, err[-3000:]
        assert "needs the folder's own Python code" in lines[0] and "trust_remote_code" in lines[0], lines
        assert "tokenization_evil.py" in lines[0] and "Traceback" not in err
        assert not out.exists()
    else:
        assert status == 0, err[-3000:]


# ------------------------------------------------------------------------------------------------------------ links


@pytest.mark.parametrize("link", ["chat_template.jinja", "additional_chat_templates/tools.jinja", "vocab.txt"])
@pytest.mark.parametrize("command", ["mhmoe-train", "mhmoe-convert", "mhmoe-export", "mhmoe-eval"])
def test_no_command_reads_through_a_link_out_of_its_input(folders, tmp_path, corpus, capsys, command, link):
    """An input folder whose file links to a file outside it (`ln -s /etc/passwd chat_template.jinja`): refused in one
    line naming the link before anything reads it; nothing is written."""
    import shutil

    secret = tmp_path / "secret.txt"
    secret.write_text("private key")
    source = {name: tmp_path / name for name in folders}
    for name, folder in folders.items():
        shutil.copytree(folder, source[name])
        (source[name] / link).parent.mkdir(exist_ok=True)
        os.symlink(secret, source[name] / link)
    out = tmp_path / "out"
    status = _run(command, _commands(source, out, corpus)[command])
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.startswith(f"{command}: ")]
    assert status == 2 and len(lines) == 1 and "Traceback" not in err, err[-3000:]
    assert "symbolic links out of the folder" in lines[0] and link in lines[0], lines
    assert not out.exists() and secret.read_text() == "private key"


def test_training_never_writes_through_a_link_in_its_output_folder(checkpoint_dir, corpus, tmp_path, capsys):
    """An output folder holding `metrics.jsonl -> a file elsewhere`: refused before anything is written there."""
    elsewhere = tmp_path / "elsewhere.txt"
    elsewhere.write_text("keep me")
    out = tmp_path / "out"
    out.mkdir()
    os.symlink(elsewhere, out / "metrics.jsonl")
    argv = [
        "--model_name_or_path",
        checkpoint_dir,
        "--train_file",
        corpus["tiny"],
        "--output_dir",
        str(out),
        "--max_steps",
        "1",
        "--block_size",
        "16",
        "--disable_tqdm",
        "--no_plot",
    ]
    assert _run("mhmoe-train", argv) == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert line.startswith("mhmoe-train: error: --output_dir") and "metrics.jsonl ->" in line
    assert elsewhere.read_text() == "keep me" and sorted(p.name for p in out.iterdir()) == [
        ".mhmoe-train.lock",
        "metrics.jsonl",
    ]


def test_upload_refuses_a_folder_with_a_link_out(tmp_path):
    """`--push_to_hub` (`upload_folder`) checks the folder before any network call: a link out is never uploaded."""
    from mhmoe.hub.export import ExportError, upload_folder

    folder = tmp_path / "exported"
    folder.mkdir()
    (folder / "config.json").write_text("{}")
    (tmp_path / "secret").write_text("key")
    os.symlink(tmp_path / "secret", folder / "chat_template.jinja")
    with pytest.raises(ExportError, match=r"chat_template.jinja -> .*secret\); nothing is read through them"):
        upload_folder(str(folder), "user/model", token="hf_not_used")


def test_links_inside_the_folder_or_into_its_own_repos_blobs_are_followed(tmp_path, monkeypatch):
    """Inside the folder, or from a snapshot of the active cache (HF_HUB_CACHE, read when asked) into the same repo's
    blobs/: followed. The same links with the cache elsewhere, into another repo's blobs, or to a `models--*/blobs/`
    lookalike outside the cache: links out."""
    from mhmoe._plumbing.trust import links_out

    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    repo = tmp_path / "hub" / "models--org--name"
    snapshot = repo / "snapshots" / "abc"
    (repo / "blobs").mkdir(parents=True)
    snapshot.mkdir(parents=True)
    (repo / "blobs" / "0f1e").write_text("{}")
    os.symlink("../../blobs/0f1e", snapshot / "config.json")  # how the Hub cache stores files
    (snapshot / "sub").mkdir()
    (snapshot / "sub" / "real.txt").write_text("x")
    os.symlink("sub/real.txt", snapshot / "merges.txt")
    os.symlink("../../../blobs/0f1e", snapshot / "sub" / "deeper.json")  # below the snapshot: the same repo
    assert links_out(str(snapshot)) == []
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "another_cache"))
    assert links_out(str(snapshot)) == ["config.json", os.path.join("sub", "deeper.json")]
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))

    other = tmp_path / "hub" / "models--else--where" / "blobs"
    other.mkdir(parents=True)
    (other / "9a8b").write_text("{}")
    os.symlink("../../../models--else--where/blobs/9a8b", snapshot / "vocab.json")  # another repo of the same cache
    lookalike = tmp_path / "x" / "models--evil--repo" / "blobs"
    lookalike.mkdir(parents=True)
    (lookalike / "abcd").write_text("{}")
    os.symlink(lookalike / "abcd", snapshot / "tokenizer.json")
    assert links_out(str(snapshot)) == ["tokenizer.json", "vocab.json"]
    os.symlink(tmp_path, snapshot / "sub" / "up")  # a folder link out, at depth
    assert os.path.join("sub", "up") in links_out(str(snapshot))
    plain = tmp_path / "models--org--name2"  # not in the cache: its blobs are links out too
    (plain / "snapshots" / "r").mkdir(parents=True)
    (plain / "blobs").mkdir()
    (plain / "blobs" / "h").write_text("{}")
    os.symlink("../../blobs/h", plain / "snapshots" / "r" / "config.json")
    assert links_out(str(plain / "snapshots" / "r")) == ["config.json"]


# ------------------------------------------------------------------------------------------------ the Hub cache


def _hub_snapshot(cache: Path, repo: str, folder: Path) -> Path:
    """`folder`'s files stored as the Hugging Face cache stores them: blobs/HASH, snapshots/REV/NAME -> ../../blobs/HASH."""
    import hashlib

    blobs, snapshot = cache / repo / "blobs", cache / repo / "snapshots" / "0123abcd"
    blobs.mkdir(parents=True, exist_ok=True)
    snapshot.mkdir(parents=True)
    for path in sorted(folder.iterdir()):
        if path.is_file():
            digest = hashlib.sha256(path.read_bytes()).hexdigest()
            (blobs / digest).write_bytes(path.read_bytes())
            os.symlink(f"../../blobs/{digest}", snapshot / path.name)
    return snapshot


def _input_of(command: str) -> str:
    """The fixture folder a command reads: the dense Llama for mhmoe-convert, its MoH conversion otherwise."""
    return "llama" if command == "mhmoe-convert" else "moh"


@pytest.mark.parametrize("command", ["mhmoe-train", "mhmoe-convert", "mhmoe-export"])
def test_commands_read_a_snapshot_of_the_hub_cache(folders, tmp_path, corpus, monkeypatch, capsys, command):
    """An input folder that is a snapshot of the active cache (HF_HUB_CACHE set after mhmoe was imported), every file a
    link into the repo's blobs/: read, and its tokenizer reaches the output as it is."""
    cache = tmp_path / "cache"
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    name = _input_of(command)
    source = {**folders, name: _hub_snapshot(cache, "models--org--tiny", folders[name])}
    out = tmp_path / "out"
    status = _run(command, _commands(source, out, corpus)[command])
    assert status == 0, capsys.readouterr().err[-3000:]
    vocab = json.loads((out / "tokenizer.json").read_text())["model"]["vocab"]
    assert vocab == json.loads((folders[name] / "tokenizer.json").read_text())["model"]["vocab"]


@pytest.mark.parametrize("target", ["a blob lookalike outside the cache", "another repo's blob in the cache"])
@pytest.mark.parametrize("command", ["mhmoe-train", "mhmoe-convert", "mhmoe-export"])
def test_commands_refuse_a_snapshot_link_to_another_repos_blob(
    folders, tmp_path, corpus, monkeypatch, capsys, command, target
):
    """`tokenizer.json -> /tmp/x/models--evil--repo/blobs/abcd` (a cache's shape anywhere on disk), or a snapshot's link
    into another repo's blobs/ of the same cache: refused in one line naming the link; nothing is written."""
    cache = tmp_path / "cache"
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    name = _input_of(command)
    snapshot = _hub_snapshot(cache, "models--org--tiny", folders[name])
    if target.startswith("a blob lookalike"):
        blob = tmp_path / "x" / "models--evil--repo" / "blobs" / "abcd"
    else:
        blob = cache / "models--evil--repo" / "blobs" / "abcd"
    blob.parent.mkdir(parents=True)
    blob.write_bytes((folders[name] / "tokenizer.json").read_bytes())  # a tokenizer that would load
    (snapshot / "tokenizer.json").unlink()
    os.symlink(blob, snapshot / "tokenizer.json")
    out = tmp_path / "out"
    status = _run(command, _commands({**folders, name: snapshot}, out, corpus)[command])
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.startswith(f"{command}: ")]
    assert status == 2 and len(lines) == 1 and "Traceback" not in err, err[-3000:]
    assert "symbolic links out of the folder" in lines[0] and f"tokenizer.json -> {blob}" in lines[0], lines
    assert not out.exists()


# ----------------------------------------------------------------------------------------- checked, then read

SECRET = "SECRET_MARKER_8d1f"


def _swap_for_a_link(path: Path, target: Path) -> None:
    """Replace the file `path` by a symbolic link to `target`, atomically (what an attacker racing the command does)."""
    temporary = path.with_name(".swap")
    os.symlink(target, temporary)
    os.replace(temporary, path)


@pytest.mark.parametrize("when", ["after the check", "after pinning"])
@pytest.mark.parametrize("command", ["mhmoe-train", "mhmoe-convert", "mhmoe-export"])
def test_a_file_swapped_for_a_link_once_checked_never_reaches_the_output(
    folders, tmp_path, corpus, monkeypatch, capsys, command, when
):
    """The input's chat_template.jinja is replaced by a link to a file outside holding a secret, right after the
    folder's links were checked (or right after the file was pinned): the secret never reaches the output; the command
    uses the template as checked, or refuses in one line."""
    import shutil

    from mhmoe._plumbing import trust

    name = _input_of(command)
    source = tmp_path / name
    shutil.copytree(folders[name], source)
    (source / "chat_template.jinja").write_text("{{ 'ORIGINAL_TEMPLATE' }}")
    secret = tmp_path / "elsewhere" / "template.jinja"
    secret.parent.mkdir()
    secret.write_text("{{ '" + SECRET + "' }}")
    swapped = []

    def swap(folder) -> None:
        if not swapped and os.path.realpath(folder) == os.path.realpath(source):
            _swap_for_a_link(source / "chat_template.jinja", secret)
            swapped.append(folder)

    links_out, pin_file = trust.links_out, trust._pin_file

    def checked(folder, *args):  # the folder's links are checked, then the file is swapped
        found = links_out(folder, *args)
        swap(folder)
        return found

    def pinned_file(folder, root, relative, *args):  # the file is pinned, then swapped
        pin_file(folder, root, relative, *args)
        if relative == "chat_template.jinja":
            swap(folder)

    if when == "after the check":
        monkeypatch.setattr(trust, "links_out", checked)
    else:
        monkeypatch.setattr(trust, "_pin_file", pinned_file)
    out = tmp_path / "out"
    status = _run(command, _commands({**folders, name: source}, out, corpus)[command])
    err = capsys.readouterr().err
    assert swapped and os.path.islink(source / "chat_template.jinja")
    written = [p for p in out.rglob("*") if p.is_file()] if out.exists() else []
    assert not [p for p in written if SECRET.encode() in p.read_bytes()]
    if status == 0:
        assert "ORIGINAL_TEMPLATE" in (out / "chat_template.jinja").read_text()
    else:
        lines = [line for line in err.splitlines() if line.startswith(f"{command}: ")]
        assert status == 2 and len(lines) == 1 and "Traceback" not in err, err[-3000:]
        assert f"chat_template.jinja -> {secret}" in lines[0] and not out.exists(), lines


# --------------------------------------------------------------------------------------------- pinned folders


def _folder(tmp_path: Path) -> Path:
    folder = tmp_path / "model"
    (folder / "additional_chat_templates").mkdir(parents=True)
    (folder / "config.json").write_text('{"a": 1}')
    (folder / "model.safetensors").write_bytes(b"weights")
    (folder / "modeling_x.py").write_text("raise SystemExit")
    (folder / "additional_chat_templates" / "tools.jinja").write_text("tools")
    (folder / "additional_chat_templates" / "notes.txt").write_text("not read")
    (folder / "sub").mkdir()
    (folder / "sub" / "other.json").write_text("{}")
    os.mkfifo(folder / "pipe")  # never opened (a reader would wait forever)
    (tmp_path / "secret").write_text(SECRET)
    return folder


def test_pinned_folder_holds_the_files_as_opened(tmp_path):
    """Same names, private (0700), the files as they were when opened: a file swapped for a link out afterwards is not
    seen; code only when trusted, weights unless left out, of subfolders only what the commands read. Removed when
    the block ends; errors in the block name the user's folder."""
    import stat

    from mhmoe._plumbing.trust import links_out, pinned

    folder = _folder(tmp_path)
    with pinned(str(folder), ValueError, "--input_dir") as source:
        pinned_dir = Path(source.path)
        assert pinned_dir.name == "model" and pinned_dir != folder
        assert stat.S_IMODE(pinned_dir.parent.stat().st_mode) == 0o700
        files = sorted(str(p.relative_to(pinned_dir)) for p in pinned_dir.rglob("*") if p.is_file())
        assert files == ["additional_chat_templates/tools.jinja", "config.json", "model.safetensors"]
        _swap_for_a_link(folder / "config.json", tmp_path / "secret")
        assert (pinned_dir / "config.json").read_text() == '{"a": 1}' and links_out(source.path) == []
        with pytest.raises(ValueError) as raised:
            with source.renaming():
                raise ValueError(f"cannot read {os.path.join(source.path, 'config.json')}")
        assert str(raised.value) == f"cannot read {folder / 'config.json'}"
    assert not pinned_dir.exists()
    with pytest.raises(ValueError, match=r"--input_dir .*/model holds symbolic links out of the folder \(config.json"):
        pinned(str(folder), ValueError, "--input_dir")
    (folder / "config.json").unlink()
    with pinned(folder, ValueError, "x", code=True, weights=False) as source:
        assert sorted(os.listdir(source.path)) == ["additional_chat_templates", "modeling_x.py"]
    with pinned("org/name", ValueError, "x") as source:  # a Hub repo id: unchanged
        assert source.path == "org/name"


@pytest.mark.parametrize("way", ["hard link by path", "descriptor link", "copy"])
def test_pinned_without_hard_links_through_the_descriptor(tmp_path, monkeypatch, way):
    """Where the opened file cannot be hard-linked through /proc (other kernels, systems): linked by path when that
    is still the file opened, else (another file system) a link to the descriptor kept open, else copied from it. In
    each way the pinned file is the one opened, and a link out is refused as the descriptor shows it."""
    from mhmoe._plumbing import trust

    real_link = os.link

    def link(source, destination, **kwargs):
        if way == "hard link by path" and not str(source).startswith("/proc"):
            return real_link(source, destination, **kwargs)
        raise OSError(18, "Invalid cross-device link")

    monkeypatch.setattr(os, "link", link)
    if way == "copy":
        monkeypatch.setattr(trust, "_FDS", str(tmp_path / "no_proc"))
    folder = _folder(tmp_path)
    with trust.pinned(folder, ValueError, "x") as source:
        config = Path(source.path) / "config.json"
        assert config.is_symlink() == (way == "descriptor link")
        _swap_for_a_link(folder / "config.json", tmp_path / "secret")
        assert config.read_text() == '{"a": 1}'
    os.unlink(folder / "config.json")
    os.symlink(tmp_path / "x" / "models--evil--repo" / "blobs" / "abcd", folder / "config.json")
    (tmp_path / "x" / "models--evil--repo" / "blobs").mkdir(parents=True)
    (tmp_path / "x" / "models--evil--repo" / "blobs" / "abcd").write_text(SECRET)
    monkeypatch.setattr(trust, "check_links", lambda *a: None)  # the descriptor's check alone
    with pytest.raises(ValueError, match=r"config.json -> .*models--evil--repo/blobs/abcd\)"):
        trust.pinned(folder, ValueError, "x")


def test_a_killed_commands_pinned_folder_is_removed_by_the_next_pin(tmp_path):
    """A process killed while it held a pinned folder (hard links that would keep files on disk after their deletion)
    leaves it behind; the next pin removes it, never one whose process lives (this one's)."""
    import signal
    import subprocess
    import sys

    from mhmoe._plumbing.trust import pinned

    folder = _folder(tmp_path)
    code = (
        "import os, signal\nfrom mhmoe._plumbing.trust import pinned\n"
        f"source = pinned({str(folder)!r}, ValueError, 'x')\nprint(source.path, flush=True)\n"
        "os.kill(os.getpid(), signal.SIGKILL)\n"
    )
    killed = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    left = Path(killed.stdout.strip())
    assert killed.returncode == -signal.SIGKILL and (left / "config.json").read_text() == '{"a": 1}', killed.stderr
    with pinned(folder, ValueError, "x") as live:
        assert not left.parent.exists()
        with pinned(folder, ValueError, "x") as other:
            assert os.path.isdir(live.path) and os.path.isdir(other.path)


def test_a_loaded_tokenizer_keeps_its_pinned_files_while_it_lives(tokenizer_dir, tmp_path):
    """`load_tokenizer` reads the pinned copy and keeps it while the tokenizer lives (a tokenizer re-reads its
    vocabulary file when saved); the copy goes with the tokenizer."""
    import gc

    from mhmoe._plumbing.trust import load_tokenizer

    tokenizer = load_tokenizer(tokenizer_dir, ValueError)
    folder = tokenizer.name_or_path
    assert folder != tokenizer_dir and os.path.isfile(os.path.join(folder, "tokenizer.json"))
    tokenizer.save_pretrained(tmp_path / "saved")
    assert "mhmoe-pinned" not in (tmp_path / "saved" / "tokenizer_config.json").read_text()
    del tokenizer
    gc.collect()
    assert not os.path.exists(folder)
