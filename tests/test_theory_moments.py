r"""Closed-form bias / variance / MSE of ``kernelapprox.theory.moments`` against Monte Carlo.

How the Monte Carlo tolerance is derived
----------------------------------------
For one (q, k) pair, let :math:`e_s = \hat K_s - K` be the error of draw ``s = 1..S`` (one draw =
one element of ``batch_shape=(S,)``, i.e. an independent projection, and offsets for the offset
variant). The Monte Carlo MSE is the sample mean of :math:`Y_s = e_s^2`, with

.. math::

    E\bar Y = \mathrm{MSE},\qquad
    \mathrm{sd}(\bar Y) = \sqrt{\frac{\mathrm{Var}(e^2)}{S}}
    = \sqrt{\frac{E e^4 - \mathrm{MSE}^2}{S}},

so its standard error needs the *fourth* moment of the error; we estimate it by
``se = std(Y, ddof=1) / sqrt(S)``. By the CLT, :math:`z = (\bar Y - \mathrm{MSE}_{\rm formula})/se`
is approximately N(0, 1) when the formula is right, and we require :math:`|z| \le 5`
(P(|N(0,1)| > 5) = 5.7e-7; with < 200 such checks the family-wise false-alarm rate is < 1.2e-4).
The se estimate is itself trustworthy only when :math:`E e^8` is not too large compared with
:math:`(E e^4)^2 S`: for the log-normal positive/hyperbolic terms this limits :math:`t=\|q+k\|^2`.
The "large :math:`\|q+k\|`" configuration has :math:`t \approx 1.7` with ``r = 6``: the relative
sd of :math:`\bar Y` is then ~5% with ``S = 1e5``; larger ``t`` would need many more draws, so
large *norms* are tested where each estimator is accurate (q ≈ -k for positive, q ≈ k for trig)
instead of loosening anything. Each check also asserts that ``se`` is below 10% of the MSE, so a
check cannot pass vacuously. The bias of fixed-norm ORF is checked the same way with the mean of
:math:`e_s` and ``se = std(e)/sqrt(S)``.

Measured agreement (printed with ``-s``): ratios MC/formula within 0.95–1.06 and |z| < 3.
"""

from __future__ import annotations

import math

import mpmath
import numpy as np
import pytest
import torch

import kernelapprox as ka
from kernelapprox.samplers import OrthogonalSampler
from kernelapprox.theory import moments as M

F64 = torch.float64
Z_TOL = 5.0
S_DRAWS = 100_000
CHUNK = 25_000

KIND_CLS = {
    "trig-sincos": (ka.TrigRF, {"variant": "sincos"}),
    "trig-offset": (ka.TrigRF, {"variant": "offset"}),
    "positive": (ka.PositiveRF, {}),
    "hyperbolic": (ka.HyperbolicRF, {}),
}


def _sampler(orth):
    return "gaussian" if orth is None else OrthogonalSampler(norms=orth)


def _configs(d: int, seed: int = 1) -> tuple[np.ndarray, np.ndarray]:
    """Five (q_i, k_i) pairs: q ≈ k, q ≈ -k, generic, |q+k| large (t ≈ 1.7), small norms."""
    rng = np.random.default_rng(seed)
    u = rng.normal(size=(5, d))
    u /= np.linalg.norm(u, axis=1, keepdims=True)
    q = np.empty((5, d))
    k = np.empty((5, d))
    q[0] = 0.6 * u[0]
    k[0] = q[0] + 0.05 * rng.normal(size=d)  # q ≈ k
    q[1] = 0.7 * u[1]
    k[1] = -q[1] + 0.05 * rng.normal(size=d)  # q ≈ -k
    q[2] = 0.5 * u[2]
    k[2] = 0.4 * rng.normal(size=d) / math.sqrt(d) * 2  # generic
    q[3] = 0.65 * u[3]
    k[3] = 0.65 * u[3] + 0.1 * rng.normal(size=d) / math.sqrt(d)  # |q + k|^2 ≈ 1.7
    q[4] = 0.2 * u[4]
    k[4] = 0.3 * rng.normal(size=d) / math.sqrt(d)
    return q, k


