"""`mhmoe-train --dataset X`: training and validation examples from any source the `datasets` library reads.

X is a local data file (json, jsonl, csv, parquet, arrow, txt), a folder of such files, a folder written by
`Dataset.save_to_disk` / `DatasetDict.save_to_disk`, or a Hub dataset name (`--dataset_config`, `--dataset_split`;
offline, a name that is not in the local cache fails in one line). `--streaming` reads it as an `IterableDataset`
(nothing loaded up front). `--validation_split` names a split, or holds out a percentage of the examples ("5%"): every
example whose index i has floor((i + 1)·p/100) > floor(i·p/100) (evenly spread, the same on a stream and on a map-style
dataset; never a random draw that a stream could not repeat).

Like Transformers' `run_clm.py`, loading goes through `datasets.load_dataset` / `load_from_disk`; a `.txt` file gives
one example per paragraph (blank-line separated) in the `text` column.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

from .arguments import TrainingError, validation_percentage

# file suffix -> the `datasets` packaged builder that reads it
FILE_BUILDERS = {
    ".json": "json",
    ".jsonl": "json",
    ".ndjson": "json",
    ".csv": "csv",
    ".tsv": "csv",
    ".parquet": "parquet",
    ".arrow": "arrow",
    ".txt": "text",
    ".text": "text",
}
SAVED_TO_DISK = ("dataset_info.json", "state.json", "dataset_dict.json")  # what save_to_disk writes


@dataclass
class Source:
    """The examples of a run: `train` and `validation` are `datasets.Dataset` (map-style) or `IterableDataset`
    (--streaming); `validation` None without a validation split; `held_out` the percentage of `train`'s examples that
    are validation examples instead (`held_out()`), 0 for none. `name` says where the examples came from."""

    train: Any
    validation: Any
    name: str
    streaming: bool
    held_out: float = 0.0


def held_out(index: int, percentage: float) -> bool:
    """Whether example `index` goes to the validation split of `percentage` % (evenly spread, deterministic)."""
    return int((index + 1) * percentage / 100) > int(index * percentage / 100)


def _builder_of(path: str) -> str:
    suffix = os.path.splitext(path)[1].lower()
    if suffix not in FILE_BUILDERS:
        known = ", ".join(sorted(FILE_BUILDERS))
        raise TrainingError(f"--dataset {path}: unknown file type {suffix or '(none)'!r} (one of {known})")
    return FILE_BUILDERS[suffix]


def _folder_kind(folder: str) -> str:
    """The builder of a folder of data files (one kind of file per folder); `datasets` infers the splits from the
    file names (train*, validation*, test*, ...)."""
    builders = {
        FILE_BUILDERS[os.path.splitext(name)[1].lower()]
        for _, _, names in os.walk(folder)
        for name in names
        if os.path.splitext(name)[1].lower() in FILE_BUILDERS and not name.startswith(".")
    }
    if not builders:
        known = ", ".join(sorted(FILE_BUILDERS))
        raise TrainingError(f"--dataset {folder}: a folder with no data file in it ({known})")
    if len(builders) > 1:
        raise TrainingError(
            f"--dataset {folder}: files of several kinds ({', '.join(sorted(builders))}); keep one kind per folder"
        )
    return builders.pop()


def _load(args, split: str, streaming: bool):
    """One split of `args.dataset` as a (possibly iterable) dataset."""
    import datasets

    name = args.dataset
    kwargs: dict[str, Any] = {"streaming": streaming}
    if os.path.isfile(name):
        builder = _builder_of(name)
        if builder == "text":
            kwargs["sample_by"] = "paragraph"
        return datasets.load_dataset(builder, data_files={"train": name}, split=split, **kwargs)
    if os.path.isdir(name):
        if any(os.path.isfile(os.path.join(name, f)) for f in SAVED_TO_DISK):
            loaded = datasets.load_from_disk(name)
            if isinstance(loaded, datasets.DatasetDict):
                if split not in loaded:
                    raise _missing_split(name, split, list(loaded))
                loaded = loaded[split]
            return loaded.to_iterable_dataset() if streaming else loaded
        if _folder_kind(name) == "text":
            kwargs["sample_by"] = "paragraph"
        return datasets.load_dataset(name, split=split, **kwargs)
    return datasets.load_dataset(name, args.dataset_config, split=split, **kwargs)


def _missing_split(name: str, split: str, splits: list[str]) -> TrainingError:
    return TrainingError(f"--dataset {name} has no split {split!r} (it has: {', '.join(sorted(splits))})")


def _one_line(error: BaseException) -> str:
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__


def _load_or_explain(args, split: str, streaming: bool):
    """`_load`, with what `datasets` raises turned into one line naming the source and the fix."""
    try:
        return _load(args, split, streaming)
    except TrainingError:
        raise
    except Exception as e:  # datasets', pyarrow's and fsspec's errors, or a StopIteration from an unparsable file
        if not os.path.exists(args.dataset) and _offline():
            raise TrainingError(
                f"--dataset {args.dataset!r} is not a local file or folder, and the Hugging Face Hub cannot be "
                "reached offline (HF_DATASETS_OFFLINE=1 / HF_HUB_OFFLINE=1) nor is it in the local cache: give a "
                "local file or folder, or unset the offline variables on a machine with a network"
            ) from None
        if "corresponds to no data" in str(e):  # datasets' words for an empty split
            raise TrainingError(f"--dataset {args.dataset}: the {split!r} split has no records") from None
        if "split" in str(e).lower() and isinstance(e, ValueError):
            raise TrainingError(f"--dataset {args.dataset}: {_one_line(e)} (--dataset_split names the split)") from None
        raise TrainingError(f"--dataset {args.dataset} does not load ({type(e).__name__}: {_one_line(e)})") from None


def iter_records(dataset, name: str):
    """(index, record) of `dataset`, a read failure part way turned into one line (`reading_error`)."""
    iterator, index = iter(dataset), 0
    while True:
        try:
            record = next(iterator)
        except StopIteration:
            return
        except Exception as e:
            raise reading_error(name, index, e) from None
        yield index, record
        index += 1


def reading_error(name: str, index: int, error: Exception) -> TrainingError:
    """A streamed dataset that fails to read part way (a broken line far into a file)."""
    return TrainingError(
        f"--dataset {name}: reading example {index + 1} failed ({type(error).__name__}: {_one_line(error)})"
    )


def _offline() -> bool:
    return any(
        os.environ.get(v, "").lower() in ("1", "true", "yes", "on") for v in ("HF_DATASETS_OFFLINE", "HF_HUB_OFFLINE")
    )


def load_source(args) -> Source:
    """The training and validation examples `args` (--dataset, --dataset_config, --dataset_split, --validation_split,
    --streaming) name."""
    from .._plumbing.extras import require

    require("train", "datasets", feature="mhmoe-train --dataset")
    import datasets

    datasets.disable_progress_bars() if args.disable_tqdm else None
    train = _load_or_explain(args, args.dataset_split, args.streaming)
    validation, percentage = None, validation_percentage(args.validation_split)
    if percentage is None and args.validation_split:
        validation = _load_or_explain(args, args.validation_split, args.streaming)
    where = args.dataset if os.path.exists(args.dataset) else f"{args.dataset} (Hub)"
    return Source(train, validation, where, args.streaming, percentage or 0.0)


def first_record(dataset, name: str, split: str) -> dict:
    """The first record of `dataset` (its columns decide the format); an empty split is refused by name."""
    for record in dataset.take(1) if hasattr(dataset, "take") else dataset:
        return record
    raise TrainingError(f"--dataset {name}: the {split!r} split has no records")


__all__ = [
    "FILE_BUILDERS",
    "Source",
    "first_record",
    "iter_records",
    "reading_error",
    "held_out",
    "load_source",
    "validation_percentage",
]
