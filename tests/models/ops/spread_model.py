"""The tiny MHMoE model the kernel tests run end to end: seeded, then every parameter drawn from N(0, 0.3) so that
routing is far from uniform and ties are unlikely."""

import torch

from mhmoe import MHMoEForCausalLM


def spread_model(config) -> MHMoEForCausalLM:
    torch.manual_seed(0)
    model = MHMoEForCausalLM(config)
    with torch.no_grad():
        for param in model.parameters():
            param.normal_(0, 0.3)
    return model
