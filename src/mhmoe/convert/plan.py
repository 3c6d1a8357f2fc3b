"""Read a dense LLaMA-family checkpoint and plan its conversion into moh_llama; nothing is written here.

`plan_conversion(input_dir, ...)` reads the config (model_type llama, mistral or qwen2), the index and every shard's
safetensors header, and returns a `ConversionPlan`: the moh_llama config (the source's Llama fields + the recipe's MoH
fields, recipe.py) and, shard by shard, the byte ranges to copy. Qwen2's q/k/v biases map onto Llama's
`attention_bias=True`, which also wants an o_proj bias: a zero one is planned (outputs unchanged).

Refused in words (`ConversionError`): a model type outside the LLaMA family, sliding-window attention (moh_llama has
none), missing or truncated shards, an index naming tensors a shard lacks, unknown / non-float / wrongly shaped
tensors, missing tensors, pickle-only checkpoints (never unpickled), ratios without an integer head split.
"""

from __future__ import annotations

import math
import os
import typing
from dataclasses import dataclass, field

from transformers.utils import CONFIG_NAME

from .._plumbing.checkpoint_files import SAFE_INDEX_NAME, read_header, read_model_type, side_files, weight_files
from .._plumbing.trust import pinned
from .errors import ConversionError
from .recipe import (
    ACTIVE_HEADS_RATIO,
    AUX_LOSS_COEF,
    SHARED_HEADS_RATIO,
    check_aux_loss_coef,
    head_split,
    moh_fields,
)

SOURCE_MODEL_TYPES = ("llama", "mistral", "qwen2")
RECORD_NAME = "moh_conversion.json"
DROPPED_TENSOR_SUFFIXES = ("rotary_emb.inv_freq",)  # buffers some old checkpoints carry; recomputed from the config
FLOAT_DTYPES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2}


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
    input_dir: str  # where the source's files are read: their pinned copy (`trust.pinned`), not the folder given
    source_model_type: str
    source_config: typing.Any
    config: typing.Any  # MoHLlamaConfig
    shards: list[ShardPlan]
    indexed: bool  # sharded with an index file (else one model.safetensors)
    copy_files: list[str]
    notes: list[str]
    source: typing.Any = None  # trust.Pinned: the source's files as checked (input_dir is where they are read)

    @property
    def total_bytes(self) -> int:
        return sum(s.nbytes for s in self.shards)


def read_shard(path: str, filename: str) -> ShardPlan:
    header, data_start = read_header(path, ConversionError)
    metadata = header.pop("__metadata__", None) or {}
    tensors = []
    for name, info in header.items():
        begin, end = info["data_offsets"]
        tensors.append(TensorEntry(name, info["dtype"], tuple(info["shape"]), data_start + begin, data_start + end))
    tensors.sort(key=lambda t: t.start)
    return ShardPlan(filename, path, metadata, tensors)


def _check_source(input_dir: str) -> None:
    if not os.path.isdir(input_dir):
        raise ConversionError(f"--input_dir {input_dir} is not a directory")
    if not os.path.isfile(os.path.join(input_dir, CONFIG_NAME)):
        raise ConversionError(f"{input_dir} is not a Transformers checkpoint: no {CONFIG_NAME}")


def _source_config(input_dir: str):
    """(config, model type) of the source, read from its pinned files."""
    from transformers import AutoConfig

    config_path = os.path.join(input_dir, CONFIG_NAME)
    model_type = read_model_type(config_path, ConversionError)
    if model_type == "moh_llama":
        raise ConversionError(f"{input_dir} is already a moh_llama (Mixture-of-Head) checkpoint")
    if model_type not in SOURCE_MODEL_TYPES:
        raise ConversionError(
            f"model_type {model_type!r} in {config_path} is not a LLaMA-family model; the converter accepts "
            f"{', '.join(SOURCE_MODEL_TYPES)} (same attention: q/k/v/o projections, RoPE, GQA)"
        )
    try:
        return AutoConfig.from_pretrained(input_dir, trust_remote_code=False), model_type
    except Exception as e:  # OSError, TypeError, ValueError; huggingface_hub's StrictDataclass*Error (not ValueErrors)
        if not _config_error(e):
            raise
        raise ConversionError(f"invalid {model_type} config {config_path}: {_one_line(e)}") from None


def _config_error(e: Exception) -> bool:
    """An error a config's values cause: TypeError/ValueError/OSError, or huggingface_hub's validation errors."""
    return isinstance(e, (OSError, TypeError, ValueError)) or type(e).__module__.split(".")[0] == "huggingface_hub"


def _one_line(e: Exception) -> str:
    """An error's message on one line (huggingface_hub's validation errors span several, the cause indented last)."""
    return " ".join(line.strip() for line in str(e).splitlines() if line.strip()) or type(e).__name__


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

    from ..models.moh_llama import MoHLlamaConfig

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
        config = MoHLlamaConfig(**fields, **moh_fields(shared, routed_active, aux_loss_coef))
    except Exception as e:
        if not _config_error(e):
            raise
        raise ConversionError(f"the source config does not make a valid moh_llama config: {_one_line(e)}") from None
    config.architectures = ["MoHLlamaForCausalLM"]
    return config, dropped


def _expected_shapes(config) -> dict[str, tuple[int, ...]]:
    import torch

    from ..models.moh_llama import MoHLlamaForCausalLM

    with torch.device("meta"):
        model = MoHLlamaForCausalLM(config)
    return {name: tuple(t.shape) for name, t in model.state_dict().items()}


