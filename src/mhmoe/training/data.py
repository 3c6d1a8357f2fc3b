"""Local text data for training: read text/JSONL files, train a small byte-level BPE tokenizer, pack into blocks.

Everything here runs offline. A `.jsonl` (or `.json` lines / array) file gives one document per record (the
`text_field` of each object); any other file is plain text and is one document. Documents are tokenised, each is
followed by the tokenizer's EOS token, all are concatenated and cut into `block_size` blocks; the remainder that does
not fill a block is dropped.

`order_by_similarity` is Lory's similarity-based data batching (Zhong et al. 2024, after in-context pretraining, Shi
et al. 2023): documents are put in an order where neighbours are similar before packing, so a block that crosses a
document boundary continues with related text and a segment routed on the previous segment (router_type="lory")
still gets a relevant routing. `mhmoe-train --similarity_batching` applies it to the training documents.
"""

from __future__ import annotations

import json
import os
import re
import zlib
from collections.abc import Iterable, Sequence

import torch

JSON_SUFFIXES = (".jsonl", ".json", ".ndjson")
_LINES_PER_CHUNK = 512  # plain text is tokenised in chunks of lines (the Rust tokenizer batches them)


def read_documents(path: str, text_field: str = "text") -> list[str]:
    """The documents of one file. Raises `FileNotFoundError` / `ValueError` with the path and what is wrong."""
    if not os.path.isfile(path):
        raise FileNotFoundError(f"data file not found: {path}")
    with open(path, encoding="utf-8") as f:
        content = f.read()
    if not path.lower().endswith(JSON_SUFFIXES):
        return [content] if content.strip() else []
    stripped = content.lstrip()
    if stripped.startswith("["):  # a JSON array of records
        try:
            records = json.loads(content)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}: not valid JSON ({e})") from None
        numbered = enumerate(records, start=1)
    else:
        numbered = []
        for number, line in enumerate(content.splitlines(), start=1):
            if not line.strip():
                continue
            try:
                numbered.append((number, json.loads(line)))
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}, line {number}: not valid JSON ({e})") from None
    documents = []
    for number, record in numbered:
        if isinstance(record, str):
            text = record
        elif isinstance(record, dict) and text_field in record:
            text = record[text_field]
        elif isinstance(record, dict) and ("messages" in record or {"prompt", "completion"} <= set(record)):
            raise ValueError(
                f"{path}, record {number}: a chat or prompt-completion record; --train_file reads text only: pass the "
                f"file as --dataset {path} (assistant/completion-only loss, the tokenizer's chat template)"
            )
        else:
            keys = sorted(record) if isinstance(record, dict) else type(record).__name__
            raise ValueError(f"{path}, record {number}: no text field {text_field!r} (has {keys}); set --text_field")
        if not isinstance(text, str):
            raise ValueError(f"{path}, record {number}: field {text_field!r} is {type(text).__name__}, not a string")
        if text.strip():
            documents.append(text)
    return documents


def read_files(paths: Sequence[str], text_field: str = "text") -> list[str]:
    documents = []
    for path in paths:
        try:
            documents.extend(read_documents(path, text_field))
        except UnicodeDecodeError as e:  # the codec's message names neither the file nor the fix
            raise ValueError(
                f"{path} is not UTF-8 text ({e.reason} at byte {e.start}); compressed files are not read: decompress "
                "it, or save the text as UTF-8"
            ) from None
    return documents


