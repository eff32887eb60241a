r"""repro-yu-orf-variance: Yu et al. 2016 (Orthogonal Random Features), Fig. 2, reproduced.

Yu et al. (NeurIPS 2016, arXiv:1610.09072), Fig. 2, plots the variance ratio
$\mathrm{Var}(K_{ORF})/\mathrm{Var}(K_{RFF})$ of the Gaussian-kernel estimate
$\hat K(x, y) = \frac1D\sum_{i=1}^D\cos(w_i^\top(x-y))$ (the sin/cos map with $D$ projections)
against $z = \|x-y\|$ (bandwidth $\sigma = 1$) for $d = 2, 4, 8, 16, 32$ at $D = d$ (one
orthogonal block). Three curves per $d$ are drawn here on one plot:

* **exact** (this library): ``ka.theory.trig_sincos_mse(..., row_law="orthogonal-chi")`` over the iid
  MSE; with $s = z^2$,
  $$\rho_{\rm exact}(z) = 1 + \frac{2(D-1)\big[{}_1F_1(d;\tfrac d2;-\tfrac s2) - e^{-s}\big]}
  {(1-e^{-s})^2};$$
* **Yu's leading order** (their eq. (3), from Lemma 2, asymptotic in $d$):
  $$\rho_{\rm Yu}(z) = 1 - \frac{(D-1)\,e^{-z^2}z^4}{d\,(1-e^{-z^2})^2};$$
* **Monte Carlo**: $S$ independent draws of the library's ``orthogonal`` (χ-norm Haar ORF, Yu's
  eq. (2)) and ``gaussian`` (iid RFF) samplers; ratio of the mean squared errors with a
  delta-method 95% CI on the log ratio (the squared errors of bounded trig features have all
  moments, so the CLT interval is valid).

The ratio does not depend on the norms of $x, y$ (for the softmax-kernel map the factor
$e^{(\|x\|^2+\|y\|^2)/2}$ cancels), so the pairs are $x = z u/2$, $y = -z u/2$.

Verdict rules (fixed before the runs; ``studies.verdicts.compare_to_reference``)
--------------------------------------------------------------------------------
Every verdict is per (d, z) point: the Monte Carlo 95% CI against a curve's value ± a relative
tolerance of ``TOL_REL`` = 10%, ``agrees`` / ``differs`` / ``inconclusive`` (Schuirmann's two
one-sided tests at 2.5% each; no correction over points: the summary reports the counts, and the
points of one d share their draws, so they are not independent).

* exact closed form vs MC (the reproduction of the figure's curves);
* Yu's eq. (3) vs MC (where their leading-order form holds);
* Yu's Lemma 1 (iid variance) vs the MC iid relative variance.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd
import torch

import kernelapprox as ka
import kernelapprox.montecarlo as mc
from studies._engine import Context, Study, df_to_markdown, fmt, row, save_figure, set_style
from studies.estimators import get
from studies.verdicts import Verdict, compare_to_reference, format_verdict

DIMS = [2, 4, 8, 16, 32]
Z_MAX = 4.0
N_Z, N_Z_QUICK = 32, 10
DRAWS, DRAWS_QUICK = 20000, 2000  # Yu et al. Fig. 3 uses 20,000 random matrices per point
CHUNK = 2000  # draws per batched map (memory: CHUNK x P x 2D doubles)
PAPER = "Yu et al. 2016, Fig. 2"
GAP_DIMS = [2, 4, 8, 16, 32, 64, 128, 256]  # closed forms only, beyond the MC range
Z_FINE = np.linspace(0.02, Z_MAX, 400)
TOL_REL = 0.10  # relative tolerance of every per-point verdict (module docstring)
LABELS = ("agrees", "differs", "inconclusive")


def point_verdicts(sub: pd.DataFrame, ref: str, what: str) -> list[Verdict]:
    """Per-point verdicts: each row's MC CI against ``sub[ref]`` ± ``TOL_REL`` (relative).

    Parameters
    ----------
    sub : pandas.DataFrame, shape (n_points, ...)
        Rows with ``mean``, ``ci_low``, ``ci_high`` and the column ``ref``.
    ref : str
        Column of the reference curve (``"exact"``, ``"yu"``).
    what : str
        How the statements name the estimate.

    Returns
    -------
    list of Verdict, length n_points
        In the row order of ``sub``.
    """
    return [compare_to_reference(float(r["mean"]), float(r["ci_low"]), float(r["ci_high"]),
                                 float(r[ref]), tolerance=TOL_REL,
                                 what=f"{what} at d = {int(r['d'])}, z = {fmt(float(r['z']))}")
            for _, r in sub.iterrows()]


def count_labels(verdicts: list[Verdict]) -> dict[str, int]:
    """Counts of ``agrees`` / ``differs`` / ``inconclusive`` in ``verdicts`` (every label shown)."""
    return {lab: sum(v.label == lab for v in verdicts) for lab in LABELS}


def _counts_text(c: dict[str, int]) -> str:
    return ", ".join(f"{lab} {c[lab]}" for lab in LABELS)


def max_abs_gap(d: int) -> float:
    """max over 0 < z <= 4 of |ρ_Yu(z) − ρ_exact(z)| at D = d (a 400-point z grid)."""
    return float(np.max(np.abs(yu_ratio(Z_FINE, d) - exact_ratio(Z_FINE, d))))


def yu_ratio(z: np.ndarray | float, d: int, D: int | None = None) -> np.ndarray:
    r"""Yu et al.'s leading-order variance ratio ORF/RFF, their eq. (3).

    $$\rho_{\rm Yu}(z) = 1 - \frac{(D-1)\,e^{-z^2}z^4}{d\,(1-e^{-z^2})^2}$$

    Parameters
    ----------
    z : float or array, shape (n,)
        $\|x - y\|/\sigma$, > 0.
    d : int
        Input dimension, >= 1.
    D : int, optional
        Number of projections ($D \le d$; default $d$, one full block).

    Returns
    -------
    numpy.ndarray, shape of ``z``

    References
    ----------
    F. X. Yu et al., "Orthogonal Random Features", NeurIPS 2016, eq. (3).

    Examples
    --------
    >>> round(float(yu_ratio(1.0, 4)), 6)  # 1 - 3 e^{-1} / (4 (1 - e^{-1})^2)
    0.309495
    """
    if isinstance(d, bool) or not isinstance(d, (int, np.integer)) or d < 1:
        raise ValueError(f"d must be a positive int, got {d!r}")
    D = d if D is None else D
    if isinstance(D, bool) or not isinstance(D, (int, np.integer)) or not 1 <= D <= d:
        raise ValueError(f"D must be an int in [1, d={d}], got {D!r}")
    z = np.asarray(z, dtype=np.float64)
    if np.any(~(z > 0)):
        raise ValueError(f"z must be > 0, got {z!r}")
    s = z**2
    return 1.0 - (D - 1) * np.exp(-s) * s**2 / (d * (-np.expm1(-s)) ** 2)


def exact_ratio(z: np.ndarray | float, d: int, D: int | None = None) -> np.ndarray:
    r"""Exact ORF/RFF variance ratio from the library's closed form (``ka.theory``).

    ``trig_sincos_mse(x, y, D, row_law="orthogonal-chi") / trig_sincos_mse(x, y, D)`` at
    $x = zu/2$, $y = -zu/2$ (any unit $u$; the ratio depends on $z$ only).

    Parameters
    ----------
    z : float or array, shape (n,)
        $\|x - y\|$, > 0.
    d : int
        Input dimension.
    D : int, optional
        Number of projections (default $d$).

    Returns
    -------
    numpy.ndarray, shape of ``z``

    References
    ----------
    F. X. Yu et al., "Orthogonal Random Features", NeurIPS 2016, Lemma 2 (whose exact value is
    ${}_1F_1(d; d/2; -z^2/2)$, derived in ``docs/theory.md``).
    """
    if isinstance(d, bool) or not isinstance(d, (int, np.integer)) or d < 1:
        raise ValueError(f"d must be a positive int, got {d!r}")
    D = d if D is None else D
    z = np.atleast_1d(np.asarray(z, dtype=np.float64))
    if np.any(~(z > 0)):
        raise ValueError(f"z must be > 0, got {z!r}")
    x, y = _pairs(z, d)
    orf = np.diagonal(ka.theory.trig_sincos_mse(x, y, D, row_law="orthogonal-chi"))
    iid = np.diagonal(ka.theory.trig_sincos_mse(x, y, D))
    return orf / iid


def _pairs(z: np.ndarray, d: int) -> tuple[np.ndarray, np.ndarray]:
    """x = z u / 2, y = -x with u = e_1: shape (n, d) each."""
    x = np.zeros((z.size, d))
    x[:, 0] = z / 2
    return x, -x


def z_grid(quick: bool) -> np.ndarray:
    """The z values, shape (N_Z,)."""
    return np.linspace(Z_MAX / (N_Z_QUICK if quick else N_Z), Z_MAX, N_Z_QUICK if quick else N_Z)


def grid(quick: bool) -> list[dict]:
    """One cell per d (D = d)."""
    return [{"d": d} for d in DIMS]


def _sq_errors(key: str, d: int, x: torch.Tensor, y: torch.Tensor, S: int, ctx: Context) -> np.ndarray:
    """Squared relative errors of S draws at the pairs, shape (S, P); batched in chunks."""
    K = torch.exp((x * y).sum(-1))
    out = []
    for c0 in range(0, S, CHUNK):
        n = min(CHUNK, S - c0)
        fm = get(key).build(d, d, batch_shape=(n,), seed=ctx.seed_for("draws", key, d, c0),
                            dtype=ctx.dtype, device=ctx.device)
        fx, lx = fm.log_features(x)  # (n, P, 2D), (n, P)
        fy, ly = fm.key_log_features(y)
        est = (fx * fy).sum(-1) * torch.exp(lx + ly)  # diagonal of fm.kernel(x, y)
        out.append((mc.relative_error(est, K) ** 2).cpu().numpy())
    return np.concatenate(out, axis=0)


def run_cell(cell: dict, ctx: Context) -> list[dict]:
    """MC variance ratio ORF/RFF at every z, beside the exact and Yu's leading-order ratios."""
    d = int(cell["d"])
    S = DRAWS_QUICK if ctx.quick else DRAWS
    z = z_grid(ctx.quick)
    xn, yn = _pairs(z, d)
    x = torch.as_tensor(xn, dtype=ctx.dtype, device=ctx.device)
    y = torch.as_tensor(yn, dtype=ctx.dtype, device=ctx.device)
    orf = _sq_errors("trig-sincos-orthogonal", d, x, y, S, ctx)
    iid = _sq_errors("trig-sincos-gaussian", d, x, y, S, ctx)
    ratio, _, lo, hi = mc.ratio_of_means_ci(orf, iid)
    ex, yu = exact_ratio(z, d), yu_ratio(z, d)
    # iid relative variance against Yu's Lemma 1, Var = (1 - e^{-z^2})^2 / (2D), relative to
    # K^2 = e^{-z^2} for the Gaussian kernel.
    lemma1 = (-np.expm1(-z**2)) ** 2 / (2 * d) / np.exp(-z**2)
    rows = []
    for i, zi in enumerate(z):
        r_ = row("var_ratio", float(ratio[i]), z=float(zi), exact=float(ex[i]), yu=float(yu[i]))
        r_.update(ci_low=float(lo[i]), ci_high=float(hi[i]), n_draws=S)
        rows.append(r_)
        rows.append(row("iid_rel_var", iid[:, i], z=float(zi), exact=float(lemma1[i]),
                        yu=float(lemma1[i])))
    return rows


