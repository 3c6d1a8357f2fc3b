"""FLOPs per token (training/throughput.py) against counts by hand, written out weight matrix by weight matrix, for a
dense Llama, an SMoE, an MH-MoE and a MoH config; MFU and the peak table."""

import pytest
import torch
from transformers import LlamaConfig

from mhmoe import MHMoEConfig
from mhmoe.training.throughput import Throughput, flops_per_token, peak_flops

S = 64  # sequence length: a token sees (S + 1) / 2 keys on average


def test_dense_llama_by_hand():
    config = LlamaConfig(
        vocab_size=1000, hidden_size=64, intermediate_size=160, num_hidden_layers=3, num_attention_heads=8,
        num_key_value_heads=2,
    )  # fmt: skip
    d, hd = 64, 8
    q, k, v, o = d * 8 * hd, d * 2 * hd, d * 2 * hd, 8 * hd * d
    mlp = d * 160 + d * 160 + 160 * d  # gate, up, down
    core = 8 * hd * (S + 1) / 2 * 2  # QK^T and PV
    macs = 3 * (q + k + v + o + mlp + core) + d * 1000
    assert flops_per_token(config, S) == pytest.approx(6 * macs)


def _moe(**fields):
    base = dict(
        vocab_size=500, hidden_size=96, intermediate_size=200, num_hidden_layers=2, num_attention_heads=4,
        decoder_sparse_step=1, moe_intermediate_size=64,
    )  # fmt: skip
    return MHMoEConfig(**{**base, **fields})


def test_smoe_by_hand():
    config = _moe(num_experts=8, num_experts_per_tok=2, moe_heads=1)
    d = 96
    attention = 4 * d * d + 4 * 24 * (S + 1) / 2 * 2
    moe = d * 8 + 2 * 3 * d * 64  # router over 8 experts, 2 SwiGLU experts of width 64 per token
    assert flops_per_token(config, S) == pytest.approx(6 * (2 * (attention + moe) + d * 500))


def test_mh_moe_by_hand():
    """h = 3: head and merge layers d×d, each of 3 sub-tokens of width 32 routed over 12 experts to its top 3."""
    config = _moe(num_experts=12, num_experts_per_tok=3, moe_heads=3, shared_expert_intermediate_size=40)
    d, w = 96, 32
    attention = 4 * d * d + 4 * 24 * (S + 1) / 2 * 2
    moe = 2 * d * d + 3 * (w * 12) + 3 * 3 * (3 * w * 64) + 3 * d * 40  # head+merge, routers, experts, shared
    assert flops_per_token(config, S) == pytest.approx(6 * (2 * (attention + moe) + d * 500))


def test_dense_layers_of_a_sparse_step_config():
    config = _moe(num_experts=4, num_experts_per_tok=1, moe_heads=1, decoder_sparse_step=2)
    d = 96
    attention = 4 * d * d + 4 * 24 * (S + 1) / 2 * 2
    dense, moe = 3 * d * 200, d * 4 + 3 * d * 64
    assert flops_per_token(config, S) == pytest.approx(6 * (2 * attention + dense + moe + d * 500))


def test_moh_counts_the_active_heads_core_and_o_proj():
    """8 heads, 2 shared + 3 routed active: the core and o_proj count 5 heads; q, k, v every head."""
    config = _moe(num_experts=4, num_experts_per_tok=1, moe_heads=1, num_attention_heads=8)
    moh = _moe(num_experts=4, num_experts_per_tok=1, moe_heads=1, num_attention_heads=8, moh_shared_heads=2,
               moh_active_heads=3)  # fmt: skip
    d, hd = 96, 12
    saved_per_layer = 3 * hd * d + 3 * hd * (S + 1) / 2 * 2  # 3 inactive heads' o_proj columns and core
    assert flops_per_token(config, S) - flops_per_token(moh, S) == pytest.approx(6 * 2 * saved_per_layer)


def test_mfu_and_peaks():
    assert peak_flops(torch.device("cpu"), "no") is None
    assert peak_flops(torch.device("cpu"), "bf16", peak_tflops=2.0) == 2e12
    fields = Throughput(flops_per_token=1e9, peak=1e12, processes=2).fields(tokens=4000, seconds=2.0)
    assert fields == {"tokens_per_second": 2000.0, "mfu": pytest.approx(2000 * 1e9 / 2e12)}
    assert "mfu" not in Throughput(1e9, None, 1).fields(10, 1.0)
