"""Tests for the orthogonal-gain convergence flag, the state-capacity beta sweep and the sign of the
large-s χ-ORF trig pair term.

References: Yu et al. (2016), "Orthogonal Random Features", NeurIPS; Choromanski et al. (2021),
"Rethinking Attention with Performers", ICLR (Lemma 2); Schlag, Irie & Schmidhuber (2021),
"Linear Transformers Are Secretly Fast Weight Programmers", ICML; DLMF §13.2, §13.6, §13.7.
"""

from __future__ import annotations

import json
import math

import numpy as np
import pandas as pd
import pytest
import torch
from scipy.special import eval_genlaguerre, factorial, gamma, poch

import kernelapprox as ka
from kernelapprox.theory import _common as moments
from studies import orthogonal_gain as og
from studies import state_capacity as sc
from studies._engine import Context


# ---------------------------------------------------------------------------------------------
# D5: the large-s chi-ORF trig term has no fixed sign
# ---------------------------------------------------------------------------------------------
def _bracket(d: int, s: np.ndarray) -> np.ndarray:
    """${}_1F_1(d; d/2; -s/2) - e^{-s}$, the χ-ORF pair excess of trig sin/cos features."""
    return moments._pair_excess(d, -0.5 * np.asarray(s, dtype=np.float64))


def test_orf_trig_pair_term_sign_alternates_with_d() -> None:
    s = np.array([20.0, 60.0, 200.0])
    # reference values from 50-digit mpmath (hyp1f1(d, d/2, -s/2) - exp(-s)), 6 digits kept, so
    # rtol 1e-5 (rounding of the references; _pair_excess itself is good to ~1e-13)
    np.testing.assert_allclose(_bracket(6, s), [-3.02687e-5, -2.37684e-11, -5.30694e-40],
                               rtol=1e-5)
    np.testing.assert_allclose(_bracket(5, s), [3.42734e-5, -1.18695e-7, -1.69047e-10], rtol=1e-5)
    assert (_bracket(6, s) < 0).all() and (_bracket(10, s) < 0).all()  # ORF better than iid
    assert (_bracket(4, s) > 0).all()  # ORF worse than iid: the sign depends on d
    # even d (Kummer + DLMF 13.6.19): e^{-s/2} n!/(d/2)_n L_n^{(d/2-1)}(s/2) - e^{-s}, n = d/2,
    # an independent evaluation; it fixes the large-s sign to (-1)^{d/2}
    for d in (4, 6, 8, 10, 16):
        n = d // 2
        lag = (np.exp(-s / 2) * factorial(n) / poch(d / 2, n) * eval_genlaguerre(n, d / 2 - 1, s / 2)
               - np.exp(-s))
        np.testing.assert_allclose(_bracket(d, s), lag, rtol=1e-9)
        big = np.array([4.0 * 4 * n + 50.0])  # beyond the largest Laguerre root (< 4n + 2α + 2)
        assert np.sign(_bracket(d, big))[0] == (-1) ** n, d
    # odd d (DLMF 13.7.2): ~ Γ(d/2)/Γ(-d/2) (s/2)^{-d}, the sign of Γ(-d/2), at s = 1e4
    for d in (5, 7, 9, 11):
        big = np.array([1.0e4])
        lead = gamma(d / 2) / gamma(-d / 2) * (big / 2) ** (-d)
        np.testing.assert_allclose(_bracket(d, big), lead, rtol=0.02)  # next term O(d^2/s)
        assert np.sign(_bracket(d, big))[0] == np.sign(gamma(-d / 2)), d


def test_orf_trig_mse_below_iid_far_from_diagonal_at_d6() -> None:
    # through the public API: r = d = 6, ‖x - y‖^2 = 20. The ORF-iid MSE difference is
    # (P/r^2) C^2 * bracket with P = d(d-1) = 30, C^2 = e^{|x|^2 + |y|^2}; it is 3e-4 of the iid
    # MSE, far above float64 rounding (1e-16 relative), so the sign is resolved exactly.
    d, s = 6, 20.0
    x = np.zeros((1, d))
    x[0, 0] = math.sqrt(s) / 2
    y = -x
    iid = ka.theory.trig_sincos_mse(x, y, d)[0, 0]
    orf = ka.theory.trig_sincos_mse(x, y, d, row_law="orthogonal-chi")[0, 0]
    c2 = math.exp(2 * (s / 4))
    assert orf < iid  # ORF is *better* than iid here (the old docstring claimed the opposite)
    assert (orf - iid) == pytest.approx(30 / 36 * c2 * _bracket(d, np.array([s]))[0], rel=1e-6)
    x4, y4 = x[:, :4], y[:, :4]  # d = 4: the opposite sign
    assert (ka.theory.trig_sincos_mse(x4, y4, 4, row_law="orthogonal-chi")[0, 0]
            > ka.theory.trig_sincos_mse(x4, y4, 4)[0, 0])


