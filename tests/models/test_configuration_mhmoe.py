import pytest

from mhmoe import MHMoEConfig


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
        (dict(router_aux_loss_mode="mixtral", moe_heads=2), "needs moe_heads=1"),
        (dict(shared_expert_intermediate_size=-2), "shared_expert_intermediate_size"),
        (dict(router_z_loss_coef=-1.0), "router_z_loss_coef"),
        (dict(sliding_window=0), "sliding_window"),
        (dict(moe_intermediate_size=0), "moe_intermediate_size"),
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
