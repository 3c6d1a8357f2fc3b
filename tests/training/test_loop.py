"""mhmoe-train: from-scratch and fine-tuning runs, resume, bad input, Trainer, and 2-process DDP (gloo, CPU)."""

import json
import math
import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

import mhmoe.training.loop as train_module
from mhmoe.training import TrainArguments, TrainingError
from mhmoe.training import train as _train
from mhmoe.training.cli import main
from tests.fixtures.training import CONFIG, free_port, fresh_accelerate_state


def train(*args, **kwargs):
    fresh_accelerate_state()  # each in-process run builds its own Accelerator
    return _train(*args, **kwargs)


def _args(output_dir, **overrides) -> TrainArguments:
    fields = dict(
        output_dir=str(output_dir),
        block_size=16,
        per_device_train_batch_size=2,
        per_device_eval_batch_size=8,
        learning_rate=3e-3,
        warmup_steps=1,
        max_steps=2,
        disable_tqdm=True,
        plot=False,
        seed=0,
    )
    fields.update(overrides)
    return TrainArguments(**fields)


def _records(output_dir, kind="loss"):
    with open(os.path.join(output_dir, "metrics.jsonl")) as f:
        return [r for r in map(json.loads, f) if kind in r]


def test_from_scratch_run(tmp_path, corpus, config_json):
    """Config JSON + trained tokenizer: logged losses add up, validation, load stats, checkpoints, plot, final save."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out = tmp_path / "run"
    args = _args(
        out,
        model_name_or_path=config_json,
        train_file=[corpus["train"]],
        validation_file=[corpus["val"]],
        tokenizer_vocab_size=300,
        max_steps=4,
        eval_steps=2,
        save_steps=2,
        save_total_limit=1,
        plot=True,
        gradient_accumulation_steps=2,
    )
    result = train(args)

    assert AutoTokenizer.from_pretrained(out).vocab_size == 300  # trained here and saved with the model
    records = _records(out)
    assert [r["step"] for r in records] == [1, 2, 3, 4]
    for r in records:  # total = LM + coef·aux + coef·z, each logged on its own
        aux, z = CONFIG["router_aux_loss_coef"] * r["aux_loss"], CONFIG["router_z_loss_coef"] * r["z_loss"]
        expected = r["lm_loss"] + aux + z
        assert r["loss"] == pytest.approx(expected, rel=1e-5)
        assert r["aux_loss"] > 0 and r["z_loss"] > 0
        assert r["tokens"] == r["step"] * 4 * 16
    assert records[0]["lr"] == 0.0 and records[1]["lr"] == pytest.approx(3e-3)  # warmup 1 step, then cosine decay
    assert records[-1]["lr"] < records[1]["lr"]

    evals = _records(out, "eval_loss")
    assert [r["step"] for r in evals] == [2, 4]
    final = evals[-1]
    assert final == result.final_eval
    assert final["eval_ppl"] == pytest.approx(math.exp(final["eval_loss"]), rel=1e-6)
    assert len(final["expert_load"]) == 1 and len(final["expert_load"][0]) == CONFIG["num_experts"]  # 1 MoE layer
    assert sum(final["expert_load"][0]) == pytest.approx(1.0, abs=1e-4)
    assert final["expert_load_mean_max_over_uniform"] >= 1.0

    assert sorted(p.name for p in out.glob("checkpoint-*")) == ["checkpoint-4"]  # save_total_limit=1
    assert (out / "loss_curve.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    summary = json.loads((out / "train_summary.json").read_text())
    assert summary["num_processes"] == 1 and summary["step"] == 4

    # the saved model reproduces the final validation loss
    model = AutoModelForCausalLM.from_pretrained(out).eval()
    tokenizer = AutoTokenizer.from_pretrained(out)
    from mhmoe.training.data import read_files, tokenize_and_pack

    blocks = tokenize_and_pack(read_files([corpus["val"]]), tokenizer, 16)
    with torch.no_grad():
        logits = model(blocks).logits
    nll = F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), blocks[:, 1:].reshape(-1))
    assert nll.item() == pytest.approx(final["eval_loss"], rel=1e-4)


def test_the_first_line_says_which_layers_route(tmp_path, corpus, config_json, tokenizer_dir, capsys):
    """decoder_sparse_step=0 builds no MoE layer (a dense LLaMA, by design): the run's first line says so, and the
    default says how many layers route."""
    common = dict(model_name_or_path=config_json, tokenizer_name_or_path=tokenizer_dir, train_file=[corpus["tiny"]])
    dense = train(_args(tmp_path / "dense", config_overrides="decoder_sparse_step=0", max_steps=1, **common))
    first = capsys.readouterr().out.splitlines()[0]
    assert "mhmoe-train: mhmoe (dense: decoder_sparse_step=0, no MoE layer)," in first, first
    assert "aux_loss" not in dense.history[-1] or dense.history[-1]["aux_loss"] == 0
    train(_args(tmp_path / "moe", max_steps=1, **common))
    layers, step = CONFIG["num_hidden_layers"], CONFIG.get("decoder_sparse_step", 1)
    routed = len(range(step - 1, layers, step))  # layers step, 2·step, ... (counted from 1)
    assert f"mhmoe-train: mhmoe (MoE in {routed} of {layers} layers)," in capsys.readouterr().out


def test_text_file_and_finetune_from_checkpoint(tmp_path, corpus, checkpoint_dir):
    """A plain .txt file trains a checkpoint directory (validation held out from it); the weights change."""
    from safetensors.torch import load_file

    out = tmp_path / "ft"
    result = train(
        _args(
            out,
            model_name_or_path=checkpoint_dir,
            train_file=[corpus["txt"]],
            max_steps=2,
            validation_split_percentage=10,
        )
    )
    before = load_file(os.path.join(checkpoint_dir, "model.safetensors"))
    after = load_file(out / "model.safetensors")
    assert before.keys() == after.keys()
    experts = "model.layers.1.mlp.experts.gate_up_proj"
    assert not torch.equal(before[experts], after[experts])
    assert len(_records(out)) == 2
    assert result.final_eval["step"] == 2 and math.isfinite(result.final_eval["eval_ppl"])


def test_train_api_with_model_and_tokenizer_objects(tmp_path, corpus, tokenizer_dir, capsys):
    """The function API the demo uses: model and tokenizer objects in, the same (trained) model object out, a
    callback per metrics record, and the progress bar."""
    from transformers import AutoTokenizer

    from mhmoe import MHMoEConfig, MHMoEForCausalLM

    model = MHMoEForCausalLM(MHMoEConfig(**{k: v for k, v in CONFIG.items() if k != "model_type"}))
    before = model.lm_head.weight.detach().clone()
    seen = []
    result = train(
        {
            "output_dir": str(tmp_path / "api"),
            "train_file": corpus["train"],
            "block_size": 16,
            "max_steps": 2,
            "plot": False,
        },
        model=model,
        tokenizer=AutoTokenizer.from_pretrained(tokenizer_dir),
        on_log=seen.append,
    )
    assert result.model is model and not torch.equal(model.lm_head.weight, before)
    assert [r["step"] for r in seen] == [1, 2] and seen == result.history
    progress = capsys.readouterr().err
    assert "training:" in progress and "2/2" in progress
    with pytest.raises(TrainingError, match="unknown training arguments: lr"):
        train({"output_dir": str(tmp_path / "x"), "train_file": corpus["train"], "lr": 1.0}, model=model)


def test_example_accelerate_configs_load():
    """The shipped Accelerate configs parse (FSDP itself needs GPUs: Accelerate never enables it on CPU)."""
    from accelerate.commands.config.config_args import load_config_from_file

    root = os.path.join(os.path.dirname(__file__), "..", "..", "examples", "accelerate")
    ddp = load_config_from_file(os.path.join(root, "ddp_multi_gpu.yaml"))
    fsdp = load_config_from_file(os.path.join(root, "fsdp.yaml"))
    assert ddp.distributed_type == "MULTI_GPU" and ddp.mixed_precision == "bf16"
    assert fsdp.distributed_type == "FSDP" and fsdp.fsdp_config["fsdp_version"] == 2


def test_resume_reproduces_uninterrupted_run(tmp_path, corpus, config_json, tokenizer_dir, monkeypatch):
    """Kill a run after its step-3 checkpoint, resume it with 'latest': steps 4-7 (crossing an epoch boundary, with
    router jitter noise drawing from the RNG) equal the uninterrupted run's, and metrics.jsonl holds each step once."""
    common = dict(
        model_name_or_path=config_json,
        tokenizer_name_or_path=tokenizer_dir,
        train_file=[corpus["tiny"]],
        validation_file=[corpus["tiny"]],
        max_steps=7,
        save_steps=3,
        eval_steps=4,
        config_overrides="router_jitter_noise=0.2",
        gradient_accumulation_steps=2,
    )
    reference = train(_args(tmp_path / "reference", **common))
    steps_per_epoch = json.loads((tmp_path / "reference" / "checkpoint-3" / "train_state.json").read_text())
    assert steps_per_epoch["num_train_blocks"] // 4 < 7  # the run wraps into a new epoch after the checkpoint

    real_evaluate = train_module._evaluate

    def interrupt(*args, **kwargs):
        raise KeyboardInterrupt  # at step 4, after checkpoint-3 was written

    monkeypatch.setattr(train_module, "_evaluate", interrupt)
    run = tmp_path / "run"
    with pytest.raises(KeyboardInterrupt):
        train(_args(run, **common))
    assert [r["step"] for r in _records(run)] == [1, 2, 3, 4]
    monkeypatch.setattr(train_module, "_evaluate", real_evaluate)

    with pytest.raises(TrainingError, match="already holds checkpoints"):
        train(_args(run, **common))  # a fresh start would silently mix runs
    with pytest.raises(TrainingError, match=r"saved with other trained parameters \(--lora False -> True\)"):
        train(_args(run, resume_from_checkpoint="latest", lora=True, **common))
    resumed = train(_args(run, resume_from_checkpoint="latest", **common))

    expected = [r for r in reference.history if "loss" in r]
    got = _records(run)
    assert [r["step"] for r in got] == list(range(1, 8))
    for key in ("loss", "lm_loss", "aux_loss", "z_loss", "lr", "grad_norm"):
        assert [r[key] for r in got] == pytest.approx([r[key] for r in expected], rel=1e-6, abs=1e-9), key
    assert resumed.final_eval["eval_loss"] == pytest.approx(reference.final_eval["eval_loss"], rel=1e-6)


