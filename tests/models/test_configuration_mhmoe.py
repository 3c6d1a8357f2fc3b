import math

import pytest
from transformers import AutoModelForCausalLM, LlamaConfig, MixtralConfig

import mhmoe
from mhmoe import MHMoEConfig, MHMoEForCausalLM

TINY = dict(
    vocab_size=50,
    hidden_size=32,
    intermediate_size=48,
    num_hidden_layers=2,
    num_attention_heads=4,
    moe_heads=2,
    num_experts=4,
    num_experts_per_tok=2,
    moe_intermediate_size=16,
)


def test_defaults_resolve_head_and_merge_layers():
    assert MHMoEConfig(moe_heads=1).moe_head_layer is False
    cfg = MHMoEConfig(hidden_size=96, num_attention_heads=4, moe_heads=3)
    assert cfg.moe_head_layer is True and cfg.moe_merge_layer is True
    assert MHMoEConfig(moe_heads=2, moe_merge_layer=False).moe_merge_layer is False


@pytest.mark.parametrize(
    "fields,words",
    [
        (dict(hidden_size=64, num_attention_heads=4, moe_heads=3), "divisible by moe_heads"),
        (dict(num_experts=4, num_experts_per_tok=5), "num_experts_per_tok (5) must be between 1 and num_experts (4)"),
        (dict(num_experts_per_tok=0), "num_experts_per_tok"),
        (dict(num_attention_heads=12, num_key_value_heads=5), "multiple of num_key_value_heads"),
        (dict(decoder_sparse_step=-1), "decoder_sparse_step"),
        (dict(capacity_factor=0), "capacity_factor"),
        (dict(router_aux_loss_mode="gshard"), "router_aux_loss_mode"),
        (dict(norm_topk_prob="yes"), "norm_topk_prob must be True, False or 'always'"),
        (dict(router_aux_loss_mode="mixtral", moe_heads=2), "needs moe_heads=1"),
        (dict(shared_expert_intermediate_size=-2), "shared_expert_intermediate_size"),
        (dict(router_z_loss_coef=-1.0), "router_z_loss_coef"),
        (dict(sliding_window=0), "sliding_window"),
        (dict(moe_intermediate_size=0), "moe_intermediate_size"),
        (dict(num_attention_heads=0), "num_attention_heads must be >= 1"),
        (dict(num_key_value_heads=0), "num_key_value_heads must be >= 1"),
        (dict(hidden_size=0), "hidden_size must be >= 1"),
        (dict(head_dim=0), "head_dim must be >= 1"),
        (dict(vocab_size=0), "vocab_size must be >= 1"),
        (dict(num_hidden_layers=-1), "num_hidden_layers must be >= 1"),
        (dict(intermediate_size=0, decoder_sparse_step=2), "intermediate_size (the dense layers' MLP width)"),
        (dict(num_hidden_layers=2, decoder_sparse_step=5), "no layer would be MoE"),
        (dict(capacity_factor=math.nan), "capacity_factor must be a finite number"),
        (dict(capacity_factor=math.inf), "capacity_factor must be a finite number"),
        (dict(router_aux_loss_coef=math.nan), "router_aux_loss_coef must be a finite number"),
        (dict(moh_aux_loss_coef=math.nan), "moh_aux_loss_coef must be a finite number"),
        (dict(rms_norm_eps=-1.0), "rms_norm_eps"),
        (dict(initializer_range=-1.0), "initializer_range"),
        (dict(hidden_act="bogus"), "hidden_act 'bogus'"),
        (dict(vocab_size=50, pad_token_id=50), "pad_token_id (50) must lie in the vocabulary"),
        (dict(router_jitter_noise=2.0), "router_jitter_noise must be < 1"),
        (dict(attention_dropout=1.5), "attention_dropout is a probability"),
        (dict(top_k=1), "top_k (use num_experts_per_tok)"),
        (dict(num_local_experts=4), "num_local_experts (use num_experts)"),
    ],
)
def test_invalid_combinations_are_refused_in_words(fields, words):
    with pytest.raises(ValueError) as err:
        MHMoEConfig(**fields)
    assert words in str(err.value)


def test_dense_model_ignores_moe_fields():
    cfg = MHMoEConfig(decoder_sparse_step=0, hidden_size=64, num_attention_heads=4, moe_heads=3)
    assert not any(cfg.is_moe_layer(i) for i in range(cfg.num_hidden_layers))


def test_no_top_k_attribute_and_json_roundtrip(tmp_path):
    cfg = MHMoEConfig(hidden_size=96, num_attention_heads=4, moe_heads=3, capacity_factor=1.25)
    assert "top_k" not in cfg.to_dict()
    cfg.save_pretrained(tmp_path)
    again = MHMoEConfig.from_pretrained(tmp_path)
    assert again.to_dict() == cfg.to_dict()


def test_overrides_are_checked_and_applied_before_the_checks(tmp_path):
    """from_pretrained(..., field=value) overrides go through the same checks as the constructor, and can repair a
    combination the saved file would not allow on its own."""
    MHMoEForCausalLM(MHMoEConfig(**TINY)).save_pretrained(tmp_path)
    with pytest.raises(ValueError, match=r"num_experts_per_tok \(9\) must be between 1 and num_experts \(4\)"):
        MHMoEConfig.from_pretrained(tmp_path, num_experts_per_tok=9)
    with pytest.raises(ValueError, match="capacity_factor must be"):
        AutoModelForCausalLM.from_pretrained(tmp_path, capacity_factor=-1.0)
    model = AutoModelForCausalLM.from_pretrained(tmp_path, num_experts_per_tok=1, router_z_loss_coef=0.5)
    assert (model.config.num_experts_per_tok, model.config.router_z_loss_coef) == (1, 0.5)
    # num_experts=1 alone would be refused (k=2 > E=1); together with k=1 it is valid
    again = MHMoEConfig.from_pretrained(tmp_path, num_experts=1, num_experts_per_tok=1)
    assert (again.num_experts, again.num_experts_per_tok) == (1, 1)


def test_fields_set_after_construction_are_checked_by_the_model_and_on_save(tmp_path):
    config = MHMoEConfig(**TINY)
    config.moe_heads = 3  # 32 is not divisible by 3
    with pytest.raises(ValueError, match="divisible by moe_heads"):
        MHMoEForCausalLM(config)
    with pytest.raises(Exception, match="divisible by moe_heads"):  # Transformers wraps it in its validation error
        config.save_pretrained(tmp_path)


@pytest.mark.parametrize(
    "method, source, words",
    [
        ("from_llama_config", None, "takes a Transformers llama config"),
        ("from_llama_config", MixtralConfig(), "got MixtralConfig (model_type 'mixtral')"),
        ("from_mixtral_config", LlamaConfig(), "got LlamaConfig (model_type 'llama')"),
        ("from_mixtral_config", {"model_type": "mixtral"}, "got dict"),
    ],
)
def test_conversions_refuse_the_wrong_config_type(method, source, words):
    with pytest.raises(ValueError) as err:
        getattr(mhmoe, method)(source)
    assert words in str(err.value)
