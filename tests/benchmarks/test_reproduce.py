"""The reproduction harness (benchmarks/reproduce/): quick runs end to end, the tables' parity, committed results."""

import json
import re
import sys
from pathlib import Path

import pytest

from mhmoe import matched_to_smoe, moe_layer_cost

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "benchmarks" / "reproduce"))

import compare  # noqa: E402
import harness  # noqa: E402
import make_splits  # noqa: E402
import run  # noqa: E402
import tables  # noqa: E402


def test_quick_table_end_to_end(tmp_path):
    run.main(["mhmoe_table1", "--quick", "--seeds", "0", "1", "--out", str(tmp_path)])
    data = json.loads((tmp_path / "reproduce_mhmoe_table1_quick.json").read_text())
    assert list(data["cells"]) == ["Dense", "SMoE", "Fine-grained SMoE", "MH-MoE h=2", "MH-MoE h=3"]
    for cell in data["cells"].values():
        assert [r["seed"] for r in cell["runs"]] == [0, 1]
        for r in cell["runs"]:
            assert [p["step"] for p in r["eval"]] == [3, 6]  # the paper's two columns: half and end of training
            assert all(1 < p["ppl"] < data["scale"]["vocab"] * 2 for p in r["eval"])
        ppls = [r["eval"][-1]["ppl"] for r in cell["runs"]]
        assert cell["summary"]["final"]["mean"] == pytest.approx(sum(ppls) / 2)
        assert cell["summary"]["final"]["min"] == min(ppls) and cell["summary"]["final"]["max"] == max(ppls)
    assert data["cells"]["Dense"]["runs"][0]["eval"] != data["cells"]["Dense"]["runs"][1]["eval"]  # seeds differ
    assert (tmp_path / "reproduce_mhmoe_table1_quick.md").read_text() == harness.markdown_table(data)
    assert (tmp_path / "reproduce_mhmoe_table1_quick.png").stat().st_size > 1000
    from huggingface_hub import ModelCard  # the cards parse offline, with the results in their model-index

    card = ModelCard((tmp_path / "cards" / "mhmoe_table1_quick" / "mh-moe-h-3.md").read_text())
    (result,) = card.data.eval_results
    assert result.metric_type == "perplexity"
    assert result.metric_value == pytest.approx(data["cells"]["MH-MoE h=3"]["summary"]["final"]["mean"], rel=1e-4)


