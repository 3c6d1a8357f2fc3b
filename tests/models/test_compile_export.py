"""torch.compile(fullgraph=True), static-cache generation under torch.compile and torch.export of whole MHMoE models,
each against the eager model: routing and expert dispatch have static shapes (no host sync, no graph break)."""

import pytest
import torch
from transformers import GenerationConfig
from transformers.generation.configuration_utils import CompileConfig

from mhmoe import MHMoEConfig, MHMoEForCausalLM

CONFIGS = {
    "mhmoe-h2-moh": dict(moe_heads=2, moh_active_heads=2, moh_shared_heads=1, moh_router="l2"),
    "capacity-moh-shared": dict(
        moe_heads=2, capacity_factor=0.75, shared_expert_intermediate_size=16, moh_active_heads=1, moh_shared_heads=1
    ),
}


def _model(**fields) -> MHMoEForCausalLM:
    base = dict(
        vocab_size=61,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        num_experts=5,
        num_experts_per_tok=2,
        moe_intermediate_size=16,
        output_router_logits=True,
    )
    torch.manual_seed(0)
    model = MHMoEForCausalLM(MHMoEConfig(**{**base, **fields})).eval()
    with torch.no_grad():  # large enough weights for the routing to depend on the input (and capacity to drop)
        for name, param in model.named_parameters():
            if "head_router" not in name:
                param.normal_(0, 0.2)
    return model


def _ids(batch=2, seq=7, vocab=61, seed=1):
    return torch.randint(0, vocab, (batch, seq), generator=torch.Generator().manual_seed(seed))


@pytest.fixture
def fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _step(call, model, ids):
    """Logits, LM + router losses and the gradients of the loss."""
    model.zero_grad(set_to_none=True)
    out = call(input_ids=ids, labels=ids)
    out.loss.backward()
    grads = [p.grad.clone() for p in model.parameters() if p.grad is not None]
    return [out.logits.detach(), out.loss.detach(), out.aux_loss.detach(), out.z_loss.detach()] + grads


def test_full_forward_compiles_fullgraph(fresh_dynamo):
    """Training forward + backward of a dropless MH-MoE model with MoH (capacity: test_experts' block test)."""
    model = _model(**CONFIGS["mhmoe-h2-moh"]).train()
    assert MHMoEForCausalLM._can_compile_fullgraph
    ids = _ids()
    expected = _step(model, model, ids)
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")  # fullgraph: a graph break is an error
    for _ in range(2):
        got = _step(compiled, model, ids)
        assert len(got) == len(expected)
        for have, want in zip(got, expected):
            torch.testing.assert_close(have, want, rtol=1e-5, atol=1e-5)


def compiled_static_generation(settings: dict) -> GenerationConfig:
    """`settings` with a static cache and a compiled forward (fullgraph) for the decoding steps."""
    compile_config = CompileConfig(fullgraph=True, backend="aot_eager")
    compile_config._compile_all_devices = True  # Transformers compiles generation on GPUs only unless told
    return GenerationConfig(**settings, cache_implementation="static", compile_config=compile_config)


def test_static_cache_generation_compiled(fresh_dynamo):
    """Greedy generation with a static cache runs the compiled forward (fullgraph) and gives eager's tokens."""
    model = _model(**CONFIGS["capacity-moh-shared"])
    ids = _ids(batch=1, seq=5)
    settings = dict(max_new_tokens=6, do_sample=False, pad_token_id=0)
    expected = model.generate(ids, generation_config=GenerationConfig(**settings))
    config = compiled_static_generation(settings)
    got = model.generate(ids, generation_config=config)
    assert hasattr(model, "_compiled_call")  # the decoding steps ran compiled
    assert torch.equal(got, expected)


@pytest.mark.parametrize("name", list(CONFIGS))
def test_export_matches_eager(name):
    model = _model(**CONFIGS[name])
    ids = _ids()
    with torch.no_grad():
        expected = model(input_ids=ids, use_cache=False)
        program = torch.export.export(model, (), {"input_ids": ids, "use_cache": False})
        got = program.module()(input_ids=ids, use_cache=False)
        other = _ids(seed=5)  # another input through the same program: the routing is not baked in
        torch.testing.assert_close(
            program.module()(input_ids=other, use_cache=False).logits,
            model(input_ids=other, use_cache=False).logits,
            rtol=1e-5,
            atol=1e-5,
        )
    torch.testing.assert_close(got.logits, expected.logits, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got.aux_loss, expected.aux_loss, rtol=1e-5, atol=1e-5)


def test_moh_llama_static_cache_generation_compiled(fresh_dynamo):
    """MoH-LLaMA's defaults (l2 router, straight-through 0/1 gates) take the CPU's fused decoding step in eager
    decoding; a compiled forward (fullgraph) takes the plain gated path instead (the step reads its weight cache and
    picks heads on the host: not traceable) and gives eager's tokens."""
    from mhmoe import MoHLlamaConfig, MoHLlamaForCausalLM

    fields = dict(vocab_size=61, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4)
    config = MoHLlamaConfig(
        **fields, num_key_value_heads=2, max_position_embeddings=64, moh_shared_heads=1, moh_active_heads=2
    )
    torch.manual_seed(0)
    model = MoHLlamaForCausalLM(config).eval()
    ids = _ids(batch=1, seq=5)
    settings = dict(max_new_tokens=6, do_sample=False, pad_token_id=0)
    expected = model.generate(ids, generation_config=GenerationConfig(**settings))
    config = compiled_static_generation(settings)
    got = model.generate(ids, generation_config=config)
    assert hasattr(model, "_compiled_call") and torch.equal(got, expected)
    # another prompt: the compiled decoding steps run again without recompiling (Transformers' no-recompile check)
    other = _ids(batch=1, seq=5, seed=7)
    with torch._dynamo.config.patch(error_on_recompile=True):
        again = model.generate(other, generation_config=config)
    assert torch.equal(again, model.generate(other, generation_config=GenerationConfig(**settings)))
