"""`grom demo`: build minitofu (models cached), run the unlearning flow on forget10, show before and after."""

from __future__ import annotations

import logging

from flows.evaluation import build_benchmark, reference_path
from flows.runtime import configure_prefect
from flows.workspace import Workspace

log = logging.getLogger("grom.demo")


def run_demo(home: str | None = None, split: str = "forget10", params: dict | None = None, workers: int = 0,
             dask_address: str | None = None) -> dict:
    ws = Workspace.resolve(home)
    configure_prefect(ws)
    built = build_benchmark("minitofu", None, str(ws.root), split)
    from flows.unlearn import unlearn
    from grom_core.benchmarks.registry import get_benchmark

    params = {**get_benchmark("minitofu").grom_params, **(params or {})}
    retain_split = {"forget01": "retain99", "forget05": "retain95", "forget10": "retain90"}[built.split]
    spec = {"benchmark": "minitofu", "split": built.split, "reference": str(reference_path(built)),
            "splits": {k: str(built.splits[k]) for k in (built.split, "retain_eval", "real_authors", "world_facts")}}
    return unlearn(model=str(built.models["target"]), forget=str(built.splits[built.split]),
                   retain=str(built.splits[retain_split]), home=str(ws.root), params=params, benchmark=spec,
                   workers=workers, dask_address=dask_address)


def run_unlearn(model: str, forget: str, retain: str, home: str | None = None, params: dict | None = None,
                model_name: str | None = None, workers: int = 0, dask_address: str | None = None) -> dict:
    ws = Workspace.resolve(home)
    configure_prefect(ws)
    from flows.unlearn import unlearn

    return unlearn(model=model, forget=forget, retain=retain, home=str(ws.root), params=params,
                   model_name=model_name, workers=workers, dask_address=dask_address)
