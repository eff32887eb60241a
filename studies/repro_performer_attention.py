r"""repro-performer-attention: Choromanski et al. 2021 (Performer, ICLR), the attention-output MSE figure.

The Performer paper (arXiv:2009.14794, §4, the figure comparing "Orthogonal vs IID features and
trigonometric sin/cos vs positive features") plots the MSE of the approximate attention output
against the number of random features $m$ at $L = 4096$, $d = 16$, with standard deviations over
15 random input samples. It prints no numbers and gives no formula for this quantity. Reproduced
here:

* **metric**: $\mathrm{MSE} = \frac{1}{L d}\sum_{i,c}(\hat o_{ic} - o_{ic})^2$, the mean squared
  error of the bidirectional attention output $\hat O$ = ``ka.linear_attention`` against the
  exact $O$ = ``ka.softmax_attention`` (kernel $e^{q^\top k}$), one value per input sample;
* **estimators**: positive (FAVOR+) and sin/cos trigonometric features, iid (``gaussian``) and
  block-orthogonal (``orthogonal``) projections, $m$ = number of projections (sin/cos: $2m$
  coordinates, as in the paper);
* **inputs**: 15 samples (one independent feature draw each, batched), entries of $Q, K, V$
  iid $\mathcal N(0,1)$. The paper says only "appropriately normalized random matrix input
  data", so two normalisations are run: ``scaled`` — $Q, K$ divided by $d^{1/4}$ (the
  transformer's $1/\sqrt d$ logit scaling; row norms $\approx d^{1/4} = 2$) — and ``unit`` —
  rows of $Q, K$ normalised to norm 1 (a benign regime where the kernel estimators have relative
  variance of order $e^{\|q\pm k\|^2}/m \approx e^2/m$);
* **our curve**: the library's first-order (delta-method) variance of the output,
  ``ka.theory.attention_variance`` (iid only; exactly $\propto 1/m$), averaged over the first
  ``THEORY_ROWS`` query rows of the first input (it costs $O(L^2)$ per row).
"""

from __future__ import annotations

import functools
import math
import warnings
from pathlib import Path

import numpy as np
import pandas as pd
import torch

import kernelapprox as ka
from studies._engine import Context, Study, df_to_markdown, fmt, row, save_figure, set_style
from studies.estimators import get

PAPER = "Choromanski et al. 2021 (Performer), attention-output MSE figure"
KEYS = ["positive-gaussian", "positive-orthogonal", "trig-sincos-gaussian", "trig-sincos-orthogonal"]
LABEL = {"positive-gaussian": "positive, iid", "positive-orthogonal": "positive, orthogonal",
         "trig-sincos-gaussian": "sin/cos, iid", "trig-sincos-orthogonal": "sin/cos, orthogonal"}
SCALES = ["scaled", "unit"]
D = 16
L_FULL, L_QUICK = 4096, 512
SAMPLES, SAMPLES_QUICK = 15, 4
M_FULL = [16, 32, 64, 128, 256, 512]
M_QUICK = [16, 64]
THEORY_ROWS, THEORY_ROWS_QUICK = 48, 16


def grid(quick: bool) -> list[dict]:
    """Cells: (input normalisation, m); the four estimators share the inputs of a cell."""
    return [{"scale": s, "m": m} for s in SCALES for m in (M_QUICK if quick else M_FULL)]


@functools.lru_cache(maxsize=4)
def _inputs(scale: str, L: int, B: int, seed: int) -> tuple[torch.Tensor, ...]:
    """(q, k, v, exact output), shapes (B, L, D); cached so every m reuses the exact attention."""
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(B, L, D, generator=g, dtype=torch.float64) for _ in range(3))
    if scale == "scaled":
        q, k = q / D**0.25, k / D**0.25
    elif scale == "unit":
        q, k = q / q.norm(dim=-1, keepdim=True), k / k.norm(dim=-1, keepdim=True)
    else:
        raise ValueError(f"scale must be one of {SCALES}, got {scale!r}")
    return q, k, v, ka.softmax_attention(q, k, v)


@functools.lru_cache(maxsize=8)
def _theory_unit(key: str, scale: str, L: int, B: int, seed: int, rows: int) -> float:
    """Delta-method output variance at m = 1, averaged over ``rows`` query rows of input 0."""
    q, k, v, _ = _inputs(scale, L, B, seed)
    fm = get(key).build(D, 1, seed=0)
    var = ka.theory.attention_variance(fm, q[0, :rows], k[0], v[0])  # (rows, D)
    return float(var.mean())


