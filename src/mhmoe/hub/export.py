"""Export a checkpoint with its modeling code, so that it loads with `trust_remote_code=True` without mhmoe installed.

`export_pretrained(model_or_dir, save_directory, tokenizer=None)` writes a self-contained folder:

- the weights as safetensors (an in-memory model through `save_pretrained`; a checkpoint directory's shards and index
  copied byte for byte; pickle-only checkpoints are refused, never unpickled), after the `export_transform` of the
  model's linear_type, if it has one: a BitNet b1.58 model (`linear_type="bitnet_b158"`) is written packed: int8
  ternary weights and one fp32 scale per matrix (`bitnet_packed=True`, inference only, the same logits),
- `config.json` with an `auto_map` naming the classes for `AutoConfig`, `AutoModel` and `AutoModelForCausalLM`,
- `generation_config.json`, the tokenizer (the one given, else the source directory's; without an `auto_map` naming
  code of the source folder), `moh_conversion.json` of a converted model (folder names, never local paths), a
  model card `README.md` (the converted card naming the base model for a converted model; the training from the
  source's `train_summary.json`),
- the modeling code (`remote_code.py`: the model's files flattened into the folder, checked as Transformers' loader
  reads them).

The folder is written to a temporary directory next to `save_directory` and renamed at the end: a failure leaves
nothing behind (and an existing directory replaced with `overwrite=True` stays as it was; a killed export's hidden
folders are removed by the next one, `checkpoint_files.recover_output_dir`). The source's config and tokenizer are read
with `trust_remote_code=False` unless asked otherwise. `push_to_hub="user/name"`
then uploads the folder with `huggingface_hub.HfApi.upload_folder`; that needs the network and a token, so the offline
test suite does not exercise it. `mhmoe-export SRC_DIR OUT_DIR [--overwrite] [--push_to_hub REPO]` is the CLI
(`cli.py`).
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from .._plumbing.checkpoint_files import (
    CONFIG_NAME,
    GENERATION_CONFIG_NAME,
    SAFE_INDEX_NAME,
    check_weight_files,
    check_writable,
    drop_code_references,
    fsync,
    overlapping,
    recover_output_dir,
    replace_dir,
    temporary_dir_next_to,
)
from .._plumbing.trust import Pinned, check_links, load_config, load_tokenizer, pinned
from .cards import CONVERSION_RECORDS, public_paths
from .remote_code import TOKENIZER_FILES, ExportError, auto_classes, modeling_sources, write_remote_code


def _first_line(error: Exception) -> str:
    return next((line.strip() for line in str(error).splitlines() if line.strip()), type(error).__name__)


def _source_dir(path: str, trust_remote_code: bool = False) -> Pinned:
    """A checkpoint directory's files, pinned (`trust.pinned`: opened once, checked, never through a link out of it)."""
    if not os.path.isdir(path):
        raise ExportError(f"source {path} is not a directory (give a checkpoint directory or a model object)")
    if not os.path.isfile(os.path.join(path, CONFIG_NAME)):
        raise ExportError(f"source {path} is not a Transformers checkpoint: no {CONFIG_NAME}")
    # nothing is read (re-saved, uploaded) through a link out of it, nor a file swapped for one once checked
    return pinned(path, ExportError, "source", code=trust_remote_code)


def _source_files(path: str, trust_remote_code: bool = False):
    """(config, weight file names) of a pinned checkpoint directory of an mhmoe model type."""
    try:
        config = load_config(path, ExportError, trust_remote_code)
    except (OSError, TypeError, ValueError, KeyError) as e:
        if isinstance(e, ExportError):
            raise
        raise ExportError(f"cannot read the config of {path}: {_first_line(e)}") from None
    classes = auto_classes(config)
    shards = check_weight_files(path, ExportError)
    _check_weights_fit_config(path, config, shards, classes["AutoModelForCausalLM"])
    index = os.path.isfile(os.path.join(path, SAFE_INDEX_NAME))
    return config, shards + ([SAFE_INDEX_NAME] if index else [])


