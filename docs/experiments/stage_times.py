"""Where the closed form's time goes on minirwku: `run_grom` with the library defaults, its retain statistics
computed, then again with them cached, one line of stage seconds each (and the placement it kept).

    python docs/experiments/stage_times.py --split forget05      # in the workspace that holds the built benchmark

The seconds are this machine's; `grom bench` gives them against a floor and the gradient methods in one process.
"""

from __future__ import annotations

import argparse
import json
import logging
import time

from flows.evaluation import build_benchmark
from flows.workspace import Workspace
from grom_core.benchmarks import minirwku
from grom_core.benchmarks.registry import get_benchmark
from grom_core.grom import GromParams, run_grom
from grom_core.statistics import MemoryStatsStore
from tasks.steps import load_for_edit


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--split", default="forget05", choices=tuple(minirwku.TARGETS))
    parser.add_argument("--home", default=None, help="the grom workspace (default: GROM_HOME or ./.grom)")
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    bench = get_benchmark("minirwku")
    built = build_benchmark("minirwku", None, str(Workspace.resolve(args.home).root), args.split, check=False)
    forget, retain = built.unlearning_inputs()
    model, tokenizer = load_for_edit(str(built.models["target"]))
    store = MemoryStatsStore()
    for stats in ("computed", "cached"):
        start = time.perf_counter()
        run = run_grom(model, tokenizer, forget, retain, GromParams(), stats_store=store,
                       prompt_format=bench.prompt_format)
        line = {"stats": stats, "seconds": round(time.perf_counter() - start, 2),
                "stages": {k: round(v, 2) for k, v in run.timings_s.items()},
                "plan": run.plan.as_dict(), "scaling": run.edit.metadata["scaling"]}
        print(json.dumps(line), flush=True)


if __name__ == "__main__":
    main()
