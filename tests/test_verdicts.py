"""studies.verdicts: each verdict follows its rule, and flips when the data cross it."""

from __future__ import annotations

import math

import numpy as np
import pytest
from scipy import stats

from studies.verdicts import (
    Verdict,
    adjust_pvalues,
    beats_baseline,
    bootstrap_median_ci,
    compare_to_reference,
    format_verdict,
    paired_ranking,
    pairwise_differences,
    score_table,
    slope_with_uncertainty,
)


def orthonormal_noise(n: int, k: int, seed: int) -> np.ndarray:
    """(n, k) columns with mean exactly 0, sample sd (ddof=1) exactly 1, mutually orthogonal:
    a paired difference ``delta + s * z`` then has the t statistic ``delta sqrt(n) / s`` exactly."""
    z = np.random.default_rng(seed).normal(size=(n, k))
    z -= z.mean(axis=0)
    q, _ = np.linalg.qr(z)  # orthonormal columns, still orthogonal to the constant vector
    return q * math.sqrt(n - 1)


# --- compare_to_reference ----------------------------------------------------------------------
def test_reference_agrees_then_differs_when_shifted_beyond_the_tolerance():
    ref, tol = 2.0, 0.05  # margin [1.9, 2.1]
    v = compare_to_reference(2.02, 1.97, 2.07, ref, tolerance=tol)
    assert v.label == "agrees"
    assert v.evidence["margin_low"] == pytest.approx(1.9)
    assert v.evidence["margin_high"] == pytest.approx(2.1)
    shift = 0.2  # the whole interval moves past the margin's upper end (2.07 + 0.2 > 2.1 + ...)
    assert compare_to_reference(2.22, 2.17, 2.27, ref, tolerance=tol).label == "differs"
    # half-way: the interval straddles the end of the margin
    assert compare_to_reference(2.02 + shift / 2, 1.97 + shift / 2, 2.07 + shift / 2, ref,
                                tolerance=tol).label == "inconclusive"
    # a wide interval around the reference itself is not agreement
    assert compare_to_reference(2.0, 1.5, 2.5, ref, tolerance=tol).label == "inconclusive"
    # below the margin
    assert compare_to_reference(1.5, 1.4, 1.6, ref, tolerance=tol).label == "differs"


def test_reference_relative_and_absolute_margins():
    # 10.3 [10.1, 10.5] against 10: relative 5% -> [9.5, 10.5] agrees; absolute 0.05 differs
    assert compare_to_reference(10.3, 10.1, 10.5, 10.0, tolerance=0.05).label == "agrees"
    assert compare_to_reference(10.3, 10.1, 10.5, 10.0, tolerance=0.05,
                                relative=False).label == "differs"
    # the margin's ends are inside: an interval equal to the margin agrees
    assert compare_to_reference(10.0, 9.5, 10.5, 10.0, tolerance=0.05).label == "agrees"
    # an infinite end can never agree
    assert compare_to_reference(10.0, 9.9, math.inf, 10.0, tolerance=0.05).label == "inconclusive"


def test_reference_bad_input():
    with pytest.raises(ValueError, match="ci_low <= estimate <= ci_high"):
        compare_to_reference(1.0, 1.1, 1.2, 1.0, tolerance=0.1)
    with pytest.raises(ValueError, match="tolerance must be finite and >= 0"):
        compare_to_reference(1.0, 0.9, 1.1, 1.0, tolerance=-0.1)
    with pytest.raises(ValueError, match="ci_high must not be NaN"):
        compare_to_reference(1.0, 0.9, float("nan"), 1.0, tolerance=0.1)
    with pytest.raises(ValueError, match="relative tolerance needs a reference != 0"):
        compare_to_reference(0.0, -0.1, 0.1, 0.0, tolerance=0.1)
    assert compare_to_reference(0.0, -0.1, 0.1, 0.0, tolerance=0.2, relative=False).label == "agrees"
    with pytest.raises(TypeError, match="estimate must be a real number"):
        compare_to_reference("a", 0.9, 1.1, 1.0, tolerance=0.1)


