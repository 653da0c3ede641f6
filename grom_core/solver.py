"""The closed-form solve of the GROM objective for one weight matrix.

    minimize_P  (w_r / r) ||P X_r||_F^2 + (w_f / s) ||P X_f - D||_F^2 + mu ||P||_F^2

    P* = c D X_f^T A^-1,  A = (w_r / r) G_r + c X_f X_f^T + mu I,  c = w_f / s,  G_r = X_r X_r^T.

Units: w_r and w_f weight *mean* squared errors (per retain position and per forget position), so they are
comparable whatever r and s are; mu is per unit of ||P||_F^2 and has the units of a squared key norm.
A is symmetric positive definite for mu > 0 and is factored once with a float64 Cholesky; no inverse is formed.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from grom_core.errors import NonFiniteError, ShapeMismatchError

log = logging.getLogger(__name__)

MAX_JITTER_TRIES = 6


@dataclass
class FactoredSystem:
    """A = L L^T in float64 plus the constants that built it. Shapes: chol (n, n)."""

    chol: torch.Tensor
    c: float  # w_forget / s
    jitter: float  # what had to be added to the diagonal (0 when none)

    def solve(self, rhs: torch.Tensor) -> torch.Tensor:
        """A^-1 rhs for rhs (n, k), float64."""
        return torch.cholesky_solve(rhs.double(), self.chol)


def _check_finite(name: str, tensor: torch.Tensor) -> None:
    if not torch.isfinite(tensor).all():
        raise NonFiniteError(f"{name} holds NaN or Inf; recollect it with the model in float32 or bfloat16")


def check_inputs(forget_keys: torch.Tensor, targets: torch.Tensor | None, retain_gram: torch.Tensor,
                 retain_count: int, w_forget: float, w_retain: float, ridge: float) -> None:
    """Validate shapes, finiteness and knobs; raises a GromError that says what to fix."""
    if forget_keys.ndim != 2:
        raise ShapeMismatchError(f"forget_keys must be (n, s), got shape {tuple(forget_keys.shape)}")
    n, s = forget_keys.shape
    if s == 0:
        raise ShapeMismatchError("forget_keys has no columns: the forget set has no supervised positions")
    if targets is not None and (targets.ndim != 2 or targets.shape[1] != s):
        raise ShapeMismatchError(f"targets must be (m, s={s}) to match forget_keys (n={n}, s={s}), "
                                 f"got {tuple(targets.shape)}")
    if retain_gram.shape != (n, n):
        raise ShapeMismatchError(f"retain_gram must be (n, n) = ({n}, {n}) to match forget_keys, "
                                 f"got {tuple(retain_gram.shape)}")
    if retain_count < 0 or (retain_count == 0 and w_retain != 0):
        raise ShapeMismatchError(f"retain_count must be positive (got {retain_count}); "
                                 f"collect retain statistics or set w_retain=0")
    if not (ridge > 0 and w_forget > 0 and w_retain >= 0):
        raise ValueError(f"need ridge > 0, w_forget > 0 and w_retain >= 0; got ridge={ridge}, "
                         f"w_forget={w_forget}, w_retain={w_retain}")
    _check_finite("forget_keys", forget_keys)
    _check_finite("retain_gram", retain_gram)
    if targets is not None:
        _check_finite("targets", targets)


def factor_system(forget_keys: torch.Tensor, retain_gram: torch.Tensor, retain_count: int, *,
                  w_forget: float = 1.0, w_retain: float = 1.0, ridge: float = 1e-2) -> FactoredSystem:
    """Build A (float64) and factor it; on failure add growing jitter to the diagonal and say so in the log.

    A is built in one (n, n) buffer (the scaled retain Gram, plus c X_f X_f^T, plus mu on the diagonal) and
    Cholesky reads its lower triangle only (LAPACK's potrf): the factor is that of the symmetric matrix with A's lower
    triangle, so the rounding-level asymmetry of the Gram sums never matters and no transpose is formed."""
    check_inputs(forget_keys, None, retain_gram, retain_count, w_forget, w_retain, ridge)
    x_f = forget_keys.double()
    n, s = x_f.shape
    c = w_forget / s
    if w_retain:
        a = retain_gram.to(device=x_f.device, dtype=torch.float64).mul(w_retain / retain_count)
    else:
        a = torch.zeros(n, n, dtype=torch.float64, device=x_f.device)
    a.addmm_(x_f, x_f.T, alpha=c)
    a.diagonal().add_(ridge)
    chol, info = torch.linalg.cholesky_ex(a)
    jitter = 0.0
    scale = float(a.diagonal().abs().mean())
    tries = 0
    while int(info) != 0:
        tries += 1
        if tries > MAX_JITTER_TRIES:
            raise NonFiniteError(f"the system matrix is not positive definite even with jitter {jitter:.3g}; "
                                 f"raise ridge (now {ridge})")
        added, jitter = jitter, scale * 10.0 ** (-12 + 2 * tries)
        log.warning("Cholesky failed (info=%d); retrying with jitter %.3g on the diagonal", int(info), jitter)
        a.diagonal().add_(jitter - added)  # the same buffer: mu + jitter on the diagonal
        chol, info = torch.linalg.cholesky_ex(a)
    return FactoredSystem(chol=chol, c=c, jitter=jitter)


def solve_factors(forget_keys: torch.Tensor, targets: torch.Tensor, retain_gram: torch.Tensor, retain_count: int,
                  *, w_forget: float = 1.0, w_retain: float = 1.0, ridge: float = 1e-2
                  ) -> tuple[torch.Tensor, torch.Tensor, FactoredSystem]:
    """P* as two factors, P = left @ right, with left = c D (m, s) and right = (A^-1 X_f)^T (s, n), float64."""
    check_inputs(forget_keys, targets, retain_gram, retain_count, w_forget, w_retain, ridge)
    system = factor_system(forget_keys, retain_gram, retain_count, w_forget=w_forget, w_retain=w_retain, ridge=ridge)
    z = system.solve(forget_keys)  # (n, s) = A^-1 X_f
    left = system.c * targets.double().to(z.device)
    return left, z.T.contiguous(), system


def solve_edit(forget_keys: torch.Tensor, targets: torch.Tensor, retain_gram: torch.Tensor, retain_count: int, *,
               w_forget: float = 1.0, w_retain: float = 1.0, ridge: float = 1e-2) -> torch.Tensor:
    """The exact minimiser P (m, n), float64, of the objective in this module's docstring.

    Args:
        forget_keys: (n, s) keys, one column per forget position.
        targets: (m, s) desired output change D at each forget position.
        retain_gram: (n, n) X_r X_r^T summed over the retain positions.
        retain_count: r, the number of retain positions.
        w_forget, w_retain: weights of the mean forget and mean retain squared errors.
        ridge: mu > 0.
    """
    left, right, _ = solve_factors(forget_keys, targets, retain_gram, retain_count, w_forget=w_forget,
                                   w_retain=w_retain, ridge=ridge)
    return left @ right
