r"""Closed forms of ``kernelapprox.theory.moments``: special functions and exact identities.

No Monte Carlo here: the bias / variance / MSE formulas are checked against Monte Carlo, for every
registered estimator with closed-form moments, every row law (iid, orthogonal with chi or fixed
norms) and several block shapes, in ``test_mse_monte_carlo.py`` (z-tests resolving a 5 % error in
a formula). This file checks the special functions against ``mpmath`` and the formulas against
independent written-out forms (Performer Lemma 2, the single-block ORF sheet, the SMREG series).
"""

from __future__ import annotations

import math

import mpmath
import numpy as np
import pytest
import torch

import kernelapprox as ka
from kernelapprox import theory as M
from kernelapprox.samplers import OrthogonalSampler
from kernelapprox.theory import _common as C

#: The row law of ``OrthogonalSampler(norms=...)`` (``None``: iid rows).
ROW_LAW = {None: "iid", "chi": "orthogonal-chi", "fixed": "orthogonal-fixed", "simplex": "simplex"}

F64 = torch.float64


# ------------------------------------------------------------------------------------------------
# special functions against mpmath
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("d", [1, 2, 3, 7, 64, 257])
def test_pair_excess_matches_mpmath(d):
    """1F1(d; d/2; z) - e^{2z}: series/scipy vs 40-digit mpmath (Kummer form for z < 0)."""
    zs = np.array([-400.0, -30.0, -3.0, -0.9, -0.05, -1e-4, 1e-4, 0.05, 0.9, 3.0, 20.0, 35.0])
    got = C._pair_excess(d, zs)
    with mpmath.workdps(40):
        for z, g in zip(zs, got, strict=True):
            zz = mpmath.mpf(z)
            f = mpmath.exp(zz) * mpmath.hyp1f1(-mpmath.mpf(d) / 2, mpmath.mpf(d) / 2, -zz, maxprec=20000)
            ref = float(f - mpmath.exp(2 * zz))
            scale = max(abs(ref), 1e-300)
            # absolute floor 1e-15 * e^{2z} for z < 0 where both terms are tiny
            assert abs(g - ref) <= 1e-10 * scale + 1e-15 * math.exp(min(2 * z, 0.0)) * (z < -1), (
                d,
                z,
                g,
                ref,
            )


@pytest.mark.parametrize("d", [2, 5, 64, 512, 2048])
def test_hyp0f1_helpers_match_mpmath(d):
    b = d / 2
    xs = -np.array([1e-3, 0.5, 3.0, 50.0, 300.0, 3000.0, 4e4])
    got = C._hyp0f1_neg(b, xs)
    with mpmath.workdps(40):
        for x, g in zip(xs, got, strict=True):
            ref = float(mpmath.hyp0f1(b, x, maxprec=20000, zeroprec=2000))
            assert abs(g - ref) <= 1e-9 * abs(ref) + 1e-14, (d, x, g, ref)
        xp = np.array([1e-3, 1.0, 100.0, 1e4, 1e6])
        lg = C._log_hyp0f1_pos(b, xp)
        for x, g in zip(xp, lg, strict=True):
            ref = float(mpmath.log(mpmath.hyp0f1(b, x)))
            assert abs(g - ref) <= 1e-11 * max(1.0, abs(ref)), (d, x, g, ref)


def test_scipy_hyp1f1_accuracy_in_tested_range():
    """The range where moments.py calls scipy.special.hyp1f1 directly (z < -1)."""
    with mpmath.workdps(30):
        for d in (1, 4, 33, 128):
            for z in (-1.5, -10.0, -100.0, -1000.0):
                ref = mpmath.exp(z) * mpmath.hyp1f1(-mpmath.mpf(d) / 2, mpmath.mpf(d) / 2, -z, maxprec=20000)
                from scipy.special import hyp1f1

                got = hyp1f1(d, d / 2, z)
                assert abs(got - float(ref)) <= 1e-11 * abs(float(ref)) + 1e-300


# ------------------------------------------------------------------------------------------------
# exact identities (no Monte Carlo)
# ------------------------------------------------------------------------------------------------


def test_orf_pair_count_brute_force():
    for d in (1, 3, 4):
        for r in range(1, 14):
            block = np.arange(r) // d
            brute = int(np.sum(block[:, None] == block[None, :]) - r)
            assert M.orf_pair_count(r, d) == brute


