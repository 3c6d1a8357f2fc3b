"""What a converted model's card says about its conversion, from mhmoe-convert's moh_conversion.json.

`parent_names` is how the converter names the dense parent in the record and the card: the Hub id the user gave
(`--base_model`), found in a Hugging Face cache snapshot's path or in the source's config.json (`_name_or_path`), else
the GGUF file's name; never a local path or folder name. `conversion_text` is the card's paragraph on the conversion
(the router actually written: `l2`, `l2_standardized`, `l2_relative`, or the learned router with W_r fitted),
`quality_text` its held-out perplexity against the parent, and `conversion_rows` the architecture table's rows (recipe,
calibration, router fit with its poorly fitted layers, held-out perplexity, logit check, speed). `cards.py` fills the
template with them. Nothing here needs the network or torch.
"""

from __future__ import annotations

import json
import os
import re

_HUB_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*/[A-Za-z0-9][A-Za-z0-9_.-]*$")  # ORG/NAME
_HUB_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")  # NAME (a model without an organisation)

ROUTER_WORDS = {
    "l2": "a parameter-free router scores each routed head by its pre-RoPE query norm (the paper's `l2` router)",
    "l2_standardized": "a parameter-free router scores each routed head by its pre-RoPE query norm minus the head's "
    "mean on calibration text, over its std there (`l2_standardized`; the statistics are in config.json)",
    "l2_relative": "a parameter-free router scores each routed head by its pre-RoPE query norm over the head's mean "
    "on calibration text (`l2_relative`; the means are in config.json)",
    "learned": "the paper's learned router scores the routed heads from the attention's input (W_r x)",
}


def hub_id(value, single: bool = False) -> bool:
    """Whether `value` reads as a Hugging Face Hub model id: ORG/NAME (with `single`, also a bare NAME); no path
    syntax (no leading / . ~, no `..`, no second slash)."""
    if not isinstance(value, str) or ".." in value or len(value) > 200:
        return False
    return bool(_HUB_ID.match(value) or (single and _HUB_NAME.match(value)))


def _snapshot_repo(input_dir: str) -> str | None:
    """The Hub repo id of a Hugging Face cache snapshot (`.../models--org--name/snapshots/REV` -> `org/name`)."""
    path = os.path.abspath(input_dir)
    snapshots = os.path.dirname(path)
    repo = os.path.basename(os.path.dirname(snapshots))
    if os.path.basename(snapshots) == "snapshots" and repo.startswith("models--"):
        return repo.removeprefix("models--").replace("--", "/")
    return None


def _config_hub_id(config_dir: str) -> str | None:
    """The source's config.json `_name_or_path` when it is a Hub id (ORG/NAME): what the folder was saved from."""
    try:
        with open(os.path.join(config_dir, "config.json"), encoding="utf-8") as f:
            name = json.load(f).get("_name_or_path")
    except (OSError, ValueError, AttributeError):
        return None
    return name if hub_id(name) else None


def parent_names(
    input_dir: str, gguf_file: str | None = None, base_model: str | None = None, config_dir: str | None = None
) -> dict:
    """{"base_model": the parent's Hub id or None, "input_dir": the name the card and moh_conversion.json give it}:
    `base_model` (the user's `--base_model`), else a Hugging Face cache snapshot's repo id, else a Hub id in the
    source's config.json `_name_or_path` (read in `config_dir`, default `input_dir`: the converter passes its checked
    copy); without one, the GGUF file's name, or None (a local folder: its name or path is never published)."""
    found = base_model or _snapshot_repo(input_dir) or _config_hub_id(config_dir or input_dir)
    return {"base_model": found, "input_dir": found or gguf_file}


def base_model_name(input_dir: str) -> str:
    """A local folder as results name it: the Hub repo id of a Hugging Face cache snapshot (`.../models--org--name/
    snapshots/REV` -> `org/name`), else the folder's name (never the local path). The converter names its parent by
    `parent_names` instead."""
    return _snapshot_repo(input_dir) or os.path.basename(os.path.abspath(input_dir))


def public_paths(input_dir: str, output_dir: str) -> dict:
    """What an older moh_conversion.json, which kept the absolute paths of its folders, keeps of them when exported
    (`base_model_name`: a Hub repo id or the folder's name)."""
    return {"input_dir": base_model_name(input_dir), "output_dir": os.path.basename(os.path.abspath(output_dir))}


def recorded_base_model(record: dict) -> str | None:
    """The card's `base_model` of a conversion record: its Hub id (None: not a Hub model); an older record's
    `input_dir` (a name, or an absolute local path: its `base_model_name`)."""
    if "base_model" in record:
        return record["base_model"]
    input_dir = record.get("input_dir")
    return base_model_name(input_dir) if isinstance(input_dir, str) and os.path.isabs(input_dir) else input_dir


def parent_text(base_model: str | None, conversion: dict | None) -> str:
    """How the card's text names the parent: its Hub id or GGUF file name, or a local checkpoint without one."""
    name = (conversion or {}).get("input_dir") if "base_model" in (conversion or {}) else base_model
    if name:
        return f"the dense checkpoint `{name}`"
    return "a local dense checkpoint (no Hub id given: `mhmoe-convert --base_model ORG/NAME` names it)"


