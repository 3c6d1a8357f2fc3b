"""Shared fixtures for the training / PEFT tests: a real-text corpus, a tiny BPE tokenizer, a tiny MHMoE checkpoint.

Sizes are tiny on purpose (hidden 32, 2 layers: one dense, one MH-MoE with 2 heads and 4 experts; 16-token blocks).
"""

import json

import pytest
import torch

CONFIG = dict(
    model_type="mhmoe", vocab_size=320, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32, decoder_sparse_step=2, num_experts=4,
    num_experts_per_tok=2, moe_intermediate_size=16, moe_heads=2, router_aux_loss_coef=0.05, router_z_loss_coef=0.01,
)  # fmt: skip


def _topics() -> list[str]:
    import pydoc_data.topics

    return [pydoc_data.topics.topics[key] for key in sorted(pydoc_data.topics.topics)]


def write_jsonl(path, texts):
    with open(path, "w") as f:
        for text in texts:
            f.write(json.dumps({"text": text}) + "\n")
    return str(path)


def fresh_accelerate_state():
    """Each in-process `train()` builds its own Accelerator; Accelerate's state is a process-wide singleton."""
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()


@pytest.fixture(autouse=True)
def _fresh_accelerate_state():
    fresh_accelerate_state()
    yield
    fresh_accelerate_state()


@pytest.fixture(scope="session")
def corpus(tmp_path_factory):
    """Small real English/Python-doc text: train.jsonl (~6 KB), val.jsonl (~2 KB), tiny.jsonl (~1 KB), train.txt."""
    root = tmp_path_factory.mktemp("corpus")
    texts = [t[:600] for t in _topics()[:40]]
    paths = {
        "train": write_jsonl(root / "train.jsonl", texts[:10]),
        "val": write_jsonl(root / "val.jsonl", texts[30:33]),
        "tiny": write_jsonl(root / "tiny.jsonl", [texts[12], texts[13][:200]]),
        "tokenizer_text": write_jsonl(root / "tok.jsonl", texts),
    }
    (root / "train.txt").write_text("\n".join(texts[:10]))
    paths["txt"] = str(root / "train.txt")
    paths["root"] = root
    return paths


@pytest.fixture(scope="session")
def config_json(tmp_path_factory):
    path = tmp_path_factory.mktemp("config") / "config.json"
    path.write_text(json.dumps(CONFIG))
    return str(path)


@pytest.fixture(scope="session")
def tokenizer_dir(tmp_path_factory, corpus):
    from mhmoe.data import read_files, train_tokenizer

    directory = tmp_path_factory.mktemp("tokenizer")
    train_tokenizer(read_files([corpus["tokenizer_text"]]), 300, CONFIG["max_position_embeddings"]).save_pretrained(
        directory
    )
    return str(directory)


@pytest.fixture(scope="session")
def checkpoint_dir(tmp_path_factory, tokenizer_dir):
    """A saved tiny MHMoE model (random init) with the tokenizer: the base for fine-tuning and LoRA tests."""
    from transformers import AutoTokenizer

    from mhmoe import MHMoEConfig, MHMoEForCausalLM

    directory = tmp_path_factory.mktemp("checkpoint")
    fields = {k: v for k, v in CONFIG.items() if k != "model_type"}
    torch.manual_seed(0)
    MHMoEForCausalLM(MHMoEConfig(**fields)).save_pretrained(directory)
    AutoTokenizer.from_pretrained(tokenizer_dir).save_pretrained(directory)
    return str(directory)


MOH_CONFIG = dict(model_type="moh_llama", vocab_size=320, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                  num_attention_heads=4, max_position_embeddings=32)  # fmt: skip


@pytest.fixture
def moh_llama_type():
    """model_type "moh_llama": the real one when mhmoe registers it, else a Llama stand-in registered for this test
    only (a LlamaConfig subclass, Llama's modules and state dict, no router outputs)."""
    from transformers import AutoConfig, AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    if "moh_llama" in CONFIG_MAPPING:
        yield "real"
        return

    class StandInMoHLlamaConfig(LlamaConfig):
        model_type = "moh_llama"

    class StandInMoHLlamaForCausalLM(LlamaForCausalLM):
        config_class = StandInMoHLlamaConfig

    AutoConfig.register("moh_llama", StandInMoHLlamaConfig)
    AutoModelForCausalLM.register(StandInMoHLlamaConfig, StandInMoHLlamaForCausalLM)
    try:
        yield "stand-in"
    finally:
        CONFIG_MAPPING._extra_content.pop("moh_llama", None)
        MODEL_FOR_CAUSAL_LM_MAPPING._extra_content.pop(StandInMoHLlamaConfig, None)
