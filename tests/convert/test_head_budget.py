"""Per-layer head budgets (`--head_budget calibrated`, issue 31): the allocation against a brute-force optimum, the
measured sensitivities against models built with the per-layer budgets in their config, and a tiny LLaMA converted
with them (config, moh_conversion.json, report, card, the routers of the reloaded model); `--head_budget threshold`:
the thresholds take each layer's budget on average over the calibration tokens."""

import copy
import itertools
import json

import pytest
import torch

from mhmoe.convert import ConversionError, convert
from mhmoe.convert.head_budget import allocate_budgets, converted_in_memory, measure_sensitivity
from tests.convert.test_convert import TINY, _llama_dir


def _cost(delta, budgets):
    return sum(row[k - 1] for row, k in zip(delta, budgets, strict=True))


@pytest.mark.parametrize("layers, routed, total", [(2, 6, 6), (3, 4, 3), (3, 4, 12), (4, 5, 8), (5, 3, 9), (4, 6, 13)])
def test_allocate_budgets_is_the_brute_force_optimum(layers, routed, total):
    """Σ K_l = total, each K_l in [1, routed], and the least Σ Δ_l(K_l) over every such allocation (brute force)."""
    generator = torch.Generator().manual_seed(layers * 100 + routed * 10 + total)
    for _ in range(4):
        scale = torch.rand(layers, 1, generator=generator) * 4  # layers differ in how much restricting them costs
        # losses that fall with K to 0 at K = routed, as measured; the optimum does not rely on it
        steps = torch.rand(layers, routed, generator=generator) * scale
        delta = steps.flip(-1).cumsum(-1).flip(-1)[:, 1:].tolist()
        delta = [row + [0.0] for row in delta]
        budgets = allocate_budgets(delta, total)
        assert sum(budgets) == total and all(1 <= k <= routed for k in budgets)
        best = min(_cost(delta, b) for b in itertools.product(range(1, routed + 1), repeat=layers) if sum(b) == total)
        assert _cost(delta, budgets) == pytest.approx(best)
    # any losses, not only falling ones
    delta = torch.rand(layers, routed, generator=generator).tolist()
    best = min(_cost(delta, b) for b in itertools.product(range(1, routed + 1), repeat=layers) if sum(b) == total)
    assert _cost(delta, allocate_budgets(delta, total)) == pytest.approx(best)


def test_allocate_budgets_favours_the_layer_that_loses_more():
    assert allocate_budgets([[1.0, 0.4, 0.1, 0.0], [0.1, 0.04, 0.01, 0.0]], 4) == [3, 1]
    assert allocate_budgets([[0.3, 0.1, 0.0], [0.3, 0.1, 0.0]], 4) == [2, 2]
    with pytest.raises(ConversionError, match="7 routed heads cannot be shared out over 2 layers of 3"):
        allocate_budgets([[0.3, 0.1, 0.0], [0.3, 0.1, 0.0]], 7)
    with pytest.raises(ConversionError, match="each layer keeps 1..3"):
        allocate_budgets([[0.3, 0.1, 0.0], [0.3, 0.1, 0.0]], 1)


def _kl(reference_logits, logits):
    """Mean over tokens of KL(reference || model), by torch's own kl_div."""
    ref, log_probs = (torch.log_softmax(x.float(), dim=-1).flatten(0, 1) for x in (reference_logits, logits))
    return torch.nn.functional.kl_div(log_probs, ref, log_target=True, reduction="batchmean").item()