def _check_weights_fit_config(path: str, config, shards: list[str], model_class) -> None:
    """The tensors of the weight files are the ones the config's model has, with its shapes: a config.json that does
    not describe its weights (another vocab_size, more layers) would export fine and fail to load."""
    import torch

    from .._plumbing.checkpoint_files import read_header

    with torch.device("meta"):
        model = model_class(config)
    expected = {name: list(t.shape) for name, t in model.state_dict().items()}
    found = {}
    for shard in shards:
        header, _ = read_header(os.path.join(path, shard), ExportError)
        found.update({name: info["shape"] for name, info in header.items() if name != "__metadata__"})
    tied = {"lm_head.weight"} if getattr(config.get_text_config(), "tie_word_embeddings", False) else set()
    missing = sorted(set(expected) - set(found) - tied)
    unexpected = sorted(set(found) - set(expected))
    mismatched = sorted(n for n in set(expected) & set(found) if expected[n] != found[n])
    if missing or unexpected or mismatched:
        first = mismatched[0] if mismatched else None
        shape = f"{first}: {found.get(first)} in the weights, {expected.get(first)} in the config"
        problems = [
            f"{len(names)} {what} (e.g. {example})"
            for names, what, example in (
                (missing, "tensors the config needs are missing", missing[:1] and missing[0]),
                (unexpected, "tensors the config has no place for", unexpected[:1] and unexpected[0]),
                (mismatched, "tensors have other shapes", shape),
            )
            if names
        ]
        sizes = ", ".join(
            f"{k}={getattr(config, k)}"
            for k in ("vocab_size", "hidden_size", "num_hidden_layers")
            if getattr(config, k, None) is not None
        )
        raise ExportError(
            f"the weights in {path} do not match its config.json ({sizes}): {'; '.join(problems)}; fix "
            "config.json or export the folder the weights came from"
        )


def _check_target(save_directory: str, overwrite: bool, source_dir: str | None) -> None:
    recover_output_dir(save_directory)  # what an earlier, killed export to it left
    if os.path.lexists(save_directory) and not os.path.isdir(save_directory):
        raise ExportError(f"{save_directory} exists and is not a directory; choose another save directory")
    if os.path.isdir(save_directory) and os.listdir(save_directory) and not overwrite:
        raise ExportError(
            f"{save_directory} exists and is not empty; pass overwrite=True (mhmoe-export --overwrite) "
            "to replace it, or choose an empty or new directory"
        )
    if source_dir is not None and overlapping(source_dir, save_directory):
        raise ExportError(
            f"save directory {save_directory} must not be the source {source_dir}, inside it, or "
            "contain it; choose another directory"
        )
    check_writable(save_directory, ExportError)


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
    trust_remote_code: bool = False,
) -> Path:
    """Write `model` (an mhmoe `PreTrainedModel`, or the path of a checkpoint directory) with its modeling code to
    `save_directory`, so that `AutoModelForCausalLM.from_pretrained(save_directory, trust_remote_code=True)` works
    without mhmoe. See the module docstring for what is written.

    `tokenizer`: a tokenizer object or path saved alongside (default: the source directory's tokenizer, if any).
    `overwrite`: replace a non-empty `save_directory` (refused otherwise). `model_card`: write README.md.
    `push_to_hub`: a Hub repo id ("user/name"); the finished folder is uploaded with `HfApi.upload_folder` (repo
    created if missing, `private` and `token` passed on). Not covered by the offline tests: it needs the network.
    `trust_remote_code`: passed to Transformers when reading the source's config and tokenizer (default False: code a
    source folder names is never run). Raises `ExportError` for anything refused (nothing is written then), and for a
    failed upload (the exported folder stays; the message gives the command that retries the upload).
    """
    from transformers import PreTrainedModel

    save_directory = os.fspath(save_directory)
    source_dir = os.fspath(model) if isinstance(model, (str, os.PathLike)) else None
    if source_dir is None and not isinstance(model, PreTrainedModel):
        kind = type(model).__name__
        hint = " (merge a PEFT adapter first: model.merge_and_unload())" if "Peft" in kind else ""
        raise ExportError(f"cannot export a {kind}: give an mhmoe PreTrainedModel or a checkpoint directory{hint}")
    _check_target(save_directory, overwrite, source_dir)
    if source_dir is None:
        _export(model, None, save_directory, tokenizer, overwrite, model_card, push_to_hub, trust_remote_code)
    else:  # read from its pinned files; errors name the folder given
        with _source_dir(source_dir, trust_remote_code) as source:
            options = (save_directory, tokenizer, overwrite, model_card, push_to_hub, trust_remote_code)
            _export(source.path, source_dir, *options)
    if push_to_hub:
        upload_folder(save_directory, push_to_hub, private, token, commit_message)
    return Path(save_directory)


