"""The estimator-league study: a quick-mode run (output files, CSV columns, invariants of the
equal-F and equal-FLOPs selections, fitting, baselines, the Chefs' Random Tables reproduction)
and unit tests of the helpers the numbers rest on (r for a feature dimension or a FLOP budget,
FLOP counts, ``EstimatorSpec.ready``, the OPRF log relative variance).

The study is run once (module-scoped fixture, about 10-20 s on two loaded cores) into a temporary
folder through the framework's runner.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch

import kernelapprox as ka
from studies import STUDY_MODULES
from studies import estimator_league as league
from studies._engine import ROW_KEYS, last_run, load_studies, run_study
from studies.estimators import get, select

D = league.D


@pytest.fixture(scope="module")
def report(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("reports")
    return run_study(league.STUDY, out=out, quick=True, progress=False)


@pytest.fixture(scope="module")
def df(report: Path) -> pd.DataFrame:
    return pd.read_csv(report / "results.csv")


@pytest.fixture(scope="module")
def lg(df: pd.DataFrame) -> pd.DataFrame:
    return df[df["part"] == "league"]


def _truthy(col: pd.Series) -> pd.Series:
    return col.astype(str) == "True"


# ---------------------------------------------------------------------------------------------
# structure
# ---------------------------------------------------------------------------------------------
def test_registered_with_the_runner() -> None:
    assert "estimator_league" in STUDY_MODULES
    assert load_studies(strict=True)["estimator-league"] is league.STUDY


def test_outputs(report: Path, df: pd.DataFrame) -> None:
    for col in ROW_KEYS:
        assert col in df.columns
    for stem in ("attention_error_equal_F", "kernel_mse_equal_F", "kernel_median_equal_F",
                 "attention_error_equal_flops", "crt_variance_vs_scale"):
        png = report / f"{stem}.png"
        assert png.exists() and png.stat().st_size > 10_000 and png.with_suffix(".svg").exists(), stem
    assert (report / league.STUDY.headline).exists()
    summary = (report / "summary.md").read_text()
    for section in ("## What was run", "## Key results", "## Finding", "## Provenance"):
        assert section in summary
    finding = summary.split("## Finding", 1)[1].split("## Provenance", 1)[0]
    assert finding.count("\n- ") >= 5 and any(ch.isdigit() for ch in finding)
    for phrase in ("tier 1", "against uniform weights", "Holm", "equal FLOPs", "worse than uniform",
                   "Chefs' Random Tables"):
        assert phrase.lower() in finding.lower(), phrase
    assert "2nd" not in finding  # tiers from paired tests, not places from point estimates
    # every regime's best is set against uniform weights by beats_baseline
    assert finding.count("against uniform weights: **") >= len(league._regimes(True))
    prov = last_run(report.parent, league.STUDY)
    assert prov["quick"] is True and prov["n_cells"] == len(league.grid(True))
    index = (report.parent / "README.md").read_text()
    assert "[estimator-league](estimator-league/summary.md)" in index


def test_csv_columns_and_intervals(df: pd.DataFrame, lg: pd.DataFrame) -> None:
    need = {"part", "regime", "sigma", "spec", "estimator", "sampler", "label", "mode", "target",
            "budget_r", "r", "feature_dim", "flops_per_token", "flops_source", "fit", "fit_steps",
            "reason", "theory", "crt_estimator", "crt_scale", "kind"}
    assert need <= set(df.columns), need - set(df.columns)
    fin = df[np.isfinite(df["mean"])]
    tol = 1e-9 * (1 + fin["mean"].abs())
    assert ((fin["ci_low"] <= fin["mean"] + tol) & (fin["mean"] <= fin["ci_high"] + tol)).all()
    per_draw = lg[lg["metric"].isin(["attn_rel_err", "kernel_rel_mse", "kernel_rel_mse_median"])]
    assert (per_draw["n_draws"] == league.DRAWS_QUICK).all()
    assert (per_draw["mean"] >= 0).all()
    assert set(lg["metric"]) >= {"attn_rel_err", "kernel_rel_mse", "kernel_rel_mse_median",
                                 "attn_entropy", "attn_max_weight", "log_n"}


# ---------------------------------------------------------------------------------------------
# every registered estimator, at equal F and at equal FLOPs
# ---------------------------------------------------------------------------------------------
def test_every_registered_estimator_is_in_the_league(lg: pd.DataFrame) -> None:
    specs = league.league_specs(quick=True)
    assert {s.name for s in specs} == {e.name for e in ka.estimators()}
    regimes = lg[["regime", "sigma"]].drop_duplicates()
    assert len(regimes) == len(league.SIGMAS_QUICK) + 1
    for spec in specs:
        rows = lg[lg["spec"] == spec.key]
        assert len(rows[["regime", "sigma"]].drop_duplicates()) == len(regimes), spec.key
        for F in league.FEATURE_DIMS_QUICK:  # each target: measured, or skipped with a reason
            at = rows[(rows["mode"] == "equal_F") & (rows["target"] == F)]
            done = at[at["metric"] == "attn_rel_err"]
            skipped = at[at["metric"] == "skipped"]
            assert len(done) + len(skipped) == len(regimes), (spec.key, F)
            assert skipped["reason"].fillna("").str.len().gt(0).all(), spec.key


def test_equal_feature_dimension(lg: pd.DataFrame) -> None:
    ev = lg[(lg["mode"] == "equal_F") & (lg["metric"] == "attn_rel_err")]
    assert len(ev)
    assert (ev["feature_dim"] == ev["target"]).all()
    for key, g in ev.groupby("spec"):
        est = get(key).estimator
        for r, F in zip(g["r"], g["target"], strict=True):
            assert est.feature_dim(int(r), D) == int(F), key


def test_equal_flops(lg: pd.DataFrame) -> None:
    ev = lg[(lg["mode"] == "equal_flops") & (lg["metric"] == "attn_rel_err")]
    assert len(ev)
    for (key, rb), g in ev.groupby(["spec", "budget_r"]):
        budget = league.flop_budget(int(rb))
        x = g.iloc[0]
        assert x["target"] == pytest.approx(budget)
        assert x["flops_per_token"] <= budget * (1 + 1e-12), key
        est = get(key).estimator
        if league.tunable(est, D):  # the largest r within the budget
            assert league.flops_per_token(est, int(x["r"]) + 1)[0] > budget, key
    pos = ev[ev["estimator"] == "positive"]
    assert len(pos) and (pos["r"] == pos["budget_r"]).all()  # FAVOR+ spends exactly its budget
    # equal FLOPs are evaluated with one sampler per random family
    assert set(ev.loc[_truthy(ev["random"]), "sampler"]) == {league.FLOPS_SAMPLER}


def test_fitting_is_recorded(lg: pd.DataFrame) -> None:
    ev = lg[lg["metric"] == "attn_rel_err"]
    ev = ev[ev["estimator"] != league.UNIFORM]
    dd, lrn = _truthy(ev["data_dependent"]), _truthy(ev["learned"])
    assert ev.loc[dd, "fit"].str.startswith("batch").all()
    assert (ev.loc[lrn, "fit"] == "calibration").all()
    assert (ev.loc[lrn, "fit_steps"] == league.FIT_STEPS_QUICK).all()
    assert (ev.loc[~dd & ~lrn, "fit"] == "none").all()
    if lrn.any():  # the distillation loss went down on the calibration batch
        first = lg[lg["metric"] == "fit_loss_first"].set_index(["spec", "regime", "sigma", "mode", "target"])
        last = lg[lg["metric"] == "fit_loss_last"].set_index(["spec", "regime", "sigma", "mode", "target"])
        assert len(last) and (last["mean"] < first.loc[last.index, "mean"]).mean() >= 0.9


def test_baselines_and_regimes(lg: pd.DataFrame) -> None:
    uni = lg[(lg["estimator"] == league.UNIFORM) & (lg["metric"] == "attn_rel_err")]
    assert len(uni) == len(league.SIGMAS_QUICK) + 1
    assert (uni["mean"] > 0).all() and (uni["mean"] <= 1.0 + 1e-9).all()  # ||mean v - O|| <= ||O|| here
    g = uni[uni["regime"] == "gaussian"].sort_values("sigma")
    assert g["mean"].is_monotonic_increasing  # more peaked attention: uniform weights are worse
    ent = lg[lg["metric"] == "attn_entropy"]
    logn = float(lg.loc[lg["metric"] == "log_n", "mean"].iloc[0])
    assert (ent["mean"] <= logn + 1e-9).all() and (ent["mean"] > 0).all()
    peaked = float(ent.loc[ent["regime"] == "peaked", "mean"].iloc[0])
    assert peaked < 0.5 * ent.loc[ent["regime"] == "gaussian", "mean"].min()
    elu = lg[(lg["estimator"] == league.BASELINE_ESTIMATOR) & (lg["metric"] == "attn_rel_err")]
    assert set(elu["mode"]) >= {"native"} and len(elu[elu["mode"] == "native"]) == len(uni)
    # positive maps never have non-positive denominators; only signed maps report them
    den = lg[lg["metric"] == "frac_den_nonpos"]
    assert set(den["estimator"]) <= {s.name for s in select() if not s.positive}


def test_attention_is_exact_in_the_limit_it_should_be(lg: pd.DataFrame) -> None:
    """At σ = 0.5 every unbiased random map at F = 128 is within a factor of a few of the uniform
    baseline and finite; nothing returns NaN."""
    ev = lg[(lg["metric"] == "attn_rel_err") & (lg["mode"] == "equal_F")]
    assert np.isfinite(ev["mean"]).all()
    small = ev[(ev["regime"] == "gaussian") & (ev["sigma"] == min(league.SIGMAS_QUICK)) & _truthy(ev["random"])]
    assert (small["mean"] < 5.0).all()


# ---------------------------------------------------------------------------------------------
# Chefs' Random Tables
# ---------------------------------------------------------------------------------------------
def test_crt_closed_forms(df: pd.DataFrame) -> None:
    crt = df[df["part"] == "crt"]
    cf = crt[(crt["metric"] == "log_relvar") & (crt["kind"] == "closed form")]
    assert set(cf["crt_estimator"]) == set(league.CRT_FAMILIES)
    assert len(cf) == 3 * len(league.CRT_SCALES_QUICK) and np.isfinite(cf["mean"]).all()
    lr = crt[crt["metric"] == "log_ratio"]
    for fam, g in lr.groupby("crt_estimator"):
        g = g.sort_values("crt_scale")
        # OPRF at its optimal A is never worse than A = 0 (FAVOR+) for any pair
        if fam == "positive/oprf":
            assert (g["q10"] >= -1e-9).all()
        assert g["mean"].is_monotonic_increasing, fam
        if fam == "positive/oprf":  # small inputs: A* -> 0, OPRF -> FAVOR+
            assert abs(g["mean"].iloc[0]) < 0.5
        else:  # small inputs: trig's relative variance ~ s^2/2 is below the exponential ones' ~ t
            assert g["mean"].iloc[0] < 0
        assert g["mean"].iloc[-1] > 60, fam  # large inputs: the paper's orders of magnitude
    # the t axis: E|x + y|^2 = 2 sigma^2 sqrt(d) for independent Gaussian points
    x = cf[cf["crt_estimator"] == "positive"]
    assert np.allclose(x["t_mean"], 2 * x["crt_scale"] ** 2 * math.sqrt(D), rtol=0.2)


def test_crt_monte_carlo_matches_the_closed_forms(df: pd.DataFrame) -> None:
    mcp = df[(df["part"] == "crt") & (df["kind"] == "monte carlo")]
    assert len(mcp)
    ok = mcp[_truthy(mcp["mc_reliable"])]
    assert len(ok) >= 2
    assert ((ok["mean"] - ok["theory"]).abs() < 0.25).all()


# ---------------------------------------------------------------------------------------------
# helpers (no study run)
# ---------------------------------------------------------------------------------------------
def test_r_for_feature_dim() -> None:
    assert league.r_for_feature_dim(ka.get_estimator("positive"), 256) == (256, "")
    assert league.r_for_feature_dim(ka.get_estimator("trig-sincos"), 256) == (128, "")
    assert league.r_for_feature_dim(ka.get_estimator("elu"), 64) == (64, "")
    r, why = league.r_for_feature_dim(ka.get_estimator("elu"), 128)
    assert r is None and "fixed at 64" in why

    class _GappyRF(ka.PositiveRF):
        """feature_dim 3r: 128 is unreachable."""

    est = ka.register_estimator(_GappyRF, name="league-test-gappy", feature_dim=lambda r, d: 3 * r)
    try:
        r, why = league.r_for_feature_dim(est, 128)
        assert r is None and "no r gives feature_dim 128" in why
        assert league.r_for_feature_dim(est, 129) == (43, "")
    finally:
        ka.unregister_estimator("league-test-gappy")


def test_flops_formula_and_budget() -> None:
    d, dv, r = 64, 64, 256
    expected = 2 * (2 * r * d + 2 * d + 3 * r) + 4 * r * (dv + 1) + dv
    assert league.flops_per_token("positive", r) == (float(expected), "formula")
    assert league.flop_budget(r) == float(expected)
    for name in ("positive", "trig-sincos", "oprf", "elu"):
        est = ka.get_estimator(name)
        B = league.flop_budget(200)
        rr, why = league.r_for_budget(est, B)
        assert rr is not None, (name, why)
        assert league.flops_per_token(est, rr)[0] <= B
        if league.tunable(est):
            assert league.flops_per_token(est, rr + 1)[0] > B
    # a data-dependent fit costs FLOPs: OPRF buys fewer projections than FAVOR+ on the same budget
    assert league.r_for_budget(ka.get_estimator("oprf"), league.flop_budget(256))[0] < 256


def test_flops_formula_matmuls_match_the_flop_counter() -> None:
    """The matmul part of c_phi (2rd, plus 2d when ‖x‖² is an einsum) is what torch's FLOP
    counter sees in the map's features, and it is within the formula."""
    from torch.utils.flop_counter import FlopCounterMode

    x = torch.randn(32, D, dtype=torch.float64) / D**0.25
    for name in ("positive", "trig-sincos", "trig-offset", "hyperbolic"):
        fm = ka.get_estimator(name).build(D, 96, seed=0, dtype=torch.float64)
        with torch.no_grad(), FlopCounterMode(display=False) as fc:
            fm.log_features(x)
        per_token = fc.get_total_flops() / 32
        assert per_token in (2 * 96 * D, 2 * 96 * D + 2 * D), (name, per_token)
        assert per_token <= league._PHI_FLOPS[name](96, D, 1024)[0], name


