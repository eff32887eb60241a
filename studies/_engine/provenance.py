"""Provenance: the code hash, the git commit, the command that reproduces a run, and the record
written to ``provenance.json``."""

from __future__ import annotations

import datetime as _dt
import functools
import hashlib
import importlib
import importlib.metadata
import importlib.util
import os
import platform
import subprocess
import sys
from pathlib import Path
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:  # pragma: no cover
    from studies._engine.model import Context

#: The repository root: the folder holding ``studies/``.
REPO_ROOT = Path(__file__).resolve().parent.parent.parent
#: What ``+dirty`` looks at: the code that computes the reports (never the reports themselves).
CODE_PATHS = ("kernelapprox", "studies", "pyproject.toml")


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
    """``git rev-parse HEAD`` of this kernelapprox clone (read-only), ``+dirty`` when the code
    (:data:`CODE_PATHS`: ``kernelapprox/``, ``studies/``, ``pyproject.toml``) differs from it; an
    edited report, document or test is no change of the code that computed the numbers.

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
            ["git", "status", "--porcelain", "--untracked-files=no", "--", *CODE_PATHS],
            cwd=REPO_ROOT,
            capture_output=True,
            text=True,
            timeout=10,
            check=False,
        )
        return head.stdout.strip() + ("+dirty" if dirty.stdout.strip() else "")
    except Exception:  # noqa: BLE001
        return "unknown"


def replot_stamp(when: str) -> dict[str, str]:
    """What ``--replot`` adds to a report's provenance: when the figures and the summary were
    redrawn from ``results.csv`` and the commit of the code that redrew them (`git_commit`,
    ``+dirty`` when it differs from that commit). The numbers in ``results.csv`` keep the
    commit that computed them (``git_commit``); the verdicts printed are those of the redrawing
    code."""
    return {"replotted_utc": when, "replot_git_commit": git_commit()}


def command_line(ctx: Context, *, use_cache: bool = True) -> str:
    """The ``python -m studies run`` command that reproduces this run, with every flag that
    changes what is computed or where it goes.

    ``--out`` (the report root) is written relative to the current folder, so that the command
    can be rerun from a clone; a root outside it (a temporary folder) is left out: the command
    then writes into ``reports/``, the same files.
    """
    parts = ["python -m studies run", ctx.study]
    if ctx.quick:
        parts.append("--quick")
    if ctx.seed:
        parts.append(f"--seed {ctx.seed}")
    if ctx.device.type != "cpu":
        parts.append(f"--device {ctx.device}")
    if ctx.dtype != torch.float64:
        parts.append(f"--dtype {str(ctx.dtype).replace('torch.', '')}")
    root = _rerunnable_root(ctx.out.parent)
    if root is not None and root != "reports":
        parts.append(f"--out {root}")
    for mod in ctx.imports:
        parts.append(f"--import {mod}")
    if ctx.estimators:
        parts.append("--estimators " + " ".join(ctx.estimators))
    if not use_cache:
        parts.append("--no-cache")
    if ctx.scheduler:
        parts.append(f"--scheduler {ctx.scheduler}")
    elif ctx.jobs > 1:
        parts.append(f"--jobs {ctx.jobs}")
    return " ".join(parts)


def _rerunnable_root(root: Path) -> str | None:
    """``root`` as a ``--out`` value a user can rerun: relative paths as given, absolute ones
    relative to the current folder when inside it, else ``None``."""
    if not root.is_absolute():
        return root.as_posix()
    try:
        return root.resolve().relative_to(Path.cwd().resolve()).as_posix() or "."
    except ValueError:
        return None


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


@functools.lru_cache(maxsize=1)
def code_hash() -> str:
    """SHA-256 (16 hex digits) of the code that computes cells: every ``.py`` file of ``studies/``
    (the engine included) and of the imported ``kernelapprox`` package.

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
    for prefix, root, pattern in (("kernelapprox", lib, "**/*.py"), ("studies", REPO_ROOT / "studies", "**/*.py")):
        for f in sorted(root.glob(pattern)):
            h.update(f"{prefix}/{f.relative_to(root).as_posix()}\n".encode())
            h.update(f.read_bytes())
    return h.hexdigest()[:16]


