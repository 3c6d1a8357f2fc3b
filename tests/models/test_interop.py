"""Dense MHMoE == Transformers' Llama; plain-SMoE MHMoE == Transformers' Mixtral (keys, shapes, logits, aux loss)."""

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, MixtralConfig, MixtralForCausalLM
from transformers.models.mixtral.modeling_mixtral import load_balancing_loss_func

from mhmoe import MHMoEForCausalLM, from_llama_config, from_mixtral_config

TINY = dict(
    vocab_size=97,
    hidden_size=48,
    intermediate_size=40,
    num_hidden_layers=2,
    num_attention_heads=4,
    max_position_embeddings=64,
    rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
)


def _shapes(model):
    return {k: tuple(v.shape) for k, v in model.state_dict().items()}


def _padded_batch(vocab):
    input_ids = torch.randint(0, vocab, (3, 11))
    attention_mask = torch.ones_like(input_ids)
    attention_mask[1, :4] = 0  # left padding
    attention_mask[2, :7] = 0
    return input_ids, attention_mask


@pytest.mark.parametrize("kv_heads,tied", [(4, False), (2, True)])
def test_dense_equals_llama(kv_heads, tied):
    llama_cfg = LlamaConfig(**TINY, num_key_value_heads=kv_heads, tie_word_embeddings=tied)
    llama = LlamaForCausalLM(llama_cfg).eval()
    ours = MHMoEForCausalLM(from_llama_config(llama_cfg)).eval()
    assert _shapes(ours) == _shapes(llama)
    ours.load_state_dict(llama.state_dict(), strict=True)
    input_ids, attention_mask = _padded_batch(TINY["vocab_size"])
    with torch.no_grad():
        expected = llama(input_ids, attention_mask=attention_mask).logits
        got = ours(input_ids, attention_mask=attention_mask).logits
    real = attention_mask.bool()
    torch.testing.assert_close(got[real], expected[real], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("top_k,sliding_window", [(2, None), (1, 5)])
def test_smoe_equals_mixtral(top_k, sliding_window):
    mixtral_cfg = MixtralConfig(
        **TINY,
        num_key_value_heads=2,
        num_local_experts=5,
        num_experts_per_tok=top_k,
        sliding_window=sliding_window,
        router_aux_loss_coef=0.02,
    )
    mixtral = MixtralForCausalLM(mixtral_cfg).eval()
    cfg = from_mixtral_config(mixtral_cfg)
    ours = MHMoEForCausalLM(cfg).eval()
    assert _shapes(ours) == _shapes(mixtral)
    ours.load_state_dict(mixtral.state_dict(), strict=True)
    input_ids, attention_mask = _padded_batch(TINY["vocab_size"])
    labels = input_ids.masked_fill(attention_mask == 0, -100)
    with torch.no_grad():
        expected = mixtral(input_ids, attention_mask=attention_mask, labels=labels, output_router_logits=True)
        got = ours(input_ids, attention_mask=attention_mask, labels=labels, output_router_logits=True)
    real = attention_mask.bool()
    torch.testing.assert_close(got.logits[real], expected.logits[real], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got.aux_loss, expected.aux_loss, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(got.loss, expected.loss, rtol=1e-5, atol=1e-6)
    for a, b in zip(got.router_logits, expected.router_logits, strict=True):
        torch.testing.assert_close(a[real.reshape(-1)], b[real.reshape(-1)], rtol=1e-5, atol=1e-5)


def test_mixtral_mode_loss_equals_transformers_function():
    from mhmoe.models.mhmoe.moe_losses import load_balancing_loss

    logits = tuple(torch.randn(30, 6) for _ in range(3))
    mask = (torch.rand(5, 6) > 0.3).long()
    for m in (None, mask):
        expected = load_balancing_loss_func(logits, 6, 2, m)
        got = load_balancing_loss(logits, 6, 2, m, moe_heads=1, mode="mixtral")
        torch.testing.assert_close(got, expected)


def test_from_config_helpers_keep_fields():
    llama_cfg = LlamaConfig(**TINY, num_key_value_heads=2, rms_norm_eps=1e-5, mlp_bias=True, attention_bias=True)
    cfg = from_llama_config(llama_cfg)
    assert cfg.decoder_sparse_step == 0 and cfg.mlp_bias and cfg.attention_bias
    assert (cfg.num_key_value_heads, cfg.rms_norm_eps, cfg.rope_parameters["rope_theta"]) == (2, 1e-5, 10000.0)
    llama = LlamaForCausalLM(llama_cfg)
    ours = MHMoEForCausalLM(cfg)
    assert _shapes(ours) == _shapes(llama)
