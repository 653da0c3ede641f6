"""MEMIT (Meng et al. 2023, "Mass-Editing Memory in a Transformer") as an unlearning method: many facts at once,
over a band of layers, each layer's update the least-squares trade between the facts' new values and the retain
keys' covariance."""

from __future__ import annotations

from dataclasses import dataclass

from grom_core.editors.band import edit_band
from grom_core.editors.facts import EditorParams
from grom_core.editors.updates import memit_update
from grom_core.params import ParamsError

GPTJ_KEY_DIM = 16384  # the width of the keys MEMIT's published cov_weight was tuned on


@dataclass(frozen=True)
class MemitParams(EditorParams):
    """cov_weight (MEMIT's mom2_update_weight, lambda: how much the retain keys' outputs count against the facts',
    C = E[k k^T]): its published value, 15000, for GPT-J's 16384-dimensional keys; it is scaled by in / 16384, which
    keeps C's energy along one fact's key (about lambda ||k||^2 / in) in the same ratio to that key's own
    ||k||^2 on a model of any width (unscaled, 15000 lets a 256-wide model's edit do nothing). clamp_norm_factor
    stays at 4 (the value MEMIT and AlphaEdit use for Llama-family models; MEMIT's GPT-J 0.75 leaves SmolLM2's and
    the tiny models' facts out of reach)."""

    cov_weight: float = 15000.0

    def validate(self) -> None:
        super().validate()
        if self.cov_weight <= 0:
            raise ParamsError("need cov_weight > 0")


def run(model, tokenizer, forget, retain, params: MemitParams, context):
    def update(keys, residuals, cov):
        return memit_update(keys, residuals, cov, params.cov_weight * keys.shape[0] / GPTJ_KEY_DIM)

    return edit_band(model, tokenizer, forget, retain, params, context, "memit", update)
