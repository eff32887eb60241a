"""The verdicts of state-capacity (n50 ratios and exponents against stated margins) and of
estimator-league (tiers from paired per-draw differences, the best against uniform weights):
each follows its rule on synthetic results and prints the opposite when the data cross it.

References: Schlag, Irie & Schmidhuber (2021), "Linear Transformers Are Secretly Fast Weight
Programmers", ICML; S. Holm (1979), Scand. J. Stat. 6; D. J. Schuirmann (1987), J.
Pharmacokinet. Biopharm. 15.
"""

from __future__ import annotations

import json
import math

import numpy as np
import pandas as pd
import pytest

from studies import estimator_league as league
from studies import state_capacity as sc

NS = 2.0 ** np.arange(2, 13)  # the full grid of n


# ---------------------------------------------------------------------------------------------
# state-capacity
# ---------------------------------------------------------------------------------------------
def _curves(n50s: dict[tuple[int, int], float], *, draws: int = 12, sd: float = 0.03,
            seed: int = 0, beta: float = sc.BETA, method: str = "linear") -> list[dict]:
    """Accuracy rows acc(n) = 1/(1 + n/n50) + N(0, sd²) per draw (clipped to [0, 1]) for each
    (d_v, r) -> n50, with common noise across the curves at each n (shared draws)."""
    rng = np.random.default_rng(seed)
    noise = {n: rng.standard_normal(draws) for n in NS}
    recs = []
    for (dv, r), n50 in n50s.items():
        for n in NS:
            acc = np.clip(1 / (1 + n / n50) + sd * noise[n], 0, 1)
            recs.append({"metric": "accuracy", "method": method, "beta": beta, "r": r, "dv": dv,
                         "n": n, "draw_values": json.dumps(acc.tolist())})
    return recs


def _labels(vs: list) -> list[str]:
    return [v.label for v in vs]


# Tolerances. At n50 the curve 1/(1 + n/n50) falls by acc(1 - acc) = 1/4 per unit of ln n, and
# the mean accuracy of 12 draws with sd 0.03 has standard error 0.0087, so ln n50 has standard
# error ~0.0087 / 0.25 = 0.035 (0.05 in log2) and the 95% interval of a log2 ratio is at most
# ~±2·√2·0.05 = ±0.14 wide (less with the common noise): the margins ±0.5 are >3.5 such
# half-widths from a true log2 ratio of 0 or 2. The grid is in powers of 2, so a curve with 4x
# the n50 sits two grid steps over with the same interpolation error: ratios 1 and 4 are exact.
def test_dv_verdicts_follow_F_and_flip_to_F_dv_when_n50_grows_with_d_v() -> None:
    same = {(16, r): 0.45 * r for r in (16, 64, 256)} | {(64, r): 0.45 * r for r in (16, 64, 256)}
    v = sc.capacity_verdicts(pd.DataFrame(_curves(same)), n_boot=400)
    assert _labels(v["follows_F"]) == ["agrees"] * 3
    assert _labels(v["follows_F_dv"]) == ["differs"] * 3
    for x in v["follows_F"]:  # the interval is narrow, as derived above
        assert x.evidence["ci_high"] - x.evidence["ci_low"] < 0.3
    # n50 four times larger at d_v = 64 (the state size rules): the opposite verdicts
    grows = {(16, r): 0.45 * r for r in (16, 64, 256)} | {(64, r): 1.8 * r for r in (16, 64, 256)}
    v = sc.capacity_verdicts(pd.DataFrame(_curves(grows)), n_boot=400)
    assert _labels(v["follows_F"]) == ["differs"] * 3
    assert _labels(v["follows_F_dv"]) == ["agrees"] * 3
    # three noisy draws: the interval spans both margins, nothing is claimed
    noisy = sc.capacity_verdicts(pd.DataFrame(_curves(same, draws=3, sd=0.3, seed=2)), n_boot=400)
    assert "inconclusive" in _labels(noisy["follows_F"])
    for x in noisy["follows_F"]:
        if x.label == "inconclusive":  # wider than the 0.3 the 12 quiet draws resolve
            assert x.evidence["ci_high"] - x.evidence["ci_low"] > 0.3


