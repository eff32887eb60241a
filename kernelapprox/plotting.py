r"""Figures and tables of approximation error from tidy results frames.

The functions read the tidy schema that the studies write (``reports/<study>/results.csv``: one
row per cell and metric, with columns such as ``estimator``, ``label``, ``d``, ``r``,
``metric``, ``mean``, ``ci_low``, ``ci_high`` and ``theory``), so a user's own results in the
same shape give the same figures:

- `plot_error_vs_r`: error against the number of features, one line per ``hue`` with its
  confidence band, the closed form dashed, optional facets;
- `plot_required_features`: the required number of features $r^*$ against the
  input dimension $d$ with laws such as $c\,d$ and $c\,d\log d$ fitted by least
  squares in log space (`fit_laws`);
- `plot_forest`: estimates with intervals, one row each (e.g. fitted slopes), a reference line;
- `ratio_table`: each method's value over a baseline's, as a table
  (`to_markdown` for a report);
- `style` (the shipped style file, `STYLE_PATH`) and `save_figure`
  (byte-stable PNG, SVG and PDF).

matplotlib and pandas are imported when a function needs them: they come with the ``studies``
extra (``pip install 'kernelapprox[studies]'``).

Examples
--------
>>> import matplotlib
>>> matplotlib.use("Agg")
>>> import pandas as pd
>>> from kernelapprox import plotting
>>> df = pd.DataFrame({"estimator": ["trig"] * 3 + ["positive"] * 3,
...                    "r": [16, 64, 256] * 2,
...                    "mean": [0.20, 0.10, 0.05, 0.30, 0.15, 0.075],
...                    "ci_low": [0.18, 0.09, 0.045, 0.26, 0.13, 0.066],
...                    "ci_high": [0.22, 0.11, 0.055, 0.34, 0.17, 0.084],
...                    "theory": [0.2, 0.1, 0.05, 0.3, 0.15, 0.075]})
>>> with plotting.style():
...     fig = plotting.plot_error_vs_r(df, y="mean", ylabel="relative RMS error")
>>> len(fig.axes[0].get_lines())  # 2 estimates + 2 dashed closed forms
4
"""

from __future__ import annotations

import contextlib
import importlib
import math
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import numpy as np

if TYPE_CHECKING:
    import pandas as pd
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

__all__ = [
    "LAWS",
    "STYLE_PATH",
    "fit_laws",
    "plot_error_vs_r",
    "plot_forest",
    "plot_required_features",
    "ratio_table",
    "save_figure",
    "style",
    "to_markdown",
]

#: The style file shipped with the package (a matplotlib ``.mplstyle``).
STYLE_PATH: Path = Path(__file__).resolve().with_name("kernelapprox.mplstyle")

#: Named laws of $r^*(d)$: the d-shape whose constant $c$ `fit_laws` fits.
#: ``"c·d^p"`` is special: the exponent $p$ is fitted too.
LAWS: dict[str, Callable[[np.ndarray], np.ndarray]] = {
    "c·d": lambda d: d,
    "c·d·log d": lambda d: d * np.log(d),
    "c·d^p": lambda d: d,
}

_SVG_SALT = "kernelapprox"  # studies._engine.figures.STABLE_RC uses the same salt
_LAW_STYLES = ("--", ":", "-.", (0, (5, 1, 1, 1, 1, 1)), (0, (1, 3)))


def _require(module: str) -> Any:
    """Import an optional dependency or say which extra provides it."""
    try:
        return importlib.import_module(module)
    except ImportError as err:
        raise ImportError(f"kernelapprox.plotting needs {module.split('.')[0]}, which is not "
                          "installed: pip install 'kernelapprox[studies]'") from err


def _check_frame(df: Any, columns: Sequence[str | None], where: str) -> None:
    pd = _require("pandas")
    if not isinstance(df, pd.DataFrame):
        raise TypeError(f"{where}: df must be a pandas DataFrame, got {type(df).__name__}")
    missing = [c for c in columns if c is not None and c not in df.columns]
    if missing:
        raise ValueError(f"{where}: column(s) {missing} not in df; its columns are "
                         f"{list(map(str, df.columns))}")


def _select_metric(df: pd.DataFrame, metric: str | None, where: str) -> pd.DataFrame:
    if "metric" not in df.columns:
        if metric is not None:
            raise ValueError(f"{where}: metric={metric!r} given but df has no 'metric' column")
        return df
    present = list(dict.fromkeys(df["metric"].dropna()))
    if metric is None:
        if len(present) > 1:
            raise ValueError(f"{where}: df holds several metrics {present}; pass metric=... "
                             "(one metric per figure)")
        return df
    if metric not in present:
        raise ValueError(f"{where}: metric {metric!r} not in df; its metrics are {present}")
    return df[df["metric"] == metric]


def _levels(df: pd.DataFrame, column: str | None, order: Sequence[Any] | None) -> list[Any]:
    """Facet or hue levels present in df, in ``order`` (values not present are skipped)."""
    if column is None:
        return [None]
    present = list(dict.fromkeys(df[column].dropna()))
    if order is None:
        try:
            return sorted(present)
        except TypeError:
            return present
    return [v for v in order if v in set(present)]


def _palette(levels: Sequence[Any], palette: Mapping[Any, Any] | None) -> dict[Any, Any]:
    if palette is not None:
        missing = [h for h in levels if h not in palette]
        if missing:
            raise ValueError(f"palette has no colour for {missing}")
        return dict(palette)
    mpl = _require("matplotlib")
    colours = mpl.rcParams["axes.prop_cycle"].by_key().get("color", ["C0"])
    if len(levels) > len(colours):
        cmap = mpl.colormaps["tab20" if len(levels) <= 20 else "viridis"]
        colours = [cmap(i / max(1, len(levels) - 1)) if len(levels) > 20 else cmap(i)
                   for i in range(len(levels))]
    return {h: colours[i % len(colours)] for i, h in enumerate(levels)}