# --- multiple testing --------------------------------------------------------------------------
def test_adjust_pvalues_known_answers():
    p = [0.01, 0.04, 0.03, 0.005]
    # Holm: sorted 0.005, 0.01, 0.03, 0.04 -> 4*0.005, 3*0.01, 2*0.03, max(1*0.04, 0.06)
    np.testing.assert_allclose(adjust_pvalues(p, "holm"), [0.03, 0.06, 0.06, 0.02])
    # BH: m p_(k) / k = 0.02, 0.02, 0.04, 0.04 (step-up minimum from the top)
    np.testing.assert_allclose(adjust_pvalues(p, "bh"), [0.02, 0.04, 0.04, 0.02])
    np.testing.assert_allclose(adjust_pvalues(p, "bonferroni"), [0.04, 0.16, 0.12, 0.02])
    np.testing.assert_allclose(adjust_pvalues(p, "none"), p)
    # the call at alpha = 0.05 changes: 4 rejections uncorrected and with BH, 2 with Holm
    assert (adjust_pvalues(p, "none") < 0.05).sum() == 4
    assert (adjust_pvalues(p, "bh") < 0.05).sum() == 4
    assert (adjust_pvalues(p, "holm") < 0.05).sum() == 2
    np.testing.assert_allclose(adjust_pvalues([1.0, 0.9], "holm"), [1.0, 1.0])
    with pytest.raises(ValueError, match=r"in \[0, 1\]"):
        adjust_pvalues([0.1, 1.2])
    with pytest.raises(ValueError, match="method must be one of"):
        adjust_pvalues([0.1], "fdr")


def baseline_family(p_each: float, n: int = 20, k: int = 4) -> dict[str, np.ndarray]:
    """A baseline and k methods, each better than it with a paired t p-value of exactly p_each."""
    base = np.random.default_rng(1).normal(5.0, 2.0, size=n)  # a unit effect, shared
    z = orthonormal_noise(n, k, seed=2)
    t = stats.t.ppf(1 - p_each / 2, n - 1)
    delta = t / math.sqrt(n)  # s = 1: t = delta sqrt(n)
    out = {"uniform": base}
    for j in range(k):
        out[f"m{j}"] = base - delta + z[:, j]
    return out


def test_holm_vs_no_correction_changes_the_baseline_call():
    scores = baseline_family(p_each=0.03)
    rows = pairwise_differences(scores, pairs=[(m, "uniform") for m in ("m0", "m1", "m2", "m3")],
                                correction="none")
    np.testing.assert_allclose([r["p"] for r in rows], 0.03, rtol=1e-9)  # the construction
    none = beats_baseline(scores, "uniform", correction="none")
    holm = beats_baseline(scores, "uniform", correction="holm")
    bh = beats_baseline(scores, "uniform", correction="bh")
    # uncorrected: 0.03 < 0.05; Holm: 4 * 0.03 = 0.12; BH: 4 * 0.03 / 4 = 0.03
    assert none.label == "beats" and bh.label == "beats"
    assert holm.label == "ties"
    assert holm.statement.startswith("no estimator beats uniform")
    assert holm.evidence["p_adj"] == pytest.approx(0.12)
    assert holm.evidence["ci_low"] < 0 < holm.evidence["ci_high"]
    assert none.evidence["ci_high"] < 0


def test_beats_baseline_flips_with_the_effect_and_reports_worse():
    assert beats_baseline(baseline_family(p_each=0.001), "uniform").label == "beats"
    assert beats_baseline(baseline_family(p_each=0.5), "uniform").label == "ties"
    # every method clearly worse (higher error) than the baseline
    s = baseline_family(p_each=0.001)
    worse = {k: (v if k == "uniform" else 2 * s["uniform"] - v) for k, v in s.items()}
    v = beats_baseline(worse, "uniform")
    assert v.label == "worse" and v.statement.startswith("no estimator beats uniform")
    # higher is better: the same numbers as accuracies flip the call
    assert beats_baseline(s, "uniform", lower_is_better=False).label == "worse"
    with pytest.raises(ValueError, match="baseline 'sdp'"):
        beats_baseline(s, "sdp")


def margin_scores(delta: float, n: int = 40) -> dict[str, np.ndarray]:
    """Log errors of uniform weights and of one map better by exactly ``delta`` on average,
    with a paired sd of 0.001: the t interval is about delta ± 0.0003."""
    base = np.random.default_rng(5).normal(0.0, 0.3, size=n)
    z = orthonormal_noise(n, 1, seed=6)[:, 0]
    return {"uniform": base, "hedgehog": base - delta + 0.001 * z}


