"""Step 3 of GROM: targets and one ridge least-squares solve per module (grom_core.solver), in the plan's order.

Editing layer l changes the keys of every later layer. With strategy "sequential" the modules are solved from the
lowest layer up; before each solve the forget keys are read again with the edits so far applied, and the module is
asked for its share of the logit drop still missing (measured on the real logits: MEMIT's way of spreading a
residual over layers). With "parallel" every module is solved from the original keys for an equal share.

What each forget position asks is a set of tokens and their drops (targets.TokenDrops): its gold next token, or,
with bags, every token asked to drop anywhere in its subject's rows. The LM head lowers the bag (its rows are the
tokens); the down-projections below it lower each position's own token.

Placement "body_first" solves the band first for the whole drop as the unedited LM head reads it, scales it to the
retain budget on its own, and only then solves the head, with the scaled band applied, for what the band left: what
the band removes is gone for any reader of the body (grom_core.attacks), what the head adds is not.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Sequence
from contextlib import ExitStack
from dataclasses import dataclass

import torch
from torch import nn

from grom_core.adapter import get_module, weight_out_in
from grom_core.capture import collect
from grom_core.edit import Edit, ModuleDelta
from grom_core.grom.params import GromParams
from grom_core.grom.plan import Inputs, Plan
from grom_core.grom.scaling import BudgetFit, fit_to_budget
from grom_core.influence import SolveRecord
from grom_core.readout import NllProbe
from grom_core.solver import solve_factors
from grom_core.statistics import GramStats
from grom_core.targets import (
    TokenDrops,
    lm_head_suppression,
    project_out,
    protected_tokens,
    representation_corruption,
    residual_suppression,
    suggest_coefficient,
    suppression_drops,
)

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class LogitDrop:
    """The mean logit drop asked for and reached over the entries solved for (nats), as solved (unscaled)."""

    asked_mean: float
    achieved_mean: float


@dataclass(frozen=True)
class BodyFirst:
    """What placement "body_first" measured: the band's budget fit and each part's logit drop."""

    band: BudgetFit
    band_logit_drop: LogitDrop
    head_logit_drop: LogitDrop


@dataclass
class Solved:
    """The updates of every module (unscaled, except a body-first band at its own budget scale), their solve
    records, and the logit drop as solved."""

    deltas: dict[str, ModuleDelta]
    records: dict[str, SolveRecord]
    logit_drop: LogitDrop
    body_first: BodyFirst | None = None


def solve(model: nn.Module, inputs: Inputs, plan: Plan, stats: dict[str, GramStats], params: GromParams,
          retain_probe: NllProbe | None = None) -> Solved:
    """Every module of the plan solved; the model is left unchanged. `retain_probe` reads the retain sample for
    a body-first band's budget (built here where not given)."""
    if plan.placement != "body_first":
        return solve_modules(model, inputs, plan, list(plan.modules), stats, params)
    head = inputs.adapter.lm_head_name
    band_modules = [m for m in plan.modules if m != head]
    band = solve_modules(model, inputs, plan, band_modules, stats, params)
    probe = retain_probe or NllProbe(model, inputs.retain_sample, head)
    fit = fit_to_budget(probe, band.deltas, float(params.retain_budget))
    deltas = {name: d.scaled(fit.scale) for name, d in band.deltas.items()}
    records = {name: scaled_record(rec, fit.scale) for name, rec in band.records.items()}
    with Edit(deltas=deltas, base_fingerprint="").applied(model, verify=False):
        rest = solve_modules(model, inputs, plan, [head], stats, params)
    log.info("body first: band %s kept at scale %.3f by the retain budget (%.4f nats at full size); the LM head "
             "lowers the rest", list(plan.layers), fit.scale, fit.damage_unscaled)
    return Solved(deltas={**deltas, **rest.deltas}, records={**records, **rest.records}, logit_drop=rest.logit_drop,
                  body_first=BodyFirst(band=fit, band_logit_drop=band.logit_drop, head_logit_drop=rest.logit_drop))


def scaled_record(record: SolveRecord, scale: float) -> SolveRecord:
    """The record of a delta scaled by `scale` (its targets scale with it; the solve is linear in them)."""
    return dataclasses.replace(record, targets=record.targets * scale)


