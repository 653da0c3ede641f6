"""Which band of layers a forget target costs least: minirwku's bands of two, each scaled to the same forget level,
against the damage on retain rows the solve never saw (docs/minirwku.md, "Held-out retain damage per band").

    python docs/experiments/band_damage.py --split forget05          # in the workspace that holds the built benchmark

Every fifth retain row (country facts and prose alike) is held out; the closed form runs on the rest with the
library defaults, `layers` set to one band of two and `forget_target`, and the
edited model is read on the held-out rows (the mean KL divergence of the next-token distribution from the unedited
one at their answer positions, and the gold tokens' NLL change, signed and absolute) and on the benchmark's forget
and neighbour probes (greedy exact match). One row a band: does a damage the data can measure before any
neighbour is asked single out the bands that keep the neighbours?
"""

from __future__ import annotations

import argparse
import json
import logging
import time
from collections.abc import Sequence

import torch

from flows.evaluation import build_benchmark
from flows.workspace import Workspace
from grom_core.adapter import ModelAdapter
from grom_core.benchmarks import minirwku
from grom_core.benchmarks.registry import get_benchmark
from grom_core.data import IGNORE_INDEX, Batch, as_examples, make_batches
from grom_core.grom import GromParams, run_grom
from grom_core.statistics import MemoryStatsStore
from tasks.steps import load_for_edit

log = logging.getLogger("band_damage")


@torch.no_grad()
def answer_logprobs(model, batches: Sequence[Batch]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per batch: log-softmax at the supervised positions (positions, vocab) and their gold tokens (positions,)."""
    out = []
    for batch in batches:
        logits = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask, use_cache=False).logits
        labels = batch.labels[:, 1:]
        mask = labels != IGNORE_INDEX
        out.append((logits[:, :-1][mask].float().log_softmax(-1), labels[mask]))
    return out


def damage(before: list, after: list) -> tuple[float, float, float]:
    """(mean KL(before || after), mean gold NLL change, mean absolute gold NLL change), nats per position."""
    kl, change = [], []
    for (lp0, gold), (lp1, _) in zip(before, after, strict=True):
        kl.append((lp0.exp() * (lp0 - lp1)).sum(-1))
        change.append((lp0 - lp1).gather(-1, gold[:, None]).squeeze(-1))
    kl, change = torch.cat(kl), torch.cat(change)
    return float(kl.mean()), float(change.mean()), float(change.abs().mean())


def probe_accuracy(probes: Sequence[dict], correct: Sequence[bool], kind: str) -> float:
    picked = [ok for p, ok in zip(probes, correct, strict=True) if p["type"] == kind]
    return sum(picked) / len(picked) if picked else float("nan")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--split", default="forget05", choices=tuple(minirwku.TARGETS))
    parser.add_argument("--home", default=None, help="the grom workspace (default: GROM_HOME or ./.grom)")
    parser.add_argument("--forget-target", type=float, default=0.05, help="GromParams.forget_target")
    parser.add_argument("--holdout", type=int, default=5, help="every N-th retain row is held out")
    parser.add_argument("--bands", default=None,
                        help="first layers of the bands to run, comma-separated (default: every band of two)")
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    log.setLevel(logging.INFO)

    bench = get_benchmark("minirwku")
    built = build_benchmark("minirwku", None, str(Workspace.resolve(args.home).root), args.split, check=False)
    forget, retain = built.unlearning_inputs()
    splits = {}
    for key in ("forget_probes", "neighbor_probes"):
        with open(built.splits[key], encoding="utf-8") as fh:
            splits[key] = [json.loads(line) for line in fh]
    model, tokenizer = load_for_edit(str(built.models["target"]))
    held = retain[::args.holdout]
    solved_on = [row for i, row in enumerate(retain) if i % args.holdout]
    log.info("%d forget rows; retain rows: %d solved on, %d held out", len(forget), len(solved_on), len(held))
    held_batches = make_batches(tokenizer, as_examples(held), 8, 128, fmt=bench.prompt_format)
    unedited = answer_logprobs(model, held_batches)
    forget_probes = [p for p in splits["forget_probes"] if p["rank"] < minirwku.TARGETS[args.split]]
    probes = forget_probes + splits["neighbor_probes"]
    store = MemoryStatsStore()  # the LM head's statistics are computed once for every band
    layers = ModelAdapter.for_model(model).num_layers

    print("| band | scale | held-out KL | gold NLL change | absolute change | forget fb / qa / adv | "
          "neighbours fb / qa |")
    print("|---|---|---|---|---|---|---|")
    firsts = [int(v) for v in args.bands.split(",")] if args.bands else range(0, layers - 1, 2)
    for first in firsts:
        start = time.perf_counter()
        params = GromParams(layers=(first, first + 1), forget_target=args.forget_target, influence=False)
        run = run_grom(model, tokenizer, forget, solved_on, params, stats_store=store,
                       prompt_format=bench.prompt_format)
        with run.edit.applied(model):
            kl, change, absolute = damage(unedited, answer_logprobs(model, held_batches))
            answers = minirwku.generate_answers(model, tokenizer, probes, max_new_tokens=10)
        correct = [minirwku.answer_matches(a, p["answer"]) for p, a in zip(probes, answers, strict=True)]
        kept = correct[len(forget_probes):]
        forget_acc = " / ".join(f"{probe_accuracy(forget_probes, correct[:len(forget_probes)], k):.2f}"
                                for k in minirwku.PROBE_TYPES)
        neighbour_acc = " / ".join(f"{probe_accuracy(splits['neighbor_probes'], kept, k):.3f}" for k in ("fb", "qa"))
        scale = run.manifest.scaling.scale
        print(f"| {first}-{first + 1} | {scale:.3f} | {kl:.4f} | {change:+.4f} | {absolute:.4f} | {forget_acc} | "
              f"{neighbour_acc} |", flush=True)
        log.info("band %d-%d: %.0f s", first, first + 1, time.perf_counter() - start)


if __name__ == "__main__":
    main()
