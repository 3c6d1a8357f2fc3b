"""Convert a dense LLaMA-family checkpoint into MoH-LLaMA, and continue-tune it (the MoH paper's §4.4 / App. B.2).

`convert(input_dir, output_dir, shared_heads_ratio=0.5, active_heads_ratio=0.75)` turns a Transformers checkpoint of
model_type llama, mistral or qwen2 (safetensors, one file or shards + index) into a `moh_llama` checkpoint with the
paper's continue-tuning router: the parameter-free "l2" router (pre-RoPE query norms) with straight-through 0/1 gates.
That router adds no parameters, so the weights are copied byte for byte, shard by shard (same shard names, same index),
without building the model: memory stays far below one shard. Qwen2's q/k/v biases map onto Llama's
`attention_bias=True`, which also wants an o_proj bias: a zero one is added (outputs unchanged).

The first `shared_heads_ratio × H` heads of every layer are shared (always on); `active_heads_ratio` is the fraction of
*all* heads active per token (shared + routed), as in the paper: LLaMA3-8B, 32 heads, 16 shared, 8 of the other 16
routed = 75%.

Everything is checked before anything is written, and refused in words (`ConversionError`): a model type outside the
LLaMA family, sliding-window attention (moh_llama has none), missing or truncated shards, an index naming tensors a
shard lacks, unknown / non-float / wrongly shaped tensors, missing tensors, pickle-only checkpoints (never
unpickled), an existing non-empty output directory without `overwrite`, ratios without an integer head split. The output
is written to a temporary directory next to `output_dir` and renamed at the end, so a failed or interrupted conversion
leaves nothing.

Verification: the output's safetensors headers are re-read and compared with the plan; unless `verify_logits=False`
the source and the converted model are loaded one after the other (peak memory about one model) and on a probe batch
the converted model with every head active must reproduce the source's logits; with routing on, the logit and
perplexity change is reported.

`main()` (conversion/convert_llama_to_moh.py, `mhmoe-convert`) adds continue-tuning with `--train_file`: the converted
model goes to OUTPUT_DIR/converted and is trained by `mhmoe.train` into OUTPUT_DIR with the paper's stage-2 recipe as
defaults (AdamW, warmup, cosine 2e-5 -> 1e-6, weight decay 0.1, clipping 1.0, MoH balance loss β=0.01), periodic
validation, the dense parent's perplexity (all heads on) at step 0, and a recovery curve (perplexity vs training
tokens, recovery_curve.csv / .png) like the paper's Fig. 2.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import math
import os
import shutil
import struct
import sys
import time
import typing
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from transformers.utils import CONFIG_NAME, SAFE_WEIGHTS_NAME

from .checkpoint_files import (
    PICKLE_SUFFIXES, SAFE_INDEX_NAME, CheckpointError, fsync, overlapping, read_header, replace_dir,
    temporary_dir_next_to, weight_files,
)

SOURCE_MODEL_TYPES = ("llama", "mistral", "qwen2")
RECORD_NAME = "moh_conversion.json"
CONVERTED_SUBDIR = "converted"
RECOVERY_CSV = "recovery_curve.csv"
RECOVERY_PNG = "recovery_curve.png"
DROPPED_TENSOR_SUFFIXES = ("rotary_emb.inv_freq",)  # buffers some old checkpoints carry; recomputed from the config
FLOAT_DTYPES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2}
_COPY_CHUNK = 64 * 1024 * 1024
_PROBE_TEXT = (
    "The quick brown fox jumps over the lazy dog. A language model predicts the next token from the ones before it; "
    "multi-head attention lets every head look at the context in its own way. Mixture-of-Head attention treats the "
    "heads as experts: each token uses the shared heads and a few routed heads chosen by a router. def add(a, b):\n"
    "    return a + b\n\nfor i in range(10):\n    print(i, add(i, i))\n"
)


class ConversionError(CheckpointError):
    """A checkpoint or an argument the converter refuses, with the reason in words."""


# --------------------------------------------------------------------------------------------------------------------
# head split


def head_split(num_heads: int, shared_heads_ratio: float, active_heads_ratio: float) -> tuple[int, int]:
    """(shared heads, routed heads active per token) for `num_heads` query heads.

    `active_heads_ratio` counts all active heads (shared + routed): 32 heads, 0.5, 0.75 -> (16, 8). Refuses ratios that
    do not give whole heads, no routed head, or no active routed head.
    """
    shared_float = num_heads * shared_heads_ratio
    active_float = num_heads * active_heads_ratio
    shared, active = round(shared_float), round(active_float)
    if not 0 <= shared_heads_ratio < 1:
        raise ConversionError(f"--shared_heads_ratio must be in [0, 1), got {shared_heads_ratio}")
    if not 0 < active_heads_ratio <= 1:
        raise ConversionError(f"--active_heads_ratio must be in (0, 1], got {active_heads_ratio}")
    if abs(shared_float - shared) > 1e-6 or abs(active_float - active) > 1e-6:
        raise ConversionError(
            f"ratios give no integer head split: {num_heads} heads × shared ratio {shared_heads_ratio} = "
            f"{shared_float:g} shared, × active ratio {active_heads_ratio} = {active_float:g} active heads (choose "
            f"ratios that are multiples of 1/{num_heads})"
        )
    if shared >= num_heads:
        raise ConversionError(f"{shared} shared heads of {num_heads} leave no head to route")
    if active <= shared:
        raise ConversionError(
            f"--active_heads_ratio {active_heads_ratio} ({active} heads) must exceed --shared_heads_ratio "
            f"{shared_heads_ratio} ({shared} heads): it counts shared + routed heads, and at least one routed head "
            "must be active"
        )
    return shared, active - shared


# --------------------------------------------------------------------------------------------------------------------
# reading the source


@dataclass
class TensorEntry:
    name: str
    dtype: str  # safetensors dtype string: F32, BF16, ...
    shape: tuple[int, ...]
    start: int = 0  # absolute byte range in the source file (zeros for added tensors: start == end == 0)
    end: int = 0
    added: bool = False  # written as zeros (Qwen2's o_proj bias)

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * FLOAT_DTYPES.get(self.dtype, 1) if self.added else self.end - self.start


@dataclass
class ShardPlan:
    filename: str
    source_path: str
    metadata: dict
    tensors: list[TensorEntry] = field(default_factory=list)  # output order: source tensors by offset, then added

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.tensors)


@dataclass
class ConversionPlan:
    input_dir: str
    source_model_type: str
    source_config: typing.Any
    config: typing.Any  # MoHLlamaConfig
    shards: list[ShardPlan]
    indexed: bool  # sharded with an index file (else one model.safetensors)
    copy_files: list[str]
    notes: list[str]

    @property
    def total_bytes(self) -> int:
        return sum(s.nbytes for s in self.shards)


def _read_shard(path: str, filename: str) -> ShardPlan:
    header, data_start = read_header(path, ConversionError)
    metadata = header.pop("__metadata__", None) or {}
    tensors = []
    for name, info in header.items():
        begin, end = info["data_offsets"]
        tensors.append(TensorEntry(name, info["dtype"], tuple(info["shape"]), data_start + begin, data_start + end))
    tensors.sort(key=lambda t: t.start)
    return ShardPlan(filename, path, metadata, tensors)


def _source_config(input_dir: str):
    from transformers import AutoConfig

    config_path = os.path.join(input_dir, CONFIG_NAME)
    if not os.path.isdir(input_dir):
        raise ConversionError(f"--input_dir {input_dir} is not a directory")
    if not os.path.isfile(config_path):
        raise ConversionError(f"{input_dir} is not a Transformers checkpoint: no {CONFIG_NAME}")
    try:
        with open(config_path) as f:
            model_type = json.load(f).get("model_type")
    except (json.JSONDecodeError, AttributeError) as e:
        raise ConversionError(f"{config_path} is not a valid JSON config ({e})") from None
    if model_type == "moh_llama":
        raise ConversionError(f"{input_dir} is already a moh_llama (Mixture-of-Head) checkpoint")
    if model_type not in SOURCE_MODEL_TYPES:
        raise ConversionError(
            f"model_type {model_type!r} in {config_path} is not a LLaMA-family model; the converter accepts "
            f"{', '.join(SOURCE_MODEL_TYPES)} (same attention: q/k/v/o projections, RoPE, GQA)"
        )
    try:
        return AutoConfig.from_pretrained(input_dir), model_type
    except (OSError, TypeError, ValueError) as e:
        raise ConversionError(f"invalid {model_type} config {config_path}: {e}") from None


def _check_attention(config, model_type: str) -> None:
    """moh_llama is Llama: refuse sliding-window attention, which it would silently drop."""
    context = config.max_position_embeddings
    window = getattr(config, "sliding_window", None)
    if model_type == "mistral" and window is not None and window < context:
        raise ConversionError(
            f"this Mistral checkpoint uses sliding-window attention (sliding_window={window} < "
            f"max_position_embeddings={context}); moh_llama has full attention, so the converted model would differ "
            "on sequences longer than the window"
        )
    if model_type == "qwen2":
        sliding = [i for i, kind in enumerate(getattr(config, "layer_types", None) or []) if kind != "full_attention"]
        if sliding or getattr(config, "use_sliding_window", False):
            raise ConversionError(
                f"this Qwen2 checkpoint uses sliding-window attention in layers {sliding or 'some'}; moh_llama has "
                "full attention everywhere"
            )


def _moh_config(source_config, model_type: str, shared: int, routed_active: int, aux_loss_coef: float):
    from transformers import LlamaConfig

    from .models.moh_llama import MoHLlamaConfig

    bookkeeping = {"model_type", "architectures", "transformers_version", "_name_or_path"}  # not architecture
    llama_fields = set(LlamaConfig().to_dict()) - bookkeeping
    source = source_config.to_dict()
    fields = {k: v for k, v in source.items() if k in llama_fields}
    dropped = {k: source[k] for k in sorted(source) if k not in llama_fields and k not in bookkeeping}
    if model_type == "qwen2":
        fields["attention_bias"] = True  # Qwen2: q/k/v biases; Llama's flag also adds an o_proj bias (zero here)
        fields["mlp_bias"] = False
    fields["head_dim"] = getattr(source_config, "head_dim", None) or (
        source_config.hidden_size // source_config.num_attention_heads
    )
    try:
        config = MoHLlamaConfig(
            **fields,
            moh_shared_heads=shared,
            moh_active_heads=routed_active,
            moh_router="l2",
            moh_straight_through=True,
            moh_aux_loss_coef=aux_loss_coef,
        )
    except (TypeError, ValueError) as e:
        raise ConversionError(f"the source config does not make a valid moh_llama config: {e}") from None
    config.architectures = ["MoHLlamaForCausalLM"]
    return config, dropped


def _expected_shapes(config) -> dict[str, tuple[int, ...]]:
    import torch

    from .models.moh_llama import MoHLlamaForCausalLM

    with torch.device("meta"):
        model = MoHLlamaForCausalLM(config)
    return {name: tuple(t.shape) for name, t in model.state_dict().items()}


def plan_conversion(
    input_dir: str, shared_heads_ratio: float = 0.5, active_heads_ratio: float = 0.75, moh_aux_loss_coef: float = 0.01
) -> ConversionPlan:
    """Read and check the source (config, index, every shard's header); nothing is written."""
    source_config, model_type = _source_config(input_dir)
    _check_attention(source_config, model_type)
    heads = source_config.num_attention_heads
    shared, routed_active = head_split(heads, shared_heads_ratio, active_heads_ratio)
    config, dropped_fields = _moh_config(source_config, model_type, shared, routed_active, moh_aux_loss_coef)
    notes = []
    if dropped_fields:
        notes.append("config fields without a Llama equivalent, dropped: " +
                     ", ".join(f"{k}={v!r}" for k, v in dropped_fields.items()))  # fmt: skip

    shard_names, weight_map = weight_files(input_dir, ConversionError)
    shards = [_read_shard(os.path.join(input_dir, name), name) for name in shard_names]

    # the index and the shards must agree
    seen: dict[str, str] = {}
    for shard in shards:
        for t in shard.tensors:
            if t.name in seen:
                raise ConversionError(f"tensor {t.name} is stored twice: in {seen[t.name]} and {shard.filename}")
            seen[t.name] = shard.filename
    if weight_map is not None:
        absent = [(n, s) for n, s in weight_map.items() if seen.get(n) != s]
        if absent:
            shown = "; ".join(f"{n} (index: {s}, found in: {seen.get(n, 'no shard')})" for n, s in absent[:3])
            raise ConversionError(f"{SAFE_INDEX_NAME} names {len(absent)} tensor(s) absent from their shard: {shown}")
        unlisted = sorted(set(seen) - set(weight_map))
        if unlisted:
            raise ConversionError(
                f"{len(unlisted)} tensor(s) are in shards but not in {SAFE_INDEX_NAME}: {', '.join(unlisted[:3])}"
            )

    # every tensor must be a float weight of the right shape, and every weight must be there
    expected = _expected_shapes(config)
    optional = {"lm_head.weight"} if config.tie_word_embeddings else set()
    added_names = set()
    if model_type == "qwen2":
        added_names = {f"model.layers.{i}.self_attn.o_proj.bias" for i in range(config.num_hidden_layers)}
    dropped_tensors = []
    for shard in shards:
        kept = []
        for t in shard.tensors:
            if t.name.endswith(DROPPED_TENSOR_SUFFIXES):
                dropped_tensors.append(t.name)
                continue
            if t.name not in expected or t.name in added_names:
                raise ConversionError(
                    f"tensor {t.name} (in {shard.filename}) is not a weight of a {model_type} model with this config "
                    "(a quantized, adapter or other-architecture checkpoint?)"
                )
            if t.dtype not in FLOAT_DTYPES:
                raise ConversionError(
                    f"tensor {t.name} has dtype {t.dtype}: only float checkpoints (F32, F16, BF16) are converted "
                    "(quantized weights are not)"
                )
            if t.shape != expected[t.name]:
                raise ConversionError(
                    f"shape mismatch: {t.name} is {list(t.shape)} in {shard.filename}, but the config "
                    f"(hidden {config.hidden_size}, {config.num_attention_heads} heads, {config.num_key_value_heads} "
                    f"key/value heads, head_dim {config.head_dim}) implies {list(expected[t.name])}"
                )
            kept.append(t)
        shard.tensors = kept
    present = {t.name for s in shards for t in s.tensors}
    missing = sorted(set(expected) - present - optional - added_names)
    if missing:
        shown = ", ".join(missing[:5])
        raise ConversionError(f"the checkpoint lacks {len(missing)} tensor(s) the config needs: {shown}")
    if dropped_tensors:
        notes.append(f"dropped {len(dropped_tensors)} rotary inv_freq buffer(s) (recomputed from the config)")

    # Qwen2: zero o_proj biases next to each o_proj weight
    if added_names:
        for shard in shards:
            for t in list(shard.tensors):
                if t.name.endswith(".self_attn.o_proj.weight"):
                    name = t.name[: -len("weight")] + "bias"
                    shard.tensors.append(TensorEntry(name, t.dtype, (t.shape[0],), added=True))
        notes.append(f"added {len(added_names)} zero o_proj biases (Qwen2 q/k/v biases -> Llama attention_bias=True)")

    weight_names = {SAFE_INDEX_NAME, *shard_names}
    copy_files, skipped = [], []
    for name in sorted(os.listdir(input_dir)):
        path = os.path.join(input_dir, name)
        if name in weight_names or name in (CONFIG_NAME, RECORD_NAME) or name.startswith("."):
            continue
        if os.path.isfile(path) and not name.endswith(PICKLE_SUFFIXES) and not name.endswith(".safetensors"):
            copy_files.append(name)
        else:
            skipped.append(name + ("/" if os.path.isdir(path) else ""))
    if skipped:
        notes.append(f"not copied: {', '.join(skipped)}")
    return ConversionPlan(input_dir, model_type, source_config, config, shards, weight_map is not None, copy_files,
                          notes)  # fmt: skip


# --------------------------------------------------------------------------------------------------------------------
# writing


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
        written = _read_shard(os.path.join(directory, shard.filename), shard.filename)
        got = {t.name: (t.dtype, t.shape) for t in written.tensors}
        want = {t.name: (t.dtype, t.shape) for t in shard.tensors}
        if got != want:
            raise ConversionError(f"written shard {shard.filename} does not match the plan")


def _output_state(output_dir: str, overwrite: bool) -> bool:
    """True when output_dir exists (and may be replaced). Refuses a non-empty one without overwrite."""
    if os.path.lexists(output_dir) and not os.path.isdir(output_dir):
        raise ConversionError(f"--output_dir {output_dir} exists and is not a directory")
    if os.path.isdir(output_dir) and os.listdir(output_dir) and not overwrite:
        raise ConversionError(f"--output_dir {output_dir} exists and is not empty; pass --overwrite to replace it")
    return os.path.isdir(output_dir)


def _check_paths(input_dir: str, output_dir: str) -> None:
    if overlapping(input_dir, output_dir):
        raise ConversionError(f"--output_dir {output_dir} must not be --input_dir, inside it, or contain it")


# --------------------------------------------------------------------------------------------------------------------
# verification


@contextlib.contextmanager
def all_heads_active(model):
    """Every MoH head router of `model` (a MoH-LLaMA, PeftModel or DDP wrapper of one) activates all its routed heads
    inside the block: with straight-through gates the model then computes the dense parent exactly."""
    routers = [m.head_router for m in model.modules() if getattr(m, "head_router", None) is not None]
    saved = [r.active_heads for r in routers]
    try:
        for router in routers:
            router.active_heads = router.routed_heads
        yield model
    finally:
        for router, active in zip(routers, saved):
            router.active_heads = active


def _probe_ids(directory: str, config, probe_text: str | None, rows: int = 2, length: int = 64):
    import torch

    length = min(length, config.max_position_embeddings)
    try:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(directory)
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


def verify_conversion(source_dir: str, converted_dir: str, probe_text: str | None = None) -> dict:
    """Load the source, then the converted model (one at a time, checkpoint dtype, CPU) and compare on a probe batch.

    Returns `all_heads_max_abs_diff` (converted with every head active vs source; must be ~0), `all_heads_equal`,
    and with routing on: `routed_max_abs_diff`, `routed_mean_abs_diff`, `routed_top1_agreement`, `source_probe_ppl`,
    `routed_probe_ppl`.
    """
    import gc

    import torch
    import torch.nn.functional as F
    from transformers import AutoModelForCausalLM

    from .models.moh_llama import MoHLlamaForCausalLM

    def nll(logits, ids):
        return F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1)).item()

    source = AutoModelForCausalLM.from_pretrained(source_dir, dtype="auto").eval()
    ids, probe_kind = _probe_ids(source_dir, source.config, probe_text)
    with torch.no_grad():
        reference = source(ids).logits.float()
    dtype = next(source.parameters()).dtype
    del source
    gc.collect()

    converted, info = MoHLlamaForCausalLM.from_pretrained(converted_dir, dtype="auto", output_loading_info=True)
    converted.eval()
    problems = {k: v for k, v in info.items() if v and k in ("missing_keys", "unexpected_keys", "mismatched_keys")}
    if problems:
        raise ConversionError(f"the converted checkpoint does not load cleanly: {problems}")
    with torch.no_grad():
        with all_heads_active(converted):
            dense = converted(ids).logits.float()
        routed = converted(ids).logits.float()
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
        "routed_max_abs_diff": (routed - reference).abs().max().item(),
        "routed_mean_abs_diff": (routed - reference).abs().mean().item(),
        "routed_top1_agreement": (routed.argmax(-1) == reference.argmax(-1)).float().mean().item(),
        "source_probe_ppl": math.exp(min(nll(reference, ids), 50.0)),
        "routed_probe_ppl": math.exp(min(nll(routed, ids), 50.0)),
    }


