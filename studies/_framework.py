"""The studies framework: `Study`, `Context`, statistics/plot helpers and the runner.

A *study* is a grid of cells (plain JSON-serialisable dicts of parameters).  For each cell the
runner calls ``study.run_cell(cell, ctx)`` which returns tidy rows (dicts with at least
``metric, mean, ci_low, ci_high, n_draws``); the runner adds the cell parameters as columns,
caches the rows per cell under ``<out>/<name>/.cache/`` (so an interrupted run resumes), writes
``<out>/<name>/results.csv``, then calls ``study.plot(df, folder)`` (figures are drawn *from the
frame*, so ``--replot`` needs no recomputation) and ``study.summarize(df, ctx)`` (markdown with a
key table and a finding generated from the numbers).  The runner wraps the summary with a
"What was run" section and a "Provenance" section and (re)writes ``<out>/README.md``, an index of
every study found in ``<out>``.
"""

from __future__ import annotations

import datetime as _dt
import functools
import hashlib
import importlib
import importlib.metadata
import importlib.util
import json
import math
import os
import platform
import subprocess
import sys
import time
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

if TYPE_CHECKING:  # pragma: no cover
    import pandas as pd

ROW_KEYS = ("metric", "mean", "ci_low", "ci_high", "n_draws")
REPO_ROOT = Path(__file__).resolve().parent.parent


# --------------------------------------------------------------------------------------------
# Study / Context
# --------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Study:
    """One study: a grid of cells, how to evaluate a cell, how to draw and summarise the results.

    Attributes:
        name: CLI name, e.g. ``"attention-error"``; the report folder is ``<out>/<name>/``.
        description: one line, shown by ``python -m studies list`` and in ``reports/README.md``.
        grid: ``grid(quick) -> list[dict]``; each cell is a JSON-serialisable dict of parameters.
        run_cell: ``run_cell(cell, ctx) -> list[dict]``; tidy rows, each with at least
            ``metric, mean, ci_low, ci_high, n_draws`` (use :func:`row`).  Evaluate the draws of a
            cell in one batched call (feature maps' ``batch_shape``), never a Python loop over draws.
        plot: ``plot(df, folder) -> list[Path]``; draws figures FROM the tidy results frame (the
            frame read back from ``results.csv``) and saves them with :func:`save_figure`.
        summarize: ``summarize(df, ctx) -> str``; markdown.  Convention: a ``## Key results``
            section (a table, e.g. from :func:`df_to_markdown`) and a ``## Finding`` section whose
            paragraph is generated from the numbers (f-strings over ``df``), never hand-written.
        headline: file name (png) of the headline figure, shown in ``reports/README.md``.
        cache_version: bump it when ``run_cell`` changes meaning, to invalidate cached cells.
        requires: importable modules the study needs beyond the ``[studies]`` extra, and
            ``install``: the command that provides them; ``run all`` skips the study (saying so)
            when one is missing, ``run NAME`` stops with that command.
        dtypes: the dtype each stage of a cell actually computes in, ``{stage: dtype name}``,
            e.g. ``{"search": "float32", "evaluation": "float64"}``, when it is not simply
            ``ctx.dtype`` (``--dtype``); ``None`` (default): every stage uses ``ctx.dtype``.
            Recorded in ``provenance.json`` (``dtypes``) and printed in the summary's Provenance
            section next to ``--dtype``.
        concurrent_cells: ``False`` for a study whose cells measure their own run time (a cost
            study): the runner then computes its cells one at a time in this process whatever
            ``--jobs``/``--scheduler`` say, so that no other cell competes for the cores.
        cell_threads: torch intra-op threads each cell computes with (``None``, default: the
            process's setting). A study of many small tensors can be faster on one thread; the
            runner sets it around ``run_cell``, restores it, and records it in the provenance
            (``torch_threads``).

    Cells may run in other processes (``--jobs N``) or on other machines (``--scheduler``): a
    worker imports the module that defines the study and finds the ``Study`` object there (see
    :func:`study_ref`), so define ``STUDY`` at module level in an importable module, and make
    ``run_cell`` a pure function of ``(cell, ctx)`` (seeds from ``ctx.seed_for``).
    """

    name: str
    description: str
    grid: Callable[[bool], list[dict]]
    run_cell: Callable[[dict, Context], list[dict]]
    plot: Callable[[pd.DataFrame, Path], list[Path]]
    summarize: Callable[[pd.DataFrame, Context], str]
    headline: str = ""
    cache_version: str = "1"
    requires: tuple[str, ...] = ()
    install: str = ""
    dtypes: dict[str, str] | None = field(default=None, hash=False)
    concurrent_cells: bool = True
    cell_threads: int | None = None

    def __post_init__(self) -> None:
        if self.dtypes is None:
            return
        if not isinstance(self.dtypes, dict) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in self.dtypes.items()
        ):
            raise TypeError(f"Study {self.name!r}: dtypes must be a dict of str stage -> str dtype name, "
                            f"got {self.dtypes!r}")
        bad = {k: v for k, v in self.dtypes.items() if not isinstance(getattr(torch, v, None), torch.dtype)}
        if bad:
            raise ValueError(f"Study {self.name!r}: dtypes names no torch dtype for {bad!r} "
                             "(use e.g. 'float32', 'float64', 'bfloat16')")

    def missing(self) -> list[str]:
        """The modules of ``requires`` that cannot be imported here."""
        import importlib.util

        return [m for m in self.requires if importlib.util.find_spec(m) is None]


