"""The README demo (`python -m mhmoe.demo`) in a quick configuration: every stage runs and reports real numbers."""

import json

from mhmoe import demo


def test_quick_demo_end_to_end(tmp_path, capsys):
    out = tmp_path / "demo"
    summary = demo.main(["--quick", "--steps", "30", "--skip_recovery", "--output_dir", str(out)])

    assert summary["ppl_after"] < 0.6 * summary["ppl_before"], summary  # training learned something
    assert summary["max_logit_diff"] < 1e-5  # the Auto-reloaded model is the trained one
    assert summary["sample"].startswith(demo.PROMPT) and len(summary["sample"]) > len(demo.PROMPT)

    config = json.loads((out / "model" / "config.json").read_text())
    assert config["model_type"] == "mhmoe" and config["moh_active_heads"] == 1 and config["moe_heads"] == 2
    assert (out / "model" / "model.safetensors").exists() and not list((out / "model").glob("*.bin"))

    # each token's sub-tokens pick top-2 experts; MoH: 2 shared heads always on, 1 of the 2 routed heads per token
    assert all(abs(sum(layer) - 2.0) < 1e-5 for layer in summary["expert_load"])
    assert all(layer[:2] == [1.0, 1.0] and abs(sum(layer[2:]) - 1.0) < 1e-5 for layer in summary["head_load"])
    assert (out / "expert_load.png").stat().st_size > 1000 and (out / "head_load.png").stat().st_size > 1000

    metrics, routing = summary["lm_eval"]["metrics"], summary["lm_eval"]["routing"]
    assert 1.0 < metrics["token_perplexity"] < 512 and metrics["bits_per_byte"] > 0
    assert routing["activated_heads_pct"] == 75.0
    printed = capsys.readouterr().out
    assert "held-out perplexity" in printed and "greedy sample" in printed and "mhmoe-eval" in printed
    assert json.loads((out / "demo_summary.json").read_text())["ppl_after"] == summary["ppl_after"]
    from tests.test_no_local_paths import local_paths

    assert local_paths(out, [tmp_path]) == {}  # its records name no local path
