"""Lory / MH-Lory v1, v2: causal segment routing, the merged expert against an explicit Python sum of expert
parameters, cached and beam-search generation against the full forward, training, save/load, export, cost, data."""

import pytest
import torch
import torch.nn.functional as F
from torch.utils.flop_counter import FlopCounterMode

from mhmoe import MHMoEConfig, MHMoEForCausalLM, moe_layer_cost
from mhmoe.hub import export_pretrained
from mhmoe.hub.cards import architecture_rows
from mhmoe.models.mhmoe.lory import MHLoryBlock
from mhmoe.training.data import order_by_similarity
from tests.fixtures.remote_code import load_without_mhmoe

POOLS = ["shared", "per_head"]  # MH-Lory v1, v2


def tiny(**kw):
    base = dict(
        vocab_size=89,
        hidden_size=48,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        moe_heads=3,
        num_experts=4,
        moe_intermediate_size=16,
        router_type="lory",
        lory_segment_length=4,
        bos_token_id=None,
        eos_token_id=None,
    )
    base.update(kw)
    return MHMoEConfig(**base)


def _randomised_block(pool: str, **kw) -> MHLoryBlock:
    torch.manual_seed(0)
    model = MHMoEForCausalLM(tiny(lory_expert_pool=pool, **kw))
    block = model.model.layers[0].mlp
    with torch.no_grad():
        block.gate.weight.normal_(std=1.0)  # routing far from uniform
    return block