def test_moh_llama_supported_when_registered(tmp_path, corpus, tokenizer_dir, moh_llama_type):
    """moh_llama trains once registered (checked at run time); without router outputs, lm_loss is the loss."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    from tests.fixtures.training import MOH_CONFIG

    path = tmp_path / "moh.json"
    path.write_text(json.dumps(MOH_CONFIG))
    assert "moh_llama" in train_module.supported_model_types()
    result = train(
        _args(
            tmp_path / "moh",
            model_name_or_path=str(path),
            tokenizer_name_or_path=tokenizer_dir,
            train_file=[corpus["train"]],
            validation_file=[corpus["tiny"]],
        )
    )
    assert type(result.model.config) is CONFIG_MAPPING["moh_llama"]
    for record in result.history[:-1]:
        extra = [k for k in record if k.endswith("_loss") and k not in ("loss", "lm_loss")]
        assert all(math.isfinite(record[k]) for k in extra)
        if not extra:  # a plain Llama stand-in: nothing is added to the LM loss
            assert record["loss"] == pytest.approx(record["lm_loss"], rel=1e-6)
    assert "expert_load" not in result.final_eval and math.isfinite(result.final_eval["eval_ppl"])


def test_gradient_checkpointing_and_bf16(tmp_path, corpus, checkpoint_dir):
    base = dict(model_name_or_path=checkpoint_dir, train_file=[corpus["train"]], max_steps=2)
    plain = [r["loss"] for r in train(_args(tmp_path / "a", **base)).history]
    checkpointed = [r["loss"] for r in train(_args(tmp_path / "b", gradient_checkpointing=True, **base)).history]
    assert checkpointed == pytest.approx(plain, rel=1e-5)
    result = train(_args(tmp_path / "c", mixed_precision="bf16", **base))
    summary = json.loads((tmp_path / "c" / "train_summary.json").read_text())
    assert summary["mixed_precision"] == "bf16"
    bf16 = [r["loss"] for r in result.history]
    assert bf16 != plain and bf16 == pytest.approx(plain, abs=0.05)  # autocast ran, master weights stayed fp32
    assert next(result.model.parameters()).dtype == torch.float32


# ------------------------------------------------------------------------------------------------------------ bad input


def _bad_cases(tmp_path, corpus, config_json, checkpoint_dir):
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n   \n")
    no_field = tmp_path / "nofield.jsonl"
    no_field.write_text('{"content": "hello"}\n')
    unknown = tmp_path / "unknown.json"
    unknown.write_text(json.dumps({**CONFIG, "model_type": "bert"}))
    not_a_dir = tmp_path / "file"
    not_a_dir.write_text("x")
    broken, weightless = tmp_path / "broken", tmp_path / "weightless"
    for folder, text in ((broken, "{not json"), (weightless, json.dumps(CONFIG))):
        folder.mkdir()
        (folder / "config.json").write_text(text)
    gzipped = tmp_path / "train.txt.gz"
    gzipped.write_bytes(b"\x1f\x8b\x08\x00 not text")
    ok = dict(model_name_or_path=checkpoint_dir, train_file=[corpus["train"]])
    return {
        "missing train file": (dict(ok, train_file=[str(tmp_path / "nope.jsonl")]), "data file not found"),
        "missing validation file": (dict(ok, validation_file=[str(tmp_path / "nope.txt")]), "data file not found"),
        "missing model": (dict(ok, model_name_or_path=str(tmp_path / "nomodel")), "does not exist"),
        "empty data": (dict(ok, train_file=[str(empty)]), "no text in --train_file"),
        "no text field": (dict(ok, train_file=[str(no_field)]), "no text field 'text'"),
        "too little data": (
            dict(ok, train_file=[corpus["tiny"]], block_size=32, per_device_train_batch_size=64),
            "do not fill one global batch",
        ),
        "block larger than context": (dict(ok, block_size=64), "larger than the model's context \\(32"),
        "unknown model type": (dict(ok, model_name_or_path=str(unknown)), "model_type 'bert' .* not supported"),
        "unwritable output dir": (dict(ok, output_dir=str(not_a_dir / "out")), "is not writable"),
        "resume without checkpoint": (dict(ok, resume_from_checkpoint="latest"), "no complete checkpoint"),
        "LoRA dropout on experts": (dict(ok, lora=True, lora_dropout=0.1), "has no dropout"),
        "LoRA target typo": (dict(ok, lora=True, lora_target_modules=["qproj"]), r"\['qproj'\] match no module"),
        "config override typo": (
            dict(ok, config_overrides="router_aux_los_coef=0.5"),
            "router_aux_los_coef is not a mhmoe config field",
        ),
        "negative save steps": (dict(ok, save_steps=-1), "--save_steps and --eval_steps must be >= 0"),
        "compressed data": (dict(ok, train_file=[str(gzipped)]), "train.txt.gz is not UTF-8 text"),
        "output dir is a file": (dict(ok, output_dir=str(not_a_dir)), "is a file, not a directory"),
        "broken config": (dict(ok, model_name_or_path=str(broken)), "config.json: not a valid config JSON"),
        "no weights": (dict(ok, model_name_or_path=str(weightless)), "--model_name_or_path: no weights in"),
        "override changes shapes": (dict(ok, config_overrides="intermediate_size=64"), "do not fit its config"),
    }


@pytest.mark.parametrize(
    "case",
    [
        "missing train file",
        "missing validation file",
        "missing model",
        "empty data",
        "no text field",
        "too little data",
        "block larger than context",
        "unknown model type",
        "unwritable output dir",
        "resume without checkpoint",
        "LoRA dropout on experts",
        "LoRA target typo",
        "config override typo",
        "negative save steps",
        "compressed data",
        "output dir is a file",
        "broken config",
        "no weights",
        "override changes shapes",
    ],
)
def test_bad_input_fails_before_training(tmp_path, corpus, config_json, checkpoint_dir, case, monkeypatch):
    fields, message = _bad_cases(tmp_path, corpus, config_json, checkpoint_dir)[case]
    out = fields.pop("output_dir", str(tmp_path / "out"))

    def no_training(*a, **k):
        raise AssertionError("an optimizer was built before the error")

    monkeypatch.setattr(torch.optim, "AdamW", no_training)
    existed = os.path.exists(out)
    with pytest.raises(TrainingError, match=message):
        train(_args(out, **fields))
    assert os.path.exists(out) == existed  # nothing created or left behind


def test_an_earlier_run_is_kept_until_training_starts(tmp_path, corpus, checkpoint_dir):
    """A finished run is refused without --overwrite_output_dir; with it, a bad input is still refused before anything
    is deleted; the model's own directory is never an output_dir; a good run then replaces the old outputs."""
    out = tmp_path / "run"
    common = dict(model_name_or_path=checkpoint_dir, train_file=[corpus["train"]])
    train(_args(out, save_steps=1, **common))
    weights, metrics = (out / "model.safetensors").read_bytes(), (out / "metrics.jsonl").read_text()
    with pytest.raises(TrainingError, match="already holds checkpoints"):
        train(_args(out, **common))
    for name in ("checkpoint-1", "checkpoint-2"):
        (out / name / "train_state.json").unlink()  # incomplete checkpoints: the finished model is what is left
    with pytest.raises(TrainingError, match=r"already holds a finished run \(model.safetensors"):
        train(_args(out, **common))
    with pytest.raises(TrainingError, match="no text field 'body'"):
        train(_args(out, text_field="body", overwrite_output_dir=True, **common))
    assert (out / "model.safetensors").read_bytes() == weights and (out / "metrics.jsonl").read_text() == metrics
    with pytest.raises(TrainingError, match="would replace or delete the model being trained"):
        train(_args(checkpoint_dir, overwrite_output_dir=True, **common))
    train(_args(out, overwrite_output_dir=True, max_steps=1, **common))
    assert (out / "model.safetensors").read_bytes() != weights and not list(out.glob("checkpoint-*"))
    assert len((out / "metrics.jsonl").read_text().splitlines()) < len(metrics.splitlines())  # a fresh log


