"""mhmoe.hub: exported folders load with `trust_remote_code=True` where mhmoe cannot be imported, evaluate with plain
`lm-eval run --model hf`, and refusals leave nothing behind.

"Without mhmoe" is checked in processes (warm children of the `warm_blocked` server) whose PYTHONPATH is only a folder
with fake `mhmoe` and `triton` packages that raise ImportError (they shadow the installed ones; src/ is not on the
path). Two tiny models are exported once
per module: (a) an MHMoE model with MoE layers (2 MoE heads, shared expert) and MoH attention (learned router,
randomised so that routing matters), from memory; (b) a MoH-LLaMA with the l2 router and straight-through gates, from
a directory.
"""

import contextlib
import glob
import json
import re
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

import mhmoe
from mhmoe import MHMoEForCausalLM, MoHLlamaConfig, MoHLlamaForCausalLM
from mhmoe.hub.cli import main
from mhmoe.hub.export import ExportError, export_pretrained
from mhmoe.hub.remote_code import check_exported_code
from tests.fixtures import lm_eval_data as fx

REPO = Path(__file__).resolve().parents[2]
MOH_LLAMA = dict(
    hidden_size=48,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=6,
    num_key_value_heads=2,
    max_position_embeddings=256,
    moh_shared_heads=1,
    moh_active_heads=2,
    moh_router="l2",
    moh_straight_through=True,
    bos_token_id=0,
    eos_token_id=0,
    pad_token_id=0,
)
MOH_LLAMA_ACTIVE_PCT = 100.0 * (1 + 2) / 6

# Loads every exported folder with the Auto classes and writes its logits and greedy cached generation.
LOAD_SCRIPT = r"""
import json, sys
import torch
from safetensors.torch import load_file, save_file
try:
    import mhmoe
except ImportError as e:
    blocked = str(e)
else:
    sys.exit(f"mhmoe is importable from {mhmoe.__file__}")
from transformers import AutoModel, AutoModelForCausalLM, AutoTokenizer

torch.set_num_threads(1)
folders, inputs, out = json.loads(sys.argv[1]), load_file(sys.argv[2]), sys.argv[3]
tensors, info = {}, {"blocked": blocked}
for name, folder in folders.items():
    model = AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True).eval()
    base = AutoModel.from_pretrained(folder, trust_remote_code=True)
    tok = AutoTokenizer.from_pretrained(folder, trust_remote_code=True)
    with torch.no_grad():
        tensors[name + ".logits"] = model(inputs["input_ids"]).logits
        tensors[name + ".generated"] = model.generate(inputs["prompt"], max_new_tokens=8, do_sample=False,
                                                      use_cache=True, pad_token_id=0)
    info[name] = {"classes": [type(x).__module__ + "." + type(x).__name__ for x in (model.config, base, model)],
                  "tokens": tok("the water")["input_ids"]}
info["mhmoe_modules"] = sorted(m for m in sys.modules if m == "mhmoe" or m.startswith("mhmoe."))
kernel_files = ("_triton", "_triton_forward", "_triton_backward")
info["kernels_loaded"] = sorted(
    {n.rsplit(".", 1)[1] for n in sys.modules if n.startswith("transformers_modules") and n.endswith(kernel_files)}
)
info["backends_has_triton"] = [m.has_triton() for n, m in list(sys.modules.items()) if n.startswith("transformers_modules") and n.endswith(".backends")]
save_file(tensors, out + ".safetensors")
with open(out + ".json", "w") as f:
    json.dump(info, f)
"""


def _leftovers(parent: Path) -> list[str]:
    return sorted(p.name for p in parent.iterdir() if p.name.startswith("."))  # temporary / moved-aside dirs


