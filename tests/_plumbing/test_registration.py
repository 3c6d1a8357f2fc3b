"""`import mhmoe` registers its model types with the Auto classes when Transformers loads them, in every import order.

Each case runs in a fresh interpreter: what matters is which modules are imported, and in which order. The cases that
need the deferral of `mhmoe._plumbing.import_hooks` are those where Transformers imports its Auto classes in the middle of
importing a model (`transformers.modeling_layers` imports AutoModel): a Llama model, or mhmoe's own modeling code."""

import pytest

from tests.test_light_import import ROOT, _run

# builds both model types through the Auto classes and reports what mhmoe registered
CHECK = """
import json, sys
from transformers import AutoConfig, AutoModel, AutoModelForCausalLM
from transformers.models.auto.configuration_auto import CONFIG_MAPPING
mhmoe = AutoModelForCausalLM.from_config(AutoConfig.for_model(
    "mhmoe", vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16, moe_heads=2))
moh_llama = AutoModel.from_config(AutoConfig.for_model(
    "moh_llama", vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
    moh_shared_heads=2, moh_active_heads=1))
from mhmoe._plumbing.import_hooks import pending
print(json.dumps(dict(classes=[f"{type(m).__module__}.{type(m).__name__}" for m in (mhmoe, moh_llama)],
                      configs=[CONFIG_MAPPING[t].__name__ for t in ("mhmoe", "moh_llama")], pending=pending())))
"""

ORDERS = {
    "mhmoe_then_auto": "import mhmoe",
    "auto_then_mhmoe": "from transformers import AutoModelForCausalLM\nimport mhmoe",
    "mhmoe_then_llama": "import mhmoe\nfrom transformers import LlamaForCausalLM",  # Auto classes load mid-import
    "mhmoe_modeling_first": "from mhmoe.models.mhmoe.modeling_mhmoe import MHMoEForCausalLM",  # ours mid-import
}


@pytest.mark.parametrize("order", ORDERS)
def test_auto_classes_find_mhmoe_in_any_import_order(order):
    result = _run(ORDERS[order] + "\n" + CHECK)
    assert result["classes"] == [
        "mhmoe.models.mhmoe.modeling_mhmoe.MHMoEForCausalLM",
        "mhmoe.models.moh_llama.modeling_moh_llama.MoHLlamaModel",
    ]
    assert result["configs"] == ["MHMoEConfig", "MoHLlamaConfig"]
    assert "transformers.models.auto.modeling_auto" not in result["pending"]


def test_register_auto_classes_registers_at_once():
    """Without any Auto class used yet: the explicit call imports and registers everything."""
    result = _run("""
import json, sys
import mhmoe
before = "transformers.models.auto.modeling_auto" in sys.modules
mhmoe.register_auto_classes()
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING
print(json.dumps(dict(before=before, causal_lm=MODEL_FOR_CAUSAL_LM_MAPPING[mhmoe.MHMoEConfig].__name__)))
""")
    assert result == dict(before=False, causal_lm="MHMoEForCausalLM")


# ---------------------------------------------------------------------------------------------- other import systems

SPAWN_SCRIPT = '''
import json, multiprocessing, sys, tempfile
import torch
import mhmoe  # the main module's imports run again in every spawned worker (as __mp_main__)
from mhmoe import MHMoEConfig, MHMoEForCausalLM

CONFIG = dict(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16, moe_heads=2)


def load(folder):
    """In the worker: the Auto classes find mhmoe's types without the worker importing anything itself."""
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(folder)
    return type(model).__name__, model(input_ids=torch.tensor([[1, 5, 9, 2]])).logits.sum().item()


def from_config(config):
    """A pickled config: unpickling imports mhmoe's config module in the worker."""
    from transformers import AutoModelForCausalLM
    return type(AutoModelForCausalLM.from_config(config)).__name__


if __name__ == "__main__":
    model = MHMoEForCausalLM(MHMoEConfig(**CONFIG)).eval()
    with tempfile.TemporaryDirectory() as folder:
        model.save_pretrained(folder)
        with multiprocessing.get_context("spawn").Pool(1) as pool:
            loaded, total = pool.apply(load, (folder,))
            built = pool.apply(from_config, (MHMoEConfig(**CONFIG),))
    expected = model(input_ids=torch.tensor([[1, 5, 9, 2]])).logits.sum().item()
    print(json.dumps(dict(loaded=loaded, built=built, same_logits=abs(total - expected) < 1e-4)))
'''


