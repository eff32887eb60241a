"""The real-attention study's paired verdicts and intervals on hand-made frames in the format of
its ``results.csv``: the verdicts follow the data (a lower error becomes "beats", an equal one a
tie) and the intervals are the stated ones.

No model is loaded: the frames are built here.
"""

from __future__ import annotations

import math

import numpy as np
import pandas as pd
import pytest

from studies import real_attention as ra

LAYERS, HEADS, DRAWS = 6, 12, 8
N_HEADS = LAYERS * HEADS
#: per-head spread of the log-error differences; the margin below is 0.3
SPREAD, MARGIN = 0.1, 0.3


def _uniform_errors() -> np.ndarray:
    """Uniform-weights error per head, shape (72,), between 0.4 and 0.9."""
    return 0.4 + 0.5 * np.arange(N_HEADS) / (N_HEADS - 1)


def _noise(seed: int) -> np.ndarray:
    """Per-head offsets of exact mean 0 and standard deviation ``SPREAD``, shape (72,)."""
    w = np.random.default_rng(seed).normal(size=N_HEADS)
    w = (w - w.mean()) / w.std(ddof=1)
    return SPREAD * w


def _rows(est: str, r: int, log_err: np.ndarray) -> list[dict]:
    """Rows of one head cell: ``log_err`` (72, draws) -> per-head means and per-draw rows."""
    err = np.exp(log_err)
    rows = []
    for i in range(N_HEADS):
        layer, head = divmod(i, HEADS)
        base = {"kind": "heads", "estimator": est, "r": r, "layer": layer, "head": head, "feature_dim": r}
        rows.append({**base, "metric": "out_rel_err", "mean": float(err[i].mean()),
                     "ci_low": float(err[i].min()), "ci_high": float(err[i].max()),
                     "n_draws": err.shape[1]})
        rows += [{**base, "metric": "out_rel_err_draw", "mean": float(err[i, s]), "ci_low": float(err[i, s]),
                  "ci_high": float(err[i, s]), "n_draws": 1, "draw": s} for s in range(err.shape[1])]
    return rows


def _frame(positive_shift: float, *, inf_head: bool = False) -> pd.DataFrame:
    """uniform (1 draw), ``positive`` and ``oprf`` at r = 256 (8 draws).

    Per head, the mean over draws of log error is: uniform + ``positive_shift`` + offsets for
    ``positive``; uniform + other offsets (mean 0 over heads) for ``oprf``. Within a head the
    draws add ±0.05 alternately, which cancels in the mean over the 8 draws.
    """
    u = np.log(_uniform_errors())
    within = 0.05 * np.where(np.arange(DRAWS) % 2 == 0, 1.0, -1.0)  # sums to 0 over the draws
    pos = (u + positive_shift + _noise(1))[:, None] + within[None, :]
    opr = (u + _noise(2))[:, None] + within[None, :]
    if inf_head:
        opr[5, 3] = math.inf
    rows = _rows("uniform", 0, u[:, None]) + _rows("positive", 256, pos) + _rows("oprf", 256, opr)
    rows.append({"kind": "norms", "estimator": "", "r": 0, "metric": "entropy_uniform", "mean": math.log(512),
                 "ci_low": math.log(512), "ci_high": math.log(512), "n_draws": 1, "layer": 0, "head": 0,
                 "d": 32})
    return pd.DataFrame(rows)


