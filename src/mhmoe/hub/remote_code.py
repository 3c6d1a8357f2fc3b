"""The modeling code that makes a checkpoint folder load with `trust_remote_code=True` where mhmoe is not installed.

`write_remote_code(folder, config)` adds to a saved checkpoint folder:

- the modeling code: the `configuration_*.py` / `modeling_*.py` files of the config and model classes and every file
  they import relatively, transitively, flattened into the folder. `moh_llama` imports `from ..moh.moh_attention
  import ...`: those files are copied too and the import is rewritten to `from .moh_attention import ...` (one source
  in the repository, the copy made here). Every exported file may import only torch, transformers, huggingface_hub and the standard library
  at module level (imports inside `try/except ImportError` are skipped, as in Transformers' own check), and relatively
  only from `mhmoe/models/` (the model layer runs on torch and Transformers alone);
- `auto_map` in config.json naming the classes for `AutoConfig`, `AutoModel` and `AutoModelForCausalLM`;
- a model card `README.md` (`cards.py`), unless the folder has one.

Transformers' `register_for_auto_class` + `save_pretrained` (`custom_object_save`) is not used for the copy: it maps
one auto class per saved object (not AutoConfig, AutoModel and AutoModelForCausalLM at once), writes `auto_map` into
the live config, and resolves `from ..moh.moh_attention import` as a file `.moh.moh_attention.py` next to the modeling
file. Its
`get_imports` and `get_relative_import_files` (what the loader itself runs) check the exported folder instead.

`export.export_pretrained` calls `write_remote_code`, and so do training's final save and the converter: an explicit
call, never a side effect of `save_pretrained` (which is Transformers' own).
"""

from __future__ import annotations

import ast
import json
import math
import os
import re
import sys
from pathlib import Path

from .._plumbing.checkpoint_files import CONFIG_NAME, CheckpointError, read_header

TOKENIZER_FILES = ("tokenizer_config.json", "tokenizer.json")
ALLOWED_IMPORTS = frozenset({"torch", "transformers", "huggingface_hub"}) | frozenset(sys.stdlib_module_names)
MODELS_ROOT = Path(__file__).resolve().parents[1] / "models"  # exported code imports relatively only from here
_RELATIVE_FROM = re.compile(r"from\s+\.+[\w.]*\s+import")


class ExportError(CheckpointError):
    """A source or target the export refuses, with the reason and the fix in words."""


def auto_classes(config) -> dict[str, type]:
    """{"AutoConfig": config class, "AutoModel": ..., "AutoModelForCausalLM": ...} for a config of one of mhmoe's
    model types (`mhmoe._plumbing.registration`, the classes mhmoe registers with the Auto classes)."""
    from .._plumbing.registration import model_classes

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
            raise ExportError(
                f"{path}:{node.lineno}: `from {'.' * node.level} import ...` cannot be exported; import "
                "from the module file instead (`from .module import name`)"
            )
        base = path.parent
        for _ in range(node.level - 1):
            base = base.parent
        target = base.joinpath(*node.module.split(".")).with_suffix(".py")
        if not target.is_file() or package_root not in target.resolve().parents:
            raise ExportError(
                f"{path}:{node.lineno}: the relative import of {node.module!r} is not a module file of "
                "mhmoe's model layer (mhmoe/models); exported code may import relatively only from its "
                "module files"
            )
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
    package_root = MODELS_ROOT
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


def _parameter_count(folder: Path) -> int:
    total = 0
    for path in sorted(folder.glob("*.safetensors")):
        header, _ = read_header(str(path), ExportError)
        total += sum(math.prod(t["shape"]) for k, t in header.items() if k != "__metadata__")
    return total


def render_model_card(
    config,
    classes,
    folder: Path,
    repo: str,
    has_tokenizer: bool | None = None,
    records_dir=None,
    training: str | None = None,
) -> str:
    """The model card (README.md, template model_cards/*.md via `cards.py`): architecture from the config,
    parameters from the exported weights, parity of one MoE layer; the base model (converted models) and the training
    from the records in `records_dir` (default: `folder`): moh_conversion.json, train_summary.json (`training`, when
    given, instead of the latter). `has_tokenizer`: whether the usage snippet loads a tokenizer (default: whether
    `folder` has one)."""
    from .cards import folder_records, model_card

    if has_tokenizer is None:
        has_tokenizer = any((folder / name).is_file() for name in TOKENIZER_FILES)

    records = folder_records(records_dir if records_dir is not None else folder)
    if training is not None:
        records["training"] = training
    card = model_card(
        config,
        model_name=repo.rsplit("/", 1)[-1],
        parameters=_parameter_count(folder),
        repo=repo,
        has_tokenizer=has_tokenizer,
        **records,
    )
    return str(card)


def write_remote_code(
    folder: str | os.PathLike,
    config,
    model_card: bool = True,
    repo: str | None = None,
    has_tokenizer: bool | None = None,
    records_dir: str | os.PathLike | None = None,
) -> None:
    """Make a saved checkpoint folder load with `trust_remote_code=True` without mhmoe: the flattened modeling code,
    `auto_map` in config.json (AutoConfig, AutoModel, AutoModelForCausalLM) and, with `model_card`, a README.md card
    (an existing README.md is kept). Called by `export_pretrained`, training's final save and the converter.
    `records_dir`: where the card reads moh_conversion.json / train_summary.json (default: `folder`)."""
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
        card = render_model_card(config, classes, folder, repo or folder.resolve().name, has_tokenizer, records_dir)
        (folder / "README.md").write_text(card, encoding="utf-8")


__all__ = [
    "ALLOWED_IMPORTS",
    "TOKENIZER_FILES",
    "ExportError",
    "auto_classes",
    "check_exported_code",
    "modeling_sources",
    "render_model_card",
    "write_remote_code",
]