@pytest.mark.parametrize("permuted", [False, True])
def test_measure_sensitivity_equals_models_built_with_those_budgets(tmp_path, permuted):
    """Δ_l(K) from switching one router at a time equals the KL of a model whose config holds the per-layer budgets
    (R everywhere, K in layer l) against the dense source; Δ_l(R) = 0. With a head permutation the in-memory model
    with every head active still computes the source."""
    from transformers import AutoModelForCausalLM

    from mhmoe.convert.heads import permute_state_dict
    from mhmoe.convert.plan import plan_conversion
    from mhmoe.convert.verify import all_heads_active
    from mhmoe.models.moh_llama import MoHLlamaForCausalLM

    source_dir = _llama_dir(tmp_path / "src", initializer_range=0.3)  # weights large enough to matter
    source = AutoModelForCausalLM.from_pretrained(str(source_dir)).eval()
    config = plan_conversion(str(source_dir), 0.25, 0.625).config  # 2 shared, 3 of 6 routed active
    orders = [[4, 5, 6, 7, 0, 1, 2, 3], [1, 0, 2, 3, 7, 6, 5, 4]] if permuted else None
    ids = torch.randint(0, TINY["vocab_size"], (3, 12), generator=torch.Generator().manual_seed(1))
    model = converted_in_memory(source, config, orders)
    with torch.no_grad():
        dense = source(ids).logits
        with all_heads_active(model):
            torch.testing.assert_close(model(ids).logits, dense, rtol=0, atol=1e-5)
    delta = measure_sensitivity(model, ids, batch=2)  # two batches
    assert [router.active_heads for router in (layer.self_attn.head_router for layer in model.model.layers)] == [3, 3]
    routed = 6
    assert len(delta) == 2 and all(len(row) == routed and row[-1] == 0.0 for row in delta)
    state = source.state_dict()
    if orders is not None:
        state = permute_state_dict(state, orders, config.num_key_value_heads, config.head_dim)
    for layer, k in itertools.product(range(2), range(1, routed)):
        budgets = [routed, routed]
        budgets[layer] = k
        per_layer = copy.deepcopy(config)
        per_layer.moh_active_heads_per_layer = budgets
        reference = MoHLlamaForCausalLM(per_layer)
        reference.load_state_dict(state, strict=False)
        reference.tie_weights()
        with torch.no_grad():
            expected = _kl(dense, reference.eval()(ids).logits)
        assert delta[layer][k - 1] == pytest.approx(expected, rel=1e-3, abs=1e-7)
    assert max(max(row) for row in delta) > 1e-3  # the measurement sees the heads


def test_calibrated_head_budget_end_to_end(tmp_path, tokenizer_dir):
    """The budgets are the allocation of the recorded sensitivities at the uniform total, in config.json,
    moh_conversion.json, the report and the card, and the reloaded model's routers use them; all heads on still
    computes the source."""
    from transformers import AutoModelForCausalLM

    from mhmoe.convert.verify import all_heads_active
    from mhmoe.models.moh_llama import MoHLlamaForCausalLM

    source = _llama_dir(tmp_path / "src", tokenizer_dir, initializer_range=0.3)
    out = tmp_path / "out"
    report = convert(
        str(source), str(out), 0.25, 0.625, recipe="calibrated", calibration_tokens=256, progress=False,
        head_budget="calibrated",
    )  # fmt: skip
    record = json.loads((out / "moh_conversion.json").read_text())
    config = json.loads((out / "config.json").read_text())
    budgets = config["moh_active_heads_per_layer"]
    assert config["moh_active_heads"] == 3 and sum(budgets) == 2 * 3 and all(1 <= k <= 6 for k in budgets)
    kl = record["head_budget"]["kl"]
    assert len(kl) == 2 and all(len(row) == 6 and row[-1] == 0 for row in kl) and max(map(max, kl)) > 0
    assert budgets == allocate_budgets(kl, 2 * 3)
    assert record["head_budget"]["kind"] == "calibrated" and record["head_budget"]["sensitivity_tokens"] == 256
    assert record["head_budget"]["routed_active_heads_per_layer"] == budgets
    assert record["routed_active_heads_per_layer"] == budgets
    assert f"head budget calibrated: routed heads active per layer {', '.join(map(str, budgets))}" in report.format()
    card = (out / "README.md").read_text()
    assert f"per-layer routed budgets, layer 0 first: {', '.join(map(str, budgets))}" in card
    moh = MoHLlamaForCausalLM.from_pretrained(str(out)).eval()
    assert [layer.self_attn.head_router.active_heads for layer in moh.model.layers] == budgets
    assert report.verification["all_heads_equal"]
    dense = AutoModelForCausalLM.from_pretrained(str(source)).eval()
    ids = torch.randint(0, TINY["vocab_size"], (2, 16), generator=torch.Generator().manual_seed(2))
    with torch.no_grad(), all_heads_active(moh):
        torch.testing.assert_close(moh(ids).logits, dense(ids).logits, rtol=0, atol=1e-5)


