"""The cell cache: one JSON record per cell under ``<out>/<name>/.cache/<key>.json``.

A cell's key hashes the study, the cell, the run's flags, the code (:func:`code_hash`) and the
source of every estimator from outside ``kernelapprox`` that the cell uses
(:func:`estimator_fingerprints`). A record is used only if it is what its key says: the cell, the
code hash and the key it carries match, and its rows are those it was written with (a digest);
anything else (an edited, foreign, truncated, empty or binary file) is a :class:`CacheWarning`
naming the file, and the cell is computed again.
"""

from __future__ import annotations

import hashlib
import inspect
import json
import warnings
from pathlib import Path
from typing import Any

from studies._engine import provenance as _prov
from studies._engine.model import ROW_KEYS, Context, Study, cell_estimator, jsonable


class CacheWarning(UserWarning):
    """A cached cell record was unreadable or not the cell's: the cell is computed again."""


def _source(obj: Any) -> str:
    """The text of the file defining ``obj`` (its whole module: helpers it calls count), else
    the object's own source, else its qualified name."""
    try:
        file = inspect.getsourcefile(obj)
        if file and Path(file).is_file():
            return Path(file).read_text(errors="replace")
    except TypeError:
        pass
    try:
        return inspect.getsource(obj)
    except (OSError, TypeError):
        return f"{getattr(obj, '__module__', '')}.{getattr(obj, '__qualname__', type(obj).__qualname__)}"


def _users(obj: Any) -> bool:
    """Whether ``obj`` is a user's code: it names a module outside the code :func:`code_hash`
    already covers (``kernelapprox``, ``studies``)."""
    mod = getattr(obj, "__module__", None)
    return isinstance(mod, str) and mod.split(".")[0] not in ("kernelapprox", "studies")


def estimator_fingerprint(est: Any) -> str | None:
    """SHA-256 (16 hex digits) of a registered estimator defined outside ``kernelapprox``.

    It hashes the source of the user's classes of the feature map (those of its MRO before the
    first ``kernelapprox`` class), of a user's ``feature_dim`` rule and closed forms, and the
    registration arguments (name, label, params, feature-dimension rule, theory). ``None`` for
    the library's own estimators, which the code hash covers.
    """
    classes = []
    for c in getattr(est.cls, "__mro__", (est.cls,)):
        if not _users(c):
            break
        classes.append(c)
    extra = [f for f in (getattr(est, "_feature_dim", None),) if f is not None and _users(f)]
    theory = getattr(est, "_theory", None)
    if theory is not None and not isinstance(theory, str):
        fields = getattr(theory, "__dict__", None) or {}
        extra += [v for v in fields.values() if callable(v) and _users(v)]
        if _users(type(theory)):
            extra.append(type(theory))
    if not classes and not extra:
        return None
    h = hashlib.sha256()
    args = {"name": est.name, "label": est.label, "params": dict(est.params),
            "feature_dim": est.feature_dim_rule, "theory": theory if isinstance(theory, str) else None}
    h.update(json.dumps(args, sort_keys=True, default=str).encode())
    for obj in [*classes, *extra]:
        h.update(f"\n{getattr(obj, '__module__', '')}.{getattr(obj, '__qualname__', '')}\n".encode())
        h.update(_source(obj).encode())
    return h.hexdigest()[:16]


def estimator_fingerprints(cell: dict) -> dict[str, str]:
    """``{name: fingerprint}`` of the estimators from outside ``kernelapprox`` that ``cell`` uses:
    the one its ``spec`` or ``estimator`` parameter names, or every registered one when it names none (a
    cell that may loop over the registry)."""
    import kernelapprox as ka

    ests = list(ka.estimators())
    key = cell_estimator(cell)
    if isinstance(key, str):
        try:
            from studies.estimators import get

            ests = [get(key).estimator]
        except (ImportError, KeyError):
            ests = [e for e in ests if e.name == key]
    out = {}
    for est in ests:
        fp = estimator_fingerprint(est)
        if fp is not None:
            out[est.name] = fp
    return out


