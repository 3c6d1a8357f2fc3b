"""FLOPs/parameter parity (paper Section 2.3 and 3) and the cost model against real modules."""

import pytest

from mhmoe import MHMoEConfig, MHMoEModel, from_mixtral_config, matched_moe_settings, matched_to_smoe, moe_layer_cost

PAPER_SMOE = dict(
    hidden_size=768,
    num_attention_heads=12,
    moe_intermediate_size=2048,
    num_experts=8,
    num_experts_per_tok=1,
    moe_heads=1,
)


@pytest.mark.parametrize("h,k,intermediate,experts", [(2, 2, 768, 40), (3, 3, 512, 96)])
def test_reproduces_paper_section_3(h, k, intermediate, experts):
    smoe = MHMoEConfig(**PAPER_SMOE)
    mh = matched_to_smoe(smoe, moe_heads=h, num_experts_per_tok=k, round_experts_to=8)
    assert (mh.moe_intermediate_size, mh.num_experts) == (intermediate, experts)
    assert mh.moe_head_layer and mh.moe_merge_layer and mh.hidden_size == 768

    # activated multiply-adds are equal once the router's d·E term (not in the paper's count) is set aside
    def without_router(cfg):
        return moe_layer_cost(cfg).macs_per_token - cfg.hidden_size * cfg.num_experts

    assert without_router(mh) == without_router(smoe)
    # total parameters agree to within the rounding of E to a multiple of 8
    gap = abs(moe_layer_cost(mh).params - moe_layer_cost(smoe).params) / moe_layer_cost(smoe).params
    assert gap < 0.05


def test_exact_parameter_solution_before_rounding():
    # E = (3·d·f_s·E_s − 2d²) / (3·(d/h)·f): 41.33 for h=2 and 93.0 for h=3 (paper rounds to 40 and 96)
    assert matched_moe_settings(768, 2048, 8, 1, moe_heads=2, top_k=2, round_experts_to=1) == (768, 41)
    assert matched_moe_settings(768, 2048, 8, 1, moe_heads=3, top_k=3, round_experts_to=1) == (512, 93)


def test_eq8_is_exact_only_for_top1_two_matrix_ffn():
    # eq. (8) f_mh = f_moe − d/k; for SwiGLU and k=2 it would give 1664, the SwiGLU solution is 768
    intermediate, _ = matched_moe_settings(768, 2048, 8, 1, moe_heads=2, top_k=2)
    assert intermediate != 2048 - 768 // 2 and 3 * 768 * intermediate * 2 + 2 * 768**2 == 3 * 768 * 2048


def test_rejects_impossible_matches():
    with pytest.raises(ValueError, match="divisible"):
        matched_moe_settings(768, 2048, 8, 1, moe_heads=5, top_k=2)
    with pytest.raises(ValueError, match="exceed"):
        matched_moe_settings(64, 8, 8, 1, moe_heads=2, top_k=1)


@pytest.mark.parametrize(
    "fields",
    [
        dict(moe_heads=1, moe_head_layer=False, moe_merge_layer=False),
        dict(moe_heads=3),
        dict(moe_heads=2, moe_head_layer=True, moe_merge_layer=False, shared_expert_intermediate_size=40),
    ],
)
def test_cost_counts_real_module_parameters(fields):
    cfg = MHMoEConfig(
        vocab_size=50,
        hidden_size=48,
        num_attention_heads=4,
        intermediate_size=32,
        num_hidden_layers=2,
        num_experts=7,
        num_experts_per_tok=2,
        moe_intermediate_size=12,
        **fields,
    )
    block = MHMoEModel(cfg).layers[0].mlp
    assert sum(p.numel() for p in block.parameters()) == moe_layer_cost(cfg).params


def _matched_gap(source: MHMoEConfig, matched: MHMoEConfig) -> tuple[float, int]:
    """(relative parameter gap, activated multiply-add difference without the routers' d·E terms)."""

    def without_router(cfg):
        return moe_layer_cost(cfg).macs_per_token - cfg.hidden_size * cfg.num_experts

    params = abs(moe_layer_cost(matched).params - moe_layer_cost(source).params) / moe_layer_cost(source).params
    return params, without_router(matched) - without_router(source)


def test_matched_to_smoe_from_mixtral_an_mh_moe_source_and_without_head_or_merge():
    from transformers import MixtralConfig

    mixtral = MixtralConfig(
        hidden_size=768,
        intermediate_size=2048,
        num_local_experts=8,
        num_experts_per_tok=1,
        num_attention_heads=12,
        num_key_value_heads=12,
    )
    source = from_mixtral_config(mixtral)
    mh = matched_to_smoe(source, moe_heads=2, num_experts_per_tok=2)
    assert mh.router_aux_loss_mode == "per_layer"  # Mixtral's pooled mode needs h=1
    assert (mh.moe_intermediate_size, mh.num_experts) == (768, 40)
    # an MH-MoE source: its experts are d/h wide (Section 3's h=3 config matched back to h=2)
    h3 = MHMoEConfig(
        **{**PAPER_SMOE, "moe_heads": 3, "num_experts": 96, "num_experts_per_tok": 3, "moe_intermediate_size": 512}
    )
    matched = matched_to_smoe(h3, moe_heads=2, num_experts_per_tok=2, round_experts_to=1)
    params_gap, macs_gap = _matched_gap(h3, matched)
    assert params_gap < 0.012 and macs_gap == 0  # E rounded to an integer: at most half an expert (1.1%) off
    # the ablations without head and/or merge layer are solved for what they really have
    for fields in (dict(moe_head_layer=False), dict(moe_head_layer=False, moe_merge_layer=False)):
        smoe = MHMoEConfig(**PAPER_SMOE)
        matched = matched_to_smoe(smoe, moe_heads=2, num_experts_per_tok=2, round_experts_to=1, **fields)
        assert not matched.moe_head_layer and matched.moe_merge_layer == fields.get("moe_merge_layer", True)
        params_gap, macs_gap = _matched_gap(smoe, matched)
        assert params_gap < 0.02 and abs(macs_gap) <= 3 * 768 * 2  # f and E rounded to integers


def test_matched_to_smoe_refusals():
    from transformers import MixtralConfig

    with pytest.raises(ValueError, match="from_mixtral_config"):
        matched_to_smoe(MixtralConfig(), moe_heads=2, num_experts_per_tok=2)
    with pytest.raises(ValueError, match="dense"):
        matched_to_smoe(MHMoEConfig(**PAPER_SMOE, decoder_sparse_step=0), moe_heads=2, num_experts_per_tok=2)
