"""Shared causal-LM conformance tester: one tiny-model factory per model type, the checks written once
(`tests/models/test_causal_lm_common.py`), modeled on Transformers' `CausalLMModelTester` / `ModelTesterMixin` /
`GenerationTesterMixin` (whose test files are not shipped in its wheel).

Every case builds a seeded tiny model (hidden 32, 2 layers, vocab 99, 4 heads): MHMoE as MH-MoE, as a plain SMoE, with
MoH attention, and with a dense + MoE mix; MoH-LLaMA; Llama, Mistral and Qwen2 after `mhmoe.apply_moh`.
"""

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from transformers import (
    AutoModelForCausalLM,
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
)

from mhmoe import MHMoEConfig, MHMoEForCausalLM, MoHLlamaConfig, MoHLlamaForCausalLM, apply_moh
from mhmoe.models.moh.head_routers import MoHRouter

VOCAB = 99
PAD = 0
TINY = dict(
    vocab_size=VOCAB,
    hidden_size=32,
    intermediate_size=37,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=64,
    pad_token_id=PAD,
    bos_token_id=1,
    eos_token_id=None,
)
MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16)
MOH = dict(moh_shared_heads=1, moh_active_heads=2)
LEARNED = dict(moh_router="learned", moh_straight_through=False)  # the paper's from-scratch router, soft gates


@dataclass
class CausalLMCase:
    """A model type under test. `make(**config_overrides)` returns a seeded fresh model in eval mode (eager attention);
    `reload(path)` loads what `save_pretrained` wrote back into the same kind of model."""

    name: str
    make: Callable[..., torch.nn.Module]
    experts: bool = False  # has MoE layers (router logits, aux_loss, experts backends)
    moh: bool = False  # has MoH attention (head-router logits, moh_aux_loss)
    reload: Callable = field(default=lambda path, **kw: AutoModelForCausalLM.from_pretrained(path, **kw))

    def __repr__(self):
        return self.name


def randomise_moh_routers(model: torch.nn.Module, seed: int = 0, std: float = 1.0) -> None:
    """Learned MoH routers start at zero (every token picks the same heads): random weights make routing depend on
    the token, as after training."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, MoHRouter):
                for param in module.parameters():  # the learned router's W_r, W_s, W_h; none for l2
                    param.copy_(torch.randn(param.shape, generator=generator) * std)


def _finish(model):
    randomise_moh_routers(model)
    model.set_attn_implementation("eager")
    return model.eval()


def _mhmoe(**fields):
    def make(**overrides):
        torch.manual_seed(0)
        return _finish(MHMoEForCausalLM(MHMoEConfig(**{**TINY, **fields, **overrides})))

    return make


def _moh_llama(**overrides):
    torch.manual_seed(0)
    return _finish(MoHLlamaForCausalLM(MoHLlamaConfig(**{**TINY, **MOH, **overrides})))


PATCHED = {
    "llama": (LlamaConfig, LlamaForCausalLM),
    "mistral": (MistralConfig, MistralForCausalLM),
    "qwen2": (Qwen2Config, Qwen2ForCausalLM),
}


def _patched(family: str, moh_router: str = "l2", **fields):
    config_cls, model_cls = PATCHED[family]

    def make(**overrides):
        torch.manual_seed(0)
        model = model_cls(config_cls(**{**TINY, **fields, **overrides}))
        return _finish(apply_moh(model, **MOH, moh_router=moh_router))

    def reload(path, **kwargs):
        model = AutoModelForCausalLM.from_pretrained(path, **kwargs)
        # Llama is saved as model_type moh_llama; Mistral/Qwen2 reload as the dense model, whose config keeps the moh_*
        # fields: `apply_moh` restores MoH from them (and learned router weights from the folder)
        return model if family == "llama" else apply_moh(model)

    return dict(make=make, reload=reload)


CASES = [
    CausalLMCase("mhmoe-mh", _mhmoe(**MOE, moe_heads=2), experts=True),
    CausalLMCase("mhmoe-smoe", _mhmoe(**MOE, moe_heads=1, sliding_window=6), experts=True),  # Mixtral-like
    CausalLMCase("mhmoe-moh", _mhmoe(**MOE, **MOH, **LEARNED, moe_heads=2), experts=True, moh=True),
    CausalLMCase(
        "mhmoe-mixed",
        _mhmoe(**MOE, moe_heads=2, decoder_sparse_step=2, shared_expert_intermediate_size=16),
        experts=True,
    ),
    CausalLMCase("moh_llama", _moh_llama, moh=True),
    CausalLMCase("llama+moh", **_patched("llama"), moh=True),
    CausalLMCase("mistral+moh", **_patched("mistral", sliding_window=8), moh=True),
    CausalLMCase("qwen2+moh", **_patched("qwen2", moh_router="learned"), moh=True),
]


def prompts(batch: int = 3, seq: int = 7, seed: int = 1):
    """Left-padded prompts: row 1 has 3 padding tokens, row 2 one (ids never PAD elsewhere)."""
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(2, VOCAB, (batch, seq), generator=generator)
    mask = torch.ones_like(ids)
    for row, pads in ((1, 3), (2, 1)):
        if row < batch:
            ids[row, :pads], mask[row, :pads] = PAD, 0
    return ids, mask


TOLERANCE = {
    torch.float32: dict(rtol=1e-4, atol=1e-5),
    torch.bfloat16: dict(rtol=5e-2, atol=5e-2),
    torch.float16: dict(rtol=1e-2, atol=1e-2),
}


def cpu_supports(dtype: torch.dtype) -> bool:
    try:
        x = torch.ones(2, 4, 8, 8, dtype=dtype)
        torch.nn.functional.scaled_dot_product_attention(x, x, x)
        return bool(torch.isfinite(torch.nn.functional.linear(x, x[0, 0]).float()).all())
    except RuntimeError:
        return False


def greedy(model, ids, mask=None, **kwargs):
    kwargs = {"max_new_tokens": 5, "do_sample": False, "pad_token_id": PAD, **kwargs}
    return model.generate(ids, attention_mask=mask if mask is not None else torch.ones_like(ids), **kwargs)
