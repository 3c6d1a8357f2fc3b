"""`import mhmoe` is light: it imports neither torch nor Transformers, its public names load on first use, and using
the models loads no optional extra (accelerate, peft, lm-eval, matplotlib, triton) beyond what transformers itself
loads; PEFT's default targets still reach users who import peft before or after mhmoe.
Checked in fresh interpreters (the test process has imported everything already); where the extras are not installed
at all: tests/test_installed_package.py."""

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
OPTIONAL = ("accelerate", "peft", "lm_eval", "matplotlib", "triton")

# builds, saves and reloads a tiny MHMoE (MoE + MoH) and a tiny MoH-LLaMA through the Auto classes
TINY_MODELS = """
import sys, tempfile, torch
from transformers import AutoModelForCausalLM
import mhmoe
from mhmoe import MHMoEConfig, MHMoEForCausalLM, MoHLlamaConfig, MoHLlamaForCausalLM

mhmoe_model = MHMoEForCausalLM(MHMoEConfig(
    vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16, moe_heads=2,
    moh_shared_heads=2, moh_active_heads=1))
moh_llama = MoHLlamaForCausalLM(MoHLlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=48,
    num_hidden_layers=2, num_attention_heads=4, moh_shared_heads=2, moh_active_heads=1))
ids = torch.tensor([[1, 5, 9, 2]])
for model in (mhmoe_model, moh_llama):
    with tempfile.TemporaryDirectory() as folder:
        model.save_pretrained(folder)
        loaded = AutoModelForCausalLM.from_pretrained(folder)
        assert type(loaded) is type(model)
        assert torch.equal(loaded(input_ids=ids).logits, model.eval()(input_ids=ids).logits)
"""


def _run(code: str) -> dict:
    """Run `code` in a fresh interpreter with this checkout's sources first; it prints one JSON line last."""
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src"), "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_import_mhmoe_imports_neither_torch_nor_transformers():
    code = """
import json, sys
import mhmoe
heavy = sorted(m for m in ("torch", "transformers", "safetensors", "tokenizers") if m in sys.modules)
names = {name: getattr(mhmoe, name).__module__ for name in mhmoe.__all__}  # each resolves (and imports) on first use
try:
    mhmoe.no_such_name
    missing = None
except AttributeError as e:
    missing = str(e)
print(json.dumps(dict(heavy=heavy, names=names, missing=missing, in_dir=sorted(set(mhmoe.__all__) - set(dir(mhmoe))),
                      evaluation=mhmoe.evaluation.__name__)))
"""
    result = _run(code)
    assert result["heavy"] == []
    assert result["names"]["MHMoEForCausalLM"] == "mhmoe.models.mhmoe.modeling_mhmoe"
    assert result["names"]["MoHLlamaConfig"] == "mhmoe.models.moh_llama.configuration_moh_llama"
    assert result["names"]["apply_moh"] == "mhmoe.models.moh_llama.patch"
    assert all(module.startswith("mhmoe.") for module in result["names"].values())
    assert result["missing"] == "module 'mhmoe' has no attribute 'no_such_name'"
    assert result["in_dir"] == []  # dir(mhmoe) lists the names before they are loaded
    assert result["evaluation"] == "mhmoe.evaluation"  # a subpackage read as an attribute is imported


def test_import_and_models_load_no_optional_extra():
    """Against a baseline: what `import transformers` and a Llama model already load. Where accelerate and triton
    are installed, transformers (modeling_utils) and torch (torch._dynamo) import them themselves; mhmoe adds none."""
    code = f"""
import json, sys
OPTIONAL = {OPTIONAL!r}
optional_loaded = lambda: sorted(m for m in OPTIONAL if m in sys.modules)
from transformers import LlamaConfig, LlamaForCausalLM
LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                             num_attention_heads=4))
baseline = optional_loaded()
{TINY_MODELS}
after_models = optional_loaded()
from peft import LoraConfig, get_peft_model  # after mhmoe: the one-shot import hook fills PEFT's tables
peft_model = get_peft_model(mhmoe_model, LoraConfig(r=4))
targets = sorted(peft_model.peft_config["default"].target_modules)
hooks_left = [type(f).__name__ for f in sys.meta_path if type(f).__module__ == "mhmoe._plumbing.import_hooks"]
print(json.dumps(dict(baseline=baseline, after_models=after_models, targets=targets, hooks_left=hooks_left,
                      file=mhmoe.__file__)))
"""
    result = _run(code)
    assert Path(result["file"]).is_relative_to(ROOT / "src")
    assert result["after_models"] == result["baseline"], result  # nothing optional beyond transformers' own
    assert not {"peft", "lm_eval", "matplotlib"} & set(result["after_models"])
    assert result["targets"] == ["k_proj", "o_proj", "q_proj", "v_proj"]  # registered when peft was imported
    assert result["hooks_left"] == []  # the import hook removed itself


def test_peft_defaults_when_peft_is_imported_first():
    code = """
import json
from peft import LoraConfig, get_peft_model
from peft.utils import TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING as LORA
before = "mhmoe" in LORA
import mhmoe
from mhmoe import MoHLlamaConfig, MoHLlamaForCausalLM

model = MoHLlamaForCausalLM(MoHLlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                           num_attention_heads=4, moh_shared_heads=2, moh_active_heads=1))
targets = sorted(get_peft_model(model, LoraConfig(r=4)).peft_config["default"].target_modules)
print(json.dumps(dict(before=before, mhmoe=LORA["mhmoe"], targets=targets)))
"""
    result = _run(code)
    assert result == dict(
        before=False, mhmoe=["q_proj", "k_proj", "v_proj", "o_proj"], targets=["k_proj", "o_proj", "q_proj", "v_proj"]
    )


def test_configs_and_models_import_no_kernel_until_one_is_chosen():
    """Kernels load when first chosen (ops/backends.py): building both configs and both models imports none of the
    ops' kernel files; a forward on the CPU then imports only the backends it runs (the experts' grouped_mm, the
    default; the head-sparse CPU op where the few-token prompts take it), never a Triton kernel on the CPU."""
    code = f"""
import json, re, sys
kernels = lambda: sorted(m.rsplit(".", 1)[1] for m in sys.modules
                         if m.startswith("mhmoe.models.ops.") and re.search(r"(_triton\\w*|_cpu|_grouped_mm)$", m))
from mhmoe import MHMoEConfig, MoHLlamaConfig
MHMoEConfig(hidden_size=32, num_attention_heads=4, moh_shared_heads=2, moh_active_heads=1)
MoHLlamaConfig(hidden_size=32, num_attention_heads=4, moh_shared_heads=2, moh_active_heads=1)
after_configs = kernels()
{TINY_MODELS}
print(json.dumps(dict(after_configs=after_configs, after_models=kernels())))
"""
    result = _run(code)
    assert result["after_configs"] == []
    assert "experts_grouped_mm" in result["after_models"]  # chosen by the MoE layers' forward
    assert not [name for name in result["after_models"] if "_triton" in name and "grouped_mm" not in name]
