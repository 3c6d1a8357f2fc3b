"""The package as pip users get it: sdist and wheel built from this checkout (`python -m build`, the wheel built from
the sdist), the wheel installed into a fresh virtual environment and used from a folder outside the checkout.

The venv reuses the dev environment's packages instead of downloading them: its site-packages gets a `.pth` line
naming a folder of symlinks to the dev site-packages' entries, without mhmoe's own (the editable install must not
shadow the wheel) and without the optional extras (accelerate, peft, lm-eval, matplotlib, triton), so it is an
environment where only the core dependencies are installed. Commands that need the extras get a second folder, with
symlinks to just those, on PYTHONPATH. Commands whose imports are not the point run in warm children of a server that
imported the wheel's mhmoe once (`wheel_servers`). Marked `installed` (about a minute; part of the normal run).
"""

import importlib.metadata
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import sysconfig
import tarfile
import zipfile
from pathlib import Path

import pytest

import mhmoe
from mhmoe.demo import PROMPT

from .test_light_import import OPTIONAL, TINY_MODELS

pytestmark = pytest.mark.installed

ROOT = Path(__file__).resolve().parents[1]
OPTIONAL_DISTRIBUTIONS = ("accelerate", "peft", "lm_eval", "matplotlib", "triton")
NOT_COPIED = shutil.ignore_patterns(
    ".git", ".venv", "outputs", "build", "dist", "*.egg-info", "__pycache__", "*.pyc", ".pytest_cache"
)


def _check(cmd, env=None, cwd=None, timeout=600, returncode=0, warm=None) -> subprocess.CompletedProcess:
    """Run `cmd` (in a fresh process, or a warm child of `warm`: see `wheel_servers`) and check its status."""
    cmd = [str(c) for c in cmd]
    if warm is None:
        proc = subprocess.run(
            cmd, env=env, cwd=cwd, capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL
        )
    else:
        proc = warm.run(cmd, env=env, cwd=cwd, timeout=timeout, input="")
    assert proc.returncode == returncode, f"{cmd}\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}"
    return proc


def _symlink_view(folder: Path, entries) -> Path:
    folder.mkdir()
    for entry in entries:
        (folder / entry.name).symlink_to(entry)
    return folder


def _dev_site_packages_views(root: Path) -> tuple[Path, Path]:
    """(core, extras): symlink folders over the dev site-packages; core without mhmoe and the optional extras,
    extras with only those."""
    dev = Path(sysconfig.get_paths()["purelib"])
    optional = set()
    for name in OPTIONAL_DISTRIBUTIONS:
        try:
            files = importlib.metadata.distribution(name).files or []
        except importlib.metadata.PackageNotFoundError:  # not in the dev environment either (triton off Linux)
            continue
        optional |= {Path(f).parts[0] for f in files if not str(f).startswith("..")}
    optional.discard("__pycache__")  # shared by every top-level module
    entries = [p for p in dev.iterdir() if p.name != "__pycache__" and "mhmoe" not in p.name]
    core = _symlink_view(root / "core_packages", [p for p in entries if p.name not in optional])
    extras = _symlink_view(root / "extra_packages", [p for p in entries if p.name in optional])
    return core, extras


