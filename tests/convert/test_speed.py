"""`mhmoe-convert --measure_speed` (issue 31): the converted model timed against its parent, recorded in
moh_conversion.json and stated in the card. No speed is asserted (speed claims go in benchmarks/): the figures are
checked for being what was measured, consistent with each other, and stated as recorded."""

import json
import math
import statistics

import pytest
import torch

import mhmoe.evaluation.conversion_speed as speed_module
from mhmoe.convert import convert, main
from mhmoe.convert.options import SpeedSettings
from mhmoe.evaluation.conversion_speed import active_head_share, forward_flops
from mhmoe.hub.cards import speed_rows
from tests.convert.test_convert import _llama_dir


def _convert_with_speed(tmp_path, tokenizer_dir, capsys, *flags):
    source = _llama_dir(tmp_path / "src", tokenizer_dir)
    out = tmp_path / "moh"
    main(
        [
            "--input_dir",
            str(source),
            "--output_dir",
            str(out),
            "--disable_tqdm",
            "--shared_heads",
            "2",
            "--active_heads",
            "5",
            "--measure_speed",
            *flags,
        ]
    )
    return out, capsys.readouterr().out


def test_measure_speed_records_the_timings_and_the_card_states_them(tmp_path, tokenizer_dir, capsys, monkeypatch):
    calls = []
    original = speed_module.lockstep_decode

    def counting(models, caches, new_tokens, rounds):  # the decode the record states is the one that ran
        times = original(models, caches, new_tokens, rounds)
        calls.append((new_tokens, rounds, times))
        return times

    monkeypatch.setattr(speed_module, "lockstep_decode", counting)
    out, printed = _convert_with_speed(
        tmp_path, tokenizer_dir, capsys, "--speed_tokens", "12", "--speed_new_tokens", "5", "--speed_rounds", "3"
    )
    speed = json.loads((out / "moh_conversion.json").read_text())["speed"]
    p, d = speed["prefill"], speed["decode"]
    assert speed["settings"] == {"tokens": 12, "new_tokens": 5, "rounds": 3}
    assert (p["tokens"], d["prompt_tokens"], d["new_tokens"], d["rounds"]) == (12, 12, 5, 3)
    assert 3 <= p["rounds"] <= 15  # more rounds for short prefills, up to 5 x
    assert calls == [(5, 3, {"parent": d["parent_seconds"], "moh": d["moh_seconds"]})]
    for c, tokens in ((p, 12), (d, 5)):
        assert len(c["parent_seconds"]) == len(c["moh_seconds"]) == c["rounds"]
        values = c["parent_seconds"] + c["moh_seconds"] + [c["parent_tokens_per_s"], c["moh_tokens_per_s"]]
        assert all(math.isfinite(v) and v > 0 for v in values)
        ratios = [a / b for a, b in zip(c["parent_seconds"], c["moh_seconds"])]
        assert c["speed_ratio"] == pytest.approx(statistics.median(ratios))
        assert c["parent_tokens_per_s"] == pytest.approx(tokens / statistics.median(c["parent_seconds"]))
        assert c["moh_tokens_per_s"] == pytest.approx(tokens / statistics.median(c["moh_seconds"]))
        assert 0 < c["inactive_attention_share"] < 1
        assert c["ideal_speed_ratio"] == pytest.approx(1 / (1 - c["inactive_attention_share"]))
    assert (p["projections"], d["projections"]) == (0, 2)  # decoding skips the inactive heads' q_proj and o_proj
    assert speed["active_head_share"] == pytest.approx(5 / 8)
    assert (speed["device"], speed["dtype"], speed["threads"]) == ("cpu", "float32", torch.get_num_threads())
    assert speed["text"] == "pydoc_data.topics (default)" and speed["batch"] == 1

    card = (out / "README.md").read_text()
    row = next(line for line in card.splitlines() if line.startswith("| speed vs the parent"))
    assert f"prefill of 12 tokens ×{p['speed_ratio']:.2f} the parent's speed" in row
    assert f"MoH {p['moh_tokens_per_s']:,.1f} vs parent {p['parent_tokens_per_s']:,.1f} tokens/s" in row
    assert f"ideal ×{p['ideal_speed_ratio']:.2f}, {p['rounds']} rounds)" in row
    assert f"greedy decoding of 5 tokens after it ×{d['speed_ratio']:.2f}" in row
    assert f"ideal ×{d['ideal_speed_ratio']:.2f}, 3 rounds in lockstep" in row
    threads = f"{speed['threads']} thread{'' if speed['threads'] == 1 else 's'},"
    assert f"float32, cpu, {threads} pydoc_data.topics (default)." in row
    assert "timings of this conversion, and noisy" in row and "`benchmarks/moh_head_sparse.py`" in row
    assert row.count(" | ") == 1  # a two-column row
    assert f"decode 5 tokens ×{d['speed_ratio']:.3f}" in printed  # the converter's report says it too


