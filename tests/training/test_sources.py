"""--dataset sources (training/sources.py): every local kind the `datasets` library reads gives the same records, map-
style and streamed; validation splits by name and by percentage; offline Hub names and bad sources in one line."""

import json
import types

import datasets
import pytest

from mhmoe.training.arguments import TrainingError
from mhmoe.training.sources import first_record, held_out, load_source, validation_percentage
from tests.fixtures.training import chat_records

TEXTS = [f"document {i}: " + "word " * (i % 5 + 1) for i in range(20)]


def _args(dataset, **kwargs):
    fields = dict(
        dataset=str(dataset),
        dataset_config=None,
        dataset_split="train",
        validation_split=None,
        streaming=False,
        disable_tqdm=True,
    )
    return types.SimpleNamespace(**{**fields, **kwargs})


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    """The same 20 text records as json, jsonl, csv, parquet, arrow, a folder of jsonl files and a save_to_disk folder."""
    root = tmp_path_factory.mktemp("sources")
    table = datasets.Dataset.from_dict({"text": TEXTS})
    (root / "data.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in TEXTS))
    (root / "data.json").write_text(json.dumps([{"text": t} for t in TEXTS]))
    table.to_csv(root / "data.csv", index=False)
    table.to_parquet(root / "data.parquet")
    (root / "arrow").mkdir()
    table.save_to_disk(str(root / "arrow"))  # its data-00000-of-00001.arrow is a plain arrow stream file
    arrow_file = next((root / "arrow").glob("*.arrow"))
    folder = root / "folder"
    folder.mkdir()
    (folder / "train.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in TEXTS[:14]))
    (folder / "validation.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in TEXTS[14:]))
    saved = datasets.DatasetDict({"train": table, "test": table.select(range(3))})
    saved.save_to_disk(str(root / "saved"))
    return {
        "jsonl": root / "data.jsonl",
        "json": root / "data.json",
        "csv": root / "data.csv",
        "parquet": root / "data.parquet",
        "arrow": arrow_file,
        "saved": root / "saved",
        "folder": folder,
        "root": root,
    }


@pytest.mark.parametrize("kind", ["jsonl", "json", "csv", "parquet", "arrow", "saved"])
@pytest.mark.parametrize("streaming", [False, True])
def test_every_local_kind_gives_the_records(sources, kind, streaming):
    source = load_source(_args(sources[kind], streaming=streaming))
    assert [r["text"] for r in source.train] == TEXTS
    assert isinstance(source.train, datasets.IterableDataset) == streaming


def test_txt_gives_one_record_per_paragraph(tmp_path):
    (tmp_path / "book.txt").write_text("first paragraph\nstill first\n\nsecond one\n")
    records = [r["text"] for r in load_source(_args(tmp_path / "book.txt")).train]
    assert [r.strip() for r in records] == ["first paragraph\nstill first", "second one"]


def test_a_folder_splits_by_file_name(sources):
    source = load_source(_args(sources["folder"], validation_split="validation"))
    assert [r["text"] for r in source.train] == TEXTS[:14]
    assert [r["text"] for r in source.validation] == TEXTS[14:]


def test_saved_dataset_dict_split_and_missing_split(sources):
    source = load_source(_args(sources["saved"], validation_split="test"))
    assert len(source.validation) == 3
    with pytest.raises(TrainingError, match=r"has no split 'dev' \(it has: test, train\)"):
        load_source(_args(sources["saved"], validation_split="dev"))


def test_validation_percentage_is_evenly_spread_and_exact():
    assert validation_percentage("5%") == 5.0 and validation_percentage("validation") is None
    picked = [i for i in range(200) if held_out(i, 5.0)]
    assert len(picked) == 10 and picked == list(range(19, 200, 20))
    assert sum(held_out(i, 12.5) for i in range(80)) == 10
    for bad in ("0%", "100%", "150%"):
        with pytest.raises(TrainingError, match="above 0% and below 100%"):
            validation_percentage(bad)


def test_hub_name_offline_is_one_line(monkeypatch):
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    with pytest.raises(TrainingError, match=r"'nobody/no-such-dataset' is not a local file or folder.*offline") as info:
        load_source(_args("nobody/no-such-dataset"))
    assert "\n" not in str(info.value)


def test_bad_sources_are_one_line(sources, tmp_path):
    (tmp_path / "data.xml").write_text("<a/>")
    with pytest.raises(TrainingError, match=r"unknown file type '.xml'"):
        load_source(_args(tmp_path / "data.xml"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(TrainingError, match="a folder with no data file"):
        load_source(_args(tmp_path / "empty"))
    (tmp_path / "broken.jsonl").write_text('{"text": "a"}\n{"text": \n')
    with pytest.raises(TrainingError, match=r"broken.jsonl does not load") as info:
        list(load_source(_args(tmp_path / "broken.jsonl")).train)
    assert "\n" not in str(info.value)
    (tmp_path / "nothing.jsonl").write_text("")
    with pytest.raises(TrainingError, match=r"nothing.jsonl.*(has no records|does not load)"):
        source = load_source(_args(tmp_path / "nothing.jsonl"))
        first_record(source.train, source.name, "train")


def test_chat_records_survive_arrow(tmp_path):
    """Messages come back from the json builder as lists of {"role", "content"} dicts."""
    records = chat_records(6)
    (tmp_path / "chat.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    loaded = list(load_source(_args(tmp_path / "chat.jsonl")).train)
    assert [r["messages"] for r in loaded] == [r["messages"] for r in records]
