"""Local-corpus perplexity tasks for lm-eval (MH-MoE Tables 1-3): data loading and per-document counts.

The corpus path comes from task metadata (`--metadata '{"c4_path": "/data/c4_val.jsonl"}'` on the command line, or
`TaskManager(metadata=...)`), else from the environment variable `MHMOE_PPL_<CORPUS>` (e.g. `MHMOE_PPL_C4`).
Supported files: `.jsonl`/`.json`/`.json.gz` (one document per record, field `text`, or `page` for wikitext, or
`<corpus>_text_field`), `.parquet`, and plain text (`.txt`/`.raw`: one document per blank-line separated paragraph).
A path may be a glob or a comma-separated list.

Token perplexity needs the model's tokenizer to count the predicted tokens of each document exactly as lm-eval
encodes them: it is taken from the metadata `tokenizer`, else `pretrained` (both merged from `--model_args` by the
CLI), else from the `mhmoe` lm-eval model built in this process. Without any, the task reports word/byte metrics only.
"""

import errno
import glob
import logging
import os
import re

import datasets

log = logging.getLogger(__name__)

DEFAULT_TEXT_FIELD = {"wikitext": "page"}
TEXT_SUFFIXES = (".txt", ".raw", ".text")


def _wikitext_detokenizer(page: str) -> str:
    # lm-eval's own detokenizer, so mhmoe_ppl_wikitext scores the same strings as lm-eval's `wikitext` task
    from lm_eval.tasks.wikitext.preprocess_wikitext import wikitext_detokenizer

    return wikitext_detokenizer({"page": page})


def _as_bool(value):
    if isinstance(value, str):
        return value.strip().lower() in ("1", "true", "yes")
    return None if value is None else bool(value)


def _tokenizer(metadata: dict):
    name = metadata.get("tokenizer") or metadata.get("pretrained")
    if isinstance(name, str) and name:
        try:
            from transformers import AutoTokenizer

            trust = bool(_as_bool(metadata.get("trust_remote_code")))
            return AutoTokenizer.from_pretrained(name, trust_remote_code=trust)
        except Exception as err:  # noqa: BLE001 - fall back to the in-process model's tokenizer
            log.warning("mhmoe_ppl: could not load tokenizer %r for token counts (%s)", name, err)
    try:
        from mhmoe.evaluation.lm_eval_model import active_tokenizer
    except ImportError:
        return None
    return active_tokenizer()


def _data_files(path: str, task: str, key: str) -> list[str]:
    """The files `path` names (comma-separated paths or globs); a missing, unmatched or empty one refused in words,
    prefixed with the task name (mhmoe-eval prints such errors as one line)."""
    files = [p.strip() for p in path.split(",") if p.strip()]
    if not files:
        raise ValueError(f"{task}: {key} is empty; give the validation file's path")
    for pattern in files:
        matched = glob.glob(pattern) if glob.has_magic(pattern) else [pattern]
        if not matched or not all(os.path.isfile(f) for f in matched):
            missing = next((f for f in matched if not os.path.isfile(f)), pattern)
            what = "is a directory, not a file" if os.path.isdir(missing) else "no such file"
            raise ValueError(f"{task}: {key}={missing}: {what}")
        empty = [f for f in matched if os.path.getsize(f) == 0]
        if empty:
            raise ValueError(f"{task}: {key}={empty[0]} is empty (0 bytes): no documents to evaluate")
    return files


def _read(files: list[str], text_field: str) -> datasets.Dataset:
    if all(f.endswith(TEXT_SUFFIXES) for f in files):
        ds = datasets.load_dataset("text", data_files=files, sample_by="paragraph", split="train")
        return ds.rename_column("text", "original") if "text" in ds.column_names else ds
    builder = "parquet" if all(f.endswith(".parquet") for f in files) else "json"
    ds = datasets.load_dataset(builder, data_files=files, split="train")
    if text_field not in ds.column_names:
        raise ValueError(f"field {text_field!r} not in {files} (columns: {ds.column_names})")
    return ds.select_columns([text_field]).rename_column(text_field, "original")


def load_corpus(mhmoe_corpus: str, **metadata) -> datasets.DatasetDict:
    """lm-eval `custom_dataset`: the validation documents of one corpus with the counts the metrics need."""
    key = f"{mhmoe_corpus}_path"
    env = f"MHMOE_PPL_{mhmoe_corpus.upper()}"
    path = metadata.get(key) or os.environ.get(env)
    if not path:
        raise ValueError(
            f"mhmoe_ppl_{mhmoe_corpus}: no data. Give the validation file with --metadata "
            f'\'{{"{key}": "/path/to/{mhmoe_corpus}_validation.jsonl"}}\' or the environment variable {env} '
            "(see eval_tasks/README.md)."
        )
    text_field = metadata.get(f"{mhmoe_corpus}_text_field") or DEFAULT_TEXT_FIELD.get(mhmoe_corpus, "text")
    task = f"mhmoe_ppl_{mhmoe_corpus}"
    where = key if metadata.get(key) else env
    files = _data_files(str(path), task, where)
    try:
        ds = _read(files, text_field)
    except ValueError as e:
        raise ValueError(f"{task}: {e}") from None
    except Exception as e:  # noqa: BLE001 - datasets' reader errors (DatasetGenerationError, ...): one line
        cause = e.__cause__ or e
        if isinstance(cause, OSError) and cause.errno in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG):
            raise cause from None  # the datasets cache could not be written: the machine's problem, not the data's
        raise ValueError(f"{task}: cannot read {path} ({type(cause).__name__}: {cause})") from None
    ds = ds.filter(lambda doc: bool(doc["original"] and doc["original"].strip()))
    if len(ds) == 0:
        raise ValueError(f"{task}: {path} holds no non-empty documents in field {text_field!r}")

    tokenizer = _tokenizer(metadata)
    add_bos = _as_bool(metadata.get("add_bos_token"))
    special = {} if add_bos is None else {"add_special_tokens": add_bos}
    detok = _wikitext_detokenizer if mhmoe_corpus == "wikitext" else (lambda s: s)

    def counts(doc):
        original = doc["original"]
        text = detok(original)
        out = {
            "text": text,
            # words and bytes of the original document, as lm-eval's wikitext/c4 tasks count them
            "num_words": len(re.split(r"\s+", original)),
            "num_bytes": len(original.encode("utf-8")),
        }
        if tokenizer is not None:  # every token of the document is predicted once by the rolling windows
            out["num_tokens"] = len(tokenizer.encode(text, **special))
        return out

    return datasets.DatasetDict({"validation": ds.map(counts)})


def process_results(doc, results):
    (loglikelihood,) = results
    out = {
        "word_perplexity": (loglikelihood, doc["num_words"]),
        "byte_perplexity": (loglikelihood, doc["num_bytes"]),
        "bits_per_byte": (loglikelihood, doc["num_bytes"]),
    }
    if doc.get("num_tokens"):
        out["token_perplexity"] = (loglikelihood, doc["num_tokens"])
    return out
