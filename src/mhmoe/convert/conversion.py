"""Write a planned conversion: shards streamed byte for byte into a temporary folder, renamed into place at the end.

`convert(input_dir, output_dir, ...)` is the whole conversion: plan (plan.py), write, verify (verify.py), record. The
weights are copied byte for byte, shard by shard (same shard names, same index), without building the model: memory
stays far below one shard (`os.copy_file_range` where the kernel has it). A calibrated recipe then rewrites the shards
once: heads permuted, and the "fitted" router's weights (the only tensors a recipe adds) filled in.
Everything is checked before anything is written. The output is written to a temporary directory next to
`output_dir`, its safetensors headers re-read and compared with the plan, every file flushed to disk, and the folder
renamed at the end, so a failed or interrupted conversion leaves nothing at `output_dir` (and hidden folders that the
next conversion to it removes: `_plumbing.checkpoint_files.recover_output_dir`); an existing non-empty `output_dir` is only
replaced with `overwrite`, and is never missing meanwhile. Besides the weights and config, only the generation config,
tokenizer and chat template files are copied (`_plumbing.checkpoint_files.side_files`: never code); the modeling code,
`auto_map` and a model card are added as `export_pretrained` adds them, so the output loads with `trust_remote_code=True`
where mhmoe is not installed.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import struct
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from .._plumbing.checkpoint_files import (
    SAFE_INDEX_NAME,
    check_writable,
    copy_side_file,
    fsync,
    overlapping,
    recover_output_dir,
    replace_dir,
    temporary_dir_next_to,
)
from .calibrate import CALIBRATION_TOKENS, DEFAULT_RECIPE, HEAD_BUDGETS, HeadRecipe, choose_heads, head_recipe
from .errors import ConversionError
from .heads import permute_checkpoint
from .heldout import heldout_line
from .plan import RECORD_NAME, ConversionPlan, ShardPlan, plan_conversion, read_shard
from .recipe import (
    ACTIVE_HEADS_RATIO,
    AUX_LOSS_COEF,
    GATES,
    ROUTER,
    SHARED_HEADS_RATIO,
    check_aux_loss_coef,
    check_number,
    head_split,
)
from .speed import SpeedSettings, measure_speed, speed_line
from .verify import verified

_COPY_CHUNK = 64 * 1024 * 1024


def _copy_range(src_fd: int, dst_fd: int, offset: int, count: int) -> None:
    """Copy `count` bytes at `offset` of src to dst's current position, in the kernel when it can (no user memory)."""
    position = offset
    end = offset + count
    use_kernel = hasattr(os, "copy_file_range")
    while position < end:
        chunk = min(_COPY_CHUNK, end - position)
        if use_kernel:
            try:
                done = os.copy_file_range(src_fd, dst_fd, chunk, position)
            except OSError:  # other file systems / kernels: fall back to read + write
                use_kernel = False
                continue
            if done == 0:
                raise ConversionError("unexpected end of a source shard while copying (was it modified meanwhile?)")
        else:
            data = os.pread(src_fd, chunk, position)
            if not data:
                raise ConversionError("unexpected end of a source shard while copying (was it modified meanwhile?)")
            os.write(dst_fd, data)  # regular files: complete writes
            done = len(data)
        position += done


