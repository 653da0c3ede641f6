"""Exact leave-one-out influence of each forget example on the edit (Sherman-Morrison-Woodbury).

Convention: c = w_forget / s is held fixed when an example is left out, so removing example i (key columns X_i,
targets D_i) is the rank-k_i downdate A_-i = A - c X_i X_i^T, and

    Z_i = A^-1 X_i,  M_i = I / c - X_i^T Z_i,  E_i = D_i - P X_i,
    P - P_-i = E_i M_i^-1 Z_i^T,
    ||P - P_-i||_F^2 = trace(M_i^-1 E_i^T E_i M_i^-1 Z_i^T Z_i).

(Letting s shrink to s - k_i instead would rescale the whole forget Gram, and the change would not be low rank.)
One Cholesky of A serves every example; the per-example work is a batch of small k x k solves. No m x n matrix
is formed. Examples whose c M_i has a smallest eigenvalue near 0 (the example alone pins a direction of the edit)
are flagged as high leverage and, when asked, refit directly.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from grom_core.errors import ShapeMismatchError
from grom_core.solver import check_inputs, factor_system

if TYPE_CHECKING:
    from grom_core.statistics import GramStats

DEFAULT_LEVERAGE_THRESHOLD = 1e-6


@dataclass
class SolveRecord:
    """Everything one module's solve used, kept for the influence audit. Shapes: keys (n, s), targets (m, s),
    example_ids, positions and tokens (s,) (the gold next token at each position); ridge is mu, w_forget and
    w_retain the objective's weights (REFERENCE section 1). An LM head's targets are kept by their non-zero rows
    (`target_rows`), which leaves every norm of the influence audit unchanged."""

    module: str
    keys: torch.Tensor
    targets: torch.Tensor
    example_ids: torch.Tensor
    ridge: float
    retain_count: int
    w_forget: float = 1.0
    w_retain: float = 1.0
    positions: torch.Tensor | None = None
    tokens: torch.Tensor | None = None
    target_rows: torch.Tensor | None = None  # (u,) for a row-sparse target: targets are the rows D[target_rows]


@dataclass
class InfluenceReport:
    """Per-example influence on one module's edit.

    Attributes:
        example_ids: (e,) the distinct example ids, ascending.
        norms: (e,) ||P - P_-i||_F, float64.
        min_eig: (e,) smallest eigenvalue of c M_i, in (0, 1]; near 0 means high leverage.
        flagged: (e,) bool, min_eig below the threshold.
        refit: (e,) bool, the norm came from a direct refit rather than the Woodbury formula.
    """

    example_ids: torch.Tensor
    norms: torch.Tensor
    min_eig: torch.Tensor
    flagged: torch.Tensor
    refit: torch.Tensor

    def as_dict(self) -> dict[int, float]:
        return {int(i): float(v) for i, v in zip(self.example_ids.tolist(), self.norms.tolist(), strict=True)}


@dataclass
class _Blocks:
    """Per-example column blocks, padded to the largest example (kmax). Shapes in the comments."""

    ids: torch.Tensor  # (e,)
    index: torch.Tensor  # (e, kmax) column indices into the s forget columns; padding points at column 0
    valid: torch.Tensor  # (e, kmax) bool


def _group_columns(example_ids: torch.Tensor, s: int) -> _Blocks:
    if example_ids.ndim != 1 or example_ids.numel() != s:
        raise ShapeMismatchError(f"example_ids must be (s,) = ({s},), got {tuple(example_ids.shape)}")
    ids, inverse, counts = torch.unique(example_ids.cpu(), return_inverse=True, return_counts=True)
    kmax = int(counts.max())
    order = torch.argsort(inverse, stable=True)
    starts = torch.cumsum(counts, 0) - counts
    slot = torch.arange(s) - starts[inverse[order]]
    index = torch.zeros(len(ids), kmax, dtype=torch.long)
    valid = torch.zeros(len(ids), kmax, dtype=torch.bool)
    index[inverse[order], slot] = order
    valid[inverse[order], slot] = True
    return _Blocks(ids=ids, index=index, valid=valid)


def _gather_blocks(matrix: torch.Tensor, blocks: _Blocks) -> torch.Tensor:
    """(s, s) matrix -> (e, kmax, kmax) per-example diagonal blocks, zero in the padding."""
    idx = blocks.index.to(matrix.device)
    out = matrix[idx[:, :, None], idx[:, None, :]]
    mask = (blocks.valid[:, :, None] & blocks.valid[:, None, :]).to(matrix.device)
    return out * mask


@dataclass
class _Solved:
    system_c: float
    ridge: float  # mu plus whatever jitter the factorisation of A had to add: the system P was solved with
    z: torch.Tensor  # (n, s) A^-1 X_f
    residual: torch.Tensor  # (m, s) E = D - P X_f
    m_blocks: torch.Tensor  # (e, kmax, kmax) M_i, I / c in the padding
    blocks: _Blocks


def _prepare(forget_keys, targets, retain_gram, retain_count, example_ids, w_forget, w_retain, ridge) -> _Solved:
    check_inputs(forget_keys, targets, retain_gram, retain_count, w_forget, w_retain, ridge)
    system = factor_system(forget_keys, retain_gram, retain_count, w_forget=w_forget, w_retain=w_retain, ridge=ridge)
    x_f = forget_keys.double()
    d = targets.double().to(x_f.device)
    z = system.solve(x_f)  # (n, s)
    c = system.c
    xtz = x_f.T @ z  # (s, s); P X_f = c D (Z^T X_f) = c D (X_f^T Z)  (A symmetric)
    residual = d - c * d @ xtz  # (m, s)
    blocks = _group_columns(example_ids, x_f.shape[1])
    eye = torch.eye(blocks.index.shape[1], dtype=torch.float64, device=x_f.device)
    valid2 = (blocks.valid[:, :, None] & blocks.valid[:, None, :]).to(x_f.device)
    m_blocks = torch.where(valid2, eye / c - _gather_blocks(xtz, blocks), eye / c)
    m_blocks = 0.5 * (m_blocks + m_blocks.transpose(1, 2))
    return _Solved(system_c=c, ridge=ridge + system.jitter, z=z, residual=residual, m_blocks=m_blocks,
                   blocks=blocks)


def _refit_norm(forget_keys, targets, retain_gram, retain_count, keep: torch.Tensor, c: float, w_retain: float,
                ridge: float, p_full: torch.Tensor) -> float:
    """||P - P_-i|| by solving the system without the left-out columns directly (c fixed)."""
    x = forget_keys.double()[:, keep]
    d = targets.double()[:, keep]
    n = x.shape[0]
    a = c * x @ x.T + ridge * torch.eye(n, dtype=torch.float64, device=x.device)
    if w_retain:
        a += (w_retain / retain_count) * retain_gram.double().to(x.device)
    p_minus = c * torch.linalg.solve(a, x @ d.T).T  # a is symmetric
    return float(torch.linalg.matrix_norm(p_full - p_minus))


def influence_report(forget_keys: torch.Tensor, targets: torch.Tensor, retain_gram: torch.Tensor,
                     retain_count: int, example_ids: torch.Tensor, *, w_forget: float = 1.0, w_retain: float = 1.0,
                     ridge: float = 1e-2, leverage_threshold: float = DEFAULT_LEVERAGE_THRESHOLD,
                     refit_flagged: bool = True) -> InfluenceReport:
    """Leave-one-out influence of every forget example; see the module docstring for the formulas.

    Shapes: forget_keys (n, s), targets (m, s), retain_gram (n, n), example_ids (s,) integer.

    High-leverage examples (min_eig below `leverage_threshold`) are refit directly when `refit_flagged`; an
    example whose M_i is not numerically positive definite (its Cholesky fails) is always flagged and refit,
    since the Woodbury value is meaningless there. Refits solve the same system as the edit, jitter included.
    """
    solved = _prepare(forget_keys, targets, retain_gram, retain_count, example_ids, w_forget, w_retain, ridge)
    blocks = solved.blocks
    ete = _gather_blocks(solved.residual.T @ solved.residual, blocks)  # (e, k, k) E_i^T E_i
    ztz = _gather_blocks(solved.z.T @ solved.z, blocks)  # (e, k, k) Z_i^T Z_i
    chol, info = torch.linalg.cholesky_ex(solved.m_blocks)
    failed = (info != 0).cpu()  # per block: M_i is not numerically positive definite
    left = torch.cholesky_solve(ete, chol)  # M^-1 E^T E
    right = torch.cholesky_solve(ztz, chol)  # M^-1 Z^T Z
    sq = (left * right.transpose(1, 2)).sum(dim=(1, 2))  # trace(left @ right)
    norms = sq.clamp_min(0).sqrt().cpu()
    eig = torch.linalg.eigvalsh(solved.system_c * solved.m_blocks)
    # padding of M is I / c, i.e. eigenvalue 1 after scaling, the largest possible: it never wins the minimum
    min_eig = eig[:, 0].cpu()
    flagged = (min_eig < leverage_threshold) | failed
    to_refit = flagged if refit_flagged else failed
    refit = torch.zeros_like(flagged)
    if bool(to_refit.any()):
        c = solved.system_c
        p_full = c * targets.double().to(solved.z.device) @ solved.z.T
        for row in torch.nonzero(to_refit).flatten().tolist():
            keep = example_ids.to(forget_keys.device) != blocks.ids[row].to(forget_keys.device)
            norms[row] = _refit_norm(forget_keys, targets, retain_gram, retain_count, keep, c, w_retain,
                                     solved.ridge, p_full)
            refit[row] = True
    return InfluenceReport(example_ids=blocks.ids, norms=norms, min_eig=min_eig, flagged=flagged, refit=refit)


def leave_one_out(forget_keys: torch.Tensor, targets: torch.Tensor, retain_gram: torch.Tensor, retain_count: int,
                  example_ids: torch.Tensor, *, w_forget: float = 1.0, w_retain: float = 1.0,
                  ridge: float = 1e-2) -> dict[int, float]:
    """example id -> ||P - P_-i||_F with c = w_forget / s held fixed (see the module docstring)."""
    return influence_report(forget_keys, targets, retain_gram, retain_count, example_ids, w_forget=w_forget,
                            w_retain=w_retain, ridge=ridge).as_dict()


def output_influence(forget_keys: torch.Tensor, targets: torch.Tensor, retain_gram: torch.Tensor,
                     retain_count: int, example_ids: torch.Tensor, probes: torch.Tensor, *, w_forget: float = 1.0,
                     w_retain: float = 1.0, ridge: float = 1e-2) -> dict[int, torch.Tensor]:
    """example id -> (m, p) change of the edit's output on probe keys q (n, p): (P - P_-i) q = E_i M_i^-1 Z_i^T q."""
    if probes.ndim != 2 or probes.shape[0] != forget_keys.shape[0]:
        raise ShapeMismatchError(f"probes must be (n={forget_keys.shape[0]}, p), got {tuple(probes.shape)}")
    solved = _prepare(forget_keys, targets, retain_gram, retain_count, example_ids, w_forget, w_retain, ridge)
    blocks = solved.blocks
    zq = solved.z.T @ probes.double().to(solved.z.device)  # (s, p)
    out = {}
    for row, example in enumerate(blocks.ids.tolist()):
        cols = blocks.index[row][blocks.valid[row]].to(zq.device)
        k = len(cols)
        m_i = solved.m_blocks[row, :k, :k]
        out[int(example)] = solved.residual[:, cols] @ torch.linalg.solve(m_i, zq[cols])
    return out


def record_influence(record: SolveRecord, stats: GramStats) -> InfluenceReport:
    """Exact leave-one-out influence of every forget example on one module's edit, from what its solve used.

    Exact for that module with everything else held fixed: its keys, targets, specificity weights, the chosen
    layers and c = w_forget / s. Leaving an example out for real would also change those (see
    methods.refit_without)."""
    return influence_report(record.keys, record.targets, stats.gram, record.retain_count, record.example_ids,
                            w_forget=record.w_forget, w_retain=record.w_retain, ridge=record.ridge)


def audit(records: Mapping[str, SolveRecord], stats: Mapping[str, GramStats]) -> dict[str, InfluenceReport]:
    """Exact leave-one-out influence of every forget example on every module's edit."""
    return {name: record_influence(rec, stats[name]) for name, rec in records.items()}
