"""Mixture-of-Head attention: routers against naive per-token loops and the paper's formulas, equivalence with dense
Llama / plain MHA, head skipping against masking, generation, load-balancing loss, configs, training, save/load."""

import dataclasses
import math

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

import mhmoe
from mhmoe import MHMoEConfig, MHMoEForCausalLM, MoHLlamaConfig, MoHLlamaForCausalLM
from mhmoe.evaluation.analysis import head_load
from mhmoe.hub.cards import architecture_rows
from mhmoe.models.moh import head_routers, head_skipping, moh_attention
from mhmoe.models.moh.head_routers import HEAD_ROUTERS
from mhmoe.models.moh.moh_losses import moh_load_balancing_loss
from tests.causal_lm_tester import randomise_moh_routers as randomise_routers

VOCAB, HIDDEN, HEADS = 100, 32, 8


def tiny_mhmoe(**kwargs) -> MHMoEConfig:
    fields = dict(
        vocab_size=VOCAB,
        hidden_size=HIDDEN,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=HEADS,
        num_key_value_heads=4,
        decoder_sparse_step=0,
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        pad_token_id=0,
        eos_token_id=None,
        moh_router="learned",  # the paper's from-scratch router (the fields' defaults are its continue-tuning one)
        moh_straight_through=False,
    )
    fields.update(kwargs)
    return MHMoEConfig(**fields)


def tiny_llama_fields(**kwargs) -> dict:
    fields = dict(
        vocab_size=VOCAB,
        hidden_size=HIDDEN,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=HEADS,
        num_key_value_heads=4,
        pad_token_id=0,
        eos_token_id=None,
    )
    fields.update(kwargs)
    return fields


# --------------------------------------------------------------------------------------------------------------------
# routers against naive per-token loops


def naive_softmax(values):
    top = max(values)
    exps = [math.exp(v - top) for v in values]
    return [e / sum(exps) for e in exps]


def naive_topk_gates(probs, k):
    """Top-k of probs, renormalised over the k, ×k; 0 elsewhere (the reference code's routed gates)."""
    order = sorted(range(len(probs)), key=lambda i: -probs[i])[:k]
    total = sum(probs[i] for i in order)
    return [probs[i] / total * k if i in order else 0.0 for i in range(len(probs))], set(order)


