"""The three record formats `mhmoe-train --dataset` reads, detected from the columns, and each example as token ids
with a loss mask (TRL's SFTTrainer's dataset types):

- `text` (the `--text_field` column): language modelling, every token trained; examples are packed into blocks.
- `messages` (a list of {"role", "content"}): a conversation rendered with the tokenizer's chat template
  (`--chat_template FILE` replaces it); the loss is on the assistant turns only.
- `prompt` + `completion` (two strings, or two lists of messages): the loss is on the completion only.

`--loss_on_prompt` trains every token of chat and prompt-completion examples too.

Assistant tokens are found from the rendered text, not from markers in the template: for assistant turn i, its
characters run from the end of `render(messages[:i], add_generation_prompt=True)` to the end of
`render(messages[:i + 1])`, both prefixes of the whole conversation's rendering for a template that renders turns
independently (ChatML, Llama, Mistral, ...); the tokens of the whole rendering whose first character falls there are
trained (a fast tokenizer's offsets). A template that re-renders earlier turns differently (one that drops earlier
reasoning, say) is refused by name: pass --chat_template with one that does not.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from .arguments import TrainingError

TEXT, CHAT, PROMPT_COMPLETION = "text", "messages", "prompt-completion"
ROLES = ("system", "user", "assistant", "tool", "developer")
TRAINED_ROLES = ("assistant",)


@dataclass
class Example:
    """One tokenised example: token ids and, per token, whether the loss is taken on it."""

    input_ids: list[int]
    trained: list[bool]


def detect_format(columns: Iterable[str], text_field: str) -> str:
    """The record format from the dataset's column names; refused in one line naming the columns."""
    columns = list(columns)
    if "messages" in columns:
        return CHAT
    if "prompt" in columns and "completion" in columns:
        return PROMPT_COMPLETION
    if text_field in columns:
        return TEXT
    raise TrainingError(
        f"the dataset has none of the three formats mhmoe-train reads: a {text_field!r} column (language modelling; "
        "--text_field names another), 'messages' (chat) or 'prompt' + 'completion'; its columns are "
        f"{', '.join(repr(c) for c in columns) or '(none)'}"
    )


def load_chat_template(path: str | None) -> str | None:
    """--chat_template FILE: a Jinja template read from a file (never a Hub lookup)."""
    if path is None:
        return None
    try:
        with open(path, encoding="utf-8") as f:
            template = f.read()
    except (OSError, UnicodeDecodeError) as e:
        raise TrainingError(f"--chat_template {path}: cannot be read ({e})") from None
    if not template.strip():
        raise TrainingError(f"--chat_template {path} is empty")
    return template


