"""The checks Transformers runs on every causal LM, written once and run for every model type and MoH-patched family
in `tests/causal_lm_tester.py`. Each compares the model with itself under another code path (attention backend,
padding, packing, cache, decoding strategy, serialisation, checkpointing, compilation, experts backend)."""

import copy

import pytest
import torch
from safetensors.torch import save_file
from transformers import AutoConfig, AutoModel, GenerationMixin

from mhmoe.models.mhmoe import experts as experts_module
from mhmoe.models.mhmoe.experts import MHMOE_EXPERTS_FUNCTIONS
from tests.causal_lm_tester import CASES, PAD, TOLERANCE, VOCAB, cpu_supports, greedy, prompts


def over(cases):
    """Parametrize a check over `cases`, named by the case."""
    return pytest.mark.parametrize("case", cases, ids=[case.name for case in cases])


every_case = over(CASES)
DTYPES = [torch.float32, torch.bfloat16] + ([torch.float16] if cpu_supports(torch.float16) else [])


def real(logits, mask):
    return logits[mask.bool()]


# --------------------------------------------------------------------------------------------------------------------
# attention backends, padding, packing


@every_case
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_eager_matches_sdpa(case, dtype):
    model = case.make().to(dtype)
    ids, mask = prompts()
    for attention_mask in (None, mask):
        kept = torch.ones_like(ids) if attention_mask is None else mask
        with torch.no_grad():
            model.set_attn_implementation("eager")
            eager = model(ids, attention_mask=attention_mask, output_attentions=True)
            model.set_attn_implementation("sdpa")
            sdpa = model(ids, attention_mask=attention_mask)
        assert eager.logits.dtype == dtype and len(eager.attentions) == 2
        probs = eager.attentions[0]  # (B, H, T, T): rows of real queries sum to 1, padded keys get nothing
        assert probs.shape == (3, 4, 7, 7)
        torch.testing.assert_close(
            probs.float().sum(-1)[kept.bool()[:, None, :].expand(-1, 4, -1)],
            torch.ones(int(kept.sum()) * 4),
            **TOLERANCE[dtype],
        )
        if attention_mask is not None:
            assert probs[1, :, 3:, :3].abs().max() == 0
        torch.testing.assert_close(real(sdpa.logits, kept), real(eager.logits, kept), **TOLERANCE[dtype])


@every_case
def test_left_padding_matches_unpadded(case):
    model = case.make()
    model.set_attn_implementation("sdpa")
    ids, mask = prompts()
    with torch.no_grad():
        padded = model(ids, attention_mask=mask).logits
        for row in range(ids.shape[0]):
            start = int((mask[row] == 0).sum())
            alone = model(ids[row : row + 1, start:]).logits[0]
            torch.testing.assert_close(padded[row, start:], alone, **TOLERANCE[torch.float32])


@every_case
def test_padding_free_packing_matches_separate_sequences(case):
    """Two sequences in one row, told apart only by `position_ids` restarting at 0 (no attention mask, no cache: the
    padding-free training format of DataCollatorWithFlattening)."""
    model = case.make()
    model.set_attn_implementation("sdpa")
    first, second = torch.randint(2, VOCAB, (1, 4)), torch.randint(2, VOCAB, (1, 5))
    position_ids = torch.cat([torch.arange(4), torch.arange(5)])[None]
    with torch.no_grad():
        packed = model(torch.cat([first, second], dim=1), position_ids=position_ids, use_cache=False).logits[0]
        separate = torch.cat([model(first).logits[0], model(second).logits[0]])
    torch.testing.assert_close(packed, separate, **TOLERANCE[torch.float32])


