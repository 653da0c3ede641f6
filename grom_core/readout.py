"""Reading a fixed sample's answer NLL under candidate updates, the model left unchanged.

The retain budget's bisection, the forget target's and the comparison of placements read one sample (32 retain
rows, the forget rows) under many scales of an update. An update of the LM head alone changes only the logits of the
rows it touches, and from inputs the unedited network already computed: `NllProbe` captures the head's inputs at
the sample's supervised positions once (one forward pass that stops before the head) and reads every head-only
update from them with a (positions x touched rows) product, a few hundred of SmolLM2's 49,152 rows, instead of a
forward pass through the whole network. An update of other modules is applied, the head's inputs are read again by
a forward pass that stops before the head, and it is reverted; the head's share is read from those inputs. Either
way the head's product over the whole vocabulary is taken at the supervised positions only (a third of the retain
sample's tokens on minirwku), not at every position as a plain forward pass does.

The head-only reading is exact up to float32 rounding: the unedited logits' softmax mass is kept per position
(float64 sum of float32 exponentials), the touched rows' old terms are taken out of it and their new ones put in;
the new rows are cast(W[rows] + P[rows]) in the weight's dtype, as `Edit.apply` writes them.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from contextlib import nullcontext
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from grom_core.adapter import get_module, weight_out_in
from grom_core.capture import collect
from grom_core.data import Batch
from grom_core.edit import Edit, ModuleDelta
from grom_core.errors import DataError
from grom_core.suffix import BlockCache

log = logging.getLogger(__name__)

CHUNK_POSITIONS = 256  # positions whose full-vocabulary logits are held at once (SmolLM2: 256 x 49,152 floats)


@dataclass(frozen=True)
class HeadInputs:
    """The LM head's view of a sample at its p supervised positions.

    Attributes:
        keys: (p, hidden) the head's inputs (after the final norm), in the head's dtype.
        tokens: (p,) the gold next token at each position.
        rows: (p,) the sample row (0..count-1, in the order of the batches) each position belongs to.
        count: N, the sample's rows (a row without supervised tokens gets NaN, as in `answer_nll`).
        top: (p,) float64, the unedited logits' maximum.
        mass: (p,) float64, sum over the vocabulary of exp(unedited logit - top).
        gold: (p,) float64, the gold token's unedited logit minus top.
    """

    keys: torch.Tensor
    tokens: torch.Tensor
    rows: torch.Tensor
    count: int
    top: torch.Tensor
    mass: torch.Tensor
    gold: torch.Tensor

    @classmethod
    @torch.no_grad()
    def read(cls, model: nn.Module, head_name: str, batches: Sequence[Batch]) -> HeadInputs:
        """One forward pass over `batches`, stopped at the head, and the unedited head applied to the supervised
        positions only."""
        got = collect(model, batches, inputs=[head_name], early_stop=True, desc="head inputs")
        ids = [int(i) for batch in batches for i in batch.example_ids]
        order = {example_id: row for row, example_id in enumerate(ids)}
        rows = torch.tensor([order[int(i)] for i in got.example_ids], dtype=torch.long)
        keys, tokens = got.inputs[head_name].cpu(), got.next_tokens.cpu()
        head = get_module(model, head_name)
        top, mass, gold = [], [], []
        for start in range(0, keys.shape[0], CHUNK_POSITIONS):
            logits = _logits(head, keys[start:start + CHUNK_POSITIONS]).float()
            peak = logits.amax(dim=-1, keepdim=True)
            gold.append((logits.gather(-1, tokens[start:start + CHUNK_POSITIONS, None]) - peak).squeeze(-1).double())
            mass.append((logits - peak).exp_().sum(dim=-1, dtype=torch.float64))
            top.append(peak.squeeze(-1).double())
        empty = torch.zeros(0, dtype=torch.float64)
        return cls(keys=keys, tokens=tokens, rows=rows, count=len(ids), top=torch.cat(top) if top else empty,
                   mass=torch.cat(mass) if mass else empty, gold=torch.cat(gold) if gold else empty)

    def row_means(self, values: torch.Tensor) -> torch.Tensor:
        """(N,) mean of per-position `values` (p,) over each row's positions, float64 (NaN for an empty row)."""
        sums = torch.zeros(self.count, dtype=torch.float64).index_add_(0, self.rows, values.double())
        counts = torch.zeros(self.count, dtype=torch.float64).index_add_(
            0, self.rows, torch.ones_like(values, dtype=torch.float64))
        return sums / counts

    def nll(self, head: nn.Module, delta: ModuleDelta | None = None) -> torch.Tensor:
        """(N,) mean token NLL (nats) of each row with the head's update `delta` (None: the unedited head)."""
        if delta is None:
            return self.row_means(torch.log(self.mass) - self.gold)
        weight = weight_out_in(head).detach()
        touched = (delta.row_index if delta.row_index is not None else torch.arange(delta.shape[0])).cpu()
        bias = getattr(head, "bias", None)
        bias = bias.detach()[touched.to(bias.device)].cpu() if bias is not None else None
        old = weight[touched.to(weight.device)].cpu()
        new = (old.double() + delta.rows_at(touched)).to(old.dtype)
        slot = torch.searchsorted(touched, self.tokens).clamp_max(max(0, touched.numel() - 1))
        gold_touched = touched[slot] == self.tokens if touched.numel() else torch.zeros_like(self.tokens, dtype=bool)
        out = []
        for start in range(0, self.keys.shape[0], CHUNK_POSITIONS):
            part = slice(start, start + CHUNK_POSITIONS)
            keys, top = self.keys[part], self.top[part, None]
            before = (F.linear(keys, old, bias).double() - top).exp().sum(dim=-1)
            after = F.linear(keys, new, bias).double() - top
            # the untouched rows' mass: what the unedited logits held, less the touched rows' old terms (>= 0, and
            # at least the gold's own term where the gold is untouched)
            rest = (self.mass[part] - before).clamp_min(0)
            if touched.numel() == weight.shape[0]:
                rest = torch.zeros_like(rest)
            kept_gold = ~gold_touched[part]
            rest = torch.where(kept_gold, torch.maximum(rest, self.gold[part].exp()), rest)
            gold = torch.where(kept_gold, self.gold[part], after.gather(-1, slot[part, None]).squeeze(-1))
            out.append(torch.log(rest + after.exp().sum(dim=-1)) - gold)
        return self.row_means(torch.cat(out) if out else torch.zeros(0, dtype=torch.float64))