# --------------------------------------------------------------------------------------------------------------------
# the conversion


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

    @property
    def active_heads(self) -> int:
        return self.shared_heads + self.routed_active_heads

    def format(self) -> str:
        h, s, k = self.num_heads, self.shared_heads, self.routed_active_heads
        lines = [
            f"converted {self.source_model_type} -> moh_llama: {self.input_dir} -> {self.output_dir}",
            f"  heads per layer: {h} ({self.num_key_value_heads} key/value), {s} shared + {k} of {h - s} routed "
            f"active = {self.active_heads}/{h} ({100 * self.active_heads / h:.1f}%); router l2, straight-through; "
            f"{self.num_layers} layers",
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
                f"perplexity {v['source_probe_ppl']:.2f} -> {v['routed_probe_ppl']:.2f} (continue-tune to recover)"
            )
        return "\n".join(lines)


def convert(
    input_dir: str,
    output_dir: str,
    shared_heads_ratio: float = 0.5,
    active_heads_ratio: float = 0.75,
    overwrite: bool = False,
    verify_logits: bool = True,
    probe_text: str | None = None,
    moh_aux_loss_coef: float = 0.01,
    progress: bool = True,
) -> ConversionReport:
    """Convert `input_dir` (llama / mistral / qwen2, safetensors) into a moh_llama checkpoint at `output_dir`.

    Raises `ConversionError` (nothing written at `output_dir`) for anything it refuses; see the module docstring.
    """
    from tqdm.auto import tqdm

    start = time.time()
    _check_paths(input_dir, output_dir)
    _output_state(output_dir, overwrite)
    plan = plan_conversion(input_dir, shared_heads_ratio, active_heads_ratio, moh_aux_loss_coef)
    existing = os.path.dirname(os.path.abspath(output_dir))
    while not os.path.isdir(existing):
        existing = os.path.dirname(existing)
    free = shutil.disk_usage(existing).free
    if plan.total_bytes > free:
        raise ConversionError(
            f"not enough disk space: {plan.total_bytes / 1e9:.2f} GB needed, {free / 1e9:.2f} GB free"
        )

    temporary = temporary_dir_next_to(output_dir)
    try:
        bar = tqdm(total=plan.total_bytes, unit="B", unit_scale=True, desc="converting", disable=not progress,
                   dynamic_ncols=True)  # fmt: skip
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
            shutil.copy2(os.path.join(input_dir, name), os.path.join(temporary, name))
        _check_written(plan, temporary)
        copy_seconds = time.time() - start
        verification = None
        if verify_logits:
            verification = verify_conversion(input_dir, temporary, probe_text)
            if not verification["all_heads_equal"]:
                raise ConversionError(
                    f"verification failed: with every head active the converted model's logits differ from the "
                    f"source's by {verification['all_heads_max_abs_diff']:.3g} (tolerance "
                    f"{verification['all_heads_tolerance']:.3g})"
                )
        report = ConversionReport(
            input_dir=input_dir, output_dir=output_dir, source_model_type=plan.source_model_type,
            num_layers=plan.config.num_hidden_layers, num_heads=plan.config.num_attention_heads,
            num_key_value_heads=plan.config.num_key_value_heads, shared_heads=plan.config.moh_shared_heads,
            routed_active_heads=plan.config.moh_active_heads, shards=len(plan.shards),
            tensors=sum(len(s.tensors) for s in plan.shards), bytes=plan.total_bytes, seconds=copy_seconds,
            notes=plan.notes, verification=verification,
        )  # fmt: skip
        record = dataclasses.asdict(report)
        record.update(shared_heads_ratio=shared_heads_ratio, active_heads_ratio=active_heads_ratio,
                      input_dir=os.path.abspath(input_dir))  # fmt: skip
        with open(os.path.join(temporary, RECORD_NAME), "w") as f:
            json.dump(record, f, indent=2)
        for name in os.listdir(temporary):
            if not name.endswith(".safetensors"):  # small files; the shards are flushed already
                fsync(os.path.join(temporary, name))
        fsync(temporary)
        _output_state(output_dir, overwrite)  # still allowed (nothing appeared meanwhile)
        replace_dir(temporary, output_dir)
        fsync(os.path.dirname(os.path.abspath(output_dir)))
    except BaseException:
        shutil.rmtree(temporary, ignore_errors=True)
        raise
    return report


