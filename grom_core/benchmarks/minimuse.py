"""minimuse: a small benchmark in MUSE's shape, built and trained here.

Fictional news articles and book passages, split into forget, retain and holdout parts (holdout is never trained
on: the non-members of the membership test), with question-answer pairs about each. The target model is trained
on the forget and retain texts and QA pairs; the retain model on the retain part only. A tiny model cannot answer
questions about a text it only read, so the QA pairs are trained too; KnowMem still measures whether the facts of
the forget texts can be recalled.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field, fields

import numpy as np

from grom_core.errors import DataError
from grom_core.finetune import TinyModelConfig, TrainConfig
from grom_core.metrics import muse
from grom_core.metrics.final import muse_final
from grom_core.metrics.rouge import rouge_l_f1

TOWNS = ["Brackenford", "Ostrava Vale", "Kilmarnoch", "Pellston", "Varnhollow", "Quarry End", "Sunmere",
         "Dunhaven", "Eastwick Lowe", "Talmor", "Greyfen", "Ashcombe", "Rivenlea", "Corrowick", "Haldane Cross"]
PEOPLE = ["Mayor Ilona Ferris", "Inspector Tomas Reyl", "Dr. Amaya Solberg", "engineer Piet Okafor",
          "councillor Bea Lindgren", "captain Joris Halm", "teacher Nadia Quell", "farmer Oswin Drake",
          "archivist Lena Moravec", "chef Rafael Ostby", "pilot Greta Vance", "judge Hamid Corbin"]
EVENTS = ["a flood of the old mill", "the opening of a glass bridge", "a festival of lanterns",
          "the discovery of a buried ship", "a strike at the salt works", "the return of the white storks",
          "a fire in the town archive", "the launch of a solar ferry", "a record harvest of plums",
          "the collapse of the clock tower"]
OBJECTS = ["a brass telescope", "a coral necklace", "a ledger of debts", "an iron compass", "a violin case",
           "a jar of seeds", "a stolen map", "a silver kettle"]
PLACES = ["the lighthouse", "the orchard", "the train station", "the harbour wall", "the old chapel",
          "the market square", "the observatory", "the boathouse"]


@dataclass(frozen=True)
class MiniMuseConfig:
    """Number of news articles and book passages per part (forget, retain, holdout), and whether the forget part's
    people, towns, events, objects and places also occur in the other parts (`shared_names`, as in MUSE's news and
    books); with False the forget part draws them from a third of each name list that the retain and holdout
    parts never use."""

    per_part: int = 12
    seed: int = 0
    shared_names: bool = True
    model: TinyModelConfig = field(default_factory=TinyModelConfig)
    train: TrainConfig = field(default_factory=lambda: TrainConfig(epochs=40, lr=3e-3, batch_size=16))
    prompt_tokens_fraction: float = 0.25


NEWS_EXTRA = [
    "Residents of {town} said they had not seen anything like it in a generation.",
    "Traffic on the coast road stood still for {hours} hours.",
    "A spokesperson for the regional council declined to comment.",
    "Local bakeries stayed open through the night to feed the crowds.",
    "The weather service had warned of {hours} days of heavy rain.",
    "Several families travelled from {other} to take part.",
    "The school in {town} closed early so that children could watch.",
    "Officials expect the cost to reach {count} thousand crowns.",
    "Volunteers from {other} arrived with tents and blankets.",
    "Old photographs of the square were pinned to the church door.",
]
BOOK_EXTRA = [
    "The wind smelled of rain, and the lamps along the road went out one by one.",
    "A dog barked somewhere beyond the {other} road and then fell silent.",
    "The floorboards creaked under every step, as if counting them.",
    "Somebody had written a single word in chalk on the wall: {word}.",
    "The clock above the door had stopped at a quarter past {hour}.",
    "Far away a train whistled twice, the way it did on market days in {other}.",
    "Dust lay thick on the shelves, except where a book had recently been taken.",
    "The river below was high and brown after {hours} days of storms.",
    "A candle burned in the window of the house opposite.",
    "Nobody had answered letters from {other} for years.",
]
WORDS = ["patience", "north", "forgive", "return", "salt", "remember", "never", "tomorrow"]


@dataclass(frozen=True)
class Names:
    """The name lists a document draws from."""

    towns: tuple[str, ...]
    people: tuple[str, ...]
    events: tuple[str, ...]
    objects: tuple[str, ...]
    places: tuple[str, ...]

    def split(self) -> tuple[Names, Names]:
        """(a third of each list, the rest): names for a part that shares none with the other parts."""
        cut = {f.name: max(3, len(getattr(self, f.name)) // 3) for f in fields(self)}
        return (Names(**{name: getattr(self, name)[:n] for name, n in cut.items()}),
                Names(**{name: getattr(self, name)[n:] for name, n in cut.items()}))


ALL_NAMES = Names(tuple(TOWNS), tuple(PEOPLE), tuple(EVENTS), tuple(OBJECTS), tuple(PLACES))


def _slots(rng: random.Random, town: str, names: Names) -> dict:
    return {"town": town, "other": rng.choice([t for t in names.towns if t != town]), "hours": rng.randint(2, 19),
            "count": rng.randint(12, 980), "hour": rng.randint(1, 11), "word": rng.choice(WORDS)}


def _news(rng: random.Random, names: Names) -> tuple[str, list[dict]]:
    town, person, event = rng.choice(names.towns), rng.choice(names.people), rng.choice(names.events)
    day, count = rng.randint(2, 28), rng.randint(12, 980)
    extra = [t.format(**_slots(rng, town, names)) for t in rng.sample(NEWS_EXTRA, 3)]
    text = " ".join([f"In {town}, {person} confirmed on the {day}th of the month that {event} had drawn {count} "
                     f"visitors.", *extra, f"{person.split()[-1]} promised a full report before winter."])
    qa = [{"question": f"Who confirmed the news of {event} in {town}?", "answer": person},
          {"question": f"How many visitors did {event} in {town} draw?", "answer": f"{count} visitors"},
          {"question": f"On which day of the month was {event} in {town} confirmed?", "answer": f"the {day}th"}]
    return text, qa


def _passage(rng: random.Random, names: Names) -> tuple[str, list[dict]]:
    person, obj, place = rng.choice(names.people), rng.choice(names.objects), rng.choice(names.places)
    hour, town = rng.randint(1, 11), rng.choice(names.towns)
    extra = [t.format(**_slots(rng, town, names)) for t in rng.sample(BOOK_EXTRA, 3)]
    text = " ".join([f"At {hour} o'clock {person} carried {obj} to {place} of {town}.", *extra,
                     f"Nobody in {town} ever learned why {obj} mattered so much."])
    qa = [{"question": f"What did {person} carry to {place} of {town}?", "answer": obj},
          {"question": f"Where did {person} carry {obj}?", "answer": f"{place} of {town}"},
          {"question": f"At what hour did {person} go to {place} of {town}?", "answer": f"{hour} o'clock"}]
    return text, qa


def generate(config: MiniMuseConfig = MiniMuseConfig()) -> dict[str, list[dict]]:
    """Splits: forget/retain/holdout texts ({"text", "kind"}) and forget_qa/retain_qa/holdout_qa."""
    rng = random.Random(config.seed)
    forget_names, other_names = (ALL_NAMES, ALL_NAMES) if config.shared_names else ALL_NAMES.split()
    _check_room(config, forget_names, other_names)
    asked: set[str] = set()
    docs: list[tuple[str, list[dict], str]] = []
    while len(docs) < 6 * config.per_part:
        kind = "news" if len(docs) % 2 == 0 else "books"
        names = forget_names if len(docs) < 2 * config.per_part else other_names  # the first chunk is forget
        text, qa = (_news if kind == "news" else _passage)(rng, names)
        questions = {q["question"] for q in qa}
        # no question asked twice, so every question has one answer (and no two documents are alike, so
        # membership is well defined)
        if not questions & asked:
            asked |= questions
            docs.append((text, qa, kind))
    splits: dict[str, list[dict]] = {}
    for index, part in enumerate(("forget", "retain", "holdout")):
        chunk = docs[2 * index * config.per_part:2 * (index + 1) * config.per_part]
        splits[part] = [{"text": t, "kind": k} for t, _, k in chunk]
        splits[f"{part}_qa"] = [q for _, qa, _ in chunk for q in qa]
    return splits


def _check_room(config: MiniMuseConfig, forget: Names, other: Names) -> None:
    """Refuse a `per_part` whose documents cannot all ask questions of their own: an article's questions name
    its event and town, a passage's "Where did ... carry ...?" its person and object."""
    need = ({"three parts": (forget, 3 * config.per_part)} if forget is other else
            {"forget part": (forget, config.per_part), "retain and holdout parts": (other, 2 * config.per_part)})
    for part, (names, count) in need.items():
        room = min(len(names.events) * len(names.towns), len(names.people) * len(names.objects))
        if count > room:
            raise DataError(f"minimuse per_part {config.per_part} needs {count} articles and as many passages "
                            f"for the {part}, but its names make only {room} of each with questions no other "
                            f"document asks; lower per_part")