def _mc_errors(kind: str, orth, d: int, r: int, q: np.ndarray, k: np.ndarray, seed: int) -> np.ndarray:
    """(S, n) errors K^ - K of the library's fm.kernel for the pairs (q_i, k_i), S independent draws."""
    cls, kw = KIND_CLS[kind]
    qt = torch.tensor(q, dtype=F64)[:, None, :]  # (n, 1, d): pair i in its own batch slot
    kt = torch.tensor(k, dtype=F64)[:, None, :]
    exact = np.exp(np.sum(q * k, axis=1))
    out = []
    for c in range(S_DRAWS // CHUNK):
        fm = cls(d, r, sampler=_sampler(orth), batch_shape=(CHUNK, 1), seed=1000 * seed + c, dtype=F64, **kw)
        out.append(fm.kernel(qt, kt)[..., 0, 0].numpy())  # (CHUNK, n)
    return np.concatenate(out) - exact


def _check_mc(kind, orth, d, r, seed):
    q, k = _configs(d, seed)
    err = _mc_errors(kind, orth, d, r, q, k, seed)
    mom = M.estimator_moments(kind, q, k, r, orthogonal=orth)
    f_mse = np.diagonal(mom.mse)
    f_bias = np.diagonal(mom.bias)
    Y = err**2
    mc = Y.mean(0)
    se = Y.std(0, ddof=1) / math.sqrt(len(Y))
    z = (mc - f_mse) / se
    print(f"\n{kind:12s} orth={orth!s:5s} d={d} r={r} ratio={np.round(mc / f_mse, 3)} z={np.round(z, 2)}")
    assert np.all(se < 0.1 * f_mse), (se, f_mse)
    assert np.all(np.abs(z) <= Z_TOL), (kind, orth, z)
    eb = err.mean(0)
    seb = err.std(0, ddof=1) / math.sqrt(len(err))
    zb = (eb - f_bias) / seb
    assert np.all(np.abs(zb) <= Z_TOL), (kind, orth, zb)
    if orth == "fixed" and kind in ("positive", "hyperbolic"):
        # the bias is resolved (not just consistent with 0) where |q + k| is large
        assert abs(f_bias[3]) > 10 * seb[3]


# one (d, r) per formula in the default suite: d=4, r=6 = one full block + a partial block of 2
@pytest.mark.parametrize("orth", [None, "chi", "fixed"])
@pytest.mark.parametrize("kind", list(KIND_CLS))
def test_mse_matches_monte_carlo(kind, orth):
    _check_mc(kind, orth, d=4, r=6, seed=3)


# several blocks with d not dividing r (two full blocks of 3 + one row), odd d (no Laguerre form)
@pytest.mark.parametrize("kind", ["trig-sincos", "positive"])
def test_orf_several_blocks_odd_dim(kind):
    _check_mc(kind, "chi", d=3, r=7, seed=5)


@pytest.mark.slow
@pytest.mark.parametrize("orth", [None, "chi", "fixed"])
@pytest.mark.parametrize("kind", list(KIND_CLS))
@pytest.mark.parametrize("d,r", [(3, 7), (5, 3)])
def test_mse_matches_monte_carlo_more_shapes(kind, orth, d, r):
    _check_mc(kind, orth, d=d, r=r, seed=7)


# ------------------------------------------------------------------------------------------------
# special functions against mpmath
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("d", [1, 2, 3, 7, 64, 257])
def test_pair_excess_matches_mpmath(d):
    """1F1(d; d/2; z) - e^{2z}: series/scipy vs 40-digit mpmath (Kummer form for z < 0)."""
    zs = np.array([-400.0, -30.0, -3.0, -0.9, -0.05, -1e-4, 1e-4, 0.05, 0.9, 3.0, 20.0, 35.0])
    got = M._pair_excess(d, zs)
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
    got = M._hyp0f1_neg(b, xs)
    with mpmath.workdps(40):
        for x, g in zip(xs, got, strict=True):
            ref = float(mpmath.hyp0f1(b, x, maxprec=20000, zeroprec=2000))
            assert abs(g - ref) <= 1e-9 * abs(ref) + 1e-14, (d, x, g, ref)
        xp = np.array([1e-3, 1.0, 100.0, 1e4, 1e6])
        lg = M._log_hyp0f1_pos(b, xp)
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
    np.testing.assert_allclose(M.positive_mse(q, k, m, orthogonal="chi"), pos, rtol=1e-9)
    c2 = 1 / lam2
    trig = c2 / (2 * m) * (1 - np.exp(-s)) ** 2 + (m - 1) / m * c2 * (hyp1f1(d, d / 2, -s / 2) - np.exp(-s))
    np.testing.assert_allclose(M.trig_sincos_mse(q, k, m, orthogonal="chi"), trig, rtol=1e-9)


def test_performer_theorem2_bound_holds_and_orf_helps():
    q, k = _rand_pairs(d=8, scale=0.4)
    for m in (2, 5, 8):
        exact = M.positive_mse(q, k, m, orthogonal="chi")
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
    assert np.all(M.positive_bias(q, k, orthogonal="fixed") <= 0)
    np.testing.assert_allclose(
        M.positive_bias(q, k, orthogonal="fixed"), lam * series - np.exp(q @ k.T), rtol=1e-10
    )
    assert np.all(M.positive_bias(q, k, orthogonal="chi") == 0)


def test_large_arguments_finite_or_true_overflow():
    d = 4
    # positive at q = k, |q| = 10: MSE = Lambda^2 (e^{2t}-e^t)/r with log = -200 + 800 = 600 (finite)
    x = np.zeros((1, d))
    x[0, 0] = 10.0
    for orth in (None, "chi", "fixed"):
        v = M.positive_mse(x, x, 8, orthogonal=orth)[0, 0]
        assert np.isfinite(v) and v > 0
    v = M.positive_mse(x, x, 8)[0, 0]
    assert math.isclose(math.log(v), 600 + math.log(-math.expm1(-400) / 8), rel_tol=1e-12)
    # ... and at |q| = 12 the true value e^{864} overflows
    x[0, 0] = 12.0
    assert np.isinf(M.positive_mse(x, x, 8)[0, 0])
    # positive at q = -k with huge norms: exact, 0 error; trig at q = k with huge norms: 0
    y = np.zeros((1, d))
    y[0, 1] = 30.0
    assert M.positive_mse(y, -y, 8, orthogonal="chi")[0, 0] == 0.0
    assert M.trig_sincos_mse(y, y, 8, orthogonal="chi")[0, 0] == 0.0
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
    out = M.positive_mse(q, k, 8, orthogonal="chi")
    assert isinstance(out, torch.Tensor) and out.dtype == F64 and out.shape == (2, 4, 5, 7)
    ref = M.positive_mse(q[1, 0].numpy(), k[2].double().numpy(), 8, orthogonal="chi")
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
        mom = M.estimator_moments(kind, q, k, fm.num_features, orthogonal=orth)
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
    with pytest.raises(ValueError, match="orthogonal"):
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
