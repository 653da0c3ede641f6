"""Metrics on a user's own forget and retain data: TOFU's probability and ROUGE-L recall of the answers, and the
recall of what each answer adds to its question (`metrics.rouge.rouge_l_recall_added`), which the forget gate reads.

QA pairs are scored on their answers; texts on all their tokens, and the forget texts also on MUSE's VerbMem (how
much of each text the model continues word for word from its first quarter), which the forget gate reads for
texts: there is no question to ask. Both in the data's prompt format (grom_core.data.PROMPT_FORMATS), the one its
keys and targets used.
"""

from __future__ import annotations

import numpy as np

from grom_core.data import as_examples, make_batches, prompt_format
from grom_core.generation import greedy_generate
from grom_core.metrics.muse import FORGET_VERBATIM, verbatim_rouge
from grom_core.metrics.rouge import rouge_l_recall, rouge_l_recall_added
from grom_core.scoring import answer_nll


def evaluate_own(model, tokenizer, forget: list[dict], retain: list[dict], *, max_examples: int = 200,
                 max_new_tokens: int = 64, max_verbatim_tokens: int = 128, batch_size: int = 32,
                 fmt: str = "qa") -> dict[str, float]:
    """{forget,retain}_probability (mean exp(-mean NLL)); for QA pairs, {forget,retain}_rougeL_recall and
    {forget,retain}_added_rougeL_recall (against the answer's words the question does not contain); for forget
    texts, forget_verbatim_rougeL (VerbMem: ROUGE-L F1 of the greedy continuation of each text's first quarter,
    `max_verbatim_tokens` new tokens, against the rest).

    At most `max_examples` of each set are scored (the first ones), so evaluation stays cheap on large sets; the
    answers are generated for at most `max_new_tokens` tokens and at most twice the longest answer's tokens plus 8
    (room for a restated question before it), so a set of one-word answers is not generated at full length.
    """
    out: dict[str, float] = {}
    for name, rows in (("forget", forget), ("retain", retain)):
        rows = rows[:max_examples]
        nll = answer_nll(model, make_batches(tokenizer, as_examples(rows), batch_size, fmt=fmt)).numpy()
        out[f"{name}_probability"] = float(np.exp(-nll).mean())
        qa = [r for r in rows if "question" in r]
        if qa:
            prompts = [prompt_format(fmt).prompt(tokenizer, r["question"]) for r in qa]
            longest = max(len(tokenizer(r["answer"], add_special_tokens=False)["input_ids"]) for r in qa)
            generated = greedy_generate(model, tokenizer, prompts, max_new_tokens=min(max_new_tokens, 2 * longest + 8),
                                        batch_size=batch_size, desc=f"generate ({name})",
                                        bos=not prompt_format(fmt).chat)
            answers, questions = [r["answer"] for r in qa], [r["question"] for r in qa]
            out[f"{name}_rougeL_recall"] = float(rouge_l_recall(generated, answers).mean())
            out[f"{name}_added_rougeL_recall"] = float(rouge_l_recall_added(generated, answers, questions).mean())
        texts = [r["text"] for r in rows if "text" in r]
        if name == "forget" and texts:  # the retain texts are kept by their probability: no generation there
            verbatim = verbatim_rouge(model, tokenizer, texts, max_new_tokens=max_verbatim_tokens,
                                      batch_size=batch_size, bos=not prompt_format(fmt).chat)
            if verbatim.size:
                out[FORGET_VERBATIM] = float(verbatim.mean())
    return out
