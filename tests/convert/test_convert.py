"""Dense LLaMA / Mistral / Qwen2 -> MoH-LLaMA conversion (mhmoe.convert): streamed shards, configs, refusals with
nothing left behind, verification, continue-tuning through mhmoe.training (resume, LoRA, 2 processes) and the recovery
curve."""

import json
import os
import pickle
import re
import stat
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file, save_file

import mhmoe
import mhmoe.convert.write as write
from mhmoe.convert import ConversionError, convert, head_split, main
from tests.fixtures.training import free_port, fresh_accelerate_state
from tests.fixtures.warm import cli_env

TINY = dict(
    vocab_size=320,
    hidden_size=32,
    intermediate_size=48,
    num_hidden_layers=2,
    num_attention_heads=8,
    num_key_value_heads=2,
    max_position_embeddings=32,
)


def _llama_dir(path, tokenizer_dir=None, dtype=torch.float32, shard_size=None, legacy_llama3=False, **overrides):
    """A tiny random dense Llama checkpoint. `legacy_llama3`: config.json written the way Meta's Llama-3.1 repos ship
    it (rope_theta + rope_scaling of type llama3, torch_dtype, a list of EOS ids) rather than by Transformers v5."""
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**{**TINY, **overrides})).to(dtype)
    model.save_pretrained(path, **({"max_shard_size": shard_size} if shard_size else {}))
    if legacy_llama3:
        fields = {
            "architectures": ["LlamaForCausalLM"],
            "model_type": "llama",
            "attention_bias": False,
            "mlp_bias": False,
            "hidden_act": "silu",
            "initializer_range": 0.02,
            "rms_norm_eps": 1e-5,
            "pretraining_tp": 1,
            "rope_theta": 500000.0,
            "bos_token_id": 1,
            "eos_token_id": [2, 0],
            "torch_dtype": "float32",
            "rope_scaling": {
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 16,
                "rope_type": "llama3",
            },
            "tie_word_embeddings": False,
            "transformers_version": "4.43.0.dev0",
            "use_cache": True,
            **TINY,
            **overrides,
        }
        (path / "config.json").write_text(json.dumps(fields, indent=2))
    if tokenizer_dir:
        AutoTokenizer.from_pretrained(tokenizer_dir).save_pretrained(path)
    return path


def _leftovers(parent, name):
    return [p.name for p in parent.iterdir() if p.name.startswith(f".{name}.")]


# ----------------------------------------------------------------------------------------------------------- head split


def test_head_split():
    assert head_split(32, 0.5, 0.75) == (16, 8)  # the paper's MoH-LLaMA3-8B: 16 shared + 8 of 16 routed = 75%
    assert head_split(8, 0.5, 0.75) == (4, 2)
    assert head_split(8, 0.25, 1.0) == (2, 6)
    assert head_split(12, 0.0, 0.5) == (0, 6)
    assert head_split(9, 0.3333, 0.7778) == (3, 4)  # ratios written to 4 decimals
    assert head_split(9, 1 / 3, 7 / 9) == (3, 4)
    assert head_split(9, shared_heads=3, active_heads=7) == (3, 4)  # counts instead of ratios
    assert head_split(9, 0.5, shared_heads=3, active_heads=7) == (3, 4)
    for heads, shared, active, message in [
        (8, 0.3, 0.75, r"shared ratio 0.3 and active ratio 0.75 give no whole number of heads of 8: 2.4 shared"),
        (8, 0.5, 0.7, "no whole number"),
        (9, 0.33, 0.7778, r"--shared_heads N --active_heads M"),
        (8, 0.5, 0.5, "4 active heads must be more than the 4 shared heads"),
        (8, 1.0, 1.0, "must be in \\[0, 1\\)"),
        (8, 0.5, 1.5, "must be in \\(0, 1\\]"),
        (8, float("nan"), 0.75, "--shared_heads_ratio must be a finite number, got nan"),
        (8, 0.5, float("inf"), "--active_heads_ratio must be a finite number, got inf"),
    ]:
        with pytest.raises(ConversionError, match=message):
            head_split(heads, shared, active)
    for value in ("0.5", None, True):
        with pytest.raises(TypeError, match=r"--shared_heads_ratio must be a number, not"):
            head_split(8, value, 0.75)
    with pytest.raises(ConversionError, match=r"--active_heads 12 must be between 0 and the model's 9 heads"):
        head_split(9, shared_heads=3, active_heads=12)
    with pytest.raises(TypeError, match=r"--shared_heads must be a whole number of heads, not str"):
        head_split(9, shared_heads="3", active_heads=7)