def test_chunked_runs_resume_merge_and_stop_at_a_deadline(tmp_path, capsys):
    """One file per (cell, seed), written as it finishes with its provenance; a rerun skips what is there; --merge
    builds the table from the files; a deadline that no run fits stops before training anything."""
    out = tmp_path / "D"
    args = ["mhmoe_table1", "--quick", "--cells", "smoe", "mhmoe_h3", "--seeds", "0", "--out", str(out)]
    assert run.main(args) == 0
    files = sorted((out / "runs" / "mhmoe_table1_quick").glob("*.json"))
    assert [f.name for f in files] == ["mhmoe_h3_seed0.json", "smoe_seed0.json"]
    record = json.loads(files[0].read_text())
    assert record["cell"] == "MH-MoE h=3" and record["run"]["seed"] == 0
    prov = record["run"]["provenance"]
    assert set(prov) >= {
        "commit",
        "dirty",
        "started_utc",
        "finished_utc",
        "device",
        "precision",
        "routing_backend",
        "kernel_fallback",
        "versions",
        "corpus",
    }
    assert prov["routing_backend"] == "torch" and prov["kernel_fallback"] is False  # CPU: the reference
    assert prov["precision"]["mixed_precision"] == "no" and set(prov["versions"]) >= {"torch", "transformers", "triton"}
    assert prov["corpus"]["train_sha256"] == harness.file_sha256(out / "cache" / "train-subset.jsonl")
    assert prov["started_utc"] <= prov["finished_utc"]
    assert [p["step"] for p in record["run"]["eval"]] == [3, 6]
    cached = (p.name for p in (out / "cache").iterdir())
    cache = sorted(name.split("-")[0] for name in cached if name.startswith(("tokenizer", "blocks")))
    assert cache == ["blocks", "blocks", "tokenizer"]  # train and validation packed once, one tokenizer
    mtimes = {f: f.stat().st_mtime_ns for f in files}
    capsys.readouterr()

    assert run.main(args + ["--seeds", "0"]) == 0  # rerun: nothing trained again
    assert "already in" in capsys.readouterr().out
    assert {f: f.stat().st_mtime_ns for f in files} == mtimes

    table = out / "reproduce_mhmoe_table1_quick.json"
    table.unlink()
    assert run.main(["mhmoe_table1", "--merge", str(out)]) == 0
    data = json.loads(table.read_text())
    assert list(data["cells"]) == ["SMoE", "MH-MoE h=3"]  # table order
    assert data["cells"]["MH-MoE h=3"]["runs"][0]["eval"] == record["run"]["eval"]
    assert (out / "reproduce_mhmoe_table1_quick.md").read_text() == harness.markdown_table(data)
    assert (out / "cards" / "mhmoe_table1_quick" / "mh-moe-h-3.md").is_file()

    capsys.readouterr()
    assert (
        run.main(
            ["mhmoe_table1", "--quick", "--cells", "dense", "--seeds", "0", "--out", str(out), "--deadline", "0.0001"]
        )
        == 0
    )
    printed = capsys.readouterr().out
    assert "deadline: not starting Dense seed 0" in printed and "Rerun the same command" in printed
    assert not (out / "runs" / "mhmoe_table1_quick" / "dense_seed0.json").exists()


def test_runs_go_seed_by_seed_in_priority_order_into_one_bundle_and_seed_a_rerun(tmp_path, monkeypatch):
    """Seed 0 of every cell (in the --cells order) before any seed 1; a run whose estimate does not fit what is left of
    the deadline is not started; the bundle holds every finished run after each one, seeds a rerun in a fresh folder,
    and merges into the table; merged_from names no local path."""
    clock = [1000.0]
    trained = []

    def fake_run_cell(config, seed, scale, files, tokenizer, workdir, **kwargs):
        trained.append((config.moe_heads, seed))
        clock[0] += 25.0  # each run takes 25 s of the deadline
        point = {"step": scale["steps"], "tokens": 1000, "ppl": 100.0 + seed + config.moe_heads}
        return {
            "seed": seed,
            "steps": scale["steps"],
            "tokens": 1000,
            "seconds": 25.0,
            "eval": [point],
            "provenance": {"device": harness.device_name(), "precision": {"mixed_precision": "no"}},
        }

    monkeypatch.setattr(harness, "run_cell", fake_run_cell)
    monkeypatch.setattr(run.time, "time", lambda: clock[0])
    monkeypatch.setattr(run.Deadline, "estimate", lambda self, *args, **kwargs: (25.0, "test"))
    out, bundle = tmp_path / "A", tmp_path / "A" / "bundle.json"
    args = [
        "mhmoe_table1",
        "--quick",
        "--cells",
        "mhmoe_h3",
        "smoe",
        "dense",
        "--seeds",
        "0",
        "1",
        "--out",
        str(out),
        "--bundle",
        str(bundle),
        "--deadline",
        str(80 / 60),
        "--started",
        str(clock[0]),
    ]
    assert run.main(args) == 0
    assert trained == [(3, 0), (1, 0), (1, 0)]  # h=3, SMoE, dense (moe_heads 1), all seed 0; then 75 s are gone
    data = json.loads(bundle.read_text())
    assert data["format"] == run.BUNDLE_FORMAT and {"commit", "dirty"} <= set(data)
    assert sorted((r["cell"], r["run"]["seed"]) for r in data["runs"]) == [("Dense", 0), ("MH-MoE h=3", 0), ("SMoE", 0)]

    trained.clear()  # a fresh folder seeded from the bundle alone: only the seed-1 runs are left
    fresh = tmp_path / "B"
    args = [
        "mhmoe_table1",
        "--quick",
        "--cells",
        "mhmoe_h3",
        "smoe",
        "dense",
        "--seeds",
        "0",
        "1",
        "--out",
        str(fresh),
        "--seed_from",
        str(bundle),
    ]
    assert run.main(args) == 0
    assert trained == [(3, 1), (1, 1), (1, 1)]
    with pytest.raises(SystemExit, match="trains 3: a table mixes no training lengths"):
        run.main(args + ["--steps", "3"])

    table = tmp_path / "C"
    assert run.main(["mhmoe_table1", "--merge", str(bundle), "--out", str(table)]) == 0
    merged = json.loads((table / "reproduce_mhmoe_table1_quick.json").read_text())
    assert list(merged["cells"]) == ["Dense", "SMoE", "MH-MoE h=3"]  # table order
    assert merged["merged_from"] == ["A/bundle.json (outside the repository)"]
    assert run.source_name(REPO / "benchmarks" / "results") == "benchmarks/results"


