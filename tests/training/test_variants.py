"""mhmoe-train with the issue-14 variants: a 1-bit (BitNet b1.58) MH-MoE and an MH-Lory model with Lory's
similarity-based batching train, evaluate and save a model that reloads to the logged validation loss."""

import json

import pytest
import torch
import torch.nn.functional as F
from transformers import AutoModelForCausalLM, AutoTokenizer

import mhmoe.training.prepare as training_setup
from mhmoe.training import TrainArguments
from mhmoe.training import train as _train
from mhmoe.training.data import read_files, tokenize_and_pack
from tests.fixtures.training import CONFIG, fresh_accelerate_state


@pytest.mark.parametrize(
    "overrides,similarity",
    [
        ({"linear_type": "bitnet_b158"}, False),
        ({"router_type": "lory", "lory_segment_length": 4, "lory_expert_pool": "per_head"}, True),
    ],
)
def test_train_variant(tmp_path, corpus, monkeypatch, overrides, similarity):
    config_json = tmp_path / "config.json"
    config_json.write_text(json.dumps({**CONFIG, **overrides}))
    calls = []
    order = training_setup.order_by_similarity
    monkeypatch.setattr(training_setup, "order_by_similarity", lambda docs: calls.append(len(docs)) or order(docs))
    out = tmp_path / "run"
    fresh_accelerate_state()
    result = _train(
        TrainArguments(
            model_name_or_path=str(config_json),
            output_dir=str(out),
            train_file=[corpus["train"]],
            validation_file=[corpus["val"]],
            tokenizer_vocab_size=300,
            block_size=16,
            per_device_train_batch_size=2,
            max_steps=3,
            learning_rate=3e-3,
            disable_tqdm=True,
            plot=False,
            seed=0,
            similarity_batching=similarity,
        )
    )
    assert calls == ([10] if similarity else [])  # the training documents are reordered before packing
    model = AutoModelForCausalLM.from_pretrained(out).eval()
    assert all(getattr(model.config, k) == v for k, v in overrides.items())
    blocks = tokenize_and_pack(read_files([corpus["val"]]), AutoTokenizer.from_pretrained(out), 16)
    with torch.no_grad():
        logits = model(blocks).logits
    nll = F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), blocks[:, 1:].reshape(-1))
    assert nll.item() == pytest.approx(result.final_eval["eval_loss"], rel=1e-4)