def _export(model, source_dir, save_directory, tokenizer, overwrite, model_card, push_to_hub, trust_remote_code):
    """`export_pretrained` once its arguments are checked: `model` is a model object, or the pinned files of the
    checkpoint directory `source_dir` (the folder given)."""
    records = model if source_dir is not None else None  # the pinned folder: how a converted model was made
    if source_dir is not None:
        config, weight_files = _source_files(model, trust_remote_code)
        if tokenizer is None and any(os.path.isfile(os.path.join(model, f)) for f in TOKENIZER_FILES):
            tokenizer = model
    else:
        config, weight_files = model.config, None
    transform = _export_transform(config)  # e.g. BitNet's: int8 ternary weights + scales, not the latent weights
    if transform is not None:
        model, weight_files = transform(_model_object(model)), None
        config = model.config
    if isinstance(tokenizer, (str, os.PathLike)):
        check_links(tokenizer, ExportError, "tokenizer folder")
        tokenizer = load_tokenizer(tokenizer, ExportError, trust_remote_code)  # its pinned files
    classes = auto_classes(config)
    modeling_sources(classes.values())  # refuses code that cannot be exported before anything is written

    temporary = Path(temporary_dir_next_to(save_directory))
    try:
        _write_weights(temporary, model, config, weight_files)
        if tokenizer is not None:
            tokenizer.save_pretrained(temporary)
            if (temporary / "tokenizer_config.json").is_file():  # no auto_map naming code that is not exported
                drop_code_references(str(temporary / "tokenizer_config.json"))
        record = next((os.path.join(records, n) for n in CONVERSION_RECORDS if _is_file(records, n)), None)
        if record is not None:  # its card names the base model
            _copy_conversion_record(record, temporary / "moh_conversion.json")
        repo = push_to_hub or os.path.basename(os.path.abspath(save_directory))
        has_tokenizer = tokenizer is not None
        write_remote_code(
            temporary, config, model_card=model_card, repo=repo, has_tokenizer=has_tokenizer, records_dir=records
        )
        for path in temporary.rglob("*"):
            if path.is_file():
                fsync(str(path))
        fsync(str(temporary))
        _check_target(save_directory, overwrite, source_dir)  # nothing appeared meanwhile
        replace_dir(str(temporary), save_directory)
    except BaseException:
        shutil.rmtree(temporary, ignore_errors=True)
        raise


def _is_file(folder: str | None, name: str) -> bool:
    return folder is not None and os.path.isfile(os.path.join(folder, name))


def _export_transform(config):
    """What the config's linear_type does to a model before it is written (`export_transform` of its class, e.g.
    `bitnet.packed_model`), or None."""
    from ..models.mhmoe.linear_types import linear_class

    return linear_class(config).export_transform(config)


def _model_object(model):
    """A model object, or the MHMoE model a checkpoint directory holds (only MHMoE models have a linear_type)."""
    from ..models.mhmoe.modeling_mhmoe import MHMoEForCausalLM

    if isinstance(model, (str, os.PathLike)):
        model = MHMoEForCausalLM.from_pretrained(model, trust_remote_code=False)
    return model


def _copy_conversion_record(source: str, target: Path) -> None:
    """moh_conversion.json as it is, except that a record from an older mhmoe-convert, which kept the absolute local
    paths of its folders, gets their names instead (`cards.public_paths`): the export is published."""
    import json

    try:
        with open(source, encoding="utf-8") as f:
            record = json.load(f)
        local = {k: v for k in ("input_dir", "output_dir") if isinstance(v := record.get(k), str) and os.path.isabs(v)}
    except (ValueError, AttributeError):  # not a JSON object: copied as it is (the card skips it)
        local = {}
    if local:
        names = public_paths(record.get("input_dir", ""), record.get("output_dir", ""))
        record.update({k: names[k] for k in local})
        target.write_text(json.dumps(record, indent=2), encoding="utf-8")
    else:
        shutil.copyfile(source, target)


def _write_weights(folder: Path, source, config, weight_files: list[str] | None) -> None:
    """Weights, config.json and generation_config.json into `folder`: a model object through `save_pretrained`, a
    checkpoint directory's files copied byte for byte (a generation config made from the config if it has none)."""
    from transformers import GenerationConfig

    if not isinstance(source, str):
        source.save_pretrained(folder)  # the code is written by write_remote_code
        return
    for name in weight_files:
        shutil.copy2(os.path.join(source, name), folder / name)
    shutil.copy2(os.path.join(source, CONFIG_NAME), folder / CONFIG_NAME)
    generation = os.path.join(source, GENERATION_CONFIG_NAME)
    if os.path.isfile(generation):
        shutil.copy2(generation, folder / GENERATION_CONFIG_NAME)
    else:
        GenerationConfig.from_model_config(config).save_pretrained(folder)


def upload_folder(
    folder: str,
    repo_id: str,
    private: bool | None = None,
    token: str | None = None,
    commit_message: str = "Upload model exported with mhmoe",
) -> None:
    """Upload a finished export with `HfApi.upload_folder` (the repo is created if missing). A failure (network,
    authentication, offline mode) raises `ExportError` saying the folder is complete and how to retry."""
    from huggingface_hub import HfApi

    check_links(folder, ExportError, "the folder to upload")  # never uploads what a link out of it points to
    try:
        api = HfApi(token=token)
        api.create_repo(repo_id, private=private, exist_ok=True)
        api.upload_folder(repo_id=repo_id, folder_path=folder, commit_message=commit_message)
    except Exception as e:  # the export itself is complete
        raise ExportError(
            f"{folder} was exported, but uploading it to {repo_id} failed ({type(e).__name__}: {e}); "
            f"log in (`hf auth login`) or pass token=..., then retry: `hf upload {repo_id} {folder}`"
        ) from e


__all__ = ["ExportError", "export_pretrained", "upload_folder"]
