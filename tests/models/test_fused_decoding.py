"""MoH's fused decoding step (`models/moh/fused_decoding.py`) against the masked path it replaces: greedy generation
(tokens and scores) with GQA, left padding, dynamic and static caches, learned and parameter-free routers, fp32 and
bf16, q/k/v biases (Qwen2); the host's top-K against `torch.topk`; the cached projection following weight updates; and
every case where the step must not run."""

import pytest
import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from mhmoe import MHMoEForCausalLM, MoHLlamaConfig, MoHLlamaForCausalLM
from mhmoe.models.moh import fused_decoding, moh_attention
from mhmoe.models.moh.head_routers import HEAD_ROUTERS
from mhmoe.models.moh_llama.patch import apply_moh
from tests.causal_lm_tester import randomise_moh_routers
from tests.models.test_moh import VOCAB, tiny_llama_fields, tiny_mhmoe


def moh_llama(router="learned", kv_heads=4, shared=3, active=2, seed=0, **fields):
    """A tiny MoH-LLaMA with straight-through gates and random router weights (`fields`: more config fields)."""
    torch.manual_seed(seed)
    moh = dict(moh_shared_heads=shared, moh_active_heads=active, moh_router=router, moh_straight_through=True)
    config = MoHLlamaConfig(**tiny_llama_fields(num_key_value_heads=kv_heads), **{**moh, **fields})
    model = MoHLlamaForCausalLM(config).eval()
    randomise_moh_routers(model)
    return model


def spy_steps(monkeypatch) -> list:
    """Record the batch of every fused decoding step the models take."""
    calls = []
    original = moh_attention.fused_decoding_step

    def spy(module, hidden_states, *args):
        calls.append(hidden_states.shape[0])
        return original(module, hidden_states, *args)

    monkeypatch.setattr(moh_attention, "fused_decoding_step", spy)
    return calls


def set_fused(model, value) -> None:
    for layer in model.model.layers:
        layer.self_attn.moh_fused_decoding = value


def generate_both(model, ids, mask, monkeypatch, **settings):
    """Greedy generation with the fused step off (the masked path), then on: (off, on, fused steps taken)."""
    calls = spy_steps(monkeypatch)
    settings = dict(max_new_tokens=5, do_sample=False, output_scores=True, return_dict_in_generate=True, **settings)
    with torch.no_grad():
        set_fused(model, False)
        masked = model.generate(ids, attention_mask=mask, **settings)
        assert not calls
        set_fused(model, True)
        fused = model.generate(ids, attention_mask=mask, **settings)
    return masked, fused, calls


def padded_prompt(batch=3, length=11, seed=1):
    ids = torch.randint(1, VOCAB, (batch, length), generator=torch.Generator().manual_seed(seed))
    mask = torch.ones_like(ids)
    ids[1, :4], mask[1, :4] = 0, 0  # left padding of row 1
    return ids, mask


def assert_same_generation(masked, fused, rtol=1e-5, atol=1e-5):
    assert torch.equal(fused.sequences, masked.sequences)
    for got, expected in zip(fused.scores, masked.scores):
        torch.testing.assert_close(got, expected, rtol=rtol, atol=atol)


@pytest.mark.parametrize("cache", ["dynamic", "static"])
@pytest.mark.parametrize("kv_heads", [8, 4, 2, 1])
@pytest.mark.parametrize("router", ["learned", "l2"])
def test_fused_step_equals_the_masked_path_in_generation(router, kv_heads, cache, monkeypatch):
    """Every decoding step of every layer takes the fused step and gives the masked path's tokens and scores."""
    model = moh_llama(router, kv_heads)
    ids, mask = padded_prompt()
    settings = {"cache_implementation": "static"} if cache == "static" else {}
    masked, fused, calls = generate_both(model, ids, mask, monkeypatch, **settings)
    assert calls == [3] * 2 * 4  # 4 decoding steps after the prefill, 2 layers
    assert_same_generation(masked, fused)


def test_fused_step_in_bf16_scores_the_learned_router_on_its_own(monkeypatch):
    """bf16: the learned router's scores stay out of the fused GEMV (they are fp32 in every path); same tokens."""
    model = moh_llama("learned").to(torch.bfloat16)
    ids, mask = padded_prompt()
    masked, fused, calls = generate_both(model, ids, mask, monkeypatch)
    assert calls and not fused_decoding.fused_projection(model.model.layers[0].self_attn)[2]
    assert_same_generation(masked, fused, rtol=0, atol=0)
    assert fused_decoding.fused_projection(moh_llama("learned").model.layers[0].self_attn)[2]  # fp32: fused


def test_fused_step_with_qkv_biases_equals_the_masked_path(monkeypatch):
    """A Qwen2 model (q/k/v biases) made MoH by apply_moh with a learned router."""
    torch.manual_seed(2)
    fields = tiny_llama_fields()
    model = Qwen2ForCausalLM(Qwen2Config(**fields, use_sliding_window=False)).eval()
    assert model.model.layers[0].self_attn.q_proj.bias is not None
    apply_moh(model, moh_shared_heads=2, moh_active_heads=3, moh_router="learned")
    randomise_moh_routers(model)
    ids, mask = padded_prompt()
    masked, fused, calls = generate_both(model, ids, mask, monkeypatch)
    assert calls
    assert_same_generation(masked, fused)