@pytest.mark.parametrize("shared,active", [(3, 2), (0, 4), (1, 1), (5, 3)])
def test_l2_router_matches_naive_per_token_loop(shared, active):
    torch.manual_seed(shared * 10 + active)
    batch, seq, head_dim = 2, 5, 4
    query = torch.randn(batch, seq, HEADS, head_dim) * torch.linspace(0.5, 2.0, HEADS)[:, None]
    hidden = torch.randn(batch, seq, HIDDEN)
    soft = HEAD_ROUTERS["l2"](HIDDEN, HEADS, shared, active, straight_through=False)
    hard = HEAD_ROUTERS["l2"](HIDDEN, HEADS, shared, active, straight_through=True)
    gates, logits, index = soft(hidden, query)
    hard_gates, _, _ = hard(hidden, query)
    assert list(soft.parameters()) == []  # parameter-free
    routed = HEADS - shared
    for b in range(batch):
        for t in range(seq):
            norms = [math.sqrt(sum(float(v) ** 2 for v in query[b, t, h])) for h in range(shared, HEADS)]
            mean = sum(norms) / routed
            std = math.sqrt(sum((n - mean) ** 2 for n in norms) / (routed - 1))
            scores = [n / max(std, 1e-6) for n in norms]
            expected, chosen = naive_topk_gates(naive_softmax(scores), active)
            torch.testing.assert_close(logits[b, t], torch.tensor(scores), rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(gates[b, t], torch.tensor([1.0] * shared + expected), rtol=1e-5, atol=1e-6)
            assert set(index[b, t].tolist()) == chosen
            assert hard_gates[b, t].tolist() == [1.0] * shared + [1.0 if i in chosen else 0.0 for i in range(routed)]


@pytest.mark.parametrize("shared,active", [(3, 2), (1, 4), (0, 3)])
def test_learned_router_matches_paper_equations(shared, active):
    """Eq. 5-6 with the reference code's renormalised ×K routed gates and ×S shared gates, per token."""
    torch.manual_seed(shared + active)
    router = HEAD_ROUTERS["learned"](HIDDEN, HEADS, shared, active)
    randomise_routers(router, std=0.5)
    hidden = torch.randn(2, 4, HIDDEN)
    gates, logits, _ = router(hidden, None)
    for b in range(2):
        for t in range(4):
            x = hidden[b, t].tolist()

            def project(weight):
                return [sum(w * xi for w, xi in zip(row, x)) for row in weight.tolist()]

            routed_logits = project(router.routed_weight)
            routed, _ = naive_topk_gates(naive_softmax(routed_logits), active)
            if shared == 0:
                expected = routed
            else:
                shared_gates = (
                    [g * shared for g in naive_softmax(project(router.shared_weight))] if shared > 1 else [1.0]
                )
                alpha1, alpha2 = (2 * a for a in naive_softmax(project(router.stage_weight)))
                expected = [alpha1 * g for g in shared_gates] + [alpha2 * g for g in routed]
            torch.testing.assert_close(logits[b, t], torch.tensor(routed_logits), rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(gates[b, t], torch.tensor(expected), rtol=1e-5, atol=1e-5)


def test_learned_router_at_init_is_plain_multi_head_attention():
    torch.manual_seed(0)
    plain = MHMoEForCausalLM(tiny_mhmoe()).eval()
    model = MHMoEForCausalLM(tiny_mhmoe(moh_shared_heads=3, moh_active_heads=5, moh_router="learned")).eval()
    result = model.load_state_dict(plain.state_dict(), strict=False)
    assert result.unexpected_keys == []
    assert result.missing_keys and all(".head_router." in key for key in result.missing_keys)
    x = torch.randint(1, VOCAB, (2, 9))
    torch.testing.assert_close(model(x).logits, plain(x).logits, rtol=0, atol=1e-6)
    router = model.model.layers[0].self_attn.head_router
    gates, _, _ = router(torch.randn(2, 3, HIDDEN), None)
    torch.testing.assert_close(gates, torch.ones_like(gates))  # uniform gates equal 1
    # with fewer active heads the fresh router keeps gate 1 on the selected heads
    partial = HEAD_ROUTERS["learned"](HIDDEN, HEADS, 3, 2)
    gates, _, _ = partial(torch.randn(2, 3, HIDDEN), None)
    assert sorted(set(gates.flatten().tolist())) == pytest.approx([0.0, 1.0])
    assert (gates != 0).sum(-1).eq(5).all()


# --------------------------------------------------------------------------------------------------------------------
# equivalence with dense models


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
@pytest.mark.parametrize("kv_heads", [8, 4, 2])
def test_all_heads_active_l2_straight_through_equals_llama_exactly(attn, kv_heads):
    torch.manual_seed(kv_heads)
    llama = LlamaForCausalLM(LlamaConfig(**tiny_llama_fields(num_key_value_heads=kv_heads))).eval()
    config = MoHLlamaConfig(
        **tiny_llama_fields(num_key_value_heads=kv_heads),
        moh_shared_heads=3,
        moh_active_heads=5,
        moh_router="l2",
        moh_straight_through=True,
    )
    model = MoHLlamaForCausalLM(config).eval()
    model.load_state_dict(llama.state_dict(), strict=True)
    assert set(model.state_dict()) == set(llama.state_dict())
    llama.set_attn_implementation(attn)
    model.set_attn_implementation(attn)
    x = torch.randint(1, VOCAB, (2, 11))
    mask = torch.ones_like(x)
    mask[1, :3] = 0
    expected, got = llama(x, attention_mask=mask, labels=x), model(x, attention_mask=mask, labels=x)
    assert torch.equal(got.logits, expected.logits)
    assert torch.equal(got.loss, expected.loss)


def test_mhmoe_all_heads_active_l2_straight_through_equals_plain_mhmoe_exactly():
    torch.manual_seed(0)
    plain = MHMoEForCausalLM(tiny_mhmoe(decoder_sparse_step=1)).eval()
    model = MHMoEForCausalLM(
        tiny_mhmoe(
            decoder_sparse_step=1, moh_shared_heads=2, moh_active_heads=6, moh_router="l2", moh_straight_through=True
        )
    ).eval()
    model.load_state_dict(plain.state_dict(), strict=True)
    x = torch.randint(1, VOCAB, (2, 7))
    assert torch.equal(model(x).logits, plain(x).logits)


def test_moh_llama_from_pretrained_loads_a_dense_llama_checkpoint(tmp_path):
    torch.manual_seed(0)
    llama = LlamaForCausalLM(LlamaConfig(**tiny_llama_fields())).eval()
    llama.save_pretrained(tmp_path)
    model, info = MoHLlamaForCausalLM.from_pretrained(
        tmp_path, moh_shared_heads=4, moh_active_heads=2, moh_router="l2", output_loading_info=True
    )
    assert info["missing_keys"] == set() or not info["missing_keys"]
    assert not info["unexpected_keys"]
    assert isinstance(model.config, MoHLlamaConfig) and model.config.moh_active_heads == 2
    for key, value in llama.state_dict().items():
        assert torch.equal(model.state_dict()[key], value), key
    x = torch.randint(1, VOCAB, (1, 6))
    assert not torch.equal(model.eval()(x).logits, llama(x).logits)  # 2 of 8 heads are off per token


# --------------------------------------------------------------------------------------------------------------------
# head skipping


@pytest.fixture
def sparse_from_two_tokens(monkeypatch):
    """The default backend's head-sparse op from 2 query tokens on (the models take it from the CPU policy's
    prefill_min_tokens, which the tiny prompts here do not reach)."""
    use_policy(monkeypatch, prefill_min_tokens=2)


def use_policy(monkeypatch, **fields) -> None:
    """The models' dispatch (`head_skipping.head_sparse_pays`) under the default CPU policy with `fields` replaced."""
    policy = dataclasses.replace(head_skipping.DEFAULT_CPU_POLICY, **fields)
    monkeypatch.setattr(head_skipping, "DEFAULT_CPU_POLICY", policy)


def set_head_skipping(model, value) -> None:
    model.config.moh_head_skipping = value  # every layer reads the model's config (attention_plan.py)


def spy_head_sparse(monkeypatch) -> list:
    """Record (query shape, backend, gates require grad) of every `head_sparse_attention` call the models make."""
    calls = []
    original = moh_attention.head_sparse_attention

    def spy(query, key, value, gates, *args, **kwargs):
        calls.append((tuple(query.shape), kwargs.get("backend"), gates.requires_grad))
        return original(query, key, value, gates, *args, **kwargs)

    monkeypatch.setattr(moh_attention, "head_sparse_attention", spy)
    return calls


def loss_and_grads(model, skipping, ids, **kwargs) -> tuple:
    """(output, {parameter: gradient}) of one forward and backward of the loss with `moh_head_skipping=skipping`."""
    set_head_skipping(model, skipping)
    model.zero_grad()
    out = model(ids, **kwargs)
    out.loss.backward()
    return out, {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def build_skipping_models():
    """Both families, GQA (8 heads on 4 key/value heads): MHMoE with a learned router (soft gates) and a sliding
    window of 9; MoH-LLaMA with the l2 router and straight-through 0/1 gates."""
    torch.manual_seed(0)
    mhmoe_model = MHMoEForCausalLM(tiny_mhmoe(moh_shared_heads=2, moh_active_heads=3, sliding_window=9))
    randomise_routers(mhmoe_model)
    fields = tiny_llama_fields()
    llama = MoHLlamaForCausalLM(
        MoHLlamaConfig(**fields, moh_shared_heads=3, moh_active_heads=2, moh_router="l2", moh_straight_through=True)
    )
    return {"mhmoe-learned-window": mhmoe_model, "moh-llama-l2-ste": llama}


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
@pytest.mark.parametrize("backend", [True, "naive", "triton"])
@pytest.mark.parametrize("name", ["mhmoe-learned-window", "moh-llama-l2-ste"])
def test_training_computes_active_heads_only_and_equals_the_masked_path(
    name, backend, attn, monkeypatch, sparse_from_two_tokens
):
    """Prefill with gradients (37 tokens, odd, left padding, GQA): loss, logits and every parameter's gradient of the
    head-sparse path (default: the CPU path) equal every head computed and masked."""
    model = build_skipping_models()[name]
    model.set_attn_implementation(attn)
    calls = spy_head_sparse(monkeypatch)
    ids = torch.randint(1, VOCAB, (2, 37), generator=torch.Generator().manual_seed(3))
    mask = torch.ones_like(ids)
    mask[1, :5] = 0
    labels = ids.masked_fill(mask == 0, -100)
    labels[1, 5] = -100  # predicted from a padding position (whose attention sees no key)

    masked, masked_grads = loss_and_grads(model, False, ids, attention_mask=mask, labels=labels)
    assert not calls
    sparse, sparse_grads = loss_and_grads(model, backend, ids, attention_mask=mask, labels=labels)
    assert len(calls) == 2 and all(call[0][2] == 37 and call[2] for call in calls)  # both layers, with gradients
    assert all(call[1] == (None if backend is True else backend) for call in calls)
    torch.testing.assert_close(sparse.loss, masked.loss, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(sparse.logits[mask.bool()], masked.logits[mask.bool()], rtol=1e-5, atol=1e-5)
    assert sparse_grads.keys() == masked_grads.keys()
    for param, grad in masked_grads.items():
        torch.testing.assert_close(sparse_grads[param], grad, rtol=1e-4, atol=1e-6, msg=param)


@pytest.mark.parametrize("name", ["mhmoe-learned-window", "moh-llama-l2-ste"])
def test_flex_backend_at_inference_equals_the_masked_path(name, monkeypatch):
    """`moh_head_skipping="flex"` (FlexAttention over each head's active rows; forward only on the CPU): a
    left-padded prefill of 37 tokens gives the logits of every head computed and masked, through the op in both
    layers on that backend."""
    model = build_skipping_models()[name].eval()
    calls = spy_head_sparse(monkeypatch)
    ids = torch.randint(1, VOCAB, (2, 37), generator=torch.Generator().manual_seed(3))
    mask = torch.ones_like(ids)
    mask[1, :5] = 0
    with torch.no_grad():
        set_head_skipping(model, False)
        masked = model(ids, attention_mask=mask).logits
        set_head_skipping(model, "flex")
        flex = model(ids, attention_mask=mask).logits
    assert [call[1] for call in calls] == ["flex", "flex"]
    torch.testing.assert_close(flex[mask.bool()], masked[mask.bool()], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("cache", ["dynamic", "static"])
@pytest.mark.parametrize("name", ["mhmoe-learned-window", "moh-llama-l2-ste"])
def test_generation_computes_active_heads_only_and_equals_the_masked_path(
    name, cache, monkeypatch, sparse_from_two_tokens
):
    """Greedy generation from a left-padded prompt (prefill of 19 tokens, then single-token steps), dynamic and static
    caches: the same tokens and scores as every head computed and masked; every step takes the head-sparse path (the
    fused decoding step, which would take the single-token steps on the CPU, is off: tests/models/test_fused_decoding.py)."""
    model = build_skipping_models()[name].eval()
    model.config.moh_fused_decoding = False
    calls = spy_head_sparse(monkeypatch)
    ids = torch.randint(1, VOCAB, (3, 19), generator=torch.Generator().manual_seed(4))
    mask = torch.ones_like(ids)
    ids[1, :6], mask[1, :6] = 0, 0
    settings = dict(max_new_tokens=6, do_sample=False, output_scores=True, return_dict_in_generate=True)
    if cache == "static":
        settings["cache_implementation"] = "static"
    with torch.no_grad():
        set_head_skipping(model, False)
        masked = model.generate(ids, attention_mask=mask, **settings)
        set_head_skipping(model, True)
        sparse = model.generate(ids, attention_mask=mask, **settings)
    assert [call[0][2] for call in calls] == [19] * 2 + [1] * 2 * 5  # prefill and 5 decoding steps, both layers
    assert torch.equal(sparse.sequences, masked.sequences)
    for got, expected in zip(sparse.scores, masked.scores):
        torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)


def test_head_major_o_proj_copy_follows_weight_updates():
    """The cached head-major copy of o_proj's weight (fused decoding) follows in-place updates and stays out of the
    state dict."""
    o_proj = torch.nn.Linear(HEADS * 4, HIDDEN, bias=False)
    first = head_skipping._head_major_weight(o_proj).clone()
    assert torch.equal(first, o_proj.weight.t())
    with torch.no_grad():
        o_proj.weight.mul_(2)  # in place: the cached copy is stale now
    assert torch.equal(head_skipping._head_major_weight(o_proj), 2 * first)
    assert "_moh_head_major" not in str(list(o_proj.state_dict()))


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
def test_short_unpadded_prompt_stays_causal(attn, sparse_from_two_tokens):
    """sdpa passes no mask for an unpadded prompt (is_causal): the head-sparse path must stay causal then."""
    torch.manual_seed(0)
    model = MHMoEForCausalLM(tiny_mhmoe(moh_shared_heads=2, moh_active_heads=3)).eval()
    randomise_routers(model)
    model.set_attn_implementation(attn)
    x = torch.randint(1, VOCAB, (1, 5))
    with torch.no_grad():
        fast = model(x).logits
        set_head_skipping(model, False)
        reference = model(x).logits
    torch.testing.assert_close(fast, reference, rtol=1e-5, atol=1e-5)
    set_head_skipping(model, True)
    torch.testing.assert_close(model(x[:, :3]).logits.detach(), reference[:, :3], rtol=1e-5, atol=1e-5)  # causal


def naive_kv_heads_skippable(heads, kv_heads, shared, active) -> bool:
    """Some top-K selection of the routed heads leaves a key/value head unread by every active head (brute force)."""
    from itertools import combinations

    groups = heads // kv_heads
    for chosen in combinations(range(shared, heads), active):
        active_heads = set(range(shared)) | set(chosen)
        if any(not active_heads & set(range(g * groups, (g + 1) * groups)) for g in range(kv_heads)):
            return True
    return False


def test_kv_heads_skippable_matches_brute_force():
    cases = 0
    for heads, kv_heads in [(9, 3), (8, 4), (8, 2), (6, 6), (12, 4), (8, 1)]:
        for shared in range(heads):
            for active in range(1, heads - shared + 1):
                router = HEAD_ROUTERS["l2"](HIDDEN, heads, shared, active)
                expected = naive_kv_heads_skippable(heads, kv_heads, shared, active)
                assert head_skipping.kv_heads_skippable(router, kv_heads) == expected, (heads, kv_heads, shared, active)
                cases += expected
    assert cases > 10
    smollm2 = {k: HEAD_ROUTERS["l2"](HIDDEN, 9, 3, k) for k in (4, 2)}  # 7/9 and 5/9 of SmolLM2-135M (GQA 3)
    assert not head_skipping.kv_heads_skippable(smollm2[4], 3) and head_skipping.kv_heads_skippable(smollm2[2], 3)


@pytest.mark.parametrize("active,decode_sparse", [(3, False), (2, True)])
def test_default_takes_the_head_sparse_op_only_where_it_pays(active, decode_sparse, monkeypatch):
    """Prefill: the op from the policy's prefill_min_tokens on, the masked path below; decoding: the op only where a
    key/value head can go unread (8 heads on 4 key/value heads, 4 shared: 3 routed active leave none unread). The
    fused decoding step, which takes single-token steps on the CPU first, is off here (test_fused_decoding.py)."""
    use_policy(monkeypatch, prefill_min_tokens=20)
    calls = spy_head_sparse(monkeypatch)
    fields = tiny_llama_fields()
    model = MoHLlamaForCausalLM(
        MoHLlamaConfig(**fields, moh_shared_heads=4, moh_active_heads=active, moh_straight_through=True)
    ).eval()
    model.config.moh_fused_decoding = False
    with torch.no_grad():
        for tokens, sparse in ((19, False), (20, True)):
            calls.clear()
            model(torch.randint(1, VOCAB, (1, tokens)))
            assert len(calls) == (2 if sparse else 0), tokens
        calls.clear()
        model.generate(torch.randint(1, VOCAB, (1, 3)), max_new_tokens=3, do_sample=False)
    decoded = [call for call in calls if call[0][2] == 1]
    assert len(decoded) == (4 if decode_sparse else 0)


def test_default_takes_the_op_for_short_prefills_with_few_routed_heads(monkeypatch):
    """Where at most the CPU policy's few_active_share of the routed heads are active (1 of 4 here, not 2 of 4) the op
    runs on shorter prefills too, in the lengths its few_active_tokens give (from 20 to 24 and from 26 tokens here), in
    inference without a mask only: not where a backward follows, not with padding."""
    use_policy(monkeypatch, few_active_tokens=(20, 24, 26))
    calls = spy_head_sparse(monkeypatch)
    fields = tiny_llama_fields()
    ids = torch.randint(1, VOCAB, (2, 26))
    for active, pays in ((1, True), (2, False)):
        model = MoHLlamaForCausalLM(
            MoHLlamaConfig(**fields, moh_shared_heads=4, moh_active_heads=active, moh_straight_through=True)
        ).eval()
        with torch.no_grad():
            for tokens in (19, 20, 23, 24, 25, 26):
                calls.clear()
                model(ids[:, :tokens])
                assert len(calls) == (2 if pays and tokens in (20, 23, 26) else 0), (active, tokens)
            calls.clear()
            padded = torch.ones_like(ids)
            padded[0, :3] = 0
            model(ids, attention_mask=padded)
            assert not calls
        calls.clear()
        model(ids).logits.sum().backward()
        assert not calls


# --------------------------------------------------------------------------------------------------------------------
# generation


def left_padded_prompt():
    generator = torch.Generator().manual_seed(1)
    ids = torch.randint(1, VOCAB, (3, 7), generator=generator)
    mask = torch.ones_like(ids)
    ids[1, :3], mask[1, :3] = 0, 0
    ids[2, :1], mask[2, :1] = 0, 0
    return ids, mask


def build_generation_models():
    torch.manual_seed(0)
    mhmoe_model = MHMoEForCausalLM(tiny_mhmoe(decoder_sparse_step=2, moh_shared_heads=2, moh_active_heads=3))
    randomise_routers(mhmoe_model)
    llama = MoHLlamaForCausalLM(MoHLlamaConfig(**tiny_llama_fields(), moh_shared_heads=4, moh_active_heads=2))
    return {"mhmoe-learned": mhmoe_model, "moh-llama-l2-ste": llama}


@pytest.mark.parametrize("attn", ["flex_attention"])  # flex compiles on first use (~8 s on CPU); sdpa: the tester
def test_backends_agree_with_eager(attn):
    model = build_generation_models()["mhmoe-learned"].eval()
    ids, mask = left_padded_prompt()
    with torch.no_grad():
        model.set_attn_implementation("eager")
        expected = model(ids, attention_mask=mask).logits[mask.bool()]
        model.set_attn_implementation(attn)
        got = model(ids, attention_mask=mask).logits[mask.bool()]
    assert not torch.equal(expected, torch.zeros_like(expected))
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)


# --------------------------------------------------------------------------------------------------------------------
# straight-through estimator and the load-balancing loss


def test_straight_through_gates_are_binary_and_pass_gradients():
    torch.manual_seed(0)
    router = HEAD_ROUTERS["learned"](HIDDEN, HEADS, 3, 2, straight_through=True)
    randomise_routers(router, std=0.3)
    hidden = torch.randn(2, 5, HIDDEN)
    gates, _, _ = router(hidden, None)
    assert set(gates.unique().tolist()) == {0.0, 1.0}
    (gates * torch.randn(gates.shape)).sum().backward()
    for param in (router.routed_weight, router.shared_weight, router.stage_weight):
        assert param.grad is not None and param.grad.abs().sum() > 0

    # l2 router: the gradient reaches the queries through the norms
    l2 = HEAD_ROUTERS["l2"](HIDDEN, HEADS, 3, 2, straight_through=True)
    query = torch.randn(2, 5, HEADS, 4, requires_grad=True)
    gates, _, _ = l2(hidden, query)
    assert set(gates.unique().tolist()) == {0.0, 1.0}
    (gates * torch.randn(gates.shape)).sum().backward()
    assert query.grad[:, :, 3:].abs().sum() > 0  # routed heads' queries
    assert query.grad[:, :, :3].abs().sum() == 0  # shared heads have constant gates


ST_MODES = (True, "scores", "selected_scores")
ROUTER_STATS = dict(
    head_norm_stats=(torch.linspace(0.5, 2.0, HEADS).tolist(), torch.linspace(0.2, 0.9, HEADS).tolist())
)


@pytest.mark.parametrize(
    "name,mode",
    [("learned", True)] + [(name, mode) for name in HEAD_ROUTERS if name != "learned" for mode in ST_MODES],
)
def test_straight_through_gates_without_autograd_are_the_forward_value_in_few_ops(name, mode):
    """Inference (no autograd) builds the straight-through gates' forward value directly: the same gates, logits and
    selected heads as with autograd, in at most 9 tensor ops besides views (the router runs once per layer per decoded
    token)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    aten = torch.ops.aten
    VIEWS = (aten.view, aten._unsafe_view, aten.t, aten.slice, aten.select, aten.expand, aten.unsqueeze)

    class CountOps(TorchDispatchMode):
        count = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func.overloadpacket not in VIEWS:
                CountOps.count += 1
            return func(*args, **(kwargs or {}))

    torch.manual_seed(1)
    stats = ROUTER_STATS if name.startswith("l2_") else {}
    router = HEAD_ROUTERS[name](HIDDEN, HEADS, 3, 2, straight_through=mode, **stats)
    randomise_routers(router, std=0.3)
    hidden, query = torch.randn(2, 5, HIDDEN), torch.randn(2, 5, HEADS, 4) * torch.linspace(0.5, 2.0, HEADS)[:, None]
    expected = router(hidden, query)
    with torch.no_grad():
        router(hidden, query)  # first use: the calibrated routers' statistics move to the device
        with CountOps():
            got = router(hidden, query)
    assert expected[0].requires_grad or name != "learned"
    for tensor, reference in zip(got, expected):
        assert torch.equal(tensor, reference.detach())
    assert set(got[0].unique().tolist()) == {0.0, 1.0} and got[0].sum(-1).eq(3 + 2).all()
    assert CountOps.count <= 9, CountOps.count


def test_straight_through_routes_lm_gradients_into_the_query_projection(monkeypatch):
    """In a model the routing path adds to the q_proj gradient: compare with gates that carry no gradient."""
    torch.manual_seed(0)
    model = MoHLlamaForCausalLM(MoHLlamaConfig(**tiny_llama_fields(), moh_shared_heads=4, moh_active_heads=2))
    x = torch.randint(1, VOCAB, (2, 8))

    def q_grad():
        model.zero_grad()
        model(x, labels=x).loss.backward()
        return model.model.layers[-1].self_attn.q_proj.weight.grad.clone()  # last layer: no routing downstream

    with_ste = q_grad()
    monkeypatch.setattr(head_routers, "straight_through", lambda soft, hard: hard)
    without = q_grad()
    routed_rows = slice(4 * 4, 8 * 4)
    assert (with_ste[routed_rows] - without[routed_rows]).abs().max() > 1e-6
    torch.testing.assert_close(with_ste[: 4 * 4], without[: 4 * 4])  # shared heads: no routing gradient


def naive_balance_loss(router_logits, active, mask):
    losses = []
    for logits in router_logits:
        batch, seq, routed = logits.shape
        tokens = [(b, t) for b in range(batch) for t in range(seq) if mask[b, t]]
        f, p = [0.0] * routed, [0.0] * routed
        for b, t in tokens:
            probs = naive_softmax(logits[b, t].tolist())
            _, chosen = naive_topk_gates(probs, active)
            for i in range(routed):
                f[i] += (i in chosen) / len(tokens)
                p[i] += probs[i] / len(tokens)
        losses.append(routed * sum(fi * pi for fi, pi in zip(f, p)))
    return sum(losses) / len(losses)


def test_load_balancing_loss_matches_equation_7():
    torch.manual_seed(0)
    logits = tuple(torch.randn(3, 6, 5) * 2 for _ in range(3))
    mask = torch.ones(3, 6, dtype=torch.long)
    mask[0, :2] = 0
    got = moh_load_balancing_loss(logits, 2, mask)
    assert got.item() == pytest.approx(naive_balance_loss(logits, 2, mask), rel=1e-5)
    # perfect balance (uniform probabilities) gives K; a collapsed router gives more
    uniform = (torch.zeros(1, 4, 5),)
    assert moh_load_balancing_loss(uniform, 2).item() == pytest.approx(2.0)
    collapsed = (torch.tensor([10.0, 10.0, 0.0, 0.0, 0.0]).expand(1, 4, 5),)
    assert moh_load_balancing_loss(collapsed, 2).item() > 3.9


@pytest.mark.parametrize("name", ["mhmoe-learned", "moh-llama-l2-ste"])
def test_model_adds_weighted_moh_aux_loss(name):
    model = build_generation_models()[name]
    ids, mask = left_padded_prompt()
    labels = ids.masked_fill(mask == 0, -100)
    plain = model(ids, attention_mask=mask, labels=labels, output_router_logits=False)
    assert getattr(plain, "moh_aux_loss", None) is None
    out = model(ids, attention_mask=mask, labels=labels, output_router_logits=True)
    assert len(out.moh_router_logits) == model.config.num_hidden_layers
    assert out.moh_router_logits[0].shape == (3, 7, HEADS - model.config.moh_shared_heads)
    expected_aux = naive_balance_loss(out.moh_router_logits, model.config.moh_active_heads, mask)
    assert out.moh_aux_loss.item() == pytest.approx(expected_aux, rel=1e-5)
    extra = out.loss - plain.loss
    if getattr(out, "aux_loss", None) is not None:  # MH-MoE layers add their own balance loss
        extra = extra - model.config.router_aux_loss_coef * out.aux_loss - model.config.router_z_loss_coef * out.z_loss
    assert extra.item() == pytest.approx(model.config.moh_aux_loss_coef * expected_aux, rel=1e-4)


# --------------------------------------------------------------------------------------------------------------------
# configs


BAD_MOH = [
    (dict(moh_shared_heads=3), "must be set together"),
    (dict(moh_active_heads=3), "must be set together"),
    (dict(moh_shared_heads=6, moh_active_heads=3), "must be <= num_attention_heads"),
    (dict(moh_shared_heads=8, moh_active_heads=1), "at least one head is routed"),
    (dict(moh_shared_heads=-1, moh_active_heads=1), "moh_shared_heads must be >= 0"),
    (dict(moh_shared_heads=2, moh_active_heads=0), "moh_active_heads (routed heads active per token) must be >= 1"),
    (dict(moh_shared_heads=2, moh_active_heads=2, moh_router="topk"), "moh_router must be one of"),
    (
        dict(moh_shared_heads=2, moh_active_heads=2, moh_aux_loss_coef=-0.1),
        "moh_aux_loss_coef must be a finite number >= 0",
    ),
    (dict(moh_shared_heads=2, moh_active_heads=2, moh_active_heads_per_layer=[2]), "a list of 2 whole numbers"),
    (dict(moh_shared_heads=2, moh_active_heads=2, moh_active_heads_per_layer=[0, 4]), "each from 1 to the 6 routed"),
    (dict(moh_shared_heads=2, moh_active_heads=2, moh_active_heads_per_layer=[1, 7]), "each from 1 to the 6 routed"),
    (dict(moh_shared_heads=2, moh_active_heads=2, moh_active_heads_per_layer=[1.5, 2]), "a list of 2 whole numbers"),
    (dict(moh_active_heads_per_layer=[2, 2]), "moh_active_heads_per_layer needs MoH on"),
]


@pytest.mark.parametrize("fields,message", BAD_MOH)
def test_invalid_moh_configs_are_refused_in_words(fields, message):
    with pytest.raises(Exception, match="Invalid MHMoEConfig") as error:
        tiny_mhmoe(**fields)
    assert message in str(error.value)
    with pytest.raises(Exception, match="Invalid MoHLlamaConfig") as error:
        MoHLlamaConfig(**tiny_llama_fields(), **fields)
    assert message in str(error.value)


def test_moh_llama_overrides_and_late_fields_are_checked(tmp_path):
    """from_pretrained overrides join the file's fields before the checks; fields set later are checked by the model."""
    config = MoHLlamaConfig(**tiny_llama_fields(), moh_shared_heads=2, moh_active_heads=2)
    MoHLlamaForCausalLM(config).save_pretrained(tmp_path)
    with pytest.raises(Exception, match="must be <= num_attention_heads"):
        MoHLlamaForCausalLM.from_pretrained(tmp_path, moh_active_heads=99)
    model = MoHLlamaForCausalLM.from_pretrained(tmp_path, moh_active_heads=3)
    assert model.config.moh_active_heads == 3 and model.model.layers[0].self_attn.head_router.active_heads == 3
    config.moh_active_heads = 99
    with pytest.raises(ValueError, match="must be <= num_attention_heads"):
        MoHLlamaForCausalLM(config)


@pytest.mark.parametrize("shared,active", [(0, 1), (0, 8), (1, 7), (7, 1), (2, 3), (5, 2)])
def test_any_shared_routed_ratio_works(shared, active):
    torch.manual_seed(shared * 8 + active)
    model = MHMoEForCausalLM(tiny_mhmoe(moh_shared_heads=shared, moh_active_heads=active)).eval()
    randomise_routers(model)
    x = torch.randint(1, VOCAB, (2, 5))
    out = model(x, output_router_logits=True)
    gates, _, _ = model.model.layers[0].self_attn.head_router(torch.randn(2, 5, HIDDEN), None)
    assert ((gates != 0).sum(-1) == shared + active).all()
    assert out.moh_router_logits[0].shape[-1] == HEADS - shared
    assert torch.isfinite(out.logits).all() and torch.isfinite(out.moh_aux_loss)


# --------------------------------------------------------------------------------------------------------------------
# training and save/load


def repetitive_corpus():
    generator = torch.Generator().manual_seed(0)
    patterns = torch.randint(1, VOCAB, (4, 8), generator=generator)
    return torch.stack([patterns[torch.randint(0, 4, (4,), generator=generator)].reshape(-1) for _ in range(8)])


def train(model, steps=30, lr=1e-2):
    data = repetitive_corpus()
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    history = []
    model.train()
    for _ in range(steps):
        out = model(data, labels=data, output_router_logits=True)
        lm_loss = out.loss - model.config.moh_aux_loss_coef * out.moh_aux_loss
        if getattr(out, "aux_loss", None) is not None:
            lm_loss = lm_loss - model.config.router_aux_loss_coef * out.aux_loss
        history.append((lm_loss.item(), out.moh_aux_loss.item()))
        optimizer.zero_grad()
        out.loss.backward()
        optimizer.step()
    return history


def test_mhmoe_with_learned_router_trains_from_scratch():
    """From a collapsed router (every token prefers the same 2 routed heads) LM loss and head balance loss fall."""
    torch.manual_seed(0)
    config = tiny_mhmoe(
        decoder_sparse_step=1, moe_heads=2, moh_shared_heads=4, moh_active_heads=2, moh_aux_loss_coef=0.1
    )  # MH-MoE feed-forward layers and MoH attention; a larger balance weight than the paper's 0.01 for 30 steps
    model = MHMoEForCausalLM(config)
    with torch.no_grad():
        shared_direction = torch.nn.functional.normalize(torch.randn(HIDDEN), dim=0)
        model.model.embed_tokens.weight += 0.2 * shared_direction
        for layer in model.model.layers:
            layer.self_attn.head_router.routed_weight[:2] = 5 * shared_direction
    history = train(model)
    (lm_start, aux_start), (lm_end, aux_end) = history[0], history[-1]
    assert aux_start > 3.9  # R·Σf·P of a collapsed router (K = 2 is perfect balance)
    assert lm_end < 0.5 * lm_start
    assert aux_end < aux_start - 0.3
    assert any(
        p.grad is not None and p.grad.abs().sum() > 0 for p in model.model.layers[0].self_attn.head_router.parameters()
    )


def test_fresh_learned_router_learns_token_dependent_routing():
    """Zero-initialised routers tie: every token starts on the same routed heads; training spreads the load."""
    torch.manual_seed(0)
    model = MHMoEForCausalLM(tiny_mhmoe(moh_shared_heads=4, moh_active_heads=2))  # paper's coefficient 0.01
    data = repetitive_corpus()
    before = mhmoe.head_load(model, [data])[:, 4:]
    assert set(before.unique().tolist()) == {0.0, 1.0}
    train(model, steps=60)
    after = mhmoe.head_load(model, [data])[:, 4:]
    assert ((after > 0.2) & (after < 0.8)).all(), after


# --------------------------------------------------------------------------------------------------------------------
# per-layer head budgets (moh_active_heads_per_layer)


def per_layer_models(budgets):
    """An MHMoE (learned router, randomised) and a MoH-LLaMA (l2, straight-through) with routed budgets `budgets`."""
    torch.manual_seed(0)
    mhmoe_model = MHMoEForCausalLM(
        tiny_mhmoe(moh_shared_heads=2, moh_active_heads=3, moh_active_heads_per_layer=budgets)
    )
    randomise_routers(mhmoe_model)
    llama_fields = dict(moh_shared_heads=2, moh_active_heads=3, moh_active_heads_per_layer=budgets)
    llama = MoHLlamaForCausalLM(MoHLlamaConfig(**tiny_llama_fields(), **llama_fields, moh_straight_through=True))
    return {"mhmoe-learned": mhmoe_model.eval(), "moh-llama-l2-ste": llama.eval()}


@pytest.mark.parametrize("name", ["mhmoe-learned", "moh-llama-l2-ste"])
def test_per_layer_budget_activates_exactly_its_routed_heads(name):
    """A layer with budget k gates exactly k routed heads (and every shared head) per token; the balance loss takes
    each layer's own k."""
    budgets = [1, 5]
    model = per_layer_models(budgets)[name]
    gates = {}
    for i, layer in enumerate(model.model.layers):
        assert layer.self_attn.head_router.active_heads == budgets[i]
        layer.self_attn.head_router.register_forward_hook(lambda m, a, out, i=i: gates.__setitem__(i, out[0]))
    x = torch.randint(1, VOCAB, (2, 7))
    mask = torch.ones_like(x)
    out = model(x, attention_mask=mask, output_router_logits=True)
    for i, k in enumerate(budgets):
        assert ((gates[i][..., 2:] != 0).sum(-1) == k).all()
        assert (gates[i][..., :2] != 0).all()
    expected = sum(naive_balance_loss(out.moh_router_logits[i : i + 1], k, mask) for i, k in enumerate(budgets)) / 2
    assert out.moh_aux_loss.item() == pytest.approx(expected, rel=1e-5)
    load = head_load(model, [x])
    assert load[:, 2:].sum(-1).tolist() == pytest.approx([float(k) for k in budgets])


@pytest.mark.parametrize("name", ["mhmoe-learned", "moh-llama-l2-ste"])
def test_uniform_per_layer_budgets_equal_no_per_layer_field(name):
    """None (the default) is the uniform moh_active_heads; the same k written per layer gives identical logits."""
    x = torch.randint(1, VOCAB, (2, 7))
    base = per_layer_models(None)[name]
    assert base.config.moh_active_heads_per_layer is None
    assert all(layer.self_attn.head_router.active_heads == 3 for layer in base.model.layers)
    listed = per_layer_models([3, 3])[name]
    listed.load_state_dict(base.state_dict())
    torch.testing.assert_close(listed(x).logits, base(x).logits, rtol=0, atol=0)
    uneven = per_layer_models([1, 5])[name]
    uneven.load_state_dict(base.state_dict())
    assert not torch.equal(uneven(x).logits, base(x).logits)


def test_per_layer_budgets_survive_save_and_load(tmp_path):
    model = per_layer_models([1, 5])["moh-llama-l2-ste"]
    model.save_pretrained(tmp_path)
    loaded = MoHLlamaForCausalLM.from_pretrained(tmp_path).eval()
    assert loaded.config.moh_active_heads_per_layer == [1, 5]
    assert [layer.self_attn.head_router.active_heads for layer in loaded.model.layers] == [1, 5]
    x = torch.randint(1, VOCAB, (2, 7))
    torch.testing.assert_close(loaded(x).logits, model(x).logits, rtol=0, atol=0)
    rows = dict(architecture_rows(loaded.config))
    assert "2 shared + 3 of 6 routed heads per token = 62.5% of 8 heads active on average" in rows["MoH attention"]
    assert "per-layer routed budgets, layer 0 first: 1, 5" in rows["MoH attention"]


def test_apply_moh_takes_per_layer_budgets():
    torch.manual_seed(0)
    llama = LlamaForCausalLM(LlamaConfig(**tiny_llama_fields())).eval()
    mhmoe.apply_moh(llama, moh_shared_heads=2, moh_active_heads=3, moh_active_heads_per_layer=[2, 4])
    assert [layer.self_attn.head_router.active_heads for layer in llama.model.layers] == [2, 4]
    with pytest.raises(ValueError, match="each from 1 to the 6 routed heads"):
        mhmoe.apply_moh(
            LlamaForCausalLM(LlamaConfig(**tiny_llama_fields())),
            moh_shared_heads=2,
            moh_active_heads=3,
            moh_active_heads_per_layer=[2, 9],
        )
