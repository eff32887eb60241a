"""Quick-mode runs of the studies attention-error, cost-crossover, state-capacity and qr-sign-bias.

Each study runs once (module-scoped fixture) in ``--quick`` mode into a temporary folder through
the framework's runner; the tests then check the outputs' structure and a few of their numbers.
Small unit tests cover the helpers the numbers rest on.
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch

from studies import attention_error, cost_crossover, qr_sign_bias, state_capacity
from studies._engine import ROW_KEYS, run_study

STUDIES = {
    "attention-error": attention_error.STUDY,
    "cost-crossover": cost_crossover.STUDY,
    "state-capacity": state_capacity.STUDY,
    "qr-sign-bias": qr_sign_bias.STUDY,
}


@pytest.fixture(scope="module")
def reports(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    out = tmp_path_factory.mktemp("reports")
    old = torch.get_num_threads()
    torch.set_num_threads(min(old, 2))
    try:
        return {name: run_study(s, out=out, quick=True, progress=False)
                for name, s in STUDIES.items()}
    finally:
        torch.set_num_threads(old)


def _df(reports: dict[str, Path], name: str) -> pd.DataFrame:
    return pd.read_csv(reports[name] / "results.csv")


@pytest.mark.parametrize("name", sorted(STUDIES))
def test_outputs_structure(reports: dict[str, Path], name: str) -> None:
    folder = reports[name]
    df = _df(reports, name)
    assert len(df) > 0
    for col in ROW_KEYS:
        assert col in df.columns
    assert (df["n_draws"] >= 1).all()
    finite = df[np.isfinite(df["mean"])]
    assert (finite["ci_low"] <= finite["mean"] + 1e-12).all()
    assert (finite["ci_high"] >= finite["mean"] - 1e-12).all()
    pngs = sorted(folder.glob("*.png"))
    assert pngs, "no figures"
    for p in pngs:
        assert p.with_suffix(".svg").exists()
        assert p.stat().st_size > 10_000
    assert (folder / STUDIES[name].headline).exists()
    summary = (folder / "summary.md").read_text()
    assert "## Key results" in summary and "## Finding" in summary
    finding = summary.split("## Finding", 1)[1].split("## Provenance", 1)[0]
    assert any(ch.isdigit() for ch in finding), "the finding must quote numbers"
    assert "No rows to summarise" not in finding
    assert (folder.parent / "README.md").exists()


# ---------------------------------------------------------------------------------------------
# qr-sign-bias
# ---------------------------------------------------------------------------------------------
def test_qr_sign_bias_numbers(reports: dict[str, Path]) -> None:
    df = _df(reports, "qr-sign-bias")
    peers = df[(df.metric == "row_mean") & (df.direction == "peers")]
    unc = peers[peers.variant == "uncorrected-cols"].sort_values("row")
    cor = peers[peers.variant == "corrected"].sort_values("row")
    # NumPy's QR gives 0.32, 0.63, 1.21, 1.12 (d = 4, x = (1, .5, -.3, .2), NumPy's QR, 20k
    # draws). The tolerance is not a standard error: LAPACK builds differ in the sign conventions
    # that produce the bias (jax.numpy gives 0.32, 0.62, 1.22, 1.16 for the same x), so
    # the check is "the same bias pattern, within the spread between implementations" (0.04),
    # plus this run's own 4 standard errors.
    se = (unc["ci_high"] - unc["ci_low"]) / (2 * 1.96)
    assert (np.abs(unc["mean"].to_numpy() - [0.32, 0.63, 1.21, 1.12]) <= 0.04 + 4 * se.to_numpy()).all()
    assert unc["ci_high"].iloc[0] < 0.5  # row 0: far outside its CI
    # the corrected sampler: every row's CI is compatible with 1 at the Bonferroni level
    assert (np.abs(cor["z"]) < 4.0).all()
    zmax = df[df.metric == "max_abs_row_z"]
    assert (zmax[zmax.variant == "corrected"]["mean"] < 4.5).all()
    assert (zmax[zmax.variant.str.startswith("uncorrected")]["mean"] > 10).all()


def test_uncorrected_projection_is_orthogonal_with_fixed_signs() -> None:
    g = torch.Generator().manual_seed(0)
    W = qr_sign_bias.uncorrected_projection(500, 4, g)
    dirs = W / W.norm(dim=-1, keepdim=True)
    eye = torch.eye(4, dtype=torch.float64).expand(500, 4, 4)
    torch.testing.assert_close(dirs @ dirs.mT, eye, atol=1e-12, rtol=0)
    # LAPACK QR: the first coordinate of the first column of Q has one sign in every draw
    s = torch.sign(W[:, 0, 0])
    assert abs(float(s.mean())) == 1.0


# ---------------------------------------------------------------------------------------------
# attention-error
# ---------------------------------------------------------------------------------------------
def test_attention_error_numbers(reports: dict[str, Path]) -> None:
    df = _df(reports, "attention-error")
    assert {"rel_err", "tv", "frac_den_nonpos", "rel_err_median", "rel_err_diff", "attn_entropy",
            "attn_max_weight", "t_bar", "rel_err_theory"} <= set(df.metric)
    gauss = df[df.data == "gaussian"]
    pos = df[df.estimator.isin(["positive", "oprf"]) & (df.metric == "frac_den_nonpos")]
    assert len(pos) and (pos["mean"] == 0).all()
    trig = gauss[gauss.estimator.str.startswith("trig") & (gauss.metric == "frac_den_nonpos")]
    assert trig[trig.sigma == 1.0]["mean"].max() > 0.05  # standard regime: signed denominators
    # mild regime: FAVOR+ (iid) improves with r, separated 95% CIs (not just means); the orthogonal
    # sampler's means fall too (3 draws at n = 1024 are too few for separated CIs)
    mild = gauss[(gauss.estimator == "positive") & (gauss.metric == "rel_err") & (gauss.sigma == 0.5)]
    for (_, key), s in mild.groupby(["n", "spec"]):
        s = s.sort_values("r")
        assert s["mean"].iloc[-1] < s["mean"].iloc[0]
        if key == "positive-gaussian":
            assert s["ci_high"].iloc[-1] < s["ci_low"].iloc[0]
    # equal feature dimension: F = 2r for hyperbolic and sin/cos, r for positive and OPRF
    err = df[(df.metric == "rel_err") & (df.sampler != "none")]
    two = err.estimator.isin(["trig-sincos", "hyperbolic"])
    assert (err[two]["feature_dim"] == 2 * err[two]["r"]).all()
    assert (err[~two]["feature_dim"] == err[~two]["r"]).all()
    # the regimes are what the study says: near-uniform gaussian rows (entropy close to ln n),
    # peaked planted rows (own key carries most of the weight); these are exact-attention
    # statistics of the data, so the bounds hold by a wide margin (n = 256: 5.05 / 5.55 and
    # 1.33 / 5.55 nats; largest weight 0.82): a construction bug (k independent of q) fails them
    uni = df[df.spec == "uniform"].set_index(["metric", "n", "data", "sigma"])["mean"]
    for n in sorted(df.n.unique()):
        assert uni.loc[("attn_entropy", n, "gaussian", 0.5)] > 0.95 * math.log(n)
        assert uni.loc[("attn_entropy", n, "gaussian", 1.0)] > 0.85 * math.log(n)
        assert uni.loc[("attn_entropy", n, "planted", 1.0)] < 0.6 * math.log(n)
        assert uni.loc[("attn_max_weight", n, "planted", 1.0)] > 0.5
        # t_bar = mean |q + k|^2 = 2 sigma^2 sqrt(d) = 16 at sigma = 1 (sd of the mean over
        # 2 heads x n^2 pairs x draws is < 0.1): the e^16 of the summary
        assert abs(uni.loc[("t_bar", n, "gaussian", 1.0)] - 16.0) < 0.5
    # the uniform-weights baseline: a proper distance, smaller when attention is flatter
    tv = uni.loc["tv"]
    assert ((tv > 0) & (tv < 1)).all()
    for n in sorted(df.n.unique()):
        assert tv.loc[(n, "gaussian", 0.5)] < tv.loc[(n, "gaussian", 1.0)] < tv.loc[(n, "planted", 1.0)]
    # deterministic maps: one value per (n, regime), TV is a proper distance in [0, 1]
    elu = df[(df.estimator == "elu") & (df.metric == "tv")]
    assert len(elu) == elu.groupby(["n", "data", "sigma"]).ngroups
    assert ((elu["mean"] > 0) & (elu["mean"] <= 1)).all()
    # paired differences use the same draws: the mean of the per-draw differences is the
    # difference of the means (exact up to rounding; a sign or pairing bug breaks it)
    means = df[df.metric == "rel_err"].set_index(["n", "data", "sigma", "spec", "r"])["mean"]
    diffs = df[df.metric == "rel_err_diff"]
    assert len(diffs)
    for x in diffs.itertuples():
        a, b = x.spec.split(" - ")
        want = means.loc[(x.n, x.data, x.sigma, a, x.r)] - means.loc[(x.n, x.data, x.sigma, b, x.r)]
        assert abs(x.mean - want) <= 1e-9 * (1 + abs(want))
    # delta-method theory of iid features scales exactly as 1/sqrt(r)
    th = df[df.metric == "rel_err_theory"]
    scaled = (th["mean"] * np.sqrt(th["r"])).groupby([th.data, th.sigma, th.spec])
    assert ((scaled.max() / scaled.min() - 1).abs() < 1e-12).all()
    # FAVOR++ per-entry relative variance of the summary = the library's closed form
    import kernelapprox as ka

    d, r = 64, 256
    rng = np.random.default_rng(0)
    for t in (4.0, 16.0):
        x = rng.standard_normal(d)
        x *= math.sqrt(t) / 2 / np.linalg.norm(x)  # |x + x|^2 = t
        K2 = math.exp(2 * float(x @ x))
        for name, fn in (("oprf", ka.theory.oprf_mse), ("positive", ka.theory.positive_mse)):
            want = fn(x[None], x[None], r)[0, 0] * r / K2
            assert math.isclose(attention_error.relvar_times_r(t, d, name), want, rel_tol=1e-9)
    # findings are bullets with numbers, one per line
    summary = (reports["attention-error"] / "summary.md").read_text()
    finding = summary.split("## Finding", 1)[1].split("\n## ", 1)[0].strip().splitlines()
    assert len(finding) >= 5 and all(ln.lstrip().startswith("- ") for ln in finding if ln.strip())
    assert "holds" in summary and "r =" in summary


# ---------------------------------------------------------------------------------------------
# state-capacity
# ---------------------------------------------------------------------------------------------
def test_state_capacity_numbers(reports: dict[str, Path]) -> None:
    df = _df(reports, "state-capacity")
    assert set(df["beta"]) == set(state_capacity.BETAS_QUICK)  # the beta sweep ran
    main = df[np.isclose(df["beta"], state_capacity.BETA)]
    acc = main[main.metric == "accuracy"]
    sm = acc[acc.method == "softmax"]
    assert len(sm) and (sm["mean"] >= 0.99).all()  # exact attention solves the task at beta = 8
    lin = acc[acc.method == "linear"]
    big = lin[lin.n == lin.n.max()]
    assert (big["mean"] < 0.5).all()  # the fixed-size state has collapsed at the largest n
    at64 = lin[lin.n == 64].set_index("r")
    # more features, more recall: separated 95% CIs
    assert at64["ci_low"].loc[at64.index.max()] > at64["ci_high"].loc[at64.index.min()]
    n50 = main[main.metric == "n50"]
    assert set(n50["method"]) == {"softmax", "linear", "elu"}
    # beta matters: at beta = 2 exact softmax itself collapses within n <= 1024 (its n50 is
    # bracketed), while at beta = 8 it recalls every pair; a study that ignored beta would not
    sm2 = df[(df.metric == "n50") & (df.method == "softmax") & np.isclose(df["beta"], 2.0)]
    assert (sm2["bracket"] == "interp").all() and len(sm2) == 1
    summary = (reports["state-capacity"] / "summary.md").read_text()
    assert "at least 100" not in summary and "100 % of the queried pairs at every n" in summary
    assert "Schlag" in summary and "4β = 32" in summary


def test_recall_linear_matches_parallel_readout() -> None:
    import kernelapprox as ka

    task = state_capacity.make_task(40, 8, 3, seed=1)
    keys, values, idx = task["keys"], task["values"], task["idx"]
    queries = torch.gather(keys, 1, idx.unsqueeze(-1).expand(-1, -1, state_capacity.D))
    fm = ka.PositiveRF(state_capacity.D, 32, sampler="orthogonal", seed=0, batch_shape=(3,),
                       dtype=torch.float64)
    got = state_capacity.recall_linear(keys, values, queries, fm)
    ref = ka.linear_attention(queries, keys, values, fm)
    torch.testing.assert_close(got, ref, rtol=1e-10, atol=1e-12)
    acc = state_capacity.decode_accuracy(values.gather(1, idx.unsqueeze(-1).expand(-1, -1, 8)),
                                         values, idx)
    assert torch.equal(acc, torch.ones(3, dtype=torch.float64))


# ---------------------------------------------------------------------------------------------
# cost-crossover
# ---------------------------------------------------------------------------------------------
def test_cost_crossover_numbers(reports: dict[str, Path]) -> None:
    df = _df(reports, "cost-crossover")
    x = df[df.metric == "crossover_flops"].set_index("method")
    # 4nd^2 vs 4n^2 d crosses at n = d, 8nrd at n = 2r
    assert x.loc["count-4nd2", "mean"] == pytest.approx(cost_crossover.D, rel=1e-6)
    r = int(x["r"].iloc[0])
    assert x.loc["count-8nrd", "mean"] == pytest.approx(2 * r, rel=1e-6)
    assert r <= x.loc["linear", "mean"] <= 4 * r
    meas = df[df.metric == "crossover_time"]
    assert set(meas["method"]) == {"linear", "linear-causal"}
    assert meas["bracket"].notna().all()  # either a value or a stated bracket
    t = df[df.metric == "time_s"]
    assert set(t["method"]) == set(cost_crossover.METHODS)
    assert (t["mean"] > 0).all()
    summary = (reports["cost-crossover"] / "summary.md").read_text()
    assert "Crossover sequence length" in summary
    mem = df[df.metric == "peak_mem_bytes"]
    if Path("/proc/self/clear_refs").exists():
        assert set(mem["method"]) == set(cost_crossover.METHODS)


def test_crossover_interpolation() -> None:
    ns = np.array([128.0, 256.0, 512.0])
    x, how = cost_crossover._crossover(ns, np.array([4.0, 2.0, 0.5]))
    assert how == "interpolated"
    assert x == pytest.approx(256 * 2 ** 0.5, rel=1e-9)  # ratio 1 midway (log) in [256, 512]
    assert cost_crossover._crossover(ns, np.array([4.0, 2.0, 1.5]))[1] == "> 512"
    assert cost_crossover._crossover(ns, np.array([0.5, 0.2, 0.1]))[1] == "<= 128"
    assert math.isnan(cost_crossover._crossover(ns, np.array([4.0, 2.0, 1.5]))[0])
    # a dip below 1 that larger n do not keep is not a crossover (the r = 64 memory row once
    # read "<= 128" from peaks of 0.03 against 0.13 MiB at n = 128, linear above SDPA beyond)
    assert cost_crossover._crossover(ns, np.array([0.5, 2.0, 1.5]))[1] == "> 512"
    x, how = cost_crossover._crossover(ns, np.array([0.5, 2.0, 0.5]))
    assert how == "interpolated" and x == pytest.approx(256 * 2 ** 0.5, rel=1e-9)


def test_attention_error_difference_verdicts_flip() -> None:
    """Holm-corrected verdicts of the committed paired differences: a cell moved to
    −0.5 with a half-width of 0.02 differs (t ≈ 0.5 / (0.02 / 2.04) ≈ 51 over 31 degrees of
    freedom, p far below the Holm threshold α / 54), and one set to 0 ± 0.001 agrees (a tie
    within 0.01: its Holm-level interval is at most ≈ 1.9× the 95% one, about ± 0.002)."""
    df = pd.read_csv(Path(__file__).resolve().parent.parent
                     / "reports/attention-error/results.csv")
    dd = df[(df.metric == "rel_err_diff") & (df.comparison == attention_error.COMPARISONS[0][2])]
    dd = dd.reset_index(drop=True)
    v = attention_error.comparison_verdicts(dd)
    i = next(k for k, x in enumerate(v) if x.label == "inconclusive")
    assert all(x.evidence["p_adj"] >= x.evidence["p"] for x in v)

    moved = dd.copy()
    moved.loc[i, ["mean", "ci_low", "ci_high"]] = [-0.5, -0.52, -0.48]
    mv = attention_error.comparison_verdicts(moved)
    assert mv[i].label == "differs" and mv[i].evidence["estimate"] < 0

    tie = dd.copy()
    tie.loc[i, ["mean", "ci_low", "ci_high"]] = [0.0, -0.001, 0.001]
    assert attention_error.comparison_verdicts(tie)[i].label == "agrees"
