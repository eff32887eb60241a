r"""Which implementation runs a call: the one module that reads the device type, the dtype and
the installed device kernels (Triton, flash-linear-attention) with their version guards.

The maps and the attention forms stay device-agnostic torch code; where a faster device path
exists, they ask this module which one to take (after flash-linear-attention's
``fla/ops/backends``). Device code is imported lazily, so ``import kernelapprox`` never needs
Triton or fla.

The environment variable ``KERNELAPPROX_BACKEND`` forces a path for testing: ``"torch"`` takes
the portable torch path everywhere; ``"fla"`` asks for flash-linear-attention's kernels wherever
they can run (a warning names the reason where they cannot); ``"accelerator"`` takes the
accelerator's torch path on any device, the CPU included (to test it without a GPU); unset (or
``"auto"``) lets this module choose.

Examples
--------
>>> import torch
>>> from kernelapprox import backends
>>> backends.is_accelerator(torch.device("cpu"))
False
"""

from __future__ import annotations

import functools
import importlib.metadata
import importlib.util
import os
import threading
import warnings
from dataclasses import dataclass

import torch

#: The environment switch that forces a path (see the module docstring).
ENV_VAR = "KERNELAPPROX_BACKEND"
_CHOICES = ("auto", "torch", "fla", "accelerator")


