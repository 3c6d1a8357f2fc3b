"""The converted model's card states its own conversion's measured figures (issue 31): the logit check, and after
continue-tuning the parent's, the untuned and the tuned perplexity (recovery_summary.json)."""

import json
import re

import pytest

from mhmoe.convert import convert, main
from mhmoe.hub.cards import recovery_text, training_text, verification_rows
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
    assert "Trained with `mhmoe-train` for 2 steps (" in card and "base_model: Tiny-Llama" in card
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
