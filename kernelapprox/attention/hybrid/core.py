r"""Hybrid attention: exact softmax on a sliding window and sink tokens, a feature map for the rest.

For query $i$ with exact set $S_i$ (a window around $i$ plus sink positions) and remainder
$R_i$ (every other key it attends to),

$$
\hat N_i = \sum_{j\in S_i} e^{q_i^\top k_j} v_j + \varphi(q_i)^\top \sum_{j\in R_i}\varphi(k_j) v_j^\top,
\qquad
\hat D_i = \sum_{j\in S_i} e^{q_i^\top k_j} + \varphi(q_i)^\top \sum_{j\in R_i}\varphi(k_j),
\qquad \hat o_i = \hat N_i / \hat D_i .
$$

One normaliser is shared by both parts, so $\hat o_i$ estimates softmax attention with the error
of the remainder only: with $p_i$ the softmax mass of $S_i$ and $\hat D_{R}$ exact,
$\hat o_i - o_i = (1 - p_i)(\hat o_{R,i} - o_{R,i})$ (`kernelapprox.theory.hybrid_attention`).
The ScatterBrain estimator [Che21]_ with a window as its sparse part; LoLCATs [Zha25]_ uses the
same two terms with the linear one left unshifted (a learned kernel rather than an estimate of
$e^{q^\top k}$).

Window convention (both forms): key $j$ is in the window of query $i$ when

- causal: $0 \le i - j < w$ (the query and the $w - 1$ keys before it, ``window = w`` keys);
- non-causal: $|i - j| < w$ (the $w - 1$ keys on each side, $2w - 1$ keys).

``window = 0`` is an empty window (plain linear attention), ``window >= n`` is softmax attention.
Sinks (e.g. a BOS token, BERT's [CLS] and [SEP]) are exact for every query that attends to them
(causal: $j \le i$), and never enter the feature-map sums.

Stabilisation. With $\varphi(x) = f(x)\,e^{s(x)}$ (`kernelapprox.FeatureMap.log_features`),
query $i$ uses one shift for both parts,
$m_i = \max(\max_{j\in S_i} q_i^\top k_j,\; s(q_i) + G_i)$, $G_i$ the largest key log-scale
of its remainder (non-causal: of all remainder keys; causal: of the keys it has seen), and
evaluates $e^{q_i^\top k_j - m_i}$ and $e^{s(q_i) + G_i - m_i} f(q_i)^\top
\sum_{j\in R_i} f(k_j) e^{s(k_j) - G_i} v_j^\top$: every weight is at most 1, and the shift
cancels in the ratio, so a positive unbiased $\varphi$ gives unbiased $\hat N_i$, $\hat D_i$.
For positive maps, the non-causal forms shift each feature by its own maximum
(`kernelapprox.attention.hybrid.logfeatures`), and the causal forms recompute the rows whose
denominator under $m_i$ falls below `kernelapprox.attention._common.den_floor` with every feature
at its own scale (`kernelapprox.attention.hybrid.rescue`; on the CPU, one host read), so that no
row underflows at any norm; on an accelerator the causal calls, with or without a state, take the
per-feature path of `kernelapprox.attention.hybrid.flex` instead (no host read). Their states, and
the decoding step's, keep one scale per feature.
Signed maps warn where the ``eps`` guard changes a row (`kernelapprox.attention.hybrid.rescue`);
without a host read (accelerators, ``torch.compile``) those rows, and a positive map's causal rows
that the CPU would recompute, are NaN (`kernelapprox.attention.hybrid.rescue.lost_rows_to_nan`).

References
----------
.. [Che21] B. Chen, T. Dao, E. Winsor, Z. Song, A. Rudra, C. Ré. "Scatterbrain: unifying sparse
   and low-rank attention approximation", NeurIPS 2021.
.. [Zha25] M. Zhang, S. Arora, R. Chalamala, A. Wu, B. Spector, A. Singhal, K. Ramesh, C. Ré.
   "LoLCATs: on low-rank linearizing of large language models", ICLR 2025 (Eq. 7, the sliding
   window + linear attention hybrid).
.. [Kat20] A. Katharopoulos, A. Vyas, N. Pappas, F. Fleuret. "Transformers are RNNs: fast
   autoregressive transformers with linear attention", ICML 2020.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import cast

import torch
import torch.nn.functional as F

from ... import backends
from ..._validation import (
    _as_int,
    broadcast_shapes,
    check_finite_float,
    check_tensor_fields,
    inputs_validated,
    no_autocast,
)
from ...maps.base import FeatureMap
from .._common import apply_padding, den_floor, normalise, padding_mask, prepare, with_ones
from .logfeatures import key_log_features, log_features_pair, shift_per_feature
from .rescue import lost_rows_to_nan, rescue_rows, underflowed_rows, warn_signed_rows
from .sinks import CausalSinks, check_sinks
from .softmax import softmax_limit

__all__ = [
    "hybrid_attention",
    "parallel_hybrid_attention",
    "chunk_hybrid_attention",
    "HybridAttentionState",
    "exact_set_mask",
    "resolve_sinks",
]

_NEG_INF = float("-inf")


# ---------------------------------------------------------------------------------- arguments
def check_window(window: object) -> int:
    """``window`` as a non-negative int, else ``TypeError``/``ValueError`` naming it."""
    w = _as_int(window)
    if w is None:
        raise TypeError(f"window must be a non-negative int (a number of keys), got {window!r}")
    if w < 0:
        raise ValueError(f"window must be a non-negative int (a number of keys), got {w}")
    return w


def resolve_sinks(sinks: object, n: int | None, *, causal: bool) -> tuple[int, ...]:
    """Sink positions, sorted and unique.

    Parameters
    ----------
    sinks : int or sequence of int
        An int (or 0-d integer tensor) ``c`` is the ``c`` leading positions ``0 .. c-1``; a
        sequence (or 1-d integer tensor or array, of any length) lists positions
        (`kernelapprox.attention.hybrid.sinks.check_sinks`). Non-causal, negative positions count from the end (``-1`` is
        the last token, e.g. BERT's [SEP]); causal, positions are absolute and non-negative. To
        combine a count with explicit positions, list them: ``[*range(4), 100]``.
    n : int or None
        Sequence length (positions must be ``< n``); ``None``: no upper bound (decoding).
    causal : bool

    Returns
    -------
    tuple of int

    Examples
    --------
    >>> resolve_sinks(2, 10, causal=True), resolve_sinks([0, -1], 10, causal=False)
    ((0, 1), (0, 9))
    """
    spec = check_sinks(sinks)
    if isinstance(spec, int):
        if n is not None and spec > n:
            raise ValueError(f"sinks as a count must be <= n = {n}, got {spec}")
        return tuple(range(spec))
    out = set()
    for p in spec:
        s = p
        if p < 0 and not causal and n is not None:
            p += n
        if p < 0 or (n is not None and p >= n):
            where = "[0, n)" if causal or n is None else "[-n, n)"
            raise ValueError(f"sinks position {s} is out of range {where} for n = {n}")
        out.add(p)
    return tuple(sorted(out))


def check_hybrid_eps(eps: object) -> float:
    """``eps`` (the signed maps' denominator guard) as a finite real number > 0, else
    ``TypeError``/``ValueError`` naming it."""
    return check_finite_float("eps", eps, min=0.0, min_open=True)


def _check_chunk(chunk_size: object) -> int:
    c = _as_int(chunk_size)
    if c is None or c <= 0:
        raise ValueError(f"chunk_size must be a positive int (a number of tokens), got {chunk_size!r}")
    return c


def check_window_mode(window_mode: object) -> str:
    """``window_mode`` as ``"token"`` or ``"block"``, else ``ValueError`` naming it."""
    if window_mode not in ("token", "block"):
        raise ValueError(f"window_mode must be 'token' or 'block', got {window_mode!r}")
    return str(window_mode)


def exact_set_mask(
    n: int, *, window: int, sinks: object = 0, causal: bool = False, device: torch.device | str | None = None,
    window_mode: str = "token",
) -> torch.Tensor:
    r"""The exact sets $S_i$ as a boolean matrix: ``mask[i, j]`` is whether key ``j`` is exact for query ``i``.

    Window $0 \le i - j < w$ (causal) or $|i - j| < w$, union the sinks (causal: those
    $\le i$); see the module docstring. Keys ``j > i`` are never in the set when causal (they
    are outside the attention altogether). ``window_mode="block"``: with blocks
    $b(i) = \lfloor i / w\rfloor$, the window is $|b(i) - b(j)| \le 1$ (non-causal) or
    $0 \le b(i) - b(j) \le 1,\ j \le i$ (causal).

    Parameters
    ----------
    n : int
        Sequence length.
    window : int
    sinks : int or sequence of int, default 0
        See `resolve_sinks`.
    causal : bool, default False
    device : torch.device, optional
    window_mode : {"token", "block"}, default "token"

    Returns
    -------
    Tensor, shape (n, n), bool.

    Examples
    --------
    >>> exact_set_mask(4, window=2, sinks=1, causal=True).int()
    tensor([[1, 0, 0, 0],
            [1, 1, 0, 0],
            [1, 1, 1, 0],
            [1, 0, 1, 1]], dtype=torch.int32)
    >>> exact_set_mask(6, window=2, causal=True, window_mode="block").int()[5]
    tensor([0, 0, 1, 1, 1, 1], dtype=torch.int32)
    """
    w = check_window(window)
    mode = check_window_mode(window_mode)
    idx = resolve_sinks(sinks, n, causal=causal)
    i = torch.arange(n, device=device)[:, None]
    j = torch.arange(n, device=device)[None, :]
    diff = i - j
    if mode == "block" and w > 0:
        bd = i // w - j // w
        mask = (bd >= 0) & (bd <= 1) & (diff >= 0) if causal else bd.abs() <= 1
    else:
        mask = (diff >= 0) & (diff < w) if causal else diff.abs() < w
    if idx:
        is_sink = torch.zeros(n, dtype=torch.bool, device=device)
        is_sink[list(idx)] = True
        mask = mask | (is_sink[None, :] & ((diff >= 0) if causal else torch.ones_like(mask)))
    return mask


# ---------------------------------------------------------------------------------- state
@dataclass
class HybridAttentionState:
    r"""State of causal hybrid attention after ``position`` tokens (for decoding).

    - a ring buffer of the last ``min(window, position)`` keys and values (the key of position
      $p$ in slot $p \bmod w$; it grows with the tokens seen), exact for the next queries;
    - the linear state $[S \mid z] = \sum_{j} \varphi(k_j)[v_j, 1]^\top$ over the keys that
      have left the window (sinks excluded), stored scaled by $e^{-\text{log\_scale}}$: one
      scale, or (positive maps, from `chunk_hybrid_attention` and `RecurrentHybridAttention`)
      one per feature, so that a feature far below the largest one keeps its mass;
    - the sink keys and values seen so far, exact for every later query.

    Its size is $O(w(d + d_v) + F(d_v + 1))$ whatever ``position``.

    Attributes
    ----------
    kv : Tensor, shape (..., F, dv + 1)
        $[S \mid z]$ divided by ``exp(log_scale)``.
    log_scale : Tensor, shape (..., 1, 1) or (..., F, 1)
        Largest key log-scale in the linear state (``-inf`` while it is empty), or one per
        feature (row $f$ of ``kv`` at the scale ``log_scale[..., f, 0]``; ``-inf`` or any value
        where no key reached the feature).
    keys : Tensor, shape (..., min(window, position), d)
    values : Tensor, shape (..., min(window, position), dv)
    sink_keys : Tensor, shape (..., s, d)
    sink_values : Tensor, shape (..., s, dv)
    sink_positions : tuple of int
        Positions of the ``s`` stored sinks.
    position : int
        Number of tokens consumed.
    window : int

    Examples
    --------
    >>> import torch, kernelapprox as ka
    >>> g = torch.Generator().manual_seed(0)
    >>> q, k, v = (0.5 * torch.randn(3, 2, 10, 8, generator=g)).unbind(0)
    >>> fm = ka.PositiveRF(8, 16, seed=0)
    >>> kw = dict(window=4, sinks=1, causal=True)
    >>> out, st = ka.hybrid_attention(q, k, v, fm, return_state=True, **kw)
    >>> st.kv.shape, st.keys.shape, st.sink_keys.shape, st.sink_positions, st.position
    (torch.Size([2, 16, 9]), torch.Size([2, 4, 8]), torch.Size([2, 1, 8]), (0,), 10)
    >>> a, s1 = ka.hybrid_attention(q[:, :6], k[:, :6], v[:, :6], fm, return_state=True, **kw)
    >>> b = ka.hybrid_attention(q[:, 6:], k[:, 6:], v[:, 6:], fm, initial_state=s1, **kw)
    >>> torch.allclose(torch.cat([a, b], dim=1), out, atol=1e-6)
    True
    """

    kv: torch.Tensor
    log_scale: torch.Tensor
    keys: torch.Tensor
    values: torch.Tensor
    sink_keys: torch.Tensor
    sink_values: torch.Tensor
    sink_positions: tuple[int, ...]
    position: int
    window: int

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """Check the fields' types and their consistency (a forged or corrupted state is refused
        with the field named): ``position`` and ``window`` non-negative ints; a ring buffer of
        ``min(window, position)`` slots (``window`` slots also accepted); the sink positions
        sorted, unique, before ``position``, one per stored sink key and value; ``log_scale``
        of shape (..., 1, 1) or (..., F, 1)."""
        check_tensor_fields(self, "kv", "log_scale", "keys", "values", "sink_keys", "sink_values")
        for name in ("position", "window"):
            val = getattr(self, name)
            if isinstance(val, bool) or not isinstance(val, int) or val < 0:
                raise ValueError(f"HybridAttentionState.{name} must be an int >= 0, got {val!r}")
        pos = self.sink_positions
        if not isinstance(pos, tuple) or any(isinstance(p, bool) or not isinstance(p, int) for p in pos):
            raise TypeError(f"HybridAttentionState.sink_positions must be a tuple of ints, got {pos!r}")
        if list(pos) != sorted(set(pos)) or (pos and (pos[0] < 0 or pos[-1] >= self.position)):
            raise ValueError(
                f"HybridAttentionState.sink_positions must be sorted, unique and in [0, position = {self.position}), "
                f"got {pos}"
            )
        for name in ("kv", "log_scale", "keys", "values", "sink_keys", "sink_values"):
            if getattr(self, name).dim() < 2:
                raise ValueError(f"HybridAttentionState.{name} must have shape (..., rows, columns), "
                                 f"got {tuple(getattr(self, name).shape)}")
        if tuple(self.log_scale.shape[-2:]) not in ((1, 1), (self.kv.shape[-2], 1)):
            raise ValueError(
                f"HybridAttentionState.log_scale must have shape (..., 1, 1) or (..., F, 1) with F = "
                f"{self.kv.shape[-2]} (kv's rows), got {tuple(self.log_scale.shape)}"
            )
        slots = self.keys.shape[-2]
        need = min(self.window, self.position)
        if slots not in (need, self.window) or self.values.shape[-2] != slots:
            raise ValueError(
                f"HybridAttentionState's ring buffer must hold min(window, position) = {need} keys and values "
                f"(window = {self.window}, position = {self.position}), got keys {tuple(self.keys.shape)} and values "
                f"{tuple(self.values.shape)}"
            )
        ns = len(pos)
        if self.sink_keys.shape[-2] != ns or self.sink_values.shape[-2] != ns:
            raise ValueError(
                f"HybridAttentionState.sink_positions lists {ns} sinks, but sink_keys has shape "
                f"{tuple(self.sink_keys.shape)} and sink_values {tuple(self.sink_values.shape)}"
            )
        if self.sink_keys.shape[-1] != self.keys.shape[-1] or self.sink_values.shape[-1] != self.values.shape[-1]:
            raise ValueError(
                f"HybridAttentionState: sink_keys {tuple(self.sink_keys.shape)} and sink_values "
                f"{tuple(self.sink_values.shape)} must have the widths of keys {tuple(self.keys.shape)} and values "
                f"{tuple(self.values.shape)}"
            )
        if self.kv.shape[-1] != self.values.shape[-1] + 1:
            raise ValueError(
                f"HybridAttentionState.kv must have shape (..., F, dv + 1) with dv = {self.values.shape[-1]} "
                f"(the values' width), got {tuple(self.kv.shape)}"
            )

    def detach(self) -> HybridAttentionState:
        """The same state, detached from autograd."""
        return HybridAttentionState(
            self.kv.detach(), self.log_scale.detach(), self.keys.detach(), self.values.detach(),
            self.sink_keys.detach(), self.sink_values.detach(), self.sink_positions, self.position, self.window,
        )


def shared_scale(state: HybridAttentionState) -> tuple[torch.Tensor, torch.Tensor]:
    r"""The state's linear part at one scale: ``(kv, G)``, ``G`` (..., 1, 1) the largest of its
    scales (detached; ``-inf`` for an empty state). A per-feature state is brought to it (features
    far below it may underflow: the forms that need them read `per_feature_scales`)."""
    ls = state.log_scale
    if ls.shape[-2] == 1:
        return state.kv, ls
    with torch.no_grad():
        G = ls.detach().amax(dim=-2, keepdim=True)
    return state.kv * exp_diff(ls.detach(), _finite_or_zero(G), state.kv.dtype), G


def per_feature_scales(state: HybridAttentionState, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    r"""The state's linear part with unit mass per reached feature: ``(kv, X)``, ``kv``
    (..., F, dv + 1) in ``dtype`` with $\tilde z_f = 1$ (0 for a feature no key reached) and
    ``X`` (..., F), float64, $X_f = \log z_f$ ($-\infty$ where $z_f = 0$), from a state with
    one scale or one per feature. ``X`` is a constant for autograd; ``kv`` keeps its gradient."""
    with torch.no_grad():
        z = state.kv[..., -1].detach().double()  # (..., F)
        X = state.log_scale.detach().double().squeeze(-1) + torch.log(z.clamp(min=0.0))
        inv = torch.where(z > 0, 1.0 / z, torch.zeros_like(z))
    kv = (state.kv.double() * inv.unsqueeze(-1)).to(dtype)
    return kv, X


def exp_diff(a: torch.Tensor, b: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``exp(a - b)`` with ``a = -inf`` read as weight 0 (also when ``b = -inf``); NaN propagates.

    The difference is replaced before the exponential (not the result after it), so that the
    gradient at such entries is 0, not ``0 * exp(nan)``."""
    diff = torch.where(a == _NEG_INF, torch.full_like(a, _NEG_INF), a - b)
    return torch.exp(diff).to(dtype)


def _finite_or_zero(x: torch.Tensor) -> torch.Tensor:
    return torch.where(x == _NEG_INF, torch.zeros_like(x), x)


# ---------------------------------------------------------------------------------- forms
def prepare_hybrid(q, k, v, feature_map, window, sinks, chunk_size, causal, key_padding_mask=None):
    w = check_window(window)
    C = _check_chunk(chunk_size)
    q, k, v, out_dtype, cdt = prepare(q, k, v, feature_map, causal, None)
    if q.shape[-2] != k.shape[-2]:
        raise ValueError(
            f"hybrid attention needs as many queries as keys (the window is a set of positions), "
            f"got q {tuple(q.shape)} and k {tuple(k.shape)}"
        )
    pad = padding_mask(key_padding_mask, k.shape)
    if pad is not None:
        pad = pad.to(q.device)
        k, v = apply_padding(pad, k, v)  # finite content; the forms give padded keys weight 0
    return q, k, v, out_dtype, cdt, w, C, pad


def softmax_path(q, k, v, feature_map, causal, kpad, out_dtype):
    """``window >= n``: every key a query attends to is exact (`softmax_limit`)."""
    lead = broadcast_shapes(q.shape[:-2], k.shape[:-2], v.shape[:-2], feature_map.batch_shape)
    return softmax_limit(q, k, v, lead, causal, kpad, out_dtype)


@no_autocast
def parallel_hybrid_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    feature_map: FeatureMap,
    *,
    window: int,
    sinks: int | Sequence[int] = 0,
    chunk_size: int = 64,
    eps: float = 1e-6,
    key_padding_mask: torch.Tensor | None = None,
) -> torch.Tensor:
    r"""Non-causal hybrid attention: exact on $|i - j| < w$ and the sinks, $\varphi$ elsewhere.

    The remainder is the global sum minus the window: with $T = \sum_{j\notin\Sigma}
    \varphi(k_j)[v_j, 1]^\top$ (sinks $\Sigma$ left out),

    $$
    [\hat N_i, \hat D_i] = \varphi(q_i)^\top T + \sum_{|i-j|<w} \big(e^{q_i^\top k_j}
    - \varphi(q_i)^\top\varphi(k_j)[j\notin\Sigma]\big)[v_j, 1]
    + \sum_{j\in\Sigma,\,|i-j|\ge w} e^{q_i^\top k_j}[v_j, 1],
    $$

    the window term evaluated per block of $C$ = ``chunk_size`` queries against the
    $C + 2(w - 1)$ keys around it (one masked score matrix for both kernels). Cost
    $O(nF(d + d_v) + n(C + 2w)(d + F + d_v))$, memory linear in ``n``. The subtraction
    leaves a rounding of order $\epsilon\,\varphi(q_i)^\top\sum_j\varphi(k_j)/\hat D_i$
    ($\epsilon$ the unit roundoff of the compute dtype) in place of the window's
    feature terms; a window that covers every key skips the feature part (softmax attention to
    rounding).

    Parameters
    ----------
    q, k : Tensor, shape (..., n, d)
    v : Tensor, shape (..., n, dv)
    feature_map : FeatureMap
    window : int
        Keys with $|i - j| < w$ are exact (``0``: none).
    sinks : int or sequence of int, default 0
        See `resolve_sinks` (negative positions count from the end).
    chunk_size : int, default 64
        Queries per block of the window term.
    eps : float, default 1e-6
        Denominator guard for signed maps (see `kernelapprox.linear_attention`).
    key_padding_mask : Tensor, shape (batch, n), optional
        ``True`` (or ``-inf``) where the key is padding, as in `kernelapprox.linear_attention`:
        padded keys are left out of the window, the sinks and the remainder.

    Returns
    -------
    Tensor, shape (..., n, dv), dtype ``promote(q, k, v)``.

    Examples
    --------
    >>> import kernelapprox as ka
    >>> q, k, v = torch.randn(3, 2, 50, 8).unbind(0)
    >>> fm = ka.PositiveRF(8, 32, seed=0)
    >>> parallel_hybrid_attention(q / 2, k / 2, v, fm, window=5, sinks=[0, -1]).shape
    torch.Size([2, 50, 8])
    """
    q, k, v, out_dtype, cdt, w, C, kpad = prepare_hybrid(q, k, v, feature_map, window, sinks, chunk_size, False,
                                                   key_padding_mask)
    eps = check_hybrid_eps(eps)
    n = q.shape[-2]
    sink_idx = resolve_sinks(sinks, n, causal=False)
    if w >= n:  # the window covers every key: softmax attention, no remainder
        return softmax_path(q, k, v, feature_map, False, kpad, out_dtype)
    if feature_map.positive:
        # per-feature log-domain shifts (`shift_per_feature`): the remainder's normaliser cannot
        # underflow, whatever the norms
        lq, lk = log_features_pair(feature_map, q, k)
        lead = broadcast_shapes(lq.shape[:-2], lk.shape[:-2], v.shape[:-2], q.shape[:-2])
        d, Fd = q.shape[-1], lq.shape[-1]
        q = q.expand(*lead, n, d)
        k = k.expand(*lead, n, d)
        v1 = with_ones(v).expand(*lead, n, v.shape[-1] + 1)
        dv = v.shape[-1]
        dev = q.device
        drop = torch.zeros(n, dtype=torch.bool, device=dev)
        if sink_idx:
            drop[list(sink_idx)] = True
        if kpad is not None:
            kpad = kpad.expand(*lead, n)
            drop = drop | kpad
        fq, fkw_all, base = shift_per_feature(lq.expand(*lead, n, Fd), lk.expand(*lead, n, Fd), drop)
        fq, fkw_all = fq.to(cdt), fkw_all.to(cdt)
        inplace = not (torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v1, fq, fkw_all)))
        fresh = False
        T = torch.matmul(fkw_all.mT, v1)  # (..., F, dv1)
    else:
        with inputs_validated():
            fq, sq = feature_map.log_features(q)
            fk, sk = feature_map.key_log_features(k)
        lead = broadcast_shapes(fq.shape[:-2], fk.shape[:-2], v.shape[:-2], q.shape[:-2])
        d, Fd = q.shape[-1], fq.shape[-1]
        q = q.expand(*lead, n, d)
        k = k.expand(*lead, n, d)
        fq = fq.expand(*lead, n, Fd)
        fk = fk.expand(*lead, n, Fd)
        sq = sq.expand(*lead, n).double()
        sk = sk.expand(*lead, n).double()
        v1 = with_ones(v).expand(*lead, n, v.shape[-1] + 1)
        dv = v.shape[-1]
        dev = q.device

        is_sink = torch.zeros(n, dtype=torch.bool, device=dev)
        if sink_idx:
            is_sink[list(sink_idx)] = True
        s_rem = sk.masked_fill(is_sink, _NEG_INF)
        if kpad is not None:
            kpad = kpad.expand(*lead, n)
            s_rem = s_rem.masked_fill(kpad, _NEG_INF)
        with torch.no_grad():
            G = _finite_or_zero(s_rem.amax(dim=-1, keepdim=True))  # (..., 1)
        wk = exp_diff(s_rem, G, cdt)  # (..., n): 0 for sinks
        # key weights folded into the key features once: they serve the global sum and the window
        inplace = not (torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v1, fq, fk, wk)))
        # without autograd, features this call owns are scaled in place (a fresh (n, F) buffer costs
        # page faults on CPU, see `kernelapprox.attention.linear.parallel`)
        fresh = inplace and feature_map.key_features_recyclable() and fk.is_contiguous() and fq.is_contiguous()
        if fresh and fk.shape == (*lead, n, Fd) and fq.shape == (*lead, n, Fd):
            fkw_all = fk.mul_(wk.unsqueeze(-1))  # (..., n, F), rows of sinks zero
        else:
            fresh = False
            fkw_all = fk * wk.unsqueeze(-1)
        T = torch.matmul(fkw_all.mT, v1)  # (..., F, dv1)
        base = sq + G  # (..., n): log of the feature part's scale

    shifts = [base.detach()]
    h = min(w - 1, n - 1)
    if h >= 0:
        Cb = min(C, n)
        nb = -(-n // Cb)
        L = Cb + 2 * h
        tail = nb * Cb - n
        back = tail + h

        def blocks(x: torch.Tensor) -> torch.Tensor:  # (..., n, c) -> (..., nb, Cb, c)
            return (F.pad(x, (0, 0, 0, tail)) if tail else x).reshape(*lead, nb, Cb, x.shape[-1])

        def windows(x: torch.Tensor) -> torch.Tensor:  # (..., n, c) -> (..., nb, L, c), overlapping
            if h > Cb or tail:
                return F.pad(x, (0, 0, h, back)).unfold(-2, L, Cb).transpose(-1, -2)
            # written once into a contiguous buffer: the tail of the previous block, the block, the
            # head of the next one (no padded copy, and the GEMMs need no copy of their own)
            xb = x.reshape(*lead, nb, Cb, x.shape[-1])
            out = x.new_empty(*lead, nb, L, x.shape[-1])
            out[..., h:h + Cb, :] = xb
            if h:
                out[..., 1:, :h, :] = xb[..., :-1, Cb - h:, :]
                out[..., 0, :h, :] = 0
                out[..., :-1, h + Cb:, :] = xb[..., 1:, :h, :]
                out[..., -1, h + Cb:, :] = 0
            return out

        t = torch.arange(Cb, device=dev)[:, None]
        col = torch.arange(L, device=dev)[None, :]
        pos = torch.arange(nb, device=dev)[:, None] * Cb - h + torch.arange(L, device=dev)[None, :]
        outside = ~(((col >= t) & (col <= t + 2 * h))[None] & ((pos >= 0) & (pos < n))[:, None, :])  # (nb, Cb, L)
        if kpad is not None:  # padded keys out of the window too: (..., nb, Cb, L)
            outside = outside | (windows(kpad.unsqueeze(-1).to(cdt))[..., 0] > 0).unsqueeze(-2)
        logits = torch.matmul(blocks(q), windows(k).mT)  # (..., nb, Cb, L)
        logits = logits.masked_fill_(outside, _NEG_INF) if inplace else logits.masked_fill(outside, _NEG_INF)
        wmax = logits.detach().amax(-1).reshape(*lead, nb * Cb)[..., :n].double()
        shifts.append(wmax)
    if sink_idx:
        sidx = torch.tensor(sink_idx, device=dev)
        slog = torch.matmul(q, k[..., sidx, :].mT)  # (..., n, s)
        i = torch.arange(n, device=dev)[:, None]
        active = (i - sidx[None, :]).abs() >= w  # (n, s): outside the window
        if kpad is not None:
            active = active & ~kpad[..., sidx].unsqueeze(-2)  # (..., n, s)
        slog = slog.masked_fill(~active, _NEG_INF)
        shifts.append(slog.detach().amax(-1).double())
    m = shifts[0]
    for s_ in shifts[1:]:
        m = torch.maximum(m, s_)
    m = _finite_or_zero(m)  # a row without any key (all padded): weights 0, not NaN
    # a window that covers every key leaves no remainder: the feature part (global sum minus the
    # window, zero up to rounding) is skipped, so that the result is softmax attention to rounding
    full = h >= n - 1
    a = exp_diff(base, m, cdt)  # (..., n): weight of the feature part
    fqa = fq.mul_(a.unsqueeze(-1)) if fresh else fq * a.unsqueeze(-1)
    out = torch.zeros_like(fqa[..., :dv + 1]) if full else torch.matmul(fqa, T)
    if h >= 0:
        mb = blocks(m.to(cdt).unsqueeze(-1))
        # A = exp(logits - m) - (a phi(q)) (w phi(k))^T on the window, 0 elsewhere
        if full:
            A = torch.exp(logits - mb)
        elif inplace and h <= Cb and not tail:
            # the feature scores against the previous block's tail, the block and the next block's
            # head, read in place from the blocks of (w phi(K)) (no windowed copy of the features)
            # In the flattened batch of blocks the neighbours are one entry away, so one GEMM on
            # views serves every block; where that pairs a sequence's first (last) block with another
            # sequence's, the columns are outside the window (positions < 0 or >= n) and masked.
            A = logits.sub_(mb).exp_()
            A3 = A.view(-1, Cb, L)
            fq3 = fqa.reshape(-1, Cb, Fd)
            fk3 = fkw_all.reshape(-1, Cb, Fd)
            A3[:, :, h:h + Cb] -= torch.bmm(fq3, fk3.mT)
            if h and A3.shape[0] > 1:
                A3[1:, :, :h] -= torch.bmm(fq3[1:], fk3[:-1, Cb - h:, :].mT)
                A3[:-1, :, h + Cb:] -= torch.bmm(fq3[:-1], fk3[1:, :h, :].mT)
            A.masked_fill_(outside, 0.0)
        elif inplace:
            A = logits.sub_(mb).exp_()
            A.view(-1, Cb, L).baddbmm_(blocks(fqa).reshape(-1, Cb, Fd), windows(fkw_all).reshape(-1, L, Fd).mT,
                                       alpha=-1.0)
            A.masked_fill_(outside, 0.0)
        else:
            A = (torch.exp(logits - mb) - torch.matmul(blocks(fqa), windows(fkw_all).mT)).masked_fill(outside, 0.0)
        out = out + torch.matmul(A, windows(v1)).reshape(*lead, nb * Cb, dv + 1)[..., :n, :]
    if sink_idx:
        out = out + torch.matmul(torch.exp(slog - m.unsqueeze(-1).to(cdt)), v1[..., sidx, :])
    res = normalise(out[..., :dv], out[..., dv:], feature_map.positive, eps)
    if not feature_map.positive:
        # the magnitudes that cancel in the global sum minus the window's feature terms
        bound = None
        if not (full or h < 0):
            with torch.no_grad():
                bound = torch.matmul(fqa.abs(), fkw_all.abs().sum(dim=-2).unsqueeze(-1))[..., 0]
        reached = None if kpad is None else (~kpad).any(dim=-1, keepdim=True)
        if _host_checks(q):
            warn_signed_rows(out[..., dv], eps, feature_map, "non-causal", reached, bound)
        else:
            res = lost_rows_to_nan(res, out[..., dv], feature_map, eps, causal=False, reached=reached, bound=bound)
    return res.to(out_dtype)


def _block_core(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, feature_map: FeatureMap, c: int, sink_idx: tuple[int, ...],
    causal: bool, eps: float, out_dtype: torch.dtype, cdt: torch.dtype, kpad: torch.Tensor | None,
) -> torch.Tensor:
    r"""Hybrid attention with a block-aligned window (``window_mode="block"``, block size ``c``; see
    `hybrid_attention`). The remainder of block $b$ is a sum of the per-block feature sums $T_{b'}$
    (`_block_remainder`): non-causal over $|b - b'| \ge 2$, the global sum minus three block sums at
    one global scale; causal over $b' \le b - 2$, a running sum at the running maximum of the
    blocks' key scales (so that output $i$ depends on positions $\le i$ only)."""
    n, dv = q.shape[-2], v.shape[-1]
    dev = q.device
    with inputs_validated():
        fq, sq = feature_map.log_features(q)
        fk, sk = feature_map.key_log_features(k)
    lead = broadcast_shapes(fq.shape[:-2], fk.shape[:-2], v.shape[:-2], q.shape[:-2])
    dv1 = dv + 1
    nb = -(-n // c)
    N = nb * c
    tail = N - n
    grad = torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v, fq, fk))
    poison = None
    if causal:  # non-finite values: finite products only, rows from the first bad value on set to NaN
        v = v.expand(*lead, n, dv)
        v_bad = ~torch.isfinite(v)
        poison = torch.cumsum(v_bad.to(torch.int32), dim=-2) > 0
        v = v.masked_fill(v_bad, 0.0)

    def aligned(x: torch.Tensor, fill: float = 0.0) -> torch.Tensor:  # (..., n, e) -> (*lead, nb, c, e)
        if tail:
            x = F.pad(x, (0, 0, 0, tail), value=fill)
        return x.expand(*lead, N, x.shape[-1]).reshape(*lead, nb, c, x.shape[-1])

    is_sink = torch.zeros(n, dtype=torch.bool, device=dev)
    if sink_idx:
        is_sink[list(sink_idx)] = True
    s_rem = sk.expand(*lead, n).double().masked_fill(is_sink, _NEG_INF)
    if kpad is not None:
        kpad = kpad.expand(*lead, n)
        s_rem = s_rem.masked_fill(kpad, _NEG_INF)
    s_b = aligned(s_rem.unsqueeze(-1), _NEG_INF)[..., 0]  # (*lead, nb, c)
    with torch.no_grad():
        g = s_b.detach().amax(-1)  # (*lead, nb): largest remainder key scale of each block
        if causal:
            Gk = torch.cummax(g, dim=-1).values  # scale of the running sum after block b
            G_read = F.pad(Gk, (2, 0), value=_NEG_INF)[..., :nb]  # block b reads the sum after b - 2
        else:
            Gk = _finite_or_zero(g.amax(-1, keepdim=True)).expand(*lead, nb)
            G_read = Gk
    v1b = aligned(with_ones(v))  # (*lead, nb, c, dv1)
    logdom = feature_map.positive and not causal
    if logdom:  # per-feature log-domain shifts (`shift_per_feature`): no underflow of the remainder
        lq, lk = log_features_pair(feature_map, q, k)
        Fd = lq.shape[-1]
        drop = is_sink if kpad is None else is_sink | kpad
        fq, psk, s_q = shift_per_feature(lq.expand(*lead, n, Fd), lk.expand(*lead, n, Fd), drop)
        fq = fq.to(cdt)
        T = torch.matmul(aligned(psk.to(cdt)).mT, v1b)  # (*lead, nb, F, dv1)
    else:
        wk = exp_diff(s_b, Gk.unsqueeze(-1), cdt).unsqueeze(-1)  # key weights at their block's scale
        T = torch.matmul(aligned(fk).mT, v1b * wk)  # (*lead, nb, F, dv1)
    R = _block_remainder(T, Gk, causal, grad, cdt) if nb > 2 else None
    # exact part: per block, dense products against the block itself, the previous block and (non-causal)
    # the next one. In the flattened batch of blocks the neighbours are one entry away, so each is one
    # GEMM on views (no copy of the keys or values); pairs that cross from one sequence to the next
    # are masked.
    nf = math.prod(lead) * nb
    q3 = aligned(q).reshape(nf, c, -1)
    k3 = aligned(k).reshape(nf, c, -1)
    v3 = v1b.reshape(nf, c, dv1)
    kpos = torch.arange(N, device=dev).reshape(nb, c) < n  # keys inside the sequence
    valid = kpos.expand(*lead, nb, c)
    if kpad is not None:
        valid = valid & ~aligned(kpad.unsqueeze(-1), True)[..., 0]
    valid = valid.reshape(nf, 1, c)
    first = (torch.arange(nf, device=dev) % nb == 0).reshape(nf, 1, 1)  # blocks without a previous one
    cur = torch.bmm(q3, k3.mT)
    cur_out = ~valid
    if causal:
        cur_out = cur_out | ~torch.ones(c, c, dtype=torch.bool, device=dev).tril()
    prev = torch.bmm(q3[1:], k3[:-1].mT)
    prev_out = ~valid[:-1] | first[1:]
    parts = [(cur, cur_out, slice(None), slice(None))]
    parts.append((prev, prev_out, slice(1, None), slice(None, -1)))
    if not causal:
        nxt = torch.bmm(q3[:-1], k3[1:].mT)
        last = (torch.arange(nf, device=dev) % nb == nb - 1).reshape(nf, 1, 1)
        parts.append((nxt, ~valid[1:] | last[:-1], slice(None, -1), slice(1, None)))
    if logdom:
        base = aligned(s_q.unsqueeze(-1))[..., 0]  # (*lead, nb, c)
    else:
        base = aligned(sq.expand(*lead, n).double().unsqueeze(-1))[..., 0] + G_read.unsqueeze(-1)  # (*lead, nb, c)
    m = base.reshape(nf, c)
    masked = []
    dense = kpad is None and not tail  # only whole blocks are masked: index them, no full-size mask
    for i, (x, out_mask, rows, _) in enumerate(parts):
        if dense and i > 0:
            drop = (first[1:] if i == 1 else last[:-1]).reshape(-1)
            # the pairs that cross sequences: rows nb - 1, 2 nb - 1, ... of both neighbour products
            # (indices from the shapes, no device read)
            x = x.masked_fill(drop[:, None, None], _NEG_INF) if grad else x.index_fill_(
                0, torch.arange(nb - 1, nf - 1, nb, device=dev), _NEG_INF)
        elif not (dense and not causal):  # the block itself needs no mask when dense and non-causal
            x = x.masked_fill(out_mask, _NEG_INF) if grad else x.masked_fill_(out_mask, _NEG_INF)
        masked.append(x)
        mx = torch.full_like(m, _NEG_INF)
        mx[rows] = x.detach().amax(-1).double() if x.shape[0] else mx[rows]
        m = torch.maximum(m, mx)
    m = m.reshape(*lead, nb, c)
    if sink_idx:
        sidx = torch.tensor(sink_idx, device=dev)
        slog = torch.matmul(q, k[..., sidx, :].mT)  # (..., n, s)
        bdist = torch.arange(n, device=dev)[:, None] // c - sidx[None, :] // c
        active = bdist >= 2 if causal else bdist.abs() >= 2  # outside the block window
        if kpad is not None:
            active = active & ~kpad[..., sidx].unsqueeze(-2)
        slog = slog.masked_fill(~active, _NEG_INF).expand(*lead, n, len(sink_idx))
        m = torch.maximum(m, aligned(slog.detach().amax(-1, keepdim=True).double(), _NEG_INF)[..., 0])
    m = _finite_or_zero(m)  # a row without any key (all padded): weights 0, not NaN
    mc = m.to(cdt).reshape(nf, c, 1)
    out = None
    for x, (_, _, rows, keys) in zip(masked, parts, strict=True):
        A = torch.exp(x - mc[rows]) if grad else x.sub_(mc[rows]).exp_()
        if out is None:
            out = torch.bmm(A, v3)
        elif grad:
            pad = (0, 0, 0, 0, 1, 0) if rows.start == 1 else (0, 0, 0, 0, 0, 1)
            out = out + F.pad(torch.bmm(A, v3[keys]), pad)
        else:
            out[rows].baddbmm_(A, v3[keys])
    out = cast(torch.Tensor, out).reshape(*lead, nb, c, dv1)
    if R is not None:
        lin = torch.matmul(aligned(fq), R) * exp_diff(base, m, cdt).unsqueeze(-1)
        out = out + lin if grad else out.add_(lin)
    out = out.reshape(*lead, N, dv1)[..., :n, :]
    if sink_idx:
        ms = m.reshape(*lead, N)[..., :n].to(cdt).unsqueeze(-1)
        out = out + torch.matmul(torch.exp(slog - ms), with_ones(v).expand(*lead, n, dv1)[..., sidx, :])
    num = out[..., :dv]
    if poison is not None:
        num = num.masked_fill(poison, float("nan"))
    reached = None
    if kpad is not None:  # rows without a valid key: 0 / 0, not an underflow
        reached = torch.cumsum((~kpad).to(torch.int32), dim=-1) > 0 if causal else (~kpad).any(dim=-1, keepdim=True)
    bound = None
    if not feature_map.positive and not causal and R is not None:
        # the magnitudes that cancel in the global sum minus three blocks
        with torch.no_grad():
            zabs = (aligned(fk).abs() * wk).sum(dim=(-3, -2))[..., None, :, None]  # (*lead, 1, F, 1)
            bound = torch.matmul(aligned(fq).abs(), zabs)[..., 0] * exp_diff(base, m, cdt)
            bound = bound.reshape(*lead, N)[..., :n]
    if not feature_map.positive and _host_checks(q):
        warn_signed_rows(out[..., dv], eps, feature_map, "causal block window" if causal else "block window",
                         reached, bound)
    res = normalise(num, out[..., dv:], feature_map.positive, eps)
    if causal and _rescue_on(feature_map, q):
        low = underflowed_rows(out[..., dv], reached)
        fixed = rescue_rows(res, low, lead, feature_map, q, k, v, window=c, block=True, sinks=sink_idx, pad=kpad)
        if fixed is not res and poison is not None:
            fixed = fixed.masked_fill(poison, float("nan"))
        res = fixed
    elif not _host_checks(q):  # no host read: the rows it would rescue or warn about are NaN
        res = lost_rows_to_nan(res, out[..., dv], feature_map, eps, causal=causal, reached=reached, bound=bound)
    return res.to(out_dtype)


