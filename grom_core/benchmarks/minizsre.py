"""minizsre: fact-level unlearning in ZsRE/CounterFact's format, on SmolLM2 itself (no fine-tuning).

Each fact is a (subject, relation, object) triple the model states: countries, their capitals, continents and
demonyms from the pinned `countryinfo` package (the data minirwku reads). A fact comes with
- a rewrite prompt, "The capital of France is" -> " Paris" (what an editor is given, with its subject);
- paraphrase prompts of the same fact, never shown to a method ("France's capital city is");
- neighbourhood prompts: the same relation of other subjects the model knows ("The capital of Peru is").
Every prompt kept is one the base model completes correctly by greedy generation (the build reports how many).

Metrics (the editing literature's, read for unlearning, where the new "object" is the fact given up):
- efficacy: share of facts whose rewrite prompt no longer yields the object (greedy, whole-word match);
- generalization: the same over the paraphrase prompts;
- specificity: share of neighbourhood prompts still answered correctly (the base model: 1.0);
- fluency: ROME's n-gram entropy (2/3 bigram + 4/3 trigram entropy, bits, per text, averaged) of greedy
  generations from the rewrite prompts: a method that breaks the model into repetition scores low.
`rewrite_accuracy` and `paraphrase_accuracy` (1 - efficacy, 1 - generalization) are the forget metrics a
quantization attack is checked on. Splits edit1/edit10/edit100 edit the first 1/10/100 facts at once (mass editing
is where MEMIT and AlphaEdit differ from ROME). The retain data handed to methods: the same relations of countries
that are neither edited nor neighbours, and general prose (CPython's reference manual, as minirwku).
"""

from __future__ import annotations

import logging
import math
import random
import re
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from grom_core.benchmarks.minirwku import (
    COUNTRYINFO,
    answer_matches,
    general_text,
    generate_answers,
    read_countries,
)
from grom_core.errors import DataError

log = logging.getLogger(__name__)

SPLITS = {"edit1": 1, "edit10": 10, "edit100": 100}
FLUENCY_TOKENS = 32


@dataclass(frozen=True)
class Relation:
    """How a relation is prompted ({s} is the subject): the rewrite prompt and the paraphrases."""

    rewrite: str
    paraphrases: tuple[str, ...]


RELATIONS = {
    "capital": Relation("The capital of {s} is", ("{s}'s capital city is",
                                                  "The city that serves as the capital of {s} is",
                                                  "The seat of government of {s} is in")),
    "continent": Relation("{s} is located on the continent of", ("{s} is a country in",
                                                                  "The continent where {s} lies is",
                                                                  "Geographically, {s} is part of")),
    "demonym": Relation("The people of {s} are called the", ("A citizen of {s} is called a",
                                                            "Someone born in {s} is described as",
                                                            "The nationality of people from {s} is")),
}
# relation -> field of minirwku.read_countries
ATTRIBUTE = {"capital": "capital", "continent": "continent", "demonym": "demonym"}


@dataclass(frozen=True)
class MiniZsreConfig:
    """Sizes of minizsre (which facts are in it is decided by what the model knows, at build time).

    Attributes:
        model: the shipped model the facts are probed on.
        neighbors: neighbourhood prompts per edited fact (other subjects, same relation).
        retain_facts: facts of other countries in the retain data handed to methods.
        retain_paragraphs: general-text paragraphs in the retain data.
        max_new_tokens: greedy tokens generated per probe.
        seed: order of the facts.
    """

    model: str = "smollm2"
    neighbors: int = 2
    retain_facts: int = 60
    retain_paragraphs: int = 60
    max_new_tokens: int = 8
    seed: int = 0


def _probe(prompt: str, answer: str, **extra) -> dict:
    return {"prompt": prompt, "format": "completion", "answer": answer, **extra}