# ---------------------------------------------------------------------------------------------
# D3: orthogonal-gain convergence diagnostic
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("estimator,norm", [("positive", 0.5), ("trig-sincos", 1.0)])
def test_iid_sq_error_moments(estimator: str, norm: float) -> None:
    r, N = 4, 200_000
    mean, sd = og.iid_sq_error_moments(estimator, norm, r)
    # E e^2 is the library's iid relative MSE (Performer Lemma 2 / K^2), to rounding
    x = np.zeros((1, 8))
    if estimator == "positive":  # ‖x + y‖ = norm, x = y
        x[0, 0] = norm / 2
        th = ka.theory.positive_mse(x, x, r)[0, 0] / math.exp(norm**2 / 4) ** 2
    else:  # ‖x - y‖ = norm, x = -y
        x[0, 0] = norm / 2
        th = ka.theory.trig_sincos_mse(x, -x, r)[0, 0] / math.exp(-(norm**2) / 4) ** 2
    assert float(mean) == pytest.approx(th, rel=1e-10)
    # Monte Carlo of e = mean of r iid terms (w.z ~ N(0, norm^2)); light tails at these norms
    rng = np.random.default_rng(7)
    g = rng.standard_normal((N, r)) * norm
    y = np.exp(g - norm**2 / 2) if estimator == "positive" else np.exp(norm**2 / 2) * np.cos(g)
    e2 = (y.mean(1) - 1.0) ** 2
    # z-scores: mean of e^2 with the formula's sd, mean of e^4 with its sample sd; |z| < 4 (two-
    # sided 6e-5 each). Power: replacing 3r(r-1) by 3r^2 in E e^4 moves it by 17% (positive) /
    # 12% (trig) while se(mean e^4) is ~1% of it here (z ~ 10-15), so that bug is caught.
    assert abs(e2.mean() - mean) / (sd / math.sqrt(N)) < 4
    e4 = e2**2
    assert abs(e4.mean() - (sd**2 + mean**2)) / (e4.std(ddof=1) / math.sqrt(N)) < 4
    with pytest.raises(ValueError, match="estimator"):
        og.iid_sq_error_moments("elu", 1.0, 4)
    with pytest.raises(ValueError, match="r must"):
        og.iid_sq_error_moments(estimator, 1.0, 0)


def test_orthogonal_gain_flags_heavy_tails() -> None:
    ctx = Context(quick=True, study="orthogonal-gain")
    rows = pd.DataFrame(og.run_cell({"estimator": "positive", "d": 16, "r": 16}, ctx))
    ratio = rows[(rows.metric == "mse_ratio") & (rows.sweep == "sum")].set_index(
        ["sampler", "sum_norm"])
    # ‖q+k‖ = 2: closed-form relative SE of the 256-draw mean of e^2 is ~47 (>> 0.1): flagged
    assert not ratio["converged"].loc[("orthogonal", 2.0)]
    assert ratio["rse_theory"].loc[("orthogonal", 2.0)] > 10
    # ‖q+k‖ = 0.25: light tail (rse ~ 0.09), flagged only if one draw dominates the sum
    assert ratio["rse_theory"].loc[("orthogonal", 0.25)] < og.RSE_MAX
    assert ratio["converged"].loc[("orthogonal", 0.25)]
    trig = pd.DataFrame(og.run_cell({"estimator": "trig-sincos", "d": 16, "r": 16}, ctx))
    t = trig[(trig.metric == "mse_ratio") & (trig.sweep == "diff") & (trig.sampler == "orthogonal")]
    assert t.set_index("diff_norm")["converged"].loc[[0.5, 1.0, 1.5, 2.0]].all()


