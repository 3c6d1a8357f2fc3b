"""lm-eval-harness integration, offline: the `mhmoe` model, routing statistics, the eval_tasks suites, the CLI.

The suites run through the real lm-eval machinery (TaskManager, unmodified built-in task configs, simple_evaluate,
the CLI in a subprocess) on a tiny MH-MoE checkpoint. Data comes from a local "hub mirror" (tests/fixtures/
lm_eval_data.py): folders named like the Hub datasets with a few rows of the real fields, found by `datasets` because
lm-eval runs from the mirror's root. MMLU, CEVAL and CMMLU run 2 subjects each (groups of the same name in a test
include dir) so the file stays fast; `test_suite_definitions` checks the full subject lists and shots from the YAML.
"""

import glob
import json
import math
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("lm_eval")

import lm_eval  # noqa: E402

from mhmoe import MHMoEConfig, MHMoEForCausalLM  # noqa: E402
from mhmoe.evaluation import (  # noqa: E402
    analysis,  # noqa: E402
    lm_eval_model,
    suites,
)
from mhmoe.evaluation import cli as eval_cli  # noqa: E402
from tests.fixtures import lm_eval_data as fx  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
SRC = REPO / "src"
SUBSET = {  # test-only groups with the real group names: 2 subjects per multi-subject benchmark
    "mmlu": ["mmlu_anatomy", "mmlu_astronomy"],
    "ceval-valid": ["ceval-valid_computer_network", "ceval-valid_physician"],
    "cmmlu": ["cmmlu_agronomy", "cmmlu_anatomy"],
}
TABLE4_TASKS = {"sciq", "piqa", "winogrande", "openbookqa", "logiqa", "truthfulqa_mc1", "truthfulqa_mc2"}
TABLE5_SHOTS = {
    "gsm8k": 8,
    "truthfulqa_mc1": 0,
    "truthfulqa_mc2": 0,
    "hellaswag": 10,
    "logiqa": 0,
    "boolq": 32,
    "lambada_openai": 0,
    "sciq": 0,
    "piqa": 0,
    "winogrande": 0,
    "nq_open": 32,
    "arc_challenge": 25,
    "arc_easy": 0,
}


# ----------------------------------------------------------------------------------------------------------- fixtures


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    # the test machine is shared: 2 OpenMP threads under contention are ~50x slower than one for these tiny models
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    """Checkpoint, dataset mirror, subject-subset include dir, corpora, and a fresh datasets cache."""
    import datasets

    root = tmp_path_factory.mktemp("lm_eval")
    subset = root / "subset_tasks"
    subset.mkdir()
    for group, tasks in SUBSET.items():
        (subset / f"{group}.yaml").write_text(
            json.dumps({"group": group, "task": tasks, "aggregate_metric_list": [{"metric": "acc"}]})
        )
    tm = suites.task_manager(include_path=str(subset))
    leaves = {}
    for suite in ("moh_llm_suite", "moh_llama3_suite"):
        leaves.update(fx.leaf_task_configs(tm.task_index, suite))
    fx.build_mirror(root / "mirror", leaves)
    cache = root / "hf_datasets_cache"
    saved = datasets.config.HF_DATASETS_CACHE
    datasets.config.HF_DATASETS_CACHE = cache
    yield {
        "root": root,
        "ckpt": fx.build_tiny_checkpoint(root / "ckpt"),
        "mirror": root / "mirror",
        "subset": subset,
        "corpora": fx.write_corpora(root / "corpora"),
        "cache": cache,
    }
    datasets.config.HF_DATASETS_CACHE = saved


def _lm(work, **kwargs):
    return lm_eval_model.MHMoELM(pretrained=str(work["ckpt"]), device="cpu", **{"batch_size": 4, **kwargs})


