"""BitNet b1.58 (1-bit MH-MoE): ternary weights × one scale per matrix, 8-bit activations against the paper's formulas,
straight-through gradients, the grouped expert path against a loop, training, save/load, packed export, PEFT."""

import json

import pytest
import torch
from peft import get_peft_model
from safetensors import safe_open
from torch import nn

from mhmoe import MHMoEConfig, MHMoEForCausalLM
from mhmoe.hub import export_pretrained
from mhmoe.models.mhmoe.bitnet import BitLinear, BitNetExperts, PackedBitLinear, packed_model
from mhmoe.training.peft import lora_config
from tests.fixtures.remote_code import load_without_mhmoe


def tiny(**kw):
    base = dict(
        vocab_size=97,
        hidden_size=48,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        moe_heads=3,
        num_experts=6,
        num_experts_per_tok=2,
        moe_intermediate_size=16,
        linear_type="bitnet_b158",
        bos_token_id=None,
        eos_token_id=None,
    )
    base.update(kw)
    return MHMoEConfig(**base)


def ref_weight_quant(w: torch.Tensor) -> torch.Tensor:
    """BitNet b1.58 eq. (1)-(3): absmean scale γ, RoundClip(W / γ, -1, 1) · γ, for one matrix."""
    gamma = w.abs().mean().clamp(min=1e-5)
    return (w / gamma).round().clamp(-1, 1) * gamma


def ref_bitlinear(layer: BitLinear, x: torch.Tensor) -> torch.Tensor:
    """y = W_q · Q_8(RMSNorm(x)), written out from the paper (absmax per token to [-128, 127])."""
    normed = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + layer.input_norm.variance_epsilon)
    normed = layer.input_norm.weight * normed
    q = 127.0 / normed.abs().amax(-1, keepdim=True).clamp(min=1e-5)
    x_q = (normed * q).round().clamp(-128, 127) / q
    return x_q @ ref_weight_quant(layer.weight.detach()).t()


def _assert_ternary_one_scale(matrix: torch.Tensor, latent: torch.Tensor):
    values = matrix.unique()
    scale = latent.abs().mean()
    assert len(values) == 3 and set((values / scale).round().tolist()) == {-1.0, 0.0, 1.0}
    torch.testing.assert_close(values.abs().max(), scale)  # the one scale is the absmean of the latent matrix


def test_weights_are_ternary_times_one_scale_per_matrix():
    torch.manual_seed(0)
    model = MHMoEForCausalLM(tiny())
    linears = {n: m for n, m in model.named_modules() if isinstance(m, BitLinear)}
    # the paper's "all": attention, dense MLP (none here), head and merge layers and experts; not embeddings/head/router
    assert {n.rsplit(".", 1)[-1] for n in linears} == {
        "q_proj",
        "k_proj",
        "v_proj",
        "o_proj",
        "head_proj",
        "merge_proj",
    }
    assert type(model.lm_head) is nn.Linear and type(model.model.layers[0].mlp.gate) is not BitLinear
    for module in linears.values():
        _assert_ternary_one_scale(module.quantized_weight(), module.weight.detach())
    experts = model.model.layers[0].mlp.experts
    assert isinstance(experts, BitNetExperts)
    gate_up, down = experts.quantized_weights()
    inter = experts.intermediate_dim
    for e in range(experts.num_experts):  # one scale per expert matrix (gate and up each their own), not per tensor
        _assert_ternary_one_scale(gate_up[e, :inter], experts.gate_up_proj[e, :inter].detach())
        _assert_ternary_one_scale(gate_up[e, inter:], experts.gate_up_proj[e, inter:].detach())
        _assert_ternary_one_scale(down[e], experts.down_proj[e].detach())
    only_experts = MHMoEForCausalLM(tiny(bitnet_quantized_layers="experts"))
    assert not any(isinstance(m, BitLinear) for m in only_experts.modules())
    assert isinstance(only_experts.model.layers[1].mlp.experts, BitNetExperts)


def test_bitlinear_matches_paper_formula_and_ste_reaches_latent_weight():
    torch.manual_seed(0)
    layer = BitLinear(24, 10)
    nn.init.normal_(layer.weight, std=0.5)
    with torch.no_grad():
        layer.input_norm.weight.uniform_(0.5, 1.5)
    x = torch.randn(3, 5, 24)
    y = layer(x)
    torch.testing.assert_close(y, ref_bitlinear(layer, x), rtol=1e-5, atol=1e-5)
    # straight-through: d loss / d latent W equals d loss / d W_q of the quantised forward (rounding as identity)
    grad_out = torch.randn_like(y)
    y.backward(grad_out)
    normed = layer.input_norm(x).detach()
    q = 127.0 / normed.abs().amax(-1, keepdim=True)
    x_q = (normed * q).round().clamp(-128, 127) / q
    expected = grad_out.reshape(-1, 10).t() @ x_q.reshape(-1, 24)
    torch.testing.assert_close(layer.weight.grad, expected, rtol=1e-5, atol=1e-5)
    assert layer.input_norm.weight.grad.abs().sum() > 0  # the sub-layer norm learns through the activation STE


