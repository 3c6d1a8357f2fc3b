"""MoH's fused decoding step (`models/moh/fused_decoding.py`) against the masked path it replaces: greedy generation
(tokens and scores) of one sequence and of a batch with GQA, left padding, dynamic and static caches, learned and
parameter-free routers, fp32 and bf16, q/k/v biases (Qwen2); the head-sparse step reading none of the inactive heads'
weights (NaN there changes nothing) and its plans; the host's top-K against `torch.topk`; the cached projection
following weight updates; and every case where the step must not run or must read every head."""

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
    model.config.moh_fused_decoding = value


def generate_both(model, ids, mask, monkeypatch, **settings):
    """Greedy generation with the fused step off (the masked path), then on: (off, on, fused steps taken)."""
    calls = spy_steps(monkeypatch)
    settings = {
        "max_new_tokens": 5,
        "do_sample": False,
        "output_scores": True,
        "return_dict_in_generate": True,
        **settings,
    }
    with torch.no_grad():
        set_fused(model, False)
        masked = model.generate(ids, attention_mask=mask, **settings)
        assert not calls
        set_fused(model, True)
        fused = model.generate(ids, attention_mask=mask, **settings)
    return masked, fused, calls


def padded_prompt(batch=3, length=11, seed=1):
    """A batch with left padding of row 1 (batch 1: one sequence, no padding)."""
    ids = torch.randint(1, VOCAB, (max(batch, 2), length), generator=torch.Generator().manual_seed(seed))
    mask = torch.ones_like(ids)
    ids[1, :4], mask[1, :4] = 0, 0  # left padding of row 1
    return ids[:batch], mask[:batch]


def assert_same_generation(masked, fused, rtol=1e-5, atol=1e-5):
    assert torch.equal(fused.sequences, masked.sequences)
    for got, expected in zip(fused.scores, masked.scores):
        torch.testing.assert_close(got, expected, rtol=rtol, atol=atol)