def reference_block(block: MHLoryBlock, x: torch.Tensor, first_segment: str = "uniform") -> torch.Tensor:
    """Segment by segment, head by head: routing weights from the previous segment's mean sub-token, the merged expert
    built as an explicit Python sum Σ_e w_e θ_e, then SwiGLU with it. The first segment: "uniform" routes on zeros;
    "proposal" (the MH-Lory proposal's code) on its own mean, with every input of that segment's computation detached
    (its sub-tokens, router and experts: a stop-gradient on the whole first-segment output)."""
    batch, seq, d = x.shape
    h, length = block.moe_heads, block.segment_length
    experts, num_experts = block.experts, block.experts.num_experts
    sub = (x @ block.head_proj.weight.t() if block.head_proj is not None else x).reshape(batch, seq, h, d // h)
    out = torch.zeros_like(sub)
    for b in range(batch):
        for start in range(0, seq, length):
            stop = first_segment == "proposal" and start == 0
            tokens = sub[b, start : start + length]
            params = [block.gate.weight, experts.gate_up_proj, experts.down_proj]
            if stop:
                tokens, params = tokens.detach(), [param.detach() for param in params]
                prev = tokens.mean(0)  # (h, W): the segment's own mean
            else:
                prev = sub[b, start - length : start].mean(0) if start else torch.zeros_like(sub[b, 0])  # (h, W)
            gate_weight, gate_up_proj, down_proj = params
            for p in range(h):
                pool = p if experts.num_pools > 1 else 0
                ids = range(pool * num_experts, (pool + 1) * num_experts)
                router = gate_weight[pool * num_experts : (pool + 1) * num_experts]
                w = torch.softmax(router.float() @ prev[p].float(), dim=-1).to(tokens.dtype)
                gate_up = sum(w[i] * gate_up_proj[e] for i, e in enumerate(ids))
                down = sum(w[i] * down_proj[e] for i, e in enumerate(ids))
                gate, up = F.linear(tokens[:, p], gate_up).chunk(2, dim=-1)
                out[b, start : start + length, p] = F.linear(F.silu(gate) * up, down)
    y = out.reshape(batch, seq, d)
    return y @ block.merge_proj.weight.t() if block.merge_proj is not None else y


@pytest.mark.parametrize("pool", POOLS)
def test_block_equals_explicit_merged_expert(pool):
    block = _randomised_block(pool)
    x = torch.randn(2, 11, 48)  # 3 segments of 4, the last one partial
    torch.testing.assert_close(block(x), reference_block(block, x), rtol=1e-4, atol=1e-5)
    assert block.experts.gate_up_proj.shape[0] == (4 * 3 if pool == "per_head" else 4)
    # the merge is linear in the parameters: the merged gate/up projection of a segment equals the routing-weighted
    # sum of every expert's own gate/up output on it
    routing = torch.softmax(torch.randn(2, 3, 4), dim=-1)  # (B, h, E)
    gate_up, _ = block.experts.merged(routing)
    sub = torch.randn(2, 5, 3, 16)
    merged_out = torch.einsum("bnhw,bhow->bnho", sub, gate_up)
    for p in range(3):
        first = p * 4 if pool == "per_head" else 0
        each = torch.stack([F.linear(sub[:, :, p], block.experts.gate_up_proj[first + e]) for e in range(4)])
        expected = torch.einsum("be,ebno->bno", routing[:, p], each)
        torch.testing.assert_close(merged_out[:, :, p], expected, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("pool", POOLS)
def test_causal_segment_routing(pool):
    block = _randomised_block(pool)
    x = torch.randn(1, 16, 48)
    changed = x.clone()
    changed[:, 8:12] = torch.randn(1, 4, 48)  # segment 2
    out, out_changed = block(x), block(changed)
    assert torch.equal(out[:, :8], out_changed[:, :8])  # segments 0 and 1 untouched
    assert not torch.allclose(out[:, 12:], out_changed[:, 12:])  # segment 3 is routed on segment 2
    # the whole model: no logit before the changed segment moves
    torch.manual_seed(0)
    model = MHMoEForCausalLM(tiny(lory_expert_pool=pool)).eval()
    ids = torch.randint(0, 89, (1, 16))
    other = ids.clone()
    other[:, 8:12] = (ids[:, 8:12] + 1) % 89
    with torch.no_grad():
        assert torch.equal(model(ids).logits[:, :8], model(other).logits[:, :8])


@pytest.mark.parametrize("pool", POOLS)
def test_loss_falls_and_cached_generation_equals_full_forward(pool):
    torch.manual_seed(0)
    model = MHMoEForCausalLM(tiny(lory_expert_pool=pool, lory_segment_length=3))
    data = torch.randint(0, 89, (4, 24))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for _ in range(25):
        out = model(data, labels=data, output_router_logits=True)
        assert out.aux_loss is None  # nothing to balance: every expert is merged
        optimizer.zero_grad()
        out.loss.backward()
        optimizer.step()
        losses.append(out.loss.item())
    assert losses[-1] < 0.6 * losses[0], losses
    assert model.model.layers[0].mlp.gate.weight.grad.abs().sum() > 0  # the router learns through the merge

    model.eval()
    prompt = data[:2, :5]  # 5 tokens: the prompt ends inside the second segment
    with torch.no_grad():
        cached = model.generate(prompt, max_new_tokens=9, do_sample=False, use_cache=True)
        uncached = model.generate(prompt, max_new_tokens=9, do_sample=False, use_cache=False)
        assert torch.equal(cached, uncached)
        # token by token with the cache: the logits of the full forward at every position
        full = model(cached).logits
        step = model(cached[:, :5], use_cache=True)
        logits, cache = [step.logits], step.past_key_values
        for t in range(5, cached.shape[1]):
            step = model(cached[:, t : t + 1], past_key_values=cache, use_cache=True)
            logits.append(step.logits)
        torch.testing.assert_close(torch.cat(logits, dim=1), full, rtol=1e-4, atol=1e-5)
        beams = model.generate(prompt[:1], max_new_tokens=6, num_beams=3, do_sample=False, use_cache=True)
        beams_uncached = model.generate(prompt[:1], max_new_tokens=6, num_beams=3, do_sample=False, use_cache=False)
        assert torch.equal(beams, beams_uncached)
        with pytest.raises(ValueError, match="keeps per-segment routing state"):
            model(cached[:, :1], past_key_values=cache, use_cache=True) if cache.crop(-2) is None else None


@pytest.mark.parametrize("pool", POOLS)
def test_proposal_first_segment_matches_its_transcription(pool):
    """`lory_first_segment="proposal"` against the transcription (float64, outputs and gradients): the first segment
    routed on its own mean without gradient; the later segments exactly as by default."""
    block = _randomised_block(pool, lory_first_segment="proposal").double()
    assert block.first_segment == "proposal"
    with torch.no_grad():
        for param in (block.experts.gate_up_proj, block.experts.down_proj, block.head_proj.weight):
            param.normal_(std=0.5)  # outputs of order 1: the tolerances below are then relative ones
    x = torch.randn(2, 11, 48, dtype=torch.float64, requires_grad=True)  # 3 segments of 4, the last one partial
    ours = block(x)
    ref_x = x.detach().clone().requires_grad_()
    ref = reference_block(block, ref_x, "proposal")
    scale = float(ref.detach().abs().max())
    torch.testing.assert_close(ours, ref, rtol=1e-4, atol=1e-6 * scale)  # both route in fp32 (the block by design)
    grad = torch.randn_like(ours)
    params = list(block.parameters())
    names = ["x"] + [name for name, _ in block.named_parameters()]
    for name, a, b in zip(
        names, torch.autograd.grad(ours, [x, *params], grad), torch.autograd.grad(ref, [ref_x, *params], grad)
    ):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6 * float(b.abs().max()), msg=name)

    uniform = reference_block(block, ref_x, "uniform")
    assert (ours[:, :4] - uniform[:, :4]).abs().max() > 1e-2 * ours.abs().max()  # another first segment
    torch.testing.assert_close(ours[:, 4:], uniform[:, 4:], rtol=1e-4, atol=1e-6 * scale)  # the same later ones
    first_only = torch.zeros_like(ours)
    first_only[:, :4] = 1.0
    inside = [x, block.head_proj.weight, block.gate.weight, block.experts.gate_up_proj, block.experts.down_proj]
    grads = torch.autograd.grad(block(x), inside, first_only, allow_unused=True)
    assert all(g is None or not g.any() for g in grads)  # no gradient into the segment (merge_proj: after it)
    changed = x.detach().clone()
    changed[:, 3] += 1.0  # the first segment's last token moves its earlier tokens' output (the forward's leak)
    assert not torch.allclose(block(changed)[:, :3], ours[:, :3], rtol=1e-4)


def test_proposal_first_segment_cached_decoding():
    """A prefill that covers the first segment decodes as the full forward; continuing an unfinished first segment
    from the cache is refused in words, and generation without a cache works."""
    torch.manual_seed(0)
    model = MHMoEForCausalLM(tiny(lory_segment_length=3, lory_first_segment="proposal")).eval()
    ids = torch.randint(0, 89, (2, 10))
    with torch.no_grad():
        full = model(ids).logits
        step = model(ids[:, :4], use_cache=True)
        logits, cache = [step.logits], step.past_key_values
        for t in range(4, 10):
            step = model(ids[:, t : t + 1], past_key_values=cache, use_cache=True)
            logits.append(step.logits)
        torch.testing.assert_close(torch.cat(logits, dim=1), full, rtol=1e-4, atol=1e-5)
        prompt = ids[:1, :5]
        assert torch.equal(
            model.generate(prompt, max_new_tokens=5, do_sample=False, use_cache=True),
            model.generate(prompt, max_new_tokens=5, do_sample=False, use_cache=False),
        )
        short = ids[:1, :2]
        with pytest.raises(ValueError, match="lory_first_segment='proposal'.*use_cache=False"):
            model.generate(short, max_new_tokens=3, do_sample=False, use_cache=True)
        assert model.generate(short, max_new_tokens=3, do_sample=False, use_cache=False).shape == (1, 5)
    rows = dict(architecture_rows(model.config))  # the model card says which first-segment rule it uses
    assert "routed on the previous segment (the first on itself, without gradient)" in rows["Lory routing"]


def test_save_load_and_export_with_trust_remote_code(tmp_path, warm_blocked):
    models, folders, ids = {}, {}, torch.randint(0, 89, (2, 13))
    for pool in POOLS:
        torch.manual_seed(0)
        model = models[pool] = MHMoEForCausalLM(tiny(lory_expert_pool=pool, shared_expert_intermediate_size=8)).eval()
        with torch.no_grad():
            for layer in model.model.layers:
                layer.mlp.gate.weight.normal_(std=1.0)
        model.save_pretrained(tmp_path / pool)
        reloaded = MHMoEForCausalLM.from_pretrained(tmp_path / pool).eval()
        assert (reloaded.config.router_type, reloaded.config.lory_expert_pool) == ("lory", pool)
        with torch.no_grad():
            assert torch.equal(reloaded(ids).logits, model(ids).logits)
        folders[pool] = tmp_path / f"export_{pool}"
        export_pretrained(model, folders[pool])
        assert (folders[pool] / "lory.py").is_file()
    remote = load_without_mhmoe(warm_blocked, folders, ids, ids[:, :6], tmp_path)
    for pool, model in models.items():
        with torch.no_grad():
            torch.testing.assert_close(remote[f"{pool}.logits"], model(ids).logits, rtol=1e-5, atol=1e-5)
            expected = model.generate(ids[:, :6], max_new_tokens=8, do_sample=False)
        assert torch.equal(remote[f"{pool}.generated"], expected)


@pytest.mark.parametrize("pool", POOLS)
def test_moe_layer_cost_counts_parameters_and_the_merge(pool):
    config = tiny(lory_expert_pool=pool, lory_segment_length=8, shared_expert_intermediate_size=8)
    block = MHMoEForCausalLM(config).model.layers[0].mlp
    cost = moe_layer_cost(config)
    assert cost.params == sum(p.numel() for p in block.parameters())
    assert cost.expert_params == block.experts.gate_up_proj.numel() + block.experts.down_proj.numel()
    d, h, E, f, W = 48, 3, 4, 16, 16
    assert cost.merge_macs_per_segment == h * E * W + h * E * 3 * W * f  # router on the mean + E× the expert params
    # measured: multiply-adds of the block's matmuls (head/merge, router, merge, expert, shared) over one segment
    with FlopCounterMode(display=False) as counter:
        block(torch.randn(1, 8, d))
    assert counter.get_total_flops() == 2 * (
        8 * (cost.macs_per_token - round(cost.merge_macs_per_segment / 8)) + cost.merge_macs_per_segment
    )
    assert cost.macs_per_token == 2 * d * d + 3 * d * f + 3 * d * 8 + round(cost.merge_macs_per_segment / 8)


def test_config_refuses_bad_lory_fields():
    with pytest.raises(ValueError, match="router_type must be one of"):
        tiny(router_type="expert_choice")
    with pytest.raises(ValueError, match="lory_segment_length must be >= 1"):
        tiny(lory_segment_length=0)
    with pytest.raises(ValueError, match="lory_expert_pool must be one of"):
        tiny(lory_expert_pool="v2")
    with pytest.raises(ValueError, match="lory_first_segment must be one of"):
        tiny(lory_first_segment="self")
    with pytest.raises(ValueError, match="capacity_factor applies to top-k"):
        tiny(capacity_factor=1.0)
    with pytest.raises(ValueError, match="not supported"):
        tiny(linear_type="bitnet_b158")


def test_order_by_similarity_puts_similar_documents_next_to_each_other():
    topics = {
        "cat": "cats purr and meow, a cat chases mice",
        "ship": "ships sail the sea, a ship has a hull",
        "code": "python code compiles, functions return values",
    }
    documents = [f"{topics[t]} {i}" for i in range(4) for t in topics]  # interleaved: every neighbour differs
    ordered = order_by_similarity(documents)
    assert sorted(ordered) == sorted(documents)  # a permutation
    changes = sum(a.split()[0] != b.split()[0] for a, b in zip(ordered, ordered[1:]))
    assert changes == 2  # three runs, one per topic (interleaved input: 11 changes)
    assert order_by_similarity(documents) == ordered  # deterministic