def test_measure_speed_with_thresholds_counts_the_heads_the_text_activates(
    tmp_path, tokenizer_dir, capsys, monkeypatch
):
    """With `--head_budget threshold` a token's count of heads varies: the ideal is computed from the share of (token,
    head) pairs the converted model activated on the timed prompt (counted here from its routers' scores), not from
    the budget."""
    shares = []
    original = speed_module.measured_head_share

    def recording(model, ids):
        share = original(model, ids)
        inputs = []
        hooks = [layer.input_layernorm.register_forward_hook(lambda m, a, out: inputs.append(out))
                 for layer in model.model.layers]  # fmt: skip
        with torch.no_grad():
            model(ids, use_cache=False)
        for hook in hooks:
            hook.remove()
        routed = [
            (x @ layer.self_attn.head_router.routed_weight.T > layer.self_attn.head_router.threshold).float().mean()
            if layer.self_attn.head_router.threshold is not None
            else torch.tensor(layer.self_attn.head_router.active_heads / 6)
            for layer, x in zip(model.model.layers, inputs)
        ]
        shares.append((share, float((2 + 6 * torch.stack(routed)).mean() / 8)))
        return share

    monkeypatch.setattr(speed_module, "measured_head_share", recording)
    out, _ = _convert_with_speed(
        tmp_path, tokenizer_dir, capsys, "--head_budget", "threshold", "--speed_tokens", "24", "--speed_new_tokens",
        "2", "--speed_rounds", "1",
    )  # fmt: skip
    speed = json.loads((out / "moh_conversion.json").read_text())["speed"]
    ((share, by_hand),) = shares
    assert speed["active_head_share"] == share == pytest.approx(by_hand, abs=1e-6)
    assert share != pytest.approx(5 / 8)  # not the budget: what this prompt activated