def test_beats_baseline_margin_turns_a_tiny_significant_win_into_a_tie():
    tiny = margin_scores(0.0005)  # a 0.05% ratio, significant on 40 units
    assert beats_baseline(tiny, "uniform").label == "beats"  # margin 0: any significant difference
    v = beats_baseline(tiny, "uniform", margin=math.log(1.01))
    assert v.label == "ties" and v.evidence["equivalent"] is True
    assert "inside the margin" in v.statement and v.evidence["pairs"][0]["beyond_margin"] is False
    # a 5% ratio clears the 1% margin: the rule can say "beats"
    big = beats_baseline(margin_scores(math.log(1.05)), "uniform", margin=math.log(1.01))
    assert big.label == "beats" and big.evidence["equivalent"] is False
    # an interval that crosses the margin's end is a tie, but not equivalence
    mid = beats_baseline(margin_scores(math.log(1.01)), "uniform", margin=math.log(1.01))
    assert mid.label == "ties" and mid.evidence["equivalent"] is False
    assert "crosses an end of the margin" in mid.statement
    # worse by more than the margin on the worse side
    w = beats_baseline(margin_scores(-math.log(1.05)), "uniform", margin=math.log(1.01))
    assert w.label == "worse" and w.evidence["pairs"][0]["beyond_margin"] is True
    w_tiny = beats_baseline(margin_scores(-0.0005), "uniform", margin=math.log(1.01))
    assert w_tiny.label == "ties"
    with pytest.raises(ValueError, match="margin must be finite and >= 0"):
        beats_baseline(tiny, "uniform", margin=-0.1)


def ranking_scores(delta: float, n: int = 20) -> dict[str, np.ndarray]:
    base = np.random.default_rng(3).normal(1.0, 0.5, size=n)
    z = orthonormal_noise(n, 2, seed=4)
    return {"A": base, "B": base + delta + 0.1 * z[:, 0], "C": base + 1.0 + 0.1 * z[:, 1]}


def test_ranking_tie_becomes_a_win_when_the_difference_grows():
    tie = paired_ranking(ranking_scores(delta=0.01), what="error")
    # t = 0.01 sqrt(20) / 0.1 = 0.45: a tie; C is worse than both
    assert tie.label == "ties"
    assert "A ties B" in tie.statement and "B beats C" in tie.statement
    assert tie.evidence["rank"] == {"A": 1, "B": 1, "C": 3}
    assert tie.statement.endswith("A ties B; B beats C; A beats C")  # the hidden win is named
    win = paired_ranking(ranking_scores(delta=0.2), what="error")
    # t = 0.2 sqrt(20) / 0.1 = 8.9
    assert win.label == "ordered"
    assert "A beats B" in win.statement and "B beats C" in win.statement
    assert win.evidence["rank"] == {"A": 1, "B": 2, "C": 3}
    assert win.evidence["order"] == ["A", "B", "C"]
    # higher is better reverses the order
    rev = paired_ranking(ranking_scores(delta=0.2), lower_is_better=False)
    assert rev.evidence["order"] == ["C", "B", "A"]


def test_ranking_names_a_win_hidden_by_ties_between():
    # B sits between A and C, tied with both; A vs C is separated
    base = np.random.default_rng(6).normal(size=20)
    z = orthonormal_noise(20, 2, seed=7)
    s = {"A": base, "B": base + 0.03 + 0.1 * z[:, 0], "C": base + 0.06 + 0.1 * z[:, 1]}
    # exact t statistics (orthonormal noise): t(A, B) = 0.03 sqrt(20) / 0.1 = 1.34 and
    # t(B, C) = 0.03 sqrt(20) / (0.1 sqrt(2)) = 0.95, ties; t(A, C) = 0.06 sqrt(20) / 0.1 = 2.68,
    # p = 0.0147, Holm 3 p = 0.044 < 0.05
    v = paired_ranking(s)
    rows = {(r["a"], r["b"]): r for r in v.evidence["pairs"]}
    assert not rows[("A", "B")]["significant"] and not rows[("B", "C")]["significant"]
    assert rows[("A", "C")]["significant"]
    assert v.statement.endswith("A ties B; B ties C; A beats C")
    assert v.evidence["rank"] == {"A": 1, "B": 1, "C": 2}