def _check_index(shards: list[ShardPlan], weight_map: dict | None) -> None:
    """The index and the shards must agree."""
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


def _check_tensors(shards: list[ShardPlan], config, model_type: str, added_names: set[str]) -> list[str]:
    """Every tensor must be a float weight of the right shape, and every weight must be there. Drops the rotary
    buffers from the shards' plans and returns their names."""
    expected = _expected_shapes(config)
    optional = {"lm_head.weight"} if config.tie_word_embeddings else set()
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
    return dropped_tensors


def _add_zero_biases(shards: list[ShardPlan]) -> None:
    """Qwen2: a zero o_proj bias next to each o_proj weight."""
    for shard in shards:
        for t in list(shard.tensors):
            if t.name.endswith(".self_attn.o_proj.weight"):
                name = t.name[: -len("weight")] + "bias"
                shard.tensors.append(TensorEntry(name, t.dtype, (t.shape[0],), added=True))


def plan_added_tensors(plan: ConversionPlan, prefix: str, shapes: dict[str, tuple[int, ...]]) -> dict:
    """Plan new per-layer tensors `model.layers.{i}.<prefix><key>` of `shapes[key]`, written as zeros in the shard
    and dtype of the layer's o_proj weight (a calibrated recipe fills them after writing). Returns each name's torch
    dtype."""
    import re

    import torch

    torch_dtypes = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}
    o_proj = re.compile(r"^model\.layers\.(\d+)\.self_attn\.o_proj\.weight$")
    dtypes = {}
    for shard in plan.shards:
        for t in list(shard.tensors):
            match = o_proj.match(t.name)
            if match is None:
                continue
            for key, shape in shapes.items():
                name = f"model.layers.{match[1]}.{prefix}{key}"
                shard.tensors.append(TensorEntry(name, t.dtype, tuple(shape), added=True))
                dtypes[name] = torch_dtypes[t.dtype]
    return dtypes


def _files_to_copy(input_dir: str, pinned_dir: str) -> tuple[list[str], list[str]]:
    """(files copied beside the weights: generation config, tokenizer, chat template; notes on what is not copied).
    Never code, never a symbolic link out of the folder (`_plumbing.checkpoint_files.side_files`): the files are those
    of the pinned copy (as checked), the notes say what of the folder given is left out."""
    return side_files(pinned_dir)[0], side_files(input_dir)[1]


def plan_conversion(
    input_dir: str,
    shared_heads_ratio: float = SHARED_HEADS_RATIO,
    active_heads_ratio: float = ACTIVE_HEADS_RATIO,
    moh_aux_loss_coef: float = AUX_LOSS_COEF,
    shared_heads: int | None = None,
    active_heads: int | None = None,
    trust_remote_code: bool = False,
) -> ConversionPlan:
    """Read and check the source (config, index, every shard's header); nothing is written. `shared_heads` /
    `active_heads`: counts instead of the ratios (`recipe.head_split`). The source's files are pinned
    (`trust.pinned`: opened once and checked, never through a link out of the folder; its Python files only with
    `trust_remote_code`) and read from there: the plan's `input_dir`, kept while the plan lives (`source`)."""
    check_aux_loss_coef(moh_aux_loss_coef)
    _check_source(input_dir)
    source = pinned(input_dir, ConversionError, "--input_dir", code=trust_remote_code)
    with source.renaming():  # errors name the folder given
        plan = _plan(
            source.path,
            source.folder,  # the folder given (also when input_dir is a pinned copy already)
            shared_heads_ratio,
            active_heads_ratio,
            moh_aux_loss_coef,
            shared_heads,
            active_heads,
        )
    plan.source = source
    return plan


def _plan(
    pinned_dir: str,
    input_dir: str,
    shared_heads_ratio,
    active_heads_ratio,
    moh_aux_loss_coef,
    shared_heads,
    active_heads,
) -> ConversionPlan:
    """`plan_conversion` of the files pinned in `pinned_dir`; `input_dir` (the folder given) only for the notes."""
    source_config, model_type = _source_config(pinned_dir)
    _check_attention(source_config, model_type)
    heads = source_config.num_attention_heads
    shared, routed_active = head_split(heads, shared_heads_ratio, active_heads_ratio, shared_heads, active_heads)
    config, dropped_fields = _moh_config(source_config, model_type, shared, routed_active, moh_aux_loss_coef)
    notes = []
    if dropped_fields:
        notes.append(
            "config fields without a Llama equivalent, dropped: "
            + ", ".join(f"{k}={v!r}" for k, v in dropped_fields.items())
        )

    shard_names, weight_map = weight_files(pinned_dir, ConversionError)
    shards = [read_shard(os.path.join(pinned_dir, name), name) for name in shard_names]
    _check_index(shards, weight_map)
    added_names = set()
    if model_type == "qwen2":
        added_names = {f"model.layers.{i}.self_attn.o_proj.bias" for i in range(config.num_hidden_layers)}
    dropped_tensors = _check_tensors(shards, config, model_type, added_names)
    if dropped_tensors:
        notes.append(f"dropped {len(dropped_tensors)} rotary inv_freq buffer(s) (recomputed from the config)")
    if added_names:
        _add_zero_biases(shards)
        notes.append(f"added {len(added_names)} zero o_proj biases (Qwen2 q/k/v biases -> Llama attention_bias=True)")

    copy_files, copy_notes = _files_to_copy(input_dir, pinned_dir)
    notes += copy_notes
    return ConversionPlan(
        pinned_dir, model_type, source_config, config, shards, weight_map is not None, copy_files, notes
    )