def _venv(venv: Path, packages: Path) -> tuple[Path, Path, Path]:
    """A new venv (no pip) whose site-packages also sees `packages`: (venv, its python, its site-packages)."""
    _check([sys.executable, "-m", "venv", "--without-pip", venv])
    python = venv / "bin" / "python"
    site = Path(_check([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"]).stdout.strip())
    (site / "dev_packages.pth").write_text(f"{packages}\n")
    return venv, python, site


def _pip_install(python: Path, *args, env: dict) -> None:
    """pip install --no-deps into the venv of `python`, with the dev environment's pip and setuptools (offline)."""
    _check(
        [
            sys.executable,
            "-m",
            "pip",
            "--python",
            python,
            "install",
            "--no-deps",
            "--no-index",
            "--no-compile",
            "--no-build-isolation",
            "--disable-pip-version-check",
            "--quiet",
            *args,
        ],
        env=env,
    )


@pytest.fixture(scope="module")
def installed(tmp_path_factory):
    root = tmp_path_factory.mktemp("installed")
    source, dist = root / "source", root / "dist"
    shutil.copytree(ROOT, source, ignore=NOT_COPIED, symlinks=True)  # as a fresh clone has it
    clean = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "MHMOE_EVAL_TASKS", "VIRTUAL_ENV")}
    _check([sys.executable, "-m", "build", "--no-isolation", "--outdir", dist, source], env=clean)
    sdist, wheel = sorted(dist.glob("*.tar.gz")), sorted(dist.glob("*.whl"))
    assert len(sdist) == 1 and len(wheel) == 1, list(dist.iterdir())

    core, extras = _dev_site_packages_views(root)
    venv, python, site = _venv(root / "venv", core)
    _pip_install(python, wheel[0], env=clean)

    work = root / "work"  # outside the checkout
    work.mkdir()
    env = {
        **clean,
        "PATH": f"{venv / 'bin'}{os.pathsep}{os.environ['PATH']}",
        "HF_HUB_OFFLINE": "1",
        "HF_DATASETS_OFFLINE": "1",
        "HF_DATASETS_CACHE": str(root / "hf_datasets"),
        "HF_MODULES_CACHE": str(root / "hf_modules"),
        "MPLBACKEND": "Agg",
        "TOKENIZERS_PARALLELISM": "false",
        "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"),
    }
    return dict(
        root=root,
        source=source,
        sdist=sdist[0],
        wheel=wheel[0],
        python=python,
        site=site,
        core=core,
        work=work,
        clean=clean,
        env=env,
        env_extras={**env, "PYTHONPATH": str(extras)},
    )


@pytest.fixture(scope="module")
def wheel_servers(installed):
    """Warm launchers (tests/fixtures/warm.py) whose servers run the venv's interpreter with the wheel's mhmoe imported:
    "core" in the core-only environment, "extras" with the extras on PYTHONPATH. The commands whose imports are the
    point (which extras a core install imports, a console script's wrapper and its refusals, loading where mhmoe is
    blocked) run fresh interpreters instead."""
    from tests.fixtures.warm import PRELOAD, WarmServer

    extras = {*OPTIONAL_DISTRIBUTIONS, "datasets"}  # what the core install lacks
    core = tuple(name for name in PRELOAD if name.split(".")[0] not in extras)
    servers = {
        "core": WarmServer(installed["env"], core, python=installed["python"]),
        "extras": WarmServer(installed["env_extras"], PRELOAD, python=installed["python"]),
    }
    yield servers
    for server in servers.values():
        server.close()


def _data_files(folder: Path) -> dict[str, bytes]:
    return {
        str(p.relative_to(folder)): p.read_bytes()
        for p in sorted(folder.rglob("*"))
        if p.is_file() and "__pycache__" not in p.parts
    }


def test_sdist_and_wheel(installed):
    """The wheel (built from the sdist, so the sdist has what a rebuild needs) carries the data folders byte for
    byte; both pass `twine check`."""
    _check([sys.executable, "-m", "twine", "check", "--strict", installed["sdist"], installed["wheel"]])
    assert installed["wheel"].name == f"mhmoe-{mhmoe.__version__}-py3-none-any.whl"
    with zipfile.ZipFile(installed["wheel"]) as wheel:
        names = set(wheel.namelist())
        for folder in ("eval_tasks", "model_cards", "examples"):
            if not (ROOT / folder).is_dir():
                continue
            expected = _data_files(ROOT / folder)
            shipped = {
                n.removeprefix(f"mhmoe/_data/{folder}/"): wheel.read(n)
                for n in names
                if n.startswith(f"mhmoe/_data/{folder}/")
            }
            assert shipped == expected, sorted(set(shipped) ^ set(expected))
    assert "mhmoe/py.typed" in names and "mhmoe/_data/eval_tasks/mhmoe_ppl/utils.py" in names
    with tarfile.open(installed["sdist"]) as sdist:
        top = f"mhmoe-{mhmoe.__version__}/"
        sdist_names = {n.removeprefix(top) for n in sdist.getnames()}
    assert {
        "setup.py",
        "pyproject.toml",
        "README.md",
        "LICENSE",
        "CHANGELOG.md",
        "src/mhmoe/_plumbing/resources.py",
        "eval_tasks/mhmoe_ppl/utils.py",
        "tests/test_installed_package.py",
    } <= sdist_names
    assert not [n for n in names if n.startswith(("tests/", "eval_tasks/")) or n.endswith(".pyc")]


