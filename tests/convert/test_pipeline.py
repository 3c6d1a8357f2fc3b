"""The converter as one pipeline (issue 51): `choose_heads` returns its choice and leaves the plan as it was, the
recipe's added tensors are planned (and counted) before calibration, the routers and shared-head choices come from
one table each (routers.py), and `convert`'s keyword arguments are one checked `ConvertOptions`."""

import dataclasses

import pytest

from mhmoe.convert import ConversionError
from mhmoe.convert.calibrate import RECIPES, ROUTER_CHOICES, HeadRecipe, choose_heads, plan_recipe, resolve_recipe
from mhmoe.convert.options import ConvertOptions, SpeedSettings
from mhmoe.convert.plan import plan_conversion
from mhmoe.convert.routers import ROUTERS, SHARED_HEADS, ConverterRouter
from tests.convert.test_convert import TINY, _llama_dir


def test_choose_heads_returns_its_choice_and_leaves_the_plan_alone(tmp_path, tokenizer_dir):
    source = _llama_dir(tmp_path / "src", tokenizer_dir)
    plan = plan_conversion(str(source), 0.25, 0.625)
    recipe, note = resolve_recipe(HeadRecipe("auto", "auto", "auto"), plan.input_dir)
    assert recipe == RECIPES["fitted"] and note is None  # the folder has a tokenizer
    unplanned = plan.total_bytes
    plan_recipe(plan, recipe)  # the fitted router's W_r, W_s, W_h: planned before calibration
    planned = plan.total_bytes
    heads, d, layers = TINY["num_attention_heads"], TINY["hidden_size"], TINY["num_hidden_layers"]
    assert planned - unplanned == layers * (heads + 2) * d * 4  # (R + S + 2, d) fp32 per layer
    config_before = plan.config.to_dict()
    shards_before = [[dataclasses.astuple(t) for t in s.tensors] for s in plan.shards]
    notes_before = list(plan.notes)

    choices = choose_heads(plan, recipe, calibration_tokens=256, head_budget="threshold")

    assert plan.config.to_dict() == config_before and list(plan.notes) == notes_before
    assert [[dataclasses.astuple(t) for t in s.tensors] for s in plan.shards] == shards_before
    assert plan.total_bytes == planned  # no second disk check needed
    assert list(choices.fields) == [
        "moh_router",
        "moh_straight_through",
        "moh_active_heads_per_layer",
        "moh_head_thresholds",
    ]
    configured = choices.configured(plan.config)
    assert configured.moh_router == "learned" and configured.moh_straight_through is True
    assert configured.moh_active_heads_per_layer == choices.record["head_budget"]["routed_active_heads_per_layer"]
    assert plan.config.to_dict() == config_before  # `configured` is a copy
    assert set(choices.tensors) == {
        t.name for s in plan.shards for t in s.tensors if t.added and ".self_attn.head_router." in t.name
    }
    assert list(choices.record) == ["recipe", "head_budget", "router_fit", "calibration", "layers"]


def test_a_source_without_a_tokenizer_resolves_auto_to_paper_with_a_note(tmp_path):
    source = _llama_dir(tmp_path / "src")
    recipe, note = resolve_recipe(HeadRecipe("auto", "auto", "auto"), str(source))
    assert recipe == RECIPES["paper"] and note.startswith("recipe paper: the source has no tokenizer")
    plan = plan_conversion(str(source), 0.25, 0.625)
    choices = choose_heads(plan, recipe)  # nothing to calibrate: no model loaded, nothing chosen
    assert choices.orders is None and choices.fields == {} and choices.tensors == {}
    assert choices.record == {"recipe": dataclasses.asdict(recipe), "head_budget": {"kind": "uniform"}}


def test_the_routers_come_from_one_table():
    """`--moh_router` offers and describes exactly the registered routers; what a recipe needs follows the table."""
    from mhmoe.convert.cli import build_parser

    assert ROUTER_CHOICES == tuple(ROUTERS) == ("l2", "l2_standardized", "l2_relative", "fitted")
    assert all(isinstance(r, ConverterRouter) and r.help for r in ROUTERS.values())
    action = next(a for a in build_parser()._actions if "--moh_router" in a.option_strings)
    assert action.choices == list(ROUTERS) and all(f"'{name}'" in action.help for name in ROUTERS)
    assert [n for n, r in ROUTERS.items() if not r.calibrated] == ["l2"]
    assert [n for n, s in SHARED_HEADS.items() if not s.calibrated] == ["first"]
    assert not RECIPES["paper"].needs_calibration
    assert HeadRecipe("x", "first", "l2_relative").needs_calibration
    assert HeadRecipe("x", "importance", "l2").needs_calibration
    assert HeadRecipe("x", "first", "no such router").needs_calibration  # unknown: not skipped silently


def test_convert_options_are_checked_on_construction():
    assert ConvertOptions().recipe == "auto" and ConvertOptions().with_recipe().recipe.name == "auto"
    assert ConvertOptions(recipe="paper").with_recipe().recipe == RECIPES["paper"]
    with pytest.raises(TypeError):
        ConvertOptions(shared_heads_ratio="half")
    with pytest.raises(ConversionError, match="--head_budget must be one of uniform, calibrated, threshold"):
        ConvertOptions(head_budget="none")
    with pytest.raises(TypeError, match="speed must be a SpeedSettings or None, not bool"):
        ConvertOptions(speed=True)
    with pytest.raises(ConversionError, match="--recipe must be one of"):
        ConvertOptions(recipe="nope").with_recipe()
    assert ConvertOptions(speed=SpeedSettings(4, 2, 1)).speed.rounds == 1
    with pytest.raises(dataclasses.FrozenInstanceError):
        ConvertOptions().overwrite = True
