"""The runner: computes the cells of a study that are not cached (with one of the executors),
merges their rows in grid order into ``results.csv``, draws the figures, writes the summary and
the provenance, and publishes the report folder all at once, unless the folder already holds
that report byte for byte (provenance aside); every completed run's own provenance goes to
``<out>/<study>/.cache/last-run.json`` (:func:`last_run`)."""

from __future__ import annotations

import datetime as _dt
import json
import time
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from kernelapprox._io import write_atomic
from studies._engine import cache as _cache
from studies._engine import executors as _exec
from studies._engine import provenance as _prov
from studies._engine import report as _report
from studies._engine.model import ROW_KEYS, Context, Study, import_user_modules, restrict_estimators

if TYPE_CHECKING:  # pragma: no cover
    import pandas as pd


class StudyInterrupted(KeyboardInterrupt):
    """Ctrl-C during a run: ``cached`` of the ``total`` cells are in the cache (a rerun resumes
    from them); the report folder holds the previous run's report, unchanged."""

    def __init__(self, study: str, cached: int, total: int) -> None:
        super().__init__(f"[{study}] interrupted; {cached} of {total} cells cached; rerun to resume")
        self.study, self.cached, self.total = study, cached, total


class UnreadableReportError(ValueError):
    """``--replot`` of a report whose ``results.csv`` or ``provenance.json`` cannot be read; the
    message names the file."""


class IncompleteReportError(RuntimeError):
    """``--replot`` of a report marked incomplete (a run was killed while replacing its files)."""


def _frame(rows: list[dict], cell_cols: list[str]) -> pd.DataFrame:
    import pandas as pd

    df = pd.DataFrame(rows)
    first = [c for c in cell_cols if c in df.columns and c not in ROW_KEYS]
    ordered = first + [c for c in ROW_KEYS if c in df.columns]
    ordered += [c for c in df.columns if c not in ordered]
    return df[ordered]


def _short(cell: dict) -> str:
    s = ",".join(f"{k}={v}" for k, v in cell.items())
    return s if len(s) < 60 else s[:57] + "..."


def _costs(study: Study, cells: list[dict], quick: bool) -> list[float]:
    """Each cell's expected compute (``study.cell_cost``; 1 each without one), all > 0."""
    if study.cell_cost is None:
        return [1.0] * len(cells)
    costs = [float(study.cell_cost(cell, quick)) for cell in cells]
    if not all(c > 0 and c < float("inf") for c in costs):
        raise ValueError(f"study {study.name!r}: cell_cost must be finite and > 0 for every cell, got "
                         f"{[c for c in costs if not (0 < c < float('inf'))][:3]}")
    return costs


def _now() -> str:
    return _dt.datetime.now(_dt.UTC).strftime("%Y-%m-%d %H:%M:%S")


