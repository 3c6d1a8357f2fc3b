"""The official code's conventions as options, each against a small transcription written here (float64, outputs and
gradients): the official MH-MoE TopkGate + MOELayer (raw top-k gates, capacity k·ceil(S/E) with GShard priority,
head/merge layers with bias), the MoH paper's eq. 9-10 straight-through estimator for the l2 router, and the official
BitNet FFN (separate fc1/fc3 scales, one sub-layer norm before fc2) and attention (torchscale's MultiheadAttention: no
norm before q/k/v, one sub-layer norm before out_proj). Sources: yushuiwx/MH-MoE (torchscale xmoe
`topkgating`, `mhmoe_layer.MOELayer`, `FeedForwardNetwork`), the MoH paper §4.4, BitNet b1.58's training tips."""

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from mhmoe import MHMoEConfig, MHMoEForCausalLM, matched_to_smoe
from mhmoe.models.mhmoe.bitnet import BitLinear, BitNetExperts, quantize_weight
from mhmoe.models.mhmoe.matching import OFFICIAL_ROUTING, conventions_fields
from mhmoe.models.mhmoe.sparse_moe import MHMoESparseMoeBlock
from mhmoe.models.moh.head_routers import HEAD_ROUTERS
from mhmoe.models.ops import backends
from mhmoe.models.ops.routing import routing_triton
from mhmoe.models.ops.routing.routing_naive import expert_capacity, route


def tiny(**kw):
    base = dict(
        vocab_size=61,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        max_position_embeddings=64,
        moe_heads=2,
        num_experts=3,
        num_experts_per_tok=2,
        moe_intermediate_size=8,
        bos_token_id=None,
        eos_token_id=None,
    )
    base.update(kw)
    return MHMoEConfig(**base)


# ---- the official MH-MoE layer, transcribed -------------------------------------------------------------------


def official_topk_gate(sub_tokens, router_weight, top_k):
    """TopkGate / topkgating: softmax, top-k, capacity k·ceil(S/E); the r-th choices are placed after all (r-1)-th
    ones of the same expert (cumsum - 1 + earlier ranks' counts); gates are raw unless
    normalize_gate_prob_before_dropping (not passed by the official decoder). Returns per rank (expert, kept, gate)."""
    gates = torch.softmax((sub_tokens @ router_weight.t()).float(), dim=1).to(sub_tokens.dtype)  # use_fp32 (default)
    num_tokens, num_experts = gates.shape
    capacity = top_k * math.ceil(num_tokens / num_experts)
    indices = torch.topk(gates, top_k, dim=1).indices
    ranks, earlier = [], torch.zeros(num_experts, dtype=torch.long)
    for r in range(top_k):
        mask = F.one_hot(indices[:, r], num_experts)
        locations = ((torch.cumsum(mask, 0) - 1 + earlier) * mask).sum(1)
        earlier = earlier + mask.sum(0)
        ranks.append((indices[:, r], locations < capacity, (gates * mask).sum(1)))
    return ranks


def official_ffn(x, fc1, fc3, fc2):
    """FeedForwardNetwork with fc3 (gate, SiLU) and fc1 (up): fc2(fc1(x) · silu(fc3(x))), no bias."""
    return (F.linear(x, fc1) * F.silu(F.linear(x, fc3))) @ fc2.t()


def official_mhmoe_layer(x, block, top_k):
    """MOELayer: multi_heads (Linear d->d, bias) -> (N·h, d/h) token-major -> gate -> experts -> concat -> out_proj."""
    tokens = x.reshape(-1, x.shape[-1])
    heads = block.moe_heads
    projected = F.linear(tokens, block.head_proj.weight, block.head_proj.bias)
    sub = projected.reshape(tokens.shape[0] * heads, -1)
    inter = block.experts.intermediate_dim
    out = torch.zeros_like(sub)
    for expert_ids, kept, gate in official_topk_gate(sub, block.gate.weight, top_k):
        for row in range(sub.shape[0]):
            if kept[row]:
                e = int(expert_ids[row])
                w = block.experts.gate_up_proj[e]
                out[row] = out[row] + gate[row] * official_ffn(
                    sub[row], w[inter:], w[:inter], block.experts.down_proj[e]
                )
    merged = F.linear(out.reshape(tokens.shape), block.merge_proj.weight, block.merge_proj.bias)
    return merged.reshape(x.shape)