def _check_routing(stats, moe_layers=2, num_experts=4):
    assert stats["moe_layers"] == moe_layers
    assert stats["routed_rows"] > 0
    assert 0.0 < stats["expert_load_entropy_normalized"] <= 1.0 + 1e-9
    assert 0.0 < stats["expert_load_entropy"] <= math.log(num_experts) + 1e-9
    assert 1.0 - 1e-9 <= stats["expert_max_load_ratio"] <= num_experts
    for layer in stats["moe_per_layer"].values():
        assert layer["num_experts"] == num_experts
        assert sum(layer["expert_load"]) == pytest.approx(1.0)
        assert layer["assignments"] == 2 * layer["routed_rows"]  # top-2, dropless


def _check_table_rows(results, suite, n_columns):
    """Every paper column recomputed from lm-eval's per-task numbers; the average is their unweighted mean."""
    scores = {**results["results"], **results.get("groups", {})}
    rows = results["paper_tables"][suite]
    for table in suites.PAPER_TABLES[suite]:
        row = rows[table.title]
        assert row["missing"] == [] and len(row["columns"]) == n_columns
        for column, entries in table.columns.items():
            expected = sum(scores[task][metric] for task, metric in entries) / len(entries)
            assert row["columns"][column] == pytest.approx(expected)
            assert 0.0 <= row["columns"][column] <= 1.0
        assert row["average"] == pytest.approx(sum(row["columns"].values()) / n_columns)
        assert results["groups"][suite][f"{table.key},none"] == pytest.approx(row["average"])


# ------------------------------------------------------------------------------------------- suite definitions


def test_suite_definitions():
    """The suites expand (through lm-eval's own YAML) to the papers' benchmarks, task variants and shot counts."""
    tm = suites.task_manager()
    llm = fx.leaf_task_configs(tm.task_index, "moh_llm_suite")
    assert set(llm) == TABLE4_TASKS and all(cfg["num_fewshot"] == 0 for cfg in llm.values())

    llama = fx.leaf_task_configs(tm.task_index, "moh_llama3_suite")
    subjects = {p: sorted(t for t in llama if t.startswith(p)) for p in ("mmlu_", "ceval-valid_", "cmmlu_")}
    assert {p: len(v) for p, v in subjects.items()} == {"mmlu_": 57, "ceval-valid_": 52, "cmmlu_": 67}
    for prefix, names in subjects.items():
        assert all(llama[t]["num_fewshot"] == 5 for t in names), prefix
    assert llama["mmlu_anatomy"]["fewshot_split"] == "dev"
    assert llama["ceval-valid_physician"]["validation_split"] == "val"
    rest = {t: cfg["num_fewshot"] for t, cfg in llama.items() if not t.startswith(tuple(subjects))}
    assert rest == TABLE5_SHOTS
    assert llama["lambada_openai"]["dataset_path"] == "EleutherAI/lambada_openai"  # Pythia's LAMBADA (OpenAI)

    # every paper column reads a task or group of its suite; Table 5 and Table E have 14 benchmarks each
    for suite, tables in suites.PAPER_TABLES.items():
        leaves = llm if suite == "moh_llm_suite" else llama
        for table in tables:
            for task, metric in (e for entries in table.columns.values() for e in entries):
                assert task in leaves or task in ("mmlu", "ceval-valid", "cmmlu"), (table.title, task)
                assert "," in metric
    assert [len(t.columns) for t in suites.PAPER_TABLES["moh_llama3_suite"]] == [14, 14]
    assert "CEVAL" not in suites.PAPER_TABLES["moh_llama3_suite"][1].columns
    assert "ARC-E" not in suites.PAPER_TABLES["moh_llama3_suite"][0].columns

    ppl = fx.leaf_task_configs(tm.task_index, "mhmoe_ppl")
    assert set(ppl) == {"mhmoe_ppl_redpajama", "mhmoe_ppl_wikipedia", "mhmoe_ppl_c4"}
    assert all(cfg["output_type"] == "loglikelihood_rolling" for cfg in ppl.values())


# ------------------------------------------------------------------------------------------------- in-process runs