def solve_modules(model: nn.Module, inputs: Inputs, plan: Plan, modules: list[str], stats: dict[str, GramStats],
                  params: GromParams) -> Solved:
    """Targets and closed-form solves of `modules`, in order; the model is left unchanged."""
    return _Solver(model, inputs, plan, params, stats).solve(modules)


def mu(stats: GramStats, params: GromParams) -> float:
    """The ridge: relative_ridge * w_retain times the mean retain key energy tr(G_r) / (r n).

    The forget weight is 1: with mu proportional to w_retain, scaling both weights scales the whole objective, so
    only their ratio is a knob (tests/test_solver.py states it)."""
    energy = float(stats.gram.diagonal().sum()) / max(1, stats.count) / stats.dim
    return params.relative_ridge * max(params.w_retain, 1e-12) * max(energy, 1e-12)


def head_logits(head: nn.Module, keys: torch.Tensor, rows: torch.Tensor, delta: ModuleDelta | None = None
                ) -> torch.Tensor:
    """(u, s) float64 logits of tokens `rows` (u,) from LM-head keys (s, hidden); `delta` adds an unapplied head
    edit."""
    w = weight_out_in(head).detach()
    weights = w[rows.to(w.device)].double()
    if delta is not None:
        weights = weights + delta.rows_at(rows).to(weights.device)
    logits = weights @ keys.double().to(w.device).T
    bias = getattr(head, "bias", None)
    if bias is not None:
        logits = logits + bias.detach().double()[rows.to(bias.device)][:, None]
    return logits.cpu()


