"""`plan_attention` (models/moh/attention_plan.py), the one place that picks a MoH attention call's path: a table of
situations and the path each must take. That each path computes the same attention is tested where the paths live
(test_moh.py: head-sparse against masked; test_fused_decoding.py: the decoding step against masked)."""

import contextlib

import pytest
import torch
from transformers import DynamicCache

from mhmoe.models.moh import head_skipping
from mhmoe.models.moh.attention_plan import plan_attention
from tests.models.test_fused_decoding import moh_llama
from tests.models.test_moh import HIDDEN


class NotATensorMask:  # flex attention's BlockMask, flash's packed sequences: not a 4-D tensor
    pass


def situation(name: str, model):
    """(hidden_states, attention_mask, cache, grad) of a call, after changing `model` as the situation says."""
    attention = model.model.layers[0].self_attn
    tokens, mask, cache, grad, device = 1, None, DynamicCache(), False, "cpu"  # a decoding step
    if name == "decoding step":
        pass
    elif name == "no router":
        attention.head_router = None
    elif name == "every head active":
        model.config.moh_active_heads = 5
        attention.head_router.active_heads = 5
    elif name == "off":
        model.config.moh_head_skipping = False
    elif name == "fused off":
        model.config.moh_fused_decoding = False
    elif name == "fused off, prefill 40":
        model.config.moh_fused_decoding, tokens, cache = False, 40, None
    elif name == "prefill 40":
        tokens, cache = 40, None
    elif name in ("long prefill", "long prefill, training"):
        tokens, cache, grad = head_skipping.DEFAULT_CPU_POLICY.prefill_min_tokens, None, name.endswith("training")
    elif name == "named backend, prefill 40":
        model.config.moh_head_skipping, tokens, cache = "naive", 40, None
    elif name == "named backend, eager":
        model.config.moh_head_skipping = "naive"
        model.set_attn_implementation("eager")
    elif name == "named backend, flex":
        model.config.moh_head_skipping = "naive"
        model.set_attn_implementation("flex_attention")
    elif name == "eager":
        model.set_attn_implementation("eager")
    elif name == "grad":
        grad = True
    elif name == "named backend, scores gradient":
        model.config.moh_head_skipping, tokens, cache, grad = "naive", 40, None, True
        attention.head_router.straight_through = "scores"
    elif name == "4-D mask":
        mask = torch.zeros(1, 1, 1, 1)
    elif name == "block mask":
        mask = NotATensorMask()
    elif name == "output_attentions":
        pass  # in kwargs
    elif name == "dropout in training":
        attention.train()
        attention.attention_dropout = 0.1
    elif name == "tensor parallel":
        attention.head_router.tensor_parallel = True
    elif name == "router hooked":
        attention.head_router.register_forward_hook(lambda *args: None)
    elif name == "not a plain q_proj":
        attention.q_proj = torch.nn.Sequential(attention.q_proj)
    elif name == "not the CPU":
        device = "meta"
    elif name == "window":
        pass  # sliding_window below
    else:
        raise AssertionError(name)
    hidden_states = torch.zeros(1, tokens, HIDDEN, device=device, requires_grad=grad)
    return attention, hidden_states, mask, cache, grad


# situation -> path (backend for head_sparse); a decoding step of a tiny MoH-LLaMA (8 heads on 4 key/value heads,
# 3 shared, 2 of 5 routed active, the learned router, straight-through gates, sdpa) unless the situation says otherwise
TABLE = {
    "decoding step": "fused_decoding",
    "no router": "plain",
    "every head active": "masked",
    "traced": "masked",
    "off": "masked",
    "fused off": "head_sparse",  # the op's decode path: a key/value head can go unread
    "fused off, prefill 40": "masked",  # a short prefill: the op does not pay
    "prefill 40": "masked",
    "long prefill": "head_sparse",
    "long prefill, training": "head_sparse",
    "named backend, prefill 40": ("head_sparse", "naive"),
    "named backend, eager": ("head_sparse", "naive"),  # a named backend is not the fused step
    "named backend, flex": "masked",
    "named backend, scores gradient": "masked",
    "eager": "head_sparse",  # no fused step (sdpa only); the op where a key/value head can go unread
    "grad": "head_sparse",
    "4-D mask": "fused_decoding",
    "block mask": "masked",
    "output_attentions": "masked",
    "dropout in training": "masked",
    "tensor parallel": "masked",
    "router hooked": "head_sparse",
    "not a plain q_proj": "head_sparse",
    "not the CPU": "masked",  # the op's Triton kernels only when asked for by name
    "window": "head_sparse",  # the fused step has no window; the op takes it
}


@pytest.mark.parametrize("name", list(TABLE))
def test_plan_table(name, monkeypatch):
    model = moh_llama("learned", kv_heads=4, shared=3, active=2)
    if name == "traced":
        monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    attention, hidden_states, mask, cache, grad = situation("decoding step" if name == "traced" else name, model)
    head_dim = attention.head_dim
    cos = sin = torch.zeros(1, hidden_states.shape[1], head_dim, device=hidden_states.device)
    kwargs = {"output_attentions": True} if name == "output_attentions" else {}
    window = 4 if name == "window" else None
    with contextlib.nullcontext() if grad else torch.no_grad():
        plan = plan_attention(attention, hidden_states, (cos, sin), mask, cache, window, kwargs)
    expected = TABLE[name]
    path, backend = expected if isinstance(expected, tuple) else (expected, None)
    assert (plan.path, plan.backend) == (path, backend)
    assert (plan.projection is not None) == (path == "fused_decoding")


def test_plan_reads_the_config_not_module_attributes():
    """The choice lives in the config (saved with the model); a module attribute of the old name changes nothing."""
    model = moh_llama("learned")
    attention, hidden_states, mask, cache, _ = situation("prefill 40", model)
    attention.moh_head_skipping = "naive"  # the module attribute of earlier versions: ignored
    cos = sin = torch.zeros(1, 40, attention.head_dim)
    with torch.no_grad():
        assert plan_attention(attention, hidden_states, (cos, sin), mask, cache, None, {}).path == "masked"
        model.config.moh_head_skipping = "naive"
        assert plan_attention(attention, hidden_states, (cos, sin), mask, cache, None, {}).backend == "naive"


@pytest.mark.parametrize("value", ["fast", 1, None])
def test_bad_head_skipping_value_is_refused_in_words(value):
    with pytest.raises(Exception, match="moh_head_skipping") as error:  # the check in words, or the strict type check
        moh_llama("learned", moh_head_skipping=value)
    assert "must be True" in str(error.value) or "doesn't match any type" in str(error.value)
