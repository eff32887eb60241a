"""dlogd: does the number of features for a UNIFORM error ε grow like d log d?

What the literature claims (Choromanski et al. 2021, arXiv:2009.14794, Thm 4 and §4): Theorem 4 is a
uniform bound for *trigonometric features with orthogonal projections*,
m = Θ((d/δ²) log(4 d^{3/4} R / δ)) with δ = ε/h*², and "take M = Θ(d log d) in practice" is said
of positive features without proof; the *pointwise* MSE at fixed norms does not depend on d.

This study measures, for d in {4, ..., 128}, data on the ball B(R) of radius R and r from d to 32d,
the normalised uniform error

    sup_{q, k in B(R)} |K^(q, k) − exp(q·k)| / e^{R²}      (e^{R²} = max of the kernel on B(R))

per independent draw of the features, estimated two ways (both reported):

* ``sup_dense``: the max over a dense random sample (N_q x N_k pairs, half on the sphere, half
  uniform in the ball), for all S draws in one batched kernel evaluation;
* ``sup_adv``: adversarial search — projected normalised-gradient ascent on (q, k) from the P worst
  pairs of the dense sample, batched over draws and starts (float32 search, float64 evaluation of
  the points found).  It is a lower bound on the true sup; a deeper search on a few cells
  (``sup_adv_deep``) shows how much is left.

r*(ε, δ) = the smallest r whose sup error is ≤ ε in at least 1 − δ of the draws (log-log
interpolation of the (1 − δ)-quantile curve between grid points; censored when it never crosses).
r* against d is fitted with c·d, c·d·log d, c·d² and a free power law c·d^p (least squares in
log r*, AIC, bootstrap CIs over draws); the error is plotted against r/d and r/(d log d) to see
which collapses the curves; the theory module's uniform-convergence requirements are overlaid;
and the pointwise error at fixed norms is shown against d.
"""

from __future__ import annotations

import copy
import json
import math
from pathlib import Path

import numpy as np
import pandas as pd
import torch

from studies._framework import (
    Context,
    Study,
    ball_points,
    df_to_markdown,
    fmt,
    row,
    save_figure,
    set_style,
    sphere_points,
)
from studies.estimators import get

ESTIMATORS = ["trig-sincos-orthogonal", "trig-sincos-gaussian", "positive-orthogonal"]
ESTIMATORS_QUICK = ["trig-sincos-orthogonal", "positive-orthogonal"]
# (estimator, R) combinations of the sup-error cells: Performer Thm 4's setting (trig +
# orthogonal) and the positive features of the "M = Θ(d log d) in practice" remark at two radii,
# iid trig (Rahimi–Recht's setting) at R = 1.
SUP_CELLS = [("trig-sincos-orthogonal", 0.5), ("trig-sincos-orthogonal", 1.0),
             ("trig-sincos-gaussian", 1.0), ("positive-orthogonal", 0.5),
             ("positive-orthogonal", 1.0)]
SUP_CELLS_QUICK = [("trig-sincos-orthogonal", 1.0), ("positive-orthogonal", 1.0)]
DIMS = [4, 8, 16, 32, 64, 128]
DIMS_QUICK = [4, 8, 16]
R_OVER_D = [1, 2, 4, 8, 16, 32]
R_OVER_D_QUICK = [1, 2, 4, 8, 16]
EPS = [0.4, 0.3, 0.2]  # normalised sup error targets of r*(ε, δ)
THEORY_EPS = [0.2, 0.25, 0.3, 0.4, 0.5]  # ε values at which the theory cells evaluate the bounds
DELTA = 0.1
N_DENSE = 64  # dense sample: N_DENSE queries x N_DENSE keys per draw
SEARCH = {"full": dict(S=32, P=10, T=24), "quick": dict(S=16, P=4, T=10),
          "deep": dict(S=32, P=30, T=48)}
POINTWISE_R = 64
POINTWISE_ANGLES = [60, 120]  # angle between q and k (degrees), |q| = |k| = R
POINTWISE_DRAWS = 2048
THEORY_KIND = "trig-sincos"
N_BOOT = 400
MODELS = {  # name -> g(d) with r* = c * g(d)
    "c·d": lambda d: d,
    "c·d·log d": lambda d: d * np.log(d),
    "c·d²": lambda d: d**2,
}


def grid(quick: bool) -> list[dict]:
    """Sup-error cells (estimator, R, d), pointwise cells (estimator, d), deep-search checks."""
    ests = ESTIMATORS_QUICK if quick else ESTIMATORS
    dims = DIMS_QUICK if quick else DIMS
    sup_cells = SUP_CELLS_QUICK if quick else SUP_CELLS
    radii = sorted({R for e, R in sup_cells if "uniform" in get(e).estimator.closed_forms("gaussian")})
    cells = [{"kind": "sup", "estimator": e, "R": R, "d": d} for e, R in sup_cells for d in dims]
    cells += [{"kind": "pointwise", "estimator": e, "R": 1.0, "d": d} for e in ests for d in dims]
    cells += [{"kind": "theory", "estimator": e, "R": R, "d": d}
              for e in ests if "uniform" in get(e).estimator.closed_forms("gaussian") for R in radii for d in dims]
    if not quick:
        cells += [{"kind": "deep", "estimator": ESTIMATORS[0], "R": 1.0, "d": d}
                  for d in (DIMS[0], DIMS[-2])]
    return cells