@every_case
def test_hidden_states_and_inputs_embeds(case):
    """`output_hidden_states` gives the embeddings and every layer's output; `inputs_embeds` gives what the ids give,
    in a forward and in `generate` (which then returns only the new tokens)."""
    model = case.make()
    ids, mask = prompts()
    embeds = model.get_input_embeddings()(ids).detach()
    with torch.no_grad():
        out = model(ids, attention_mask=mask, output_hidden_states=True)
        from_embeds = model(inputs_embeds=embeds, attention_mask=mask).logits
    assert len(out.hidden_states) == model.config.num_hidden_layers + 1
    assert all(h.shape == (3, 7, 32) for h in out.hidden_states) and torch.equal(out.hidden_states[0], embeds)
    assert torch.equal(from_embeds, out.logits)
    generated = greedy(model, None, mask, inputs_embeds=embeds)
    assert torch.equal(generated, greedy(model, ids, mask)[:, 7:])


# --------------------------------------------------------------------------------------------------------------------
# cache


@every_case
def test_cache_continuation_matches_full_forward(case):
    model = case.make()
    ids, mask = prompts(seq=9)
    with torch.no_grad():
        full = model(ids, attention_mask=mask).logits
        out = model(ids[:, :5], attention_mask=mask[:, :5], use_cache=True)
        steps = [out.logits]
        for t in range(5, 9):  # one token at a time: MoH decodes with head skipping here
            out = model(
                ids[:, t : t + 1], attention_mask=mask[:, : t + 1], past_key_values=out.past_key_values, use_cache=True
            )
            steps.append(out.logits)
    torch.testing.assert_close(real(torch.cat(steps, dim=1), mask), real(full, mask), **TOLERANCE[torch.float32])


@every_case
def test_static_cache_matches_dynamic_cache(case):
    model = case.make()
    ids, mask = prompts()
    kwargs = dict(output_scores=True, return_dict_in_generate=True)
    dynamic = greedy(model, ids, mask, **kwargs)
    static = greedy(model, ids, mask, cache_implementation="static", **kwargs)
    assert torch.equal(static.sequences, dynamic.sequences)
    torch.testing.assert_close(torch.stack(static.scores), torch.stack(dynamic.scores), rtol=1e-4, atol=1e-4)


# --------------------------------------------------------------------------------------------------------------------
# decoding strategies


@every_case
def test_greedy_with_cache_matches_without_and_padding_changes_nothing(case):
    model = case.make()
    ids, mask = prompts()
    with_cache = greedy(model, ids, mask)
    assert with_cache.shape == (3, 12)
    assert torch.equal(with_cache, greedy(model, ids, mask, use_cache=False))
    alone = greedy(model, ids[1:2, 3:])  # the left-padded row generates what it generates alone
    assert torch.equal(alone[0, 4:], with_cache[1, 7:])


@every_case
def test_sampling_invariants(case):
    model = case.make()
    ids, mask = prompts()
    torch.manual_seed(5)
    first = greedy(model, ids, mask, do_sample=True, top_p=0.9)
    torch.manual_seed(5)
    assert torch.equal(first, greedy(model, ids, mask, do_sample=True, top_p=0.9))  # seeded: reproducible
    assert ((first >= 0) & (first < VOCAB)).all()
    assert torch.equal(greedy(model, ids, mask, do_sample=True, top_k=1), greedy(model, ids, mask))  # top-1 = greedy


@every_case
def test_beam_search_scores_are_the_sequences_log_probabilities(case):
    model = case.make()
    ids = prompts(batch=1)[0]
    assert torch.equal(greedy(model, ids, num_beams=1), greedy(model, ids))
    out = greedy(
        model,
        ids,
        num_beams=3,
        num_return_sequences=2,
        length_penalty=0.0,
        output_scores=True,
        return_dict_in_generate=True,
    )
    assert out.sequences.shape == (2, 12)
    with torch.no_grad():
        log_probs = torch.log_softmax(model(out.sequences).logits[:, 6:-1].float(), dim=-1)
    recomputed = log_probs.gather(-1, out.sequences[:, 7:, None]).squeeze(-1).sum(-1)  # length_penalty 0: a sum
    torch.testing.assert_close(out.sequences_scores, recomputed, rtol=1e-4, atol=1e-4)
    assert out.sequences_scores[0] >= out.sequences_scores[1]


