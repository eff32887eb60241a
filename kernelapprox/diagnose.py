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
  $E[(\hat K-K)^2]/K^2$ (mean and median over the sampled pairs; the mean is carried by the
  worst pairs), the ``r`` at which the median would reach ``target`` (the MSE of the iid term
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
from dataclasses import dataclass, field
from typing import Any, cast

import numpy as np
import torch

from ._validation import check_finite_float, check_floating, check_last_dim, check_positive_int, check_seed
from .attention._common import install_input_check
from .maps.base import FeatureMap
from .registry import estimators

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
        and minimum entropy of exact attention rows and ``log_m``.
    rows : list of dict
        One per estimator: ``estimator``, ``label``, ``sampler``, ``num_features``,
        ``feature_dim``, ``rel_mse_mean``, ``rel_mse_median``, ``r_needed``,
        ``normaliser_rel_var`` (NaN where no theory), ``delta_method_valid``,
        ``attn_rel_err_pred`` (with ``v``; NaN otherwise), ``kind``.
    recommendation : str
    feasible : bool
        Whether some random estimator reaches ``target`` with at most ``max_features`` projections.
    target : float

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
        head = ["estimator", "sampler", "r", "rel. MSE (median)", "rel. MSE (mean)", "r for target", "normaliser var"]
        out = [head]
        for r in self.rows:
            nv = r["normaliser_rel_var"]
            out.append([
                r["label"], r["sampler"], str(r["num_features"]), f"{r['rel_mse_median']:.3g}",
                f"{r['rel_mse_mean']:.3g}", "-" if not math.isfinite(r["r_needed"]) else f"{r['r_needed']:.3g}",
                "-" if not math.isfinite(nv) else f"{nv:.3g}" + ("" if r["delta_method_valid"] else " (delta invalid)"),
            ])
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
        estimator with a closed form, with orthogonal rows where the theory covers them.
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
    }

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
                law = "orthogonal" if "moments" in est.closed_forms("orthogonal") else "gaussian"
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
        rows.append({
            "estimator": est.name, "label": est.label, "sampler": smp or "none",
            "num_features": int(getattr(fm, "num_features", d)), "feature_dim": int(fm.feature_dim),
            "rel_mse_mean": rel_mean, "rel_mse_median": rel_med, "r_needed": float(r_need),
            "normaliser_rel_var": nv, "delta_method_valid": bool(valid), "attn_rel_err_pred": attn_pred,
            "kind": "random" if est.is_random else "deterministic",
        })

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


class KernelApproxWarning(UserWarning):
    """Raised (once per call site, by Python's default warning filter) when the closed forms predict
    that a random feature map cannot approximate $e^{q^\\top k}$ on the given batch.

    Issued by `warn_if_hopeless`: once per map by `kernelapprox.nn.LinearAttention`,
    `kernelapprox.nn.LinearAttentionHeads` and `kernelapprox.hf.linearize` (their ``check=False``
    turns it off), and by ``ka.linear_attention(..., check=True)``. Silence it with
    ``warnings.filterwarnings("ignore", category=ka.KernelApproxWarning)``.

    Examples
    --------
    >>> import torch, warnings, kernelapprox as ka
    >>> g = torch.Generator().manual_seed(0)
    >>> q, k = (2 * torch.randn(2, 32, 16, generator=g)).unbind(0)    # logits far too large
    >>> with warnings.catch_warnings(record=True) as w:
    ...     warnings.simplefilter("always")
    ...     _ = warn_if_hopeless(ka.PositiveRF(16, 64, seed=0), q, k)
    >>> issubclass(w[0].category, ka.KernelApproxWarning), issubclass(ka.KernelApproxWarning, UserWarning)
    (True, True)
    """


#: Predicted relative kernel MSE above which `warn_if_hopeless` warns.
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
        torch.broadcast_shapes(q.shape[:-2], k.shape[:-2])
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


def _linear_attention_check(feature_map: Any, q: torch.Tensor, k: torch.Tensor) -> None:
    """The check of ``ka.linear_attention(..., check=True)``: `warn_if_hopeless`."""
    warn_if_hopeless(feature_map, q, k)


install_input_check(_linear_attention_check)
