"""GROM, the closed-form unlearning edit, in its four steps (grom_core.grom.run):

    run = run_grom(model, tokenizer, forget, retain, GromParams())
    run.plan          # every automatic choice (plan.py)
    run.edit          # the Edit value; the model is unchanged until run.edit.apply(model)
    run.manifest      # what each step measured, stored as the edit's metadata

Modules: params (the knobs), plan (step 1), drops (measured drops and beta), solve (step 3), scaling (step 4), run.
"""

from grom_core.grom.params import CounterfactualDrops, GromParams, SentenceDrops, SpecificityDrops
from grom_core.grom.plan import Inputs, Plan, make_plan
from grom_core.grom.run import GromRun, Manifest, compute_edit, run_grom

__all__ = ["CounterfactualDrops", "GromParams", "GromRun", "Inputs", "Manifest", "Plan", "SentenceDrops",
           "SpecificityDrops", "compute_edit", "make_plan", "run_grom"]
