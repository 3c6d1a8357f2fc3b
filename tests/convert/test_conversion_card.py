"""What mhmoe-convert's card and report say is true (issue 50): the router described is the router written, the parent
is named by its Hub id or GGUF file (never a local folder), poorly fitted router layers are named, and the held-out
perplexity ratio is measured on calibration text that calibration never read. Tiny models, offline."""

import json
import math

import pytest
import torch

import mhmoe.convert.calibrate as calibrate
from mhmoe.convert import ConversionError, convert, main
from tests.convert.test_convert import _llama_dir


def _card_and_record(out):
    return (out / "README.md").read_text(), json.loads((out / "moh_conversion.json").read_text())


def _metadata(card: str) -> str:
    return card.split("---")[1]


def _intro(card: str) -> str:
    """The card's paragraphs before its architecture table."""
    return card.split("## Architecture")[0]


def test_fitted_card_describes_the_fitted_router_flags_poor_layers_and_names_the_hub_parent(
    tmp_path, tokenizer_dir, capsys, monkeypatch
):
    """The default recipe (`fitted`): the card's text describes the learned router with W_r fitted (not a
    parameter-free query-norm router); a layer whose fit is worse than a constant (R² < 0) is named in the card and in
    the report; the parent is the Hub id in the source's config.json `_name_or_path`, not the folder's name."""
    source = _llama_dir(tmp_path / "llm_private_folder", tokenizer_dir)
    config = json.loads((source / "config.json").read_text())
    (source / "config.json").write_text(json.dumps({**config, "_name_or_path": "SomeOrg/Tiny-Llama-1B"}))
    fit_routers = calibrate.fit_routers

    def one_poor_layer(*args, **kwargs):
        fit = fit_routers(*args, **kwargs)
        fit.r2 = [0.4321, -1.87]  # layer 1 fits worse than a constant score
        return fit

    monkeypatch.setattr(calibrate, "fit_routers", one_poor_layer)
    out = tmp_path / "moh"
    main(["--input_dir", str(source), "--output_dir", str(out), "--calibration_tokens", "256", "--disable_tqdm"])
    printed = capsys.readouterr().out
    card, record = _card_and_record(out)
    assert record["recipe"]["router"] == "fitted" and json.loads((out / "config.json").read_text())["moh_router"] == (
        "learned"
    )
    intro = _intro(card)
    assert "query norm" not in intro and "parameter-free" not in intro
    assert "learned router" in intro and "W_r fitted on calibration text" in intro
    fit_lines = [line for line in printed.splitlines() if "router fit" in line]
    assert len(fit_lines) == 1 and "poor fit (R² < 0" in fit_lines[0] and "layer 1 (-1.87)" in fit_lines[0]
    assert "layer 0" not in fit_lines[0]
    row = next(line for line in card.splitlines() if line.startswith("| router fit"))
    assert "layer 1 (-1.87)" in row and "from -1.87 to 0.43" in row
    assert "base_model: SomeOrg/Tiny-Llama-1B" in _metadata(card)
    assert "Converted from the dense checkpoint `SomeOrg/Tiny-Llama-1B`" in intro
    assert (record["input_dir"], record["base_model"]) == ("SomeOrg/Tiny-Llama-1B", "SomeOrg/Tiny-Llama-1B")
    text = card + json.dumps(record)
    assert "llm_private_folder" not in text and str(tmp_path) not in text


@pytest.mark.parametrize(
    "recipe, words, absent",
    [
        ("paper", ["pre-RoPE query norm", "`l2` router", "adds no parameters"], ["W_r", "learned router"]),
        ("calibrated", ["pre-RoPE query norm over the head's mean", "`l2_relative`"], ["W_r", "learned router"]),
    ],
)
def test_l2_card_says_query_norms_and_a_local_folder_is_not_named(tmp_path, tokenizer_dir, recipe, words, absent):
    """The l2 routers: the card says the routed heads are scored by their query norms. A local source without a Hub
    id: no base_model in the metadata, and the folder's name nowhere."""
    source = _llama_dir(tmp_path / "llm_local", tokenizer_dir)
    out = tmp_path / "moh"
    convert(str(source), str(out), 0.25, 0.625, recipe=recipe, calibration_tokens=256, progress=False)
    card, record = _card_and_record(out)
    intro = _intro(card)
    assert all(w in intro for w in words), intro
    assert not any(w in intro for w in absent), intro
    assert "base_model" not in _metadata(card) and "a local dense checkpoint" in intro
    assert record["input_dir"] is None and record["base_model"] is None
    assert "llm_local" not in card + json.dumps(record)


