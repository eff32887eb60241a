"""Executors: where the cells are computed (this process, spawned local processes, a Dask
cluster). Each returns a label for the provenance and hands every completed cell's record to
``done(key, record)`` as it completes."""

from __future__ import annotations

import importlib
import importlib.util
import os
import signal
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

from studies._engine import provenance as _prov
from studies._engine.model import Context, Study, clean_row, import_user_modules

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
    return {"cell": cell, "rows": [clean_row(r) for r in cell_rows],
            "seconds": time.perf_counter() - tc, "cpu_s": time.process_time() - c0, "threads": threads,
            "code_hash": _prov.code_hash()}


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
    import_user_modules(ctx.imports)  # a user's registrations, before the study selects estimators
    return _evaluate(_load_study(*ref), cell, ctx)


def _ignore_sigint() -> None:
    """Worker initializer: Ctrl-C is the parent's to handle (it stops the pool), so a worker
    prints no traceback of its own."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)


def worker_info() -> dict:
    """What a Dask worker runs: the code hash, kernelapprox version and torch threads."""
    return {"code_hash": _prov.code_hash(), "kernelapprox": _prov.package_version("kernelapprox"),
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
                               mp_context=multiprocessing.get_context("spawn"), initializer=_ignore_sigint)
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
    except BaseException as e:
        if isinstance(e, KeyboardInterrupt):  # stop the running cells too: nothing is cached from them
            for proc in list(getattr(pool, "_processes", {}).values()):
                proc.terminate()
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
        except Exception as e:  # noqa: BLE001  (the workers cannot import studies._engine)
            raise RuntimeError(
                f"the Dask workers at {address} cannot run the studies ({e!r}); start them from the "
                "root of a kernelapprox clone with PYTHONPATH=$PWD (see docs/cluster.md)"
            ) from e
        if not info:
            raise RuntimeError(f"the Dask scheduler at {address} has no workers")
        mine = _prov.code_hash()
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