# ------------------------------------------------------------------------------------------
# measurement
# ------------------------------------------------------------------------------------------
def dense_points(d: int, R: float, ctx: Context) -> tuple[torch.Tensor, torch.Tensor]:
    """The dense sample: half on the sphere of radius R, half uniform in the ball."""
    g = ctx.generator("dense", d, R)
    h = N_DENSE // 2
    q = torch.cat([sphere_points(h, d, R, g), ball_points(N_DENSE - h, d, R, g)])
    k = torch.cat([sphere_points(h, d, R, g), ball_points(N_DENSE - h, d, R, g)])
    return q.to(ctx.device, ctx.dtype), k.to(ctx.device, ctx.dtype)


def _pair_error(fm: torch.nn.Module, q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """|phi(q_p)·phi(k_p) − exp(q_p·k_p)| for paired rows of q, k (..., P, d) -> (..., P)."""
    return ((fm(q) * fm.key_features(k)).sum(-1) - torch.exp((q * k).sum(-1))).abs()


def sup_errors(spec_key: str, d: int, r: int, R: float, ctx: Context, S: int, P: int,
               T: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Per-draw normalised sup error: (dense sample, adversarial search), each of shape (S,)."""
    spec = get(spec_key)
    fm = spec.build(d, r, batch_shape=(S,), seed=seed, dtype=ctx.dtype, device=ctx.device)
    pq, pk = dense_points(d, R, ctx)
    E = (fm.kernel(pq, pk) - torch.exp(pq @ pk.mT)).abs()  # (S, N, N)
    dense = E.amax(dim=(-2, -1))
    idx = E.flatten(1).topk(P, dim=-1).indices  # the P worst pairs of each draw
    n = pk.shape[0]
    # search in float32 on a cast copy of the same projection
    fm32 = copy.deepcopy(fm).to(torch.float32)
    q = pq[idx // n].float()
    k = pk[idx % n].float()
    best_q, best_k = q.clone(), k.clone()
    best = torch.full(idx.shape, -1.0, device=q.device)
    for t in range(T + 1):
        q.requires_grad_(True)
        k.requires_grad_(True)
        with torch.enable_grad():
            err = _pair_error(fm32, q, k)  # (S, P)
            better = err.detach() > best
            best = torch.where(better, err.detach(), best)
            best_q = torch.where(better[..., None], q.detach(), best_q)
            best_k = torch.where(better[..., None], k.detach(), best_k)
            if t == T:
                break
            gq, gk = torch.autograd.grad(err.sum(), (q, k))
        step = R * (0.03 ** (t / max(T - 1, 1)))  # normalised steps from R down to 0.03 R
        with torch.no_grad():
            q = q + step * gq / gq.norm(dim=-1, keepdim=True).clamp_min(1e-30)
            k = k + step * gk / gk.norm(dim=-1, keepdim=True).clamp_min(1e-30)
            q = q * (R / q.norm(dim=-1, keepdim=True)).clamp(max=1.0)
            k = k * (R / k.norm(dim=-1, keepdim=True)).clamp(max=1.0)
    with torch.no_grad():  # exact float64 error at the points found
        adv = _pair_error(fm, best_q.to(ctx.dtype), best_k.to(ctx.dtype)).amax(-1)
    adv = torch.maximum(adv, dense)
    scale = math.exp(R * R)
    return (dense / scale).cpu().numpy(), (adv / scale).cpu().numpy()


def theory_rows(d: int, R: float) -> list[dict]:
    """Required r from the theory module's uniform bounds for each ε (absolute ε = ε·e^{R²})."""
    import kernelapprox as ka

    rows = []
    for eps in THEORY_EPS:
        for bound in THEORY_BOUNDS:
            req = ka.theory.required_features_uniform(THEORY_KIND, eps * math.exp(R * R), DELTA,
                                                      d, R, bound=bound)
            rows.append(row("theory_r", float(req), eps=eps, delta=DELTA, bound=bound))
    return rows


THEORY_BOUNDS = ["rahimi-recht", "sutherland-schneider", "sriperumbudur-szabo", "performer"]


def run_cell(cell: dict, ctx: Context) -> list[dict]:
    """One sup-error cell (all r), pointwise cell, theory cell or deep-search check."""
    kind, key, R, d = cell["kind"], cell["estimator"], float(cell["R"]), int(cell["d"])
    rows: list[dict] = []
    if kind == "pointwise":
        return pointwise_rows(key, d, R, ctx)
    if kind == "theory":
        return theory_rows(d, R)
    if kind == "deep":
        r = 8 * d
        cfg = SEARCH["full"]
        for name, c in (("sup_adv", cfg), ("sup_adv_deep", SEARCH["deep"])):
            _, adv = sup_errors(key, d, r, R, ctx, c["S"], c["P"], c["T"],
                                ctx.seed_for(cell, "deep"))
            rows.append(row(name, adv, r=r, P=c["P"], T=c["T"]))
        return rows
    cfg = SEARCH["quick" if ctx.quick else "full"]
    for rod in R_OVER_D_QUICK if ctx.quick else R_OVER_D:
        r = rod * d
        dense, adv = sup_errors(key, d, r, R, ctx, cfg["S"], cfg["P"], cfg["T"],
                                ctx.seed_for(cell, r))
        for name, v in (("sup_dense", dense), ("sup_adv", adv)):
            rows.append(row(name, v, r=r, values=json.dumps([float(x) for x in v])))
    return rows


def pointwise_rows(key: str, d: int, R: float, ctx: Context) -> list[dict]:
    """Relative RMS error at fixed pairs |q| = |k| = R (angles in POINTWISE_ANGLES), r fixed."""
    import kernelapprox as ka

    spec = get(key)
    g = ctx.generator("pointwise", d)
    m = torch.linalg.qr(torch.randn(d, d, generator=g, dtype=torch.float64))[0]
    u, v = m[:, 0], m[:, 1]
    th = torch.tensor(POINTWISE_ANGLES, dtype=torch.float64) * math.pi / 180
    q = (R * u).expand(len(th), d)
    k = R * (torch.cos(th)[:, None] * u + torch.sin(th)[:, None] * v)
    q, k = q.to(ctx.device, ctx.dtype), k.to(ctx.device, ctx.dtype)
    S = 256 if ctx.quick else POINTWISE_DRAWS
    fm = spec.build(d, POINTWISE_R, batch_shape=(S,), seed=ctx.seed_for("pw", key, d),
                    dtype=ctx.dtype, device=ctx.device)
    K = torch.exp((q * k).sum(-1))
    est = (fm(q) * fm.key_features(k)).sum(-1)  # (S, A)
    rel2 = ((est - K) / K) ** 2
    fm0 = spec.build(d, POINTWISE_R, seed=0, dtype=ctx.dtype, device=ctx.device)
    th_mse = torch.diagonal(ka.theory.mse(fm0, q, k)) / K**2
    return [row("pointwise_rel_mse", rel2[:, i], r=POINTWISE_R, angle=a,
                theory=float(th_mse[i])) for i, a in enumerate(POINTWISE_ANGLES)]


# ------------------------------------------------------------------------------------------
# analysis (from the frame only)
# ------------------------------------------------------------------------------------------
def _crossing(r: np.ndarray, qv: np.ndarray, eps: float) -> np.ndarray:
    """Smallest r where each quantile curve qv[..., i] (over the r grid) is <= eps.

    Log-log interpolation between the last grid point above eps and the first one at or below;
    NaN where the curve never reaches eps; r[0] where it starts below (flagged by the caller).
    """
    qv = np.atleast_2d(qv)
    below = qv <= eps
    hit = below.any(axis=-1)
    i = np.where(hit, below.argmax(axis=-1), 0)
    i0 = np.clip(i - 1, 0, None)
    lr = np.log(r)
    with np.errstate(divide="ignore", invalid="ignore"):
        lq0 = np.log(np.take_along_axis(qv, i0[:, None], -1)[:, 0])
        lq1 = np.log(np.maximum(np.take_along_axis(qv, i[:, None], -1)[:, 0], 1e-300))
        frac = np.where(lq1 != lq0, (math.log(eps) - lq0) / (lq1 - lq0), 1.0)
        out = np.exp(lr[i0] + frac * (lr[i] - lr[i0]))
    out = np.where(i == 0, r[0], out)
    return np.where(hit, out, np.nan)


def rstar_table(df: pd.DataFrame, n_boot: int = N_BOOT) -> tuple[pd.DataFrame, dict]:
    """r*(ε, δ) per (estimator, R, d, method) with bootstrap replicates over draws.

    Returns the table (r_star, CI, censoring flags) and ``{(est, R, method, eps): {d: reps}}``.
    """
    rng = np.random.default_rng(12345)
    sub = df[df["metric"].isin(["sup_dense", "sup_adv"]) & (df["kind"] == "sup")]
    out, boots = [], {}
    for (est, R, d, metric), g in sub.groupby(["estimator", "R", "d", "metric"], sort=True):
        g = g.sort_values("r")
        r = g["r"].to_numpy(float)
        vals = [np.asarray(json.loads(v), float) for v in g["values"]]
        q = np.array([np.quantile(v, 1 - DELTA) for v in vals])
        qb = np.stack([np.quantile(v[rng.integers(0, v.size, (n_boot, v.size))], 1 - DELTA,
                                   axis=1) for v in vals], axis=-1)  # (B, n_r)
        for eps in EPS:
            rs = float(_crossing(r, q, eps)[0])
            reps = _crossing(r, qb, eps)
            boots.setdefault((est, R, metric, eps), {})[int(d)] = reps
            lo, hi = (np.nanquantile(reps, [0.025, 0.975]) if np.isfinite(reps).mean() > 0.5
                      else (np.nan, np.nan))
            out.append({"estimator": est, "R": R, "d": int(d), "method": metric, "eps": eps,
                        "r_star": rs, "r_star_lo": lo, "r_star_hi": hi,
                        "censored": "above grid" if np.isnan(rs) else (
                            "at or below grid" if rs <= r[0] else ""),
                        "r_min": r[0], "r_max": r[-1],
                        "boot_finite": float(np.isfinite(reps).mean())})
    return pd.DataFrame(out), boots


def _fit(d: np.ndarray, rs: np.ndarray) -> dict:
    """Least-squares fits of log r* for each model + free power law; AIC per model."""
    ld, lr = np.log(d), np.log(rs)
    n = ld.size
    res = {}
    for name, gfun in MODELS.items():
        lg = np.log(gfun(d))
        lc = float(np.mean(lr - lg))
        rss = float(np.sum((lr - lg - lc) ** 2))
        res[name] = {"c": math.exp(lc), "p": float("nan"), "rss": rss, "k": 1}
    A = np.vstack([np.ones(n), ld]).T
    coef, *_ = np.linalg.lstsq(A, lr, rcond=None)
    rss = float(np.sum((lr - A @ coef) ** 2))
    res["c·d^p"] = {"c": math.exp(coef[0]), "p": float(coef[1]), "rss": rss, "k": 2}
    for v in res.values():
        v["aic"] = n * math.log(max(v["rss"], 1e-12) / n) + 2 * v["k"]
    return res


def fits_table(rst: pd.DataFrame, boots: dict) -> pd.DataFrame:
    """Fits of r*(d) per (estimator, R, method, ε) over the uncensored d, with bootstrap CIs."""
    out = []
    for (est, R, method, eps), g in rst.groupby(["estimator", "R", "method", "eps"], sort=True):
        g = g[g["censored"] == ""].sort_values("d")
        if len(g) < 3:
            out.append({"estimator": est, "R": R, "method": method, "eps": eps, "n_d": len(g),
                        "best": "too few uncensored d"})
            continue
        d = g["d"].to_numpy(float)
        fit = _fit(d, g["r_star"].to_numpy(float))
        reps = np.vstack([boots[(est, R, method, eps)][int(x)] for x in d]).T  # (B, n_d)
        reps = reps[np.isfinite(reps).all(axis=1)]
        bp = np.array([_fit(d, rr)["c·d^p"]["p"] for rr in reps]) if len(reps) else np.array([])
        bc = {m: np.array([_fit(d, rr)[m]["c"] for rr in reps]) for m in MODELS}
        aic_min = min(v["aic"] for v in fit.values())
        rec = {"estimator": est, "R": R, "method": method, "eps": eps, "n_d": len(g),
               "d_range": f"{int(d.min())}–{int(d.max())}",
               "p": fit["c·d^p"]["p"],
               "p_lo": float(np.quantile(bp, 0.025)) if bp.size > 10 else float("nan"),
               "p_hi": float(np.quantile(bp, 0.975)) if bp.size > 10 else float("nan"),
               "best": min(fit, key=lambda m: fit[m]["aic"])}
        for m, v in fit.items():
            rec[f"c[{m}]"] = v["c"]
            rec[f"dAIC[{m}]"] = v["aic"] - aic_min
            if m in bc and bc[m].size > 10:
                rec[f"c_lo[{m}]"], rec[f"c_hi[{m}]"] = np.quantile(bc[m], [0.025, 0.975])
        out.append(rec)
    return pd.DataFrame(out)


# ------------------------------------------------------------------------------------------
# figures
# ------------------------------------------------------------------------------------------
def _sup_frame(df: pd.DataFrame) -> pd.DataFrame:
    sub = df[(df["kind"] == "sup") & df["metric"].isin(["sup_dense", "sup_adv"])].copy()
    sub["method"] = sub["metric"].map({"sup_dense": "dense sample", "sup_adv": "adversarial"})
    sub["q90"] = [np.quantile(json.loads(v), 1 - DELTA) for v in sub["values"]]
    sub["r/d"] = sub["r"] / sub["d"]
    sub["r/(d ln d)"] = sub["r"] / (sub["d"] * np.log(sub["d"]))
    return sub


def plot(df: pd.DataFrame, folder: Path) -> list[Path]:
    """Sup error vs r, collapse plots, r* vs d with fits and theory, pointwise vs d."""
    import matplotlib.pyplot as plt
    import seaborn as sns
    from matplotlib.lines import Line2D

    set_style()
    paths: list[Path] = []
    sup = _sup_frame(df)
    ests = [e for e in ESTIMATORS if e in set(sup["estimator"])]
    radii = sorted(sup["R"].unique())
    dims = sorted(sup["d"].unique())
    dpal = dict(zip(dims, sns.color_palette("viridis", len(dims)), strict=False))
    labels = {e: get(e).label for e in ests}

    # 1) sup error vs r
    fig, axes = plt.subplots(len(radii), len(ests), figsize=(4.3 * len(ests), 3.4 * len(radii)),
                             squeeze=False)
    for i, R in enumerate(radii):
        for j, e in enumerate(ests):
            ax = axes[i][j]
            g = sup[(sup["R"] == R) & (sup["estimator"] == e)]
            if g.empty:
                ax.set_visible(False)
                continue
            sns.lineplot(data=g, x="r", y="q90", hue="d", style="method", palette=dpal,
                         markers=True, dashes={"adversarial": "", "dense sample": (3, 2)},
                         ax=ax, legend=(i == 0 and j == len(ests) - 1), markersize=4,
                         errorbar=None)
            for eps in EPS:
                ax.axhline(eps, color="grey", lw=0.8, ls=":")
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
            ax.set_title(f"{labels[e]}, R = {R:g}", fontsize=9)
            ax.set_xlabel("r (number of random projections)")
            ax.set_ylabel(f"{100 * (1 - DELTA):.0f}% quantile over draws of\n"
                          "sup |K̂ − K| / e^{R²} (unitless)" if j == 0 else "")
    leg = axes[0][-1].get_legend()
    if leg is not None:
        sns.move_legend(axes[0][-1], "upper left", bbox_to_anchor=(1.02, 1), fontsize=8)
    fig.suptitle("Uniform error over the ball B(R) vs r (dotted: the ε levels of r*)")
    fig.tight_layout()
    paths += save_figure(fig, folder, "sup_error_vs_r")

    # 2) collapse: error against r/d and r/(d ln d), adversarial, largest R
    R = radii[-1]
    fig, axes = plt.subplots(2, len(ests), figsize=(4.3 * len(ests), 6.6), squeeze=False)
    adv = sup[(sup["method"] == "adversarial") & (sup["R"] == R)]
    for i, x in enumerate(["r/d", "r/(d ln d)"]):
        for j, e in enumerate(ests):
            ax = axes[i][j]
            g = adv[adv["estimator"] == e]
            sns.lineplot(data=g, x=x, y="q90", hue="d", palette=dpal, marker="o", ax=ax,
                         legend=(i == 0 and j == len(ests) - 1), markersize=4, errorbar=None)
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
            ax.set_title(f"{labels[e]}, R = {R:g}", fontsize=9)
            ax.set_xlabel(f"{x} (unitless)")
            ax.set_ylabel("90% quantile of normalised sup error" if j == 0 else "")
    if axes[0][-1].get_legend() is not None:
        sns.move_legend(axes[0][-1], "upper left", bbox_to_anchor=(1.02, 1), fontsize=8)
    fig.suptitle("Do the curves for different d collapse? top: x = r/d, bottom: x = r/(d ln d) "
                 "(adversarial sup)")
    fig.tight_layout()
    paths += save_figure(fig, folder, "collapse")

    # 3) r* vs d with fits and theory (headline)
    rst, boots = rstar_table(df)
    fits = fits_table(rst, boots)
    th = df[df["metric"] == "theory_r"]
    epal = dict(zip(EPS, sns.color_palette("tab10", len(EPS)), strict=False))
    mstyle = {"c·d": ":", "c·d·log d": "--", "c·d²": "-.", "c·d^p": "-"}
    fig, axes = plt.subplots(len(radii), len(ests), figsize=(4.3 * len(ests), 3.6 * len(radii)),
                             squeeze=False)
    dd = np.geomspace(min(dims), max(dims), 50)
    for i, R in enumerate(radii):
        for j, e in enumerate(ests):
            ax = axes[i][j]
            if rst[(rst["estimator"] == e) & (rst["R"] == R)].empty:
                ax.set_visible(False)
                continue
            for eps in EPS:
                for method, filled in (("sup_adv", True), ("sup_dense", False)):
                    g = rst[(rst["estimator"] == e) & (rst["R"] == R) & (rst["eps"] == eps)
                            & (rst["method"] == method) & (rst["censored"] == "")]
                    if len(g):
                        ax.errorbar(g["d"], g["r_star"],
                                    yerr=[(g["r_star"] - g["r_star_lo"]).clip(lower=0).fillna(0),
                                          (g["r_star_hi"] - g["r_star"]).clip(lower=0).fillna(0)],
                                    fmt="o", ms=5, capsize=2, color=epal[eps],
                                    mfc=epal[eps] if filled else "white", lw=1)
                    c = rst[(rst["estimator"] == e) & (rst["R"] == R) & (rst["eps"] == eps)
                            & (rst["method"] == method) & (rst["censored"] == "above grid")]
                    if len(c):  # lower bounds: r* > the largest r tried
                        ax.scatter(c["d"], c["r_max"], marker="^", s=36, color=epal[eps],
                                   facecolors=epal[eps] if filled else "white", zorder=3)
                f = fits[(fits["estimator"] == e) & (fits["R"] == R) & (fits["eps"] == eps)
                         & (fits["method"] == "sup_adv")]
                if len(f) and "p" in f and np.isfinite(f["p"].iloc[0]):
                    fr = f.iloc[0]
                    for m, ls in mstyle.items():
                        y = fr[f"c[{m}]"] * (dd ** fr["p"] if m == "c·d^p" else MODELS[m](dd))
                        ax.plot(dd, y, ls=ls, lw=1, color=epal[eps], alpha=0.8)
                t = th[(th["estimator"] == e) & (th["R"] == R) & (th["eps"] == eps)]
                if len(t):
                    band = t.groupby("d")["mean"].agg(["min", "max"]).sort_index()
                    ax.fill_between(band.index, band["min"], band["max"], color=epal[eps],
                                    alpha=0.15, lw=0)
                    ax.plot(band.index, band["min"], color=epal[eps], lw=0.8, alpha=0.5)
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
            ax.set_title(f"{labels[e]}, R = {R:g}", fontsize=9)
            ax.set_xlabel("d (input dimension)")
            ax.set_ylabel(f"r*(ε, δ={DELTA:g}) (number of projections)" if j == 0 else "")
    handles = [Line2D([], [], color=epal[eps], marker="o", ls="", label=f"ε = {eps:g}")
               for eps in EPS]
    handles += [Line2D([], [], color="k", marker="o", ls="", label="adversarial sup"),
                Line2D([], [], color="k", marker="o", mfc="white", ls="", label="dense-sample sup")]
    handles += [Line2D([], [], color="k", marker="^", ls="",
                       label="censored: r* > largest r tried (plotted at that r)")]
    handles += [Line2D([], [], color="k", ls=ls, lw=1, label=f"fit {m} (adversarial)")
                for m, ls in mstyle.items()]
    if len(th):
        from matplotlib.patches import Patch

        handles += [Patch(color="k", alpha=0.15,
                          label=f"theory: range of {th['bound'].nunique()} uniform bounds "
                          "(ka.theory.required_features_uniform; trig only)")]
    fig.legend(handles=handles, loc="upper center", bbox_to_anchor=(0.5, 1.0 + 0.06), ncol=4,
               fontsize=8, frameon=False)
    fig.suptitle("r*: smallest r with sup error ≤ ε in 90% of draws, vs d (bars: bootstrap 95% CI)", y=1.0 + 0.1)
    fig.tight_layout()
    paths += save_figure(fig, folder, "rstar_vs_d")

    # 4) pointwise vs uniform at fixed r
    pw = df[df["metric"] == "pointwise_rel_mse"].copy()
    if len(pw):
        pw["rms"] = np.sqrt(pw["mean"])
        pw["theory_rms"] = np.sqrt(pw["theory"])
        pw["estimator "] = pw["estimator"].map(lambda k: get(k).label)
        pw["angle "] = pw["angle"].map(lambda a: f"∠(q, k) = {a:g}°")
        fig, axes = plt.subplots(1, 2, figsize=(10.5, 3.9))
        ax = axes[0]
        pal = dict(zip(pw["estimator "].unique(), sns.color_palette("tab10"), strict=False))
        sns.lineplot(data=pw, x="d", y="rms", hue="estimator ", style="angle ", palette=pal,
                     markers=True, dashes=False, errorbar=None, ax=ax)
        for (lab, _a), g in pw.groupby(["estimator ", "angle "]):
            g = g.sort_values("d")
            ax.plot(g["d"], g["theory_rms"], ls="--", lw=1, color=pal[lab])
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        rr = int(pw["r"].iloc[0])
        ax.set_title(f"pointwise: ‖q‖ = ‖k‖ = 1, r = {rr} (dashed: theory)", fontsize=9)
        ax.set_xlabel("d (input dimension)")
        ax.set_ylabel("relative RMS error (unitless)")
        sns.move_legend(ax, "best", fontsize=7)
        ax = axes[1]
        s1 = sup[(sup["R"] == 1.0) & (sup["method"] == "adversarial")]
        rows = []
        for (e, d), g in s1.groupby(["estimator", "d"]):
            g = g.sort_values("r")
            y = np.exp(np.interp(np.log(rr), np.log(g["r"]), np.log(g["mean"]), left=np.nan,
                                 right=np.nan))
            rows.append({"estimator ": get(e).label, "d": d, "sup": y})
        s1 = pd.DataFrame(rows)
        if len(s1):
            sns.lineplot(data=s1, x="d", y="sup", hue="estimator ", palette=pal, marker="o",
                         ax=ax, errorbar=None)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_title(f"uniform: mean adversarial sup over B(1) at r = {rr} (interpolated in r)",
                     fontsize=9)
        ax.set_xlabel("d (input dimension)")
        ax.set_ylabel("sup |K̂ − K| / e^{R²} (unitless)")
        fig.suptitle("Pointwise error (left) and uniform error (right) against d at fixed r")
        fig.tight_layout()
        paths += save_figure(fig, folder, "pointwise_vs_d")
    return paths


# ------------------------------------------------------------------------------------------
# summary
# ------------------------------------------------------------------------------------------
def summarize(df: pd.DataFrame, ctx: Context) -> str:
    """r* table, fits table, and a finding generated from the numbers."""
    rst, boots = rstar_table(df)
    fits = fits_table(rst, boots)
    lines = ["## Key results", ""]
    r2 = rst.copy()
    r2["cell"] = [
        (f"{fmt(a)} [{fmt(lo)}, {fmt(hi)}]" if c == "" else
         (f"> {fmt(rmax)}" if c == "above grid" else f"≤ {fmt(rmin)}"))
        for a, lo, hi, c, rmin, rmax in zip(r2["r_star"], r2["r_star_lo"], r2["r_star_hi"],
                                            r2["censored"], r2["r_min"], r2["r_max"], strict=True)]
    r2["method"] = r2["method"].map({"sup_adv": "adversarial", "sup_dense": "dense"})
    tab = r2.pivot_table(index=["estimator", "R", "eps", "method"], columns="d", values="cell",
                         aggfunc="first").reset_index()
    tab.columns = [f"d = {c}" if isinstance(c, (int, np.integer)) else c for c in tab.columns]
    lines += [f"r*(ε, δ = {DELTA:g}) with bootstrap 95% CI (ε is the sup error normalised by "
              "e^{R²}; '>' = never reached on the r grid):", "", df_to_markdown(tab), ""]
    if len(fits) and "p" in fits:
        ft = fits[fits["p"].notna()].copy()
        ft["p (95% CI)"] = [f"{fmt(p)} [{fmt(a)}, {fmt(b)}]"
                            for p, a, b in zip(ft["p"], ft["p_lo"], ft["p_hi"], strict=True)]
        cols = ["estimator", "R", "method", "eps", "d_range", "p (95% CI)", "best"]
        cols += [f"dAIC[{m}]" for m in [*MODELS, "c·d^p"]]
        cols += ["c[c·d·log d]"]
        lines += ["Fits of r*(d) (least squares in log r*; dAIC = AIC − best AIC, k = 1 for the "
                  "fixed shapes, 2 for the power law):", "", df_to_markdown(ft[cols]), ""]

    lines += ["## Finding", "", finding(df, rst, fits), ""]
    return "\n".join(lines)


def collapse_spread(sup: pd.DataFrame, est: str, R: float, x: str) -> tuple[float, float]:
    """Max/min ratio across d of the adversarial 90% quantile at a common value of ``x``.

    ``x`` is ``"r/d"`` or ``"r/(d ln d)"``; the common value is the geometric middle of the
    range every d covers (log-log interpolation).  1 = perfect collapse.  Returns (x0, spread).
    """
    g = sup[(sup["estimator"] == est) & (sup["R"] == R) & (sup["method"] == "adversarial")]
    if g["d"].nunique() < 2:
        return float("nan"), float("nan")
    lo = g.groupby("d")[x].min().max()
    hi = g.groupby("d")[x].max().min()
    if lo > hi:
        return float("nan"), float("nan")
    x0 = math.sqrt(lo * hi)
    ys = [np.exp(np.interp(math.log(x0), np.log(gd.sort_values(x)[x]),
                           np.log(gd.sort_values(x)["q90"]))) for _, gd in g.groupby("d")]
    return x0, float(max(ys) / min(ys))


def _local_exponent(d: np.ndarray, gfun: object) -> float:
    """OLS slope of log g(d) on log d over the d values used: the exponent g looks like there."""
    ld = np.log(d)
    return float(np.polyfit(ld, np.log(gfun(d)), 1)[0])


def finding(df: pd.DataFrame, rst: pd.DataFrame, fits: pd.DataFrame) -> str:
    """The finding paragraph, every statement computed from the data."""
    f: list[str] = []
    sup = _sup_frame(df)
    adv_fits = fits[fits["method"] == "sup_adv"] if len(fits) else fits
    ok = adv_fits[adv_fits["p"].notna()] if "p" in adv_fits else adv_fits.iloc[0:0]
    verdicts = []
    for _, x in ok.iterrows():
        dvals = rst[(rst["estimator"] == x["estimator"]) & (rst["R"] == x["R"])
                    & (rst["eps"] == x["eps"]) & (rst["method"] == "sup_adv")
                    & (rst["censored"] == "")]["d"].to_numpy(float)
        p_dlogd = _local_exponent(dvals, MODELS["c·d·log d"])
        lo, hi = x["p_lo"], x["p_hi"]
        if lo <= 1 <= hi and not lo <= p_dlogd <= hi:
            v = "linear in d (d log d excluded)"
        elif lo <= 1 <= hi:
            v = "cannot tell d from d log d"
        elif lo <= p_dlogd <= hi:
            v = "consistent with d log d, not with d"
        elif hi < 1:
            v = "sub-linear in d"
        elif lo > 2:
            v = "faster than d²"
        else:
            v = f"faster than d log d (exponent above {fmt(p_dlogd)})"
        verdicts.append(v)
        f.append(f"{get(x['estimator']).label}, R = {fmt(x['R'])}, ε = {fmt(x['eps'])} "
                 f"(d = {x['d_range']}): r* ∝ d^p with p = {fmt(x['p'])} "
                 f"[{fmt(x['p_lo'])}, {fmt(x['p_hi'])}] (d log d looks like d^{fmt(p_dlogd)} "
                 f"over these d), AIC prefers {x['best']} "
                 f"(ΔAIC c·d: {fmt(x['dAIC[c·d]'], 2)}, c·d·log d: "
                 f"{fmt(x['dAIC[c·d·log d]'], 2)}, c·d²: {fmt(x['dAIC[c·d²]'], 2)}) — {v}.")
    if verdicts:
        counts = pd.Series(verdicts).value_counts()
        f.append("Verdict over the " + str(len(verdicts)) + " uncensored adversarial fits: "
                 + "; ".join(f"{k}: {n}" for k, n in counts.items()) + ".")
    for e, R in sorted({(e, R) for e, R in zip(sup["estimator"], sup["R"], strict=True)}):
        x1, s1 = collapse_spread(sup, e, R, "r/d")
        x2, s2 = collapse_spread(sup, e, R, "r/(d ln d)")
        if np.isfinite(s1) and np.isfinite(s2):
            better = ("neither normalisation collapses them" if min(s1, s2) > 3 else
                      ("r/d" if s1 < s2 else "r/(d ln d)") + " collapses the curves better")
            f.append(f"Collapse, {get(e).label}, R = {fmt(R)}: across d the sup error differs by a "
                     f"factor {fmt(s1)} at fixed r/d = {fmt(x1)} and {fmt(s2)} at fixed "
                     f"r/(d ln d) = {fmt(x2)} — {better}.")
    for e in ESTIMATORS:
        ge = rst[(rst["estimator"] == e) & (rst["method"] == "sup_adv")]
        cens = ge[ge["censored"] == "above grid"]
        if len(cens):
            rod = int((cens["r_max"] / cens["d"]).max())
            f.append(f"{get(e).label}: r* was not reached on the grid (r ≤ {rod}d) in "
                     f"{len(cens)} of {len(ge)} (R, ε, d) combinations (smallest such d: "
                     f"{int(cens['d'].min())}).")
        gs = sup[(sup["estimator"] == e) & (sup["method"] == "adversarial")]
        if len(gs):
            top = gs[gs["r/d"] == gs["r/d"].max()]
            for R, gr in top.groupby("R"):
                gr = gr.sort_values("d")
                f.append(f"{get(e).label}, R = {fmt(R)}: at r = {int(gr['r/d'].iloc[0])}d the "
                         f"adversarial sup error (90% quantile) is {fmt(gr['q90'].iloc[0])} at "
                         f"d = {int(gr['d'].iloc[0])} and {fmt(gr['q90'].iloc[-1])} at "
                         f"d = {int(gr['d'].iloc[-1])}.")
    both = sup.pivot_table(index=["estimator", "R", "d", "r"], columns="method", values="mean")
    if {"adversarial", "dense sample"} <= set(both.columns):
        gain = (both["adversarial"] / both["dense sample"])
        for e in ESTIMATORS:
            if e not in gain.index.get_level_values(0):
                continue
            ge = gain.xs(e, level="estimator").groupby(level="d").median()
            trend = ("grows with d: the dense sample alone understates the d-dependence"
                     if ge.iloc[-1] > ge.iloc[0] else "does not grow with d")
            f.append(f"{get(e).label}: the adversarial search beats the dense sample by a median "
                     f"factor {fmt(ge.iloc[0])} at d = {ge.index[0]} and {fmt(ge.iloc[-1])} at "
                     f"d = {ge.index[-1]} ({trend}).")
    dn = fits[fits["method"] == "sup_dense"] if len(fits) else fits
    if len(dn) and "p" in dn and dn["p"].notna().any():
        f.append(f"Dense-sample-only fits give p = {fmt(dn['p'].min())}–{fmt(dn['p'].max())}.")
    deep = df[df["kind"] == "deep"]
    if len(deep):
        parts = []
        for d, g in deep.groupby("d"):
            m = g.set_index("metric")
            parts.append(f"d = {d}, r = {int(m.loc['sup_adv', 'r'])}: "
                         f"{fmt(100 * (m.loc['sup_adv_deep', 'mean'] / m.loc['sup_adv', 'mean'] - 1), 2)}%")
        dp = deep[deep["metric"] == "sup_adv_deep"].iloc[0]
        sp = deep[deep["metric"] == "sup_adv"].iloc[0]
        f.append(f"A deeper search ({int(dp['P'])} starts x {int(dp['T'])} steps instead of "
                 f"{int(sp['P'])} x {int(sp['T'])}) raises the mean sup by " + ", ".join(parts)
                 + " (the adversarial values are lower bounds on the true sup).")
        gains = deep.pivot_table(index="d", columns="metric", values="mean")
        if len(gains) >= 2:
            g_lo = gains["sup_adv_deep"].iloc[0] / gains["sup_adv"].iloc[0]
            g_hi = gains["sup_adv_deep"].iloc[-1] / gains["sup_adv"].iloc[-1]
            dlo, dhi = gains.index[0], gains.index[-1]
            shift = 2 * math.log(g_hi / g_lo) / math.log(dhi / dlo)
            f.append(f"If the standard search misses that much more at d = {dhi} than at "
                     f"d = {dlo}, r* ∝ 1/ε² would be understated there by a factor "
                     f"{fmt((g_hi / g_lo) ** 2)}, i.e. the fitted exponents may be low by about "
                     f"{fmt(shift, 2)}.")
    th = df[df["metric"] == "theory_r"]
    if len(th) and len(rst):
        m = rst[(rst["method"] == "sup_adv") & (rst["censored"] == "")].merge(
            th[["estimator", "R", "d", "eps", "bound", "mean"]], on=["estimator", "R", "d", "eps"])
        if len(m):
            m["ratio"] = m["mean"] / m["r_star"]
            parts = [f"{b} {fmt(g['ratio'].min())}–{fmt(g['ratio'].max())}x"
                     for b, g in m.groupby("bound")]
            below = m[m["ratio"] < 1]
            f.append("Theory requirement / measured r* (trig, adversarial): " + "; ".join(parts)
                     + (". Every bound lies above the measurements (valid, loose)."
                        if below.empty else
                        f". {len(below)} bound values fall BELOW the measured r* (bounds: "
                        f"{', '.join(sorted(below['bound'].unique()))}; the Performer bound's "
                        "Θ-constant is unknown and set to 1)."))
    pw = df[df["metric"] == "pointwise_rel_mse"]
    if len(pw):
        g = pw.assign(rms=np.sqrt(pw["mean"]), th=np.sqrt(pw["theory"]))
        lo_d, hi_d = int(g["d"].min()), int(g["d"].max())
        parts = []
        for e, ge in g.groupby("estimator", sort=False):
            a, b = ge[ge["d"] == lo_d], ge[ge["d"] == hi_d]
            parts.append(f"{get(e).label} {fmt(a['rms'].mean())} → {fmt(b['rms'].mean())} "
                         f"(theory {fmt(a['th'].mean())} → {fmt(b['th'].mean())})")
        r_pw = int(g["r"].iloc[0])
        s1 = sup[(sup["method"] == "adversarial") & (sup["r"] == r_pw) & (sup["R"] == 1.0)
                 & (sup["estimator"] == g["estimator"].iloc[0])].sort_values("d")
        tail = ""
        if len(s1) >= 2:
            tail = (f"; at the same r the adversarial sup error of "
                    f"{get(g['estimator'].iloc[0]).label} goes {fmt(s1['mean'].iloc[0])} → "
                    f"{fmt(s1['mean'].iloc[-1])} from d = {int(s1['d'].iloc[0])} to "
                    f"{int(s1['d'].iloc[-1])}")
        f.append(f"Pointwise (‖q‖ = ‖k‖ = 1, r = {r_pw}, mean over the angles), the relative RMS "
                 f"error from d = {lo_d} to {hi_d}: " + "; ".join(parts) + tail + ".")
    return " ".join(f)


STUDY = Study(
    name="dlogd",
    description="Is r = O(d log d) enough for a uniform error ε? Adversarial sup error over the "
    "ball vs r and d, r*(ε, δ) fitted against d, d log d, d², d^p, beside the uniform bounds.",
    grid=grid,
    run_cell=run_cell,
    plot=plot,
    summarize=summarize,
    headline="rstar_vs_d.png",
    cache_version="2",
)
