"""The converted model's card states its own conversion's measured figures (issue 31): the logit check."""

import json

from mhmoe.convert import convert
from mhmoe.hub.cards import verification_rows
from tests.convert.test_convert import _llama_dir


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