@pytest.mark.parametrize("hidden_size,moe_heads", [(48, 3), (18, 3)])  # W=16: grouped GEMM kernel; W=6: refused
def test_grouped_quantised_experts_match_loop(hidden_size, moe_heads):
    torch.manual_seed(0)
    experts = BitNetExperts(
        tiny(hidden_size=hidden_size, moe_heads=moe_heads, num_attention_heads=3, num_key_value_heads=3)
    )
    experts.init_parameters(0.5)
    with torch.no_grad():
        experts.gate_up_norm.uniform_(0.5, 1.5)
    x = torch.randn(20, hidden_size // moe_heads, requires_grad=True)
    index = torch.stack([torch.randperm(6)[:2] for _ in range(20)])
    index[3, 1] = 6  # a dropped assignment (capacity): contributes nothing
    weights = torch.rand(20, 2, requires_grad=True)
    out = experts(x, index, weights)
    torch.testing.assert_close(out, experts.eager_forward(x, index, weights), rtol=1e-4, atol=1e-5)
    out.square().sum().backward()
    assert experts.gate_up_proj.grad.abs().sum() > 0 and experts.down_proj.grad.abs().sum() > 0
    assert x.grad.abs().sum() > 0 and weights.grad.abs().sum() > 0
    assert experts.gate_up_proj.grad[index[index < 6].unique()].abs().sum() > 0


def _train(model, steps=30, lr=1e-2):
    torch.manual_seed(1)
    data = torch.randint(0, 97, (4, 24))
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    losses = []
    for _ in range(steps):
        loss = model(data, labels=data).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses, data


def test_tiny_model_loss_falls_and_generates():
    torch.manual_seed(0)
    model = MHMoEForCausalLM(tiny(decoder_sparse_step=2))  # layer 0 dense (BitLinear MLP), layer 1 MH-MoE
    assert isinstance(model.model.layers[0].mlp.down_proj, BitLinear)
    losses, data = _train(model)
    assert losses[-1] < 0.6 * losses[0], losses
    model.eval()
    generated = model.generate(data[:1, :6], max_new_tokens=8, do_sample=False)
    assert generated.shape == (1, 14)
    with torch.no_grad():  # cached greedy decoding equals the full forward's argmax
        logits = model(generated).logits
    assert torch.equal(logits[0, 5:-1].argmax(-1), generated[0, 6:])


def test_save_load_and_packed_export_round_trip(tmp_path, warm_blocked):
    torch.manual_seed(0)
    model = MHMoEForCausalLM(tiny())
    _train(model, steps=3)
    model.eval()
    ids = torch.randint(0, 97, (2, 12))
    with torch.no_grad():
        expected = model(ids).logits
    model.save_pretrained(tmp_path / "latent")  # latent weights: training resumes from these
    reloaded = MHMoEForCausalLM.from_pretrained(tmp_path / "latent").eval()
    assert reloaded.config.linear_type == "bitnet_b158" and not reloaded.config.bitnet_packed
    with torch.no_grad():
        torch.testing.assert_close(reloaded(ids).logits, expected, rtol=0, atol=0)

    packed = packed_model(model)
    assert isinstance(packed.model.layers[0].self_attn.q_proj, PackedBitLinear)
    with torch.no_grad():
        torch.testing.assert_close(packed(ids).logits, expected, rtol=1e-6, atol=1e-6)

    prompt = ids[:1, :5]
    with torch.no_grad():
        expected_generation = model.generate(prompt, max_new_tokens=8, do_sample=False)
    folders = {}
    for source in (model, tmp_path / "latent"):  # object and checkpoint directory
        out = folders[type(source).__name__] = tmp_path / f"export_{type(source).__name__}"
        export_pretrained(source, out)
        assert json.loads((out / "config.json").read_text())["bitnet_packed"] is True
        with safe_open(out / "model.safetensors", "pt") as f:
            q = f.get_tensor("model.layers.0.self_attn.q_proj.weight")
            experts = f.get_tensor("model.layers.1.mlp.experts.gate_up_proj")
            assert q.dtype == torch.int8 and set(q.unique().tolist()) <= {-1, 0, 1}
            assert experts.dtype == torch.int8 and experts.shape == (6, 32, 16)
            assert f.get_tensor("model.layers.1.mlp.experts.gate_up_proj_scale").shape == (6, 2)  # gate, up
            assert f.get_tensor("model.layers.1.mlp.experts.down_proj_scale").shape == (6,)
            assert f.get_tensor("model.layers.0.self_attn.q_proj.weight_scale").shape == ()
    remote = load_without_mhmoe(warm_blocked, folders, ids, prompt, tmp_path)  # trust_remote_code, mhmoe not importable
    for name in folders:
        torch.testing.assert_close(remote[f"{name}.logits"], expected, rtol=1e-6, atol=1e-6)
        assert torch.equal(remote[f"{name}.generated"], expected_generation)


def test_packed_round_trip_with_moh_and_dense_layers(tmp_path):
    """MoH attention (its router follows q_proj's dtype, int8 when packed) and a dense BitLinear MLP layer."""
    torch.manual_seed(0)
    learned = dict(moh_router="learned", moh_straight_through=False)
    model = MHMoEForCausalLM(tiny(moh_shared_heads=1, moh_active_heads=2, decoder_sparse_step=2, **learned)).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if ".head_router." in name:
                param.normal_()  # zero-initialised routers gate every head alike
    ids = torch.randint(0, 97, (2, 9))
    export_pretrained(model, tmp_path / "out")
    assert "| BitNet b1.58 | every decoder projection ternary" in (tmp_path / "out" / "README.md").read_text()
    loaded = MHMoEForCausalLM.from_pretrained(tmp_path / "out").eval()
    assert isinstance(loaded.model.layers[0].mlp.up_proj, PackedBitLinear)
    assert loaded.model.layers[0].self_attn.head_router.routed_weight.dtype == torch.float32
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids).logits, model(ids).logits, rtol=1e-6, atol=1e-6)
        prompt = ids[:1, :4]
        assert torch.equal(
            loaded.generate(prompt, max_new_tokens=6, do_sample=False),
            model.generate(prompt, max_new_tokens=6, do_sample=False),
        )


