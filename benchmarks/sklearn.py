"""Benchmark of the scikit-learn front end against ``sklearn.kernel_approximation.RBFSampler``.

Run: ``python -m benchmarks sklearn [--seeds N] [--cv-seeds N] [--full] [--write-docs]``

On scikit-learn's bundled datasets (digits, breast cancer, wine, iris), features standardised,
RBF kernel $e^{-\\gamma\\|x-y\\|^2}$ with $\\gamma = 1/d$ (scikit-learn's ``gamma="scale"`` on
standardised data: $1/(d\\,\\mathrm{Var}\\,X)$ with $\\mathrm{Var}\\,X = 1$):

(a) Gram-matrix error: the relative Frobenius error $\\|ZZ^\\top - K\\|_F / \\|K\\|_F$ of the
    approximate Gram matrix against the exact ``rbf_kernel``, at equal output width
    ``n_components`` in {64, 256, 1024}, on the first 500 rows of each dataset (all rows of wine
    and iris), mean ± standard error over ``--seeds`` seeds (default 20);
(b) 5-fold stratified cross-validated accuracy (same folds for every method) of
    ``StandardScaler -> features -> LinearSVC`` (``LinearSVC`` rather than ``LogisticRegression``:
    lbfgs takes 10-25 s per cross-validation on digits here, 20x LinearSVC), mean ± standard
    error over ``--cv-seeds`` seeds (default 5), at ``n_components`` in {64, 256}
    (``--full``: also 1024, about 3 more minutes).

Methods: ``RBFSampler`` (iid rows, $\\sqrt{2/F}\\cos(Wx+b)$), and ``kernelapprox.sklearn.
RandomFeatures`` with the same offset estimator (``trig-offset``) or the sin/cos one
(``trig-sincos``, $r = F/2$ projections; the front end's default) on the ``gaussian`` (iid),
``orthogonal``, ``qmc`` and ``structured`` samplers. A method "beats" RBFSampler when the
difference of means exceeds twice its standard error, $\\sqrt{se_a^2 + se_b^2}$ (seeds are
independent across methods).

``--write-docs`` replaces the tables between the markers in ``docs/sklearn.md``. The default run
takes about 2 minutes on 2 CPU cores.
"""

from __future__ import annotations

import argparse
import math
import sys
import time
import warnings
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
from sklearn.datasets import load_breast_cancer, load_digits, load_iris, load_wine
from sklearn.exceptions import ConvergenceWarning
from sklearn.kernel_approximation import RBFSampler
from sklearn.metrics.pairwise import rbf_kernel
from sklearn.model_selection import StratifiedKFold, cross_val_score
from sklearn.pipeline import make_pipeline
from sklearn.preprocessing import StandardScaler
from sklearn.svm import LinearSVC

from kernelapprox.sklearn import RandomFeatures

DATASETS: dict[str, Callable] = {
    "digits": load_digits,
    "breast_cancer": load_breast_cancer,
    "wine": load_wine,
    "iris": load_iris,
}
GRAM_ROWS = 500
DOCS = Path(__file__).resolve().parent.parent / "docs" / "sklearn.md"
START, END = "<!-- bench_sklearn:start -->", "<!-- bench_sklearn:end -->"


def _ours(estimator: str, sampler: str) -> Callable[[int, float, int], object]:
    def make(F: int, gamma: float, seed: int) -> object:
        return RandomFeatures(
            kernel="rbf", estimator=estimator, sampler=sampler, n_components=F, gamma=gamma, random_state=seed
        )

    return make


