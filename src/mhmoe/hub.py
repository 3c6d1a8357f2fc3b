"""Export a checkpoint with its modeling code, so that it loads with `trust_remote_code=True` without mhmoe installed.

`export_pretrained(model_or_dir, save_directory, tokenizer=None)` writes a self-contained folder:

- the weights as safetensors (an in-memory model through `save_pretrained`; a checkpoint directory's shards and index
  copied byte for byte; pickle-only checkpoints are refused, never unpickled). A BitNet b1.58 model
  (`linear_type="bitnet_b158"`) is written packed: int8 ternary weights and one fp32 scale per matrix
  (`bitnet_packed=True`, inference only, the same logits),
- `config.json` with an `auto_map` naming the classes for `AutoConfig`, `AutoModel` and `AutoModelForCausalLM`,
- `generation_config.json`, the tokenizer (the one given, else the source directory's), a model card `README.md`,
- the modeling code: the `configuration_*.py` / `modeling_*.py` files of the config and model classes and every file
  they import relatively, transitively, flattened into the folder. `moh_llama` imports `from ..mhmoe.moh import ...`:
  those files are copied too and the import is rewritten to `from .moh import ...` (one source in the repository, the
  copy made here). Every exported file may import only torch, transformers, huggingface_hub and the standard library
  at module level (imports inside `try/except ImportError` are skipped, as in Transformers' own check).

Transformers' `register_for_auto_class` + `save_pretrained` (`custom_object_save`) is not used for the copy: it maps
one auto class per saved object (not AutoConfig, AutoModel and AutoModelForCausalLM at once), writes `auto_map` into
the live config, and resolves `from ..mhmoe.moh import` as a file `.mhmoe.moh.py` next to the modeling file. Its
`get_imports` and `get_relative_import_files` (what the loader itself runs) check the exported folder instead.

The folder is written to a temporary directory next to `save_directory` and renamed at the end: a failure leaves
nothing behind (and an existing directory replaced with `overwrite=True` stays as it was). `push_to_hub="user/name"`
then uploads the folder with `huggingface_hub.HfApi.upload_folder`; that needs the network and a token, so the offline
test suite does not exercise it. `mhmoe-export SRC_DIR OUT_DIR [--overwrite] [--push_to_hub REPO]` is the CLI.
"""

from __future__ import annotations

import argparse
import ast
import json
import math
import os
import re
import shutil
import sys
from pathlib import Path

from transformers.utils import CONFIG_NAME, GENERATION_CONFIG_NAME

from .checkpoint_files import (
    SAFE_INDEX_NAME, CheckpointError, fsync, overlapping, read_header, replace_dir, temporary_dir_next_to, weight_files,
)

TOKENIZER_FILES = ("tokenizer_config.json", "tokenizer.json")
ALLOWED_IMPORTS = frozenset({"torch", "transformers", "huggingface_hub"}) | frozenset(sys.stdlib_module_names)
_RELATIVE_FROM = re.compile(r"from\s+\.+[\w.]*\s+import")


class ExportError(CheckpointError):
    """A source or target the export refuses, with the reason and the fix in words."""


# ------------------------------------------------------------------------------------------------- classes and code


def auto_classes(config) -> dict[str, type]:
    """{"AutoConfig": config class, "AutoModel": ..., "AutoModelForCausalLM": ...} for a config of one of mhmoe's
    model types (`mhmoe.registration`, the classes mhmoe registers with the Auto classes)."""
    from .registration import model_classes

    config_class = type(config)
    classes = model_classes().get(config_class)
    if classes is None:
        raise ExportError(
            f"model_type {getattr(config, 'model_type', None)!r} ({config_class.__name__}) is not one of mhmoe's "
            "model types ('mhmoe', 'moh_llama'); only those are exported with their modeling code. A Llama, Mistral or "
            "Qwen2 model patched with apply_moh has no modeling code of its own: convert the checkpoint with "
            "mhmoe-convert into a moh_llama checkpoint first"
        )
    return {"AutoConfig": config_class, **classes}


def _module_file(cls: type) -> Path:
    return Path(sys.modules[cls.__module__].__file__).resolve()