def _rand_pairs(d=5, n=4, m=3, seed=0, scale=0.5):
    rng = np.random.default_rng(seed)
    return rng.normal(size=(n, d)) * scale, rng.normal(size=(m, d)) * scale


def test_iid_forms_equal_performer_lemma2():
    q, k = _rand_pairs()
    r = 7
    x2 = (q**2).sum(-1)[:, None]
    y2 = (k**2).sum(-1)[None, :]
    t = ((q[:, None] + k[None]) ** 2).sum(-1)
    s = ((q[:, None] - k[None]) ** 2).sum(-1)
    sm = np.exp(q @ k.T)
    pos = np.exp(t) * sm**2 * (1 - np.exp(-t)) / r  # eq. (8)
    np.testing.assert_allclose(M.positive_mse(q, k, r), pos, rtol=1e-12)
    np.testing.assert_allclose(M.hyperbolic_mse(q, k, r), 0.5 * (1 - np.exp(-t)) * pos, rtol=1e-12)
    trig = np.exp(t) * sm ** (-2) * (1 - np.exp(-s)) ** 2 / (2 * r)
    np.testing.assert_allclose(M.trig_sincos_mse(q, k, r), trig, rtol=1e-12)
    off = np.exp(x2 + y2) * (1 + 0.5 * np.exp(-2 * s) - np.exp(-s)) / r
    np.testing.assert_allclose(M.trig_offset_mse(q, k, r), off, rtol=1e-12)
    fm = ka.PositiveRF(5, r, seed=0)
    np.testing.assert_allclose(M.relative_mse(fm, q, k), np.expm1(t) / r, rtol=1e-12)


def test_single_block_orf_equals_estimators_sheet_formula():
    """estimators.md §3d (single block, m <= d) written directly with scipy hyp1f1."""
    from scipy.special import hyp1f1

    q, k = _rand_pairs(d=6)
    m, d = 5, 6
    lam2 = np.exp(-((q**2).sum(-1)[:, None] + (k**2).sum(-1)[None, :]))
    t = ((q[:, None] + k[None]) ** 2).sum(-1)
    s = ((q[:, None] - k[None]) ** 2).sum(-1)
    pos = lam2 / m * (np.exp(2 * t) - np.exp(t)) + (m - 1) / m * lam2 * (hyp1f1(d, d / 2, t / 2) - np.exp(t))
    np.testing.assert_allclose(M.positive_mse(q, k, m, row_law="orthogonal-chi"), pos, rtol=1e-9)
    c2 = 1 / lam2
    trig = c2 / (2 * m) * (1 - np.exp(-s)) ** 2 + (m - 1) / m * c2 * (hyp1f1(d, d / 2, -s / 2) - np.exp(-s))
    np.testing.assert_allclose(M.trig_sincos_mse(q, k, m, row_law="orthogonal-chi"), trig, rtol=1e-9)


def test_performer_theorem2_bound_holds_and_orf_helps():
    q, k = _rand_pairs(d=8, scale=0.4)
    for m in (2, 5, 8):
        exact = M.positive_mse(q, k, m, row_law="orthogonal-chi")
        bound = M.performer_theorem2_bound(q, k, m)
        iid = M.positive_mse(q, k, m)
        assert np.all(exact <= bound * (1 + 1e-12))
        assert np.all(bound <= iid)
    with pytest.raises(ValueError, match="m <= d"):
        M.performer_theorem2_bound(q, k, 9)


def test_smreg_series_and_bias_sign():
    """SMREG = Lambda * sum_k (t/2)^k/k! d^k/(d(d+2)...(d+2k-2)) (Performer eqs. 21-29) <= SM."""
    q, k = _rand_pairs(d=4, scale=0.6)
    d = 4
    t = ((q[:, None] + k[None]) ** 2).sum(-1)
    lam = np.exp(-0.5 * ((q**2).sum(-1)[:, None] + (k**2).sum(-1)[None, :]))
    series = np.zeros_like(t)
    for j in range(60):
        series += (t / 2) ** j / math.factorial(j) * d**j / np.prod([d + 2.0 * i for i in range(j)])
    np.testing.assert_allclose(M.smreg_kernel(q, k), lam * series, rtol=1e-12)
    assert np.all(M.positive_bias(q, k, row_law="orthogonal-fixed") <= 0)
    np.testing.assert_allclose(
        M.positive_bias(q, k, row_law="orthogonal-fixed"), lam * series - np.exp(q @ k.T), rtol=1e-10
    )
    assert np.all(M.positive_bias(q, k, row_law="orthogonal-chi") == 0)


