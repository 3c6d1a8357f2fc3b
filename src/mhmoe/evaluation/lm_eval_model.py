"""The lm-eval model `mhmoe` (`MHMoELM`): lm-eval's `HFLM` for mhmoe checkpoints, with routing statistics.

`MHMoELM` loads checkpoints of every model type mhmoe registers through the Auto classes. It takes HFLM's model_args
(`pretrained`, `dtype`, `peft`, `batch_size`, `max_length`, ...) plus `routing_stats` (default true), and adds to
`results["config"]` `routing_statistics`: per MoE layer the expert load entropy and max-load ratio over the evaluated
tokens (padding excluded), averaged over layers, and MoH activated heads % from every MoH head router (`MoHRouter`,
whose first output is the (B, T, H) gates).

lm-eval finds models only in modules that are imported (no entry points), so plain `lm-eval --model mhmoe` does not
work; use `mhmoe-eval` (`cli.py`), or `import mhmoe.evaluation.lm_eval_model` before calling `lm_eval.simple_evaluate`. A
checkpoint exported with its modeling code (`mhmoe.hub.export.export_pretrained`, `mhmoe-export`) also runs with plain
lm-eval and no mhmoe installed: `lm-eval run --model hf --model_args pretrained=DIR,trust_remote_code=True` (without
routing statistics).
"""

from __future__ import annotations

import contextlib

from .._plumbing.extras import require

require("eval", "lm_eval", feature="mhmoe.evaluation")

from lm_eval.api.registry import register_model
from lm_eval.models import huggingface as _hf_module
from lm_eval.models.huggingface import HFLM

from .analysis import RoutingStatistics

ROUTING_KEY = "routing_statistics"

_ACTIVE: dict = {}  # the most recently built MHMoELM's tokenizer, for the perplexity tasks' token counts


def active_tokenizer():
    """The tokenizer of the most recently built `mhmoe` lm-eval model in this process (or None)."""
    return _ACTIVE.get("tokenizer")


@contextlib.contextmanager
def _recording_padding(stats: RoutingStatistics | None):
    """Let the statistics see the real lengths of HFLM's right-padded loglikelihood batches.

    HFLM calls the model on zero-padded rows without an attention mask; causal outputs of real tokens do not depend on
    the padding, but the routers still route it. HFLM pads through its module-level `pad_and_concat`, which this
    wraps for the duration of one `_loglikelihood_tokens` call to record the lengths. If lm-eval stops padding this
    way, statistics simply include padding (as with any batch of unequal lengths).
    """
    original = getattr(_hf_module, "pad_and_concat", None)
    if stats is None or original is None:
        yield
        return

    def recording(max_length, tensors, padding_side="right"):
        stats.pending_lengths = [int(t.shape[-1]) for t in tensors] if padding_side == "right" else None
        return original(max_length, tensors, padding_side=padding_side)

    _hf_module.pad_and_concat = recording
    try:
        yield
    finally:
        _hf_module.pad_and_concat = original


def _as_bool(value) -> bool:
    if isinstance(value, str):
        return value.strip().lower() in ("1", "true", "yes", "on")
    return bool(value)


class MHMoELM(HFLM):
    """lm-eval's HFLM for mhmoe checkpoints (any model type `import mhmoe` registers), with routing statistics.

    Model args: everything HFLM takes (`pretrained`, `dtype`, `peft`, `batch_size`, `max_length`, `device`, ...);
    `backend` defaults to "causal" (mhmoe model types are not in Transformers' static causal-LM list);
    `routing_stats=false` turns the forward hooks off; `trust_remote_code` (default false: code a checkpoint folder names
    is never run) is passed to Transformers.
    """

    def __init__(
        self,
        pretrained,
        backend: str = "causal",
        routing_stats: bool | str = True,
        trust_remote_code: bool | str = False,
        **kwargs,
    ):
        trust = _as_bool(trust_remote_code)
        super().__init__(pretrained=pretrained, backend=backend, trust_remote_code=trust, **kwargs)
        self.routing = RoutingStatistics(self.model) if _as_bool(routing_stats) else None
        _ACTIVE["tokenizer"] = self.tokenizer

    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, override_bs: int | None = None):
        with _recording_padding(self.routing):
            return super()._loglikelihood_tokens(requests, disable_tqdm=disable_tqdm, override_bs=override_bs)

    def _detect_batch_size(self, requests=None, pos: int = 0):
        # the probe batches are not evaluation data
        with self.routing.paused() if self.routing is not None else contextlib.nullcontext():
            return super()._detect_batch_size(requests, pos)

    def routing_summary(self, reset: bool = False) -> dict:
        if self.routing is None:
            return {}
        summary = self.routing.summary()
        if reset:
            self.routing.reset()
        return summary

    def get_model_info(self) -> dict:
        """HFLM's model info plus the routing statistics of this evaluation (counters restart afterwards, so each
        `simple_evaluate` call reports its own)."""
        info = super().get_model_info()
        if self.routing is not None:
            info[ROUTING_KEY] = self.routing_summary(reset=True)
        return info


register_model("mhmoe")(MHMoELM)


__all__ = ["MHMoELM", "ROUTING_KEY", "active_tokenizer"]
