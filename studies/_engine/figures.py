"""Figures: one style for every study, and byte-stable files.

:func:`save_figure` writes the same bytes for the same figure on every run: no date in the SVG
or PDF metadata, and a fixed ``svg.hashsalt`` so that the ids matplotlib gives clip paths and
glyphs are the same in every file (the PNG carries no date).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

#: rcParams applied around every save (and set by :func:`set_style`): fixed SVG ids.
STABLE_RC: dict[str, Any] = {"svg.hashsalt": "kernelapprox-studies"}
#: ``metadata`` of ``savefig`` per format: no creation date.
STABLE_METADATA = {"svg": {"Date": None}, "pdf": {"CreationDate": None, "ModDate": None}, "png": {}}


def save_figure(fig: Any, outdir: Path | str, stem: str) -> list[Path]:
    """Save ``fig`` as ``<outdir>/<stem>.png`` (dpi 150) and ``.svg``, close it, return the paths.

    The files are byte-stable: the same figure gives the same bytes on every run (see
    :data:`STABLE_RC`, :data:`STABLE_METADATA`).
    """
    import matplotlib
    import matplotlib.pyplot as plt

    outdir = Path(outdir)
    outdir.mkdir(parents=True, exist_ok=True)
    paths = [outdir / f"{stem}.png", outdir / f"{stem}.svg"]
    with matplotlib.rc_context(STABLE_RC):  # type: ignore[arg-type]
        fig.savefig(paths[0], dpi=150, bbox_inches="tight", metadata=STABLE_METADATA["png"])
        fig.savefig(paths[1], bbox_inches="tight", metadata=STABLE_METADATA["svg"])
    plt.close(fig)
    return paths


def set_style() -> None:
    """Common seaborn/matplotlib style for every study figure (Agg backend, no display)."""
    import matplotlib

    matplotlib.use("Agg", force=True)
    import seaborn as sns

    sns.set_theme(context="notebook", style="whitegrid", font_scale=0.9)
    matplotlib.rcParams.update(STABLE_RC)  # type: ignore[arg-type]
