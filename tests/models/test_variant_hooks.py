"""Variants own their knowledge: the model card, the layer cost, `expert_load` and the export ask the class a
`router_type` / `linear_type` names (`router_types.block_class`, `linear_types.linear_class`) instead of naming it.
A kind registered from outside mhmoe (a class here and one table entry) reaches all of them with no other edit."""

import dataclasses

import pytest
import torch
from safetensors.torch import load_file

from mhmoe import MHMoEConfig, MHMoEForCausalLM, MoHLlamaConfig, moe_layer_cost
from mhmoe.evaluation.analysis import expert_load
from mhmoe.hub.cards import architecture_rows, parity_rows
from mhmoe.hub.export import export_pretrained
from mhmoe.models.mhmoe.linear_types import LINEAR_TYPES, Linear, linear_class
from mhmoe.models.mhmoe.matching import conventions_fields
from mhmoe.models.mhmoe.parity import MoELayerCost
from mhmoe.models.mhmoe.router_types import ROUTER_TYPES, block_class
from mhmoe.models.mhmoe.sparse_moe import MHMoESparseMoeBlock

BLOCK_HOOKS = ("config_problems", "reads_cache", "card_rows", "layer_cost", "no_expert_selection")
LINEAR_HOOKS = (
    "linear",
    "experts",
    "config_problems",
    "card_rows",
    "export_transform",
    "training_refusal",
    "official_fields",
)
COST = dict(params=7, macs_per_token=5, expert_params=4, head_merge_params=2, router_params=1, shared_expert_params=0)


class DummyBlock(MHMoESparseMoeBlock):
    """A block kind of its own: top-k routing underneath, its own answers to the rest of mhmoe."""

    no_expert_selection = "a dummy model selects no experts"

    @classmethod
    def card_rows(cls, config):
        return [("dummy routing", f"{config.num_experts} experts, dummy")]

    @classmethod
    def layer_cost(cls, config):
        return dict(COST)


class DummyLinear(Linear):
    """A linear kind of its own: full precision underneath; the export zeroes the output embedding."""

    official_fields = dict(moe_layer_bias=False)

    @staticmethod
    def card_rows(config):
        return [("dummy linear", "full precision, dummy")]

    @staticmethod
    def export_transform(config):
        def zero_lm_head(model):
            with torch.no_grad():
                model.lm_head.weight.zero_()
            return model

        return zero_lm_head

    @staticmethod
    def training_refusal(config):
        return "dummy weights do not train"


def tiny(**kw):
    base = dict(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=16,
        moe_heads=2,
        tie_word_embeddings=False,
    )
    return MHMoEConfig(**{**base, **kw})


@pytest.fixture
def dummies(monkeypatch):
    monkeypatch.setitem(ROUTER_TYPES, "dummy", DummyBlock)
    monkeypatch.setitem(LINEAR_TYPES, "dummy", DummyLinear)


@pytest.mark.parametrize("name", sorted(ROUTER_TYPES))
def test_every_block_kind_answers_every_hook(name):
    assert all(hasattr(ROUTER_TYPES[name], hook) for hook in BLOCK_HOOKS)


@pytest.mark.parametrize("name", sorted(LINEAR_TYPES))
def test_every_linear_kind_answers_every_hook(name):
    assert all(hasattr(LINEAR_TYPES[name], hook) for hook in LINEAR_HOOKS)


def test_configs_without_the_fields_get_the_plain_kinds():
    """Another model's config (MoH-LLaMA's, or a dict without the field) is asked as the top-k block / `Linear`."""
    moh_llama = MoHLlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4
    )
    assert block_class(moh_llama) is MHMoESparseMoeBlock and linear_class(moh_llama) is Linear
    assert linear_class({}) is Linear and linear_class({"linear_type": "bitnet_b158"}) is LINEAR_TYPES["bitnet_b158"]


def test_a_registered_block_kind_reaches_card_cost_and_expert_load(dummies):
    config = tiny(router_type="dummy")
    assert block_class(config) is DummyBlock
    assert ("dummy routing", "4 experts, dummy") in architecture_rows(config)
    assert moe_layer_cost(config) == MoELayerCost(**COST)
    assert parity_rows(config)[1] == ("activated multiply-adds per token", "5")
    model = MHMoEForCausalLM(config).eval()
    with pytest.raises(ValueError, match="expert selections; a dummy model selects no experts"):
        expert_load(model, [dict(input_ids=torch.tensor([[1, 2, 3]]))])


def test_a_registered_linear_kind_reaches_card_conventions_and_export(dummies, tmp_path):
    config = tiny(linear_type="dummy")
    assert ("dummy linear", "full precision, dummy") in architecture_rows(config)
    assert conventions_fields("official", config)["moe_layer_bias"] is False  # its own, over OFFICIAL_ROUTING's
    assert conventions_fields("official", config.to_dict())["moe_layer_bias"] is False
    torch.manual_seed(0)
    model = MHMoEForCausalLM(config).eval()
    export_pretrained(model, tmp_path / "out")
    weights = load_file(tmp_path / "out" / "model.safetensors")
    assert not weights["lm_head.weight"].any()  # the kind's transform ran before the weights were written
    assert weights["model.embed_tokens.weight"].any()
    assert "dummy linear" in (tmp_path / "out" / "README.md").read_text()
    pytest.importorskip("peft")
    from mhmoe.training.peft import lora_config

    with pytest.raises(ValueError, match="dummy weights do not train"):
        lora_config(model)


def test_the_registered_kinds_answer_as_before():
    """Lory's and BitNet's answers, which the card, parity, expert_load, matching and export used to spell out."""
    lory = tiny(router_type="lory", capacity_factor=None, lory_segment_length=4, lory_expert_pool="per_head")
    assert block_class(lory).card_rows(lory) == [
        (
            "Lory routing",
            "all experts merged into one per 4-token segment, routed on the previous segment; one pool per head "
            "(MH-Lory v2)",
        )
    ]
    cost = dataclasses.asdict(moe_layer_cost(lory))
    assert cost["merge_macs_per_segment"] > 0 and cost["router_params"] == 2 * 4 * 16  # h pools of E·(d/h)
    assert "Lory model" in block_class(lory).no_expert_selection
    assert block_class(tiny()).no_expert_selection is None and block_class(tiny()).card_rows(tiny()) == []
    bitnet = tiny(linear_type="bitnet_b158")
    kind = linear_class(bitnet)
    assert kind.card_rows(bitnet) == [
        ("BitNet b1.58", "every decoder projection ternary, 8-bit activations; stored as latent fp weights")
    ]
    assert kind.official_fields["bitnet_quantized_layers"] == "official"
    assert kind.export_transform(bitnet) is not None
    assert kind.export_transform(tiny(linear_type="bitnet_b158", bitnet_packed=True)) is None
    assert linear_class(tiny()).export_transform(tiny()) is None and linear_class(tiny()).official_fields == {}
    assert kind.training_refusal(bitnet) is None
    assert "packed export" in kind.training_refusal(tiny(linear_type="bitnet_b158", bitnet_packed=True))
