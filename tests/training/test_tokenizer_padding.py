"""Tokenizers made by `mhmoe.training.data.train_tokenizer` (and so by mhmoe-train and the demo) pad, on the left:
Trainer's `DataCollatorForLanguageModeling` and batched generation work without setting a pad token or side first."""

import pytest
import torch

from mhmoe.training.data import read_files, train_tokenizer


@pytest.fixture(scope="module")
def tokenizer(corpus):
    return train_tokenizer(read_files([corpus["tokenizer_text"]]), 300, 64)


def test_pad_token_is_unk_and_matches_the_demo_config(tokenizer, tmp_path):
    from transformers import AutoTokenizer

    from mhmoe.demo import demo_config

    assert tokenizer.pad_token == "<unk>" and tokenizer.pad_token_id == 0
    assert tokenizer.pad_token_id != tokenizer.eos_token_id  # the collator masks pads out of the labels
    assert demo_config("quick", 300, 64).pad_token_id == tokenizer.pad_token_id
    tokenizer.save_pretrained(tmp_path)
    assert AutoTokenizer.from_pretrained(tmp_path).pad_token_id == 0


def test_data_collator_for_language_modeling(tokenizer):
    from transformers import DataCollatorForLanguageModeling

    texts = ["The if statement is used", "for conditional execution of code in Python programs"]
    features = [tokenizer(text + tokenizer.eos_token) for text in texts]
    lengths = [len(f["input_ids"]) for f in features]
    assert lengths[0] != lengths[1]
    batch = DataCollatorForLanguageModeling(tokenizer, mlm=False)(features)
    assert batch["input_ids"].shape == (2, max(lengths))
    short = lengths.index(min(lengths))
    assert batch["attention_mask"][short].sum() == min(lengths)
    real = batch["attention_mask"].bool()
    assert (batch["labels"][~real] == -100).all() and (batch["labels"][real] == batch["input_ids"][real]).all()
    assert (batch["labels"] == tokenizer.eos_token_id).sum() == 2  # EOS stays a target


def test_batched_generation_matches_one_by_one(tokenizer):
    from mhmoe import MHMoEConfig, MHMoEForCausalLM

    torch.manual_seed(0)
    config = MHMoEConfig(
        vocab_size=300,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_experts=4,
        moe_intermediate_size=16,
        moe_heads=2,
        max_position_embeddings=64,
        pad_token_id=tokenizer.pad_token_id,
    )
    model = MHMoEForCausalLM(config).eval()
    assert tokenizer.padding_side == "left"  # as saved: batched generate pads in front of the prompts, without warning
    prompts = ['The "if" statement', "Assignment statements are used to bind names"]
    batch = tokenizer(prompts, return_tensors="pt", padding=True)
    with torch.no_grad():
        together = model.generate(**batch, max_new_tokens=6, do_sample=False)
        for row, prompt in enumerate(prompts):
            alone = model.generate(**tokenizer(prompt, return_tensors="pt"), max_new_tokens=6, do_sample=False)
            assert together[row, -6:].tolist() == alone[0, -6:].tolist()


def test_mhmoe_train_saves_a_tokenizer_with_a_pad_token(tmp_path, corpus, config_json):
    from transformers import AutoTokenizer

    from tests.training.test_loop import _args, train

    out = tmp_path / "run"
    train(
        _args(out, model_name_or_path=config_json, train_file=[corpus["train"]], tokenizer_vocab_size=300, max_steps=1)
    )
    assert AutoTokenizer.from_pretrained(out).pad_token_id == 0