_CORE_ONLY = f"""
import importlib.metadata, importlib.util, json, sys
import mhmoe
from mhmoe._plumbing.extras import MissingExtraError
from mhmoe._plumbing.resources import data_dir
{TINY_MODELS}
optional = sorted(m for m in {OPTIONAL!r} if m in sys.modules)
try:
    import mhmoe.evaluation.lm_eval_model
    evaluate_error = None
except MissingExtraError as e:
    evaluate_error = str(e)
print(json.dumps(dict(
    file=mhmoe.__file__, version=mhmoe.__version__, metadata_version=importlib.metadata.version("mhmoe"),
    eval_tasks=str(data_dir("eval_tasks")), optional=optional, evaluate_error=evaluate_error,
    installed=sorted(m for m in {OPTIONAL!r} if importlib.util.find_spec(m) is not None))))
"""


def test_core_install_imports_no_extra(installed):
    """Only the core dependencies installed: mhmoe comes from the wheel, models build, save and reload, no optional
    extra is imported (none is installed), the suites are the wheel's, and missing extras are named."""
    result = json.loads(
        _check([installed["python"], "-c", _CORE_ONLY], env=installed["env"], cwd=installed["work"])
        .stdout.strip()
        .splitlines()[-1]
    )
    assert Path(result["file"]).is_relative_to(installed["site"]), result["file"]  # the wheel, not the checkout
    assert result["version"] == result["metadata_version"]
    assert result["installed"] == [] and result["optional"] == []
    eval_tasks = Path(result["eval_tasks"])
    assert eval_tasks == installed["site"] / "mhmoe" / "_data" / "eval_tasks"
    assert _data_files(eval_tasks) == _data_files(ROOT / "eval_tasks")
    assert (
        result["evaluate_error"] == 'mhmoe.evaluation needs lm-eval, which is not installed: pip install "mhmoe[eval]"'
    )

    # a console script whose extra is missing: one line naming it, status 2, no traceback (checked before importing)
    proc = _check(
        ["mhmoe-eval", "--tasks", "mhmoe_ppl_wikipedia"], env=installed["env"], cwd=installed["work"], returncode=2
    )
    message = 'mhmoe-eval needs lm-eval, which is not installed: pip install "mhmoe[eval]"'
    assert proc.stderr.strip() == f"mhmoe-eval: error: {message}"
    # ... and one met late (mhmoe-convert continue-tuning imports accelerate when it starts)
    proc = _check(
        ["mhmoe-convert", "--input_dir", "in", "--output_dir", "out", "--train_file", "t.jsonl"],
        env=installed["env"],
        cwd=installed["work"],
        returncode=2,
    )
    assert "Traceback" not in proc.stderr and proc.stderr.strip().endswith('pip install "mhmoe[train]"'), proc.stderr


_EXPORTED = """
import json, sys
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer
model = AutoModelForCausalLM.from_pretrained("exported", trust_remote_code=True).eval()
tokenizer = AutoTokenizer.from_pretrained("exported", trust_remote_code=True)
inputs = tokenizer(sys.argv[1], return_tensors="pt")
out = model.generate(**inputs, max_new_tokens=40, do_sample=False, pad_token_id=tokenizer.pad_token_id)
print(json.dumps(dict(sample=tokenizer.decode(out[0], skip_special_tokens=True), module=type(model).__module__,
                      mhmoe=sorted(m for m in sys.modules if m.split(".")[0] == "mhmoe"))))
"""