def test_unlisted_estimators_get_measured_flops() -> None:
    class _InstrumentedRF(ka.PositiveRF):
        """FAVOR+ under another name: no formula row."""

    ka.register_estimator(_InstrumentedRF, name="league-test-measured", feature_dim="r")
    try:
        f, src = league.flops_per_token("league-test-measured", 128)
        ref, _ = league.flops_per_token("positive", 128)
        assert src == "measured"
        assert f == pytest.approx(ref, rel=0.05)
    finally:
        ka.unregister_estimator("league-test-measured")


def test_plan_has_native_and_skips() -> None:
    items = league.plan(get("elu"), [64, 128], [128])
    modes = [(i["mode"], i["r"]) for i in items]
    assert modes[0] == ("native", 64)
    assert ("equal_F", 64) in modes and ("equal_F", None) in modes
    assert ("equal_flops", 64) in modes  # elu+1 costs far less than FAVOR+ with r = 128


def test_ready_fits_data_dependent_maps_and_leaves_others() -> None:
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 64, D, generator=g, dtype=torch.float64) / D**0.25
    k = torch.randn(2, 64, D, generator=g, dtype=torch.float64) / D**0.25
    pos = get("positive-gaussian")
    fm = pos.build(D, 16, batch_shape=(2,), seed=0)
    W = fm.weight.clone()
    assert pos.ready(fm, q, k) is fm and torch.equal(fm.weight, W)
    dd = [s for s in select(samplers="gaussian") if s.data_dependent and s.name == "oprf"]
    if not dd:
        pytest.skip("oprf is not registered")
    fm = dd[0].build(D, 16, batch_shape=(2,), seed=0)
    assert dd[0].ready(fm, q, k) is fm
    assert fm.A_.shape == (2,) and bool((fm.A_ < 0).all())