@dataclass
class Context:
    """What a cell (and ``summarize``) knows about the run.

    Attributes:
        device: where tensors are evaluated (``--device``).
        seed: the run's base seed (``--seed``); per-cell seeds derive from it via :meth:`seed_for`.
        quick: ``--quick`` (reduced grid, fewer draws).
        out: the study's report folder ``<out>/<name>/``.
        dtype: evaluation dtype (float64 by default: accuracy studies).
        study: the study's name.
        jobs: ``--jobs``: cells computed by this many local processes (1: in this process).
        scheduler: ``--scheduler``: address of the Dask scheduler that computes the cells, or
            ``None``.  ``jobs`` and ``scheduler`` say where cells run, never what they compute.
    """

    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    seed: int = 0
    quick: bool = False
    out: Path = field(default_factory=lambda: Path("reports"))
    dtype: torch.dtype = torch.float64
    study: str = ""
    jobs: int = 1
    scheduler: str | None = None

    def seed_for(self, *keys: Any) -> int:
        """A deterministic 62-bit seed from ``(seed, study, *keys)`` (stable across processes)."""
        payload = json.dumps([self.seed, self.study, *keys], sort_keys=True, default=str)
        return int(hashlib.sha256(payload.encode()).hexdigest()[:15], 16)

    def generator(self, *keys: Any) -> torch.Generator:
        """A CPU ``torch.Generator`` seeded from :meth:`seed_for` ``(*keys)``."""
        g = torch.Generator(device="cpu")
        g.manual_seed(self.seed_for(*keys))
        return g

    def rng(self, *keys: Any) -> np.random.Generator:
        """A numpy generator seeded from :meth:`seed_for` ``(*keys)``."""
        return np.random.default_rng(self.seed_for(*keys))


# --------------------------------------------------------------------------------------------
# Statistics helpers
# --------------------------------------------------------------------------------------------
def _to_numpy(x: np.ndarray | torch.Tensor | Sequence[float] | float) -> np.ndarray:
    if isinstance(x, torch.Tensor):
        return x.detach().to("cpu", torch.float64).numpy()
    return np.asarray(x, dtype=np.float64)


def row(metric: str, samples_or_value: Any, **extra: Any) -> dict:
    """One tidy row: ``metric, mean, ci_low, ci_high, n_draws`` plus ``extra`` columns.

    ``samples_or_value`` is a 1-D array/tensor of per-draw values (Student-t interval over them,
    :func:`kernelapprox.montecarlo.mean_ci`) or a
    scalar (CI collapses to the value, ``n_draws=1`` unless given in ``extra``).  ``extra`` may
    override ``ci_low``/``ci_high``/``n_draws`` (e.g. for a bootstrap interval).
    """
    from kernelapprox.montecarlo import mean_ci

    x = _to_numpy(samples_or_value)
    if x.ndim == 0 or x.size == 1:
        m = lo = hi = float(x.reshape(-1)[0]) if x.ndim else float(x)
        n = 1
    else:
        x = x.reshape(-1)
        m, _, lo, hi = (float(a) for a in mean_ci(x))  # Student t over the draws
        n = int(x.size)
    out = {"metric": metric, "mean": m, "ci_low": lo, "ci_high": hi, "n_draws": n}
    for k, v in extra.items():
        out[k] = _jsonable(v)
    return out


def _jsonable(v: Any) -> Any:
    if isinstance(v, torch.Tensor):
        v = v.detach().cpu().numpy()
    if isinstance(v, np.ndarray):
        return v.item() if v.ndim == 0 else v.tolist()
    if isinstance(v, np.generic):
        return v.item()
    return v


def save_figure(fig: Any, outdir: Path | str, stem: str) -> list[Path]:
    """Save ``fig`` as ``<outdir>/<stem>.png`` (dpi 150) and ``.svg``, close it, return the paths."""
    import matplotlib.pyplot as plt

    outdir = Path(outdir)
    outdir.mkdir(parents=True, exist_ok=True)
    paths = [outdir / f"{stem}.png", outdir / f"{stem}.svg"]
    fig.savefig(paths[0], dpi=150, bbox_inches="tight")
    fig.savefig(paths[1], bbox_inches="tight")
    plt.close(fig)
    return paths


def fmt(x: Any, digits: int = 3) -> str:
    """Compact number formatting for tables and findings (``nan`` -> ``"–"``)."""
    if x is None:
        return "–"
    if isinstance(x, (bool, np.bool_)):
        return str(bool(x))
    if isinstance(x, (int, np.integer)):
        return str(int(x))
    if isinstance(x, (float, np.floating)):
        if not math.isfinite(float(x)):
            return "–" if math.isnan(float(x)) else ("∞" if x > 0 else "-∞")
        if float(x).is_integer() and abs(x) < 1e7:
            return str(int(x))
        return f"{float(x):.{digits}g}"
    return str(x)


def df_to_markdown(df: pd.DataFrame, digits: int = 3, index: bool = False) -> str:
    """A GitHub pipe table of ``df`` (no ``tabulate`` dependency)."""
    d = df.reset_index() if index else df
    cols = [str(c) for c in d.columns]
    lines = ["| " + " | ".join(cols) + " |", "|" + "|".join("---" for _ in cols) + "|"]
    for rec in d.itertuples(index=False):
        cells = [fmt(v, digits).replace("|", "\\|") for v in rec]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


# --------------------------------------------------------------------------------------------
# Study registry
# --------------------------------------------------------------------------------------------
_WARNED: set[str] = set()


