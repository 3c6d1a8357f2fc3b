"""benchmarks/reproduce/moh_convert_real*.py: the dense control is tuned exactly as the MoH conversion is, the texts of
other domains, the tune stage end to end on a tiny Llama (9 heads, as SmolLM2), and the report's goal lines."""

import dataclasses
import json
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "benchmarks" / "reproduce"))

import moh_convert_real as real  # noqa: E402
import moh_convert_real_recovery as recovery  # noqa: E402
import moh_convert_real_report as report  # noqa: E402

STATUS = """Package: zlib1g
Status: install ok installed
Description: compression library - runtime
 zlib is a library implementing the deflate compression method.
 .
 This package includes the shared library.
Homepage: https://zlib.net/

Package: adduser
Version: 3.134
Description: add and remove users and groups
 This package includes the 'adduser' and 'deluser' commands.
Conffiles:
 /etc/adduser.conf cc3493ecd2d09837ffdcc3e25fdfff18

Package: no-description
Version: 1
"""


def test_package_descriptions_are_prose_sorted_by_name():
    assert recovery.package_descriptions(STATUS) == (
        "adduser: add and remove users and groups\nThis package includes the 'adduser' and 'deluser' commands.\n\n"
        "zlib1g: compression library - runtime\nzlib is a library implementing the deflate compression method.\n\n"
        "This package includes the shared library."
    )


def _args(tmp_path, **changes):
    parser_defaults = dict(
        gguf_dir=str(tmp_path / "gguf"),
        workdir=str(tmp_path / "work"),
        tune_steps=12,
        tune_eval_every=4,
        tune_lr=1e-4,
        eval_blocks=12,
        tune_eval_blocks=8,
        tune_recipe=None,
        tune_head_budget="uniform",
    )
    return type("Args", (), {**parser_defaults, **changes})()


def test_the_dense_control_gets_the_same_training_arguments(tmp_path):
    """mhmoe-train's parse of the dense control's flags and mhmoe-convert's parse of the MoH run's flags give the same
    TrainArguments (every field mhmoe-convert passes on), but for the model and the output folder."""
    from mhmoe.convert.cli import build_parser as convert_parser
    from mhmoe.training.cli import build_parser as train_parser

    args, data = _args(tmp_path), tmp_path / "data"
    dense = recovery.dense_argv("dense", tmp_path / "d", data, args, seed=1)
    moh = recovery.moh_argv("dense", tmp_path / "m", data, args, 1, "7/9", ("importance", "l2_relative"), False)
    (train_args,) = train_parser().parse_args_into_dataclasses(args=dense)
    conversion, tune = convert_parser().parse_args_into_dataclasses(args=moh)
    tune = dataclasses.asdict(tune)
    dense_fields = {k: v for k, v in dataclasses.asdict(train_args).items() if k in tune}
    assert dense_fields == tune
    assert tune["seed"] == 1 and tune["weight_decay"] == 0.1 and tune["eval_at_start"] is True  # the recipe's
    assert train_args.model_name_or_path == "dense" and conversion.input_dir == "dense"
    assert conversion.active_heads_ratio == pytest.approx(7 / 9) and conversion.moh_router == "l2_relative"
    five = recovery.moh_argv("dense", tmp_path / "m", data, args, 1, "5/9", ("first", "l2"), True)
    conversion, _ = convert_parser().parse_args_into_dataclasses(args=five)
    assert conversion.active_heads_ratio == pytest.approx(5 / 9) and conversion.distill
    assert recovery.recipe_tag(args) is None


