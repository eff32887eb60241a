"""The command line: ``python -m studies list`` / ``python -m studies run NAME|all [options]``."""

from __future__ import annotations

import sys
import time
import warnings
from collections.abc import Sequence
from pathlib import Path

import torch

from studies._engine.cache import CacheEntryError
from studies._engine.executors import CLUSTER_INSTALL
from studies._engine.model import (
    Study,
    get_study,
    import_user_modules,
    load_studies,
    restrict_estimators,
    suggest,
)
from studies._engine.provenance import git_commit, package_version
from studies._engine.report import ReportFolderError, check_writable, is_incomplete
from studies._engine.runner import StudyInterrupted, UnreadableReportError, last_run, last_run_path, run_study

STUDIES_EXTRA = ("pandas", "matplotlib", "seaborn", "tqdm")
STUDIES_INSTALL = 'pip install "torch==2.13.0" -e ".[studies]"  (from the repository root)'
#: Exit status after Ctrl-C (128 + SIGINT, as a shell reports it).
EXIT_INTERRUPTED = 130

_EPILOG = """examples:
  python -m studies list                          what each study shows
  python -m studies run dlogd                     the headline study, into reports/dlogd/
  python -m studies run attention-error --quick   a reduced grid (about a minute)
  python -m studies run all --out /tmp/reports    every study (skips those whose extra is missing)
  python -m studies run dlogd --replot            redraw figures and summary from results.csv
  python -m studies run all --jobs 4              cells in 4 local processes
  python -m studies run dlogd --scheduler tcp://host:8786   cells on a Dask cluster (docs/cluster.md)
  python -m studies run error-vs-r --import mymodule --estimators my-rf --out my-reports
                                                  a study of your own estimator (registered in
                                                  mymodule with ka.register_estimator)

Each run writes <out>/<study>/: results.csv (tidy: one row per cell and metric, with a 95% CI),
figures (png, svg), summary.md (key table, findings, provenance) and provenance.json. Cells are
cached under <out>/<study>/.cache/, keyed on the cell, the flags and a hash of the code (and of
your own estimators' source), so an interrupted run (Ctrl-C) resumes and a code change
recomputes. results.csv is the same file whichever executor (in process, --jobs, --scheduler)
computed the cells. The files of a report are replaced together, at the end of a run; a run
that reproduces the report already there byte for byte (results.csv, figures, the summary but
its provenance lines) leaves the folder untouched, so a clone stays clean. Every run's own
provenance is written to <out>/<study>/.cache/last-run.json.
"""