def load_studies(strict: bool = False) -> dict[str, Study]:
    """Import every module listed in ``studies.STUDY_MODULES`` and return ``{name: STUDY}``.

    A module that does not exist (or fails to import, when ``strict`` is False) is skipped with a
    warning, so ``python -m studies list`` works while studies are being written.
    """
    from studies import STUDY_MODULES

    found: dict[str, Study] = {}

    def warn(msg: str) -> None:
        if msg not in _WARNED:
            _WARNED.add(msg)
            warnings.warn(msg, stacklevel=3)

    for mod_name in STUDY_MODULES:
        full = f"studies.{mod_name}"
        try:
            mod = importlib.import_module(full)
        except ModuleNotFoundError as e:
            if e.name == full or not strict:
                warn(f"study module {full} skipped: {e}")
                continue
            raise
        except Exception as e:  # a broken module must not hide the others
            if strict:
                raise
            warn(f"study module {full} failed to import: {e!r}")
            continue
        study = getattr(mod, "STUDY", None)
        if not isinstance(study, Study):
            warn(f"study module {full} defines no STUDY")
            continue
        found[study.name] = study
    return found


def get_study(name: str) -> Study:
    """The study called ``name`` (the module name with underscores is accepted too)."""
    studies = load_studies(strict=False)
    key = name.replace("_", "-")
    if key in studies:
        return studies[key]
    # re-import strictly to surface the real import error of this module
    from studies import STUDY_MODULES

    mod_name = name.replace("-", "_")
    if mod_name in STUDY_MODULES:
        mod = importlib.import_module(f"studies.{mod_name}")
        return mod.STUDY
    raise KeyError(f"unknown study {name!r}; known: {sorted(studies)}")


# --------------------------------------------------------------------------------------------
# Provenance
# --------------------------------------------------------------------------------------------
def package_version(name: str) -> str:
    """Installed version of ``name`` (``__version__`` of the module, else metadata, else '?')."""
    try:
        v = getattr(importlib.import_module(name), "__version__", None)
    except Exception:  # noqa: BLE001
        v = None
    if v:
        return str(v)
    try:
        return importlib.metadata.version(name)
    except Exception:  # noqa: BLE001
        return "?"


def git_commit() -> str:
    """``git rev-parse HEAD`` of this kernelapprox clone (read-only), ``+dirty`` when modified.

    Only a git work tree whose top level is the folder holding ``studies/`` counts: a clone
    inside another repository (or a copy inside a user's project or venv) never reports the
    enclosing repository's commit.
    """
    try:
        top = subprocess.run(
            ["git", "rev-parse", "--show-toplevel"], cwd=REPO_ROOT, capture_output=True, text=True,
            timeout=10, check=False,
        )
        if top.returncode != 0 or Path(top.stdout.strip()).resolve() != REPO_ROOT:
            return "none (not a git clone of kernelapprox)"
        head = subprocess.run(
            ["git", "rev-parse", "HEAD"],
            cwd=REPO_ROOT,
            capture_output=True,
            text=True,
            timeout=10,
            check=False,
        )
        if head.returncode != 0:
            return "none (no commit yet)"
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"],
            cwd=REPO_ROOT,
            capture_output=True,
            text=True,
            timeout=10,
            check=False,
        )
        return head.stdout.strip() + ("+dirty" if dirty.stdout.strip() else "")
    except Exception:  # noqa: BLE001
        return "unknown"


def command_line(ctx: Context, *, use_cache: bool = True) -> str:
    """The ``python -m studies run`` command that reproduces this run, with every flag that
    changes what is computed or where it goes (``--out`` is the report root)."""
    parts = ["python -m studies run", ctx.study]
    if ctx.quick:
        parts.append("--quick")
    if ctx.seed:
        parts.append(f"--seed {ctx.seed}")
    if ctx.device.type != "cpu":
        parts.append(f"--device {ctx.device}")
    if ctx.dtype != torch.float64:
        parts.append(f"--dtype {str(ctx.dtype).replace('torch.', '')}")
    root = ctx.out.parent
    if root.as_posix() != "reports":
        parts.append(f"--out {root.as_posix()}")
    if not use_cache:
        parts.append("--no-cache")
    if ctx.scheduler:
        parts.append(f"--scheduler {ctx.scheduler}")
    elif ctx.jobs > 1:
        parts.append(f"--jobs {ctx.jobs}")
    return " ".join(parts)


def provenance(
    ctx: Context, wall_s: float, compute_s: float, n_cells: int, n_cached: int, *, use_cache: bool = True,
    executor: str = "sequential", dtypes: dict[str, str] | None = None,
) -> dict:
    """The provenance record written to ``provenance.json`` and the summary.

    ``executor`` says where the cells were computed (``sequential``, ``processes(N)`` or
    ``dask(address, n_workers=N)``); ``dtypes`` is the study's ``{stage: dtype}`` (see
    :class:`Study`), recorded next to ``dtype`` (the ``--dtype`` flag) when given.
    """
    prov = {
        "study": ctx.study,
        "date_utc": _dt.datetime.now(_dt.UTC).strftime("%Y-%m-%d %H:%M:%S"),
        "command": command_line(ctx, use_cache=use_cache),
        "code_hash": code_hash(),
        "seed": ctx.seed,
        "quick": ctx.quick,
        "device": str(ctx.device),
        "device_name": _device_name(ctx.device),
        "dtype": str(ctx.dtype).replace("torch.", ""),
        **({"dtypes": dict(dtypes)} if dtypes else {}),
        "executor": executor,
        "torch_threads": torch.get_num_threads(),
        "load_avg": _load_avg(),
        "wall_s": round(wall_s, 2),
        "compute_s_all_cells": round(compute_s, 2),
        "n_cells": n_cells,
        "n_cells_from_cache": n_cached,
        "git_commit": git_commit(),
        "python": platform.python_version(),
        "platform": platform.platform(),
        "versions": {
            p: package_version(p)
            for p in ("kernelapprox", "torch", "numpy", "scipy", "pandas", "seaborn", "matplotlib")
        },
    }
    return prov


def _load_avg() -> str:
    try:
        import os

        return ", ".join(f"{x:.1f}" for x in os.getloadavg())
    except OSError:
        return "?"


