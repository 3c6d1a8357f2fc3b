"""benchmarks/moh_head_sparse.py: the decoding ideal's bytes (weights read once per step, the K/V cache, and what
the head-sparse step may skip: the inactive heads' q_proj rows and o_proj columns and the unneeded K/V) against a
count by hand on a tiny Llama."""

import sys
from pathlib import Path

import pytest
from transformers import LlamaConfig, LlamaForCausalLM

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import moh_head_sparse as bench  # noqa: E402


def test_decode_bytes_count_the_weights_the_cache_and_what_the_step_skips():
    config = LlamaConfig(
        vocab_size=100, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, tie_word_embeddings=True,
    )  # fmt: skip
    model = LlamaForCausalLM(config)
    per_layer = 32 * 32 * 2 + 32 * 16 * 2 + 3 * 32 * 64 + 2 * 32  # q, o; k, v; MLP; two norms
    weights = (2 * per_layer + 32 + 100 * 32) * 4  # + final norm + the tied lm_head, fp32
    context, new_tokens = 10, 4
    kv = 2 * 2 * 2 * 8 * (context + 2.5) * 4  # K and V, 2 layers, 2 heads of 8, mean keys over the 4 steps
    assert bench.projection_weights(config) == 2 * 32 * 32
    for skipped in (2, 1, 0):  # q_proj and o_proj (fitted router), o_proj (l2), none
        total, skippable = bench.decode_bytes(model, config, context, new_tokens, 0.75, 0.5, skipped)
        assert total == pytest.approx(weights + kv)
        assert skippable == pytest.approx(kv * 0.5 + skipped * 2 * 32 * 32 * 4 * 0.25)