def _grid(df: pd.DataFrame, row: str | None, col: str | None, row_order: Sequence[Any] | None,
          col_order: Sequence[Any] | None, ax: Axes | None, panel: tuple[float, float],
          where: str, sharey: bool) -> tuple[Figure, list[tuple[Any, Any, Axes, pd.DataFrame]]]:
    """The facet grid: (figure, [(row value, col value, axes, cell frame)]) of non-empty cells.

    Cells without data are hidden; a grid without any data is a ValueError. Axis labels are
    kept on the lowest panel of each column (x) and the leftmost of each row (y).
    """
    plt = _require("matplotlib.pyplot")
    rows = _levels(df, row, row_order)
    cols = _levels(df, col, col_order)
    if not rows or not cols or len(df) == 0:
        raise ValueError(f"{where}: nothing to draw: no rows left for the facets "
                         f"(row={row!r} levels {rows}, col={col!r} levels {cols}, "
                         f"{len(df)} rows of data)")
    if ax is not None:
        if row is not None or col is not None:
            raise ValueError(f"{where}: ax= draws one panel; it cannot be combined with "
                             f"row={row!r} or col={col!r}")
        return cast("Figure", ax.figure), [(None, None, ax, df)]
    fig, axes = plt.subplots(len(rows), len(cols), squeeze=False, sharex=True, sharey=sharey,
                             layout="constrained",
                             figsize=(panel[0] * len(cols) + 0.6, panel[1] * len(rows) + 0.6))
    cells = []
    for i, rv in enumerate(rows):
        for j, cv in enumerate(cols):
            m = np.ones(len(df), dtype=bool)
            if row is not None:
                m &= (df[row] == rv).to_numpy()
            if col is not None:
                m &= (df[col] == cv).to_numpy()
            if not m.any():
                axes[i][j].set_visible(False)  # a missing facet: skipped
                continue
            cells.append((rv, cv, axes[i][j], df[m]))
    return fig, cells


def _outer_labels(cells: Sequence[tuple[Any, Any, Axes, Any]], xlabel: str, ylabel: str) -> None:
    """x label on the lowest panel of each grid column, y label on the leftmost of each row."""
    pos = {}
    for _, _, a, _ in cells:
        spec = a.get_subplotspec()
        pos[a] = (spec.rowspan.start, spec.colspan.start) if spec is not None else (0, 0)
    for a, (i, j) in pos.items():
        lowest = not any(q == j and p > i for p, q in pos.values())
        a.set_xlabel(xlabel if lowest else "")
        if lowest:  # the panel below is a skipped facet: the shared x axis keeps its ticks here
            a.tick_params(axis="x", which="both", labelbottom=True)
        a.set_ylabel(ylabel if not any(p == i and q < j for p, q in pos.values()) else "")


def _title(row: str | None, rv: Any, col: str | None, cv: Any) -> str:
    parts = [f"{k} = {v}" for k, v in ((row, rv), (col, cv)) if k is not None]
    return ", ".join(parts)


def _finite_positive(values: Sequence[np.ndarray]) -> np.ndarray:
    v = np.concatenate([np.asarray(x, dtype=float).ravel() for x in values]) if values else \
        np.empty(0)
    return v[np.isfinite(v) & (v > 0)]


def _flags(values: Any) -> np.ndarray:
    """Boolean flags of a column: any non-empty, non-False value (``"True"`` read from a CSV)."""
    return np.asarray(values.fillna("").map(lambda v: bool(v) and str(v) != "False"), dtype=bool)


def _legend(fig: Figure, cells: Sequence[tuple[Any, Any, Axes, Any]], handles: list[Any],
            *, below: bool = False) -> None:
    """One panel: a legend in it; a grid: one legend above the panels, or below them when the
    figure has a title (constrained layout does not stack a title and a legend above a grid)."""
    if not handles:
        return
    if len(cells) == 1:
        cells[0][2].legend(handles=handles, loc="best")
    else:
        fig.legend(handles=handles, loc="outside lower center" if below else "outside upper center",
                   ncol=min(4, len(handles)))