def test_large_arguments_finite_or_true_overflow():
    d = 4
    # positive at q = k, |q| = 10: MSE = Lambda^2 (e^{2t}-e^t)/r with log = -200 + 800 = 600 (finite)
    x = np.zeros((1, d))
    x[0, 0] = 10.0
    for orth in (None, "chi", "fixed"):
        v = M.positive_mse(x, x, 8, row_law=ROW_LAW[orth])[0, 0]
        assert np.isfinite(v) and v > 0
    v = M.positive_mse(x, x, 8)[0, 0]
    assert math.isclose(math.log(v), 600 + math.log(-math.expm1(-400) / 8), rel_tol=1e-12)
    # ... and at |q| = 12 the true value e^{864} overflows
    x[0, 0] = 12.0
    assert np.isinf(M.positive_mse(x, x, 8)[0, 0])
    # positive at q = -k with huge norms: exact, 0 error; trig at q = k with huge norms: 0
    y = np.zeros((1, d))
    y[0, 1] = 30.0
    assert M.positive_mse(y, -y, 8, row_law="orthogonal-chi")[0, 0] == 0.0
    assert M.trig_sincos_mse(y, y, 8, row_law="orthogonal-chi")[0, 0] == 0.0
    # relative MSE of trig at moderate distance with huge norms: finite and norm-independent
    a = np.zeros((1, d))
    a[0, 0] = 15.0
    b = a.copy()
    b[0, 1] = 0.5  # s = 0.25, e^{|a|^2+|b|^2} = e^{450.25}: finite
    mom = M.estimator_moments("trig-sincos", a, b, 8)
    assert np.isfinite(mom.variance[0, 0])
    rel = mom.mse[0, 0] / np.exp(2 * 225.0)
    assert rel == pytest.approx(np.exp(0.25) * (1 - np.exp(-0.25)) ** 2 / 16, rel=1e-9)
    a[0, 0] = 20.0  # e^{800}: the true variance overflows float64
    b[0, 0] = 20.0
    assert np.isinf(M.estimator_moments("trig-sincos", a, b, 8).variance[0, 0])
    # near-cancellation: q ≈ -k to 1e-9 keeps the positive MSE accurate (t from coordinates)
    z = np.array([[0.3, -0.2, 0.5, 0.1]])
    w = -z + 1e-9
    t = 4 * 1e-18
    assert M.positive_mse(z, w, 1)[0, 0] == pytest.approx(np.exp(-2 * 0.39 + 0) * t, rel=1e-6)


def test_shapes_broadcasting_and_torch_roundtrip():
    q = torch.randn(generator=torch.Generator().manual_seed(310), size=(2, 1, 5, 3), dtype=F64) / 2
    k = torch.randn(generator=torch.Generator().manual_seed(311), size=(4, 7, 3), dtype=torch.float32) / 2
    out = M.positive_mse(q, k, 8, row_law="orthogonal-chi")
    assert isinstance(out, torch.Tensor) and out.dtype == F64 and out.shape == (2, 4, 5, 7)
    ref = M.positive_mse(q[1, 0].numpy(), k[2].double().numpy(), 8, row_law="orthogonal-chi")
    np.testing.assert_allclose(out[1, 2].numpy(), ref, rtol=1e-12)
    assert isinstance(M.trig_offset_mse(q.numpy(), k.double().numpy(), 3), np.ndarray)