def test_console_scripts_from_the_wheel(installed, wheel_servers):
    """With the extras: mhmoe-demo --quick to the end, the mhmoe-eval command it prints (a local mhmoe_ppl task on
    the model it trained), mhmoe-export of that model, and the export loaded where mhmoe cannot be imported."""
    work, env, warm = installed["work"], installed["env_extras"], wheel_servers["extras"]
    proc = _check(
        ["mhmoe-demo", "--quick", "--steps", "20", "--skip_recovery", "--output_dir", "demo"],
        env=env,
        cwd=work,
        warm=warm,
    )
    summary = json.loads((work / "demo" / "demo_summary.json").read_text())
    assert summary["lm_eval"]["routing"]["activated_heads_pct"] == 75.0 and (work / "demo" / "head_load.png").is_file()
    assert "done in" in proc.stdout

    printed = next(line for line in proc.stdout.splitlines() if line.startswith("same from the shell: "))
    command = shlex.split(printed.removeprefix("same from the shell: ")) + ["--limit", "4", "--batch_size", "4"]
    assert command[0] == "mhmoe-eval" and "mhmoe_ppl_wikipedia" in command
    proc = _check(command, env=env, cwd=work, warm=warm)
    assert "Wikipedia (validation)" in proc.stdout and "token_perplexity" in proc.stdout, proc.stdout[-2000:]
    assert "routing statistics: MoE layers" in proc.stdout and "activated heads 75.0%" in proc.stdout

    _check(["mhmoe-export", "demo/model", "exported"], env=env, cwd=work, warm=warm)
    card = (work / "exported" / "README.md").read_text()  # filled from the wheel's model_cards/mhmoe.md
    assert card.startswith("---\n") and "## Architecture" in card and "{{" not in card
    assert "Trained with `mhmoe-train` for 20 steps" in card and "Not recorded" not in card  # train_summary.json
    blocked = work / "no_mhmoe"
    (blocked / "mhmoe").mkdir(parents=True)
    (blocked / "mhmoe" / "__init__.py").write_text("raise ImportError('mhmoe must not be imported here (test)')\n")
    proc = _check(
        [installed["python"], "-c", _EXPORTED, PROMPT], env={**installed["env"], "PYTHONPATH": str(blocked)}, cwd=work
    )
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["mhmoe"] == [] and result["module"].startswith("transformers_modules.")
    assert result["sample"] == summary["sample"]  # the exported code generates what the trained model generated


def test_editable_install_reads_the_top_level_folders(installed, tmp_path):
    """`pip install -e` of the checkout: the code and the data folders are read in place (no copy)."""
    _, python, site = _venv(tmp_path / "venv", installed["core"])
    _pip_install(python, "-e", installed["source"], env=installed["clean"])
    code = "import mhmoe, mhmoe._plumbing.resources as r; print(mhmoe.__file__); print(r.data_dir('eval_tasks'))"
    out = _check([python, "-c", code], env=installed["env"], cwd=installed["work"]).stdout.strip().splitlines()
    source = installed["source"]
    assert out[-2:] == [str(source / "src" / "mhmoe" / "__init__.py"), str(source / "eval_tasks")]
    assert not (site / "mhmoe").exists()


def _readme_python_blocks() -> list[str]:
    blocks, block = [], None
    for line in (ROOT / "README.md").read_text().splitlines():
        if block is None and line.strip() == "```python":
            block = []
        elif block is not None and line.strip() == "```":
            blocks.append("\n".join(block) + "\n")
            block = None
        elif block is not None:
            block.append(line)
    return blocks


def _free_names(code: str) -> set[str]:
    """Names a snippet reads without binding them itself (the reader's own model, tokenizer, folders)."""
    import ast
    import builtins

    tree = ast.parse(code)
    bound = set(dir(builtins))
    for node in ast.walk(tree):
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            bound |= {(alias.asname or alias.name).split(".")[0] for alias in node.names}
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            bound.add(node.id)
    return {node.id for node in ast.walk(tree) if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Load)} - bound


def test_readme_python_snippets_from_the_wheel(installed, wheel_servers):
    """Every README Python snippet that needs nothing from the reader runs from the wheel, outside the checkout, with
    only the core dependencies; where a line prints, the comment after it is what it prints."""
    blocks = [code for code in _readme_python_blocks() if not _free_names(code)]
    assert len(blocks) >= 2, "the README's runnable quick-start snippets are gone"
    for index, code in enumerate(blocks):
        command = [installed["python"], "-c", code]
        proc = _check(command, env=installed["env"], cwd=installed["work"], warm=wheel_servers["core"])
        expected = [line.split("#", 1)[1].strip() for line in code.splitlines() if line.startswith("print(")]
        assert proc.stdout.strip().splitlines() == expected, (index, code)