# --------------------------------------------------------------------------------------------------------------------
# continue-tuning (mhmoe.train) and the recovery curve


def recovery_curve(output_dir: str, threshold: float = 1.05) -> dict | None:
    """Write recovery_curve.csv / .png (validation perplexity vs training tokens, the dense parent as reference, like
    the MoH paper's Fig. 2) from a continue-tuning run's metrics.jsonl, and return a summary (None without
    validation records)."""
    from .train import METRICS_FILE, _read_metrics

    records = _read_metrics(os.path.join(output_dir, METRICS_FILE))
    references = [r["reference_eval_ppl"] for r in records if "reference_eval_ppl" in r]
    dense = references[-1] if references else None
    by_step = {r["step"]: r for r in records if "eval_ppl" in r}
    if not by_step:
        return None
    rows = [by_step[step] for step in sorted(by_step)]
    with open(os.path.join(output_dir, RECOVERY_CSV), "w") as f:
        f.write("step,tokens,eval_loss,eval_ppl,dense_ppl,ppl_over_dense\n")
        for r in rows:
            ratio = r["eval_ppl"] / dense if dense else float("nan")
            f.write(f"{r['step']},{r.get('tokens', '')},{r['eval_loss']:.6f},{r['eval_ppl']:.6f},"
                    f"{dense if dense else ''},{ratio:.6f}\n")  # fmt: skip
    _plot_recovery(rows, dense, threshold, os.path.join(output_dir, RECOVERY_PNG))
    summary = {
        "dense_ppl": dense,
        "start_ppl": rows[0]["eval_ppl"] if rows[0]["step"] == 0 else None,
        "final_ppl": rows[-1]["eval_ppl"],
        "final_tokens": rows[-1].get("tokens"),
        "final_step": rows[-1]["step"],
        "threshold": threshold,
    }
    if dense:
        summary["final_ratio"] = rows[-1]["eval_ppl"] / dense
        summary["recovered"] = summary["final_ratio"] <= threshold
        within = [r.get("tokens") for r in rows if r["eval_ppl"] <= threshold * dense and r["step"] > 0]
        summary["tokens_to_recover"] = within[0] if within else None
    return summary


