r"""Tests of ``kernelapprox.montecarlo``: metrics, interval estimators and the batched drivers.

Tolerances
----------
* Metrics are checked on hand-computed values (exact up to float rounding).
* Interval coverage: each estimator is run on ``R`` independent data sets at once (a vectorised
  axis) with a known truth. The number of intervals covering the truth is Binomial(R, p) with
  p ~ 0.95; we require the observed coverage within 4 binomial standard errors of 0.95
  (sd = sqrt(0.95*0.05/R)). This detects a wrong t/z quantile or a wrong standard-error formula
  (e.g. a missing sqrt(S) gives coverage near 0 or 1) while a correct one fails with probability
  < 1e-4.
* Driver statistics against the closed-form theory (``ka.theory.mse``, unbiasedness): z-scores
  (MC - theory) / se with the driver's own standard errors, |z| < Z_MAX = 4.5 per entry
  (P(|N(0,1)| > 4.5) = 6.8e-6; ~800 entries checked in this file).
* Power (what a passing check rules out). If the tested quantity is off by a relative ``delta``,
  z ~ N(delta / se_rel, 1) with ``se_rel = se / value``, and the check fails with probability
  >= 1 - beta once ``delta / se_rel >= Z_MAX + z_beta``. With beta = 1e-3 (z_beta = 3.09) the
  check *resolves* ``delta = (Z_MAX + 3.09) se_rel = 7.59 se_rel``; a guard ``se_rel <= delta / Z_MAX``
  (the form used before) gives only 50 % power at ``delta``. Each z-check asserts a power guard
  ``se_rel <= delta / 7.59`` (``RESOLVE``): unbiasedness ``delta = 1 %`` of K (``bias_se <= 0.00132
  K``), MSE and variance formulas ``delta = 4 %`` (``mse_se, variance_se <= 0.0053 * theory``).
  Measured at S = 5e5 (base seeds 0 and 1): bias_se/K <= 0.00043, mse_se/MSE <= 0.0044, so in
  practice a 1 % bias is caught with certainty and a 3 % error in an MSE formula with probability
  >= 0.99 per entry (z shift >= 6.9). Checked by mutation: a
  3 % bias in the features (K^ -> 1.03 K^) and a 3 % error in ``ka.theory.mse`` each make
  ``test_kernel_error_matches_theory`` fail for every parametrisation (see that test).
  Inputs have norm 0.45 (random directions), so ``||q + k||^2 <= 0.81``: the log-normal positive
  features are light-tailed enough there for the CLT on the mean of ``e^2``, whose standard error
  needs the eighth moment of the error.
* Fast path against a plain per-draw loop (``test_*_equals_per_draw_reference``): the batched,
  fused drivers reproduce, to float64 rounding (rtol 1e-10), every statistic computed one draw at a
  time from single-draw maps built on the same projections.

Seeds: every statistical test here draws its data and projections from ``conftest.seed`` (base
``KERNELAPPROX_TEST_SEED``) and carries the ``statistical`` marker.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from conftest import F64, Z_MAX, seed

import kernelapprox as ka
from kernelapprox import montecarlo as mc

#: z-shift needed for a check |z| < Z_MAX to fail with probability >= 1 - 1e-3: Z_MAX + 3.09
RESOLVE = Z_MAX + 3.09
BIAS_GUARD = 0.01 / RESOLVE  # se <= 0.00132 K: a 1 % bias is detected with probability >= 0.999
MSE_GUARD = 0.04 / RESOLVE  # se <= 0.0053 MSE: a 4 % error in a formula, probability >= 0.999


def small_inputs(n=4, m=5, d=4, dv=2, scale=0.25, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(n, d, generator=g, dtype=F64) * scale
    k = torch.randn(m, d, generator=g, dtype=F64) * scale
    v = torch.randn(m, dv, generator=g, dtype=F64)
    return q, k, v


def normed_inputs(n=4, m=5, d=4, norm=0.45, stream=0):
    """Rows of norm ``norm`` in random directions (from ``conftest.seed(stream)``): the geometry
    (``||q + k||^2 <= 4 norm^2``), hence the tails of the errors, does not depend on the seed."""
    g = torch.Generator().manual_seed(seed(stream))
    q = torch.randn(n, d, generator=g, dtype=F64)
    k = torch.randn(m, d, generator=g, dtype=F64)
    return q / q.norm(dim=-1, keepdim=True) * norm, k / k.norm(dim=-1, keepdim=True) * norm


# ------------------------------------------------------------------------------ metrics
def test_metrics_on_hand_computed_values():
    est = torch.tensor([[[1.1, 1.8], [3.0, 4.0]]], dtype=F64)  # (1, 2, 2)
    ex = torch.tensor([[1.0, 2.0], [3.0, 5.0]], dtype=F64)
    torch.testing.assert_close(mc.relative_error(est, ex), torch.tensor([[[0.1, 0.1], [0.0, 0.2]]], dtype=F64))
    torch.testing.assert_close(mc.relative_rms(est, ex), torch.tensor([math.sqrt((0.01 + 0.01 + 0.04) / 4)], dtype=F64))
    fro = math.sqrt(0.01 + 0.04 + 0.0 + 1.0) / math.sqrt(1 + 4 + 9 + 25)
    torch.testing.assert_close(mc.relative_frobenius(est, ex), torch.tensor([fro], dtype=F64))
    torch.testing.assert_close(mc.max_abs_error(est, ex), torch.tensor([1.0], dtype=F64))
    o_hat, o = torch.tensor([[1.0, 2.0], [2.0, 2.0]]), torch.tensor([[1.0, 1.0], [2.0, 2.0]])
    torch.testing.assert_close(mc.attention_relative_error(o_hat, o), torch.tensor(1 / math.sqrt(10)))
    a_hat = torch.tensor([[0.2, 0.3, 0.5], [1.0, 0.0, 0.0]])
    a = torch.tensor([[0.2, 0.5, 0.3], [0.0, 0.0, 1.0]])
    torch.testing.assert_close(mc.total_variation(a_hat, a), torch.tensor([0.2, 1.0]))


def test_metrics_reject_bad_input():
    with pytest.raises(ValueError, match="do not broadcast"):
        mc.relative_rms(torch.ones(2, 3), torch.ones(2, 4))
    with pytest.raises(ValueError, match=r"\(\.\.\., n, m\)"):
        mc.relative_frobenius(torch.ones(3), torch.ones(3))
    with pytest.raises(TypeError, match="floating"):
        mc.max_abs_error(torch.ones(2, 2, dtype=torch.int64), torch.ones(2, 2))


# ---------------------------------------------------------------------------- estimators
def _coverage_ok(covered: np.ndarray) -> bool:
    R = covered.size
    return abs(covered.mean() - 0.95) <= 4 * math.sqrt(0.95 * 0.05 / R)


@pytest.mark.statistical
def test_mean_ci_coverage():
    rng = np.random.default_rng(seed(500))
    x = rng.exponential(size=(200, 4000)) + 1.0  # S = 200 draws, R = 4000 data sets, mean 2
    mean, se, lo, hi = mc.mean_ci(x, axis=0)
    assert mean.shape == (4000,)
    np.testing.assert_allclose(se, x.std(axis=0, ddof=1) / math.sqrt(200))
    assert _coverage_ok((lo < 2.0) & (2.0 < hi))


@pytest.mark.statistical
def test_variance_ci_coverage():
    rng = np.random.default_rng(seed(501))
    x = rng.normal(scale=2.0, size=(2000, 2000))  # variance 4; m4 - m2^2 = 2 sigma^4
    var, se, lo, hi = mc.variance_ci(torch.from_numpy(x), axis=0)
    np.testing.assert_allclose(np.median(se), math.sqrt(2 * 16 / 2000), rtol=0.05)
    assert _coverage_ok((lo < 4.0) & (4.0 < hi))


@pytest.mark.statistical
def test_quantile_ci_covers_and_has_the_right_shape():
    """Exact order-statistic intervals: coverage >= 95% for any continuous law.

    Coverage is measured on 2000 independent samples of S = 200 exponential draws, for p = 0.5 and
    0.9. The interval is conservative (coverage in [0.95, ~0.97] by the discreteness of the
    binomial); the binomial standard error of a coverage estimate near 0.95 over 2000 trials is
    sqrt(.95 * .05 / 2000) = 0.0049, so a coverage below 0.95 - 4.5 * 0.0049 = 0.928 would be a
    real defect (a bootstrap interval at S = 200 covers ~0.93 for p = 0.9).
    """
    rng = np.random.default_rng(seed(502))
    probs = np.array([0.5, 0.9])
    truth = -np.log(1 - probs)
    hits = np.zeros(2)
    trials = 2000
    for _ in range(trials):
        _, lo, hi = mc.quantile_ci(rng.exponential(size=200), probs)
        hits += (lo <= truth) & (truth <= hi)
    cover = hits / trials
    assert np.all(cover >= 0.95 - 4.5 * math.sqrt(0.95 * 0.05 / trials)), cover
    x = rng.exponential(size=5000)
    qs, lo, hi = mc.quantile_ci(x, [0.5, 0.9])
    assert qs.shape == lo.shape == hi.shape == (2,)
    # the endpoints are order statistics x_(l), x_(u) with binomial ranks: check one by hand
    # (smallest interval symmetric in tail probability with P(l <= B < u) >= 0.95, B ~ Bin(S, p)).
    xs = np.sort(x)
    assert lo[0] in xs and hi[0] in xs
    from scipy import stats

    l_rank, u_rank = np.searchsorted(xs, lo[0]) + 1, np.searchsorted(xs, hi[0]) + 1
    cov = stats.binom.cdf(u_rank - 1, 5000, 0.5) - stats.binom.cdf(l_rank - 1, 5000, 0.5)
    assert cov >= 0.95
    # The width matches the asymptotic 2 * 1.96 sd of a sample quantile, sd = sqrt(p(1-p)) /
    # (f(x_p) sqrt(S)). The width x_(u) - x_(l) is a sum of k = u - l ~ 2 * 1.96 sqrt(S p (1-p))
    # nearly exponential spacings, so its own relative sd is ~ 1/sqrt(k) (8.5% at p = 0.5, 11% at
    # p = 0.9); allowed: 4.5 of those plus the rank rounding 2/k. A scale check: it catches a
    # missing sqrt(S) or a wrong quantile level, not a few percent.
    k = 2 * 1.96 * np.sqrt(5000 * probs * (1 - probs))
    sd = np.sqrt(probs * (1 - probs)) / (np.exp(-truth) * math.sqrt(5000))
    ratio = (hi - lo) / (2 * 1.96 * sd)
    assert np.all(np.abs(ratio - 1.0) < 4.5 / np.sqrt(k) + 2 / k), ratio
    med, a, b = mc.quantile_ci(x, 0.5)
    assert np.ndim(med) == 0 and a <= med <= b
    with pytest.raises(ValueError, match="probabilities"):
        mc.quantile_ci(x, 1.5)
    with pytest.raises(ValueError, match="1-D"):
        mc.quantile_ci(x.reshape(50, 100), 0.5)
    with pytest.raises(ValueError, match="confidence"):
        mc.mean_ci(x, confidence=1.0)


# ------------------------------------------------------------------------------- drivers
def test_batched_draws_shapes_seeds_and_independence():
    fm = ka.TrigRF(4, 8, variant="offset", seed=0)
    copies = [(c.batch_shape, c.weight.clone(), c.offsets.clone()) for c in
              mc.batched_draws(fm, 7, seed=3, chunk_size=3, extra_dims=2)]
    assert [s for s, _, _ in copies] == [(3, 1, 1), (3, 1, 1), (1, 1, 1)]
    assert all(w.dtype == F64 and w.shape[-2:] == (8, 4) for _, w, _ in copies)
    assert not torch.equal(copies[0][1], copies[1][1])  # a fresh draw per chunk
    again = [c.weight.clone() for c in mc.batched_draws(fm, 7, seed=3, chunk_size=3, extra_dims=2)]
    assert all(torch.equal(a, w) for a, (_, w, _) in zip(again, copies, strict=True))
    first = next(iter(mc.batched_draws(fm, 7, seed=4, chunk_size=3)))
    assert not torch.equal(first.weight, copies[0][1].squeeze(-3).squeeze(-3))
    assert next(iter(mc.batched_draws(fm, 2, chunk_size=2))).variant == "offset"
    with pytest.raises(ValueError, match="random feature map"):
        next(iter(mc.batched_draws(ka.EluFeatures(4), 2, chunk_size=2)))


_MAPS = {"positive": (ka.PositiveRF, {}), "hyperbolic": (ka.HyperbolicRF, {}),
         "sincos": (ka.TrigRF, {}), "offset": (ka.TrigRF, {"variant": "offset"})}


@pytest.mark.statistical
@pytest.mark.parametrize("sampler", ["gaussian", "orthogonal"])
@pytest.mark.parametrize("family", list(_MAPS))
def test_kernel_error_matches_theory(family, sampler):
    """The driver's statistics and standard errors, and the theory they estimate.

    S = 5e5 draws, r = 16, d = 4 (orthogonal: 4 Haar blocks with chi norms, unbiased), a 4 x 5
    kernel with ||q + k||^2 <= 0.81. Measured se_rel (base seeds 0 and 1): bias_se/K <= 0.00043
    (guard 0.00132), mse_se/MSE and variance_se/Var <= 0.0044 (hyperbolic orthogonal, whose e^2 is
    the most heavy-tailed here; <= 0.0032 positive, <= 0.0023 trigonometric; guard 0.0053). So this
    test resolves (fails with probability >= 0.999 on) a 1 % bias and a 4 % error in the MSE or
    variance formula, and catches a 3 % one with probability >= 0.99 per entry.

    Mutation check (run by hand, then reverted; a pytest plugin patching the library at import):
    multiplying every kernel estimate by 1.03 fails the bias z-check for all 8 parametrisations
    (max |z| 112-2777); multiplying ``ka.theory.mse`` and ``ka.theory.variance`` by 1.03 fails the
    MSE z-check for all 8 (max |z| 12.5-17.5)."""
    cls, kw = _MAPS[family]
    fm = cls(4, 16, sampler=sampler, **kw)
    q, k = normed_inputs(stream=510)
    S = 500_000
    draw_seed = seed(511)
    res = mc.kernel_error(fm, q, k, draws=S, seed=draw_seed, chunk_size=50_000, quantiles=(0.5, 0.9))
    assert res["draws"] == S and res["mse"].shape == (4, 5)
    exact = torch.exp(q @ k.T).numpy()
    np.testing.assert_allclose(res["exact"], exact, rtol=1e-12)
    if sampler == "gaussian":
        # independent recomputation of the per-draw estimates (same seed and chunks => same
        # draws): bias_se must be the plain standard error of the mean, std(ddof=1)/sqrt(S)
        Kh = torch.cat([c.kernel(q, k) for c in mc.batched_draws(fm, S, seed=draw_seed,
                                                                  chunk_size=50_000)]).numpy()
        assert Kh.shape == (S, 4, 5)
        np.testing.assert_allclose(res["bias"], Kh.mean(0) - exact, rtol=1e-8, atol=1e-12)
        np.testing.assert_allclose(res["bias_se"], Kh.std(0, ddof=1) / math.sqrt(S), rtol=1e-8)
        fro2_direct = ((Kh - exact) ** 2).sum((1, 2)) / (exact**2).sum()
        np.testing.assert_allclose(res["per_draw"]["relative_frobenius"] ** 2, fro2_direct, rtol=1e-8)
        del Kh
    # unbiasedness: the guard makes a 1 % bias fail with probability >= 0.999 (module docstring)
    assert (res["bias_se"] <= BIAS_GUARD * exact).all(), (res["bias_se"] / exact).max()
    z_bias = res["bias"] / res["bias_se"]
    assert np.abs(z_bias).max() < Z_MAX, np.abs(z_bias).max()
    # MSE and variance against the closed forms: a 4 % error fails with probability >= 0.999
    th = ka.theory.mse(fm, q, k).numpy()
    assert (res["mse_se"] <= MSE_GUARD * th).all(), (res["mse_se"] / th).max()
    z_mse = (res["mse"] - th) / res["mse_se"]
    assert np.abs(z_mse).max() < Z_MAX, np.abs(z_mse).max()
    # bias is ~0, so the variance estimates the MSE as well
    th_var = ka.theory.variance(fm, q, k).numpy()
    np.testing.assert_allclose(th_var, th, rtol=1e-12)
    assert (res["variance_se"] <= MSE_GUARD * th_var).all(), (res["variance_se"] / th_var).max()
    assert np.abs((res["variance"] - th_var) / res["variance_se"]).max() < Z_MAX
    lo, hi = res["mse_ci"]
    assert (lo < res["mse"]).all() and (res["mse"] < hi).all()
    np.testing.assert_allclose(res["relative_mse"], res["mse"] / res["exact"] ** 2)
    summ = res["summary"]
    assert list(summ.index) == ["relative_frobenius", "relative_rms", "max_abs_error", "max_relative_error"]
    assert (summ["q0.5_low"] <= summ["q0.5"]).all() and (summ["q0.9"] <= summ["q0.9_high"]).all()
    assert (summ["nonfinite"] == 0).all()
    # the per-draw relative Frobenius error: E[||Kh-K||_F^2] = sum MSE, so its mean square matches.
    # z-check: mean of the S iid values fro^2 against sum MSE / ||K||_F^2, se = std(fro^2)/sqrt(S)
    # (CLT on S = 5e5 iid draws), |z| < Z_MAX; power guard: se <= 0.0053 * target, so a 4 % error
    # in the theory fails with probability >= 0.999 (measured se/target <= 0.0024: a sum over
    # 20 entries).
    fro2 = res["per_draw"]["relative_frobenius"] ** 2
    assert fro2.shape == (S,)
    target = th.sum() / (res["exact"] ** 2).sum()
    fro2_se = fro2.std(ddof=1) / math.sqrt(S)
    assert fro2_se <= MSE_GUARD * target, fro2_se / target
    assert abs(fro2.mean() - target) / fro2_se < Z_MAX


@pytest.mark.statistical
def test_kernel_error_half_million_draws_default_chunks():
    """S = 5e5 through the default (max_bytes-sized) chunking path, with the same 4 % power guard
    (measured mse_se/MSE <= 0.0034, base seeds 0 and 1)."""
    q, k = normed_inputs(n=4, m=4, stream=520)
    fm = ka.PositiveRF(4, 16)
    res = mc.kernel_error(fm, q, k, draws=500_000, seed=seed(521), quantiles=(0.5,),
                          max_bytes=16 * 2**20)
    assert res["per_draw"]["relative_rms"].shape == (500_000,)
    th = ka.theory.mse(fm, q, k).numpy()
    assert (res["mse_se"] <= MSE_GUARD * th).all(), (res["mse_se"] / th).max()
    assert np.abs((res["mse"] - th) / res["mse_se"]).max() < Z_MAX


def test_kernel_error_batch_dims_frame_and_seed():
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 3, 4, generator=g, dtype=F64) * 0.3
    k = torch.randn(1, 5, 4, generator=g, dtype=F64) * 0.3
    fm = ka.TrigRF(4, 8)
    a = mc.kernel_error(fm, q, k, draws=500, seed=5, chunk_size=64, quantiles=(0.5,))
    b = mc.kernel_error(fm, q, k, draws=500, seed=5, chunk_size=64, quantiles=(0.5,))
    c = mc.kernel_error(fm, q, k, draws=500, seed=6, chunk_size=64, quantiles=(0.5,))
    assert a["mse"].shape == (2, 3, 5)
    np.testing.assert_array_equal(a["mse"], b["mse"])
    assert not np.array_equal(a["mse"], c["mse"])
    df = mc.kernel_error(fm, q, k, draws=500, seed=5, chunk_size=64, as_frame=True)
    assert list(df.index.names) == ["b0", "i", "j"] and len(df) == 30
    np.testing.assert_allclose(df["mse"].to_numpy(), a["mse"].ravel())
    assert {"exact", "mean_low", "mean_high", "bias_se", "mse_high"} <= set(df.columns)


def test_kernel_error_deterministic_map():
    q, k, _ = small_inputs()
    fm = ka.EluFeatures(4)
    res = mc.kernel_error(fm, q, k, draws=10)
    K_hat = (fm(q) @ fm(k).T).numpy()
    np.testing.assert_allclose(res["bias"], K_hat - res["exact"], rtol=1e-10, atol=1e-12)
    assert res["draws"] == 1 and (res["variance"] == 0).all()
    np.testing.assert_allclose(res["mse"], res["bias"] ** 2, rtol=1e-10, atol=1e-14)


@pytest.mark.parametrize("causal", [False, True])
def test_attention_error_deterministic_equals_linear_attention(causal):
    q, k, v = small_inputs(n=5, m=5)
    fm = ka.EluFeatures(4)
    res = mc.attention_error(fm, q, k, v, draws=4, causal=causal)
    lin = ka.linear_attention(q, k, v, fm, causal=causal).numpy()
    ex = ka.softmax_attention(q, k, v, causal=causal).numpy()
    np.testing.assert_allclose(res["exact"], ex, rtol=1e-12)
    np.testing.assert_allclose(res["mean"], lin, rtol=1e-10, atol=1e-12)
    err = np.linalg.norm(lin - ex) / np.linalg.norm(ex)
    np.testing.assert_allclose(res["per_draw"]["attention_relative_error"], [err], rtol=1e-10)


@pytest.mark.statistical
def test_attention_error_statistics():
    q, k, v = small_inputs(n=6, m=6, d=4, dv=3, seed=seed(530))
    fm = ka.PositiveRF(4, 32)
    res = mc.attention_error(fm, q, k, v, draws=20_000, causal=True, seed=seed(531),
                             quantiles=(0.5, 0.99))
    assert res["variance"].shape == (6, 3)
    np.testing.assert_allclose(res["variance"][0], 0.0, atol=1e-25)  # o_0 = v_0 exactly
    # The output o_hat = N_hat / D_hat is a ratio: biased at O(1/r), so a z-test of bias = 0 would
    # (rightly) fail at large S. Exact bound instead: N_hat and D_hat are unbiased and D_hat > 0
    # (positive features), so o_hat - o = (N_hat - o D_hat) / D_hat has E[N_hat - o D_hat] = 0 and
    #   bias = E[o_hat - o] = -E[(o_hat - o)(D_hat / D - 1)],
    # hence (Cauchy-Schwarz) |bias| <= sqrt(Var o_hat + bias^2) cv, cv^2 = Var(D_hat)/D^2, i.e.
    #   |bias| <= sqrt(Var o_hat) cv / sqrt(1 - cv^2).
    # MC bias and variance carry sampling error: allow 4.5 bias_se on top (per entry; ~15 entries),
    # and use the variance's upper 4.5-se value.
    cv2 = ka.theory.normaliser_relative_variance(fm, q, k, causal=True)
    cv2 = np.asarray(cv2, dtype=np.float64)[1:, None]
    assert (cv2 > 0).all() and (cv2 < 0.25).all()
    var_hi = res["variance"][1:] + Z_MAX * res["variance_se"][1:]
    bound = np.sqrt(var_hi * cv2 / (1 - cv2))
    assert (res["bias_se"][1:] < 0.5 * bound).all()  # the MC resolves the bound (power guard)
    assert (np.abs(res["bias"][1:]) <= bound + Z_MAX * res["bias_se"][1:]).all()
    summ = res["summary"]
    assert list(summ.index) == ["attention_relative_error", "mean_total_variation", "max_total_variation"]
    tv = res["per_draw"]["max_total_variation"]
    assert tv.shape == (20_000,) and (tv >= 0).all() and (tv <= 1).all()  # positive weights: TV <= 1
    assert summ.loc["max_total_variation", "q0.99"] > summ.loc["mean_total_variation", "q0.5"]


def _single_draw_maps(fm, draws, seed_, chunk_size):
    """The draws of ``batched_draws`` as a list of one-projection maps (``from_projection``)."""
    maps = []
    for copy in mc.batched_draws(fm, draws, seed=seed_, chunk_size=chunk_size):
        W = copy.weight.reshape(-1, fm.num_features, fm.dim)
        b = copy.offsets.reshape(W.shape[0], -1) if getattr(copy, "variant", None) == "offset" else None
        for j in range(W.shape[0]):
            kw = {"offsets": b[j]} if b is not None else {}
            if isinstance(fm, ka.TrigRF):
                kw["variant"] = fm.variant
            maps.append(type(fm).from_projection(W[j], sampler=fm.sampler, **kw))
    return maps


def _reference_moments(x: np.ndarray, exact: np.ndarray) -> dict:
    """Per-entry statistics of draws ``x`` (S, ...) by the textbook formulas (numpy, two-pass)."""
    S = x.shape[0]
    e = x - exact
    c = e - e.mean(0)
    m2, m4 = (c**2).mean(0), (c**4).mean(0)
    return {"bias": e.mean(0), "bias_se": e.std(0, ddof=1) / math.sqrt(S), "variance": e.var(0, ddof=1),
            "variance_se": np.sqrt((m4 - m2**2) / S), "mse": (e**2).mean(0),
            "mse_se": (e**2).std(0, ddof=1) / math.sqrt(S), "mean": x.mean(0)}


@pytest.mark.parametrize("family", list(_MAPS))
def test_kernel_error_equals_per_draw_reference(family):
    """The fused batched path of `kernel_error` against a plain loop over single draws.

    Same seed and chunks => the same projections; each draw's K^ is computed by a one-projection
    map (``from_projection``) and its ``kernel``, the metrics by the public metric functions one
    draw at a time, the statistics by numpy's two-pass formulas. Agreement to float64 rounding
    (rtol 1e-10; the fused path sums in another order). Fails on any change of the estimator, a
    wrong power sum, a mis-assigned per-draw metric or a chunk boundary error (S = 37, chunks of
    10 and a last one of 7)."""
    cls, kw = _MAPS[family]
    fm = cls(4, 8, **kw)
    q, k, _ = small_inputs(n=3, m=4, scale=0.4)
    S, chunk = 37, 10
    res = mc.kernel_error(fm, q, k, draws=S, seed=7, chunk_size=chunk, quantiles=(0.5, 0.9))
    exact = torch.exp(q @ k.T)
    ests = [m.kernel(q, k) for m in _single_draw_maps(fm, S, 7, chunk)]
    x = torch.stack(ests).numpy()
    ref = _reference_moments(x, exact.numpy())
    for key, val in ref.items():
        np.testing.assert_allclose(res[key], val, rtol=1e-10, atol=1e-14, err_msg=key)
    per = {name: np.array([float(f(e, exact)) for e in ests]) for name, f in (
        ("relative_frobenius", mc.relative_frobenius), ("relative_rms", mc.relative_rms),
        ("max_abs_error", mc.max_abs_error),
        ("max_relative_error", lambda e, ex: mc.relative_error(e, ex).max()))}
    for name, val in per.items():
        np.testing.assert_allclose(res["per_draw"][name], val, rtol=1e-10, err_msg=name)
        np.testing.assert_allclose(res["summary"].loc[name, "mean"], val.mean(), rtol=1e-10)
        np.testing.assert_allclose(res["summary"].loc[name, "q0.9"], np.quantile(val, 0.9), rtol=1e-10)


@pytest.mark.parametrize("causal", [False, True])
def test_attention_error_equals_per_draw_reference(causal):
    """The fused batched path of `attention_error` against a loop over single draws, each through
    ``ka.linear_attention`` (the attention the driver claims to measure) and the public metrics."""
    fm = ka.PositiveRF(4, 8)
    q, k, v = small_inputs(n=5, m=5, dv=3, scale=0.4)
    S, chunk = 23, 8
    res = mc.attention_error(fm, q, k, v, draws=S, causal=causal, seed=3, chunk_size=chunk)
    exact = ka.softmax_attention(q, k, v, causal=causal)
    w = torch.softmax((q @ k.T).masked_fill(torch.ones(5, 5, dtype=torch.bool).triu(1), -math.inf)
                      if causal else q @ k.T, dim=-1)
    outs, tvs = [], []
    for m in _single_draw_maps(fm, S, 3, chunk):
        outs.append(ka.linear_attention(q, k, v, m, causal=causal))
        Kh = m.kernel(q, k)
        if causal:
            Kh = Kh.tril()
        tvs.append(mc.total_variation(Kh / Kh.sum(-1, keepdim=True), w))
    x = torch.stack(outs).numpy()
    ref = _reference_moments(x, exact.numpy())
    for key, val in ref.items():
        np.testing.assert_allclose(res[key], val, rtol=1e-9, atol=1e-14, err_msg=key)
    err = np.array([float(mc.attention_relative_error(o, exact)) for o in outs])
    np.testing.assert_allclose(res["per_draw"]["attention_relative_error"], err, rtol=1e-9)
    tv = torch.stack(tvs).numpy()
    np.testing.assert_allclose(res["per_draw"]["mean_total_variation"], tv.mean(-1), rtol=1e-9)
    np.testing.assert_allclose(res["per_draw"]["max_total_variation"], tv.max(-1), rtol=1e-9)


def test_streaming_moments_equal_numpy():
    """`StreamingMoments` (GEMV power sums, chunks of unequal size) against numpy on all draws."""
    x = np.random.default_rng(0).gamma(2.0, size=(1000, 3, 2)) + 5.0
    acc = mc.StreamingMoments()
    for part in np.split(x, [100, 350, 999]):
        acc.update(part)
    mean, se, _, _ = acc.mean_ci()
    var, var_se, _, _ = acc.variance_ci()
    m, s_, _, _ = mc.mean_ci(x)
    v_, vs, _, _ = mc.variance_ci(x)
    for a, b in ((mean, m), (se, s_), (var, v_), (var_se, vs)):
        np.testing.assert_allclose(a, b, rtol=1e-10)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_attention_error_runs_in_float32(dtype):
    """dtype=float32 features (the fast path): statistics stay float64 and agree with the float64
    run to the float32 rounding of the features (before this fix ``a @ v`` mixed dtypes and raised)."""
    fm = ka.PositiveRF(4, 8)
    q, k, v = small_inputs(n=5, m=5, dv=3, scale=0.4)
    a = mc.attention_error(fm, q, k, v, draws=50, seed=1, chunk_size=16, dtype=dtype)
    b = mc.attention_error(fm, q, k, v, draws=50, seed=1, chunk_size=16)
    assert a["mean"].dtype == np.float64
    np.testing.assert_allclose(a["mean"], b["mean"], rtol=1e-5)


def test_estimate_path_equals_kernel():
    q, k, _ = small_inputs(n=3, m=4)
    for fm in (ka.PositiveRF(4, 8), ka.TrigRF(4, 8, variant="offset"), ka.HyperbolicRF(4, 8)):
        copy = next(iter(mc.batched_draws(fm, 6, chunk_size=6)))
        torch.testing.assert_close(mc._estimate(copy, q, k), copy.kernel(q, k), rtol=1e-12, atol=1e-14)


def test_driver_bad_inputs():
    q, k, v = small_inputs()
    fm = ka.PositiveRF(4, 8)
    with pytest.raises(ValueError, match="draws must be >= 2"):
        mc.kernel_error(fm, q, k, draws=1)
    with pytest.raises(TypeError, match="draws"):
        mc.kernel_error(fm, q, k, draws=10.0)
    with pytest.raises(ValueError, match=r"\(\.\.\., n, 4\)"):
        mc.kernel_error(fm, q[:, :3], k)
    with pytest.raises(ValueError, match="seed"):
        mc.kernel_error(fm, q, k, draws=10, seed=-1)
    with pytest.raises(ValueError, match="quantiles"):
        mc.kernel_error(fm, q, k, draws=10, quantiles=(2.0,))
    with pytest.raises(ValueError, match="causal"):
        mc.attention_error(fm, q, k, v, draws=10, causal=True)  # n != m
    with pytest.raises(ValueError, match="sequence length"):
        mc.attention_error(fm, q, k, v[:3], draws=10)
    given = ka.PositiveRF.from_projection(torch.randn(8, 4, dtype=F64))
    with pytest.raises(ValueError, match="given projection"):
        mc.kernel_error(given, q, k, draws=10)
