"""GGUF input: a LLaMA-family GGUF file dequantised through Transformers' GGUF support into a dense checkpoint.

`dequantise_gguf(input_dir, gguf_file, dense_dir)` writes an ordinary safetensors checkpoint (fp32 weights, config,
tokenizer, generation config) that the converter then reads like any other (source.py, its reader step, yields it to
plan.py, write.py, verify.py). Needs the `gguf` package (`pip install 'mhmoe[gguf]'`). The whole model is dequantised
in memory (fp32) by Transformers; it is not streamed tensor by tensor.
"""

from __future__ import annotations

import os

from .errors import ConversionError

GGUF_MISSING = 'reading a GGUF file needs gguf, which is not installed: pip install "mhmoe[gguf]"'


def _pinned(input_dir: str, gguf_file: str):
    """The folder's files (the GGUF file its only weights) as `trust.pinned` checks them: nothing is read through a
    link out of the folder, nor through a file swapped for one once checked."""
    from .._plumbing.trust import pinned

    return pinned(input_dir, ConversionError, "--input_dir", weights=(gguf_file,))


def check_gguf_source(input_dir: str, gguf_file: str) -> str:
    """The GGUF file's path; refuses a missing package, file or a non-GGUF file (one line each)."""
    try:
        import gguf  # noqa: F401
    except ImportError:
        raise ConversionError(GGUF_MISSING) from None
    if os.path.basename(gguf_file) != gguf_file:
        raise ConversionError(f"--gguf_file {gguf_file} must be a file name inside --input_dir {input_dir}")
    path = os.path.join(input_dir, gguf_file)
    with _pinned(input_dir, gguf_file) as source:
        if not os.path.isfile(os.path.join(source.path, gguf_file)):
            raise ConversionError(f"--gguf_file {gguf_file}: no such file in --input_dir {input_dir}")
        with open(os.path.join(source.path, gguf_file), "rb") as f:
            if f.read(4) != b"GGUF":
                raise ConversionError(f"{path} is not a GGUF file (no GGUF magic number)")
    return path


def gguf_config(input_dir: str, gguf_file: str):
    """The config of the GGUF file's model (read from its metadata, no weights), refusing other model types."""
    from transformers import AutoConfig

    from .plan import SOURCE_MODEL_TYPES

    try:
        with _pinned(input_dir, gguf_file) as source:
            config = AutoConfig.from_pretrained(source.path, gguf_file=gguf_file, trust_remote_code=False)
    except (OSError, ValueError, KeyError, RuntimeError) as e:
        if isinstance(e, ConversionError):
            raise
        raise ConversionError(f"cannot read the GGUF file {gguf_file}: {str(e).splitlines()[0]}") from None
    if config.model_type not in SOURCE_MODEL_TYPES:
        raise ConversionError(
            f"the GGUF file {gguf_file} holds a {config.model_type!r} model; the converter accepts "
            f"{', '.join(SOURCE_MODEL_TYPES)}"
        )
    return config


def dequantise_gguf(input_dir: str, gguf_file: str, dense_dir: str) -> list[str]:
    """Write the GGUF model of `input_dir/gguf_file` as a dense fp32 safetensors checkpoint into `dense_dir` (a new,
    empty folder) with its tokenizer, read from the folder's files as checked (`trust.pinned`). Returns notes for the
    conversion report."""
    check_gguf_source(input_dir, gguf_file)
    config = gguf_config(input_dir, gguf_file)
    with _pinned(input_dir, gguf_file) as source:  # errors name input_dir
        return _dequantise(source.path, gguf_file, dense_dir, config)


def _dequantise(input_dir: str, gguf_file: str, dense_dir: str, config) -> list[str]:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    try:
        model = AutoModelForCausalLM.from_pretrained(
            input_dir, gguf_file=gguf_file, dtype=torch.float32, trust_remote_code=False
        )
    except (OSError, ValueError, KeyError, RuntimeError, NotImplementedError) as e:
        raise ConversionError(f"cannot dequantise {gguf_file}: {str(e).splitlines()[0]}") from None
    model.hf_quantizer = None  # dequantised fp32 weights: nothing is quantised any more
    for cfg in (model.config, config):
        if hasattr(cfg, "quantization_config"):
            del cfg.quantization_config
    model.save_pretrained(dense_dir)
    del model
    notes = [f"dequantised {gguf_file} (GGUF) to float32 through Transformers' GGUF support"]
    try:
        tokenizer = AutoTokenizer.from_pretrained(input_dir, gguf_file=gguf_file, trust_remote_code=False)
        tokenizer.save_pretrained(dense_dir)
    except (OSError, ValueError, KeyError, TypeError, RuntimeError) as e:
        notes.append(f"no tokenizer in the GGUF file ({type(e).__name__}): the probe uses random token ids")
    return notes


__all__ = ["GGUF_MISSING", "check_gguf_source", "dequantise_gguf", "gguf_config"]