def _version() -> str:
    return f"kernelapprox {package_version('kernelapprox')} (studies from commit {git_commit()})"


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m studies list`` / ``python -m studies run NAME|all [options]``.

    Returns the exit status: 0, 1 (a run failed in a way that is no usage error), 2 (usage
    errors exit through ``SystemExit(2)`` with one line) or 130 (Ctrl-C: one line saying how
    many cells are cached).
    """
    import argparse
    import importlib.util

    parser = argparse.ArgumentParser(
        prog="python -m studies",
        description="Reproduce kernelapprox's evidence: each study computes a grid of cells and writes "
                    "its data, figures and a summary into a report folder.",
        epilog=_EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=_version())
    sub = parser.add_subparsers(dest="cmd", required=True, metavar="{list,run}")
    sub.add_parser("list", help="name each study with one line on what it shows")
    run = sub.add_parser("run", help="run studies (NAME ... or all)", epilog=_EPILOG,
                         formatter_class=argparse.RawDescriptionHelpFormatter)
    run.add_argument("names", nargs="+", help="study names (see `python -m studies list`) or `all`")
    run.add_argument("--quick", action="store_true", help="reduced grid (about a minute per study)")
    run.add_argument("--device", default="cpu", help="torch device for the computation: cpu (default), cuda, cuda:N")
    run.add_argument("--seed", type=int, default=0, help="root seed; every cell's seed is derived from it (default 0)")
    run.add_argument("--out", default="reports", help="report root folder (default: reports)")
    run.add_argument("--replot", action="store_true", help="redraw figures and summary from results.csv, no compute")
    run.add_argument("--dtype", default="float64", choices=["float64", "float32"],
                     help="dtype of the studies' tensors (default float64)")
    run.add_argument("--no-cache", action="store_true", help="ignore and overwrite cached cells")
    run.add_argument("--no-progress", action="store_true", help="no progress bars")
    run.add_argument("--jobs", type=int, default=1, metavar="N",
                     help="compute cells in N local processes (default 1: in this process)")
    run.add_argument("--scheduler", metavar="ADDRESS",
                     help="compute cells on a Dask cluster, e.g. tcp://host:8786 (needs the [cluster] extra; "
                          "see docs/cluster.md)")
    run.add_argument("--import", dest="imports", action="append", default=[], metavar="MODULE",
                     help="import MODULE (a module name or a .py file) first: your estimators, registered "
                          "there with ka.register_estimator (repeatable)")
    run.add_argument("--estimators", nargs="+", metavar="NAME",
                     help="restrict the grid to these estimators (registered names, e.g. my-rf, or study keys "
                          "such as positive-orthogonal); give the report an --out folder of its own")
    args = parser.parse_args(argv)

    missing = [m for m in STUDIES_EXTRA if importlib.util.find_spec(m) is None]
    if missing:
        parser.exit(2, f"python -m studies: the studies need {', '.join(missing)} (the [studies] extra); "
                       f"install it with: {STUDIES_INSTALL}\n")

    if args.cmd == "list":
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            found = load_studies(strict=False)
        for w in caught:
            print(f"warning: {w.message}", file=sys.stderr)
        width = max((len(n) for n in found), default=0)
        for n, st in found.items():
            print(f"{n:<{width}}  {st.description}")
        return 0

    if args.jobs < 1:
        run.error(f"--jobs must be at least 1, got {args.jobs}")
    if args.scheduler is not None:
        if args.jobs > 1:
            run.error(f"--jobs {args.jobs} and --scheduler {args.scheduler}: give one of them (a Dask "
                      "cluster's size is its workers')")
        if importlib.util.find_spec("distributed") is None:
            parser.exit(2, f"python -m studies: --scheduler needs dask.distributed (the [cluster] extra); "
                           f"install it with: {CLUSTER_INSTALL}\n")
    try:
        device = torch.device(args.device)
    except RuntimeError:
        run.error(f"--device {args.device!r} is not a torch device (cpu, cuda, cuda:N)")
    if device.type == "cuda" and not torch.cuda.is_available():
        run.error(f"--device {args.device}: no CUDA device is available here (torch.cuda.is_available() "
                  "is False); run without --device for the CPU")
    try:
        import_user_modules(args.imports)
    except Exception as e:  # noqa: BLE001  (any error of the user's module: one line)
        run.error(f"--import: cannot import {', '.join(args.imports)}: {e!r}")
    known = load_studies(strict=False)
    if args.names == ["all"]:
        studies: list[Study] = []
        for s in known.values():
            if s.missing():
                print(f"[{s.name}] skipped: needs {', '.join(s.missing())} ({s.install})", file=sys.stderr)
            else:
                studies.append(s)
    else:
        unknown = [n for n in args.names if n.replace("_", "-") not in known]
        if unknown:
            hints = "".join(suggest(n, list(known)) for n in unknown[:1])
            run.error(f"unknown study {', '.join(map(repr, unknown))}{hints} (choose from: {', '.join(known)} or all)")
        studies = [get_study(n) for n in args.names]
        for s in studies:
            if s.missing():
                run.error(f"study {s.name} needs {', '.join(s.missing())}: {s.install}")
    if args.estimators is not None:
        if args.replot:
            run.error("--estimators restricts the cells to compute; --replot computes none")
        kept = []
        for s in studies:
            try:
                restrict_estimators(s, s.grid(args.quick), args.estimators)
            except ValueError as e:
                if args.names != ["all"]:
                    run.error(str(e))
                print(f"[{s.name}] skipped: {e}", file=sys.stderr)  # run all: the studies that have them
            else:
                kept.append(s)
        studies = kept
    if args.replot:
        absent = [s.name for s in studies if not (Path(args.out) / s.name / "results.csv").exists()]
        if absent:
            run.error(f"--replot redraws from results.csv, which {', '.join(absent)} lack(s) under "
                      f"{args.out}/; run the study first")
        broken = [s.name for s in studies if is_incomplete(Path(args.out) / s.name)]
        if broken:
            run.error(f"the report(s) {', '.join(broken)} under {args.out}/ are incomplete (a run was killed "
                      "while replacing their files); run the study again")
    try:  # before any work: a folder that cannot be written is one line, not a traceback at the end
        for s in studies:
            check_writable(Path(args.out) / s.name)
    except ReportFolderError as e:
        parser.exit(2, f"python -m studies: {e}\n")
    t0 = time.perf_counter()
    for s in studies:
        ts = time.perf_counter()
        try:
            folder = run_study(
                s,
                out=args.out,
                quick=args.quick,
                device=device,
                seed=args.seed,
                dtype=getattr(torch, args.dtype),
                replot=args.replot,
                use_cache=not args.no_cache,
                progress=not args.no_progress,
                jobs=args.jobs,
                scheduler=args.scheduler,
                imports=tuple(args.imports),
                estimators=None if args.estimators is None else tuple(args.estimators),
            )
        except StudyInterrupted as e:
            print(f"python -m studies: {e}", file=sys.stderr)
            return EXIT_INTERRUPTED
        except KeyboardInterrupt:  # between two cells' bookkeeping, or while plotting
            print(f"python -m studies: [{s.name}] interrupted; rerun to resume", file=sys.stderr)
            return EXIT_INTERRUPTED
        except (ConnectionError, ReportFolderError, CacheEntryError, UnreadableReportError) as e:  # one line
            print(f"python -m studies: {e}", file=sys.stderr)
            return 1
        if not args.replot and last_run(args.out, s).get("report") == "reproduced":
            print(f"[{s.name}] reproduced the report in {folder} byte for byte (results.csv, figures, summary): "
                  f"its summary.md and provenance.json are kept; this run's provenance is in "
                  f"{last_run_path(args.out, s)}", file=sys.stderr)
        print(f"[{s.name}] {time.perf_counter() - ts:.1f} s -> {folder}", file=sys.stderr)
    print(f"total {time.perf_counter() - t0:.1f} s", file=sys.stderr)
    return 0
