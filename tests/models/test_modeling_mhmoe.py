"""MHMoE model behaviour: the MH-MoE block against a naive loop, losses against their formulas, cache, save/load."""

import math

import pytest
import torch
import torch.nn.functional as F
from transformers import AutoConfig, AutoModel, AutoModelForCausalLM

from mhmoe import MHMoEConfig, MHMoEForCausalLM, MHMoEModel
from mhmoe.models.mhmoe.moe_losses import load_balancing_loss, router_z_loss
from mhmoe.models.mhmoe.sparse_moe import MHMoESparseMoeBlock


def tiny(**kw):
    base = dict(
        vocab_size=101,
        hidden_size=48,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        moe_heads=3,
        num_experts=10,
        num_experts_per_tok=3,
        moe_intermediate_size=20,
        shared_expert_intermediate_size=0,
    )
    base.update(kw)
    return MHMoEConfig(**base)


def naive_block(block: MHMoESparseMoeBlock, x: torch.Tensor, capacity: int | None = None) -> torch.Tensor:
    """Token by token, sub-token by sub-token, expert by expert: the paper's eq. (2)-(4)."""
    cfg_h, E = block.moe_heads, block.experts.num_experts
    k = block.gate.top_k
    d = x.shape[-1]
    flat = x.reshape(-1, d)
    heads = flat @ block.head_proj.weight.t() if block.head_proj is not None else flat
    subs = heads.reshape(-1, d // cfg_h)
    scores = [torch.softmax(F.linear(s.float(), block.gate.weight.float()), -1) for s in subs]
    choice = [torch.topk(p, k) for p in scores]
    used = [0] * E
    kept = {}
    for slot in range(k):  # capacity priority: all top-1 choices first, then top-2, in row order
        for row, (_vals, idx) in enumerate(choice):
            e = int(idx[slot])
            kept[row, slot] = capacity is None or used[e] < capacity
            used[e] += 1
    out = torch.zeros_like(subs)
    for row, (vals, idx) in enumerate(choice):
        norm = block.gate.norm_topk_prob  # renormalised when k > 1, at every k with "always" (Mixtral)
        weights = vals / vals.sum() if norm == "always" or (norm is True and k > 1) else vals
        for slot in range(k):
            if not kept[row, slot]:
                continue
            e = int(idx[slot])
            gate, up = (block.experts.gate_up_proj[e] @ subs[row]).chunk(2)
            out[row] += weights[slot] * (block.experts.down_proj[e] @ (F.silu(gate) * up))
    y = out.reshape(flat.shape)
    if block.merge_proj is not None:
        y = y @ block.merge_proj.weight.t()
    if block.shared_expert is not None:
        y = y + block.shared_expert(flat)
    return y.reshape(x.shape)


@pytest.mark.parametrize(
    "fields",
    [
        dict(),
        dict(moe_heads=1, moe_head_layer=False, moe_merge_layer=False, num_experts_per_tok=2),
        dict(moe_heads=4, moe_head_layer=True, moe_merge_layer=False, norm_topk_prob=False),
        dict(moe_heads=2, moe_head_layer=False, moe_merge_layer=True, shared_expert_intermediate_size=24),
        dict(capacity_factor=0.5),
        dict(num_experts_per_tok=1),
        dict(num_experts_per_tok=1, norm_topk_prob="always"),
    ],
)
@pytest.mark.parametrize("impl", ["grouped_mm", "eager"])
def test_block_matches_naive_loop(fields, impl):
    cfg = tiny(**fields)
    cfg._experts_implementation = impl
    model = MHMoEModel(cfg).eval()
    block = model.layers[0].mlp
    x = torch.randn(2, 5, cfg.hidden_size)
    capacity = None
    if cfg.capacity_factor is not None:
        capacity = math.ceil(cfg.capacity_factor * 2 * 5 * cfg.moe_heads * cfg.num_experts_per_tok / cfg.num_experts)
    with torch.no_grad():
        torch.testing.assert_close(block(x), naive_block(block, x, capacity), rtol=1e-4, atol=1e-5)


def test_capacity_drops_overflow_to_residual():
    cfg = tiny(capacity_factor=0.01, num_hidden_layers=1)  # capacity 1 per expert
    block = MHMoEModel(cfg).layers[0].mlp
    x = torch.randn(1, 30, cfg.hidden_size)
    _, weights, experts = block.gate(block.head_proj(x).reshape(-1, cfg.hidden_size // cfg.moe_heads))
    kept = experts < cfg.num_experts
    assert int(kept.sum()) <= cfg.num_experts  # at most one assignment per expert survives
    assert torch.all(weights[~kept] == 0)
    assert torch.bincount(experts[kept], minlength=cfg.num_experts).max() <= 1


def test_load_balancing_and_z_loss_formulas():
    h, E, k = 2, 5, 2
    logits = (torch.randn(3 * 4 * h, E), torch.randn(3 * 4 * h, E))
    mask = torch.tensor([[0, 1, 1, 1], [1, 1, 1, 1], [0, 0, 1, 1]])
    rows = mask.reshape(-1).repeat_interleave(h).bool()  # token-major sub-tokens inherit their token's mask
    per_layer = []
    for lg in logits:
        p = torch.softmax(lg[rows], -1)
        sel = torch.topk(p, k).indices
        f = torch.stack([(sel == e).sum() for e in range(E)]).float() / rows.sum()
        per_layer.append(E * (f * p.mean(0)).sum())
    expected = torch.stack(per_layer).mean()
    torch.testing.assert_close(load_balancing_loss(logits, E, k, mask, moe_heads=h), expected)
    expected_z = torch.stack([torch.logsumexp(lg[rows], -1).pow(2).mean() for lg in logits]).mean()
    torch.testing.assert_close(router_z_loss(logits, mask, moe_heads=h), expected_z)


def test_losses_added_to_lm_loss():
    cfg = tiny(output_router_logits=True, router_aux_loss_coef=0.3, router_z_loss_coef=0.01)
    model = MHMoEForCausalLM(cfg)
    ids = torch.randint(0, cfg.vocab_size, (2, 9))
    out = model(ids, labels=ids)
    lm_only = model(ids, labels=ids, output_router_logits=False)
    assert lm_only.aux_loss is None and out.aux_loss is not None
    assert len(out.router_logits) == cfg.num_hidden_layers
    assert out.router_logits[0].shape == (2 * 9 * cfg.moe_heads, cfg.num_experts)
    torch.testing.assert_close(out.loss, lm_only.loss + 0.3 * out.aux_loss + 0.01 * out.z_loss)
    out.loss.backward()
    assert model.model.layers[0].mlp.gate.weight.grad.abs().sum() > 0


def test_sparse_step_places_moe_layers():
    model = MHMoEModel(tiny(num_hidden_layers=4, decoder_sparse_step=2))
    kinds = [type(layer.mlp).__name__ for layer in model.layers]
    assert kinds == ["MHMoEMLP", "MHMoESparseMoeBlock", "MHMoEMLP", "MHMoESparseMoeBlock"]


def test_router_runs_in_fp32_under_bf16():
    model = MHMoEForCausalLM(tiny(output_router_logits=True)).to(torch.bfloat16)
    out = model(torch.randint(0, 101, (1, 6)))
    assert out.logits.dtype == torch.bfloat16
    assert all(lg.dtype == torch.float32 for lg in out.router_logits)


def test_router_runs_in_fp32_under_autocast():
    """Accelerate's bf16 mixed precision is autocast: the router's linear must not be cast down by it."""
    model = MHMoEForCausalLM(tiny(output_router_logits=True))
    router = model.model.layers[0].mlp.gate
    sub_tokens = torch.randn(30, 16, generator=torch.Generator().manual_seed(0))
    expected = router(sub_tokens)[0]
    with torch.autocast("cpu", dtype=torch.bfloat16):
        logits = router(sub_tokens)[0]
        out = model(torch.randint(0, 101, (1, 6)))
    assert logits.dtype == torch.float32 and torch.equal(logits, expected)
    assert all(lg.dtype == torch.float32 for lg in out.router_logits)


def test_losses_are_zero_not_nan_without_real_tokens():
    model = MHMoEForCausalLM(tiny(output_router_logits=True, router_z_loss_coef=0.1))
    ids = torch.randint(0, 101, (2, 6))
    out = model(ids, attention_mask=torch.zeros_like(ids))
    assert out.aux_loss.item() == 0.0 and out.z_loss.item() == 0.0


def test_save_and_reload_through_auto_classes(tmp_path):
    cfg = tiny(shared_expert_intermediate_size=16, capacity_factor=1.5, router_z_loss_coef=0.001)
    model = AutoModelForCausalLM.from_config(cfg).eval()
    model.save_pretrained(tmp_path)
    assert (tmp_path / "model.safetensors").exists() and not list(tmp_path.glob("*.bin"))
    assert AutoConfig.from_pretrained(tmp_path).to_dict()["num_experts_per_tok"] == 3
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    assert isinstance(reloaded, MHMoEForCausalLM)
    assert reloaded.config.capacity_factor == 1.5 and reloaded.config.shared_expert_intermediate_size == 16
    ids = torch.randint(0, cfg.vocab_size, (2, 7))
    torch.testing.assert_close(reloaded(ids).logits, model(ids).logits)
    assert isinstance(AutoModel.from_pretrained(tmp_path), MHMoEModel)


def test_jitter_only_in_training():
    cfg = tiny(router_jitter_noise=0.5)
    model = MHMoEForCausalLM(cfg)
    ids = torch.randint(0, cfg.vocab_size, (1, 6))
    model.eval()
    torch.testing.assert_close(model(ids).logits, model(ids).logits)
    model.train()
    assert not torch.allclose(model(ids).logits, model(ids).logits)
