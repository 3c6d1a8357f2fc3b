"""Packing (training/packing.py): the rows' ids, labels and positions against a construction by hand, and packed
examples kept apart in the model: each example's logits in a packed row equal those of the example run alone
(MH-MoE with and without MoH, MoH-LLaMA, Transformers' Llama as the reference implementation of packed masks)."""

import pytest
import torch

from mhmoe.training.formats import Example
from mhmoe.training.packing import IGNORE, pack_examples, pack_text


def _examples():
    return [
        Example([5, 6, 7, 8], [False, False, True, True]),
        Example([9, 10, 11], [False, True, True]),
        Example([12, 13, 14, 15, 16, 17], [False, False, False, True, True, True]),
        Example(list(range(20, 32)), [False] * 6 + [True] * 6),  # longer than the block: cut to 10
        Example([40, 41], [True, False]),  # nothing left to predict after its first token: dropped
    ]


def test_packed_rows_by_hand():
    blocks, stats = pack_examples(_examples(), block_size=10, pad_id=0, packing=True)
    assert stats == {"truncated": 1, "dropped": 1}
    assert blocks.input_ids.tolist() == [
        [5, 6, 7, 8, 9, 10, 11, 0, 0, 0],
        [12, 13, 14, 15, 16, 17, 0, 0, 0, 0],
        list(range(20, 30)),
    ]
    assert blocks.position_ids.tolist() == [
        [0, 1, 2, 3, 0, 1, 2, 0, 1, 2],
        [0, 1, 2, 3, 4, 5, 0, 1, 2, 3],
        list(range(10)),
    ]
    assert blocks.labels.tolist() == [
        [IGNORE, IGNORE, 7, 8, IGNORE, 10, 11, IGNORE, IGNORE, IGNORE],
        [IGNORE, IGNORE, IGNORE, 15, 16, 17] + [IGNORE] * 4,
        [IGNORE] * 6 + [26, 27, 28, 29],
    ]
    assert blocks.lengths.tolist() == [7, 6, 10]
    assert blocks.real_tokens(torch.tensor([0, 2])) == 17
    assert int((blocks.labels != IGNORE).sum()) == 4 + 3 + 4


def test_unpacked_rows_are_cut_to_the_longest_in_the_batch():
    blocks, _ = pack_examples(_examples(), block_size=10, pad_id=0, packing=False)
    assert len(blocks) == 4 and blocks.ragged
    batch = blocks.batch(torch.tensor([0, 1]))
    assert batch["input_ids"].tolist() == [[5, 6, 7, 8], [9, 10, 11, 0]]
    assert batch["labels"].tolist() == [[IGNORE, IGNORE, 7, 8], [IGNORE, 10, 11, IGNORE]]
    assert "position_ids" not in batch  # one example per row, right-padded: plain positions


def test_text_rows_are_the_concatenation_cut_into_blocks():
    blocks = pack_text([Example([1, 2, 3], [True] * 3), Example([4, 5, 6, 7, 8], [True] * 5)], block_size=3)
    assert blocks.input_ids.tolist() == [[1, 2, 3], [4, 5, 6]]
    assert blocks.labels is None and blocks.position_ids is None
    batch = blocks.batch(torch.tensor([1]))
    assert torch.equal(batch["labels"], batch["input_ids"])


def _models():
    from transformers import LlamaConfig, LlamaForCausalLM

    from mhmoe import MHMoEConfig, MHMoEForCausalLM
    from mhmoe.models.moh_llama import MoHLlamaConfig, MoHLlamaForCausalLM

    small = dict(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4)
    moe = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16, moe_heads=2, decoder_sparse_step=1)
    yield "llama", LlamaForCausalLM(LlamaConfig(**small, num_key_value_heads=2))
    yield "mhmoe h=2", MHMoEForCausalLM(MHMoEConfig(**small, **moe, num_key_value_heads=2))
    yield "mhmoe h=2 + MoH", MHMoEForCausalLM(MHMoEConfig(**small, **moe, moh_shared_heads=1, moh_active_heads=2))
    yield "moh_llama", MoHLlamaForCausalLM(MoHLlamaConfig(**small, moh_shared_heads=2, moh_active_heads=1))


@pytest.mark.parametrize("name", ["llama", "mhmoe h=2", "mhmoe h=2 + MoH", "moh_llama"])
def test_packed_examples_see_only_themselves(name):
    torch.manual_seed(0)
    model = dict(_models())[name].eval()
    examples = [Example(torch.randint(1, 64, (n,)).tolist(), [True] * n) for n in (5, 7, 3)]
    blocks, _ = pack_examples(examples, block_size=16, pad_id=0, packing=True)
    assert len(blocks) == 1
    batch = blocks.batch(torch.tensor([0]))
    with torch.no_grad():
        packed = model(input_ids=batch["input_ids"], position_ids=batch["position_ids"], use_cache=False).logits[0]
        start = 0
        for example in examples:
            alone = model(input_ids=torch.tensor([example.input_ids]), use_cache=False).logits[0]
            torch.testing.assert_close(packed[start : start + len(example.input_ids)], alone, rtol=1e-4, atol=1e-5)
            start += len(example.input_ids)