def _plot_recovery(rows: list[dict], dense: float | None, threshold: float, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.5, 4))
    tokens = [r.get("tokens", r["step"]) for r in rows]
    ax.plot(tokens, [r["eval_ppl"] for r in rows], "o-", label="MoH (continue-tuned)")
    if dense:
        ax.axhline(dense, color="k", label=f"dense parent ({dense:.2f})")
        ax.axhline(dense * threshold, color="k", ls="--", alpha=0.6, label=f"{threshold:g} × dense")
    ax.set_xlabel("continue-tuning tokens")
    ax.set_ylabel("validation perplexity")
    ax.set_title("Recovery of the converted MoH model")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def format_recovery(summary: dict) -> str:
    if summary.get("dense_ppl") is None:
        return f"recovery: validation perplexity {summary['final_ppl']:.3f} after {summary['final_tokens']} tokens"
    dense = summary["dense_ppl"]
    parts = [f"recovery: dense parent perplexity {dense:.3f}"]
    if summary.get("start_ppl") is not None:
        parts.append(f"converted, before tuning {summary['start_ppl']:.3f} (×{summary['start_ppl'] / dense:.3f})")
    parts.append(f"after {summary['final_tokens']:,} tokens {summary['final_ppl']:.3f} (×{summary['final_ratio']:.3f})")
    recovered = summary["tokens_to_recover"]
    parts.append(f"within {summary['threshold']:g}× from {recovered:,} tokens" if recovered is not None else
                 f"not within {summary['threshold']:g}× yet")  # fmt: skip
    return "; ".join(parts)