def _official_block(seed=0, **kw):
    torch.manual_seed(seed)
    config = tiny(**{**OFFICIAL_ROUTING, "moe_layer_bias": True, **kw})
    block = MHMoESparseMoeBlock(config).double()
    with torch.no_grad():
        for p in block.parameters():
            p.normal_(0, 0.5)
    return config, block


@pytest.mark.parametrize("top_k", [1, 2])
def test_mhmoe_layer_matches_the_official_layer(top_k):
    config, block = _official_block(num_experts_per_tok=top_k)
    assert block.head_proj.bias is not None and block.merge_proj.bias is not None  # official nn.Linear(d, d, bias)
    x = torch.randn(2, 4, config.hidden_size, dtype=torch.float64, requires_grad=True)  # S = 16 sub-tokens, E = 3
    sub = F.linear(x.detach().reshape(8, 32), block.head_proj.weight, block.head_proj.bias).reshape(16, 16)
    ranks = official_topk_gate(sub, block.gate.weight, top_k)
    assert not all(bool(kept.all()) for _, kept, _ in ranks), "no assignment dropped: the capacity is not tested"
    ours = block(x)
    ref_x = x.detach().clone().requires_grad_()
    ref = official_mhmoe_layer(ref_x, block, top_k)
    scale = float(ref.detach().abs().max())
    torch.testing.assert_close(ours, ref, rtol=1e-5, atol=1e-6 * scale)  # both routers softmax in fp32
    grad = torch.randn_like(ours)
    params = [p for p in block.parameters()]
    ours_grads = torch.autograd.grad(ours, [x, *params], grad, allow_unused=True)
    ref_grads = torch.autograd.grad(ref, [ref_x, *params], grad, allow_unused=True)
    for name, a, b in zip(["x"] + [n for n, _ in block.named_parameters()], ours_grads, ref_grads):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6 * float(b.detach().abs().max()), msg=name)


def test_the_library_conventions_differ_from_the_official_layer():
    """Each official option matters here: renormalised gates, Switch rounding or no bias give another output."""
    config, block = _official_block()
    x = torch.randn(2, 4, config.hidden_size, dtype=torch.float64)  # S = 16: Switch capacity 11, official 12
    ref = official_mhmoe_layer(x, block, 2)
    for field, library, official in (("norm_topk_prob", True, False), ("capacity_rounding", "switch", "official")):
        setattr(block.gate, field, library)
        assert not torch.allclose(block(x), ref), field
        setattr(block.gate, field, official)
    torch.testing.assert_close(block(x), ref, rtol=1e-5, atol=1e-6 * float(ref.abs().max()))
    with torch.no_grad():
        block.merge_proj.bias.zero_()
    assert not torch.allclose(block(x), ref)


def test_capacity_roundings():
    # S = 10 sub-tokens, E = 3 experts, k = 2: Switch ceil(1.0·10·2/3) = 7, official 2·ceil(10/3) = 8
    assert expert_capacity(1.0, 10, 2, 3) == 7
    assert expert_capacity(1.0, 10, 2, 3, "official") == 8
    assert expert_capacity(1.0, 12, 2, 3, "official") == expert_capacity(1.0, 12, 2, 3) == 8  # E divides S: equal
    assert expert_capacity(1.0, 10, 1, 3, "official") == expert_capacity(1.0, 10, 1, 3) == 4  # k = 1: equal
    with pytest.raises(ValueError, match="rounding"):
        expert_capacity(1.0, 10, 2, 3, "floor")
    torch.manual_seed(3)
    logits = torch.randn(10, 3, dtype=torch.float64) * 3
    weights, experts = route(logits, 2, False, 1.0, "official")
    kept = experts < 3
    for r, (expert_ids, ref_kept, gate) in enumerate(official_topk_gate(logits, torch.eye(3, dtype=torch.float64), 2)):
        assert torch.equal(kept[:, r], ref_kept)
        assert torch.equal(experts[:, r][ref_kept], expert_ids[ref_kept])
        torch.testing.assert_close(weights[:, r].double(), (gate * ref_kept).double(), rtol=1e-6, atol=1e-7)


