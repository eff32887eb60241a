"""qr-sign-bias: orthogonal random features from a QR *without* the sign correction are biased.

LAPACK-style Householder QR (``torch.linalg.qr``, ``numpy.linalg.qr``, ``jnp.linalg.qr``) ties
the sign of column ``j`` of ``Q`` to ``R[j, j]``, so ``Q`` is not Haar-distributed and the rows of
an orthogonal block do not point in uniformly random directions.  Most public Performer code uses
those columns as projection directions without the correction ``Q * sign(diag R)`` (Mezzadri
2007), which breaks the unbiasedness of the positive estimator *row by row*.

The statistic.  For a projection row ``w_i`` the positive-feature term
``Y_i(x) = exp(w_i.x - |x|^2/2) = sqrt(r) phi_i(x)`` has ``E[Y_i] = 1`` whenever ``w_i`` is
marginally ``N(0, I_d)`` (it is the per-feature estimate of ``exp(x.0) = 1``, and equally the
per-feature ratio ``r phi_i(q) phi_i(k) / exp(q.k)`` for any pair with ``q + k = x``).  We draw one
orthogonal block (``r = d`` rows) per draw, in three variants:

* ``corrected``: the library, ``ka.PositiveRF(d, d, sampler="orthogonal")`` (sign-corrected QR,
  chi-distributed row norms);
* ``uncorrected (columns of Q)``: ``Q, _ = torch.linalg.qr(G)`` with no correction, directions =
  columns of ``Q`` (= rows of ``Q^T``: performer-pytorch, google-research JAX/TF,
  fast-transformers), chi norms;
* ``uncorrected (rows of Q)``: the rows of the same uncorrected ``Q`` (pyrfm), chi norms.

Both uncorrected variants are built here with ``PositiveRF.from_projection``; the library does not
offer them.  Reported per cell (d, direction of x) and per ``|x|``: the per-row means with 95%
t-intervals, the overall ratio ``mean_i Y_i`` (the estimate of ``exp(q.k)`` divided by its
target), the largest per-row ``|z|``-score and the fraction of rows whose CI excludes 1.
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pandas as pd
import torch
from scipy import stats

import kernelapprox.montecarlo as mc
from studies._engine import Context, Study, df_to_markdown, fmt, one_thread, row, save_figure

VARIANTS: dict[str, str] = {
    "corrected": "sign-corrected QR (library)",
    "uncorrected-cols": "uncorrected QR, columns of Q (Performer)",
    "uncorrected-rows": "uncorrected QR, rows of Q (pyrfm)",
}
# The input of the peers' table (reference/peers.md, finding 1): d=4, 20k draws.
PEERS_X = (1.0, 0.5, -0.3, 0.2)
PEERS_NORM = float(np.linalg.norm(PEERS_X))
CHUNK = 4000  # draws per batched call (memory bound: CHUNK * d * d float64 per variant)


def grid(quick: bool) -> list[dict]:
    """Cells: (d, direction of x); the norms of x are evaluated inside a cell on the same draws."""
    if quick:
        dims, draws, norms = [4, 16], 4000, [0.5, 1.0, 2.0]
    else:
        dims, draws, norms = [2, 4, 8, 16, 32, 64], 20000, [0.25, 0.5, 1.0, 1.5, 2.0]
    cells = [
        {"d": 4, "direction": "peers", "norms": [PEERS_NORM], "draws": draws},
    ]
    for d in dims:
        for direction in ("e1", "random"):
            cells.append({"d": d, "direction": direction, "norms": norms, "draws": draws})
    return cells


def _direction(d: int, direction: str, ctx: Context) -> torch.Tensor:
    if direction == "peers":
        u = torch.tensor(PEERS_X, dtype=torch.float64)
    elif direction == "e1":
        u = torch.zeros(d, dtype=torch.float64)
        u[0] = 1.0
    elif direction == "ones":
        u = torch.ones(d, dtype=torch.float64)
    elif direction == "random":
        u = torch.randn(d, generator=ctx.generator("direction", d), dtype=torch.float64)
    else:  # pragma: no cover - grid only produces the names above
        raise ValueError(f"unknown direction {direction!r}")
    return u / u.norm()


def uncorrected_projection(
    batch: int, d: int, generator: torch.Generator, use_rows: bool = False
) -> torch.Tensor:
    """``batch`` single-block ORF projections (batch, d, d) from a QR *without* sign correction.

    Directions are the columns of ``Q`` (Performer: ``q.T`` rows) or, with ``use_rows``, the rows
    of ``Q`` (pyrfm); each row is rescaled by an independent chi_d norm, as in the paper default.
    """
    G = torch.randn(batch, d, d, generator=generator, dtype=torch.float64)
    Q, _ = torch.linalg.qr(G)
    W = Q if use_rows else Q.mT
    norms = torch.randn(batch, d, d, generator=generator, dtype=torch.float64).norm(dim=-1)
    return W * norms.unsqueeze(-1)


def _feature_map(variant: str, d: int, batch: int, generator: torch.Generator) -> torch.nn.Module:
    import kernelapprox as ka

    if variant == "corrected":
        return ka.PositiveRF(
            d, d, sampler="orthogonal", generator=generator, batch_shape=(batch,), dtype=torch.float64
        )
    W = uncorrected_projection(batch, d, generator, use_rows=variant == "uncorrected-rows")
    return ka.PositiveRF.from_projection(W)


def run_cell(cell: dict, ctx: Context) -> list[dict]:
    """Per-row and overall means of ``Y_i(x)`` for every variant and norm of x, batched over draws.

    Runs on one CPU thread: a batched ``torch.linalg.qr`` of thousands of small matrices was
    measured 20x slower with 2 threads than with 1 on a loaded 2-core machine (77 s vs 3.6 s for
    4000 blocks of 64 x 64).
    """
    with one_thread():
        return _run_cell(cell, ctx)


def _run_cell(cell: dict, ctx: Context) -> list[dict]:
    d, direction, norms, S = cell["d"], cell["direction"], cell["norms"], int(cell["draws"])
    u = _direction(d, direction, ctx)
    X = torch.stack([u * float(rho) for rho in norms])  # (m, d)
    rows: list[dict] = []
    for variant in VARIANTS:
        g = ctx.generator("qr", d, direction, variant)
        rows_acc, overall_acc = mc.StreamingMoments(), mc.StreamingMoments()
        done = 0
        while done < S:  # chunks of draws, each chunk one batched evaluation
            b = min(CHUNK, S - done)
            fm = _feature_map(variant, d, b, g)
            Y = fm(X) * math.sqrt(d)  # (b, m, r=d): Y_i = exp(w_i.x - |x|^2/2)
            rows_acc.update(Y)
            overall_acc.update(Y.mean(-1))  # (b, m): the estimate of exp(q.k) over its target
            done += b
        mean, se, lo, hi = rows_acc.mean_ci()  # Student t per (norm, row)
        omean, ose, olo, ohi = overall_acc.mean_ci()
        for j, rho in enumerate(norms):
            z = (mean[j] - 1.0) / se[j]
            common = {"variant": variant, "x_norm": float(rho)}
            for i in range(d):
                rows.append(
                    row("row_mean", float(mean[j, i]), ci_low=float(lo[j, i]),
                        ci_high=float(hi[j, i]), n_draws=S, row=i, z=float(z[i]), **common)
                )
            rows.append(
                row("overall_ratio", float(omean[j]), ci_low=float(olo[j]), ci_high=float(ohi[j]),
                    n_draws=S, z=float((omean[j] - 1.0) / ose[j]), **common)
            )
            rows.append(row("max_abs_row_z", float(np.abs(z).max()), n_draws=S, **common))
            outside = float(np.mean((lo[j] > 1.0) | (hi[j] < 1.0)))
            rows.append(row("frac_rows_ci_excludes_1", outside, n_draws=S, **common))
    return rows


# ----------------------------------------------------------------------------------------------
# Figures
# ----------------------------------------------------------------------------------------------
def _style() -> None:
    import seaborn as sns

    sns.set_theme(style="whitegrid", context="notebook")


def plot(df: pd.DataFrame, folder: Path) -> list[Path]:
    """Per-row means at d=4 (the peers' input), max |z| over rows vs d, overall bias vs |x|."""
    import seaborn as sns

    from kernelapprox import plotting

    _style()
    paths: list[Path] = []
    df = df.copy()
    df["variant_label"] = df["variant"].map(VARIANTS)
    order = list(VARIANTS.values())
    palette = dict(zip(order, sns.color_palette("deep", len(order)), strict=True))

    # 1. per-row means, d = 4, the peers' x: one row of the forest per projection row
    sub = df[(df.metric == "row_mean") & (df.direction == "peers")].copy()
    if len(sub):
        rows = sorted(sub["row"].astype(int).unique())
        sub["row"] = [f"row i = {int(i)}" for i in sub["row"]]
        sub["QR"] = sub["variant_label"]
        n = int(sub["n_draws"].max())
        fig = plotting.plot_forest(
            sub, x="mean", ci=("ci_low", "ci_high"), y="row", hue="QR",
            order=[f"row i = {i}" for i in rows], hue_order=order, palette=palette,
            reference=1.0, reference_label="target E[Y_i] = 1",
            xlabel=r"mean of $Y_i = \exp(w_i^\top x - |x|^2/2)$ (dimensionless)",
            title=f"Rows of the orthogonal block, d = 4, x = {PEERS_X}, |x| = {PEERS_NORM:.3g}; "
                  f"{n} draws, 95% CI")
        (ax,) = fig.axes  # the legend beside the panel, not over the rows
        legend = ax.get_legend()
        ax.legend(handles=legend.legend_handles, loc="upper left", bbox_to_anchor=(1.02, 1.0),
                  fontsize=8)
        fig.set_size_inches(9.0, 3.4)
        paths += save_figure(fig, folder, "per_row_means_d4")

    # 2. max |z| over rows against d at |x| = 1, the Bonferroni bound dashed
    sub = df[(df.metric == "max_abs_row_z") & (df.direction != "peers")].copy()
    if len(sub):
        ref_norm = 1.0 if (sub.x_norm == 1.0).any() else float(sub.x_norm.max())
        sub = sub[sub.x_norm == ref_norm]
        sub["bonferroni"] = stats.norm.ppf(1 - 0.025 / sub["d"].to_numpy(dtype=float))
        sub["x along"] = sub["direction"]
        fig = plotting.plot_error_vs_r(
            sub, x="d", y="mean", hue="variant_label", ci=None, closed_form="bonferroni",
            col="x along", hue_order=order, palette=palette, panel_size=(4.2, 3.6),
            closed_form_label="95% Bonferroni bound for the largest of d null z-scores",
            xlabel="dimension d (= rows per block)",
            ylabel="max over rows of |mean - 1| / s.e.",
            title=f"Per-row bias z-scores, |x| = {ref_norm:g}")
        paths += save_figure(fig, folder, "max_row_z_vs_d")

    # 3. overall ratio - 1 against |x|
    sub = df[(df.metric == "overall_ratio") & (df.direction != "peers")].copy()
    if len(sub):
        sub["bias"] = sub["mean"] - 1.0
        sub["lo"] = sub["ci_low"] - 1.0
        sub["hi"] = sub["ci_high"] - 1.0
        fig = plotting.plot_error_vs_r(
            sub, x="x_norm", y="bias", hue="variant_label", ci=("lo", "hi"), closed_form=None,
            row="direction", col="d", hue_order=order, palette=palette, xscale="linear",
            yscale="linear", panel_size=(2.6, 2.6), reference=0.0,
            reference_label="no bias",
            facet_title=lambda direction, d: f"d = {d}, x along {direction}",
            xlabel="|x| = |q + k|", ylabel="relative bias of the\nkernel estimate",
            title="Overall relative bias (mean over the d rows) with 95% CI")
        paths += save_figure(fig, folder, "overall_bias_vs_norm")
    return paths


# ----------------------------------------------------------------------------------------------
# Summary
# ----------------------------------------------------------------------------------------------
def summarize(df: pd.DataFrame, ctx: Context) -> str:
    """Key tables (the peers' d=4 rows; bias and z by d) and findings as bullets generated from them."""
    out: list[str] = ["## Key results", ""]
    peers = df[(df.metric == "row_mean") & (df.direction == "peers")].copy()
    finding: list[str] = []
    if len(peers):
        peers["row"] = peers["row"].astype(int)
        tab = peers.pivot_table(index="row", columns="variant", values="mean")
        lo = peers.pivot_table(index="row", columns="variant", values="ci_low")
        hi = peers.pivot_table(index="row", columns="variant", values="ci_high")
        t = pd.DataFrame({"row i": tab.index})
        for v in VARIANTS:
            if v in tab:
                t[v] = [
                    f"{fmt(m, 3)} [{fmt(a, 3)}, {fmt(b, 3)}]"
                    for m, a, b in zip(tab[v], lo[v], hi[v], strict=True)
                ]
        n = int(peers["n_draws"].max())
        out += [
            f"Per-row means of Y_i at d = 4, x = {PEERS_X} ({n} draws; target 1; 95% CI):",
            "",
            df_to_markdown(t),
            "",
        ]
        if "uncorrected-cols" in tab and "corrected" in tab:
            unc = ", ".join(fmt(m, 2) for m in tab["uncorrected-cols"])
            cor = ", ".join(fmt(m, 2) for m in tab["corrected"])
            pin = peers[peers.variant == "corrected"]
            n_out = int(((pin.ci_low > 1) | (pin.ci_high < 1)).sum())
            finding += [
                f"- d = 4, the peers' input x = {PEERS_X}; every row should average 1:",
                f"  - uncorrected QR (columns of Q, the Performer convention): per-row means {unc} "
                f"(the same experiment run with NumPy's QR gives 0.32, 0.63, 1.21, 1.12);",
                f"  - sign-corrected library sampler: {cor}; {n_out} of 4 row intervals exclude 1.",
            ]
    summ = df[(df.direction != "peers") & (df.metric.isin(["overall_ratio", "max_abs_row_z",
                                                            "frac_rows_ci_excludes_1"]))]
    if len(summ):
        ref_norm = 1.0 if (summ.x_norm == 1.0).any() else float(summ.x_norm.max())
        s = summ[summ.x_norm == ref_norm]
        wide = s.pivot_table(index=["d", "direction", "variant"], columns="metric",
                             values="mean").reset_index()
        wide["overall_bias_%"] = 100 * (wide["overall_ratio"] - 1.0)
        wide = wide[["d", "direction", "variant", "overall_bias_%", "max_abs_row_z",
                     "frac_rows_ci_excludes_1"]]
        out += [
            (
                f"Bias at |x| = {ref_norm:g} by dimension (overall = the r = d estimate of "
                f"exp(q.k) relative to its target; max |z| = largest per-row z-score; last column "
                f"= share of rows whose 95% CI excludes 1):"
            ),
            "",
            df_to_markdown(wide, digits=3),
            "",
        ]
        unc = wide[wide.variant == "uncorrected-cols"]
        cor = wide[wide.variant == "corrected"]
        if len(unc) and len(cor):
            worst = unc.loc[unc["max_abs_row_z"].idxmax()]
            big_d = unc[unc.d == unc.d.max()]
            finding += [
                f"- d = {int(wide.d.min())}..{int(wide.d.max())} at |x| = {ref_norm:g}, largest "
                f"per-row |z|:",
                f"  - uncorrected: {fmt(unc['max_abs_row_z'].min(), 3)} to "
                f"{fmt(unc['max_abs_row_z'].max(), 3)} (worst at d = {int(worst.d)}, x along "
                f"{worst.direction}); {fmt(100 * unc['frac_rows_ci_excludes_1'].mean(), 3)}% of "
                f"its row intervals exclude 1;",
                f"  - corrected: {fmt(cor['max_abs_row_z'].min(), 3)} to "
                f"{fmt(cor['max_abs_row_z'].max(), 3)}; "
                f"{fmt(100 * cor['frac_rows_ci_excludes_1'].mean(), 3)}% of row intervals exclude 1 "
                f"(about 5% expected by chance).",
                f"- Overall r = d estimate, bias without the correction: "
                f"{fmt(unc['overall_bias_%'].abs().min(), 2)}% to "
                f"{fmt(unc['overall_bias_%'].abs().max(), 2)}% (at d = {int(big_d.d.iloc[0])}: "
                f"{', '.join(fmt(b, 2) + '%' for b in big_d['overall_bias_%'])} for directions "
                f"{', '.join(big_d.direction)}); with it: "
                f"{fmt(cor['overall_bias_%'].abs().max(), 2)}% at most.",
            ]
    rm = df[(df.metric == "row_mean") & (df.direction != "peers")
            & (df.variant == "uncorrected-cols")].copy()
    if len(rm) and rm.d.nunique() > 1:
        rm["dev"] = (rm["mean"] - 1.0).abs()
        ref_norm = 1.0 if (rm.x_norm == 1.0).any() else float(rm.x_norm.max())
        parts = []
        for direction, sub in rm[rm.x_norm == ref_norm].groupby("direction"):
            by_d = sub.groupby("d")["dev"].max()
            ratio = by_d.iloc[-1] / by_d.iloc[0]
            trend = ("about constant" if 0.8 <= ratio <= 1.25
                     else "shrinking" if ratio < 1 else "growing")
            parts.append(
                f"x along {direction}: {fmt(by_d.iloc[0], 2)} at d = {int(by_d.index[0])} and "
                f"{fmt(by_d.iloc[-1], 2)} at d = {int(by_d.index[-1])} ({trend} in d)"
            )
        by_x = rm[rm.d == rm.d.min()].groupby("x_norm")["dev"].max()
        finding += [
            f"- Largest per-row deviation |mean - 1| of the uncorrected variant at "
            f"|x| = {ref_norm:g}:",
            *[f"  - {p};" for p in parts],
            f"  - at d = {int(rm.d.min())} it {'grows' if by_x.iloc[-1] > by_x.iloc[0] else 'falls'}"
            f" from {fmt(by_x.iloc[0], 2)} at |x| = {by_x.index[0]:g} to "
            f"{fmt(by_x.iloc[-1], 2)} at |x| = {by_x.index[-1]:g}.",
        ]
    rows_unc = df[(df.metric == "overall_ratio") & (df.variant == "uncorrected-rows")
                  & (df.direction != "peers")]
    rows_col = df[(df.metric == "overall_ratio") & (df.variant == "uncorrected-cols")
                  & (df.direction != "peers")]
    if len(rows_unc) and len(rows_col):
        b_rows = 100 * (rows_unc["mean"] - 1).abs().max()
        b_cols = 100 * (rows_col["mean"] - 1).abs().max()
        verdict = "does not remove the bias" if b_rows > 0.5 * b_cols else "reduces the bias"
        finding.append(
            f"- Using the rows of the uncorrected Q (pyrfm) instead of its columns {verdict}: largest "
            f"overall bias {fmt(b_rows, 3)}% against {fmt(b_cols, 3)}% for the columns."
        )
    out += ["## Finding", "", *(finding or ["No rows to summarise."]), ""]
    return "\n".join(out)


STUDY = Study(
    name="qr-sign-bias",
    description=(
        "Per-row and overall bias of positive ORF features with vs without the QR sign "
        "correction (Mezzadri), against d and |x|"
    ),
    grid=grid,
    run_cell=run_cell,
    plot=plot,
    summarize=summarize,
    headline="per_row_means_d4.png",
)