def forced_backend() -> str:
    """The value of ``KERNELAPPROX_BACKEND`` (``"auto"`` when unset), checked.

    Returns
    -------
    str
        One of ``"auto"``, ``"torch"``, ``"fla"``, ``"accelerator"``.
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
#
# The dtype rule of the feature maps. CPU policy (the CPU and ``meta``): every computation in
# ``promote(input, map)``, at least float32 (16-bit inputs are promoted). Accelerator policy (any
# other device): a 16-bit input keeps 16-bit GEMM operands (the accumulation is float32 in the
# GEMM kernels of cuBLAS and Triton), the log-domain statistics (norms, row maxima, log-scales,
# fitted parameters) are float32, and the outputs come back in the input's dtype.

#: Environment switch of the dtype policy: ``"auto"`` (by device) or ``"accelerator"`` (the
#: accelerator policy on every device; for tests of that policy on CPU tensors).
POLICY_ENV_VAR = "KERNELAPPROX_DTYPE_POLICY"
_POLICIES = ("auto", "accelerator")
_LOW_PRECISION = (torch.float16, torch.bfloat16)


class _PolicyFlag(threading.local):
    """Per-thread override behind `accelerator_dtypes` (a thread-local attribute, which
    ``torch.compile`` traces)."""

    def __init__(self) -> None:
        self.forced = False


_POLICY = _PolicyFlag()


class accelerator_dtypes:  # noqa: N801 - a context manager, like contextlib's
    """Within this block the feature maps follow the accelerator dtype policy on every device.

    For tests and error measurements of that policy on CPU tensors (`gemm_dtype`). Re-entrant;
    the previous value is restored on exit. The environment variable
    ``KERNELAPPROX_DTYPE_POLICY=accelerator`` does the same for a whole process.

    Examples
    --------
    >>> import torch, kernelapprox as ka
    >>> from kernelapprox import backends
    >>> x = torch.randn(5, 8, dtype=torch.bfloat16)
    >>> fm = ka.PositiveRF(8, 16, seed=0)
    >>> with backends.accelerator_dtypes():
    ...     f, log_scale = fm.log_features(x)
    >>> f.dtype, log_scale.dtype
    (torch.bfloat16, torch.float32)
    """

    def __enter__(self) -> None:
        self._prev = _POLICY.forced
        _POLICY.forced = True

    def __exit__(self, *exc: object) -> None:
        _POLICY.forced = self._prev


def dtype_policy(device: torch.device | str) -> str:
    """The dtype policy on ``device``: ``"accelerator"`` or ``"cpu"``.

    ``"accelerator"`` on any device but the CPU and ``meta``, inside `accelerator_dtypes`, or when
    ``KERNELAPPROX_DTYPE_POLICY=accelerator``; ``"cpu"`` otherwise.

    Examples
    --------
    >>> dtype_policy("cpu")
    'cpu'
    """
    if _POLICY.forced or is_accelerator(device):
        return "accelerator"
    value = os.environ.get(POLICY_ENV_VAR, "auto").strip().lower() or "auto"
    if value not in _POLICIES:
        raise ValueError(f"{POLICY_ENV_VAR} must be one of {_POLICIES}, got {value!r}")
    return "accelerator" if value == "accelerator" else "cpu"


def gemm_dtype(x_dtype: torch.dtype, device: torch.device | str, compute: torch.dtype) -> torch.dtype:
    """The dtype of a feature map's GEMM operands for an input of ``x_dtype`` on ``device``.

    Parameters
    ----------
    x_dtype : torch.dtype
        The input's dtype (before any promotion).
    device : torch.device or str
    compute : torch.dtype
        The map's compute dtype, ``promote(x_dtype, map dtype)`` and at least float32.

    Returns
    -------
    torch.dtype
        ``x_dtype`` when it is 16-bit, the map computes in float32 and the accelerator policy
        holds (`dtype_policy`); ``compute`` otherwise. The statistics stay in ``compute``
        (float32 there) and the outputs come back in ``x_dtype``.

    Examples
    --------
    >>> gemm_dtype(torch.bfloat16, "cpu", torch.float32)
    torch.float32
    >>> with accelerator_dtypes():
    ...     gemm_dtype(torch.bfloat16, "cpu", torch.float32)
    torch.bfloat16
    """
    if x_dtype in _LOW_PRECISION and compute == torch.float32 and dtype_policy(device) == "accelerator":
        return x_dtype
    return compute


class _TorchPathFlag(threading.local):
    def __init__(self) -> None:
        self.forced = False


_TORCH_PATH = _TorchPathFlag()


class torch_path:  # noqa: N801 - a context manager, like contextlib's
    """Within this block the feature maps take their torch path on every device (the fused
    kernels' backward re-runs the torch map under it; also for comparisons). Re-entrant.

    Examples
    --------
    >>> with torch_path():
    ...     pass
    """

    def __enter__(self) -> None:
        self._prev = _TORCH_PATH.forced
        _TORCH_PATH.forced = True

    def __exit__(self, *exc: object) -> None:
        _TORCH_PATH.forced = self._prev


def use_fused_maps(x: object) -> bool:
    """Whether a feature-map call on ``x`` takes the fused Triton kernels
    (`kernelapprox.maps.fused_exponential`): ``x`` is a CUDA tensor of dtype float16, bfloat16 or
    float32, Triton is installed, ``KERNELAPPROX_BACKEND`` is not ``"torch"``, and the call is
    neither inside `torch_path` nor traced by ``torch.compile`` (which compiles the torch path).

    Examples
    --------
    >>> import torch
    >>> use_fused_maps(torch.zeros(3, 4))  # a CPU tensor
    False
    """
    if not isinstance(x, torch.Tensor) or x.device.type != "cuda":
        return False
    if x.dtype not in (torch.float16, torch.bfloat16, torch.float32) or _TORCH_PATH.forced:
        return False
    if torch.compiler.is_compiling():
        return False
    return forced_backend() != "torch" and has_module("triton")


def fused_log_features(
    fm: torch.nn.Module, x: torch.Tensor, shared: bool = False, key: bool = False
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """``fm.log_features(x, shared)`` (``key``: ``key_log_features``) from the fused kernel when
    `use_fused_maps` holds and the map has a fused form; ``None`` otherwise (the map then takes its
    torch path). ``x`` is validated by the caller.

    Examples
    --------
    >>> import torch, kernelapprox as ka
    >>> fused_log_features(ka.PositiveRF(4, 8, seed=0), torch.zeros(3, 4)) is None  # CPU: torch path
    True
    """
    if not use_fused_maps(x):
        return None
    from .maps import fused_exponential

    return fused_exponential.log_features(fm, x, shared, key)


def fused_features(fm: torch.nn.Module, x: torch.Tensor, key: bool = False) -> torch.Tensor | None:
    """``fm(x)`` (``key``: ``fm.key_features(x)``) from the fused kernel, or ``None`` (see
    `fused_log_features`).

    Examples
    --------
    >>> import torch, kernelapprox as ka
    >>> fused_features(ka.PositiveRF(4, 8, seed=0), torch.zeros(3, 4)) is None
    True
    """
    if not use_fused_maps(x):
        return None
    from .maps import fused_exponential

    return fused_exponential.features(fm, x, key)


# --------------------------------------------------------------------------- attention

#: The flash-linear-attention release the adapter is written and tested against (``fla-core``).
FLA_VERSION = "0.6.0"

#: Below this sequence length, causal linear attention on an accelerator takes the quadratic
#: form (`kernelapprox.attention.linear.quadratic`, one masked score GEMM pair) rather than the
#: log-domain scan (`kernelapprox.attention.linear.chunk_logscan`): short calls are launch-bound,
#: and the quadratic form has none of the scan's state operations. A CPU measurement (forced
#: accelerator path, FAVOR+, float32, one thread, least of 5-7 interleaved calls, 2026-12-04):
#: the scan is as fast as the quadratic form from n = 128-160 forward and n = 128 forward +
#: backward at B32 H4 d16 r64, from n = 384 and 256 at B8 H16 d64 r128 (128 is the conservative
#: side there: the quadratic form's memory grows as n^2). The GPU crossover is printed by
#: ``python -m benchmarks gpu --only short`` (not yet measured).
SHORT_CALL_N = 128

#: Triton releases under which fla 0.6.0 refuses the gated backward on Hopper (sm90): a Triton
#: miscompile fixed in 3.7.1 (fla issues #640, #826, #983).
_HOPPER_BAD_TRITON = ((3, 4, 0), (3, 7, 1))


@dataclass(frozen=True)
class AttentionCapabilities:
    """What a device offers the attention kernels (read by `attention_capabilities`; tests pass
    their own).

    Attributes
    ----------
    device_type : str
        ``"cpu"``, ``"cuda"``, ``"meta"``, ...
    compute_capability : tuple of int, or None
        CUDA ``(major, minor)`` (``(9, 0)`` on Hopper); ``None`` elsewhere.
    fla_version : str or None
        The installed ``fla-core`` version, ``None`` when absent.
    triton_version : str or None
        The installed Triton version, ``None`` when absent.
    """

    device_type: str
    compute_capability: tuple[int, int] | None = None
    fla_version: str | None = None
    triton_version: str | None = None


@dataclass(frozen=True)
class AttentionPlan:
    """The path chosen for a call of causal linear attention.

    Attributes
    ----------
    path : str
        ``"cpu"`` (the CPU algorithms: shared-scale / running-maximum chunks), ``"torch"`` (the
        accelerator's torch path: per-feature gated chunks), ``"quadratic"`` (one masked GEMM
        pair, short calls on accelerators) or ``"fla"`` (flash-linear-attention's chunked kernels).
        A decoding step's plan (`decode_plan`) is ``"torch"`` (the torch step) or ``"fla"`` (fla's
        fused recurrent kernels).
    reason : str or None
        Why a faster path was not taken (a fallback, announced by a warning), else ``None``.
    """

    path: str
    reason: str | None = None


def _version(name: str) -> str | None:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def _parse(version: str) -> tuple[int, ...]:
    parts = []
    for p in version.split("+")[0].split("."):
        digits = "".join(ch for ch in p if ch.isdigit())
        parts.append(int(digits) if digits else 0)
    return tuple((parts + [0, 0, 0])[:3])


def attention_capabilities(device: torch.device | str) -> AttentionCapabilities:
    """The capabilities of ``device`` for the attention kernels (no value of any tensor is read).

    Examples
    --------
    >>> attention_capabilities("cpu").compute_capability is None
    True
    """
    dev = torch.device(device)
    cc = None
    if dev.type == "cuda" and torch.cuda.is_available():
        cc = tuple(torch.cuda.get_device_capability(dev))
    fla = _version("fla-core") if has_module("fla") else None
    triton = _version("triton") if has_module("triton") else None
    return AttentionCapabilities(dev.type, cc, fla, triton)  # type: ignore[arg-type]


_WARNED: set[str] = set()


def _warn_once(reason: str, fallback: str = "linear attention falls back to the torch path") -> None:
    """Announce a fallback once per (fallback, reason) with a `KernelApproxWarning`."""
    key = f"{fallback}: {reason}"
    if key in _WARNED:
        return
    _WARNED.add(key)
    from ._validation import KernelApproxWarning

    warnings.warn(key, KernelApproxWarning, stacklevel=4)


def _fla_unavailable(caps: AttentionCapabilities, dtype: torch.dtype) -> str | None:
    """Why fla's kernels cannot take a call of ``dtype`` on a device with ``caps`` (``None``: they
    can), for `attention_plan` and `decode_plan`."""
    if caps.fla_version is None:
        return "flash-linear-attention (fla-core) is not installed"
    if _parse(caps.fla_version) != _parse(FLA_VERSION):
        return f"fla-core {caps.fla_version} is installed; the adapter is written for {FLA_VERSION}"
    if caps.triton_version is None:
        return "Triton is not installed"
    if caps.device_type != "cuda":
        return f"fla's kernels run on CUDA devices, not {caps.device_type!r}"
    if dtype == torch.float64:
        return "fla has no float64 kernels"
    return None


def attention_plan(
    device: torch.device | str,
    dtype: torch.dtype,
    *,
    n: int,
    gated: bool,
    grad: bool,
    caps: AttentionCapabilities | None = None,
    warn: bool = True,
) -> AttentionPlan:
    r"""The path of a causal linear-attention call, with the reason of any fallback.

    The rules, in order (``KERNELAPPROX_BACKEND`` = ``env``):

    1. ``env == "torch"``: ``"cpu"`` on the CPU, ``"torch"`` elsewhere.
    2. A CPU or ``meta`` device (and ``env`` not ``"fla"``/``"accelerator"``): ``"cpu"``.
    3. ``n < SHORT_CALL_N`` (and ``env`` not ``"fla"``): ``"quadratic"``.
    4. ``env == "accelerator"``: ``"torch"``.
    5. fla's kernels, unless: fla-core absent or not `FLA_VERSION`; Triton absent; not a CUDA
       device; float64 inputs (fla has no float64 kernels); or a gated call that needs a
       gradient on Hopper (sm90) with Triton in [3.4, 3.7.1) (fla refuses that backward).
       Each of these is a fallback to ``"torch"`` with its reason, announced once per reason by
       a `kernelapprox.KernelApproxWarning` (never silently).

    Parameters
    ----------
    device : torch.device or str
    dtype : torch.dtype
        The inputs' dtype.
    n : int
        Sequence length.
    gated : bool
        Whether the map needs decay gates (positive maps with log2 features: per-feature gates).
    grad : bool
        Whether autograd will take a gradient through the call.
    caps : AttentionCapabilities, optional
        The device's capabilities (default: `attention_capabilities`); tests pass their own.
    warn : bool, default True
        Announce a fallback.

    Returns
    -------
    AttentionPlan

    Examples
    --------
    >>> attention_plan("cpu", torch.float32, n=4096, gated=True, grad=False).path
    'cpu'
    >>> caps = AttentionCapabilities("cuda", (9, 0), "0.6.0", "3.6.0")
    >>> plan = attention_plan("cuda", torch.bfloat16, n=4096, gated=True, grad=True, caps=caps, warn=False)
    >>> plan.path, plan.reason is not None
    ('torch', True)
    >>> attention_plan("cuda", torch.bfloat16, n=4096, gated=True, grad=False, caps=caps).path
    'fla'
    """
    env = forced_backend()
    dev = torch.device(device)
    accel = is_accelerator(dev)
    if env == "torch":
        return AttentionPlan("torch" if accel else "cpu")
    if not accel and env not in ("fla", "accelerator"):
        return AttentionPlan("cpu")
    if n < SHORT_CALL_N and env != "fla":
        return AttentionPlan("quadratic")
    if env == "accelerator":
        return AttentionPlan("torch")
    if caps is None:
        caps = attention_capabilities(dev)
    reason = _fla_unavailable(caps, dtype)
    if (reason is None and gated and grad and caps.triton_version is not None
            and caps.compute_capability is not None and caps.compute_capability[0] == 9
            and _HOPPER_BAD_TRITON[0] <= _parse(caps.triton_version) < _HOPPER_BAD_TRITON[1]):
        reason = (f"fla {caps.fla_version} refuses the gated backward on Hopper (sm90) with Triton "
                  f"{caps.triton_version} (a Triton miscompile fixed in 3.7.1)")
    if reason is None:
        return AttentionPlan("fla")
    if warn:
        _warn_once(reason)
    return AttentionPlan("torch", reason)


# --------------------------------------------------------------------------- decoding

_CAPS_CACHE: dict[str, AttentionCapabilities] = {}


def _decode_capabilities(device: torch.device) -> AttentionCapabilities:
    """`attention_capabilities`, read once per device (a decoding step is a few microseconds on a
    GPU: the package metadata is not read again at every token)."""
    key = str(device)
    caps = _CAPS_CACHE.get(key)
    if caps is None:
        caps = _CAPS_CACHE[key] = attention_capabilities(device)
    return caps


def decode_plan(
    device: torch.device | str,
    dtype: torch.dtype,
    *,
    mode: str | None,
    caps: AttentionCapabilities | None = None,
    warn: bool = True,
) -> AttentionPlan:
    r"""The path of one decoding step (`kernelapprox.RecurrentLinearAttention.step`): ``"torch"``
    (the torch step, every device) or ``"fla"`` (flash-linear-attention's fused recurrent kernels,
    ``fused_recurrent_gla`` / ``fused_recurrent_simple_gla``, one token per call).

    The rules, in order (``KERNELAPPROX_BACKEND`` = ``env``):

    1. ``env == "torch"`` or ``"accelerator"``: ``"torch"``.
    2. A CPU or ``meta`` device (and ``env`` not ``"fla"``): ``"torch"``.
    3. A map without an fla form (``mode`` ``None``: trigonometric, Nyström and HybridRF
       features, see `kernelapprox.attention.linear.fla.fla_mode`): ``"torch"``, announced only
       when ``env`` is ``"fla"`` (the fla path was asked for).
    4. fla's kernels, unless: fla-core absent or not `FLA_VERSION`; Triton absent; not a CUDA
       device; a float64 computation (fla has no float64 kernels). Each is a fallback to
       ``"torch"`` with its reason, announced once per reason by a
       `kernelapprox.KernelApproxWarning`.

    The fused recurrent kernels have their own backward, not the chunked one that fla refuses on
    Hopper with Triton in [3.4, 3.7.1) (see `attention_plan`), so a gradient changes nothing here.
    The device's capabilities are read once per device and kept.

    Parameters
    ----------
    device : torch.device or str
    dtype : torch.dtype
        The step's compute dtype (the promotion of the inputs and the map, at least float32).
    mode : str or None
        ``fla_mode(feature_map)``: ``"gla"``, ``"plain"`` or ``None``.
    caps : AttentionCapabilities, optional
        The device's capabilities (default: read once per device); tests pass their own.
    warn : bool, default True
        Announce a fallback.

    Returns
    -------
    AttentionPlan
        ``path`` ``"torch"`` or ``"fla"``, with the ``reason`` of a fallback.

    Examples
    --------
    >>> decode_plan("cpu", torch.float32, mode="gla").path
    'torch'
    >>> caps = AttentionCapabilities("cuda", (9, 0), "0.6.0", "3.6.0")
    >>> decode_plan("cuda", torch.float32, mode="gla", caps=caps).path
    'fla'
    >>> plan = decode_plan("cuda", torch.float64, mode="gla", caps=caps, warn=False)
    >>> plan.path, plan.reason
    ('torch', 'fla has no float64 kernels')
    """
    env = forced_backend()
    dev = torch.device(device)
    if env in ("torch", "accelerator"):
        return AttentionPlan("torch")
    if not is_accelerator(dev) and env != "fla":
        return AttentionPlan("torch")
    if mode is None:
        no_form = "the feature map has no fla form (trigonometric, Nystrom and HybridRF features)"
        if warn and env == "fla":
            _warn_once(no_form, "decoding falls back to the torch step")
        return AttentionPlan("torch", no_form)
    if caps is None:
        caps = _decode_capabilities(dev)
    reason = _fla_unavailable(caps, dtype)
    if reason is None:
        return AttentionPlan("fla")
    if warn:
        _warn_once(reason, "decoding falls back to the torch step")
    return AttentionPlan("torch", reason)


def _flex_attention_importable() -> bool:
    try:
        return importlib.util.find_spec("torch.nn.attention.flex_attention") is not None
    except ModuleNotFoundError:  # pragma: no cover - older torch without torch.nn.attention
        return False


#: Whether flex_attention is importable, decided once at import (a plain constant, so that a
#: compiled graph reads it without tracing a cached function).
_HAS_FLEX_ATTENTION = _flex_attention_importable()


def has_flex_attention() -> bool:
    """Whether ``torch.nn.attention.flex_attention`` is importable (torch >= 2.5).

    Returns
    -------
    bool

    Examples
    --------
    >>> isinstance(has_flex_attention(), bool)
    True
    """
    return _HAS_FLEX_ATTENTION


def hybrid_path(device: torch.device | str, dtype: torch.dtype, requires_grad: bool) -> str:
    r"""The path of a hybrid attention call of a positive map: ``"flex"`` or ``"torch"``.

    ``"flex"``: the window and sinks by `torch.nn.attention.flex_attention` (returning its
    log-sum-exp), the remainder by a delayed per-feature log-domain scan
    (`kernelapprox.attention.hybrid.flex`), taken on accelerators where flex_attention is
    importable, and under ``torch.compile`` on the CPU (there with its window term in plain torch:
    no host read can rescue the chunked forms' underflowed rows in a compiled graph; 3-7x their
    cost). ``"torch"``: the library's chunked, parallel and block forms, taken on the CPU
    (eager flex_attention has a forward but no backward there, and compiled flex on the CPU cannot
    return the log-sum-exp) and whenever ``KERNELAPPROX_BACKEND=torch``.
    ``KERNELAPPROX_BACKEND=accelerator`` takes ``"flex"`` on the CPU too for calls without a
    gradient (eager flex_attention's forward), to test the path without a GPU.
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
    env = forced_backend()
    if env == "torch" or not has_flex_attention():
        return "torch"
    if torch.compiler.is_compiling() and not is_accelerator(device) and dtype.is_floating_point:
        # compiled on the CPU: no host read can rescue the chunked forms' underflowed rows, so the
        # per-feature log-domain path (its window term in plain torch: compiled flex_attention on
        # the CPU returns no log-sum-exp)
        return "flex"
    if env == "accelerator" and not requires_grad:  # the accelerator's path, on the CPU too (forward)
        return "flex" if dtype.is_floating_point else "torch"
    if not is_accelerator(device):
        return "torch"
    if not dtype.is_floating_point:
        return "torch"
    return "flex"