def test_lower_errors_beat_uniform_and_rank_first() -> None:
    """positive's log error is MARGIN lower on average: ranked first, beats uniform; oprf ties.

    Tolerance derivation: the per-head differences positive − uniform have mean −MARGIN = −0.3 and
    standard deviation SPREAD = 0.1, so their standard error is 0.1/√72 = 0.0118 and the
    t statistic is −25. The Holm-corrected interval is at level 1 − 0.05/3 at the widest, half
    width t_{0.9917, 71} · 0.0118 ≈ 0.029 < 0.3: it excludes 0 with margin. oprf − uniform has a
    mean of exactly 0 (offsets centred), so t = 0, p = 1 and every interval contains 0.
    """
    res = ra.rankings(_frame(-MARGIN))
    vs = res["vs_uniform"]
    assert vs.label == "beats"
    assert vs.evidence["best"] == "positive"
    assert vs.evidence["diff"] == pytest.approx(-MARGIN, abs=1e-9)
    assert vs.evidence["ci_high"] < 0
    assert vs.evidence["ci_high"] - vs.evidence["diff"] < 0.04  # half width ≈ 0.029 (docstring)
    ranking = res["at_r8"]
    assert ranking.evidence["rank"] == {"positive": 1, "oprf": 2, "uniform": 2}
    assert ranking.label == "ties"  # oprf and uniform cannot be separated
    assert "positive beats" in ranking.statement
    assert ("oprf ties uniform" in ranking.statement) or ("uniform ties oprf" in ranking.statement)
    fav = res["favor_vs_uniform"]
    assert fav is not None and fav.label == "beats"
    assert res["left_out_r8"] == []


def test_equal_errors_give_a_tie() -> None:
    """The same frame with no shift: positive − uniform has mean exactly 0 (centred offsets), p = 1:
    no estimator beats uniform weights, and all three share rank 1."""
    res = ra.rankings(_frame(0.0))
    vs = res["vs_uniform"]
    assert vs.label == "ties"
    assert vs.statement.startswith("no estimator beats uniform")
    assert vs.evidence["ci_low"] < 0 < vs.evidence["ci_high"]
    assert res["at_r8"].evidence["rank"] == {"positive": 1, "oprf": 1, "uniform": 1}
    assert res["favor_vs_uniform"].label == "ties"


def test_higher_errors_are_worse() -> None:
    """positive's log error MARGIN higher: it is ranked below both others (same derivation as the
    first test, sign flipped), and uniform still is not beaten (oprf, the best, ties it)."""
    res = ra.rankings(_frame(+MARGIN))
    assert res["at_r8"].evidence["rank"]["positive"] == 3
    assert res["vs_uniform"].label == "ties"
    assert res["favor_vs_uniform"].label == "worse"


def test_non_finite_head_is_left_out() -> None:
    """An infinite error on one head of oprf (a signed map's 0/0 row) keeps it out of the paired
    comparisons, and the ranking of the others is unchanged."""
    res = ra.rankings(_frame(-MARGIN, inf_head=True))
    assert res["left_out_r8"] == ["oprf"]
    assert res["at_r8"].evidence["rank"] == {"positive": 1, "uniform": 2}
    assert res["vs_uniform"].label == "beats"


def test_table_intervals() -> None:
    """The key table's intervals: the median's bootstrap interval brackets it, and the share of heads
    worse than uniform has its Clopper-Pearson interval.

    With a shift of −2·MARGIN = −0.6, positive is below uniform on every head: a head's mean error
    over draws is exp(log uniform − 0.6 + offset)·cosh(0.05), below uniform while the offset is
    below 0.6 − 0.0012, i.e. 6 SPREAD (the premise is asserted, not assumed). So 0 of 72 heads are
    worse, and the exact interval is [0, 1 − 0.025^{1/72}] = [0, 0.04995].
    """
    df = _frame(-2 * MARGIN)
    t = ra.features_needed(df).set_index("estimator")
    heads = df[(df["metric"] == "out_rel_err")].pivot_table(index=["layer", "head"], columns="estimator",
                                                            values="mean")
    assert (heads["positive"] < heads["uniform"]).all()  # the premise of the share
    share = t.loc["positive", "share of heads worse than uniform at r=256"]
    assert share == 0.0
    lo, hi = (float(x) for x in t.loc["positive", "share 95% CI"].strip("[]").split(", "))
    assert lo == 0.0
    assert hi == pytest.approx(1 - 0.025 ** (1 / 72), rel=2e-3)  # printed to 3 significant digits
    for est in ("positive", "oprf", "uniform"):
        col = "95% CI at r=256"
        m = t.loc[est, "median err at r=256"]
        lo, hi = (float(x) for x in t.loc[est, col].strip("[]").split(", "))
        assert lo <= m <= hi, (est, lo, m, hi)
    # the median over heads x draws: for uniform, one value per head
    u = _uniform_errors()
    assert t.loc["uniform", "median err at r=256"] == pytest.approx(float(np.median(u)))


