"""Input validation shared by the public API.

Every check raises `TypeError` or `ValueError` with a message that names the
argument, the expected value and the received one; nothing here uses ``assert``.
"""

from __future__ import annotations

import functools
import operator
import threading
from collections.abc import Callable, Sequence
from typing import SupportsIndex, TypeVar, cast

import torch

__all__ = [
    "check_floating",
    "check_last_dim",
    "check_positive_int",
    "check_bool",
    "check_seed",
    "check_finite_float",
    "check_device",
    "check_dtype",
    "broadcast_batch",
    "broadcast_shapes",
    "compute_dtype",
    "as_batch_shape",
    "no_autocast",
    "inputs_validated",
    "validation_skipped",
]

_F = TypeVar("_F", bound=Callable)


def no_autocast(fn: _F) -> _F:
    """Run ``fn`` with autocast disabled (CPU and CUDA), so that its float32 internals stay float32.

    Under ``torch.autocast`` the matmuls would otherwise run in 16 bits, which is what makes
    the key sums of peer implementations overflow in fp16.
    """

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        if not (torch.is_autocast_enabled("cpu") or torch.is_autocast_enabled("cuda")):
            return fn(*args, **kwargs)
        with torch.autocast("cpu", enabled=False), torch.autocast("cuda", enabled=False):
            return fn(*args, **kwargs)

    return wrapper  # type: ignore[return-value]


