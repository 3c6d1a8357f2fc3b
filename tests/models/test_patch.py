"""`mhmoe.apply_moh` on in-memory Llama, Mistral and Qwen2 models, against the dense model itself and a hook-based
reference (every head computed, per-token 0/1 head mask applied before o_proj, as in the released MoH-LLaMA3 code)."""

import copy

import pytest
import torch
from transformers import (
    AutoModel,
    AutoModelForCausalLM,
    GPT2Config,
    GPT2LMHeadModel,
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
)

import mhmoe
from mhmoe import apply_moh

VOCAB, HIDDEN, HEADS, HEAD_DIM = 100, 32, 8, 4
FAMILIES = {
    "llama": (LlamaConfig, LlamaForCausalLM),
    "mistral": (MistralConfig, MistralForCausalLM),
    "qwen2": (Qwen2Config, Qwen2ForCausalLM),
}


def dense(family: str, seed: int = 0, **kwargs):
    config_cls, model_cls = FAMILIES[family]
    fields = dict(
        vocab_size=VOCAB,
        hidden_size=HIDDEN,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=HEADS,
        num_key_value_heads=4,
        pad_token_id=0,
        eos_token_id=None,
        attn_implementation="eager",
    )
    fields.update(kwargs)
    torch.manual_seed(seed)
    return model_cls(config_cls(**fields)).eval()


def inputs():
    generator = torch.Generator().manual_seed(3)
    ids = torch.randint(1, VOCAB, (2, 9), generator=generator)
    mask = torch.ones_like(ids)
    ids[1, :2], mask[1, :2] = 0, 0
    return ids, mask


def reference_l2_moh_logits(model, shared, active, ids, mask):
    """The dense model with hooks: capture each layer's pre-RoPE queries, pick heads per token (L2 norm / std,
    softmax, top-k), zero the other heads' outputs at the o_proj input."""
    handles, queries = [], {}
    for index, layer in enumerate(model.model.layers):
        attention = layer.self_attn

        def keep_query(module, args, output, index=index):
            queries[index] = output.detach().view(*output.shape[:2], HEADS, HEAD_DIM)

        def mask_heads(module, args, index=index):
            (heads_out,) = args
            norms = queries[index][..., shared:, :].pow(2).sum(-1).sqrt()  # (B, T, R)
            scores = torch.softmax(norms / norms.std(dim=-1, keepdim=True), dim=-1)
            keep = torch.zeros_like(scores).scatter(-1, scores.topk(active, dim=-1).indices, 1.0)
            keep = torch.cat([keep.new_ones(*keep.shape[:2], shared), keep], dim=-1)  # (B, T, H)
            return (heads_out.view(*heads_out.shape[:2], HEADS, HEAD_DIM) * keep[..., None]).flatten(2)

        handles.append(attention.q_proj.register_forward_hook(keep_query))
        handles.append(attention.o_proj.register_forward_pre_hook(mask_heads))
    try:
        with torch.no_grad():
            return model(ids, attention_mask=mask).logits
    finally:
        for handle in handles:
            handle.remove()


@pytest.mark.parametrize("family", list(FAMILIES))
def test_all_heads_active_patch_changes_nothing(family):
    model = dense(family)
    ids, mask = inputs()
    before = model(ids, attention_mask=mask).logits
    state = {key: value.clone() for key, value in model.state_dict().items()}
    assert apply_moh(model, moh_shared_heads=2, moh_active_heads=6) is model
    assert type(model).__name__.startswith("MoH") and type(model.model).__name__.startswith("MoH")
    assert all(layer.self_attn.head_router is not None for layer in model.model.layers)
    after = model.state_dict()
    assert set(after) == set(state) and all(torch.equal(after[key], state[key]) for key in state)
    assert torch.equal(model(ids, attention_mask=mask).logits, before)


@pytest.mark.parametrize("family", list(FAMILIES))
@pytest.mark.parametrize("shared,active", [(4, 2), (2, 3), (0, 5), (6, 1)])
def test_patched_model_matches_masked_dense_reference(family, shared, active):
    model = dense(family, seed=shared + active)
    ids, mask = inputs()
    expected = reference_l2_moh_logits(model, shared, active, ids, mask)
    assert not torch.allclose(expected, model(ids, attention_mask=mask).logits)  # the head mask matters
    apply_moh(model, moh_shared_heads=shared, moh_active_heads=active)
    for attn in ("eager", "sdpa"):
        model.set_attn_implementation(attn)
        with torch.no_grad():
            got = model(ids, attention_mask=mask).logits
        torch.testing.assert_close(got[mask.bool()], expected[mask.bool()], rtol=1e-5, atol=1e-5)


def test_learned_router_patch_starts_as_the_dense_model():
    model = dense("qwen2").to(torch.bfloat16)
    ids, mask = inputs()
    before = model(ids, attention_mask=mask).logits
    apply_moh(model, moh_shared_heads=3, moh_active_heads=5, moh_router="learned", moh_straight_through=False)
    router = model.model.layers[0].self_attn.head_router
    assert router.routed_weight.dtype == torch.bfloat16 and router.routed_weight.abs().sum() == 0  # follows q_proj
    new_keys = {key for key in model.state_dict() if ".head_router." in key}
    assert new_keys and len(new_keys) == 3 * 2  # W_s, W_r, W_h per layer
    assert torch.equal(
        model(ids, attention_mask=mask).logits, before
    )  # fp32 gates within rounding of 1, exactly 1 in bf16