def router_text(config, conversion: dict | None = None, tuned: bool = False) -> str:
    """The router the model has (config.json), in words: its score, how many routed heads a token takes, its gates;
    `conversion` says whether W_r was fitted, `tuned` whether continue-tuning trained it since."""
    router = getattr(config, "moh_router", "l2")
    words = ROUTER_WORDS.get(router, f"the `{router}` router scores the routed heads")
    if router == "learned" and (conversion or {}).get("router_fit"):
        words += (
            ", with W_r fitted on calibration text by a ridge regression instead of trained, and W_s and W_h zero "
            "(the shared heads' gates and the two stages' weights are 1)"
        ) + ("; continue-tuning then trained them with the rest of the model" if tuned else "")
    if getattr(config, "moh_head_thresholds", None) is not None:
        pick = "each token takes the routed heads whose score exceeds the layer's calibrated threshold"
    else:
        pick = "each token takes its top-scoring routed heads (how many per layer: the table)"
    if getattr(config, "moh_straight_through", True):
        gates = "0/1 gates in the forward pass and straight-through gradients"
    else:
        gates = "soft gates (the selected heads' outputs weighted by their router scores)"
    return f"{words}; {pick}, with {gates}"


def conversion_text(config, base_model: str | None, conversion: dict | None, tuned: bool = False) -> str:
    """The card's paragraph on the conversion: the parent, the router written, the weights."""
    added = (
        ", plus the learned router's weights"
        if getattr(config, "moh_router", "l2") == "learned"
        else " (the router adds no parameters)"
    )
    return (
        f"Converted from {parent_text(base_model, conversion)} with `mhmoe-convert` (MoH paper §4.4): per layer some "
        f"heads are shared (always on) and {router_text(config, conversion, tuned)}. The conversion recipe (which "
        "heads are shared, how routed heads are scored) is in the table below. The state dict is the dense model's "
        f"(heads possibly permuted within their key/value groups, which computes the same function){added}."
    )


def quality_text(conversion: dict | None, tuned: bool = False) -> str:
    """The card's sentence on the conversion's held-out perplexity against its parent (moh_conversion.json's
    "heldout"); empty for a record without one."""
    h = (conversion or {}).get("heldout")
    when = "At conversion (before continue-tuning)" if tuned else "At conversion"
    if not isinstance(h, dict):
        return ""
    if "skipped" in h:
        return f"{when} no held-out perplexity was measured ({h['skipped']})."
    try:
        return (
            f"{when}, on {h['tokens']:,} held-out tokens of {h['text']} (calibration text the conversion did not "
            f"calibrate on), its perplexity with routing on was ×{h['ratio']:.3f} its parent's ({h['converted_ppl']:.3f} "
            f"vs {h['parent_ppl']:.3f}, {h['dtype']})."
        )
    except (KeyError, TypeError, ValueError):  # a partial record
        return ""


def probe_change(before: float, after: float) -> str:
    """The logit check's probe perplexity change with routing on, in words (the report's line)."""
    ratio = after / before if before else float("inf")
    if f"{ratio:.2f}" == "1.00":
        return f"×{ratio:.3f}: about the same with routing on"
    if ratio > 1:
        return f"×{ratio:.2f}: higher with routing on; continue-tuning recovers it"
    return f"×{ratio:.2f}: lower with routing on, on this short probe"


def poor_fit_layers(r2) -> list[tuple[int, float]]:
    """(layer, R²) of the layers whose router fit is worse than a constant score (R² < 0)."""
    return [(i, v) for i, v in enumerate(r2 or []) if v < 0]


def fit_words(r2: list[float]) -> str:
    """The router fit's R² per layer in words: range, median and every poorly fitted layer by index."""
    ordered = sorted(r2 or [0.0])
    text = f"from {ordered[0]:.2f} to {ordered[-1]:.2f}, median {ordered[len(ordered) // 2]:.2f}"
    poor = poor_fit_layers(r2)
    if not poor:
        return text + "; no layer below 0"
    plural = "s" if len(poor) > 1 else ""
    shown = ", ".join(f"{i} ({v:.2f})" for i, v in poor)
    return f"{text}; poor fit (R² < 0: worse than a constant score) in layer{plural} {shown}"


def verification_rows(record: dict) -> list[tuple[str, str]]:
    """The conversion's own measured quality: its logit check against the source (moh_conversion.json)."""
    if "verification" not in record:
        return []
    v = record["verification"]
    if v is None:
        return [("logit check", "not run (`--skip_logit_check`)")]
    try:
        text = (
            f"every head on: max \\|Δlogit\\| {v['all_heads_max_abs_diff']:.3g} vs the source "
            f"({'within' if v['all_heads_equal'] else 'NOT within'} {v['all_heads_tolerance']:.3g}); routing on: "
            f"probe perplexity {v['source_probe_ppl']:.2f} → {v['routed_probe_ppl']:.2f} "
            f"(×{v['routed_probe_ppl'] / v['source_probe_ppl']:.2f}), top-1 agreement with the source "
            f"{100 * v['routed_top1_agreement']:.1f}%"
        )
    except (KeyError, TypeError, ZeroDivisionError):  # an older or partial record
        return []
    return [(f"logit check ({v.get('probe', 'probe')}, {v.get('dtype', '')})", text)]


