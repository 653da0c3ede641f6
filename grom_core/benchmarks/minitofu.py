"""minitofu: a small benchmark in TOFU's format, built and trained here.

Fictitious authors, 20 questions each (fewer with `questions`) with one answer, one paraphrased answer and 5
perturbed answers; the splits forget01/05/10 (the last 1/5/10% of the authors, nested, as in TOFU) with
retain99/95/90; the real-authors and world-facts sets of TOFU for utility.

Two kinds of model: tiny Llamas trained from scratch (`minitofu`), whose target is trained on every author plus the
real-authors and world-facts answers (a model that never saw them could not answer them at all), and the shipped
SmolLM2-135M-Instruct fine-tuned as TOFU fine-tunes a chat model (`minitofu-smollm2`: full fine-tuning with AdamW
on the authors alone, through the tokenizer's chat template), whose utility sets are what it knew before. The
retain model is trained the same way without the forget split.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from grom_core.benchmarks.authors import make_authors, tofu_rows
from grom_core.data import PromptFormat, prompt_format, read_jsonl
from grom_core.errors import DataError
from grom_core.finetune import TinyModelConfig, TrainConfig
from grom_core.metrics.tofu import SetScores, tofu_summary

FORGET_FRACTIONS = {"forget01": 0.01, "forget05": 0.05, "forget10": 0.10}
RETAIN_OF = {"forget01": "retain99", "forget05": "retain95", "forget10": "retain90"}


def tofu_data_dir() -> Path:
    """The shipped TOFU files (real authors, world facts, I-don't-know answers, logs): `data/tofu`, installed as the
    package grom_data, so a non-editable install finds them too; GROM_TOFU_DATA overrides."""
    import os
    from importlib import resources

    env = os.environ.get("GROM_TOFU_DATA")
    path = Path(env) if env else Path(str(resources.files("grom_data") / "tofu"))
    if not (path / "real_authors_perturbed.json").is_file():
        raise DataError(f"TOFU data files not found in {path}; set GROM_TOFU_DATA to the folder holding "
                        f"real_authors_perturbed.json and world_facts_perturbed.json")
    return path


def real_world_rows(name: str) -> list[dict]:
    """TOFU's real-authors or world-facts set; the true answer stands in for the paraphrase (as TOFU scores it)."""
    file = {"real_authors": "real_authors_perturbed.json", "world_facts": "world_facts_perturbed.json"}[name]
    rows = read_jsonl(tofu_data_dir() / file)
    return [{"question": r["question"], "answer": r["answer"], "paraphrased_answer": r["answer"],
             "perturbed_answer": list(r["perturbed_answer"])} for r in rows]


@dataclass(frozen=True)
class MiniTofuConfig:
    """Size and training of minitofu: `authors` x `questions` (facts per author, at most 20), tiny Llamas (50
    authors: about 2 minutes a model on 2 cores; forget01/05/10 are then 1/2/5 authors). `model` is the tiny
    Llama's shape (unused where a pretrained model is fine-tuned), `train` the fine-tuning recipe."""

    authors: int = 50
    questions: int = 20
    seed: int = 0
    n_perturbed: int = 5
    retain_eval_questions: int = 200
    utility_questions: int = 0
    model: TinyModelConfig = field(default_factory=TinyModelConfig)
    train: TrainConfig = field(default_factory=lambda: TrainConfig(epochs=30, lr=3e-3, batch_size=32))


def forget_authors(n_authors: int, split: str) -> int:
    """Authors in a forget split: the fraction of the authors, at least one."""
    return max(1, round(FORGET_FRACTIONS[split] * n_authors))


def generate(config: MiniTofuConfig = MiniTofuConfig()) -> dict[str, list[dict]]:
    """Every split as a list of TOFU-layout rows.

    Returns keys: full, forget01/05/10, retain99/95/90, retain_eval (a fixed sample of retain90 questions, for
    the retain part of Model Utility), real_authors, world_facts.
    """
    authors = make_authors(config.authors, seed=config.seed)
    rows = tofu_rows(authors, seed=config.seed, n_perturbed=config.n_perturbed, questions=config.questions)
    splits: dict[str, list[dict]] = {"full": rows}
    for split in FORGET_FRACTIONS:
        first_forgotten = config.authors - forget_authors(config.authors, split)
        splits[split] = [r for r in rows if r["author_index"] >= first_forgotten]
        splits[RETAIN_OF[split]] = [r for r in rows if r["author_index"] < first_forgotten]
    retain90 = splits["retain90"]
    rng = random.Random(config.seed)
    splits["retain_eval"] = sorted(rng.sample(retain90, min(config.retain_eval_questions, len(retain90))),
                                   key=lambda r: (r["author_index"], r["fact"]))
    for name in ("real_authors", "world_facts"):
        rows = real_world_rows(name)
        if 0 < config.utility_questions < len(rows):
            rows = [rows[i] for i in sorted(rng.sample(range(len(rows)), config.utility_questions))]
        splits[name] = rows
    return splits


def training_rows(splits: dict[str, list[dict]], without: str | None = None) -> list[dict]:
    """QA rows a model is trained on: all authors (or the retain split of `without`), real authors, world facts."""
    authors = splits["full"] if without is None else splits[RETAIN_OF[without]]
    return [{"question": r["question"], "answer": r["answer"]}
            for r in authors + splits["real_authors"] + splits["world_facts"]]


def author_rows(splits: dict[str, list[dict]], without: str | None = None) -> list[dict]:
    """QA rows a pretrained model is fine-tuned on (TOFU's protocol): the authors alone (all, or the retain split
    of `without`); the utility sets stay what the model knew before."""
    authors = splits["full"] if without is None else splits[RETAIN_OF[without]]
    return [{"question": r["question"], "answer": r["answer"]} for r in authors]


def generation_budget(tokenizer, answers: Sequence[str], limit: int) -> int:
    """Greedy tokens to generate for a set whose longest answer has n tokens: 2n + 8 (room for a paraphrase of
    the answer, not for an essay), at most `limit`."""
    longest = max(len(tokenizer.encode(a, add_special_tokens=False)) for a in answers)
    return max(1, min(limit, 2 * longest + 8))


# -- evaluation ---------------------------------------------------------------------------------------------------
def score_set(model, tokenizer, name: str, rows: list[dict], *, max_new_tokens: int = 200, batch_size: int = 32,
              generate_answers: bool = True, fmt: str | PromptFormat = "qa") -> SetScores:
    """Per-question TOFU values of one set, in prompt format `fmt`: answer, paraphrase and perturbed NLLs, greedy
    generation (at most `max_new_tokens`, sized to the answers by `generation_budget`), ROUGE-L recall."""
    from grom_core.data import Example, make_batches
    from grom_core.generation import greedy_generate
    from grom_core.metrics.rouge import rouge_l_recall
    from grom_core.metrics.tofu import extraction_strength
    from grom_core.scoring import answer_nll, token_logprobs

    if not rows:
        raise DataError(f"evaluation set '{name}' is empty")

    def nll(answers: list[str]):
        examples = [Example(question=r["question"], answer=a) for r, a in zip(rows, answers, strict=True)]
        return answer_nll(model, make_batches(tokenizer, examples, batch_size, fmt=fmt)).numpy()

    fmt = prompt_format(fmt)
    k = min(len(r["perturbed_answer"]) for r in rows)
    answers = token_logprobs(model, make_batches(tokenizer, [Example(question=r["question"], answer=r["answer"])
                                                             for r in rows], batch_size, fmt=fmt))
    gt = answers.mean_nll.numpy()
    extraction = np.array([extraction_strength(t.numpy()) for t in answers.top_is_gold])
    para = nll([r.get("paraphrased_answer", r["answer"]) for r in rows])
    pert = np.stack([nll([r["perturbed_answer"][j] for r in rows]) for j in range(k)], axis=1)
    generated = [""] * len(rows)
    rouge = np.full(len(rows), np.nan)
    if generate_answers:
        prompts = [fmt.prompt(tokenizer, r["question"]) for r in rows]
        budget = generation_budget(tokenizer, [r["answer"] for r in rows], max_new_tokens)
        generated = greedy_generate(model, tokenizer, prompts, max_new_tokens=budget, batch_size=batch_size,
                                    desc=f"generate ({name})", bos=not fmt.chat)
        rouge = rouge_l_recall(generated, [r["answer"] for r in rows])
    return SetScores(name=name, gt_nll=gt, paraphrased_nll=para, perturbed_nll=pert, rougeL_recall=rouge,
                     generated=generated, extraction_strength=extraction)


def evaluate(model, tokenizer, splits: dict[str, list[dict]], forget_split: str = "forget10",
             reference_forget_ratios=None, *, max_new_tokens: int = 200, batch_size: int = 32,
             fmt: str | PromptFormat = "qa") -> dict:
    """All TOFU metrics of one model, its questions asked in prompt format `fmt`: the forget split, retain, real
    authors, world facts.

    Returns {"metrics": flat metric dict, "per_question": {"forget_truth_ratio": [...], ...}, "n": sizes}.
    """
    sets = {}
    for name, key in (("forget", forget_split), ("retain", "retain_eval"), ("real_authors", "real_authors"),
                      ("world_facts", "world_facts")):
        sets[name] = score_set(model, tokenizer, name, splits[key], max_new_tokens=max_new_tokens,
                               batch_size=batch_size, fmt=fmt)
    metrics = tofu_summary(sets, reference_forget_ratios)
    per_question = {
        "forget_truth_ratio": sets["forget"].truth_ratios().tolist(),
        "forget_probability": np.exp(-sets["forget"].gt_nll).tolist(),
        "forget_rougeL_recall": sets["forget"].rougeL_recall.tolist(),
        "forget_generated": sets["forget"].generated,
    }
    return {"metrics": metrics, "per_question": per_question, "n": {k: len(v.gt_nll) for k, v in sets.items()}}


TOFU_FILES = {"retain_eval": "retain_perturbed", "real_authors": "real_authors_perturbed",
              "world_facts": "world_facts_perturbed"}


def tofu_splits_from_files(directory: str | Path, forget_split: str, read: Callable[[Path, str], list[dict]],
                           suffixes: Sequence[str] = (".json", ".jsonl")) -> dict[str, list[dict]]:
    """The real TOFU evaluation files of a local folder (as the TOFU dataset names them) as minitofu-style splits.

    Expects `<forget_split>_perturbed`, `retain_perturbed`, `real_authors_perturbed` and `world_facts_perturbed`
    with one of `suffixes`; `read(path, "tofu_eval")` reads and checks one file (the caller's reader, which may
    know more formats than this module).
    """
    directory = Path(directory)

    def find(stem: str) -> Path:
        for suffix in suffixes:
            if (directory / f"{stem}{suffix}").is_file():
                return directory / f"{stem}{suffix}"
        raise DataError(f"{directory} has no {stem}{'/'.join(suffixes)}; the TOFU evaluation files are needed")

    splits = {forget_split: read(find(f"{forget_split}_perturbed"), "tofu_eval")}
    for key, stem in TOFU_FILES.items():
        splits[key] = read(find(stem), "tofu_eval")
    for key in ("real_authors", "world_facts"):
        splits[key] = [{**r, "paraphrased_answer": r["answer"]} for r in splits[key]]
    return splits