def run_cell(cell: dict, ctx: Context) -> list[dict]:
    """Per-sample attention-output MSE of the four estimators at this m, plus the iid theory."""
    scale, m = cell["scale"], int(cell["m"])
    L = L_QUICK if ctx.quick else L_FULL
    B = SAMPLES_QUICK if ctx.quick else SAMPLES
    seed = ctx.seed_for("inputs", L, B)
    q, k, v, exact = _inputs(scale, L, B, seed)
    rows = []
    for key in KEYS:
        fm = get(key).build(D, m, batch_shape=(B,), seed=ctx.seed_for(cell, key), dtype=ctx.dtype)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", ka.KernelApproxWarning)
            out = ka.linear_attention(q, k, v, fm)  # (B, L, D): draw b on input b
        mse = ((out - exact) ** 2).mean(dim=(-1, -2))  # (B,)
        ok = torch.isfinite(mse)
        theory = float("nan")
        if key.endswith("gaussian"):
            nrows = THEORY_ROWS_QUICK if ctx.quick else THEORY_ROWS
            theory = _theory_unit(key, scale, L, B, seed, nrows) / m
        rows.append(row("output_mse", mse[ok], spec=key, theory=theory,
                        sd=float(mse[ok].std()) if ok.sum() > 1 else float("nan"),
                        median=float(mse[ok].median()), n_nonfinite=int((~ok).sum()), L=L))
    return rows


def _frame(df: pd.DataFrame) -> pd.DataFrame:
    sub = df[df["metric"] == "output_mse"].copy()
    sub["label"] = sub["spec"].map(LABEL)
    return sub


def plot(df: pd.DataFrame, folder: Path) -> list[Path]:
    """MSE against m per normalisation: mean ± sd over inputs (paper style), theory dashed."""
    from kernelapprox import plotting

    set_style()
    sub = _frame(df)
    sub["sd_low"] = np.maximum(sub["mean"] - sub["sd"], sub["mean"] * 1e-3)  # log axis: > 0
    sub["sd_high"] = sub["mean"] + sub["sd"]
    L = sub.groupby("scale")["L"].first().to_dict()
    what = {"scaled": "Q, K / d^(1/4)", "unit": "unit-norm rows of Q, K"}
    fig = plotting.plot_error_vs_r(
        sub, x="m", y="mean", hue="label", ci=("sd_low", "sd_high"), closed_form="theory",
        col="scale", col_order=SCALES, hue_order=[LABEL[k] for k in KEYS],
        palette={LABEL[k]: f"C{i}" for i, k in enumerate(KEYS)},
        facet_title=lambda _, scale: f"L = {int(L[scale])}, d = {D}, {what.get(scale, scale)}",
        xlabel="m (random projections)", ylabel="attention-output MSE (value units²)",
        closed_form_label="delta-method variance (library, iid)", panel_size=(5.4, 3.8),
        title=f"Reproduction of {PAPER}:\nmean ± sd over input samples (bands)")
    return save_figure(fig, folder, "performer_attention_mse")


