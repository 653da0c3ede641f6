"""Why the closed form's PrivLeak stays near -100 on minimuse (docs/minimuse.md, "Where PrivLeak goes").

    python docs/experiments/muse_membership.py  # in the built benchmark's workspace
    python docs/experiments/muse_membership.py --recombined 48 --recombined 200

PrivLeak ranks each forget text against each holdout text (never trained on) by Min-K% (the mean log-prob of a
text's 40% least likely tokens). An edit can lower the forget texts' scores and still leave the ranking as it was if
it lowers the holdout texts' scores as much. This prints, for the unedited target and for the closed form with each
row of parameters, both sides' mean Min-K% beside the MUSE metrics, so that one sees where each side went.

`--recombined N` runs every row again with N more retain texts, each five sentences drawn from different retain
texts: documents nobody wrote, which the target reads the way it reads a text it never saw (its next sentence is a
guess), held unchanged by the solve like any retain row. A prototype of keys that look like the holdout texts'.
"""

from __future__ import annotations

import argparse
import json
import logging
import random
import re

import numpy as np

from flows.evaluation import build_benchmark, reference_path
from flows.workspace import Workspace
from grom_core.benchmarks.registry import get_benchmark
from grom_core.grom import GromParams, run_grom
from tasks.steps import load_for_edit

log = logging.getLogger("muse_membership")


def recombined(texts: list[str], n: int, per_text: int = 5, seed: int = 0) -> list[dict]:
    """`n` texts of `per_text` sentences, each drawn (without repeats within a text) from all of `texts`' sentences."""
    sentences = [s for text in texts for s in re.split(r"(?<=[.!?]) ", text)]
    rng = random.Random(seed)
    return [{"text": " ".join(rng.sample(sentences, per_text))} for _ in range(n)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--params", default='[{}, {"retain_budget": null}]',
                        help="a JSON list of GromParams fields, one row each")
    parser.add_argument("--recombined", type=int, action="append", default=[],
                        help="also run every row with this many recombined retain texts (repeatable)")
    parser.add_argument("--home", default=None, help="the grom workspace (default: GROM_HOME or ./.grom)")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    rows = json.loads(args.params)
    for row in rows:
        GromParams.from_dict(row)  # a bad row is refused before the build

    built = build_benchmark("minimuse", None, str(Workspace.resolve(args.home).root))
    bench = get_benchmark("minimuse")
    splits, reference = built.load_splits(), bench.read_reference(reference_path(built))
    forget, retain = built.unlearning_inputs()
    model, tokenizer = load_for_edit(str(built.models["target"]))
    retain_texts = [row["text"] for row in retain if "text" in row]

    print("| model | retain budget scale | VerbMem | KnowMem (forget) | Utility Preservation | MIA AUC | PrivLeak | "
          "Min-K% forget / holdout |")
    print("|---|---|---|---|---|---|---|---|")

    def show(label: str, model, tokenizer, scale: str = "") -> None:
        result = bench.evaluate(model, tokenizer, splits, built.split, reference)
        m, scores = result["metrics"], result["per_question"]["min_k"]
        print(f"| {label} | {scale} | {m['verbmem_rougeL_f1']:.3f} | {m['knowmem_forget_rougeL_f1']:.3f} | "
              f"{m['utility_preservation_rougeL_f1']:.3f} | {m['mia_auc']:.3f} | {m['privleak']:.1f} | "
              f"{np.mean(scores['forget']):.2f} / {np.mean(scores['holdout']):.2f} |", flush=True)

    show("unedited", model, tokenizer)
    show("retain model (never read the forget texts)", *load_for_edit(str(built.models["retain"])))
    for row in rows:
        params = GromParams.from_dict({**row, "influence": False})
        for extra in [0, *args.recombined]:
            more = recombined(retain_texts, extra, seed=params.seed)
            run = run_grom(model, tokenizer, forget, [*retain, *more], params)
            log.info("%s with %d recombined retain texts: layers %s", row or "defaults", extra, list(run.layers))
            fit = run.manifest.scaling.budget
            undo = run.edit.apply(model)
            try:
                show(f"grom {json.dumps(row) if row else 'defaults'}"
                     + (f", {extra} recombined retain texts" if extra else ""), model, tokenizer,
                     scale=f"{fit.scale:.3g}" if fit else "none")
            finally:
                run.edit.revert(model, undo)


if __name__ == "__main__":
    main()