def test_official_routing_fields_are_checked():
    with pytest.raises(ValueError, match="capacity_rounding='official'.*capacity_factor is None"):
        tiny(capacity_rounding="official")
    with pytest.raises(ValueError, match="capacity_rounding must be one of"):
        tiny(capacity_factor=1.0, capacity_rounding="floor")
    with pytest.raises(ValueError, match="moe_layer_bias=True needs a head or merge layer"):
        tiny(moe_heads=1, moe_layer_bias=True)


# ---- the preset ------------------------------------------------------------------------------------------------


def test_official_preset():
    smoe = tiny(moe_heads=1, num_experts=4, num_experts_per_tok=1, moe_intermediate_size=64)
    official = matched_to_smoe(smoe, 2, 2, round_experts_to=1, conventions="official")
    library = matched_to_smoe(smoe, 2, 2, round_experts_to=1)
    sizes = ("num_experts", "moe_intermediate_size")
    assert [getattr(official, n) for n in sizes] == [getattr(library, n) for n in sizes]  # the same parity solve
    assert official.norm_topk_prob is False and official.capacity_factor == 1.0
    assert official.capacity_rounding == "official" and official.moe_layer_bias is True
    assert official.router_aux_loss_mode == "top1_sum"
    assert (library.norm_topk_prob, library.capacity_factor, library.moe_layer_bias) == (True, None, False)
    assert conventions_fields("official", smoe).get("moe_layer_bias") is None  # SMoE: no head/merge layer to bias
    bitnet_smoe = tiny(moe_heads=1, moe_intermediate_size=64, linear_type="bitnet_b158")
    bitnet = matched_to_smoe(bitnet_smoe, 2, 2, round_experts_to=1, conventions="official")
    assert (bitnet.bitnet_quantized_layers, bitnet.bitnet_ffn_norm) == ("official", "before_down")
    assert bitnet.bitnet_attention_norm == "before_o_proj"
    # kwargs win over the preset
    assert (
        matched_to_smoe(smoe, 2, 2, round_experts_to=1, conventions="official", capacity_factor=2.0).capacity_factor
        == 2.0
    )
    with pytest.raises(ValueError, match="conventions must be one of"):
        matched_to_smoe(smoe, 2, 2, conventions="paper")


# ---- MoH eq. 9-10 ------------------------------------------------------------------------------------------------


def test_l2_router_scores_straight_through_is_eq_9_10():
    """Forward: 0/1 gates; backward: ∂L/∂g_i^q = ∂L/∂g_i, g_i = softmax(‖q_i‖ / std_j ‖q_j‖) over routed heads."""
    torch.manual_seed(0)
    heads, shared, active, hd = 6, 2, 2, 4
    queries = torch.randn(2, 3, heads, hd, dtype=torch.float64, requires_grad=True)
    hidden = torch.randn(2, 3, 8, dtype=torch.float64)
    router = HEAD_ROUTERS["l2"](8, heads, shared, active, "scores")
    gates, _, index = router(hidden, queries)
    hard = torch.zeros(2, 3, heads - shared, dtype=torch.float64).scatter(-1, index, 1.0)
    torch.testing.assert_close(gates.double(), torch.cat([torch.ones(2, 3, shared, dtype=torch.float64), hard], -1))
    upstream = torch.randn(2, 3, heads, dtype=torch.float64)
    (grad,) = torch.autograd.grad((gates.double() * upstream).sum(), queries)

    ref_q = queries.detach().clone().requires_grad_()
    norms = ref_q[..., shared:, :].pow(2).sum(-1).sqrt()
    scores = torch.softmax(norms / norms.std(-1, keepdim=True), dim=-1)  # the paper's g_i, every routed head
    (ref_grad,) = torch.autograd.grad((scores * upstream[..., shared:]).sum(), ref_q)
    torch.testing.assert_close(grad, ref_grad, rtol=1e-5, atol=1e-7)  # the router computes in fp32

    library = HEAD_ROUTERS["l2"](8, heads, shared, active, True)
    gates_lib, _, _ = library(hidden, queries)
    torch.testing.assert_close(gates_lib, gates)  # same forward
    (grad_lib,) = torch.autograd.grad((gates_lib.double() * upstream).sum(), queries)
    assert (grad_lib - grad).abs().max() > 1e-3 * grad.abs().max()  # another estimator