def test_deadline_estimate_uses_finished_runs_then_probe_files_of_the_cell(tmp_path):
    scale = tables.SCALES["quick"]  # 6 steps
    config = tables.smoe(scale)
    for seed, seconds, steps in ((0, 42.0, 6), (1, 30.0, 3)):  # the slowest, scaled to this run's steps: 60 s
        record = {
            "format": run.RUN_FORMAT,
            "run": {
                "seed": seed,
                "seconds": seconds,
                "steps": steps,
                "provenance": {"device": "dev", "precision": {"mixed_precision": "bf16"}},
            },
        }
        harness.atomic_write_text(run.run_path(tmp_path, "mhmoe_table1", "quick", "SMoE", seed), json.dumps(record))
    deadline = run.Deadline(10)
    seconds, how = deadline.estimate(tmp_path, "mhmoe_table1", "quick", "SMoE", config, scale, "dev", "bf16")
    assert seconds == 60.0 and "slowest of 2 finished" in how
    probe = tmp_path / "probe.json"  # a --probe result of another machine, then of this one
    cells = {"SMoE": {"ms_per_step": 1000.0}}
    tokens = scale["batch"] * scale["block"]
    probe.write_text(
        json.dumps({"device": "other", "mixed_precision": "bf16", "tokens_per_step": tokens, "cells": cells})
    )
    seconds, how = deadline.estimate(tmp_path, "mhmoe_table1", "quick", "SMoE", config, scale, "other", "no", [probe])
    assert "probe:" in how and 0 < seconds < 60  # precision differs: measured here instead
    seconds, how = deadline.estimate(tmp_path, "mhmoe_table1", "quick", "SMoE", config, scale, "other", "bf16", [probe])
    assert seconds == pytest.approx(6 * 1.25) and "probe.json: 1000.0 ms/step" in how
    (tmp_path / "runs" / "mhmoe_table1_quick" / "broken_seed0.json").write_text("{")  # half-written: not finished
    assert run.read_run(tmp_path / "runs" / "mhmoe_table1_quick" / "broken_seed0.json") is None


def test_unknown_cells_and_the_gpu_scale_without_the_corpus_are_refused(tmp_path, monkeypatch):
    with pytest.raises(SystemExit, match="has no cell 'nope'.*smoe \\(SMoE\\)"):
        run.select_cells("mhmoe_table1", tables.SCALES["quick"], ["nope"])
    assert run.cell_id("MH-MoE h=3") == "mhmoe_h3" and run.cell_id("Fine-grained SMoE") == "finegrained_smoe"
    monkeypatch.setattr(harness, "CORPUS", tmp_path / "no-corpus")
    with pytest.raises(harness.CorpusMissing, match="scripts/get_corpus.sh.*carry data/corpus"):
        harness.data_files("gpu", tmp_path / "cache")