def test_ready_trains_learned_maps(monkeypatch: pytest.MonkeyPatch) -> None:
    learned = [s for s in select() if s.learned]
    if not learned:
        pytest.skip("no learned estimator registered")
    spec = learned[0]
    g = torch.Generator().manual_seed(1)
    k = torch.randn(32, D, generator=g) / D**0.25
    q = k + 0.1 * torch.randn(32, D, generator=g) / D**0.25
    fm = spec.build(D, D, seed=0, dtype=torch.float32)
    before = [p.detach().clone() for p in fm.parameters()]
    spec.ready(fm, q, k, steps=3, seed=0)
    assert any(not torch.equal(a, b) for a, b in zip(before, fm.parameters(), strict=True))
    monkeypatch.delattr(ka.training, "fit_feature_map")
    with pytest.raises(NotImplementedError, match="fit_feature_map"):
        spec.ready(spec.build(D, D, seed=0), q, k, steps=3)


def test_oprf_log_relative_variance() -> None:
    t = np.array([0.5, 4.0, 30.0, 300.0])
    # A = 0 is FAVOR+: log(e^t - 1)
    np.testing.assert_allclose(league.oprf_log_relvar(t, 64, A=np.zeros_like(t)), np.log(np.expm1(t)), rtol=1e-12)
    assert (league.oprf_log_relvar(t, 64) <= np.log(np.expm1(t)) + 1e-12).all()
    mse = getattr(ka.theory, "oprf_mse", None)
    if mse is None:
        pytest.skip("ka.theory.oprf_mse is not available")
    g = torch.Generator().manual_seed(2)
    x = 0.8 * torch.randn(5, 64, generator=g, dtype=torch.float64) / 64**0.25
    y = 0.8 * torch.randn(5, 64, generator=g, dtype=torch.float64) / 64**0.25
    tt = ((x[:, None] + y[None]) ** 2).sum(-1).numpy()
    lib = np.log(np.asarray(mse(x, y, 1, A=None))) - 2 * (x @ y.T).numpy()
    np.testing.assert_allclose(league.oprf_log_relvar(tt, 64), lib, rtol=1e-9, atol=1e-9)


def test_ranking_against_uniform_needs_more_than_the_margin() -> None:
    """A map 0.05% better than uniform weights on every draw is significant but within the 1%
    margin: a tie; 5% better on every draw: beats."""
    rng = np.random.default_rng(0)
    base = np.exp(rng.normal(-0.2, 0.05, size=12))
    jitter = 1 + 1e-4 * rng.standard_normal(12)

    def rows(ratio: float) -> pd.DataFrame:
        return pd.DataFrame([
            {"label": league.UNIFORM_LABEL, "mode": "baseline", "feature_dim": 0,
             "draw_values": json.dumps(base.tolist())},
            {"label": "hedgehog", "mode": "equal_F", "feature_dim": 256,
             "draw_values": json.dumps((base * ratio * jitter).tolist())}])

    res = league.ranking(rows(0.9995), what="attention error")
    assert res is not None and res[1] is not None
    assert res[1].label == "ties" and res[1].evidence["equivalent"] is True
    assert res[1].evidence["pairs"][0]["significant"] is True  # significant, yet a tie
    res = league.ranking(rows(0.95), what="attention error")
    assert res is not None and res[1] is not None and res[1].label == "beats"