def plot_error_vs_r(df: pd.DataFrame, *, x: str = "r", y: str = "mean",
                    hue: str | None = "estimator",
                    ci: tuple[str, str] | None = ("ci_low", "ci_high"),
                    closed_form: str | None = "theory", metric: str | None = None,
                    row: str | None = None, col: str | None = None,
                    style_by: str | None = None, hue_order: Sequence[Any] | None = None,
                    row_order: Sequence[Any] | None = None,
                    col_order: Sequence[Any] | None = None,
                    palette: Mapping[Any, Any] | None = None,
                    transform: Callable[[np.ndarray], np.ndarray] | None = None,
                    xscale: str = "log", yscale: str = "log",
                    xlabel: str | None = None, ylabel: str | None = None,
                    title: str | None = None,
                    facet_title: Callable[[Any, Any], str] | None = None,
                    ax: Axes | None = None, closed_form_label: str = "closed form",
                    reference: float | None = None, reference_label: str | None = None,
                    hollow: str | None = None,
                    hollow_label: str = "unreliable (not an estimate)",
                    panel_size: tuple[float, float] = (3.6, 2.9),
                    style_order: Sequence[Any] | None = None) -> Figure:
    r"""Error against the number of features: one line per ``hue``, its confidence band, and
    the closed form dashed in the same colour.

    For a Monte Carlo estimator with $r$ independent features the mean squared error is
    $\mathrm{MSE}(r) = V/r$ (so the RMS error falls like $r^{-1/2}$, a straight
    line of slope $-1/2$ on log-log axes); ``closed_form`` is a column holding such a
    prediction (e.g. `kernelapprox.theory.mse_formula`'s, as the studies write it).

    Parameters
    ----------
    df : pandas.DataFrame
        Tidy results: one row per (facet, hue, style, x).
    x, y : str
        Columns of the abscissa (the number of features) and of the error.
    hue : str or None
        Column whose levels are the lines (e.g. ``"estimator"`` or ``"label"``).
    ci : (str, str) or None
        Columns of the confidence band's ends; ``None``: no band.
    closed_form : str or None
        Column of the predicted error, drawn dashed; skipped when absent or all NaN for a line.
    metric : str, optional
        Keep the rows with ``df["metric"] == metric``. Required when ``df`` holds several
        metrics.
    row, col : str, optional
        Facet columns (a grid of panels). Facet levels without data are skipped (their panel
        hidden); levels named in ``row_order``/``col_order`` that are absent are left out.
    style_by : str, optional
        Column whose levels get different markers (same colour per hue).
    hue_order, row_order, col_order : sequence, optional
        Orders of the levels (default: sorted).
    palette : mapping, optional
        Colour per hue level (default: the colour cycle).
    transform : callable, optional
        Applied to ``y``, the band and the closed form before drawing, e.g. ``np.sqrt`` for an
        MSE column drawn as an RMS (negative band ends are clipped at 0 first).
    xscale, yscale : str
        Axis scales (``"log"`` axes are base 2 on x).
    xlabel, ylabel, title : str, optional
        Labels (default: the column names).
    facet_title : callable, optional
        ``facet_title(row value, col value) -> str`` (``None`` for an absent facet); default
        ``"row = value, col = value"``.
    ax : matplotlib.axes.Axes, optional
        Draw into this panel (no facets).
    closed_form_label : str
        Legend entry of the dashed closed-form lines (e.g. ``"delta-method variance"``).
    reference : float, optional
        A horizontal line in every panel (thin, black, dash-dotted), e.g. ``1`` under a ratio
        or ``0`` under a difference; with ``yscale="log"`` it must be positive.
    reference_label : str, optional
        Its legend entry (default ``"reference <value>"``).
    hollow : str, optional
        Column flagging points drawn with hollow markers (any non-empty, non-False value):
        values kept on the line but not to be read as estimates (e.g. an unconverged Monte
        Carlo mean).
    hollow_label : str
        Legend entry of the hollow markers (shown when a point is flagged).
    panel_size : (float, float)
        Width and height of one facet panel in inches (the figure grows with the grid).
    style_order : sequence, optional
        Order of the ``style_by`` levels (their markers and legend entries; default: sorted).

    Returns
    -------
    matplotlib.figure.Figure
        One visible panel per facet cell with data; in each, per hue level one line labelled
        with the level, one band (a ``PolyCollection``) and one dashed closed-form line.

    Raises
    ------
    ValueError
        A missing column, several metrics without ``metric``, no data left to draw, or several
        rows for one point (filter the frame or add a facet).

    References
    ----------
    - [RR07] A. Rahimi and B. Recht, "Random features for large-scale kernel machines", NeurIPS
      (2007): the $r^{-1/2}$ Monte Carlo rate.
    - [Cho21] K. Choromanski et al., "Rethinking attention with Performers", ICLR (2021): the
      closed-form MSE of positive and trigonometric features (their Lemma 2).

    Examples
    --------
    >>> import matplotlib
    >>> matplotlib.use("Agg")
    >>> import numpy as np, pandas as pd
    >>> from kernelapprox.plotting import plot_error_vs_r
    >>> r = np.array([8, 32, 128, 512])
    >>> df = pd.concat([pd.DataFrame({"estimator": e, "d": d, "r": r, "mean": v / r,
    ...                               "ci_low": 0.8 * v / r, "ci_high": 1.2 * v / r,
    ...                               "theory": v / r})
    ...                 for e, v in (("trig", 1.0), ("positive", 3.0)) for d in (16, 64)])
    >>> fig = plot_error_vs_r(df, col="d", transform=np.sqrt, ylabel="relative RMS error")
    >>> len(fig.axes), [len(a.get_lines()) for a in fig.axes]
    (2, [4, 4])

    A ratio to a baseline, its reference line at 1, and a point flagged as unreliable:

    >>> ratio = pd.DataFrame({"sampler": "orthogonal", "r": r, "mean": [0.9, 0.7, 0.5, 0.4],
    ...                       "ci_low": [0.8, 0.6, 0.45, 0.2], "ci_high": [1.0, 0.8, 0.55, 0.9],
    ...                       "converged": [True, True, True, False]})
    >>> ratio["unconverged"] = ~ratio["converged"]
    >>> fig = plot_error_vs_r(ratio, hue="sampler", closed_form=None, reference=1.0,
    ...                       reference_label="iid (ratio 1)", hollow="unconverged")
    >>> [t.get_text() for t in fig.axes[0].get_legend().get_texts()]
    ['orthogonal', 'iid (ratio 1)', 'unreliable (not an estimate)']
    """
    where = "plot_error_vs_r"
    _check_frame(df, [x, y, hue, row, col, style_by, hollow], where)
    if reference is not None:
        if not isinstance(reference, int | float) or isinstance(reference, bool) or \
                not math.isfinite(reference):
            raise TypeError(f"{where}: reference must be a finite number, got {reference!r}")
        if yscale == "log" and reference <= 0:
            raise ValueError(f"{where}: reference={reference!r} cannot be drawn on a log y axis "
                             "(pass a positive value or yscale='linear')")
    if ci is not None and any(c not in df.columns for c in ci):
        raise ValueError(f"{where}: the band's columns ci={ci} are not both in df (pass ci=None "
                         f"for no band); its columns are {list(map(str, df.columns))}")
    data = _select_metric(df, metric, where)
    data = data[np.isfinite(data[y].to_numpy(dtype=float))]  # a cell without a value: no point
    if len(data) == 0:
        raise ValueError(f"{where}: nothing to draw: no row of df has a finite {y!r}"
                         + (f" for metric {metric!r}" if metric is not None else ""))
    if closed_form is not None and closed_form not in data.columns:
        closed_form = None
    keys = [c for c in (row, col, hue, style_by, x) if c is not None]
    dup = data.duplicated(subset=keys)
    if dup.any():
        first = data.loc[dup, keys].iloc[0].to_dict()
        raise ValueError(f"{where}: several rows for one point {first}: filter df (e.g. by "
                         "metric) or facet by the column that differs (row=, col=, style_by=)")
    _require("matplotlib")
    from matplotlib.lines import Line2D

    hues = _levels(data, hue, hue_order)
    if hue is not None and not hues:
        raise ValueError(f"{where}: no rows with a {hue!r} in hue_order={list(hue_order or [])}")
    data = data if hue is None else data[data[hue].isin(hues)]
    pal = _palette(hues, palette)
    styles = _levels(data, style_by, style_order)
    if style_by is not None and not styles:
        raise ValueError(f"{where}: no rows with a {style_by!r} in "
                         f"style_order={list(style_order or [])}")
    data = data if style_by is None else data[data[style_by].isin(styles)]
    markers = dict(zip(styles, ["o", "s", "^", "D", "v", "P", "X", "*"] * 4, strict=False))
    if len(panel_size) != 2 or not all(isinstance(v, int | float) and v > 0
                                       for v in panel_size):
        raise ValueError(f"{where}: panel_size must be (width, height) in inches, both > 0, "
                         f"got {panel_size!r}")
    fig, cells = _grid(data, row, col, row_order, col_order, ax, panel_size, where, sharey=False)

    def tf(v: Any) -> np.ndarray:
        a = np.asarray(v, dtype=float)
        return transform(np.clip(a, 0, None)) if transform is not None else a

    any_closed = any_hollow = False
    for rv, cv, a, g in cells:
        curves: list[np.ndarray] = []
        if reference is not None:
            a.axhline(reference, color="k", ls="-.", lw=0.8, zorder=1)
        for h in hues:
            gh = g if hue is None else g[g[hue] == h]
            for s in styles:
                gs = gh if style_by is None else gh[gh[style_by] == s]
                if len(gs) == 0:
                    continue
                gs = gs.sort_values(x)
                xs = gs[x].to_numpy(dtype=float)
                ys = tf(gs[y])
                lab = (y if hue is None else str(h)) if style_by is None else f"{h}, {s}"
                a.plot(xs, ys, marker=markers[s], color=pal[h], label=lab)
                curves.append(ys)
                if hollow is not None:
                    flag = _flags(gs[hollow])
                    if flag.any():
                        a.plot(xs[flag], ys[flag], ls="none", marker=markers[s], mfc="white",
                               mec=pal[h], mew=1.3, ms=7, zorder=5, label="_hollow")
                        any_hollow = True
                if ci is not None:
                    a.fill_between(xs, tf(gs[ci[0]]), tf(gs[ci[1]]), color=pal[h], alpha=0.18,
                                   lw=0)
                if closed_form is not None and gs[closed_form].notna().any():
                    cf = tf(gs[closed_form])
                    a.plot(xs, cf, ls="--", lw=1.0, color=pal[h], label="_closed form")
                    curves.append(cf)
                    any_closed = True
        a.set_xscale(xscale, **({"base": 2} if xscale == "log" else {}))
        a.set_yscale(yscale)
        vals = _finite_positive(curves)
        if yscale == "log" and vals.size:  # limits from the curves: a band reaching 0 runs off
            a.set_ylim(vals.min() / 3, vals.max() * 3)
        a.set_title(_title(row, rv, col, cv) if facet_title is None else facet_title(rv, cv))
    _outer_labels(cells, xlabel if xlabel is not None else x, ylabel if ylabel is not None else y)
    handles: list[Any] = []
    if hue is not None:
        for h in hues:
            if style_by is None:
                handles.append(Line2D([], [], color=pal[h], marker="o", label=str(h)))
            else:
                handles.append(Line2D([], [], color=pal[h], label=str(h)))
    if style_by is not None:
        for s in styles:
            handles.append(Line2D([], [], color="0.3", marker=markers[s], ls="", label=str(s)))
    if any_closed:
        handles.append(Line2D([], [], color="k", ls="--", lw=1.0, label=closed_form_label))
    if reference is not None:
        handles.append(Line2D([], [], color="k", ls="-.", lw=0.8,
                              label=reference_label if reference_label is not None
                              else f"reference {reference:g}"))
    if any_hollow:
        handles.append(Line2D([], [], color="0.3", marker="o", mfc="white", mew=1.3, ms=7,
                              ls="", label=hollow_label))
    if title is not None:
        fig.suptitle(title)
    _legend(fig, cells, handles, below=title is not None)
    return fig