def heldout_rows(record: dict) -> list[tuple[str, str]]:
    """The held-out perplexity against the parent (moh_conversion.json's "heldout"); none in an older record."""
    h = record.get("heldout")
    if not isinstance(h, dict):
        return []
    label = "held-out perplexity vs the parent (at conversion)"
    if "skipped" in h:
        return [(label, f"not measured ({h['skipped']})")]
    try:
        text = (
            f"×{h['ratio']:.3f} (converted {h['converted_ppl']:.3f}, parent {h['parent_ppl']:.3f}, routing on) on "
            f"{h['tokens']:,} tokens of {h['text']} never used for calibration ({h['split']}; rows of {h['block']} "
            f"tokens, {h['dtype']})"
        )
    except (KeyError, TypeError, ValueError):
        return []
    return [(label, text)]


def speed_rows(record: dict) -> list[tuple[str, str]]:
    """The conversion's own timing against its parent (`mhmoe-convert --measure_speed`, moh_conversion.json's
    "speed"); none when it was not measured."""
    speed = record.get("speed")
    if not speed:
        return []
    try:
        p, d = speed["prefill"], speed["decode"]
        text = (
            f"prefill of {p['tokens']:,} tokens ×{p['speed_ratio']:.2f} the parent's speed (MoH "
            f"{p['moh_tokens_per_s']:,.1f} vs parent {p['parent_tokens_per_s']:,.1f} tokens/s; ideal "
            f"×{p['ideal_speed_ratio']:.2f}, {p['rounds']} rounds); greedy decoding of {d['new_tokens']} tokens after "
            f"it ×{d['speed_ratio']:.2f} ({d['moh_tokens_per_s']:,.1f} vs {d['parent_tokens_per_s']:,.1f} tokens/s; "
            f"ideal ×{d['ideal_speed_ratio']:.2f}, {d['rounds']} rounds in lockstep); medians of the per-round ratios "
            f"parent time / MoH time, batch {speed['batch']}, {speed['dtype']}, {speed['device']}, "
            f"{speed['threads']} thread{'' if speed['threads'] == 1 else 's'}, {speed['text']}. These are the converting machine's timings of this "
            f"conversion, and noisy; the repeatable benchmark is `{speed['benchmark']}` in mhmoe's repository"
        )
    except (KeyError, TypeError, ValueError):  # an older or partial record
        return []
    return [("speed vs the parent (`--measure_speed`)", text)]


def conversion_rows(record: dict | None) -> list[tuple[str, str]]:
    """(label, text) rows from a converted model's moh_conversion.json: head recipe, calibration data, the router
    fit, the held-out perplexity, the logit check's figures and, where measured, its speed against the parent."""
    if not record or "recipe" not in record:
        return []
    recipe = record["recipe"]
    rows = [
        (
            "conversion recipe",
            f"`{recipe['name']}`: shared heads `{recipe['shared_heads']}`, routed-head score "
            f"`{recipe['router']}` (mhmoe-convert)",
        )
    ]
    calibration = record.get("calibration")
    if calibration:
        held = calibration.get("heldout_tokens")
        rows.append(
            (
                "calibration",
                f"{calibration['source']}, {calibration['tokens']:,} tokens, sha256 `{calibration['sha256'][:16]}…`"
                + (f"; its next {held:,} tokens held out (never calibrated on)" if held else ""),
            )
        )
    fit = record.get("router_fit")
    if fit:
        rows.append(
            (
                "router fit",
                f"W_r of the learned router fitted on the calibration text ({fit['tokens']:,} tokens): per layer a "
                f"ridge regression of the {fit['target']} on {fit['features']}, {fit['ridge']}; R² per layer (the "
                f"mean over its heads, on the calibration tokens; no intercept) {fit_words(fit.get('r2'))}",
            )
        )
    layers = record.get("layers") or []
    if layers and recipe["shared_heads"] != "first":
        shown = "; ".join(f"{i}: {layer['shared_source_heads']}" for i, layer in enumerate(layers[:4]))
        rows.append(
            (
                "shared heads (source head ids, per layer)",
                shown + (f"; … ({len(layers)} layers in moh_conversion.json)" if len(layers) > 4 else ""),
            )
        )
    return rows + heldout_rows(record) + verification_rows(record) + speed_rows(record)


__all__ = [
    "ROUTER_WORDS",
    "base_model_name",
    "conversion_rows",
    "conversion_text",
    "fit_words",
    "heldout_rows",
    "hub_id",
    "parent_names",
    "parent_text",
    "poor_fit_layers",
    "probe_change",
    "public_paths",
    "quality_text",
    "recorded_base_model",
    "router_text",
    "speed_rows",
    "verification_rows",
]
