"""`grom demo`: build minitofu (models cached), run the unlearning flow on forget10, show before and after."""

from __future__ import annotations

import json
import logging

from flows.evaluation import build_benchmark, reference_path
from flows.runtime import configure_prefect, quiet_prefect_tracebacks
from flows.workspace import Workspace
from grom_core.adapter import FAMILIES, HAND_NAMING_HINT
from grom_core.benchmarks.minitofu import RETAIN_OF
from grom_core.errors import DataError, UnsupportedArchitectureError
from grom_core.loading import check_model_dir
from tasks.datafiles import read_examples

log = logging.getLogger("grom.demo")


def run_demo(home: str | None = None, split: str = "forget10", params: dict | None = None, workers: int = 0,
             dask_address: str | None = None, authors: int | None = None, method: str = "grom",
             compose: str | None = None, quantization: bool = True) -> dict:
    """The README's main job. `authors` shrinks minitofu (default 50 authors) for quick runs and tests."""
    ws = Workspace.resolve(home)
    configure_prefect(ws)
    config = None
    if authors is not None:
        from grom_core.benchmarks.minitofu import MiniTofuConfig

        config = MiniTofuConfig(authors=authors)
    built = build_benchmark("minitofu", None, str(ws.root), split, config=config)
    from flows.unlearn import unlearn
    from grom_core.benchmarks.registry import get_benchmark

    quiet_prefect_tracebacks()
    check_method(method, compose)
    if method == "grom":
        params = {**get_benchmark("minitofu").grom_params, **(params or {})}
    retain_split = RETAIN_OF[built.split]
    spec = {"benchmark": "minitofu", "split": built.split, "reference": str(reference_path(built)),
            "splits": {k: str(built.splits[k]) for k in (built.split, "retain_eval", "real_authors", "world_facts")}}
    return unlearn(model=str(built.models["target"]), forget=str(built.splits[built.split]),
                   retain=str(built.splits[retain_split]), home=str(ws.root), params=params, benchmark=spec,
                   workers=workers, dask_address=dask_address, method=method, compose=compose,
                   quantization=quantization)


def run_unlearn(model: str, forget: str, retain: str, home: str | None = None, params: dict | None = None,
                model_name: str | None = None, workers: int = 0, dask_address: str | None = None,
                method: str = "grom", compose: str | None = None, quantization: bool = False) -> dict:
    from tasks.tracking import resolve_model

    ws = Workspace.resolve(home)
    check_method(method, compose)
    model = resolve_model(ws.root, model)
    preflight(model, forget, retain, params or {})
    configure_prefect(ws)
    from flows.unlearn import unlearn

    quiet_prefect_tracebacks()
    return unlearn(model=model, forget=forget, retain=retain, home=str(ws.root), params=params,
                   model_name=model_name, workers=workers, dask_address=dask_address, method=method,
                   compose=compose, quantization=quantization)


def check_method(method: str, compose: str | None) -> None:
    from grom_core.gradient.composition import COMPOSERS
    from grom_core.gradient.methods import METHODS

    if method != "grom" and method not in METHODS:
        raise DataError(f"unknown method '{method}'; choose grom or one of {', '.join(sorted(METHODS))}")
    if compose is not None and method == "grom":
        raise DataError("--compose applies to gradient methods only; the closed form has nothing to compose")
    if compose is not None and compose not in COMPOSERS:
        raise DataError(f"unknown composer '{compose}'; choose one of {', '.join(sorted(COMPOSERS))}")


def preflight(model: str, forget: str, retain: str, params: dict) -> None:
    """Check what can be checked before a flow starts, so a mistake costs one line and changes nothing."""
    path = check_model_dir(model)
    config_file = path / "config.json"
    if not config_file.is_file():
        raise DataError(f"{path} has no config.json; it is not a Hugging Face model directory")
    config = json.loads(config_file.read_text())
    model_type = config.get("model_type")
    if model_type not in FAMILIES:
        known = ", ".join(sorted(FAMILIES))
        raise UnsupportedArchitectureError(f"unknown architecture '{model_type}' (known: {known}); from Python, "
                                           f"{HAND_NAMING_HINT}")
    n_layers = config.get("num_hidden_layers", config.get("n_layer"))
    bad = [layer for layer in params.get("layers") or [] if not (n_layers and 0 <= layer < n_layers)]
    if bad:
        raise DataError(f"layers {bad} do not exist; the model has layers 0..{(n_layers or 1) - 1}")
    read_examples(forget)
    read_examples(retain)
