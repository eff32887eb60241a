"""The studies engine: a study is a grid of cells, computed (and cached) by the runner, drawn and
summarised from its tidy results.

A *study* is a grid of cells (plain JSON-serialisable dicts of parameters). For each cell the
runner calls ``study.run_cell(cell, ctx)`` which returns tidy rows (dicts with at least
``metric, mean, ci_low, ci_high, n_draws``); the runner adds the cell parameters as columns,
caches the rows per cell under ``<out>/<name>/.cache/`` (so an interrupted run resumes), writes
``results.csv``, then calls ``study.plot(df, folder)`` (figures are drawn *from the frame*, so
``--replot`` needs no recomputation) and ``study.summarize(df, ctx)`` (markdown with a key table
and a finding generated from the numbers). The runner wraps the summary with a "What was run"
section and a "Provenance" section, moves the report's files into ``<out>/<name>/`` together,
and rewrites the index ``<out>/README.md``; a run that reproduces the report already there byte
for byte (provenance aside) leaves the folder and the index untouched. Every completed run's own
provenance is in ``<out>/<name>/.cache/last-run.json`` (:func:`last_run`).

Modules:

- :mod:`~studies._engine.model`: :class:`Study`, :class:`Context`, tidy rows, the registry of
  studies, the estimator axis of a grid;
- :mod:`~studies._engine.cache`: cell keys, checked cache records;
- :mod:`~studies._engine.executors`: where cells are computed (this process, ``--jobs``, Dask);
- :mod:`~studies._engine.runner`: :func:`run_study`, :func:`last_run`;
- :mod:`~studies._engine.provenance`: code hash, git commit, the command that reproduces a run;
- :mod:`~studies._engine.report`: tables, summary, index, publishing a report folder;
- :mod:`~studies._engine.figures`: the figure style, byte-stable files;
- :mod:`~studies._engine.helpers`: points on spheres and balls, log-log slopes, `one_thread`;
- :mod:`~studies._engine.cli`: ``python -m studies``.
"""

from studies._engine.cache import CacheWarning
from studies._engine.cli import main
from studies._engine.executors import CellError
from studies._engine.figures import save_figure, set_style
from studies._engine.helpers import ball_points, loglog_slope, one_thread, sphere_points
from studies._engine.model import ROW_KEYS, Context, Study, get_study, load_studies, row
from studies._engine.provenance import REPO_ROOT, code_hash
from studies._engine.report import ReportFolderError, df_to_markdown, fmt, write_index
from studies._engine.runner import StudyInterrupted, last_run, run_study

__all__ = [
    "REPO_ROOT",
    "ROW_KEYS",
    "CacheWarning",
    "CellError",
    "Context",
    "ReportFolderError",
    "Study",
    "StudyInterrupted",
    "ball_points",
    "code_hash",
    "df_to_markdown",
    "fmt",
    "one_thread",
    "get_study",
    "last_run",
    "load_studies",
    "loglog_slope",
    "main",
    "row",
    "run_study",
    "save_figure",
    "set_style",
    "sphere_points",
    "write_index",
]
