"""Model cards: the templates in `model_cards/` (Hugging Face `ModelCard` format) filled from a config and real results.

`model_card(config, ...)` returns a `huggingface_hub.ModelCard` whose YAML metadata holds `library_name`, `tags`,
`license`, `pipeline_tag`, `base_model` (converted models whose parent has a Hub id), `datasets` and a `model-index`
with the evaluation results, and whose body gives the architecture, the parity numbers of one MoE layer
(`moe_layer_cost`), the activated heads and experts, and how the model was trained; a converted model's card also
says what its conversion did and measured (conversion_cards.py, from moh_conversion.json). `export_pretrained` /
`mhmoe-export`, `write_remote_code` (training's final save, the converter) and the reproduction runs
(benchmarks/reproduce) write it as README.md. Nothing here needs the network.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from .conversion_cards import (  # noqa: F401 (the converted card's parts, importable from here as before)
    base_model_name,
    conversion_rows,
    conversion_text,
    public_paths,
    quality_text,
    recorded_base_model,
    speed_rows,
    verification_rows,
)

TEMPLATES = {"mhmoe": "mhmoe.md", "moh_llama": "moh_llama.md", "converted": "converted.md"}


def templates_dir() -> Path:
    """The `model_cards/` folder: $MHMOE_MODEL_CARDS, else the one shipped with mhmoe (`mhmoe._plumbing.resources`: the wheel's
    copy, or the repository's folder)."""
    from .._plumbing.resources import data_dirs

    candidates = data_dirs("model_cards", "MHMOE_MODEL_CARDS")
    for path in candidates:
        if (path / TEMPLATES["mhmoe"]).is_file():
            return path
    where = ", ".join(map(str, candidates)) or "this installation"
    raise FileNotFoundError(f"model card templates not found in {where} (set $MHMOE_MODEL_CARDS to a folder with them)")


def architecture_rows(config, parameters: int | None = None) -> list[tuple[str, str]]:
    """(label, text) rows describing the model: size, attention, MoE options, the rows its MoE block kind and
    linear_type add (`card_rows` of their classes: Lory's, BitNet's), MoH options."""
    from ..models.mhmoe.linear_types import linear_class
    from ..models.mhmoe.router_types import block_class

    heads = config.num_attention_heads
    kv = getattr(config, "num_key_value_heads", None) or heads
    rows = [("model type", f"`{config.model_type}`")]
    if parameters is not None:
        rows.append(("parameters", f"{parameters:,} ({parameters / 1e6:.2f}M)"))
    rows += [
        ("layers", str(config.num_hidden_layers)),
        ("hidden size", str(config.hidden_size)),
        ("attention heads", f"{heads} ({kv} key/value)"),
        ("vocabulary", str(config.vocab_size)),
    ]
    if hasattr(config, "is_moe_layer"):
        moe_layers = sum(config.is_moe_layer(i) for i in range(config.num_hidden_layers))
        if moe_layers:
            h = config.moe_heads
            moe = (
                f"{moe_layers} of {config.num_hidden_layers} layers: {config.num_experts} experts, "
                f"top-{config.num_experts_per_tok}, {h} MoE head{'s' if h > 1 else ''} (sub-tokens of width "
                f"{config.hidden_size // h}), expert inner size {config.moe_intermediate_size}"
            )
            if config.shared_expert_intermediate_size:
                moe += f", shared expert inner size {config.shared_expert_intermediate_size}"
            rows.append(("MoE", moe))
        else:
            rows.append(("MoE", "none (dense)"))
    rows += block_class(config).card_rows(config) + linear_class(config).card_rows(config)  # e.g. Lory's, BitNet's
    if getattr(config, "moh_shared_heads", None) is not None:
        shared, active = config.moh_shared_heads, config.moh_active_heads
        gates = ", straight-through 0/1 gates" if config.moh_straight_through else ""
        per_layer = getattr(config, "moh_active_heads_per_layer", None)
        budgets = ""
        if per_layer is not None:  # the layers' average budget
            active = round(sum(per_layer) / len(per_layer), 3)
            budgets = f" on average (per-layer routed budgets, layer 0 first: {', '.join(map(str, per_layer))})"
        if getattr(config, "moh_head_thresholds", None) is not None:
            budgets += (
                "; per token, the routed heads whose score exceeds the layer's threshold (`moh_head_thresholds`, "
                "calibrated to those averages on calibration text: the count varies by token and text)"
            )
        rows.append(
            (
                "MoH attention",
                f"{shared} shared + {active:g} of {heads - shared} routed heads per token = "
                f"{100 * (shared + active) / heads:.1f}% of {heads} heads active{budgets}; "
                f"`{config.moh_router}` router{gates}"
                + (
                    " (per-head query-norm statistics from calibration text in config.json)"
                    if getattr(config, "moh_head_norm_mean", None)
                    else ""
                ),
            )
        )
    return rows


def parity_rows(config) -> list[tuple[str, str]]:
    """One MoE layer's total parameters and activated multiply-adds per token (`moe_layer_cost`); none for dense."""
    if not getattr(config, "decoder_sparse_step", 0):
        return []
    from ..models.mhmoe.parity import moe_layer_cost

    cost = moe_layer_cost(config)
    return [
        (
            "parameters",
            f"{cost.params:,} (experts {cost.expert_params:,}, head + merge {cost.head_merge_params:,}, "
            f"router {cost.router_params:,}, shared expert {cost.shared_expert_params:,})",
        ),
        ("activated multiply-adds per token", f"{cost.macs_per_token:,}"),
    ]


def training_text(summary: dict, final_ppl: bool = True) -> str:
    """The card's Training section from mhmoe-train's train_summary.json (data file names, not their paths).
    `final_ppl=False` leaves out the final validation perplexity (a continue-tuned conversion's recovery sentence
    states it beside the parent's)."""
    args = summary.get("args") or {}
    tokens = summary.get("tokens_seen")  # real tokens; older summaries: every block full
    if tokens is None:
        tokens = (
            (summary.get("step") or 0) * (summary.get("global_batch_blocks") or 0) * (summary.get("block_size") or 0)
        )
    files = [os.path.basename(str(f)) for f in args.get("train_file") or []]
    if args.get("dataset"):
        formats = {"messages": "chat, loss on the assistant turns", "prompt-completion": "loss on the completions"}
        kind = formats.get(summary.get("data_format"))
        if kind and args.get("loss_on_prompt"):
            kind = f"{summary['data_format']}, loss on every token"
        files = [str(args["dataset"]) + (f" ({kind})" if kind else "")]
    steps = summary.get("step")
    parts = [
        f"Trained with `mhmoe-train` for {steps} step{'' if steps == 1 else 's'}"
        + (
            f" ({tokens:,} tokens, {summary['global_batch_blocks']} blocks of {summary['block_size']} per step)"
            if tokens
            else ""
        )
        + (f" on {', '.join(files)}" if files else "")
        + "."
    ]
    if args.get("learning_rate") is not None:
        parts.append(
            f"Learning rate {args['learning_rate']:g} ({args.get('lr_scheduler_type', 'schedule')}), "
            f"{summary.get('num_processes', 1)} process(es), mixed precision "
            f"{summary.get('mixed_precision', 'no')}."
        )
    if args.get("lora"):
        parts.append(f"LoRA (rank {args.get('lora_r')})" + (", merged." if args.get("merge_lora") else "."))
    final = summary.get("final_eval") or {}
    if final_ppl and final.get("eval_ppl") is not None:
        parts.append(f"Final validation perplexity {final['eval_ppl']:.3f}.")
    return " ".join(parts)


def recovery_text(summary: dict) -> str:
    """The Training section's last sentence for a continue-tuned conversion, from its recovery_summary.json: the
    validation perplexity of the dense parent (the converted model with every head on), of the converted model before
    tuning and after it. A figure the run did not measure is left out."""
    dense, start, final, tokens = (summary.get(k) for k in ("dense_ppl", "start_ppl", "final_ppl", "final_tokens"))

    def versus_parent(ppl: float) -> str:
        return f" (×{ppl / dense:.3f} of the parent's)" if dense else ""

    parts = [f"dense parent {dense:.3f} (every head on)"] if dense is not None else []
    if start is not None:
        parts.append(f"MoH before tuning {start:.3f}{versus_parent(start)}")
    after = f" ({tokens:,} tokens)" if isinstance(tokens, int) else ""
    parts.append(f"MoH after tuning{after} {final:.3f}{versus_parent(final)}")
    return f"Validation perplexity: {'; '.join(parts)}."


CONVERSION_RECORDS = ("moh_conversion.json", "converted/moh_conversion.json")  # converted; converted + continue-tuned
RECOVERY_RECORD = "recovery_summary.json"  # a continue-tuned conversion's (convert/continue_tune.py)


def folder_records(folder) -> dict:
    """What a checkpoint folder records about how it was made, for its card: {"base_model", "conversion", "training"}
    from moh_conversion.json (mhmoe-convert; in converted/ after continue-tuning), train_summary.json (mhmoe-train)
    and recovery_summary.json (continue-tuning's perplexities, after the training); unreadable records are skipped."""
    found, training, summary, recovery = {}, None, None, None
    conversion = next((n for n in CONVERSION_RECORDS if os.path.isfile(os.path.join(folder, n))), CONVERSION_RECORDS[0])
    for name, key in ((conversion, "base_model"), ("train_summary.json", "training"), (RECOVERY_RECORD, "recovery")):
        try:
            with open(os.path.join(folder, name), encoding="utf-8") as f:
                record = json.load(f)
            if key == "base_model" and (record.get("input_dir") or "base_model" in record):
                found[key] = recorded_base_model(record)  # a Hub id, or None
                found["conversion"] = record  # its head recipe and calibration data join the architecture table
            elif key == "training" and isinstance(record, dict):
                training, summary = training_text(record), record
            elif key == "recovery" and isinstance(record, dict):
                recovery = recovery_text(record)
        except (OSError, ValueError, TypeError, KeyError, AttributeError):
            continue
    if summary is not None and recovery:  # the final perplexity once, in the recovery sentence
        training = training_text(summary, final_ppl=False)
    if training or recovery:
        found["training"] = " ".join(filter(None, (training, recovery)))
    return found


def _table(rows) -> str:
    return "\n".join(f"| {a} | {b} |" for a, b in rows)


def model_card(
    config,
    *,
    model_name: str,
    parameters: int | None = None,
    results: list[dict] | None = None,
    datasets: list[str] | None = None,
    base_model: str | None = None,
    training: str | None = None,
    repo: str | None = None,
    has_tokenizer: bool = False,
    remote_code: bool = True,
    license: str = "apache-2.0",
    versions: dict | None = None,
    conversion: dict | None = None,
):
    """A `huggingface_hub.ModelCard` for a model of `config`.

    `results`: evaluation results, each {"dataset_name", "dataset_type", "metric_type", "metric_value"} (optional
    "metric_name", "dataset_split", "task_type" (default "text-generation")), written to the `model-index`.
    `base_model`: the Hub id of a converted model's dense parent. `conversion`: the converter's moh_conversion.json
    record (its router, head recipe, calibration data and figures join the card). Either selects the `converted`
    template. `remote_code`: the folder carries its modeling code (`trust_remote_code=True` loads it without mhmoe).
    `versions`: {"mhmoe": ..., "transformers": ...} the model was made with (default: the running ones)."""
    import transformers
    from huggingface_hub import ModelCard, ModelCardData

    from .._plumbing.version import __version__

    converted = bool(base_model or conversion)
    kind = "converted" if converted else ("moh_llama" if config.model_type == "moh_llama" else "mhmoe")
    data = ModelCardData(
        library_name="transformers",
        pipeline_tag="text-generation",
        license=license,
        tags=_tags(config, remote_code),
        base_model=base_model,
        datasets=datasets,
        model_name=model_name,
        eval_results=_eval_results(results) or None,
    )
    repo = repo or model_name
    load = ", trust_remote_code=True" if remote_code else ""
    usage = ("import mhmoe  # or, without mhmoe installed: trust_remote_code=True\n" if not remote_code else "") + (
        f"from transformers import AutoModelForCausalLM{', AutoTokenizer' if has_tokenizer else ''}\n\n"
        f'model = AutoModelForCausalLM.from_pretrained("{repo}"{load})'
        # the tokenizer too: AutoTokenizer reads config.json, whose auto_map would otherwise ask y/N on the terminal
        + (f'\ntokenizer = AutoTokenizer.from_pretrained("{repo}"{load})' if has_tokenizer else "")
    )
    summary = f"A `{config.model_type}` model made with [mhmoe](https://pypi.org/project/mhmoe/)" + (
        ": it loads with `trust_remote_code=True` on torch and transformers alone." if remote_code else "."
    )
    results_rows = "\n".join(
        f"| {r['dataset_name']}{' (' + r['dataset_split'] + ')' if r.get('dataset_split') else ''} | "
        f"{r.get('metric_name') or r['metric_type']} | {r['metric_value']:.4g} |"
        for r in results or []
    )
    tuned = training is not None
    return ModelCard.from_template(
        data,
        template_path=str(templates_dir() / TEMPLATES[kind]),
        model_name=model_name,
        summary=summary,
        architecture_rows=_table(architecture_rows(config, parameters) + conversion_rows(conversion)),
        parity_rows=_table(parity_rows(config)),
        training=training or "Not recorded.",
        results_rows=results_rows,
        usage=usage,
        base_model=base_model,
        conversion_text=conversion_text(config, base_model, conversion, tuned) if converted else "",
        quality_text=quality_text(conversion, tuned) if converted else "",
        mhmoe_version=(versions or {}).get("mhmoe", __version__),
        transformers_version=(versions or {}).get("transformers", transformers.__version__),
    )


def _tags(config, remote_code: bool) -> list[str]:
    tags = ["mhmoe", config.model_type, *(["custom_code"] if remote_code else [])]
    if getattr(config, "moh_shared_heads", None) is not None:
        tags.append("mixture-of-head-attention")
    if getattr(config, "decoder_sparse_step", 0):
        tags.append("mixture-of-experts")
    return list(dict.fromkeys(tags))


def _eval_results(results: list[dict] | None) -> list:
    from huggingface_hub import EvalResult

    return [
        EvalResult(
            task_type=r.get("task_type", "text-generation"),
            dataset_type=r["dataset_type"],
            dataset_name=r["dataset_name"],
            dataset_split=r.get("dataset_split"),
            metric_type=r["metric_type"],
            metric_value=r["metric_value"],
            metric_name=r.get("metric_name"),
        )
        for r in results or []
    ]


__all__ = [
    "architecture_rows",
    "base_model_name",
    "conversion_rows",
    "folder_records",
    "model_card",
    "parity_rows",
    "public_paths",
    "recovery_text",
    "speed_rows",
    "templates_dir",
    "training_text",
    "verification_rows",
]