def test_spawned_workers_find_mhmoe(tmp_path):
    """multiprocessing with the spawn start method (DataLoader workers, accelerate's notebook launcher on macOS and
    Windows): each worker is a fresh interpreter in which the hooks are installed again."""
    import json
    import os
    import subprocess
    import sys

    script = tmp_path / "spawn_main.py"
    script.write_text(SPAWN_SCRIPT)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result == dict(loaded="MHMoEForCausalLM", built="MHMoEForCausalLM", same_logits=True)


def test_reload_keeps_one_finder_and_registers_again():
    """`importlib.reload(mhmoe)` (notebooks, autoreload) before and after Transformers loads the Auto classes: the
    finder is not installed twice, no hook is left waiting, and the Auto classes still build mhmoe's models."""
    result = _run(
        """
import importlib, json, sys
import mhmoe
from mhmoe._plumbing import import_hooks
importlib.reload(mhmoe)
finders = [f for f in sys.meta_path if type(f).__module__ == "mhmoe._plumbing.import_hooks"]
"""
        + CHECK.replace("print(json.dumps(dict(", "first = dict(").replace("pending=pending())))", "pending=pending())")
        + """
importlib.reload(sys.modules["mhmoe"])  # the Auto classes are loaded now: registration runs again at once, idempotent
from transformers import AutoConfig, AutoModelForCausalLM
again = type(AutoModelForCausalLM.from_config(AutoConfig.for_model("mhmoe", vocab_size=64, hidden_size=32,
    intermediate_size=48, num_hidden_layers=1, num_attention_heads=4))).__name__
print(json.dumps(dict(finders=len(finders), first=first, again=again, pending=import_hooks.pending(),
                      hooks=len(import_hooks._waiting["peft.utils.constants"]),
                      finders_left=[type(f).__name__ for f in sys.meta_path
                                    if type(f).__module__ == "mhmoe._plumbing.import_hooks"])))
"""
    )
    assert result["finders"] == 1 and result["hooks"] == 1
    assert result["first"]["classes"][0] == "mhmoe.models.mhmoe.modeling_mhmoe.MHMoEForCausalLM"
    assert result["again"] == "MHMoEForCausalLM"
    # only PEFT's tables are still awaited (peft was never imported), once, by the one finder
    assert result["pending"] == ["peft.utils.constants"] and result["finders_left"] == ["_PostImportFinder"]


XDIST_TESTS = """
import torch
from transformers import AutoConfig, AutoModelForCausalLM

import mhmoe

SIZES = dict(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=1, num_attention_heads=4)


def test_mhmoe_through_auto():
    assert type(AutoModelForCausalLM.from_config(AutoConfig.for_model("mhmoe", **SIZES))).__name__ == "MHMoEForCausalLM"


def test_moh_llama_through_auto():
    config = AutoConfig.for_model("moh_llama", moh_shared_heads=2, moh_active_heads=1, **SIZES)
    assert type(AutoModelForCausalLM.from_config(config)).__name__ == "MoHLlamaForCausalLM"


def test_save_and_reload(tmp_path):
    model = mhmoe.MHMoEForCausalLM(mhmoe.MHMoEConfig(**SIZES)).eval()
    model.save_pretrained(tmp_path)
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path)
    ids = torch.tensor([[1, 2, 3]])
    assert torch.equal(loaded(input_ids=ids).logits, model(input_ids=ids).logits)
"""


def test_pytest_xdist_workers_find_mhmoe(tmp_path):
    """pytest-xdist: the tests run in a worker process started by execnet (one worker: a second would only repeat the
    same imports), importing mhmoe and transformers in the order the test module gives."""
    import os
    import subprocess
    import sys

    (tmp_path / "test_auto_in_workers.py").write_text(XDIST_TESTS)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-n",
            "1",
            "-p",
            "no:cacheprovider",
            "--rootdir",
            str(tmp_path),
            str(tmp_path),
        ],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]
    assert "3 passed" in proc.stdout