def test_another_recipe_is_converted_as_asked_and_tagged(tmp_path):
    """--tune_recipe / --tune_head_budget: the MoH run converts with that recipe as it stands (no shared-head or router
    override) and its entries carry a tag that keeps them apart from the section's recipe."""
    from mhmoe.convert.cli import build_parser as convert_parser

    args = _args(tmp_path, tune_recipe="paper", tune_head_budget="calibrated")
    argv = recovery.moh_argv("dense", tmp_path / "m", tmp_path / "data", args, 0, "7/9", ("importance", "x"), False)
    conversion, _ = convert_parser().parse_args_into_dataclasses(args=argv)
    assert conversion.recipe == "paper" and conversion.head_budget == "calibrated"
    assert "--moh_router" not in argv and "--shared_heads_by" not in argv
    assert recovery.recipe_tag(args) == "recipe paper, calibrated head budgets"
    entries = [{"model": "MoH tuned", "budget": "7/9", "seed": 0}]
    recovery._put(entries, {"model": "MoH tuned", "budget": "7/9", "seed": 0, "recipe": recovery.recipe_tag(args)})
    assert len(entries) == 2  # the tagged run does not replace the section recipe's


def test_commands_are_recorded_with_placeholders(tmp_path):
    args = _args(tmp_path)
    argv = ["--gguf_dir", args.gguf_dir, "--workdir", args.workdir + "/x", "--budgets", "7/9"]
    assert real.typed_command(argv, args, "mhmoe-train") == (
        "mhmoe-train --gguf_dir <gguf_dir> --workdir <workdir>/x --budgets 7/9"
    )


def _tiny_dense(folder: Path, tokenizer_dir: str) -> None:
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    tokenizer.chat_template = "{% for m in messages %}{{ m['content'] }}\n{% endfor %}"
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=36,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=9,  # SmolLM2's heads: 3 key/value groups of 3
        num_key_value_heads=3,
        max_position_embeddings=512,
        tie_word_embeddings=True,
    )
    LlamaForCausalLM(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)


def test_tune_stage_end_to_end(tmp_path, tokenizer_dir, monkeypatch, capsys):
    """Dense control, MoH LM and MoH distilled on a tiny 9-head Llama, 2 steps each, two seeds of the control: every
    run and the untuned models evaluated on each text, commands recorded with placeholders, the report's table and
    goal lines computed from those numbers; a second call runs nothing again."""
    work = tmp_path / "work"
    _tiny_dense(work / "dense", tokenizer_dir)
    licence = tmp_path / "GPL-3"
    licence.write_text("Everyone is permitted to copy and distribute verbatim copies of this license. " * 80)
    status = tmp_path / "status"
    status.write_text("\n\n".join(STATUS.replace("zlib1g", f"pkg{i}") for i in range(40)))
    results = tmp_path / "results.json"
    monkeypatch.setattr(real, "OUT", results)
    monkeypatch.setattr(real, "GPL3", str(licence))
    monkeypatch.setattr(recovery, "DPKG_STATUS", str(status))
    common = ["--stage", "tune", "--gguf_dir", str(tmp_path), "--workdir", str(work), "--tune_steps", "2"]
    common += ["--tune_eval_every", "1", "--tune_eval_blocks", "1", "--eval_blocks", "2"]
    tune = recovery.stage_tune  # as run.py passes it (moh_convert_real never imports its tune stage: no circle)
    real.main(common + ["--runs", "dense", "lm", "distill", "--seeds", "0"], stage_tune=tune)
    real.main(common + ["--runs", "dense", "--seeds", "0", "1"], stage_tune=tune)
    out = capsys.readouterr().out
    assert "parent tuned seed 0: already in the results" in out
    data = json.loads(results.read_text())
    tune = data["tune"]
    assert {k: t["tokens"] for k, t in tune["texts"].items()} == {"python_docs": 256, "gpl3": 512, "packages": 512}
    assert [(r["model"], r["budget"], r["seed"]) for r in tune["runs"]] == [
        ("parent tuned", None, 0),
        ("MoH tuned", "7/9", 0),
        ("MoH distilled", "7/9", 0),
        ("parent tuned", None, 1),
    ]
    assert [(r["model"], r["budget"]) for r in tune["untuned"]] == [("parent", None), ("MoH zero-shot", "7/9")]
    for entry in tune["runs"] + tune["untuned"]:
        assert set(entry["ppl"]) == {"python_docs", "gpl3", "packages"}
        assert all(1 < v < 10 * len(tune["texts"]) * 1000 for v in entry["ppl"].values())
    runs = {(r["model"], r["seed"]): r for r in tune["runs"]}
    dense0, moh0 = runs[("parent tuned", 0)], runs[("MoH tuned", 0)]
    assert dense0["command"].startswith("mhmoe-train --model_name_or_path <workdir>/dense --output_dir <workdir>/")
    assert moh0["command"].startswith("mhmoe-convert --input_dir <workdir>/dense")
    assert "--seed 0" in moh0["command"] and "--weight_decay 0.1" in dense0["command"]
    assert dense0["driver"].startswith("python benchmarks/reproduce/run.py moh_convert_real --stage tune --gguf_dir ")
    assert str(tmp_path) not in results.read_text()
    assert [p["tokens"] for p in dense0["curve"]] == [0, 1024, 2048]  # the trainer's own evaluation, step 0 first
    assert dense0["ppl"] != runs[("parent tuned", 1)]["ppl"]  # the seed changes the data order
    # the trainer's final validation and the stage's own evaluation read the same Python-docs text
    assert dense0["ppl"]["python_docs"] == pytest.approx(dense0["curve"][-1]["ppl"], rel=1e-3)
    # the tuned models are the ones on disk: reloading the control's output gives the recorded perplexity
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(work / "tune" / "seed0" / "dense"), dtype=torch.float32).eval()
    gpl = recovery.eval_texts(
        __import__("transformers").AutoTokenizer.from_pretrained(str(work / "dense")),
        _args(tmp_path, eval_blocks=2, tune_eval_blocks=1),
    )["gpl3"]
    assert real.perplexity(model, gpl)["ppl"] == pytest.approx(dense0["ppl"]["gpl3"], rel=1e-5)

    (goal,) = [r for r in report.goal_rows(tune) if r["model"] == "MoH tuned" and r["text"] == "gpl3"]
    assert goal["ratios"] == {0: pytest.approx(moh0["ppl"]["gpl3"] / dense0["ppl"]["gpl3"])}
    assert goal["met"] == (goal["ratios"][0] <= report.GOAL)
    md = (tmp_path / "results.md").read_text()
    assert "## Recovery against a dense control" in md
    assert f"| parent tuned | 1 | {runs[('parent tuned', 1)]['ppl']['python_docs']:.2f} (×" in md
    verdict = "met" if goal["met"] else "NOT met"
    assert f"- MoH tuned 7/9 on GPL-3 licence: seed 0 ×{goal['ratios'][0]:.3f}" in md and f"**{verdict}**" in md