def _logits(head: nn.Module, keys: torch.Tensor) -> torch.Tensor:
    """(k, vocab) logits of the head at keys (k, hidden), on the head's device, returned on the CPU."""
    weight = weight_out_in(head).detach()
    bias = getattr(head, "bias", None)
    return F.linear(keys.to(weight.device, weight.dtype), weight,
                    bias.detach() if bias is not None else None).cpu()


class NllProbe:
    """The per-row mean answer NLL (nats) of one sample under scaled updates alpha * P; the model is unchanged.

    `base` (N,) is the unedited model's, read from the head's inputs (one forward pass, at construction). An update
    of `head_name` alone is read from those inputs (see the module docstring); the layers' updates are applied, the
    head's inputs read again, and reverted. With `from_block` (the blocks' ModuleList path and a layer k), that
    pass also keeps the stream entering block k (grom_core.suffix), and the layers' updates at k and above are read
    by passes from block k up, where those agree with the full pass on the unedited model.
    """

    def __init__(self, model: nn.Module, batches: Sequence[Batch], head_name: str,
                 from_block: tuple[str, int] | None = None) -> None:
        if not batches:
            raise DataError("an NLL probe needs a sample of at least one batch")
        self.model, self.batches, self.head_name = model, list(batches), head_name
        self.cache = BlockCache(model, *from_block) if from_block is not None and from_block[1] > 0 else None
        with self.cache.capturing() if self.cache is not None else nullcontext():
            self.inputs = HeadInputs.read(model, head_name, self.batches)
        if self.cache is not None:  # the check compares the head's inputs alone: no logits needed
            with self.cache.running():
                again = collect(model, self.batches, inputs=[head_name], early_stop=True, desc="head inputs")
            if not self.cache.verify(self.inputs.keys, again.inputs[head_name].cpu()):
                log.debug("passes from block %d differ from the full pass: the probe runs full passes",
                          self.cache.layer)
        self.base = self.inputs.nll(get_module(model, head_name))

    def nll(self, deltas: Mapping[str, ModuleDelta], alpha: float = 1.0) -> torch.Tensor:
        """(N,) each row's mean token NLL with alpha * P of every module in `deltas` added."""
        scaled = {name: delta.scaled(alpha) for name, delta in deltas.items()}
        head = get_module(self.model, self.head_name)
        below = {name: delta for name, delta in scaled.items() if name != self.head_name}
        if not below:
            return self.inputs.nll(head, scaled.get(self.head_name))
        # the layers' updates change the head's inputs: read them again with those applied, still stopping
        # before the head, whose own update is read from them
        short = self.cache is not None and self.cache.exact and self.cache.covers(list(below))
        with Edit(deltas=below, base_fingerprint="").applied(self.model, verify=False), \
                self.cache.running() if short else nullcontext():
            inputs = HeadInputs.read(self.model, self.head_name, self.batches)
        return inputs.nll(head, scaled.get(self.head_name))

    def rise(self, deltas: Mapping[str, ModuleDelta], alpha: float = 1.0) -> float:
        """The mean rise (nats) of the rows' mean token NLL over the unedited model's."""
        return float((self.nll(deltas, alpha) - self.base).nanmean())