def transcribed_l2_scores(queries, shared, active, selected_only):
    """MoH §4.4 in float64: g_i = softmax_i(‖q_i‖ / std_j ‖q_j‖) over the routed heads; the tokens' top-K heads. With
    `selected_only` g_i is 0 on the heads a token does not select (eq. 5's definition of the gates), so eq. 10 gives
    gradient to the selected heads' scores only; otherwise to every routed head's score."""
    norms = queries[..., shared:, :].pow(2).sum(-1).sqrt()
    scores = torch.softmax(norms / norms.std(-1, keepdim=True), dim=-1)
    selected = torch.zeros_like(scores).scatter(-1, scores.topk(active, dim=-1).indices, 1.0)
    return scores * selected if selected_only else scores


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("mode", ["scores", "selected_scores"])
def test_l2_router_score_straight_through_readings(mode, backend):
    """Both readings of eq. 9-10 against the transcription, on the PyTorch router and on the triton kernel (under
    TRITON_INTERPRET=1): 0/1 gates forward; backward the gradient of the raw scores of every routed head ("scores") or
    of the selected heads only ("selected_scores"). The two readings give different gradients."""
    if backend == "triton" and not routing_triton.HAS_TRITON:
        pytest.skip("triton is not installed")
    torch.manual_seed(4)
    heads, shared, active, hd = 7, 2, 2, 5  # 5 routed heads, 2 selected
    queries = torch.randn(3, 5, heads, hd, dtype=torch.float64, requires_grad=True)
    router = HEAD_ROUTERS["l2"](8, heads, shared, active, mode)
    router.routing_backend = backend
    gates, _, index = router(torch.zeros(3, 5, 8, dtype=torch.float64), queries)
    upstream = torch.randn(3, 5, heads, dtype=torch.float64)
    (grad,) = torch.autograd.grad((gates.double() * upstream).sum(), queries)

    ref_q = queries.detach().clone().requires_grad_()
    ref = transcribed_l2_scores(ref_q, shared, active, selected_only=mode == "selected_scores")
    hard = torch.zeros_like(ref).scatter(-1, index, 1.0)
    assert torch.equal(hard, (transcribed_l2_scores(ref_q, shared, active, True) > 0).double())  # same selection
    torch.testing.assert_close(gates.double(), torch.cat([torch.ones_like(hard[..., :shared]), hard], -1))
    (ref_grad,) = torch.autograd.grad((ref * upstream[..., shared:]).sum(), ref_q)
    torch.testing.assert_close(grad, ref_grad, rtol=1e-5, atol=1e-7 * float(ref_grad.abs().max()))  # fp32 router

    other = transcribed_l2_scores(ref_q, shared, active, selected_only=mode == "scores")
    (other_grad,) = torch.autograd.grad((other * upstream[..., shared:]).sum(), ref_q)
    assert (other_grad - grad).abs().max() > 0.05 * grad.abs().max()  # the other reading: another estimator


def test_scores_straight_through_needs_the_l2_router():
    with pytest.raises(ValueError, match="'scores'.*needs moh_router 'l2', 'l2_standardized' or 'l2_relative'"):
        tiny(moh_shared_heads=2, moh_active_heads=1, moh_router="learned", moh_straight_through="scores")
    with pytest.raises(ValueError, match="'selected_scores'.*needs moh_router 'l2'"):
        tiny(moh_shared_heads=2, moh_active_heads=1, moh_router="learned", moh_straight_through="selected_scores")
    with pytest.raises(ValueError, match="moh_straight_through must be"):
        tiny(moh_shared_heads=2, moh_active_heads=1, moh_router="l2", moh_straight_through="soft")
    config = tiny(moh_shared_heads=2, moh_active_heads=1, moh_router="l2", moh_straight_through="scores")
    model = MHMoEForCausalLM(config)
    model(torch.randint(0, 61, (1, 5)), labels=torch.randint(0, 61, (1, 5))).loss.backward()
    assert model.model.layers[0].self_attn.q_proj.weight.grad.abs().sum() > 0


# ---- BitNet ------------------------------------------------------------------------------------------------------


def ref_weight_quant(w):
    """Training tips: scale = 1 / mean|W| (clamped), RoundClip(W · scale, -1, 1) / scale; one matrix."""
    scale = 1.0 / w.abs().mean().clamp(min=1e-5)
    return (w * scale).round().clamp(-1, 1) / scale