def _flatten_imports(path: Path, package_root: Path) -> tuple[str, list[Path]]:
    """The text of `path` with every relative import rewritten to `from .<file stem> import`, and the files imported."""
    text = path.read_text(encoding="utf-8")
    lines = text.splitlines(keepends=True)
    needed = []
    for node in ast.walk(ast.parse(text, filename=str(path))):
        if not isinstance(node, ast.ImportFrom) or node.level == 0:
            continue
        if node.module is None:
            raise ExportError(f"{path}:{node.lineno}: `from {'.' * node.level} import ...` cannot be exported; import "
                              "from the module file instead (`from .module import name`)")  # fmt: skip
        base = path.parent
        for _ in range(node.level - 1):
            base = base.parent
        target = base.joinpath(*node.module.split(".")).with_suffix(".py")
        if not target.is_file() or package_root not in target.resolve().parents:
            raise ExportError(f"{path}:{node.lineno}: the relative import of {node.module!r} is not a module file of "
                              "the mhmoe package; exported code may import relatively only from module files")
        needed.append(target.resolve())
        if node.level != 1 or "." in node.module:
            line = lines[node.lineno - 1]
            new, count = _RELATIVE_FROM.subn(f"from .{target.stem} import", line, count=1)
            if not count:
                raise ExportError(f"{path}:{node.lineno}: cannot rewrite the relative import {line.strip()!r}")
            lines[node.lineno - 1] = new
    return "".join(lines), needed


def modeling_sources(classes) -> dict[str, str]:
    """{exported file name: text}: the files defining `classes` and, transitively, every file they import relatively,
    flattened into one folder (relative imports rewritten to `from .<file> import`)."""
    package_root = Path(__file__).resolve().parent
    origin: dict[str, Path] = {}
    texts: dict[str, str] = {}
    queue = list(dict.fromkeys(_module_file(c) for c in classes))
    while queue:
        path = queue.pop(0)
        if path.name in origin:
            if origin[path.name] != path:
                raise ExportError(f"two source files export as {path.name}: {origin[path.name]} and {path}; rename one")
            continue
        origin[path.name] = path
        texts[path.name], needed = _flatten_imports(path, package_root)
        queue.extend(needed)
    return texts


def check_exported_code(folder: str | os.PathLike) -> list[str]:
    """Check the exported code the way Transformers' loader reads it: every relative import names a file of the
    folder, and module-level imports (Transformers' `get_imports`, which skips try/except blocks) are torch,
    transformers, huggingface_hub or the standard library. Returns the checked file names."""
    from transformers.dynamic_module_utils import get_imports, get_relative_import_files

    names = sorted(p.name for p in Path(folder).glob("*.py"))
    for name in names:
        path = Path(folder) / name
        missing = [Path(f).name for f in get_relative_import_files(path) if not Path(f).is_file()]
        if missing:
            raise ExportError(f"exported {name} imports {', '.join(missing)}, which is not in the exported folder")
        foreign = [m for m in get_imports(path) if m not in ALLOWED_IMPORTS]
        if foreign:
            raise ExportError(
                f"exported {name} imports {', '.join(foreign)} at module level; code loaded with trust_remote_code "
                "must run on torch, transformers and huggingface_hub alone: guard optional imports with "
                "`try: ... except ImportError:`"
            )
    return names


# ----------------------------------------------------------------------------------------------------------- sources


def _source_dir(path: str):
    """(config, weight file names) of a checkpoint directory of an mhmoe model type."""
    from transformers import AutoConfig

    if not os.path.isdir(path):
        raise ExportError(f"source {path} is not a directory (give a checkpoint directory or a model object)")
    if not os.path.isfile(os.path.join(path, CONFIG_NAME)):
        raise ExportError(f"source {path} is not a Transformers checkpoint: no {CONFIG_NAME}")
    try:
        config = AutoConfig.from_pretrained(path)
    except (OSError, TypeError, ValueError, KeyError) as e:
        raise ExportError(f"cannot read the config of {path}: {e}") from None
    auto_classes(config)
    shards, weight_map = weight_files(path, ExportError)
    return config, shards + ([] if weight_map is None else [SAFE_INDEX_NAME])


def _check_target(save_directory: str, overwrite: bool, source_dir: str | None) -> None:
    if os.path.lexists(save_directory) and not os.path.isdir(save_directory):
        raise ExportError(f"{save_directory} exists and is not a directory; choose another save directory")
    if os.path.isdir(save_directory) and os.listdir(save_directory) and not overwrite:
        raise ExportError(f"{save_directory} exists and is not empty; pass overwrite=True (mhmoe-export --overwrite) "
                          "to replace it, or choose an empty or new directory")  # fmt: skip
    if source_dir is not None and overlapping(source_dir, save_directory):
        raise ExportError(f"save directory {save_directory} must not be the source {source_dir}, inside it, or "
                          "contain it; choose another directory")  # fmt: skip


# -------------------------------------------------------------------------------------------------------- model card

def _parameter_count(folder: Path) -> int:
    total = 0
    for path in sorted(folder.glob("*.safetensors")):
        header, _ = read_header(str(path), ExportError)
        total += sum(math.prod(t["shape"]) for k, t in header.items() if k != "__metadata__")
    return total