def train_tokenizer(documents: Iterable[str], vocab_size: int, model_max_length: int):
    """A byte-level BPE tokenizer trained on `documents` (`<unk>`=0, `<s>`=1, `</s>`=2, like Llama's ids).

    Returns a Transformers fast tokenizer that `save_pretrained` / `AutoTokenizer.from_pretrained` round-trip. Its pad
    token is `<unk>` (id 0; byte-level BPE never emits it), on the left, so padding (batched generation, Trainer's
    `DataCollatorForLanguageModeling`) works out of the box; not `</s>`: the collator masks pad ids out of the labels,
    and a pad equal to EOS would stop the model from learning to end documents.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    special = ["<unk>", "<s>", "</s>"]
    if vocab_size < 256 + len(special):
        raise ValueError(f"vocab_size {vocab_size} is too small for a byte-level BPE tokenizer (needs >= 259)")
    backend = Tokenizer(models.BPE(unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=special,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    backend.train_from_iterator(_chunks(documents), trainer=trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=backend,
        unk_token="<unk>",
        bos_token="<s>",
        eos_token="</s>",
        pad_token="<unk>",
        padding_side="left",  # a decoder-only model generates after its prompt: batched prompts are padded in front
        model_max_length=model_max_length,
    )


def _chunks(documents: Iterable[str]) -> Iterable[str]:
    for document in documents:
        lines = document.splitlines(keepends=True)
        for start in range(0, len(lines), _LINES_PER_CHUNK):
            yield "".join(lines[start : start + _LINES_PER_CHUNK])


def tokenize_and_pack(documents: Sequence[str], tokenizer, block_size: int) -> torch.Tensor:
    """(num_blocks, block_size) int64 token ids: documents + EOS each, concatenated, cut into full blocks."""
    eos = tokenizer.eos_token_id
    ids: list[int] = []
    for document in documents:
        pieces = list(_chunks([document]))
        for encoded in tokenizer(pieces, add_special_tokens=False, verbose=False)["input_ids"]:
            ids.extend(encoded)
        if eos is not None:
            ids.append(eos)
    num_blocks = len(ids) // block_size
    return torch.tensor(ids[: num_blocks * block_size], dtype=torch.long).view(num_blocks, block_size)


def order_by_similarity(documents: Sequence[str], dim: int = 1024, neighbours: int = 8, block: int = 1024) -> list[str]:
    """`documents` reordered so that consecutive documents are similar (Lory's similarity-based batching).

    Like in-context pretraining (Shi et al. 2023): each document's `neighbours` nearest documents by cosine similarity,
    then one path through that graph, from the first document always to its most similar unvisited neighbour; when
    all its neighbours are visited the path jumps to the first unvisited document. Shi et al. embed with a retriever
    and search approximately; here a document is its TF-IDF vector of words hashed (crc32) into `dim` buckets, and the
    search is exact, in blocks of `block` rows (memory block × n). Deterministic; every document appears once.
    """
    n = len(documents)
    if n <= 2:
        return list(documents)
    counts = torch.zeros(n, dim)
    for i, document in enumerate(documents):
        buckets = [zlib.crc32(word.encode()) % dim for word in re.findall(r"\w+", document.lower())]
        if buckets:
            counts[i].index_add_(0, torch.tensor(buckets), torch.ones(len(buckets)))
    idf = torch.log((1 + n) / (1 + (counts > 0).sum(0).float())) + 1
    vectors = torch.nn.functional.normalize(counts.log1p() * idf, dim=1)  # (n, dim)
    k = min(neighbours, n - 1)
    nearest = torch.empty(n, k, dtype=torch.long)
    for start in range(0, n, block):
        sims = vectors[start : start + block] @ vectors.t()  # (block, n)
        rows = torch.arange(start, min(start + block, n))
        sims[rows - start, rows] = -float("inf")  # not its own neighbour
        nearest[rows] = sims.topk(k, dim=1).indices  # most similar first (ties: lower index, topk is stable here)
    nearest_lists = nearest.tolist()
    visited, path, next_unvisited = [False] * n, [], 0
    current = 0
    while True:
        visited[current] = True
        path.append(current)
        candidate = next((j for j in nearest_lists[current] if not visited[j]), None)
        if candidate is None:
            while next_unvisited < n and visited[next_unvisited]:
                next_unvisited += 1
            if next_unvisited == n:
                break
            candidate = next_unvisited
        current = candidate
    return [documents[i] for i in path]


__all__ = ["order_by_similarity", "read_documents", "read_files", "tokenize_and_pack", "train_tokenizer"]
