"""Recovery by distillation: continue-tune the converted MoH model against its dense parent's logits.

The parent is the converted model itself with every head active (a frozen copy; with 0/1 gates that is the dense
source, as the converter verified), on the same device. `Distillation.attach(model)`
hooks the model's forward: in training mode the loss becomes

    loss = weight · T² · KL(softmax(parent / T) ‖ softmax(model / T)) + (1 − weight) · LM loss + (MoH balance loss)

and the output also carries `distill_kl_loss` (logged by mhmoe.training next to `lm_loss`). Evaluation (eval mode) is
untouched. The cost is one parent forward per micro-batch (no backward) and one more copy of the weights.
"""

from __future__ import annotations

import copy
import time
from dataclasses import dataclass, field

from .errors import ConversionError


def dense_parent(model):
    """A frozen copy of a MoH model with every routed head active: the dense parent (eval mode, no gradients)."""
    parent = copy.deepcopy(model)
    for module in parent.modules():
        router = getattr(module, "head_router", None)
        if router is not None:
            router.active_heads, router.threshold = router.routed_heads, None  # top-R: every head
    parent.eval()
    for param in parent.parameters():
        param.requires_grad_(False)
    return parent


def distillation_loss(student_logits, parent_logits, input_ids, temperature: float, weight: float):
    """(mixed loss, T²·KL, LM loss) over next-token positions, KL(parent ‖ student) at `temperature`, fp32."""
    import torch.nn.functional as F

    s = student_logits[:, :-1].float()
    t = parent_logits[:, :-1].float()
    vocab = s.shape[-1]
    lm = F.cross_entropy(s.reshape(-1, vocab), input_ids[:, 1:].reshape(-1))
    log_p_s = F.log_softmax(s / temperature, dim=-1).reshape(-1, vocab)
    log_p_t = F.log_softmax(t / temperature, dim=-1).reshape(-1, vocab)
    kl = F.kl_div(log_p_s, log_p_t, log_target=True, reduction="batchmean") * temperature**2
    return weight * kl + (1 - weight) * lm, kl, lm


@dataclass
class Distillation:
    temperature: float = 2.0
    weight: float = 0.5
    parent_seconds: float = 0.0
    steps: int = 0
    parent_bytes: int = 0
    _parent: object = field(default=None, repr=False)

    def __post_init__(self):
        if not self.temperature > 0:
            raise ConversionError(f"--distill_temperature must be > 0, got {self.temperature}")
        if not 0 <= self.weight <= 1:
            raise ConversionError(f"--distill_weight must be in [0, 1], got {self.weight}")

    def attach(self, model):
        """Make the parent from `model` (before training) and hook `model`'s forward; returns the hook handle."""
        self._parent = dense_parent(model)
        self.parent_bytes = sum(p.numel() * p.element_size() for p in self._parent.parameters())
        return model.register_forward_hook(self._hook, with_kwargs=True)

    def _hook(self, module, args, kwargs, output):
        import torch

        input_ids = kwargs.get("input_ids", args[0] if args else None)
        if not module.training or input_ids is None or getattr(output, "logits", None) is None:
            return output
        parent = self._parent
        if next(parent.parameters()).device != input_ids.device:
            parent.to(input_ids.device)
        start = time.perf_counter()
        with torch.no_grad():
            parent_logits = parent(input_ids=input_ids).logits
        self.parent_seconds += time.perf_counter() - start
        self.steps += 1
        mixed, kl, lm = distillation_loss(output.logits, parent_logits, input_ids, self.temperature, self.weight)
        balance = output.get("moh_aux_loss")  # weighted into output.loss by the model: kept
        if balance is not None:
            mixed = mixed + module.config.moh_aux_loss_coef * balance.to(mixed.device)
        output["loss"] = mixed
        output["distill_kl_loss"] = kl.detach()
        return output

    def record(self) -> dict:
        return {
            "temperature": self.temperature,
            "weight": self.weight,
            "loss": "weight * T^2 * KL(parent || model) + (1 - weight) * LM loss (+ MoH balance loss)",
            "parent": "frozen copy of the converted model with every head active (the dense source), same device",
            "parent_memory_bytes": self.parent_bytes,
            "parent_forward_seconds": round(self.parent_seconds, 3),
            "parent_forwards": self.steps,
        }


__all__ = ["Distillation", "dense_parent", "distillation_loss"]