def ref_activation_quant(x):
    scale = 127.0 / x.abs().amax(dim=-1, keepdim=True).clamp(min=1e-5)
    return (x * scale).round().clamp(-128, 127) / scale


def ste(full, quantized):
    return full + (quantized - full).detach()


def official_bitnet_ffn(x, fc1, fc3, fc2, down_gain, eps, input_gain=None):
    """The official FFN with BitLinear projections: fc1 (up) and fc3 (gate) each their own scale; the sub-layer norm
    (RMSNorm with gain) only before fc2; `input_gain`: this library's extra norm before gate/up."""
    if input_gain is not None:
        x = input_gain * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))
    xq = ste(x, ref_activation_quant(x))
    up = xq @ ste(fc1, ref_weight_quant(fc1)).t()
    gate = F.silu(xq @ ste(fc3, ref_weight_quant(fc3)).t())
    h = up * gate
    h = down_gain * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps))
    return ste(h, ref_activation_quant(h)) @ ste(fc2, ref_weight_quant(fc2)).t()


@pytest.mark.parametrize("ffn_norm", ["before_down", "every_projection"])
def test_bitnet_experts_match_the_official_ffn(ffn_norm):
    torch.manual_seed(1)
    config = tiny(linear_type="bitnet_b158", bitnet_quantized_layers="official", bitnet_ffn_norm=ffn_norm)
    experts = BitNetExperts(config).double()
    inter = experts.intermediate_dim
    with torch.no_grad():
        experts.gate_up_proj.normal_(0, 0.3)
        experts.gate_up_proj[:, inter:] *= 4.0  # up's scale is not gate's: one shared scale would show
        experts.down_proj.normal_(0, 0.3)
        experts.down_norm.uniform_(0.5, 1.5)
        if experts.gate_up_norm is not None:
            experts.gate_up_norm.uniform_(0.5, 1.5)
    assert (experts.gate_up_norm is None) == (ffn_norm == "before_down")
    x = torch.randn(7, experts.hidden_dim, dtype=torch.float64, requires_grad=True)
    index = torch.randint(0, 3, (7, 2))
    index[:, 1] = (index[:, 0] + 1) % 3
    weights = torch.rand(7, 2, dtype=torch.float64)
    ours = experts(x, index, weights)

    ref_x = x.detach().clone().requires_grad_()
    rows = []
    for n in range(7):
        row = 0
        for slot in range(2):
            e = int(index[n, slot])
            w = experts.gate_up_proj[e]
            gain = None if experts.gate_up_norm is None else experts.gate_up_norm[e]
            row = (
                row
                + weights[n, slot]
                * official_bitnet_ffn(
                    ref_x[n : n + 1],
                    w[inter:],
                    w[:inter],
                    experts.down_proj[e],
                    experts.down_norm[e],
                    experts.eps,
                    gain,
                )[0]
            )
        rows.append(row)
    ref = torch.stack(rows)
    torch.testing.assert_close(ours, ref, rtol=1e-5, atol=1e-6)  # quantisers compute in fp32
    grad = torch.randn_like(ours)
    params = [p for p in experts.parameters()]
    for a, b in zip(torch.autograd.grad(ours, [x, *params], grad), torch.autograd.grad(ref, [ref_x, *params], grad)):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