def generate(config: MiniZsreConfig, model_dir: str | Path) -> dict[str, list[dict]]:
    """Every split: the facts (each with its kept paraphrases and neighbourhood prompts), the retain facts and
    text, and a build record."""
    from grom_core.loading import load_model

    model, tokenizer = load_model(model_dir, device="cpu")
    triples = [{"subject": c["entity"], "relation": r, "object": c[ATTRIBUTE[r]]}
               for c in read_countries() for r in RELATIONS if c.get(ATTRIBUTE[r])]
    prompts = [_probe(RELATIONS[t["relation"]].rewrite.format(s=t["subject"]), t["object"], fact=i, kind="rewrite")
               for i, t in enumerate(triples)]
    prompts += [_probe(p.format(s=t["subject"]), t["object"], fact=i, kind="paraphrase")
                for i, t in enumerate(triples) for p in RELATIONS[t["relation"]].paraphrases]
    got = generate_answers(model, tokenizer, prompts, max_new_tokens=config.max_new_tokens)
    known = [p for p, g in zip(prompts, got, strict=True) if answer_matches(g, p["answer"])]
    rewrite_ok = {p["fact"] for p in known if p["kind"] == "rewrite"}
    paraphrases: dict[int, list[str]] = {}
    for p in known:
        if p["kind"] == "paraphrase" and p["fact"] in rewrite_ok:
            paraphrases.setdefault(p["fact"], []).append(p["prompt"])
    # facts with a known paraphrase come first (so edit1 and edit10 measure generalization on every fact); the
    # model states too few of those for edit100, which takes stated facts without one after them
    rng = random.Random(config.seed)
    with_paraphrase = sorted(paraphrases)
    without = [i for i in sorted(rewrite_ok) if i not in paraphrases]
    rng.shuffle(with_paraphrase)
    rng.shuffle(without)
    editable = with_paraphrase + without
    need = max(SPLITS.values())
    if len(editable) < need:
        raise DataError(f"the model states only {len(editable)} facts; minizsre needs {need}")
    edited = editable[:need]
    subjects = {triples[i]["subject"] for i in edited}
    others = [i for i in sorted(rewrite_ok) if triples[i]["subject"] not in subjects]
    rng.shuffle(others)
    # the other subjects' facts: half are neighbourhood prompts (evaluated, never shown to a method), half retain data
    retain_pool, others = others[1::2][:config.retain_facts], others[0::2]
    neighbor_pool = {r: [i for i in others if triples[i]["relation"] == r] for r in RELATIONS}
    facts = []
    for rank, i in enumerate(edited):
        t = triples[i]
        pool = neighbor_pool[t["relation"]]
        picks = [pool[(rank * config.neighbors + k) % len(pool)] for k in range(config.neighbors)] if pool else []
        facts.append({**t, "rank": rank, "prompt": RELATIONS[t["relation"]].rewrite.format(s=t["subject"]),
                      "paraphrases": paraphrases.get(i, []),
                      "neighborhood": [{"prompt": RELATIONS[triples[j]["relation"]].rewrite.format(
                          s=triples[j]["subject"]), "answer": triples[j]["object"]} for j in picks]})
    text = general_text(config.retain_paragraphs)
    log.info("minizsre: %d triples, %d stated on the rewrite prompt, %d with a paraphrase, %d probes of %d kept",
             len(triples), len(rewrite_ok), len(with_paraphrase), len(known), len(prompts))
    return {
        "facts": facts,
        "retain_facts": [{"question": RELATIONS[triples[i]["relation"]].rewrite.format(s=triples[i]["subject"]),
                          "answer": triples[i]["object"], "subject": triples[i]["subject"]} for i in retain_pool],
        "retain_text": [{"text": t} for t in text],
        "build": [{"triples": len(triples), "stated": len(rewrite_ok), "with_paraphrase": len(with_paraphrase),
                   "probes_tried": len(prompts), "probes_kept": len(known), "source": COUNTRYINFO,
                   "model": str(Path(model_dir).name)}],
    }


def unlearning_inputs(splits: dict, split: str) -> tuple[list[dict], list[dict]]:
    """(the split's facts as rewrite prompt, object and subject; the retain facts and text)."""
    n = SPLITS[split]
    forget = [{"question": f["prompt"], "answer": f["object"], "subject": f["subject"]}
              for f in splits["facts"] if f["rank"] < n]
    return forget, list(splits["retain_facts"]) + [{"text": r["text"]} for r in splits["retain_text"]]


def ngram_entropy(text: str, ns: Sequence[int] = (2, 3), weights: Sequence[float] = (2 / 3, 4 / 3)) -> float:
    """ROME's fluency of one text: the weighted mean of the entropies (bits) of its word n-gram distributions."""
    words = re.findall(r"\w+|[^\w\s]", text.lower())
    entropies = []
    for n in ns:
        counts = Counter(tuple(words[i:i + n]) for i in range(len(words) - n + 1))
        total = sum(counts.values())
        entropies.append(-sum(c / total * math.log2(c / total) for c in counts.values()) if total else 0.0)
    return float(np.average(entropies, weights=weights))


def evaluate(model, tokenizer, splits: dict, split: str = "edit10", reference=None, *, batch_size: int = 32,
             max_new_tokens: int = 8) -> dict:
    """Every metric (flat keys) and the per-fact outcomes; `reference` is not needed."""
    facts = [f for f in splits["facts"] if f["rank"] < SPLITS[split]]
    rewrite = [_probe(f["prompt"], f["object"]) for f in facts]
    paraphrase = [_probe(p, f["object"]) for f in facts for p in f["paraphrases"]]
    neighbors = [_probe(n["prompt"], n["answer"]) for f in facts for n in f["neighborhood"]]
    probes = rewrite + paraphrase + neighbors
    got = generate_answers(model, tokenizer, probes, max_new_tokens=max_new_tokens, batch_size=batch_size)
    ok = [answer_matches(g, p["answer"]) for p, g in zip(probes, got, strict=True)]
    rewrite_ok, rest = ok[:len(rewrite)], ok[len(rewrite):]
    paraphrase_ok, neighbor_ok = rest[:len(paraphrase)], rest[len(paraphrase):]
    texts = generate_answers(model, tokenizer, rewrite, max_new_tokens=FLUENCY_TOKENS, batch_size=batch_size)
    mean = lambda xs: float(np.mean(xs)) if len(xs) else float("nan")  # noqa: E731
    metrics = {"efficacy": 1 - mean(rewrite_ok), "generalization": 1 - mean(paraphrase_ok),
               "specificity": mean(neighbor_ok), "fluency": mean([ngram_entropy(t) for t in texts]),
               "rewrite_accuracy": mean(rewrite_ok), "paraphrase_accuracy": mean(paraphrase_ok)}
    per_question = {"facts": [{"subject": f["subject"], "relation": f["relation"], "object": f["object"],
                               "generated": g, "given_up": not o}
                              for f, g, o in zip(facts, got[:len(rewrite)], rewrite_ok, strict=True)],
                    "neighbor_correct": neighbor_ok}
    return {"metrics": metrics, "per_question": per_question,
            "n": {"facts": len(facts), "paraphrases": len(paraphrase), "neighbors": len(neighbors)}}