def test_cli_reports_errors_and_help(tmp_path, corpus, checkpoint_dir, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(
            [
                "--model_name_or_path",
                checkpoint_dir,
                "--train_file",
                str(tmp_path / "missing.txt"),
                "--output_dir",
                str(tmp_path / "o"),
            ]
        )
    assert exit_info.value.code == 2
    assert "mhmoe-train: error: data file not found" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exit_info:
        main(["--help"])
    assert exit_info.value.code == 0
    assert "--resume_from_checkpoint" in capsys.readouterr().out


# -------------------------------------------------------------------------------------------------------------- Trainer


def test_transformers_trainer_includes_aux_loss(tmp_path):
    from torch.utils.data import Dataset
    from transformers import Trainer, TrainingArguments

    from mhmoe import MHMoEConfig, MHMoEForCausalLM

    fields = {k: v for k, v in CONFIG.items() if k != "model_type"}
    fields.update(output_router_logits=True, router_aux_loss_coef=0.5)
    model = MHMoEForCausalLM(MHMoEConfig(**fields))
    block = torch.randint(0, CONFIG["vocab_size"], (16,))

    class Blocks(Dataset):  # every item the same block: the first batch is known whatever the sampler does
        def __len__(self):
            return 8

        def __getitem__(self, i):
            return {"input_ids": block, "labels": block}

    batch = {"input_ids": block.repeat(2, 1), "labels": block.repeat(2, 1)}
    with torch.no_grad():
        out = model(**batch)
    lm = F.cross_entropy(out.logits[0, :-1], block[1:]).item()
    total = lm + 0.5 * out.aux_loss.item() + CONFIG["router_z_loss_coef"] * out.z_loss.item()

    args = TrainingArguments(
        output_dir=str(tmp_path),
        max_steps=2,
        per_device_train_batch_size=2,
        learning_rate=1e-2,
        report_to=[],
        use_cpu=True,
        logging_steps=1,
        save_strategy="no",
        disable_tqdm=True,
    )
    trainer = Trainer(model=model, args=args, train_dataset=Blocks())
    assert trainer.compute_loss(model, batch).item() == pytest.approx(total, rel=1e-5)
    trainer.train()
    first_logged = trainer.state.log_history[0]["loss"]
    assert first_logged == pytest.approx(total, rel=1e-4)  # the trained loss carries the aux losses
    assert first_logged > lm + 0.9


# ------------------------------------------------------------------------------------------------------- multi-process


def test_ddp_two_processes_match_one(tmp_path, corpus, config_json, tokenizer_dir):
    """`accelerate launch` with 2 CPU processes (gloo) == 1 process with 2 accumulation steps: same micro-batches, same
    global batch, so the same losses and weights. (`accelerate launch --cpu` alone starts a single process; the
    multi-process CPU launch is `--multi_gpu` with ACCELERATE_USE_CPU=1, see docs/training.md.)"""
    from safetensors.torch import load_file

    common = [
        "--model_name_or_path",
        config_json,
        "--tokenizer_name_or_path",
        tokenizer_dir,
        "--train_file",
        corpus["train"],
        "--validation_file",
        corpus["val"],
        "--block_size",
        "16",
        "--per_device_train_batch_size",
        "2",
        "--learning_rate",
        "3e-3",
        "--max_steps",
        "3",
        "--seed",
        "0",
        "--disable_tqdm",
        "--no_plot",
    ]
    src = os.path.join(os.path.dirname(train_module.__file__), "..", "..")
    env = dict(
        os.environ,
        ACCELERATE_USE_CPU="1",
        OMP_NUM_THREADS="1",
        HF_HUB_OFFLINE="1",
        HF_DATASETS_OFFLINE="1",
        PYTHONPATH=os.pathsep.join([os.path.abspath(src), os.environ.get("PYTHONPATH", "")]),
    )
    two = tmp_path / "two"
    launch = [
        sys.executable,
        "-m",
        "accelerate.commands.launch",
        "--multi_gpu",
        "--num_processes",
        "2",
        "--num_machines",
        "1",
        "--mixed_precision",
        "no",
        "--dynamo_backend",
        "no",
        "--main_process_port",
        str(free_port()),
        "-m",
        "mhmoe.training",
        *common,
        "--output_dir",
        str(two),
    ]
    proc = subprocess.run(launch, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads((two / "train_summary.json").read_text())
    assert summary["num_processes"] == 2 and summary["distributed_type"] == "MULTI_CPU"

    one = tmp_path / "one"
    fresh_accelerate_state()
    main([*common, "--output_dir", str(one), "--gradient_accumulation_steps", "2"])
    got, expected = _records(two), _records(one)
    assert len(got) == len(expected) == 3
    for key in ("loss", "lm_loss", "aux_loss", "z_loss", "grad_norm"):
        assert [r[key] for r in got] == pytest.approx([r[key] for r in expected], rel=1e-5), key
    eval_two, eval_one = _records(two, "eval_loss")[0], _records(one, "eval_loss")[0]
    assert eval_two["eval_loss"] == pytest.approx(eval_one["eval_loss"], rel=1e-5)
    weights_two, weights_one = load_file(two / "model.safetensors"), load_file(one / "model.safetensors")
    for key in weights_one:
        torch.testing.assert_close(weights_two[key], weights_one[key], rtol=1e-4, atol=1e-6)


def test_output_folder_card_reads_its_train_summary(tmp_path, corpus, config_json):
    """The training folder's own README.md is written after train_summary.json and the tokenizer: its Training section
    is the summary's (as in an export of the folder), and its usage code loads the tokenizer."""
    from mhmoe.hub.cards import training_text

    out = tmp_path / "run"
    train(_args(out, model_name_or_path=config_json, train_file=[corpus["train"]], tokenizer_vocab_size=300))
    card = (out / "README.md").read_text()
    summary = json.loads((out / "train_summary.json").read_text())
    training = card.split("## Training", 1)[1].split("##", 1)[0]
    assert training.strip() == training_text(summary)
    assert "for 2 steps (64 tokens, 2 blocks of 16 per step) on train.jsonl." in training
    assert "Not recorded" not in card and str(corpus["root"]) not in card
    assert 'tokenizer = AutoTokenizer.from_pretrained("run", trust_remote_code=True)' in card
    assert not [p.name for p in out.iterdir() if ".tmp" in p.name]

    # --overwrite_output_dir: the earlier run's card is replaced; a README.md that mhmoe did not write is kept
    train(
        _args(
            out,
            model_name_or_path=config_json,
            train_file=[corpus["train"]],
            tokenizer_vocab_size=300,
            max_steps=3,
            overwrite_output_dir=True,
        )
    )
    assert "for 3 steps (96 tokens," in (out / "README.md").read_text()
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "README.md").write_text("# my notes\n")
    train(
        _args(tmp_path / "mine", model_name_or_path=config_json, train_file=[corpus["train"]], tokenizer_vocab_size=300)
    )
    assert (tmp_path / "mine" / "README.md").read_text() == "# my notes\n"


def test_a_run_the_disk_cannot_hold_is_refused_before_anything_is_written(
    tmp_path, corpus, checkpoint_dir, monkeypatch, capsys
):
    """The estimate (final model, checkpoints alive at once: weights and AdamW's two moments) against the free space,
    with --overwrite_output_dir's freed space counted: refused in one line when not even the final save and one
    checkpoint fit (nothing created or removed), a warning when only later checkpoints do not."""
    from collections import namedtuple
    from types import SimpleNamespace

    from mhmoe.training import outputs

    usage = namedtuple("usage", "total used free")
    linear = torch.nn.Linear(10, 10)  # 110 fp32 parameters: 440 bytes, all trainable
    model_bytes, checkpoint_bytes = 440, 3 * 440  # a checkpoint: weights + AdamW's two moments

    def check(free, **overrides):
        monkeypatch.setattr(outputs.shutil, "disk_usage", lambda path: usage(10**9, 0, free))
        run = SimpleNamespace(
            args=_args(tmp_path / "unit", **overrides),
            accelerator=SimpleNamespace(unwrap_model=lambda m: m, print=print),
            model=linear,
            total_steps=10,
        )
        outputs.check_disk_space(run)
        return capsys.readouterr().out

    # 10 steps, a checkpoint every 3: 3 checkpoints, then the final model
    assert check(model_bytes + 3 * checkpoint_bytes, save_steps=3) == ""
    warned = check(model_bytes + 3 * checkpoint_bytes - 1, save_steps=3)
    assert "has room for 2 of this run's 3 checkpoints (1.3 KB each)" in warned and warned.count("\n") == 1
    with pytest.raises(TrainingError, match=r"the final model \(440 bytes\) and a checkpoint \(1.3 KB.*need 1.8 KB"):
        check(model_bytes + checkpoint_bytes - 1, save_steps=3)
    assert check(model_bytes + 2 * checkpoint_bytes, save_steps=3, save_total_limit=1) == ""  # newest, then oldest goes
    assert check(model_bytes, save_steps=0) == ""
    linear.requires_grad_(False)  # frozen weights: no optimizer state
    assert check(model_bytes + 3 * model_bytes, save_steps=3) == ""
    linear.requires_grad_(True)

    # end to end: refused before the output folder exists; an earlier run kept, its space counted when overwriting
    out = tmp_path / "run"
    common = dict(model_name_or_path=checkpoint_dir, train_file=[corpus["train"]])
    monkeypatch.setattr(outputs.shutil, "disk_usage", lambda path: usage(10**9, 0, 1000))
    with pytest.raises(TrainingError, match="not enough disk space to write .*choose another --output_dir") as refused:
        train(_args(out, save_steps=1, **common))
    assert refused.value.exit_status == 1 and "\n" not in str(refused.value) and not out.exists()
    monkeypatch.undo()
    train(_args(out, **common))  # no checkpoints: the final model alone
    weights = (out / "model.safetensors").read_bytes()
    monkeypatch.setattr(outputs.shutil, "disk_usage", lambda path: usage(10**9, 0, 1000))
    with pytest.raises(TrainingError, match=r"and a checkpoint"):  # what it replaces is not room for a checkpoint too
        train(_args(out, overwrite_output_dir=True, save_steps=1, **common))
    assert (out / "model.safetensors").read_bytes() == weights  # nothing removed
    train(_args(out, overwrite_output_dir=True, **common))  # the model it replaces is room for the new one
