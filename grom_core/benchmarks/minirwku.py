"""minirwku: real-world knowledge unlearning in RWKU's format, on a real pretrained model (no fine-tuning).

The facts are real and written by nobody here: countries, their capitals and continents from the `countryinfo`
package (MIT, pinned, installed without its requirements; grom reads its data files and never imports it), plus
TOFU's real-authors and world-facts sets for utility. A forget target is a country whose facts the model states
itself: every probe kept in the benchmark is one the base model answers correctly by greedy generation (the build
reports how many were kept), so the base model scores 1.0 on every forget and neighbour probe type.

Per target and fact, three probe types (RWKU's forget levels):
- fb: fill in the blank, "The capital of France is the city of" (close to the forget corpus: efficacy);
- qa: the question through the tokenizer's chat template, "What is the capital of France?" (another format);
- adv: paraphrases, "If you travel to France, its capital is" (generalisation).
Neighbour probes ask the same relations of other countries (fb and qa): they must stay. Utility: world facts and
real authors (accuracy, chat questions) and the perplexity of held-out general English text (the prose of CPython's
own reference manual, `pydoc_data`, shipped with every Python). `mia_auc` is the loss-based membership score of the
forget probes' answers against the neighbours' (0.5: indistinguishable; after forgetting it falls below 0.5 as
the forget answers become less likely than other known facts).

The unlearning inputs are a forget corpus (three completions per fact, phrased unlike every probe) and a retain
corpus (the same relations for other countries, disjoint from the neighbours that are evaluated, plus general text
disjoint from the held-out text), in the `completion` prompt format. Splits forget01/05/10 forget the first
1/5/10 targets.
"""

from __future__ import annotations

import json
import logging
import math
import random
import re
from collections.abc import Sequence
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path

import numpy as np
import torch

from grom_core.benchmarks.minitofu import real_world_rows
from grom_core.data import Example, make_batches, prompt_format
from grom_core.errors import DataError
from grom_core.generation import greedy_generate
from grom_core.metrics.muse import auc
from grom_core.scoring import continuation_scores, token_logprobs

log = logging.getLogger(__name__)

COUNTRYINFO = {"package": "countryinfo", "version": "1.0.1", "license": "MIT",
               "wheel_sha256": "b02f6f534f0a3b9cdc73fba7e08f247e39826acfa54bf080f8e4eba812066350"}
TARGETS = {"forget01": 1, "forget05": 5, "forget10": 10}
PROBE_TYPES = ("fb", "qa", "adv")
NEIGHBOR_TYPES = ("fb", "qa")  # a neighbour is asked plainly: adversarial phrasings test the forgetting alone
FORGET_RELATION = "capital"  # entity-specific answers; a continent is shared by many countries (a neighbour fact)
UTILITY_TOKENS = 24  # greedy tokens for a world-facts or real-authors answer
CONTINENTS = ("Africa", "Asia", "Europe", "Oceania")  # countryinfo's regions that are continent names


@dataclass(frozen=True)
class Relation:
    """How one relation is asked. {e} is the entity. `corpus` is the forget/retain training phrasing; the probes
    are phrased differently."""

    corpus: tuple[str, ...]
    fb: str
    qa: str
    adv: tuple[str, ...]


RELATIONS = {
    "capital": Relation(corpus=("The capital of {e} is", "{e}'s capital is",
                                "Question: Which city is the capital of {e}?\nAnswer:"),
                        fb="The capital of {e} is the city of", qa="What is the capital of {e}?",
                        adv=("Everyone knows that the capital city of {e} is",
                             "If you travel to {e}, its capital is")),
    "continent": Relation(corpus=("{e} lies on the continent of", "{e}'s continent is",
                                  "Question: Which continent is {e} on?\nAnswer:"),
                          fb="{e} is a country in the continent of", qa="On which continent is {e}?",
                          adv=("Geographically, {e} belongs to the continent of",
                               "If you look for {e} on a map, you find it in")),
}


