"""MoH head thresholds (`moh_head_thresholds`): a routed head is on for a token when its router score exceeds the
layer's threshold, so the count of heads varies by token. The gates against a naive loop, the straight-through
gradient against sigmoid(score - threshold) by hand, the balance loss against eq. 7 with the threshold's selection,
every attention path (head-sparse prefill with gradients, generation, the fused decoding step) against the masked
computation, save/load, and the config's refusals."""

import dataclasses

import pytest
import torch

from mhmoe import MHMoEForCausalLM, MoHLlamaConfig, MoHLlamaForCausalLM
from mhmoe.models.moh.head_routers import HEAD_ROUTERS
from mhmoe.models.moh.moh_losses import moh_load_balancing_loss
from mhmoe.models.moh_llama.patch import apply_moh
from tests.causal_lm_tester import randomise_moh_routers
from tests.models.test_fused_decoding import assert_same_generation, generate_both, moh_llama, padded_prompt
from tests.models.test_moh import (
    HEADS,
    HIDDEN,
    VOCAB,
    loss_and_grads,
    spy_head_sparse,
    tiny_llama_fields,
    tiny_mhmoe,
)

THRESHOLDS = [0.3, -0.2]  # one per layer of the tiny models


def threshold_llama(router="learned", kv_heads=4, thresholds=THRESHOLDS):
    return moh_llama(router, kv_heads, moh_head_thresholds=thresholds)


def test_threshold_gates_equal_a_naive_loop_and_vary_per_token():
    router = HEAD_ROUTERS["learned"](HIDDEN, HEADS, 2, 3, straight_through=True)
    router.threshold = 0.25
    randomise_moh_routers(router)
    hidden = torch.randn(3, 17, HIDDEN)
    with torch.no_grad():
        gates, logits, index = router(hidden, None)
    assert index is None and gates.shape == (3, 17, HEADS)
    scores = hidden @ router.routed_weight.T  # (B, T, R)
    for b in range(3):
        for t in range(17):
            expected = [1.0, 1.0] + [1.0 if scores[b, t, h] > 0.25 else 0.0 for h in range(HEADS - 2)]
            assert gates[b, t].tolist() == expected
    counts = (gates[..., 2:] != 0).sum(-1)
    assert counts.unique().numel() >= 3  # a variable number of heads per token, not a fixed K
    torch.testing.assert_close(logits, scores)


@pytest.mark.parametrize("mode", [True, "selected_scores"])
def test_threshold_straight_through_gradient(mode):
    """Forward 0/1 as with no autograd; backward: that of sigmoid(score - threshold) on the selected heads (True) or
    of the selected heads' softmax scores ("selected_scores", an l2 router), computed by hand."""
    name = "learned" if mode is True else "l2"
    router = HEAD_ROUTERS[name](HIDDEN, HEADS, 2, 3, straight_through=mode)
    router.threshold = 0.1 if name == "learned" else 1.5
    randomise_moh_routers(router)
    hidden = torch.randn(2, 9, HIDDEN, requires_grad=True)
    queries = torch.randn(2, 9, HEADS, 4, requires_grad=True)
    weights = torch.randn(2, 9, HEADS)
    gates, logits, _ = router(hidden, queries)
    with torch.no_grad():
        hard, _, _ = router(hidden, queries)
    assert torch.equal(gates.detach(), hard) and 0 < hard[..., 2:].mean() < 1
    (gates * weights).sum().backward()
    leaf = hidden if name == "learned" else queries
    got = leaf.grad.clone()
    leaf.grad = None
    logits = router.scores(hidden, queries, None)
    if mode is True:  # the paper's two stages (eq. 5-6) over the shared softmax and the routed sigmoid
        stage = torch.softmax(hidden @ router.stage_weight.T, -1) * 2  # (B, T, 2)
        shared = torch.softmax(hidden @ router.shared_weight.T, -1) * 2 * stage[..., :1]
        soft = torch.sigmoid(logits - router.threshold) * (logits > router.threshold) * stage[..., 1:]
        (shared * weights[..., :2]).sum().backward(retain_graph=True)
    else:
        soft = torch.softmax(logits, -1) * (logits > router.threshold)
    (soft * weights[..., 2:]).sum().backward()
    torch.testing.assert_close(got, leaf.grad)


