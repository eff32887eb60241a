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
from studies._framework import ROW_KEYS, run_study

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
    # the reference sheet's 0.32, 0.63, 1.21, 1.12 (d = 4, x = (1, .5, -.3, .2), NumPy's QR, 20k
    # draws). The tolerance is not a standard error: LAPACK builds differ in the sign conventions
    # that produce the bias (peers.md: jax.numpy gives 0.32, 0.62, 1.22, 1.16 for the same x), so
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
    assert {"rel_err", "tv", "frac_den_nonpos", "rel_err_median"} <= set(df.metric)
    pos = df[(df.family == "positive") & (df.metric == "frac_den_nonpos")]
    assert len(pos) and (pos["mean"] == 0).all()
    trig = df[df.family.str.startswith("trig") & (df.metric == "frac_den_nonpos")]
    assert trig[trig.sigma == 1.0]["mean"].max() > 0.05  # standard regime: signed denominators
    # mild regime: the positive estimator improves with r
    sub = df[(df.family == "positive") & (df.metric == "rel_err") & (df.sigma == 0.5)]
    for _, s in sub.groupby("n"):
        s = s.sort_values("r")
        assert s["ci_high"].iloc[-1] < s["ci_low"].iloc[0]  # separated 95% CIs, not just means
    # deterministic maps: one value per (n, sigma), TV is a proper distance in [0, 1]
    elu = df[(df.family == "elu") & (df.metric == "tv")]
    assert len(elu) == elu.groupby(["n", "sigma"]).ngroups
    assert ((elu["mean"] > 0) & (elu["mean"] <= 1)).all()
    # the uniform-weights baseline: a proper distance, smaller when attention is flatter
    uni = df[(df.family == "uniform") & (df.metric == "tv")].set_index(["n", "sigma"])["mean"]
    assert ((uni > 0) & (uni < 1)).all()
    for n in {i[0] for i in uni.index}:
        assert uni.loc[(n, 0.5)] < uni.loc[(n, 1.0)]


# ---------------------------------------------------------------------------------------------
# state-capacity
# ---------------------------------------------------------------------------------------------
def test_state_capacity_numbers(reports: dict[str, Path]) -> None:
    df = _df(reports, "state-capacity")
    acc = df[df.metric == "accuracy"]
    sm = acc[acc.method == "softmax"]
    assert len(sm) and (sm["mean"] >= 0.99).all()  # exact attention solves the task
    lin = acc[acc.method == "linear"]
    big = lin[lin.n == lin.n.max()]
    assert (big["mean"] < 0.5).all()  # the fixed-size state has collapsed at the largest n
    at64 = lin[lin.n == 64].set_index("r")
    # more features, more recall: separated 95% CIs
    assert at64["ci_low"].loc[at64.index.max()] > at64["ci_high"].loc[at64.index.min()]
    n50 = df[df.metric == "n50"]
    assert set(n50["method"]) == {"softmax", "linear", "elu"}


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
    # the seed's 4nd^2 vs 4n^2 d crosses at n = d, the sheet's 8nrd at n = 2r
    assert x.loc["seed-linear", "mean"] == pytest.approx(cost_crossover.D, rel=1e-6)
    r = int(x["r"].iloc[0])
    assert x.loc["sheet-linear", "mean"] == pytest.approx(2 * r, rel=1e-6)
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
