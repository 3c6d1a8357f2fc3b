"""Publishing a model: `save_pretrained` / `push_to_hub` are Transformers' own (weights and config; the folder loads
where mhmoe is installed), and the explicit `mhmoe.hub.export_pretrained` writes the folder that loads with
trust_remote_code where mhmoe is not installed (the same logits)."""

import json
import sys

import pytest
import torch
from safetensors.torch import load_file, save_file

from mhmoe import MHMoEConfig, MHMoEForCausalLM, MoHLlamaConfig, MoHLlamaForCausalLM
from mhmoe.hub import export_pretrained

SCRIPT = r"""
import sys
import torch
from safetensors.torch import load_file, save_file
try:
    import mhmoe
    sys.exit("mhmoe is importable")
except ImportError:
    pass
from transformers import AutoModelForCausalLM

model = AutoModelForCausalLM.from_pretrained(sys.argv[1], trust_remote_code=True).eval()
with torch.no_grad():
    logits = model(load_file(sys.argv[2])["input_ids"]).logits
save_file({"logits": logits, "is_remote": torch.tensor(type(model).__module__.startswith("transformers_modules"))},
          sys.argv[3])
"""


def _models():
    torch.manual_seed(0)
    mhmoe_model = MHMoEForCausalLM(
        MHMoEConfig(
            vocab_size=64,
            hidden_size=32,
            intermediate_size=48,
            num_hidden_layers=2,
            num_attention_heads=4,
            moe_heads=2,
            num_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=16,
            decoder_sparse_step=2,
            moh_shared_heads=2,
            moh_active_heads=1,
            max_position_embeddings=64,
        )
    )
    moh_llama = MoHLlamaForCausalLM(
        MoHLlamaConfig(
            vocab_size=64,
            hidden_size=32,
            intermediate_size=48,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            moh_shared_heads=1,
            moh_active_heads=2,
            max_position_embeddings=64,
        )
    )
    return {"mhmoe": mhmoe_model.eval(), "moh_llama": moh_llama.eval()}


@pytest.mark.parametrize("name", ["mhmoe", "moh_llama"])
def test_export_pretrained_loads_in_a_process_without_mhmoe(name, tmp_path, warm_blocked):
    model = _models()[name]
    folder = tmp_path / "exported"
    export_pretrained(model, folder)
    names = {p.name for p in folder.iterdir()}
    assert {"config.json", "model.safetensors", "README.md", f"modeling_{name}.py"} <= names
    auto_map = json.loads((folder / "config.json").read_text())["auto_map"]
    assert auto_map["AutoModelForCausalLM"] == f"modeling_{name}.{type(model).__name__}"
    card = (folder / "README.md").read_text()
    assert "library_name: transformers" in card and "custom_code" in card

    ids = torch.randint(0, 64, (2, 9))
    save_file({"input_ids": ids}, tmp_path / "in.safetensors")
    args = [
        sys.executable,
        "-c",
        SCRIPT,
        str(folder),
        str(tmp_path / "in.safetensors"),
        str(tmp_path / "out.safetensors"),
    ]
    proc = warm_blocked.run(args, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = load_file(tmp_path / "out.safetensors")
    assert bool(out["is_remote"])
    with torch.no_grad():
        torch.testing.assert_close(out["logits"], model(ids).logits, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("name", ["mhmoe", "moh_llama"])
def test_save_pretrained_is_transformers_own(name, tmp_path):
    """Weights and config only (no code, no card, no auto_map), as Transformers writes them for any model; the folder
    loads through the Auto classes where mhmoe is imported."""
    from transformers import AutoModelForCausalLM

    model = _models()[name]
    model.save_pretrained(tmp_path)
    assert not list(tmp_path.glob("*.py")) and not (tmp_path / "README.md").exists()
    assert "auto_map" not in json.loads((tmp_path / "config.json").read_text())
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    assert type(reloaded) is type(model)
    ids = torch.randint(0, 64, (1, 5))
    with torch.no_grad():
        torch.testing.assert_close(reloaded(ids).logits, model(ids).logits)


def test_push_to_hub_uploads_what_save_pretrained_writes(monkeypatch):
    """Up to the upload: push_to_hub sends Transformers' folder (weights and config), no code of mhmoe's."""
    import huggingface_hub

    sent = {}

    class Uploaded(Exception):  # stops at the upload itself
        pass

    def fake_create_commit(self, repo_id, operations, **kwargs):
        sent["repo"] = repo_id
        sent["files"] = sorted(op.path_in_repo for op in operations)
        raise Uploaded

    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    endpoint = "https://hub.invalid"
    repo_url = huggingface_hub.RepoUrl(f"{endpoint}/someone/tiny-mhmoe", endpoint=endpoint)
    monkeypatch.setattr(huggingface_hub.HfApi, "create_repo", lambda self, *a, **k: repo_url)
    monkeypatch.setattr(huggingface_hub.HfApi, "create_commit", fake_create_commit)
    monkeypatch.setattr(huggingface_hub.HfApi, "preupload_lfs_files", lambda self, *a, **k: None, raising=False)
    with pytest.raises(Uploaded):
        _models()["mhmoe"].push_to_hub("someone/tiny-mhmoe", token="hf_fake")
    assert sent["repo"] == "someone/tiny-mhmoe"
    assert {"config.json", "model.safetensors"} <= set(sent["files"])
    assert not [name for name in sent["files"] if name.endswith(".py")]
