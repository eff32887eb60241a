r"""Which implementation runs a call: the one module that reads the device type, the dtype and
the installed device kernels (Triton, flash-linear-attention) with their version guards.

The maps and the attention forms stay device-agnostic torch code; where a faster device path
exists, they ask this module which one to take (after flash-linear-attention's
``fla/ops/backends``). Device code is imported lazily, so ``import kernelapprox`` never needs
Triton or fla.

The environment variable ``KERNELAPPROX_BACKEND`` forces a path for testing: ``"torch"`` takes
the portable torch path everywhere; unset (or ``"auto"``) lets this module choose.

Examples
--------
>>> import torch
>>> from kernelapprox import backends
>>> backends.is_accelerator(torch.device("cpu"))
False
"""

from __future__ import annotations

import functools
import importlib.util
import os

import torch

#: The environment switch that forces a path (``"torch"`` or ``"auto"``).
ENV_VAR = "KERNELAPPROX_BACKEND"
_CHOICES = ("auto", "torch")


def forced_backend() -> str:
    """The value of ``KERNELAPPROX_BACKEND`` (``"auto"`` when unset), checked.

    Returns
    -------
    str
        ``"auto"`` or ``"torch"``.
    """
    value = os.environ.get(ENV_VAR, "auto").strip().lower() or "auto"
    if value not in _CHOICES:
        raise ValueError(f"{ENV_VAR} must be one of {_CHOICES}, got {value!r}")
    return value


def is_accelerator(device: torch.device | str) -> bool:
    """Whether ``device`` is an accelerator (anything but the CPU and ``meta``).

    Parameters
    ----------
    device : torch.device or str
    """
    kind = torch.device(device).type
    return kind not in ("cpu", "meta")


@functools.cache
def has_module(name: str) -> bool:
    """Whether the optional package ``name`` (``"triton"``, ``"fla"``) is installed, without
    importing it."""
    return importlib.util.find_spec(name) is not None


# --------------------------------------------------------------------------- feature maps


# --------------------------------------------------------------------------- attention


@functools.cache
def has_flex_attention() -> bool:
    """Whether ``torch.nn.attention.flex_attention`` is importable (torch >= 2.5)."""
    try:
        from torch.nn.attention import flex_attention  # noqa: F401
    except ImportError:  # pragma: no cover - older torch
        return False
    return True


def hybrid_path(device: torch.device | str, dtype: torch.dtype, requires_grad: bool) -> str:
    r"""The path of a hybrid attention call of a positive map: ``"flex"`` or ``"torch"``.

    ``"flex"``: the window and sinks by `torch.nn.attention.flex_attention` (returning its
    log-sum-exp), the remainder by a delayed per-feature log-domain scan
    (`kernelapprox.attention.hybrid.flex`), taken on accelerators where flex_attention is
    importable. ``"torch"``: the library's chunked, parallel and block forms, taken on the CPU
    (eager flex_attention has a forward but no backward there, and compiled flex on the CPU cannot
    return the log-sum-exp) and whenever ``KERNELAPPROX_BACKEND=torch``.

    Parameters
    ----------
    device : torch.device or str
    dtype : torch.dtype
        The computation dtype (floating point; the choice does not depend on it today).
    requires_grad : bool
        Whether the call is differentiated (the choice does not depend on it on accelerators,
        where flex_attention has a backward).

    Returns
    -------
    str

    Examples
    --------
    >>> import torch
    >>> from kernelapprox import backends
    >>> backends.hybrid_path(torch.device("cpu"), torch.float32, False)
    'torch'
    """
    if forced_backend() == "torch":
        return "torch"
    if not is_accelerator(device) or not has_flex_attention():
        return "torch"
    if not dtype.is_floating_point:
        return "torch"
    return "flex"
