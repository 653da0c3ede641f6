"""Examples and batches: QA pairs or raw texts turned into token ids with supervision labels.

A QA pair is supervised on its answer only (the question's labels are -100, as in TOFU); a raw text is supervised
on every token after the first. Keys are captured where the *next* token is supervised.

How a QA pair becomes text is a `PromptFormat`, chosen per dataset: `qa` ("Question: ...\nAnswer: ..." and an
end-of-sequence token: how grom's tiny models are trained), `completion` (the question is a prefix the answer
continues, no end-of-sequence token: what a pretrained base model does, "The capital of France is the city of" ->
" Paris"), or `chat` (the tokenizer's chat template, the answer ending the assistant's turn). The keys, the
targets and the metrics of one dataset use the same format.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from grom_core.errors import DataError

if TYPE_CHECKING:  # torch is imported where batches are made: reading a data file needs none
    import torch

IGNORE_INDEX = -100

QUESTION_TEMPLATE = "Question: {question}\nAnswer:"


@dataclass(frozen=True)
class PromptFormat:
    """How an example becomes model input.

    Attributes:
        name: qa, completion or chat.
        template: the prompt around the question ({question}); unused by chat, which asks the tokenizer.
        answer_prefix: what precedes the answer (a space after a prompt that ends in a word).
        eos: whether an end-of-sequence token follows the answer (and a text).
        chat: use the tokenizer's chat template (the prompt is a user turn, the answer the assistant's).
    """

    name: str
    template: str
    answer_prefix: str
    eos: bool
    chat: bool = False

    def prompt(self, tokenizer, question: str) -> str:
        if self.chat:
            if not getattr(tokenizer, "chat_template", None):
                raise DataError("prompt format 'chat' needs a tokenizer with a chat template; use 'qa' or "
                                "'completion'")
            return tokenizer.apply_chat_template([{"role": "user", "content": question}], tokenize=False,
                                                 add_generation_prompt=True)
        return self.template.format(question=question)

    def prefix(self, tokenizer) -> list[int]:
        """Token ids before the prompt: the BOS token, unless a chat template already opens the sequence."""
        return [] if self.chat else bos_prefix(tokenizer)


PROMPT_FORMATS = {
    "qa": PromptFormat("qa", QUESTION_TEMPLATE, " ", eos=True),
    "completion": PromptFormat("completion", "{question}", " ", eos=False),
    "chat": PromptFormat("chat", "{question}", "", eos=True, chat=True),
}


def prompt_format(name: str | PromptFormat) -> PromptFormat:
    if isinstance(name, PromptFormat):
        return name
    if name not in PROMPT_FORMATS:
        raise DataError(f"unknown prompt format '{name}'; choose one of {', '.join(PROMPT_FORMATS)}")
    return PROMPT_FORMATS[name]


@dataclass(frozen=True)
class Example:
    """One unit of data: a QA pair (question and answer) or a raw text (text only).

    `subject` (QA pairs only, optional) names what the fact is about, as it is written in the question ("France" in
    "The capital of France is"); the locate-then-edit methods key their update at its last token."""

    question: str | None = None
    answer: str | None = None
    text: str | None = None
    subject: str | None = None

    def __post_init__(self) -> None:
        is_qa = self.question is not None and self.answer is not None
        if is_qa == (self.text is not None):
            raise DataError("an example is either a question/answer pair or a text; give one of the two")
        content = (self.question or "") + (self.answer or "") + (self.text or "")
        if not content.strip():
            raise DataError("an example is empty; drop empty rows from the input file")
        if self.subject is not None and (self.question is None or not self.subject.strip()
                                         or self.subject not in self.question):
            raise DataError(f"subject {self.subject!r} must be a non-empty part of the example's question "
                            f"({self.question!r}); fix the subject or leave it out")

    def record(self) -> dict[str, str]:
        """JSON-serialisable content, used for digests and the catalog (the subject only where one is given, so
        that the digests of data without subjects stay as they were)."""
        if self.text is not None:
            return {"text": self.text}
        subject = {} if self.subject is None else {"subject": self.subject}
        return {"question": self.question, "answer": self.answer, **subject}


def as_examples(items: Sequence[Example | dict | tuple | str]) -> list[Example]:
    """Normalise user input: Example, {"question", "answer"} / {"text"} dicts, (question, answer) tuples or strings."""
    out = []
    for i, item in enumerate(items):
        if isinstance(item, Example):
            out.append(item)
        elif isinstance(item, str):
            out.append(Example(text=item))
        elif isinstance(item, tuple) and len(item) == 2:
            out.append(Example(question=item[0], answer=item[1]))
        elif isinstance(item, dict) and ("question" in item and "answer" in item):
            subject = item.get("subject")
            out.append(Example(question=str(item["question"]), answer=str(item["answer"]),
                               subject=None if subject is None else str(subject)))
        elif isinstance(item, dict) and "text" in item:
            out.append(Example(text=str(item["text"])))
        else:
            raise DataError(f"example {i} has neither question/answer nor text; give one of the two per row")
    return out


@dataclass
class EncodedExample:
    """Token ids (T,) and labels (T,) of one example; labels are -100 where nothing is supervised."""

    input_ids: list[int]
    labels: list[int]


def encode(tokenizer, example: Example, max_length: int = 512, fmt: str | PromptFormat = "qa") -> EncodedExample:
    """Tokenise one example in prompt format `fmt`. The prompt and answer are encoded separately so the boundary
    is exact."""
    fmt = prompt_format(fmt)
    bos = fmt.prefix(tokenizer)
    eos = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None and fmt.eos else []
    if example.text is not None:
        ids = bos + tokenizer.encode(example.text, add_special_tokens=False) + eos
        labels = [IGNORE_INDEX] * len(bos) + ids[len(bos):]
    else:
        prompt = bos + tokenizer.encode(fmt.prompt(tokenizer, example.question), add_special_tokens=False)
        answer = tokenizer.encode(fmt.answer_prefix + example.answer, add_special_tokens=False) + eos
        ids = prompt + answer
        labels = [IGNORE_INDEX] * len(prompt) + answer
    ids, labels = ids[:max_length], labels[:max_length]
    if all(label == IGNORE_INDEX for label in labels[1:]):
        raise DataError(f"example has no supervised token within max_length={max_length}; shorten its prompt "
                        f"or raise max_length")
    return EncodedExample(ids, labels)


def subject_position(tokenizer, example: Example, fmt: PromptFormat) -> int:
    """Index of the subject's last token in the encoded example (`data.encode`'s ids); without a subject, the
    prompt's last token (where the model is about to state the fact)."""
    prefix = fmt.prefix(tokenizer)
    prompt = fmt.prompt(tokenizer, example.question)
    last = len(prefix) + len(tokenizer.encode(prompt, add_special_tokens=False)) - 1
    if example.subject is None:
        return last
    end = prompt.index(example.subject) + len(example.subject)  # Example checks the subject is in the question
    at = len(prefix) + len(tokenizer.encode(prompt[:end], add_special_tokens=False)) - 1
    return max(len(prefix), min(at, last))


