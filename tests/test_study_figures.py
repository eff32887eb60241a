"""The studies' box plots draw with Matplotlib's own ``boxplot``: no deprecation warning.

seaborn 0.13's ``boxplot`` passes ``vert=`` to Matplotlib, deprecated in 3.11 and removed in
3.13 (the figure would then fail); `studies.real_attention._boxes` draws the same boxes (one per
level of ``x``, dodged per level of ``hue``) without it. Checked with warnings as errors.
"""

from __future__ import annotations

import warnings

import pytest

pd = pytest.importorskip("pandas")
matplotlib = pytest.importorskip("matplotlib")
matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from studies.real_attention import _boxes  # noqa: E402


def test_boxes_draw_without_deprecation_warnings():
    df = pd.DataFrame({"layer": [0, 0, 1, 1, 0, 1, 2], "mean": [1.0, 2, 3, 4, 5, 6, 7],
                       "metric": ["a", "b", "a", "b", "a", "a", "a"]})
    fig, axes = plt.subplots(1, 2)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _boxes(axes[0], df, "layer", "mean", hue="metric")
        _boxes(axes[1], df, "layer", "mean", color="C2")
        fig.canvas.draw()
    assert len(axes[0].patches) == 3 * 2 and len(axes[1].patches) == 3  # levels x hues boxes
    assert [t.get_text() for t in axes[0].get_xticklabels()] == ["0", "1", "2"]
    assert [t.get_text() for t in axes[0].get_legend().get_texts()] == ["a", "b"]
    plt.close(fig)
