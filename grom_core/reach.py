"""Where an LM-head edit reaches beyond the positions it was solved for.

An LM-head edit changes only its rows' logits (the tokens it lowers), but it changes them at every position: row j
moves by P_j k at key k. For one subject's bag the update is rank one, P = -a w^T (a the bag's drops, w = c A^-1
m_f, m_f the sum of the forget keys; REFERENCE section 1), so every token of the bag moves together by a_j times
one scalar w^T k: a linear detector of the subject that is about 1 at the forget keys, 0 on the retain keys, and
either sign elsewhere. Where it is negative the bag rises; where it is positive the bag is lowered where nothing
was asked. `head_reach` measures both on any set of answers, with and without the edit, by forward passes.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

from grom_core.capture import model_device, supervised_mask
from grom_core.data import Batch
from grom_core.edit import Edit
from grom_core.errors import DataError
from grom_core.modes import evaluating
from grom_core.scoring import gold_logprobs


@dataclass(frozen=True)
class HeadReach:
    """What an LM-head edit does to its own rows at the supervised positions of some answers.

    Attributes:
        positions: supervised positions read.
        rows: tokens the head edit moves (its non-zero rows).
        largest_rise: mean over positions of the largest logit rise among those rows (nats; negative where every
            row is lowered).
        rise_share: share of the positions where that largest rise exceeds `threshold`.
        gold_nll_rows: mean increase of the gold token's NLL (nats) at positions whose gold token is one of the
            rows (NaN when there is none): what lowering them costs where they are the answer.
        gold_nll_others: the same where the gold token is not one of the rows: what the risen rows take from it.
        threshold: nats.
    """

    positions: int
    rows: int
    largest_rise: float
    rise_share: float
    gold_nll_rows: float
    gold_nll_others: float
    threshold: float


@torch.no_grad()
def head_reach(model: nn.Module, edit: Edit, batches: Sequence[Batch], head_name: str, threshold: float = 3.0
               ) -> HeadReach:
    """`HeadReach` of `edit` (which must edit `head_name` by rows) on the supervised positions of `batches`; the
    edit is applied for the second pass and reverted, the model is left as it was."""
    delta = edit.deltas.get(head_name)
    if delta is None or delta.row_index is None:
        raise DataError(f"the edit does not change rows of '{head_name}'; head_reach reads an LM-head edit by rows")
    device = model_device(model)
    rows = delta.row_index.to(device)
    rises, nll_rows, nll_others = [], [], []
    with evaluating(model):
        for batch in batches:
            mask = supervised_mask(batch).to(device)
            if not mask.any():
                continue
            ids, attention = batch.input_ids.to(device), batch.attention_mask.to(device)
            before = model(input_ids=ids, attention_mask=attention).logits[mask]  # (p, vocab)
            with edit.applied(model):
                after = model(input_ids=ids, attention_mask=attention).logits[mask]
            gold = batch.labels.to(device)[:, 1:][mask[:, :-1]]  # the token after each kept position
            rises.append((after[:, rows].double() - before[:, rows].double()).amax(dim=1))
            lost = gold_logprobs(before, gold) - gold_logprobs(after, gold)  # (p,) float64
            in_rows = torch.isin(gold, rows)
            nll_rows.append(lost[in_rows])
            nll_others.append(lost[~in_rows])
    if not rises:
        raise DataError("no supervised position in the batches: head_reach reads answers")
    rise, on_rows, others = torch.cat(rises), torch.cat(nll_rows), torch.cat(nll_others)

    def mean(values: torch.Tensor) -> float:
        return float(values.mean()) if values.numel() else math.nan

    return HeadReach(positions=int(rise.numel()), rows=int(rows.numel()), largest_rise=mean(rise),
                     rise_share=float((rise > threshold).double().mean()), gold_nll_rows=mean(on_rows),
                     gold_nll_others=mean(others), threshold=threshold)
