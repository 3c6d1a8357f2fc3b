"""Router gates: which top-k weights are renormalised (Switch / official MH-MoE at k=1, Mixtral always)."""

import pytest
import torch

from mhmoe import MHMoEConfig, MHMoEForCausalLM
from mhmoe.models.ops.backends import route


@pytest.mark.parametrize("top_k", [1, 2, 3])
@pytest.mark.parametrize("norm", [True, "always", False])
def test_route_weights_follow_the_setting(top_k, norm):
    logits = torch.randn(7, 5)
    probs = torch.softmax(logits, -1)
    weights, experts = route(logits, top_k, norm)
    raw = torch.gather(probs, 1, experts)  # the router probabilities of the chosen experts
    torch.testing.assert_close(raw, torch.topk(probs, top_k).values)
    renormalised = norm == "always" or (norm is True and top_k > 1)
    expected = raw / raw.sum(-1, keepdim=True) if renormalised else raw
    torch.testing.assert_close(weights, expected)
    if top_k == 1 and norm is True:  # Switch: the raw top-1 probability, not p/p = 1
        assert (weights < 1).all()


def _router_grad(norm_topk_prob, top_k):
    torch.manual_seed(0)
    config = MHMoEConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_experts=4,
        num_experts_per_tok=top_k,
        moe_intermediate_size=16,
        norm_topk_prob=norm_topk_prob,
        initializer_range=0.2,
    )
    model = MHMoEForCausalLM(config)
    ids = torch.randint(0, 64, (2, 12))
    model(input_ids=ids, labels=ids).loss.backward()  # the LM loss alone: no aux loss requested
    return model.model.layers[0].mlp.gate.weight.grad.norm().item()


def test_top1_router_learns_from_the_lm_loss():
    """With the default norm_topk_prob=True, a top-1 router gets a gradient from the LM loss (through its raw gate);
    Mixtral's renormalisation ("always") makes every top-1 gate 1 and leaves it none."""
    assert _router_grad(True, 1) > 1e-4
    assert _router_grad("always", 1) < 1e-7
    assert _router_grad(True, 2) > 1e-4


@pytest.mark.parametrize("renormalise", [True, False])
@pytest.mark.parametrize("shape", [(13, 5, 1), (13, 5, 2), (7, 9, 4), (1, 3, 3)])
def test_weights_backward_in_closed_form_is_autograds(shape, renormalise):
    """routing_naive.route_weights_backward (the kernels' reference inside traced graphs) gives the gradient autograd
    takes through `route`'s softmax, top-k and renormalisation, for an arbitrary weights' gradient."""
    from mhmoe.models.ops.routing.routing_naive import route as naive_route
    from mhmoe.models.ops.routing.routing_naive import route_weights_backward

    num_rows, num_experts, top_k = shape
    generator = torch.Generator().manual_seed(sum(shape))
    logits = (torch.randn(num_rows, num_experts, generator=generator) * 2).double().requires_grad_()
    grad_weights = torch.randn(num_rows, top_k, generator=generator).double()
    weights, experts = naive_route(logits, top_k, "always" if renormalise else False)
    (expected,) = torch.autograd.grad(weights, logits, grad_weights)
    got = route_weights_backward(logits.detach(), experts, grad_weights, renormalise)
    assert got.dtype == logits.dtype
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)