def _write_shard(shard: ShardPlan, out_path: str, progress=None) -> None:
    header, offset = {}, 0
    for t in shard.tensors:
        header[t.name] = {"dtype": t.dtype, "shape": list(t.shape), "data_offsets": [offset, offset + t.nbytes]}
        offset += t.nbytes
    metadata = {str(k): str(v) for k, v in shard.metadata.items()} or {"format": "pt"}
    metadata.setdefault("format", "pt")
    header["__metadata__"] = metadata
    encoded = json.dumps(header, separators=(",", ":")).encode()
    encoded += b" " * (-len(encoded) % 8)  # the data starts 8-byte aligned
    src_fd = os.open(shard.source_path, os.O_RDONLY)
    dst_fd = os.open(out_path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    try:
        os.write(dst_fd, struct.pack("<Q", len(encoded)) + encoded)
        run_start = run_end = None
        for t in shard.tensors + [None]:  # copy maximal runs of contiguous source bytes in one go
            if t is not None and not t.added and t.start == run_end:
                run_end = t.end
                continue
            if run_start is not None and run_end > run_start:
                _copy_range(src_fd, dst_fd, run_start, run_end - run_start)
                if progress is not None:
                    progress.update(run_end - run_start)
            run_start = run_end = None
            if t is None:
                break
            if t.added:
                zeros = bytes(min(t.nbytes, _COPY_CHUNK))
                left = t.nbytes
                while left:
                    left -= os.write(dst_fd, zeros[: min(left, len(zeros))])
            else:
                run_start, run_end = t.start, t.end
    finally:
        os.close(src_fd)
        os.close(dst_fd)


def _check_written(plan: ConversionPlan, directory: str) -> None:
    """The written shards hold exactly the planned tensors (names, dtypes, shapes) and are complete."""
    for shard in plan.shards:
        written = read_shard(os.path.join(directory, shard.filename), shard.filename)
        got = {t.name: (t.dtype, t.shape) for t in written.tensors}
        want = {t.name: (t.dtype, t.shape) for t in shard.tensors}
        if got != want:
            raise ConversionError(f"written shard {shard.filename} does not match the plan")


def output_state(output_dir: str, overwrite: bool) -> bool:
    """True when output_dir exists (and may be replaced). Refuses a non-empty one without overwrite. What an earlier,
    killed conversion to output_dir left is cleaned up first (`recover_output_dir`)."""
    recover_output_dir(output_dir)
    if os.path.lexists(output_dir) and not os.path.isdir(output_dir):
        raise ConversionError(f"--output_dir {output_dir} exists and is not a directory")
    if os.path.isdir(output_dir) and os.listdir(output_dir) and not overwrite:
        raise ConversionError(f"--output_dir {output_dir} exists and is not empty; pass --overwrite to replace it")
    return os.path.isdir(output_dir)


def check_paths(input_dir: str, output_dir: str) -> None:
    if overlapping(input_dir, output_dir):
        raise ConversionError(f"--output_dir {output_dir} must not be --input_dir, inside it, or contain it")


def _check_disk_space(plan: ConversionPlan, output_dir: str) -> None:
    check_writable(output_dir, ConversionError, needed=plan.total_bytes)  # a read-only target is not a full disk


def _write_checkpoint(plan: ConversionPlan, temporary: str, progress: bool) -> None:
    """Shards, index, config and the copied files into `temporary`; the shards' headers re-read and checked."""
    from tqdm.auto import tqdm

    bar = tqdm(
        total=plan.total_bytes, unit="B", unit_scale=True, desc="converting", disable=not progress, dynamic_ncols=True
    )
    # each shard is flushed to disk by a background thread while the next one is copied (fsync drops the GIL)
    with ThreadPoolExecutor(max_workers=1) as flusher:
        flushed = []
        for shard in plan.shards:
            path = os.path.join(temporary, shard.filename)
            _write_shard(shard, path, bar)
            flushed.append(flusher.submit(fsync, path))
        for future in flushed:
            future.result()
    bar.close()
    if plan.indexed:
        weight_map = {t.name: s.filename for s in plan.shards for t in s.tensors}
        index = {"metadata": {"total_size": plan.total_bytes}, "weight_map": dict(sorted(weight_map.items()))}
        with open(os.path.join(temporary, SAFE_INDEX_NAME), "w") as f:
            json.dump(index, f, indent=2)
    plan.config.save_pretrained(temporary)
    for name in plan.copy_files:
        note = copy_side_file(plan.input_dir, name, temporary)
        if note:
            plan.notes.append(note)
    _check_written(plan, temporary)


def _add_remote_code(temporary: str, output_dir: str) -> None:
    """The modeling code, `auto_map` and the converted model card (base model from the conversion record), as
    `export_pretrained` writes them: the folder loads with trust_remote_code=True without mhmoe."""
    from ..hub.remote_code import write_remote_code
    from ..models.moh_llama import MoHLlamaConfig

    config = MoHLlamaConfig.from_pretrained(temporary, trust_remote_code=False)
    write_remote_code(temporary, config, repo=os.path.basename(os.path.abspath(output_dir)))


def _commit(temporary: str, output_dir: str, overwrite: bool) -> None:
    """Add the modeling code and card, flush the small files and the folder, then rename it into place."""
    _add_remote_code(temporary, output_dir)
    for folder, _, names in os.walk(temporary):
        for name in names:
            if not name.endswith(".safetensors"):  # small files; the shards are flushed already
                fsync(os.path.join(folder, name))
    fsync(temporary)
    output_state(output_dir, overwrite)  # still allowed (nothing appeared meanwhile)
    replace_dir(temporary, output_dir)
    fsync(os.path.dirname(os.path.abspath(output_dir)))


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
    speed: dict | None = None  # --measure_speed (speed.py)
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
    checkpoint at `output_dir`.

    `recipe`: how shared heads and the routed-head score are chosen (calibrate.py; "paper": the first heads shared,
    l2 router, weights copied byte for byte; a calibrated recipe measures the source on the first tokens of
    `calibration_file` and permutes heads). Raises `ConversionError` (nothing written at `output_dir`) for anything it
    refuses; see plan.py's docstring. `verify_logits=False` skips loading the models (names, dtypes and shapes are
    still checked; no held-out perplexity). The logit check also measures the converted model's perplexity over its
    parent's on the calibration text's held-out tokens (heldout.py). `base_model`: the source's Hugging Face Hub id,
    which the card and moh_conversion.json name it by (default: a Hub cache snapshot's repo id, a Hub id in the
    source's config.json `_name_or_path`, else the GGUF file's name; never a local path or folder name:
    `hub.conversion_cards.parent_names`). `source_names`: those names, already found (a GGUF conversion's).
    `source_notes`: how the source was read (GGUF dequantisation), first among the report's and moh_conversion.json's
    notes. `trust_remote_code`: let Transformers run the code the source's tokenizer names (calibration, the logit
    check); the model's code is always Transformers' own and no code is copied. `shared_heads` / `active_heads`: the
    head split as counts per layer (active = shared + routed) instead of the ratios. `head_budget`: "uniform" (every
    layer `active_heads`), "calibrated" (per-layer routed budgets at the same total, from each layer's measured effect
    on the model's predictions: head_budget.py) or "threshold" (those budgets as averages; per token the heads
    scoring above a per-layer threshold). `speed`: time the converted model against its parent on this machine before
    the folder is renamed into place (speed.py; recorded in moh_conversion.json and the card). Arguments of the wrong
    type raise `TypeError`, values out of range `ConversionError` (a `ValueError`).
    """
    options = dict(locals())  # the arguments (nothing else is defined yet)
    for name in ("input_dir", "output_dir", "gguf_file"):
        del options[name]
    _check_arguments(shared_heads_ratio, active_heads_ratio, moh_aux_loss_coef, shared_heads, active_heads)
    _check_options(head_budget, speed, base_model)
    check_paths(input_dir, output_dir)
    output_state(output_dir, overwrite)
    options["recipe"] = head_recipe(recipe) if isinstance(recipe, str) else recipe
    if gguf_file is not None:
        return _convert_gguf(input_dir, output_dir, gguf_file, **options)
    return _convert_folder(input_dir, output_dir, **options)


def _convert_folder(input_dir: str, output_dir: str, **o) -> ConversionReport:
    """`convert` of a safetensors folder, its arguments checked: plan, calibrate, write, verify, record, rename."""
    from ..hub.conversion_cards import parent_names

    start = time.time()
    plan = plan_conversion(  # its files pinned as checked (trust.pinned): plan.input_dir is where they are read
        input_dir,
        o["shared_heads_ratio"],
        o["active_heads_ratio"],
        o["moh_aux_loss_coef"],
        o["shared_heads"],
        o["active_heads"],
        trust_remote_code=o["trust_remote_code"],
    )
    names = o["source_names"] or parent_names(input_dir, base_model=o["base_model"], config_dir=plan.input_dir)
    plan.notes[:0] = o["source_notes"] or []
    _check_disk_space(plan, output_dir)  # before calibration's minutes
    planned = plan.total_bytes
    calibration_start = time.time()
    with plan.source.renaming():  # errors name input_dir, not its pinned copy
        choices = choose_heads(
            plan,
            o["recipe"],
            o["calibration_file"],
            o["calibration_tokens"],
            o["trust_remote_code"],
            o["progress"],
            o["head_budget"],
        )
    if plan.total_bytes > planned:  # the fitted router's tensors, planned by calibration
        _check_disk_space(plan, output_dir)
    if "calibration" in choices.record:
        choices.record["calibration"]["seconds"] = round(time.time() - calibration_start, 3)
    start += time.time() - calibration_start  # "copied in" counts the copy (and the permutation), not calibration

    temporary = temporary_dir_next_to(output_dir)
    try:
        _write_converted(plan, choices, temporary, o["progress"])
        copy_seconds = time.time() - start
        source = plan.input_dir  # the pinned copy
        verification, heldout = _verify(source, temporary, plan, choices, o)
        report = ConversionReport.of(plan, input_dir, output_dir, copy_seconds, verification)
        report.heldout = heldout
        report.router_fit_r2 = (choices.record.get("router_fit") or {}).get("r2")
        if o["speed"] is not None:
            report.speed = measure_speed(
                source, temporary, o["speed"], o["calibration_file"], o["trust_remote_code"], o["progress"]
            )
        report.recipe = choices.record["recipe"]["name"]
        _write_record(temporary, report, choices, o["shared_heads_ratio"], o["active_heads_ratio"], names)
        _commit(temporary, output_dir, o["overwrite"])
    except BaseException as e:
        shutil.rmtree(temporary, ignore_errors=True)
        plan.source.rename(e)
        raise
    return report


def _verify(input_dir: str, temporary: str, plan, choices, o: dict) -> tuple[dict | None, dict]:
    """The logit check (verify.py) and, in the same loads of the two models, the held-out perplexity (heldout.py):
    (verification or None, moh_conversion.json's "heldout": the figures, or {"skipped": why})."""
    from .heldout import HeldOut, held_out

    if not o["verify_logits"]:
        return None, {"skipped": "--skip_logit_check: the models were not loaded"}
    config = plan.config
    found = held_out(
        input_dir,
        config.vocab_size,
        config.max_position_embeddings,
        o["calibration_file"],
        o["calibration_tokens"],
        o["trust_remote_code"],
    )
    heldout = found if isinstance(found, HeldOut) else None
    verification = verified(input_dir, temporary, o["probe_text"], o["trust_remote_code"], heldout)
    if heldout is None:
        return verification, {"skipped": found}
    return verification, heldout.record(verification["dtype"], calibrated="calibration" in choices.record)


def _check_arguments(shared_heads_ratio, active_heads_ratio, moh_aux_loss_coef, shared_heads, active_heads) -> None:
    """The numbers given, before anything is read (a ratio replaced by its count is not checked as a ratio)."""
    _check_numbers(
        shared_heads_ratio if shared_heads is None else 0.0,
        active_heads_ratio if active_heads is None else 0.0,
        moh_aux_loss_coef,
    )


def _check_options(head_budget: str, speed, base_model) -> None:
    from ..hub.conversion_cards import hub_id

    if base_model is not None and not hub_id(base_model, single=True):
        raise ConversionError(
            f"--base_model must be a Hugging Face Hub model id (NAME or ORG/NAME), not a local path: {base_model!r}"
        )
    if head_budget not in HEAD_BUDGETS:
        raise ConversionError(f"--head_budget must be one of {', '.join(HEAD_BUDGETS)}, got {head_budget!r}")
    if speed is not None and not isinstance(speed, SpeedSettings):
        raise TypeError(f"speed must be a SpeedSettings or None, not {type(speed).__name__}")


def _write_converted(plan, choices, temporary: str, progress: bool) -> None:
    """The source's shards copied into `temporary`, then (calibrated recipes) the heads permuted and the fitted
    router's weights filled in."""
    _write_checkpoint(plan, temporary, progress)
    if choices.orders is not None or choices.tensors:
        config = plan.config
        permute_checkpoint(
            temporary,
            [s.filename for s in plan.shards],
            choices.orders,
            config.num_key_value_heads,
            config.head_dim,
            replace=choices.tensors,
        )


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


def _check_numbers(shared_heads_ratio, active_heads_ratio, moh_aux_loss_coef) -> None:
    """Before anything is read: the ratios and β are finite numbers (a TypeError for a string or None)."""
    check_number("--shared_heads_ratio", shared_heads_ratio)
    check_number("--active_heads_ratio", active_heads_ratio)
    check_aux_loss_coef(moh_aux_loss_coef)


def _convert_gguf(input_dir: str, output_dir: str, gguf_file: str, **options) -> ConversionReport:
    """`convert` of a GGUF file: dequantised into a dense checkpoint in a temporary folder (gguf.py), converted from
    there, the temporary folder removed. The card and the record name the source by its Hub id when there is one,
    else by the GGUF file's name (`parent_names`), never by the temporary folder."""
    from ..hub.conversion_cards import parent_names
    from .gguf import check_gguf_source, dequantise_gguf, gguf_config

    check_gguf_source(input_dir, gguf_file)
    heads = gguf_config(input_dir, gguf_file).num_attention_heads  # the head split is checked before dequantising
    head_split(
        heads,
        options["shared_heads_ratio"],
        options["active_heads_ratio"],
        options["shared_heads"],
        options["active_heads"],
    )
    options["source_names"] = options["source_names"] or parent_names(input_dir, gguf_file, options["base_model"])
    dense = temporary_dir_next_to(output_dir)
    try:
        if options.get("progress", True):
            print(f"dequantising {gguf_file} to float32 (the whole model, in memory)", flush=True)
        notes = dequantise_gguf(input_dir, gguf_file, dense)
        report = convert(dense, output_dir, **{**options, "source_notes": notes})
        report.input_dir = os.path.join(input_dir, gguf_file)
    finally:
        shutil.rmtree(dense, ignore_errors=True)
    return report