def _device_name(device: torch.device) -> str:
    if device.type == "cuda" and torch.cuda.is_available():
        return torch.cuda.get_device_name(device)
    try:  # Linux: the CPU model, e.g. "AMD EPYC ..." (platform.processor() only says "x86_64")
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


# --------------------------------------------------------------------------------------------
# Runner
# --------------------------------------------------------------------------------------------
@functools.lru_cache(maxsize=1)
def code_hash() -> str:
    """SHA-256 (16 hex digits) of the code that computes cells: every ``studies/*.py`` and every
    ``.py`` file of the imported ``kernelapprox`` package.

    Part of each cell's cache key (and of the provenance): a code change never serves a cached
    cell computed by other code, whatever the commit label or version says. Conservative: a
    change in any study or library file invalidates every study's cache.
    """
    spec = importlib.util.find_spec("kernelapprox")  # where it is, without importing it (workers)
    if spec is None or spec.origin is None:
        raise ModuleNotFoundError(
            "code_hash: the kernelapprox package is not importable from this interpreter "
            f"(sys.path[0] = {sys.path[0]!r}); install it with pip install -e . from the repository root"
        )
    lib = Path(spec.origin).resolve().parent
    h = hashlib.sha256()
    for prefix, root, pattern in (("kernelapprox", lib, "**/*.py"), ("studies", REPO_ROOT / "studies", "*.py")):
        for f in sorted(root.glob(pattern)):
            h.update(f"{prefix}/{f.relative_to(root).as_posix()}\n".encode())
            h.update(f.read_bytes())
    return h.hexdigest()[:16]


def _cell_key(study: Study, cell: dict, ctx: Context) -> str:
    payload = json.dumps(
        {
            "study": study.name,
            "code": code_hash(),
            "cache_version": study.cache_version,
            "cell": cell,
            "seed": ctx.seed,
            "quick": ctx.quick,
            "dtype": str(ctx.dtype),
            "device": ctx.device.type,
            "kernelapprox": package_version("kernelapprox"),
        },
        sort_keys=True,
        default=str,
    )
    return hashlib.sha256(payload.encode()).hexdigest()[:24]


def _frame(rows: list[dict], cell_cols: list[str]) -> pd.DataFrame:
    import pandas as pd

    df = pd.DataFrame(rows)
    first = [c for c in cell_cols if c in df.columns and c not in ROW_KEYS]
    ordered = first + [c for c in ROW_KEYS if c in df.columns]
    ordered += [c for c in df.columns if c not in ordered]
    return df[ordered]


# --------------------------------------------------------------------------------------------
# Executors: where the cells are computed
# --------------------------------------------------------------------------------------------
CLUSTER_INSTALL = ('pip install "kernelapprox[studies,cluster]"  (from a clone: pip install -e '
                   '".[studies,cluster]")')


class CellError(RuntimeError):
    """A cell failed (in this process, a worker process or a Dask worker); names the cell.

    The original exception is the ``__cause__``; ``study`` and ``cell`` are attributes.
    """

    def __init__(self, study: str, cell: dict | None, message: str) -> None:
        super().__init__(message)
        self.study = study
        self.cell = cell


def study_ref(study: Study) -> tuple[str, str, str | None]:
    """``(module, attribute, file)`` where a worker process finds ``study``.

    The module is the one that defines ``study.run_cell`` (a study module's ``STUDY``), else any
    imported module holding the very object; ``file`` is that module's source file, which a
    worker loads when it cannot import the module by name.

    Raises
    ------
    ValueError
        When no imported module holds ``study`` at module level (a study built inside a
        function cannot be found by a worker: define ``STUDY = Study(...)`` in a module).
    """
    first = getattr(study.run_cell, "__module__", None)
    names = ([first] if first in sys.modules else []) + [m for m in list(sys.modules) if m != first]
    for mod_name in names:
        mod = sys.modules.get(mod_name)
        attrs = getattr(mod, "__dict__", None)
        if not isinstance(attrs, dict):
            continue
        for attr, value in list(attrs.items()):
            if value is study:
                return mod_name, attr, getattr(mod, "__file__", None)
    raise ValueError(
        f"study {study.name!r} is not a module-level attribute of any imported module, so worker "
        "processes cannot import it; define STUDY = Study(...) in a module (or run with --jobs 1)"
    )


def _load_study(module: str, attr: str, file: str | None) -> Study:
    """The inverse of :func:`study_ref`, in a worker: import ``module`` (else load ``file``)."""
    try:
        mod = importlib.import_module(module)
    except ModuleNotFoundError as e:
        if not file or e.name != module or not Path(file).exists():
            raise
        spec = importlib.util.spec_from_file_location(module, file)
        if spec is None or spec.loader is None:
            raise ImportError(f"cannot load study module {module!r} from {file!r}") from e
        mod = importlib.util.module_from_spec(spec)
        sys.modules[module] = mod
        spec.loader.exec_module(mod)
    study = getattr(mod, attr)
    if not isinstance(study, Study):
        raise TypeError(f"{module}.{attr} is a {type(study).__name__}, not a Study")
    return study


def _evaluate(study: Study, cell: dict, ctx: Context) -> dict:
    """Compute one cell: the cache record ``{cell, rows, seconds, cpu_s, threads, code_hash}``."""
    outer = torch.get_num_threads()
    threads = study.cell_threads or outer
    torch.set_num_threads(threads)
    try:
        tc, c0 = time.perf_counter(), time.process_time()
        cell_rows = study.run_cell(dict(cell), ctx)
    finally:
        torch.set_num_threads(outer)
    return {"cell": cell, "rows": [_clean_row(r) for r in cell_rows],
            "seconds": time.perf_counter() - tc, "cpu_s": time.process_time() - c0, "threads": threads,
            "code_hash": code_hash()}


