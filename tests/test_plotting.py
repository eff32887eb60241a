"""kernelapprox.plotting on small synthetic tidy frames (the schema the studies write)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

pd = pytest.importorskip("pandas")
matplotlib = pytest.importorskip("matplotlib")
matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.collections import PolyCollection  # noqa: E402

from kernelapprox import plotting  # noqa: E402

R = np.array([8, 16, 64, 256])
ESTIMATORS = {"trig": 1.0, "positive": 3.0, "relu": None}  # relu: no closed form


def tidy(dims=(16, 64), regimes=("sphere", "attention"), metrics=("rel_mse",)) -> pd.DataFrame:
    """Rows like reports/error-vs-r/results.csv: estimator, d, regime, r, metric, mean, CI, theory."""
    rows = []
    for m in metrics:
        for reg in regimes:
            for d in dims:
                for e, v in ESTIMATORS.items():
                    for r in R:
                        mean = (v or 0.5) * d / (16 * r)
                        rows.append({"estimator": e, "d": d, "regime": reg, "r": r, "metric": m,
                                     "mean": mean, "ci_low": 0.8 * mean, "ci_high": 1.25 * mean,
                                     "theory": np.nan if v is None else v * d / (16 * r)})
    return pd.DataFrame(rows)


def solid_lines(ax) -> list:
    return [ln for ln in ax.get_lines() if ln.get_linestyle() == "-"]


def dashed_lines(ax) -> list:
    return [ln for ln in ax.get_lines() if ln.get_linestyle() == "--"]


def bands(ax) -> list:
    return [c for c in ax.collections if isinstance(c, PolyCollection)]


@pytest.fixture(autouse=True)
def _close_figures():
    yield
    plt.close("all")


def test_error_vs_r_one_line_band_per_hue_and_dashed_closed_form():
    fig = plotting.plot_error_vs_r(tidy(dims=(16,), regimes=("sphere",)))
    assert isinstance(fig, matplotlib.figure.Figure)
    (ax,) = fig.axes
    assert sorted(ln.get_label() for ln in solid_lines(ax)) == sorted(ESTIMATORS)
    assert len(bands(ax)) == len(ESTIMATORS)
    # the closed form: dashed, one per estimator that has one (relu's theory is NaN)
    dashed = dashed_lines(ax)
    assert len(dashed) == 2
    colours = {ln.get_label(): ln.get_color() for ln in solid_lines(ax)}
    assert {tuple(matplotlib.colors.to_rgba(ln.get_color())) for ln in dashed} == {
        tuple(matplotlib.colors.to_rgba(colours[e])) for e in ("trig", "positive")}
    # the data drawn are the frame's, in r order
    trig = next(ln for ln in solid_lines(ax) if ln.get_label() == "trig")
    np.testing.assert_allclose(trig.get_xdata(), R)
    np.testing.assert_allclose(trig.get_ydata(), 16 / (16 * R))
    assert ax.get_xscale() == "log" and ax.get_yscale() == "log"
    assert "closed form" in [t.get_text() for t in ax.get_legend().get_texts()]


def test_error_vs_r_no_closed_form_and_no_band():
    fig = plotting.plot_error_vs_r(tidy(dims=(16,), regimes=("sphere",)), ci=None, closed_form=None)
    (ax,) = fig.axes
    assert not dashed_lines(ax) and not bands(ax)
    assert len(solid_lines(ax)) == len(ESTIMATORS)


def test_error_vs_r_transform_applies_to_line_band_and_closed_form():
    df = tidy(dims=(16,), regimes=("sphere",))
    fig = plotting.plot_error_vs_r(df, transform=np.sqrt, hue_order=["trig"])
    (ax,) = fig.axes
    (line,) = solid_lines(ax)
    (cf,) = dashed_lines(ax)
    np.testing.assert_allclose(line.get_ydata(), np.sqrt(1 / R))
    np.testing.assert_allclose(cf.get_ydata(), np.sqrt(1 / R))
    (band,) = bands(ax)
    ys = band.get_paths()[0].vertices[:, 1]
    assert ys.max() == pytest.approx(np.sqrt(1.25 / R[0]))


def test_error_vs_r_facets_and_missing_facets_skipped():
    df = tidy()
    # d = 64 has no attention rows: that panel is skipped (hidden), the others drawn
    df = df[~((df["d"] == 64) & (df["regime"] == "attention"))]
    fig = plotting.plot_error_vs_r(df, row="regime", col="d", row_order=["sphere", "attention"])
    visible = [a for a in fig.axes if a.get_visible()]
    assert len(fig.axes) == 4 and len(visible) == 3
    assert sorted(a.get_title() for a in visible) == [
        "regime = attention, d = 16", "regime = sphere, d = 16", "regime = sphere, d = 64"]
    for a in visible:
        assert len(solid_lines(a)) == len(ESTIMATORS) and len(bands(a)) == len(ESTIMATORS)
    # the panel above the skipped one is the lowest of its column: x label and tick labels
    (above,) = [a for a in visible if a.get_title() == "regime = sphere, d = 64"]
    fig.canvas.draw()
    assert above.get_xlabel() == "r"
    assert any(t.get_text() for t in above.get_xticklabels())
    # a level named in the order but absent from the data is left out, not a crash
    fig = plotting.plot_error_vs_r(df, col="d", row="regime", col_order=[16, 64, 1024])
    assert len(fig.axes) == 4


def test_facet_title_formats_the_panels():
    fig = plotting.plot_error_vs_r(tidy(), row="regime", col="d",
                                   facet_title=lambda reg, d: f"{reg} at d={d}")
    assert sorted(a.get_title() for a in fig.axes)[0] == "attention at d=16"
    # axis labels only on the outer panels
    assert [a.get_xlabel() for a in fig.axes] == ["", "", "r", "r"]
    assert [a.get_ylabel() for a in fig.axes] == ["mean", "", "mean", ""]


def test_error_vs_r_empty_grid_is_a_clear_error():
    df = tidy()
    with pytest.raises(ValueError, match="nothing to draw"):
        plotting.plot_error_vs_r(df, col="d", row="regime", col_order=[1024])
    with pytest.raises(ValueError, match="nothing to draw"):
        plotting.plot_error_vs_r(df.iloc[0:0], metric=None)


def test_error_vs_r_bad_input_errors():
    df = tidy(metrics=("rel_mse", "rel_frob"), dims=(16,), regimes=("sphere",))
    with pytest.raises(ValueError, match="several metrics"):
        plotting.plot_error_vs_r(df)
    with pytest.raises(ValueError, match="metric 'nope' not in df"):
        plotting.plot_error_vs_r(df, metric="nope")
    with pytest.raises(ValueError, match=r"column\(s\) \['num_features'\] not in df"):
        plotting.plot_error_vs_r(df, x="num_features", metric="rel_mse")
    with pytest.raises(ValueError, match="pass ci=None"):
        plotting.plot_error_vs_r(df.drop(columns="ci_low"), metric="rel_mse")
    with pytest.raises(ValueError, match="several rows for one point"):
        plotting.plot_error_vs_r(tidy(dims=(16, 64), regimes=("sphere",)))  # d not faceted
    with pytest.raises(TypeError, match="DataFrame"):
        plotting.plot_error_vs_r({"r": [1]})
    _, ax = plt.subplots()
    with pytest.raises(ValueError, match="ax= draws one panel"):
        plotting.plot_error_vs_r(tidy(dims=(16,)), col="regime", ax=ax)


def test_error_vs_r_into_given_axes():
    fig, ax = plt.subplots()
    out = plotting.plot_error_vs_r(tidy(dims=(16,), regimes=("sphere",)), ax=ax)
    assert out is fig and len(solid_lines(ax)) == len(ESTIMATORS)


def test_error_vs_r_style_by_gives_markers():
    df = tidy(dims=(16,), regimes=("sphere", "attention"))
    fig = plotting.plot_error_vs_r(df, style_by="regime", closed_form=None)
    (ax,) = fig.axes
    lines = solid_lines(ax)
    assert len(lines) == 2 * len(ESTIMATORS)
    assert {ln.get_marker() for ln in lines} == {"o", "s"}
    fig = plotting.plot_error_vs_r(df, style_by="regime", closed_form=None,
                                   style_order=["sphere", "attention"])
    texts = legend_texts(fig)
    assert texts.index("sphere") < texts.index("attention")
    marker = {ln.get_label().split(", ")[1]: ln.get_marker() for ln in solid_lines(fig.axes[0])}
    assert marker == {"sphere": "o", "attention": "s"}
    fig = plotting.plot_error_vs_r(df, style_by="regime", closed_form=None,
                                   style_order=["sphere"])
    assert len(solid_lines(fig.axes[0])) == len(ESTIMATORS)


def legend_texts(fig) -> list[str]:
    legends = [lg for a in fig.axes if (lg := a.get_legend()) is not None] + fig.legends
    return [t.get_text() for lg in legends for t in lg.get_texts()]


def test_error_vs_r_reference_line_in_every_panel_with_its_label():
    df = tidy(dims=(16, 64), regimes=("sphere",))
    fig = plotting.plot_error_vs_r(df, col="d", reference=0.01, reference_label="target 0.01",
                                   closed_form_label="delta method")
    for ax in fig.axes:
        refs = [ln for ln in ax.get_lines() if ln.get_linestyle() == "-."]
        assert len(refs) == 1
        assert np.allclose(refs[0].get_ydata(), 0.01)
        assert len(solid_lines(ax)) == len(ESTIMATORS)  # the reference is not an estimator line
    texts = legend_texts(fig)
    assert "target 0.01" in texts and "delta method" in texts and "closed form" not in texts
    fig = plotting.plot_error_vs_r(df[df["d"] == 16], reference=1.0, yscale="linear")
    assert "reference 1" in legend_texts(fig)


def test_error_vs_r_reference_bad_values():
    df = tidy(dims=(16,), regimes=("sphere",))
    with pytest.raises(ValueError, match="log y axis"):
        plotting.plot_error_vs_r(df, reference=0.0)
    with pytest.raises(TypeError, match="reference must be a finite number"):
        plotting.plot_error_vs_r(df, reference="1")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="reference must be a finite number"):
        plotting.plot_error_vs_r(df, reference=float("nan"))


def test_error_vs_r_hollow_marks_only_the_flagged_points():
    df = tidy(dims=(16,), regimes=("sphere",))
    flagged = (df["estimator"] == "trig") & (df["r"] >= 64)
    df["unconverged"] = np.where(flagged, "True", "False")  # as read back from a CSV
    fig = plotting.plot_error_vs_r(df, hollow="unconverged", hollow_label="unconverged MC")
    (ax,) = fig.axes
    hollow = [ln for ln in ax.get_lines() if ln.get_linestyle() == "None"]
    assert len(hollow) == 1
    assert np.array_equal(hollow[0].get_xdata(), R[R >= 64])
    assert hollow[0].get_markerfacecolor() in ("white", "w", (1.0, 1.0, 1.0, 1.0))
    assert "unconverged MC" in legend_texts(fig)
    df["unconverged"] = False
    fig = plotting.plot_error_vs_r(df, hollow="unconverged", hollow_label="unconverged MC")
    assert not [ln for ln in fig.axes[0].get_lines() if ln.get_linestyle() == "None"]
    assert "unconverged MC" not in legend_texts(fig)
    with pytest.raises(ValueError, match=r"\['nope'\] not in df"):
        plotting.plot_error_vs_r(df, hollow="nope")


def test_error_vs_r_panel_size_sets_the_figure_size():
    df = tidy(dims=(16, 64), regimes=("sphere",))
    small = plotting.plot_error_vs_r(df, col="d").get_size_inches()
    big = plotting.plot_error_vs_r(df, col="d", panel_size=(5.0, 4.0)).get_size_inches()
    assert np.allclose(big - small, [2 * (5.0 - 3.6), 4.0 - 2.9])
    with pytest.raises(ValueError, match="panel_size must be"):
        plotting.plot_error_vs_r(df, col="d", panel_size=(5.0, 0.0))


def rstar_frame(laws=("d", "dlogd")) -> pd.DataFrame:
    d = np.array([4, 8, 16, 32, 64, 128, 256], dtype=float)
    rows = []
    for eps, c, law in ((0.1, 40.0, laws[0]), (0.3, 5.0, laws[1])):
        shape = d if law == "d" else d * np.log(d)
        rows.append(pd.DataFrame({"eps": eps, "R": 1.0, "d": d, "r_star": c * shape,
                                  "r_star_lo": 0.9 * c * shape, "r_star_hi": 1.1 * c * shape,
                                  "se_log": 0.05, "censored": ""}))
    return pd.concat(rows, ignore_index=True)


def test_required_features_recovers_the_laws_and_draws_them():
    fig = plotting.plot_required_features(rstar_frame(), hue="eps", se="se_log",
                                          laws=("c·d", "c·d·log d", "c·d^p"))
    fits = fig.kernelapprox_fits.set_index(["hue", "law"])
    # noise-free data: the true law fits exactly (RSS 0), the wrong one does not
    assert fits.loc[(0.1, "c·d"), "c"] == pytest.approx(40.0)
    assert fits.loc[(0.1, "c·d"), "rss"] == pytest.approx(0.0, abs=1e-20)
    assert fits.loc[(0.1, "c·d·log d"), "rss"] > 1.0
    assert fits.loc[(0.3, "c·d·log d"), "c"] == pytest.approx(5.0)
    assert fits.loc[(0.1, "c·d^p"), "p"] == pytest.approx(1.0)
    (ax,) = fig.axes
    # per hue: one errorbar line of points + one curve per law
    assert len([ln for ln in ax.get_lines() if ln.get_label().startswith("_fit")]) == 2 * 3
    assert {ln.get_linestyle() for ln in ax.get_lines() if ln.get_label().startswith("_fit")} == {
        "--", ":", "-."}
    assert len(ax.containers) == 2  # one errorbar container per hue


def test_required_features_per_x_and_custom_law():
    df = rstar_frame(laws=("d", "d"))
    fig = plotting.plot_required_features(df, hue="eps", per_x=True, ci=None,
                                          laws={"c·d·log(1e5·d)": lambda d: d * np.log(1e5 * d)})
    (ax,) = fig.axes
    pts = [ln for ln in ax.get_lines() if ln.get_label() == "0.1"]
    np.testing.assert_allclose(pts[0].get_ydata(), 40.0)  # r*/d of a linear law is flat
    assert set(fig.kernelapprox_fits["law"]) == {"c·d·log(1e5·d)"}


def test_required_features_censored_points_not_fitted_and_missing_facets():
    df = rstar_frame()
    df.loc[(df["eps"] == 0.1) & (df["d"] == 256), ["r_star", "censored"]] = [1e9, "above grid"]
    df.loc[df["eps"] == 0.3, "R"] = 0.5
    fig = plotting.plot_required_features(df, hue="eps", censored="censored", col="R",
                                          row="eps")
    assert len([a for a in fig.axes if a.get_visible()]) == 2  # (eps, R) pairs with data
    fits = fig.kernelapprox_fits.set_index(["hue", "law"])
    assert fits.loc[(0.1, "c·d"), "c"] == pytest.approx(40.0)  # the censored 1e9 left out
    assert fits.loc[(0.1, "c·d"), "n"] == 6
    # a cell whose r* are all NaN (censored without a bound) is skipped, all NaN: an error
    df2 = rstar_frame()
    df2.loc[df2["eps"] == 0.3, "r_star"] = np.nan
    fig = plotting.plot_required_features(df2, hue="eps", row="eps")
    assert len(fig.axes) == 1
    df2["r_star"] = np.nan
    with pytest.raises(ValueError, match="nothing to draw"):
        plotting.plot_required_features(df2, hue="eps")
    with pytest.raises(ValueError, match="unknown law"):
        plotting.plot_required_features(rstar_frame(), hue="eps", laws=("c·d²",))


def test_fit_laws_weights_and_aicc():
    d = np.array([4.0, 8, 16, 32, 64, 128])
    r = 3 * d * np.exp(np.array([0.1, -0.1, 0.1, -0.1, 0.1, -0.1]))
    tab = plotting.fit_laws(d, r, ["c·d", "c·d^p"]).set_index("law")
    assert tab.loc["c·d", "c"] == pytest.approx(3.0)  # the log residuals average to 0
    assert np.isfinite(tab["aicc"]).all()
    # a weight on one point pulls the constant to it
    se = np.array([1e-3, 1, 1, 1, 1, 1])
    tab_w = plotting.fit_laws(d, r, ["c·d"], se=se).set_index("law")
    assert tab_w.loc["c·d", "c"] == pytest.approx(3 * np.exp(0.1), rel=1e-4)
    with pytest.raises(ValueError, match="same length|shapes"):
        plotting.fit_laws(d, r[:3])


def slope_frame() -> pd.DataFrame:
    rows = []
    for reg in ("sphere", "attention"):
        for d in (16, 64, 256):
            for lab, s0 in (("trig", -0.5), ("positive", -0.45), ("relu", 0.0)):
                rows.append({"label": lab, "regime": reg, "d": d, "slope": s0 + 0.001 * d,
                             "slope_lo": s0 - 0.05, "slope_hi": s0 + 0.05 + 0.002 * d})
    return pd.DataFrame(rows)


def test_forest_one_container_per_hue_rows_in_order_and_reference():
    fig = plotting.plot_forest(slope_frame(), hue="d", col="regime", reference=-0.5,
                               col_order=["sphere", "attention", "missing"])
    assert [a.get_title() for a in fig.axes] == ["regime = sphere", "regime = attention"]
    # the rows are shared: labelled on the first panel
    assert [t.get_text() for t in fig.axes[0].get_yticklabels()] == ["trig", "positive", "relu"]
    for a in fig.axes:
        assert len(a.containers) == 3  # d = 16, 64, 256
        assert list(a.get_yticks()) == [0, 1, 2]
        ref = [ln for ln in a.get_lines() if ln.get_linestyle() == "--"]
        assert len(ref) == 1 and list(ref[0].get_xdata()) == [-0.5, -0.5]
        # the hues are dodged within a row, and the points are the frame's
        ys = sorted(float(c.lines[0].get_ydata()[0]) for c in a.containers)
        assert ys == pytest.approx([-0.25, 0.0, 0.25])
        xs = a.containers[0].lines[0].get_xdata()
        np.testing.assert_allclose(xs, np.array([-0.5, -0.45, 0.0]) + 0.016)
    fig = plotting.plot_forest(slope_frame(), hue="d", col="regime", order=["relu", "trig"])
    assert [t.get_text() for t in fig.axes[0].get_yticklabels()] == ["relu", "trig"]
    with pytest.raises(ValueError, match="several rows"):
        plotting.plot_forest(slope_frame(), hue="d")
    with pytest.raises(ValueError, match="nothing to draw"):
        plotting.plot_forest(slope_frame(), hue="d", col="regime", col_order=["missing"])


def test_forest_reference_label():
    one = slope_frame().query("regime == 'sphere'")
    fig = plotting.plot_forest(one, hue="d", reference=-0.5, reference_label="Monte Carlo rate")
    assert "Monte Carlo rate" in legend_texts(fig) and "reference -0.5" not in legend_texts(fig)
    fig = plotting.plot_forest(one, hue="d", reference=-0.5)
    assert "reference -0.5" in legend_texts(fig)


def test_ratio_table_and_markdown():
    df = pd.DataFrame({"estimator": ["uniform", "a", "b"] * 2, "sigma": [0.5] * 3 + [2.0] * 3,
                       "metric": "err", "mean": [0.2, 0.1, 0.4, 0.5, 0.5, 0.25]})
    t = plotting.ratio_table(df, baseline="uniform", index="sigma", metric="err")
    assert list(t.columns) == ["uniform", "a", "b"]
    np.testing.assert_allclose(t.to_numpy(), [[1, 0.5, 2], [1, 1, 0.5]])
    md = plotting.to_markdown(t)
    assert md.splitlines()[0] == "| sigma | uniform | a | b |"
    assert md.splitlines()[2] == "| 0.5 | 1 | 0.5 | 2 |"
    with pytest.raises(ValueError, match="baseline 'nope'"):
        plotting.ratio_table(df, baseline="nope", index="sigma")
    with pytest.raises(ValueError, match="several rows"):
        plotting.ratio_table(df, baseline="uniform")


def test_style_file_is_applied_and_restored():
    assert plotting.STYLE_PATH.is_file()
    before = matplotlib.rcParams["axes.spines.top"]
    with plotting.style():
        assert matplotlib.rcParams["axes.spines.top"] is False
        assert matplotlib.rcParams["svg.hashsalt"] == "kernelapprox"
    assert matplotlib.rcParams["axes.spines.top"] == before


def _figure():
    return plotting.plot_error_vs_r(tidy(dims=(16, 64), regimes=("sphere",)), col="d")


@pytest.mark.parametrize("ext", ["svg", "png", "pdf"])
def test_save_figure_is_byte_stable(tmp_path: Path, ext: str):
    fig = _figure()
    a = plotting.save_figure(fig, tmp_path / f"a.{ext}").read_bytes()
    b = plotting.save_figure(fig, tmp_path / "sub" / f"b.{ext}").read_bytes()
    assert len(a) > 1000 and a == b
    if ext == "svg":
        assert b"<dc:date>" not in a
        # the check can fail: matplotlib's own defaults (random salt, a date) differ run to run
        with matplotlib.rc_context({"svg.hashsalt": None}):
            fig.savefig(tmp_path / "c.svg")
            fig.savefig(tmp_path / "d.svg")
        assert (tmp_path / "c.svg").read_bytes() != (tmp_path / "d.svg").read_bytes()


# the module loaded from its file (it imports nothing from the package), so that a fresh
# interpreter does not pay for importing torch
_LOAD = ("import importlib.util, sys;"
         "spec = importlib.util.spec_from_file_location('kaplot', sys.argv[1]);"
         "plotting = importlib.util.module_from_spec(spec); spec.loader.exec_module(plotting);")


def test_save_figure_same_bytes_in_a_fresh_process(tmp_path: Path):
    code = _LOAD + (
        "import matplotlib; matplotlib.use('Agg'); import pandas as pd;"
        "df = pd.DataFrame({'estimator': ['a'] * 3 + ['b'] * 3, 'r': [8, 64, 512] * 2,"
        " 'mean': [1.0, 0.3, 0.1, 2.0, 0.6, 0.2], 'theory': [1.0, 0.35, 0.12, 2.0, 0.7, 0.25]});"
        "plotting.save_figure(plotting.plot_error_vs_r(df, ci=None), sys.argv[2])"
    )
    src = Path(plotting.__file__)
    for name in ("p.svg", "q.svg"):
        subprocess.run([sys.executable, "-c", code, str(src), str(tmp_path / name)], check=True)
    p, q = (tmp_path / "p.svg").read_bytes(), (tmp_path / "q.svg").read_bytes()
    assert len(p) > 1000 and p == q


def test_save_figure_needs_a_suffix(tmp_path: Path):
    with pytest.raises(ValueError, match="suffix"):
        plotting.save_figure(_figure(), tmp_path / "noext")


def test_missing_matplotlib_names_the_extra(monkeypatch):
    import importlib

    real = importlib.import_module

    def fake(name, *args, **kwargs):
        if name.startswith("matplotlib"):
            raise ImportError("No module named 'matplotlib'")
        return real(name, *args, **kwargs)

    monkeypatch.setattr(importlib, "import_module", fake)
    with pytest.raises(ImportError, match=r"needs matplotlib.*pip install 'kernelapprox\[studies\]'"):
        plotting.style().__enter__()


def test_import_does_not_import_matplotlib():
    code = _LOAD + "print('matplotlib' in sys.modules, 'pandas' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code, plotting.__file__], check=True,
                         capture_output=True, text=True)
    assert out.stdout.strip() == "False False"