def render_model_card(config, classes, folder: Path, repo: str, has_tokenizer: bool) -> str:
    """The model card (README.md, template model_cards/*.md via `mhmoe.cards`): architecture from the config,
    parameters from the exported weights, parity of one MoE layer."""
    from .cards import model_card

    card = model_card(config, model_name=repo.rsplit("/", 1)[-1], parameters=_parameter_count(folder), repo=repo,
                      has_tokenizer=has_tokenizer)  # fmt: skip
    return str(card)


# ------------------------------------------------------------------------------------------------------------ export


def export_pretrained(
    model,
    save_directory: str | os.PathLike,
    tokenizer=None,
    overwrite: bool = False,
    model_card: bool = True,
    push_to_hub: str | None = None,
    private: bool | None = None,
    token: str | None = None,
    commit_message: str = "Upload model exported with mhmoe",
) -> Path:
    """Write `model` (an mhmoe `PreTrainedModel`, or the path of a checkpoint directory) with its modeling code to
    `save_directory`, so that `AutoModelForCausalLM.from_pretrained(save_directory, trust_remote_code=True)` works
    without mhmoe. See the module docstring for what is written.

    `tokenizer`: a tokenizer object or path saved alongside (default: the source directory's tokenizer, if any).
    `overwrite`: replace a non-empty `save_directory` (refused otherwise). `model_card`: write README.md.
    `push_to_hub`: a Hub repo id ("user/name"); the finished folder is uploaded with `HfApi.upload_folder` (repo
    created if missing, `private` and `token` passed on). Not covered by the offline tests: it needs the network.
    Raises `ExportError` for anything refused (nothing is written then), and for a failed upload (the exported folder
    stays; the message gives the command that retries the upload).
    """
    from transformers import AutoTokenizer, PreTrainedModel

    save_directory = os.fspath(save_directory)
    source_dir = os.fspath(model) if isinstance(model, (str, os.PathLike)) else None
    if source_dir is None and not isinstance(model, PreTrainedModel):
        kind = type(model).__name__
        hint = " (merge a PEFT adapter first: model.merge_and_unload())" if "Peft" in kind else ""
        raise ExportError(f"cannot export a {kind}: give an mhmoe PreTrainedModel or a checkpoint directory{hint}")
    _check_target(save_directory, overwrite, source_dir)
    if source_dir is not None:
        config, weight_files = _source_dir(source_dir)
        if tokenizer is None and any(os.path.isfile(os.path.join(source_dir, f)) for f in TOKENIZER_FILES):
            tokenizer = source_dir
    else:
        config, weight_files = model.config, None
    if getattr(config, "linear_type", "linear") == "bitnet_b158" and not config.bitnet_packed:
        model, weight_files = _bitnet_packed(model), None  # int8 ternary weights + scales, not the latent weights
        config = model.config
    if isinstance(tokenizer, (str, os.PathLike)):
        tokenizer = AutoTokenizer.from_pretrained(tokenizer)
    classes = auto_classes(config)
    modeling_sources(classes.values())  # refuses code that cannot be exported before anything is written

    temporary = Path(temporary_dir_next_to(save_directory))
    try:
        _write_weights(temporary, model if weight_files is None else source_dir, config, weight_files)
        if tokenizer is not None:
            tokenizer.save_pretrained(temporary)
        repo = push_to_hub or os.path.basename(os.path.abspath(save_directory))
        write_remote_code(temporary, config, model_card=model_card, repo=repo, has_tokenizer=tokenizer is not None)
        for path in temporary.iterdir():
            fsync(str(path))
        fsync(str(temporary))
        _check_target(save_directory, overwrite, source_dir)  # nothing appeared meanwhile
        replace_dir(str(temporary), save_directory)
    except BaseException:
        shutil.rmtree(temporary, ignore_errors=True)
        raise
    if push_to_hub:
        upload_folder(save_directory, push_to_hub, private, token, commit_message)
    return Path(save_directory)


