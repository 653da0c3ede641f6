"""grom_core: the closed-form unlearning edit (GROM) as a library of pure torch/transformers code.

    from grom_core import GromParams, run_grom
    run = run_grom(model, tokenizer, forget, retain, GromParams())
    undo = run.edit.apply(model)     # ... and run.edit.revert(model) restores every bit
    get_method("npo").run(...)       # any method of the registry returns the same Edit value

It never imports the orchestration stack (prefect, mlflow, duckdb, pyarrow); that lives in `tasks` and `flows`.
The names below are imported on first use (PEP 562), so that `import grom_core.errors` and the command line's
help do not load torch and transformers.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

__version__ = "0.1.0"

_EXPORTS = {
    "ModelAdapter": "grom_core.adapter",
    "GromParams": "grom_core.grom", "GromRun": "grom_core.grom", "Plan": "grom_core.grom",
    "compute_edit": "grom_core.grom", "run_grom": "grom_core.grom",
    "Example": "grom_core.data",
    "Edit": "grom_core.edit", "ModuleDelta": "grom_core.edit", "Undo": "grom_core.edit",
    "GromError": "grom_core.errors",
    "influence_report": "grom_core.influence", "leave_one_out": "grom_core.influence",
    "output_influence": "grom_core.influence",
    "METHODS": "grom_core.methods", "Method": "grom_core.methods", "MethodContext": "grom_core.methods",
    "MethodRun": "grom_core.methods", "get_method": "grom_core.methods",
    "Params": "grom_core.params",
    "solve_edit": "grom_core.solver",
    "GramStats": "grom_core.statistics",
}

__all__ = [
    "METHODS", "Edit", "Example", "GramStats", "GromError", "GromParams", "GromRun", "Method", "MethodContext",
    "MethodRun", "ModelAdapter", "ModuleDelta", "Params", "Plan", "Undo", "compute_edit", "get_method",
    "influence_report", "leave_one_out", "output_influence", "run_grom", "solve_edit",
]


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'grom_core' has no attribute '{name}'")
    value = getattr(importlib.import_module(_EXPORTS[name]), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_EXPORTS])


if TYPE_CHECKING:  # what type checkers and IDEs see
    from grom_core.adapter import ModelAdapter
    from grom_core.data import Example
    from grom_core.edit import Edit, ModuleDelta, Undo
    from grom_core.errors import GromError
    from grom_core.grom import GromParams, GromRun, Plan, compute_edit, run_grom
    from grom_core.influence import influence_report, leave_one_out, output_influence
    from grom_core.methods import METHODS, Method, MethodContext, MethodRun, get_method
    from grom_core.params import Params
    from grom_core.solver import solve_edit
    from grom_core.statistics import GramStats
