"""Own-data metrics: VerbMem of the forget texts (what the text gates read) beside the QA metrics."""

import torch
from conftest import FORGET, RETAIN

from grom_core.benchmarks.owndata import evaluate_own
from grom_core.data import bos_prefix
from grom_core.metrics.muse import verbatim_rouge


def _own_words(model, tokenizer, start: str) -> str:
    """`start` and the model's own greedy continuation of it (to its end of sequence), as one text."""
    ids = bos_prefix(tokenizer) + tokenizer.encode(start, add_special_tokens=False)
    with torch.no_grad():
        out = model.generate(input_ids=torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                             do_sample=False, max_new_tokens=40, pad_token_id=tokenizer.pad_token_id,
                             eos_token_id=tokenizer.eos_token_id)
    return tokenizer.decode(out[0, len(bos_prefix(tokenizer)):].tolist(), skip_special_tokens=True)


def test_verbmem_is_one_for_what_the_model_writes_itself_and_skips_what_cannot_be_continued(trained):
    model, tokenizer = trained
    # from the training format's first word: where the model's path was short ("Rosalind Halloran odalten.", one
    # CPU's training), the half-way cut fell inside a word, which tokenizes differently once decoded
    start = "Question:"
    text = _own_words(model, tokenizer, start)
    n = len(tokenizer.encode(text, add_special_tokens=False))
    assert n >= 8 and len(tokenizer.encode(start, add_special_tokens=False)) <= n // 2
    # the first half is the prompt (a prefix of the model's own path), the rest what the model writes after it
    own = verbatim_rouge(model, tokenizer, [text], prompt_fraction=0.5, max_new_tokens=n - n // 2)
    words = text.split()
    shuffled = " ".join(words[:len(words) // 2] + words[len(words) // 2:][::-1])
    other = verbatim_rouge(model, tokenizer, [shuffled], prompt_fraction=0.5, max_new_tokens=n - n // 2)
    assert own.tolist() == [1.0] and other[0] < 0.8
    single = tokenizer.decode(tokenizer.encode(text, add_special_tokens=False)[:1])
    assert verbatim_rouge(model, tokenizer, [single]).size == 0  # one token: nothing to continue


def test_own_data_metrics_give_forget_texts_verbmem_only(trained):
    model, tokenizer = trained
    texts = [{"text": ex.answer + " " + ex.answer} for ex in FORGET[:3]]
    qa = [{"question": ex.question, "answer": ex.answer} for ex in RETAIN[:4]]
    mixed = evaluate_own(model, tokenizer, texts + [{"question": FORGET[3].question, "answer": FORGET[3].answer}],
                         qa + texts, max_new_tokens=16, max_verbatim_tokens=16)
    assert 0 <= mixed["forget_verbatim_rougeL"] <= 1 and "forget_rougeL_recall" in mixed
    assert not any(k.startswith("retain_verbatim") for k in mixed)  # retain texts: probability only
    qa_only = evaluate_own(model, tokenizer, [{"question": FORGET[0].question, "answer": FORGET[0].answer}], qa,
                           max_new_tokens=16)
    assert "forget_verbatim_rougeL" not in qa_only