def test_goal_rows_compare_each_seed_with_its_own_control():
    tune = {
        "texts": {"gpl3": {}, "packages": {}},
        "untuned": [{"model": "parent", "budget": None, "seed": None, "ppl": {"gpl3": 30.0, "packages": 40.0}}],
        "runs": [
            {"model": "parent tuned", "budget": None, "seed": 0, "ppl": {"gpl3": 20.0, "packages": 30.0}},
            {"model": "parent tuned", "budget": None, "seed": 1, "ppl": {"gpl3": 25.0, "packages": 30.0}},
            {"model": "MoH tuned", "budget": "7/9", "seed": 0, "ppl": {"gpl3": 21.0, "packages": 36.0}},
            {"model": "MoH tuned", "budget": "7/9", "seed": 1, "ppl": {"gpl3": 25.0, "packages": 30.0}},
        ],
    }
    rows = {(r["model"], r["text"]): r for r in report.goal_rows(tune)}
    assert rows[("MoH tuned", "gpl3")]["ratios"] == {0: pytest.approx(1.05), 1: pytest.approx(1.0)}
    assert rows[("MoH tuned", "gpl3")]["met"]
    assert rows[("MoH tuned", "packages")]["ratios"] == {0: pytest.approx(1.2), 1: pytest.approx(1.0)}
    assert not rows[("MoH tuned", "packages")]["met"]  # one seed misses it
    assert rows[("MoH tuned", "gpl3")]["untuned"] == pytest.approx(23 / 30)  # seeds' mean ÷ the untuned parent
