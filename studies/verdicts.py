"""Verdicts computed from a rule stated in advance, each returned with its evidence.

Every finding a study prints ("agrees", "A beats B", "no estimator beats uniform weights", an
exponent with its uncertainty) comes from one of these helpers, so the words follow from the
numbers and change when the numbers do:

- `compare_to_reference`: a confidence interval against a reference value and a tolerance
  (an equivalence test): ``agrees`` / ``differs`` / ``inconclusive``;
- `pairwise_differences`, `paired_ranking`, `beats_baseline`: paired
  per-unit scores of several methods, differences with a multiple-testing correction (Holm by
  default, or Benjamini-Hochberg), ties printed as ties;
- `adjust_pvalues`: the Holm, Benjamini-Hochberg and Bonferroni adjustments;
- `bootstrap_median_ci`: a (hierarchical) bootstrap interval of a median or any quantile,
  e.g. over heads x draws;
- `slope_with_uncertainty`: a log-log slope whose interval is the envelope over stated
  analysis choices (statistic x fit range), not the noise of one choice;
- `format_verdict`: one markdown bullet.

References
----------
- [Sch87] D. J. Schuirmann, "A comparison of the two one-sided tests procedure and the power
  approach for assessing the equivalence of average bioavailability", J. Pharmacokinet.
  Biopharm. 15 (1987).
- [Hol79] S. Holm, "A simple sequentially rejective multiple test procedure", Scand. J. Stat. 6
  (1979).
- [BH95] Y. Benjamini and Y. Hochberg, "Controlling the false discovery rate: a practical and
  powerful approach to multiple testing", J. R. Stat. Soc. B 57 (1995).
- [DH97] A. C. Davison and D. V. Hinkley, "Bootstrap Methods and their Application", Cambridge
  University Press (1997), section 3.8 (hierarchical data).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, NamedTuple

import numpy as np
from numpy.typing import ArrayLike

__all__ = [
    "Interval",
    "SlopeEstimate",
    "Verdict",
    "adjust_pvalues",
    "beats_baseline",
    "bootstrap_median_ci",
    "compare_to_reference",
    "format_verdict",
    "paired_ranking",
    "pairwise_differences",
    "score_table",
    "slope_with_uncertainty",
]

Correction = Literal["holm", "bh", "bonferroni", "none"]
_CORRECTIONS = ("holm", "bh", "bonferroni", "none")
_CORRECTION_NAME = {"holm": "Holm", "bh": "Benjamini-Hochberg", "bonferroni": "Bonferroni",
                    "none": "no"}


@dataclass(frozen=True)
class Verdict:
    """A verdict, the sentence that states it and the numbers it was computed from.

    Attributes
    ----------
    label : str
        The call: ``"agrees"``, ``"differs"`` or ``"inconclusive"``
        (`compare_to_reference`); ``"ordered"`` or ``"ties"`` (`paired_ranking`);
        ``"beats"``, ``"ties"`` or ``"worse"`` (`beats_baseline`).
    statement : str
        One sentence, generated from the numbers.
    evidence : dict
        The inputs and intermediate numbers of the rule (intervals, tolerance, p-values, ...).
    """

    label: str
    statement: str
    evidence: dict[str, Any] = field(default_factory=dict)


class Interval(NamedTuple):
    """A point estimate with a confidence interval ``(estimate, low, high)``."""

    estimate: float
    low: float
    high: float


@dataclass(frozen=True)
class SlopeEstimate:
    """A log-log slope with an interval that covers the stated analysis choices.

    Attributes
    ----------
    slope : float
        The slope of the primary analysis (the first statistic over the first range).
    low, high : float
        The envelope of the variants' confidence intervals: the smallest lower and the largest
        upper end.
    primary_low, primary_high : float
        The confidence interval of the primary analysis alone.
    level : float
        The confidence level of every variant's interval.
    variants : list of dict
        One record per (statistic, range): ``statistic``, ``range``, ``n``, ``slope``, ``low``,
        ``high`` (``nan`` where fewer than ``min_points`` points fall in the range).
    """

    slope: float
    low: float
    high: float
    primary_low: float
    primary_high: float
    level: float
    variants: list[dict[str, Any]]


# --------------------------------------------------------------------------------------------
# one estimate against a reference
# --------------------------------------------------------------------------------------------
def _finite_float(name: str, value: Any) -> float:
    try:
        out = float(value)
    except (TypeError, ValueError):
        raise TypeError(f"{name} must be a real number, got {value!r}") from None
    if math.isnan(out):
        raise ValueError(f"{name} must not be NaN, got {value!r}")
    return out


def compare_to_reference(estimate: float, ci_low: float, ci_high: float, reference: float, *,
                         tolerance: float, relative: bool = True,
                         what: str = "the estimate") -> Verdict:
    r"""Equivalence test of an estimate's confidence interval against ``reference ± tolerance``.

    With the margin $M = [\rho - \tau, \rho + \tau]$ ($\tau$ = ``tolerance``,
    multiplied by $|\rho|$ when ``relative``) and the interval
    $[\ell, u]$ = ``[ci_low, ci_high]``:

    - ``agrees`` if $[\ell, u] \subseteq M$;
    - ``differs`` if $[\ell, u] \cap M = \emptyset$ ($u < \rho - \tau$ or
      $\ell > \rho + \tau$);
    - ``inconclusive`` otherwise (the interval straddles an end of the margin).

    With a $(1 - 2\alpha)$ interval, ``agrees`` is Schuirmann's two one-sided tests at
    level $\alpha$ [Sch87] (both "the difference is below $-\tau$" and "above
    $+\tau$" rejected), and ``differs`` rejects "the difference is within the margin" at
    level $\alpha$; a 95% interval gives both at 2.5%. The tolerance must be stated before
    the data are seen: it is part of the claim, and the statement prints it.

    Parameters
    ----------
    estimate, ci_low, ci_high : float
        The point estimate and its confidence interval (``ci_low <= estimate <= ci_high``; an
        infinite end is allowed and can only give ``inconclusive`` or ``differs``).
    reference : float
        The value compared with (a closed form, a published number).
    tolerance : float
        Half-width of the margin, ``>= 0``: relative to ``|reference|`` when ``relative``,
        absolute otherwise.
    relative : bool
        See ``tolerance``.
    what : str
        How the statement names the estimate.

    Returns
    -------
    Verdict
        ``evidence`` holds the inputs and the margin ``margin_low``, ``margin_high``.

    Examples
    --------
    >>> from studies.verdicts import compare_to_reference
    >>> compare_to_reference(1.01, 0.99, 1.03, 1.0, tolerance=0.05).label
    'agrees'
    >>> compare_to_reference(1.21, 1.19, 1.23, 1.0, tolerance=0.05).label
    'differs'
    >>> compare_to_reference(1.04, 1.00, 1.08, 1.0, tolerance=0.05).label
    'inconclusive'
    """
    est = _finite_float("estimate", estimate)
    lo = _finite_float("ci_low", ci_low)
    hi = _finite_float("ci_high", ci_high)
    ref = _finite_float("reference", reference)
    tol = _finite_float("tolerance", tolerance)
    if not math.isfinite(ref):
        raise ValueError(f"reference must be finite, got {reference!r}")
    if not (math.isfinite(tol) and tol >= 0):
        raise ValueError(f"tolerance must be finite and >= 0, got {tolerance!r}")
    if not lo <= est <= hi:
        raise ValueError(f"expected ci_low <= estimate <= ci_high, got ci_low={lo!r}, "
                         f"estimate={est!r}, ci_high={hi!r}")
    if relative and ref == 0.0:
        raise ValueError("a relative tolerance needs a reference != 0 (got reference=0); pass "
                         "relative=False for an absolute margin")
    half = tol * abs(ref) if relative else tol
    m_lo, m_hi = ref - half, ref + half
    if m_lo <= lo and hi <= m_hi:
        label = "agrees"
    elif hi < m_lo or lo > m_hi:
        label = "differs"
    else:
        label = "inconclusive"
    margin = f"{ref:.4g} ± {tol:.3g}" + (" (relative)" if relative else "")
    ci = f"{est:.4g} [{lo:.4g}, {hi:.4g}]"
    statement = {
        "agrees": f"{what} {ci} agrees with {margin}: the interval lies inside the margin",
        "differs": f"{what} {ci} differs from {margin}: the interval lies outside the margin",
        "inconclusive": f"{what} {ci} is inconclusive against {margin}: the interval crosses "
                        "an end of the margin",
    }[label]
    return Verdict(label, statement, {"estimate": est, "ci_low": lo, "ci_high": hi,
                                      "reference": ref, "tolerance": tol, "relative": relative,
                                      "margin_low": m_lo, "margin_high": m_hi})


# --------------------------------------------------------------------------------------------
# multiple testing
# --------------------------------------------------------------------------------------------
def adjust_pvalues(pvalues: ArrayLike, method: Correction = "holm") -> np.ndarray:
    r"""Adjusted p-values: reject hypothesis $i$ at family level $\alpha$ iff
    $\tilde p_i < \alpha$.

    With the sorted p-values $p_{(1)} \le \dots \le p_{(m)}$:

    - Holm [Hol79] (family-wise error): $\tilde p_{(k)} = \max_{j \le k}
      \min(1, (m - j + 1)\, p_{(j)})$;
    - Benjamini-Hochberg [BH95] (false discovery rate, independent or positively dependent tests):
      $\tilde p_{(k)} = \min_{j \ge k} \min(1, m\, p_{(j)} / j)$
      (``scipy.stats.false_discovery_control``);
    - Bonferroni: $\min(1, m\, p_i)$; ``"none"``: $p_i$.

    Parameters
    ----------
    pvalues : array_like, shape (m,)
        p-values in [0, 1].
    method : {"holm", "bh", "bonferroni", "none"}

    Returns
    -------
    numpy.ndarray, shape (m,)
        Adjusted p-values, in the input order.

    Examples
    --------
    >>> from studies.verdicts import adjust_pvalues
    >>> adjust_pvalues([0.01, 0.04, 0.03, 0.005], "holm").round(4).tolist()
    [0.03, 0.06, 0.06, 0.02]
    >>> adjust_pvalues([0.01, 0.04, 0.03, 0.005], "bh").round(4).tolist()
    [0.02, 0.04, 0.04, 0.02]
    """
    p = np.asarray(pvalues, dtype=float)
    if p.ndim != 1:
        raise ValueError(f"pvalues must be 1-D, got shape {p.shape}")
    if np.isnan(p).any() or (p < 0).any() or (p > 1).any():
        raise ValueError(f"pvalues must lie in [0, 1] (no NaN), got {p.tolist()}")
    if method not in _CORRECTIONS:
        raise ValueError(f"method must be one of {_CORRECTIONS}, got {method!r}")
    m = p.size
    if m == 0 or method == "none":
        return p.copy()
    if method == "bonferroni":
        return np.minimum(1.0, m * p)
    if method == "bh":
        from scipy import stats

        return np.asarray(stats.false_discovery_control(p, method="bh"), dtype=float)
    order = np.argsort(p, kind="stable")
    adj = np.maximum.accumulate(np.minimum(1.0, (m - np.arange(m)) * p[order]))
    out = np.empty(m)
    out[order] = adj
    return out


# --------------------------------------------------------------------------------------------
# paired comparisons of methods
# --------------------------------------------------------------------------------------------
def score_table(df: Any, *, unit: str | Sequence[str], method: str = "estimator",
                value: str = "mean") -> Any:
    """The wide table of paired scores (rows = units, columns = methods) from a tidy frame.

    Parameters
    ----------
    df : pandas.DataFrame
        Tidy results, one row per (unit, method).
    unit : str or sequence of str
        Column(s) naming the unit that pairs the methods (a head, a seed, a data set).
    method : str
        Column of the methods.
    value : str
        Column of the scores.

    Returns
    -------
    pandas.DataFrame
        ``df.pivot(index=unit, columns=method, values=value)``; NaN where a method has no score.

    Examples
    --------
    >>> import pandas as pd
    >>> from studies.verdicts import score_table
    >>> df = pd.DataFrame({"head": [0, 0, 1, 1], "estimator": ["a", "b", "a", "b"],
    ...                    "mean": [1.0, 2.0, 1.5, 2.5]})
    >>> score_table(df, unit="head").to_numpy().tolist()
    [[1.0, 2.0], [1.5, 2.5]]
    """
    units = [unit] if isinstance(unit, str) else list(unit)
    cols = [*units, method, value]
    missing = [c for c in cols if c not in getattr(df, "columns", [])]
    if missing:
        raise ValueError(f"score_table: column(s) {missing} not in df; its columns are "
                         f"{list(getattr(df, 'columns', []))}")
    dup = df.duplicated(subset=[*units, method])
    if dup.any():
        first = df.loc[dup, [*units, method]].iloc[0].to_dict()
        raise ValueError(f"score_table: several rows for {first}: one score per (unit, method); "
                         "add the column that differs to unit or filter df")
    wide = df.pivot(index=units, columns=method, values=value)
    wide.columns.name = None
    return wide


def _as_score_table(scores: Any) -> tuple[list[str], np.ndarray]:
    """(method names, (n_units, n_methods) float array) from a wide DataFrame or a mapping."""
    if hasattr(scores, "columns") and hasattr(scores, "to_numpy"):
        names = [str(c) for c in scores.columns]
        try:
            arr = scores.to_numpy(dtype=float)
        except (TypeError, ValueError):
            raise TypeError("scores must hold numbers (one column per method, one row per "
                            "unit)") from None
    elif isinstance(scores, Mapping):
        names = [str(k) for k in scores]
        cols = [np.asarray(v, dtype=float) for v in scores.values()]
        if any(c.ndim != 1 for c in cols) or len({c.size for c in cols}) > 1:
            raise ValueError("scores: every method needs a 1-D array of the same length (one "
                             "score per unit), got shapes "
                             f"{ {k: np.shape(v) for k, v in scores.items()} }")
        arr = np.stack(cols, axis=1) if cols else np.empty((0, 0))
    else:
        raise TypeError("scores must be a pandas DataFrame (rows = units, columns = methods) or "
                        f"a mapping method -> per-unit scores, got {type(scores).__name__}")
    if len(names) < 2:
        raise ValueError(f"scores: need at least 2 methods, got {names}")
    if len(set(names)) != len(names):
        raise ValueError(f"scores: method names must be unique, got {names}")
    if np.isinf(arr).any():
        raise ValueError("scores must be finite or NaN (a missing unit), got an infinite value")
    return names, arr


def _paired_test(diff: np.ndarray, ci: str, n_boot: int, rng: np.random.Generator
                 ) -> tuple[float, float, Any]:
    """(mean difference, two-sided p-value, function level -> (lo, hi))."""
    n = diff.size
    mean = float(diff.mean())
    if ci == "t":
        sd = float(diff.std(ddof=1)) if n > 1 else math.nan
        if n < 2 or sd == 0.0 or not math.isfinite(sd):
            p = 1.0 if mean == 0.0 or n < 2 else 0.0
            return mean, p, (lambda level: (mean, mean) if n >= 2 else (-math.inf, math.inf))
        from scipy import special

        # scipy.stats.ttest_1samp's p-value and interval in closed form (Student t with n - 1
        # degrees of freedom), through the ufuncs: a ranking of m methods runs m(m-1)/2 tests
        se = sd / math.sqrt(n)
        t = mean / se
        p_t = float(min(1.0, 2.0 * special.stdtr(n - 1, -abs(t))))

        def interval_t(level: float) -> tuple[float, float]:
            half = float(special.stdtrit(n - 1, 0.5 + level / 2)) * se
            return mean - half, mean + half

        return mean, p_t, interval_t
    # percentile bootstrap of the mean difference; p = 2 min(P*(<= 0), P*(>= 0)), so that the
    # (1 - g) percentile interval excludes 0 exactly when p < g
    reps = diff[rng.integers(0, n, size=(n_boot, n))].mean(axis=1)
    p = min(1.0, 2.0 * min(float(np.mean(reps <= 0.0)), float(np.mean(reps >= 0.0))))

    def interval_b(level: float) -> tuple[float, float]:
        lo, hi = np.quantile(reps, [(1 - level) / 2, (1 + level) / 2])
        return float(lo), float(hi)

    return mean, p, interval_b


def pairwise_differences(scores: Any, *, pairs: Sequence[tuple[str, str]] | None = None,
                         alpha: float = 0.05, correction: Correction = "holm",
                         ci: Literal["t", "bootstrap"] = "t", n_boot: int = 4000,
                         seed: int = 0) -> list[dict[str, Any]]:
    r"""Paired differences of per-unit scores with multiple-testing corrected intervals.

    For each pair $(a, b)$ the per-unit differences $\Delta_u = s_{a,u} - s_{b,u}$
    over the units scored by both (a unit: a head, a seed, a data set) give a two-sided test of
    $E\Delta = 0$ (paired t test, or a percentile bootstrap of the mean) with p-value
    $p$. The p-values of all pairs are adjusted together (`adjust_pvalues`), and the
    interval of each pair is reported at level $1 - \alpha\, p / \tilde p$, the level at
    which the procedure tests that pair, so that **the interval excludes 0 exactly when the
    corrected test rejects** ($\tilde p < \alpha$; exactly for the t test, to the resolution of
    the replicates for the bootstrap) and a tie is an interval that contains 0. The call itself
    (``significant``) is always $\tilde p < \alpha$.

    Parameters
    ----------
    scores : pandas.DataFrame or mapping
        Wide table, one row per unit and one column per method (from a tidy frame:
        `score_table`), or a mapping
        ``method -> per-unit scores`` (equal lengths, aligned by position). NaN marks a unit a
        method did not score.
    pairs : sequence of (str, str), optional
        The comparisons (default: every pair, in column order). The correction counts these.
    alpha : float
        Family level.
    correction : {"holm", "bh", "bonferroni", "none"}
        Holm (default) controls the family-wise error; ``"bh"`` the false discovery rate.
    ci : {"t", "bootstrap"}
        Paired t test and interval, or a percentile bootstrap of the mean difference.
    n_boot : int
        Bootstrap replicates (``ci="bootstrap"``).
    seed : int
        Seed of the bootstrap's ``numpy.random.Generator``.

    Returns
    -------
    list of dict
        One record per pair: ``a``, ``b``, ``n`` (paired units), ``diff`` (mean of
        $s_a - s_b$), ``p``, ``p_adj``, ``level``, ``ci_low``, ``ci_high``, ``significant``.

    Examples
    --------
    >>> from studies.verdicts import pairwise_differences
    >>> rows = pairwise_differences({"A": [1.0, 1.1, 0.9, 1.0], "B": [2.0, 2.2, 1.9, 2.1]})
    >>> rows[0]["a"], rows[0]["b"], round(rows[0]["diff"], 3), rows[0]["significant"]
    ('A', 'B', -1.05, True)
    """
    names, arr = _as_score_table(scores)
    if not 0 < alpha < 1:
        raise ValueError(f"alpha must lie in (0, 1), got {alpha!r}")
    if correction not in _CORRECTIONS:
        raise ValueError(f"correction must be one of {_CORRECTIONS}, got {correction!r}")
    if ci not in ("t", "bootstrap"):
        raise ValueError(f"ci must be 't' or 'bootstrap', got {ci!r}")
    if ci == "bootstrap" and n_boot < 100:
        raise ValueError(f"n_boot must be >= 100, got {n_boot!r}")
    index = {n: i for i, n in enumerate(names)}
    if pairs is None:
        pairs = list(itertools.combinations(names, 2))
    for a, b in pairs:
        for x in (a, b):
            if x not in index:
                raise ValueError(f"pairs: unknown method {x!r}; the methods are {names}")
    rng = np.random.default_rng(seed)
    raw = []
    for a, b in pairs:
        d = arr[:, index[a]] - arr[:, index[b]]
        d = d[~np.isnan(d)]
        if d.size < 2:
            raise ValueError(f"pair ({a!r}, {b!r}) has {d.size} unit(s) scored by both; a paired "
                             "comparison needs at least 2")
        raw.append((a, b, d.size, *_paired_test(d, ci, n_boot, rng)))
    p = np.array([r[4] for r in raw])
    p_adj = adjust_pvalues(p, correction)
    m = len(raw)
    out = []
    for (a, b, n, mean, pv, interval), pa in zip(raw, p_adj, strict=True):
        if pa > 0:
            g = alpha * pv / pa
        else:  # p = 0: any level rejects; report the Bonferroni level
            g = alpha / m if correction != "none" else alpha
        level = 1.0 - min(g, alpha)
        lo, hi = interval(level)
        out.append({"a": a, "b": b, "n": int(n), "diff": mean, "p": float(pv), "p_adj": float(pa),
                    "level": level, "ci_low": lo, "ci_high": hi,
                    "significant": bool(pa < alpha)})
    return out


def paired_ranking(scores: Any, *, lower_is_better: bool = True, alpha: float = 0.05,
                   correction: Correction = "holm", ci: Literal["t", "bootstrap"] = "t",
                   n_boot: int = 4000, seed: int = 0, what: str = "score") -> Verdict:
    r"""Rank methods by paired per-unit scores; methods that the corrected tests cannot separate
    are printed as ties.

    All $m(m-1)/2$ pairs are tested with `pairwise_differences` (one family). The
    methods are ordered by their mean score; the rank of a method is 1 + the number of methods
    that beat it (corrected interval of the difference excludes 0 in their favour), so tied
    methods can share a rank. The statement walks the order: "A beats B" where the pair's
    interval excludes 0, "A ties B" where it contains 0, then names each win between
    non-neighbours that a tie in between hides ("A ties B; B ties C; A beats C").

    Parameters
    ----------
    scores : pandas.DataFrame or mapping
        See `pairwise_differences`.
    lower_is_better : bool
        Whether a lower score is better (an error) or a higher one (an accuracy).
    alpha, correction, ci, n_boot, seed
        See `pairwise_differences`.
    what : str
        The name of the score in the statement.

    Returns
    -------
    Verdict
        ``label`` is ``"ordered"`` when every neighbour in the order is separated, else
        ``"ties"``; ``evidence`` holds ``order``, ``means``, ``rank`` and ``pairs``.

    Examples
    --------
    >>> from studies.verdicts import paired_ranking
    >>> v = paired_ranking({"A": [1.0, 1.1, 0.9, 1.0, 1.05], "B": [1.0, 1.2, 0.8, 1.1, 1.0],
    ...                     "C": [2.0, 2.2, 1.9, 2.1, 2.0]}, what="error")
    >>> v.label, v.evidence["rank"]
    ('ties', {'A': 1, 'B': 1, 'C': 3})
    >>> print(v.statement)
    ranking by error (lower is better; paired t, Holm correction over 3 pairs, α = 0.05): A ties B; B beats C; A beats C
    """
    names, arr = _as_score_table(scores)
    rows = pairwise_differences(scores, alpha=alpha, correction=correction, ci=ci,
                                n_boot=n_boot, seed=seed)
    sign = 1.0 if lower_is_better else -1.0
    means = {n: float(np.nanmean(arr[:, i])) for i, n in enumerate(names)}
    order = sorted(names, key=lambda n: sign * means[n])
    # better[x] = the methods significantly better than x
    better: dict[str, set[str]] = {n: set() for n in names}
    lookup: dict[frozenset[str], dict[str, Any]] = {}
    for r in rows:
        lookup[frozenset((r["a"], r["b"]))] = r
        if r["significant"]:
            a_better = sign * r["diff"] < 0
            better[r["b"] if a_better else r["a"]].add(r["a"] if a_better else r["b"])
    rank = {n: 1 + len(better[n]) for n in order}
    steps = []
    all_sep = True
    for x, y in itertools.pairwise(order):
        sep = x in better[y]
        all_sep &= sep
        steps.append(f"{x} {'beats' if sep else 'ties'} {y}")
    # a win the neighbour steps do not show: x beats z with a tie somewhere between them
    for i, j in itertools.combinations(range(len(order)), 2):
        chain = all(order[t] in better[order[t + 1]] for t in range(i, j))
        if j > i + 1 and order[i] in better[order[j]] and not chain:
            steps.append(f"{order[i]} beats {order[j]}")
    how = "paired t" if ci == "t" else "paired bootstrap"
    head = (f"ranking by {what} ({'lower' if lower_is_better else 'higher'} is better; {how}, "
            f"{_CORRECTION_NAME[correction]} correction over {len(rows)} pairs, α = {alpha:g})")
    return Verdict("ordered" if all_sep else "ties", f"{head}: " + "; ".join(steps),
                   {"order": order, "means": means, "rank": rank, "pairs": rows,
                    "alpha": alpha, "correction": correction, "lower_is_better": lower_is_better})


def beats_baseline(scores: Any, baseline: str, *, lower_is_better: bool = True,
                   alpha: float = 0.05, correction: Correction = "holm",
                   ci: Literal["t", "bootstrap"] = "t", n_boot: int = 4000, seed: int = 0,
                   what: str = "estimator", margin: float = 0.0) -> Verdict:
    r"""Does the best method beat a baseline (e.g. uniform attention weights)?

    Every other method is compared with ``baseline`` (`pairwise_differences` on the
    $m - 1$ pairs, one family: the best is chosen after looking, so all comparisons
    count). The best method is the one with the best mean score. Its corrected interval
    $[\ell, u]$ of the difference to the baseline, against the equivalence margin
    $[-\delta, \delta]$ ($\delta$ = ``margin``, in the units of the scores, stated
    before the data), decides:

    - ``beats``: the test rejects and the whole interval lies beyond $-\delta$ on the better
      side (the best is better by more than the margin);
    - ``worse``: the test rejects and the whole interval lies beyond $+\delta$ on the worse
      side (every method is worse than the baseline by more than the margin);
    - ``ties`` otherwise, printed "no {what} beats {baseline}", with ``equivalent`` in the
      evidence when the interval lies inside $[-\delta, \delta]$ (Schuirmann's two one-sided
      tests [Sch87]: a difference too small to matter, however significant).

    With ``margin = 0`` a significant difference of any size decides: a 0.05% difference
    measured on many units "beats". On log scores, ``margin = log(1.01)`` asks for a 1%
    ratio.

    Parameters
    ----------
    scores : pandas.DataFrame or mapping
        See `pairwise_differences`; must contain ``baseline``.
    baseline : str
        The baseline's column.
    lower_is_better, alpha, correction, ci, n_boot, seed
        See `paired_ranking`.
    what : str
        What the methods are called in the statement.
    margin : float
        Half-width $\delta \ge 0$ of the equivalence margin around 0, in score units.

    Returns
    -------
    Verdict
        ``evidence`` holds ``best``, the best method's ``diff`` to the baseline with its
        ``ci_low``, ``ci_high``, ``p_adj``, ``margin``, ``equivalent`` and every comparison in
        ``pairs`` (each with ``beyond_margin``: significant and outside the margin).

    Examples
    --------
    >>> from studies.verdicts import beats_baseline
    >>> v = beats_baseline({"uniform": [0.50, 0.52, 0.49, 0.51],
    ...                     "favor+": [0.50, 0.53, 0.48, 0.51]}, "uniform")
    >>> v.label
    'ties'
    >>> v.statement.split(":")[0]
    'no estimator beats uniform'
    >>> tiny = {"uniform": [1.000, 1.100, 0.900, 1.050, 0.950],
    ...         "hedgehog": [0.999, 1.099, 0.899, 1.049, 0.949]}  # 0.001 better everywhere
    >>> beats_baseline(tiny, "uniform").label
    'beats'
    >>> v = beats_baseline(tiny, "uniform", margin=0.01)
    >>> v.label, v.evidence["equivalent"]
    ('ties', True)
    """
    names, _ = _as_score_table(scores)
    if baseline not in names:
        raise ValueError(f"baseline {baseline!r} is not a method of scores; the methods are {names}")
    others = [n for n in names if n != baseline]
    rows = pairwise_differences(scores, pairs=[(n, baseline) for n in others], alpha=alpha,
                                correction=correction, ci=ci, n_boot=n_boot, seed=seed)
    delta = _finite_float("margin", margin)
    if not (math.isfinite(delta) and delta >= 0):
        raise ValueError(f"margin must be finite and >= 0, got {margin!r}")
    sign = 1.0 if lower_is_better else -1.0
    for r in rows:
        # the interval's end nearest 0, on the side of the difference, beyond the margin
        near = min(sign * r["ci_low"], sign * r["ci_high"]) if sign * r["diff"] > 0 else \
            max(sign * r["ci_low"], sign * r["ci_high"])
        r["beyond_margin"] = bool(r["significant"] and abs(near) > delta
                                  and (near > 0) == (sign * r["diff"] > 0))
    best = min(rows, key=lambda r: sign * r["diff"])
    lo, hi = best["ci_low"], best["ci_high"]
    equivalent = bool(-delta <= lo and hi <= delta) if delta > 0 else False
    if not best["beyond_margin"]:
        label = "ties"
    else:
        label = "beats" if sign * best["diff"] < 0 else "worse"
    diff = f"{best['diff']:.3g} [{lo:.3g}, {hi:.3g}]"
    tail = (f"{best['a']} − {baseline} = {diff} ({_CORRECTION_NAME[correction]}-corrected "
            f"{best['level']:.4g} interval over {len(rows)} comparisons)")
    if delta > 0:
        m_txt = f"±{delta:.3g}"
        statement = {
            "beats": f"{best['a']} beats {baseline}: {tail} lies beyond the margin {m_txt}",
            "ties": (f"no {what} beats {baseline} by more than the margin {m_txt}: the best, "
                     f"{tail}, " + ("lies inside the margin (equivalent)" if equivalent
                                   else "crosses an end of the margin" if best["significant"]
                                   else "contains 0")),
            "worse": f"no {what} beats {baseline}: even the best is worse, {tail}, beyond "
                     f"the margin {m_txt}",
        }[label]
    else:
        statement = {
            "beats": f"{best['a']} beats {baseline}: {tail} excludes 0",
            "ties": f"no {what} beats {baseline}: the best, {tail}, contains 0",
            "worse": f"no {what} beats {baseline}: even the best is worse, {tail}",
        }[label]
    return Verdict(label, statement, {"best": best["a"], "baseline": baseline,
                                      "diff": best["diff"], "ci_low": lo, "ci_high": hi,
                                      "p_adj": best["p_adj"], "margin": delta,
                                      "equivalent": equivalent, "pairs": rows})


# --------------------------------------------------------------------------------------------
# bootstrap of a median over a hierarchy
# --------------------------------------------------------------------------------------------
def _row_quantile(a: np.ndarray, counts: np.ndarray, q: float) -> np.ndarray:
    """Quantile (numpy's default "linear" method) of each row's first ``counts`` values after
    sorting (the NaN padding sorts last): ``np.nanquantile(a, q, axis=1)`` without its per-row
    Python loop."""
    srt = np.sort(a, axis=1)
    pos = q * (counts - 1)
    lo = np.floor(pos).astype(np.intp)
    hi = np.minimum(lo + 1, counts - 1)
    rows = np.arange(a.shape[0])
    frac = pos - lo
    return srt[rows, lo] * (1 - frac) + srt[rows, hi] * frac


def bootstrap_median_ci(values: ArrayLike, *, groups: ArrayLike | None = None,
                        n_boot: int = 4000, seed: int = 0, level: float = 0.95,
                        quantile: float = 0.5, resample_within: bool = True) -> Interval:
    r"""Percentile bootstrap interval of a median (or any quantile), flat or over a hierarchy.

    Flat (``groups=None``): resample the values with replacement. Hierarchical (``groups``
    given, e.g. the head of each (head, draw) value): each replicate resamples the groups with
    replacement and then, when ``resample_within``, the values within each chosen group, and
    takes the quantile of the pooled resampled values [DH97]. Values in one group are correlated
    (the same head), so the flat bootstrap treats $n_{\text{heads}} \times n_{\text{draws}}$
    values as independent and its interval is too narrow; resampling the groups carries the
    between-group variance. Resampling within as well adds the within-group variance a second
    time (slightly conservative when it is large); ``resample_within=False`` resamples groups
    only.

    Vectorised: the replicates are one ``(n_boot, n_groups, max group size)`` gather (padded with
    NaN for unequal groups), in chunks of about 4 million values.

    Parameters
    ----------
    values : array_like, shape (n,)
        Finite values.
    groups : array_like, shape (n,), optional
        Group label of each value.
    n_boot : int
        Replicates (>= 100).
    seed : int
        Seed of ``numpy.random.default_rng``.
    level : float
        Confidence level in (0, 1).
    quantile : float
        The statistic: 0.5 is the median, 0.9 the 90% quantile.
    resample_within : bool
        See above.

    Returns
    -------
    Interval
        ``(estimate, low, high)``: the quantile of ``values`` and the percentile interval.

    Examples
    --------
    >>> import numpy as np
    >>> from studies.verdicts import bootstrap_median_ci
    >>> rng = np.random.default_rng(0)
    >>> heads = np.repeat(np.arange(12), 8)  # 12 heads x 8 draws
    >>> x = rng.normal(size=12)[heads] + 0.3 * rng.normal(size=96)
    >>> flat = bootstrap_median_ci(x, seed=1)
    >>> nested = bootstrap_median_ci(x, groups=heads, seed=1)
    >>> bool(nested.high - nested.low > flat.high - flat.low)  # the head effect widens it
    True
    """
    v = np.asarray(values, dtype=float)
    if v.ndim != 1 or v.size == 0:
        raise ValueError(f"values must be a non-empty 1-D array, got shape {v.shape}")
    if not np.isfinite(v).all():
        raise ValueError("values must be finite (drop missing values first)")
    if not 0 < level < 1:
        raise ValueError(f"level must lie in (0, 1), got {level!r}")
    if not 0 <= quantile <= 1:
        raise ValueError(f"quantile must lie in [0, 1], got {quantile!r}")
    if n_boot < 100:
        raise ValueError(f"n_boot must be >= 100, got {n_boot!r}")
    rng = np.random.default_rng(seed)
    est = float(np.quantile(v, quantile))
    if groups is None:
        chunk = max(1, 4_000_000 // v.size)
        reps = np.concatenate([
            np.quantile(v[rng.integers(0, v.size, size=(min(chunk, n_boot - s), v.size))],
                        quantile, axis=1)
            for s in range(0, n_boot, chunk)])
    else:
        g = np.asarray(groups)
        if g.shape != v.shape:
            raise ValueError(f"groups must have the shape of values {v.shape}, got {g.shape}")
        _, inv, sizes = np.unique(g, return_inverse=True, return_counts=True)
        n_g, w = sizes.size, int(sizes.max())
        order = np.argsort(inv, kind="stable")
        pos = np.arange(v.size) - np.repeat(np.cumsum(sizes) - sizes, sizes)
        table = np.full((n_g, w), np.nan)
        table[inv[order], pos] = v[order]
        chunk = max(1, 4_000_000 // (n_g * w))
        parts = []
        for s in range(0, n_boot, chunk):
            b = min(chunk, n_boot - s)
            pick = rng.integers(0, n_g, size=(b, n_g))  # (b, G) groups
            size = sizes[pick][..., None]  # (b, G, 1)
            if resample_within:
                col = np.floor(rng.random((b, n_g, w)) * size).astype(np.intp)
            else:
                col = np.broadcast_to(np.arange(w), (b, n_g, w))
            col = np.where(np.arange(w) < size, col, w - 1)
            vals = table[pick[..., None], col]
            vals = np.where(np.arange(w) < size, vals, np.nan)
            parts.append(_row_quantile(vals.reshape(b, -1), sizes[pick].sum(axis=1), quantile))
        reps = np.concatenate(parts)
    lo, hi = np.quantile(reps, [(1 - level) / 2, (1 + level) / 2])
    return Interval(est, float(lo), float(hi))


# --------------------------------------------------------------------------------------------
# slopes across analysis choices
# --------------------------------------------------------------------------------------------
def slope_with_uncertainty(x: ArrayLike, y: ArrayLike | Mapping[str, ArrayLike], *,
                           ranges: Sequence[tuple[float, float]] | None = None,
                           level: float = 0.95, min_points: int = 3) -> SlopeEstimate:
    r"""Log-log slope whose interval includes the spread across stated analysis choices.

    Each variant, a statistic (one ``y`` series, e.g. the 90% quantile, the median, the mean)
    fitted over one ``x`` range, gives the OLS slope of $\log y$ on $\log x$ with
    its t interval, $\hat p \pm t_{1-(1-\text{level})/2,\, n-2}\, \mathrm{se}(\hat p)$.
    The reported interval is the **envelope** of the variants' intervals,
    $[\min_v \ell_v, \max_v u_v]$: an exponent is only known to the precision that
    survives every reasonable choice of statistic and range, not to the noise of one of them.
    The primary slope is the first statistic over the first range.

    Parameters
    ----------
    x : array_like, shape (n,)
        Positive abscissae (e.g. the dimension d).
    y : array_like, shape (n,), or mapping str -> array_like, shape (n,)
        One series or several named statistics on the same ``x``. Non-positive or non-finite
        values are dropped from the fit (a censored point).
    ranges : sequence of (float, float), optional
        Inclusive ``x`` ranges to fit over (default: the full range).
    level : float
        Confidence level of each variant's interval.
    min_points : int
        Variants with fewer points (>= 3) give NaN and are left out of the envelope.

    Returns
    -------
    SlopeEstimate

    Examples
    --------
    >>> import numpy as np
    >>> from studies.verdicts import slope_with_uncertainty
    >>> d = np.array([4.0, 8, 16, 32, 64, 128])
    >>> s = slope_with_uncertainty(d, {"q90": 3 * d * (1 + 0.01 * np.sin(d)),
    ...                                "median": 2 * d ** 1.1},
    ...                            ranges=[(4, 128), (16, 128)])
    >>> round(s.slope, 2), bool(s.low < 1.0 and s.high > 1.09)
    (1.0, True)
    >>> len(s.variants)
    4
    """
    from scipy import stats

    xa = np.asarray(x, dtype=float)
    if xa.ndim != 1:
        raise ValueError(f"x must be 1-D, got shape {xa.shape}")
    series = dict(y) if isinstance(y, Mapping) else {"y": y}
    if not series:
        raise ValueError("y: need at least one statistic")
    if not 0 < level < 1:
        raise ValueError(f"level must lie in (0, 1), got {level!r}")
    if min_points < 3:
        raise ValueError(f"min_points must be >= 3 (a slope and its standard error), got {min_points}")
    rngs = list(ranges) if ranges is not None else [(-math.inf, math.inf)]
    variants = []
    for (name, ys), (a, b) in itertools.product(series.items(), rngs):
        ya = np.asarray(ys, dtype=float)
        if ya.shape != xa.shape:
            raise ValueError(f"y[{name!r}] must have the shape of x {xa.shape}, got {ya.shape}")
        ok = (xa >= a) & (xa <= b) & (xa > 0) & (ya > 0) & np.isfinite(xa) & np.isfinite(ya)
        rec: dict[str, Any] = {"statistic": name, "range": (a, b), "n": int(ok.sum()),
                               "slope": math.nan, "low": math.nan, "high": math.nan}
        if ok.sum() >= min_points:
            lx, ly = np.log(xa[ok]), np.log(ya[ok])
            res = stats.linregress(lx, ly)
            half = float(stats.t.ppf(0.5 + level / 2, lx.size - 2)) * float(res.stderr)
            rec.update(slope=float(res.slope), low=float(res.slope) - half,
                       high=float(res.slope) + half)
        variants.append(rec)
    fitted = [v for v in variants if math.isfinite(v["slope"])]
    if not fitted:
        raise ValueError(f"no variant has {min_points} positive points to fit: "
                         f"{[(v['statistic'], v['range'], v['n']) for v in variants]}")
    first = variants[0]
    return SlopeEstimate(slope=first["slope"], low=min(v["low"] for v in fitted),
                         high=max(v["high"] for v in fitted), primary_low=first["low"],
                         primary_high=first["high"], level=level, variants=variants)


# --------------------------------------------------------------------------------------------
# report
# --------------------------------------------------------------------------------------------
def _fmt_evidence(value: Any) -> str | None:
    if isinstance(value, bool | np.bool_):
        return str(bool(value))
    if isinstance(value, int | np.integer):
        return str(int(value))
    if isinstance(value, float | np.floating):
        return f"{float(value):.4g}"
    if isinstance(value, str):
        return value
    return None  # lists, tables: in the evidence, not in the bullet


def format_verdict(v: Verdict) -> str:
    """One markdown bullet: the bold label, the statement and the scalar evidence.

    Parameters
    ----------
    v : Verdict

    Returns
    -------
    str

    Examples
    --------
    >>> from studies.verdicts import compare_to_reference, format_verdict
    >>> print(format_verdict(compare_to_reference(0.5, 0.49, 0.51, 0.5, tolerance=0.1)))
    - **agrees**: the estimate 0.5 [0.49, 0.51] agrees with 0.5 ± 0.1 (relative): the interval lies inside the margin (margin_low = 0.45, margin_high = 0.55)
    """
    if not isinstance(v, Verdict):
        raise TypeError(f"v must be a Verdict, got {type(v).__name__}")
    shown = ("margin_low", "margin_high", "p_adj")
    ev = [f"{k} = {s}" for k, val in v.evidence.items()
          if k in shown and (s := _fmt_evidence(val)) is not None]
    return f"- **{v.label}**: {v.statement}" + (f" ({', '.join(ev)})" if ev else "")