@dataclass
class ConvertArguments:
    """The conversion (`convert_llama_to_moh.py` also takes every continue-tuning flag of mhmoe-train)."""

    input_dir: str = field(default=None, metadata={"help": "Dense llama / mistral / qwen2 checkpoint (safetensors)."})
    output_dir: str = field(
        default=None,
        metadata={"help": "Where the moh_llama checkpoint goes. With --train_file: the continue-tuned model, metrics, "
                          "checkpoints and recovery curve; the converted (untuned) model is in OUTPUT_DIR/converted."},
    )
    shared_heads_ratio: float = field(default=0.5, metadata={"help": "Fraction of heads shared (the first ones)."})
    active_heads_ratio: float = field(
        default=0.75, metadata={"help": "Fraction of ALL heads active per token (shared + routed), e.g. 0.75."}
    )
    moh_aux_loss_coef: float = field(default=0.01, metadata={"help": "β of the MoH load-balance loss (eq. 7)."})
    overwrite: bool = field(default=False, metadata={"help": "Replace a non-empty --output_dir."})
    skip_logit_check: bool = field(
        default=False,
        metadata={"help": "Skip loading source and converted model to compare logits (for models too large for this "
                          "machine's memory); names, dtypes and shapes are still checked."},
    )
    probe_file: str | None = field(default=None, metadata={"help": "Text for the probe batch of the logit check."})