def compute_cell(ref: tuple[str, str, str | None], cell: dict, ctx: Context, threads: int | None = None) -> dict:
    """A cell as a pure function of ``(study, cell, ctx)``, run in a worker process.

    Parameters
    ----------
    ref : tuple
        :func:`study_ref` of the study: the worker imports it by module path (no closure is
        pickled).
    cell : dict
        The cell's parameters, as in ``study.grid(quick)``.
    ctx : Context
        Seed, quick, device, dtype, study name of the run.
    threads : int, optional
        Torch intra-op threads for this worker (``None``: leave the worker's setting).

    Returns
    -------
    dict
        The cache record ``{"cell", "rows", "seconds", "cpu_s", "threads", "code_hash"}``.
    """
    if threads is not None:
        torch.set_num_threads(threads)
    return _evaluate(_load_study(*ref), cell, ctx)


def worker_info() -> dict:
    """What a Dask worker runs: the code hash, kernelapprox version and torch threads."""
    return {"code_hash": code_hash(), "kernelapprox": package_version("kernelapprox"),
            "torch_threads": torch.get_num_threads()}


def _cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # macOS, Windows
        return os.cpu_count() or 1


_THREAD_VARS = ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS")


def _run_sequential(study: Study, todo: list[tuple[str, dict]], ctx: Context,
                    done: Callable[[str, dict], None]) -> str:
    for key, cell in todo:
        try:
            rec = _evaluate(study, cell, ctx)
        except Exception as e:
            raise CellError(study.name, cell, f"[{study.name}] cell {cell} failed: {e!r}") from e
        done(key, rec)
    return "sequential"