def test_score_table_pivots_a_tidy_frame():
    pd = pytest.importorskip("pandas")
    s = ranking_scores(delta=0.2)
    tidy = pd.DataFrame([{"head": u, "estimator": m, "mean": float(v[u])}
                         for m, v in s.items() for u in range(20)])
    wide = score_table(tidy, unit="head")
    assert list(wide.columns) == ["A", "B", "C"] and wide.shape == (20, 3)
    assert paired_ranking(wide).statement == paired_ranking(s).statement
    with pytest.raises(ValueError, match="several rows"):
        score_table(pd.concat([tidy, tidy]), unit="head")
    with pytest.raises(ValueError, match=r"column\(s\) \['draw'\]"):
        score_table(tidy, unit="draw")


def test_ranking_accepts_a_wide_dataframe_and_skips_missing_units():
    pd = pytest.importorskip("pandas")
    s = ranking_scores(delta=0.2)
    df = pd.DataFrame(s)
    df.loc[0, "C"] = np.nan  # C did not score unit 0
    rows = {(r["a"], r["b"]): r for r in pairwise_differences(df)}
    assert rows[("A", "B")]["n"] == 20 and rows[("A", "C")]["n"] == 19
    assert paired_ranking(df).evidence["order"] == ["A", "B", "C"]
    with pytest.raises(ValueError, match="at least 2 methods"):
        paired_ranking({"A": [1.0, 2.0]})
    with pytest.raises(ValueError, match="same length"):
        paired_ranking({"A": [1.0, 2.0], "B": [1.0]})
    with pytest.raises(TypeError, match="DataFrame"):
        paired_ranking([[1.0, 2.0]])


@pytest.mark.parametrize("ci", ["t", "bootstrap"])
@pytest.mark.parametrize("correction", ["holm", "bh", "none"])
def test_corrected_interval_excludes_zero_iff_the_corrected_test_rejects(ci, correction):
    rng = np.random.default_rng(5)
    n = 15
    base = rng.normal(size=n)
    # effects from none to strong, so that both calls occur
    scores = {f"m{j}": base + e + 0.3 * rng.normal(size=n)
              for j, e in enumerate([0.0, 0.05, 0.12, 0.2, 0.35, 0.6])}
    rows = pairwise_differences(scores, correction=correction, ci=ci, n_boot=2000, seed=1)
    calls = [r["significant"] for r in rows]
    assert 0 < sum(calls) < len(calls)
    for r in rows:
        excludes = not (r["ci_low"] <= 0.0 <= r["ci_high"])
        assert excludes == r["significant"] == (r["p_adj"] < 0.05), r
        assert r["level"] >= 0.95


def test_paired_t_matches_scipy_ttest_1samp():
    # the closed-form t test of pairwise_differences is scipy.stats.ttest_1samp (p-value and the
    # interval at the reported level), to float rounding: rtol 1e-9 covers the ufunc evaluation
    # of the t CDF and quantile against scipy.stats.t's
    rng = np.random.default_rng(11)
    for n, effect in ((3, 0.0), (8, 0.4), (16, 2.0), (40, 0.05)):
        a, b = rng.normal(size=n), rng.normal(size=n) + effect
        (r,) = pairwise_differences({"a": a, "b": b}, correction="none")
        ref = stats.ttest_1samp(a - b, 0.0)
        c = ref.confidence_interval(confidence_level=r["level"])
        assert r["p"] == pytest.approx(float(ref.pvalue), rel=1e-9, abs=1e-300)
        assert r["ci_low"] == pytest.approx(float(c.low), rel=1e-9)
        assert r["ci_high"] == pytest.approx(float(c.high), rel=1e-9)


# --- bootstrap of a median ---------------------------------------------------------------------
# Coverage: M independent data sets, each with an interval at level 0.95; the number covering the
# true median is Binomial(M, 0.95) when the interval is exact, so the coverage has standard error
# sqrt(0.95 * 0.05 / M) = 0.0109 at M = 400, and |coverage - 0.95| < 3 se = 0.033 holds with
# probability 0.997. The data: heads a_h ~ N(0, 1) and draws a_h + N(0, 0.5^2), a pooled
# population N(0, 1.25) whose median is 0; within-head correlation 0.8, so treating the values as
# independent (the flat bootstrap) undercovers far below 0.95 - 3 se.
M_COVER = 400
SE_COVER = math.sqrt(0.95 * 0.05 / M_COVER)


def coverage(sizes: np.ndarray, nested: bool, seed: int) -> float:
    rng = np.random.default_rng(seed)
    heads = np.repeat(np.arange(sizes.size), sizes)
    hit = 0
    for m in range(M_COVER):
        x = rng.normal(size=sizes.size)[heads] + 0.5 * rng.normal(size=heads.size)
        ci = bootstrap_median_ci(x, groups=heads if nested else None, n_boot=400, seed=m)
        hit += ci.low <= 0.0 <= ci.high
    return hit / M_COVER