# the paper's second stage (Table D): AdamW, warmup 50 iterations, cosine 2e-5 -> 1e-6, weight decay 0.1, clip 1.0
CONTINUE_TUNING_DEFAULTS = {
    "learning_rate": 2e-5, "min_learning_rate": 1e-6, "warmup_steps": 50, "lr_scheduler_type": "cosine",
    "weight_decay": 0.1, "max_grad_norm": 1.0, "eval_at_start": True,
}  # fmt: skip
_NOT_CONTINUE_TUNING = ("model_name_or_path", "output_dir", "overwrite_output_dir", "config_overrides",
                        "tokenizer_vocab_size")  # fmt: skip


@functools.cache
def _continue_tune_arguments_class():
    """mhmoe-train's TrainArguments without the model/output fields (set by the converter), paper defaults; built on
    first use (it imports mhmoe.train)."""
    from .train import TrainArguments

    hints = typing.get_type_hints(TrainArguments)
    fields = []
    for f in dataclasses.fields(TrainArguments):
        if f.name in _NOT_CONTINUE_TUNING:
            continue
        default = CONTINUE_TUNING_DEFAULTS.get(f.name, f.default)
        fields.append((f.name, hints[f.name], field(default=default, metadata=f.metadata)))
    return dataclasses.make_dataclass("ContinueTuneArguments", fields)