def fit_laws(d: Any, r: Any, laws: Sequence[str] | Mapping[str, Callable[[np.ndarray], np.ndarray]]
             = ("c·d", "c·d·log d"), *, se: Any = None) -> pd.DataFrame:
    r"""Fit laws $r^*(d) = c\, f(d)$ by (weighted) least squares in log space.

    For a law with a fixed shape $f$, $\log c = \sum_i w_i (\log r_i - \log f(d_i))
    / \sum_i w_i$ with $w_i = 1/\mathrm{se}_i^2$ (``se`` is the standard error of
    $\log r_i$; equal weights without it). ``"c·d^p"`` fits $\log r = \log c +
    p \log d$ (WLS line). The residual sum of squares $\mathrm{RSS} = \sum_i w_i
    \hat\epsilon_i^2$ (with unit weights when ``se`` is None) gives
    $\mathrm{AICc} = n \log(\mathrm{RSS}/n) + 2k + 2k(k+1)/(n-k-1)$, $k$ = fitted
    parameters + 1 (the noise level), NaN when $n \le k + 1$.

    Parameters
    ----------
    d, r : array_like, shape (n,)
        Positive dimensions and required numbers of features; non-finite or non-positive
        points are left out.
    laws : sequence of str or mapping str -> callable
        Names from `LAWS`, or ``name -> f`` with ``f(d)`` the law's shape (e.g.
        ``lambda d: d * np.log(1e5 * d)``).
    se : array_like, shape (n,), optional
        Standard errors of $\log r$.

    References
    ----------
    - [HT89] C. M. Hurvich and C.-L. Tsai, "Regression and time series model selection in small
      samples", Biometrika 76 (1989): the AICc.

    Returns
    -------
    pandas.DataFrame
        One row per law: ``law``, ``c``, ``p`` (the exponent of ``"c·d^p"``, else NaN),
        ``n``, ``rss``, ``aicc``.

    Examples
    --------
    >>> import numpy as np
    >>> from kernelapprox.plotting import fit_laws
    >>> d = np.array([4.0, 8, 16, 32, 64])
    >>> fit_laws(d, 3 * d, ["c·d", "c·d^p"])[["law", "c", "p"]].round(3).to_dict("list")
    {'law': ['c·d', 'c·d^p'], 'c': [3.0, 3.0], 'p': [nan, 1.0]}
    """
    pd = _require("pandas")
    da = np.asarray(d, dtype=float)
    ra = np.asarray(r, dtype=float)
    if da.ndim != 1 or ra.shape != da.shape:
        raise ValueError(f"fit_laws: d and r must be 1-D of one length, got shapes {da.shape}, "
                         f"{ra.shape}")
    w = np.ones_like(da) if se is None else np.asarray(se, dtype=float) ** -2.0
    if w.shape != da.shape:
        raise ValueError(f"fit_laws: se must have the shape of d {da.shape}, got {w.shape}")
    if isinstance(laws, Mapping):
        shapes = dict(laws)
    else:
        unknown = [name for name in laws if name not in LAWS]
        if unknown:
            raise ValueError(f"fit_laws: unknown law(s) {unknown}; the named laws are "
                             f"{list(LAWS)} (or pass a mapping name -> shape function)")
        shapes = {name: LAWS[name] for name in laws}
    out = []
    for name, f in shapes.items():
        with np.errstate(divide="ignore", invalid="ignore"):
            shape = np.asarray(f(da), dtype=float)
            ok = (np.isfinite(da) & (da > 0) & np.isfinite(ra) & (ra > 0) & np.isfinite(shape)
                  & (shape > 0) & np.isfinite(w) & (w > 0))
        n = int(ok.sum())
        rec: dict[str, Any] = {"law": name, "c": math.nan, "p": math.nan, "n": n,
                               "rss": math.nan, "aicc": math.nan}
        power = name == "c·d^p"
        k = (2 if power else 1) + 1
        if n >= (3 if power else 1):
            ww, lr = w[ok], np.log(ra[ok])
            if power:
                lx = np.log(da[ok])
                xm, ym = np.average(lx, weights=ww), np.average(lr, weights=ww)
                p = float(np.sum(ww * (lx - xm) * (lr - ym)) / np.sum(ww * (lx - xm) ** 2))
                logc = ym - p * xm
                res = lr - logc - p * lx
                rec["p"] = p
            else:
                ls = np.log(shape[ok])
                logc = float(np.average(lr - ls, weights=ww))
                res = lr - logc - ls
            rss = float(np.sum(ww * res**2))
            rec.update(c=float(np.exp(logc)), rss=rss)
            if n > k + 1 and rss > 0:
                rec["aicc"] = n * math.log(rss / n) + 2 * k + 2 * k * (k + 1) / (n - k - 1)
        out.append(rec)
    return pd.DataFrame(out)


