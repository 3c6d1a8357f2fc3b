"""The checks both configs share (models/config_checks.py): a misspelt keyword, RoPE and the special token ids that
Transformers only warns about (or refuses with a KeyError), and head counts larger than the hidden size. Each is a
ValueError with one line naming the value and what is allowed, from the constructor and from `from_pretrained`."""

import json
import re

import pytest
import torch

from mhmoe import MHMoEConfig, MHMoEForCausalLM, MoHLlamaConfig, MoHLlamaForCausalLM

TINY = dict(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4)
MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16)
CLASSES = {"mhmoe": (MHMoEConfig, MHMoEForCausalLM, MOE), "moh_llama": (MoHLlamaConfig, MoHLlamaForCausalLM, {})}

CASES = {
    "misspelt field": (dict(moh_shared_head=2), r"unknown argument\(s\) 'moh_shared_head' \(did you mean "),
    "misnamed field": (dict(top_k=2), r"top_k \(use num_experts_per_tok\)"),
    "negative rope_theta": (dict(rope_theta=-1.0), r"rope_theta .* must be a finite number > 0, got -1.0"),
    "nan rope_theta": (dict(rope_theta=float("nan")), r"rope_theta .* must be a finite number > 0, got nan"),
    "rope_theta as text": (dict(rope_theta="1e4"), r"rope_theta .* must be a finite number > 0, got '1e4'"),
    "negative theta in rope_parameters": (
        dict(rope_parameters={"rope_type": "default", "rope_theta": -5.0}),
        r"rope_theta .* got -5.0",
    ),
    "unknown rope type": (
        dict(rope_parameters={"rope_type": "bogus", "rope_theta": 1e4}),
        r"rope_type must be one of \('default', 'linear', .*\), got 'bogus'",
    ),
    "unknown legacy rope_scaling type": (
        dict(rope_scaling={"type": "bogus", "factor": 2.0}),
        r"rope_type must be one of .*, got 'bogus'",
    ),
    "rope type without its keys": (
        dict(rope_scaling={"rope_type": "linear"}),
        r"Missing required keys .* 'rope_type'='linear': \{'factor'\}",
    ),
    "bos_token_id outside the vocabulary": (
        dict(bos_token_id=64),
        r"bos_token_id \(64\) must lie in the vocabulary: 0 to 63 \(vocab_size 64\), or be None",
    ),
    "negative eos_token_id": (dict(eos_token_id=-1), r"eos_token_id \(-1\) must lie in the vocabulary: 0 to 63"),
    "eos_token_id list outside the vocabulary": (
        dict(eos_token_id=[2, 1000]),
        r"eos_token_id \(\[2, 1000\]\) must lie in the vocabulary",
    ),
    "zero heads": (dict(num_attention_heads=0), r"num_attention_heads must be >= 1, got 0"),
    "linear factor 0": (
        dict(rope_scaling={"rope_type": "linear", "factor": 0}),
        r"rope_parameters' factor must be finite numbers > 0, got 0",
    ),
    "dynamic factor -2 in rope_parameters": (
        dict(rope_parameters={"rope_type": "dynamic", "rope_theta": 1e4, "factor": -2.0}),
        r"factor must be finite numbers > 0, got -2.0",
    ),
    "nan long_factor": (
        dict(
            rope_parameters={
                "rope_type": "longrope",
                "rope_theta": 1e4,
                "factor": 2.0,
                "original_max_position_embeddings": 16,
                "short_factor": [1.0] * 4,
                "long_factor": [1.0, float("nan"), 1.0, 1.0],
            }
        ),
        r"long_factor must be finite numbers > 0, got a list holding nan",
    ),
}

# every rope type with every numeric field Transformers reads, at values a typo or a bad tool gives
ROPE_TYPES = {
    "default": {},
    "linear": {"factor": 2.0},
    "dynamic": {"factor": 2.0},
    "yarn": {
        "factor": 2.0,
        "original_max_position_embeddings": 8,
        "beta_fast": 32.0,
        "beta_slow": 1.0,
        "attention_factor": 1.0,
        "mscale": 1.0,
        "mscale_all_dim": 1.0,
    },
    "longrope": {
        "factor": 2.0,
        "short_factor": [1.0] * 8,
        "long_factor": [1.0] * 8,
        "original_max_position_embeddings": 8,
        "attention_factor": 1.0,
    },
    "llama3": {"factor": 2.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8},
}
ODD_VALUES = (0, -2, float("nan"), float("inf"), -float("inf"), 1e-30, 0.5, 1, 1e30)


def _one_line_value_error(make, words):
    with pytest.raises(ValueError) as info:
        make()
    message = str(info.value)
    assert "\n" not in message and "Traceback" not in message, message
    assert re.search(words, message), message
    return message


@pytest.mark.parametrize("model_type", CLASSES)
@pytest.mark.parametrize("case", CASES)
def test_bad_values_are_one_line_value_errors(model_type, case):
    config_class, _, moe = CLASSES[model_type]
    fields, words = CASES[case]
    if case == "misnamed field" and model_type == "moh_llama":
        fields = dict(num_local_experts=4)  # MoH-LLaMA has no experts: the name other MoE configs use is still named
        words = r"num_local_experts \(use num_experts\)"
    message = _one_line_value_error(lambda: config_class(**{**TINY, **moe, **fields}), words)
    assert message.startswith(f"Invalid {config_class.__name__}: "), message


