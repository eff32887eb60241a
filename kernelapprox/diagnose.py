r"""``ka.diagnose``: from the data alone, which estimator of $e^{q^\top k}$ can work, at what r.

The closed forms of `kernelapprox.theory` say when random features fail: the relative
variance of FAVOR+ grows like $e^{\|q+k\|^2}/r$, that of trigonometric features like
$e^{\|q\|^2+\|k\|^2}/r$. `diagnose` evaluates them on a subsample of the user's own
``(q, k)`` pairs, for every registered estimator with a closed form, and turns them into a
regime report and a recommendation.

What is computed (``P`` = ``max_pairs`` sampled ``(q_i, k_j)`` pairs, ``R`` = ``max_rows`` query
rows; cost $O(nd)$ for the statistics plus $O(R\,m\,d)$ for the exact attention rows
and $O(P)$ closed-form evaluations):

* the regime: quantiles of $\|q\|$, $\|k\|$, of $t = \|q_i + k_j\|^2$ and its pair
  mean $\bar t$ (the FAVOR++ statistic), and the entropy of exact attention rows
  ($\log m$ = uniform);
* per estimator, at ``num_features`` projections: the predicted relative kernel MSE
  $E[(\hat K-K)^2]/K^2$ (mean and median over the sampled pairs, $\sqrt P \times \sqrt P$ of
  them: 64 x 64 by default; the table labels both with the sample size. The mean is carried by
  the worst pairs, so on heavy-tailed data the sample mean can be far from the all-pairs mean
  (an order of magnitude); the median is the robust statistic and the one ``target`` is
  compared with), the ``r`` at which the median would reach ``target`` (the MSE of the iid term
  scales as $1/r$: $r_{\rm need} = r\cdot \mathrm{median}/\mathrm{target}$), and, where
  the estimator has the delta-method attention theory, the largest relative variance of the
  attention normaliser over the sampled rows (iid rows, at the same r), flagged when it exceeds
  ``0.05`` (there the delta method is off by factors, see ``docs/theory.md`` §2: the attention
  output cannot be predicted, and in practice it is poor);
* deterministic maps with an exact error (elu+1, ReLU, Taylor, and Nyström fitted on the keys with
  ``min(r, m // 4)`` landmarks: with as many landmarks as keys it is exact attention at quadratic
  cost): the exact relative kernel error on the same pairs.

The recommendation is the random estimator with the smallest ``r_needed`` if it is at most
``max_features``, else the deterministic map with the smallest error, with the advice to use a
learned or data-dependent map. Data-dependent maps are fitted on the given ``q, k`` first.

Hybrid attention (``window=``, ``sinks=``, ``causal=``; `kernelapprox.hybrid_attention`). Softmax
is exact on the set $S_i$ (window and sinks), the map estimates the remainder $R_i$, with one
normaliser. Then the report adds:

* $p_i$, the softmax mass inside $S_i$ (`kernelapprox.theory.hybrid_attention.exact_mass`), as
  quantiles over the queries (median, 10th and 90th percentile), for every head of ``q``
  (`Diagnosis.exact_mass`) and for the diagnosed one (``regime["p_median"]``, ...);
* per estimator: the median relative kernel MSE over the sampled pairs in the remainder
  (``rel_mse_median_remainder``), the largest relative variance of the hybrid normaliser over the
  sampled rows, $\max_i \mathrm{Var}(\hat D_i)/D_i^2$ with the pair covariances summed over
  $R_i$ only (``hybrid_normaliser_rel_var``, iid rows), and with ``v`` the predicted relative
  output error of the hybrid, $\sqrt{\sum_{i,c}\mathrm{Var}(\hat o_{ic})}/\|o\|_F$ by the
  delta method over the remainder (``hybrid_attn_rel_err_pred``; the exact error on the
  sampled rows for deterministic maps). By `kernelapprox.theory.hybrid_attention.hybrid_error_identity`
  the hybrid error is the remainder's error times $1 - p_i$, which the delta method contains: it is
  the remainder's error, scaled by $D_{R,i}/D_i = 1 - p_i$.

Rule of the hybrid recommendation. With the error scaled by $1 - p$, the map's relative kernel MSE
budget becomes ``target / (1 - p)^2``, so the projections needed are

$$
r_{\rm hybrid} = r\cdot\mathrm{median}_{(i,j)\in R}\,\frac{\mathrm{MSE}\,\hat K_{ij}}{K_{ij}^2}
\cdot\frac{(1 - p_{\rm median})^2}{\rm target}
$$

(``r_needed_hybrid``; at least 1). The recommendation is "window w + <map> at r ≈ r_hybrid" for the
random estimator with the smallest $r_{\rm hybrid}$ when it is at most ``max_features``;
otherwise the advice of the plain report, with the deterministic map of the smallest hybrid
error.

Examples
--------
>>> import torch, kernelapprox as ka
>>> g = torch.Generator().manual_seed(0)
>>> q, k = (torch.randn(2, 256, 64, generator=g) / 64**0.25).unbind(0)
>>> dx = ka.diagnose(0.25 * q, 0.25 * k, num_features=256)
>>> dx.feasible
True
>>> dx = ka.diagnose(q, k, num_features=256)      # the standard attention scale at d = 64
>>> dx.feasible, dx.recommendation.split(":")[0]
(False, 'no random-feature estimator reaches the target')
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, cast

import numpy as np
import torch

from ._validation import (
    KernelApproxWarning,  # noqa: F401  (its public home is here and ka)
    _as_int,
    broadcast_shapes,
    check_finite_float,
    check_floating,
    check_last_dim,
    check_positive_int,
    check_seed,
)
from .maps.base import FeatureMap
from .registry import DEFAULT_SAMPLER, estimators

__all__ = [
    "Diagnosis", "diagnose", "KernelApproxWarning", "quick_relative_mse", "warn_if_hopeless", "WARN_RELATIVE_MSE",
]

#: Largest normaliser relative variance at which the delta method was found accurate (docs/theory.md §2).
DELTA_VALID = 0.05


@dataclass
class Diagnosis:
    """The result of `diagnose`: regime statistics, one row per estimator, a recommendation.

    Attributes
    ----------
    regime : dict
        ``n, m, d``, quantiles of ``|q|``, ``|k|`` and ``t = |q_i + k_j|^2``, ``t_bar``, the mean
        and minimum entropy of exact attention rows, ``log_m``, and ``pairs_q`` x ``pairs_k``,
        the sampled queries and keys whose pairs the closed forms are evaluated on.
    rows : list of dict
        One per estimator: ``estimator``, ``label``, ``sampler``, ``num_features``,
        ``feature_dim``, ``rel_mse_mean``, ``rel_mse_median``, ``r_needed``,
        ``normaliser_rel_var`` (NaN where no theory), ``delta_method_valid``,
        ``attn_rel_err_pred`` (with ``v``; NaN otherwise), ``kind``.
        With ``window``: also ``rel_mse_median_remainder``, ``r_needed_hybrid``,
        ``hybrid_normaliser_rel_var``, ``hybrid_delta_method_valid`` and
        ``hybrid_attn_rel_err_pred`` (module docstring).
    recommendation : str
    feasible : bool
        Whether some random estimator reaches ``target`` with at most ``max_features`` projections
        (with ``window``: ``r_needed_hybrid`` at most ``max_features``).
    target : float
    hybrid : dict or None
        With ``window``: ``window``, ``sinks``, ``causal`` of the exact set.
    exact_mass : list of dict
        With ``window``: one per head (leading index of ``q``, flattened), ``head``, ``p_median``,
        ``p_q10``, ``p_q90``, ``p_mean``: quantiles over the queries of the mass inside the exact set.

    Examples
    --------
    >>> import torch, kernelapprox as ka
    >>> g = torch.Generator().manual_seed(0)
    >>> q, k = (0.1 * torch.randn(2, 64, 16, generator=g)).unbind(0)
    >>> dx = ka.diagnose(q, k, ka.PositiveRF(16, 64), max_pairs=256)
    >>> dx.feasible, [row["estimator"] for row in dx.rows], dx.regime["n"]
    (True, ['positive'], 64)
    >>> df = dx.to_frame()                  # one row per estimator
    >>> df.shape[0], bool(df["rel_mse_median"].iloc[0] < dx.target)
    (1, True)
    """

    regime: dict[str, Any]
    rows: list[dict[str, Any]] = field(default_factory=list)
    recommendation: str = ""
    feasible: bool = False
    target: float = 0.01
    hybrid: dict[str, Any] | None = None
    exact_mass: list[dict[str, Any]] = field(default_factory=list)

    def __post_init__(self) -> None:
        if not isinstance(self.regime, dict):
            raise TypeError(f"regime must be a dict, got {type(self.regime).__name__}")
        if not isinstance(self.rows, list):
            raise TypeError(f"rows must be a list of dicts, got {type(self.rows).__name__}")

    def to_frame(self) -> Any:
        """The rows as a pandas DataFrame (pandas needed)."""
        import pandas as pd

        return pd.DataFrame(self.rows)

    def _table(self) -> list[list[str]]:
        pairs = f"{self.regime.get('pairs_q', '?')}x{self.regime.get('pairs_k', '?')}"
        head = ["estimator", "sampler", "r", f"rel. MSE (median, {pairs} pairs)", f"rel. MSE (mean, {pairs}-pair sample)",
                "r for target", "normaliser var"]
        if self.hybrid is not None:
            head += ["r for target (hybrid)", "normaliser var (hybrid)"]
        out = [head]

        def num(x: float, valid: bool = True) -> str:
            return "-" if not math.isfinite(x) else f"{x:.3g}" + ("" if valid else " (delta invalid)")

        for r in self.rows:
            row = [
                r["label"], r["sampler"], str(r["num_features"]), f"{r['rel_mse_median']:.3g}",
                f"{r['rel_mse_mean']:.3g}", num(r["r_needed"]), num(r["normaliser_rel_var"], r["delta_method_valid"]),
            ]
            if self.hybrid is not None:
                row += [num(r["r_needed_hybrid"]),
                        num(r["hybrid_normaliser_rel_var"], r["hybrid_delta_method_valid"])]
            out.append(row)
        return out

    def __repr__(self) -> str:
        g = self.regime
        lines = [
            f"Diagnosis(n={g['n']}, m={g['m']}, d={g['d']}, target relative MSE={self.target:g})",
            f"  |q| median {g['q_norm_median']:.3g} (90%: {g['q_norm_q90']:.3g}), |k| median "
            f"{g['k_norm_median']:.3g} (90%: {g['k_norm_q90']:.3g})",
            f"  t = |q+k|^2: mean {g['t_bar']:.3g}, median {g['t_median']:.3g}, 90% {g['t_q90']:.3g}",
            f"  exact attention row entropy: mean {g['entropy_mean']:.3g}, min {g['entropy_min']:.3g} "
            f"(uniform: {g['log_m']:.3g})",
        ]
        if self.hybrid is not None:
            h = self.hybrid
            lines.append(
                f"  hybrid: window {h['window']}, sinks {h['sinks']}{', causal' if h['causal'] else ''}; mass in "
                f"the exact set p: median {g['p_median']:.3g} (10%: {g['p_q10']:.3g}, 90%: {g['p_q90']:.3g})"
            )
        table = self._table()
        widths = [max(len(row[i]) for row in table) for i in range(len(table[0]))]
        for row in table:
            lines.append("  " + "  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)))
        lines.append(f"  -> {self.recommendation}")
        return "\n".join(lines)

    def _repr_html_(self) -> str:
        table = self._table()
        head = "".join(f"<th>{c}</th>" for c in table[0])
        body = "".join("<tr>" + "".join(f"<td>{c}</td>" for c in row) + "</tr>" for row in table[1:])
        g = self.regime
        return (f"<p><b>Diagnosis</b> n={g['n']}, m={g['m']}, d={g['d']}; t̄ = {g['t_bar']:.3g}; "
                f"attention entropy {g['entropy_mean']:.3g} of {g['log_m']:.3g}</p>"
                f"<table><tr>{head}</tr>{body}</table><p>{self.recommendation}</p>")


def _flat(x: torch.Tensor) -> torch.Tensor:
    return x.reshape(-1, x.shape[-2], x.shape[-1])[0] if x.dim() > 2 else x


def diagnose(
    q: torch.Tensor,
    k: torch.Tensor,
    feature_map: Any = None,
    *,
    v: torch.Tensor | None = None,
    num_features: int | None = None,
    target: float = 0.01,
    max_features: int = 65536,
    max_pairs: int = 4096,
    max_rows: int = 64,
    seed: int = 0,
    window: int | None = None,
    sinks: int | Sequence[int] = 0,
    causal: bool = False,
) -> Diagnosis:
    r"""Report the regime of ``(q, k)`` and predict every estimator's error there (module docstring).

    Parameters
    ----------
    q : Tensor, shape (..., n, d)
    k : Tensor, shape (..., m, d)
        Inputs exactly as they would go into `kernelapprox.linear_attention` (already scaled
        by $d^{-1/4}$ for attention). With leading dimensions, the first batch element is
        diagnosed (pass one head at a time to see them all).
    feature_map : FeatureMap, optional
        Diagnose only this map (its ``num_features`` and sampler); default: every registered
        estimator with a closed form, with ``ka.DEFAULT_SAMPLER`` (orthogonal) rows where the theory
        covers them and iid rows otherwise.
    v : Tensor, shape (..., m, dv), optional
        Values: with them, each row also predicts the relative attention-output error
        $\sqrt{\sum\mathrm{Var}(\hat o)}/\|o\|_F$ on the sampled query rows by the delta
        method (iid rows, `kernelapprox.theory.attention_variance`; valid only where
        ``delta_method_valid``).
    num_features : int, optional
        ``r`` for the registered estimators (default 256, or ``feature_map.num_features``).
    target : float, default 0.01
        Target relative kernel MSE (median over pairs).
    max_features : int, default 65536
        Largest ``r`` considered feasible.
    max_pairs, max_rows : int
        Subsample sizes (pairs for the closed forms, query rows for exact attention).
    seed : int, default 0
        Seed of the subsampling.
    window : int, optional
        Diagnose hybrid attention with this window (`kernelapprox.hybrid_attention`; needs
        ``n == m``): the mass $p$ inside the exact set, the remainder's predicted errors and the
        hybrid recommendation (module docstring). Default ``None``: plain linear attention.
    sinks : int or sequence of int, default 0
        Sinks of the exact set (`kernelapprox.attention.hybrid.resolve_sinks`), with ``window``.
    causal : bool, default False
        Causal exact set and remainder ($j \le i$), with ``window``.

    Returns
    -------
    Diagnosis

    Examples
    --------
    One map, with values (the predicted attention-output error):

    >>> import torch, kernelapprox as ka
    >>> g = torch.Generator().manual_seed(0)
    >>> q, k, v = (0.1 * torch.randn(3, 64, 16, generator=g)).unbind(0)
    >>> dx = ka.diagnose(q, k, ka.PositiveRF(16, 64), v=v, max_pairs=256)
    >>> row = dx.rows[0]
    >>> row["estimator"], row["delta_method_valid"], bool(row["attn_rel_err_pred"] < 0.1)
    ('positive', True, True)
    >>> bool(row["r_needed"] < 64)      # r at which the median relative MSE reaches target
    True

    Hybrid attention: the mass inside a window of 8 keys and a sink, and the r the map then needs:

    >>> dx = ka.diagnose(3 * q, 3 * k, ka.PositiveRF(16, 64), v=v, window=8, sinks=1)
    >>> 0 < dx.regime["p_median"] < 1, dx.recommendation.startswith("window 8 + ")
    (True, True)
    >>> bool(dx.rows[0]["r_needed_hybrid"] < dx.rows[0]["r_needed"])
    True
    """
    from . import theory

    q = check_floating("q", q)
    k = check_floating("k", k)
    if q.dim() < 2:
        raise ValueError(f"q must have shape (..., n, d) with at least 2 dimensions, got shape {tuple(q.shape)}")
    d = q.shape[-1]
    check_last_dim("q", q, d)
    check_last_dim("k", k, d)
    check_finite_float("target", target, min=0.0, min_open=True)
    if num_features is not None:
        num_features = check_positive_int("num_features", num_features)
    seed = cast(int, check_seed("seed", seed, allow_none=False))
    if feature_map is not None and not isinstance(feature_map, FeatureMap):
        raise TypeError(f"feature_map must be a kernelapprox FeatureMap or None, got {feature_map!r}")
    check_positive_int("max_features", max_features)
    check_positive_int("max_pairs", max_pairs)
    check_positive_int("max_rows", max_rows)
    if not isinstance(causal, bool):
        raise TypeError(f"causal must be a bool, got {causal!r}")
    hyb: dict[str, Any] | None = None
    if window is not None:
        from .attention.hybrid import check_window, resolve_sinks

        if q.shape[-2] != k.shape[-2]:
            raise ValueError(
                f"window= (hybrid attention) needs as many queries as keys, got q {tuple(q.shape)} and k {tuple(k.shape)}"
            )
        w = check_window(window)
        hyb = {"window": w, "sinks": resolve_sinks(sinks, q.shape[-2], causal=causal), "causal": causal}
    elif _as_int(sinks) != 0:
        raise ValueError(f"sinks={sinks!r} needs window= (hybrid attention); pass window=0 for exact sinks alone")
    qf, kf = _flat(q).detach().double().cpu(), _flat(k).detach().double().cpu()
    if not (bool(torch.isfinite(qf).all()) and bool(torch.isfinite(kf).all())):
        raise ValueError("diagnose needs finite q and k")
    n, m = qf.shape[0], kf.shape[0]
    g = torch.Generator().manual_seed(seed)
    n_side = max(1, int(math.sqrt(max_pairs)))
    qi = torch.randperm(n, generator=g)[: min(n, n_side)]
    kj = torch.randperm(m, generator=g)[: min(m, n_side)]
    qs, ks = qf[qi], kf[kj]  # the closed forms are evaluated on all qs x ks pairs
    rows_idx = torch.randperm(n, generator=g)[: min(n, max_rows)]
    vf = None
    if v is not None:
        v = check_floating("v", v)
        if v.shape[-2] != k.shape[-2]:
            raise ValueError(f"v must have shape (..., m={k.shape[-2]}, dv), got {tuple(v.shape)}")
        vf = _flat(v).detach().double().cpu()

    qn, kn = qf.norm(dim=-1), kf.norm(dim=-1)
    t = ((qs[:, None, :] + ks[None, :, :]) ** 2).sum(-1)
    t_bar = float((qn**2).mean() + (kn**2).mean() + 2 * (qf.mean(0) @ kf.mean(0)))
    logits = qf[rows_idx] @ kf.T
    p = torch.softmax(logits, dim=-1)
    ent = -(p * torch.log(p.clamp_min(1e-300))).sum(-1)
    regime = {
        "n": n, "m": m, "d": d,
        "q_norm_median": float(qn.median()), "q_norm_q90": float(qn.quantile(0.9)),
        "k_norm_median": float(kn.median()), "k_norm_q90": float(kn.quantile(0.9)),
        "t_bar": t_bar, "t_median": float(t.median()), "t_q90": float(t.quantile(0.9)),
        "entropy_mean": float(ent.mean()), "entropy_min": float(ent.min()), "log_m": math.log(m),
        "pairs_q": len(qi), "pairs_k": len(kj),
    }
    per_head: list[dict[str, Any]] = []
    S_mask = R_mask = None
    if hyb is not None:
        from .attention.hybrid import exact_set_mask

        per_head = _exact_mass_per_head(q, k, hyb)
        regime.update({key: per_head[0][key] for key in ("p_median", "p_q10", "p_q90", "p_mean")})
        S_mask = exact_set_mask(n, window=hyb["window"], sinks=hyb["sinks"], causal=causal)
        att = torch.ones(n, n, dtype=torch.bool).tril() if causal else torch.ones(n, n, dtype=torch.bool)
        S_mask = S_mask & att
        R_mask = att & ~S_mask

    if feature_map is not None:
        from .registry import estimator_of

        est = estimator_of(feature_map)
        r0 = int(num_features or feature_map.num_features)
        smp0: str | None = getattr(getattr(feature_map, "sampler", None), "name", None)
        cands: list[tuple[Any, str | None, Any]] = [(est, smp0, feature_map)]
    else:
        r0 = int(num_features or 256)
        cands = []
        for est in estimators():
            if est.learned:
                continue
            if est.is_random:
                # the library's default rows where the theory covers them, iid rows otherwise
                law = DEFAULT_SAMPLER if "moments" in est.closed_forms(DEFAULT_SAMPLER) else "gaussian"
                if "moments" not in est.closed_forms(law):
                    continue
                cands.append((est, law, None))
            elif "exact_error" in est.closed_forms():
                cands.append((est, None, None))
    check_positive_int("num_features", r0)

    rows: list[dict[str, Any]] = []
    for est, smp, fm in cands:
        kw: dict[str, Any] = {} if smp is None else {"sampler": smp}
        if fm is None:
            r_build = r0 if est.is_random or est.data_dependent else None
            if est.data_dependent and not est.is_random:
                # Nystrom: with as many landmarks as keys it is exact attention at quadratic cost
                r_build = max(1, min(r0, m // 4))
            fm = est.build(d, r_build, seed=0, dtype=torch.float64, **kw)
        if est.data_dependent:
            fm.fit(qf, kf)
        rel = np.asarray(theory.relative_mse(fm, qs, ks), dtype=np.float64)
        rel_mean, rel_med = float(np.mean(rel)), float(np.median(rel))
        nv, valid, attn_pred = math.nan, True, math.nan
        r_need = math.nan
        if est.is_random:
            r_need = fm.num_features * rel_med / target
            if "attention_variance" in est.closed_forms("gaussian"):
                # the delta-method theory is for iid rows: evaluated on the iid twin of the map
                twin = fm if getattr(fm.sampler, "row_law", None) == "iid" else est.build(
                    d, fm.num_features, sampler="gaussian", seed=0, dtype=torch.float64)
                nrv = theory.normaliser_relative_variance(twin, qf[rows_idx], kf)
                nv = float(torch.as_tensor(nrv).max())
                valid = nv <= DELTA_VALID
                if vf is not None:
                    var = theory.attention_variance(twin, qf[rows_idx], kf, vf)
                    o = torch.softmax(qf[rows_idx] @ kf.T, dim=-1) @ vf
                    attn_pred = float(torch.sqrt(torch.as_tensor(var).sum()) / o.norm())
        row = {
            "estimator": est.name, "label": est.label, "sampler": smp or "none",
            "num_features": int(getattr(fm, "num_features", d)), "feature_dim": int(fm.feature_dim),
            "rel_mse_mean": rel_mean, "rel_mse_median": rel_med, "r_needed": float(r_need),
            "normaliser_rel_var": nv, "delta_method_valid": bool(valid), "attn_rel_err_pred": attn_pred,
            "kind": "random" if est.is_random else "deterministic",
        }
        if hyb is not None and R_mask is not None and S_mask is not None:
            in_rem = R_mask[qi][:, kj].numpy()
            rel_r = float(np.median(rel[in_rem])) if in_rem.any() else 0.0
            one_minus_p = 1.0 - regime["p_median"]
            r_hyb = max(1.0, fm.num_features * rel_r * one_minus_p**2 / target) if est.is_random else math.nan
            hnv, hvalid, hpred = math.nan, True, math.nan
            twin_h = None
            if est.is_random and "attention_variance" in est.closed_forms("gaussian"):
                twin_h = fm if getattr(fm.sampler, "row_law", None) == "iid" else est.build(
                    d, fm.num_features, sampler="gaussian", seed=0, dtype=torch.float64)
            if twin_h is not None or not est.is_random:
                var_d, var_o, err_det = _hybrid_rows(
                    twin_h if twin_h is not None else fm, qf, kf, vf, rows_idx, S_mask, R_mask)
                hnv = float(var_d.max())
                hvalid = hnv <= DELTA_VALID or not est.is_random  # deterministic: the exact error
                if vf is not None:
                    o = torch.softmax((qf[rows_idx] @ kf.T).masked_fill(~(S_mask | R_mask)[rows_idx], -math.inf),
                                      dim=-1) @ vf
                    sq_err = var_o.sum() if var_o is not None else cast(torch.Tensor, err_det)
                    hpred = float(sq_err.sqrt() / o.norm())
            row.update({
                "rel_mse_median_remainder": rel_r, "r_needed_hybrid": float(r_hyb),
                "hybrid_normaliser_rel_var": hnv, "hybrid_delta_method_valid": bool(hvalid),
                "hybrid_attn_rel_err_pred": hpred,
            })
        rows.append(row)

    if hyb is not None:
        return _hybrid_diagnosis(regime, rows, hyb, per_head, float(target), max_features)
    rand = [r for r in rows if r["kind"] == "random" and math.isfinite(r["r_needed"])]
    best = min(rand, key=lambda r: r["r_needed"], default=None)
    # feasible: the kernel target is reached with at most max_features projections and the
    # attention normaliser concentrates there (where the theory for it exists)
    feasible = best is not None and best["r_needed"] <= max_features
    if feasible and best is not None:
        rec = (f"{best['label']} ({best['sampler']} rows) reaches a median relative kernel MSE of "
               f"{target:g} at r ≈ {math.ceil(best['r_needed'])}")
        if not best["delta_method_valid"]:
            rec += ("; but its attention normaliser does not concentrate at r = "
                    f"{best['num_features']}: check the attention output by Monte Carlo")
    else:
        det = [r for r in rows if r["kind"] == "deterministic"]
        bd = min(det, key=lambda r: r["rel_mse_median"], default=None)
        rec = "no random-feature estimator reaches the target: "
        rec += (f"best random estimator {best['label']} would need r ≈ {best['r_needed']:.3g}; "
                if best is not None else "")
        rec += "use a learned or data-dependent map (ka.fit_feature_map with HedgehogFeatures, Nyström, Taylor)"
        if bd is not None:
            rec += f"; the best deterministic map here is {bd['label']} (median relative MSE {bd['rel_mse_median']:.3g})"
    return Diagnosis(regime=regime, rows=rows, recommendation=rec, feasible=feasible, target=float(target))


def _exact_mass_per_head(q: torch.Tensor, k: torch.Tensor, hyb: dict[str, Any]) -> list[dict[str, Any]]:
    """Quantiles over the queries of `exact_mass`, one dict per head (leading index, flattened)."""
    from .theory.hybrid_attention import exact_mass

    qh = q.detach().reshape(-1, *q.shape[-2:]) if q.dim() > 2 else q.detach()[None]
    kh = k.detach().reshape(-1, *k.shape[-2:]) if k.dim() > 2 else k.detach()[None]
    nh = max(qh.shape[0], kh.shape[0])
    out = []
    for h in range(nh):
        p = exact_mass(qh[h % qh.shape[0]].double().cpu(), kh[h % kh.shape[0]].double().cpu(),
                       window=hyb["window"], sinks=list(hyb["sinks"]), causal=hyb["causal"])
        out.append({"head": h, "p_median": float(p.median()), "p_q10": float(p.quantile(0.1)),
                    "p_q90": float(p.quantile(0.9)), "p_mean": float(p.mean())})
    return out


def _hybrid_rows(
    fm: FeatureMap, qf: torch.Tensor, kf: torch.Tensor, vf: torch.Tensor | None, rows: torch.Tensor,
    S: torch.Tensor, R: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    r"""Closed forms of hybrid attention on the sampled query rows.

    Random maps (iid rows): the pair covariances of `kernelapprox.theory.attention.pair_terms`
    summed over each row's remainder $R_i$ (the quadratic form of
    `kernelapprox.theory.hybrid_attention.hybrid_normaliser_variance` and
    `~kernelapprox.theory.hybrid_attention.hybrid_attention_variance`, evaluated on the rows
    only, in the log domain): $\mathrm{Var}(\hat D_i)/D_i^2$ (rows,) and, with ``vf``,
    $\mathrm{Var}(\hat o_{ic})$ (rows, dv). Deterministic maps: the exact squared errors,
    $(\hat D_i - D_i)^2/D_i^2$ and $\sum_{i,c}(\hat o_{ic} - o_{ic})^2$ (third output).
    """
    from .theory.attention import pair_terms

    terms = pair_terms(fm)
    q, A_att = qf[rows], (S | R)[rows]
    Rr = R[rows]
    logits = q @ kf.T  # (b, m)
    log_a = torch.log_softmax(logits.masked_fill(~A_att, -math.inf), dim=-1)
    if terms is None:  # deterministic: the error itself
        K_hat = fm.kernel(q, kf).double()
        A = torch.exp(log_a)  # softmax weights; the estimate on R, the same scale
        A_hat = torch.where(Rr, K_hat * torch.exp(-torch.logsumexp(logits.masked_fill(~A_att, -math.inf), -1,
                                                                   keepdim=True)), A).masked_fill(~A_att, 0.0)
        var_d = (A_hat.sum(-1) - 1.0) ** 2
        err = None
        if vf is not None:
            o_hat = (A_hat @ vf) / A_hat.sum(-1, keepdim=True)
            err = ((o_hat - A @ vf) ** 2).sum()
        return var_d, None, err
    r = fm.num_features
    kk = kf @ kf.T
    knorm = torch.diagonal(kk)
    half = 0.5 * (knorm[:, None] + knorm[None, :])
    kernels = {g: torch.exp(g * kk - half) for g in {t[3] for t in terms}}
    qn = (q * q).sum(-1, keepdim=True)
    results = []
    for a in ([None] if vf is None else [None, vf]):
        if a is None:
            w_base = torch.ones(*log_a.shape, 1, dtype=torch.float64)
        else:
            o = torch.exp(log_a) @ a
            w_base = a[None, :, :] - o[:, None, :]  # (b, m, c): the delta method's centring
        lin = (torch.exp(log_a.masked_fill(~Rr, -math.inf))[..., None] * w_base).sum(-2)
        second = torch.zeros(lin.shape, dtype=torch.float64)
        for c, al, be, ga in terms:
            u = (log_a + (be - 1.0) * logits + 0.5 * knorm[None, :] + 0.5 * al * qn).masked_fill(~Rr, -math.inf)
            shift = u.amax(-1, keepdim=True)
            shift = torch.where(torch.isfinite(shift), shift, torch.zeros_like(shift))  # empty remainder
            wts = torch.exp(u - shift)[..., None] * w_base
            second = second + c * torch.exp(2.0 * shift) * (wts * (kernels[ga] @ wts)).sum(-2)
        results.append(((second - lin**2) / r).clamp_min(0.0))
    return results[0][..., 0], (results[1] if vf is not None else None), None


def _hybrid_diagnosis(
    regime: dict[str, Any], rows: list[dict[str, Any]], hyb: dict[str, Any], per_head: list[dict[str, Any]],
    target: float, max_features: int,
) -> Diagnosis:
    """The hybrid recommendation (rule in the module docstring)."""
    w = hyb["window"]
    rand = [r for r in rows if r["kind"] == "random" and math.isfinite(r["r_needed_hybrid"])]
    best = min(rand, key=lambda r: r["r_needed_hybrid"], default=None)
    feasible = best is not None and best["r_needed_hybrid"] <= max_features
    p_med = regime["p_median"]
    if feasible and best is not None:
        budget = target / (1 - p_med) ** 2 if 1 - p_med > 1e-150 else math.inf
        rec = (f"window {w} + {best['label']} ({best['sampler']} rows) at r ≈ {math.ceil(best['r_needed_hybrid'])}: "
               f"the exact set holds a median p = {p_med:.3g} of the attention mass, the map's relative kernel "
               f"MSE budget on the remainder is target / (1 - p)^2 = {budget:.3g}")
        if not best["hybrid_delta_method_valid"]:
            rec += ("; but the hybrid normaliser does not concentrate at r = "
                    f"{best['num_features']}: check the attention output by Monte Carlo")
    else:
        det = [r for r in rows if r["kind"] == "deterministic"]
        bd = min(det, key=lambda r: r["rel_mse_median_remainder"], default=None)
        rec = f"no random-feature estimator reaches the target with window {w}: "
        rec += (f"best random estimator {best['label']} would need r ≈ {best['r_needed_hybrid']:.3g}; "
                if best is not None else "")
        rec += "use a wider window, or a learned or data-dependent map (ka.fit_feature_map with HedgehogFeatures, Nyström, Taylor)"
        if bd is not None:
            rec += (f"; the best deterministic map on the remainder is {bd['label']} (median relative MSE "
                    f"{bd['rel_mse_median_remainder']:.3g})")
    return Diagnosis(regime=regime, rows=rows, recommendation=rec, feasible=feasible, target=target,
                     hybrid=hyb, exact_mass=per_head)


WARN_RELATIVE_MSE = 1.0


def quick_relative_mse(fm: Any, q: torch.Tensor, k: torch.Tensor) -> float:
    r"""Predicted relative kernel MSE of ``fm`` on the batch ``(q, k)`` from $O(nd)$ statistics.

    The closed form of the map's estimator (`kernelapprox.theory.relative_mse`, fitted
    parameters included) evaluated at one representative pair with
    $\|x\|^2 = \overline{\|q\|^2}$, $\|y\|^2 = \overline{\|k\|^2}$ and
    $x^\top y = \bar q^\top\bar k$ (so that $\|x+y\|^2 = \bar t$, the mean over all
    pairs; the means are taken over at most ~256 evenly spaced tokens of each sequence), for the
    batch element with the largest $\bar t$. The relative MSE is convex and
    increasing in $t$, so by Jensen the mean over pairs is at least this value: the check
    errs toward silence. ``nan`` for maps without closed-form moments (deterministic, learned,
    hybrid, SORF/QMC rows).

    Parameters
    ----------
    fm : FeatureMap
    q : Tensor, shape (..., n, d)
    k : Tensor, shape (..., m, d)

    Returns
    -------
    float
    """
    from . import theory
    from ._logdomain import _mean_stats
    from .registry import estimator_of

    try:
        est = estimator_of(fm)
    except (LookupError, TypeError):
        return math.nan
    if not est.is_random or "moments" not in est.closed_forms(getattr(fm, "sampler", None)):
        return math.nan
    with torch.no_grad():
        dt = torch.promote_types(torch.promote_types(q.dtype, k.dtype), torch.float32)
        # at most ~256 evenly spaced tokens per sequence: the means of |q|^2, |k|^2, q and k are
        # what the check needs, and a strided view reads a fraction of the memory
        qd = q.detach()[..., :: max(1, q.shape[-2] // 256), :].to(dt)
        kd = k.detach()[..., :: max(1, k.shape[-2] // 256), :].to(dt)
        nq, nk, xy = torch.broadcast_tensors(*_mean_stats(qd, kd))
        tb = nq + nk + 2 * xy
        if not bool(torch.isfinite(tb).all()):
            return math.nan
        i = int(tb.reshape(-1).argmax())
        a2, b2, c = float(nq.reshape(-1)[i]), float(nk.reshape(-1)[i]), float(xy.reshape(-1)[i])
    d = int(q.shape[-1])
    a = math.sqrt(max(a2, 0.0))
    x = np.zeros((1, d))
    y = np.zeros((1, d))
    x[0, 0] = a
    y[0, 0] = c / a if a > 0 else 0.0
    if d > 1:
        y[0, 1] = math.sqrt(max(b2 - y[0, 0] ** 2, 0.0))
    rel = np.asarray(theory.relative_mse(fm, x, y), dtype=np.float64)
    return float(np.max(rel))


def _checkable(fm: Any, q: object, k: object) -> bool:
    """Inputs the check can read: floating tensors of the map's ``dim`` with broadcastable batch
    dimensions and at least one element, off the meta device (anything else is left to the attention
    call, which raises the input errors)."""
    if not (isinstance(q, torch.Tensor) and isinstance(k, torch.Tensor) and q.is_floating_point()
            and k.is_floating_point() and q.dim() >= 2 and k.dim() >= 2 and q.shape[-1] == fm.dim
            and k.shape[-1] == fm.dim and q.numel() > 0 and k.numel() > 0):
        return False  # an empty batch (B = 0) or sequence: nothing to check
    try:
        broadcast_shapes(q.shape[:-2], k.shape[:-2])
    except RuntimeError:
        return False
    return q.device.type != "meta"


def _user_stacklevel() -> int:
    """``stacklevel`` of the first frame outside kernelapprox and torch (the user's call), counted
    from the caller of this function's caller (`warn_if_hopeless`)."""
    import os
    import sys

    skip = (os.path.dirname(__file__) + os.sep, os.path.dirname(torch.__file__) + os.sep)
    frame: Any = sys._getframe(2)
    level = 2
    while frame is not None and frame.f_code.co_filename.startswith(skip):
        frame, level = frame.f_back, level + 1
    return level


def warn_if_hopeless(
    feature_map: Any, q: torch.Tensor, k: torch.Tensor, *, stacklevel: int | None = None
) -> float:
    r"""Warn when ``feature_map`` cannot approximate $e^{q^\top k}$ on the batch ``(q, k)``.

    Evaluates `quick_relative_mse` (the closed form at the mean pair, $O(nd)$ statistics and one
    host synchronisation) and issues a `KernelApproxWarning` when it exceeds `WARN_RELATIVE_MSE`:

    $$
    \frac{\operatorname{MSE}\hat K(\bar x, \bar y)}{K(\bar x, \bar y)^2} > 1,
    $$

    where linear attention with this map is far from softmax attention [Cho21]_. Maps without
    closed-form moments (deterministic, learned, hybrid, SORF/QMC rows) are never flagged, nor
    are inputs the attention call would reject, and nothing runs inside ``torch.compile`` (a
    decision on the host would break the graph). The layers of `kernelapprox.nn` and
    `kernelapprox.hf.linearize` call it once per map; ``ka.linear_attention(..., check=True)`` on
    every call.

    Parameters
    ----------
    feature_map : FeatureMap
    q : Tensor, shape (..., n, d)
    k : Tensor, shape (..., m, d)
        The inputs of the attention (already scaled, as the map sees them).
    stacklevel : int, optional
        Passed to `warnings.warn` (1: this function, 2: its caller). Default: the first frame
        outside kernelapprox and torch, i.e. the user's line.

    Returns
    -------
    float
        The predicted relative kernel MSE (``nan`` where nothing was checked).

    References
    ----------
    .. [Cho21] K. Choromanski et al. "Rethinking attention with Performers", ICLR 2021.

    Examples
    --------
    >>> import torch, warnings, kernelapprox as ka
    >>> from kernelapprox.diagnose import warn_if_hopeless
    >>> q, k = torch.randn(2, 128, 64, generator=torch.Generator().manual_seed(0)).unbind(0)
    >>> fm = ka.PositiveRF(64, 256, seed=0)
    >>> with warnings.catch_warnings(record=True) as w:
    ...     warnings.simplefilter("always")
    ...     rel = warn_if_hopeless(fm, q, k)      # the unscaled attention logits
    >>> rel > 1, [x.category.__name__ for x in w]
    (True, ['KernelApproxWarning'])
    >>> warn_if_hopeless(fm, q / 8, k / 8) < 1       # small norms: silent
    True
    """
    if (not getattr(feature_map, "is_random", False) or torch.compiler.is_compiling()
            or not _checkable(feature_map, q, k)):
        return math.nan
    rel = quick_relative_mse(feature_map, q, k)
    if rel > WARN_RELATIVE_MSE:
        import warnings

        warnings.warn(
            KernelApproxWarning(
                f"{type(feature_map).__name__} with r = {feature_map.num_features}: the closed form predicts "
                f"a relative kernel MSE of {rel:.3g} on this batch (at the mean |q + k|^2; > "
                f"{WARN_RELATIVE_MSE:g}), so linear attention will be far from softmax attention. Inputs "
                "scaled by d^(-1/4)? See ka.diagnose(q, k) for every estimator and the r each needs; "
                "silence with check=False or warnings.filterwarnings('ignore', category=ka.KernelApproxWarning)."
            ),
            stacklevel=_user_stacklevel() if stacklevel is None else stacklevel,
        )
    return rel

