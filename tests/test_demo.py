"""The end-to-end demo in its --quick configuration (seconds on CPU), and its building blocks."""

import json

import pytest
import torch

from mhmoe import MHMoEForCausalLM, demo


@pytest.fixture(scope="module")
def corpus():
    return demo.load_corpus()


def test_corpus_split_is_held_out(corpus):
    train, valid = corpus
    assert len(train) > 5 * len(valid) > 0
    assert not set(train) & set(valid)
    assert sum(map(len, train)) + sum(map(len, valid)) > 400_000


def test_tokenizer_is_lossless_and_packs_documents(corpus):
    train, valid = corpus
    tokenizer = demo.train_tokenizer(train, vocab_size=512, model_max_length=64)
    assert len(tokenizer) == 512 and tokenizer.model_max_length == 64
    assert (tokenizer.pad_token_id, tokenizer.bos_token_id, tokenizer.eos_token_id) == (0, 1, 2)
    text = valid[0][:2000]  # unseen text, including non-ASCII bytes round-trips through byte-level BPE
    ids = tokenizer(text + " é→", verbose=False)["input_ids"]
    assert ids[0] == tokenizer.bos_token_id
    assert tokenizer.decode(ids, skip_special_tokens=True) == text + " é→"
    blocks = demo.pack(tokenizer, valid, block_size=64)
    assert blocks.dtype == torch.long and blocks.shape[1] == 64
    assert (blocks == tokenizer.eos_token_id).sum() >= len(valid) - 1  # every document ends with </s>


def test_quick_demo_end_to_end(tmp_path, capsys):
    out_dir = tmp_path / "demo"
    result = demo.main(["--quick", "--steps", "40", "--output_dir", str(out_dir)])

    assert result["ppl_after"] < 0.6 * result["ppl_before"], result
    assert result["losses"][-1] < result["losses"][0] - 0.5
    assert result["max_logit_diff"] < 1e-5  # the Auto-reloaded model is the trained one
    assert result["sample"].startswith(demo.PROMPT) and len(result["sample"]) > len(demo.PROMPT)
    assert torch.isclose(result["expert_load"].sum(), torch.tensor(1.0))

    assert "model.safetensors" in result["files"] and not any(f.endswith(".bin") for f in result["files"])
    config = json.loads((out_dir / "config.json").read_text())
    assert config["model_type"] == "mhmoe" and config["moe_heads"] == 2 and config["output_router_logits"] is True
    printed = capsys.readouterr().out
    assert "held-out perplexity before training" in printed and "greedy sample" in printed


def test_reloaded_model_generates_like_the_trained_one(tmp_path, corpus):
    train, _ = corpus
    torch.manual_seed(0)
    tokenizer = demo.train_tokenizer(train[:20], vocab_size=300, model_max_length=32)
    model = demo.build_model(tokenizer, block_size=32, size="quick").eval()
    reloaded, reloaded_tokenizer = demo.save_and_reload(model, tokenizer, tmp_path)
    assert isinstance(reloaded, MHMoEForCausalLM)
    assert demo.generate_sample(model, tokenizer, max_new_tokens=8) == demo.generate_sample(
        reloaded, reloaded_tokenizer, max_new_tokens=8
    )