def _spread_frame(values: dict[tuple[str, int], np.ndarray]) -> pd.DataFrame:
    """One row per head (72 heads, one draw) with the given per-head errors, plus uniform
    weights at 0.7 and the sequence length."""
    rows = []
    for (est, r), err in values.items():
        rows += _rows(est, r, np.log(err)[:, None])
    rows += _rows("uniform", 0, np.log(np.full(N_HEADS, 0.7))[:, None])
    rows.append({"kind": "norms", "estimator": "", "r": 0, "metric": "entropy_uniform",
                 "mean": math.log(512), "ci_low": math.log(512), "ci_high": math.log(512),
                 "n_draws": 1, "layer": 0, "head": 0, "d": 32})
    return pd.DataFrame(rows)


def test_target_call_follows_the_interval_not_the_point() -> None:
    assert ra.target_call(0.159, 0.0777, 0.533, 0.25) == "undecided"  # the point is below 0.25
    assert ra.target_call(0.159, 0.10, 0.20, 0.25) == "met"
    assert ra.target_call(0.40, 0.30, 0.50, 0.25) == "missed"
    assert ra.target_call(0.20, 0.10, math.inf, 0.25) == "undecided"


def test_r_for_target_is_undecided_when_the_median_interval_crosses_it() -> None:
    """A median of 0.24 whose heads spread from 0.02 to 0.6: the point-estimate rule said
    "reached at r = 64"; the interval crosses 0.25, so it is undecided there, and met at r = 256
    where every head is at 0.05."""
    rng = np.random.default_rng(0)
    wide = rng.permutation(np.linspace(0.02, 0.46, N_HEADS))
    df = _spread_frame({("x", 64): wide, ("x", 256): np.full(N_HEADS, 0.05)})
    t = ra.features_needed(df).set_index("estimator")
    assert float(np.median(wide)) < 0.25  # the premise: the old rule would have printed 64
    assert t.loc["x", "r for err<=0.25"] == "256; undecided at r = 64"
    df2 = _spread_frame({("x", 64): wide})
    t2 = ra.features_needed(df2).set_index("estimator")
    assert t2.loc["x", "r for err<=0.25"] == "undecided at r = 64; not met"
    df3 = _spread_frame({("x", 64): np.full(N_HEADS, 0.2)})
    assert ra.features_needed(df3).set_index("estimator").loc["x", "r for err<=0.25"] == "64"


def test_rank_ranges_print_ties_as_overlapping_ranges() -> None:
    tie = ra.rankings(_frame(0.0))["at_r8"]
    assert set(ra.rank_ranges(tie).values()) == {"1–3"}  # nothing separates the three
    sep = ra.rankings(_frame(-MARGIN))["at_r8"]
    rr = ra.rank_ranges(sep)
    assert rr["positive"] == "1" and rr["uniform"] == "2–3" and rr["oprf"] == "2–3"


def test_layer_advice_by_the_rule() -> None:
    """Layer 0 meets 0.25 (every head at 0.1), layer 1 is undecided (heads spread across 0.25),
    layer 2 misses (every head at 0.6)."""
    err = np.empty(N_HEADS)
    err[:HEADS] = 0.1
    err[HEADS:2 * HEADS] = np.linspace(0.05, 0.5, HEADS)
    err[2 * HEADS:] = 0.6
    adv = {a["layer"]: a for a in ra.layer_advice(_spread_frame({("x", 64): err}))}
    assert adv[0]["met"] is not None and adv[0]["met"]["r"] == 64
    assert adv[1]["met"] is None and [u["estimator"] for u in adv[1]["undecided"]] == ["x"]
    assert adv[2]["met"] is None and adv[2]["undecided"] == []