class _Solver:
    """Solves modules lowest layer first (strategy "sequential") or all from the original keys ("parallel")."""

    def __init__(self, model: nn.Module, inputs: Inputs, plan: Plan, params: GromParams,
                 stats: dict[str, GramStats]) -> None:
        self.model, self.inputs, self.plan, self.params, self.stats = model, inputs, plan, params, stats
        self.adapter = inputs.adapter

    def _collect(self, modules: Sequence[str], edit: Edit | None):
        """Forget-side capture (with `edit` applied when given): keys of `modules`, the LM-head key (logits) and
        the final-norm input (its scale), plus the block outputs for corruption targets. The pass ends at the LM
        head's input: the logits themselves are never needed."""
        inputs = list(dict.fromkeys([*modules, self.adapter.lm_head_name, self.adapter.final_norm_name]))
        outputs = [self.adapter.block_names[layer] for layer in self.plan.layers] \
            if self.params.target == "corrupt" else []
        with edit.applied(self.model, verify=False) if edit is not None and edit.deltas else ExitStack():
            return collect(self.model, self.inputs.forget_batches, inputs, outputs, desc="forget keys")

    def solve(self, modules: list[str]) -> Solved:
        adapter, head_name = self.adapter, self.adapter.lm_head_name
        base = self._collect(modules, None)
        tokens = base.next_tokens.cpu()
        drops = self.inputs.drops if self.inputs.drops is not None else \
            suppression_drops(tokens, self.inputs.weights, self.plan.beta or 0.0)
        if drops.numel() != tokens.numel():  # the drops were computed on other batches than the keys
            raise RuntimeError(f"{drops.numel()} drops for {tokens.numel()} forget positions")
        if self.inputs.groups is not None:
            desired = TokenDrops.over_groups(tokens, drops, self.inputs.groups[base.example_ids.cpu()])
        else:
            desired = TokenDrops.at_next_tokens(tokens, drops)
        # the entries solved for: each position's own gold token (even where nothing is asked of it, so that a rise
        # caused by the layers below is taken back) and, with a bag, every token of it; below the head, only its own
        own = desired.rows[:, None] == tokens[None, :]
        solved = desired.entries() | own
        layer_entries = own if self.inputs.groups is not None and head_name in modules else solved
        logits0 = head_logits(adapter.lm_head, base.inputs[head_name], desired.rows)
        deltas: dict[str, ModuleDelta] = {}
        records: dict[str, SolveRecord] = {}
        got = base
        sequential = self.params.strategy == "sequential"
        with ExitStack() as solved_so_far:  # sequential: each solved layer's update stays applied until the end
            for i, name in enumerate(modules):
                if sequential and i > 0:
                    got = self._collect(modules, None)
                if sequential:  # the down-projections split what is still missing; the head, last, does the rest
                    achieved = logits0 - head_logits(adapter.lm_head, got.inputs[head_name], desired.rows)
                    left_to_do = max(1, sum(1 for m in modules[i:] if m != head_name))
                    share = torch.where(solved, desired.amounts - achieved, 0.0).clamp_min(0) / left_to_do
                else:
                    share = desired.amounts / len(modules)
                if name != head_name:
                    share = torch.where(layer_entries, share, 0.0)
                deltas[name], records[name] = self._solve_module(name, got, TokenDrops(desired.rows, share))
                if sequential and name != head_name:
                    solved_so_far.enter_context(Edit(deltas={name: deltas[name]}, base_fingerprint="").applied(
                        self.model, verify=False))
            if sequential and modules[-1] == head_name:
                final = got  # read with every other module's edit applied; the head's own delta is added below
            elif sequential:
                final = self._collect([], None)
            else:
                final = self._collect([], Edit(deltas={m: d for m, d in deltas.items() if m != head_name},
                                               base_fingerprint=""))
        drop = logits0 - head_logits(adapter.lm_head, final.inputs[head_name], desired.rows, deltas.get(head_name))
        return Solved(deltas=deltas, records=records,
                      logit_drop=LogitDrop(asked_mean=float(desired.amounts[solved].mean()),
                                           achieved_mean=float(drop[solved].mean())))

    def _solve_module(self, name: str, got, share: TokenDrops) -> tuple[ModuleDelta, SolveRecord]:
        """The update of one module for `share`, from the forget keys `got`."""
        params = self.params
        rows, targets = self._targets(name, got, share)
        st = self.stats[name]
        # solved where the retain Gram lives (the model's device: a GPU's float64 where there is one); the factors
        # come back to the CPU in ModuleDelta.from_factors
        keys = got.inputs[name].to(st.gram.device, torch.float64).T.contiguous()  # (n, s)
        ridge = mu(st, params)
        left, right, system = solve_factors(keys, targets, st.gram, st.count, w_forget=1.0,
                                            w_retain=params.w_retain, ridge=ridge)
        out_features = weight_out_in(get_module(self.model, name)).shape[0]
        delta = ModuleDelta.from_factors(name, left, right, row_index=rows, out_features=out_features)
        record = SolveRecord(module=name, keys=keys.cpu(), targets=targets, example_ids=got.example_ids.cpu(),
                             ridge=ridge, retain_count=st.count, w_forget=1.0, w_retain=params.w_retain,
                             positions=got.positions.cpu(), tokens=got.next_tokens.cpu(), target_rows=rows)
        log.debug("solved %s: keys %s, ridge %.3g%s", name, tuple(keys.shape), ridge,
                  f", jitter {system.jitter:.3g}" if system.jitter else "")
        return delta, record

    def _targets(self, name: str, got, share: TokenDrops) -> tuple[torch.Tensor | None, torch.Tensor]:
        """(rows, D): the module's targets D (out, s), or, for the LM head, its non-zero rows (u,) and D[rows]."""
        adapter, params = self.adapter, self.params
        if params.target == "corrupt":
            layer = adapter.down_proj_names.index(name)
            h = got.outputs[adapter.block_names[layer]]
            c = params.corrupt_coefficient or suggest_coefficient(h)
            return None, representation_corruption(h, c, params.seed + layer)
        if name == adapter.lm_head_name:
            return lm_head_suppression(share)
        scale = adapter.norm_scale(got.inputs[adapter.final_norm_name])
        unembedding = adapter.unembedding(share.rows)
        if params.protect and self.inputs.retain_tokens is not None:
            kept = protected_tokens(share.rows, self.inputs.retain_tokens, adapter.unembedding, params.protect)
            unembedding = project_out(unembedding, adapter.unembedding(kept))
        return None, residual_suppression(share, unembedding, scale)
