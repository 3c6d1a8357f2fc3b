"""mhmoe-train on `datasets` sources: chat SFT trains and validates on the assistant tokens only (checked against the
model run on each example alone), the run states its format, every log line has tokens/s, trackers receive the
metrics, and bad data is one line naming the record."""

import json
import re

import pytest
import torch
import torch.nn.functional as F
from transformers import AutoModelForCausalLM, AutoTokenizer

from mhmoe.training import TrainingError, train
from mhmoe.training.cli import main
from mhmoe.training.formats import CHAT, Encoder


def _args(out, config, tokenizer, dataset, **extra):
    fields = dict(
        model_name_or_path=config,
        tokenizer_name_or_path=tokenizer,
        dataset=dataset,
        output_dir=str(out),
        block_size=128,
        per_device_train_batch_size=2,
        max_steps=3,
        learning_rate=3e-3,
        disable_tqdm=True,
        plot=False,
    )
    return {**fields, **extra}


def _assistant_nll(model, tokenizer, records):
    """Mean NLL of the assistant tokens, each conversation run alone, the trained tokens found turn by turn."""
    encoder = Encoder(tokenizer, CHAT)
    total, count = 0.0, 0
    for number, record in enumerate(records, start=1):
        example = encoder(record, number)
        ids = torch.tensor([example.input_ids])
        with torch.no_grad():
            logits = model(input_ids=ids, use_cache=False).logits[0, :-1].float()
        nll = F.cross_entropy(logits, ids[0, 1:], reduction="none")
        trained = torch.tensor(example.trained[1:])
        total, count = total + float(nll[trained].sum()), count + int(trained.sum())
    return total / count


def test_chat_sft_validates_on_assistant_tokens(tmp_path, chat_config_json, chat_tokenizer_dir, chat_data, capsys):
    records = [json.loads(line) for line in open(chat_data["chat"])]
    result = train(
        _args(tmp_path / "out", chat_config_json, chat_tokenizer_dir, chat_data["chat"], validation_split="20%")
    )
    printed = capsys.readouterr().out
    assert "messages records (chat, loss on the assistant/completion tokens, packed (examples kept apart))" in printed
    held = [r for i, r in enumerate(records) if int((i + 1) * 0.2) > int(i * 0.2)]
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()
    tokenizer = AutoTokenizer.from_pretrained(tmp_path / "out")
    assert tokenizer.chat_template == AutoTokenizer.from_pretrained(chat_tokenizer_dir).chat_template
    assert result.final_eval["eval_loss"] == pytest.approx(_assistant_nll(model, tokenizer, held), rel=1e-4)
    steps = [r for r in result.history if "loss" in r]
    assert all(r["tokens_per_second"] > 0 and "mfu" not in r for r in steps)  # no MFU on CPU without --peak_tflops


def test_tokens_count_real_tokens_and_peak_gives_mfu(tmp_path, chat_config_json, chat_tokenizer_dir, chat_data):
    """Unpacked rows are padded: `tokens` counts the examples' own tokens, not the padding."""
    from mhmoe.training.packing import pack_examples

    result = train(
        _args(
            tmp_path / "out",
            chat_config_json,
            chat_tokenizer_dir,
            chat_data["chat"],
            packing=False,
            per_device_train_batch_size=40,
            max_steps=1,
            peak_tflops=1.0,
        )  # fmt: skip
    )
    tokenizer = AutoTokenizer.from_pretrained(chat_tokenizer_dir)
    encoder = Encoder(tokenizer, CHAT)
    examples = [encoder(json.loads(line), n) for n, line in enumerate(open(chat_data["chat"]), start=1)]
    blocks, _ = pack_examples(examples, 128, 0, packing=False)
    (record,) = [r for r in result.history if "loss" in r]
    assert record["tokens"] == int(blocks.lengths.sum()) < 40 * 128
    assert 0 < record["mfu"] < 1


def test_loss_on_prompt_and_prompt_completion(tmp_path, chat_config_json, chat_tokenizer_dir, chat_data):
    for name, extra in (("pc", {}), ("pcm", {}), ("chat", {"loss_on_prompt": True})):
        result = train(
            _args(
                tmp_path / name, chat_config_json, chat_tokenizer_dir, chat_data[name], validation_split="10%", **extra
            )
        )
        assert torch.isfinite(torch.tensor(result.final_eval["eval_loss"]))


def test_tensorboard_receives_every_logged_step(tmp_path, chat_config_json, chat_tokenizer_dir, chat_data):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    result = train(
        _args(tmp_path / "out", chat_config_json, chat_tokenizer_dir, chat_data["chat"], report_to="tensorboard")
    )
    (run,) = (tmp_path / "out" / "runs").iterdir()
    events = EventAccumulator(str(run))
    events.Reload()
    logged = {e.step: e.value for e in events.Scalars("loss")}
    assert logged == pytest.approx({r["step"]: r["loss"] for r in result.history if "loss" in r})
    assert "tokens_per_second" in events.Tags()["scalars"]


