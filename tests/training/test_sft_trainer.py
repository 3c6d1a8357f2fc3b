"""TRL's SFTTrainer through mhmoe.training.sft_trainer (its default configuration: the fused LM head): the logged loss
of the first step equals the loss mhmoe's own forward gives on the same batch (LM + weighted router losses), for
MH-MoE h=2 and h=3 with and without MoH and for MoH-LLaMA; plain TRL on MH-MoE fails inside Mixtral's loss."""

import copy
import json

import datasets
import pytest
import torch
from transformers import AutoTokenizer
from trl import SFTConfig
from trl import SFTTrainer as PlainSFTTrainer

from mhmoe import MHMoEConfig, MHMoEForCausalLM
from mhmoe.models.moh_llama import MoHLlamaConfig, MoHLlamaForCausalLM
from mhmoe.training.sft_trainer import SFTTrainer
from tests.fixtures.training import chat_records

SMALL = dict(vocab_size=320, hidden_size=48, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4)
MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16, decoder_sparse_step=1,
           router_aux_loss_coef=0.05, router_z_loss_coef=0.01, output_router_logits=True)  # fmt: skip
MOH = dict(
    moh_shared_heads=1, moh_active_heads=2, moh_aux_loss_coef=0.1, moh_router="learned", moh_straight_through=False
)


def _model(name):
    torch.manual_seed(0)
    if name == "moh_llama":
        return MoHLlamaForCausalLM(
            MoHLlamaConfig(**SMALL, moh_shared_heads=2, moh_active_heads=1, moh_aux_loss_coef=0.1)
        )
    heads = int(name[len("mhmoe h=")])
    return MHMoEForCausalLM(MHMoEConfig(**SMALL, **MOE, moe_heads=heads, **(MOH if "MoH" in name else {})))


@pytest.fixture(scope="module")
def chat_dataset(tmp_path_factory):
    path = tmp_path_factory.mktemp("trl") / "chat.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in chat_records(8)))
    return datasets.load_dataset("json", data_files=str(path), split="train")


def _config(tmp_path):
    return SFTConfig(
        output_dir=str(tmp_path), max_steps=1, per_device_train_batch_size=4, logging_steps=1, report_to=[],
        use_cpu=True, max_length=128, save_strategy="no", learning_rate=1e-3, seed=0, disable_tqdm=True,
    )  # fmt: skip


class Recording(SFTTrainer):
    """Keeps the first batch it computes the loss on."""

    batches: list = []

    def compute_loss(self, model, inputs, *args, **kwargs):
        self.batches.append({k: v.clone() for k, v in inputs.items() if torch.is_tensor(v)})
        return super().compute_loss(model, inputs, *args, **kwargs)


@pytest.mark.parametrize("name", ["mhmoe h=2", "mhmoe h=3", "mhmoe h=2 + MoH", "mhmoe h=3 + MoH", "moh_llama"])
def test_logged_loss_is_lm_plus_our_aux(tmp_path, chat_tokenizer_dir, chat_dataset, name):
    model = _model(name)
    reference = copy.deepcopy(model).train()
    tokenizer = AutoTokenizer.from_pretrained(chat_tokenizer_dir)
    Recording.batches = []
    trainer = Recording(model=model, args=_config(tmp_path), train_dataset=chat_dataset, processing_class=tokenizer)
    trainer.train()
    (logged,) = [r for r in trainer.state.log_history if "loss" in r]
    batch = Recording.batches[0]
    inputs = {k: batch[k] for k in ("input_ids", "attention_mask", "labels") if k in batch}
    ours = reference(**inputs, output_router_logits=True, use_cache=False)
    aux_names = [k for k in ("aux_loss", "z_loss", "moh_aux_loss") if ours.get(k) is not None]
    assert aux_names == (
        ["moh_aux_loss"]
        if name == "moh_llama"
        else ["aux_loss", "z_loss"] + (["moh_aux_loss"] if "MoH" in name else [])
    )
    aux = sum(float(ours[k]) for k in aux_names)
    assert aux > 0
    assert float(logged["loss"]) == pytest.approx(float(ours.loss), rel=1e-5, abs=1e-5)  # LM + weighted aux
    for k in aux_names:
        assert float(logged[k]) == pytest.approx(float(ours[k]), rel=1e-5)
    assert model.config.get_text_config().output_router_logits == (name != "moh_llama")  # restored after training


def test_plain_trl_fails_on_mh_moe_inside_mixtrals_loss(tmp_path, chat_tokenizer_dir, chat_dataset):
    """Why the subclass exists: TRL reads MH-MoE's per-sub-token router logits against the (B, T) mask."""
    tokenizer = AutoTokenizer.from_pretrained(chat_tokenizer_dir)
    trainer = PlainSFTTrainer(
        model=_model("mhmoe h=2"), args=_config(tmp_path), train_dataset=chat_dataset, processing_class=tokenizer
    )
    with pytest.raises(RuntimeError, match="index"):
        trainer.train()