def test_entry_points():
    """mhmoe-convert runs mhmoe.convert.cli:main (through mhmoe._plumbing.cli, which checks the extras first), as
    does `python -m mhmoe.convert`; the old module mhmoe.conversion is gone (nothing was released with it)."""
    import importlib
    import re

    import mhmoe.convert as package

    with open(os.path.join(os.path.dirname(mhmoe.__file__), "..", "..", "pyproject.toml")) as f:
        (target,) = re.findall(r'^mhmoe-convert = "(.+)"$', f.read(), re.MULTILINE)
    assert target == "mhmoe._plumbing.cli:convert"
    from mhmoe._plumbing.cli import COMMANDS

    module, _ = COMMANDS["mhmoe-convert"]
    assert module == "mhmoe.convert.cli" and importlib.import_module(module).main is main is package.main
    with pytest.raises(ModuleNotFoundError):
        importlib.import_module("mhmoe.conversion")
    proc = subprocess.run(
        [sys.executable, "-m", "mhmoe.convert", "--help"], capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0 and "--input_dir" in proc.stdout, proc.stderr[-2000:]


# ----------------------------------------------------------------------------------------------------- good checkpoints


def test_sharded_llama3_checkpoint(tmp_path, tokenizer_dir):
    """Llama-3-style config (GQA, llama3 rope scaling, untied), 7 shards: same shards and index, bytes unchanged,
    tokenizer copied, exact logits with every head active, a report of the change with routing on."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from mhmoe import MoHLlamaForCausalLM

    source = _llama_dir(tmp_path / "llama", tokenizer_dir, shard_size="8KB", legacy_llama3=True)
    shards = sorted(p.name for p in source.glob("*.safetensors"))
    assert len(shards) > 3
    out = tmp_path / "moh"
    report = convert(str(source), str(out), progress=False, recipe="paper")  # the weights copied byte for byte

    assert sorted(p.name for p in out.glob("*.safetensors")) == shards
    index_in = json.loads((source / "model.safetensors.index.json").read_text())["weight_map"]
    index_out = json.loads((out / "model.safetensors.index.json").read_text())
    assert index_out["weight_map"] == index_in
    for shard in shards:  # every tensor byte-identical, shard by shard
        a, b = load_file(source / shard), load_file(out / shard)
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    sizes = [v.numel() * 4 for s in shards for v in load_file(out / s).values()]
    assert index_out["metadata"]["total_size"] == sum(sizes)

    config = json.loads((out / "config.json").read_text())
    assert config["model_type"] == "moh_llama" and config["architectures"] == ["MoHLlamaForCausalLM"]
    assert (config["moh_shared_heads"], config["moh_active_heads"], config["moh_router"]) == (4, 2, "l2")
    assert config["moh_straight_through"] == "scores" and config["moh_aux_loss_coef"] == 0.01  # eq. 9-10
    assert config["rope_parameters"]["rope_type"] == "llama3" and config["rope_parameters"]["rope_theta"] == 500000.0
    assert config["rope_parameters"]["factor"] == 8.0 and config["num_key_value_heads"] == 2
    assert config["eos_token_id"] == [2, 0] and config["tie_word_embeddings"] is False
    assert AutoTokenizer.from_pretrained(out).get_vocab() == AutoTokenizer.from_pretrained(tokenizer_dir).get_vocab()
    assert (out / "generation_config.json").is_file()
    assert stat.S_IMODE(out.stat().st_mode) & 0o055  # an ordinary directory, not mkdtemp's private one
    assert _leftovers(tmp_path, "moh") == []

    v = report.verification
    assert v["all_heads_max_abs_diff"] == 0.0 and v["all_heads_equal"]
    assert v["probe"].endswith("tokenized text")
    assert v["routed_max_abs_diff"] > 1e-3 and v["routed_top1_agreement"] < 1.0  # routing really drops heads
    text = report.format()
    assert "4 shared + 2 of 4 routed active = 6/8 (75.0%)" in text and "-> OK" in text
    assert f"{len(shards)} shard(s)" in text

    model = AutoModelForCausalLM.from_pretrained(out)
    assert type(model) is MoHLlamaForCausalLM
    record = json.loads((out / "moh_conversion.json").read_text())
    assert record["shared_heads"] == 4 and record["verification"]["all_heads_equal"] is True


def test_llama2_style_fp16_single_file(tmp_path):
    """A LLaMA-2-style config.json (rope_scaling null, torch_dtype float16, no GQA) with one model.safetensors."""
    from transformers import LlamaConfig, LlamaForCausalLM

    LlamaForCausalLM(LlamaConfig(**{**TINY, "num_key_value_heads": 8})).half().save_pretrained(tmp_path / "l2")
    fields = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "rope_scaling": None,
        "rope_theta": 10000.0,
        "torch_dtype": "float16",
        "pretraining_tp": 1,
        "rms_norm_eps": 1e-5,
        "hidden_act": "silu",
        "tie_word_embeddings": False,
        "bos_token_id": 1,
        "eos_token_id": 2,
        **TINY,
        "num_key_value_heads": 8,
    }
    (tmp_path / "l2" / "config.json").write_text(json.dumps(fields))
    report = convert(str(tmp_path / "l2"), str(tmp_path / "out"), 0.5, 0.625, progress=False)
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert config["dtype"] == "float16" and config["rope_parameters"] == {"rope_type": "default", "rope_theta": 10000.0}
    assert (report.shared_heads, report.routed_active_heads, report.num_key_value_heads) == (4, 1, 8)
    assert report.verification["all_heads_max_abs_diff"] == 0.0 and report.verification["dtype"] == "float16"
    written = sorted(p.name for p in (tmp_path / "out").iterdir() if p.suffix != ".py")  # + the modeling code
    assert written == ["README.md", "config.json", "generation_config.json", "model.safetensors", "moh_conversion.json"]


def test_qwen2_tied_bf16_and_mistral(tmp_path):
    """Qwen2 (q/k/v biases, tied embeddings, bf16) gains zero o_proj biases and matches exactly; Mistral without a
    sliding window converts, with one it is refused."""
    from transformers import MistralConfig, MistralForCausalLM, Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    qwen = Qwen2ForCausalLM(Qwen2Config(**TINY, tie_word_embeddings=True))
    with torch.no_grad():  # initialised at zero: make the q/k/v biases matter
        for name, param in qwen.named_parameters():
            if name.endswith("_proj.bias"):
                param.normal_(0, 0.5)
    qwen.to(torch.bfloat16).save_pretrained(tmp_path / "q")
    report = convert(str(tmp_path / "q"), str(tmp_path / "q_moh"), 0.25, 0.5, progress=False)
    weights = load_file(tmp_path / "q_moh" / "model.safetensors")
    biases = [k for k in weights if k.endswith("o_proj.bias")]
    assert len(biases) == 2 and all(weights[k].dtype == torch.bfloat16 and not weights[k].any() for k in biases)
    assert "lm_head.weight" not in weights and weights["model.layers.0.self_attn.q_proj.bias"].any()
    config = json.loads((tmp_path / "q_moh" / "config.json").read_text())
    assert config["attention_bias"] is True and config["tie_word_embeddings"] is True and config["dtype"] == "bfloat16"
    assert (config["moh_shared_heads"], config["moh_active_heads"]) == (2, 2)
    assert report.verification["all_heads_equal"] and report.verification["dtype"] == "bfloat16"
    assert any("zero o_proj biases" in note for note in report.notes)

    MistralForCausalLM(MistralConfig(**TINY, sliding_window=None)).save_pretrained(tmp_path / "m")
    report = convert(str(tmp_path / "m"), str(tmp_path / "m_moh"), progress=False)
    assert report.source_model_type == "mistral" and report.verification["all_heads_max_abs_diff"] == 0.0
    MistralForCausalLM(MistralConfig(**TINY, sliding_window=16)).save_pretrained(tmp_path / "m_sw")
    with pytest.raises(ConversionError, match="sliding-window attention \\(sliding_window=16"):
        convert(str(tmp_path / "m_sw"), str(tmp_path / "m_sw_moh"), progress=False)
    assert not (tmp_path / "m_sw_moh").exists()


# ------------------------------------------------------------------------------------------------------------- refusals


def _refusal_cases(tmp_path):
    """name -> (make the broken source checkpoint in directory d, expected message)."""

    def sharded(d):
        return _llama_dir(d, shard_size="8KB")

    def index(d):
        return json.loads((d / "model.safetensors.index.json").read_text())

    def shard(d, i):
        return sorted(d.glob("model-*.safetensors"))[i]

    def not_llama(d):
        _llama_dir(d)
        (d / "config.json").write_text(json.dumps({"model_type": "gpt2", "n_layer": 2}))

    def missing_shard(d):
        sharded(d)
        os.remove(shard(d, 1))

    def truncated_shard(d):
        sharded(d)
        path = shard(d, 2)
        os.truncate(path, path.stat().st_size - 16)

    def index_names_absent(d):
        sharded(d)
        data = index(d)
        data["weight_map"]["model.layers.0.self_attn.q_proj.weight"] = shard(d, -1).name
        (d / "model.safetensors.index.json").write_text(json.dumps(data))

    def shape_mismatch(d):
        _llama_dir(d)
        config = json.loads((d / "config.json").read_text())
        (d / "config.json").write_text(json.dumps({**config, "intermediate_size": 64}))

    def pickle_only(d):
        d.mkdir()
        (d / "config.json").write_text(json.dumps({"model_type": "llama", **TINY}))

        class Payload:  # unpickling this would create the marker file
            def __reduce__(self):
                return (open, (str(d.parent / "UNPICKLED"), "w"))

        (d / "pytorch_model.bin").write_bytes(pickle.dumps(Payload()))

    def quantized(d):
        _llama_dir(d)
        weights = load_file(d / "model.safetensors")
        weights["model.layers.0.mlp.up_proj.weight"] = weights["model.layers.0.mlp.up_proj.weight"].to(torch.int8)
        save_file(weights, d / "model.safetensors", metadata={"format": "pt"})

    def missing_tensor(d):
        _llama_dir(d)
        weights = load_file(d / "model.safetensors")
        del weights["model.layers.1.post_attention_layernorm.weight"]
        save_file(weights, d / "model.safetensors", metadata={"format": "pt"})

    def unknown_tensor(d):
        _llama_dir(d)
        weights = load_file(d / "model.safetensors")
        weights["model.layers.0.self_attn.q_proj.lora_A.weight"] = torch.zeros(2, 32)
        save_file(weights, d / "model.safetensors", metadata={"format": "pt"})

    def no_index(d):
        sharded(d)
        os.remove(d / "model.safetensors.index.json")

    return {
        "non-llama model type": (not_llama, "model_type 'gpt2' .* is not a LLaMA-family model"),
        "missing shard": (missing_shard, "shard\\(s\\) named by model.safetensors.index.json are missing"),
        "truncated shard": (truncated_shard, "model-00003-of-000\\d\\d.safetensors is not a complete safetensors file"),
        "index names absent tensor": (index_names_absent, "names 1 tensor\\(s\\) absent from their shard"),
        "shape mismatch": (shape_mismatch, "shape mismatch: model.layers.0.mlp.down_proj.weight is \\[32, 48\\]"),
        "pickle only": (pickle_only, "only pickle checkpoints \\(pytorch_model.bin\\); they are never unpickled"),
        "quantized tensor": (quantized, "has dtype I8: only float checkpoints"),
        "missing tensor": (missing_tensor, "lacks 1 tensor\\(s\\).*post_attention_layernorm"),
        "unknown tensor": (unknown_tensor, "lora_A.weight .* is not a weight of a llama model"),
        "no index for shards": (no_index, "the index file is missing"),
    }


@pytest.mark.parametrize(
    "case",
    [
        "non-llama model type",
        "missing shard",
        "truncated shard",
        "index names absent tensor",
        "shape mismatch",
        "pickle only",
        "quantized tensor",
        "missing tensor",
        "unknown tensor",
        "no index for shards",
    ],
)
def test_refusals_leave_nothing(tmp_path, case, capsys):
    make, message = _refusal_cases(tmp_path)[case]
    make(tmp_path / "src")
    out = tmp_path / "out"
    with pytest.raises(ConversionError, match=message):
        convert(str(tmp_path / "src"), str(out), progress=False)
    with pytest.raises(SystemExit) as exit_info:  # the CLI: exit status 2, the reason in words
        main(["--input_dir", str(tmp_path / "src"), "--output_dir", str(out), "--disable_tqdm"])
    assert exit_info.value.code == 2
    assert ": error:" in capsys.readouterr().err
    assert not out.exists() and _leftovers(tmp_path, "out") == []
    assert not (tmp_path / "UNPICKLED").exists()


def test_output_dir_rules_and_interrupted_write(tmp_path, monkeypatch, capsys):
    source = _llama_dir(tmp_path / "llama", shard_size="8KB")
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    with pytest.raises(ConversionError, match="exists and is not empty; pass --overwrite"):
        convert(str(source), str(out), progress=False)
    assert (out / "keep.txt").read_text() == "mine"
    with pytest.raises(ConversionError, match="give no whole number of heads"):
        convert(str(source), str(out), 0.5, 0.7, overwrite=True, progress=False)
    with pytest.raises(ConversionError, match="must not be --input_dir, inside it"):
        convert(str(source), str(source / "sub"), progress=False)

    calls = []
    real_write = write._write_shard

    def failing_write(shard, path, progress=None):  # the disk fills up at the third shard
        calls.append(shard.filename)
        if len(calls) == 3:
            raise OSError(28, "No space left on device")
        return real_write(shard, path, progress)

    monkeypatch.setattr(write, "_write_shard", failing_write)
    with pytest.raises(OSError, match="No space left"):
        convert(str(source), str(out), overwrite=True, progress=False)
    assert sorted(p.name for p in out.iterdir()) == ["keep.txt"] and _leftovers(tmp_path, "out") == []
    monkeypatch.undo()

    main(["--input_dir", str(source), "--output_dir", str(out), "--overwrite", "--skip_logit_check", "--disable_tqdm"])
    printed = capsys.readouterr().out
    assert "logits: not checked (--skip_logit_check)" in printed and "6/8 (75.0%)" in printed
    assert not (out / "keep.txt").exists() and (out / "model.safetensors.index.json").is_file()
    assert _leftovers(tmp_path, "out") == []
    nested = tmp_path / "new" / "deeper" / "moh"  # missing parents are made
    convert(str(source), str(nested), verify_logits=False, progress=False)
    assert (nested / "config.json").is_file()


# ------------------------------------------------------------------------------------------------------ continue-tuning


def _tune_flags(source, out, corpus, *extra):
    return [
        "--input_dir",
        str(source),
        "--output_dir",
        str(out),
        "--train_file",
        corpus["train"],
        "--block_size",
        "16",
        "--per_device_train_batch_size",
        "2",
        "--per_device_eval_batch_size",
        "8",
        "--learning_rate",
        "3e-3",
        "--min_learning_rate",
        "3e-4",
        "--warmup_steps",
        "1",
        "--seed",
        "0",
        "--disable_tqdm",
        *extra,
    ]


def _records(out, key):
    with open(out / "metrics.jsonl") as f:
        return [r for r in map(json.loads, f) if key in r]


def test_continue_tuning_curve_and_exact_resume(tmp_path, corpus, tokenizer_dir, capsys):
    """--train_file: converted model in OUT/converted, mhmoe.training with the MoH balance loss and a cosine to the final
    LR, the dense parent's perplexity at step 0 (all heads on), periodic evaluation, recovery curve; resuming from a
    checkpoint reproduces the uninterrupted run."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from mhmoe import MoHLlamaForCausalLM
    from mhmoe.training.data import read_files, tokenize_and_pack

    source = _llama_dir(tmp_path / "llama", tokenizer_dir)
    out = tmp_path / "run"
    flags = _tune_flags(
        source,
        out,
        corpus,
        "--validation_file",
        corpus["val"],
        "--max_steps",
        "4",
        "--eval_steps",
        "2",
        "--save_steps",
        "2",
    )
    main(flags)
    printed = capsys.readouterr().out
    assert "converted llama -> moh_llama" in printed and "recovery: dense parent perplexity" in printed

    converted = json.loads((out / "converted" / "config.json").read_text())
    assert converted["model_type"] == "moh_llama" and converted["moh_active_heads"] == 2
    assert type(AutoModelForCausalLM.from_pretrained(out)) is MoHLlamaForCausalLM  # the continue-tuned model

    # the reference at step 0 is the dense parent's validation perplexity, computed here independently
    dense = AutoModelForCausalLM.from_pretrained(source).eval()
    blocks = tokenize_and_pack(read_files([corpus["val"]]), AutoTokenizer.from_pretrained(source), 16)
    with torch.no_grad():
        logits = dense(blocks).logits
    dense_loss = torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, 320), blocks[:, 1:].reshape(-1))
    (reference,) = _records(out, "reference_eval_ppl")
    assert reference["step"] == 0 and reference["reference_eval_loss"] == pytest.approx(dense_loss.item(), rel=1e-5)

    evals = _records(out, "eval_ppl")
    assert [(r["step"], r["tokens"]) for r in evals] == [(0, 0), (2, 64), (4, 128)]
    assert evals[0]["eval_loss"] != pytest.approx(reference["reference_eval_loss"], rel=1e-6)  # routing changed it
    train_records = _records(out, "loss")
    for r in train_records:  # the MoH load-balance loss is trained with β = 0.01
        assert r["moh_aux_loss"] > 0 and r["loss"] == pytest.approx(r["lm_loss"] + 0.01 * r["moh_aux_loss"], rel=1e-5)
    lrs = [r["lr"] for r in train_records]
    assert lrs[0] == 0.0 and lrs[1] == pytest.approx(3e-3) and lrs[1] > lrs[2] > lrs[3] > 3e-4  # warmup, cosine
    summary = json.loads((out / "train_summary.json").read_text())["args"]
    assert summary["weight_decay"] == 0.1 and summary["max_grad_norm"] == 1.0  # paper defaults

    lines = (out / "recovery_curve.csv").read_text().splitlines()
    assert lines[0] == "step,tokens,eval_loss,eval_ppl,dense_ppl,ppl_over_dense" and len(lines) == 4
    assert [int(line.split(",")[1]) for line in lines[1:]] == [0, 64, 128]
    assert float(lines[-1].split(",")[5]) == pytest.approx(evals[-1]["eval_ppl"] / reference["reference_eval_ppl"])
    assert (out / "recovery_curve.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    recovery = json.loads((out / "recovery_summary.json").read_text())
    assert recovery["dense_ppl"] == pytest.approx(reference["reference_eval_ppl"])

    # resume from step 2: the same steps 3-4 and the same final model
    final_before = {k: v.clone() for k, v in load_file(out / "model.safetensors").items()}
    fresh_accelerate_state()
    main(flags + ["--resume_from_checkpoint", str(out / "checkpoint-2")])
    resumed = _records(out, "loss")
    assert [r["step"] for r in resumed] == [1, 2, 3, 4]
    for key in ("loss", "lm_loss", "moh_aux_loss", "lr"):
        assert [r[key] for r in resumed] == pytest.approx([r[key] for r in train_records], rel=1e-6), key
    final_after = load_file(out / "model.safetensors")
    assert all(torch.allclose(final_after[k], final_before[k], rtol=1e-5, atol=1e-7) for k in final_before)
    assert len(_records(out, "reference_eval_ppl")) == 1  # step-0 records kept, not redone

    # a second fresh run into the same directory is refused; resuming a directory without a conversion too
    fresh_accelerate_state()
    with pytest.raises(SystemExit) as exit_info:
        main(flags)
    assert exit_info.value.code == 2 and "exists and is not empty" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(_tune_flags(source, tmp_path / "none", corpus, "--resume_from_checkpoint", "latest"))
    assert "no converted model" in capsys.readouterr().err


def test_training_input_errors_leave_no_conversion_behind(tmp_path, corpus, tokenizer_dir, capsys, monkeypatch):
    """A bad training argument is found before converting; a data problem only found by the training run removes the
    conversion it stopped, so the same command works once fixed."""
    import mhmoe.convert.continue_tune as conversion

    source = _llama_dir(tmp_path / "llama", tokenizer_dir)
    out = tmp_path / "t"
    converted = []
    monkeypatch.setattr(conversion, "convert", lambda *a, **k: converted.append(1) or pytest.fail("converted"))
    with pytest.raises(SystemExit):
        main(_tune_flags(source, out, corpus, "--max_steps", "1", "--validation_file", str(tmp_path / "nope.jsonl")))
    assert "data file not found" in capsys.readouterr().err and not converted and not out.exists()
    monkeypatch.undo()
    with pytest.raises(SystemExit):
        main(_tune_flags(source, out, corpus, "--max_steps", "1", "--text_field", "body"))
    assert "no text field 'body'" in capsys.readouterr().err and not out.exists()
    assert _leftovers(tmp_path, "t") == []
    main(_tune_flags(source, out, corpus, "--max_steps", "1"))
    assert (out / "converted" / "config.json").is_file() and (out / "model.safetensors").is_file()


def test_continue_tuning_lora_without_validation(tmp_path, corpus, tokenizer_dir, capsys):
    source = _llama_dir(tmp_path / "llama", tokenizer_dir)
    out = tmp_path / "lora"
    main(_tune_flags(source, out, corpus, "--max_steps", "2", "--lora", "--lora_r", "4", "--merge_lora"))
    assert "no perplexity, no recovery curve" in capsys.readouterr().out
    adapter = load_file(out / "adapter_model.safetensors")
    assert any("q_proj.lora_A" in k for k in adapter) and not (out / "recovery_curve.csv").exists()
    merged = json.loads((out / "merged" / "config.json").read_text())
    assert merged["model_type"] == "moh_llama" and merged["moh_shared_heads"] == 4
    before = load_file(out / "converted" / "model.safetensors")["model.layers.0.self_attn.q_proj.weight"]
    after = load_file(out / "merged" / "model.safetensors")["model.layers.0.self_attn.q_proj.weight"]
    assert not torch.equal(before, after)  # the LoRA update was merged into q_proj


def test_two_processes(tmp_path, corpus, tokenizer_dir):
    """Under `accelerate launch` with 2 CPU processes: the main process converts once, both train; a refusal on the
    main process ends both processes (none waits forever)."""
    source = _llama_dir(tmp_path / "llama", tokenizer_dir)
    out = tmp_path / "ddp"
    script = os.path.join(os.path.dirname(__file__), "..", "..", "conversion", "convert_llama_to_moh.py")
    src = os.path.join(os.path.dirname(mhmoe.__file__), "..")
    env = dict(
        os.environ,
        ACCELERATE_USE_CPU="1",
        OMP_NUM_THREADS="1",
        HF_HUB_OFFLINE="1",
        HF_DATASETS_OFFLINE="1",
        PYTHONPATH=os.pathsep.join([os.path.abspath(src), os.environ.get("PYTHONPATH", "")]),
    )
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
        script,
        *_tune_flags(source, out, corpus, "--validation_file", corpus["val"], "--max_steps", "2"),
    ]
    proc = subprocess.run(launch, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.count("converted llama -> moh_llama") == 1
    summary = json.loads((out / "train_summary.json").read_text())
    assert summary["num_processes"] == 2 and summary["distributed_type"] == "MULTI_CPU"
    assert (out / "converted" / "model.safetensors").is_file() and (out / "recovery_curve.csv").is_file()
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []

    launch[launch.index("--main_process_port") + 1] = str(free_port())  # again into the same, now non-empty, dir
    proc = subprocess.run(launch, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0 and "exists and is not empty" in proc.stderr
    assert "the main process failed: ConversionError" in proc.stderr  # rank 1 was told and stopped


# ----------------------------------------------------------------------------------------------------- end-to-end proof


def test_recovery_demo_dense_to_moh_on_cpu(tmp_path):
    """The paper's Fig. 2 claim in miniature: a tiny dense LLaMA trained here on the stdlib's pydoc topics (held-out
    topics for validation), converted to MoH with 75% of the heads active per token, which costs clearly more than 5%
    perplexity, recovers to within 5% of the dense parent after a short continue-tuning budget."""
    from mhmoe.recovery_demo import format_result, run_recovery_demo

    result = run_recovery_demo(str(tmp_path), control=False)  # the defaults: hidden 128, 300 + 60 steps
    print(format_result(result))
    assert result["active_heads"] == "6/8"
    assert result["dense_ppl"] < result["chance_ppl"] / 8  # clearly better than chance (384)
    assert result["dense_ppl_all_heads_reference"] == pytest.approx(result["dense_ppl"], rel=1e-4)
    assert result["moh_ppl_before_tuning"] > 1.08 * result["dense_ppl"]  # the conversion hurts: recovery is needed
    assert result["moh_over_dense"] <= 1.05
    assert result["tokens_to_recover"] is not None and result["tokens_to_recover"] <= result["tune_tokens"]
    assert (tmp_path / "moh" / "recovery_curve.png").is_file() and (tmp_path / "recovery_demo.json").is_file()


@pytest.mark.parametrize(
    "fields, message",
    [
        (dict(min_learning_rate=3e-3), "must be >= 0 and < --learning_rate"),
        (dict(min_learning_rate=1e-4, lr_scheduler_type="linear"), "applies to the cosine schedule, not 'linear'"),
        (dict(lr_scheduler_type="cosine_with_min_lr"), "needs --min_learning_rate > 0"),
        (dict(eval_at_start=True, validation_file=None), "--eval_at_start .* need --validation_file"),
    ],
)
def test_train_hooks_refuse_bad_input(tmp_path, corpus, tokenizer_dir, fields, message):
    """The options continue-tuning added to mhmoe-train refuse nonsense before anything is trained."""
    from mhmoe.training import TrainingError, train

    source = _llama_dir(tmp_path / "llama", tokenizer_dir)  # a dense llama trains too (the converter's parents)
    args = dict(
        model_name_or_path=str(source),
        output_dir=str(tmp_path / "out"),
        train_file=[corpus["train"]],
        validation_file=[corpus["val"]],
        block_size=16,
        learning_rate=3e-3,
        max_steps=1,
        disable_tqdm=True,
    )
    with pytest.raises(TrainingError, match=message):
        train({**args, **fields})


def test_continue_tuning_on_a_chat_dataset(tmp_path, chat_tokenizer_dir, chat_data, capsys):
    """--dataset with chat records: the converter's continue-tuning runs chat SFT (assistant-only loss) with the MoH
    balance loss, the parent's and the converted model's validation on the held-out conversations, a recovery curve."""
    source = _llama_dir(tmp_path / "llama", chat_tokenizer_dir, max_position_embeddings=128)
    out = tmp_path / "run"
    main(
        [
            "--input_dir", str(source), "--output_dir", str(out), "--dataset", chat_data["chat"],
            "--validation_split", "20%", "--block_size", "128", "--per_device_train_batch_size", "2",
            "--max_steps", "2", "--warmup_steps", "1", "--disable_tqdm",
        ]
    )  # fmt: skip
    printed = capsys.readouterr().out
    assert "messages records (chat, loss on the assistant/completion tokens" in printed
    assert "recovery: dense parent perplexity" in printed
    (reference,) = _records(out, "reference_eval_ppl")
    assert reference["step"] == 0 and reference["reference_eval_loss"] > 0
    summary = json.loads((out / "train_summary.json").read_text())
    assert summary["data_format"] == "messages" and summary["args"]["dataset"] == "chat.jsonl"
    assert "chat.jsonl (chat, loss on the assistant turns)" in (out / "README.md").read_text()


def test_conversion_entry_script_runs_as_mhmoe_convert(tmp_path, tokenizer_dir, warm):
    """conversion/convert_llama_to_moh.py (the design's entry point) is mhmoe-convert: the same options (both
    commands' --help), and a conversion through the script (its own process, `python SCRIPT`, forked warm: see
    tests/fixtures/warm.py) writes the same tensors as the function
    the console script runs (mhmoe.convert.cli.main, here in-process: mhmoe-convert itself converts from the wheel in
    tests/test_installed_package.py)."""
    from mhmoe.convert.cli import main as console_main

    source = _llama_dir(tmp_path / "llama", tokenizer_dir)
    script = os.path.join(os.path.dirname(__file__), "..", "..", "conversion", "convert_llama_to_moh.py")
    console = os.path.join(os.path.dirname(sys.executable), "mhmoe-convert")
    env = dict(os.environ, HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", OMP_NUM_THREADS="1")
    outputs = {}
    for name, command in (("script", [sys.executable, script]), ("console", [console])):
        helps = subprocess.run([*command, "--help"], capture_output=True, text=True, env=env, check=True).stdout
        outputs[name] = re.findall(r"--\w+", helps)
    assert outputs["script"] == outputs["console"] and "--head_budget" in outputs["script"]
    flags = ["--input_dir", str(source), "--recipe", "paper", "--disable_tqdm"]
    done = warm.run(
        [sys.executable, script, *flags, "--output_dir", str(tmp_path / "script")], env=cli_env(), timeout=300
    )
    assert done.returncode == 0, done.stderr[-3000:]
    console_main([*flags, "--output_dir", str(tmp_path / "console")])
    script_tensors = load_file(tmp_path / "script" / "model.safetensors")
    console_tensors = load_file(tmp_path / "console" / "model.safetensors")
    assert script_tensors.keys() == console_tensors.keys()
    assert all(torch.equal(script_tensors[k], console_tensors[k]) for k in script_tensors)