@pytest.mark.parametrize("model_type", CLASSES)
def test_more_heads_than_channels_is_named(model_type):
    """2**40 heads over 32 channels: one line naming both numbers (not a derived head_dim of 0 or a traceback)."""
    config_class, _, moe = CLASSES[model_type]
    fields = {**TINY, **moe, "num_attention_heads": 2**40, "num_key_value_heads": 2**40}
    _one_line_value_error(lambda: config_class(**fields), r"1099511627776.*32|32.*1099511627776")


@pytest.mark.parametrize("model_type", CLASSES)
@pytest.mark.parametrize("case", ["negative rope_theta", "unknown rope type", "bos_token_id outside the vocabulary"])
def test_from_pretrained_refuses_the_same_values(tmp_path, model_type, case):
    """A config.json carrying the value (written by hand, or by another tool) is refused on loading, same words."""
    config_class, _, moe = CLASSES[model_type]
    config_class(**TINY, **moe).save_pretrained(tmp_path)
    fields = json.loads((tmp_path / "config.json").read_text())
    bad, words = CASES[case]
    if "rope_theta" in bad:
        fields["rope_parameters"] = {"rope_type": "default", "rope_theta": bad["rope_theta"]}
    else:
        fields.update(bad)
    (tmp_path / "config.json").write_text(json.dumps(fields))
    _one_line_value_error(lambda: config_class.from_pretrained(tmp_path), words)


@pytest.mark.parametrize("rope_type", ROPE_TYPES)
def test_every_rope_value_is_refused_or_gives_finite_logits(rope_type):
    """Property over every rope type, each of its fields and `rope_theta` at odd values (0, negative, NaN, inf, tiny,
    huge): the config is refused in one line, or a tiny forward past the model's length (where dynamic and long
    scalings switch) has finite logits. No accepted config computes NaN."""
    tiny = dict(TINY, num_hidden_layers=1, num_attention_heads=2, max_position_embeddings=16)
    fields = ROPE_TYPES[rope_type]
    refused = accepted = 0
    for name in [*fields, "rope_theta"]:
        for value in ODD_VALUES:
            parameters = {"rope_type": rope_type, "rope_theta": 1e4, **fields}
            parameters[name] = [value] * 8 if isinstance(parameters[name], list) else value
            try:
                config = MHMoEConfig(**tiny, **MOE, rope_parameters=parameters)
            except ValueError as e:
                assert "\n" not in str(e) and "rope" in str(e), str(e)
                refused += 1
                continue
            torch.manual_seed(0)
            with torch.no_grad():
                logits = MHMoEForCausalLM(config).eval()(torch.randint(0, 64, (1, 24))).logits
            assert torch.isfinite(logits).all(), (name, value)
            accepted += 1
    assert refused and accepted  # both sides of the rule are reached for every type


@pytest.mark.parametrize("model_type", CLASSES)
def test_valid_rope_scaling_and_token_ids_still_build_a_model(model_type):
    """What the checks let through works: Llama 3's rope scaling and a list of eos ids give a model with finite
    logits (a check too eager would refuse real Llama configs)."""
    config_class, model_class, moe = CLASSES[model_type]
    llama3 = {
        "rope_type": "llama3",
        "rope_theta": 500000.0,
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 16,
    }
    config = config_class(**TINY, **moe, rope_parameters=llama3, bos_token_id=0, eos_token_id=[1, 63])
    torch.manual_seed(0)
    logits = model_class(config)(torch.randint(0, 64, (1, 8))).logits
    assert torch.isfinite(logits).all()


def test_rope_checks_work_under_a_meta_device():
    """Transformers builds configs inside `torch.device("meta")` when loading with empty weights: the frequencies the
    check computes are real numbers there too (a meta tensor has none to test)."""
    llama3 = dict(ROPE_TYPES["llama3"], rope_type="llama3", rope_theta=5e5)
    with torch.device("meta"):
        MHMoEConfig(**TINY, **MOE, rope_parameters=llama3)
        with pytest.raises(ValueError, match="factor must be finite numbers > 0"):
            MHMoEConfig(**TINY, **MOE, rope_parameters=dict(llama3, factor=0.0))


@pytest.mark.parametrize("model_type", CLASSES)
def test_no_field_is_named_like_an_init_std_but_init_fields(model_type):
    """Transformers' common tests (and tools that follow them) take every config field ending in `_std` or `_range`
    for an initialisation scale and overwrite it (1e-10): only real init fields may be named so."""
    import dataclasses

    config_class = CLASSES[model_type][0]
    named = {f.name for f in dataclasses.fields(config_class) if f.name.endswith(("_std", "_range"))}
    assert named <= {"initializer_range", "embedding_init_std"}, named


def test_calibration_statistics_saved_under_their_old_name_load(tmp_path):
    """A config saved when moh_head_norm_sigma was moh_head_norm_std loads with its statistics in the new field and
    saves them under the new name."""
    sigma = [[0.5] * 4, [2.0] * 4]
    config = MoHLlamaConfig(**TINY, moh_shared_heads=1, moh_active_heads=2, moh_router="l2")
    config.save_pretrained(tmp_path)
    fields = json.loads((tmp_path / "config.json").read_text())
    fields.update(moh_router="l2_standardized", moh_head_norm_mean=[[1.0] * 4] * 2, moh_head_norm_std=sigma)
    fields.pop("moh_head_norm_sigma", None)
    (tmp_path / "config.json").write_text(json.dumps(fields))
    loaded = MoHLlamaConfig.from_pretrained(tmp_path)
    assert loaded.moh_head_norm_sigma == sigma and not hasattr(loaded, "moh_head_norm_std")
    loaded.save_pretrained(tmp_path / "again")
    saved = json.loads((tmp_path / "again" / "config.json").read_text())
    assert saved["moh_head_norm_sigma"] == sigma and "moh_head_norm_std" not in saved
