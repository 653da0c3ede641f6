"""Where minitofu's LM-head edit reaches: its bag's logits on the utility sets' answers, and what the greedy answers
become (docs/minitofu.md, "Other builds, and where forget01's utility goes").

    python docs/experiments/head_reach.py --split forget01          # in the workspace that holds the built benchmark

Runs the closed form with the benchmark's parameters (as `grom bench` does), then, for the forget rows and each
Model Utility set, `grom_core.reach.head_reach` on their answers (table), and the real authors' greedy answers
before and after the edit (how many changed, a few of them).
"""

from __future__ import annotations

import argparse
import json
import logging

from flows.evaluation import build_benchmark
from flows.workspace import Workspace
from grom_core.adapter import ModelAdapter
from grom_core.benchmarks.registry import get_benchmark
from grom_core.data import QUESTION_TEMPLATE, as_examples, make_batches, prompt_format
from grom_core.generation import greedy_generate
from grom_core.grom import GromParams, run_grom
from grom_core.reach import head_reach
from tasks.steps import load_for_edit

log = logging.getLogger("head_reach")
SETS = ("forget", "retain_eval", "real_authors", "world_facts")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--split", default="forget01", choices=("forget01", "forget05", "forget10"))
    parser.add_argument("--home", default=None, help="the grom workspace (default: GROM_HOME or ./.grom)")
    parser.add_argument("--rows", type=int, default=100, help="answers read per set")
    parser.add_argument("--threshold", type=float, default=3.0, help="a rise past it counts (nats)")
    parser.add_argument("--examples", type=int, default=8, help="changed greedy answers printed")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")

    bench = get_benchmark("minitofu")
    built = build_benchmark("minitofu", None, str(Workspace.resolve(args.home).root), args.split, check=False)
    forget, retain = built.unlearning_inputs()
    model, tokenizer = load_for_edit(str(built.models["target"]))
    params = GromParams.from_dict({**bench.params_for("grom", False), "influence": False})
    run = run_grom(model, tokenizer, forget, retain, params, prompt_format=bench.prompt_format)
    head = ModelAdapter.for_model(model).lm_head_name
    fmt = prompt_format(bench.prompt_format)

    print(f"| {args.split} answers | positions | bag tokens | largest bag rise, mean (nats) | share > "
          f"{args.threshold:g} nats | gold NLL change, gold in bag | gold not in bag |")
    print("|---|---|---|---|---|---|---|")
    rows_of = {}
    for name in SETS:
        key = args.split if name == "forget" else name
        with open(built.splits[key], encoding="utf-8") as fh:
            rows = [json.loads(line) for line in fh][:args.rows]
        rows_of[name] = rows
        batches = make_batches(tokenizer, as_examples([{"question": r["question"], "answer": r["answer"]}
                                                       for r in rows]), 16, 256, fmt=fmt)
        got = head_reach(model, run.edit, batches, head, args.threshold)
        log.info("%s: %d positions read", name, got.positions)
        print(f"| {name} | {got.positions} | {got.rows} | {got.largest_rise:+.2f} | {got.rise_share:.0%} | "
              f"{got.gold_nll_rows:+.3f} | {got.gold_nll_others:+.3f} |")

    prompts = [QUESTION_TEMPLATE.format(question=r["question"]) for r in rows_of["real_authors"]]
    before = greedy_generate(model, tokenizer, prompts, max_new_tokens=40, desc="real authors, unedited")
    with run.edit.applied(model):
        after = greedy_generate(model, tokenizer, prompts, max_new_tokens=40, desc="real authors, edited")
    changed = [(r, b, a) for r, b, a in zip(rows_of["real_authors"], before, after, strict=True) if a != b]
    print(f"\nreal authors: {len(changed)} of {len(prompts)} greedy answers changed")
    for row, b, a in changed[:args.examples]:
        print(f"- {row['question']} {b!r} -> {a!r}")


if __name__ == "__main__":
    main()