class Encoder:
    """Turns records of one format into `Example`s with `tokenizer` (a fast tokenizer for chat formats)."""

    def __init__(self, tokenizer, fmt: str, text_field: str = "text", loss_on_prompt: bool = False):
        self.tokenizer, self.format, self.text_field, self.loss_on_prompt = tokenizer, fmt, text_field, loss_on_prompt
        self.eos = tokenizer.eos_token_id
        chat_records = fmt == CHAT
        if chat_records and not getattr(tokenizer, "chat_template", None):
            raise TrainingError(
                "the dataset holds chat records ('messages') but the tokenizer has no chat template: use a tokenizer "
                "that has one (an instruct model's), or give one with --chat_template FILE (a Jinja template)"
            )
        if fmt != TEXT and not getattr(tokenizer, "is_fast", False):
            raise TrainingError(
                f"{fmt} records need a fast tokenizer (its character offsets find the trained tokens); "
                f"{type(tokenizer).__name__} is not one"
            )

    def __call__(self, record: dict, number: int) -> Example:
        """`record` (the `number`-th of its split, from 1) as an `Example`; a bad record raises naming it."""
        if self.format == TEXT:
            text = record.get(self.text_field)
            if not isinstance(text, str):
                raise TrainingError(f"record {number}: field {self.text_field!r} is {_kind(text)}, not a string")
            ids = self.tokenizer(text, add_special_tokens=False, verbose=False)["input_ids"]
            ids = ids + ([self.eos] if self.eos is not None else [])
            return Example(ids, [True] * len(ids))
        if self.format == CHAT:
            messages = _messages(record.get("messages"), number, "messages")
            if not any(m["role"] in TRAINED_ROLES for m in messages):
                raise TrainingError(f"record {number}: 'messages' has no assistant turn, nothing to train on")
            return self._chat(messages, number)
        return self._prompt_completion(record, number)

    # ----------------------------------------------------------------------------------------------------------------

    def _render(self, messages: list[dict], generation_prompt: bool) -> str:
        return self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt)

    def _spans_to_example(self, text: str, spans: list[tuple[int, int]], number: int, add_eos: bool) -> Example:
        """Tokens of `text`, trained where their first character lies in one of `spans` (or everywhere with
        --loss_on_prompt)."""
        encoded = self.tokenizer(text, add_special_tokens=False, return_offsets_mapping=True, verbose=False)
        ids, offsets = list(encoded["input_ids"]), encoded["offset_mapping"]
        trained = [self.loss_on_prompt or any(a <= start < b for a, b in spans) for start, _ in offsets]
        if add_eos and self.eos is not None and (not ids or ids[-1] != self.eos):
            ids.append(self.eos)
            trained.append(True)
        if not any(trained):
            raise TrainingError(f"record {number}: no trained token after tokenization (an empty answer?)")
        return Example(ids, trained)

    def _chat(self, messages: list[dict], number: int) -> Example:
        text = self._render(messages, False)
        spans = []
        for i, message in enumerate(messages):
            if message["role"] not in TRAINED_ROLES:
                continue
            before = self._render(messages[:i], True) if i else self._render_generation_prompt_only()
            upto = self._render(messages[: i + 1], False)
            if not (text.startswith(upto) and upto.startswith(before)):
                raise TrainingError(
                    f"record {number}: the chat template renders turns 1-{i + 1} differently from the start of the "
                    "whole conversation (it re-renders earlier turns), so the assistant tokens cannot be found; pass "
                    "--chat_template with a template that renders each turn on its own"
                )
            spans.append((len(before), len(upto)))
        return self._spans_to_example(text, spans, number, add_eos=False)

    def _render_generation_prompt_only(self) -> str:
        """What the template puts before a first assistant turn with no message before it (rare: most data starts
        with a user turn)."""
        try:
            return self._render([], True)
        except Exception:  # a template that needs at least one message
            return ""

    def _prompt_completion(self, record: dict, number: int) -> Example:
        prompt, completion = record.get("prompt"), record.get("completion")
        if isinstance(prompt, str) and isinstance(completion, str):
            text = prompt + completion
            return self._spans_to_example(text, [(len(prompt), len(text))], number, add_eos=True)
        if isinstance(prompt, list) and isinstance(completion, list):
            if getattr(self.tokenizer, "chat_template", None) is None:
                raise TrainingError(
                    f"record {number}: prompt and completion are message lists but the tokenizer has no chat "
                    "template: give one with --chat_template FILE"
                )
            prompt = _messages(prompt, number, "prompt")
            completion = _messages(completion, number, "completion")
            before = self._render(prompt, True)
            text = self._render(prompt + completion, False)
            if not text.startswith(before):
                raise TrainingError(
                    f"record {number}: the chat template renders the prompt differently from the start of prompt + "
                    "completion, so the completion's tokens cannot be found; pass --chat_template with one that does"
                )
            return self._spans_to_example(text, [(len(before), len(text))], number, add_eos=False)
        raise TrainingError(
            f"record {number}: 'prompt' and 'completion' must both be strings or both be lists of messages, got "
            f"{_kind(prompt)} and {_kind(completion)}"
        )


def _kind(value) -> str:
    return "missing" if value is None else f"a {type(value).__name__}"


def _messages(value, number: int, field: str) -> list[dict]:
    """A list of {"role", "content"} turns, checked; refused naming the record and the turn."""
    if not isinstance(value, list) or not value:
        raise TrainingError(f"record {number}: {field!r} must be a non-empty list of messages, got {_kind(value)}")
    for turn, message in enumerate(value, start=1):
        if not isinstance(message, dict) or "role" not in message or "content" not in message:
            raise TrainingError(
                f"record {number}, {field} turn {turn}: a message is an object with 'role' and 'content', got "
                f"{message!r:.80}"
            )
        if message["role"] not in ROLES:
            raise TrainingError(
                f"record {number}, {field} turn {turn}: unknown role {message['role']!r} (one of {', '.join(ROLES)})"
            )
        if not isinstance(message["content"], str):
            raise TrainingError(
                f"record {number}, {field} turn {turn}: 'content' is {_kind(message['content'])}, not a string"
            )
    return value


__all__ = ["CHAT", "PROMPT_COMPLETION", "TEXT", "Encoder", "Example", "detect_format", "load_chat_template"]
