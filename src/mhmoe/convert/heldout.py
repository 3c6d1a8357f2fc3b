"""The conversion's held-out quality figure: the perplexity of the converted model (routing on) over its parent's on
the part of the calibration text that calibration never reads.

`held_out(source_dir, calibration_file, calibration_tokens, ...)` tokenizes the calibration text as calibration does
(calibrate.py) and keeps the tokens after the ones calibration reads (`calibrate.split_tokens`: up to
`HELDOUT_TOKENS`, fewer for a short text). The logit check (verify.py) runs each model over them while it has it loaded
(`HeldOut.measure`), so the figure costs two forwards of a few thousand tokens and no extra load. `HeldOut.record()` is
moh_conversion.json's "heldout", which the card and the report state; `heldout_line` is the report's line.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

HELDOUT_BLOCK = 512  # tokens per row (capped by the model's positions); a shorter last row takes the rest
_LOGITS_PER_BATCH = 2**25  # rows per forward: at most this many logits (128 MB in float32)
# a half-precision model on CPU whose float32 weights fit in this is measured in float32 (bfloat16 matmuls on CPUs
# without bfloat16 instructions were 4x slower: 120 s against 30 s for 4,096 tokens of a SmolLM2-135M-sized model)
UPCAST_BYTES = 4 * 2**30


@dataclass
class HeldOut:
    """The held-out token ids of the calibration text `text` (its label) and, once measured, each model's summed
    next-token negative log-likelihood over them."""

    ids: list[int]
    text: str
    calibration_tokens: int  # the text's first tokens, which calibration reads (when the recipe calibrates)
    text_tokens: int
    block: int = HELDOUT_BLOCK
    nll: dict = field(default_factory=dict)  # "parent" / "converted" -> (sum, predicted tokens)
    seconds: float = 0.0  # the forwards' time, both models
    dtype: str | None = None  # what the forwards ran in, when not the checkpoint's dtype

    def rows(self) -> list[list[int]]:
        """The ids cut into rows of `block` tokens; a last, shorter row of at least 2 tokens is kept."""
        rows = [self.ids[i : i + self.block] for i in range(0, len(self.ids), self.block)]
        return [row for row in rows if len(row) >= 2]

    def measure(self, model, which: str) -> None:
        """Sum `model`'s next-token NLL over the held-out rows (batches of equal rows, no gradient) as `which`. A
        half-precision model on CPU whose float32 weights take at most `UPCAST_BYTES` is turned into float32 in place
        first (measure it last)."""
        import time

        import torch
        import torch.nn.functional as F

        started, total, count = time.perf_counter(), 0.0, 0
        dtype = next(model.parameters()).dtype
        small = 4 * sum(p.numel() for p in model.parameters()) <= UPCAST_BYTES
        if dtype in (torch.bfloat16, torch.float16) and model.device.type == "cpu" and small:
            model.float()
            self.dtype = f"float32 (weights upcast from {str(dtype).removeprefix('torch.')})"
        rows = self.rows()
        full = [row for row in rows if len(row) == self.block]
        batch = max(1, _LOGITS_PER_BATCH // (self.block * model.config.vocab_size))
        groups = [full[i : i + batch] for i in range(0, len(full), batch)]
        if len(rows) > len(full):
            groups.append(rows[len(full) :])  # the shorter last row
        with torch.no_grad():
            for group in groups:
                ids = torch.tensor(group, device=model.device)
                logits = model(ids).logits[:, :-1].float()
                total += F.cross_entropy(
                    logits.reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1), reduction="sum"
                ).item()
                count += ids[:, 1:].numel()
        self.nll[which] = (total, count)
        self.seconds += time.perf_counter() - started

    def record(self, dtype: str, calibrated: bool = True) -> dict:
        """moh_conversion.json's "heldout" (both models measured); `calibrated`: whether the recipe read the
        calibration tokens before them."""
        (parent, count), (converted, _) = self.nll["parent"], self.nll["converted"]
        parent_ppl, converted_ppl = math.exp(min(parent / count, 50.0)), math.exp(min(converted / count, 50.0))
        return {
            "text": self.text,
            "tokens": len(self.ids),
            "predicted_tokens": count,
            "block": self.block,
            "split": f"tokens {self.calibration_tokens:,} to {self.calibration_tokens + len(self.ids):,} of the "
            f"calibration text's {self.text_tokens:,}; "
            + (
                f"calibration reads only the first {self.calibration_tokens:,}"
                if calibrated
                else "this recipe reads no calibration text"
            ),
            "parent_ppl": parent_ppl,
            "converted_ppl": converted_ppl,
            "ratio": converted_ppl / parent_ppl,
            "dtype": self.dtype or dtype,
            "seconds": round(self.seconds, 3),
        }


def held_out(
    source_dir: str,
    vocab_size: int,
    positions: int,
    calibration_file: str | None,
    calibration_tokens: int,
    trust_remote_code: bool = False,
) -> HeldOut | str:
    """The held-out part of the calibration text for the source in `source_dir`, or why there is none (a string):
    no usable tokenizer, or a text too short to hold any out."""
    from .._plumbing.trust import load_tokenizer
    from .calibrate import read_calibration, split_tokens, text_ids
    from .errors import ConversionError

    text, label = read_calibration(calibration_file)
    try:
        tokenizer = load_tokenizer(source_dir, ConversionError, trust_remote_code)
        ids = text_ids(tokenizer, text)
    except (OSError, ValueError, TypeError, KeyError, ConversionError) as e:
        return f"the source has no usable tokenizer ({type(e).__name__})"
    used, count = split_tokens(len(ids), max(calibration_tokens, 2))
    heldout = ids[used : used + count]
    if len(heldout) < 2:
        return f"the calibration text ({label}, {len(ids):,} tokens) is too short to hold any out"
    if max(heldout) >= vocab_size:
        return "the source's tokenizer gives token ids beyond the model's vocabulary"
    return HeldOut(heldout, label, used, len(ids), block=min(HELDOUT_BLOCK, positions))


def heldout_line(heldout: dict) -> str:
    """The conversion report's line on the held-out perplexity (moh_conversion.json's "heldout")."""
    if "skipped" in heldout:
        return f"  held-out perplexity: not measured ({heldout['skipped']})"
    h = heldout
    return (
        f"  held-out perplexity ({h['tokens']:,} tokens of {h['text']} not used for calibration, routing on): "
        f"parent {h['parent_ppl']:.3f} -> converted {h['converted_ppl']:.3f} = ×{h['ratio']:.3f} the parent's"
    )


__all__ = ["HELDOUT_BLOCK", "HeldOut", "held_out", "heldout_line"]