#: label -> factory(n_components, gamma, seed); the first is the reference.
METHODS: dict[str, Callable[[int, float, int], object]] = {
    "RBFSampler": lambda F, gamma, seed: RBFSampler(gamma=gamma, n_components=F, random_state=seed),
    "offset iid": _ours("trig-offset", "gaussian"),
    "offset orthogonal": _ours("trig-offset", "orthogonal"),
    "offset qmc": _ours("trig-offset", "qmc"),
    "sincos iid": _ours("trig-sincos", "gaussian"),
    "sincos orthogonal": _ours("trig-sincos", "orthogonal"),
    "sincos qmc": _ours("trig-sincos", "qmc"),
    "sincos structured": _ours("trig-sincos", "structured"),
}
CV_METHODS = ["RBFSampler", "offset orthogonal", "sincos iid", "sincos orthogonal", "sincos qmc"]


def load(name: str) -> tuple[np.ndarray, np.ndarray]:
    X, y = DATASETS[name](return_X_y=True)
    return np.asarray(X, dtype=np.float64), np.asarray(y)


def mean_se(values: list[float]) -> tuple[float, float]:
    a = np.asarray(values, dtype=np.float64)
    return float(a.mean()), float(a.std(ddof=1) / math.sqrt(len(a))) if len(a) > 1 else float("nan")


def gram_errors(X: np.ndarray, gamma: float, Fs: list[int], seeds: int) -> dict[tuple[str, int], list[float]]:
    """Relative Frobenius error of Z Z^T against the exact RBF Gram matrix, per method, F, seed."""
    K = rbf_kernel(X, gamma=gamma)
    nK = np.linalg.norm(K)
    out: dict[tuple[str, int], list[float]] = {}
    for label, make in METHODS.items():
        for F in Fs:
            errs = []
            for s in range(seeds):
                Z = make(F, gamma, 1000 + s).fit_transform(X)
                errs.append(float(np.linalg.norm(Z @ Z.T - K) / nK))
            out[label, F] = errs
    return out


def cv_accuracy(X: np.ndarray, y: np.ndarray, gamma: float, Fs: list[int], seeds: int) -> dict[tuple[str, int], list[float]]:
    """Mean 5-fold accuracy of StandardScaler -> features -> LinearSVC, per method, F, seed."""
    folds = StratifiedKFold(5, shuffle=True, random_state=0)
    out: dict[tuple[str, int], list[float]] = {}
    for label in CV_METHODS:
        for F in Fs:
            accs = []
            for s in range(seeds):
                pipe = make_pipeline(StandardScaler(), METHODS[label](F, gamma, 2000 + s), LinearSVC())
                accs.append(float(cross_val_score(pipe, X, y, cv=folds).mean()))
            out[label, F] = accs
    return out


def verdict(res: dict, label: str, F: int, lower_is_better: bool) -> str:
    """``better``/``worse`` than RBFSampler by more than 2 standard errors of the difference, else ``≈``."""
    m, se = mean_se(res[label, F])
    m0, se0 = mean_se(res["RBFSampler", F])
    diff = (m0 - m) if lower_is_better else (m - m0)
    tol = 2 * math.hypot(se, se0)
    return "better" if diff > tol else ("worse" if diff < -tol else "≈")