def test_dispatch_reads_feature_map():
    q = torch.randn(generator=torch.Generator().manual_seed(320), size=(3, 4), dtype=F64) / 2
    k = torch.randn(generator=torch.Generator().manual_seed(321), size=(5, 4), dtype=F64) / 2
    cases = [
        (ka.TrigRF(4, 6, seed=0), "trig-sincos", None),
        (ka.TrigRF(4, 6, variant="offset", sampler="orthogonal", seed=0), "trig-offset", "chi"),
        (ka.PositiveRF(4, 6, sampler=OrthogonalSampler("fixed"), seed=0), "positive", "fixed"),
        (ka.HyperbolicRF(4, 9, sampler="orthogonal", seed=0), "hyperbolic", "chi"),
    ]
    for fm, kind, orth in cases:
        mom = M.estimator_moments(kind, q, k, fm.num_features, row_law=ROW_LAW[orth])
        torch.testing.assert_close(M.mse(fm, q, k), mom.mse)
        torch.testing.assert_close(M.variance(fm, q, k), mom.variance)
        torch.testing.assert_close(M.bias(fm, q, k), mom.bias)
        torch.testing.assert_close(M.relative_mse(fm, q, k), mom.mse / torch.exp(q @ k.T) ** 2)
    for samp in ("structured", "qmc"):
        fm = ka.PositiveRF(4, 8, sampler=samp, seed=0)
        for fn in (M.bias, M.variance, M.mse, M.relative_mse):
            with pytest.raises(NotImplementedError, match="montecarlo.kernel_error"):
                fn(fm, q, k)
    fm = ka.PositiveRF.from_projection(torch.randn(generator=torch.Generator().manual_seed(339), size=(8, 4), dtype=F64))
    with pytest.raises(NotImplementedError, match="no closed form"):
        M.mse(fm, q, k)
    with pytest.raises(TypeError):
        M.mse(object(), q, k)
    with pytest.raises(ValueError, match=r"row_law must be one of .*'orthogonal-chi'.*got 'chi'"):
        M.positive_mse(q, k, 4, row_law="chi")
    with pytest.raises(ValueError, match="orthogonal must be None, 'chi', 'fixed' or 'simplex', got 'haar'"):
        M.positive_mse(q, k, 4, orthogonal="haar")
    with pytest.raises(ValueError, match="num_features"):
        M.positive_mse(q, k, 0)
    with pytest.raises(ValueError, match="unknown estimator"):
        M.estimator_moments("cosine", q, k, 4)


@pytest.mark.parametrize("cls", [ka.EluFeatures, ka.ReluFeatures])
def test_deterministic_error_bias_only(cls):
    q = torch.randn(generator=torch.Generator().manual_seed(354), size=(3, 4), dtype=F64) / 2
    k = torch.randn(generator=torch.Generator().manual_seed(355), size=(5, 4), dtype=F64) / 2
    fm = cls(4)
    err = M.deterministic_error(fm, q, k)
    direct = fm(q) @ fm(k).T - torch.exp(q @ k.T)
    torch.testing.assert_close(err, direct)
    torch.testing.assert_close(fm.kernel(q, k) - torch.exp(q @ k.T), err)
    torch.testing.assert_close(M.bias(fm, q, k), err)
    assert torch.all(M.variance(fm, q, k) == 0)
    torch.testing.assert_close(M.mse(fm, q, k), err**2)
    torch.testing.assert_close(M.relative_mse(fm, q, k), (err / torch.exp(q @ k.T)) ** 2)


@pytest.mark.parametrize("old,new", list(ROW_LAW.items()))
def test_orthogonal_keyword_is_a_deprecated_spelling_of_row_law(old, new):
    """``orthogonal={None, "chi", "fixed", "simplex"}`` still works for one release: it warns
    (DeprecationWarning naming the new spelling) and gives exactly the ``row_law=`` result; both
    spellings at once are an error. The former ``kind=`` / ``fm_or_kind=`` keywords likewise."""
    q = np.array([[0.3, -0.2, 0.1, 0.4]])
    k = np.array([[0.1, 0.2, -0.3, 0.2]])
    want = M.positive_mse(q, k, 6, row_law=new)
    with pytest.warns(DeprecationWarning, match=f"orthogonal= is deprecated.*row_law={new!r}"):
        got = M.positive_mse(q, k, 6, orthogonal=old)
    np.testing.assert_array_equal(got, want)
    with pytest.warns(DeprecationWarning, match="kind= is deprecated"), pytest.warns(DeprecationWarning, match="orthogonal="):
        mom = M.estimator_moments(kind="trig-sincos", q=q, k=k, num_features=6, orthogonal=old)
    np.testing.assert_array_equal(mom.mse, M.trig_sincos_mse(q, k, 6, row_law=new))
    with pytest.raises(TypeError, match="both orthogonal= and row_law="):
        M.positive_mse(q, k, 6, orthogonal=old, row_law=new)
    if old != "simplex":
        with pytest.warns(DeprecationWarning, match="fm_or_kind= is deprecated"), pytest.warns(DeprecationWarning, match="orthogonal="):
            p_old = M.failure_probability(fm_or_kind="positive", eps=0.1, q=q, k=k, num_features=64, orthogonal=old)
        np.testing.assert_array_equal(p_old, M.failure_probability("positive", 0.1, q, k, 64, row_law=new))
