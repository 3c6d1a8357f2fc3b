"""--streaming (training/streaming.py): a run stopped after a checkpoint and resumed with `latest` logs exactly the
losses of an uninterrupted run, step by step (chat rows packed two to a row, and text rows carrying tokens across
rows, across the end of the stream); the processes' shares of a stream are disjoint and cover it."""

import json

import datasets
import pytest
import torch

from mhmoe.training import train
from mhmoe.training.formats import CHAT, Encoder
from mhmoe.training.streaming import RowStream, split_for_process
from tests.fixtures.training import fresh_accelerate_state

WALL_CLOCK = ("elapsed_s", "tokens_per_second", "mfu")


class Stop(Exception):
    pass


def _args(out, config, tokenizer, dataset, **extra):
    return dict(
        model_name_or_path=config,
        tokenizer_name_or_path=tokenizer,
        dataset=dataset,
        streaming=True,
        output_dir=str(out),
        block_size=extra.pop("block_size", 128),
        per_device_train_batch_size=2,
        gradient_accumulation_steps=2,
        max_steps=8,
        save_steps=3,
        learning_rate=3e-3,
        seed=0,
        disable_tqdm=True,
        plot=False,
        **extra,
    )


def _records(out):
    with open(out / "metrics.jsonl") as f:
        return [{k: v for k, v in json.loads(line).items() if k not in WALL_CLOCK} for line in f]


@pytest.mark.parametrize("kind", ["chat", "text"])
def test_stopped_and_resumed_stream_equals_uninterrupted(
    tmp_path, chat_config_json, chat_tokenizer_dir, chat_data, corpus, kind
):
    dataset = chat_data["chat"] if kind == "chat" else corpus["train"]
    extra = {"validation_split": "10%"} if kind == "chat" else {"block_size": 24}
    whole = tmp_path / "whole"
    train(_args(whole, chat_config_json, chat_tokenizer_dir, dataset, **extra))

    stopped = tmp_path / "stopped"

    def stop_after_checkpoint(record):
        if record.get("step") == 5 and "loss" in record:  # checkpoint-3 is written; steps 4-5 are lost
            raise Stop

    fresh_accelerate_state()
    with pytest.raises(Stop):
        train(_args(stopped, chat_config_json, chat_tokenizer_dir, dataset, **extra), on_log=stop_after_checkpoint)
    assert (stopped / "checkpoint-3" / "stream_state_0.json").is_file()
    fresh_accelerate_state()
    train(_args(stopped, chat_config_json, chat_tokenizer_dir, dataset, resume_from_checkpoint="latest", **extra))
    assert _records(stopped) == _records(whole)
    losses = [r["loss"] for r in _records(whole) if "loss" in r]
    assert len(losses) == 8 and len(set(losses)) == 8  # each step its own rows
    state = json.loads((stopped / "checkpoint-3" / "stream_state_0.json").read_text())
    assert state["index"] > 0 and state["dataset"] is not None
    if kind == "chat":  # 36 training conversations, about two to a row: the 32 rows read the stream more than once
        assert [r["epoch"] for r in _records(whole) if "loss" in r][-1] >= 1


def test_process_shares_are_disjoint_and_cover_the_stream(chat_tokenizer_dir, tmp_path):
    from transformers import AutoTokenizer

    from tests.fixtures.training import chat_records

    records = chat_records(12)
    for i, record in enumerate(records):
        record["messages"][-1]["content"] = f"answer {i}"  # each example recognisable by its answer
    path = tmp_path / "chat.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    stream = datasets.load_dataset("json", data_files=str(path), split="train", streaming=True)
    tokenizer = AutoTokenizer.from_pretrained(chat_tokenizer_dir)
    encoder = Encoder(tokenizer, CHAT)
    seen = []
    for rank in range(2):
        rows = RowStream(split_for_process(stream, rank, 2), encoder, 128, 0, packing=False).take(6)
        texts = [tokenizer.decode(row[row != 0]) for row in rows.input_ids]
        seen.append({i for i in range(12) for t in texts if f"answer {i}<" in t})
    assert seen[0].isdisjoint(seen[1]) and seen[0] | seen[1] == set(range(12))
    assert torch.is_tensor(rows.labels)