def test_threshold_head_budget_end_to_end(tmp_path, tokenizer_dir):
    """The calibrated budgets become averages: per layer, a threshold that the calibration tokens' routed scores pass
    K_l times per token on average (as recorded, in layer 0, whose inputs no routing changes), recorded in config.json,
    moh_conversion.json, the report and the card; the reloaded routers use them; all heads on computes the source."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from mhmoe.convert.calibrate import calibration_blocks, read_calibration
    from mhmoe.convert.verify import all_heads_active
    from mhmoe.models.moh_llama import MoHLlamaForCausalLM

    source = _llama_dir(tmp_path / "src", tokenizer_dir, initializer_range=0.3)
    out = tmp_path / "out"
    report = convert(
        str(source), str(out), 0.25, 0.625, recipe="fitted", calibration_tokens=512, progress=False,
        head_budget="threshold",
    )  # fmt: skip
    record = json.loads((out / "moh_conversion.json").read_text())["head_budget"]
    config = json.loads((out / "config.json").read_text())
    budgets, thresholds = config["moh_active_heads_per_layer"], config["moh_head_thresholds"]
    assert record["kind"] == "threshold" and record["thresholds"] == thresholds and len(thresholds) == 2
    assert all((t is None) == (k == 6) for t, k in zip(thresholds, budgets)) and thresholds[0] is not None
    assert record["routed_active_fraction"][0] == pytest.approx(budgets[0] / 6, abs=0.01)  # ties aside: K_0 / R
    assert "head budget threshold (per-layer averages)" in report.format()
    assert "the routed heads whose score exceeds the layer's threshold" in (out / "README.md").read_text()
    moh = MoHLlamaForCausalLM.from_pretrained(str(out)).eval()
    assert [layer.self_attn.head_router.threshold for layer in moh.model.layers] == thresholds
    tokenizer = AutoTokenizer.from_pretrained(str(source))
    blocks = calibration_blocks(tokenizer, read_calibration(None)[0], 512, 256)
    gates = []
    hook = moh.model.layers[0].self_attn.head_router.register_forward_hook(lambda m, a, out: gates.append(out[0]))
    with torch.no_grad():
        moh(blocks, use_cache=False)
    hook.remove()
    routed = gates[0][..., 2:]  # (N, T, 6)
    assert routed.mean().item() == pytest.approx(record["routed_active_fraction"][0], abs=1e-4)  # as recorded
    assert routed.sum(-1).unique().numel() > 1  # and not per token
    dense = AutoModelForCausalLM.from_pretrained(str(source)).eval()
    ids = blocks[:1, :16]
    with torch.no_grad(), all_heads_active(moh):
        torch.testing.assert_close(moh(ids).logits, dense(ids).logits, rtol=0, atol=1e-5)


def test_uniform_head_budget_is_the_default_and_bad_kinds_are_refused(tmp_path, tokenizer_dir):
    from mhmoe.convert.arguments import ConvertArguments

    source = _llama_dir(tmp_path / "src", tokenizer_dir)
    convert(str(source), str(tmp_path / "paper"), progress=False, recipe="paper")
    record = json.loads((tmp_path / "paper" / "moh_conversion.json").read_text())
    config = json.loads((tmp_path / "paper" / "config.json").read_text())
    assert record["head_budget"] == {"kind": "uniform"} and "calibration" not in record
    assert config.get("moh_active_heads_per_layer") is None
    assert ConvertArguments().head_budget == "uniform"
    with pytest.raises(ConversionError, match="--head_budget must be one of uniform, calibrated, threshold"):
        convert(str(source), str(tmp_path / "bad"), progress=False, head_budget="greedy")
    assert not (tmp_path / "bad").exists()