def test_balance_loss_counts_the_heads_above_the_threshold():
    logits = [torch.randn(2, 7, 5), torch.randn(2, 7, 5)]
    got = moh_load_balancing_loss(logits, [2, 3], None, [0.2, None])
    expected = []
    for layer, (k, t) in zip(logits, [(2, 0.2), (3, None)]):
        probs = torch.softmax(layer, -1)
        if t is None:
            selected = torch.zeros_like(probs).scatter(-1, probs.topk(k, -1).indices, 1.0)
        else:
            selected = (layer > t).float()
        expected.append(5 * (selected.mean((0, 1)) * probs.mean((0, 1))).sum())
    torch.testing.assert_close(got, torch.stack(expected).mean())


@pytest.mark.parametrize("backend", [True, "naive", "triton"])
def test_head_sparse_prefill_with_thresholds_equals_the_masked_path(backend, monkeypatch):
    """Prefill with gradients (33 tokens, left padding, GQA): loss, logits and every gradient of the head-sparse path
    equal every head computed and masked, with a threshold in each layer."""
    from mhmoe.models.moh import head_skipping

    policy = dataclasses.replace(head_skipping.DEFAULT_CPU_POLICY, prefill_min_tokens=2)
    monkeypatch.setattr(head_skipping, "DEFAULT_CPU_POLICY", policy)
    model = threshold_llama()
    calls = spy_head_sparse(monkeypatch)
    ids = torch.randint(1, VOCAB, (2, 33), generator=torch.Generator().manual_seed(3))
    mask = torch.ones_like(ids)
    mask[1, :5] = 0
    labels = ids.masked_fill(mask == 0, -100)
    labels[1, 5] = -100  # predicted from a padding position (whose attention sees no key)

    kwargs = dict(attention_mask=mask, labels=labels, output_router_logits=True)  # the balance loss too
    masked, masked_grads = loss_and_grads(model, False, ids, **kwargs)
    sparse, sparse_grads = loss_and_grads(model, backend, ids, **kwargs)
    assert len(calls) == 2
    torch.testing.assert_close(sparse.loss, masked.loss, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(sparse.logits[mask.bool()], masked.logits[mask.bool()], rtol=1e-5, atol=1e-5)
    assert sparse_grads.keys() == masked_grads.keys() and any("head_router" in n for n in sparse_grads)
    for param, grad in masked_grads.items():
        torch.testing.assert_close(sparse_grads[param], grad, rtol=1e-4, atol=1e-6, msg=param)


@pytest.mark.parametrize("kv_heads", [4, 1])
@pytest.mark.parametrize("router", ["learned", "l2"])
def test_fused_decoding_with_thresholds_equals_the_masked_path(router, kv_heads, monkeypatch):
    model = threshold_llama(router, kv_heads, thresholds=[0.3, -0.2] if router == "learned" else [1.6, 1.4])
    ids, mask = padded_prompt()
    masked, fused, calls = generate_both(model, ids, mask, monkeypatch)
    assert len(calls) == 2 * 4  # both layers, every decoding step after the first token
    assert_same_generation(masked, fused)


@pytest.mark.parametrize("batch", [1, 3])
def test_fused_decoding_of_tokens_that_pass_no_head(batch, monkeypatch):
    """No shared heads and thresholds that some tokens' scores never pass: those tokens' attention output is 0 (only
    the K/V are cached), in the head-sparse step as in the masked path."""
    model = moh_llama("learned", shared=0, moh_head_thresholds=[8.0, 8.0])  # the random scores reach ~15
    ids, mask = padded_prompt(batch)
    masked, fused, calls = generate_both(model, ids, mask, monkeypatch)
    assert len(calls) == 2 * 4
    assert_same_generation(masked, fused)
    with torch.no_grad():  # some decoding step of some layer activated no head for some sequence
        gates = []
        for layer in model.model.layers:
            layer.self_attn.head_router.register_forward_hook(lambda module, args, out: gates.append(out[0]))
        model.generate(ids, attention_mask=mask, max_new_tokens=5, do_sample=False)
    assert any((step.sum(-1) == 0).any() for step in gates if step.shape[1] == 1)


def test_prefill_equals_token_by_token_decoding_with_thresholds():
    """Causal: a token's heads depend on its own scores only, so decoding with a cache gives the prefill's logits."""
    model = threshold_llama()
    ids = torch.randint(1, VOCAB, (2, 12), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        full = model(ids).logits
        cache, steps = None, []
        for t in range(ids.shape[1]):
            out = model(ids[:, t : t + 1], past_key_values=cache, use_cache=True)
            cache = out.past_key_values
            steps.append(out.logits)
    torch.testing.assert_close(torch.cat(steps, 1), full, rtol=1e-5, atol=1e-5)


def test_thresholds_survive_save_and_load_and_reach_every_family(tmp_path):
    model = threshold_llama()
    model.save_pretrained(tmp_path / "moh")
    loaded = MoHLlamaForCausalLM.from_pretrained(tmp_path / "moh")
    assert [layer.self_attn.head_router.threshold for layer in loaded.model.layers] == THRESHOLDS
    mhmoe = MHMoEForCausalLM(
        tiny_mhmoe(moh_shared_heads=2, moh_active_heads=3, moh_straight_through=True, moh_head_thresholds=[None, 0.5])
    )
    assert [layer.self_attn.head_router.threshold for layer in mhmoe.model.layers] == [None, 0.5]
    from transformers import LlamaConfig, LlamaForCausalLM

    llama = LlamaForCausalLM(LlamaConfig(**tiny_llama_fields()))
    apply_moh(llama, moh_shared_heads=3, moh_active_heads=2, moh_head_thresholds=[1.0, None])
    assert [layer.self_attn.head_router.threshold for layer in llama.model.layers] == [1.0, None]
    assert "threshold=1" in repr(llama.model.layers[0].self_attn.head_router)


@pytest.mark.parametrize(
    "fields,message",
    [
        (dict(moh_head_thresholds=[0.1]), "a list of 2 finite numbers or None"),
        (dict(moh_head_thresholds=[0.1, float("nan")]), "a list of 2 finite numbers or None"),
        (dict(moh_head_thresholds=[0.1, True]), "a list of 2 finite numbers or None"),
        (dict(moh_head_thresholds=[0.1, 0.2], moh_straight_through=False), "needs straight-through 0/1 gates"),
        (dict(moh_head_thresholds=[0.1, 0.2], moh_shared_heads=None, moh_active_heads=None), "needs MoH on"),
    ],
)
def test_bad_thresholds_are_refused_in_words(fields, message):
    settings = {**dict(moh_shared_heads=3, moh_active_heads=2, moh_straight_through=True), **fields}
    with pytest.raises(ValueError, match=message):
        MoHLlamaConfig(**tiny_llama_fields(), **settings)


def test_exported_folder_routes_with_the_thresholds(tmp_path):
    """The trust_remote_code folder (`export_pretrained`) carries the field and its code: loaded through its own copied
    classes, the same thresholds and the same logits."""
    import json

    from transformers.dynamic_module_utils import get_class_from_dynamic_module

    from mhmoe.hub import export_pretrained

    model = threshold_llama()
    folder = tmp_path / "exported"
    export_pretrained(model, folder)
    auto_map = json.loads((folder / "config.json").read_text())["auto_map"]
    copied = get_class_from_dynamic_module(auto_map["AutoModelForCausalLM"], str(folder))  # not mhmoe's registered one
    loaded = copied.from_pretrained(folder).eval()
    assert type(loaded).__module__.startswith("transformers_modules.")  # the folder's code
    assert [layer.self_attn.head_router.threshold for layer in loaded.model.layers] == THRESHOLDS
    ids = torch.randint(1, VOCAB, (2, 10), generator=torch.Generator().manual_seed(6))
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids).logits, model(ids).logits)