def test_patched_llama_continue_tunes_with_l2_and_straight_through():
    """Routed heads 0-1 start with 4× larger queries, so every token picks them (collapsed routing); training lowers
    the LM loss and, through the query norms, the head balance loss."""
    model = dense("llama")
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.q_proj.weight[4 * HEAD_DIM : 6 * HEAD_DIM] *= 4
    apply_moh(model, moh_shared_heads=4, moh_active_heads=2, moh_aux_loss_coef=0.1)
    assert model.config.moh_router == "l2" and model.config.moh_straight_through  # the continue-tuning defaults
    generator = torch.Generator().manual_seed(0)
    patterns = torch.randint(1, VOCAB, (4, 8), generator=generator)
    data = torch.stack([patterns[torch.randint(0, 4, (4,), generator=generator)].reshape(-1) for _ in range(8)])
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    history = []
    model.train()
    for _ in range(30):
        out = model(data, labels=data, output_router_logits=True)
        history.append(((out.loss - 0.1 * out.moh_aux_loss).item(), out.moh_aux_loss.item()))
        optimizer.zero_grad()
        out.loss.backward()
        optimizer.step()
    (lm_start, aux_start), (lm_end, aux_end) = history[0], history[-1]
    assert aux_start > 3.0  # collapsed: perfect balance is K = 2, full collapse R = 4
    assert lm_end < 0.5 * lm_start
    assert aux_end < aux_start - 0.5


def test_hooks_installed_before_patching_still_record():
    model = dense("llama")
    ids, mask = inputs()
    model(ids, attention_mask=mask, output_attentions=True)  # installs the output-capturing hooks
    apply_moh(model, moh_shared_heads=4, moh_active_heads=2)
    out = model(ids, attention_mask=mask, output_attentions=True, output_router_logits=True)
    assert len(out.attentions) == 2 and len(out.moh_router_logits) == 2
    assert out.moh_aux_loss is not None


def test_base_model_can_be_patched():
    model = dense("llama")
    base = copy.deepcopy(model.model)
    ids, mask = inputs()
    apply_moh(base, moh_shared_heads=2, moh_active_heads=6)
    assert type(base).__name__ == "MoHLlamaModel"
    assert torch.equal(base(ids, attention_mask=mask).last_hidden_state, model.model(ids, attention_mask=mask)[0])


def test_refusals():
    with pytest.raises(ValueError, match="needs moh_shared_heads and moh_active_heads"):
        apply_moh(dense("llama"))
    with pytest.raises(ValueError, match=r"must be <= num_attention_heads"):
        apply_moh(dense("llama"), moh_shared_heads=6, moh_active_heads=3)
    with pytest.raises(ValueError, match="moh_router must be one of"):
        apply_moh(dense("llama"), moh_shared_heads=2, moh_active_heads=2, moh_router="top2")
    with pytest.raises(TypeError, match="unknown fields"):
        apply_moh(dense("llama"), moh_shared_heads=2, moh_active_heads=2, top_k=2)
    patched = apply_moh(dense("qwen2"), moh_shared_heads=2, moh_active_heads=2)
    with pytest.raises(ValueError, match="already a Mixture-of-Head attention model"):
        apply_moh(patched, moh_shared_heads=2, moh_active_heads=2)
    gpt2 = GPT2LMHeadModel(GPT2Config(vocab_size=VOCAB, n_embd=HIDDEN, n_layer=1, n_head=4))
    with pytest.raises(ValueError, match="supports Llama, Mistral and Qwen2"):
        apply_moh(gpt2, moh_shared_heads=2, moh_active_heads=2)
    assert mhmoe.apply_moh is apply_moh


@pytest.mark.parametrize(
    "fields, words",
    [
        (
            dict(moh_shared_heads="2", moh_active_heads=2),
            "moh_shared_heads must be a whole number of heads, not str ('2')",
        ),
        (dict(moh_shared_heads=2, moh_active_heads=2.0), "moh_active_heads must be a whole number of heads, not float"),
        (dict(moh_shared_heads=True, moh_active_heads=2), "moh_shared_heads must be a whole number of heads, not bool"),
        (dict(moh_shared_heads=2, moh_active_heads=2, moh_aux_loss_coef="0.1"), "moh_aux_loss_coef must be a number"),
    ],
)
def test_values_of_the_wrong_type_are_one_line_type_errors(fields, words):
    """They failed deep inside the checks (`'<' not supported between 'str' and 'int'`); the model is left as it was."""
    model = dense("llama")
    with pytest.raises(TypeError) as raised:
        apply_moh(model, **fields)
    assert str(raised.value).startswith(f"apply_moh: {words}")
    assert "\n" not in str(raised.value) and type(model.model).__name__ == "LlamaModel"


def test_learned_routers_come_back_after_reloading(tmp_path):
    """Transformers drops the head-router weights of a saved MoH Mistral/Qwen2 as unexpected keys; `apply_moh(model)`
    reads them back from the folder the model was loaded from (causal LM, and base model from the same folder)."""
    model = apply_moh(dense("qwen2"), moh_shared_heads=2, moh_active_heads=3, moh_router="learned")
    with torch.no_grad():
        for name, param in model.named_parameters():
            if ".head_router." in name:
                param.normal_()
    model.save_pretrained(tmp_path)
    ids, mask = inputs()
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path, attn_implementation="eager")
    assert type(reloaded) is Qwen2ForCausalLM
    apply_moh(reloaded)
    assert torch.equal(reloaded(ids, attention_mask=mask).logits, model(ids, attention_mask=mask).logits)
    base = apply_moh(AutoModel.from_pretrained(tmp_path, attn_implementation="eager"))
    torch.testing.assert_close(
        base(ids, attention_mask=mask).last_hidden_state, model.model(ids, attention_mask=mask).last_hidden_state
    )