def test_quick_fig2_end_to_end(tmp_path):
    run.main(["moh_fig2", "--quick", "--seeds", "0", "--out", str(tmp_path)])
    data = json.loads((tmp_path / "reproduce_moh_fig2_quick.json").read_text())
    (result,) = data["runs"]
    assert result["active_heads"] == "6/8"  # 75% of the heads, the paper's setting
    assert set(result["curves"]) == {"MoH 75% (converted)", "dense control"}
    assert result["curves"]["MoH 75% (converted)"][0]["tokens"] == 0  # the converted model before tuning
    assert result["curves"]["MoH 75% (converted)"][0]["ppl"] == pytest.approx(result["moh_ppl_before_tuning"])
    assert (tmp_path / "reproduce_moh_fig2_quick.md").read_text() == harness.fig2_markdown(data)
    from mhmoe.convert import recipe

    assert result["conversion"]["moh_straight_through"] == recipe.STRAIGHT_THROUGH  # what the converter set
    assert result["conversion"]["moh_router"] == "l2" and "workdir" not in result  # no local path in results
    assert result["conversion"]["recipe"]  # the converter's record of the head recipe
    assert {"commit", "dirty", "env"} <= set(data)


def test_fig2_refuses_a_scale_it_has_not(capsys):
    with pytest.raises(SystemExit):
        run.main(["moh_fig2", "--scale", "gpu_slice"])
    assert "moh_fig2 has the scales cpu, cpu_long, gpu, not gpu_slice" in capsys.readouterr().err


@pytest.mark.parametrize("scale", ["cpu", "gpu", "gpu_slice"])
def test_every_table_is_matched_to_the_top1_smoe(scale):
    """FLOPs and parameter parity as the paper sets it: equal activated expert + head/merge MACs (the routers' d·E
    terms aside) and MoE-layer parameters (routers aside) within the paper's own rounding of E to a multiple of 8
    (3.125%: its h=2 and h=3 models); MoE every second layer."""
    smoe = tables.smoe(tables.SCALES[scale])
    reference = moe_layer_cost(smoe)
    d = smoe.hidden_size
    for name in ("mhmoe_table1", "mhmoe_table2", "mhmoe_ablation", "mhmoe_capacity"):
        for cell, config in tables.TABLES[name][0](tables.SCALES[scale]).items():
            if config.decoder_sparse_step == 0:
                continue
            assert config.decoder_sparse_step == 2 and config.router_aux_loss_mode == "top1_sum", cell
            cost = moe_layer_cost(config)
            shared = 3 * d * config.shared_expert_intermediate_size
            macs = cost.macs_per_token - d * config.num_experts - shared  # routers aside
            assert macs == pytest.approx(reference.macs_per_token - d * 8, rel=0.02), (name, cell)
            params = cost.params - cost.router_params - shared
            assert params == pytest.approx(reference.params - reference.router_params, rel=1 / 32), (name, cell)


def test_ablations_round_experts_as_the_paper_unless_that_breaks_parity():
    """E a multiple of 8 (the paper's 40 for h=2) where that stays within 3.125% of the SMoE's parameters; the
    one-layer ablations' exact solve is 36.0, halfway between 32 and 40 (-10.9% / +10.9%): E = 36, parameters equal."""
    cells = tables.ablations(tables.SCALES["cpu"])
    assert {name: c.num_experts for name, c in cells.items()} == {
        "MH-MoE h=2": 40,
        "w/o head layer": 36,
        "w/o merge layer": 36,
        "w/o both": 32,
    }
    source = tables.smoe(tables.SCALES["cpu"])
    assert tables.parameter_gap(cells["w/o head layer"], source) == 0.0
    assert tables.parameter_gap(cells["MH-MoE h=2"], source) == pytest.approx(-1 / 32)
    rounded_to_8 = matched_to_smoe(source, moe_heads=2, num_experts_per_tok=2, moe_head_layer=False)
    assert rounded_to_8.num_experts == 32 and tables.parameter_gap(rounded_to_8, source) < -0.1  # the old sizing


