"""Check a converted checkpoint against its dense source: with every head active it must compute the same logits.

`verify_conversion(source_dir, converted_dir)` loads the source and the converted model one after the other (peak
memory about one model) and compares them on a probe batch: the converted model with every head active must reproduce
the source's logits; with routing on, the logit and perplexity change is reported. The same loads measure the held-out
perplexity of both models (heldout.py; a half-precision model of up to 1B parameters is run in float32 for it, which
holds its float32 copy too). `all_heads_active(model)` is the
switch it uses (continue-tuning uses it too, to measure the dense parent at step 0).
"""

from __future__ import annotations

import contextlib
import math

from .errors import ConversionError

_PROBE_TEXT = (
    "The quick brown fox jumps over the lazy dog. A language model predicts the next token from the ones before it; "
    "multi-head attention lets every head look at the context in its own way. Mixture-of-Head attention treats the "
    "heads as experts: each token uses the shared heads and a few routed heads chosen by a router. def add(a, b):\n"
    "    return a + b\n\nfor i in range(10):\n    print(i, add(i, i))\n"
)


def moh_routers(model) -> list:
    """The MoH head routers of `model` (a MoH-LLaMA, PeftModel or DDP wrapper of one), layer 0 first."""
    return [m.head_router for m in model.modules() if getattr(m, "head_router", None) is not None]


@contextlib.contextmanager
def all_heads_active(model):
    """Every MoH head router of `model` (a MoH-LLaMA, PeftModel or DDP wrapper of one) activates all its routed heads
    inside the block: with straight-through gates the model then computes the dense parent exactly."""
    routers = moh_routers(model)
    saved = [(r.active_heads, r.threshold) for r in routers]
    try:
        for router in routers:
            router.active_heads, router.threshold = router.routed_heads, None  # top-R: every head
        yield model
    finally:
        for router, (active, threshold) in zip(routers, saved):
            router.active_heads, router.threshold = active, threshold


def read_probe(path: str | None) -> str | None:
    """The text of --probe_file (None: the built-in probe text)."""
    if path is None:
        return None
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
        if not text.strip():
            raise ConversionError(
                f"--probe_file {path} holds no text (the logit check needs some; leave --probe_file "
                "out for the built-in probe)"
            )
        return text
    except OSError as e:
        raise ConversionError(f"--probe_file {path}: {e.strerror or e}") from None
    except UnicodeDecodeError as e:  # a binary file: the codec's message names neither the file nor the fix
        raise ConversionError(
            f"--probe_file {path} is not UTF-8 text ({e.reason} at byte {e.start}); give a text file"
        ) from None


def _probe_ids(
    directory: str, config, probe_text: str | None, rows: int = 2, length: int = 64, trust_remote_code: bool = False
):
    import torch

    length = min(length, config.max_position_embeddings)
    try:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(directory, trust_remote_code=trust_remote_code)
        text = probe_text or _PROBE_TEXT
        ids = tokenizer(text, add_special_tokens=False, verbose=False)["input_ids"]
        if ids and max(ids) < config.vocab_size:
            while len(ids) < rows * length:
                ids = ids + ids
            return torch.tensor(ids[: rows * length]).view(rows, length), "tokenized text"
    except (OSError, ValueError, TypeError, KeyError):
        pass
    generator = torch.Generator().manual_seed(0)
    return torch.randint(0, config.vocab_size, (rows, length), generator=generator), "random token ids"


def _refuse_non_finite(model, source_dir: str) -> None:
    """NaN or inf in the source's weights: said in words (the logit check would only find NaN differences)."""
    import torch

    bad = [name for name, t in model.state_dict().items() if t.is_floating_point() and not torch.isfinite(t).all()]
    if bad:
        raise ConversionError(
            f"the source checkpoint {source_dir} has NaN or inf values in {len(bad)} tensor(s) ({', '.join(bad[:3])}"
            f"{', ...' if len(bad) > 3 else ''}): a corrupt or diverged model; fix the source (with "
            "--skip_logit_check it is converted unchecked, as it is)"
        )


