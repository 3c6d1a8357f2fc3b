"""Per-layer head budgets (`--head_budget calibrated`, issue 31): the allocation against a brute-force optimum, and a
tiny LLaMA converted with them (config, moh_conversion.json, report, card, the routers of the reloaded model)."""

import itertools
import json

import pytest
import torch

from mhmoe.convert import ConversionError, convert
from mhmoe.convert.calibrate import head_budgets
from tests.convert.test_convert import TINY, _llama_dir


def _kept(importance, budgets):
    return sum(sum(sorted(row, reverse=True)[:k]) for row, k in zip(importance, budgets, strict=True))


@pytest.mark.parametrize("layers, routed, active", [(2, 6, 3), (3, 4, 1), (3, 4, 4), (4, 5, 2), (5, 3, 2)])
def test_head_budgets_keep_the_most_importance_at_the_uniform_total(layers, routed, active):
    """Same total as the uniform budget, each layer in [1, routed], and the largest total importance of the kept
    routed heads over every such allocation (brute force)."""
    generator = torch.Generator().manual_seed(layers * 100 + routed * 10 + active)
    for _ in range(3):
        scale = torch.rand(layers, 1, generator=generator) * 4  # layers differ in how much their heads contribute
        importance = (torch.rand(layers, routed, generator=generator) * scale).tolist()
        budgets = head_budgets(importance, active)
        assert sum(budgets) == layers * active and all(1 <= k <= routed for k in budgets)
        best = max(
            _kept(importance, b)
            for b in itertools.product(range(1, routed + 1), repeat=layers)
            if sum(b) == layers * active
        )
        assert _kept(importance, budgets) == pytest.approx(best)


def test_head_budgets_favour_the_layer_that_loses_more():
    assert head_budgets([[1.0, 0.9, 0.8, 0.7], [0.1, 0.09, 0.08, 0.07]], 2) == [3, 1]
    assert head_budgets([[0.5] * 4, [0.5] * 4], 2) == [2, 2]  # ties: equal importances stay uniform
    with pytest.raises(ConversionError, match="uniform budget must be within"):
        head_budgets([[1.0, 0.5]], 3)


def test_calibrated_head_budget_end_to_end(tmp_path, tokenizer_dir):
    """The budgets follow the calibration's routed-head importances, are in config.json, moh_conversion.json, the
    report and the card, and the reloaded model's routers use them; all heads on still computes the source."""
    from transformers import AutoModelForCausalLM

    from mhmoe.convert.verify import all_heads_active
    from mhmoe.models.moh_llama import MoHLlamaForCausalLM

    source = _llama_dir(tmp_path / "src", tokenizer_dir)
    out = tmp_path / "out"
    report = convert(
        str(source), str(out), 0.25, 0.625, recipe="calibrated", calibration_tokens=256, progress=False,
        head_budget="calibrated",
    )  # fmt: skip
    record = json.loads((out / "moh_conversion.json").read_text())
    config = json.loads((out / "config.json").read_text())
    budgets = config["moh_active_heads_per_layer"]
    assert config["moh_active_heads"] == 3 and sum(budgets) == 2 * 3 and all(1 <= k <= 6 for k in budgets)
    routed = [[layer["importance"][h] for h in layer["head_order"][2:]] for layer in record["layers"]]
    assert budgets == head_budgets(routed, 3)  # recorded importances are rounded; the allocation is the same
    assert record["head_budget"] == {"kind": "calibrated", "routed_active_heads_per_layer": budgets}
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


def test_uniform_head_budget_is_the_default_and_bad_kinds_are_refused(tmp_path, tokenizer_dir):
    from mhmoe.convert.arguments import ConvertArguments

    source = _llama_dir(tmp_path / "src", tokenizer_dir)
    convert(str(source), str(tmp_path / "paper"), progress=False, recipe="paper")
    record = json.loads((tmp_path / "paper" / "moh_conversion.json").read_text())
    config = json.loads((tmp_path / "paper" / "config.json").read_text())
    assert record["head_budget"] == {"kind": "uniform"} and "calibration" not in record
    assert config.get("moh_active_heads_per_layer") is None
    assert ConvertArguments().head_budget == "uniform"
    with pytest.raises(ConversionError, match="--head_budget must be one of uniform, calibrated"):
        convert(str(source), str(tmp_path / "bad"), progress=False, head_budget="greedy")
    assert not (tmp_path / "bad").exists()
