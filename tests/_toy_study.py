"""A toy study for tests/test_studies_executor.py: five cells with deterministic float rows.

It lives in its own module so that worker processes (``--jobs``, Dask) can import it by module
path, as they import the studies in ``studies/``.  Two environment variables steer it, read in
the worker (spawned workers inherit the environment; Dask workers of a LocalCluster too):

- ``TOY_LOG``: a file to which every computed cell appends its ``i`` (which cells computed);
- ``TOY_EXIT_AT=i`` kills the process (``os._exit(3)``) in cell ``i``, as a killed run would be.

With ``--seed 13`` (:data:`FAIL_SEED`) cell ``i = 2`` raises ``ArithmeticError``: the failure
travels with the cell's context, so it happens on whichever worker computes the cell.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import torch

from studies._engine import Context, Study

N_CELLS = 5
FAIL_SEED = 13


def grid(quick: bool) -> list[dict]:
    return [{"i": i, "name": f"c{i}", "sizes": [i, i + 1]} for i in range(N_CELLS)]


def run_cell(cell: dict, ctx: Context) -> list[dict]:
    i = int(cell["i"])
    if os.environ.get("TOY_EXIT_AT") == str(i):
        os._exit(3)
    if ctx.seed == FAIL_SEED and i == 2:
        raise ArithmeticError(f"toy failure in cell {i}")
    # later cells are quicker: parallel workers complete them out of grid order
    time.sleep(0.1 * (N_CELLS - i))
    log = os.environ.get("TOY_LOG")
    if log:
        with open(log, "a") as f:
            f.write(f"{i}\n")
    # draws whose float64 digits are all significant: any change of seed, order or rounding shows.
    # Rows built by hand (no kernelapprox import: the workers start faster)
    x = torch.randn(257, generator=ctx.generator("toy", i), dtype=torch.float64) / 3.0
    m, s = float(x.mean()), float(x.std() / 257**0.5)
    top = float(x.max())
    return [
        {"metric": "mean_x", "mean": m, "ci_low": m - 1.96 * s, "ci_high": m + 1.96 * s, "n_draws": 257},
        {"metric": "max_x", "mean": top, "ci_low": top, "ci_high": top, "n_draws": 1, "extra": float(x.sum() / 7)},
    ]


def plot(df, folder: Path) -> list[Path]:
    return []


def plot_figure(df, folder: Path) -> list[Path]:
    """One figure of the rows (the harness's byte-stable save)."""
    import matplotlib

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    from studies._engine import save_figure

    fig, ax = plt.subplots(figsize=(3, 2))
    m = df[df["metric"] == "mean_x"]
    ax.errorbar(m["i"], m["mean"], yerr=[m["mean"] - m["ci_low"], m["ci_high"] - m["mean"]], fmt="o")
    ax.set_title("toy")
    return save_figure(fig, folder, "toy")


def summarize(df, ctx: Context) -> str:
    return f"## Key results\n\n{len(df)} rows.\n\n## Finding\n\n- {len(df)} rows.\n"


STUDY = Study(
    name="toy-executor",
    description="toy study of the executor tests",
    grid=grid,
    run_cell=run_cell,
    plot=plot,
    summarize=summarize,
    dtypes={"search": "float32", "evaluation": "float64"},
)
#: The same cells, with a figure.
FIGURE_STUDY = Study(name="toy-figure", description="toy study with a figure", grid=grid, run_cell=run_cell,
                     plot=plot_figure, summarize=summarize)