def official_bitnet_attention(x, proj, out_gain, eps, cos, sin, heads, kv_heads, input_gains=None):
    """torchscale's MultiheadAttention with BitLinear q/k/v/out_proj (`proj`: their latent weights): q/k/v quantise the
    layer input as is (no norm of their own), causal softmax(q·kᵀ/√hd)·v per head (k/v repeated for GQA), the one
    sub-layer norm `inner_attn_ln` (RMSNorm with gain) on the concatenated heads, then out_proj. Positions: this
    library's RoPE (Llama's rotate-half), given as `cos`/`sin` (the one part not transcribed: position encoding is not
    what the option changes). `input_gains`: this library's extra norms before q/k/v (every_projection)."""

    def bitlinear(inp, w, gain=None):
        if gain is not None:
            inp = gain * (inp * torch.rsqrt(inp.pow(2).mean(-1, keepdim=True) + eps))
        return ste(inp, ref_activation_quant(inp)) @ ste(w, ref_weight_quant(w)).t()

    def rope(t):  # (B, heads, T, hd)
        half = t.shape[-1] // 2
        rotated = torch.cat([-t[..., half:], t[..., :half]], dim=-1)
        return t * cos[:, None] + rotated * sin[:, None]

    batch, seq, _ = x.shape
    gains = input_gains or (None, None, None)
    q, k, v = (
        bitlinear(x, w, g).view(batch, seq, n, -1).transpose(1, 2)
        for w, g, n in zip(proj[:3], gains, (heads, kv_heads, kv_heads))
    )
    q, k = rope(q), rope(k)
    k, v = (t.repeat_interleave(heads // kv_heads, dim=1) for t in (k, v))
    scores = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
    causal = torch.ones(seq, seq, dtype=torch.bool).triu(1)
    attn = torch.softmax(scores.masked_fill(causal, float("-inf")), dim=-1) @ v  # (B, H, T, hd)
    attn = attn.transpose(1, 2).reshape(batch, seq, -1)
    return bitlinear(attn, proj[3], out_gain)


@pytest.mark.parametrize("attention_norm", ["before_o_proj", "every_projection"])
def test_bitnet_attention_matches_the_official_attention(attention_norm):
    """`bitnet_attention_norm="before_o_proj"`: torchscale's attention (no norm before q/k/v, one before out_proj),
    float64, outputs and gradients; "every_projection" (the default, old checkpoints) keeps the q/k/v norms."""
    torch.manual_seed(6)
    config = tiny(
        linear_type="bitnet_b158",
        bitnet_quantized_layers="official",
        bitnet_attention_norm=attention_norm,
        num_key_value_heads=2,
        decoder_sparse_step=0,
    )
    model = MHMoEForCausalLM(config).double()
    attention = model.model.layers[0].self_attn
    projections = [attention.q_proj, attention.k_proj, attention.v_proj, attention.o_proj]
    with torch.no_grad():
        for layer in projections:
            layer.weight.normal_(0, 0.3)
            if layer.input_norm is not None:
                layer.input_norm.weight.uniform_(0.5, 1.5)
    assert all(isinstance(layer, BitLinear) for layer in projections)
    has_norms = [layer.input_norm is not None for layer in projections]
    assert has_norms == ([False, False, False, True] if attention_norm == "before_o_proj" else [True] * 4)

    x = torch.randn(2, 6, config.hidden_size, dtype=torch.float64, requires_grad=True)
    positions = torch.arange(6)[None].expand(2, 6)
    cos, sin = model.model.rotary_emb(x, positions)
    ours, _ = attention(x, (cos, sin), None)

    ref_x = x.detach().clone().requires_grad_()
    gains = None if attention_norm == "before_o_proj" else [layer.input_norm.weight for layer in projections[:3]]
    ref_args = (attention.o_proj.input_norm.weight, config.rms_norm_eps, cos, sin, 4, config.num_key_value_heads)
    ref = official_bitnet_attention(ref_x, [layer.weight for layer in projections], *ref_args, gains)
    torch.testing.assert_close(ours, ref, rtol=1e-5, atol=1e-6)  # quantisers compute in fp32
    if gains is None:  # the library's q/k/v norms (unit gains) would give another output
        ones = [torch.ones(config.hidden_size, dtype=torch.float64)] * 3
        other = official_bitnet_attention(ref_x, [layer.weight for layer in projections], *ref_args, ones)
        assert not torch.allclose(other, ref, rtol=1e-3)
    grad = torch.randn_like(ours)
    params = [p for p in attention.parameters()]
    names = ["x"] + [n for n, _ in attention.named_parameters()]
    ours_grads = torch.autograd.grad(ours, [x, *params], grad)
    ref_grads = torch.autograd.grad(ref, [ref_x, *params], grad)
    for name, a, b in zip(names, ours_grads, ref_grads):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5, msg=name)


def test_bitnet_attention_norm_is_checked_and_in_the_official_preset():
    official = tiny(linear_type="bitnet_b158", bitnet_quantized_layers="official")
    assert official.bitnet_attention_norm == "every_projection"  # the default: old checkpoints build as before
    with pytest.raises(ValueError, match="bitnet_attention_norm must be one of"):
        tiny(linear_type="bitnet_b158", bitnet_attention_norm="before_out")
    with pytest.raises(ValueError, match="bitnet_attention_norm='before_o_proj' applies to quantised attention"):
        tiny(linear_type="bitnet_b158", bitnet_quantized_layers="ffn_only", bitnet_attention_norm="before_o_proj")
    fields = conventions_fields("official", official)
    assert fields["bitnet_attention_norm"] == "before_o_proj" and fields["bitnet_ffn_norm"] == "before_down"


def test_fused_gate_up_has_one_scale_per_projection():
    torch.manual_seed(2)
    w = torch.randn(3, 2 * 8, 16)
    w[:, 8:] *= 10.0
    ternary, scale = quantize_weight(w, parts=2)
    assert scale.shape == (3, 2)
    torch.testing.assert_close(scale, torch.stack([w[:, :8].abs().mean((1, 2)), w[:, 8:].abs().mean((1, 2))], -1))
    gate_alone, _ = quantize_weight(w[:, :8])
    assert torch.equal(ternary[:, :8], gate_alone)  # the gate half ignores up's magnitude


MODULE_TYPES = {  # bitnet_quantized_layers -> quantised (attention, dense MLP, head/merge, experts)
    "all": (True, True, True, True),
    "official": (True, True, False, True),
    "ffn_only": (False, True, False, True),
    "experts": (False, False, False, True),
}


@pytest.mark.parametrize("layers", list(MODULE_TYPES))
def test_which_projections_each_bitnet_setting_quantises(layers):
    model = MHMoEForCausalLM(
        tiny(
            linear_type="bitnet_b158",
            bitnet_quantized_layers=layers,
            decoder_sparse_step=2,
            shared_expert_intermediate_size=8,
        )
    )
    dense, moe = model.model.layers
    attention, mlp, head, experts = MODULE_TYPES[layers]
    assert isinstance(dense.self_attn.q_proj, BitLinear) == attention
    assert isinstance(dense.mlp.up_proj, BitLinear) == mlp
    assert isinstance(moe.mlp.shared_expert.down_proj, BitLinear) == mlp
    assert isinstance(moe.mlp.head_proj, BitLinear) == head and isinstance(moe.mlp.merge_proj, BitLinear) == head
    assert isinstance(moe.mlp.experts, BitNetExperts) == experts
    assert type(moe.mlp.gate.weight) is nn.Parameter and not isinstance(moe.mlp.gate, BitLinear)  # routers: never


def test_before_down_drops_the_ffn_input_norms_only():
    model = MHMoEForCausalLM(
        tiny(
            linear_type="bitnet_b158",
            bitnet_quantized_layers="official",
            decoder_sparse_step=2,
            bitnet_ffn_norm="before_down",
        )
    )
    dense, moe = model.model.layers
    assert dense.mlp.gate_proj.input_norm is None and dense.mlp.up_proj.input_norm is None
    assert dense.mlp.down_proj.input_norm is not None and dense.self_attn.q_proj.input_norm is not None
    assert moe.mlp.experts.gate_up_norm is None
    out = model(torch.randint(0, 61, (1, 6)), labels=torch.randint(0, 61, (1, 6)))
    out.loss.backward()
    assert torch.isfinite(out.loss)
    with pytest.raises(ValueError, match="bitnet_ffn_norm must be one of"):
        tiny(bitnet_ffn_norm="none")


@pytest.mark.skipif(not routing_triton.HAS_TRITON, reason="triton is not installed")
def test_official_rounding_through_the_dispatch_and_the_kernel(monkeypatch):
    """`backends.route` passes the rounding to both backends (kernel under TRITON_INTERPRET on CPU, tests/conftest.py)."""
    torch.manual_seed(5)
    logits = torch.randn(10, 3) * 3  # S = 10, E = 3, k = 2: official capacity 8, Switch 7
    reference = route(logits, 2, False, 1.0, "official")
    for backend in ("torch", "triton"):
        monkeypatch.setenv("MHMOE_ROUTING_BACKEND", backend)
        weights, experts = backends.route(logits, 2, False, 1.0, capacity_rounding="official")
        assert torch.equal(experts, reference[1]), backend
        torch.testing.assert_close(weights, reference[0])
    switch = backends.route(logits, 2, False, 1.0)[1]
    assert (switch == 3).sum() > (reference[1] == 3).sum()  # the smaller Switch capacity drops more here
