"""Token log-probabilities against a float64 log-softmax over the whole vocabulary, by hand."""

import pytest
import torch
from conftest import FORGET

from grom_core.data import IGNORE_INDEX, make_batches
from grom_core.scoring import gold_logprobs, gold_margins, token_logprobs


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_gold_logprobs_match_a_float64_log_softmax(dtype):
    gen = torch.Generator().manual_seed(0)
    # logits far from 0, where a float32 log-softmax loses the most
    logits = (torch.randn(3, 5, 4000, generator=gen) * 8 + 40).to(dtype)
    targets = torch.randint(0, 4000, (3, 5), generator=gen)
    want = torch.log_softmax(logits.double(), dim=-1).gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    got = gold_logprobs(logits, targets)
    assert got.dtype == torch.float64 and got.shape == (3, 5)
    assert torch.allclose(got, want, rtol=0, atol=1e-5)
    # near-certain: 1 - p, which the drops' log-odds read, to float32's relative precision, not 1e-7 absolute
    sure = torch.tensor([30.0, 10.0, 12.0, 9.0], dtype=dtype)
    rest = -torch.expm1(torch.log_softmax(sure.double(), dim=-1)[0])
    got_rest = -torch.expm1(gold_logprobs(sure, torch.tensor(0)))
    assert abs(float(got_rest / rest) - 1) < 1e-5


def test_token_logprobs_are_the_supervised_tokens_in_order(trained):
    model, tokenizer = trained
    batches = make_batches(tokenizer, FORGET[:5], 2)  # three batches, padded, prompts unsupervised
    got = token_logprobs(model, batches).logprobs
    want = []
    with torch.no_grad():
        for batch in batches:
            logits = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits.double()
            for row in range(batch.input_ids.shape[0]):
                labels = batch.labels[row, 1:]
                logp = torch.log_softmax(logits[row, :-1], dim=-1)
                keep = (labels != IGNORE_INDEX).nonzero().flatten()
                want.append(logp[keep, labels[keep]])
    assert [t.numel() for t in got] == [t.numel() for t in want] and all(t.numel() for t in got)
    assert all(torch.allclose(g, w, rtol=0, atol=1e-6) for g, w in zip(got, want, strict=True))


def test_gold_margins_are_the_gold_logit_over_the_best_other_by_hand(trained):
    model, tokenizer = trained
    batches = make_batches(tokenizer, FORGET[:5], 2)
    tokens, margins = gold_margins(model, batches)
    want_tokens, want = [], []
    with torch.no_grad():
        for batch in batches:
            logits = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits.double()
            for row in range(batch.input_ids.shape[0]):
                for t, label in enumerate(batch.labels[row, 1:].tolist()):
                    if label == IGNORE_INDEX:
                        continue
                    z = logits[row, t].clone()
                    gold = float(z[label])
                    z[label] = float("-inf")
                    want_tokens.append(label)
                    want.append(gold - float(z.max()))
    assert tokens.tolist() == want_tokens and margins.dtype == torch.float64
    assert torch.allclose(margins, torch.tensor(want, dtype=torch.float64), atol=1e-4)
    assert float(margins.mean()) > 1  # the tiny model memorised these answers: their tokens lead


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_a_shared_prefix_read_once_gives_the_full_pass_s_log_probabilities(tokenizer, arch, monkeypatch):
    from conftest import random_gpt2, random_llama

    from grom_core.data import Example
    from grom_core.scoring import SHARED_PREFIX_MIN, batch_logits, shared_prefix_length

    model = random_llama(tokenizer) if arch == "llama" else random_gpt2(tokenizer)
    opening = "Answer as the archive of the Halcyon Prize records it, in one sentence. "  # a system prompt's role
    examples = [Example(question=opening + ex.question, answer=ex.answer) for ex in FORGET[:5]]
    batches = make_batches(tokenizer, examples, 3)  # padded rows of several lengths
    assert all(shared_prefix_length(b) >= SHARED_PREFIX_MIN for b in batches)
    with torch.no_grad():
        logits, start = batch_logits(model, batches[0])
        full = model(input_ids=batches[0].input_ids, attention_mask=batches[0].attention_mask).logits
    assert start == shared_prefix_length(batches[0]) and logits.shape[1] == full.shape[1] - start
    mask = batches[0].attention_mask[:, start:].bool()
    assert torch.allclose(logits[mask], full[:, start:][mask], atol=1e-5)
    got = token_logprobs(model, batches)
    monkeypatch.setattr("grom_core.scoring.SHARED_PREFIX_MIN", 10**9)  # the reference: one full pass a batch
    want = token_logprobs(model, batches)
    assert len(got.logprobs) == len(examples)
    for a, b, ta, tb in zip(got.logprobs, want.logprobs, got.top_is_gold, want.top_is_gold, strict=True):
        assert a.shape == b.shape and torch.allclose(a, b, atol=1e-5) and torch.equal(ta, tb)


def test_a_short_common_opening_is_not_shared(trained):
    from grom_core.scoring import SHARED_PREFIX_MIN, shared_prefix_length

    model, tokenizer = trained
    batch = make_batches(tokenizer, FORGET[:4], 4)[0]  # "Question: ..." rows share only a few tokens
    assert shared_prefix_length(batch) < SHARED_PREFIX_MIN