def cell_key(study: Study, cell: dict, ctx: Context) -> str:
    """The cache key of ``cell``: 24 hex digits of SHA-256 over the study, the cell, the flags
    that change what is computed, the code hash and the cell's user estimators."""
    payload: dict[str, Any] = {
        "study": study.name,
        "code": _prov.code_hash(),
        "cache_version": study.cache_version,
        "cell": cell,
        "seed": ctx.seed,
        "quick": ctx.quick,
        "dtype": str(ctx.dtype),
        "device": ctx.device.type,
        "kernelapprox": _prov.package_version("kernelapprox"),
    }
    users = estimator_fingerprints(cell)
    if users:
        payload["user_estimators"] = users
    return hashlib.sha256(json.dumps(payload, sort_keys=True, default=str).encode()).hexdigest()[:24]


def rows_digest(rows: list[dict]) -> str:
    """SHA-256 (16 hex digits) of a record's rows, as written."""
    return hashlib.sha256(json.dumps(rows, sort_keys=True, default=jsonable).encode()).hexdigest()[:16]


def seal(rec: dict, key: str) -> str:
    """The JSON text of the record ``rec`` stored under ``key`` (with the key and a digest)."""
    return json.dumps({**rec, "key": key, "digest": rows_digest(rec["rows"])}, default=jsonable)


def _problem(rec: Any, key: str, cell: dict) -> str | None:
    if not isinstance(rec, dict):
        return f"holds a {type(rec).__name__}, not a record"
    missing = [k for k in ("cell", "rows", "code_hash", "key", "digest") if k not in rec]
    if missing:
        return f"lacks {missing}"
    if rec["key"] != key:
        return f"is the record of key {rec['key']!r}, not of its own name"
    want = json.loads(json.dumps(cell, default=str))
    if rec["cell"] != want:
        return f"is the record of cell {rec['cell']!r}, not of {want!r}"
    if rec["code_hash"] != _prov.code_hash():
        return f"was computed by code hash {rec['code_hash']!r}, not {_prov.code_hash()!r}"
    rows = rec["rows"]
    if not isinstance(rows, list) or not all(isinstance(r, dict) and all(k in r for k in ROW_KEYS) for r in rows):
        return f"has rows without {list(ROW_KEYS)}"
    if rows_digest(rows) != rec["digest"]:
        return "has rows that are not those it was written with (edited)"
    return None


def read_record(path: Path, key: str, cell: dict) -> dict | None:
    """The cached record of ``cell`` at ``path``, or ``None`` (with a :class:`CacheWarning`
    naming the file) when it cannot be read or is not the cell's record under this code."""
    try:
        rec = json.loads(path.read_bytes().decode("utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        warnings.warn(f"cache file {path} is unreadable ({type(e).__name__}: {e}); computing the cell again",
                      CacheWarning, stacklevel=2)
        return None
    problem = _problem(rec, key, cell)
    if problem:
        warnings.warn(f"cache file {path} {problem}; computing the cell again", CacheWarning, stacklevel=2)
        return None
    return rec


class CacheEntryError(OSError):
    """A cache entry of the run is not a regular file (a folder, a FIFO, a socket): raised
    before any cell is computed, naming the entry."""


def check_entries(cache_dir: Path, keys: list[str]) -> None:
    """Raise :class:`CacheEntryError` if the entry of any of ``keys`` under ``cache_dir`` exists
    and is not a regular file: reading a FIFO would hang, and replacing a folder would fail after
    the cell's work."""
    import stat

    for key in dict.fromkeys(keys):
        path = cache_dir / f"{key}.json"
        try:
            mode = path.lstat().st_mode
        except FileNotFoundError:
            continue
        if not stat.S_ISREG(mode):
            kind = "a folder" if stat.S_ISDIR(mode) else "a FIFO" if stat.S_ISFIFO(mode) else "not a regular file"
            raise CacheEntryError(f"the cache entry {path} is {kind}: remove it, then run again")