def test_hierarchical_bootstrap_covers_at_the_nominal_rate_and_the_flat_one_does_not():
    sizes = np.full(40, 4)  # 40 heads x 4 draws
    nested = coverage(sizes, nested=True, seed=10)
    flat = coverage(sizes, nested=False, seed=10)
    assert abs(nested - 0.95) < 3 * SE_COVER, nested
    assert flat < 0.95 - 3 * SE_COVER, flat


def test_hierarchical_bootstrap_unequal_groups_cover():
    sizes = np.random.default_rng(11).integers(2, 7, size=40)  # 2..6 draws per head
    cov = coverage(sizes, nested=True, seed=12)
    assert abs(cov - 0.95) < 3 * SE_COVER, cov


def test_bootstrap_median_basics():
    x = np.arange(11.0)
    ci = bootstrap_median_ci(x, seed=0)
    assert ci.estimate == 5.0 and ci.low < 5.0 < ci.high
    assert bootstrap_median_ci(x, seed=0) == ci  # the seed fixes it
    q90 = bootstrap_median_ci(x, quantile=0.9, seed=0)
    assert q90.estimate == pytest.approx(9.0)
    with pytest.raises(ValueError, match="groups must have the shape"):
        bootstrap_median_ci(x, groups=[0, 1])
    with pytest.raises(ValueError, match="finite"):
        bootstrap_median_ci([1.0, np.nan])
    with pytest.raises(ValueError, match="n_boot must be >= 100"):
        bootstrap_median_ci(x, n_boot=10)


# --- slopes across analysis choices ------------------------------------------------------------
def test_slope_envelope_widens_with_a_disagreeing_analysis_choice():
    d = np.array([4.0, 8, 16, 32, 64, 128, 256, 512])
    wiggle = 1 + 0.02 * np.cos(np.arange(d.size))
    q90 = 5 * d * wiggle
    one = slope_with_uncertainty(d, {"q90": q90})
    assert one.slope == pytest.approx(1.0, abs=0.01)
    assert compare_to_reference(one.slope, one.low, one.high, 1.0, tolerance=0.05,
                                relative=False).label == "agrees"
    # a second statistic whose exponent is 1.15 at d >= 32: the envelope covers it, and the
    # claim "exponent 1 within 0.05" is no longer supported
    median = np.where(d >= 32, 3 * 32 * (d / 32) ** 1.15, 3 * d) * wiggle
    both = slope_with_uncertainty(d, {"q90": q90, "median": median}, ranges=[(4, 512), (32, 512)])
    assert len(both.variants) == 4
    assert both.slope == pytest.approx(one.slope) and both.primary_low == pytest.approx(one.low)
    assert both.high > 1.14 and both.low <= one.low
    assert compare_to_reference(both.slope, both.low, both.high, 1.0, tolerance=0.05,
                                relative=False).label == "inconclusive"
    # the t interval of one variant is the textbook one
    res = stats.linregress(np.log(d), np.log(q90))
    half = stats.t.ppf(0.975, d.size - 2) * res.stderr
    assert one.primary_high - one.slope == pytest.approx(half)


def test_slope_skips_short_ranges_and_censored_points():
    d = np.array([4.0, 8, 16, 32, 64])
    y = 2 * d
    y[-1] = np.nan  # censored
    s = slope_with_uncertainty(d, y, ranges=[(4, 64), (32, 64)])
    assert s.variants[0]["n"] == 4 and s.variants[1]["n"] == 1
    assert math.isnan(s.variants[1]["slope"]) and s.slope == pytest.approx(1.0)
    with pytest.raises(ValueError, match="no variant has 3"):
        slope_with_uncertainty(d, y, ranges=[(32, 64)])


# --- formatting --------------------------------------------------------------------------------
def test_format_verdict_is_one_bullet_with_the_label():
    v = compare_to_reference(1.0, 0.99, 1.01, 1.0, tolerance=0.02)
    line = format_verdict(v)
    assert line.startswith("- **agrees**: ") and "\n" not in line
    assert "margin_low = 0.98" in line
    assert format_verdict(Verdict("ties", "A ties B")) == "- **ties**: A ties B"
    with pytest.raises(TypeError, match="Verdict"):
        format_verdict("agrees")
