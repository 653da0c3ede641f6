"""The weight updates of the locate-then-edit editors, as pure float64 functions of keys, residuals and covariances.

Notation (one MLP down-projection W, (out, in)): K (in, N) holds the keys of N facts (one column each), R (out, N)
the change of output each fact asks for (v*_i - W k_i), C (in, in) the second moment of the keys that must keep
their outputs (the retain data's keys, C = G / r). Every function returns the update as factors, Delta = left @
right with left (out, N) and right (N, in), which `ModuleDelta.from_factors` stores without forming Delta.
"""

from __future__ import annotations

import torch

from grom_core.errors import ShapeMismatchError


def _check(keys: torch.Tensor, residuals: torch.Tensor, square: torch.Tensor | None = None) -> None:
    if keys.ndim != 2 or residuals.ndim != 2 or keys.shape[1] != residuals.shape[1]:
        raise ShapeMismatchError(f"keys (in, N) and residuals (out, N) must have one column per fact, got "
                                 f"{tuple(keys.shape)} and {tuple(residuals.shape)}")
    if square is not None and square.shape != (keys.shape[0], keys.shape[0]):
        raise ShapeMismatchError(f"the covariance must be ({keys.shape[0]}, {keys.shape[0]}), got "
                                 f"{tuple(square.shape)}")


def rome_updates(keys: torch.Tensor, residuals: torch.Tensor, cov: torch.Tensor, ridge: float = 0.0
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """Sequential rank-one edits (ROME, Meng et al. 2022), one fact after the other.

    Fact i's update is Delta_i = r_i u_i^T / (u_i^T k_i) with u_i = (C + ridge I)^-1 k_i and r_i what is still
    missing after the updates before it, r_i = R[:, i] - sum_{j<i} Delta_j k_i. So (W + sum_{j<=i} Delta_j) k_i =
    W k_i + R[:, i] holds exactly right after edit i (later edits may disturb it: ROME edits one fact at a time).

    Args:
        keys: (in, N). residuals: (out, N). cov: (in, in) C. ridge: added to C's diagonal (units of C), for a C
            that is singular (fewer retain positions than key dimensions).
    Returns:
        left (out, N), right (N, in), float64: Delta = sum_i left[:, i] right[i] = left @ right.
    """
    _check(keys, residuals, cov)
    k, r = keys.double(), residuals.double()
    c = cov.double() + ridge * torch.eye(k.shape[0], dtype=torch.float64, device=k.device)
    u = torch.linalg.solve(0.5 * (c + c.T), k)  # (in, N): C^-1 k_i, every fact at once (C never changes)
    right = (u / (u * k).sum(dim=0, keepdim=True)).T.contiguous()  # (N, in): u_i^T / (u_i^T k_i)
    left = torch.zeros_like(r)
    for i in range(k.shape[1]):
        done = left[:, :i] @ (right[:i] @ k[:, i]) if i else 0.0  # what earlier edits already did to k_i
        left[:, i] = r[:, i] - done
    return left, right


def memit_update(keys: torch.Tensor, residuals: torch.Tensor, cov: torch.Tensor, cov_weight: float
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """MEMIT's batch update (Meng et al. 2023): the least-squares solution

        argmin_Delta ||Delta K - R||_F^2 + cov_weight tr(Delta C Delta^T)  =  R K^T (cov_weight C + K K^T)^-1,

    i.e. the facts' new outputs, traded against the change of output on the preserved keys (C = E[k k^T]).
    Returns left = R (out, N) and right = (cov_weight C + K K^T)^-1 K, transposed (N, in)."""
    _check(keys, residuals, cov)
    k = keys.double()
    a = cov_weight * cov.double() + k @ k.T
    right = torch.linalg.solve(0.5 * (a + a.T), k).T.contiguous()
    return residuals.double().clone(), right


def null_space_projector(cov: torch.Tensor, threshold: float) -> torch.Tensor:
    """(in, in) P projecting onto the eigenvectors of C whose eigenvalues are below threshold x the largest
    (AlphaEdit's null space of the preserved keys: P k ~ 0 for every key C was summed from). float64."""
    c = cov.double()
    values, vectors = torch.linalg.eigh(0.5 * (c + c.T))
    small = vectors[:, values < threshold * float(values.max().clamp_min(0))]
    return small @ small.T


def alphaedit_update(keys: torch.Tensor, residuals: torch.Tensor, projector: torch.Tensor, l2: float
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """AlphaEdit's update (Fang et al. 2025): MEMIT's least squares restricted to the null space of the preserved
    keys, Delta = R K^T P (K K^T P + l2 I)^-1 = R K^T (P K K^T + l2 I)^-1 P.

    It ends in P, so Delta k_0 = 0 for every preserved key k_0 with P k_0 = 0: their outputs cannot move. (The
    published form also carries the keys of earlier edit batches; one batch here.) Returns left = R (out, N) and
    right = K^T (P K K^T + l2 I)^-1 P (N, in), computed as (P (K K^T P + l2 I)^-1 K)^T so that P is applied last
    and the preserved keys' outputs stay exact.
    """
    _check(keys, residuals, projector)
    k, p = keys.double(), projector.double()
    a = (k @ k.T) @ p + l2 * torch.eye(k.shape[0], dtype=torch.float64, device=k.device)
    right = (p @ torch.linalg.solve(a, k)).T.contiguous()  # (N, in)
    return residuals.double().clone(), right
