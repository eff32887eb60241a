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
  (MC - theory) / se with the driver's own standard errors, |z| < 4.5 per entry
  (P(|N(0,1)| > 4.5) = 6.8e-6; ~300 entries checked in this file). Each z-check asserts a power
  guard (conftest.py): ``bias_se <= 0.0022 K`` (a 1 % bias shifts z by >= 4.5) and
  ``mse_se, variance_se <= 0.011 * theory`` (a 5 % error in the MSE or variance formula shifts z by
  >= 4.5). Inputs have norm 0.45 (random directions), so ``||q + k||^2 <= 0.81``: the log-normal
  positive features are light-tailed enough there for the CLT on the mean of ``e^2``, whose
  standard error needs the eighth moment of the error.

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

BIAS_GUARD = 0.01 / Z_MAX  # se <= 0.0022 K: a 1 % bias shifts z by Z_MAX
MSE_GUARD = 0.05 / Z_MAX  # se <= 0.011 MSE: a 5 % error in a formula shifts z by Z_MAX


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


@pytest.mark.statistical
@pytest.mark.parametrize(
    "fm",
    [ka.PositiveRF(4, 16), ka.HyperbolicRF(4, 16), ka.TrigRF(4, 16), ka.TrigRF(4, 16, variant="offset")],
    ids=["positive", "hyperbolic", "sincos", "offset"],
)
def test_kernel_error_matches_theory(fm):
    """The driver's statistics and standard errors, and the theory they estimate.

    S = 1e5 draws, r = 16, a 4 x 5 kernel with ||q + k||^2 <= 0.81. Measured (two base seeds):
    bias_se/K <= 0.0009 (guard 0.0022), mse_se/MSE and variance_se/Var <= 0.0081 (hyperbolic, whose
    e^2 is the most heavy-tailed here; 0.0072 positive, <= 0.0052 trigonometric; guard 0.011)."""
    q, k = normed_inputs(stream=510)
    S = 100_000
    draw_seed = seed(511)
    res = mc.kernel_error(fm, q, k, draws=S, seed=draw_seed, chunk_size=25_000, quantiles=(0.5, 0.9))
    assert res["draws"] == S and res["mse"].shape == (4, 5)
    exact = torch.exp(q @ k.T).numpy()
    np.testing.assert_allclose(res["exact"], exact, rtol=1e-12)
    # independent recomputation of the per-draw estimates (same seed and chunks => same draws):
    # bias_se must be the plain standard error of the mean, std(ddof=1)/sqrt(S)
    Kh = torch.cat([c.kernel(q, k) for c in mc.batched_draws(fm, S, seed=draw_seed, chunk_size=25_000)]).numpy()
    assert Kh.shape == (S, 4, 5)
    np.testing.assert_allclose(res["bias"], Kh.mean(0) - exact, rtol=1e-8, atol=1e-12)
    np.testing.assert_allclose(res["bias_se"], Kh.std(0, ddof=1) / math.sqrt(S), rtol=1e-8)
    # unbiasedness, resolving a 1 % bias: 4.5 se <= 1 % of K
    assert (res["bias_se"] <= BIAS_GUARD * exact).all(), (res["bias_se"] / exact).max()
    z_bias = res["bias"] / res["bias_se"]
    assert np.abs(z_bias).max() < Z_MAX
    # MSE and variance against the closed forms, resolving a 5 % error: 4.5 se <= 5 % of the value
    th = ka.theory.mse(fm, q, k).numpy()
    assert (res["mse_se"] <= MSE_GUARD * th).all(), (res["mse_se"] / th).max()
    assert np.abs((res["mse"] - th) / res["mse_se"]).max() < Z_MAX
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
    # (CLT on S = 1e5 iid draws), |z| < Z_MAX; power guard: se <= 0.011 * target, so a 5 % error in
    # the theory shifts z by Z_MAX (measured se/target <= 0.0044: a sum over 20 entries).
    fro2 = res["per_draw"]["relative_frobenius"] ** 2
    assert fro2.shape == (S,)
    np.testing.assert_allclose(fro2, ((Kh - exact) ** 2).sum((1, 2)) / (exact**2).sum(), rtol=1e-8)
    target = th.sum() / (res["exact"] ** 2).sum()
    fro2_se = fro2.std(ddof=1) / math.sqrt(S)
    assert fro2_se <= MSE_GUARD * target
    assert abs(fro2.mean() - target) / fro2_se < Z_MAX


@pytest.mark.statistical
def test_kernel_error_hundred_thousand_draws():
    """S = 1e5 through the default (max_bytes-sized) chunking path, with the same 5 % power guard."""
    q, k = normed_inputs(n=4, m=4, stream=520)
    fm = ka.PositiveRF(4, 16)
    res = mc.kernel_error(fm, q, k, draws=100_000, seed=seed(521), quantiles=(0.5,),
                          max_bytes=16 * 2**20)
    assert res["per_draw"]["relative_rms"].shape == (100_000,)
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