def _block_remainder(T: torch.Tensor, Gk: torch.Tensor, causal: bool, grad: bool, cdt: torch.dtype) -> torch.Tensor:
    r"""Remainder sums of the blocks, (..., nb, F, dv1), from the block sums ``T`` (..., nb, F, dv1)
    at the scales ``Gk`` (..., nb).

    Non-causal (one scale): $\sum_b T_b - T_{b-1} - T_b - T_{b+1}$, whole-tensor operations (the
    subtraction leaves a rounding of order $\epsilon\,\varphi(q_i)^\top\sum_j\varphi(k_j)/\hat D_i$,
    as the token window's). Causal: $\sum_{b' \le b - 2} T_{b'}$ at the scale ``Gk[b - 2]``, a
    running sum (the sum after block $b$ is that after $b - 1$ rescaled by $e^{G_{b-1} - G_b}$, plus
    $T_b$), no cancellation.
    """
    nb = T.shape[-3]
    if not causal:
        total = T.sum(dim=-3, keepdim=True)
        if grad:
            return (total - T - F.pad(T[..., :-1, :, :], (0, 0, 0, 0, 1, 0))
                    - F.pad(T[..., 1:, :, :], (0, 0, 0, 0, 0, 1)))
        R = torch.sub(total, T)
        R[..., 1:, :, :] -= T[..., :-1, :, :]
        R[..., :-1, :, :] -= T[..., 1:, :, :]
        return R
    decay = exp_diff(Gk[..., :-1], Gk[..., 1:], cdt)[..., None, None]  # (..., nb - 1, 1, 1)
    if grad:  # out-of-place, for autograd
        zero = torch.zeros_like(T[..., 0, :, :])
        acc, pre = zero, [zero, zero]
        for b in range(nb - 2):
            acc = T[..., 0, :, :] if b == 0 else acc * decay[..., b - 1, :, :] + T[..., b, :, :]
            pre.append(acc)
        return torch.stack(pre, dim=-3)
    R = torch.empty_like(T)  # the same running sum written in place, one operation per block
    R[..., :2, :, :] = 0
    R[..., 2, :, :] = T[..., 0, :, :]
    for b in range(3, nb):
        torch.addcmul(T[..., b - 2, :, :], R[..., b - 1, :, :], decay[..., b - 3, :, :], out=R[..., b, :, :])
    return R


