import pytest
import torch

from grom_core.influence import influence_report, leave_one_out, output_influence
from grom_core.solver import factor_system, solve_edit


def refit_without(x_f, d, gram, r, ids, example, w_f, w_r, mu):
    """Brute force: solve again without the example's columns, with c = w_f / s held at the full s."""
    s = x_f.shape[1]
    keep = ids != example
    c = w_f / s
    x, dd = x_f[:, keep], d[:, keep]
    a = c * x @ x.T + (w_r / r) * gram + mu * torch.eye(x_f.shape[0], dtype=torch.float64)
    return c * dd @ x.T @ torch.linalg.inv(a)


def problem(seed, n=9, m=6, sizes=(1, 2, 3, 4, 1), r=60):
    gen = torch.Generator().manual_seed(seed)
    ids = torch.cat([torch.full((k,), 10 + i) for i, k in enumerate(sizes)])
    ids = ids[torch.randperm(len(ids), generator=gen)]  # columns of one example need not be adjacent
    s = len(ids)
    x_f = torch.randn(n, s, generator=gen, dtype=torch.float64)
    x_r = torch.randn(n, r, generator=gen, dtype=torch.float64)
    d = torch.randn(m, s, generator=gen, dtype=torch.float64)
    return x_f, d, x_r @ x_r.T, r, ids


@pytest.mark.parametrize("seed,mu", [(0, 1e-2), (1, 1e-4), (2, 1.0)])
def test_leave_one_out_equals_brute_force_refits(seed, mu):
    x_f, d, gram, r, ids = problem(seed)
    w_f, w_r = 2.0, 0.5
    got = leave_one_out(x_f, d, gram, r, ids, w_forget=w_f, w_retain=w_r, ridge=mu)
    p = solve_edit(x_f, d, gram, r, w_forget=w_f, w_retain=w_r, ridge=mu)
    assert sorted(got) == sorted(set(ids.tolist()))
    for example, value in got.items():
        expected = float(torch.linalg.matrix_norm(p - refit_without(x_f, d, gram, r, ids, example, w_f, w_r, mu)))
        assert value == pytest.approx(expected, rel=1e-8, abs=1e-12)


def test_output_influence_equals_brute_force_on_probes():
    x_f, d, gram, r, ids = problem(5)
    probes = torch.randn(x_f.shape[0], 3, dtype=torch.float64, generator=torch.Generator().manual_seed(9))
    got = output_influence(x_f, d, gram, r, ids, probes)
    p = solve_edit(x_f, d, gram, r)
    for example, change in got.items():
        expected = (p - refit_without(x_f, d, gram, r, ids, example, 1.0, 1.0, 1e-2)) @ probes
        assert torch.allclose(change, expected, rtol=1e-8, atol=1e-12)


def test_high_leverage_example_is_flagged_and_refit():
    # One example alone spans a direction that no retain key and no other forget key touches.
    x_f, d, gram, r, ids = problem(4, n=6, sizes=(2, 2, 1))
    lone = ids == ids[0]
    x_f[5, :] = 0.0
    x_f[5, lone] = 1e3
    gram[5, :] = 0.0
    gram[:, 5] = 0.0
    report = influence_report(x_f, d, gram, r, ids, ridge=1e-9, leverage_threshold=1e-3)
    flagged = {int(e) for e, f in zip(report.example_ids, report.flagged, strict=True) if f}
    assert flagged == {int(ids[0])}
    assert bool(report.refit[report.example_ids == ids[0]].all())
    p = solve_edit(x_f, d, gram, r, ridge=1e-9)
    exact = torch.linalg.matrix_norm(p - refit_without(x_f, d, gram, r, ids, int(ids[0]), 1.0, 1.0, 1e-9))
    got = report.as_dict()[int(ids[0])]
    assert got == pytest.approx(float(exact), rel=1e-6)
    assert float(report.min_eig.max()) <= 1.0 + 1e-12


def test_an_example_whose_block_is_not_positive_definite_is_refit_even_when_refits_are_off():
    # Two nearly identical columns alone span a direction: M_i is singular to rounding and its Cholesky fails.
    x_f, d, gram, r, ids = problem(0, n=6, sizes=(2, 2, 2))
    lone = ids == ids[0]
    x_f[5, :] = 0.0
    x_f[5, lone] = torch.tensor([1e3, 1e3 * (1 + 1e-9)], dtype=torch.float64)
    x_f[:5, lone] = x_f[:5, lone][:, :1]
    gram[5, :] = 0.0
    gram[:, 5] = 0.0
    mu = 1e-12
    report = influence_report(x_f, d, gram, r, ids, ridge=mu, refit_flagged=False)
    row = int(torch.nonzero(report.example_ids == ids[0]))
    assert bool(report.flagged[row]) and bool(report.refit[row])
    assert int(report.refit.sum()) == 1  # the others keep their Woodbury values
    p = solve_edit(x_f, d, gram, r, ridge=mu)
    exact = float(torch.linalg.matrix_norm(p - refit_without(x_f, d, gram, r, ids, int(ids[0]), 1.0, 1.0, mu)))
    assert float(report.norms[row]) == pytest.approx(exact, rel=1e-4)


def test_refits_solve_the_same_jittered_system_as_the_edit():
    # A retain Gram of rank 3 at scale 1e18 with mu = 1e-12: A's Cholesky needs jitter, and P was solved with it.
    gen = torch.Generator().manual_seed(0)
    x_r = torch.randn(8, 3, generator=gen, dtype=torch.float64) * 1e9
    gram = x_r @ x_r.T
    x_f = torch.randn(8, 5, generator=gen, dtype=torch.float64)
    d = torch.randn(4, 5, generator=gen, dtype=torch.float64)
    ids = torch.tensor([0, 0, 1, 2, 3])
    mu = 1e-12
    system = factor_system(x_f, gram, 3, ridge=mu)
    assert system.jitter > 0
    p = system.c * d @ system.solve(x_f).T
    report = influence_report(x_f, d, gram, 3, ids, ridge=mu, leverage_threshold=1.0)  # every example refit
    assert bool(report.refit.all())
    for example, value in report.as_dict().items():
        exact = torch.linalg.matrix_norm(p - refit_without(x_f, d, gram, 3, ids, example, 1.0, 1.0, mu + system.jitter))
        assert value == pytest.approx(float(exact), rel=1e-4)