def continue_tune_arguments(**values):
    return _continue_tune_arguments_class()(**values)


def _check_converted(converted: str, args: ConvertArguments) -> None:
    """A resumed run's converted model must be the one these arguments would make."""
    config_path = os.path.join(converted, CONFIG_NAME)
    if not os.path.isfile(config_path):
        raise ConversionError(f"--resume_from_checkpoint: no converted model in {converted}")
    with open(config_path) as f:
        config = json.load(f)
    want = head_split(config["num_attention_heads"], args.shared_heads_ratio, args.active_heads_ratio)
    got = (config.get("moh_shared_heads"), config.get("moh_active_heads"))
    if config.get("model_type") != "moh_llama" or got != want:
        raise ConversionError(
            f"--resume_from_checkpoint: {converted} holds {got[0]} shared + {got[1]} routed active heads, but the "
            f"ratios ask for {want[0]} + {want[1]}"
        )


def convert_and_continue_tune(args: ConvertArguments, tune, progress: bool = True) -> dict:
    """Convert into OUTPUT_DIR/converted (main process; skipped when resuming), then continue-tune with mhmoe.train into
    OUTPUT_DIR (every process). Returns {"conversion": ConversionReport | None, "train": TrainResult,
    "recovery": summary | None}."""
    from accelerate import PartialState
    from accelerate.utils import broadcast_object_list, parse_flag_from_env

    from .train import TrainArguments, TrainingError, check_arguments, train

    if isinstance(tune, dict):
        tune = continue_tune_arguments(**tune)
    state = PartialState(cpu=parse_flag_from_env("ACCELERATE_USE_CPU"))  # as the Accelerator in mhmoe.train will
    out = args.output_dir
    converted = os.path.join(out, CONVERTED_SUBDIR)
    report, failure = None, None
    if state.is_main_process:
        try:
            if tune.resume_from_checkpoint:
                _check_converted(converted, args)
            else:
                _check_paths(args.input_dir, out)
                _output_state(out, args.overwrite)
                # the training arguments are checked before the conversion, which may take long
                check_arguments(TrainArguments(model_name_or_path=converted, output_dir=out, **dataclasses.asdict(tune),
                                               overwrite_output_dir=args.overwrite), model_given=True)  # fmt: skip
                temporary = temporary_dir_next_to(out)
                try:
                    report = convert(
                        args.input_dir, os.path.join(temporary, CONVERTED_SUBDIR), args.shared_heads_ratio,
                        args.active_heads_ratio, verify_logits=not args.skip_logit_check,
                        probe_text=_read_probe(args.probe_file), moh_aux_loss_coef=args.moh_aux_loss_coef,
                        progress=progress,
                    )  # fmt: skip
                    report.output_dir = converted
                    print(report.format(), flush=True)
                    _output_state(out, args.overwrite)
                    replace_dir(temporary, out)
                except BaseException:
                    shutil.rmtree(temporary, ignore_errors=True)
                    raise
        except Exception as e:  # told to every process before it is raised here, so that none waits forever
            failure = e
    if state.num_processes > 1:
        box = [None if failure is None else f"{type(failure).__name__}: {failure}"]
        broadcast_object_list(box, from_process=0)
        if box[0] is not None and failure is None:
            raise ConversionError(f"the main process failed: {box[0]}")
    if failure is not None:
        raise failure

    train_args = TrainArguments(model_name_or_path=converted, output_dir=out, **dataclasses.asdict(tune))
    validated = bool(train_args.validation_file) or train_args.validation_split_percentage > 0
    if not validated:
        train_args.eval_at_start = False
        state.print("note: no --validation_file / --validation_split_percentage: no perplexity, no recovery curve")
    try:
        result = train(train_args, reference_eval=all_heads_active if validated else None)
    except TrainingError:  # an input problem found before training (e.g. in the data): no half-done output
        if not tune.resume_from_checkpoint and state.is_main_process:
            shutil.rmtree(out, ignore_errors=True)
        raise
    summary = None
    if state.is_main_process and validated:
        summary = recovery_curve(out)
        if summary is not None:
            print(format_recovery(summary), flush=True)
            with open(os.path.join(out, "recovery_summary.json"), "w") as f:
                json.dump(summary, f, indent=2)
    state.wait_for_everyone()
    return {"conversion": report, "train": result, "recovery": summary}


