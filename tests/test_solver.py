import pytest
import torch

from grom_core.errors import NonFiniteError, ShapeMismatchError
from grom_core.solver import factor_system, solve_edit


def brute_force(x_f, d, x_r, w_f, w_r, mu):
    """Least squares of the stacked system [sqrt(w_r/r) X_r, sqrt(c) X_f, sqrt(mu) I] -> [0, sqrt(c) D, 0]."""
    n, s = x_f.shape
    r = x_r.shape[1]
    c = w_f / s
    big = torch.cat([(w_r / r) ** 0.5 * x_r, c ** 0.5 * x_f, mu ** 0.5 * torch.eye(n, dtype=torch.float64)], dim=1)
    rhs = torch.cat([torch.zeros(d.shape[0], r, dtype=torch.float64), c ** 0.5 * d,
                     torch.zeros(d.shape[0], n, dtype=torch.float64)], dim=1)
    # P big = rhs  <=>  big^T P^T = rhs^T
    return torch.linalg.lstsq(big.T, rhs.T, driver="gelsd").solution.T


def rel_err(a, b):
    return float(torch.linalg.matrix_norm(a - b) / torch.linalg.matrix_norm(b))


@pytest.mark.parametrize("n,m,s,r,rank_r,mu", [
    (8, 5, 6, 40, 8, 1e-2),
    (12, 7, 20, 50, 3, 1e-3),  # rank-deficient retain side
    (16, 30, 4, 10, 2, 1e-6),  # small ridge, rank-deficient
    (6, 3, 12, 100, 6, 1.0),
])
def test_solve_edit_matches_stacked_least_squares(n, m, s, r, rank_r, mu):
    gen = torch.Generator().manual_seed(n * 1000 + s)
    x_f = torch.randn(n, s, generator=gen, dtype=torch.float64)
    basis = torch.randn(n, rank_r, generator=gen, dtype=torch.float64)
    x_r = basis @ torch.randn(rank_r, r, generator=gen, dtype=torch.float64)
    d = torch.randn(m, s, generator=gen, dtype=torch.float64)
    w_f, w_r = 1.3, 0.7
    p = solve_edit(x_f, d, x_r @ x_r.T, r, w_forget=w_f, w_retain=w_r, ridge=mu)
    assert p.dtype == torch.float64 and p.shape == (m, n)
    assert rel_err(p, brute_force(x_f, d, x_r, w_f, w_r, mu)) < 1e-8


def test_only_the_ratio_of_the_weights_matters_when_the_ridge_scales_with_w_retain():
    """GROM fixes w_forget = 1 and sets mu proportional to w_retain: (k w_f, k w_r, k mu) is the same objective times
    k, so the same edit (grom_core.grom.solve.mu)."""
    gen = torch.Generator().manual_seed(7)
    x_f = torch.randn(9, 6, generator=gen, dtype=torch.float64)
    x_r = torch.randn(9, 40, generator=gen, dtype=torch.float64)
    d = torch.randn(4, 6, generator=gen, dtype=torch.float64)
    base = solve_edit(x_f, d, x_r @ x_r.T, 40, w_forget=1.0, w_retain=10.0, ridge=1e-2)
    scaled = solve_edit(x_f, d, x_r @ x_r.T, 40, w_forget=3.0, w_retain=30.0, ridge=3e-2)
    other = solve_edit(x_f, d, x_r @ x_r.T, 40, w_forget=3.0, w_retain=10.0, ridge=1e-2)
    assert rel_err(scaled, base) < 1e-10
    assert rel_err(other, base) > 1e-3  # the ratio does matter


def test_solve_edit_accepts_float32_inputs_and_returns_float64():
    gen = torch.Generator().manual_seed(0)
    x_f = torch.randn(5, 7, generator=gen)
    x_r = torch.randn(5, 30, generator=gen)
    d = torch.randn(4, 7, generator=gen)
    p = solve_edit(x_f, d, x_r @ x_r.T, 30)
    ref = brute_force(x_f.double(), d.double(), x_r.double(), 1.0, 1.0, 1e-2)
    assert p.dtype == torch.float64
    assert rel_err(p, ref) < 1e-5  # the float32 Gram is the only inexact step


def test_retain_outputs_move_less_than_forget_outputs():
    gen = torch.Generator().manual_seed(3)
    n = 10
    x_r = torch.randn(n, 200, generator=gen, dtype=torch.float64)
    x_r[:3] *= 0.01  # the forget keys live mostly where retain keys are quiet
    x_f = torch.zeros(n, 5, dtype=torch.float64)
    x_f[:3] = torch.randn(3, 5, generator=gen, dtype=torch.float64)
    d = -torch.ones(4, 5, dtype=torch.float64)
    p = solve_edit(x_f, d, x_r @ x_r.T, 200, ridge=1e-4)
    forget_move = (p @ x_f).norm(dim=0).mean()
    retain_move = (p @ x_r).norm(dim=0).mean()
    assert forget_move > 10 * retain_move


def test_jitter_retry_is_logged(caplog):
    x_f = torch.ones(4, 2, dtype=torch.float64)
    gram = -1e3 * torch.eye(4, dtype=torch.float64)  # indefinite on purpose
    with caplog.at_level("WARNING"), pytest.raises(NonFiniteError, match="raise ridge"):
        factor_system(x_f, gram, 1, ridge=1e-2)
    assert "retrying with jitter" in caplog.text


def test_bad_inputs_are_named():
    x_f, d, g = torch.randn(4, 3), torch.randn(2, 3), torch.eye(4)
    with pytest.raises(ShapeMismatchError, match="targets"):
        solve_edit(x_f, torch.randn(2, 5), g, 10)
    with pytest.raises(ShapeMismatchError, match="retain_gram"):
        solve_edit(x_f, d, torch.eye(3), 10)
    with pytest.raises(ShapeMismatchError, match="no columns"):
        solve_edit(torch.randn(4, 0), torch.randn(2, 0), g, 10)
    with pytest.raises(ShapeMismatchError, match="retain_count"):
        solve_edit(x_f, d, g, 0)
    bad = x_f.clone()
    bad[0, 0] = float("nan")
    with pytest.raises(NonFiniteError, match="forget_keys"):
        solve_edit(bad, d, g, 10)
    with pytest.raises(ValueError, match="ridge"):
        solve_edit(x_f, d, g, 10, ridge=0.0)


def test_the_bench_solve_scaling_rows_are_exact_solves():
    from flows.bench import solve_scaling

    rows = solve_scaling(sizes=(16, 32), s=8, m=4)
    assert [(r["n"], r["s"], r["m"]) for r in rows] == [(16, 8, 4), (32, 8, 4)]
    assert all(r["relative_gradient"] < 1e-10 for r in rows)  # the gradient of the objective vanishes