def run_study(
    study: Study,
    *,
    out: Path | str = "reports",
    quick: bool = False,
    device: str | torch.device = "cpu",
    seed: int = 0,
    dtype: torch.dtype = torch.float64,
    replot: bool = False,
    use_cache: bool = True,
    progress: bool = True,
    jobs: int = 1,
    scheduler: str | None = None,
    imports: Sequence[str] = (),
    estimators: Sequence[str] | None = None,
) -> Path:
    """Run (or, with ``replot``, redraw) ``study`` into ``<out>/<name>/``; return that folder.

    Cells not in the cache are computed in this process (``jobs=1``, the default), by ``jobs``
    spawned local processes, or by the Dask cluster whose scheduler is at ``scheduler``
    (``"tcp://host:port"``). Every cell is cached as it completes (atomically), and the rows are
    merged in grid order, so ``results.csv`` is the same file whatever the executor and however
    often the run was interrupted. The outputs are staged and moved into the report folder only
    when all of them are written (see :mod:`studies._engine.report`); when they are the report
    already in the folder byte for byte, provenance aside, the folder and the index are left
    untouched. Either way (and after ``replot``) the run's own provenance is written to
    ``<out>/<name>/.cache/last-run.json`` (read it with :func:`last_run`).

    ``imports`` are modules imported first (a user's estimator registrations; worker processes
    import them too); ``estimators`` restricts the grid to the cells of those estimators
    (registered names or study keys, see :func:`~studies._engine.model.restrict_estimators`).

    Raises
    ------
    ValueError
        ``jobs`` below 1, or both ``jobs > 1`` and ``scheduler``; ``estimators`` for a study
        without an estimator axis, or naming none of its grid.
    ReportFolderError
        The report folder cannot be written (checked before any cell is computed).
    StudyInterrupted
        Ctrl-C (a ``KeyboardInterrupt``): the message says how many cells are cached.
    CellError
        A cell failed; the message names it and the cause is the cell's exception. The cells
        completed before stay cached.
    """
    import pandas as pd
    from tqdm.auto import tqdm

    if isinstance(jobs, bool) or not isinstance(jobs, int):
        raise TypeError(f"jobs must be an int, got {jobs!r}")
    if jobs < 1:
        raise ValueError(f"jobs must be >= 1, got {jobs}")
    if scheduler is not None and jobs > 1:
        raise ValueError(f"give jobs (got {jobs}) or scheduler (got {scheduler!r}), not both")
    folder = Path(out) / study.name
    csv = folder / "results.csv"
    prov_path = folder / "provenance.json"
    if replot and not csv.exists():
        raise FileNotFoundError(
            f"--replot redraws from {csv}, which does not exist; run the study first "
            f"(python -m studies run {study.name})"
        )
    if replot and _report.is_incomplete(folder):
        raise IncompleteReportError(f"the report in {folder} is incomplete (a run was killed while replacing its "
                                    f"files): run the study again (python -m studies run {study.name})")
    import_user_modules(tuple(imports))
    cells = None if replot else study.grid(quick)
    if cells is not None and estimators is not None:
        cells = restrict_estimators(study, cells, estimators)
    _report.check_writable(folder)
    folder.mkdir(parents=True, exist_ok=True)
    _report.check_writable(folder)
    ctx = Context(
        device=torch.device(device), seed=seed, quick=quick, out=folder, dtype=dtype, study=study.name,
        jobs=jobs, scheduler=scheduler, imports=tuple(imports),
        estimators=None if estimators is None else tuple(estimators),
    )

    if replot:
        try:
            df = pd.read_csv(csv)
        except (ValueError, UnicodeDecodeError, OSError) as e:
            raise UnreadableReportError(f"--replot cannot read {csv} ({type(e).__name__}: {e}); run the study again "
                             f"(python -m studies run {study.name})") from None
        try:
            prov = json.loads(prov_path.read_text()) if prov_path.exists() else {}
            if not isinstance(prov, dict):
                raise ValueError("not a JSON object")
        except (ValueError, UnicodeDecodeError, OSError) as e:
            raise UnreadableReportError(f"--replot cannot read {prov_path} ({type(e).__name__}: {e}); run the study again "
                             f"(python -m studies run {study.name})") from None
        ctx.seed = int(prov.get("seed", seed))
        ctx.quick = bool(prov.get("quick", quick))
        ctx.device = torch.device(prov.get("device", str(ctx.device)))
        prov.update(_prov.replot_stamp(_now()))
        stage = _report.staging_folder(folder)
    else:
        assert cells is not None
        t0 = time.perf_counter()
        c0 = time.process_time()
        if scheduler is not None or jobs > 1:
            # workers import the files as they are now: so does the key of the cells they compute
            _prov.code_hash.cache_clear()
        cache_dir = folder / ".cache"
        cache_dir.mkdir(exist_ok=True)
        keys = [_cache.cell_key(study, cell, ctx) for cell in cells]
        _cache.check_entries(cache_dir, keys)
        recs: dict[str, dict] = {}
        todo: list[tuple[str, dict]] = []
        for key, cell in zip(keys, cells, strict=True):
            path = cache_dir / f"{key}.json"
            if key in recs:
                continue
            if use_cache and path.exists():
                rec = _cache.read_record(path, key, cell)
                if rec is not None:
                    recs[key] = rec
                    continue
            if not any(k == key for k, _ in todo):
                todo.append((key, cell))
        n_cached = sum(1 for k in keys if k in recs)
        # the bar advances by each cell's share of the expected compute (Study.cell_cost), in %
        costs = _costs(study, cells, quick)
        share = {k: 0.0 for k in keys}
        for k, c in zip(keys, costs, strict=True):
            share[k] += 100.0 * c / sum(costs)
        bar = tqdm(total=100.0, initial=min(100.0, sum(share[k] for k in set(keys) if k in recs)), desc=study.name,
                   unit="%", disable=not progress, dynamic_ncols=True,
                   bar_format="{l_bar}{bar}| {n:.1f}/{total:.0f}% [{elapsed}<{remaining}{postfix}]")

        def done(key: str, rec: dict) -> None:
            if rec.get("code_hash", _prov.code_hash()) != _prov.code_hash():
                # a worker imported the files after an edit: its rows must not be cached under
                # this run's key (which hashes the code as it was when the run started)
                raise RuntimeError(
                    f"[{study.name}] the code changed during the run: cell {rec['cell']} was computed by "
                    f"code hash {rec['code_hash']}, the run started with {_prov.code_hash()}; run it again"
                )
            # the parent writes the cache (workers may not share this filesystem); every executor's
            # record goes through the same JSON round trip, so the rows are the same objects
            text = _cache.seal(rec, key)
            write_atomic(cache_dir / f"{key}.json", text)
            recs[key] = json.loads(text)
            bar.set_postfix_str(_short(rec["cell"]), refresh=False)
            bar.update(max(0.0, min(share[key], bar.total - bar.n)))  # the shares' rounding never passes 100 %

        asked = f"dask({scheduler})" if scheduler else f"processes({jobs})" if jobs > 1 else "sequential"
        try:
            if not todo:
                executor = asked if asked == "sequential" else f"{asked}: idle, every cell was cached"
            elif not study.concurrent_cells or asked == "sequential":
                executor = _exec._run_sequential(study, todo, ctx, done)
                if asked != "sequential":
                    executor += f" (not {asked}: the study's cells time themselves, one at a time)"
            elif scheduler is not None:
                executor = _exec._run_dask(study, todo, ctx, scheduler, done)
            else:
                executor = _exec._run_processes(study, todo, ctx, jobs, done)
        except KeyboardInterrupt:
            raise StudyInterrupted(study.name, sum(1 for k in keys if k in recs), len(cells)) from None
        finally:
            bar.close()
        cpu_s = time.process_time() - c0
        if "sequential" not in executor:  # add the workers' CPU time (this process only waited)
            cpu_s += sum(float(recs[k].get("cpu_s", 0.0)) for k, _ in todo)
        computed = {int(recs[k]["threads"]) for k, _ in todo if "threads" in recs[k]}
        compute_s = sum(float(recs[k].get("seconds", 0.0)) for k in keys)
        rows: list[dict] = []
        for key, cell in zip(keys, cells, strict=True):  # grid order, whatever the completion order
            for r in recs[key]["rows"]:
                merged = {k: (json.dumps(v) if isinstance(v, (list, dict)) else v)
                          for k, v in cell.items()}
                merged.update(r)
                rows.append(merged)
        cell_cols = list(dict.fromkeys(k for c in cells for k in c))
        df = _frame(rows, cell_cols)
        stage = _report.staging_folder(folder)
        try:
            (stage / "results.csv").write_text(df.to_csv(index=False))
            df = pd.read_csv(stage / "results.csv")  # plot and summarise exactly what --replot will see
            prov = _prov.provenance(ctx, time.perf_counter() - t0, compute_s, len(cells), n_cached,
                                    use_cache=use_cache, executor=executor, dtypes=study.dtypes)
        except BaseException:
            _report.discard(stage)  # a Ctrl-C here leaves no staging folder behind
            raise
        if estimators is not None:
            prov["estimators"] = list(estimators)
        if imports:
            prov["imports"] = list(imports)
        if computed and computed != {prov["torch_threads"]}:
            prov["torch_threads"] = sorted(computed)[0] if len(computed) == 1 else sorted(computed)
        prov["cpu_s"] = round(cpu_s, 2)

    try:
        t_plot = time.perf_counter()
        figures = study.plot(df, stage)
        body = study.summarize(df, ctx)
        prov["plot_summary_s"] = round(time.perf_counter() - t_plot, 2)
        if not replot:
            prov["wall_s"] = round(prov["wall_s"] + prov["plot_summary_s"], 2)
        prov["figures"] = sorted(Path(p).name for p in figures)
        (stage / "provenance.json").write_text(json.dumps(prov, indent=2) + "\n")
        (stage / "summary.md").write_text(_report.compose_summary(study, df, body, prov, cells))
    except BaseException:
        _report.discard(stage)  # the previous report stays as it was
        raise
    published = _report.publish(stage, folder, keep_reproduced=not replot)
    if published or not (Path(out) / "README.md").exists():
        _report.write_index(Path(out))
    outcome = "replotted" if replot else "published" if published else "reproduced"
    last = last_run_path(out, study)
    last.parent.mkdir(exist_ok=True)
    write_atomic(last, json.dumps({**prov, "report": outcome}, indent=2) + "\n")
    return folder