def _law_curve(rec: Mapping[str, Any], f: Callable[[np.ndarray], np.ndarray],
               dd: np.ndarray) -> np.ndarray:
    if rec["law"] == "c·d^p":
        return float(rec["c"]) * dd ** float(rec["p"])
    return float(rec["c"]) * np.asarray(f(dd), dtype=float)


def plot_required_features(df: pd.DataFrame, *, x: str = "d", y: str = "r_star",
                           ci: tuple[str, str] | None = ("r_star_lo", "r_star_hi"),
                           hue: str | None = None,
                           laws: Sequence[str] | Mapping[str, Callable[[np.ndarray], np.ndarray]]
                           = ("c·d", "c·d·log d"),
                           se: str | None = None, censored: str | None = None,
                           per_x: bool = False, row: str | None = None, col: str | None = None,
                           hue_order: Sequence[Any] | None = None,
                           row_order: Sequence[Any] | None = None,
                           col_order: Sequence[Any] | None = None,
                           palette: Mapping[Any, Any] | None = None,
                           xlabel: str | None = None, ylabel: str | None = None,
                           title: str | None = None,
                           facet_title: Callable[[Any, Any], str] | None = None,
                           ax: Axes | None = None) -> Figure:
    r"""The required number of features $r^*$ against $d$, with fitted laws.

    Points with error bars (``ci``) per ``hue`` level; for each level, every law of ``laws`` is
    fitted to that level's points by `fit_laws` (log space, weights $1/\mathrm{se}^2$
    from the ``se`` column when given) and drawn in the level's colour, one line style per law.
    With ``per_x=True`` the y axis is $r^*/d$: a flat curve is linear in $d$ and a
    $c\,d\log d$ law rises like $\log d$.

    Parameters
    ----------
    df : pandas.DataFrame
        One row per (facet, hue, x) (e.g. the studies' ``rstar_table``: ``d``, ``eps``,
        ``r_star``, ``r_star_lo``, ``r_star_hi``, ``se_log``, ``censored``).
    x, y : str
        Columns of $d$ and $r^*$.
    ci : (str, str) or None
        Columns of the interval of ``y``.
    hue : str, optional
        Column of the levels drawn in different colours (e.g. ``"eps"``).
    laws : sequence of str or mapping
        See `fit_laws`; empty: no fits.
    se : str, optional
        Column of the standard error of $\log r^*$ (fit weights).
    censored : str, optional
        Column flagging censored points (any non-empty, non-False value): drawn hollow at their
        ``y`` (put the bound there, e.g. the largest r of the grid for "r* above the grid") and
        left out of the fits. Rows whose ``y`` is NaN are not drawn.
    per_x : bool
        Plot $r^*/d$.
    row, col, hue_order, row_order, col_order, palette, xlabel, ylabel, title, facet_title, ax
        As in `plot_error_vs_r` (missing facets are skipped).

    References
    ----------
    - [RR07] A. Rahimi and B. Recht, "Random features for large-scale kernel machines", NeurIPS
      (2007), Claim 1: a uniform error $\varepsilon$ on a set of diameter
      $\mathrm{diam}$ with $r = \Omega(d\,\varepsilon^{-2}
      \log(\sigma_p\,\mathrm{diam}/\varepsilon))$ features, $\sigma_p^2 =
      E\|\omega\|^2$ ($= d$ for the Gaussian kernel): a $d\log d$-type law.
    - [SS15] B. Sriperumbudur and Z. Szabó, "Optimal rates for random Fourier features", NeurIPS
      (2015).

    Returns
    -------
    matplotlib.figure.Figure
        The fitted constants are in ``fig.kernelapprox_fits`` (a DataFrame: the facet and hue
        values and `fit_laws`' columns).

    Examples
    --------
    >>> import matplotlib
    >>> matplotlib.use("Agg")
    >>> import numpy as np, pandas as pd
    >>> from kernelapprox.plotting import plot_required_features
    >>> d = np.array([4, 8, 16, 32, 64, 128])
    >>> df = pd.concat([pd.DataFrame({"eps": e, "d": d, "r_star": c * d * np.log(d),
    ...                               "r_star_lo": 0.9 * c * d * np.log(d),
    ...                               "r_star_hi": 1.1 * c * d * np.log(d)})
    ...                 for e, c in ((0.1, 40.0), (0.3, 5.0))])
    >>> fig = plot_required_features(df, hue="eps", per_x=True)
    >>> fits = fig.kernelapprox_fits
    >>> fits[fits["law"] == "c·d·log d"]["c"].round(6).tolist()
    [40.0, 5.0]
    """
    where = "plot_required_features"
    _check_frame(df, [x, y, hue, row, col, se, censored, *(ci or ())], where)
    pd = _require("pandas")
    from matplotlib.lines import Line2D

    keys = [c for c in (row, col, hue, x) if c is not None]
    dup = df.duplicated(subset=keys)
    if dup.any():
        first = df.loc[dup, keys].iloc[0].to_dict()
        raise ValueError(f"{where}: several rows for one point {first}: filter df or facet by "
                         "the column that differs")
    hues = _levels(df, hue, hue_order)
    if hue is not None and not hues:
        raise ValueError(f"{where}: no rows with a {hue!r} in hue_order={list(hue_order or [])}")
    data = df if hue is None else df[df[hue].isin(hues)]
    data = data[np.isfinite(data[y].to_numpy(dtype=float))]  # no value (e.g. censored): no point
    if len(data) == 0:
        raise ValueError(f"{where}: nothing to draw: no row of df has a finite {y!r}")
    pal = _palette(hues, palette)
    if isinstance(laws, Mapping):
        shapes = dict(laws)
    else:
        unknown = [n for n in laws if n not in LAWS]
        if unknown:
            raise ValueError(f"{where}: unknown law(s) {unknown}; the named laws are {list(LAWS)} "
                             "(or pass a mapping name -> shape function)")
        shapes = {n: LAWS[n] for n in laws}
    lstyle = dict(zip(shapes, _LAW_STYLES * 4, strict=False))
    fig, cells = _grid(data, row, col, row_order, col_order, ax, (4.2, 3.4), where, sharey=False)
    fits = []
    for rv, cv, a, g in cells:
        for h in hues:
            gh = (g if hue is None else g[g[hue] == h]).sort_values(x)
            if len(gh) == 0:
                continue
            dx = gh[x].to_numpy(dtype=float)
            scale = dx if per_x else np.ones_like(dx)
            yv = gh[y].to_numpy(dtype=float)
            cens = (np.zeros(len(gh), dtype=bool) if censored is None else
                    gh[censored].fillna("").map(lambda v: bool(v) and v != "False").to_numpy(bool))
            if ci is not None:
                lo = gh[ci[0]].to_numpy(dtype=float)
                hi = gh[ci[1]].to_numpy(dtype=float)
                err = np.vstack([np.clip(yv - lo, 0, None), np.clip(hi - yv, 0, None)]) / scale
                err = np.nan_to_num(err)
                a.errorbar(dx[~cens], (yv / scale)[~cens], yerr=err[:, ~cens], fmt="o",
                           capsize=2, color=pal[h], lw=1, label=str(h))
            else:
                a.plot(dx[~cens], (yv / scale)[~cens], "o", color=pal[h], label=str(h))
            if cens.any():
                a.plot(dx[cens], (yv / scale)[cens], "o", mfc="none", color=pal[h],
                       label="_censored")
            if shapes:
                sev = None if se is None else gh[se].to_numpy(dtype=float)[~cens]
                tab = fit_laws(dx[~cens], yv[~cens], shapes if isinstance(laws, Mapping)
                               else list(laws), se=sev)
                used = dx[~cens]
                used = used[np.isfinite(used) & (used > 0)]
                if used.size:
                    dd = np.geomspace(used.min(), used.max(), 60)
                    for rec in tab.to_dict("records"):
                        if math.isfinite(rec["c"]):
                            a.plot(dd, _law_curve(rec, shapes[rec["law"]], dd) /
                                   (dd if per_x else 1.0), ls=lstyle[rec["law"]], lw=1.0,
                                   color=pal[h], label=f"_fit {rec['law']}")
                tab.insert(0, "hue", h)
                if col is not None:
                    tab.insert(0, col, cv)
                if row is not None:
                    tab.insert(0, row, rv)
                fits.append(tab)
        a.set_xscale("log", base=2)
        a.set_yscale("log")
        a.set_title(_title(row, rv, col, cv) if facet_title is None else facet_title(rv, cv))
    _outer_labels(cells, xlabel if xlabel is not None else x,
                  ylabel if ylabel is not None else (f"{y} / {x}" if per_x else y))
    handles: list[Any] = []
    if hue is not None:
        handles += [Line2D([], [], color=pal[h], marker="o", ls="", label=f"{hue} = {h}")
                    for h in hues]
    handles += [Line2D([], [], color="k", ls=lstyle[n], lw=1.0, label=f"fit {n}") for n in shapes]
    if censored is not None and data[censored].fillna("").map(
            lambda v: bool(v) and v != "False").any():
        handles.append(Line2D([], [], color="k", marker="o", mfc="none", ls="",
                              label="censored (not fitted)"))
    _legend(fig, cells, handles)
    if title is not None:
        fig.suptitle(title)
    fig.kernelapprox_fits = (pd.concat(fits, ignore_index=True)  # type: ignore[attr-defined]
                             if fits else pd.DataFrame())
    return fig