@every_case
def test_assisted_decoding_matches_greedy(case):
    model = case.make()
    ids = prompts(batch=1)[0]
    assistant = case.make()  # a draft model that disagrees with the model now and then
    with torch.no_grad():
        for param in assistant.parameters():
            param.add_(torch.randn(param.shape, generator=torch.Generator().manual_seed(2)) * 0.1)
    assert torch.equal(greedy(model, ids, assistant_model=assistant), greedy(model, ids))


# --------------------------------------------------------------------------------------------------------------------
# serialisation and embeddings


@every_case
@pytest.mark.parametrize("shard", [None, "20KB"])
def test_save_and_reload(case, shard, tmp_path):
    model = case.make()
    kwargs = {"max_shard_size": shard} if shard else {}
    model.save_pretrained(tmp_path, **kwargs)
    assert not list(tmp_path.glob("*.bin"))
    if shard:
        assert (tmp_path / "model.safetensors.index.json").exists() and len(list(tmp_path.glob("*.safetensors"))) > 1
    else:
        assert [p.name for p in tmp_path.glob("*.safetensors")] == ["model.safetensors"]
    reloaded = case.reload(tmp_path, attn_implementation="eager").eval()
    assert type(reloaded) is type(model)
    saved = reloaded.config.to_dict()
    assert {key: saved.get(key) for key in model.config.to_dict() if key != "_name_or_path"} == {
        key: value for key, value in model.config.to_dict().items() if key != "_name_or_path"
    }
    ids, mask = prompts()
    with torch.no_grad():
        assert torch.equal(reloaded(ids, attention_mask=mask).logits, model(ids, attention_mask=mask).logits)
        if model.config.model_type in ("mhmoe", "moh_llama"):  # own model types: the auto classes know them
            assert type(AutoConfig.from_pretrained(tmp_path)) is type(model.config)
            base = AutoModel.from_pretrained(tmp_path, attn_implementation="eager").eval()
            assert type(base) is type(model.model)
            assert torch.equal(
                base(ids, attention_mask=mask).last_hidden_state,
                model.model(ids, attention_mask=mask).last_hidden_state,
            )


@every_case
def test_resize_token_embeddings(case):
    model = case.make()
    before = model.get_input_embeddings().weight.detach().clone()
    model.resize_token_embeddings(VOCAB + 7)
    assert model.get_input_embeddings().weight.shape == (VOCAB + 7, 32)
    assert model.get_output_embeddings().weight.shape == (VOCAB + 7, 32) and model.config.vocab_size == VOCAB + 7
    assert torch.equal(model.get_input_embeddings().weight[:VOCAB], before)
    with torch.no_grad():
        logits = model(torch.tensor([[2, VOCAB + 3, 5]])).logits
    assert logits.shape == (1, 3, VOCAB + 7) and torch.isfinite(logits).all()
    model.resize_token_embeddings(VOCAB - 9)
    assert model(torch.tensor([[2, 3]])).logits.shape[-1] == VOCAB - 9


@every_case
def test_tied_embeddings_stay_tied(case, tmp_path):
    model = case.make(tie_word_embeddings=True)
    assert model.get_output_embeddings().weight is model.get_input_embeddings().weight
    model.resize_token_embeddings(VOCAB + 3)
    assert model.get_output_embeddings().weight is model.get_input_embeddings().weight
    model.save_pretrained(tmp_path)
    reloaded = case.reload(tmp_path, attn_implementation="eager").eval()
    assert reloaded.get_output_embeddings().weight is reloaded.get_input_embeddings().weight
    ids = prompts()[0]
    with torch.no_grad():
        assert torch.equal(reloaded(ids).logits, model(ids).logits)


# --------------------------------------------------------------------------------------------------------------------
# training