def test_explicit_base_model_wins_and_a_path_is_refused(tmp_path, tokenizer_dir):
    source = _llama_dir(tmp_path / "llm_local", tokenizer_dir)
    out = tmp_path / "moh"
    convert(str(source), str(out), recipe="paper", verify_logits=False, progress=False, base_model="org/Parent-1B")
    card, record = _card_and_record(out)
    assert "base_model: org/Parent-1B" in _metadata(card) and record["base_model"] == "org/Parent-1B"
    for bad in (str(source), "../x", "./x", "a/b/c"):
        with pytest.raises(ConversionError, match="--base_model must be a Hugging Face Hub model id"):
            convert(str(source), str(tmp_path / "no"), progress=False, base_model=bad)
    assert not (tmp_path / "no").exists()


def _perplexity(model, ids: list[int], row: int) -> float:
    """Plain HF forward passes: the mean next-token loss over rows of `row` tokens (a last shorter row too)."""
    total, count = 0.0, 0
    with torch.no_grad():
        for start in range(0, len(ids), row):
            chunk = torch.tensor([ids[start : start + row]])
            if chunk.shape[1] < 2:
                continue
            n = chunk.shape[1] - 1
            total += model(chunk, labels=chunk).loss.item() * n
            count += n
    return math.exp(total / count)


def test_heldout_ratio_is_measured_on_tokens_calibration_never_read(
    tmp_path, tokenizer_dir, corpus, capsys, monkeypatch
):
    """The card, moh_conversion.json and the report state the converted / parent perplexity on the calibration text's
    held-out tokens (the text named as given, the token count stated); recomputed here with plain forward passes of
    both models it is the same; the calibration pass saw only the tokens before them."""
    from transformers import AutoTokenizer, LlamaForCausalLM

    from mhmoe.models.moh_llama import MoHLlamaForCausalLM

    source = _llama_dir(tmp_path / "src", tokenizer_dir)
    seen = []
    measure_heads = calibrate.measure_heads

    def recording(model, blocks, *args, **kwargs):
        seen.append(blocks.flatten().tolist())
        return measure_heads(model, blocks, *args, **kwargs)

    monkeypatch.setattr(calibrate, "measure_heads", recording)
    out = tmp_path / "moh"
    main(
        ["--input_dir", str(source), "--output_dir", str(out), "--calibration_file", corpus["txt"]]
        + ["--calibration_tokens", "300", "--disable_tqdm"]
    )
    printed = capsys.readouterr().out
    card, record = _card_and_record(out)
    h = record["heldout"]

    text = open(corpus["txt"], encoding="utf-8").read()
    ids = AutoTokenizer.from_pretrained(str(source))(text, add_special_tokens=False)["input_ids"]
    assert len(ids) > 300 + 4096 // 4  # the rule: the tokens after the first 300, up to 4,096
    heldout = ids[300 : 300 + 4096]
    assert h["tokens"] == len(heldout) and h["text"] == "train.txt" and h["block"] == 32  # the tiny model's positions
    assert len(seen) == 1 and seen[0] == ids[: len(seen[0])] and len(seen[0]) <= 300  # calibration: before them

    parent = LlamaForCausalLM.from_pretrained(str(source)).eval()
    converted = MoHLlamaForCausalLM.from_pretrained(str(out)).eval()
    parent_ppl, converted_ppl = _perplexity(parent, heldout, 32), _perplexity(converted, heldout, 32)
    assert h["parent_ppl"] == pytest.approx(parent_ppl, rel=1e-4)
    assert h["converted_ppl"] == pytest.approx(converted_ppl, rel=1e-4)
    assert h["ratio"] == pytest.approx(converted_ppl / parent_ppl, rel=1e-4)

    stated = f"on {len(heldout):,} held-out tokens of train.txt"
    assert stated in _intro(card) and f"×{converted_ppl / parent_ppl:.3f} its parent's" in _intro(card)
    assert f"| held-out perplexity vs the parent (at conversion) | ×{h['ratio']:.3f}" in card
    line = next(line for line in printed.splitlines() if "held-out perplexity" in line)
    assert f"{len(heldout):,} tokens of train.txt" in line and f"×{h['ratio']:.3f} the parent's" in line


def test_probe_line_says_what_happened(tmp_path, tokenizer_dir, capsys):
    from mhmoe.hub.conversion_cards import probe_change

    assert probe_change(10.0, 12.0).startswith("×1.20: higher with routing on")
    assert probe_change(10.0, 9.0).startswith("×0.90: lower with routing on")
    assert probe_change(10.0, 10.01).startswith("×1.001: about the same")
    source = _llama_dir(tmp_path / "src", tokenizer_dir)
    main(["--input_dir", str(source), "--output_dir", str(tmp_path / "moh"), "--recipe", "paper", "--disable_tqdm"])
    record = json.loads((tmp_path / "moh" / "moh_conversion.json").read_text())
    v = record["verification"]
    line = next(line for line in capsys.readouterr().out.splitlines() if "probe perplexity" in line)
    assert probe_change(v["source_probe_ppl"], v["routed_probe_ppl"]) in line
    assert "continue-tune to recover" not in line
