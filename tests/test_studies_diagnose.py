"""The diagnose-validation study: a quick-mode run (output files, CSV metrics, summary) and the
claims it rests on: at small inputs ka.diagnose's predicted median relative kernel MSE matches the
measurement within ×2 for every random estimator and linear_attention stays silent; where FAVOR+
fails (σ = 1.5 at d = 16) the KernelApproxWarning fires.

The study is run once (module-scoped fixture, a few seconds) into a temporary folder.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from studies import STUDY_MODULES
from studies import diagnose_validation as dv
from studies._framework import ROW_KEYS, load_studies, run_study

METRICS = {"pred_rel_mse_median", "pred_all_pairs_median", "meas_rel_mse_median", "ratio",
           "ratio_all_pairs", "within_2x", "attn_rel_err", "uniform_attn_rel_err",
           "normaliser_rel_var", "delta_method_valid", "quick_pred", "warned", "worse_than_uniform"}


@pytest.fixture(scope="module")
def report(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("reports")
    return run_study(dv.STUDY, out=out, quick=True, progress=False, use_cache=False)


@pytest.fixture(scope="module")
def df(report: Path) -> pd.DataFrame:
    return pd.read_csv(report / "results.csv")


@pytest.fixture(scope="module")
def w(df: pd.DataFrame) -> pd.DataFrame:
    return dv.wide(df)


def test_registered() -> None:
    assert "diagnose_validation" in STUDY_MODULES
    assert "diagnose-validation" in load_studies()


def test_outputs(report: Path, df: pd.DataFrame) -> None:
    assert (report / "measured_vs_predicted.png").exists()
    assert set(ROW_KEYS) <= set(df.columns)
    assert METRICS <= set(df["metric"]), METRICS - set(df["metric"])
    summary = (report / "summary.md").read_text()
    for phrase in ("## Key results", "## Warning hit/miss", "## Finding", "within ×2"):
        assert phrase in summary, phrase
    finding = summary.split("## Finding", 1)[1]
    assert finding.count("\n- ") >= 4 and any(ch.isdigit() for ch in finding)
    prov = json.loads((report / "provenance.json").read_text())
    assert prov["quick"] is True and prov["n_cells"] == len(dv.grid(True))


def test_every_random_estimator_of_each_regime(w: pd.DataFrame) -> None:
    regimes = w["regime_label"].unique()
    assert len(regimes) == len(dv.grid(True))
    per = w.groupby("regime_label")["estimator"].nunique()
    assert (per >= 3).all() and per.nunique() == 1  # the same diagnosis rows everywhere
    assert {"positive", "trig-sincos"} <= set(w["estimator"])
    assert (w["S"] == dv.S_QUICK).all() and (w["r"] == dv.R_QUICK).all()
    assert np.isfinite(w[["pred_rel_mse_median", "meas_rel_mse_median", "ratio"]].to_numpy(float)).all()
    np.testing.assert_allclose(w["ratio"], w["meas_rel_mse_median"] / w["pred_rel_mse_median"], rtol=1e-9)
    assert ((w["within_2x"] == 1) == ((w["ratio"] >= 0.5) & (w["ratio"] <= 2))).all()


def test_small_inputs_predicted_within_2x_and_silent(w: pd.DataFrame) -> None:
    small = w[(w["regime"] == "gaussian") & (w["sigma"] == min(dv.SIGMAS_QUICK))]
    assert len(small)
    assert small["ratio"].between(0.5, 2.0).all(), small[["estimator", "ratio"]]
    assert (small["warned"] == 0).all()
    assert (small["quick_pred"] < 1.0).all()


def test_warning_fires_where_favor_fails(w: pd.DataFrame) -> None:
    big = w[(w["regime"] == "gaussian") & (w["sigma"] == max(dv.SIGMAS_QUICK))]
    pos = big[big["estimator"] == "positive"]
    assert len(pos) == 1
    assert float(pos["warned"].iloc[0]) == 1.0
    assert float(pos["attn_rel_err"].iloc[0]) > float(pos["uniform_attn_rel_err"].iloc[0])
    assert float(pos["delta_method_valid"].iloc[0]) == 0.0
    # heavy tails: the S-draw measurement falls far below the closed-form expectation
    assert float(pos["ratio"].iloc[0]) < 0.5
    # no false alarm in the quick grid: every warned row is worse than uniform weights
    warned = w[w["warned"] == 1]
    assert len(warned) and (warned["worse_than_uniform"] == 1).all()