def _grads(model, ids, output_router_logits=True):
    model.zero_grad()
    out = model(ids, labels=ids, output_router_logits=output_router_logits)
    out.loss.backward()
    return out.loss.detach(), {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}


@every_case
@pytest.mark.parametrize("use_reentrant", [True, False])
def test_gradient_checkpointing_matches(case, use_reentrant):
    """Reentrant checkpointing is checked on the LM loss alone: router logits recorded inside a reentrant checkpoint
    (Transformers' output capturing) carry no graph, so the router losses add no gradient there, in Transformers'
    Mixtral as well. `mhmoe-train` checkpoints non-reentrantly, which keeps them (checked here with them on)."""
    model = case.make().train()
    ids = prompts()[0].clamp(min=2)
    with_router_losses = not use_reentrant
    loss, expected = _grads(model, ids, with_router_losses)
    model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": use_reentrant})
    assert model.is_activation_checkpointing
    got_loss, got = _grads(model, ids, with_router_losses)
    torch.testing.assert_close(got_loss, loss)
    assert got.keys() == expected.keys() and len(got) == len(list(model.parameters()))
    for name in expected:
        torch.testing.assert_close(got[name], expected[name], rtol=1e-4, atol=1e-6, msg=name)


@every_case
def test_overfits_one_batch(case):
    model = case.make().train()
    ids = prompts(batch=2, seq=8)[0].clamp(min=2)
    optimizer = torch.optim.AdamW(model.parameters(), lr=2e-2)
    losses = []
    for _ in range(40):
        loss = model(ids, labels=ids).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    assert losses[-1] < 0.2 * losses[0], losses[::8]


# --------------------------------------------------------------------------------------------------------------------
# compilation and export


@over(CASES)
def test_torch_compile_forward_and_generation(case):
    """Full-graph compilation: the forward through AOT autograd (`aot_eager`: the graphs inductor would get, without
    its C++ build), then greedy generation with a static cache through a compiled forward."""
    torch._dynamo.reset()  # the cases share forward code objects: start each without the others' recompilations
    model = case.make()
    ids, mask = prompts()
    with torch.no_grad():
        expected = model(ids, attention_mask=mask).logits
        got = torch.compile(model, backend="aot_eager", fullgraph=True)(ids, attention_mask=mask).logits
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    expected_tokens = greedy(model, ids, mask, max_new_tokens=3, cache_implementation="static")
    model.forward = torch.compile(model.forward, backend="eager", fullgraph=True)  # what generate() calls per step
    assert torch.equal(greedy(model, ids, mask, max_new_tokens=3, cache_implementation="static"), expected_tokens)


@over(CASES)
def test_torch_export(case):
    model = case.make()
    ids, mask = prompts()
    exported = torch.export.export(model, (ids,), {"attention_mask": mask, "use_cache": False}, strict=False)
    with torch.no_grad():
        expected = model(ids, attention_mask=mask).logits
        got = exported.module()(ids, attention_mask=mask, use_cache=False).logits
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


# --------------------------------------------------------------------------------------------------------------------
# routers: captured logits and load-balancing losses (Mixtral's padding test, for every router)