def test_moh_llm_suite_in_process(work, monkeypatch):
    monkeypatch.chdir(work["mirror"])
    lm = _lm(work)
    tm = suites.task_manager(["moh_llm_suite"])
    results = suites.simple_evaluate(model=lm, tasks=["moh_llm_suite"], task_manager=tm, limit=3, bootstrap_iters=0)
    assert set(results["group_subtasks"]["moh_llm_suite"]) == TABLE4_TASKS
    for task in TABLE4_TASKS:
        assert results["n-shot"][task] == 0 and results["results"][task]["sample_len"] == 3
        assert 0.0 <= results["results"][task]["acc,none"] <= 1.0
    _check_table_rows(results, "moh_llm_suite", 6)
    stats = results["config"][lm_eval_model.ROUTING_KEY]
    _check_routing(stats)
    assert stats["moh_layers"] == 0 and "activated_heads_pct" not in stats  # no module exposes head gates


def test_moh_llama3_suite_in_process(work, monkeypatch):
    monkeypatch.chdir(work["mirror"])
    lm = _lm(work, max_length=1024)
    tm = suites.task_manager(["moh_llama3_suite"], include_path=str(work["subset"]))
    results = suites.simple_evaluate(
        model=lm,
        tasks=["moh_llama3_suite"],
        task_manager=tm,
        limit=2,
        bootstrap_iters=0,
        gen_kwargs={"max_gen_toks": 8},
    )
    shots = results["n-shot"]
    assert {t: shots[t] for t in TABLE5_SHOTS} == TABLE5_SHOTS
    assert all(shots[t] == 5 for tasks in SUBSET.values() for t in tasks)
    res = results["results"]
    for key in ("exact_match,strict-match", "exact_match,flexible-extract"):
        assert 0.0 <= res["gsm8k"][key] <= 1.0
    assert 0.0 <= res["nq_open"]["exact_match,remove_whitespace"] <= 1.0
    assert res["lambada_openai"]["perplexity,none"] > 1.0
    for group in SUBSET:
        assert results["groups"][group]["sample_len"] == 4  # 2 subjects x 2 docs, aggregated by lm-eval
    _check_table_rows(results, "moh_llama3_suite", 14)
    _check_routing(results["config"][lm_eval_model.ROUTING_KEY])


def test_routing_statistics_exclude_padding(work, monkeypatch):
    """HFLM right-pads loglikelihood batches without a mask: the counted rows must not depend on the batch size."""
    monkeypatch.chdir(work["mirror"])
    tm = suites.task_manager(["moh_llm_suite"])
    stats = []
    for batch_size in (1, 4):
        lm = _lm(work, batch_size=batch_size, logits_cache=False)
        results = lm_eval.simple_evaluate(model=lm, tasks=["sciq", "piqa"], task_manager=tm, limit=3, bootstrap_iters=0)
        stats.append(results["config"][lm_eval_model.ROUTING_KEY])
    assert stats[0]["routed_rows"] == stats[1]["routed_rows"] > 0
    for layer in stats[0]["moe_per_layer"]:
        loads = [s["moe_per_layer"][layer]["expert_load"] for s in stats]
        assert loads[0] == pytest.approx(loads[1], abs=0.02)


