"""The study model: :class:`Study`, :class:`Context`, tidy rows and the registry of studies."""

from __future__ import annotations

import difflib
import hashlib
import importlib
import importlib.util
import json
import sys
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
#: The cell parameters that name the estimator a cell computes, in the order they are read: a
#: study key of ``studies.estimators`` (``"positive-orthogonal"``) or a registered estimator's name.
ESTIMATOR_AXES = ("spec", "estimator")


def cell_estimator(cell: dict) -> Any:
    """The value of the first of `ESTIMATOR_AXES` that ``cell`` has (``None`` without one)."""
    for axis in ESTIMATOR_AXES:
        if axis in cell:
            return cell[axis]
    return None


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
        cell_cost: ``cell_cost(cell, quick) -> float``, the expected compute of a cell in any
            unit (``None``, default: every cell costs the same); the progress bar advances by
            each cell's share of the total, so its ETA holds when a few cells dominate.

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
    cell_cost: Callable[[dict, bool], float] | None = field(default=None, hash=False, compare=False)

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
        imports: ``--import``: modules imported before the study runs (a user's module that
            registers estimators with ``ka.register_estimator``); worker processes import them
            too.
        estimators: ``--estimators``: the estimators the grid was restricted to, or ``None``.
    """

    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    seed: int = 0
    quick: bool = False
    out: Path = field(default_factory=lambda: Path("reports"))
    dtype: torch.dtype = torch.float64
    study: str = ""
    jobs: int = 1
    scheduler: str | None = None
    imports: tuple[str, ...] = ()
    estimators: tuple[str, ...] | None = None

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
        m, _, lo, hi = (float(a) for a in mean_ci(x, nan_policy="propagate"))  # Student t over the draws
        n = int(x.size)
    out = {"metric": metric, "mean": m, "ci_low": lo, "ci_high": hi, "n_draws": n}
    for k, v in extra.items():
        out[k] = jsonable(v)
    return out


def jsonable(v: Any) -> Any:
    if isinstance(v, torch.Tensor):
        v = v.detach().cpu().numpy()
    if isinstance(v, np.ndarray):
        return v.item() if v.ndim == 0 else v.tolist()
    if isinstance(v, np.generic):
        return v.item()
    return v


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
    raise KeyError(f"unknown study {name!r}{suggest(name, list(studies))}; known: {sorted(studies)}")


_IMPORTED_FILES: dict[str, Any] = {}


def import_user_modules(modules: Sequence[str]) -> None:
    """Import each of ``modules`` (by module name, or a ``.py`` file path): a user's module that
    registers estimators with ``ka.register_estimator`` before a study selects them."""
    for name in modules:
        path = Path(name)
        if not name.endswith(".py"):
            importlib.import_module(name)  # once: Python caches it in sys.modules
            continue
        if not path.is_file():
            raise FileNotFoundError(f"--import {name}: no such file")
        where = str(path.resolve())
        if where in _IMPORTED_FILES:
            continue
        spec = importlib.util.spec_from_file_location(path.stem, path)
        if spec is None or spec.loader is None:
            raise ImportError(f"cannot import {name!r}")
        mod = importlib.util.module_from_spec(spec)
        if sys.modules.get(path.stem) in (None, *_IMPORTED_FILES.values()):
            sys.modules[path.stem] = mod  # where inspect (and pickle) find its classes
        spec.loader.exec_module(mod)
        _IMPORTED_FILES[where] = mod


def clean_row(r: dict) -> dict:
    """``r`` with JSON values, checked to hold every key of :data:`ROW_KEYS`."""
    missing = [k for k in ROW_KEYS if k not in r]
    if missing:
        raise ValueError(f"row {r!r} lacks {missing}")
    return {k: jsonable(v) for k, v in r.items()}




def suggest(name: str, known: Sequence[str]) -> str:
    """``"; did you mean 'x'?"`` for the names of ``known`` close to ``name`` (else ``""``)."""
    close = difflib.get_close_matches(name.replace("_", "-"), list(known), n=3, cutoff=0.6)
    if not close:
        return ""
    return "; did you mean " + " or ".join(repr(c) for c in close) + "?"


def _estimator_matches(value: Any, wanted: set[str]) -> bool:
    """Whether a cell's estimator key (``"<estimator>-<sampler>"`` or a name) is one of ``wanted``
    (a study key or a registered estimator's name)."""
    if not isinstance(value, str):
        return False
    if value in wanted:
        return True
    try:
        from studies.estimators import get
    except ImportError:  # pragma: no cover
        return False
    try:
        return get(value).name in wanted
    except KeyError:
        return False


def restrict_estimators(study: Study, cells: list[dict], estimators: Sequence[str]) -> list[dict]:
    """The cells of ``cells`` whose estimator is one of ``estimators``.

    A name may be a registered estimator's name (``"positive"``, ``"my-rf"``: every sampler of
    it) or a study key (``"positive-orthogonal"``).

    Raises
    ------
    ValueError
        The study's grid has no estimator axis (no cell has a ``spec`` or ``estimator`` parameter), or no
        cell of the grid uses one of ``estimators`` (the message lists the grid's estimators).
    """
    wanted = {str(e) for e in estimators}
    if not any(cell_estimator(c) is not None for c in cells):
        raise ValueError(f"study {study.name!r} has no estimator axis (its cells have none of the "
                         f"parameters {ESTIMATOR_AXES}): --estimators does not apply to it")
    kept = [c for c in cells if _estimator_matches(cell_estimator(c), wanted)]
    if not kept:
        present = sorted({str(cell_estimator(c)) for c in cells if cell_estimator(c) is not None})
        raise ValueError(f"no cell of study {study.name!r} uses the estimator(s) {sorted(wanted)}; its grid "
                         f"has {present} (a --quick grid holds a subset: try without --quick)")
    return kept