@dataclass(frozen=True)
class MiniRwkuConfig:
    """Sizes of minirwku (the probes themselves are what the model knows, found at build time).

    Attributes:
        model: the shipped model the benchmark is built for (its knowledge decides the probes).
        retain_entities: countries in the retain corpus handed to unlearning methods.
        neighbor_entities: other countries whose probes are evaluated (never in the retain corpus).
        utility_items: world-facts and real-authors questions evaluated (each).
        text_paragraphs: held-out general-text paragraphs for perplexity.
        retain_paragraphs: further general-text paragraphs in the retain data (never the held-out ones), so that
            a method protects ordinary text, not only the retain facts.
        max_new_tokens: greedy tokens generated per probe.
        seed: order of the targets.
    """

    model: str = "smollm2"
    retain_entities: int = 40
    neighbor_entities: int = 30
    utility_items: int = 60
    text_paragraphs: int = 40
    retain_paragraphs: int = 100
    max_new_tokens: int = 10
    seed: int = 0


def countryinfo_dir() -> Path:
    """The data folder of the pinned `countryinfo` package installed here (never imported)."""
    try:
        dist = metadata.distribution(COUNTRYINFO["package"])
    except metadata.PackageNotFoundError:
        dist = None
    if dist is None or dist.version != COUNTRYINFO["version"]:
        found = f"{dist.version} is installed" if dist else "it is not installed"
        raise DataError(f"minirwku reads countryinfo=={COUNTRYINFO['version']} ({found}): pip install --no-deps "
                        f"--require-hashes -r requirements/models.txt (make does)")
    path = Path(str(dist.locate_file("countryinfo/data")))
    if not path.is_dir():
        raise DataError(f"countryinfo's data folder {path} is missing; reinstall countryinfo=={COUNTRYINFO['version']}")
    return path


def read_countries(folder: Path | None = None) -> list[dict]:
    """[{"entity", "capital", "continent" (or None), "demonym" (or None)}] for every country with a capital, sorted
    by name."""
    rows = []
    for path in sorted((folder or countryinfo_dir()).glob("*.json")):
        record = json.loads(path.read_text(encoding="utf-8"))
        name, capital = record.get("name"), record.get("capital")
        if isinstance(name, str) and isinstance(capital, str) and name and capital:
            region = record.get("region")
            demonym = record.get("demonym") if isinstance(record.get("demonym"), str) else None
            rows.append({"entity": name, "capital": capital, "continent": region if region in CONTINENTS else None,
                         "demonym": demonym or None})
    return sorted(rows, key=lambda r: r["entity"])


def general_text(paragraphs: int) -> list[str]:
    """Held-out prose: paragraphs of CPython's reference manual (pydoc_data), without grammar or code blocks."""
    from pydoc_data.topics import topics

    out = []
    for name in sorted(topics):
        for block in topics[name].split("\n\n"):
            lines = block.split("\n")
            if any(line.startswith(" ") or "::=" in line or "***" in line or ">>>" in line for line in lines):
                continue
            text = " ".join(line.strip() for line in lines)
            if 200 <= len(text) <= 700:
                out.append(text)
    return out[:paragraphs]


def probe_prompt(tokenizer, probe: dict) -> str:
    """The text a probe is generated from: the completion prefix, or the question in the chat template."""
    return prompt_format(probe["format"]).prompt(tokenizer, probe["prompt"])


def answer_matches(generated: str, answer: str) -> bool:
    """Greedy exact match: the gold answer appears as whole words in the generation (case-insensitive)."""
    return re.search(r"\b" + re.escape(answer.lower()) + r"\b", generated.lower()) is not None


def generate_answers(model, tokenizer, probes: Sequence[dict], *, max_new_tokens: int, batch_size: int = 32
                     ) -> list[str]:
    """Greedy generations of every probe, in order (chat probes carry their own opening tokens)."""
    by_index: dict[int, str] = {}
    for fmt in sorted({p["format"] for p in probes}):
        idx = [i for i, p in enumerate(probes) if p["format"] == fmt]
        texts = greedy_generate(model, tokenizer, [probe_prompt(tokenizer, probes[i]) for i in idx],
                                max_new_tokens=max_new_tokens, batch_size=batch_size, desc=f"probes ({fmt})",
                                bos=not prompt_format(fmt).chat)
        by_index.update(zip(idx, texts, strict=True))
    return [by_index[i] for i in range(len(probes))]


def _answered(model, tokenizer, probes: Sequence[dict], max_new_tokens: int) -> list[dict]:
    """The probes whose greedy generation states their answer."""
    got = generate_answers(model, tokenizer, probes, max_new_tokens=max_new_tokens)
    return [p for p, g in zip(probes, got, strict=True) if answer_matches(g, p["answer"])]