def plot_forest(df: pd.DataFrame, *, x: str = "slope",
                ci: tuple[str, str] | None = ("slope_lo", "slope_hi"), y: str = "label",
                hue: str | None = None, col: str | None = None,
                reference: float | None = None, order: Sequence[Any] | None = None,
                hue_order: Sequence[Any] | None = None, col_order: Sequence[Any] | None = None,
                palette: Mapping[Any, Any] | None = None, xlabel: str | None = None,
                title: str | None = None,
                facet_title: Callable[[Any, Any], str] | None = None,
                ax: Axes | None = None, reference_label: str | None = None) -> Figure:
    r"""A forest plot: one estimate with its interval per row, e.g. fitted log-log slopes.

    Each level of ``y`` is a row of the panel; the levels of ``hue`` are dodged vertically
    within it, one colour each; ``reference`` is a dashed vertical line (e.g. $-1/2$, the
    Monte Carlo rate of an RMS error against $r$ [RR07]).

    Parameters
    ----------
    df : pandas.DataFrame
        One row per (col, y, hue).
    x : str
        Column of the estimates.
    ci : (str, str) or None
        Columns of the interval.
    y : str
        Column of the row labels.
    hue : str, optional
        Column of the levels dodged within a row.
    col : str, optional
        Facet column (panels side by side, the rows shared); levels without data are skipped.
    reference : float, optional
        Value drawn as a dashed vertical line.
    order, hue_order, col_order : sequence, optional
        Orders of the rows (default: first appearance), hues and panels (default: sorted).
    palette, xlabel, title, facet_title, ax
        As in `plot_error_vs_r`.
    reference_label : str, optional
        Legend entry of the reference line (default ``"reference <value>"``).

    Returns
    -------
    matplotlib.figure.Figure
        Per panel one errorbar container per hue level.

    References
    ----------
    - [RR07] A. Rahimi and B. Recht, "Random features for large-scale kernel machines", NeurIPS
      (2007).

    Examples
    --------
    >>> import matplotlib
    >>> matplotlib.use("Agg")
    >>> import pandas as pd
    >>> from kernelapprox.plotting import plot_forest
    >>> df = pd.DataFrame({"label": ["trig", "trig", "positive", "positive"],
    ...                    "d": [16, 64, 16, 64], "slope": [-0.50, -0.49, -0.51, -0.30],
    ...                    "slope_lo": [-0.52, -0.51, -0.55, -0.45],
    ...                    "slope_hi": [-0.48, -0.47, -0.47, -0.15]})
    >>> fig = plot_forest(df, hue="d", reference=-0.5)
    >>> len(fig.axes[0].containers)  # one per d
    2
    """
    where = "plot_forest"
    _check_frame(df, [x, y, hue, col, *(ci or ())], where)
    from matplotlib.lines import Line2D

    keys = [c for c in (col, y, hue) if c is not None]
    dup = df.duplicated(subset=keys)
    if dup.any():
        first = df.loc[dup, keys].iloc[0].to_dict()
        raise ValueError(f"{where}: several rows for {first}: filter df or facet by the column "
                         "that differs (hue=, col=)")
    data = df[np.isfinite(df[x].to_numpy(dtype=float))]
    if len(data) == 0:
        raise ValueError(f"{where}: nothing to draw: no row of df has a finite {x!r}")
    rows = list(dict.fromkeys(data[y])) if order is None else [v for v in order
                                                                if v in set(data[y])]
    if not rows:
        raise ValueError(f"{where}: nothing to draw: no {y!r} of order={list(order or [])} in df")
    data = data[data[y].isin(rows)]
    hues = _levels(data, hue, hue_order)
    data = data if hue is None else data[data[hue].isin(hues)]
    pal = _palette(hues, palette)
    pos = {v: i for i, v in enumerate(rows)}
    offs = np.linspace(-0.25, 0.25, len(hues)) if len(hues) > 1 else np.zeros(1)
    if ax is None:
        plt = _require("matplotlib.pyplot")
        cols = _levels(data, col, col_order)
        if not cols:
            raise ValueError(f"{where}: nothing to draw: no {col!r} of col_order="
                             f"{list(col_order or [])} in df")
        fig, axes = plt.subplots(1, len(cols), squeeze=False, sharey=True, layout="constrained",
                                 figsize=(3.4 * len(cols) + 1.5, 0.32 * len(rows) + 1.6))
        cells = []
        for j, cv in enumerate(cols):
            g = data if col is None else data[data[col] == cv]
            if len(g) == 0:
                axes[0][j].set_visible(False)
                continue
            cells.append((None, cv, axes[0][j], g))
    else:
        fig, cells = _grid(data, None, col, None, col_order, ax, (3.4, 3.0), where, sharey=True)
    for _, cv, a, g in cells:
        for o, h in zip(offs, hues, strict=True):
            gh = g if hue is None else g[g[hue] == h]
            if len(gh) == 0:
                continue
            yy = np.array([pos[v] for v in gh[y]], dtype=float) + o
            xv = gh[x].to_numpy(dtype=float)
            err = None
            if ci is not None:
                lo, hi = gh[ci[0]].to_numpy(dtype=float), gh[ci[1]].to_numpy(dtype=float)
                err = np.nan_to_num(np.vstack([np.clip(xv - lo, 0, None),
                                               np.clip(hi - xv, 0, None)]))
            a.errorbar(xv, yy, xerr=err, fmt="o", ms=3, lw=1, color=pal[h],
                       label=str(h) if hue is not None else x)
        if reference is not None:
            a.axvline(reference, color="k", ls="--", lw=1)
        a.set_yticks(np.arange(len(rows)), [str(v) for v in rows])
        a.set_ylim(len(rows) - 0.5, -0.5)  # the first row on top
        a.set_xlabel(xlabel if xlabel is not None else x)
        a.set_title(_title(None, None, col, cv) if facet_title is None else facet_title(None, cv))
    handles: list[Any] = []
    if hue is not None:
        handles = [Line2D([], [], color=pal[h], marker="o", ls="", label=f"{hue} = {h}")
                   for h in hues]
    if reference is not None:
        handles.append(Line2D([], [], color="k", ls="--", lw=1,
                              label=reference_label if reference_label is not None
                              else f"reference {reference:g}"))
    if title is not None:
        fig.suptitle(title)
    _legend(fig, cells, handles, below=title is not None)
    return fig


