"""The conversion as one straight pipeline: read → plan → choose heads → write → verify → record, rename.

`convert(input_dir, output_dir, ...)` is the whole conversion, each step in its own module:
* read       source.py: the input folder, or a GGUF file dequantised into a temporary folder (gguf.py)
* plan       plan.py: the source's config and shard headers read and checked into a `ConversionPlan`; the recipe
             resolved and the tensors its router adds planned (calibrate.py, routers.py); the disk space checked
* choose     calibrate.py `choose_heads`: the heads measured on calibration text, the shared heads, router and head
             budgets chosen; it returns its choice (`HeadChoices`), applied to a copy of the plan's config here
* write      write.py: the shards copied byte for byte into a temporary folder beside `output_dir`, heads permuted
* verify     verify.py: the logit check and the held-out perplexity (heldout.py); with `speed`, the timing against the
             parent (`mhmoe.evaluation.conversion_speed`)
* record     moh_conversion.json, the modeling code and card; the folder renamed into place (write.py `commit`)
Everything is checked before anything is written; a failed or interrupted conversion leaves nothing at `output_dir`.
Continue-tuning (continue_tune.py) runs after `convert`, on its output.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import time
from dataclasses import dataclass

from .._plumbing.checkpoint_files import temporary_dir_next_to
from ..evaluation.conversion_speed import speed_line
from .calibrate import CALIBRATION_TOKENS, DEFAULT_RECIPE, HeadRecipe, choose_heads, plan_recipe, resolve_recipe
from .heldout import heldout_line
from .options import ConvertOptions, SpeedSettings
from .plan import RECORD_NAME, ConversionPlan, plan_conversion
from .recipe import ACTIVE_HEADS_RATIO, AUX_LOSS_COEF, GATES, ROUTER, SHARED_HEADS_RATIO
from .source import Source, read_source
from .verify import verified
from .write import check_disk_space, check_paths, commit, output_state, write_converted


@dataclass
class ConversionReport:
    input_dir: str
    output_dir: str
    source_model_type: str
    num_layers: int
    num_heads: int
    num_key_value_heads: int
    shared_heads: int
    routed_active_heads: int
    shards: int
    tensors: int
    bytes: int
    seconds: float
    notes: list[str]
    verification: dict | None = None
    router: str = ROUTER
    recipe: str = "paper"
    routed_active_heads_per_layer: list[int] | None = None  # --head_budget calibrated
    head_thresholds: list[float | None] | None = None  # --head_budget threshold
    speed: dict | None = None  # --measure_speed (mhmoe.evaluation.conversion_speed)
    heldout: dict | None = None  # the held-out perplexity (heldout.py), or {"skipped": why}
    router_fit_r2: list[float] | None = None  # the fitted router's R² per layer (calibrate.py)

    @classmethod
    def of(cls, plan: ConversionPlan, input_dir: str, output_dir: str, seconds: float, verification: dict | None):
        config = plan.config
        return cls(
            input_dir=input_dir,
            output_dir=output_dir,
            source_model_type=plan.source_model_type,
            num_layers=config.num_hidden_layers,
            num_heads=config.num_attention_heads,
            num_key_value_heads=config.num_key_value_heads,
            shared_heads=config.moh_shared_heads,
            routed_active_heads=config.moh_active_heads,
            shards=len(plan.shards),
            tensors=sum(len(s.tensors) for s in plan.shards),
            bytes=plan.total_bytes,
            seconds=seconds,
            notes=plan.notes,
            verification=verification,
            router=config.moh_router,
            routed_active_heads_per_layer=getattr(config, "moh_active_heads_per_layer", None),
            head_thresholds=getattr(config, "moh_head_thresholds", None),
        )

    @property
    def active_heads(self) -> int:
        return self.shared_heads + self.routed_active_heads

    def format(self) -> str:
        from ..hub.conversion_cards import fit_words, probe_change

        h, s, k = self.num_heads, self.shared_heads, self.routed_active_heads
        lines = [
            f"converted {self.source_model_type} -> moh_llama: {self.input_dir} -> {self.output_dir}",
            f"  heads per layer: {h} ({self.num_key_value_heads} key/value), {s} shared + {k} of {h - s} routed "
            f"active = {self.active_heads}/{h} ({100 * self.active_heads / h:.1f}%); recipe {self.recipe}, router "
            f"{self.router}, {GATES}; "
            f"{self.num_layers} layers",
        ]
        if self.routed_active_heads_per_layer is not None:
            budgets = ", ".join(map(str, self.routed_active_heads_per_layer))
            kind = "calibrated" if self.head_thresholds is None else "threshold (per-layer averages)"
            lines.append(f"  head budget {kind}: routed heads active per layer {budgets} (average {k})")
        if self.head_thresholds is not None:
            lines.append(
                "  per token: the routed heads whose score exceeds the layer's threshold (calibrated to those "
                "averages; see moh_conversion.json)"
            )
        lines += [
            f"  weights: {self.tensors} tensors, {self.bytes / 1e6:,.1f} MB in {self.shards} shard(s), copied in "
            f"{self.seconds:.2f} s ({self.bytes / 1e6 / max(self.seconds, 1e-9):,.0f} MB/s)",
        ]
        lines += [f"  note: {note}" for note in self.notes]
        v = self.verification
        if v is None:
            lines.append("  logits: not checked (--skip_logit_check); tensor names, dtypes and shapes were checked")
        else:
            lines.append(
                f"  check ({v['probe']}, {v['dtype']}): all heads active: max |Δlogit| = "
                f"{v['all_heads_max_abs_diff']:.3g} vs source -> {'OK' if v['all_heads_equal'] else 'FAILED'}"
            )
            lines.append(
                f"  routing on ({self.active_heads}/{h} heads): max |Δlogit| {v['routed_max_abs_diff']:.3g}, mean "
                f"{v['routed_mean_abs_diff']:.3g}, top-1 agreement {100 * v['routed_top1_agreement']:.1f}%, probe "
                f"perplexity {v['source_probe_ppl']:.2f} -> {v['routed_probe_ppl']:.2f} "
                f"({probe_change(v['source_probe_ppl'], v['routed_probe_ppl'])})"
            )
        if self.router_fit_r2 is not None:
            lines.append(f"  router fit: R² per layer {fit_words(self.router_fit_r2)}")
        if self.heldout is not None:
            lines.append(heldout_line(self.heldout))
        if self.speed is not None:
            lines.append(speed_line(self.speed))
        return "\n".join(lines)


def convert(
    input_dir: str,
    output_dir: str,
    shared_heads_ratio: float = SHARED_HEADS_RATIO,
    active_heads_ratio: float = ACTIVE_HEADS_RATIO,
    overwrite: bool = False,
    verify_logits: bool = True,
    probe_text: str | None = None,
    moh_aux_loss_coef: float = AUX_LOSS_COEF,
    progress: bool = True,
    gguf_file: str | None = None,
    recipe: HeadRecipe | str = DEFAULT_RECIPE,
    calibration_file: str | None = None,
    calibration_tokens: int = CALIBRATION_TOKENS,
    source_names: dict | None = None,
    source_notes: list[str] | None = None,
    trust_remote_code: bool = False,
    shared_heads: int | None = None,
    active_heads: int | None = None,
    head_budget: str = "uniform",
    speed: SpeedSettings | None = None,
    base_model: str | None = None,
) -> ConversionReport:
    """Convert `input_dir` (llama / mistral / qwen2, safetensors; or `gguf_file` inside it) into a moh_llama
    checkpoint at `output_dir`: read, plan, choose heads, write, verify, record, rename (the module's docstring).
    The keyword arguments are the fields of `ConvertOptions` (options.py, which says what each does). Raises
    `ConversionError` (nothing written at `output_dir`) for anything it refuses (see plan.py's docstring); arguments of
    the wrong type raise `TypeError`, values out of range `ConversionError` (a `ValueError`).
    """
    arguments = dict(locals())
    options = ConvertOptions(**{k: v for k, v in arguments.items() if k not in ("input_dir", "output_dir")})
    check_paths(input_dir, output_dir)
    output_state(output_dir, options.overwrite)
    options = options.with_recipe()
    with read_source(input_dir, output_dir, options) as source:
        started = time.time()
        plan, recipe = _plan(source, output_dir, options)
        calibration_start = time.time()
        with plan.source.renaming():  # errors name input_dir, not its pinned copy
            choices = choose_heads(
                plan,
                recipe,
                options.calibration_file,
                options.calibration_tokens,
                options.trust_remote_code,
                options.progress,
                options.head_budget,
            )
        calibration = time.time() - calibration_start
        if "calibration" in choices.record:
            choices.record["calibration"]["seconds"] = round(calibration, 3)
        plan = dataclasses.replace(plan, config=choices.configured(plan.config))
        # "copied in" counts the plan, the copy and the permutation, not calibration
        return _write_and_verify(plan, choices, source, output_dir, options, started + calibration)


def _plan(source: Source, output_dir: str, options: ConvertOptions) -> tuple[ConversionPlan, HeadRecipe]:
    """The plan of `source` (its files pinned as checked: `plan.input_dir` is where they are read), with the recipe
    resolved, its router's tensors planned and the disk space for all of it checked, before calibration's minutes."""
    plan = plan_conversion(
        source.folder,
        options.shared_heads_ratio,
        options.active_heads_ratio,
        options.moh_aux_loss_coef,
        options.shared_heads,
        options.active_heads,
        trust_remote_code=options.trust_remote_code,
    )
    plan.notes[:0] = source.notes
    recipe, note = resolve_recipe(options.recipe, plan.input_dir)
    if note is not None:
        plan.notes.append(note)
    plan_recipe(plan, recipe)
    check_disk_space(plan, output_dir)
    return plan, recipe


def _write_and_verify(plan, choices, source: Source, output_dir: str, options: ConvertOptions, started: float):
    """Write into a temporary folder beside `output_dir`, verify, record, and rename it into place; on any failure
    the temporary folder is removed and the error names the folder given, not its pinned copy."""
    from ..hub.conversion_cards import parent_names

    names = source.names or parent_names(source.folder, base_model=options.base_model, config_dir=plan.input_dir)
    temporary = temporary_dir_next_to(output_dir)
    try:
        write_converted(plan, choices, temporary, options.progress)
        copy_seconds = time.time() - started
        verification, heldout = _verify(plan.input_dir, temporary, plan, choices, options)
        report = ConversionReport.of(plan, source.label, output_dir, copy_seconds, verification)
        report.heldout = heldout
        report.router_fit_r2 = (choices.record.get("router_fit") or {}).get("r2")
        report.speed = _speed(plan.input_dir, temporary, options)
        report.recipe = choices.record["recipe"]["name"]
        _write_record(temporary, report, choices, options.shared_heads_ratio, options.active_heads_ratio, names)
        commit(temporary, output_dir, options.overwrite)
    except BaseException as e:
        shutil.rmtree(temporary, ignore_errors=True)
        plan.source.rename(e)
        raise
    return report


def _verify(input_dir: str, temporary: str, plan, choices, options: ConvertOptions) -> tuple[dict | None, dict]:
    """The logit check (verify.py) and, in the same loads of the two models, the held-out perplexity (heldout.py):
    (verification or None, moh_conversion.json's "heldout": the figures, or {"skipped": why})."""
    from .heldout import HeldOut, held_out

    if not options.verify_logits:
        return None, {"skipped": "--skip_logit_check: the models were not loaded"}
    config = plan.config
    found = held_out(
        input_dir,
        config.vocab_size,
        config.max_position_embeddings,
        options.calibration_file,
        options.calibration_tokens,
        options.trust_remote_code,
    )
    heldout = found if isinstance(found, HeldOut) else None
    verification = verified(input_dir, temporary, options.probe_text, options.trust_remote_code, heldout)
    if heldout is None:
        return verification, {"skipped": found}
    return verification, heldout.record(verification["dtype"], calibrated="calibration" in choices.record)


def _speed(source_dir: str, temporary: str, options: ConvertOptions) -> dict | None:
    """With `options.speed`: the converted model timed against its parent on the calibration text, before the folder
    is renamed into place (`mhmoe.evaluation.conversion_speed`); else None."""
    if options.speed is None:
        return None
    from ..evaluation.conversion_speed import measure_speed
    from .calibrate import read_calibration

    text = read_calibration(options.calibration_file)
    return measure_speed(source_dir, temporary, options.speed, text, options.trust_remote_code, options.progress)


def _write_record(temporary: str, report, choices, shared_heads_ratio, active_heads_ratio, names: dict) -> None:
    """moh_conversion.json: the report, the ratios and the recipe's record, with `names` (`parent_names`: the
    source's public name and Hub id) and the output folder's name, not local paths: the record is published with the
    model."""
    record = dataclasses.asdict(report)
    record.pop("router_fit_r2")  # the record's router_fit has it
    record.update(
        shared_heads_ratio=shared_heads_ratio,
        active_heads_ratio=active_heads_ratio,
        input_dir=names["input_dir"],
        base_model=names["base_model"],
        output_dir=os.path.basename(os.path.abspath(report.output_dir)),
        **choices.record,
    )
    with open(os.path.join(temporary, RECORD_NAME), "w") as f:
        json.dump(record, f, indent=2)


__all__ = ["ConversionReport", "convert"]