def verify_conversion(
    source_dir: str,
    converted_dir: str,
    probe_text: str | None = None,
    trust_remote_code: bool = False,
    heldout=None,
) -> dict:
    """Load the source, then the converted model (one at a time, checkpoint dtype, CPU) and compare on a probe batch.

    Returns `all_heads_max_abs_diff` (converted with every head active vs source; must be ~0), `all_heads_equal`,
    and with routing on: `routed_max_abs_diff`, `routed_mean_abs_diff`, `routed_top1_agreement`, `source_probe_ppl`,
    `routed_probe_ppl`. `heldout` (heldout.py's `HeldOut`): each model, while loaded, is also run over the held-out
    tokens (the converted one with routing on).
    """
    import gc

    import torch
    import torch.nn.functional as F
    from transformers import AutoModelForCausalLM

    from ..models.moh_llama import MoHLlamaForCausalLM

    def nll(logits, ids):
        return F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1)).item()

    source = AutoModelForCausalLM.from_pretrained(source_dir, dtype="auto", trust_remote_code=False).eval()
    _refuse_non_finite(source, source_dir)
    ids, probe_kind = _probe_ids(source_dir, source.config, probe_text, trust_remote_code=trust_remote_code)
    with torch.no_grad():
        reference = source(ids).logits.float()
    dtype = next(source.parameters()).dtype
    if heldout is not None:  # last: it may leave the model in float32
        heldout.measure(source, "parent")
    del source
    gc.collect()

    converted, info = MoHLlamaForCausalLM.from_pretrained(
        converted_dir, dtype="auto", output_loading_info=True, trust_remote_code=False
    )
    converted.eval()
    problems = {k: v for k, v in info.items() if v and k in ("missing_keys", "unexpected_keys", "mismatched_keys")}
    if problems:
        raise ConversionError(f"the converted checkpoint does not load cleanly: {problems}")
    with torch.no_grad():
        with all_heads_active(converted):
            dense = converted(ids).logits.float()
        routed = converted(ids).logits.float()
    if heldout is not None:  # last: it may leave the model in float32
        heldout.measure(converted, "converted")
    del converted
    gc.collect()
    scale = max(1.0, reference.abs().max().item())
    tolerance = (1e-5 if dtype in (torch.float32, torch.float64) else 2e-2) * scale
    diff = (dense - reference).abs().max().item()
    return {
        "probe": f"{ids.shape[0]}×{ids.shape[1]} {probe_kind}",
        "dtype": str(dtype).removeprefix("torch."),
        "all_heads_max_abs_diff": diff,
        "all_heads_tolerance": tolerance,
        "all_heads_equal": diff <= tolerance,
        "source_logits_finite": bool(torch.isfinite(reference).all()),
        "routed_max_abs_diff": (routed - reference).abs().max().item(),
        "routed_mean_abs_diff": (routed - reference).abs().mean().item(),
        "routed_top1_agreement": (routed.argmax(-1) == reference.argmax(-1)).float().mean().item(),
        "source_probe_ppl": math.exp(min(nll(reference, ids), 50.0)),
        "routed_probe_ppl": math.exp(min(nll(routed, ids), 50.0)),
    }


def verified(
    source_dir: str,
    converted_dir: str,
    probe_text: str | None = None,
    trust_remote_code: bool = False,
    heldout=None,
) -> dict:
    """`verify_conversion`, refusing a converted model that with every head active is not its source."""
    verification = verify_conversion(source_dir, converted_dir, probe_text, trust_remote_code, heldout)
    if not verification["source_logits_finite"]:
        raise ConversionError(
            f"verification failed: the source model's own logits on the probe are not finite (NaN or inf) in "
            f"{verification['dtype']} although its weights are; check the source (or pass --skip_logit_check)"
        )
    if math.isnan(verification["all_heads_max_abs_diff"]):
        raise ConversionError(
            "verification failed: with every head active the converted model's logits are not finite (NaN) where the "
            "source's are; the converted checkpoint does not compute its source"
        )
    if not verification["all_heads_equal"]:
        raise ConversionError(
            f"verification failed: with every head active the converted model's logits differ from the "
            f"source's by {verification['all_heads_max_abs_diff']:.3g} (tolerance "
            f"{verification['all_heads_tolerance']:.3g})"
        )
    return verification