# ---------------------------------------------------------------------------------------------
# D10: state-capacity beta sweep
# ---------------------------------------------------------------------------------------------
def test_make_task_beta_is_paired() -> None:
    a = sc.make_task(32, 8, 2, seed=3, beta=2.0)
    b = sc.make_task(32, 8, 2, seed=3, beta=8.0)
    torch.testing.assert_close(a["keys"] * 2.0, b["keys"])  # same directions, norm sqrt(beta)
    torch.testing.assert_close(b["keys"].norm(dim=-1), torch.full((2, 32), math.sqrt(8.0),
                                                                   dtype=torch.float64))
    assert torch.equal(a["idx"], b["idx"]) and torch.equal(a["values"], b["values"])
    with pytest.raises(ValueError, match="beta"):
        sc.make_task(4, 2, 1, seed=0, beta=0.0)


def test_capacity_fits_recovers_a_known_exponent() -> None:
    # synthetic recall curves acc(n) = 1/(1 + n/n50) with n50 = 2 r^p, p = 0.7, 12 noisy draws
    # per n (sd 0.03); the fitted p must sit in its bootstrap CI-widened-by-half tolerance and
    # the CI must exclude p = 1 (would fail if the fit regressed n50 on F d_v or on n).
    rng = np.random.default_rng(0)
    p_true, ns = 0.7, 2.0 ** np.arange(2, 13)
    recs = []
    for r in (16, 64, 256, 1024):
        n50 = 2.0 * r**p_true
        for n in ns:
            draws = np.clip(1 / (1 + n / n50) + 0.03 * rng.standard_normal(12), 0, 1)
            recs.append({"metric": "accuracy", "method": "linear", "beta": 4.0, "r": r,
                         "dv": sc.SWEEP_DV, "n": n, "draw_values": json.dumps(draws.tolist())})
    n50, fits = sc.capacity_fits(pd.DataFrame(recs), n_boot=200, seed=1)
    fit = fits.iloc[0]
    assert fit["n_r"] == 4 and fit["share_fitted"] > 0.99
    half = (fit["p_high"] - fit["p_low"]) / 2
    assert 0 < half < 0.05  # the draws resolve p to a few hundredths
    assert fit["p_low"] - half <= p_true <= fit["p_high"] + half
    assert fit["p_high"] < 1.0
    assert (n50["n50_low"] <= n50["n50"]).all() and (n50["n50"] <= n50["n50_high"]).all()
    with pytest.raises(ValueError, match="n_boot"):
        sc.capacity_fits(pd.DataFrame(recs), n_boot=3)


def test_orthogonal_gain_verdicts_flip_when_a_point_moves() -> None:
    """Per-point verdicts on the committed ratios: a converged trig point that agrees with its
    closed form (± 25%) differs once its CI is scaled by 1.6 (the interval then starts above
    1.25 × the closed form, since the committed lower end is > 0.8 × it), and is inconclusive
    once its CI is stretched across the margin; against 1 (no gain) a CI excluding 1 differs and
    one containing 1 is inconclusive."""
    from pathlib import Path

    df = pd.read_csv(Path(__file__).resolve().parent.parent / "reports/orthogonal-gain/results.csv")
    sub = og._ratio_frame(df)
    trig = sub[(sub["sampler"] == "orthogonal") & sub["converged"]
               & (sub["estimator"] == "trig-sincos")]
    v = og.point_verdicts(trig)
    i = next(k for k, x in enumerate(v) if x.label == "agrees")
    m = trig.iloc[[i]].copy()
    th = float(m["theory"].iloc[0])
    assert float(m["ci_low"].iloc[0]) > 0.75 * th  # agrees: inside [0.75, 1.25] x theory

    moved = m.copy()
    moved[["mean", "ci_low", "ci_high"]] = 1.6 * m[["mean", "ci_low", "ci_high"]].to_numpy(float)
    assert og.point_verdicts(moved)[0].label == "differs"

    wide = m.copy()
    wide[["mean", "ci_low", "ci_high"]] = [[th, 0.9 * th, 1.4 * th]]
    assert og.point_verdicts(wide)[0].label == "inconclusive"

    gain = m.copy()
    gain[["mean", "ci_low", "ci_high"]] = [[0.5, 0.45, 0.55]]
    assert og.point_verdicts(gain, 1.0)[0].label == "differs"
    gain[["mean", "ci_low", "ci_high"]] = [[0.95, 0.85, 1.05]]
    assert og.point_verdicts(gain, 1.0)[0].label == "inconclusive"
    assert og.count_labels(og.point_verdicts(gain, 1.0)) == {"agrees": 0, "differs": 0,
                                                            "inconclusive": 1}