@pytest.mark.parametrize("tracker", ["wandb", "mlflow", "trackio"])
def test_other_trackers_run_offline_into_the_output_folder(
    tmp_path, chat_config_json, chat_tokenizer_dir, chat_data, tracker, monkeypatch
):
    monkeypatch.delenv("WANDB_MODE", raising=False)
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.setenv("TRACKIO_DIR", str(tmp_path / "trackio"))
    result = train(_args(tmp_path / "out", chat_config_json, chat_tokenizer_dir, chat_data["chat"], report_to=tracker))
    last = [r for r in result.history if "loss" in r][-1]
    if tracker == "wandb":
        (run,) = (tmp_path / "out" / "wandb").glob("offline-run-*")
        assert any(run.glob("*.wandb"))
    elif tracker == "mlflow":
        import mlflow

        client = mlflow.MlflowClient()
        (experiment,) = [e for e in client.search_experiments() if e.name == "mhmoe-train"]
        (found,) = client.search_runs([experiment.experiment_id])
        assert found.data.metrics["loss"] == pytest.approx(last["loss"])
        assert (tmp_path / "out").resolve().as_posix() in mlflow.get_tracking_uri()
    else:
        assert any((tmp_path / "trackio").glob("*.db")) or any((tmp_path / "trackio").rglob("*"))


def _cli(capsys, *argv):
    with pytest.raises(SystemExit) as info:
        main(list(argv))
    err = capsys.readouterr().err.strip().split("\r")[-1]  # after the progress bar's last redraw
    return info.value.code, err


@pytest.mark.parametrize(
    "records, words",
    [
        ([{"question": "q", "answer": "a"}], r"none of the three formats .* columns are 'question', 'answer'"),
        ([{"text": "ok"}, {"text": 5}], r"record 2: field 'text' is a int, not a string|does not load"),
        (
            [{"messages": [{"role": "user", "content": "q"}, {"role": "oracle", "content": "a"}]}],
            r"record 1, messages turn 2: unknown role 'oracle'",
        ),
        ([{"prompt": "q", "completion": ["a"]}], r"record 1: 'prompt' and 'completion' must both be"),
    ],
)
def test_bad_data_is_one_line(tmp_path, capsys, chat_config_json, chat_tokenizer_dir, records, words):
    path = tmp_path / "data.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    code, err = _cli(
        capsys, "--model_name_or_path", chat_config_json, "--tokenizer_name_or_path", chat_tokenizer_dir,
        "--dataset", str(path), "--output_dir", str(tmp_path / "out"), "--max_steps", "1",
    )  # fmt: skip
    assert code == 2 and err.count("\n") == 0 and err.startswith("mhmoe-train: error: "), err
    assert re.search(words, err), err
    assert not (tmp_path / "out").exists()  # nothing left behind


def test_empty_split_and_chat_file_given_as_train_file(
    tmp_path, capsys, chat_config_json, chat_tokenizer_dir, chat_data
):
    (tmp_path / "empty.csv").write_text("text\n")
    code, err = _cli(
        capsys, "--model_name_or_path", chat_config_json, "--tokenizer_name_or_path", chat_tokenizer_dir,
        "--dataset", str(tmp_path / "empty.csv"), "--output_dir", str(tmp_path / "out"), "--max_steps", "1",
    )  # fmt: skip
    assert code == 2 and "split has no records" in err and err.count("\n") == 0, err
    code, err = _cli(
        capsys, "--model_name_or_path", chat_config_json, "--tokenizer_name_or_path", chat_tokenizer_dir,
        "--train_file", chat_data["chat"], "--output_dir", str(tmp_path / "out"), "--max_steps", "1",
    )  # fmt: skip
    assert code == 2 and f"pass the file as --dataset {chat_data['chat']}" in err, err
    code, err = _cli(
        capsys, "--model_name_or_path", chat_config_json, "--dataset", chat_data["chat"], "--streaming",
        "--output_dir", str(tmp_path / "out"),
    )  # fmt: skip
    assert code == 2 and "--streaming needs --max_steps" in err, err


def test_chat_template_file_replaces_the_tokenizers_and_is_saved(tmp_path, chat_config_json, tokenizer_dir, chat_data):
    """A tokenizer without a template trains on chat data with --chat_template FILE; the trained model keeps it."""
    from tests.fixtures.training import CHATML

    template = tmp_path / "template.jinja"
    template.write_text(CHATML.replace("<|im_start|>", "[").replace("<|im_end|>", "]"))
    train(_args(tmp_path / "out", chat_config_json, tokenizer_dir, chat_data["chat"], chat_template=str(template)))
    saved = AutoTokenizer.from_pretrained(tmp_path / "out")
    assert saved.chat_template == template.read_text()
    assert saved.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False) == "[user\nhi]\n"
    with pytest.raises(TrainingError, match=r"--chat_template .*missing.jinja: no such file"):
        train(
            _args(
                tmp_path / "out2",
                chat_config_json,
                tokenizer_dir,
                chat_data["chat"],
                chat_template=str(tmp_path / "missing.jinja"),
            )
        )
