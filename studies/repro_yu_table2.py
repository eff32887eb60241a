r"""repro-yu-table2: an analogue of Yu et al. 2016 (Orthogonal Random Features), Table 2 and Fig. 3, on bundled data.

Yu et al. (NeurIPS 2016, arXiv:1610.09072) compare RFF, ORF and SORF (and QMC) by the Gram-matrix
approximation error (their Fig. 3) and by the test accuracy of a linear SVM trained on the
random features (their Table 2) at $D = 2d, 4d, \dots$ projections, with the Gaussian-kernel
bandwidth $\sigma$ set to the mean distance to the 50th $\ell_2$ nearest neighbour. Their datasets
(letter, forest cover, USPS, MNIST, CIFAR, ...) need a download; this machine has no network, so
scikit-learn's **bundled** real datasets are used instead: ``load_digits`` (1797 × 64, 10
classes) and ``load_breast_cancer`` (569 × 30, 2 classes). covtype and letter were not available
offline. The paper's letter numbers at $D = 2d$ (RFF 76.44 ± 1.04, ORF 77.49 ± 0.95, SORF
76.18 ± 1.20 % accuracy) are quoted for context only: they are on other data.

Per seed: a stratified 75/25 split, features standardised on the training part,
$\gamma = 1/(2\sigma^2)$ from the 50th-neighbour rule on (up to 1000) training points; every map
is a ``kernelapprox.sklearn.RandomFeatures`` (``kernel="rbf"``) with **equal output width $2D$**:

* RFF / ORF / SORF / QMC / simplex = ``trig-sincos`` with the ``gaussian`` / ``orthogonal`` /
  ``structured`` / ``qmc`` / ``simplex`` sampler ($D$ projections, $[\sin, \cos]$ pairs, Yu's map);
* positive = ``positive`` with ``orthogonal`` rows (FAVOR+ features of the RBF kernel, $2D$
  projections);
* RBFSampler = ``sklearn.kernel_approximation.RBFSampler`` (iid cos + random phase, $2D$
  projections).

Metrics: the relative Frobenius error $\|ZZ^\top - K\|_F/\|K\|_F$ of the test-set Gram matrix and
the test accuracy of ``LinearSVC`` (C = 1) trained on the features; the exact-kernel ``SVC`` (same
$\gamma$, C = 1) accuracy is the ceiling. Mean ± sd over seeds.

This is an **analogue**, not a reproduction: the data sets are not Yu's. What can be compared is
the paper's qualitative claims, each tested with paired differences over the seeds (every method
sees the same split in a seed) and Holm's correction across all the cells and pairs of a claim
(`studies.verdicts.pairwise_differences`, rule fixed before the data):

* kernel error, "ORF and SORF below RFF" (Fig. 3): per (data set, D) cell, a corrected interval of
  ORF − RFF (SORF − RFF) below 0 supports it, above 0 contradicts it, containing 0 is a tie; the
  claim *agrees* if every cell supports it, *differs* if one contradicts it, else *inconclusive*;
* accuracy, "ORF at least as accurate as RFF" (Table 2): *differs* if a corrected interval of
  ORF − RFF lies below 0 in some cell, *agrees* if it lies above 0 in every cell, else
  *inconclusive* (ties: the seeds cannot tell the methods apart).
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import numpy as np
import pandas as pd

from studies._engine import Context, Study, df_to_markdown, fmt, row, save_figure, set_style
from studies.verdicts import Verdict, format_verdict, pairwise_differences

PAPER = "Yu et al. 2016, Table 2 / Fig. 3 (analogue on other data)"
DATASETS = ["digits", "breast_cancer"]
#: label -> (estimator, sampler); None = scikit-learn's RBFSampler
METHODS: dict[str, tuple[str, str] | None] = {
    "RFF": ("trig-sincos", "gaussian"),
    "ORF": ("trig-sincos", "orthogonal"),
    "SORF": ("trig-sincos", "structured"),
    "QMC": ("trig-sincos", "qmc"),
    "simplex": ("trig-sincos", "simplex"),
    "positive ORF": ("positive", "orthogonal"),
    "RBFSampler": None,
}
MULTS, MULTS_QUICK = [2, 4, 8], [2]
ACC_MULTS = [2, 4]  # the classifier is trained at these D/d only (LinearSVC cost grows with D)
SEEDS, SEEDS_QUICK = 5, 2
QUICK_MAX_SAMPLES = 400
YU_LETTER = {"RFF": (76.44, 1.04), "ORF": (77.49, 0.95), "SORF": (76.18, 1.20)}  # Table 2, D = 2d


def load(name: str, quick: bool = False) -> tuple[np.ndarray, np.ndarray]:
    """A bundled scikit-learn dataset as (X (n, d) float64, y (n,))."""
    from sklearn import datasets

    loaders = {"digits": datasets.load_digits, "breast_cancer": datasets.load_breast_cancer}
    if name not in loaders:
        raise ValueError(f"dataset must be one of {sorted(loaders)}, got {name!r}")
    X, y = loaders[name](return_X_y=True)
    if quick and len(X) > QUICK_MAX_SAMPLES:
        keep = np.random.default_rng(0).permutation(len(X))[:QUICK_MAX_SAMPLES]
        X, y = X[keep], y[keep]
    return np.asarray(X, dtype=np.float64), y


def bandwidth_gamma(X: np.ndarray, k: int = 50, max_points: int = 1000) -> float:
    r"""$\gamma = 1/(2\sigma^2)$ with $\sigma$ the mean distance to the ``k``-th nearest neighbour.

    Yu et al. 2016 §5's bandwidth rule, over the first ``max_points`` rows of ``X`` (shape (n, d)).
    """
    from sklearn.neighbors import NearestNeighbors

    if not isinstance(k, int) or k < 1 or k >= len(X):
        raise ValueError(f"k must be an int in [1, n_samples), got {k!r}")
    nn = NearestNeighbors(n_neighbors=k + 1).fit(X)
    dist, _ = nn.kneighbors(X[:max_points])
    sigma = float(dist[:, k].mean())
    return 1.0 / (2.0 * sigma**2)


def grid(quick: bool) -> list[dict]:
    """Cells: (dataset, D/d); all methods and seeds inside a cell."""
    return [{"dataset": ds, "mult": m} for ds in DATASETS for m in (MULTS_QUICK if quick else MULTS)]


def _features(method: str, D: int, gamma: float, seed: int, Xtr: np.ndarray, Xte: np.ndarray):
    from sklearn.kernel_approximation import RBFSampler

    from kernelapprox.sklearn import RandomFeatures

    spec = METHODS[method]
    if spec is None:
        tf = RBFSampler(gamma=gamma, n_components=2 * D, random_state=seed)
    else:
        tf = RandomFeatures(kernel="rbf", estimator=spec[0], sampler=spec[1], n_components=2 * D,
                            gamma=gamma, random_state=seed)
    return tf.fit_transform(Xtr), tf.transform(Xte)


def _draws(x: np.ndarray) -> str:
    """Per-seed values as JSON, in seed order (paired across the methods of a cell)."""
    return json.dumps([float(v) for v in np.asarray(x, float)])


def run_cell(cell: dict, ctx: Context) -> list[dict]:
    """Gram error and LinearSVC accuracy of every method over the seeds; exact-SVC ceiling."""
    from sklearn.metrics.pairwise import rbf_kernel
    from sklearn.model_selection import train_test_split
    from sklearn.preprocessing import StandardScaler
    from sklearn.svm import SVC, LinearSVC

    ds, mult = cell["dataset"], int(cell["mult"])
    X, y = load(ds, ctx.quick)
    d = X.shape[1]
    D = mult * d
    n_seeds = SEEDS_QUICK if ctx.quick else SEEDS
    err = {m: [] for m in METHODS}
    acc = {m: [] for m in METHODS}
    exact_acc = []
    for s in range(n_seeds):
        seed = ctx.seed_for(ds, s) % (2**31 - 1)  # the split and scaler do not depend on D
        Xtr, Xte, ytr, yte = train_test_split(X, y, test_size=0.25, random_state=seed, stratify=y)
        sc = StandardScaler().fit(Xtr)
        Xtr, Xte = sc.transform(Xtr), sc.transform(Xte)
        gamma = bandwidth_gamma(Xtr)
        K = rbf_kernel(Xte, gamma=gamma)
        if mult == ACC_MULTS[0]:
            exact_acc.append(SVC(gamma=gamma, C=1.0).fit(Xtr, ytr).score(Xte, yte))
        for j, method in enumerate(METHODS):
            Ztr, Zte = _features(method, D, gamma, (seed + 7919 * (j + 1) + mult) % (2**31 - 1),
                                 Xtr, Xte)
            err[method].append(np.linalg.norm(Zte @ Zte.T - K) / np.linalg.norm(K))
            if mult in ACC_MULTS:
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")  # ConvergenceWarning at max_iter
                    clf = LinearSVC(C=1.0, max_iter=2000).fit(Ztr, ytr)
                acc[method].append(clf.score(Zte, yte))
    rows = []
    for method in METHODS:
        base = {"method": method, "D": D, "d": d, "n": len(X)}
        e = np.asarray(err[method])
        rows.append(row("gram_rel_error", e, sd=float(e.std(ddof=1)) if e.size > 1 else 0.0,
                        draw_values=_draws(e), **base))
        if acc[method]:
            a = 100 * np.asarray(acc[method])
            rows.append(row("accuracy", a, sd=float(a.std(ddof=1)) if a.size > 1 else 0.0,
                            draw_values=_draws(a), **base))
    if exact_acc:
        a = 100 * np.asarray(exact_acc)
        rows.append(row("accuracy", a, sd=float(a.std(ddof=1)) if a.size > 1 else 0.0,
                        method="exact kernel SVC", D=0, d=d, n=len(X)))
    return rows


def plot(df: pd.DataFrame, folder: Path) -> list[Path]:
    """Gram error against D/d (log) and accuracy against D/d, per dataset."""
    import matplotlib.pyplot as plt
    import seaborn as sns

    set_style()
    pal = dict(zip(list(METHODS), sns.color_palette("tab10", len(METHODS)), strict=True))
    dss = [ds for ds in DATASETS if (df["dataset"] == ds).any()]
    fig, axes = plt.subplots(2, len(dss), figsize=(5.5 * len(dss), 7.5), squeeze=False)
    for j, ds in enumerate(dss):
        for i, metric in enumerate(("gram_rel_error", "accuracy")):
            ax = axes[i][j]
            g0 = df[(df["dataset"] == ds) & (df["metric"] == metric)]
            for method in METHODS:
                g = g0[g0["method"] == method].sort_values("mult")
                if g.empty:
                    continue
                ax.errorbar(g["mult"] + 0.04 * list(METHODS).index(method), g["mean"],
                            yerr=g["sd"], marker="o", ms=4, capsize=2, lw=1.2,
                            color=pal[method], label=method)
            ex = g0[g0["method"] == "exact kernel SVC"]
            if len(ex):
                ax.axhline(float(ex["mean"].iloc[0]), color="k", lw=1, ls="--",
                           label="exact-kernel SVC")
            if metric == "gram_rel_error":
                ax.set_yscale("log")
                ax.set_ylabel("‖ZZᵀ − K‖_F / ‖K‖_F (test set)")
            else:
                ax.set_ylabel("LinearSVC test accuracy (%)")
            ax.set_xlabel("D / d (projections per input dimension; width 2D)")
            ax.set_title(f"{ds} (d = {int(g0['d'].iloc[0]) if len(g0) else 0})", fontsize=10)
    handles, labels = axes[1][0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="upper center", bbox_to_anchor=(0.5, 1.04), ncol=5,
               fontsize=8, frameon=False)
    fig.suptitle(f"{PAPER} style, on scikit-learn's bundled data: mean ± sd over seeds", y=1.07)
    fig.tight_layout()
    return save_figure(fig, folder, "yu_table2_kernel_and_accuracy")


def summarize(df: pd.DataFrame, ctx: Context) -> str:
    """Tables (Gram error, accuracy, mean ± sd), orderings with paired comparisons, verdicts."""
    lines = ["## Key results", ""]
    t = df.copy()
    t["mean ± sd"] = [f"{fmt(a)} ± {fmt(b, 2)}" for a, b in zip(t["mean"], t["sd"], strict=True)]
    for metric, what in (("gram_rel_error", "Relative Frobenius error of the test Gram matrix"),
                         ("accuracy", "LinearSVC test accuracy (%)")):
        g = t[t["metric"] == metric]
        tab = g.pivot_table(index=["dataset", "method"], columns="mult", values="mean ± sd",
                            aggfunc="first").reset_index()
        tab.columns = [f"D = {int(c)}d" if isinstance(c, (int, float, np.integer)) else c
                       for c in tab.columns]
        lines += [f"{what}, mean ± sd over {int(g['n_draws'].max())} seeds:", "",
                  df_to_markdown(tab), ""]
    lines += ["Context only (other data): Yu et al. Table 2, letter, D = 2d: " +
              ", ".join(f"{k} {a} ± {b}" for k, (a, b) in YU_LETTER.items()) + " %.", ""]
    f = []
    err = df[df["metric"] == "gram_rel_error"]
    for ds in DATASETS:
        g = err[err["dataset"] == ds]
        if g.empty:
            continue
        for mult in sorted(g["mult"].unique()):
            gm = g[g["mult"] == mult].set_index("method")
            order = " < ".join(gm["mean"].sort_values().index)
            f.append(f"- {ds}, D = {int(mult)}d: Gram error, order of the means {order} "
                     f"(ORF / RFF = {fmt(gm.loc['ORF', 'mean'] / gm.loc['RFF', 'mean'])}, "
                     f"SORF / RFF = {fmt(gm.loc['SORF', 'mean'] / gm.loc['RFF', 'mean'])}, "
                     f"RBFSampler / RFF = {fmt(gm.loc['RBFSampler', 'mean'] / gm.loc['RFF', 'mean'])}).")
    acc = df[df["metric"] == "accuracy"]
    for ds in DATASETS:
        g = acc[(acc["dataset"] == ds) & (acc["mult"] == ACC_MULTS[0])].set_index("method")
        if g.empty:
            continue
        ex = g.loc["exact kernel SVC"] if "exact kernel SVC" in g.index else None
        f.append(f"- {ds}, D = {ACC_MULTS[0]}d accuracy: " + ", ".join(
            f"{m} {fmt(g.loc[m, 'mean'], 4)} ± {fmt(g.loc[m, 'sd'], 2)}" for m in METHODS
            if m in g.index) + (f"; exact-kernel SVC {fmt(ex['mean'], 4)}" if ex is not None else "")
            + ".")
    sp = acc[acc["method"] != "exact kernel SVC"]
    spread = sp.groupby(["dataset", "mult"])["mean"].agg(lambda a: a.max() - a.min())
    sds = sp.groupby(["dataset", "mult"])["sd"].max()
    f.append("- Accuracy spread between methods (max − min of the means) per (dataset, D/d): " +
             ", ".join(f"{ds} {int(m)}d {fmt(v, 2)} pts (largest sd {fmt(sds[(ds, m)], 2)})"
                       for (ds, m), v in spread.items()) + ".")
    gram = _claim(err, [("ORF", "RFF"), ("SORF", "RFF")], better="lower",
                  what="Gram error, ORF and SORF below RFF (Fig. 3)")
    accv = _claim(sp, [("ORF", "RFF")], better="higher",
                  what="accuracy, ORF at least as accurate as RFF (Table 2)")
    f += [format_verdict(gram), format_verdict(accv),
          "- Absolute numbers are not comparable: bundled digits / breast cancer, not letter or "
          "covtype (which need a download)."]
    lines += ["## Finding", "", *f, ""]
    return "\n".join(lines)


def _claim(df: pd.DataFrame, pairs: list[tuple[str, str]], *, better: str, what: str) -> Verdict:
    """Paired per-seed differences of ``pairs`` in every (data set, D) cell, Holm-corrected as one
    family; the claim's label by the rule of the module docstring.

    ``better="lower"`` (an error): *agrees* if every interval lies below 0, *differs* if one lies
    above. ``better="higher"`` (an accuracy; the claim is "at least as good"): *differs* if one
    interval lies below 0, *agrees* if all lie above, else *inconclusive*.
    """
    scores: dict[str, list[float]] = {}
    cells: list[tuple[str, str, str, str]] = []
    for (ds, mult), g in df.groupby(["dataset", "mult"], sort=True):
        if "draw_values" not in g or g["draw_values"].isna().any():
            continue
        vals = {m: json.loads(v) for m, v in zip(g["method"], g["draw_values"], strict=True)}
        for a, b in pairs:
            if a in vals and b in vals and len(vals[a]) >= 2:
                ka, kb = f"{a}@{ds}@{int(mult)}", f"{b}@{ds}@{int(mult)}"
                scores[ka], scores[kb] = vals[a], vals[b]
                cells.append((ka, kb, f"{ds} D={int(mult)}d", f"{a} − {b}"))
    if not cells:
        return Verdict("inconclusive", f"{what}: no paired per-seed values to compare", {})
    n = max(len(v) for v in scores.values())
    table = {k: list(v) + [float("nan")] * (n - len(v)) for k, v in scores.items()}
    recs = pairwise_differences(table, pairs=[(a, b) for a, b, _, _ in cells])
    good = [(r["ci_high"] < 0) if better == "lower" else (r["ci_low"] > 0) for r in recs]
    bad = [(r["ci_low"] > 0) if better == "lower" else (r["ci_high"] < 0) for r in recs]
    if any(bad):
        label = "differs"
    elif all(good):
        label = "agrees"
    else:
        label = "inconclusive"
    detail = "; ".join(
        f"{cell} {name} = {r['diff']:.3g} [{r['ci_low']:.3g}, {r['ci_high']:.3g}]"
        + (" (supports)" if ok else " (contradicts)" if no else " (tie)")
        for (_, _, cell, name), r, ok, no in zip(cells, recs, good, bad, strict=True))
    statement = (f"{what}: {sum(good)} of {len(recs)} paired comparisons support the claim, "
                 f"{sum(bad)} contradict it, {len(recs) - sum(good) - sum(bad)} are ties "
                 f"(mean paired difference over {n} seeds [Holm-corrected interval]: {detail})")
    return Verdict(label, statement, {"support": sum(good), "contradict": sum(bad),
                                      "pairs": len(recs), "records": recs})


STUDY = Study(
    name="repro-yu-table2",
    description="an analogue (other data, not a reproduction) of Yu et al. 2016 Table 2 / Fig. 3 "
    "on scikit-learn's bundled digits and breast-cancer data: Gram error and LinearSVC accuracy "
    "of RFF/ORF/SORF/QMC/simplex/positive vs RBFSampler.",
    grid=grid,
    run_cell=run_cell,
    plot=plot,
    summarize=summarize,
    headline="yu_table2_kernel_and_accuracy.png",
    cache_version="1",
    requires=("sklearn",),
    install='pip install -e ".[sklearn]"',
)