def test_exponent_verdict_agrees_with_1_then_differs_at_p_07() -> None:
    # p is the slope of ln n50 on ln r over r = 16..1024 (ln r spread 4.16): with se(ln n50)
    # ~0.035 per r (above), se(p) ~0.035 / sqrt(sum (ln r - mean)^2) = 0.035 / 3.1 = 0.011, so
    # the 95% interval is ~±0.03, five times inside the tolerance 0.15 around p = 1 and far
    # outside it at p = 0.7.
    rs = (16, 64, 256, 1024)
    lin = sc.capacity_verdicts(pd.DataFrame(_curves({(64, r): 0.45 * r for r in rs})),
                               n_boot=400)
    (e,) = lin["exponent"]
    assert e.label == "agrees" and abs(e.evidence["estimate"] - 1.0) < 0.05
    sub = sc.capacity_verdicts(pd.DataFrame(_curves({(64, r): 2.0 * r**0.7 for r in rs})),
                               n_boot=400)
    (e,) = sub["exponent"]
    assert e.label == "differs" and abs(e.evidence["estimate"] - 0.7) < 0.05


def test_linear_with_softmax_at_small_beta_flips() -> None:
    def rows(lin_n50: float) -> pd.DataFrame:
        a = _curves({(sc.SWEEP_DV, 1024): lin_n50}, beta=1.0)
        b = _curves({(sc.SWEEP_DV, 0): 40.0}, beta=1.0, method="softmax")
        return pd.DataFrame(a + b)

    (v,) = sc.capacity_verdicts(rows(40.0), n_boot=400)["with_softmax"]
    assert v.label == "agrees"
    (v,) = sc.capacity_verdicts(rows(160.0), n_boot=400)["with_softmax"]  # log2 ratio 2
    assert v.label == "differs"


def test_n50_bootstrap_shares_the_resampled_draws_across_curves() -> None:
    # two curves with identical per-draw accuracies: a paired bootstrap gives identical
    # replicates (log2 ratio exactly 0 in every replicate), an unpaired one would not
    same = {(16, 64): 30.0, (64, 64): 30.0}
    n50, boots = sc.n50_bootstrap(pd.DataFrame(_curves(same)), n_boot=200)
    np.testing.assert_array_equal(boots[("linear", sc.BETA, 16, 64)],
                                  boots[("linear", sc.BETA, 64, 64)])
    ci = sc.log2_ratio(boots, n50, ("linear", sc.BETA, 64, 64), ("linear", sc.BETA, 16, 64))
    assert ci is not None
    est, lo, hi = ci
    assert est == lo == hi == 0.0
    assert (n50["n50_low"] <= n50["n50"]).all() and (n50["n50"] <= n50["n50_high"]).all()
    # the batch n50 is the loop's, replicate by replicate
    acc = np.random.default_rng(3).uniform(0, 1, (50, NS.size))
    acc[:, 0] = np.maximum(acc[:, 0], 0.5)
    loop = np.array([sc._n50(NS, a)[0] for a in acc])
    np.testing.assert_allclose(sc._n50_batch(NS, acc), loop, rtol=1e-12)


# ---------------------------------------------------------------------------------------------
# estimator-league
# ---------------------------------------------------------------------------------------------
def _orthonormal(n: int, k: int, seed: int) -> np.ndarray:
    """(n, k) columns of mean 0, sample sd 1, mutually orthogonal (exact t statistics)."""
    z = np.random.default_rng(seed).normal(size=(n, k))
    z -= z.mean(axis=0)
    q, _ = np.linalg.qr(z)
    return q * math.sqrt(n - 1)


def _league_rows(log_err: dict[str, np.ndarray]) -> pd.DataFrame:
    recs = []
    for name, le in log_err.items():
        mode = "baseline" if name == league.UNIFORM_LABEL else "equal_F"
        err = np.exp(le)
        recs.append({"metric": "attn_rel_err", "regime": "gaussian", "sigma": 2.0,
                     "label": name, "mode": mode, "target": 512.0 if mode == "equal_F" else np.nan,
                     "budget_r": np.nan, "feature_dim": 512, "estimator": name,
                     "mean": float(err.mean()), "draw_values": json.dumps(err.tolist())})
    return pd.DataFrame(recs)


