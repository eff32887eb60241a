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