def _ratio(df: pd.DataFrame) -> pd.DataFrame:
    sub = df[df["metric"] == "var_ratio"].copy()
    sub["yu_gap"] = sub["yu"] / sub["exact"] - 1.0
    sub["inside"] = (sub["ci_low"] <= sub["exact"]) & (sub["exact"] <= sub["ci_high"])
    return sub


def plot(df: pd.DataFrame, folder: Path) -> list[Path]:
    """(a) the ratio against z: exact, Yu eq. (3), MC; (b) Yu's relative gap against z; (c) max gap vs d."""
    # hand-written: the closed forms are dense curves in z evaluated here, not columns of results.csv
    import matplotlib.pyplot as plt
    import seaborn as sns
    from matplotlib.lines import Line2D

    set_style()
    sub = _ratio(df)
    dims = sorted(sub["d"].unique())
    pal = dict(zip(dims, sns.color_palette("viridis", len(dims)), strict=True))
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    ax = axes[0]
    zz = np.linspace(0.02, Z_MAX, 300)
    for d in dims:
        g = sub[sub["d"] == d].sort_values("z")
        ax.plot(zz, exact_ratio(zz, int(d)), color=pal[d], lw=1.6)
        ax.plot(zz, yu_ratio(zz, int(d)), color=pal[d], lw=1.2, ls="--")
        ax.errorbar(g["z"], g["mean"], yerr=[g["mean"] - g["ci_low"], g["ci_high"] - g["mean"]],
                    fmt="o", ms=3, color=pal[d], capsize=1.5, lw=0.8)
    ax.axhline(1, color="k", lw=0.8)
    ax.set_xlabel("z = ‖x − y‖ (σ = 1)")
    ax.set_ylabel("Var(ORF) / Var(RFF), D = d")
    ax.set_title(f"(a) {PAPER}: variance ratio", fontsize=10)
    handles = [Line2D([], [], color=pal[d], lw=2) for d in dims]
    labels = [f"d = {int(d)}" for d in dims]
    handles += [Line2D([], [], color="k", lw=1.6), Line2D([], [], color="k", lw=1.2, ls="--"),
                Line2D([], [], color="k", marker="o", ls="", ms=4)]
    labels += ["exact (library, ₁F₁)", "Yu eq. (3), leading order in 1/d",
               "Monte Carlo, 95% CI"]
    ax.legend(handles, labels, fontsize=7, loc="lower right")

    ax = axes[1]
    for d in dims:
        gap = np.abs(yu_ratio(zz, int(d)) - exact_ratio(zz, int(d)))
        ax.plot(zz, gap, color=pal[d], label=f"d = {int(d)}")
    ax.set_yscale("log")
    ax.set_ylim(1e-4, 1)
    ax.set_xlabel("z = ‖x − y‖")
    ax.set_ylabel("|ρ_Yu − ρ_exact| (ratio units)")
    ax.set_title("(b) gap of Yu's eq. (3) to the exact ratio", fontsize=10)
    ax.legend(fontsize=7)

    ax = axes[2]
    dd = np.asarray(GAP_DIMS, float)
    worst = np.array([max_abs_gap(int(d)) for d in GAP_DIMS])
    ax.loglog(dd, worst, "o-", color="C3", label="max over z ≤ 4 of |ρ_Yu − ρ_exact|")
    ax.loglog(dd, 3 / (dd + 2), "s-", color="C0", ms=4, label="exact ρ(z → 0) = 3/(d + 2)")
    ax.loglog(dd, 1 / dd, "^--", color="C0", ms=4, label="Yu's ρ(z → 0) = 1/d")
    ax.loglog(dd, worst[-1] * dd[-1] / dd, "k:", lw=1, label="∝ 1/d")
    ax.axhline(0.05, color="grey", lw=0.8, ls="--", label="0.05")
    ax.set_xlabel("d (= D)")
    ax.set_ylabel("ratio units")
    ax.set_title("(c) where the leading-order form holds", fontsize=10)
    ax.legend(fontsize=7)
    fig.suptitle(f"Reproduction of {PAPER}: orthogonal / iid variance of the Gaussian-kernel "
                 "estimate (curves: closed forms; dots: Monte Carlo)", y=1.02)
    fig.tight_layout()
    return save_figure(fig, folder, "yu_fig2_variance_ratio")