#: Where every completed run writes its own provenance, inside the report folder's cache
#: (git-ignored): ``<out>/<study>/.cache/last-run.json``.
LAST_RUN = Path(".cache") / "last-run.json"


def last_run_path(out: Path | str, study: Study | str) -> Path:
    """The file :func:`last_run` reads: ``<out>/<study>/.cache/last-run.json``."""
    name = study if isinstance(study, str) else study.name
    return Path(out) / name / LAST_RUN


def last_run(out: Path | str, study: Study | str) -> dict:
    """The provenance of the last completed run of ``study`` (a :class:`Study` or its name) into
    the report root ``out``, whether or not that run replaced the report's files.

    Every completed run writes it to ``<out>/<study>/.cache/last-run.json``: the record
    ``provenance.json`` holds (command, commit, code hash, times, cells from cache, executor,
    figures, ...) plus ``report``, what the run did with the report folder:

    - ``"published"``: its files replaced the report's; ``provenance.json`` is this record
      without ``report``;
    - ``"reproduced"``: the report in the folder was this run's byte for byte (``results.csv``,
      figures, the summary's body: :func:`studies._engine.report.reproduces`), so the folder was
      left untouched and its ``summary.md`` and ``provenance.json`` still name the run that
      produced the report; the index ``<out>/README.md`` was left untouched too;
    - ``"replotted"``: ``--replot`` redrew the figures and the summary (``provenance.json`` is
      this record without ``report``).

    A run that fails or is interrupted writes none: the file keeps the last completed run's.

    Parameters
    ----------
    out : Path or str
        The report root (``--out``; ``reports`` by default).
    study : Study or str
        The study, or its name (``"dlogd"``).

    Returns
    -------
    dict
        The record, as written (JSON).

    Raises
    ------
    FileNotFoundError
        No run of ``study`` has completed into ``out`` (the message names the file).

    Examples
    --------
    After ``python -m studies run dlogd`` in a fresh clone (every cell computed, the committed
    report reproduced):

    >>> from studies._engine import last_run
    >>> rec = last_run("reports", "dlogd")  # doctest: +SKIP
    >>> rec["report"], rec["n_cells_from_cache"], rec["n_cells"]  # doctest: +SKIP
    ('reproduced', 0, 66)
    """
    path = last_run_path(out, study)
    try:
        text = path.read_text()
    except FileNotFoundError:
        name = study if isinstance(study, str) else study.name
        raise FileNotFoundError(f"{path} does not exist: no run of {name} has completed into {out} "
                                f"(python -m studies run {name} --out {out})") from None
    rec = json.loads(text)
    if not isinstance(rec, dict):
        raise ValueError(f"{path} holds a {type(rec).__name__}, not a run's provenance record")
    return rec