def test_mhmoe_attention_takes_the_fused_step_too(monkeypatch):
    """MHMoE's attention (MoH option, learned router, straight-through gates, MH-MoE layers) routes through the same
    attention forward."""
    torch.manual_seed(3)
    config = tiny_mhmoe(moh_shared_heads=2, moh_active_heads=3, moh_router="learned", moh_straight_through=True)
    model = MHMoEForCausalLM(config).eval()
    randomise_moh_routers(model)
    ids, mask = padded_prompt()
    masked, fused, calls = generate_both(model, ids, mask, monkeypatch)
    assert calls == [3] * 2 * 4
    assert_same_generation(masked, fused)


def test_host_top_k_equals_torch_topk_and_leaves_ties_to_it():
    router = HEAD_ROUTERS["learned"](32, 8, 3, 2, straight_through=True)
    logits = torch.randn(16, 5, generator=torch.Generator().manual_seed(0))
    expected = router.hard_gates(logits.view(16, 1, 5))[0].view(16, 8)
    assert torch.equal(fused_decoding.host_hard_gates(router, logits, torch.float32), expected)
    assert fused_decoding.host_hard_gates(router, logits[:1], torch.bfloat16).dtype == torch.bfloat16
    tied = torch.tensor([[0.5, 0.2, 0.5, 0.1, 0.5]])  # 2nd and 3rd highest equal: torch.topk decides
    assert fused_decoding.host_hard_gates(router, tied, torch.float32) is None
    untied = torch.tensor([[0.9, 0.2, 0.5, 0.2, 0.1]])  # a tie below the top-K: no matter
    assert torch.equal(
        fused_decoding.host_hard_gates(router, untied, torch.float32), torch.tensor([[1.0] * 3 + [1, 0, 1, 0, 0]])
    )


def test_fresh_learned_router_ties_everywhere_and_still_equals_the_masked_path(monkeypatch):
    """A zero-initialised learned router scores every head 0: each step falls back to torch.topk's choice."""
    torch.manual_seed(0)
    config = MoHLlamaConfig(
        **tiny_llama_fields(), moh_shared_heads=3, moh_active_heads=2, moh_router="learned", moh_straight_through=True
    )
    model = MoHLlamaForCausalLM(config).eval()
    ids, mask = padded_prompt()
    masked, fused, calls = generate_both(model, ids, mask, monkeypatch)
    assert calls
    assert_same_generation(masked, fused)


def test_cached_projection_follows_weight_updates():
    model = moh_llama("learned")
    attention = model.model.layers[0].self_attn
    weight, _, _ = fused_decoding.fused_projection(attention)
    assert fused_decoding.fused_projection(attention)[0] is weight  # cached
    with torch.no_grad():
        attention.k_proj.weight.mul_(2.0)  # an in-place update (an optimizer step, load_state_dict)
    rebuilt = fused_decoding.fused_projection(attention)[0]
    rows = attention.q_proj.out_features
    assert rebuilt is not weight and torch.equal(
        rebuilt[rows : rows + attention.k_proj.out_features], attention.k_proj.weight
    )
    attention.head_router.routed_weight = torch.nn.Parameter(torch.randn_like(attention.head_router.routed_weight))
    assert torch.equal(fused_decoding.fused_projection(attention)[0][-5:], attention.head_router.routed_weight)
    assert "_moh_fused_projection" not in str(list(model.state_dict()))


def decode_once(model, ids, **kwargs):
    with torch.no_grad():
        cache = model(ids[:, :-1], use_cache=True).past_key_values
        return model(ids[:, -1:], past_key_values=cache, use_cache=True, **kwargs)


@pytest.mark.parametrize(
    "case",
    [
        "grad",
        "eager",
        "head_skipping_backend",
        "masked_path",
        "off",
        "router_hooks",
        "all_heads",
        "lora_like",
        "offloaded",
        "window",
    ],
)
def test_fused_step_runs_only_where_it_equals_the_masked_path(case, monkeypatch):
    model = moh_llama("learned", active=5 if case == "all_heads" else 2)
    ids, _ = padded_prompt()
    calls = spy_steps(monkeypatch)
    attentions = [layer.self_attn for layer in model.model.layers]
    if case == "eager":
        model.set_attn_implementation("eager")
    elif case in ("head_skipping_backend", "masked_path"):
        for attention in attentions:
            attention.moh_head_skipping = "naive" if case == "head_skipping_backend" else False
    elif case == "off":
        set_fused(model, False)
    elif case == "router_hooks":
        attentions[0].head_router.register_forward_hook(lambda *args: None)
        attentions[1].head_router.register_forward_hook(lambda *args: None)
    elif case == "lora_like":
        for attention in attentions:
            attention.v_proj = torch.nn.Sequential(attention.v_proj)  # not a plain nn.Linear
    elif case == "offloaded":  # Accelerate's offloading hook: the weights are loaded in the projection's forward
        for attention in attentions:
            attention.k_proj._hf_hook = object()
    elif case == "window":
        monkeypatch.setattr(model.config, "sliding_window", 4, raising=False)
        for attention in attentions:
            attention.sliding_window = 4
    if case == "grad":
        cache = model(ids[:, :-1], use_cache=True).past_key_values
        model(ids[:, -1:], past_key_values=cache, use_cache=True)
    else:
        decode_once(model, ids)
    assert calls == []
    baseline = moh_llama("learned")
    spy = spy_steps(monkeypatch)
    decode_once(baseline, ids)
    assert spy == [3, 3]  # the same step on the default model takes it (both layers)
