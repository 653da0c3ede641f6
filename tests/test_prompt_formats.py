"""How QA pairs become text: the three prompt formats, by hand on the session's tokenizer."""

import pytest

from grom_core.data import IGNORE_INDEX, PROMPT_FORMATS, Example, encode, make_batches
from grom_core.errors import DataError

QA = Example(question="Where was Ada born?", answer="in Tallinn")


def supervised(tokenizer, enc):
    return [t for t, label in zip(enc.input_ids, enc.labels, strict=True) if label != IGNORE_INDEX]


def test_qa_format_wraps_the_question_and_ends_with_eos(tokenizer):
    enc = encode(tokenizer, QA, fmt="qa")
    text = tokenizer.decode(enc.input_ids)
    assert "Question: Where was Ada born?\nAnswer: in Tallinn" in text
    assert enc.input_ids[-1] == tokenizer.eos_token_id and enc.labels[-1] == tokenizer.eos_token_id
    assert tokenizer.decode(supervised(tokenizer, enc)).startswith(" in Tallinn")


def test_completion_format_continues_the_prompt_without_eos(tokenizer):
    enc = encode(tokenizer, QA, fmt="completion")
    assert tokenizer.decode(enc.input_ids).endswith("Where was Ada born? in Tallinn")
    assert tokenizer.eos_token_id not in enc.input_ids
    assert tokenizer.decode(supervised(tokenizer, enc)) == " in Tallinn"  # only the answer is supervised
    text = encode(tokenizer, Example(text="Ada was born in Tallinn."), fmt="completion")
    assert tokenizer.eos_token_id not in text.input_ids


def test_chat_format_needs_a_chat_template_and_uses_it(tokenizer):
    assert not getattr(tokenizer, "chat_template", None)
    with pytest.raises(DataError, match="chat template"):
        encode(tokenizer, QA, fmt="chat")
    tokenizer.chat_template = "{% for m in messages %}<user>{{ m['content'] }}{% endfor %}<bot>"
    try:
        enc = encode(tokenizer, QA, fmt="chat")
    finally:
        tokenizer.chat_template = None
    assert tokenizer.decode(enc.input_ids).startswith("<user>Where was Ada born?<bot>")
    assert enc.input_ids[-1] == tokenizer.eos_token_id


def test_unknown_format_is_named(tokenizer):
    with pytest.raises(DataError, match="qa, completion, chat"):
        make_batches(tokenizer, [QA], fmt="alpaca")
    assert set(PROMPT_FORMATS) == {"qa", "completion", "chat"}
