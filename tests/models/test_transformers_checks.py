"""Two of Transformers' model checks, rewritten for mhmoe's model types (Transformers' test files are not in its wheel):
the TP plan names only modules the config's model has (after `test_tp_plan_matches_params`), and the causal LM's
`forward` return annotation is an output class with `router_logits` that MoE models fill (after
`test_moe_models_record_router_logits`). Plus LlamaConfig's head check and misspelt config keys named in a warning."""

import pytest
import torch
from transformers.distributed.parallel_utils import _get_parameter_plan
from transformers.modeling_outputs import ModelOutput

from mhmoe import MHMoEConfig, MHMoEForCausalLM, MoHLlamaConfig, MoHLlamaForCausalLM
from mhmoe.models.mhmoe.modeling_mhmoe import MHMoEModel

TINY = dict(
    vocab_size=64,
    hidden_size=32,
    intermediate_size=48,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=32,
)
MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16)
CONFIGS = {
    "dense": (MHMoEConfig, dict(TINY, decoder_sparse_step=0)),
    "smoe, every layer MoE": (MHMoEConfig, dict(TINY, **MOE, decoder_sparse_step=1)),
    "mh-moe, every layer MoE": (MHMoEConfig, dict(TINY, **MOE, moe_heads=2)),
    "mh-moe, no merge layer": (MHMoEConfig, dict(TINY, **MOE, moe_heads=2, moe_merge_layer=False)),
    "dense + moe, shared expert": (
        MHMoEConfig,
        dict(TINY, **MOE, decoder_sparse_step=2, shared_expert_intermediate_size=8),
    ),
    "moh learned": (MHMoEConfig, dict(TINY, **MOE, moh_shared_heads=1, moh_active_heads=2, moh_router="learned")),
    "moh l2, dense": (
        MHMoEConfig,
        dict(TINY, decoder_sparse_step=0, moh_shared_heads=1, moh_active_heads=2, moh_router="l2"),
    ),
    "mh-lory": (MHMoEConfig, dict(TINY, **MOE, moe_heads=2, router_type="lory", lory_segment_length=4)),
    "moh_llama without moh": (MoHLlamaConfig, dict(TINY)),
    "moh_llama": (MoHLlamaConfig, dict(TINY, moh_shared_heads=1, moh_active_heads=2)),
}
MODEL_CLASSES = {MHMoEConfig: MHMoEForCausalLM, MoHLlamaConfig: MoHLlamaForCausalLM}


@pytest.mark.parametrize("name", list(CONFIGS))
def test_tp_plan_matches_params(name):
    """Every rule of the model's TP and EP plans applies to some parameter or module of that model (matched by
    Transformers' own rule lookup), and no rule of the class's full plan that applies is left out."""
    config_class, fields = CONFIGS[name]
    config = config_class(**fields)
    model = MODEL_CLASSES[config_class](config)
    params = [n for n, _ in model.named_parameters()]
    modules = [n for n, _ in model.named_modules() if n]
    assert model.tp_plan, "the plan must not be empty"
    for plan_name, plan in (("tp", model.tp_plan), ("ep", model.ep_plan)):
        unused = [
            rule
            for rule in plan
            if not any(_get_parameter_plan(p, {rule: "x"}, is_weight=True) for p in params)
            and not any(_get_parameter_plan(m, {rule: "x"}, is_weight=False) for m in modules)
        ]
        assert not unused, f"{plan_name} plan rules naming nothing in {name}: {unused}"
    for plan_name, full, got in (
        ("tp", config_class.base_model_tp_plan, config.base_model_tp_plan),
        ("ep", config_class.base_model_ep_plan or {}, config.base_model_ep_plan or {}),
    ):
        applying = {
            rule for rule in full if any(_get_parameter_plan(p.removeprefix("model."), {rule: "x"}) for p in params)
        }
        assert applying <= set(got), f"{plan_name} rules dropped although {name} has their modules"


def test_tp_plan_class_access_is_the_full_plan():
    full = MHMoEConfig.base_model_tp_plan
    assert {
        "layers.*.mlp.gate_proj",
        "layers.*.self_attn.head_router",
        "layers.*.mlp.shared_expert.up_proj",
        "layers.*.mlp.head_proj",
        "layers.*.mlp.experts",
    } <= set(full)
    every_layer_moe = MHMoEConfig(**TINY, **MOE).base_model_tp_plan
    assert "layers.*.mlp.gate_proj" not in every_layer_moe and "layers.*.self_attn.head_router" not in every_layer_moe
    assert "layers.*.self_attn.head_router" not in MoHLlamaConfig(**TINY).base_model_tp_plan
    assert "layers.*.self_attn.head_router" in MoHLlamaConfig.base_model_tp_plan


@pytest.mark.parametrize("model_class", [MHMoEForCausalLM, MHMoEModel])
def test_moe_models_record_router_logits(model_class):
    """`forward.__annotations__["return"]` is the output class itself (not a string), with `router_logits`; with
    output_router_logits the model fills it with one (tokens·heads, experts) tensor per MoE layer."""
    output_class = model_class.forward.__annotations__["return"]
    assert isinstance(output_class, type) and issubclass(output_class, ModelOutput), output_class
    assert "router_logits" in output_class.__dataclass_fields__
    config = MHMoEConfig(**dict(TINY, num_hidden_layers=4), **MOE, moe_heads=2, decoder_sparse_step=2)
    model = model_class(config).eval()
    ids = torch.randint(0, TINY["vocab_size"], (2, 5))
    with torch.no_grad():
        output = model(ids, output_router_logits=True)
        plain = model(ids)
    assert type(output) is output_class
    assert len(output.router_logits) == 2  # layers 1 and 3 are MoE
    assert all(logits.shape == (2 * 5 * 2, MOE["num_experts"]) for logits in output.router_logits)
    assert plain.router_logits is None


def test_moh_llama_forward_annotation_has_the_moh_outputs():
    output_class = MoHLlamaForCausalLM.forward.__annotations__["return"]
    assert isinstance(output_class, type) and "moh_router_logits" in output_class.__dataclass_fields__
    assert MHMoEForCausalLM.forward is not MoHLlamaForCausalLM.forward


def test_head_count_must_divide_hidden_size_like_llama():
    from transformers import LlamaConfig

    with pytest.raises(Exception, match=r"not a multiple of the number of attention heads"):
        LlamaConfig(hidden_size=64, num_attention_heads=5)  # the reference behaviour
    with pytest.raises(ValueError, match=r"hidden_size \(64\) is not a multiple of num_attention_heads \(5\)"):
        MHMoEConfig(hidden_size=64, num_attention_heads=5)
    assert MHMoEConfig(hidden_size=64, num_attention_heads=5, num_key_value_heads=5, head_dim=16).head_dim == 16


def test_misspelt_config_key_is_refused_by_name():
    """Transformers keeps an unknown keyword as an attribute (the field keeps its default): a close match is refused."""
    from transformers import LlamaConfig

    assert LlamaConfig(num_attention_head=4).num_attention_heads == 32  # the reference behaviour: silently kept
    with pytest.raises(ValueError, match=r"'num_expert' \(did you mean 'num_experts'\?\)"):
        MHMoEConfig(**TINY, num_expert=4)