def ratio_table(df: pd.DataFrame, *, baseline: Any, by: str = "estimator", values: str = "mean",
                index: str | Sequence[str] | None = None, metric: str | None = None,
                order: Sequence[Any] | None = None) -> pd.DataFrame:
    r"""Each method's value over the baseline's, $v_m / v_{\text{baseline}}$, per row of
    ``index``.

    A ratio below 1 (for an error) is a method better than the baseline at that point. The
    ratio is of point estimates: whether it differs from 1 beyond the noise is a paired test
    (``studies.verdicts.beats_baseline``).

    Parameters
    ----------
    df : pandas.DataFrame
        Tidy results with one row per (index..., by).
    baseline : object
        The level of ``by`` to divide by (e.g. ``"uniform"``).
    by : str
        Column of the methods (the table's columns).
    values : str
        Column of the values.
    index : str or sequence of str, optional
        Columns of the table's rows (e.g. ``["regime", "sigma"]``); default: one row.
    metric : str, optional
        Keep the rows with ``df["metric"] == metric`` (required when several).
    order : sequence, optional
        Order of the columns (methods absent from df are skipped).

    Returns
    -------
    pandas.DataFrame
        Rows: ``index`` levels (where the baseline has a value); columns: the methods, the
        baseline included (all 1).

    Examples
    --------
    >>> import pandas as pd
    >>> from kernelapprox.plotting import ratio_table, to_markdown
    >>> df = pd.DataFrame({"estimator": ["uniform", "favor+", "uniform", "favor+"],
    ...                    "sigma": [0.5, 0.5, 2.0, 2.0], "mean": [0.2, 0.1, 0.4, 0.5]})
    >>> t = ratio_table(df, baseline="uniform", index="sigma", order=["favor+", "uniform"])
    >>> print(to_markdown(t))
    | sigma | favor+ | uniform |
    |---|---|---|
    | 0.5 | 0.5 | 1 |
    | 2 | 1.25 | 1 |
    """
    where = "ratio_table"
    idx = [] if index is None else ([index] if isinstance(index, str) else list(index))
    _check_frame(df, [by, values, *idx], where)
    data = _select_metric(df, metric, where)
    if baseline not in set(data[by]):
        raise ValueError(f"{where}: baseline {baseline!r} not in column {by!r}; its values are "
                         f"{list(dict.fromkeys(data[by]))}")
    keys = [*idx, by]
    dup = data.duplicated(subset=keys)
    if dup.any():
        first = data.loc[dup, keys].iloc[0].to_dict()
        raise ValueError(f"{where}: several rows for {first}: filter df or add the column that "
                         "differs to index")
    if idx:
        wide = data.pivot(index=idx, columns=by, values=values)
    else:
        wide = data.set_index(by)[[values]].T.reset_index(drop=True)
    wide = wide.astype(float)
    base = wide[baseline]
    out = wide.div(base, axis=0)[base.notna()]
    cols = _levels(data, by, order) if order is not None else list(dict.fromkeys(data[by]))
    out = out[[c for c in cols if c in out.columns]]
    out.columns.name = None
    return out