# Tolerances: 12 draws, per-draw log errors base + effect + 0.05 z with orthonormal z, so each
# paired difference has sample sd 0.05·√2 and t = effect·√12 / (0.05·√2) exactly (up to the
# orthogonality of the columns); for effect 0.5 that is t = 24, far above the Holm threshold
# for 3 pairs (|t_11| > 3.2 at 0.05/3); for effect 0 the t statistic is 0.
def test_league_ranking_clear_winner_becomes_a_tie_when_shifted_to_the_runner_up() -> None:
    n = 12
    base = np.log(0.998) + 0.01 * np.random.default_rng(0).normal(size=n)
    z = _orthonormal(n, 3, seed=1)
    scores = {"A": base - 0.5 + 0.05 * z[:, 0], "B": base + 0.05 * z[:, 1],
              league.UNIFORM_LABEL: base + 0.05 * z[:, 2]}
    fam = league.family(_league_rows(scores), "gaussian", 2.0, "equal_F", 512.0)
    assert set(fam["label"]) == {"A", "B", league.UNIFORM_LABEL}
    res = league.ranking(fam, what="log attention error per draw")
    assert res is not None
    rank, base_v = res
    assert rank.evidence["rank"]["A"] == 1 and rank.evidence["rank"]["B"] == 2
    assert base_v is not None and base_v.label == "beats"
    assert base_v.statement.startswith(f"A beats {league.UNIFORM_LABEL}")
    # A's per-draw values shifted onto B's: the winner is gone, A and B tie, and no estimator
    # beats uniform weights (B vs uniform has effect 0)
    scores["A"] = scores["B"] + 0.05 * z[:, 0] - 0.05 * z[:, 0].mean()
    res = league.ranking(league.family(_league_rows(scores), "gaussian", 2.0, "equal_F", 512.0),
                         what="log attention error per draw")
    assert res is not None
    rank, base_v = res
    assert rank.label == "ties" and set(rank.evidence["rank"].values()) == {1}
    assert base_v is not None and base_v.label == "ties"
    assert base_v.statement.startswith(f"no estimator beats {league.UNIFORM_LABEL}")
    assert base_v.evidence["ci_low"] <= 0.0 <= base_v.evidence["ci_high"]


def test_league_ranking_reports_worse_than_uniform_and_skips_rows_without_draws() -> None:
    n = 12
    z = _orthonormal(n, 2, seed=4)
    base = np.log(0.8) + 0.01 * np.random.default_rng(5).normal(size=n)
    rows = _league_rows({"T": base + 6.0 + 0.05 * z[:, 0],
                         league.UNIFORM_LABEL: base + 0.05 * z[:, 1]})
    res = league.ranking(rows, what="log attention error per draw")
    assert res is not None and res[1] is not None
    assert res[1].label == "worse"  # the only estimator is worse than the baseline
    (p,) = res[1].evidence["pairs"]
    assert p["significant"] and p["diff"] == pytest.approx(6.0, abs=1e-9)
    rows.loc[rows["label"] == "T", "draw_values"] = np.nan  # an old results.csv: no per-draw values
    assert league.ranking(rows, what="x") is None


def test_tier_summary_names_a_lone_top_and_a_shared_one() -> None:
    """A method 10 sd better than the rest is alone in tier 1; two identical-in-distribution
    leaders share it. The wording follows the ranking, not a fixed string."""
    from studies.estimator_league import _tier_summary
    from studies.verdicts import paired_ranking

    rng = np.random.default_rng(0)
    noise = rng.normal(0, 0.01, (12, 3))
    alone = paired_ranking({"A": 0.5 + noise[:, 0], "B": 1.0 + noise[:, 1],
                            "C": 1.0 + noise[:, 2]})
    assert "tier 1 has one member" in _tier_summary(alone)
    shared = paired_ranking({"A": 0.5 + noise[:, 0], "B": 0.5 + noise[:, 1],
                             "C": 1.0 + noise[:, 2]})
    assert "tier 1 shared by 2" in _tier_summary(shared)
    ordered = paired_ranking({"A": 0.5 + noise[:, 0], "B": 1.0 + noise[:, 1],
                              "C": 1.5 + noise[:, 2]})
    assert _tier_summary(ordered).startswith("fully ordered")