def mark_subjects(tokenizer, examples: Sequence[Example], batches: Sequence[Batch], fmt: str | PromptFormat,
                  answers: bool = True) -> list[Batch]:
    """The batches (of `examples`, in order, as `make_batches` makes them) with each subject's last token also
    supervised, its "next token" the answer's first token, so that keys are also captured where the model holds
    what it knows about the subject; with answers=False only there (the answers' own labels dropped). Examples
    without a subject keep their labels. The input ids are untouched: only the labels say where keys are taken."""
    fmt = prompt_format(fmt)
    out = []
    for batch in batches:
        labels = batch.labels.clone()
        for row, index in enumerate(batch.example_ids.tolist()):
            example = examples[index]
            if example.subject is None:
                continue
            supervised = (labels[row] != IGNORE_INDEX).nonzero().flatten()
            first = int(labels[row, supervised[0]]) if supervised.numel() else None
            if first is None:
                continue
            if not answers:
                labels[row, :] = IGNORE_INDEX
            labels[row, subject_position(tokenizer, example, fmt) + 1] = first
        out.append(Batch(batch.input_ids, batch.attention_mask, labels, batch.example_ids))
    return out


@dataclass
class Batch:
    """A padded batch (right padding). Shapes: input_ids, attention_mask, labels (B, T); example_ids (B,)."""

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    labels: torch.Tensor
    example_ids: torch.Tensor

    def to(self, device: torch.device | str) -> Batch:
        return Batch(self.input_ids.to(device), self.attention_mask.to(device), self.labels.to(device),
                     self.example_ids.to(device))

    @property
    def num_supervised(self) -> int:
        return int((self.labels[:, 1:] != IGNORE_INDEX).sum())