def _fmt(v: Any, digits: int) -> str:
    if v is None:
        return "–"
    if isinstance(v, bool | np.bool_):
        return str(bool(v))
    if isinstance(v, int | np.integer):
        return str(int(v))
    if isinstance(v, float | np.floating):
        f = float(v)
        if not math.isfinite(f):
            return "–" if math.isnan(f) else ("∞" if f > 0 else "-∞")
        if f.is_integer() and abs(f) < 1e7:
            return str(int(f))
        return f"{f:.{digits}g}"
    return str(v)


def to_markdown(table: pd.DataFrame, digits: int = 3, index: bool = True) -> str:
    """A GitHub pipe table of ``table`` (numbers to ``digits`` significant digits, NaN as –).

    Parameters
    ----------
    table : pandas.DataFrame
    digits : int
        Significant digits.
    index : bool
        Write the index as the first column(s).

    Returns
    -------
    str

    Examples
    --------
    >>> import pandas as pd
    >>> from kernelapprox.plotting import to_markdown
    >>> print(to_markdown(pd.DataFrame({"a": [1.23456, float("nan")]}), index=False))
    | a |
    |---|
    | 1.23 |
    | – |
    """
    pd = _require("pandas")
    if not isinstance(table, pd.DataFrame):
        raise TypeError(f"to_markdown: table must be a pandas DataFrame, got {type(table).__name__}")
    d = table.reset_index() if index and not isinstance(table.index, pd.RangeIndex) else table
    cols = [str(c) for c in d.columns]
    lines = ["| " + " | ".join(cols) + " |", "|" + "|".join("---" for _ in cols) + "|"]
    for rec in d.itertuples(index=False):
        lines.append("| " + " | ".join(_fmt(v, digits).replace("|", "\\|") for v in rec) + " |")
    return "\n".join(lines)


@contextlib.contextmanager
def style() -> Iterator[None]:
    """Context manager applying the shipped style file (`STYLE_PATH`).

    Examples
    --------
    >>> import matplotlib
    >>> from kernelapprox import plotting
    >>> with plotting.style():
    ...     matplotlib.rcParams["svg.hashsalt"]
    'kernelapprox'
    """
    mstyle = _require("matplotlib.style")
    with mstyle.context(str(STYLE_PATH)):
        yield


def save_figure(fig: Figure, path: str | Path, *, dpi: int = 150, close: bool = False) -> Path:
    """Save ``fig`` so that the same figure gives the same bytes: no date, fixed SVG ids.

    The format comes from the suffix (``.png``, ``.svg``, ``.pdf``, ...). SVG is written with
    ``metadata={"Date": None}`` and ``svg.hashsalt`` fixed (the ids of clip paths and glyphs
    are hashes of the content and the salt, not random), PDF with
    ``metadata={"CreationDate": None}``; PNG from the Agg renderer carries no date.
    Parent folders are created.

    Parameters
    ----------
    fig : matplotlib.figure.Figure
    path : str or pathlib.Path
        Output file; its suffix names the format.
    dpi : int
        Resolution of raster formats.
    close : bool
        Close the figure after saving.

    Returns
    -------
    pathlib.Path

    Examples
    --------
    >>> import matplotlib
    >>> matplotlib.use("Agg")
    >>> import matplotlib.pyplot as plt, tempfile, pathlib
    >>> from kernelapprox.plotting import save_figure
    >>> fig, ax = plt.subplots()
    >>> _ = ax.plot([1, 2, 3])
    >>> out = pathlib.Path(tempfile.mkdtemp()) / "f.svg"
    >>> a = save_figure(fig, out).read_bytes()
    >>> a == save_figure(fig, out).read_bytes()
    True
    """
    mpl = _require("matplotlib")
    p = Path(path)
    fmt = p.suffix.lstrip(".").lower()
    if not fmt:
        raise ValueError(f"save_figure: path needs a suffix naming the format (.png, .svg, "
                         f".pdf), got {str(path)!r}")
    metadata: dict[str, Any] | None = {"svg": {"Date": None},
                                       "pdf": {"CreationDate": None}}.get(fmt)
    p.parent.mkdir(parents=True, exist_ok=True)
    with mpl.rc_context({"svg.hashsalt": _SVG_SALT}):
        fig.savefig(p, dpi=dpi, bbox_inches="tight", metadata=metadata)
    if close:
        _require("matplotlib.pyplot").close(fig)
    return p