@over([c for c in CASES if c.experts or c.moh])
def test_router_logits_and_load_balancing_loss(case):
    """Router logits are captured per routed layer; the balance losses ignore padding: a left-padded batch with its
    attention mask gives the loss of the unpadded batch, and differs when the mask is left out."""
    model = case.make()
    config = model.config
    ids = torch.randint(2, VOCAB, (2, 6), generator=torch.Generator().manual_seed(4))
    padded = torch.cat([torch.full((2, 3), PAD), ids], dim=1)
    mask = torch.cat([torch.zeros(2, 3, dtype=torch.long), torch.ones(2, 6, dtype=torch.long)], dim=1)
    with torch.no_grad():
        plain = model(ids, output_router_logits=True)
        masked = model(padded, attention_mask=mask, output_router_logits=True)
        unmasked = model(padded, output_router_logits=True)
    names = (["aux_loss"] if case.experts else []) + (["moh_aux_loss"] if case.moh else [])
    if case.experts:
        moe_layers = sum(config.is_moe_layer(i) for i in range(config.num_hidden_layers))
        assert len(plain.router_logits) == moe_layers
        assert plain.router_logits[0].shape == (2 * 6 * config.moe_heads, config.num_experts)
    if case.moh:
        assert len(plain.moh_router_logits) == config.num_hidden_layers
        assert plain.moh_router_logits[0].shape == (2, 6, config.num_attention_heads - config.moh_shared_heads)
    for name in names:
        assert getattr(model(ids, output_router_logits=False), name) is None
        torch.testing.assert_close(getattr(masked, name), getattr(plain, name), rtol=1e-5, atol=1e-6)
        assert not torch.allclose(getattr(unmasked, name), getattr(plain, name), rtol=1e-5, atol=1e-6)


# --------------------------------------------------------------------------------------------------------------------
# experts backends


@over([c for c in CASES if c.experts])
def test_experts_backends_agree_and_really_run(case, monkeypatch):
    model = case.make().train()
    ids = prompts()[0].clamp(min=2)
    calls = []

    def spy(name, function):
        def forward(*args, **kwargs):
            calls.append(name)
            return function(*args, **kwargs)

        return forward

    monkeypatch.setattr(experts_module, "eager_experts_forward", spy("eager", experts_module.eager_experts_forward))
    for name in ("batched_mm", "grouped_mm"):
        monkeypatch.setitem(MHMOE_EXPERTS_FUNCTIONS._global_mapping, name, spy(name, MHMOE_EXPERTS_FUNCTIONS[name]))
    results = {}
    for name in ("eager", "batched_mm", "grouped_mm"):
        model.set_experts_implementation(name)
        calls.clear()
        results[name] = _grads(model, ids)
        moe_layers = sum(model.config.is_moe_layer(i) for i in range(model.config.num_hidden_layers))
        assert calls == [name] * moe_layers, (name, calls)
    for name in ("batched_mm", "grouped_mm"):
        loss, grads = results[name]
        torch.testing.assert_close(loss, results["eager"][0], rtol=1e-5, atol=1e-6)
        for param, grad in grads.items():
            torch.testing.assert_close(grad, results["eager"][1][param], rtol=1e-4, atol=1e-6, msg=f"{name} {param}")


@every_case
def test_generation_mixin_is_a_direct_base(case):
    """Transformers' `can_generate` looks for GenerationMixin in the class's own bases (or a generative parent)."""
    model = case.make()
    assert GenerationMixin in type(model).__mro__ and type(model).can_generate()
    assert model.generation_config is not None
    assert torch.equal(copy.deepcopy(model).lm_head.weight, model.lm_head.weight)  # assisted decoding copies models


@every_case
def test_missing_weights_are_initialised(case, tmp_path):
    """A checkpoint holding only the embeddings: every other parameter is created by the model's `_init_weights`
    (Transformers' 'can init all missing weights' check): finite, norms at 1, MoH routers at 0 (every gate 1), weight
    matrices random at `initializer_range`."""
    model = case.make()
    model.save_pretrained(tmp_path)
    save_file(
        {"model.embed_tokens.weight": model.model.embed_tokens.weight.detach().contiguous()},
        tmp_path / "model.safetensors",
        metadata={"format": "pt"},
    )
    loaded = case.reload(tmp_path)
    std = model.config.initializer_range
    for name, param in loaded.named_parameters():
        assert torch.isfinite(param).all(), name
        if "norm" in name:
            assert torch.equal(param, torch.ones_like(param)), name
        elif ".head_router." in name:
            assert torch.equal(param, torch.zeros_like(param)), name
        elif param.dim() >= 2 and name != "model.embed_tokens.weight":
            assert 0.5 * std < param.float().std() < 2 * std, (name, param.std())