@contextlib.contextmanager
def _datasets_cache(path: Path):
    try:
        import datasets
    except ImportError:  # without lm-eval (and datasets) the lm-eval tests skip
        yield
        return
    saved, datasets.config.HF_DATASETS_CACHE = datasets.config.HF_DATASETS_CACHE, path
    try:
        yield
    finally:
        datasets.config.HF_DATASETS_CACHE = saved


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    root = tmp_path_factory.mktemp("hub")
    torch.manual_seed(0)
    src = fx.build_tiny_checkpoint(
        root / "mhmoe_src",
        shared_expert_intermediate_size=32,
        moh_shared_heads=2,
        moh_active_heads=1,
        moh_router="learned",
    )
    tokenizer = AutoTokenizer.from_pretrained(src)
    mhmoe_model = MHMoEForCausalLM.from_pretrained(src).eval()
    with torch.no_grad():
        for name, param in mhmoe_model.named_parameters():
            if ".head_router." in name:
                param.normal_(std=1.0)  # zero-initialised routers gate every head alike
    assert mhmoe_model.config.moe_heads == 2 and mhmoe_model.config.decoder_sparse_step == 1
    export_pretrained(mhmoe_model, root / "out" / "mhmoe", tokenizer=tokenizer)

    moh_model = MoHLlamaForCausalLM(MoHLlamaConfig(vocab_size=len(tokenizer), **MOH_LLAMA)).eval()
    moh_model.save_pretrained(root / "moh_src")
    tokenizer.save_pretrained(root / "moh_src")
    export_pretrained(root / "moh_src", root / "out" / "moh_llama")  # the directory route; tokenizer found there
    with _datasets_cache(root / "hf_datasets"):  # the in-process evaluations' cache, as the subprocesses'
        yield {
            "root": root,
            "tokenizer": tokenizer,
            "models": {"mhmoe": mhmoe_model, "moh_llama": moh_model},
            "dirs": {"mhmoe": root / "out" / "mhmoe", "moh_llama": root / "out" / "moh_llama"},
        }


# ---------------------------------------------------------------------------------------- loading without mhmoe


