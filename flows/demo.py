"""`grom demo` (build a benchmark, models cached, and run the unlearning flow on its forget split) and `grom
unlearn` (the flow on the user's own model and data), with the checks that run before any work."""

from __future__ import annotations

import logging

from flows.evaluation import build_benchmark, reference_path, sized_config
from flows.preflight import preflight
from flows.runtime import prefect_environment
from flows.workspace import Workspace
from grom_core.benchmarks.registry import check_split, get_benchmark
from grom_core.data import prompt_format as grom_prompt_format
from grom_core.methods import DEFAULT_METHOD, get_method, method_params
from tasks.records import EvaluationSettings, EvaluationSpec

log = logging.getLogger("grom.demo")


def run_demo(home: str | None = None, split: str | None = None, params: dict | None = None, workers: int = 0,
             dask_address: str | None = None, authors: int | None = None, method: str = DEFAULT_METHOD,
             quantization: bool = True, benchmark: str = "minitofu", config: object | None = None) -> dict:
    """The README's main job: build a benchmark of the registry (models cached), unlearn its forget split through
    the whole flow. `authors` shrinks it (minitofu: default 50 authors) for quick runs and tests; `config` gives
    its whole configuration instead."""
    ws = Workspace.resolve(home)
    bench = get_benchmark(benchmark)
    params = {**bench.params_for(method, get_method(method).gradient), **(params or {})}
    method_params(method, params)  # checked before anything is built
    check_split(bench, split)
    built = build_benchmark(benchmark, None, str(ws.root), split, config=config or sized_config(benchmark, authors))
    spec = EvaluationSpec(benchmark=benchmark, split=built.split, reference=str(reference_path(built)),
                          splits={k: str(v) for k, v in built.splits.items()})
    forget, retain = built.unlearning_files()
    with prefect_environment(ws):
        from flows.unlearn import unlearn

        return unlearn(model=str(built.models["target"]), forget=str(forget), retain=str(retain),
                       home=str(ws.root), method=method, params=params, evaluation=spec, workers=workers,
                       dask_address=dask_address, quantization=quantization, prompt_format=bench.prompt_format)


def run_unlearn(model: str, forget: str, retain: str, home: str | None = None, params: dict | None = None,
                model_name: str | None = None, workers: int = 0, dask_address: str | None = None,
                method: str = DEFAULT_METHOD, checks: EvaluationSettings | None = None,
                prompt_format: str = "qa", max_examples: int = 200) -> dict:
    """`grom unlearn`: checks every input, then runs the unlearn flow; `checks`: the robustness checks to run after
    the edit (None: none); `max_examples`: the evaluation's size (forget and retain rows each)."""
    from tasks.tracking import check_model_name
    from tasks.versions import resolve_model

    ws = Workspace.resolve(home)
    method_params(method, params)
    grom_prompt_format(prompt_format)
    if model_name is not None:
        check_model_name(model_name)
    model = resolve_model(ws.root, model)
    preflight(model, forget, retain, method, params)
    with prefect_environment(ws):
        from flows.unlearn import unlearn

        return unlearn(model=model, forget=forget, retain=retain, home=str(ws.root), method=method,
                       params=params, model_name=model_name, workers=workers, dask_address=dask_address,
                       quantization=checks is not None, prompt_format=prompt_format,
                       quantizers=list(checks.quantizers) if checks else None,
                       attacks=list(checks.attacks) if checks else None, max_examples=max_examples)