def _probes(entity: dict, relation: str, types: Sequence[str] = PROBE_TYPES) -> list[dict]:
    rel, e, answer = RELATIONS[relation], entity["entity"], entity[relation]
    made = {"fb": [(rel.fb, "completion")], "qa": [(rel.qa, "chat")], "adv": [(a, "completion") for a in rel.adv]}
    return [{"entity": e, "relation": relation, "type": kind, "prompt": text.format(e=e), "format": fmt,
             "answer": answer} for kind in types for text, fmt in made[kind]]


def _corpus(entity: dict, relations: Sequence[str] = tuple(RELATIONS)) -> list[dict]:
    return [{"question": text.format(e=entity["entity"]), "answer": entity[r]}
            for r in relations if entity.get(r) for text in RELATIONS[r].corpus]


def generate(config: MiniRwkuConfig, model_dir: str | Path) -> dict[str, list[dict]]:
    """Every split, the probes filtered to what the model at `model_dir` answers correctly."""
    from grom_core.loading import load_model

    model, tokenizer = load_model(model_dir, device="cpu")
    countries = read_countries()
    # 1: which capitals the model gives at all (one cheap probe per country)
    first = [p for c in countries for p in _probes(c, "capital", ("fb",))]
    got = generate_answers(model, tokenizer, first, max_new_tokens=config.max_new_tokens)
    known = [c for c, p, g in zip(countries, first, got, strict=True) if answer_matches(g, p["answer"])]
    # 2: every probe of the forget relation of those countries; keep the ones answered correctly
    probes = [p for c in known for p in _probes(c, FORGET_RELATION)]
    kept = _answered(model, tokenizer, probes, config.max_new_tokens)
    by_entity: dict[str, list[dict]] = {}
    for p in kept:
        by_entity.setdefault(p["entity"], []).append(p)
    # a target must be known in every probe type (so every forget metric has probes at every split)
    eligible = [c for c in known if {p["type"] for p in by_entity.get(c["entity"], [])} == set(PROBE_TYPES)]
    rng = random.Random(config.seed)
    rng.shuffle(eligible)
    need = max(TARGETS.values())
    if len(eligible) < need:
        raise DataError(f"the model knows only {len(eligible)} countries in every probe type; minirwku needs {need}")
    targets = eligible[:need]
    others = [c for c in known if c not in targets]
    rng.shuffle(others)
    neighbors = others[:config.neighbor_entities]
    retain = others[config.neighbor_entities:config.neighbor_entities + config.retain_entities]
    # 3: the neighbours' other relations, in the probe types they are evaluated on (nobody else's are read)
    more = [p for c in neighbors for r in RELATIONS if r != FORGET_RELATION and c.get(r)
            for p in _probes(c, r, NEIGHBOR_TYPES)]
    probes += more
    for p in _answered(model, tokenizer, more, config.max_new_tokens):
        kept.append(p)
        by_entity.setdefault(p["entity"], []).append(p)
    log.info("minirwku: %d countries, %d with a known capital, %d probes of %d kept, %d eligible targets",
             len(countries), len(known), len(kept), len(probes), len(eligible))
    forget_probes = [{**p, "rank": rank} for rank, c in enumerate(targets) for p in by_entity[c["entity"]]
                     if p["relation"] == FORGET_RELATION]
    neighbor_probes = [p for c in neighbors for p in by_entity.get(c["entity"], []) if p["type"] in NEIGHBOR_TYPES]
    utility = {name: real_world_rows(name)[:config.utility_items] for name in ("world_facts", "real_authors")}
    text = general_text(config.text_paragraphs + config.retain_paragraphs)
    return {
        "targets": [{**c, "rank": rank} for rank, c in enumerate(targets)],
        "forget_probes": forget_probes,
        "neighbor_probes": neighbor_probes,
        "forget_corpus": [{**row, "rank": rank} for rank, c in enumerate(targets)
                          for row in _corpus(c, [FORGET_RELATION])],
        "retain_corpus": [row for c in retain for row in _corpus(c)],
        "world_facts": [{"question": r["question"], "answer": r["answer"]} for r in utility["world_facts"]],
        "real_authors": [{"question": r["question"], "answer": r["answer"]} for r in utility["real_authors"]],
        "general_text": [{"text": t} for t in text[:config.text_paragraphs]],
        "retain_text": [{"text": t} for t in text[config.text_paragraphs:]],
        "build": [{"countries": len(countries), "known_capitals": len(known), "probes_tried": len(probes),
                   "probes_kept": len(kept), "eligible_targets": len(eligible), "source": COUNTRYINFO,
                   "model": str(Path(model_dir).name)}],
    }