def test_without_the_flag_nothing_is_timed_and_the_card_says_nothing_of_speed(tmp_path, tokenizer_dir, monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("timed without --measure_speed")

    monkeypatch.setattr(speed_module, "measure_speed", refuse)
    monkeypatch.setattr(speed_module, "interleaved_prefill", refuse)
    monkeypatch.setattr(speed_module, "lockstep_decode", refuse)
    source = _llama_dir(tmp_path / "src", tokenizer_dir)
    main(["--input_dir", str(source), "--output_dir", str(tmp_path / "moh"), "--disable_tqdm"])
    record = json.loads((tmp_path / "moh" / "moh_conversion.json").read_text())
    assert record.get("speed") is None and speed_rows(record) == []
    card = (tmp_path / "moh" / "README.md").read_text()
    assert "| logit check" in card and "speed" not in card.lower() and "tokens/s" not in card


@pytest.mark.parametrize(
    "flags, words",
    [
        (["--speed_tokens", "0"], "--speed_tokens must be a whole number >= 1, got 0"),
        (["--speed_new_tokens", "-3", "--measure_speed"], "--speed_new_tokens must be a whole number >= 1, got -3"),
        (["--speed_rounds", "0", "--measure_speed"], "--speed_rounds must be a whole number >= 1, got 0"),
        (["--speed_rounds", "two"], "argument --speed_rounds/--speed-rounds: invalid int value: 'two'"),
    ],
)
def test_bad_speed_values_are_one_line(tmp_path, capsys, flags, words):
    source = _llama_dir(tmp_path / "llama")
    capsys.readouterr()  # (writing the source)
    with pytest.raises(SystemExit) as exit_info:
        main(["--input_dir", str(source), "--output_dir", str(tmp_path / "out"), "--disable_tqdm", *flags])
    err = capsys.readouterr().err.strip()
    assert exit_info.value.code == 2 and len(err.splitlines()) == 1 and "Traceback" not in err, err
    assert words in err, err
    assert not (tmp_path / "out").exists()


def test_speed_settings_refuse_what_is_not_a_count(tmp_path):
    with pytest.raises(ValueError, match="--speed_tokens must be a whole number >= 1, got 2.5"):
        SpeedSettings(tokens=2.5)
    with pytest.raises(ValueError, match="--speed_rounds must be a whole number >= 1, got True"):
        SpeedSettings(rounds=True)
    with pytest.raises(TypeError, match="speed must be a SpeedSettings or None, not bool"):
        convert(str(tmp_path / "src"), str(tmp_path / "out"), speed=True)


def test_ideal_counts_the_models_own_weights_and_the_causal_keys():
    """The shapes' count of `forward_flops` against one made from a Llama's parameters and a naive loop over the
    keys each position sees; a MoH config's active share from its budgets (per layer, averaged)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from mhmoe.models.moh_llama import MoHLlamaConfig

    config = LlamaConfig(
        vocab_size=50, hidden_size=24, intermediate_size=40, num_hidden_layers=3, num_attention_heads=6,
        num_key_value_heads=2,
    )  # fmt: skip
    model = LlamaForCausalLM(config)
    linear = sum(p.numel() for n, p in model.model.layers.named_parameters() if n.endswith("proj.weight"))
    prompt, new = 7, 4
    for tokens, keys, logits in ((prompt, range(1, prompt + 1), 1), (new, range(prompt + 1, prompt + new + 1), new)):
        keys_seen = sum(keys)
        core = 2 * 2 * sum(6 * 4 * k for k in keys) * 3  # QK^T and PV, 6 heads of 4, per layer
        want = 2 * tokens * linear + 2 * logits * model.lm_head.weight.numel() + core
        assert forward_flops(config, tokens, keys_seen, logits) == pytest.approx((want, core))

    uniform = MoHLlamaConfig(**config.to_dict(), moh_shared_heads=2, moh_active_heads=2)
    assert active_head_share(uniform) == pytest.approx(4 / 6)
    per_layer = MoHLlamaConfig(
        **config.to_dict(), moh_shared_heads=2, moh_active_heads=2, moh_active_heads_per_layer=[1, 2, 3]
    )
    assert active_head_share(per_layer) == pytest.approx((3 + 4 + 5) / 18)


def test_older_or_partial_speed_records_give_no_row():
    assert speed_rows({}) == [] and speed_rows({"speed": None}) == []
    assert speed_rows({"speed": {"prefill": {"tokens": 3}}}) == []


def test_help_says_what_measuring_costs():
    from mhmoe.convert.cli import build_parser

    text = " ".join(build_parser().format_help().split())
    assert "--measure_speed" in text and "both models in memory at once" in text and "about a minute" in text
    assert "benchmarks/moh_head_sparse.py is the repeatable benchmark" in text


def test_ideal_counts_the_inactive_heads_projections_when_the_step_skips_them():
    """The ideal by hand: 2 layers of d=64, 4 heads of 16, 2 K/V heads, MLP 128, vocab 100; 3 tokens seeing 6 keys
    in all; half of the (token, head) pairs active."""
    from transformers import LlamaConfig

    config = LlamaConfig(
        hidden_size=64, num_attention_heads=4, num_key_value_heads=2, intermediate_size=128, num_hidden_layers=2
    )
    config.vocab_size = 100
    weights = 2 * (64 * 64 * 2 + 64 * 32 * 2 + 3 * 64 * 128)  # q, o; k, v; MLP: per token, both layers
    total = 2 * 3 * weights + 2 * 3 * 64 * 100 + 2 * 2 * 2 * 4 * 16 * 6  # + lm_head + QK^T and PV
    attention_only = speed_module.ideal(config, 0.5, 3, 6, 3)
    assert attention_only["ideal_speed_ratio"] == pytest.approx(total / (total - 0.5 * 2 * 2 * 2 * 4 * 16 * 6))
    for projections in (1, 2):  # o_proj; q_proj and o_proj
        heads_work = 2 * 2 * 2 * 4 * 16 * 6 + projections * 2 * 3 * 2 * 64 * 64
        skipping = speed_module.ideal(config, 0.5, 3, 6, 3, projections=projections)
        assert skipping["ideal_speed_ratio"] == pytest.approx(total / (total - 0.5 * heads_work))
