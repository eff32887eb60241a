r"""The one reading of a ``sinks`` argument, shared by `hybrid_attention`, the recurrent hybrid
form, `kernelapprox.nn.LinearAttention` and `kernelapprox.hf.linearize`.

A Python int (or a 0-d integer tensor or array) is a *count* ``c``: the leading positions
``0 .. c-1``. Anything with a dimension (a list, a tuple, a 1-d integer tensor or array) is a list of
*positions*, whatever its length: ``torch.tensor([5])`` is position 5, never five sinks.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ..._validation import _as_int

__all__ = ["check_sinks"]


def check_sinks(sinks: object, *, name: str = "sinks") -> int | tuple[int, ...]:
    """``sinks`` as a count or as sorted unique positions, else a clear error naming ``name``.

    Parameters
    ----------
    sinks : int, 0-d integer tensor/array, or sequence / 1-d integer tensor/array of int
        A count of leading positions (``>= 0``), or positions (negative ones count from the end
        where the form allows it: non-causal attention; see `resolve_sinks`).
    name : str, default "sinks"
        The argument's name in error messages.

    Returns
    -------
    int or tuple of int
        The count, or the positions sorted and unique (range checks against a length are the
        caller's: `resolve_sinks`).

    Examples
    --------
    >>> import torch
    >>> check_sinks(2), check_sinks([3, 0, 3]), check_sinks(torch.tensor([5])), check_sinks(torch.tensor(1))
    (2, (0, 3), (5,), 1)
    """
    ndim = getattr(sinks, "ndim", None)
    if isinstance(sinks, torch.Tensor) or ndim is not None:
        # tensors and arrays: the dimension decides, never the number of elements
        dtype = getattr(sinks, "dtype", None)
        integer = (not dtype.is_floating_point and not dtype.is_complex and dtype != torch.bool) if isinstance(
            dtype, torch.dtype) else getattr(dtype, "kind", "") in ("i", "u")
        if not integer or ndim not in (0, 1):
            shape = tuple(getattr(sinks, "shape", ()))
            raise TypeError(f"{name} as a tensor or array must be 0-d (a count) or 1-d (positions) of integers, "
                            f"got {dtype} of shape {shape}")
        if ndim == 0:
            c = _as_int(sinks)
            if c is None:  # pragma: no cover - integer 0-d tensors and arrays support __index__
                raise TypeError(f"{name} must be an int, got {sinks!r}")
            if c < 0:
                raise ValueError(f"{name} as a count of leading positions must be >= 0, got {c}")
            return c
        sinks = sinks.tolist()  # type: ignore[attr-defined]
    else:
        c = _as_int(sinks)
        if c is not None:
            if c < 0:
                raise ValueError(f"{name} as a count of leading positions must be >= 0, got {c}")
            return c
    if not isinstance(sinks, Sequence) or isinstance(sinks, str):
        raise TypeError(f"{name} must be an int (a count of leading positions) or a sequence of positions, "
                        f"got {sinks!r}")
    out = set()
    for s in sinks:
        p = _as_int(s)
        if p is None or getattr(s, "ndim", 0) != 0:
            raise TypeError(f"{name} must contain ints (positions), got {s!r}")
        out.add(p)
    return tuple(sorted(out))


class CausalSinks:
    """Causal sinks without materialising a count: the leading ``count`` positions and the listed
    ``positions`` (``sinks = 10**12`` costs nothing until tokens arrive).

    Examples
    --------
    >>> s = CausalSinks(10**12)
    >>> 5 in s, s.within(3, 6)
    (True, (3, 4, 5))
    >>> CausalSinks([7, 2]).within(0, 8)
    (2, 7)
    """

    __slots__ = ("count", "positions", "_set")
    count: int
    positions: tuple[int, ...]
    _set: frozenset[int]

    def __init__(self, sinks: object, *, name: str = "sinks") -> None:
        spec = check_sinks(sinks, name=name)
        if isinstance(spec, int):
            self.count, self.positions = spec, ()
        else:
            if spec and spec[0] < 0:
                raise ValueError(f"{name} position {spec[0]} is out of range [0, n) (causal positions are absolute)")
            self.count, self.positions = 0, spec
        self._set = frozenset(self.positions)

    def __contains__(self, p: object) -> bool:
        return isinstance(p, int) and (0 <= p < self.count or p in self._set)

    def within(self, lo: int, hi: int) -> tuple[int, ...]:
        """The sink positions ``p`` with ``lo <= p < hi``, sorted (at most ``hi - lo``)."""
        lo = max(lo, 0)
        lead = tuple(range(lo, min(hi, self.count)))
        return lead + tuple(p for p in self.positions if lo <= p < hi and p >= self.count)