def test_perplexity_tasks(work, monkeypatch):
    """Token/word perplexity and bits per byte equal the values recomputed from the model's own log-likelihoods."""
    corpora = work["corpora"]
    monkeypatch.setenv("MHMOE_PPL_WIKITEXT", str(corpora["wikitext"]))  # env var path; the others via metadata
    metadata = {f"{c}_path": str(corpora[c]) for c in ("redpajama", "wikipedia", "c4")}
    tm = suites.task_manager(["mhmoe_ppl"], metadata=metadata)
    lm = _lm(work, max_length=512)
    results = suites.simple_evaluate(
        model=lm, tasks=["mhmoe_ppl", "mhmoe_ppl_wikitext"], task_manager=tm, bootstrap_iters=0
    )
    assert results["max_length"] == 512
    model, tok = lm.model, lm.tokenizer
    from lm_eval.tasks.wikitext.preprocess_wikitext import wikitext_detokenizer

    for corpus in ("redpajama", "wikipedia", "c4", "wikitext"):
        field = "page" if corpus == "wikitext" else "text"
        docs = [json.loads(line)[field] for line in corpora[corpus].read_text().splitlines()]
        ll = n_tokens = n_words = n_bytes = 0
        for original in docs:
            text = wikitext_detokenizer({"page": original}) if corpus == "wikitext" else original
            ids = tok.encode(text)
            assert len(ids) < 512  # one rolling window: [prefix] + ids[:-1] predicts ids
            with torch.no_grad():
                logits = model(torch.tensor([[tok.bos_token_id] + ids[:-1]])).logits[0]
            ll += logits.float().log_softmax(-1)[torch.arange(len(ids)), ids].sum().item()
            n_tokens, n_words = n_tokens + len(ids), n_words + len(re.split(r"\s+", original))
            n_bytes += len(original.encode("utf-8"))
        got = results["results"][f"mhmoe_ppl_{corpus}"]
        assert got["token_perplexity,none"] == pytest.approx(math.exp(-ll / n_tokens), rel=1e-4)
        assert got["word_perplexity,none"] == pytest.approx(math.exp(-ll / n_words), rel=1e-4)
        assert got["byte_perplexity,none"] == pytest.approx(math.exp(-ll / n_bytes), rel=1e-4)
        assert got["bits_per_byte,none"] == pytest.approx(-ll / n_bytes / math.log(2), rel=1e-4)
        assert 1.0 < got["token_perplexity,none"] < 10 * tok.vocab_size  # an untrained model: near-uniform
    _check_routing(results["config"][lm_eval_model.ROUTING_KEY])

    # plain text, one document per paragraph; and a corpus without a path fails with instructions
    tm = suites.task_manager(["mhmoe_ppl"], metadata={"c4_path": str(corpora["text"])})
    text_run = lm_eval.simple_evaluate(model=lm, tasks=["mhmoe_ppl_c4"], task_manager=tm, bootstrap_iters=0)
    assert text_run["results"]["mhmoe_ppl_c4"]["sample_len"] == len(corpora["text"].read_text().strip().split("\n\n"))
    monkeypatch.delenv("MHMOE_PPL_WIKITEXT")
    with pytest.raises(ValueError, match="MHMOE_PPL_WIKITEXT"):
        suites.task_manager(["mhmoe_ppl"]).load(["mhmoe_ppl_wikitext"])