def summarize(df: pd.DataFrame, ctx: Context) -> str:
    """Table of ratio per d at a few z, coverage of the exact curve, Yu's gap per d; verdict."""
    sub = _ratio(df)
    zs = sorted(sub["z"].unique())
    pick = [zs[int(round(i))] for i in np.linspace(0, len(zs) - 1, 4)]
    t = sub[sub["z"].isin(pick)].copy()
    t["MC (95% CI)"] = [f"{fmt(m)} [{fmt(a)}, {fmt(b)}]"
                        for m, a, b in zip(t["mean"], t["ci_low"], t["ci_high"], strict=True)]
    tab = t[["d", "z", "MC (95% CI)", "exact", "yu"]].rename(
        columns={"exact": "exact (library)", "yu": "Yu eq. (3)"})
    gaps = {d: max_abs_gap(d) for d in GAP_DIMS}
    z1 = float(sub["z"].iloc[(sub["z"] - 1).abs().argmin()])
    rel1 = {int(d): float(yu_ratio(z1, int(d)) / exact_ratio(z1, int(d))[0] - 1) for d in DIMS}
    cover = float(sub["inside"].mean())
    n = len(sub)
    S = int(sub["n_draws"].iloc[0])
    iid = df[df["metric"] == "iid_rel_var"]
    iid_in = float(((iid["ci_low"] <= iid["exact"]) & (iid["exact"] <= iid["ci_high"])).mean())
    holds = [d for d, g in gaps.items() if g < 0.05]
    zmin = sub[sub["z"] == sub["z"].min()].sort_values("d")
    lines = ["## Key results", "",
             f"Variance ratio ORF / RFF of the Gaussian-kernel estimate at D = d ({S} draws per "
             "sampler and point; every z is in results.csv):", "", df_to_markdown(tab), "",
             "Where Yu's leading-order form holds: largest gap |ρ_Yu − ρ_exact| over 0 < z ≤ 4, "
             f"the relative gap ρ_Yu/ρ_exact − 1 at z = {fmt(z1)}, and the z → 0 limits "
             "(exact 3/(d+2), Yu 1/d; closed forms, d > 32 without Monte Carlo):", "",
             df_to_markdown(pd.DataFrame({
                 "d": GAP_DIMS, "max |gap|": [gaps[d] for d in GAP_DIMS],
                 f"rel. gap at z = {fmt(z1)} (%)": [100 * rel1[d] if d in rel1 else float("nan")
                                                     for d in GAP_DIMS],
                 "exact ρ(0+)": [3 / (d + 2) for d in GAP_DIMS],
                 "Yu ρ(0+)": [1 / d for d in GAP_DIMS]})), "",
             "## Finding", ""]
    se_log = (np.log(sub["ci_high"]) - np.log(sub["ci_low"])) / (2 * 1.959964)
    dev = (np.log(sub["mean"]) - np.log(sub["exact"])) / se_log
    worst = sub.loc[dev.abs().idxmax()]
    f = [f"- Exact closed form vs Monte Carlo: the exact ratio lies inside the 95% CI at "
         f"{fmt(100 * cover, 3)}% of the {n} (d, z) points; the misses come in runs of "
         "neighbouring z, because one d's draws are shared by all its z (so the points are not "
         f"independent); the largest deviation is {fmt(float(dev.abs().max()), 2)} standard "
         f"errors (d = {int(worst['d'])}, z = {fmt(worst['z'])}).",
         f"- Yu's Lemma 1 (iid variance (1 − e^(−z²))²/(2D)) lies inside the MC CI at "
         f"{fmt(100 * iid_in, 3)}% of the points.",
         f"- Yu's eq. (3) vs exact at z = {fmt(z1)}: " +
         ", ".join(f"{fmt(100 * g, 2)}% (d = {d})" for d, g in rel1.items()) +
         ".",
         "- Largest absolute gap over z: " +
         ", ".join(f"{fmt(gaps[d], 2)} (d = {d})" for d in GAP_DIMS) +
         f"; it falls like 1/d and is below 0.05 only from d = {min(holds) if holds else '–'}.",
         "- Near z = 0 the exact ratio tends to 3/(d + 2) (MC at the smallest z: " +
         ", ".join(f"{fmt(r.mean)} [{fmt(r.ci_low)}, {fmt(r.ci_high)}] at d = {int(r.d)}"
                   for r in zmin.itertuples()) +
         "), Yu's to 1/d: the relative error there tends to 2/3 at every d, because both are "
         "O(1/d) and the dropped f(z)/d² term is of the same order.",
         f"- ORF is worse than iid (ratio > 1) at large z for small d (max MC ratio "
         f"{fmt(sub['mean'].max())}; exact {fmt(sub['exact'].max())}).",
         ]
    v_exact = point_verdicts(sub, "exact", "MC ratio")
    v_yu = point_verdicts(sub, "yu", "MC ratio")
    v_iid = point_verdicts(iid, "exact", "MC iid relative variance")
    c_exact, c_iid = count_labels(v_exact), count_labels(v_iid)
    f.append(f"- {PAPER}, exact closed form (the library) vs Monte Carlo, per (d, z) point, MC 95% "
             f"CI against exact ± {fmt(100 * TOL_REL, 2)}% (relative): {_counts_text(c_exact)} "
             f"of {len(v_exact)} points.")
    f.append(f"- Yu's Lemma 1 (iid variance) vs Monte Carlo, same rule: {_counts_text(c_iid)} of "
             f"{len(v_iid)} points.")
    by_d = "; ".join(
        f"d = {int(d)}: " + _counts_text(count_labels([v for v, dd in zip(v_yu, sub["d"],
                                                                         strict=True)
                                                       if dd == d]))
        for d in sorted(sub["d"].unique()))
    f.append(f"- Yu's leading-order eq. (3) vs Monte Carlo, same rule ({_counts_text(count_labels(v_yu))}"
             f" of {len(v_yu)} points); per d: {by_d}. Where it differs it drops the O(1/d²) "
             "remainder f(z)/d² of their Lemma 2.")
    worst_yu = max(zip(v_yu, sub["yu"] / sub["mean"], strict=True),
                   key=lambda t: abs(float(np.log(t[1]))))[0]
    shown = [v for v in v_exact if v.label != "agrees"][:3] or [v_exact[int(dev.abs().argmax())]]
    f += [f"  {format_verdict(v)}" for v in [*shown, worst_yu]]
    lines += f + [""]
    return "\n".join(lines)


STUDY = Study(
    name="repro-yu-orf-variance",
    description="Reproduces Yu et al. 2016 Fig. 2: Var(ORF)/Var(RFF) against ‖x−y‖ for d = 2–32 "
    "(exact closed form, Yu's eq. (3), Monte Carlo).",
    grid=grid,
    run_cell=run_cell,
    plot=plot,
    summarize=summarize,
    headline="yu_fig2_variance_ratio.png",
    cache_version="1",
)
