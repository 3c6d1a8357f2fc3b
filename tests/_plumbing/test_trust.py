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


def test_links_inside_the_folder_or_into_a_hub_cache_are_followed(tmp_path):
    from mhmoe._plumbing.trust import links_out

    repo = tmp_path / "models--org--name"
    snapshot = repo / "snapshots" / "abc"
    (repo / "blobs").mkdir(parents=True)
    snapshot.mkdir(parents=True)
    (repo / "blobs" / "0f1e").write_text("{}")
    os.symlink("../../blobs/0f1e", snapshot / "config.json")  # how the Hub cache stores files
    (snapshot / "sub").mkdir()
    (snapshot / "sub" / "real.txt").write_text("x")
    os.symlink("sub/real.txt", snapshot / "merges.txt")
    assert links_out(str(snapshot)) == []
    os.symlink(tmp_path, snapshot / "sub" / "up")  # a folder link out, at depth
    assert links_out(str(snapshot)) == [os.path.join("sub", "up")]