def _tiny_llama(folder: Path) -> None:
    """A tiny dense Llama with a word-level tokenizer: only the converter's input, written from this process (it is
    not what is under test; the converter reading it is, from the wheel)."""
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
    )
    LlamaForCausalLM(config).save_pretrained(folder)
    vocab = {**{f"w{i}": i for i in range(63)}, "[UNK]": 63}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tokenizer, unk_token="[UNK]").save_pretrained(folder)


def _card_usage(card: str) -> str:
    """The Python block of a model card's Usage section."""
    return card.split("## Usage", 1)[1].split("```python\n", 1)[1].split("```", 1)[0]


def test_converter_and_paper_cuts_from_the_wheel(installed, wheel_servers):
    """From the wheel, with only the core dependencies: the converter (`mhmoe-convert` and `python -m mhmoe.convert`)
    writes a self-contained folder whose card's own usage snippet runs non-interactively where mhmoe cannot be
    imported; mhmoe-export of it keeps the converted card and the conversion record; a usage error is one
    line; the Accelerate configs and the eval-tasks folder are found in the installed package."""
    work, env, warm = installed["work"] / "convert", installed["env"], wheel_servers["core"]
    work.mkdir()
    _tiny_llama(work / "llama")
    command = ["mhmoe-convert", "--input_dir", "llama", "--output_dir", "moh", "--disable_tqdm"]
    proc = _check(command, env=env, cwd=work, warm=warm)
    # the default recipe calibrates, permutes heads (o_proj sums the heads in another order: float rounding only) and
    # fits the learned router
    assert "recipe fitted, router learned" in proc.stdout, proc.stdout
    assert re.search(r"all heads active: max \|Δlogit\| = \S+ vs source -> OK", proc.stdout), proc.stdout
    proc = _check([installed["python"], "-m", "mhmoe.convert", "--help"], env=env, cwd=work, warm=warm)
    assert "--input_dir" in proc.stdout
    proc = _check(["mhmoe-convert", "--bogus"], env=env, cwd=work, returncode=2)
    assert proc.stderr.strip() == "mhmoe-convert: error: unrecognized arguments: --bogus (see mhmoe-convert --help)"

    card = (work / "moh" / "README.md").read_text()
    assert "Converted from a local dense checkpoint" in card and "base_model" not in card.split("---")[1]
    usage = _card_usage(card)
    assert 'AutoTokenizer.from_pretrained("moh", trust_remote_code=True)' in usage
    blocked = work / "no_mhmoe"
    (blocked / "mhmoe").mkdir(parents=True)
    (blocked / "mhmoe" / "__init__.py").write_text("raise ImportError('mhmoe must not be imported here (test)')\n")
    check = usage + (
        "\nimport sys\nassert 'mhmoe' not in sys.modules\nprint(type(model).__module__, tokenizer('w1 w2').input_ids)\n"
    )
    proc = _check([installed["python"], "-c", check], env={**env, "PYTHONPATH": str(blocked)}, cwd=work)
    assert proc.stdout.split()[0].startswith("transformers_modules.") and proc.stdout.strip().endswith("[1, 2]")

    _check(["mhmoe-export", "moh", "exported"], env=env, cwd=work, warm=warm)
    card = (work / "exported" / "README.md").read_text()
    assert "Converted from a local dense checkpoint" in card and "held-out perplexity" in card
    record = (work / "moh" / "moh_conversion.json").read_bytes()
    assert (work / "exported" / "moh_conversion.json").read_bytes() == record

    site_data = installed["site"] / "mhmoe" / "_data"
    code = "from mhmoe._plumbing.resources import data_dir; print(data_dir('examples'))"
    examples = Path(_check([installed["python"], "-c", code], env=env, cwd=work, warm=warm).stdout.strip())
    assert examples == site_data / "examples" and (examples / "accelerate" / "fsdp.yaml").is_file()
    proc = _check(["mhmoe-eval", "--print_tasks_dir"], env=installed["env_extras"], cwd=work)
    assert Path(proc.stdout.strip()) == site_data / "eval_tasks"
