"""All-or-nothing file writes, shared by the library (`kernelapprox.recover.save`) and the studies
harness (its cache entries and reports).

A file is written to a temporary file in the same folder (same file system), flushed to disk,
then moved over the destination with ``os.replace`` (atomic on POSIX and Windows): an
interrupted write leaves either the old file or the new one, never part of one, and no
temporary file behind.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import BinaryIO

__all__ = ["atomic_write", "write_atomic"]


def atomic_write(path: str | os.PathLike[str], write: Callable[[BinaryIO], object]) -> None:
    """Call ``write(f)`` on a temporary binary file beside ``path``, then replace ``path`` with it.

    Parameters
    ----------
    path : str or PathLike
        The destination; its folder must exist.
    write : callable
        Writes the content to the open binary file it is given (e.g. ``lambda f: torch.save(obj, f)``).
        If it raises (or the process is interrupted), ``path`` is left as it was and the
        temporary file is removed.

    Examples
    --------
    >>> import pathlib, tempfile
    >>> p = pathlib.Path(tempfile.mkdtemp()) / "x.bin"
    >>> atomic_write(p, lambda f: f.write(b"abc"))
    >>> p.read_bytes()
    b'abc'
    """
    dest = Path(path)
    # a fresh name in the same folder, created exclusively (the umask's permissions, as a plain write)
    tmp = dest.with_name(f".{dest.name}.{os.getpid()}.{uuid.uuid4().hex[:12]}.tmp")
    try:
        with open(tmp, "xb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, dest)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:  # pragma: no cover - already moved or removed
            pass
        raise


def write_atomic(path: str | os.PathLike[str], text: str) -> None:
    """Write ``text`` (UTF-8) to ``path`` all or nothing (`atomic_write`).

    Examples
    --------
    >>> import pathlib, tempfile
    >>> p = pathlib.Path(tempfile.mkdtemp()) / "x.txt"
    >>> write_atomic(p, "hello")
    >>> p.read_text()
    'hello'
    """
    data = text.encode("utf-8")
    atomic_write(path, lambda f: f.write(data))