def test_moh_table4_head_budgets():
    cells = tables.moh_table4(tables.SCALES["cpu"])
    active = {
        name: (c.moh_shared_heads or 0) + (c.moh_active_heads or c.num_attention_heads) for name, c in cells.items()
    }
    heads = cells["MHA (100% heads)"].num_attention_heads
    assert active == {"MHA (100% heads)": heads, "MoH 75% heads": heads * 3 // 4, "MoH 50% heads": heads // 2}


@pytest.mark.parametrize("path", sorted((REPO / "benchmarks" / "results").glob("reproduce_*.json")), ids=str)
def test_committed_tables_and_cards_are_what_the_command_prints(path, tmp_path):
    data = json.loads(path.read_text())
    render = harness.fig2_markdown if data["table"] == "moh_fig2" else harness.markdown_table
    assert path.with_suffix(".md").read_text() == render(data)
    assert path.with_suffix(".png").is_file()
    if data["table"] != "moh_fig2":
        for card in harness.write_cards(data, tmp_path):
            assert (path.parent / "cards" / card.parent.name / card.name).read_text() == card.read_text()


def test_make_splits_is_by_document_and_deterministic(tmp_path):
    source = tmp_path / "src"
    for i in range(60):
        (source / f"d{i // 10}").mkdir(parents=True, exist_ok=True)
        (source / f"d{i // 10}" / f"doc{i}.rst.txt").write_text(f"document {i} " + "word " * 30)
    (source / "stub.rst.txt").write_text("too short")
    outs = []
    for name in ("a", "b"):
        make_splits.main(["--source", f"pkg={source}", "--out", str(tmp_path / name)])
        outs.append({s: (tmp_path / name / f"{s}.jsonl").read_text() for s in ("train", "validation", "test")})
    assert outs[0] == outs[1]
    docs = [json.loads(line)["text"] for split in outs[0].values() for line in split.splitlines()]
    assert sorted(docs) == sorted((f"document {i} " + "word " * 30).strip() for i in range(60))  # each once; no stub
    manifest = json.loads((tmp_path / "a" / "manifest.json").read_text())
    assert sum(s["documents"] for s in manifest["splits"].values()) == 60
    assert not list(tmp_path.glob(".a-*"))  # no temporary folder left


def test_moe_cells_use_the_official_preset():
    """Every top-k MoE cell runs as the official code did (raw gates, capacity k·ceil(S/E), head/merge bias), except
    the capacity table's dropless pair; Table 2's shared expert is full size (the SMoE expert's width)."""
    scale = tables.SCALES["cpu"]
    assert tables.CONVENTIONS == "official"
    for name in ("mhmoe_table1", "mhmoe_table2", "mhmoe_ablation", "mhmoe_capacity", "bitnet_table3"):
        for cell, c in tables.TABLES[name][0](scale).items():
            if c.decoder_sparse_step == 0:
                continue
            assert c.norm_topk_prob is False, (name, cell)
            dropless = "dropless" in cell
            assert (c.capacity_factor, c.capacity_rounding) == ((None, "switch") if dropless else (1.0, "official"))
            assert c.moe_layer_bias == bool(c.moe_head_layer or c.moe_merge_layer), (name, cell)
    table2 = tables.TABLES["mhmoe_table2"][0](scale)
    assert {c.shared_expert_intermediate_size for c in table2.values()} == {scale["smoe_intermediate"]}


def test_variant_tables():
    """Table 3 is Table 1 as BitNet b1.58 (the official code's quantised layers and FFN norm); the Lory comparison
    holds total parameters within rounding and uses Lory routing where it says so."""
    scale = tables.SCALES["cpu"]
    bitnet = tables.bitnet_table3(scale)
    assert list(bitnet) == list(tables.table1(scale))
    assert all(
        c.linear_type == "bitnet_b158"
        and c.bitnet_quantized_layers == "official"
        and c.bitnet_ffn_norm == "before_down"
        for c in bitnet.values()
    )
    lory = tables.lory_comparison(scale)
    assert [c.router_type for c in lory.values()] == ["topk", "topk", "lory", "lory", "lory"]
    assert lory["MH-Lory v2"].lory_expert_pool == "per_head" and lory["MH-Lory v1"].lory_expert_pool == "shared"
    params = {name: moe_layer_cost(c).params for name, c in lory.items()}
    assert params["Lory"] == params["SMoE"] and params["MH-Lory v1"] == params["MH-Lory v2"]
    assert params["MH-Lory v1"] == pytest.approx(params["SMoE"], rel=0.05)


def test_quick_throughput_columns(tmp_path):
    run.main(["lory_comparison", "--quick", "--seeds", "0", "--out", str(tmp_path)])
    data = json.loads((tmp_path / "reproduce_lory_comparison_quick.json").read_text())
    for cell in data["cells"].values():
        assert all(r["train_tokens_per_second"] > 0 and r["inference_tokens_per_second"] > 0 for r in cell["runs"])
    table = (tmp_path / "reproduce_lory_comparison_quick.md").read_text()
    assert "train tokens/s | inference tokens/s |" in table and table == harness.markdown_table(data)


def test_merge_reads_the_committed_one_piece_tables(tmp_path):
    """--merge takes the results JSON written before run files existed (the committed tables): same cells, runs and
    summary as the committed file."""
    committed = json.loads((REPO / "benchmarks" / "results" / "reproduce_mhmoe_table1_cpu.json").read_text())
    assert run.main(["mhmoe_table1", "--merge", str(REPO / "benchmarks" / "results"), "--out", str(tmp_path)]) == 0
    merged = json.loads((tmp_path / "reproduce_mhmoe_table1_cpu.json").read_text())
    assert list(merged["cells"]) == list(committed["cells"])
    for cell, entry in committed["cells"].items():
        assert [r["eval"] for r in merged["cells"][cell]["runs"]] == [r["eval"] for r in entry["runs"]]
        assert merged["cells"][cell]["summary"] == entry["summary"]


def test_comparison_puts_each_cell_beside_its_earlier_result():
    def cell(*finals):
        return {"runs": [{"eval": [{"step": 10, "tokens": 640, "ppl": p}]} for p in finals]}

    old = {"commit": "aaa", "cells": {"SMoE": cell(200.0, 210.0)}}
    new = {"commit": "bbb", "cells": {"SMoE": cell(190.0, 194.0), "MH-MoE h=2": cell(180.0, 181.0)}}
    for data in (old, new):
        for entry in data["cells"].values():
            entry["summary"] = harness.summarise(entry)
    assert compare.comparison(old, new).splitlines() == [
        "| model | library conventions (aaa) | official preset (bbb) |",
        "| --- | --- | --- |",
        "| SMoE | 205.00 (200.00–210.00) | 192.00 (190.00–194.00) |",
        "| MH-MoE h=2 | - | 180.50 (180.00–181.00) |",
    ]


RESULT_FILES = sorted((REPO / "benchmarks" / "results").glob("reproduce_*.json"))
LOCAL_PATH = re.compile(r"(?<![\w.~$<>-])/(?:tmp|work|home|root|Users|usr|var|opt|mnt|private)/|[A-Za-z]:\\\\")


def test_no_local_path_in_any_committed_result():
    """Results, logs, tables and cards under benchmarks/results name no path of the machine that wrote them."""
    offenders = []
    for path in sorted((REPO / "benchmarks" / "results").rglob("*")):
        if path.is_file() and path.suffix in (".json", ".md", ".log", ".txt"):
            offenders += [
                f"{path.relative_to(REPO)}:{n}"
                for n, line in enumerate(path.read_text().splitlines(), 1)
                if LOCAL_PATH.search(line)
            ]
    assert not offenders, offenders[:10]
    assert (
        LOCAL_PATH.search('"/tmp/rr/cpu"')
        and LOCAL_PATH.search("to /work/main/outputs")
        and not LOCAL_PATH.search("$OUT/gpu_moe.json <checkout>/src benchmarks/results")
    )


@pytest.mark.parametrize("path", RESULT_FILES, ids=lambda p: p.name)
def test_every_committed_result_records_its_provenance(path):
    """Each run: its commit and dirty flag; each MoE cell: the official preset's fields it ran with; Fig. 2: the
    converter's router and straight-through mode."""
    data = json.loads(path.read_text())
    if data["table"] == "moh_fig2":
        assert data["commit"] and data.get("dirty") is not None
        for run in data["runs"]:
            assert run["conversion"]["moh_router"] and "moh_straight_through" in run["conversion"]
        return
    for name, cell in data["cells"].items():
        for run in cell["runs"]:
            assert run["provenance"].get("commit") and run["provenance"].get("dirty") is not None, (name, run["seed"])
        if cell["parity"].get("moe_layers") and cell["config"].get("router_type", "topk") == "topk":
            assert {"norm_topk_prob", "router_aux_loss_mode", "num_experts", "moe_heads"} <= set(cell["config"]), name


@pytest.mark.parametrize("doc", ["README.md", "benchmarks/README.md", "benchmarks/reproduce/README.md"])
def test_ordering_and_overlap_sentences_are_what_the_json_gives(doc):
    """Every ordering/overlap sentence about a reproduction table sits in a claims block generated from its JSON."""
    text = (REPO / doc).read_text()
    assert compare.rewrite_claims(text) == text, f"run: python benchmarks/reproduce/compare.py --write {doc}"
    if doc == "benchmarks/reproduce/README.md":
        blocks = {(m.group(2), m.group(3)) for m in compare.CLAIMS.finditer(text)}
        tables = {tuple(p.stem.removeprefix("reproduce_").rsplit("_", 1)) for p in RESULT_FILES}
        tables = {(t, s) if s != "long" else (t.removesuffix("_cpu"), "cpu_long") for t, s in tables}
        tables = {(t.removesuffix("_gpu"), "gpu_slice") if s == "slice" else (t, s) for t, s in tables}
        assert tables <= blocks, tables - blocks  # every committed table is described by its JSON


def test_claims_say_order_apartness_and_the_papers_ordering():
    def cell(*finals):
        return {"runs": [{"eval": [{"step": 10, "tokens": 640, "ppl": p}]} for p in finals]}

    data = {
        "table": "mhmoe_table2",
        "seeds": [0, 1],
        "cells": {"SMoE": cell(10.0, 11.0), "Fine-grained SMoE": cell(12.0, 13.0), "MH-MoE h=2": cell(9.0, 10.5)},
    }
    for entry in data["cells"].values():
        entry["summary"] = harness.summarise(entry)
    said = compare.claims(data)
    assert "Means: MH-MoE h=2 < SMoE < Fine-grained SMoE." in said
    assert (
        "Seed ranges apart: MH-MoE h=2 below Fine-grained SMoE (by 1.50); SMoE below Fine-grained SMoE (by "
        "1.00); the other 1 pair(s) overlap."
    ) in said
    assert "does not hold in the means: Fine-grained SMoE is not below SMoE." in said
    data["cells"]["Fine-grained SMoE"] = cell(10.4, 10.8)
    data["cells"]["Fine-grained SMoE"]["summary"] = harness.summarise(data["cells"]["Fine-grained SMoE"])
    data["cells"]["SMoE"] = cell(11.0, 11.5)
    data["cells"]["SMoE"]["summary"] = harness.summarise(data["cells"]["SMoE"])
    said = compare.claims(data)
    assert "holds in the means, but the seed ranges do not separate MH-MoE h=2 from Fine-grained SMoE" in said
    data["cells"]["SMoE"] = cell(11.2)  # a cut run: one seed of two
    data["cells"]["SMoE"]["summary"] = harness.summarise(data["cells"]["SMoE"])
    said = compare.claims(data)
    assert "mean of 2 seeds (min–max) (SMoE 1 seed so far): " in said and "SMoE 11.20 (11.20–11.20)" in said
    assert "Seed ranges (one seed's range: its value) apart: " in said
