"""Record formats (training/formats.py): detection, the trained tokens of chat and prompt-completion examples against
a reference built turn by turn, and every bad record refused in one line naming it."""

import json

import pytest
from transformers import AutoTokenizer

from mhmoe.training.arguments import TrainingError
from mhmoe.training.formats import CHAT, PROMPT_COMPLETION, TEXT, Encoder, detect_format
from tests.fixtures.training import chat_records


@pytest.fixture(scope="module")
def chat_tokenizer(chat_tokenizer_dir):
    return AutoTokenizer.from_pretrained(chat_tokenizer_dir)


def _trained_text(tokenizer, example):
    return tokenizer.decode([t for t, m in zip(example.input_ids, example.trained) if m])


def test_detect_format():
    assert detect_format(["messages", "id"], "text") == CHAT
    assert detect_format(["prompt", "completion", "text"], "text") == PROMPT_COMPLETION
    assert detect_format(["body"], "body") == TEXT
    with pytest.raises(
        TrainingError, match=r"none of the three formats.*'prompt' \+ 'completion'.*'question', 'answer'"
    ):
        detect_format(["question", "answer"], "text")


def test_chat_trains_exactly_the_assistant_turns(chat_tokenizer):
    """The reference: each turn rendered and tokenised on its own (ChatML renders turns independently), trained where
    the role is assistant (its content, <|im_end|> and the newline after it)."""
    encoder = Encoder(chat_tokenizer, CHAT)
    for number, record in enumerate(chat_records(16), start=1):
        example = encoder(record, number)
        ids, trained = [], []
        for message in record["messages"]:
            head = chat_tokenizer(f"<|im_start|>{message['role']}\n", add_special_tokens=False)["input_ids"]
            body = chat_tokenizer(f"{message['content']}<|im_end|>\n", add_special_tokens=False)["input_ids"]
            ids += head + body
            trained += [False] * len(head) + [message["role"] == "assistant"] * len(body)
        assert example.input_ids == ids
        assert example.trained == trained
        answers = "".join(f"{m['content']}<|im_end|>\n" for m in record["messages"] if m["role"] == "assistant")
        assert _trained_text(chat_tokenizer, example) == answers


def test_loss_on_prompt_trains_every_token(chat_tokenizer):
    record = chat_records(1)[0]
    example = Encoder(chat_tokenizer, CHAT, loss_on_prompt=True)(record, 1)
    assert all(example.trained)


def test_prompt_completion_strings_and_messages(chat_tokenizer):
    strings = Encoder(chat_tokenizer, PROMPT_COMPLETION)({"prompt": "What is x?\n", "completion": "A name."}, 1)
    assert _trained_text(chat_tokenizer, strings) == "A name.</s>"  # the completion, then EOS
    assert chat_tokenizer.decode(strings.input_ids) == "What is x?\nA name.</s>"
    messages = Encoder(chat_tokenizer, PROMPT_COMPLETION)(
        {"prompt": [{"role": "user", "content": "What is x?"}], "completion": [{"role": "assistant", "content": "A."}]},
        1,
    )
    assert _trained_text(chat_tokenizer, messages) == "A.<|im_end|>\n"
    assert chat_tokenizer.decode(messages.input_ids).startswith("<|im_start|>user\nWhat is x?<|im_end|>\n")


@pytest.mark.parametrize(
    "fmt, record, words",
    [
        (CHAT, {"messages": []}, r"record 7: 'messages' must be a non-empty list"),
        (CHAT, {"messages": "hi"}, r"record 7: 'messages' must be a non-empty list of messages, got a str"),
        (CHAT, {"messages": [{"role": "robot", "content": "x"}]}, r"record 7, messages turn 1: unknown role 'robot'"),
        (CHAT, {"messages": [{"role": "user", "content": 3}]}, r"record 7, messages turn 1: 'content' is a int"),
        (CHAT, {"messages": [{"role": "user"}]}, r"record 7, messages turn 1: a message is an object with 'role'"),
        (CHAT, {"messages": [{"role": "user", "content": "q"}]}, r"record 7: 'messages' has no assistant turn"),
        (TEXT, {"text": ["a list"]}, r"record 7: field 'text' is a list, not a string"),
        (TEXT, {"text": None}, r"record 7: field 'text' is missing, not a string"),
        (PROMPT_COMPLETION, {"prompt": "q", "completion": 5}, r"record 7: 'prompt' and 'completion' must both be"),
    ],
)
def test_bad_records_are_one_line_naming_the_record(chat_tokenizer, fmt, record, words):
    with pytest.raises(TrainingError, match=words) as info:
        Encoder(chat_tokenizer, fmt)(record, 7)
    assert "\n" not in str(info.value)


def test_chat_without_a_template_is_one_line(tokenizer_dir):
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    with pytest.raises(TrainingError, match=r"chat records .* no chat template.*--chat_template FILE"):
        Encoder(tokenizer, CHAT)


def test_a_template_that_rerenders_earlier_turns_is_refused(chat_tokenizer):
    """A template that drops the earlier assistant turns' content (as reasoning templates do) is not prefix-stable."""
    tokenizer = chat_tokenizer
    original = tokenizer.chat_template
    tokenizer.chat_template = (
        "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{% if m['role'] == 'assistant' and not loop.last %}"
        "(earlier){% else %}{{ m['content'] }}{% endif %}<|im_end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )
    try:
        record = json.loads(json.dumps(chat_records(1)[0]))  # the first record has two exchanges
        with pytest.raises(TrainingError, match=r"record 1: the chat template renders turns .* differently"):
            Encoder(tokenizer, CHAT)(record, 1)
    finally:
        tokenizer.chat_template = original
