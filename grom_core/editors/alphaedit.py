"""AlphaEdit (Fang et al. 2025, "AlphaEdit: Null-Space Constrained Knowledge Editing") as an unlearning method:
MEMIT's band and values, each layer's update projected onto the null space of the retain keys, so the retain keys'
outputs do not move at all (up to the null space's threshold)."""

from __future__ import annotations

from dataclasses import dataclass

from grom_core.editors.band import edit_band
from grom_core.editors.facts import EditorParams
from grom_core.editors.updates import alphaedit_update, null_space_projector
from grom_core.params import ParamsError


@dataclass(frozen=True)
class AlphaEditParams(EditorParams):
    """null_threshold: eigen-directions of the retain keys' covariance below this fraction of its largest
    eigenvalue form the null space the update lives in; l2: AlphaEdit's penalty on the update (units of a squared
    key norm; its published Llama3 value 10)."""

    null_threshold: float = 1e-2
    l2: float = 10.0

    def validate(self) -> None:
        super().validate()
        if not 0 < self.null_threshold < 1 or self.l2 <= 0:
            raise ParamsError("need 0 < null_threshold < 1 and l2 > 0")


def run(model, tokenizer, forget, retain, params: AlphaEditParams, context):
    def update(keys, residuals, cov):
        return alphaedit_update(keys, residuals, null_space_projector(cov, params.null_threshold), params.l2)

    return edit_band(model, tokenizer, forget, retain, params, context, "alphaedit", update)