def collate(encoded: Sequence[EncodedExample], example_ids: Sequence[int], pad_id: int) -> Batch:
    import torch

    width = max(len(e.input_ids) for e in encoded)
    input_ids = torch.full((len(encoded), width), pad_id, dtype=torch.long)
    labels = torch.full((len(encoded), width), IGNORE_INDEX, dtype=torch.long)
    mask = torch.zeros((len(encoded), width), dtype=torch.long)
    for row, enc in enumerate(encoded):
        n = len(enc.input_ids)
        input_ids[row, :n] = torch.tensor(enc.input_ids)
        labels[row, :n] = torch.tensor(enc.labels)
        mask[row, :n] = 1
    return Batch(input_ids, mask, labels, torch.tensor(list(example_ids), dtype=torch.long))


def pad_token_id(tokenizer) -> int:
    for candidate in (tokenizer.pad_token_id, tokenizer.eos_token_id, 0):
        if candidate is not None:
            return int(candidate)
    return 0  # pragma: no cover


def make_batches(tokenizer, examples: Sequence[Example], batch_size: int = 16, max_length: int = 512,
                 first_id: int = 0, fmt: str | PromptFormat = "qa", by_length: bool = False) -> list[Batch]:
    """Encode (in prompt format `fmt`) and batch examples; example i gets id `first_id + i`.

    In order by default. `by_length` batches examples of similar length together (longest first), for passes whose
    result does not depend on the order (sums of statistics, token counts): a batch is as wide as its longest
    example, so mixing short facts with long prose pays for padding (minirwku's retain data in batches of 16:
    1.87 positions per real token in order, 1.13 by length)."""
    if not examples:
        raise DataError("no examples given; the forget and retain sets must each hold at least one example")
    if batch_size < 1:
        raise DataError(f"batch_size must be >= 1, got {batch_size}")
    encoded = [encode(tokenizer, ex, max_length, fmt) for ex in examples]
    order = list(range(len(encoded)))
    if by_length:
        order.sort(key=lambda i: -len(encoded[i].input_ids))  # stable: ties keep their order
    pad = pad_token_id(tokenizer)
    batches = []
    for start in range(0, len(order), batch_size):
        chunk = order[start:start + batch_size]
        batches.append(collate([encoded[i] for i in chunk], [first_id + i for i in chunk], pad))
    return batches


def iter_answer_tokens(batches: Sequence[Batch]) -> Iterator[int]:
    """Every supervised token id, in order (used for token frequencies)."""
    for batch in batches:
        supervised = batch.labels[:, 1:]
        yield from supervised[supervised != IGNORE_INDEX].tolist()


def read_json_object(path: str | Path, what: str) -> dict:
    """A JSON file holding one object, with errors that name `what` the file was meant to be."""
    path = Path(path)
    if not path.is_file():
        raise DataError(f"{what} {path} does not exist")
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise DataError(f"{what} {path} is not valid JSON ({exc.msg} at line {exc.lineno})") from exc
    if not isinstance(data, dict):
        raise DataError(f"{what} {path} must hold a JSON object")
    return data


def read_jsonl(path: str | Path) -> list[dict]:
    """One JSON object per non-blank line (UTF-8, with or without the byte-order mark some editors write); a bad
    line is a DataError that names the file and the line."""
    path = Path(path)
    rows = []
    for number, line in enumerate(path.read_text(encoding="utf-8-sig").splitlines(), start=1):
        if not line.strip():
            continue
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError as exc:
            raise DataError(f"{path}: line {number} is not valid JSON ({exc.msg}); one JSON object per line") from exc
    return rows


def bos_prefix(tokenizer) -> list[int]:
    """The BOS token the model was trained with in front of every sequence ([] for tokenizers without one)."""
    return [tokenizer.bos_token_id] if tokenizer.bos_token_id is not None else []