def table(results: dict[str, dict], Fs: list[int], labels: list[str], lower_is_better: bool, fmt: str) -> str:
    """A markdown table: dataset, method, then 'mean ± se' per F (bold: beats RBFSampler)."""
    head = "| dataset | method | " + " | ".join(f"F = {F}" for F in Fs) + " |"
    lines = [head, "|---|---|" + "---:|" * len(Fs)]
    for ds, res in results.items():
        for label in labels:
            cells = []
            for F in Fs:
                m, se = mean_se(res[label, F])
                cell = f"{m:{fmt}} ± {se:{fmt}}"
                if label != "RBFSampler":
                    v = verdict(res, label, F, lower_is_better)
                    cell = f"**{cell}**" if v == "better" else (f"{cell} (worse)" if v == "worse" else cell)
                cells.append(cell)
            lines.append(f"| {ds} | {label} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def summary(results: dict[str, dict], Fs: list[int], labels: list[str], lower_is_better: bool) -> str:
    """Per method: in how many (dataset, F) settings it is better / within noise / worse."""
    rows = ["| method | better | ≈ | worse |", "|---|---:|---:|---:|"]
    for label in labels[1:]:
        counts = {"better": 0, "≈": 0, "worse": 0}
        for res in results.values():
            for F in Fs:
                counts[verdict(res, label, F, lower_is_better)] += 1
        rows.append(f"| {label} | {counts['better']} | {counts['≈']} | {counts['worse']} |")
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks sklearn", description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", type=int, default=20, help="seeds per Gram-error cell (default 20)")
    ap.add_argument("--cv-seeds", type=int, default=None, help="seeds per accuracy cell (default 5)")
    ap.add_argument("--full", action="store_true", help="cross-validate at n_components = 1024 too")
    ap.add_argument("--write-docs", action="store_true", help=f"write the tables into {DOCS.name}")
    args = ap.parse_args(argv)
    if args.seeds < 2:
        ap.error("--seeds must be >= 2 (a standard error needs two seeds)")
    cv_seeds = args.cv_seeds if args.cv_seeds is not None else 5
    if cv_seeds < 2:
        ap.error("--cv-seeds must be >= 2")
    gram_Fs, cv_Fs = [64, 256, 1024], ([64, 256, 1024] if args.full else [64, 256])
    warnings.simplefilter("ignore", ConvergenceWarning)
    t0 = time.perf_counter()
    gram, acc = {}, {}
    for name in DATASETS:
        X, y = load(name)
        Xs = StandardScaler().fit_transform(X)
        gamma = 1.0 / X.shape[1]
        gram[name] = gram_errors(Xs[:GRAM_ROWS], gamma, gram_Fs, args.seeds)
        acc[name] = cv_accuracy(X, y, gamma, cv_Fs, cv_seeds)
        print(f"# {name}: n={X.shape[0]}, d={X.shape[1]}, gamma=1/{X.shape[1]} ({time.perf_counter() - t0:.0f} s)",
              file=sys.stderr)
    labels = list(METHODS)
    cmd = "python -m benchmarks sklearn" + "".join(
        f" {a}" for a in (sys.argv[1:] if argv is None else argv) if a != "--write-docs"
    )
    text = "\n\n".join([
        f"Command: `{cmd}` (scikit-learn {__import__('sklearn').__version__}, torch {torch.__version__}, "
        f"{time.perf_counter() - t0:.0f} s on {torch.get_num_threads()} threads).",
        f"**(a) Relative Frobenius error of the Gram matrix** ($\\|ZZ^\\top-K\\|_F/\\|K\\|_F$, "
        f"first {GRAM_ROWS} rows, mean ± s.e. over {args.seeds} seeds; **bold**: lower than "
        f"RBFSampler by more than 2 s.e. of the difference)",
        table(gram, gram_Fs, labels, True, ".4f"),
        "Settings (dataset × F) where each method beats RBFSampler's Gram error, is within noise, or loses:",
        summary(gram, gram_Fs, labels, True),
        f"**(b) 5-fold cross-validated accuracy of LinearSVC on the features** (mean ± s.e. over "
        f"{cv_seeds} seeds; **bold**: higher than RBFSampler by more than 2 s.e.)",
        table(acc, cv_Fs, CV_METHODS, False, ".4f"),
        "Settings where each method beats RBFSampler's accuracy, is within noise, or loses:",
        summary(acc, cv_Fs, CV_METHODS, False),
    ])
    print(text)
    if args.write_docs:
        doc = DOCS.read_text()
        i, j = doc.find(START), doc.find(END)
        if i < 0 or j < i:
            print(f"{DOCS}: markers {START} ... {END} not found; nothing written", file=sys.stderr)
            return 1
        DOCS.write_text(doc[: i + len(START)] + "\n\n" + text + "\n\n" + doc[j:])
        print(f"wrote {DOCS}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
