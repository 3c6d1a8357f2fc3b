"""TRL's `SFTTrainer` with mhmoe's auxiliary losses in the trained loss: `from mhmoe.training.sft_trainer import
SFTTrainer`, then use it exactly as `trl.SFTTrainer` (its default configuration, fused LM head included).

Why a subclass. TRL computes the loss itself: it runs the backbone, projects only the labelled positions through a
fused LM head, and, for a config with `output_router_logits`, adds Transformers' Mixtral `load_balancing_loss_func` over
the backbone's `router_logits`. For MH-MoE those logits are per sub-token (h× the tokens), which Mixtral's loss cannot
read against the (B, T) attention mask (it raises), and any other loss the model adds in its own forward (the router
z-loss, MoH's head balance loss, MH-MoE's per-layer balance convention) never reaches TRL's loss. This class turns
TRL's MoE term off and adds, to TRL's language-model loss, exactly the weighted router losses mhmoe's own forward adds
(`models/causal_lm.add_router_losses`, from the router logits recorded by hooks on the routers, the same modules the
models' `_can_record_outputs` name), scaled over gradient accumulation as TRL scales its own aux term. The unweighted
losses are logged beside TRL's metrics (`aux_loss`, `z_loss`, `moh_aux_loss`).

Plain `trl.SFTTrainer` on an mhmoe model: MoH-LLaMA trains on the language-model loss alone; MHMoE with
`output_router_logits` raises inside Mixtral's loss (h > 1); both drop mhmoe's auxiliary losses.
"""

from __future__ import annotations

import contextlib

import torch
from trl import SFTTrainer as _TRLSFTTrainer

from ..models.causal_lm import add_router_losses
from ..models.mhmoe.sparse_moe import MHMoETopKRouter
from ..models.moh.head_routers import MoHRouter

RECORDED = {"router_logits": (MHMoETopKRouter, 0), "moh_router_logits": (MoHRouter, 1)}  # as _can_record_outputs


@contextlib.contextmanager
def recorded_router_logits(model: torch.nn.Module):
    """{"router_logits": [...], "moh_router_logits": [...]}: each router's logits, layer by layer, while the block
    runs (whatever flags the forward gets)."""
    recorded: dict[str, list] = {key: [] for key in RECORDED}
    hooks = []
    for module in model.modules():
        for key, (cls, index) in RECORDED.items():
            if isinstance(module, cls):
                hooks.append(module.register_forward_hook(lambda m, a, out, k=key, i=index: recorded[k].append(out[i])))
    try:
        yield recorded
    finally:
        for hook in hooks:
            hook.remove()


class SFTTrainer(_TRLSFTTrainer):
    """`trl.SFTTrainer` whose trained loss is TRL's language-model loss + mhmoe's weighted router losses."""

    def __init__(self, model, *args, **kwargs):
        super().__init__(model, *args, **kwargs)
        self._mhmoe_config = self.accelerator.unwrap_model(self.model).config.get_text_config()
        # TRL's Mixtral balance term off: the model's own losses replace it (module docstring)
        self.aux_loss_enabled = False
        if hasattr(self._mhmoe_config, "output_router_logits"):
            self._output_router_logits = self._mhmoe_config.output_router_logits
            self._mhmoe_config.output_router_logits = False

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        mode = "train" if self.model.training else "eval"
        with recorded_router_logits(model) as recorded:
            loss, outputs = super().compute_loss(
                model, inputs, return_outputs=True, num_items_in_batch=num_items_in_batch
            )
        logits = tuple(recorded["router_logits"]) or None, tuple(recorded["moh_router_logits"]) or None
        weighted, losses = add_router_losses(
            loss.new_zeros(()), self._mhmoe_config, inputs.get("attention_mask"), *logits
        )
        # like TRL's own aux term: a per-micro-batch mean, averaged over the accumulation steps
        steps = self.current_gradient_accumulation_steps if num_items_in_batch is not None else 1
        loss = loss + weighted / steps
        for name, value in losses.items():
            if value is not None:
                self._metrics[mode][name].append(self.accelerator.gather_for_metrics(value.detach()).mean().item())
        return (loss, outputs) if return_outputs else loss

    def train(self, *args, **kwargs):
        try:
            return super().train(*args, **kwargs)
        finally:  # the saved config keeps what the user set
            if hasattr(self, "_output_router_logits"):
                self._mhmoe_config.output_router_logits = self._output_router_logits


__all__ = ["SFTTrainer", "recorded_router_logits"]