def write_remote_code(folder: str | os.PathLike, config, model_card: bool = True, repo: str | None = None,
                      has_tokenizer: bool | None = None) -> None:  # fmt: skip
    """Make a saved checkpoint folder load with `trust_remote_code=True` without mhmoe: the flattened modeling code,
    `auto_map` in config.json (AutoConfig, AutoModel, AutoModelForCausalLM) and, with `model_card`, a README.md card
    (an existing README.md is kept). Called by `export_pretrained` and by `save_pretrained` / `push_to_hub` of mhmoe
    models."""
    folder = Path(folder)
    classes = auto_classes(config)
    config_path = folder / CONFIG_NAME
    config_dict = json.loads(config_path.read_text())
    config_dict["auto_map"] = {auto: f"{_module_file(cls).stem}.{cls.__name__}" for auto, cls in classes.items()}
    config_path.write_text(json.dumps(config_dict, indent=2, sort_keys=True) + "\n")
    for name, text in modeling_sources(classes.values()).items():
        (folder / name).write_text(text, encoding="utf-8")
    check_exported_code(folder)
    if model_card and not (folder / "README.md").exists():
        if has_tokenizer is None:
            has_tokenizer = any((folder / name).is_file() for name in TOKENIZER_FILES)
        card = render_model_card(config, classes, folder, repo or folder.resolve().name, has_tokenizer)
        (folder / "README.md").write_text(card, encoding="utf-8")


def _bitnet_packed(model):
    """A latent BitNet model (object or checkpoint directory) as its packed inference copy (`bitnet.packed_model`)."""
    from .models.mhmoe.bitnet import packed_model
    from .models.mhmoe.modeling_mhmoe import MHMoEForCausalLM

    if isinstance(model, (str, os.PathLike)):
        model = MHMoEForCausalLM.from_pretrained(model)
    return packed_model(model)


def _write_weights(folder: Path, source, config, weight_files: list[str] | None) -> None:
    """Weights, config.json and generation_config.json into `folder`: a model object through `save_pretrained`, a
    checkpoint directory's files copied byte for byte (a generation config made from the config if it has none)."""
    from transformers import GenerationConfig

    if not isinstance(source, str):
        source.save_pretrained(folder, self_contained=False)  # the code is written by write_remote_code
        return
    for name in weight_files:
        shutil.copy2(os.path.join(source, name), folder / name)
    shutil.copy2(os.path.join(source, CONFIG_NAME), folder / CONFIG_NAME)
    generation = os.path.join(source, GENERATION_CONFIG_NAME)
    if os.path.isfile(generation):
        shutil.copy2(generation, folder / GENERATION_CONFIG_NAME)
    else:
        GenerationConfig.from_model_config(config).save_pretrained(folder)


def upload_folder(folder: str, repo_id: str, private: bool | None = None, token: str | None = None,
                  commit_message: str = "Upload model exported with mhmoe") -> None:  # fmt: skip
    """Upload a finished export with `HfApi.upload_folder` (the repo is created if missing). A failure (network,
    authentication, offline mode) raises `ExportError` saying the folder is complete and how to retry."""
    from huggingface_hub import HfApi

    try:
        api = HfApi(token=token)
        api.create_repo(repo_id, private=private, exist_ok=True)
        api.upload_folder(repo_id=repo_id, folder_path=folder, commit_message=commit_message)
    except Exception as e:  # the export itself is complete
        raise ExportError(
            f"{folder} was exported, but uploading it to {repo_id} failed ({type(e).__name__}: {e}); "
            f"log in (`hf auth login`) or pass token=..., then retry: `hf upload {repo_id} {folder}`"
        ) from e


def main(argv: list[str] | None = None) -> None:
    """`mhmoe-export SRC_DIR OUT_DIR [--overwrite] [--push_to_hub REPO]`; refusals exit with status 2 and a message."""
    parser = argparse.ArgumentParser(
        prog="mhmoe-export",
        description="Export an mhmoe checkpoint with its modeling code (loads with trust_remote_code=True without "
        "mhmoe installed), a model card and the tokenizer; optionally upload it to the Hugging Face Hub.",
    )
    parser.add_argument("src_dir", help="checkpoint directory (model_type mhmoe or moh_llama, safetensors)")
    parser.add_argument("out_dir", help="directory to write (must be new or empty unless --overwrite)")
    parser.add_argument("--overwrite", action="store_true", help="replace a non-empty OUT_DIR")
    parser.add_argument("--push_to_hub", metavar="REPO", help="upload the exported folder to this Hub repo id")
    parser.add_argument("--private", action="store_true", help="create the Hub repo as private")
    parser.add_argument("--no_model_card", action="store_true", help="do not write README.md")
    args = parser.parse_args(argv)
    try:
        out = export_pretrained(args.src_dir, args.out_dir, overwrite=args.overwrite, model_card=not args.no_model_card,
                                push_to_hub=args.push_to_hub, private=args.private or None)  # fmt: skip
    except ExportError as e:
        parser.exit(2, f"mhmoe-export: error: {e}\n")
    print(f"exported {args.src_dir} -> {out}" + (f" (uploaded to {args.push_to_hub})" if args.push_to_hub else ""))


if __name__ == "__main__":
    main(sys.argv[1:])