def test_loads_without_mhmoe(exported, warm_blocked):
    """AutoModelForCausalLM / AutoModel / AutoTokenizer with trust_remote_code in a process where mhmoe cannot be
    imported: the same logits and the same greedy cached generation as the original models."""
    root = exported["root"]
    vocab = len(exported["tokenizer"])
    inputs = {"input_ids": torch.randint(3, vocab, (2, 12)), "prompt": torch.randint(3, vocab, (1, 5))}
    save_file(inputs, root / "inputs.safetensors")
    (root / "load.py").write_text(LOAD_SCRIPT)
    folders = {name: str(path) for name, path in exported["dirs"].items()}
    cmd = [
        sys.executable,
        str(root / "load.py"),
        json.dumps(folders),
        str(root / "inputs.safetensors"),
        str(root / "got"),
    ]
    proc = warm_blocked.run(cmd, cwd=root, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    got, info = load_file(root / "got.safetensors"), json.loads((root / "got.json").read_text())
    assert "not installed here" in info["blocked"] and info["mhmoe_modules"] == []
    # the op registry in the config's and the model's dynamic-module namespaces of each folder: no kernel offered (no
    # triton here); kernels load when first chosen (ops/backends.py): on the CPU only the default experts backend's
    # (grouped_mm, whose fused steps file offers nothing without triton), no routing, head-router or attention kernel
    assert len(info["backends_has_triton"]) == 4 and not any(info["backends_has_triton"])
    assert info["kernels_loaded"] == ["experts_grouped_mm_steps_triton"]
    for name, model in exported["models"].items():
        classes = info[name]["classes"]
        assert all(c.startswith("transformers_modules.") for c in classes), classes
        suffix = "MoHLlama" if name == "moh_llama" else "MHMoE"
        assert [c.rsplit(".", 1)[1] for c in classes] == [f"{suffix}Config", f"{suffix}Model", f"{suffix}ForCausalLM"]
        with torch.no_grad():
            logits = model(inputs["input_ids"]).logits
            generated = model.generate(
                inputs["prompt"], max_new_tokens=8, do_sample=False, use_cache=True, pad_token_id=0
            )
        torch.testing.assert_close(got[f"{name}.logits"], logits, rtol=1e-5, atol=1e-5)
        assert torch.equal(got[f"{name}.generated"], generated)
        assert info[name]["tokens"] == exported["tokenizer"]("the water")["input_ids"]
    # the MoH routers really route: a dense model would not need the exported MoH files
    gates = (
        exported["models"]["mhmoe"]
        .model.layers[0]
        .self_attn.head_router(torch.randn(1, 3, 32), torch.randn(1, 3, 4, 8))[0]
    )
    assert int((gates != 0).sum()) == 3 * 3  # 2 shared + 1 routed of 4 heads per token


def test_exported_folder(exported):
    """auto_map, the flattened code (relative imports rewritten to the flat folder, other files byte for byte), the
    card."""
    mhmoe_dir, moh_dir = exported["dirs"]["mhmoe"], exported["dirs"]["moh_llama"]
    models = REPO / "src" / "mhmoe" / "models"
    config = json.loads((moh_dir / "config.json").read_text())
    assert config["auto_map"] == {
        "AutoConfig": "configuration_moh_llama.MoHLlamaConfig",
        "AutoModel": "modeling_moh_llama.MoHLlamaModel",
        "AutoModelForCausalLM": "modeling_moh_llama.MoHLlamaForCausalLM",
    }
    assert json.loads((mhmoe_dir / "config.json").read_text())["auto_map"]["AutoModelForCausalLM"] == (
        "modeling_mhmoe.MHMoEForCausalLM"
    )
    moh_files = check_exported_code(moh_dir)
    shared = {
        "moh_attention.py",
        "head_routers.py",
        "head_skipping.py",
        "moh_config.py",
        "moh_losses.py",
        "moh_parallel.py",
        "causal_lm.py",
        "cache_naming.py",
        "config_checks.py",
        "backends.py",
        "head_router_naive.py",
        "head_router_triton.py",
        "head_sparse_attention_naive.py",
        "head_sparse_attention_cpu.py",
        "head_sparse_attention_triton.py",
        "head_sparse_attention_triton_common.py",
        "head_sparse_attention_triton_forward.py",
        "head_sparse_attention_triton_backward.py",
        "routing_naive.py",
        "routing_triton.py",
    }
    assert {"configuration_moh_llama.py", "modeling_moh_llama.py"} | shared <= set(moh_files)
    assert not {"modeling_mhmoe.py", "sparse_moe.py", "lory.py", "bitnet.py", "patch.py"} & set(moh_files)
    # the MHMoE model reaches every module file of the model layer but MoH-LLaMA's and the config builders
    unused = {"__init__.py", "matching.py", "parity.py"}
    every = sorted(p.name for p in models.rglob("*.py") if p.name not in unused and "moh_llama" not in p.parts)
    assert check_exported_code(mhmoe_dir) == every
    for name in ("moh_attention.py", "head_routers.py", "backends.py", "configuration_moh_llama.py"):
        source = next(models.rglob(name)).read_text()  # relative imports flattened to `from .<file> import`
        flattened = re.sub(r"from \.+(?:\w+\.)*(\w+) import", r"from .\1 import", source)
        assert (moh_dir / name).read_text() == flattened, name
    for name in ("cache_naming.py", "triton_compat.py"):  # no relative import: byte for byte
        assert (moh_dir / name).read_bytes() == next(models.rglob(name)).read_bytes()
    for name in ("configuration_moh_llama.py", "modeling_moh_llama.py"):
        assert "from .." not in (moh_dir / name).read_text()
    config_code = (moh_dir / "configuration_moh_llama.py").read_text()
    assert "from .moh_config import MoHConfigFields, moh_config_problems" in config_code
    for folder in (mhmoe_dir, moh_dir):
        names = {p.name for p in folder.iterdir()}
        assert {"model.safetensors", "generation_config.json", "README.md", "tokenizer.json"} <= names
        assert not any(n.endswith((".bin", ".pt", ".pkl")) for n in names)

    card = (moh_dir / "README.md").read_text()
    params = exported["models"]["moh_llama"].num_parameters()
    assert f"| parameters | {params:,} " in card and "| layers | 2 |" in card and "| hidden size | 48 |" in card
    assert "| attention heads | 6 (2 key/value) |" in card
    assert f"1 shared + 2 of 5 routed heads per token = {MOH_LLAMA_ACTIVE_PCT:.1f}%" in card and "`l2` router" in card
    assert 'from_pretrained("moh_llama", trust_remote_code=True)' in card and mhmoe.__version__ in card
    card = (mhmoe_dir / "README.md").read_text()
    assert card.split("---")[1].count("- mhmoe\n") == 1  # the model type is also the library's name: one tag
    assert f"| parameters | {exported['models']['mhmoe'].num_parameters():,} " in card
    assert "2 of 2 layers: 4 experts, top-2, 2 MoE heads" in card and "shared expert inner size 32" in card
    assert "2 shared + 1 of 2 routed heads per token = 75.0%" in card and "`learned` router" in card


# ------------------------------------------------------------------------------------------------------- lm-eval


def _ppl_metadata(root: Path) -> dict:
    corpora = root / "corpora"
    if not corpora.is_dir():
        fx.write_corpora(corpora)
    return {"c4_path": str(corpora / "c4_validation.jsonl")}


@pytest.mark.parametrize("name", ["mhmoe", "moh_llama"])
def test_lm_eval_hf_trust_remote_code(exported, name, warm_blocked):
    """Plain `lm-eval run --model hf --model_args pretrained=DIR,trust_remote_code=True` with mhmoe blocked gives the
    perplexities the `mhmoe` model computes in-process on the same folder."""
    pytest.importorskip("lm_eval")
    from mhmoe.evaluation import lm_eval_model, suites

    root, folder = exported["root"], exported["dirs"][name]
    metadata = _ppl_metadata(root)
    cmd = [
        sys.executable,
        "-m",
        "lm_eval",
        "run",
        "--model",
        "hf",
        "--model_args",
        f"pretrained={folder},trust_remote_code=True,max_length=512",
        "--include_path",
        str(REPO / "eval_tasks"),
        "--tasks",
        "mhmoe_ppl_c4",
        "--metadata",
        json.dumps(metadata),
        "--device",
        "cpu",
        "--batch_size",
        "4",
        "--output_path",
        str(root / f"lm_eval_out_{name}"),
    ]
    proc = warm_blocked.run(cmd, cwd=root, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    (path,) = glob.glob(str(root / f"lm_eval_out_{name}" / "**" / "results_*.json"), recursive=True)
    results = json.loads(Path(path).read_text())
    assert results["config"]["model"] == "hf" and results["config"]["model_args"]["trust_remote_code"] is True
    got = results["results"]["mhmoe_ppl_c4"]

    lm = lm_eval_model.MHMoELM(pretrained=str(folder), device="cpu", batch_size=4, max_length=512)
    tm = suites.task_manager(["mhmoe_ppl"], metadata=metadata)
    expected = suites.simple_evaluate(model=lm, tasks=["mhmoe_ppl_c4"], task_manager=tm, bootstrap_iters=0)
    expected = expected["results"]["mhmoe_ppl_c4"]
    assert got["sample_len"] == expected["sample_len"] == 3
    for metric in ("token_perplexity,none", "word_perplexity,none", "bits_per_byte,none"):
        assert got[metric] == pytest.approx(expected[metric], rel=1e-4), metric
    assert 1.0 < got["token_perplexity,none"] < 10 * len(exported["tokenizer"])  # untrained: near-uniform


def test_lm_eval_moh_llama_routing_statistics(exported):
    """The exported moh_llama checkpoint through the `mhmoe` lm-eval model: MoH activated heads % is reported, and
    with the l2 router's 0/1 gates it is exactly (shared + active) / heads."""
    pytest.importorskip("lm_eval")
    import lm_eval

    from mhmoe.evaluation import lm_eval_model, suites

    metadata = _ppl_metadata(exported["root"])
    lm = lm_eval_model.MHMoELM(
        pretrained=str(exported["dirs"]["moh_llama"]), device="cpu", batch_size=4, max_length=512
    )
    assert type(lm.model) is MoHLlamaForCausalLM  # mhmoe's own class, not the exported copy
    tm = suites.task_manager(["mhmoe_ppl"], metadata=metadata)
    results = lm_eval.simple_evaluate(model=lm, tasks=["mhmoe_ppl_c4"], task_manager=tm, bootstrap_iters=0)
    assert results["results"]["mhmoe_ppl_c4"]["token_perplexity,none"] > 1.0
    stats = results["config"][lm_eval_model.ROUTING_KEY]
    assert stats["moe_layers"] == 0 and stats["moh_layers"] == MOH_LLAMA["num_hidden_layers"]
    assert stats["activated_heads_pct"] == pytest.approx(MOH_LLAMA_ACTIVE_PCT)
    for layer in stats["moh_per_layer"].values():
        assert layer["num_heads"] == 6 and layer["activated_heads_pct"] == pytest.approx(MOH_LLAMA_ACTIVE_PCT)


# ------------------------------------------------------------------------------------------------------ refusals


def test_refuses_non_empty_target_and_overwrites_on_request(exported, tmp_path):
    model = exported["models"]["moh_llama"]
    target = tmp_path / "target"
    target.mkdir()
    (target / "keep.txt").write_text("mine")
    with pytest.raises(ExportError, match=r"not empty; pass overwrite=True \(mhmoe-export --overwrite\)"):
        export_pretrained(model, target)
    assert [p.name for p in target.iterdir()] == ["keep.txt"] and _leftovers(tmp_path) == []
    export_pretrained(model, target, overwrite=True, model_card=False)
    names = {p.name for p in target.iterdir()}
    assert "keep.txt" not in names and "model.safetensors" in names and "README.md" not in names
    assert _leftovers(tmp_path) == []
    (tmp_path / "empty").mkdir()
    export_pretrained(model, tmp_path / "empty", model_card=False)  # an empty directory is not refused
    assert (tmp_path / "empty" / "config.json").is_file()


def test_refuses_bad_sources(exported, tmp_path):
    src = exported["root"] / "moh_src"
    (tmp_path / "no_config").mkdir()
    pickled = tmp_path / "pickled"
    pickled.mkdir()
    (pickled / "config.json").write_text((src / "config.json").read_text())
    (pickled / "pytorch_model.bin").write_bytes(b"not unpickled")
    llama = LlamaForCausalLM(
        LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2)
    )
    llama.save_pretrained(tmp_path / "llama")
    cases = [
        (tmp_path / "missing", "is not a directory"),
        (tmp_path / "no_config", "no config.json"),
        (pickled, "only pickle checkpoints"),
        (tmp_path / "llama", "'llama' .* is not one of mhmoe's model types"),
        (llama, "not one of mhmoe's model types.*mhmoe-convert"),
        ({"not": "a model"}, "cannot export a dict"),
    ]
    for source, message in cases:
        target = tmp_path / "out"
        with pytest.raises(ExportError, match=message):
            export_pretrained(source, target)
        assert not target.exists() and _leftovers(tmp_path) == [], source
    with pytest.raises(ExportError, match="must not be the source"):
        export_pretrained(src, src / "inside")
    assert not (src / "inside").exists()


class _FailingTokenizer:
    def save_pretrained(self, directory):
        (Path(directory) / "tokenizer.json").write_text("{}")
        raise RuntimeError("disk full")


def test_failure_leaves_nothing_behind(exported, tmp_path):
    """A failure after files were written: no target, no temporary directory; a replaced target stays as it was."""
    model = exported["models"]["moh_llama"]
    with pytest.raises(RuntimeError, match="disk full"):
        export_pretrained(model, tmp_path / "new", tokenizer=_FailingTokenizer())
    assert not (tmp_path / "new").exists() and _leftovers(tmp_path) == []
    old = tmp_path / "old"
    old.mkdir()
    (old / "keep.txt").write_text("mine")
    with pytest.raises(RuntimeError, match="disk full"):
        export_pretrained(model, old, tokenizer=_FailingTokenizer(), overwrite=True)
    assert [p.name for p in old.iterdir()] == ["keep.txt"] and _leftovers(tmp_path) == []


def test_cli(exported, tmp_path, capsys):
    """`mhmoe-export SRC_DIR OUT_DIR`; refusals exit 2 with the reason in words."""
    src = exported["root"] / "moh_src"
    main([str(src), str(tmp_path / "out")])
    assert "exported" in capsys.readouterr().out
    assert json.loads((tmp_path / "out" / "config.json").read_text())["auto_map"]
    with pytest.raises(SystemExit) as exit_info:
        main([str(src), str(tmp_path / "out")])
    assert exit_info.value.code == 2
    assert "mhmoe-export: error:" in capsys.readouterr().err
    main([str(src), str(tmp_path / "out"), "--overwrite", "--no_model_card"])
    assert not (tmp_path / "out" / "README.md").exists()


def test_moh_llama_register_for_auto_class_points_to_the_export():
    """Transformers' own route (register_for_auto_class + save_pretrained) cannot copy moh_llama's shared code: it is
    refused up front with the way out, instead of failing on a missing `.moh.moh_attention.py` while saving."""
    for cls in (MoHLlamaConfig, MoHLlamaForCausalLM):
        with pytest.raises(ValueError, match="export_pretrained"):
            cls.register_for_auto_class()
    assert "_auto_class" not in MoHLlamaForCausalLM.__dict__ and "_auto_class" not in MoHLlamaConfig.__dict__


def test_card_of_a_trained_model_reads_train_summary(checkpoint_dir, corpus, tmp_path):
    """mhmoe-export of an mhmoe-train output: the card's Training section comes from its train_summary.json (steps,
    tokens, data file names, never their paths), not "Not recorded."."""
    from mhmoe.training import train

    run = tmp_path / "run"
    train(
        dict(
            model_name_or_path=checkpoint_dir,
            output_dir=str(run),
            train_file=[corpus["train"]],
            block_size=16,
            per_device_train_batch_size=2,
            max_steps=2,
            learning_rate=1e-3,
            disable_tqdm=True,
            plot=False,
        )
    )
    assert (run / "train_summary.json").is_file()
    export_pretrained(str(run), str(tmp_path / "exported"))
    card = (tmp_path / "exported" / "README.md").read_text()
    training = card.split("## Training", 1)[1].split("##", 1)[0]
    assert "Trained with `mhmoe-train` for 2 steps (64 tokens, 2 blocks of 16 per step) on train.jsonl." in training
    assert "Not recorded" not in card and str(corpus["root"]) not in card


def test_export_drops_local_paths_of_an_older_conversion_record(checkpoint_dir, tmp_path):
    """A moh_conversion.json from an older mhmoe-convert kept absolute local paths: the export, which is published,
    names the folders instead; the card's base_model is the source folder's name."""
    import json
    import shutil

    source = tmp_path / "converted"
    shutil.copytree(checkpoint_dir, source)
    dense = str(tmp_path / "private" / "Tiny-Llama")
    (source / "moh_conversion.json").write_text(
        json.dumps({"input_dir": dense, "output_dir": str(source), "shared_heads": 2})
    )
    export_pretrained(str(source), str(tmp_path / "exported"))
    record = (tmp_path / "exported" / "moh_conversion.json").read_text()
    assert json.loads(record) == {"input_dir": "Tiny-Llama", "output_dir": "converted", "shared_heads": 2}
    card = (tmp_path / "exported" / "README.md").read_text()
    assert "base_model: Tiny-Llama" in card and str(tmp_path) not in card + record


@pytest.mark.parametrize(
    "change, words",
    [
        (
            {"vocab_size": 1000, "num_hidden_layers": 6},
            r"\(vocab_size=1000, hidden_size=32, num_hidden_layers=6\): 40 tensors the config needs are missing \(e.g. "
            r"model.layers.2.input_layernorm.weight\); 2 tensors have other shapes \(e.g. lm_head.weight: \[320, 32\] in the "
            r"weights, \[1000, 32\] in the config\)",
        ),
        (
            {"num_hidden_layers": 1, "decoder_sparse_step": 1},
            r"14 tensors the config has no place for \(e.g. model.layers.0.mlp.down_proj.weight\)",
        ),
    ],
)
def test_a_config_that_does_not_describe_its_weights_is_refused(checkpoint_dir, tmp_path, capsys, change, words):
    """config.json saying 6 layers and 1000 tokens over 2-layer, 320-token weights (or 1 layer): refused in one line
    before anything is written; the export would otherwise not load."""
    import re
    import shutil

    source = tmp_path / "source"
    shutil.copytree(checkpoint_dir, source)
    config = json.loads((source / "config.json").read_text())
    (source / "config.json").write_text(json.dumps({**config, **change}))
    with pytest.raises(SystemExit) as exit_info:
        main([str(source), str(tmp_path / "out")])
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert exit_info.value.code == 2 and line.startswith(
        f"mhmoe-export: error: the weights in {source} do not match its config.json"
    ), line
    assert re.search(words, line), line
    assert not (tmp_path / "out").exists() and not _leftovers(tmp_path)
