"""orthogonal-gain: MSE of orthogonal / structured / QMC projections relative to iid ones.

For positive and trig sin/cos features at d in {16, 64} and r/d in {1/4 ... 8}, a fixed set of
(q, k) pairs is built with controlled ‖q + k‖ (what the positive estimator's MSE depends on) and
‖q − k‖ (what the trig estimator's MSE depends on): q = (z + Δ)/2, k = (z − Δ)/2 with z ⊥ Δ in
random directions.  Two sweeps share the pairs: ‖q + k‖ varies at ‖q − k‖ = 1, and ‖q − k‖ varies
at ‖q + k‖ = 1.  Each sampler (gaussian = iid, orthogonal, structured = SORF, qmc) is drawn S times
in one batched map; the per-pair MSE ratio sampler/iid is reported with a delta-method 95% CI
(on the log ratio, independent draws) beside the closed-form ratio from ``ka.theory.mse``
(orthogonal only; SORF and QMC have no closed form).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd
import torch

import kernelapprox.montecarlo as mc
from studies._framework import Context, Study, df_to_markdown, fmt, row, save_figure, set_style
from studies.estimators import SAMPLER_LABEL, get

FAMILIES = ["positive", "trig-sincos"]
SAMPLERS = ["gaussian", "orthogonal", "structured", "qmc"]
DIMS = [16, 64]
R_OVER_D = [0.25, 0.5, 1, 2, 4, 8]
NORMS = [0.25, 0.5, 1.0, 1.5, 2.0]
FIXED = 1.0  # the other norm in each sweep
DRAWS, DRAWS_QUICK = 1024, 256
FAMILY_AXIS = {"positive": "sum", "trig-sincos": "diff"}  # the norm each family's MSE depends on
AXIS_LABEL = {"sum": "‖q + k‖", "diff": "‖q − k‖"}


def grid(quick: bool) -> list[dict]:
    """Cells: (family, d, r); samplers evaluated inside a cell on the same pairs."""
    dims = DIMS[:1] if quick else DIMS
    rod = [0.25, 1, 4] if quick else R_OVER_D
    return [{"family": f, "d": d, "r": max(1, int(round(x * d)))}
            for f in FAMILIES for d in dims for x in rod]


def make_pairs(d: int, ctx: Context) -> tuple[torch.Tensor, torch.Tensor, pd.DataFrame]:
    """(q, k) pairs of the two sweeps, as (P, d) tensors, and their description."""
    g = ctx.generator("pairs", d)
    specs = [("sum", a, FIXED) for a in NORMS] + [("diff", FIXED, b) for b in NORMS]
    qs, ks, meta = [], [], []
    for sweep, a, b in specs:
        m = torch.randn(2, d, generator=g, dtype=torch.float64)
        u = m[0] / m[0].norm()
        v = m[1] - (m[1] @ u) * u
        v = v / v.norm()
        z, delta = a * u, b * v
        qs.append((z + delta) / 2)
        ks.append((z - delta) / 2)
        meta.append({"sweep": sweep, "sum_norm": a, "diff_norm": b})
    q, k = torch.stack(qs), torch.stack(ks)
    return q.to(ctx.device, ctx.dtype), k.to(ctx.device, ctx.dtype), pd.DataFrame(meta)


def run_cell(cell: dict, ctx: Context) -> list[dict]:
    """Squared errors of every sampler on the pairs; MSE ratios to iid with CIs and theory."""
    import kernelapprox as ka

    fam, d, r = cell["family"], int(cell["d"]), int(cell["r"])
    S = DRAWS_QUICK if ctx.quick else DRAWS
    q, k, meta = make_pairs(d, ctx)
    K = torch.exp((q * k).sum(-1))  # (P,)
    sq: dict[str, np.ndarray] = {}
    theory: dict[str, np.ndarray] = {}
    for smp in SAMPLERS:
        spec = get(f"{fam}-{smp}")
        fm = spec.build(d, r, batch_shape=(S,), seed=ctx.seed_for(cell, smp), dtype=ctx.dtype,
                        device=ctx.device)
        fq, lq = fm.log_features(q)  # (S, P, F), (S, P)
        fk, lk = fm.key_log_features(k)
        est = (fq * fk).sum(-1) * torch.exp(lq + lk)  # the diagonal of fm.kernel(q, k)
        sq[smp] = (mc.relative_error(est, K) ** 2).cpu().numpy()  # (S, P) squared relative errors
        if spec.has_theory:
            fm0 = spec.build(d, r, seed=0, dtype=ctx.dtype, device=ctx.device)
            theory[smp] = torch.diagonal(ka.theory.mse(fm0, q, k)).div(K**2).cpu().numpy()
    rows: list[dict] = []
    base = sq["gaussian"]
    for smp in SAMPLERS:
        x = sq[smp]
        # MSE ratio to iid per pair, delta-method CI on the log ratio (independent draws)
        ratio, _, lo, hi = mc.ratio_of_means_ci(x, base)
        for p, m in meta.iterrows():
            extra = {"sampler": smp, "pair": int(p), **m.to_dict(), "r_over_d": r / d}
            rows.append(row("rel_mse", x[:, p],
                            theory=float(theory[smp][p]) if smp in theory else float("nan"),
                            **extra))
            if smp == "gaussian":
                continue
            th = (theory[smp][p] / theory["gaussian"][p]) if smp in theory else float("nan")
            r_ = row("mse_ratio", float(ratio[p]), **extra, theory=float(th))
            r_.update(ci_low=float(lo[p]), ci_high=float(hi[p]), n_draws=S)
            rows.append(r_)
    return rows


def _ratio_frame(df: pd.DataFrame) -> pd.DataFrame:
    sub = df[df["metric"] == "mse_ratio"].copy()
    sub["sampler "] = sub["sampler"].map(SAMPLER_LABEL)
    sub["axis_norm"] = np.where(sub["sweep"] == "sum", sub["sum_norm"], sub["diff_norm"])
    # keep, per family, the sweep along the norm that family's MSE depends on
    keep = sub["sweep"] == sub["family"].map(FAMILY_AXIS)
    return sub[keep]


def plot(df: pd.DataFrame, folder: Path) -> list[Path]:
    """MSE ratio vs r/d (at norm 1) and vs the relevant norm (at r = d and r = 4d)."""
    import matplotlib.pyplot as plt
    import seaborn as sns

    set_style()
    sub = _ratio_frame(df)
    smps = [SAMPLER_LABEL[s] for s in SAMPLERS[1:] if SAMPLER_LABEL[s] in set(sub["sampler "])]
    pal = dict(zip(smps, sns.color_palette("tab10", 4)[1:], strict=False))
    dims = sorted(sub["d"].unique())
    marks = dict(zip(dims, ["o", "s", "^", "D"], strict=False))
    paths: list[Path] = []

    # 1) against r/d at axis norm = 1 (headline)
    fig, axes = plt.subplots(1, len(FAMILIES), figsize=(5.2 * len(FAMILIES), 3.8), squeeze=False)
    for ax, fam in zip(axes[0], FAMILIES, strict=False):
        g = sub[(sub["family"] == fam) & np.isclose(sub["axis_norm"], FIXED)]
        for (lab, d), gg in g.groupby(["sampler ", "d"], sort=False):
            gg = gg.sort_values("r_over_d")
            ax.errorbar(gg["r_over_d"], gg["mean"], yerr=[gg["mean"] - gg["ci_low"],
                                                          gg["ci_high"] - gg["mean"]],
                        marker=marks[d], ms=4, lw=1.2, capsize=2, color=pal[lab],
                        label=f"{lab}, d = {d}")
            if gg["theory"].notna().any():
                ax.plot(gg["r_over_d"], gg["theory"], ls="--", lw=1, color=pal[lab])
        ax.axhline(1, color="k", lw=0.8)
        ax.axvline(1, color="grey", lw=0.8, ls=":")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("r / d (projections per input dimension)")
        ax.set_ylabel("MSE ratio to iid features (unitless)")
        ax.set_title(f"{fam}: {AXIS_LABEL[FAMILY_AXIS[fam]]} = {FIXED:g}", fontsize=10)
    handles, labels = axes[0][0].get_legend_handles_labels()
    from matplotlib.lines import Line2D

    handles.append(Line2D([], [], ls="--", color="k", lw=1))
    labels.append("closed-form ratio (orthogonal)")
    fig.legend(handles, labels, loc="upper center", bbox_to_anchor=(0.5, 1.12), ncol=4,
               fontsize=8, frameon=False)
    fig.suptitle("MSE of structured projections relative to iid (below 1 = better); "
                 "bars = 95% CI", y=1.16)
    fig.tight_layout()
    paths += save_figure(fig, folder, "ratio_vs_r_over_d")

    # 2) against the relevant norm at r = d and r = 4d
    rods = [x for x in (1.0, 4.0) if np.isclose(sub["r_over_d"], x).any()]
    if rods:
        fig, axes = plt.subplots(len(rods), len(FAMILIES),
                                 figsize=(5.2 * len(FAMILIES), 3.4 * len(rods)), squeeze=False)
        for i, x in enumerate(rods):
            for j, fam in enumerate(FAMILIES):
                ax = axes[i][j]
                g = sub[(sub["family"] == fam) & np.isclose(sub["r_over_d"], x)]
                for (lab, d), gg in g.groupby(["sampler ", "d"], sort=False):
                    gg = gg.sort_values("axis_norm")
                    ax.errorbar(gg["axis_norm"], gg["mean"],
                                yerr=[gg["mean"] - gg["ci_low"], gg["ci_high"] - gg["mean"]],
                                marker=marks[d], ms=4, lw=1.2, capsize=2, color=pal[lab],
                                label=f"{lab}, d = {d}")
                    if gg["theory"].notna().any():
                        ax.plot(gg["axis_norm"], gg["theory"], ls="--", lw=1, color=pal[lab])
                ax.axhline(1, color="k", lw=0.8)
                ax.set_yscale("log")
                other = "‖q − k‖" if FAMILY_AXIS[fam] == "sum" else "‖q + k‖"
                ax.set_xlabel(f"{AXIS_LABEL[FAMILY_AXIS[fam]]} (input units; {other} = {FIXED:g})")
                ax.set_ylabel("MSE ratio to iid (unitless)")
                ax.set_title(f"{fam}, r = {x:g}·d", fontsize=10)
        handles, labels = axes[0][0].get_legend_handles_labels()
        handles.append(Line2D([], [], ls="--", color="k", lw=1))
        labels.append("closed-form ratio (orthogonal)")
        fig.legend(handles, labels, loc="upper center", bbox_to_anchor=(0.5, 1.07), ncol=4,
                   fontsize=8, frameon=False)
        fig.suptitle("MSE ratio to iid against the norm the MSE depends on; bars = 95% CI",
                     y=1.1)
        fig.tight_layout()
        paths += save_figure(fig, folder, "ratio_vs_norm")
    return paths


def summarize(df: pd.DataFrame, ctx: Context) -> str:
    """Ratio table at norm 1 and a finding generated from the numbers."""
    sub = _ratio_frame(df)
    at1 = sub[np.isclose(sub["axis_norm"], FIXED)].copy()
    at1["ratio (95% CI)"] = [f"{fmt(m)} [{fmt(a)}, {fmt(b)}]"
                             for m, a, b in zip(at1["mean"], at1["ci_low"], at1["ci_high"],
                                                strict=True)]
    at1["ratio (95% CI)"] = [x + (f"; theory {fmt(t)}" if np.isfinite(t) else "")
                             for x, t in zip(at1["ratio (95% CI)"], at1["theory"], strict=True)]
    rods = [x for x in (0.25, 1.0, 8.0) if np.isclose(at1["r_over_d"], x).any()]
    at1 = at1[np.isclose(at1["r_over_d"].to_numpy()[:, None], rods).any(axis=1)]
    tab = at1.pivot_table(index=["family", "d", "sampler"], columns="r_over_d",
                          values="ratio (95% CI)", aggfunc="first").reset_index()
    tab.columns = [f"r = {c:g}d" if isinstance(c, float) else c for c in tab.columns]
    lines = ["## Key results", "",
             f"MSE ratio sampler / iid with 95% CI at {AXIS_LABEL['sum']} = {FIXED:g} (positive) "
             f"and {AXIS_LABEL['diff']} = {FIXED:g} (trig), and the closed-form ratio where one "
             "exists (every r/d and norm is in results.csv and the figures):", "",
             df_to_markdown(tab), ""]
    f: list[str] = []
    orth = sub[sub["sampler"] == "orthogonal"]
    if len(orth):
        below = (orth["ci_high"] < 1).mean()
        th = orth[orth["theory"].notna()]
        inside = ((th["ci_low"] <= th["theory"]) & (th["ci_high"] >= th["theory"])).mean()
        f.append(f"Orthogonal projections: MSE ratio to iid between {fmt(orth['mean'].min())} and "
                 f"{fmt(orth['mean'].max())}; significantly below 1 in {fmt(100 * below, 2)}% of "
                 f"the {len(orth)} (family, d, r, norm) points; the closed-form ratio lies inside "
                 f"the 95% CI in {fmt(100 * inside, 2)}% of them.")
        for fam in FAMILIES:
            g = orth[(orth["family"] == fam) & np.isclose(orth["r_over_d"], 1.0)]
            if len(g):
                srt = g.sort_values("axis_norm")
                first, last = srt.iloc[0], srt.iloc[-1]
                f.append(f"{fam} at r = d: ratio {fmt(first['mean'])} "
                         f"[{fmt(first['ci_low'])}, {fmt(first['ci_high'])}] at "
                         f"{AXIS_LABEL[FAMILY_AXIS[fam]]} = {fmt(first['axis_norm'])} and "
                         f"{fmt(last['mean'])} [{fmt(last['ci_low'])}, {fmt(last['ci_high'])}] at "
                         f"{fmt(last['axis_norm'])} (theory {fmt(first['theory'])} and "
                         f"{fmt(last['theory'])}).")
        for fam in FAMILIES:
            g1 = orth[(orth["family"] == fam) & (orth["r_over_d"] <= 1)]
            g4 = orth[(orth["family"] == fam) & (orth["r_over_d"] >= 4)]
            if len(g1) and len(g4):
                f.append(f"{fam}: median orthogonal ratio {fmt(g1['mean'].median())} for r ≤ d "
                         f"(one block) and {fmt(g4['mean'].median())} for r ≥ 4d (independent "
                         f"blocks; theory median {fmt(g4['theory'].median())}).")
    for smp in ("structured", "qmc"):
        g = sub[sub["sampler"] == smp]
        if len(g):
            f.append(f"{SAMPLER_LABEL[smp]}: ratio {fmt(g['mean'].min())}–{fmt(g['mean'].max())} "
                     f"(median {fmt(g['mean'].median())}); below 1 with 95% confidence in "
                     f"{fmt(100 * (g['ci_high'] < 1).mean(), 2)}% of points, above 1 in "
                     f"{fmt(100 * (g['ci_low'] > 1).mean(), 2)}%.")
    lines += ["## Finding", "", " ".join(f), ""]
    return "\n".join(lines)


STUDY = Study(
    name="orthogonal-gain",
    description="MSE ratio of orthogonal, SORF and QMC projections to iid ones against r/d and "
    "against ‖q+k‖ / ‖q−k‖, beside the closed-form orthogonal ratio.",
    grid=grid,
    run_cell=run_cell,
    plot=plot,
    summarize=summarize,
    headline="ratio_vs_r_over_d.png",
    cache_version="2",
)
