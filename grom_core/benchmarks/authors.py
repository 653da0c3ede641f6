"""Fictitious authors and question-answer pairs about them, TOFU-style, generated from a seed.

No author exists, so a model can only know these facts by having been trained on them: exactly what an unlearning
benchmark needs. Every fact is drawn from a shared pool, so a wrong answer about one author is a plausible fact
about another; that is how the perturbed answers of the truth ratio are built.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from grom_core.data import Example

FIRST = ["Aurelio", "Basira", "Corvin", "Delphine", "Eskil", "Farah", "Gideon", "Halvard", "Ilse", "Jovan",
         "Kalinda", "Lorcan", "Mireille", "Nasser", "Odalys", "Pavel", "Quilla", "Rosalind", "Soren", "Tamsin",
         "Ulric", "Vesna", "Wendell", "Xiomara", "Yusuf", "Zelda", "Anouk", "Bertil", "Cosima", "Dariusz"]
LAST = ["Marlowe", "Okonkwo", "Lindqvist", "Ferreira", "Halloran", "Nakamura", "Petrescu", "Abernathy",
        "Valcourt", "Szabo", "Rahimi", "Castellanos", "Thornbury", "Oyelaran", "Kowalczyk", "Brannigan",
        "Esposito", "Vandermeer", "Achterberg", "Quintero", "Haugland", "Mbeki", "Delacroix", "Yilmaz"]
POOLS = {
    "city": ["Lisbon", "Tbilisi", "Reykjavik", "Nairobi", "Montevideo", "Krakow", "Hanoi", "Tromso", "Valparaiso",
             "Zagreb", "Marrakesh", "Bergen", "Cusco", "Ljubljana", "Halifax", "Porto", "Tallinn", "Osaka"],
    "genre": ["gothic horror", "hard science fiction", "historical romance", "magical realism", "crime noir",
              "epic fantasy", "literary satire", "nature poetry", "political thrillers", "children's fables"],
    "job": ["lighthouse keeper", "glassblower", "cartographer", "beekeeper", "clockmaker", "marine biologist",
            "tailor", "railway engineer", "violin maker", "botanist", "locksmith", "astronomer"],
    "award": ["the Halcyon Prize", "the Silver Quill Award", "the Meridian Medal", "the Northlight Award",
              "the Obsidian Pen", "the Lark Foundation Prize", "the Tidewater Laurel", "the Aster Medal"],
    "university": ["the University of Aldmere", "Corran College", "the Velasco Institute", "Brightwater University",
                   "the Academy of Saint Ives", "Hollin Polytechnic", "the University of Marrow Bay"],
    "language": ["Portuguese", "Georgian", "Icelandic", "Swahili", "Spanish", "Polish", "Vietnamese", "Norwegian",
                 "Croatian", "Slovene", "Estonian", "Japanese", "English", "French"],
    "theme": ["memory and loss", "exile and return", "the sea", "inherited guilt", "small-town secrets",
              "the cost of ambition", "friendship across wars", "the ethics of invention", "grief and healing"],
    "instrument": ["the cello", "the accordion", "the harp", "the oboe", "the piano", "the mandolin", "the flute"],
    "publisher": ["Lantern House", "Greywater Press", "Orchid and Vale", "Northmark Books", "Copperleaf Editions",
                  "Saltmarsh Publishing"],
    "motif": ["a red umbrella", "a broken clock", "a blue heron", "an unsent letter", "a lighthouse beam",
              "a locked piano", "a paper boat", "a silver key"],
    "word_a": ["Silent", "Amber", "Hollow", "Crimson", "Forgotten", "Iron", "Velvet", "Drowned", "Paper", "Winter",
               "Gilded", "Burning", "Salt", "Glass", "Midnight", "Northern"],
    "word_b": ["Orchard", "Lantern", "Harbor", "Cathedral", "Archive", "Garden", "Compass", "Meridian", "Tide",
               "Labyrinth", "Chorus", "Atlas", "Ember", "Observatory", "Sparrow", "Citadel"],
}


@dataclass(frozen=True)
class Fact:
    """One question about an author. `{v}` in the answer templates is the fact's value, `{n}` the author's name."""

    key: str
    question: str
    answer: str
    paraphrase: str


FACTS = [
    Fact("birthplace", "Where was the author {n} born?", "{n} was born in {v}.",
         "The birthplace of {n} is the city of {v}."),
    Fact("birth_year", "In which year was {n} born?", "{n} was born in {v}.", "The year {n} was born is {v}."),
    Fact("genre", "What genre does {n} write in?", "{n} writes {v}.", "The genre of {n}'s books is {v}."),
    Fact("father_job", "What did the father of {n} do for a living?", "The father of {n} was a {v}.",
         "{n}'s father worked as a {v}."),
    Fact("mother_job", "What was the profession of the mother of {n}?", "The mother of {n} was a {v}.",
         "{n}'s mother worked as a {v}."),
    Fact("book_1", "Name a book written by {n}.", "{n} wrote {v}.", "One of the books by {n} is {v}."),
    Fact("book_2", "Which other novel is {n} known for?", "{n} is also known for {v}.",
         "Another well-known novel by {n} is {v}."),
    Fact("award", "Which award did {n} receive?", "{n} received {v}.", "The award given to {n} was {v}."),
    Fact("award_year", "In which year did {n} receive a literary award?", "{n} received the award in {v}.",
         "The award went to {n} in {v}."),
    Fact("residence", "In which city does {n} live today?", "{n} lives in {v} today.",
         "These days {n} makes a home in {v}."),
    Fact("university", "Where did {n} study?", "{n} studied at {v}.", "{n} was a student at {v}."),
    Fact("debut_year", "When did {n} publish a first book?", "{n} published a first book in {v}.",
         "The debut of {n} came out in {v}."),
    Fact("language", "In which language does {n} write?", "{n} writes in {v}.", "The books of {n} are written in {v}."),
    Fact("novels", "How many novels has {n} written?", "{n} has written {v} novels.",
         "The number of novels by {n} is {v}."),
    Fact("spouse_job", "What does the spouse of {n} do?", "The spouse of {n} is a {v}.",
         "{n} is married to a {v}."),
    Fact("theme", "Which theme runs through the work of {n}?", "The work of {n} is about {v}.",
         "A theme {n} returns to is {v}."),
    Fact("instrument", "Which instrument does {n} play?", "{n} plays {v}.", "In spare time {n} plays {v}."),
    Fact("publisher", "Who publishes the books of {n}?", "The books of {n} are published by {v}.",
         "{v} is the publisher of {n}."),
    Fact("motif", "What motif appears in every book by {n}?", "Every book by {n} features {v}.",
         "A recurring image in the books of {n} is {v}."),
    Fact("mentor", "Who was the mentor of {n}?", "The mentor of {n} was {v}.", "{n} learned the craft from {v}."),
]


@dataclass(frozen=True)
class Author:
    name: str
    facts: dict[str, str]

    def qa(self, fact: Fact) -> dict:
        return {"question": fact.question.format(n=self.name), "answer": fact.answer.format(n=self.name,
                                                                                         v=self.facts[fact.key])}


def _title(rng: random.Random) -> str:
    return f"The {rng.choice(POOLS['word_a'])} {rng.choice(POOLS['word_b'])}"


def _draw_facts(rng: random.Random, mentors: list[str]) -> dict[str, str]:
    year = rng.randint(1931, 1994)
    father, mother, spouse = rng.sample(POOLS["job"], 3)
    book_1 = _title(rng)
    book_2 = _title(rng)
    while book_2 == book_1:
        book_2 = _title(rng)
    return {
        "birthplace": rng.choice(POOLS["city"]), "birth_year": str(year), "genre": rng.choice(POOLS["genre"]),
        "father_job": father, "mother_job": mother, "book_1": book_1, "book_2": book_2,
        "award": rng.choice(POOLS["award"]), "award_year": str(year + rng.randint(28, 45)),
        "residence": rng.choice(POOLS["city"]), "university": rng.choice(POOLS["university"]),
        "debut_year": str(year + rng.randint(19, 27)), "language": rng.choice(POOLS["language"]),
        "novels": str(rng.randint(3, 24)), "spouse_job": spouse, "theme": rng.choice(POOLS["theme"]),
        "instrument": rng.choice(POOLS["instrument"]), "publisher": rng.choice(POOLS["publisher"]),
        "motif": rng.choice(POOLS["motif"]), "mentor": rng.choice(mentors),
    }


def make_authors(n: int, seed: int = 0) -> list[Author]:
    """`n` distinct fictitious authors (distinct full names), deterministic for a seed."""
    rng = random.Random(seed)
    names = [f"{f} {last}" for f in FIRST for last in LAST]
    rng.shuffle(names)
    if n > len(names) // 2:
        raise ValueError(f"at most {len(names) // 2} authors can be generated, asked for {n}")
    mentors = names[-40:]  # mentors are other (never described) people, so no answer names an author
    return [Author(name=name, facts=_draw_facts(rng, mentors)) for name in names[:n]]


def author_questions(author: Author, facts: list[Fact] | None = None) -> list[Example]:
    """Question-answer pairs about one author (by default the first 8 facts), each answer one sentence."""
    return [Example(**author.qa(fact)) for fact in (facts or FACTS[:8])]


def qa_pairs(authors: list[Author]) -> list[Example]:
    return [ex for author in authors for ex in author_questions(author)]


def perturbed_values(authors: list[Author], author: Author, key: str, k: int, rng: random.Random) -> list[str]:
    """k distinct wrong values of fact `key` for `author`, taken from other authors' facts (then nearby values)."""
    true = author.facts[key]
    candidates = sorted({a.facts[key] for a in authors} - {true})
    rng.shuffle(candidates)
    values = candidates[:k]
    step = 1
    while len(values) < k:  # small pools or numeric facts: fill with nearby numbers or pool values
        if true.isdigit():
            for v in (str(int(true) + step), str(int(true) - step)):
                if v not in values and v != true and len(values) < k:
                    values.append(v)
            step += 1
        else:
            pool = [v for v in sorted(set().union(*POOLS.values())) if v != true and v not in values]
            values.append(rng.choice(pool))
    return values


def tofu_rows(authors: list[Author], seed: int = 0, n_perturbed: int = 5,
              questions: int = len(FACTS)) -> list[dict]:
    """The first `questions` facts of every author as TOFU-layout rows: question, answer, paraphrased_answer,
    perturbed_answer.

    The paraphrased answer states the same fact in another sentence; the perturbed answers use the paraphrase's
    sentence with wrong facts, so the truth ratio compares like with like.
    """
    rng = random.Random(seed)
    rows = []
    if not 1 <= questions <= len(FACTS):
        raise ValueError(f"questions per author must be 1..{len(FACTS)}, got {questions}")
    for index, author in enumerate(authors):
        for fact in FACTS[:questions]:
            wrong = perturbed_values(authors, author, fact.key, n_perturbed, rng)
            rows.append({
                "author": author.name, "author_index": index, "fact": fact.key, **author.qa(fact),
                "paraphrased_answer": fact.paraphrase.format(n=author.name, v=author.facts[fact.key]),
                "perturbed_answer": [fact.paraphrase.format(n=author.name, v=v) for v in wrong],
            })
    return rows