def test_official_sublayer_norms_save_load_and_pack(tmp_path):
    """The official conventions' norms (`bitnet_attention_norm="before_o_proj"`, `bitnet_ffn_norm="before_down"`):
    q/k/v and gate/up have no input norm, latent and packed checkpoints load back to the same logits."""
    torch.manual_seed(0)
    config = tiny(
        bitnet_quantized_layers="official",
        bitnet_attention_norm="before_o_proj",
        bitnet_ffn_norm="before_down",
        decoder_sparse_step=2,
    )
    model = MHMoEForCausalLM(config).eval()
    attention = model.model.layers[0].self_attn
    assert [p.input_norm is None for p in (attention.q_proj, attention.k_proj, attention.v_proj)] == [True] * 3
    assert attention.o_proj.input_norm is not None and not any("q_proj.input_norm" in k for k in model.state_dict())
    ids = torch.randint(0, 97, (2, 9))
    model.save_pretrained(tmp_path / "latent")
    packed = packed_model(model)
    assert packed.model.layers[0].self_attn.q_proj.input_norm is None
    with torch.no_grad():
        expected = model(ids).logits
        reloaded = MHMoEForCausalLM.from_pretrained(tmp_path / "latent").eval()
        torch.testing.assert_close(reloaded(ids).logits, expected, rtol=0, atol=0)
        torch.testing.assert_close(packed(ids).logits, expected, rtol=1e-6, atol=1e-6)


def test_peft_lora_on_bitnet_model(tmp_path):
    torch.manual_seed(0)
    model = MHMoEForCausalLM(tiny())
    peft_model = get_peft_model(model, lora_config(model, r=4))
    ids = torch.randint(0, 97, (2, 10))
    peft_model(ids, labels=ids).loss.backward()
    lora = {n: p for n, p in peft_model.named_parameters() if "lora_" in n}
    assert any("q_proj" in n for n in lora) and any("experts" in n for n in lora)
    assert all(p.grad is not None for p in lora.values())  # LoRA B starts at 0: A's gradient is 0, B's is not
    assert any(p.grad.abs().sum() > 0 for n, p in lora.items() if "q_proj.lora_B" in n)
    assert any(p.grad.abs().sum() > 0 for n, p in lora.items() if "experts" in n)
    assert all(p.grad is None for n, p in peft_model.named_parameters() if "lora_" not in n)  # base frozen
    with pytest.raises(ValueError, match="packed export"):
        lora_config(packed_model(MHMoEForCausalLM(tiny())))


def test_config_refuses_bad_bitnet_fields():
    with pytest.raises(ValueError, match="linear_type must be one of"):
        tiny(linear_type="bitnet")
    with pytest.raises(ValueError, match="bitnet_quantized_layers must be one of"):
        tiny(bitnet_quantized_layers="attention")
    with pytest.raises(ValueError, match="quantises nothing in a dense model"):
        tiny(bitnet_quantized_layers="experts", decoder_sparse_step=0)
    with pytest.raises(ValueError, match="bitnet_packed=True needs"):
        tiny(linear_type="linear", bitnet_packed=True)
