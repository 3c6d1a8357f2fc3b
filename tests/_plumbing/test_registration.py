"""`import mhmoe` registers its model types with the Auto classes when Transformers loads them, in every import order.

Each case runs in a fresh interpreter: what matters is which modules are imported, and in which order. The cases that
need the deferral of `mhmoe._plumbing.import_hooks` are those where Transformers imports its Auto classes in the middle of
importing a model (`transformers.modeling_layers` imports AutoModel): a Llama model, or mhmoe's own modeling code."""

import pytest

from tests.test_light_import import _run

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
    assert result["classes"] == ["mhmoe.models.mhmoe.modeling_mhmoe.MHMoEForCausalLM",
                                 "mhmoe.models.moh_llama.modeling_moh_llama.MoHLlamaModel"]  # fmt: skip
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