@pytest.mark.parametrize("batch", [1, 2])
@pytest.mark.parametrize("router", ["learned", "l2"])
def test_step_reads_key_value_heads_by_runs_on_long_caches(router, batch, monkeypatch):
    """With enough cached keys in the key/value heads between the needed ones (the CPU policy's
    decode_split_min_skipped_keys), the step
    reads only the runs of key/value heads its active heads need, one SDPA call each, and still gives the masked
    path's tokens and scores (multi-head attention: a key/value head per query head; batch 2: a padding mask)."""
    model = moh_llama(router, kv_heads=8)
    ids, mask = padded_prompt(batch, length=fused_decoding.DEFAULT_CPU_POLICY.decode_split_min_skipped_keys // 2 + 20)
    runs, original = [], fused_decoding.head_sparse_decode

    def spy(query, key, value, scaling, attention_mask, kv_runs):
        runs.append(kv_runs)
        return original(query, key, value, scaling, attention_mask, kv_runs)

    monkeypatch.setattr(fused_decoding, "head_sparse_decode", spy)
    masked, fused, calls = generate_both(model, ids, mask, monkeypatch, max_new_tokens=3)
    assert_same_generation(masked, fused)
    assert calls and runs
    if batch == 1:  # one sequence's 3 shared + 2 routed heads of 8 leave gaps between runs in some layer and step
        assert any(kv_runs is not None and len(kv_runs) > 1 for kv_runs in runs)


@pytest.mark.parametrize("batch", [1, 3])
@pytest.mark.parametrize("cache", ["dynamic", "static"])
@pytest.mark.parametrize("kv_heads", [8, 4, 2, 1])
@pytest.mark.parametrize("router", ["learned", "l2"])
def test_fused_step_equals_the_masked_path_in_generation(router, kv_heads, cache, batch, monkeypatch):
    """Every decoding step of every layer takes the fused step and gives the masked path's tokens and scores (the
    learned router in fp32: the head-sparse step; one sequence: its own heads, a batch: the union, gated)."""
    model = moh_llama(router, kv_heads)
    ids, mask = padded_prompt(batch)
    settings = {"cache_implementation": "static"} if cache == "static" else {}
    masked, fused, calls = generate_both(model, ids, mask, monkeypatch, **settings)
    assert calls == [batch] * 2 * 4  # 4 decoding steps after the prefill, 2 layers
    assert_same_generation(masked, fused)
    projection = fused_decoding.fused_projection(model.model.layers[0].self_attn)
    assert projection.skips_heads and projection.skips_queries == (router == "learned")


@pytest.mark.parametrize("batch", [1, 3])
def test_fused_step_in_bf16_scores_the_learned_router_on_its_own(batch, monkeypatch):
    """bf16: the learned router's scores stay out of the fused GEMV (they are fp32 in every path) and every head is
    read (o_proj in one piece, as the masked path sums it); the same tokens and scores, bit for bit."""
    model = moh_llama("learned").to(torch.bfloat16)
    ids, mask = padded_prompt(batch)
    masked, fused, calls = generate_both(model, ids, mask, monkeypatch)
    projection = fused_decoding.fused_projection(model.model.layers[0].self_attn)
    assert calls and not projection.scores_fused and not projection.skips_heads
    assert_same_generation(masked, fused, rtol=0, atol=0)
    assert fused_decoding.fused_projection(moh_llama("learned").model.layers[0].self_attn).scores_fused  # fp32


@pytest.mark.parametrize("batch", [1, 3])
def test_fused_step_with_qkv_biases_equals_the_masked_path(batch, monkeypatch):
    """A Qwen2 model (q/k/v biases) made MoH by apply_moh with a learned router."""
    torch.manual_seed(2)
    fields = tiny_llama_fields()
    model = Qwen2ForCausalLM(Qwen2Config(**fields, use_sliding_window=False)).eval()
    assert model.model.layers[0].self_attn.q_proj.bias is not None
    apply_moh(model, moh_shared_heads=2, moh_active_heads=3, moh_router="learned")
    randomise_moh_routers(model)
    ids, mask = padded_prompt(batch)
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
    gates, heads = fused_decoding.host_hard_gates(router, logits, torch.float32)
    assert torch.equal(gates, expected)
    assert heads == tuple(expected.any(0).nonzero().flatten().tolist())  # the union of the rows' heads
    one, heads = fused_decoding.host_hard_gates(router, logits[:1], torch.bfloat16)
    assert one.dtype == torch.bfloat16 and heads == tuple(expected[0].nonzero().flatten().tolist())
    tied = torch.tensor([[0.5, 0.2, 0.5, 0.1, 0.5]])  # 2nd and 3rd highest equal: torch.topk decides
    assert fused_decoding.host_hard_gates(router, tied, torch.float32) is None
    untied = torch.tensor([[0.9, 0.2, 0.5, 0.2, 0.1]])  # a tie below the top-K: no matter
    gates, heads = fused_decoding.host_hard_gates(router, untied, torch.float32)
    assert torch.equal(gates, torch.tensor([[1.0] * 3 + [1, 0, 1, 0, 0]])) and heads == (0, 1, 2, 3, 5)


def test_step_plan_reads_the_active_heads_and_their_key_value_groups():
    """Heads (0, 1, 2, 5, 6) of 8 with key/value groups of 2: queries of heads 0-2 and 5-6 (zeros for 3, 4 and 7,
    which share a needed group), o_proj's rows of those heads, key/value heads 0-3; heads (4, 5): groups 2 only."""
    attention = moh_llama("learned", kv_heads=4).model.layers[0].self_attn
    projection = fused_decoding.fused_projection(attention)
    hd, weight = attention.head_dim, attention.q_proj.weight
    plan = fused_decoding.step_plan(projection, (0, 1, 2, 5, 6), 8, hd)
    assert (plan.first, plan.last) == (0, 8)
    assert [width for width, _, _ in plan.query_pieces] == [3 * hd, 2 * hd, 2 * hd, hd]
    assert [w is None for _, w, _ in plan.query_pieces] == [False, True, False, True]
    assert torch.equal(plan.query_pieces[2][1], weight[5 * hd : 7 * hd])
    head_major = attention.o_proj.weight.t()
    assert [(start, end) for start, end, _ in plan.output_runs] == [(0, 3 * hd), (5 * hd, 7 * hd)]
    assert torch.equal(plan.output_runs[1][2], head_major[5 * hd : 7 * hd])
    narrow = fused_decoding.step_plan(projection, (4, 5), 8, hd)
    assert (narrow.first, narrow.last) == (4, 6) and narrow.output_runs[0][:2] == (0, 2 * hd)
    assert fused_decoding.step_plan(projection, (4, 5), 8, hd) is narrow  # cached


@pytest.mark.parametrize("kv_heads", [4, 2])
@pytest.mark.parametrize("router", ["learned", "l2"])
def test_head_sparse_step_reads_no_weight_of_an_inactive_head(router, kv_heads, monkeypatch):
    """NaN in the inactive heads' q_proj rows (the learned router; l2 scores every query) and o_proj columns (after the
    prompt's prefill) of one sequence's decoding step: the head-sparse step still gives the clean masked path's logits
    (the masked path itself would turn NaN × 0 into NaN)."""
    model = moh_llama(router, kv_heads=kv_heads)
    ids, _ = padded_prompt(1)
    gates = []
    for layer in model.model.layers:  # each layer's gates (1, 1, H) in the masked path's step
        layer.self_attn.head_router.register_forward_hook(lambda module, args, out: gates.append(out[0]))
    set_fused(model, False)
    expected = decode_once(model, ids).logits
    set_fused(model, True)
    for layer in model.model.layers:
        layer.self_attn.head_router._forward_hooks.clear()
    with torch.no_grad():
        cache = model(ids[:, :-1], use_cache=True).past_key_values
    hd = model.config.head_dim
    for layer, layer_gates in zip(model.model.layers, gates[-2:]):
        with torch.no_grad():
            for head in (layer_gates.flatten() == 0).nonzero().flatten().tolist():
                if router == "learned":
                    layer.self_attn.q_proj.weight[head * hd : (head + 1) * hd] = float("nan")
                layer.self_attn.o_proj.weight[:, head * hd : (head + 1) * hd] = float("nan")
    calls = spy_steps(monkeypatch)
    with torch.no_grad():
        logits = model(ids[:, -1:], past_key_values=cache, use_cache=True).logits
    torch.testing.assert_close(logits, expected, rtol=1e-5, atol=1e-5)
    assert calls == [1, 1]


def test_a_hooked_o_proj_is_called_by_a_step_reading_every_head(monkeypatch):
    """A forward hook on o_proj (added after the step has cached its weights) runs: the step reads every head and
    calls o_proj; removed, the step is head-sparse again."""
    model = moh_llama("learned")
    ids, _ = padded_prompt(1)
    expected = decode_once(model, ids).logits
    attention = model.model.layers[0].self_attn
    assert fused_decoding.fused_projection(attention).skips_heads
    seen = []
    handle = attention.o_proj.register_forward_hook(lambda module, args, out: seen.append(out.shape))
    calls = spy_steps(monkeypatch)
    torch.testing.assert_close(decode_once(model, ids).logits, expected, rtol=1e-5, atol=1e-5)
    assert calls == [1, 1] and seen[-1] == (1, 1, model.config.hidden_size)
    assert not fused_decoding.fused_projection(attention).skips_heads
    handle.remove()
    assert fused_decoding.fused_projection(attention).skips_heads


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
    weight = fused_decoding.fused_projection(attention).weight  # head-sparse: keys, values, scores
    assert fused_decoding.fused_projection(attention).weight is weight  # cached
    with torch.no_grad():
        attention.k_proj.weight.mul_(2.0)  # an in-place update (an optimizer step, load_state_dict)
    rebuilt = fused_decoding.fused_projection(attention).weight
    assert rebuilt is not weight and torch.equal(rebuilt[: attention.k_proj.out_features], attention.k_proj.weight)
    attention.head_router.routed_weight = torch.nn.Parameter(torch.randn_like(attention.head_router.routed_weight))
    assert torch.equal(fused_decoding.fused_projection(attention).weight[-5:], attention.head_router.routed_weight)
    with torch.no_grad():
        attention.o_proj.weight.add_(1.0)
    assert torch.equal(fused_decoding.fused_projection(attention).output_weight, attention.o_proj.weight.t())
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
        model.config.moh_head_skipping = "naive" if case == "head_skipping_backend" else False
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
