"""grom_core: the closed-form unlearning edit (GROM) as a library of pure torch/transformers code.

    from grom_core import GromParams, run_grom
    run = run_grom(model, tokenizer, forget, retain, GromParams())
    undo = run.edit.apply(model)     # ... and run.edit.revert(model) restores every bit
    get_method("npo").run(...)       # any method of the registry returns the same Edit value

It never imports the orchestration stack (prefect, mlflow, duckdb, pyarrow); that lives in `tasks` and `flows`.
"""

from grom_core.adapter import ModelAdapter
from grom_core.closed_form import GromParams, GromRun, compute_edit, run_grom
from grom_core.data import Example
from grom_core.edit import Edit, ModuleDelta, Undo
from grom_core.errors import GromError
from grom_core.influence import influence_report, leave_one_out, output_influence
from grom_core.methods import METHODS, Method, MethodContext, MethodRun, get_method
from grom_core.params import Params
from grom_core.solver import solve_edit
from grom_core.statistics import GramStats

__version__ = "0.1.0"

__all__ = [
    "METHODS", "Edit", "Example", "GramStats", "GromError", "GromParams", "GromRun", "Method", "MethodContext",
    "MethodRun", "ModelAdapter", "ModuleDelta", "Params", "Undo", "compute_edit", "get_method", "influence_report",
    "leave_one_out", "output_influence", "run_grom", "solve_edit",
]