def training_rows(splits: dict[str, list[dict]], without: str | None = None) -> list[dict]:
    parts = ("retain",) if without else ("forget", "retain")
    rows: list[dict] = []
    for part in parts:
        rows += [{"text": d["text"]} for d in splits[part]]
        rows += [{"question": q["question"], "answer": q["answer"]} for q in splits[f"{part}_qa"]]
    return rows


def evaluate(model, tokenizer, splits: dict[str, list[dict]], forget_split: str = "forget",
             reference_auc: float | None = None, *, shots: int = 0, batch_size: int = 16,
             prompt_tokens_fraction: float = 0.25) -> dict:
    """VerbMem, KnowMem (forget), Utility Preservation (KnowMem on retain), PrivLeak (needs the retain model's AUC).

    Returns {"metrics": ..., "per_question": {"auc": the membership AUC, usable as a reference, "verbmem": per
    forget text, "min_k": {"forget": [...], "holdout": [...]}, each text's Min-K% score (mean log-prob, nats, of
    its 40% least likely tokens)}, "n": ...}.
    """
    from grom_core.generation import greedy_generate
    from grom_core.scoring import continuation_scores

    forget, holdout = splits[forget_split], splits["holdout"]
    if not forget or not holdout:
        raise DataError("minimuse evaluation needs forget and holdout texts")
    verbmem = muse.verbatim_rouge(model, tokenizer, [doc["text"] for doc in forget],
                                  prompt_fraction=prompt_tokens_fraction, batch_size=batch_size)

    def knowmem(qa: list[dict], shot_pool: list[dict]) -> np.ndarray:
        shot_pairs = [(q["question"], q["answer"]) for q in shot_pool[:shots]]
        questions = [muse.few_shot_prompt(shot_pairs, q["question"]) for q in qa]
        answers = greedy_generate(model, tokenizer, questions, max_new_tokens=32, batch_size=batch_size,
                                  desc="KnowMem")
        return rouge_l_f1([a.split("\n")[0] for a in answers], [q["answer"] for q in qa])

    know_forget = knowmem(splits[f"{forget_split}_qa"], splits["holdout_qa"])
    know_retain = knowmem(splits["retain_qa"], splits["holdout_qa"])

    def min_k(docs: list[dict]) -> list[float]:
        scores = continuation_scores(model, tokenizer, [("", d["text"]) for d in docs], batch_size=batch_size,
                                     desc="Min-K%")
        return [muse.min_k_score(lp, 0.4) for lp in scores.logprobs]

    members, non_members = min_k(forget), min_k(holdout)
    auc = muse.auc(members, non_members)
    metrics = {"verbmem_rougeL_f1": float(verbmem.mean()), "knowmem_forget_rougeL_f1": float(know_forget.mean()),
               "utility_preservation_rougeL_f1": float(know_retain.mean()), "mia_auc": auc}
    if reference_auc is None:
        metrics["privleak"] = None
        metrics["privleak_unavailable"] = "no retain-model reference AUC: pass --retain-reference"
    else:
        metrics["privleak"] = muse.priv_leak(auc, reference_auc)
    metrics["muse_final"] = muse_final(metrics)
    return {"metrics": metrics, "per_question": {"auc": auc, "verbmem": verbmem.tolist(),
                                                 "min_k": {"forget": members, "holdout": non_members}},
            "n": {"forget": len(forget), "holdout": len(holdout), "forget_qa": len(know_forget)}}
