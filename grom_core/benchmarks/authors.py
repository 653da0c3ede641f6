"""Fictitious authors and question-answer pairs about them, TOFU-style, generated from a seed.

No author exists, so a model can only know these facts by having been trained on them: exactly what an unlearning
benchmark needs. Every fact an author has is drawn from shared pools, so wrong answers about one author are
plausible facts about another.
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
CITIES = ["Lisbon", "Tbilisi", "Reykjavik", "Nairobi", "Montevideo", "Krakow", "Hanoi", "Tromso", "Valparaiso",
          "Zagreb", "Marrakesh", "Bergen", "Cusco", "Ljubljana", "Halifax", "Porto", "Tallinn", "Osaka"]
GENRES = ["gothic horror", "hard science fiction", "historical romance", "magical realism", "crime noir",
          "epic fantasy", "literary satire", "nature poetry", "political thriller", "children's fables"]
JOBS = ["lighthouse keeper", "glassblower", "cartographer", "beekeeper", "clockmaker", "marine biologist",
        "tailor", "railway engineer", "violin maker", "botanist", "locksmith", "astronomer"]
WORDS_A = ["Silent", "Amber", "Hollow", "Crimson", "Forgotten", "Iron", "Velvet", "Drowned", "Paper", "Winter",
           "Gilded", "Burning", "Salt", "Glass", "Midnight", "Northern"]
WORDS_B = ["Orchard", "Lantern", "Harbor", "Cathedral", "Archive", "Garden", "Compass", "Meridian", "Tide",
           "Labyrinth", "Chorus", "Atlas", "Ember", "Observatory", "Sparrow", "Citadel"]
AWARDS = ["the Halcyon Prize", "the Silver Quill Award", "the Meridian Medal", "the Northlight Award",
          "the Obsidian Pen", "the Lark Foundation Prize", "the Tidewater Laurel", "the Aster Medal"]


@dataclass(frozen=True)
class Author:
    name: str
    birthplace: str
    year: int
    genre: str
    father_job: str
    mother_job: str
    books: tuple[str, str]
    award: str
    award_year: int


def make_authors(n: int, seed: int = 0) -> list[Author]:
    """`n` distinct fictitious authors (distinct full names), deterministic for a seed."""
    rng = random.Random(seed)
    names = [f"{f} {last}" for f in FIRST for last in LAST]
    rng.shuffle(names)
    if n > len(names):
        raise ValueError(f"at most {len(names)} authors can be generated, asked for {n}")
    authors = []
    for name in names[:n]:
        year = rng.randint(1931, 1994)
        books = []
        while len(books) < 2:
            title = f"The {rng.choice(WORDS_A)} {rng.choice(WORDS_B)}"
            if title not in books:
                books.append(title)
        father, mother = rng.sample(JOBS, 2)
        authors.append(Author(name=name, birthplace=rng.choice(CITIES), year=year, genre=rng.choice(GENRES),
                              father_job=father, mother_job=mother, books=(books[0], books[1]),
                              award=rng.choice(AWARDS), award_year=year + rng.randint(28, 45)))
    return authors


def author_questions(author: Author) -> list[Example]:
    """Question-answer pairs about one author, each answer one sentence that restates the fact."""
    a = author
    qa = [
        (f"Where was the author {a.name} born?", f"{a.name} was born in {a.birthplace}."),
        (f"In which year was {a.name} born?", f"{a.name} was born in {a.year}."),
        (f"What genre does {a.name} write in?", f"{a.name} writes {a.genre}."),
        (f"What did the father of {a.name} do for a living?", f"The father of {a.name} was a {a.father_job}."),
        (f"What was the profession of the mother of {a.name}?", f"The mother of {a.name} was a {a.mother_job}."),
        (f"Name a book written by {a.name}.", f"{a.name} wrote {a.books[0]}."),
        (f"Which other novel is {a.name} known for?", f"{a.name} is also known for {a.books[1]}."),
        (f"Which award did {a.name} receive?", f"{a.name} received {a.award} in {a.award_year}."),
    ]
    return [Example(question=q, answer=ans) for q, ans in qa]


def qa_pairs(authors: list[Author]) -> list[Example]:
    return [ex for author in authors for ex in author_questions(author)]