def test_peft_adapter(work, tmp_path):
    """`peft=DIR` loads a LoRA adapter on the mhmoe checkpoint; hooks still find the routers inside the PEFT model."""
    peft = pytest.importorskip("peft")
    base = MHMoEForCausalLM.from_pretrained(work["ckpt"])
    model = peft.get_peft_model(base, peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"], lora_alpha=8))
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.normal_(std=0.5)  # a fresh LoRA is a no-op; make this one change the model
    model.save_pretrained(tmp_path / "adapter")

    tm = suites.task_manager(["mhmoe_ppl"], metadata={"c4_path": str(work["corpora"]["c4"])})
    ppl = {}
    for name, extra in (("base", {}), ("lora", {"peft": str(tmp_path / "adapter")})):
        lm = _lm(work, **extra)
        results = lm_eval.simple_evaluate(model=lm, tasks=["mhmoe_ppl_c4"], task_manager=tm, bootstrap_iters=0)
        ppl[name] = results["results"]["mhmoe_ppl_c4"]["token_perplexity,none"]
        _check_routing(results["config"][lm_eval_model.ROUTING_KEY])
    assert type(lm.model).__name__.startswith("Peft")
    assert ppl["lora"] != pytest.approx(ppl["base"], rel=1e-3)


def test_cli_user_mistakes_are_one_line_errors(work, tmp_path, capsys):
    """Missing checkpoints, an adapter given as the model, unknown tasks, a ppl task without data or with a --metadata
    path that is missing, empty or blank, --metadata that is not JSON, --batch_size 0, --limit -1, a truncated or
    pickle-only model or adapter, a broken tokenizer.json, an --output_path under a file (before evaluating), a config.json its class refuses, max_length past the model's positions, a Hub suite offline
    without its data, no arguments: exit 2 with the reason in one line, no traceback."""
    adapter = tmp_path / "adapter"
    adapter.mkdir()
    empty, blank = tmp_path / "empty.jsonl", tmp_path / "blank.jsonl"
    empty.write_text("")
    blank.write_text('{"text": "  "}\n')
    (adapter / "adapter_config.json").write_text("{}")
    ckpt = str(work["ckpt"])
    truncated, pickled, bad_config = tmp_path / "truncated", tmp_path / "pickled", tmp_path / "bad_config"
    for folder in (truncated, pickled, bad_config):
        shutil.copytree(ckpt, folder)
    config = json.loads((bad_config / "config.json").read_text())
    config["rope_parameters"] = {"rope_type": "default", "rope_theta": -1.0}  # trains and evaluates to NaN
    (bad_config / "config.json").write_text(json.dumps(config))
    weights = (truncated / "model.safetensors").read_bytes()
    (truncated / "model.safetensors").write_bytes(weights[: len(weights) // 2])
    (pickled / "model.safetensors").rename(pickled / "pytorch_model.bin")  # a pickle-only checkpoint's file name
    pickled_adapter = tmp_path / "pickled_adapter"
    pickled_adapter.mkdir()
    (pickled_adapter / "adapter_config.json").write_text("{}")
    (pickled_adapter / "adapter_model.bin").write_bytes(b"\x80\x04N.")  # what PEFT would torch.load
    broken_tokenizer = tmp_path / "broken_tokenizer"
    shutil.copytree(ckpt, broken_tokenizer)
    (broken_tokenizer / "tokenizer.json").write_bytes(b"{}")
    a_file = tmp_path / "a_file"
    a_file.write_text("not a folder")
    cases = [
        (
            ["--model_args", f"pretrained={ckpt},peft={pickled_adapter}", "--tasks", "mhmoe_ppl_c4"],
            "peft=.*pickled_adapter holds its adapter only as a pickle \\(adapter_model.bin\\); pickles are never "
            "loaded",
        ),
        (
            ["--model_args", f"pretrained={broken_tokenizer}", "--tasks", "mhmoe_ppl_c4"],
            "pretrained=.*broken_tokenizer: .*tokenizer.json does not load as a tokenizer",
        ),
        (
            ["--model_args", f"pretrained={ckpt}", "--tasks", "mhmoe_ppl_c4", "--output_path", f"{a_file}/results"],
            "--output_path .*a_file/results: .*a_file is a file, not a folder",
        ),
        (["--tasks", "mhmoe_ppl_c4"], "give the checkpoint with --model_args pretrained=DIR"),
        (["--model_args", f"pretrained={tmp_path / 'missing'}", "--tasks", "mhmoe_ppl_c4"], "no such directory"),
        (
            ["--model_args", f"pretrained={ckpt},peft={tmp_path / 'nope'}", "--tasks", "mhmoe_ppl_c4"],
            "peft=.*nope: no such directory",
        ),
        (
            ["--model_args", f"pretrained={adapter}", "--tasks", "mhmoe_ppl_c4"],
            "is a LoRA adapter folder: use pretrained",
        ),
        (["--model_args", f"pretrained={ckpt}", "--tasks", "no_such_task"], "Tasks not found: no_such_task"),
        (["--model_args", f"pretrained={ckpt}", "--tasks", "mhmoe_ppl_c4"], "mhmoe_ppl_c4: no data"),
        (
            [
                "--model_args",
                f"pretrained={ckpt}",
                "--tasks",
                "mhmoe_ppl_c4",
                "--metadata",
                json.dumps({"c4_path": str(tmp_path / "nope.jsonl")}),
            ],
            "mhmoe_ppl_c4: c4_path=.*nope.jsonl: no such file",
        ),
        (
            [
                "--model_args",
                f"pretrained={ckpt}",
                "--tasks",
                "mhmoe_ppl_c4",
                "--metadata",
                json.dumps({"c4_path": str(empty)}),
            ],
            "mhmoe_ppl_c4: c4_path=.*empty.jsonl is empty \\(0 bytes\\)",
        ),
        (
            [
                "--model_args",
                f"pretrained={ckpt}",
                "--tasks",
                "mhmoe_ppl_c4",
                "--metadata",
                json.dumps({"c4_path": " , "}),
            ],
            "mhmoe_ppl_c4: c4_path is empty",
        ),
        (
            [
                "--model_args",
                f"pretrained={ckpt}",
                "--tasks",
                "mhmoe_ppl_c4",
                "--metadata",
                json.dumps({"c4_path": str(blank)}),
            ],
            "mhmoe_ppl_c4: .*blank.jsonl holds no non-empty documents",
        ),
        (
            ["--model_args", f"pretrained={ckpt}", "--tasks", "mhmoe_ppl_c4", "--metadata", "{bad"],
            "Invalid JSON: {bad. Hint: Use double quotes for JSON strings. \\(see mhmoe-eval run --help\\)",
        ),
        (
            ["--model_args", f"pretrained={ckpt}", "--tasks", "mhmoe_ppl_c4", "--batch_size", "0"],
            "--batch_size 0: give a number >= 1, 'auto' or 'auto:N'",
        ),
        (
            ["--model_args", f"pretrained={ckpt}", "--tasks", "mhmoe_ppl_c4", "--limit", "-1"],
            "--limit -1: give a number of examples per task \\(>= 1\\) or a fraction in \\(0, 1\\)",
        ),
        (
            ["--model_args", f"pretrained={truncated}", "--tasks", "mhmoe_ppl_c4"],
            "pretrained=.*truncated: .*model.safetensors is not a complete safetensors file",
        ),
        (
            ["--model_args", f"pretrained={pickled}", "--tasks", "mhmoe_ppl_c4"],
            "pretrained=.*pickled: .*pickled holds only pickle checkpoints \\(pytorch_model.bin\\); they are never "
            "unpickled",
        ),
        (
            ["--model_args", f"pretrained={bad_config}", "--tasks", "mhmoe_ppl_c4"],
            "pretrained=.*bad_config: invalid config.json: Invalid MHMoEConfig: rope_theta .* must be a finite "
            "number > 0, got -1.0",
        ),
        (
            ["--model_args", f"pretrained={ckpt},max_length=100000", "--tasks", "mhmoe_ppl_c4"],
            "max_length=100000 is longer than the 2048 positions of .*ckpt \\(a mhmoe model\\): give max_length <= 2048",
        ),
        (
            ["--model_args", f"pretrained={ckpt}", "--tasks", "moh_llm_suite", "--limit", "1"],
            "Couldn't reach '[^']+' on the Hub \\(OfflineModeIsEnabled\\): its data is neither in the datasets cache nor "
            "in a folder of that name here",
        ),
        (
            [],
            "give the checkpoint and the tasks: --model_args pretrained=DIR --tasks TASKS \\(see mhmoe-eval --help\\)",
        ),
    ]
    for argv, message in cases:
        with pytest.raises(SystemExit) as exit_info:
            eval_cli.main(argv)
        err = capsys.readouterr().err
        assert exit_info.value.code == 2 and re.search("mhmoe-eval: error: .*" + message, err), (argv, err[-500:])
        assert "Traceback" not in err


# ----------------------------------------------------------------------------------------------- routing statistics


def test_routing_counts_match_router_logits():
    """Hook counts equal top-k of the router logits the model returns, over real tokens only (mask or lengths)."""
    cfg = MHMoEConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_experts=5,
        num_experts_per_tok=2,
        moe_intermediate_size=16,
        moe_heads=2,
        decoder_sparse_step=1,
        max_position_embeddings=64,
    )
    model = MHMoEForCausalLM(cfg).eval()
    stats = analysis.RoutingStatistics(model)
    assert len(stats.router_names) == 3
    ids = torch.randint(0, 64, (3, 9))
    lengths = [9, 4, 6]
    real = torch.arange(9)[None, :] < torch.tensor(lengths)[:, None]  # right padding
    for use_mask in (True, False):
        stats.reset()
        with torch.no_grad():
            if use_mask:
                out = model(ids, attention_mask=real.long(), output_router_logits=True)
            else:  # the HFLM loglikelihood path: no mask, lengths recorded from its padding
                stats.pending_lengths = lengths
                out = model(ids, output_router_logits=True)
        rows = real.reshape(-1).repeat_interleave(cfg.moe_heads)
        for name, logits in zip(stats.router_names, out.router_logits, strict=True):
            chosen = logits[rows].topk(cfg.num_experts_per_tok, dim=-1).indices
            expected = torch.bincount(chosen.reshape(-1), minlength=cfg.num_experts)
            assert torch.equal(stats.moe[name].counts[: cfg.num_experts], expected), (use_mask, name)
            assert stats.moe[name].rows == sum(lengths) * cfg.moe_heads
    with stats.paused():
        model(ids)
    assert stats.moe[stats.router_names[0]].rows == sum(lengths) * cfg.moe_heads  # paused: nothing counted
    stats.remove()
    model(ids)
    assert stats.moe[stats.router_names[0]].rows == sum(lengths) * cfg.moe_heads  # removed: nothing counted


def test_routing_counts_in_cached_generation():
    """generate_until path: left-padded prompts, then one token per step with a mask covering the past."""
    cfg = MHMoEConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_experts=4,
        num_experts_per_tok=1,
        moe_intermediate_size=16,
        moe_heads=4,
        max_position_embeddings=64,
    )
    model = MHMoEForCausalLM(cfg).eval()
    stats = analysis.RoutingStatistics(model)
    ids = torch.randint(3, 64, (3, 7))
    mask = torch.ones_like(ids)
    mask[1, :3] = 0  # left padding, as HFLM's generate_until batches are
    mask[2, :5] = 0
    new = 4
    with torch.no_grad():
        model.generate(
            ids,
            attention_mask=mask,
            max_new_tokens=new,
            min_new_tokens=new,
            do_sample=False,
            pad_token_id=0,
            eos_token_id=None,
        )
    # prefill: the real prompt tokens; then new - 1 decode steps of one token per sequence
    expected_rows = (int(mask.sum()) + (new - 1) * ids.shape[0]) * cfg.moe_heads
    assert [stats.moe[n].rows for n in stats.router_names] == [expected_rows] * 2


def test_routing_summary_formulas():
    model = torch.nn.Linear(2, 2)
    stats = analysis.RoutingStatistics(model)
    stats.moe["a"] = analysis._LayerCounts(torch.tensor([3, 1, 0, 0, 0]), rows=2)  # 4 experts, nothing dropped
    stats.moe["b"] = analysis._LayerCounts(torch.tensor([1, 1, 1, 1, 4]), rows=4)  # balanced, half dropped
    summary = stats.summary()
    h_a = -(0.75 * math.log(0.75) + 0.25 * math.log(0.25))
    layer_a, layer_b = summary["moe_per_layer"]["a"], summary["moe_per_layer"]["b"]
    assert layer_a["load_entropy"] == pytest.approx(h_a)
    assert layer_a["load_entropy_normalized"] == pytest.approx(h_a / math.log(4))
    assert layer_a["max_load_ratio"] == pytest.approx(3.0)
    assert layer_b["load_entropy_normalized"] == pytest.approx(1.0) and layer_b["max_load_ratio"] == pytest.approx(1.0)
    assert layer_b["dropped_fraction"] == pytest.approx(0.5)
    assert summary["expert_max_load_ratio"] == pytest.approx(2.0)
    assert summary["expert_load_entropy"] == pytest.approx((h_a + math.log(4)) / 2)


def test_moh_activated_heads(work, monkeypatch):
    """MoH head routers are counted: 2 shared + 1 of 2 routed heads on per token -> 75% of 4 heads."""
    monkeypatch.chdir(work["mirror"])
    base = MHMoEForCausalLM.from_pretrained(work["ckpt"])
    config = base.config.to_dict()
    config.update(moh_shared_heads=2, moh_active_heads=1, moh_router="learned")
    model = MHMoEForCausalLM(type(base.config).from_dict(config)).eval()
    assert model.config.num_attention_heads == 4
    from transformers import AutoTokenizer

    lm = lm_eval_model.MHMoELM(pretrained=model, tokenizer=AutoTokenizer.from_pretrained(work["ckpt"]), batch_size=4)
    tm = suites.task_manager(["moh_llm_suite"])
    results = lm_eval.simple_evaluate(model=lm, tasks=["piqa"], task_manager=tm, limit=3, bootstrap_iters=0)
    stats = results["config"][lm_eval_model.ROUTING_KEY]
    assert stats["moh_layers"] == 2
    assert stats["activated_heads_pct"] == pytest.approx(75.0)
    assert all(v["num_heads"] == 4 for v in stats["moh_per_layer"].values())
    _check_routing(stats)
    # counters restart after each evaluation's report
    assert lm.routing_summary()["moe_layers"] == 0


# -------------------------------------------------------------------------------------------------------- the CLI


def test_cli_subprocess(work, tmp_path):
    """`python -m mhmoe.evaluation` (= mhmoe-eval): the documented command, eval_tasks on the include path, results
    written with paper table rows and routing statistics, dtype/batch_size/max_length reaching the model."""
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(SRC), os.environ.get("PYTHONPATH", "")]),
        "HF_HUB_OFFLINE": "1",
        "HF_DATASETS_OFFLINE": "1",
        "HF_DATASETS_CACHE": str(work["cache"]),
        "OMP_NUM_THREADS": "1",
        "TOKENIZERS_PARALLELISM": "false",
    }
    cmd = [
        sys.executable,
        "-m",
        "mhmoe.evaluation",
        "--model",
        "mhmoe",
        "--model_args",
        f"pretrained={work['ckpt']},dtype=bfloat16,max_length=256",
        "--tasks",
        "moh_llm_suite",
        "--device",
        "cpu",
        "--batch_size",
        "4",
        "--limit",
        "2",
        "--output_path",
        str(tmp_path / "out"),
    ]
    proc = subprocess.run(cmd, cwd=work["mirror"], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "routing statistics: MoE layers 2" in proc.stdout and "table4_avg" in proc.stdout
    (path,) = glob.glob(str(tmp_path / "out" / "**" / "results_*.json"), recursive=True)
    results = json.loads(Path(path).read_text())
    assert set(results["group_subtasks"]["moh_llm_suite"]) == TABLE4_TASKS
    assert all(0.0 <= results["results"][t]["acc,none"] <= 1.0 for t in TABLE4_TASKS)
    assert all(results["n-shot"][t] == 0 for t in TABLE4_TASKS)
    _check_table_rows(results, "moh_llm_suite", 6)
    _check_routing(results["config"][lm_eval_model.ROUTING_KEY])
    assert results["config"]["model_dtype"] == "torch.bfloat16" and results["max_length"] == 256
    assert results["config"]["batch_size"] == "4"