def _read_probe(path: str | None) -> str | None:
    if path is None:
        return None
    try:
        with open(path, encoding="utf-8") as f:
            return f.read()
    except OSError as e:
        raise ConversionError(f"--probe_file {path}: {e.strerror or e}") from None


def build_parser():
    from transformers import HfArgumentParser

    return HfArgumentParser(
        (ConvertArguments, _continue_tune_arguments_class()),
        description="Convert a dense LLaMA / Mistral / Qwen2 checkpoint into MoH-LLaMA (Mixture-of-Head attention, "
        "l2 router, straight-through gates); with --train_file, continue-tune it with mhmoe-train (paper stage-2 "
        "defaults: lr 2e-5 -> 1e-6 cosine, warmup 50, weight decay 0.1, clip 1.0, β 0.01).",
    )


def main(argv: list[str] | None = None) -> None:
    """Console entry point; refusals exit with status 2 and a one-line message, nothing left at --output_dir."""
    from .train import TrainingError

    parser = build_parser()
    args, tune = parser.parse_args_into_dataclasses(args=argv)
    try:
        if not args.input_dir or not args.output_dir:
            raise ConversionError("--input_dir and --output_dir are required")
        if tune.train_file:
            convert_and_continue_tune(args, tune, progress=not tune.disable_tqdm)
        else:
            if tune.resume_from_checkpoint:
                raise ConversionError("--resume_from_checkpoint continues a continue-tuning run: give --train_file")
            if int(os.environ.get("RANK", "0")) > 0:  # launched with several processes: one converts
                return
            report = convert(
                args.input_dir, args.output_dir, args.shared_heads_ratio, args.active_heads_ratio,
                overwrite=args.overwrite, verify_logits=not args.skip_logit_check,
                probe_text=_read_probe(args.probe_file), moh_aux_loss_coef=args.moh_aux_loss_coef,
                progress=not tune.disable_tqdm,
            )  # fmt: skip
            print(report.format(), flush=True)
    except (ConversionError, TrainingError) as e:
        parser.exit(2, f"{parser.prog}: error: {e}\n")
    import torch

    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1:])
