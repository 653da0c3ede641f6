"""Do the counterfactual drops' strangers stand in for a model that never read the forget authors? (docs/minitofu.md,
"What the strangers are worth").

    python docs/experiments/stranger_truth_ratios.py --split forget10  # in the built benchmark's workspace

minitofu's Forget Quality compares the edited model's forget-set truth ratios with the retain model's. This scores
the *unedited* target on the forget set's evaluation rows (question, paraphrased and perturbed answers) with the
author's name replaced, everywhere in the row, by each stranger the closed form compares with
(`grom_core.counterfactual.strangers`, the same seed, pool and number as the defaults), once with the first name
replaced (the defaults' `rename="first"`) and once with the whole name (`rename="whole"`), and prints each
stranger's Forget Quality against the retain model: the level a perfect counterfactual edit would reach.
"""

from __future__ import annotations

import argparse
import json
import logging

import numpy as np

from flows.evaluation import build_benchmark, reference_path
from flows.workspace import Workspace
from grom_core.benchmarks.minitofu import score_set
from grom_core.counterfactual import strangers
from grom_core.data import as_examples
from grom_core.grom import GromParams
from grom_core.metrics.tofu import forget_quality
from grom_core.metrics.tofu_logs import read_tofu_log
from tasks.steps import load_for_edit

log = logging.getLogger("stranger_truth_ratios")
ANSWER_FIELDS = ("question", "answer", "paraphrased_answer")


def renamed(row: dict, stranger: str) -> dict:
    """The evaluation row with its author replaced by `stranger` in the question and every answer."""
    swap = row["author"]
    out = {f: row[f].replace(swap, stranger) for f in ANSWER_FIELDS}
    out["perturbed_answer"] = [p.replace(swap, stranger) for p in row["perturbed_answer"]]
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--split", default="forget10", choices=("forget01", "forget05", "forget10"))
    parser.add_argument("--home", default=None, help="the grom workspace (default: GROM_HOME or ./.grom)")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")

    # built with its memorisation check: the retain model's reference truth ratios
    built = build_benchmark("minitofu", None, str(Workspace.resolve(args.home).root), args.split)
    reference = read_tofu_log(reference_path(built)).forget_truth_ratios
    with open(built.splits[args.split], encoding="utf-8") as fh:
        rows = [json.loads(line) for line in fh]
    forget, retain = built.unlearning_inputs()
    # the strangers the closed form compares with: its seed, its count, the same pool and text to avoid
    everything = [*as_examples(forget), *as_examples(retain)]
    text = " ".join(str(v) for ex in everything for v in ex.record().values()).lower()
    pool = sorted({ex.subject.split(" ", 1)[0] for ex in everything if ex.subject and " " in ex.subject})
    params = GromParams()
    model, tokenizer = load_for_edit(str(built.models["target"]))

    print(f"| {args.split}: the target asked about | example question | Forget Quality | median truth ratio | "
          "paraphrased / perturbed NLL |")
    print("|---|---|---|---|---|")
    print(f"| (the retain model, for reference) | | 1 | {np.median(reference):.3g} | |")
    scored = score_set(model, tokenizer, "forget", rows, generate_answers=False)
    print(f"| its own authors | {rows[0]['question']} | {forget_quality(scored.truth_ratios(), reference).pvalue:.3g}"
          f" | {np.median(scored.truth_ratios()):.3g} | {scored.paraphrased_nll.mean():.2f} / "
          f"{scored.perturbed_nll.mean():.2f} |")
    for rename in ("first", "whole"):
        names = {a: strangers(a, params.counterfactuals, params.seed, pool, text, rename)
                 for a in dict.fromkeys(r["author"] for r in rows)}
        for j in range(params.counterfactuals):
            swapped = [renamed(r, names[r["author"]][j]) for r in rows]
            s = score_set(model, tokenizer, "forget", swapped, generate_answers=False)
            log.info("rename=%s, stranger %d: %d rows scored", rename, j, len(rows))
            print(f"| stranger {j + 1}, rename={rename} | {swapped[0]['question']} | "
                  f"{forget_quality(s.truth_ratios(), reference).pvalue:.3g} | {np.median(s.truth_ratios()):.3g} | "
                  f"{s.paraphrased_nll.mean():.2f} / {s.perturbed_nll.mean():.2f} |")


if __name__ == "__main__":
    main()