def _run_processes(study: Study, todo: list[tuple[str, dict]], ctx: Context, jobs: int,
                   done: Callable[[str, dict], None]) -> str:
    import multiprocessing
    from concurrent.futures import FIRST_COMPLETED, ProcessPoolExecutor, wait
    from concurrent.futures.process import BrokenProcessPool

    ref = study_ref(study)
    threads = max(1, _cores() // jobs)
    # spawn: a fresh interpreter per worker (no fork of a process holding torch's thread pools or
    # a CUDA context; the same on Linux, macOS and Windows). The BLAS thread variables reach the
    # workers through the environment they are spawned with; torch's through compute_cell.
    saved = {v: os.environ.get(v) for v in _THREAD_VARS}
    os.environ.update({v: str(threads) for v in _THREAD_VARS})
    pool = ProcessPoolExecutor(max_workers=min(jobs, len(todo)),
                               mp_context=multiprocessing.get_context("spawn"))
    try:
        pending = {pool.submit(compute_cell, ref, cell, ctx, threads): (key, cell) for key, cell in todo}
        while pending:
            finished, _ = wait(pending, return_when=FIRST_COMPLETED)
            for fut in finished:
                key, cell = pending.pop(fut)
                try:
                    rec = fut.result()
                except BrokenProcessPool as e:
                    running = [c for _, c in [(key, cell), *pending.values()]][:4]
                    raise CellError(study.name, cell, f"[{study.name}] a worker process died (killed, out of "
                                    f"memory or exited) while computing one of the cells {running}") from e
                except Exception as e:
                    raise CellError(study.name, cell, f"[{study.name}] cell {cell} failed in a worker "
                                    f"process: {e!r}") from e
                done(key, rec)
    except BaseException:
        pool.shutdown(wait=False, cancel_futures=True)
        raise
    finally:
        for v, old in saved.items():
            if old is None:
                os.environ.pop(v, None)
            else:
                os.environ[v] = old
    pool.shutdown(wait=True)
    return f"processes({jobs})"


def _run_dask(study: Study, todo: list[tuple[str, dict]], ctx: Context, address: str,
              done: Callable[[str, dict], None]) -> str:
    try:
        from dask.distributed import Client, as_completed
    except ImportError as e:
        raise ImportError(f"--scheduler needs dask.distributed (the [cluster] extra): {CLUSTER_INSTALL}") from e

    ref = study_ref(study)
    try:
        client = Client(address, timeout="20s")
    except (OSError, TimeoutError) as e:
        raise ConnectionError(f"cannot reach the Dask scheduler at {address}: {e}") from e
    try:
        try:
            info = client.run(worker_info)
        except Exception as e:  # noqa: BLE001  (the workers cannot import studies._framework)
            raise RuntimeError(
                f"the Dask workers at {address} cannot run the studies ({e!r}); start them from the "
                "root of a kernelapprox clone with PYTHONPATH=$PWD (see docs/cluster.md)"
            ) from e
        if not info:
            raise RuntimeError(f"the Dask scheduler at {address} has no workers")
        mine = code_hash()
        other = {w: i["code_hash"] for w, i in info.items() if i["code_hash"] != mine}
        if other:
            raise RuntimeError(
                f"Dask workers run other code than this clone (code hash {mine}): {other}; every worker "
                "must run the same commit of kernelapprox and studies/"
            )
        futures = {}
        for key, cell in todo:
            fut = client.submit(compute_cell, ref, cell, ctx, None, key=f"{study.name}-cell-{key}")
            futures[fut.key] = (fut, key, cell)
        for fut in as_completed([f for f, _, _ in futures.values()]):
            _, key, cell = futures.pop(fut.key)
            try:
                rec = fut.result()
            except Exception as e:
                client.cancel([f for f, _, _ in futures.values()])
                raise CellError(study.name, cell, f"[{study.name}] cell {cell} failed on a Dask worker: "
                                f"{e!r}") from e
            done(key, rec)
    finally:
        client.close()
    return f"dask({address}, n_workers={len(info)})"


def _write_atomic(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` through a temporary file and ``os.replace``: a killed run leaves
    either the old file or the new one, never half of one."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


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
) -> Path:
    """Run (or, with ``replot``, redraw) ``study`` into ``<out>/<name>/``; return that folder.

    Cells not in the cache are computed in this process (``jobs=1``, the default), by ``jobs``
    spawned local processes, or by the Dask cluster whose scheduler is at ``scheduler``
    (``"tcp://host:port"``). Every cell is cached as it completes (atomically), and the rows are
    merged in grid order, so ``results.csv`` is the same file whatever the executor and however
    often the run was interrupted.

    Raises
    ------
    ValueError
        ``jobs`` below 1, or both ``jobs > 1`` and ``scheduler``.
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
    if replot and not (folder / "results.csv").exists():
        raise FileNotFoundError(
            f"--replot redraws from {folder / 'results.csv'}, which does not exist; run the study first "
            f"(python -m studies run {study.name})"
        )
    folder.mkdir(parents=True, exist_ok=True)
    ctx = Context(
        device=torch.device(device), seed=seed, quick=quick, out=folder, dtype=dtype, study=study.name,
        jobs=jobs, scheduler=scheduler,
    )
    csv = folder / "results.csv"
    prov_path = folder / "provenance.json"

    if replot:
        if not csv.exists():
            raise FileNotFoundError(f"--replot needs {csv}; run the study first")
        df = pd.read_csv(csv)
        prov = json.loads(prov_path.read_text()) if prov_path.exists() else {}
        ctx.seed = int(prov.get("seed", seed))
        ctx.quick = bool(prov.get("quick", quick))
        ctx.device = torch.device(prov.get("device", str(ctx.device)))
        prov["replotted_utc"] = _dt.datetime.now(_dt.UTC).strftime("%Y-%m-%d %H:%M:%S")
        cells = None
    else:
        t0 = time.perf_counter()
        c0 = time.process_time()
        if scheduler is not None or jobs > 1:
            # workers import the files as they are now: so does the key of the cells they compute
            code_hash.cache_clear()
        cells = study.grid(quick)
        cache_dir = folder / ".cache"
        cache_dir.mkdir(exist_ok=True)
        keys = [_cell_key(study, cell, ctx) for cell in cells]
        recs: dict[str, dict] = {}
        todo: list[tuple[str, dict]] = []
        for key, cell in zip(keys, cells, strict=True):
            path = cache_dir / f"{key}.json"
            if use_cache and path.exists():
                recs[key] = json.loads(path.read_text())
            elif not any(k == key for k, _ in todo):
                todo.append((key, cell))
        n_cached = sum(1 for k in keys if k in recs)
        bar = tqdm(total=len(cells), initial=n_cached, desc=study.name, unit="cell", disable=not progress,
                   dynamic_ncols=True)

        def done(key: str, rec: dict) -> None:
            if rec.get("code_hash", code_hash()) != code_hash():
                # a worker imported the files after an edit: its rows must not be cached under
                # this run's key (which hashes the code as it was when the run started)
                raise RuntimeError(
                    f"[{study.name}] the code changed during the run: cell {rec['cell']} was computed by "
                    f"code hash {rec['code_hash']}, the run started with {code_hash()}; run it again"
                )
            # the parent writes the cache (workers may not share this filesystem); every executor's
            # record goes through the same JSON round trip, so the rows are the same objects
            text = json.dumps(rec, default=_jsonable)
            _write_atomic(cache_dir / f"{key}.json", text)
            recs[key] = json.loads(text)
            bar.set_postfix_str(_short(rec["cell"]), refresh=False)
            bar.update(sum(1 for k in keys if k == key))

        asked = f"dask({scheduler})" if scheduler else f"processes({jobs})" if jobs > 1 else "sequential"
        try:
            if not todo:
                executor = asked if asked == "sequential" else f"{asked}: idle, every cell was cached"
            elif not study.concurrent_cells or asked == "sequential":
                executor = _run_sequential(study, todo, ctx, done)
                if asked != "sequential":
                    executor += f" (not {asked}: the study's cells time themselves, one at a time)"
            elif scheduler is not None:
                executor = _run_dask(study, todo, ctx, scheduler, done)
            else:
                executor = _run_processes(study, todo, ctx, jobs, done)
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
        _write_atomic(csv, df.to_csv(index=False))
        df = pd.read_csv(csv)  # plot and summarise exactly what --replot will see
        prov = provenance(ctx, time.perf_counter() - t0, compute_s, len(cells), n_cached, use_cache=use_cache,
                          executor=executor, dtypes=study.dtypes)
        if computed and computed != {prov["torch_threads"]}:
            prov["torch_threads"] = sorted(computed)[0] if len(computed) == 1 else sorted(computed)
        prov["cpu_s"] = round(cpu_s, 2)

    t_plot = time.perf_counter()
    for old in list(folder.glob("*.png")) + list(folder.glob("*.svg")):
        old.unlink()
    figures = study.plot(df, folder)
    body = study.summarize(df, ctx)
    prov["plot_summary_s"] = round(time.perf_counter() - t_plot, 2)
    if not replot:
        prov["wall_s"] = round(prov["wall_s"] + prov["plot_summary_s"], 2)
    prov["figures"] = sorted(Path(p).name for p in figures)
    _write_atomic(prov_path, json.dumps(prov, indent=2) + "\n")
    _write_atomic(folder / "summary.md", _compose_summary(study, df, body, prov, cells))
    write_index(Path(out))
    return folder


def _short(cell: dict) -> str:
    s = ",".join(f"{k}={v}" for k, v in cell.items())
    return s if len(s) < 60 else s[:57] + "..."


def _clean_row(r: dict) -> dict:
    missing = [k for k in ROW_KEYS if k not in r]
    if missing:
        raise ValueError(f"row {r!r} lacks {missing}")
    return {k: _jsonable(v) for k, v in r.items()}


def _compose_summary(
    study: Study, df: pd.DataFrame, body: str, prov: dict, cells: list[dict] | None
) -> str:
    lines = [f"# {study.name}", "", study.description, ""]
    lines += ["## What was run", ""]
    lines.append(
        f"{prov.get('n_cells', '?')} cells ({'quick' if prov.get('quick') else 'full'} grid), "
        f"{len(df)} result rows in `results.csv` (one row per cell and metric: mean, 95% CI, "
        f"number of draws); {int(df['n_draws'].max()) if len(df) else 0} draws per cell at most."
    )
    lines.append("")
    skip = set(ROW_KEYS)
    params = []
    for c in df.columns:
        if c in skip or df[c].dtype.kind == "f" and df[c].nunique() > 12:
            continue
        vals = sorted(df[c].dropna().unique().tolist(), key=lambda v: (str(type(v)), v))
        if 1 <= len(vals) <= 24:
            params.append(f"- `{c}`: " + ", ".join(fmt(v) for v in vals))
    if params:
        lines += ["Grid and row labels:", "", *params, ""]
    lines += [body.strip(), ""]
    lines += ["## Provenance", ""]
    lines.append(f"- command: `{prov.get('command', '?')}`")
    lines.append(
        f"- wall time: {fmt(prov.get('wall_s'))} s this run (compute over all cells, cached ones "
        f"included: {fmt(prov.get('compute_s_all_cells'))} s; {prov.get('n_cells_from_cache', 0)} "
        f"of {prov.get('n_cells', '?')} cells from cache)"
    )
    if "cpu_s" in prov:
        lines.append(
            f"- CPU time of the computation: {fmt(prov['cpu_s'])} s (all threads; wall time "
            f"above includes waiting when the machine is shared; load average at the end "
            f"{prov.get('load_avg', '?')})"
        )
    dtypes = prov.get("dtypes")
    dtype = (", ".join(f"{stage} {dt}" for stage, dt in dtypes.items()) + f" (--dtype {prov.get('dtype')})"
             if dtypes else f"{prov.get('dtype')}")
    lines.append(
        f"- device: {prov.get('device')} ({prov.get('device_name')}), dtype {dtype}, "
        f"{prov.get('torch_threads')} torch threads"
    )
    lines.append(f"- executor: {prov.get('executor', 'sequential')}")
    lines.append(f"- seed: {prov.get('seed')} (per-cell seeds derived by hashing the cell)")
    lines.append(f"- git commit: {prov.get('git_commit')}")
    lines.append(f"- date (UTC): {prov.get('date_utc')}")
    if "replotted_utc" in prov:
        lines.append(f"- figures and summary redrawn from results.csv at {prov['replotted_utc']}")
    vers = prov.get("versions", {})
    lines.append(
        f"- python {prov.get('python')}; " + ", ".join(f"{k} {v}" for k, v in vers.items())
    )
    return "\n".join(lines) + "\n"


def _finding_excerpt(summary: str, limit: int = 600) -> str:
    marker = "## Finding"
    if marker not in summary:
        return ""
    text = summary.split(marker, 1)[1].split("\n## ", 1)[0].strip()
    text = " ".join(text.split())
    return text if len(text) <= limit else text[: limit - 1].rsplit(" ", 1)[0] + " …"


def write_index(out: Path) -> Path:
    """(Re)write ``<out>/README.md``: every study with a report in ``out``, headline first."""
    try:
        studies = load_studies(strict=False)
    except Exception:  # noqa: BLE001
        studies = {}
    from studies import STUDY_MODULES

    order = [m.replace("_", "-") for m in STUDY_MODULES]
    names = [n for n in order if (out / n / "summary.md").exists()]
    names += sorted(
        p.name for p in out.iterdir()
        if p.is_dir() and (p / "summary.md").exists() and p.name not in names
    )
    lines = [
        "# Reports",
        "",
        (
            "Generated by `python -m studies run all` (see `docs/studies.md`); every figure is "
            "drawn from the study's `results.csv` (`python -m studies run NAME --replot` redraws "
            "without computing)."
        ),
        "",
        "| study | what it shows | compute time, all cells | quick? |",
        "|---|---|---|---|",
    ]
    for n in names:
        prov_p = out / n / "provenance.json"
        prov = json.loads(prov_p.read_text()) if prov_p.exists() else {}
        desc = (studies[n].description if n in studies else "").replace("|", "\\|")
        cost = prov.get("compute_s_all_cells", prov.get("wall_s"))
        lines.append(
            f"| [{n}]({n}/summary.md) | {desc} | {fmt(cost)} s | "
            f"{'yes' if prov.get('quick') else 'no'} |"
        )
    lines.append("")
    for n in names:
        lines += [f"## [{n}]({n}/summary.md)", ""]
        if n in studies:
            lines += [studies[n].description, ""]
            head = studies[n].headline
            if head and (out / n / head).exists():
                lines += [f"![{n}]({n}/{head})", ""]
        exc = _finding_excerpt((out / n / "summary.md").read_text())
        if exc:
            lines += [exc, ""]
    path = out / "README.md"
    path.write_text("\n".join(lines))
    return path


# --------------------------------------------------------------------------------------------
# CLI
# --------------------------------------------------------------------------------------------
STUDIES_EXTRA = ("pandas", "matplotlib", "seaborn", "tqdm")
STUDIES_INSTALL = 'pip install "torch==2.13.0" -e ".[studies]"  (from the repository root)'

_EPILOG = """examples:
  python -m studies list                          what each study shows
  python -m studies run dlogd                     the headline study, into reports/dlogd/
  python -m studies run attention-error --quick   a reduced grid (about a minute)
  python -m studies run all --out /tmp/reports    every study (skips those whose extra is missing)
  python -m studies run dlogd --replot            redraw figures and summary from results.csv
  python -m studies run all --jobs 4              cells in 4 local processes
  python -m studies run dlogd --scheduler tcp://host:8786   cells on a Dask cluster (docs/cluster.md)

Each run writes <out>/<study>/: results.csv (tidy: one row per cell and metric, with a 95% CI),
figures (png, svg), summary.md (key table, findings, provenance) and provenance.json. Cells are
cached under <out>/<study>/.cache/, keyed on the cell, the flags and a hash of the code, so an
interrupted run resumes and a code change recomputes. results.csv is the same file whichever
executor (in process, --jobs, --scheduler) computed the cells.
"""


def _version() -> str:
    return f"kernelapprox {package_version('kernelapprox')} (studies from commit {git_commit()})"


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m studies list`` / ``python -m studies run NAME|all [options]``."""
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
    args = parser.parse_args(argv)

    missing = [m for m in STUDIES_EXTRA if importlib.util.find_spec(m) is None]
    if missing:
        parser.exit(2, f"python -m studies: the studies need {', '.join(missing)} (the [studies] extra); "
                       f"install it with: {STUDIES_INSTALL}\n")

    if args.cmd == "list":
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            studies = load_studies(strict=False)
        for w in caught:
            print(f"warning: {w.message}", file=sys.stderr)
        width = max((len(n) for n in studies), default=0)
        for n, s in studies.items():
            print(f"{n:<{width}}  {s.description}")
        return 0

    if args.jobs < 1:
        parser.error(f"--jobs must be at least 1, got {args.jobs}")
    if args.scheduler is not None:
        if args.jobs > 1:
            parser.error(f"--jobs {args.jobs} and --scheduler {args.scheduler}: give one of them (a Dask "
                         "cluster's size is its workers')")
        if importlib.util.find_spec("distributed") is None:
            parser.exit(2, f"python -m studies: --scheduler needs dask.distributed (the [cluster] extra); "
                           f"install it with: {CLUSTER_INSTALL}\n")
    try:
        device = torch.device(args.device)
    except RuntimeError:
        parser.error(f"--device {args.device!r} is not a torch device (cpu, cuda, cuda:N)")
    if device.type == "cuda" and not torch.cuda.is_available():
        parser.error(f"--device {args.device}: no CUDA device is available here (torch.cuda.is_available() "
                     "is False); run without --device for the CPU")
    known = load_studies(strict=False)
    if args.names == ["all"]:
        studies = []
        for s in known.values():
            if s.missing():
                print(f"[{s.name}] skipped: needs {', '.join(s.missing())} ({s.install})", file=sys.stderr)
            else:
                studies.append(s)
    else:
        unknown = [n for n in args.names if n.replace("_", "-") not in known]
        if unknown:
            parser.error(f"unknown study {', '.join(map(repr, unknown))}; choose from: {', '.join(known)} or all")
        studies = [get_study(n) for n in args.names]
        for s in studies:
            if s.missing():
                parser.error(f"study {s.name} needs {', '.join(s.missing())}: {s.install}")
    if args.replot:
        absent = [s.name for s in studies if not (Path(args.out) / s.name / "results.csv").exists()]
        if absent:
            parser.error(f"--replot redraws from results.csv, which {', '.join(absent)} lack(s) under "
                         f"{args.out}/; run the study first")
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
            )
        except ConnectionError as e:  # the scheduler is unreachable: one line, nothing computed
            print(f"python -m studies: {e}", file=sys.stderr)
            return 1
        print(f"[{s.name}] {time.perf_counter() - ts:.1f} s -> {folder}", file=sys.stderr)
    print(f"total {time.perf_counter() - t0:.1f} s", file=sys.stderr)
    return 0


# --------------------------------------------------------------------------------------------
# Shared helpers for the studies (data, fits, plot style)
# --------------------------------------------------------------------------------------------
def sphere_points(
    n: int, d: int, radius: float, generator: torch.Generator, dtype: torch.dtype = torch.float64
) -> torch.Tensor:
    """``n`` points uniform on the sphere of radius ``radius`` in R^d, shape (n, d)."""
    x = torch.randn(n, d, generator=generator, dtype=torch.float64)
    return (radius * x / x.norm(dim=-1, keepdim=True)).to(dtype)


def ball_points(
    n: int, d: int, radius: float, generator: torch.Generator, dtype: torch.dtype = torch.float64
) -> torch.Tensor:
    """``n`` points uniform in the ball of radius ``radius`` in R^d, shape (n, d)."""
    u = torch.rand(n, 1, generator=generator, dtype=torch.float64) ** (1.0 / d)
    return (sphere_points(n, d, radius, generator) * u).to(dtype)


def loglog_slope(x: Sequence[float], y: Sequence[float], level: float = 0.95) -> tuple[float, float, float]:
    """OLS slope of log(y) on log(x) with its t confidence interval ``(slope, lo, hi)``."""
    from scipy import stats

    lx, ly = np.log(np.asarray(x, float)), np.log(np.asarray(y, float))
    ok = np.isfinite(lx) & np.isfinite(ly)
    lx, ly = lx[ok], ly[ok]
    if lx.size < 3:
        return float("nan"), float("nan"), float("nan")
    res = stats.linregress(lx, ly)
    half = stats.t.ppf(0.5 + level / 2, lx.size - 2) * res.stderr
    return float(res.slope), float(res.slope - half), float(res.slope + half)


def set_style() -> None:
    """Common seaborn/matplotlib style for every study figure (Agg backend, no display)."""
    import matplotlib

    matplotlib.use("Agg", force=True)
    import seaborn as sns

    sns.set_theme(context="notebook", style="whitegrid", font_scale=0.9)