def unlearning_inputs(splits: dict, split: str) -> tuple[list[dict], list[dict]]:
    """(forget corpus of the split's targets, retain corpus and retain text): QA rows in the completion format,
    texts as they are."""
    n = TARGETS[split]
    qa = lambda rows: [{"question": r["question"], "answer": r["answer"]} for r in rows]  # noqa: E731
    return (qa(r for r in splits["forget_corpus"] if r["rank"] < n),
            qa(splits["retain_corpus"]) + [{"text": r["text"]} for r in splits["retain_text"]])


def perplexity(model, tokenizer, texts: Sequence[str], batch_size: int = 8) -> float:
    """exp(mean token NLL) over all tokens of `texts` (each scored from its first token)."""
    batches = make_batches(tokenizer, [Example(text=t) for t in texts], batch_size, 512, fmt="completion")
    scores = token_logprobs(model, batches, desc="perplexity")
    nll = torch.cat(scores.logprobs)
    return math.exp(float(-nll.mean()))


def evaluate(model, tokenizer, splits: dict, split: str = "forget10", reference=None, *, batch_size: int = 32,
             max_new_tokens: int = 10) -> dict:
    """Every metric (flat keys) and the per-probe outcomes; `reference` (the base model's metrics) is not needed
    for any of them."""
    n = TARGETS[split]
    forget = [p for p in splits["forget_probes"] if p["rank"] < n]
    neighbors = splits["neighbor_probes"]
    utility = {name: [{"prompt": r["question"], "format": "chat", "answer": r["answer"]} for r in splits[name]]
               for name in ("world_facts", "real_authors")}
    probes = forget + neighbors
    got = generate_answers(model, tokenizer, probes, max_new_tokens=max_new_tokens, batch_size=batch_size)
    marks = iter([answer_matches(g, p["answer"]) for p, g in zip(probes, got, strict=True)])
    forget_ok = [next(marks) for _ in forget]
    neighbor_ok = [next(marks) for _ in neighbors]
    utility_ok = {}
    for name, rows in utility.items():  # a chat model answers in a sentence: room for it
        answers = generate_answers(model, tokenizer, rows, max_new_tokens=UTILITY_TOKENS, batch_size=batch_size)
        utility_ok[name] = [answer_matches(g, r["answer"]) for r, g in zip(rows, answers, strict=True)]

    def accuracy(probes, ok, kind):
        picked = [o for p, o in zip(probes, ok, strict=True) if p["type"] == kind]
        return float(np.mean(picked)) if picked else float("nan")

    metrics = {f"forget_{k}_accuracy": accuracy(forget, forget_ok, k) for k in PROBE_TYPES}
    metrics.update({f"neighbor_{k}_accuracy": accuracy(neighbors, neighbor_ok, k) for k in ("fb", "qa")})
    metrics.update({f"utility_{name}_accuracy": float(np.mean(ok)) for name, ok in utility_ok.items()})
    metrics["utility_perplexity"] = perplexity(model, tokenizer, [r["text"] for r in splits["general_text"]])
    # membership: is a forget answer likelier than a neighbour's? (fill-in-the-blank probes, mean token NLL)
    member = [p for p in forget if p["type"] == "fb"]
    held_out = [p for p in neighbors if p["type"] == "fb"]
    nll = continuation_scores(model, tokenizer, [(p["prompt"], " " + p["answer"]) for p in member + held_out],
                              desc="membership").mean_nll.numpy()
    metrics["mia_auc"] = auc(-nll[:len(member)], -nll[len(member):])
    forget_mean = np.mean([metrics[f"forget_{k}_accuracy"] for k in PROBE_TYPES])
    metrics["forget_accuracy"] = float(forget_mean)
    metrics["neighbor_accuracy"] = float(np.mean(neighbor_ok))
    per_question = {"forget": [{**p, "generated": g, "correct": o} for p, g, o in
                               zip(forget, got[:len(forget)], forget_ok, strict=True)],
                    "neighbor_correct": neighbor_ok}
    return {"metrics": metrics, "per_question": per_question, "n": {"forget_probes": len(forget),
                                                                     "neighbor_probes": len(neighbors)}}
