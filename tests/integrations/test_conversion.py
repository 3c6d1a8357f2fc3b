"""Dense LLaMA / Mistral / Qwen2 -> MoH-LLaMA conversion (mhmoe.conversion): streamed shards, configs, refusals with
nothing left behind, verification, continue-tuning through mhmoe.train (resume, LoRA, 2 processes) and the recovery
curve."""

import json
import os
import pickle
import stat
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file, save_file

import mhmoe.conversion as conversion
from mhmoe.conversion import ConversionError, convert, head_split, main

from .conftest import fresh_accelerate_state

TINY = dict(vocab_size=320, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=8,
            num_key_value_heads=2, max_position_embeddings=32)  # fmt: skip


def _llama_dir(path, tokenizer_dir=None, dtype=torch.float32, shard_size=None, legacy_llama3=False, **overrides):
    """A tiny random dense Llama checkpoint. `legacy_llama3`: config.json written the way Meta's Llama-3.1 repos ship
    it (rope_theta + rope_scaling of type llama3, torch_dtype, a list of EOS ids) rather than by Transformers v5."""
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**{**TINY, **overrides})).to(dtype)
    model.save_pretrained(path, **({"max_shard_size": shard_size} if shard_size else {}))
    if legacy_llama3:
        fields = {
            "architectures": ["LlamaForCausalLM"], "model_type": "llama", "attention_bias": False, "mlp_bias": False,
            "hidden_act": "silu", "initializer_range": 0.02, "rms_norm_eps": 1e-5, "pretraining_tp": 1,
            "rope_theta": 500000.0, "bos_token_id": 1, "eos_token_id": [2, 0], "torch_dtype": "float32",
            "rope_scaling": {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                             "original_max_position_embeddings": 16, "rope_type": "llama3"},
            "tie_word_embeddings": False, "transformers_version": "4.43.0.dev0", "use_cache": True, **TINY, **overrides,
        }  # fmt: skip
        (path / "config.json").write_text(json.dumps(fields, indent=2))
    if tokenizer_dir:
        AutoTokenizer.from_pretrained(tokenizer_dir).save_pretrained(path)
    return path


def _leftovers(parent, name):
    return [p.name for p in parent.iterdir() if p.name.startswith(f".{name}.")]


# ------------------------------------------------------------------------------------------------------------ head split


def test_head_split():
    assert head_split(32, 0.5, 0.75) == (16, 8)  # the paper's MoH-LLaMA3-8B: 16 shared + 8 of 16 routed = 75%
    assert head_split(8, 0.5, 0.75) == (4, 2)
    assert head_split(8, 0.25, 1.0) == (2, 6)
    assert head_split(12, 0.0, 0.5) == (0, 6)
    for heads, shared, active, message in [(8, 0.3, 0.75, "no integer head split"), (8, 0.5, 0.7, "no integer"),
                                           (8, 0.5, 0.5, "must exceed"), (8, 1.0, 1.0, "must be in \\[0, 1\\)"),
                                           (8, 0.5, 1.5, "must be in \\(0, 1\\]")]:  # fmt: skip
        with pytest.raises(ConversionError, match=message):
            head_split(heads, shared, active)


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
    report = convert(str(source), str(out), progress=False)

    assert sorted(p.name for p in out.glob("*.safetensors")) == shards
    index_in = json.loads((source / "model.safetensors.index.json").read_text())["weight_map"]
    index_out = json.loads((out / "model.safetensors.index.json").read_text())
    assert index_out["weight_map"] == index_in
    for shard in shards:  # every tensor byte-identical, shard by shard
        a, b = load_file(source / shard), load_file(out / shard)
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert index_out["metadata"]["total_size"] == sum(v.numel() * 4 for s in shards for v in load_file(out / s).values())

    config = json.loads((out / "config.json").read_text())
    assert config["model_type"] == "moh_llama" and config["architectures"] == ["MoHLlamaForCausalLM"]
    assert (config["moh_shared_heads"], config["moh_active_heads"], config["moh_router"]) == (4, 2, "l2")
    assert config["moh_straight_through"] is True and config["moh_aux_loss_coef"] == 0.01
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


# --------------------------------------------------------------------------------------------------------------- refusals


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


@pytest.mark.parametrize("case", ["non-llama model type", "missing shard", "truncated shard",
                                  "index names absent tensor", "shape mismatch", "pickle only", "quantized tensor",
                                  "missing tensor", "unknown tensor", "no index for shards"])  # fmt: skip
def test_refusals_leave_nothing(tmp_path, case, capsys):
    make, message = _refusal_cases(tmp_path)[case]
    make(tmp_path / "src")
    out = tmp_path / "out"
    with pytest.raises(ConversionError, match=message):
        convert(str(tmp_path / "src"), str(out), progress=False)
    with pytest.raises(SystemExit) as exit_info:  # the CLI: exit status 2, the reason in words
        main(["--input_dir", str(tmp_path / "src"), "--output_dir", str(out), "--disable_tqdm"])
    assert exit_info.value.code == 2
    assert "convert_llama_to_moh: error:" in capsys.readouterr().err
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
    with pytest.raises(ConversionError, match="no integer head split"):
        convert(str(source), str(out), 0.5, 0.7, overwrite=True, progress=False)
    with pytest.raises(ConversionError, match="must not be --input_dir, inside it"):
        convert(str(source), str(source / "sub"), progress=False)

    calls = []
    real_write = conversion._write_shard

    def failing_write(shard, path, progress=None):  # the disk fills up at the third shard
        calls.append(shard.filename)
        if len(calls) == 3:
            raise OSError(28, "No space left on device")
        return real_write(shard, path, progress)

    monkeypatch.setattr(conversion, "_write_shard", failing_write)
    with pytest.raises(OSError, match="No space left"):
        convert(str(source), str(out), overwrite=True, progress=False)
    assert sorted(p.name for p in out.iterdir()) == ["keep.txt"] and _leftovers(tmp_path, "out") == []
    monkeypatch.undo()

    main(["--input_dir", str(source), "--output_dir", str(out), "--overwrite", "--skip_logit_check", "--disable_tqdm"])
    printed = capsys.readouterr().out
    assert "logits: not checked (--skip_logit_check)" in printed and "6/8 (75.0%)" in printed
    assert not (out / "keep.txt").exists() and (out / "model.safetensors.index.json").is_file()
    assert _leftovers(tmp_path, "out") == []