def _causal_core(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, feature_map: FeatureMap, w: int, C: int,
    sink_idx: tuple[int, ...], eps: float, out_dtype: torch.dtype, cdt: torch.dtype,
    initial_state: HybridAttentionState | None, return_state: bool, kpad: torch.Tensor | None = None,
) -> torch.Tensor | tuple[torch.Tensor, HybridAttentionState]:
    """Causal hybrid attention on the extended sequence [state's buffer, new tokens] (see
    `chunk_hybrid_attention`); ``kpad`` (..., n) True = padded new key."""
    n, d, dv = q.shape[-2], q.shape[-1], v.shape[-1]
    dev = q.device
    t0 = 0
    b = 0  # buffered keys before the new ones
    ext_sinks: list[int] = []  # positions (extended coordinates) of sinks among the keys
    kv0 = G0 = None
    out_sk = out_sv = None  # sinks that left the window before this call (always exact)
    if initial_state is not None:
        st = initial_state
        t0 = st.position
        b = min(w, t0)
        lead0 = broadcast_shapes(q.shape[:-2], k.shape[:-2], v.shape[:-2], st.kv.shape[:-2])
        if b:
            slots = [p % w for p in range(t0 - b, t0)]
            kb = st.keys[..., slots, :].to(cdt)
            vb = st.values[..., slots, :].to(cdt)
            k = torch.cat((kb.expand(*lead0, b, d), k.expand(*lead0, n, d)), dim=-2)
            v = torch.cat((vb.expand(*lead0, b, dv), v.expand(*lead0, n, dv)), dim=-2)
        old = [u for u, p in enumerate(st.sink_positions) if p < t0 - b]
        ext_sinks += [p - (t0 - b) for p in st.sink_positions if p >= t0 - b]
        if old:
            out_sk = st.sink_keys[..., old, :].to(cdt)
            out_sv = st.sink_values[..., old, :].to(cdt)
        kv0, G0 = shared_scale(st)
        kv0 = kv0.to(cdt)
        G0 = G0.detach().double().reshape(*G0.shape[:-2], 1)
    ext_sinks += [p - t0 + b for p in sink_idx if t0 <= p < t0 + n]
    ne = b + n  # extended length
    with inputs_validated():
        fq, sq = feature_map.log_features(q)
        fk, sk = feature_map.key_log_features(k)
    lead = broadcast_shapes(fq.shape[:-2], fk.shape[:-2], v.shape[:-2], q.shape[:-2])
    Fd = fq.shape[-1]
    q = q.expand(*lead, n, d)
    k = k.expand(*lead, ne, d)
    fq = fq.expand(*lead, n, Fd)
    fk = fk.expand(*lead, ne, Fd)
    sq = sq.expand(*lead, n).double()
    sk = sk.expand(*lead, ne).double()
    v = v.expand(*lead, ne, dv)
    # Non-finite values: the products use finite values only (a masked 0 times NaN would reach
    # earlier rows), and every row from the first non-finite value of a column on is set to NaN.
    v_bad = ~torch.isfinite(v)
    poison = (torch.cumsum(v_bad.to(torch.int32), dim=-2) > 0)[..., b:, :]
    v1 = with_ones(v.masked_fill(v_bad, 0.0))  # (..., ne, dv1)

    is_sink = torch.zeros(ne, dtype=torch.bool, device=dev)
    if ext_sinks:
        is_sink[ext_sinks] = True
    s_rem = sk.masked_fill(is_sink, _NEG_INF)
    if kpad is not None:
        kpad = F.pad(kpad.expand(*lead, n), (b, 0), value=False)  # (..., ne): buffered keys are real
        s_rem = s_rem.masked_fill(kpad, _NEG_INF)
    wl = min(w, ne)  # lag of the remainder
    # Remainder of query e = b + t: keys e' <= e - w (extended coordinates), i.e. causal linear
    # attention against the key sequence delayed by w.
    s_lag = F.pad(s_rem, (wl, 0), value=_NEG_INF)[..., b:b + n]
    fk_lag = F.pad(fk, (0, 0, wl, 0))[..., b:b + n, :]
    v1_lag = F.pad(v1, (0, 0, wl, 0))[..., b:b + n, :]
    dv1 = dv + 1
    nc = -(-n // C)
    pad = nc * C - n
    s_lag = F.pad(s_lag, (0, pad), value=_NEG_INF)
    with torch.no_grad():
        sd = s_lag.detach()
        if G0 is not None:
            sd = torch.cat((G0.expand(*lead, 1), sd), dim=-1)
            M = torch.cummax(sd, dim=-1).values[..., 1:]
        else:
            M = torch.cummax(sd, dim=-1).values  # (..., nc*C): running max of the remainder scales
    M = M.reshape(*lead, nc, C)
    s_lag = s_lag.reshape(*lead, nc, C)
    fqc = F.pad(fq, (0, 0, 0, pad)).reshape(*lead, nc, C, Fd)
    fkc = F.pad(fk_lag, (0, 0, 0, pad)).reshape(*lead, nc, C, Fd)
    v1c = F.pad(v1_lag, (0, 0, 0, pad)).reshape(*lead, nc, C, dv1)
    G_end = M[..., -1]  # (..., nc): scale of the state after each chunk
    G_start = torch.cat(((G0 if G0 is not None else M.new_full((*lead, 1), _NEG_INF)).expand(*lead, 1),
                         G_end[..., :-1]), dim=-1)
    kv_c = torch.matmul(fkc.mT, v1c * exp_diff(s_lag, G_end.unsqueeze(-1), cdt).unsqueeze(-1))
    decay = exp_diff(G_start, G_end, cdt)  # (..., nc)
    S = fq.new_zeros(*lead, Fd, dv1) if kv0 is None else kv0.expand(*lead, Fd, dv1)
    if torch.is_grad_enabled() and any(t.requires_grad for t in (S, kv_c, decay)):
        states = []
        for c in range(nc):
            states.append(S)
            S = S * decay[..., c, None, None] + kv_c[..., c, :, :]
        S_in = torch.stack(states, dim=-3)  # (..., nc, F, dv1) at scales G_start
    else:  # the same recurrence written in place, into one buffer of chunk states
        S_in = kv_c.new_empty(*lead, nc + 1, Fd, dv1)
        S_in[..., 0, :, :] = S
        for c in range(nc):
            torch.mul(S_in[..., c, :, :], decay[..., c, None, None], out=S_in[..., c + 1, :, :])
            S_in[..., c + 1, :, :] += kv_c[..., c, :, :]
        S = S_in[..., nc, :, :]
        S_in = S_in[..., :nc, :, :]
    tril = torch.ones(C, C, dtype=torch.bool, device=dev).tril()
    # weights e^{s_j - M_i} of the intra-chunk keys, masked before the product too: a later key's
    # weight may overflow (M_i does not include it), and 0 * inf would turn gradients into NaN
    sj = s_lag.unsqueeze(-2).masked_fill(~tril, _NEG_INF)  # masked before the exponential
    E = exp_diff(sj, M.unsqueeze(-1), cdt)  # (..., nc, C_i, C_j)
    A = (torch.matmul(fqc, fkc.mT) * E).masked_fill(~tril, 0.0)
    lin = torch.matmul(fqc, S_in) * exp_diff(G_start.unsqueeze(-1), M, cdt).unsqueeze(-1)
    lin = (lin + torch.matmul(A, v1c)).reshape(*lead, nc * C, dv1)[..., :n, :]
    M = M.reshape(*lead, nc * C)[..., :n]
    base = sq + M  # log scale of the feature part

    shifts = [base.detach()]
    if wl >= 1:
        P = wl - 1
        L = C + P
        start = b - P  # extended position of column 0 of chunk 0
        front = max(0, -start)
        kp = F.pad(k, (0, 0, front, 0))[..., start + front:, :]
        v1p = F.pad(v1, (0, 0, front, 0))[..., start + front:, :]
        need = (nc - 1) * C + L
        kp = F.pad(kp, (0, 0, 0, max(0, need - kp.shape[-2])))[..., :need, :]
        v1p = F.pad(v1p, (0, 0, 0, max(0, need - v1p.shape[-2])))[..., :need, :]
        kw = kp.unfold(-2, L, C).transpose(-1, -2)  # (..., nc, L, d)
        v1w = v1p.unfold(-2, L, C).transpose(-1, -2)  # (..., nc, L, dv1)
        qc = F.pad(q, (0, 0, 0, pad)).reshape(*lead, nc, C, d)
        t = torch.arange(C, device=dev)[:, None]
        col = torch.arange(L, device=dev)[None, :]
        epos = b + torch.arange(nc, device=dev)[:, None] * C - P + col  # extended key positions
        mask = ((col >= t) & (col <= t + P))[None] & ((epos >= 0) & (epos < ne))[:, None, :]
        if kpad is not None:  # padded keys out of the window: (..., nc, C, L)
            kpp = F.pad(kpad, (front, 0), value=False)[..., start + front:]
            kpp = F.pad(kpp, (0, max(0, need - kpp.shape[-1])), value=False)[..., :need]
            mask = mask & ~kpp.unfold(-1, L, C).unsqueeze(-2)
        logits = torch.matmul(qc, kw.mT).masked_fill(~mask, _NEG_INF)
        shifts.append(logits.detach().amax(-1).reshape(*lead, nc * C)[..., :n].double())
    # sinks outside the window: those among the keys (e' <= e - w) and those before this call
    sk_keys, sk_vals, sk_mask = [], [], []
    if ext_sinks:
        sidx = torch.tensor(ext_sinks, device=dev)
        e = b + torch.arange(n, device=dev)[:, None]
        sk_keys.append(k[..., sidx, :])
        sk_vals.append(v1[..., sidx, :])
        act = e - sidx[None, :] >= max(wl, 1) if wl >= 1 else e - sidx[None, :] >= 0
        sk_mask.append(act if kpad is None else act & ~kpad[..., sidx].unsqueeze(-2))
    if out_sk is not None and out_sv is not None:
        sk_keys.append(out_sk.expand(*lead, *out_sk.shape[-2:]))
        sv = out_sv.expand(*lead, *out_sv.shape[-2:])
        sk_vals.append(with_ones(sv))
        sk_mask.append(torch.ones(n, out_sk.shape[-2], dtype=torch.bool, device=dev))
    if sk_keys:
        skk = torch.cat(sk_keys, dim=-2)
        skv = torch.cat(sk_vals, dim=-2)
        sk_mask = [a.expand(*lead, n, a.shape[-1]) for a in sk_mask] if kpad is not None else sk_mask
        active = torch.cat(sk_mask, dim=-1)
        slog = torch.matmul(q, skk.mT).masked_fill(~active, _NEG_INF)
        shifts.append(slog.detach().amax(-1).double())
    m = shifts[0]
    for s_ in shifts[1:]:
        m = torch.maximum(m, s_)
    m = _finite_or_zero(m)  # a row without any key (all padded): weights 0, not NaN
    out = lin * exp_diff(base, m, cdt).unsqueeze(-1)
    if wl >= 1:
        mc = F.pad(m, (0, pad)).reshape(*lead, nc, C, 1).to(cdt)
        ex = torch.exp(logits - mc)
        out = out + torch.matmul(ex, v1w).reshape(*lead, nc * C, dv1)[..., :n, :]
    if sk_keys:
        out = out + torch.matmul(torch.exp(slog - m.unsqueeze(-1).to(cdt)), skv)
    num = out[..., :dv].masked_fill(poison, float("nan"))
    reached = None
    if kpad is not None and t0 == 0:  # rows before the first valid key: 0 / 0, not an underflow
        reached = (torch.cumsum((~kpad).to(torch.int32), dim=-1) > 0)[..., b:]
    if not feature_map.positive and _host_checks(q):
        warn_signed_rows(out[..., dv], eps, feature_map, "causal", reached)
    res = normalise(num, out[..., dv:], feature_map.positive, eps)
    if not _host_checks(q):  # no host read: the rows it would rescue or warn about are NaN
        res = lost_rows_to_nan(res, out[..., dv], feature_map, eps, causal=True, reached=reached)
    elif _rescue_on(feature_map, q):
        rows = underflowed_rows(out[..., dv], reached)
        fixed = rescue_rows(
            res, rows, lead, feature_map, q, k, v.masked_fill(v_bad, 0.0), window=w, block=False,
            sinks=tuple(ext_sinks), pad=kpad,
            old_sinks=None if out_sk is None or out_sv is None else (out_sk, out_sv),
            state=None if initial_state is None else per_feature_scales(initial_state, cdt),
        )
        if fixed is not res:
            res = fixed.masked_fill(poison, float("nan"))
    res = res.to(out_dtype)
    if not return_state:
        return res
    # the state after the last token: keys <= t_end - w in the linear state, the last w in the buffer
    G_last = G_end[..., -1:].unsqueeze(-1)  # (..., 1, 1)
    kv = S
    if feature_map.positive:
        # positive maps: the linear state at per-feature scales, so that a later segment or a decoder
        # reads every feature, also those far below the largest. From the state at one scale where
        # every feature's mass is above the floor (then every lost term is below the smallest
        # normal number); else by one more product of the keys' log-features.
        kv, G_last = _per_feature_from_shared(S, G_last)
        redo = True
        if _host_checks(q):
            with torch.no_grad():
                redo = bool((S[..., dv] < den_floor(S.dtype)).any())  # the host read
        if redo:
            kv, G_last = per_feature_state(feature_map, k, v1, s_rem, ne - w, initial_state, cdt)
    return res, finish_state(kv, G_last, k, v, t0, b, n, w, sink_idx, initial_state, cdt)


def finish_state(
    kv: torch.Tensor, log_scale: torch.Tensor, k: torch.Tensor, v: torch.Tensor, t0: int, b: int, n: int, w: int,
    sink_idx: tuple[int, ...], initial_state: HybridAttentionState | None, cdt: torch.dtype,
) -> HybridAttentionState:
    r"""The state after a causal segment of ``n`` tokens from position ``t0``: the linear part
    ``kv`` at ``log_scale``, the ring buffer of the last $\min(w, t_0 + n)$ keys and values of
    the extended sequence ``k`` (*lead, b + n, d), ``v`` (*lead, b + n, dv) (``b`` buffered keys
    before the new ones; the key of position $p$ in slot $p \bmod w$, one gather), and the sinks:
    the state's and the new ones among ``sink_idx`` (absolute positions)."""
    lead, d, dv = k.shape[:-2], k.shape[-1], v.shape[-1]
    dev = k.device
    t_end = t0 + n
    # the ring buffer holds the last min(w, t_end) keys, the key of position p in slot p mod w
    # (sized by the tokens seen, not by the window); one gather, no loop
    size = min(w, t_end)
    pos = torch.arange(t_end - size, t_end, device=dev)
    order = torch.argsort(pos % w) if size else pos
    src = (pos - t0 + b)[order]
    keys = k.index_select(-2, src)
    vals = v.index_select(-2, src)
    pos_all = [] if initial_state is None else list(initial_state.sink_positions)
    sk_list = [] if initial_state is None else [initial_state.sink_keys.to(cdt).expand(*lead, -1, d)]
    sv_list = [] if initial_state is None else [initial_state.sink_values.to(cdt).expand(*lead, -1, dv)]
    new = [p for p in sink_idx if t0 <= p < t_end]
    if new:
        ids = [p - t0 + b for p in new]
        sk_list.append(k[..., ids, :])
        sv_list.append(v[..., ids, :])
        pos_all += new
    sink_k = torch.cat(sk_list, dim=-2) if sk_list else k.new_zeros(*lead, 0, d)
    sink_v = torch.cat(sv_list, dim=-2) if sv_list else v.new_zeros(*lead, 0, dv)
    return HybridAttentionState(kv, log_scale, keys, vals, sink_k, sink_v, tuple(pos_all), t_end, w)


def _host_checks(q: torch.Tensor) -> bool:
    """Whether a call may read a value on the host to check its rows: on the CPU, in eager mode."""
    return q.device.type == "cpu" and not torch.compiler.is_compiling()


def _rescue_on(feature_map: FeatureMap, q: torch.Tensor) -> bool:
    """Whether a causal call checks its rows for an underflowed normaliser (`rescue_rows`): positive
    maps on the CPU, in eager mode (the check reads one value on the host)."""
    return feature_map.positive and _host_checks(q)


def _per_feature_from_shared(S: torch.Tensor, G: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    r"""A linear state ``S`` (..., F, dv + 1) at one scale ``G`` (..., 1, 1) as one at per-feature
    scales: ``(S / z_f, G + log z_f)``, the scales (..., F, 1) float64 (0 where $z_f = 0$, ``S`` 0
    there). ``S`` keeps its gradient."""
    with torch.no_grad():
        z = S[..., -1].detach().double()  # (..., F)
        X = G.detach().double().squeeze(-1) + torch.log(z.clamp(min=0.0))
        X = torch.where(z > 0, X, torch.zeros_like(X))
        inv = torch.where(z > 0, 1.0 / z, torch.zeros_like(z))
    return (S.double() * inv.unsqueeze(-1)).to(S.dtype), X.unsqueeze(-1)


def per_feature_state(
    fm: FeatureMap, k: torch.Tensor, v1: torch.Tensor, s_rem: torch.Tensor, upto: int,
    initial_state: HybridAttentionState | None, cdt: torch.dtype, key_logs: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    r"""The linear state of the keys ``k[..., :upto, :]`` (..., ne, d) outside the sinks and padding
    (``s_rem`` (..., ne) ``-inf`` there) and of ``initial_state``, at per-feature scales:
    ``kv`` (..., F, dv + 1) $= \sum_j e^{\log\psi_f(k_j) - t_f}[v_j, 1]$ plus the state's part,
    and ``log_scale`` (..., F, 1) $= t_f$, the largest $\log\psi_f$ (float64, 0 where no key
    reached the feature). ``key_logs`` (..., ne, F): the keys' natural-log features
    (`key_log_features`) where the caller has them, else computed here."""
    m = max(upto, 0)
    lead, dv1 = v1.shape[:-2], v1.shape[-1]
    st = None if initial_state is None else per_feature_scales(initial_state, cdt)
    t = torch.full((*lead, fm.feature_dim), _NEG_INF, dtype=torch.float64, device=k.device)
    lk = None
    if m:
        lk = key_log_features(fm, k[..., :m, :]) if key_logs is None else key_logs[..., :m, :]
        lk = lk.to(cdt)  # (..., m, F)
        lk = lk.masked_fill((s_rem[..., :m] == _NEG_INF).unsqueeze(-1), _NEG_INF)
        t = torch.maximum(t, lk.detach().amax(dim=-2).double())
    if st is not None:
        t = torch.maximum(t, st[1])
    t = _finite_or_zero(t)
    kv = v1.new_zeros(*lead, fm.feature_dim, dv1)
    if lk is not None:
        kv = kv + torch.matmul(exp_diff(lk, t.unsqueeze(-2).to(cdt), cdt).mT, v1[..., :m, :])
    if st is not None:
        kv = kv + exp_diff(st[1], t, cdt).unsqueeze(-1) * st[0]
    return kv, t.unsqueeze(-1)


def check_hybrid_state(
    state: object, fm: FeatureMap, w: int, d: int, dv: int, sinks: CausalSinks | None = None,
    name: str = "initial_state",
) -> HybridAttentionState:
    """``state`` checked against the call: its own consistency (`HybridAttentionState.validate`),
    the window, the widths, and (with ``sinks``) the sinks it stored: those of ``sinks`` before its
    position, else a continuation with other sinks."""
    if not isinstance(state, HybridAttentionState):
        raise TypeError(f"{name} must be a HybridAttentionState, got {type(state).__name__}")
    state.validate()
    if state.window != w:
        raise ValueError(f"{name} was built with window={state.window}, got window={w}")
    if tuple(state.kv.shape[-2:]) != (fm.feature_dim, dv + 1):
        raise ValueError(
            f"{name} has kv of shape {tuple(state.kv.shape)}, expected (..., {fm.feature_dim}, {dv + 1}) "
            "= (..., feature_dim, dv + 1)"
        )
    if state.keys.shape[-1] != d or state.values.shape[-1] != dv:
        raise ValueError(
            f"{name} holds keys of dimension {state.keys.shape[-1]} and values of {state.values.shape[-1]}, "
            f"expected {d} and {dv}"
        )
    if sinks is not None:
        expect = sinks.within(0, state.position)
        if tuple(state.sink_positions) != expect:
            raise ValueError(
                f"{name} was built with other sinks: it stored sinks at positions {state.sink_positions} before "
                f"position {state.position}, the sinks given place them at {expect}"
            )
    return state


def state_batch(state: HybridAttentionState, lead: torch.Size, name: str = "initial_state") -> None:
    """Refuse a state whose batch dimensions do not broadcast to ``lead`` (the call's)."""
    for field in ("kv", "keys", "values", "sink_keys", "sink_values"):
        shape = getattr(state, field).shape[:-2]
        try:
            ok = broadcast_shapes(shape, lead) == lead
        except RuntimeError:
            ok = False
        if not ok:
            raise ValueError(
                f"{name} holds a batch of shape {tuple(shape)} ({field}), which does not match the inputs' batch "
                f"{tuple(lead)}: a state continues the sequences it was built from"
            )


@no_autocast
def chunk_hybrid_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    feature_map: FeatureMap,
    *,
    window: int,
    sinks: int | Sequence[int] = 0,
    chunk_size: int = 64,
    initial_state: HybridAttentionState | None = None,
    return_state: bool = False,
    eps: float = 1e-6,
    key_padding_mask: torch.Tensor | None = None,
) -> torch.Tensor | tuple[torch.Tensor, HybridAttentionState]:
    r"""Causal hybrid attention, chunked: exact on $0 \le i - j < w$ and the sinks, $\varphi$ on $j \le i - w$.

    The remainder of query $i$ is the prefix $j \le i - w$ (sinks left out): causal linear
    attention against the keys delayed by $w$ positions, computed chunk-wise (an intra-chunk
    masked product plus a carried $F \times (d_v + 1)$ state, [Kat20]_); the window is one
    masked score block per chunk against the ``chunk_size + w - 1`` keys that end with it:

    $$
    [\hat N_i, \hat D_i] = \sum_{0 \le i-j < w} e^{q_i^\top k_j}[v_j, 1]
    + \sum_{j\in\Sigma,\, j \le i - w} e^{q_i^\top k_j}[v_j, 1]
    + \varphi(q_i)^\top \sum_{j \le i-w,\, j\notin\Sigma} \varphi(k_j)[v_j, 1]^\top .
    $$

    Stabilisation is causal: query $i$'s shift uses key scales of positions $\le i$ only
    (the running maximum), so output $i$ depends on positions $\le i$ only, also for
    non-finite inputs (a NaN at position $j$ reaches rows $\ge j$). Cost
    $O(nF(d + d_v) + nC(F + d_v) + n(C + w)(d + d_v))$, memory linear in ``n`` (autograd
    keeps one $F \times (d_v + 1)$ state per chunk).

    No row underflows (positive maps, CPU, eager mode): the shift
    $m_i \ge s(q_i) + G_i$ bounds the remainder from above, and for a map whose query and key
    features peak at different features (fitted FAVOR++/FAVOR#/SDERF at large norms) the bound
    can exceed the row's whole mass by hundreds of nats, so that every weight underflows. The
    rows whose denominator under $m_i$ is below `kernelapprox.attention._common.den_floor`
    ($2.3\cdot10^{-13}$ in float32; above it, every lost term is below the smallest normal
    number) are recomputed, in the sequences that hold one, with every feature at its own scale
    in the log domain (`kernelapprox.attention.hybrid.rescue`; denominator $\ge 1$,
    differentiable). One host read per call; the other rows are unchanged, bitwise. On other
    devices and under ``torch.compile`` there is no host read: the torch forms return those rows
    NaN (`kernelapprox.attention.hybrid.rescue.lost_rows_to_nan`), and on an accelerator
    `hybrid_attention` sends the causal calls of positive maps, with or without a state, to
    `kernelapprox.attention.hybrid.flex.flex_hybrid_attention` instead (per feature at every norm;
    `kernelapprox.backends.hybrid_path`), and so does ``torch.compile`` on the CPU (its window
    term in plain torch). With
    ``return_state``, a positive map's linear state is returned at per-feature scales
    (``log_scale`` (..., F, 1); one more product of the keys), so that a continuation or a
    decoder reads every feature. Signed maps: a `kernelapprox.KernelApproxWarning` where the
    ``eps`` guard changes a row.

    Parameters
    ----------
    q, k : Tensor, shape (..., n, d)
    v : Tensor, shape (..., n, dv)
    feature_map : FeatureMap
    window : int
        Keys with $0 \le i - j < w$ are exact (``0``: none, plain causal linear attention).
    sinks : int or sequence of int, default 0
        Absolute positions ``>= 0`` (`resolve_sinks`; positions after this segment are allowed
        and apply to the segments that reach them); with ``initial_state``, positions continue
        its count (the first new token is ``initial_state.position``).
    chunk_size : int, default 64
    initial_state : HybridAttentionState, optional
        State after a preceding segment (from ``return_state=True`` or
        `RecurrentHybridAttention`), continued here; built with the same ``window`` and sinks.
    return_state : bool, default False
        Also return the state after the last token (not with ``key_padding_mask``: the state's
        window buffer would hold the padded keys).
    eps : float, default 1e-6
    key_padding_mask : Tensor, shape (batch, n), optional
        ``True`` (or ``-inf``) where a key of this segment is padding: left out of the window,
        the sinks and the remainder.

    Returns
    -------
    out : Tensor, shape (..., n, dv), dtype ``promote(q, k, v)``
    state : HybridAttentionState, if ``return_state``

    Examples
    --------
    >>> import kernelapprox as ka
    >>> q, k, v = torch.randn(3, 1, 40, 8).unbind(0)
    >>> v[0, 30, 0] = float("nan")
    >>> out = chunk_hybrid_attention(q / 2, k / 2, v, ka.PositiveRF(8, 16, seed=0), window=8, chunk_size=16)
    >>> bool(out[0, :30].isfinite().all()), bool(out[0, 30:, 0].isnan().all())
    (True, True)
    """
    q, k, v, out_dtype, cdt, w, C, kpad = prepare_hybrid(q, k, v, feature_map, window, sinks, chunk_size, True,
                                                   key_padding_mask)
    if not isinstance(return_state, bool):
        raise TypeError(f"return_state must be a bool, got {return_state!r}")
    if return_state and kpad is not None:
        raise ValueError(
            "return_state=True with a key_padding_mask: the state's window buffer would hold padded keys; "
            "decode unpadded sequences (or drop return_state)"
        )
    eps = check_hybrid_eps(eps)
    spec = CausalSinks(sinks)  # absolute positions; later ones apply to later segments
    t0 = 0
    if initial_state is not None:
        check_hybrid_state(initial_state, feature_map, w, q.shape[-1], v.shape[-1], spec)
        state_batch(initial_state, broadcast_shapes(q.shape[:-2], k.shape[:-2], v.shape[:-2],
                                                          feature_map.batch_shape))
        t0 = initial_state.position
    sink_idx = spec.within(t0, t0 + q.shape[-2])
    if initial_state is None and not return_state and w >= q.shape[-2]:  # softmax attention
        return softmax_path(q, k, v, feature_map, True, kpad, out_dtype)
    return _causal_core(q, k, v, feature_map, w, C, sink_idx, eps, out_dtype, cdt, initial_state, return_state,
                        kpad)


@no_autocast
def _flex_eligible(q, k, v, feature_map, window, causal, window_mode, initial_state, return_state,
                   key_padding_mask) -> bool:
    """Whether a call takes `kernelapprox.backends.hybrid_path`'s ``"flex"`` path: a positive map,
    ``window >= 1`` (causal: ``>= 0``), a state only in a causal token-window call (``return_state``
    without padding), and the dispatch choosing it (inputs are checked by the form; a call the flex
    form would refuse goes to the torch forms, which name the argument)."""
    w = _as_int(window)
    if not (isinstance(feature_map, FeatureMap) and feature_map.positive and w is not None
            and w >= (0 if causal is True else 1)
            and all(isinstance(t, torch.Tensor) and t.is_floating_point() for t in (q, k, v))):
        return False
    if (initial_state is not None or return_state is not False) and not (
            causal is True and (window_mode == "token" or w == 0) and isinstance(return_state, bool)
            and (initial_state is None or isinstance(initial_state, HybridAttentionState))
            and not (return_state and key_padding_mask is not None)):
        return False
    grad = torch.is_grad_enabled() and (any(t.requires_grad for t in (q, k, v))
                                        or any(p.requires_grad for p in feature_map.parameters()))
    return backends.hybrid_path(q.device, q.dtype, grad) == "flex"


def hybrid_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    feature_map: FeatureMap,
    *,
    window: int,
    sinks: int | Sequence[int] = 0,
    causal: bool = False,
    chunk_size: int = 64,
    initial_state: HybridAttentionState | None = None,
    return_state: bool = False,
    eps: float = 1e-6,
    key_padding_mask: torch.Tensor | None = None,
    window_mode: str = "token",
) -> torch.Tensor | tuple[torch.Tensor, HybridAttentionState]:
    r"""Hybrid attention: exact softmax on a window and sinks, the feature map $\varphi$ elsewhere, one normaliser.

    $$
    \hat o_i = \frac{\sum_{j\in S_i} e^{q_i^\top k_j} v_j + \varphi(q_i)^\top\sum_{j\in R_i}\varphi(k_j)v_j^\top}
    {\sum_{j\in S_i} e^{q_i^\top k_j} + \varphi(q_i)^\top\sum_{j\in R_i}\varphi(k_j)},
    $$

    $S_i$ = window ($0 \le i - j < w$ causal, $|i - j| < w$ non-causal) $\cup$ sinks,
    $R_i$ = the other keys query $i$ attends to. Both parts share one stabilising shift per query
    (module docstring), so the result does not depend on it and a positive unbiased $\varphi$
    gives unbiased numerator and denominator. ScatterBrain's estimator [Che21]_ with a window as
    the sparse part; LoLCATs' hybrid [Zha25]_ with the linear term on the kernel's own scale.
    ``window = 0, sinks = 0`` is `kernelapprox.linear_attention`; ``window >= n`` is
    `kernelapprox.softmax_attention`.

    Non-causal: `parallel_hybrid_attention`; causal: `chunk_hybrid_attention`; decoding one token
    at a time: `kernelapprox.attention.hybrid.recurrent.RecurrentHybridAttention`. On an
    accelerator with ``flex_attention``, a positive map with ``window >= 1`` (causal: ``>= 0``)
    takes `kernelapprox.attention.hybrid.flex.flex_hybrid_attention`, causal token windows with
    their ``initial_state``/``return_state`` too (the same result; the choice is
    `kernelapprox.backends.hybrid_path`'s). 16-bit inputs are computed in float32, the output is cast back.

    No silently wrong row: for positive maps the remainder of the non-causal forms is shifted per
    feature, the causal forms on the CPU recompute per feature the rows whose normaliser
    underflows (`chunk_hybrid_attention`), and the accelerator's flex path is per feature
    throughout, with or without a state; for signed maps a `kernelapprox.KernelApproxWarning`
    names the rows the ``eps`` guard changes or (non-causal) whose global-minus-window remainder
    cancels beyond the compute dtype (`kernelapprox.attention.hybrid.rescue`).

    Parameters
    ----------
    q, k : Tensor, shape (..., n, d)
    v : Tensor, shape (..., n, dv)
        Leading dimensions broadcast with each other and with ``feature_map.batch_shape``.
    feature_map : FeatureMap
        Any map of the library (random, deterministic, fitted or learned).
    window : int
        Window size ``w >= 0`` (see above).
    sinks : int or sequence of int, default 0
        A count of leading positions, or positions (`resolve_sinks`).
    causal : bool, default False
    chunk_size : int, default 64
        Tokens per chunk (causal) or per block of the window term (non-causal).
    initial_state : HybridAttentionState, optional
        Causal only: the state of a preceding segment.
    return_state : bool, default False
        Causal only: also return the state after the last token.
    eps : float, default 1e-6
        Denominator guard for signed (trigonometric) maps, see `kernelapprox.linear_attention`.
    key_padding_mask : Tensor, shape (batch, n), optional
        ``True`` (or ``-inf``) where the key is padding, as in `kernelapprox.linear_attention`:
        padded keys are in neither the window, nor the sinks, nor the remainder, so the real
        tokens' outputs are those of the unpadded sequence (for right padding).
    window_mode : {"token", "block"}, default "token"
        ``"token"``: the sliding window above. ``"block"``: a block-aligned window, LoLCATs'
        "terrace" [Zha25]_: the sequence is cut into blocks of ``window`` tokens, $b(i) =
        \lfloor i / w \rfloor$, and query $i$ is exact on its own block and the neighbouring
        ones, $|b(i) - b(j)| \le 1$ (non-causal, between $2w$ and $3w - 1$ keys), or on its block
        up to itself and the previous block, $0 \le b(i) - b(j) \le 1,\ j \le i$ (causal,
        between $w$ and $2w$ keys). Every query of a block then shares one remainder, the sum of
        the per-block feature sums $T_b = \sum_{j\in b}\varphi(k_j)[v_j, 1]^\top$ over
        $|b - b'| \ge 2$ (the global sum minus three block sums; a rounding as in
        `parallel_hybrid_attention`) or $b' \le b - 2$ (a running sum): no per-token feature
        scores on the window, and the exact part is one dense $w \times 3w$ (causal
        $w \times 2w$) product per block. Cost
        $O(nF(d + d_v) + nw(d + d_v))$, memory $O(nF d_v / w)$ for the block sums; ``chunk_size``
        is not used. ``window >= n`` (one block, or two when causal) is softmax attention. No
        ``initial_state``/``return_state`` (the recurrent form has a sliding window).

    Returns
    -------
    out : Tensor, shape (..., n, dv), dtype ``promote(q, k, v)``
    state : HybridAttentionState, if ``return_state``

    Examples
    --------
    >>> import kernelapprox as ka
    >>> from kernelapprox.attention.hybrid import hybrid_attention
    >>> q, k, v = torch.randn(3, 2, 4, 128, 16).unbind(0)
    >>> fm = ka.PositiveRF(dim=16, num_features=64, seed=0)
    >>> out = hybrid_attention(q / 2, k / 2, v, fm, window=16, sinks=1, causal=True)
    >>> out.shape
    torch.Size([2, 4, 128, 16])
    >>> exact = ka.softmax_attention(q / 2, k / 2, v)
    >>> torch.allclose(hybrid_attention(q / 2, k / 2, v, fm, window=128), exact, atol=1e-5)
    True
    """
    if not isinstance(causal, bool):
        raise TypeError(f"causal must be a bool, got {causal!r}")
    if _flex_eligible(q, k, v, feature_map, window, causal, window_mode, initial_state, return_state,
                      key_padding_mask):
        from .flex import flex_hybrid_attention

        check_hybrid_eps(eps)
        # off accelerators (compiled on the CPU, or forced) the window term in plain torch when
        # compiling: compiled flex_attention on the CPU returns no log-sum-exp
        term = "torch" if torch.compiler.is_compiling() and not backends.is_accelerator(q.device) else "flex"
        return flex_hybrid_attention(q, k, v, feature_map, window=window, sinks=sinks, causal=causal,
                                     key_padding_mask=key_padding_mask, window_mode=window_mode,
                                     initial_state=initial_state, return_state=return_state,
                                     window_term=term)
    if check_window_mode(window_mode) == "block" and check_window(window) > 0:
        check_hybrid_eps(eps)
        if initial_state is not None or return_state:
            raise ValueError(
                "window_mode='block' has no state to carry (the recurrent form slides its window): use "
                f"window_mode='token', got initial_state={type(initial_state).__name__}, return_state={return_state!r}"
            )
        q, k, v, out_dtype, cdt, w, _, kpad = prepare_hybrid(q, k, v, feature_map, window, sinks, chunk_size, causal,
                                                      key_padding_mask)
        n = q.shape[-2]
        if w >= n:  # one block (two when causal): every key a query attends to is exact
            return softmax_path(q, k, v, feature_map, causal, kpad, out_dtype)
        sink_idx = CausalSinks(sinks).within(0, n) if causal else resolve_sinks(sinks, n, causal=False)
        lead = broadcast_shapes(q.shape[:-2], k.shape[:-2], v.shape[:-2], feature_map.batch_shape)
        if math.prod(lead) == 0:  # an empty batch: the empty output
            return q.new_zeros(*lead, n, v.shape[-1]).to(out_dtype)
        return _block_core(q, k, v, feature_map, w, sink_idx, causal, eps, out_dtype, cdt, kpad)
    if causal:
        return chunk_hybrid_attention(
            q, k, v, feature_map, window=window, sinks=sinks, chunk_size=chunk_size,
            initial_state=initial_state, return_state=return_state, eps=eps, key_padding_mask=key_padding_mask,
        )
    if initial_state is not None or return_state:
        raise ValueError(
            "initial_state and return_state need causal=True (a non-causal window has no state to carry), "
            f"got initial_state={type(initial_state).__name__}, return_state={return_state!r}"
        )
    return parallel_hybrid_attention(q, k, v, feature_map, window=window, sinks=sinks, chunk_size=chunk_size, eps=eps,
                                     key_padding_mask=key_padding_mask)



# A checkpoint holding a state loads with ``torch.load(..., weights_only=True)``: the class is
# allow-listed for the restricted unpickler (tensors, ints and a tuple of ints); a loaded state
# is checked when it is used (`HybridAttentionState.validate`).
torch.serialization.add_safe_globals([HybridAttentionState])
