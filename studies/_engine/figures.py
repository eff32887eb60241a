"""Figures: one style for every study, and byte-stable files.

:func:`save_figure` writes the same bytes for the same figure on every run: no date in the SVG
or PDF metadata, and a fixed ``svg.hashsalt`` so that the ids matplotlib gives clip paths and
glyphs are the same in every file (the PNG carries no date).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

#: rcParams set by :func:`set_style`: the fixed SVG hash salt of `kernelapprox.plotting.save_figure`.
STABLE_RC: dict[str, Any] = {"svg.hashsalt": "kernelapprox"}


def save_figure(fig: Any, outdir: Path | str, stem: str) -> list[Path]:
    """Save ``fig`` as ``<outdir>/<stem>.png`` (dpi 150) and ``.svg``, close it, return the paths.

    The files are byte-stable: the same figure gives the same bytes on every run
    (`kernelapprox.plotting.save_figure`, which the studies share with users' own figures).
    """
    import matplotlib.pyplot as plt

    from kernelapprox.plotting import save_figure as save

    outdir = Path(outdir)
    paths = [save(fig, outdir / f"{stem}.png", dpi=150), save(fig, outdir / f"{stem}.svg")]
    plt.close(fig)
    return paths


def set_style() -> None:
    """Common seaborn/matplotlib style for every study figure (Agg backend, no display)."""
    import matplotlib

    matplotlib.use("Agg", force=True)
    import seaborn as sns

    sns.set_theme(context="notebook", style="whitegrid", font_scale=0.9)
    matplotlib.rcParams.update(STABLE_RC)  # type: ignore[arg-type]