def check_floating(name: str, x: object) -> torch.Tensor:
    """Return ``x`` if it is a real floating-point tensor, else raise ``TypeError``."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if x.is_complex() or not x.is_floating_point():
        raise TypeError(
            f"{name} must have a real floating dtype (float16, bfloat16, float32 or float64), "
            f"got {x.dtype}"
        )
    return x


def check_tensor_fields(obj: object, *names: str) -> None:
    """Raise ``TypeError`` naming the first attribute of ``obj`` among ``names`` that is not a
    tensor (the ``__post_init__`` of the library's state and result dataclasses)."""
    for name in names:
        value = getattr(obj, name)
        if not isinstance(value, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {value!r} ({type(value).__name__})")


def check_last_dim(name: str, x: torch.Tensor, dim: int) -> None:
    """Raise ``ValueError`` unless ``x`` has shape (..., n, dim) with ``n >= 1``."""
    if x.dim() < 2:
        raise ValueError(
            f"{name} must have shape (..., n, {dim}) with at least 2 dimensions, "
            f"got shape {tuple(x.shape)}"
        )
    if x.shape[-2] == 0:
        raise ValueError(f"{name} is an empty sequence (shape {tuple(x.shape)}); need n >= 1 rows")
    if x.shape[-1] != dim:
        raise ValueError(
            f"{name} has last dimension {x.shape[-1]}, expected dim={dim} "
            f"(shape {tuple(x.shape)})"
        )


def _as_int(value: object) -> int | None:
    if isinstance(value, bool):
        return None
    try:
        return operator.index(cast(SupportsIndex, value))  # int, numpy ints, 0-d int tensors
    except TypeError:
        return None


def check_positive_int(name: str, value: object) -> int:
    """Return ``value`` as ``int`` if it is a positive integer (numpy integers too), else raise."""
    iv = _as_int(value)
    if iv is None:
        raise TypeError(f"{name} must be a positive int, got {value!r} ({type(value).__name__})")
    if iv <= 0:
        raise ValueError(f"{name} must be a positive int, got {iv}")
    return iv


def check_bool(name: str, value: object) -> bool:
    """Return ``value`` if it is a ``bool`` (numpy bools too), else raise ``TypeError``.

    Strings such as ``"yes"`` and ints are refused: ``bool("no")`` is true.
    """
    if isinstance(value, bool):
        return value
    if type(value).__name__ == "bool_":  # numpy.bool_
        return bool(value)
    raise TypeError(f"{name} must be a bool, got {value!r} ({type(value).__name__})")


def check_seed(name: str, value: object, *, allow_none: bool = True) -> int | None:
    """Return ``value`` as ``int`` if it is a non-negative integer below 2**64 (or ``None``).

    A negative seed is refused rather than wrapped: ``torch.Generator.manual_seed(-1)`` draws the
    same as ``2**64 - 1``.
    """
    if value is None and allow_none:
        return None
    iv = _as_int(value)
    expected = "a non-negative int" + (" or None" if allow_none else "")
    if iv is None:
        raise TypeError(f"{name} must be {expected}, got {value!r} ({type(value).__name__})")
    if not 0 <= iv < 2**64:
        raise ValueError(f"{name} must be {expected} below 2**64, got {iv}")
    return iv


def check_finite_float(
    name: str, value: object, *, min: float | None = None, max: float | None = None,
    min_open: bool = False, max_open: bool = False,
) -> float:
    """Return ``value`` as ``float`` if it is a finite real number in the given range, else raise.

    ``min``/``max`` are inclusive bounds unless ``min_open``/``max_open``. Bools are refused.
    """
    if isinstance(value, bool) or isinstance(value, (str, bytes)):
        raise TypeError(f"{name} must be a real number, got {value!r} ({type(value).__name__})")
    if isinstance(value, torch.Tensor) and value.numel() != 1:
        raise TypeError(f"{name} must be a real number, got a tensor of shape {tuple(value.shape)}")
    try:
        fv = float(cast(float, value))
    except (TypeError, ValueError):
        raise TypeError(f"{name} must be a real number, got {value!r} ({type(value).__name__})") from None
    if fv != fv or fv in (float("inf"), float("-inf")):
        raise ValueError(f"{name} must be finite, got {fv}")
    lo = "(" if min_open else "["
    hi = ")" if max_open else "]"
    rng = f"{lo}{'-inf' if min is None else min}, {'inf' if max is None else max}{hi}"
    if min is not None and (fv < min or (min_open and fv == min)):
        raise ValueError(f"{name} must be in {rng}, got {fv}")
    if max is not None and (fv > max or (max_open and fv == max)):
        raise ValueError(f"{name} must be in {rng}, got {fv}")
    return fv


def check_device(name: str, value: object) -> torch.device | None:
    """Return ``value`` as a ``torch.device`` (``None`` stays ``None``), else raise.

    Examples
    --------
    >>> check_device("device", "cpu")
    device(type='cpu')
    """
    if value is None:
        return None
    if isinstance(value, torch.device):
        return _check_available(name, value)
    if isinstance(value, (str, int)) and not isinstance(value, bool):
        try:
            device = torch.device(value)
        except (RuntimeError, ValueError, TypeError):
            device = None
        if device is not None:
            return _check_available(name, device)
        raise ValueError(f"{name} must be a torch.device or a device string such as 'cpu' or 'cuda:0', "
                         f"got {value!r}")
    raise TypeError(f"{name} must be a torch.device, a str or None, got {value!r} ({type(value).__name__})")


def _check_available(name: str, device: torch.device) -> torch.device:
    """``device``, unless it is a CUDA device that this torch build or machine does not have."""
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"{name}={str(device)!r}: torch {torch.__version__} sees no CUDA device here "
                         "(torch.cuda.is_available() is False: a CPU build, or no GPU); pass device='cpu' "
                         "or install a CUDA build of torch")
    return device


def check_dtype(name: str, value: object, *, floating: bool = True, allow_none: bool = True) -> torch.dtype | None:
    """Return ``value`` if it is a ``torch.dtype`` (floating unless ``floating=False``), else raise.

    Strings are refused with a hint (``"float64"`` is ``torch.float64``).
    """
    if value is None and allow_none:
        return None
    if isinstance(value, str):
        raise TypeError(f"{name} must be a torch.dtype such as torch.{value.removeprefix('torch.')}, "
                        f"got the string {value!r}")
    if not isinstance(value, torch.dtype):
        raise TypeError(f"{name} must be a torch.dtype, got {value!r} ({type(value).__name__})")
    if floating and (not value.is_floating_point or value.is_complex):
        raise TypeError(f"{name} must be a real floating torch.dtype, got {value}")
    return value


def as_batch_shape(batch_shape: object) -> tuple[int, ...]:
    """Normalise ``batch_shape`` to a tuple of non-negative ints."""
    if _as_int(batch_shape) is not None:
        batch_shape = (batch_shape,)
    if not isinstance(batch_shape, (Sequence, torch.Size)) or isinstance(batch_shape, str):
        raise TypeError(f"batch_shape must be a tuple of ints, got {batch_shape!r}")
    out = []
    for s in batch_shape:
        iv = _as_int(s)
        if iv is None or iv < 1:
            raise ValueError(f"batch_shape must contain positive ints, got {tuple(batch_shape)!r}")
        out.append(iv)
    return tuple(out)


def broadcast_shapes(*shapes: Sequence[int]) -> torch.Size:
    """`torch.broadcast_shapes` of concrete shapes, in plain Python.

    The same result and the same ``RuntimeError`` on shapes that do not broadcast, at about
    1 µs instead of about 14 µs a call (torch's goes through its symbolic-shape reference
    implementation): a decoding step calls it several times per token. Inside ``torch.compile``
    it is `torch.broadcast_shapes` itself (symbolic shapes).

    Examples
    --------
    >>> broadcast_shapes((2, 1), (1, 3), ())
    torch.Size([2, 3])
    """
    if torch.compiler.is_compiling():
        return torch.broadcast_shapes(*shapes)
    n = max((len(s) for s in shapes), default=0)
    out = [1] * n
    for s in shapes:
        off = n - len(s)
        for i, x in enumerate(s):
            if x < 0:
                raise ValueError("Attempting to broadcast a dimension with negative length!")  # torch's
            if x == 1:
                continue
            j = off + i
            if out[j] == 1:
                out[j] = x
            elif out[j] != x:
                raise RuntimeError(
                    f"Shape mismatch: objects cannot be broadcast to a single shape.  Mismatch is between "
                    f"{out[j]} and {x} at dimension {j - n}."
                )
    return torch.Size(out)


def broadcast_batch(name: str, leading: Sequence[int], batch_shape: Sequence[int]) -> tuple[int, ...]:
    """Broadcast the input's leading dims against a feature map's ``batch_shape``."""
    try:
        return tuple(broadcast_shapes(tuple(leading), tuple(batch_shape)))
    except RuntimeError:
        raise ValueError(
            f"{name} has leading dimensions {tuple(leading)} which do not broadcast with the "
            f"feature map's batch_shape {tuple(batch_shape)}"
        ) from None


def compute_dtype(*dtypes: torch.dtype | None) -> torch.dtype:
    """The dtype computations run in: ``promote(*dtypes)``, at least float32 (bf16/fp16 are
    promoted); ``None`` entries (a map without buffers) are ignored.

    This is the library's one dtype rule: every entry point computes in
    ``compute_dtype(input dtypes..., feature-map dtype)`` and returns the inputs' dtype.

    Examples
    --------
    >>> compute_dtype(torch.bfloat16, torch.float16), compute_dtype(torch.float32, torch.float64)
    (torch.float32, torch.float64)
    """
    out = torch.float32
    for dt in dtypes:
        if dt is not None:
            out = torch.promote_types(out, dt)
    return out


class _ValidatedFlag(threading.local):
    """Per-thread flag behind `inputs_validated` (read by `validation_skipped`).

    A thread-local attribute rather than a ``contextvars.ContextVar``: ``torch.compile`` traces
    attribute reads and writes of a thread-local object (and guards on the value it read), while
    ``ContextVar.get``/``set`` break the graph. Inside a synchronous ``with`` block the two are the
    same thing.
    """

    def __init__(self) -> None:
        # set on the instance (threading.local runs __init__ once per thread), not as a class
        # default: the first write would otherwise change where the attribute lives and make
        # torch.compile recompile
        self.skipped = False


_VALIDATED = _ValidatedFlag()


class inputs_validated:  # noqa: N801 - used as a context manager, like contextlib's
    """Within this block, feature maps skip re-validating their inputs.

    Entry points (attention, ``kernel``, ``forward``) validate every input once, with messages
    that name *their* arguments, then call the public feature-map methods inside this block, so
    each input is checked once per call. Re-entrant; the previous value is restored on exit (also
    when the block raises). A plain class, not a generator context manager, so that
    ``torch.compile(fullgraph=True)`` traces it without a graph break.
    """

    def __enter__(self) -> None:
        self._prev = _VALIDATED.skipped
        _VALIDATED.skipped = True

    def __exit__(self, *exc: object) -> None:
        _VALIDATED.skipped = self._prev


def validation_skipped() -> bool:
    """Whether the caller already validated the inputs (see `inputs_validated`)."""
    return _VALIDATED.skipped


class KernelApproxWarning(UserWarning):
    """The library's warnings (once per call site, by Python's default warning filter): the closed
    forms predict that a random feature map cannot approximate $e^{q^\\top k}$ on the given batch.

    Also issued where a fast device path falls back to the torch path (`kernelapprox.backends`)
    and by scikit-learn's softmax features outside their regime. The closed-form check is
    `kernelapprox.diagnose.warn_if_hopeless`: once per map by `kernelapprox.nn.LinearAttention`,
    `kernelapprox.nn.LinearAttentionHeads` and `kernelapprox.hf.linearize` (their ``check=False``
    turns it off), and by ``ka.linear_attention(..., check=True)``. Silence it with
    ``warnings.filterwarnings("ignore", category=ka.KernelApproxWarning)``.

    Examples
    --------
    >>> import torch, warnings, kernelapprox as ka
    >>> from kernelapprox.diagnose import warn_if_hopeless
    >>> g = torch.Generator().manual_seed(0)
    >>> q, k = (2 * torch.randn(2, 32, 16, generator=g)).unbind(0)    # logits far too large
    >>> with warnings.catch_warnings(record=True) as w:
    ...     warnings.simplefilter("always")
    ...     _ = warn_if_hopeless(ka.PositiveRF(16, 64, seed=0), q, k)
    >>> issubclass(w[0].category, ka.KernelApproxWarning), issubclass(ka.KernelApproxWarning, UserWarning)
    (True, True)
    """


#: Predicted relative kernel MSE above which `warn_if_hopeless` warns.