def summarize(df: pd.DataFrame, ctx: Context) -> str:
    """Table of MSE per (scale, estimator, m); orderings and slopes; verdict."""
    from studies._engine import loglog_slope

    sub = _frame(df)
    t = sub.copy()
    t["MSE mean ± sd"] = [f"{fmt(a)} ± {fmt(b, 2)}" for a, b in zip(t["mean"], t["sd"], strict=True)]
    tab = t.pivot_table(index=["scale", "label"], columns="m", values="MSE mean ± sd",
                        aggfunc="first").reset_index()
    tab.columns = [f"m = {c}" if isinstance(c, (int, np.integer)) else c for c in tab.columns]
    lines = ["## Key results", "",
             f"Attention-output MSE, mean ± sd over {int(sub['n_draws'].max())} input samples "
             "(one feature draw each):", "", df_to_markdown(tab), ""]
    f = []
    verdicts: dict[str, bool] = {}
    for scale in SCALES:
        g0 = sub[sub["scale"] == scale]
        if g0.empty:
            continue
        mmax = g0["m"].max()
        at = g0[g0["m"] == mmax].set_index("spec")["mean"]
        slopes = {}
        for key in KEYS:
            g = g0[g0["spec"] == key].sort_values("m")
            slopes[key] = loglog_slope(g["m"], g["mean"])[0] if len(g) >= 3 else float("nan")
        order = " < ".join(LABEL[k] for k in at.sort_values().index)
        f.append(f"- {scale}: at m = {mmax} the ordering is {order} "
                 f"(positive orthogonal / iid = {fmt(at['positive-orthogonal'] / at['positive-gaussian'])}, "
                 f"sin/cos orthogonal / iid = "
                 f"{fmt(at['trig-sincos-orthogonal'] / at['trig-sincos-gaussian'])}, "
                 f"sin/cos iid / positive iid = "
                 f"{fmt(at['trig-sincos-gaussian'] / at['positive-gaussian'])}).")
        if any(np.isfinite(v) for v in slopes.values()):
            f.append(f"- {scale}: log-log slope of MSE in m: " + ", ".join(
                f"{LABEL[k]} {fmt(v, 2)}" for k, v in slopes.items()) + " (−1 = the 1/m rate).")
        for fam in ("positive", "trig-sincos"):
            th = g0[g0["theory"].notna() & g0["spec"].str.startswith(fam)]
            if len(th):
                rat = th["mean"] / th["theory"]
                f.append(f"- {scale}, {fam} iid: measured MSE / delta-method variance between "
                         f"{fmt(rat.min())} and {fmt(rat.max())} over m (1 = the first-order "
                         "theory holds).")
        pos_wins = bool(at["positive-gaussian"] < at["trig-sincos-gaussian"])
        # orthogonal vs iid: geometric mean over m of the MSE ratio (one m is noisy at 15 samples)
        gm = {}
        for fam in ("positive", "trig-sincos"):
            o = g0[g0["spec"] == f"{fam}-orthogonal"].set_index("m")["mean"]
            i = g0[g0["spec"] == f"{fam}-gaussian"].set_index("m")["mean"]
            gm[fam] = float(np.exp(np.mean(np.log(o / i))))
        orth_wins = [fam for fam, v in gm.items() if v < 1]
        verdicts[scale] = pos_wins and len(orth_wins) == 2
        f.append(f"- {scale}: positive beats sin/cos (iid, m = {mmax}): "
                 f"{'yes' if pos_wins else 'no'}; orthogonal / iid MSE, geometric mean over m: "
                 + ", ".join(f"{fam} {fmt(v)}" for fam, v in gm.items()) + ".")
    # closed-form relative kernel MSE at r = 1 for unit rows with q ⊥ k (s = t = 2):
    # sin/cos e^s (1 - e^-s)^2 / 2, positive e^t - 1 (Performer Lemma 2).
    trig_pos = float(np.exp(2) * (1 - np.exp(-2)) ** 2 / 2 / (np.exp(2) - 1))
    agree = [s_ for s_, v in verdicts.items() if v]
    differ = [s_ for s_, v in verdicts.items() if not v]
    parts = ([f"agrees for `{'`, `'.join(agree)}` inputs"] if agree else []) + (
        [f"differs for `{'`, `'.join(differ)}` inputs"] if differ else [])
    f.append(f"- **{PAPER}: {'; '.join(parts)}** — "
             "the paper's claim (positive below sin/cos, orthogonal below iid) holds where the "
             "softmax kernel has small values (sin/cos relative variance e^(‖q−k‖²)(1−e^(−‖q−k‖²))²"
             "/(2m) explodes with ‖q−k‖); for unit-norm, nearly orthogonal q, k "
             f"(‖q−k‖² ≈ ‖q+k‖² ≈ 2) the closed forms give sin/cos / positive = "
             f"{fmt(trig_pos)} at equal m, so sin/cos wins there. In `scaled`, ‖q+k‖² ≈ 2√d = "
             f"{fmt(2 * math.sqrt(D))}, so the positive relative kernel variance "
             f"(e^(‖q+k‖²) − 1)/m is still ≈ {fmt((math.exp(2 * math.sqrt(D)) - 1) / max(M_FULL))} "
             f"at m = {max(M_FULL)}: its MSE is nearly flat in m. There the measured positive MSE "
             "is orders of magnitude below its first-order expectation (ratios above): with one "
             "draw per input the Monte Carlo shows the typical error, while the mean square is "
             "carried by rare draws (heavy tails, as in orthogonal-gain's unconverged cells), so "
             "the `scaled` ordering is one of typical errors, not of expected MSE. The comparison "
             "is qualitative: the paper prints no numbers and does not state its input "
             "normalisation.")
    lines += ["## Finding", "", *f, ""]
    return "\n".join(lines)


STUDY = Study(
    name="repro-performer-attention",
    description="Reproduces the Performer attention-output MSE figure (L = 4096, d = 16): iid vs "
    "orthogonal × sin/cos vs positive against m.",
    grid=grid,
    run_cell=run_cell,
    plot=plot,
    summarize=summarize,
    headline="performer_attention_mse.png",
    cache_version="1",
)
