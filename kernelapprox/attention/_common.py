"""Pieces shared by the parallel, chunked and recurrent forms of linear attention (the input checks
`check_qkv` and `padding_mask` are those of `kernelapprox.exact`, shared with softmax attention)."""

from __future__ import annotations

import math
import os
import sys
import warnings

import torch

from .. import backends
from .._validation import (
    KernelApproxWarning,
    broadcast_batch,
    broadcast_shapes,
    check_bool,
    check_finite_float,
    compute_dtype,
)
from ..exact import check_qkv, padding_mask  # noqa: F401 (padding_mask: imported from here by the forms)
from ..maps.base import FeatureMap
from .state import LinearAttentionState


def run_input_checks(feature_map: FeatureMap, q: torch.Tensor, k: torch.Tensor) -> None:
    """The check of ``linear_attention(..., check=True)``: `kernelapprox.diagnose.warn_if_hopeless`,
    called by name (imported here, on the first checked call: attention loads no statistics)."""
    from ..diagnose import warn_if_hopeless

    warn_if_hopeless(feature_map, q, k)


def apply_padding(
    mask: torch.Tensor | None, k: torch.Tensor, v: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Padded keys and values replaced by zeros (``mask`` True = padded, from `padding_mask`).

    Whatever a padded position holds (a huge norm, NaN), its features are then those of a zero
    key, finite, and no gradient reaches it through the feature map (``masked_fill`` passes
    none to the filled entries). The forms also give the padded keys weight zero
    (`key_side`, the chunked and recurrent forms): zeroing is for finiteness, not for exclusion.
    """
    if mask is None:
        return k, v
    m = mask.unsqueeze(-1)
    return k.masked_fill(m, 0.0), v.masked_fill(m, 0.0)


def check_feature_map(feature_map: object) -> FeatureMap:
    if not isinstance(feature_map, FeatureMap):
        raise TypeError(f"feature_map must be a kernelapprox FeatureMap, got {type(feature_map).__name__}")
    return feature_map


def check_eps(eps: object) -> float:
    """``eps`` (the denominators' floor) as a finite float >= 0, else ``TypeError``/``ValueError``."""
    return check_finite_float("eps", eps, min=0.0)


def check_options(return_state: object, eps: object) -> float:
    """Check the scalar options every attention form takes: ``return_state`` a bool, ``eps`` a
    finite float >= 0 (returned as ``float``)."""
    check_bool("return_state", return_state)
    return check_eps(eps)


def prepare(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    feature_map: FeatureMap,
    causal: bool,
    initial_state: LinearAttentionState | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.dtype, torch.dtype]:
    """Validate the inputs of an attention call once, and cast them to the compute dtype.

    Returns ``q, k, v`` in ``compute_dtype(q, k, v, feature map)`` (at least float32), the output
    dtype ``promote(q, k, v)`` and the compute dtype. The feature map is then called inside
    `kernelapprox._validation.inputs_validated`, so nothing is checked twice.
    """
    check_feature_map(feature_map)
    check_qkv(q, k, v, causal=causal)
    if q.shape[-1] != feature_map.dim:
        raise ValueError(
            f"q and k have last dimension {q.shape[-1]}, but the feature map expects dim={feature_map.dim}"
        )
    for name, t in (("q", q), ("k", k), ("v", v)):
        broadcast_batch(name, t.shape[:-2], feature_map.batch_shape)
    if initial_state is not None:
        if not isinstance(initial_state, LinearAttentionState):
            raise TypeError(f"initial_state must be a LinearAttentionState, got {type(initial_state).__name__}")
        batch = broadcast_shapes(q.shape[:-2], k.shape[:-2], v.shape[:-2])
        check_state(initial_state, feature_map.feature_dim, v.shape[-1], "initial_state", tuple(batch))
    out_dtype = torch.promote_types(torch.promote_types(q.dtype, k.dtype), v.dtype)
    cdt = compute_dtype(out_dtype, feature_map.param_dtype)
    return q.to(cdt), k.to(cdt), v.to(cdt), out_dtype, cdt


def check_state(
    state: LinearAttentionState, feature_dim: int, dv: int, name: str, batch: tuple[int, ...] | None = None
) -> None:
    """Raise ``ValueError`` unless ``state.kv`` has shape (..., feature_dim, dv + 1) and its batch
    dimensions broadcast with the inputs' ``batch`` (shapes only: no host synchronisation)."""
    if tuple(state.kv.shape[-2:]) != (feature_dim, dv + 1):
        raise ValueError(
            f"{name} has kv of shape {tuple(state.kv.shape)}, expected (..., {feature_dim}, {dv + 1}) "
            f"= (..., feature_dim, dv + 1) for this feature map and v"
        )
    if batch is not None:
        state_batch = tuple(state.kv.shape[:-2])
        try:
            broadcast_shapes(state_batch, batch)
        except RuntimeError:
            raise ValueError(
                f"{name} has batch shape {state_batch} (kv of shape {tuple(state.kv.shape)}), which does not "
                f"broadcast with the inputs' batch shape {tuple(batch)}: a decoding state belongs to the batch "
                "it was computed on"
            ) from None


def key_side(
    feature_map: FeatureMap,
    k: torch.Tensor,
    v: torch.Tensor,
    initial_state: LinearAttentionState | None,
    multiple: int = 1,
    pad: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor]:
    r"""Key features with their per-row scales folded into the values.

    With $\psi(k_j) = f_j e^{s_j}$ (`FeatureMap.key_log_features`, one scale per row) and
    $G = \max_j s_j$ (and the initial state's scale), the keys enter
    $\psi(K)^\top [V, 1] = e^{G} f^\top [w \circ V, w]$ with $w_j = e^{s_j - G} \le 1$:
    the scale multiplies the $m \times (d_v + 1)$ values instead of the $m \times F$ features
    (for maps whose features and scale come separately, such as the trigonometric ones, this
    saves a pass over the features). $G$ is a stabiliser, constant for autograd.

    A padded key (``pad`` True, (..., m), from `padding_mask`) gets $s_j = -\infty$: weight
    $w_j = 0$ in the numerator and the denominator, and no part in $G$ (a padded key of huge
    norm would otherwise set $G$ and underflow every real key's weight). Without any valid key
    $G = 0$ and the state is zero (the output rows are 0, see `normalise`).

    Returns
    -------
    fk : Tensor, shape (..., m, F)
    v1 : Tensor, shape (..., m, P)
        $[w \circ V, w, 0, \dots]$, ``P = multiple * ceil((dv + 1) / multiple)`` (see `with_ones`).
    kv0 : Tensor, shape (..., F, P), or None
        The initial state brought to the scale $G$ (zero-padded to ``P`` columns); ``None``
        without one.
    log_scale : Tensor, shape (..., 1, 1)
        $G$.
    """
    fk, s = feature_map.key_log_features(k)  # s: (..., m)
    if pad is not None:
        s = s.masked_fill(pad, float("-inf"))
    with torch.no_grad():
        g = s.amax(dim=-1, keepdim=True)  # (..., 1)
        if initial_state is not None:
            g = torch.maximum(g, initial_state.log_scale.to(g.dtype).squeeze(-1))
        # all scales -inf (every key feature zero): any finite reference gives w = 0
        g = torch.where(g == float("-inf"), torch.zeros_like(g), g)
    w = torch.exp(s - g).to(fk.dtype).unsqueeze(-1)  # (..., m, 1)
    dv = v.shape[-1]
    pad_cols = -(dv + 1) % multiple
    if torch.is_grad_enabled() and (v.requires_grad or w.requires_grad) or torch.compiler.is_compiling():
        parts = [v * w, w.expand(*broadcast_shapes(v.shape[:-1], w.shape[:-1]), 1)]
        if pad_cols:
            parts.append(w.new_zeros(*parts[1].shape[:-1], pad_cols))
        v1 = torch.cat(parts, dim=-1)
    else:
        lead = broadcast_shapes(v.shape[:-1], w.shape[:-1])
        v1 = v.new_empty(*lead, dv + 1 + pad_cols)
        torch.mul(v, w, out=v1[..., :dv])
        v1[..., dv:dv + 1] = w
        if pad_cols:
            v1[..., dv + 1:] = 0
    kv0 = None
    g = g.unsqueeze(-1)  # (..., 1, 1)
    if initial_state is not None:
        old = initial_state.kv.to(fk.dtype) * torch.exp(initial_state.log_scale - g).to(fk.dtype)
        kv0 = torch.nn.functional.pad(old, (0, pad_cols))
    return fk, v1, kv0, g


def doubly_shifted(
    lq: torch.Tensor, lk: torch.Tensor, pad: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    r"""Query and key features of a positive map, shifted per feature and per query.

    With $\ell^q_{if} = \log_2\varphi_f(q_i) + c_i$ (``lq`` (..., n, F), $c_i$ any per-row
    constant) and $\ell^k_{jf} = \log_2\psi_f(k_j)$ (``lk`` (..., m, F)), each feature is
    shifted by its maximum over the keys and each query by its maximum after that:
    $$
    t_f = \max_j \ell^k_{jf}, \qquad s_i = \max_f (\ell^q_{if} + t_f), \qquad
    \tilde\psi_f(k_j) = 2^{\ell^k_{jf} - t_f}, \qquad
    \tilde\varphi_f(q_i) = 2^{\ell^q_{if} + t_f - s_i}.
    $$
    $\tilde\varphi(q_i)^\top\tilde\psi(k_j) = 2^{-s_i}\,\varphi(q_i)^\top\psi(k_j)\,2^{-c_i}$: the
    factor is one per query, and cancels in $o_i = \text{num}_i / \text{den}_i$. Every feature
    is in $[0, 1]$, $\tilde z_f = \sum_j\tilde\psi_f(k_j) \in [1, m]$ (0 for a feature no key
    reaches), and at the maximiser $f^*$ of $s_i$, $\tilde\varphi_{f^*}(q_i) = 1$: so
    $$
    1 \le \text{den}_i = \textstyle\sum_f \tilde\varphi_f(q_i)\,\tilde z_f \le F m,
    $$
    and neither the forward nor the backward ($1/\text{den}_i$, $\tilde\varphi(Q)^\top\partial O$,
    $\partial O\,\tilde z^\top$) can underflow or overflow, however peaked the features (a
    fitted FAVOR++/FAVOR# map, whose per-row shift lets $\text{den}_i$ fall to $10^{-37}$ in
    float32). Padded keys (``pad`` True) get $\ell^k = -\infty$; features that no key reaches
    get $\tilde\psi = \tilde\varphi = 0$; without any valid key every denominator is 0 (see
    `normalise`). The shifts are constants for autograd.
    """
    if pad is not None:
        lk = lk.masked_fill(pad.unsqueeze(-1), float("-inf"))
    with torch.no_grad():
        t = lk.amax(dim=-2, keepdim=True)  # (..., 1, F); -inf on a feature no key reaches
        tk = torch.where(t == float("-inf"), torch.zeros_like(t), t)
    a = lq + t
    with torch.no_grad():
        s = a.amax(dim=-1, keepdim=True)  # (..., n, 1); -inf only without any valid key
        s = torch.where(s == float("-inf"), torch.zeros_like(s), s)
    return torch.exp2(a - s), torch.exp2(lk - tk)


_LN2 = 0.6931471805599453


def log2_state(
    state: LinearAttentionState, dv: int, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    r"""A state as per-feature log2 scales: ``kv`` (..., F, P) with each reached feature's mass
    $\tilde z_f = 1$, and $X_f = \log_2 z_f$ (..., F), $-\infty$ for a feature no key reached.

    Works for a state with one scale (``log_scale`` (..., 1, 1)) or one per feature
    (..., F, 1). $X$ is a constant for autograd; ``kv`` keeps its gradient.
    """
    kv = state.kv.to(dtype)
    with torch.no_grad():
        z0 = state.kv[..., dv].double()  # (..., F)
        X0 = state.log_scale.detach().double().squeeze(-1) * (1.0 / _LN2) + torch.log2(z0)
        inv = torch.where(z0 > 0, 1.0 / z0, torch.zeros_like(z0)).to(dtype)
    return kv * inv.unsqueeze(-1), X0.to(dtype)


def feature_state(kv: torch.Tensor, X: torch.Tensor) -> LinearAttentionState:
    r"""`LinearAttentionState` of a state kept at per-feature log2 scales ``X`` (..., F): the
    stored ``log_scale`` (..., F, 1) is the natural log (float64), 0 where no key reached."""
    X = torch.where(X == float("-inf"), torch.zeros_like(X), X).detach()
    return LinearAttentionState(kv, (X.double() * _LN2).unsqueeze(-1))


def per_feature_keys(
    lk: torch.Tensor, v1: torch.Tensor, pad: torch.Tensor | None,
    state: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    r"""The key state $\sum_j 2^{\ell^k_{jf} - t_f} [v_j, 1]$ (..., F, P) at per-feature scales
    $t_f = \max_j \ell^k_{jf}$ (and the state's $X_f$), with $t$ (..., F) ($-\infty$ for a
    feature no key reaches; ``kv`` is 0 there). Arguments as `per_feature_parallel`."""
    if pad is not None:
        lk = lk.masked_fill(pad.unsqueeze(-1), float("-inf"))
    with torch.no_grad():
        t = lk.amax(dim=-2)  # (..., F)
        if state is not None:
            t = torch.maximum(t, state[1])
        tk = torch.where(t == float("-inf"), torch.zeros_like(t), t)
    kv = torch.matmul(torch.exp2(lk - tk.unsqueeze(-2)).mT, v1)
    if state is not None:
        kv = kv + torch.exp2(state[1] - tk).unsqueeze(-1) * state[0]
    return kv, t


def shared_state(state: LinearAttentionState | None) -> LinearAttentionState | None:
    r"""``state`` with one log scale (..., 1, 1): a per-feature state (``log_scale`` (..., F, 1),
    from `kernelapprox.RecurrentLinearAttention` or a per-feature prefill) brought to the
    largest of its scales (features far below it may underflow: the forms that need them read
    the per-feature state itself)."""
    if state is None or state.log_scale.shape[-2] == 1:
        return state
    ls = state.log_scale
    with torch.no_grad():
        G = ls.amax(dim=-2, keepdim=True)
    return LinearAttentionState(state.kv * torch.exp(ls - G).to(state.kv.dtype), G)


def per_feature_parallel(
    lq: torch.Tensor, lk: torch.Tensor, v1: torch.Tensor, pad: torch.Tensor | None,
    state: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    r"""Non-causal ``[num | den]`` with every feature at its own scale (`doubly_shifted`, with a
    state): $\text{den}_i \ge 1$ for a query that reaches any key.

    ``lq`` (..., n, F) and ``lk`` (..., m, F): log2 features; ``v1`` (..., m, P) $[v, 1, 0]$;
    ``state``: ``(kv (..., F, P), X (..., F))`` from `log2_state` (zero-padded to ``P``).
    Returns ``out`` (..., n, P), the key state ``kv`` (..., F, P) at the scales ``t`` (..., F)
    (log2, $-\infty$ for a feature no key reaches).
    """
    kv, t = per_feature_keys(lk, v1, pad, state)
    a = lq + t.unsqueeze(-2)
    with torch.no_grad():
        s = a.amax(dim=-1, keepdim=True)
        s = torch.where(s == float("-inf"), torch.zeros_like(s), s)
    return torch.matmul(torch.exp2(a - s), kv), kv, t


def den_floor(dtype: torch.dtype) -> float:
    r"""The smallest denominator the stabilised chunked paths keep: $t^{1/3}$ for the smallest
    normal number $t$ of ``dtype`` ($2.3 \cdot 10^{-13}$ in float32).

    With every feature and key weight $\le 1$ in those paths, a row of denominator
    $\text{den}_i \ge t^{1/3}$ loses only terms below $t$ (relative error
    $\le nF\,t^{2/3}$) and its backward ($1/\text{den}_i$ times sums of at most
    $n F$ bounded terms) stays below $t^{-1/3} n F \max|v|$, far from overflow. A row below
    it (a fitted FAVOR++/FAVOR# map, whose peaked query and key features meet nowhere the per-row
    shifts can see) is recomputed by `kernelapprox.attention.linear.chunk.per_feature_attention`.

    Examples
    --------
    >>> den_floor(torch.float32) == torch.finfo(torch.float32).tiny ** (1 / 3)
    True
    """
    return float(torch.finfo(dtype).tiny) ** (1.0 / 3.0)


def has_log2_features(feature_map: FeatureMap) -> bool:
    """Whether the map's class provides log2 features (`FeatureMap.query_log2_features` and
    `FeatureMap.key_log2_features` overridden; an instance may still return ``None``)."""
    cls = type(feature_map)
    return (cls.query_log2_features is not FeatureMap.query_log2_features
            and cls.key_log2_features is not FeatureMap.key_log2_features)


def with_ones(v: torch.Tensor, multiple: int = 1) -> torch.Tensor:
    """``[v, 1]`` (..., m, dv + 1): numerator and denominator share one GEMM (and its rounding).

    With ``multiple > 1``, zero columns follow up to the next multiple of ``multiple`` columns
    (..., m, P), ``P = multiple * ceil((dv + 1) / multiple)``: a GEMM of width ``dv + 1 = 65``
    is ~25 % slower on CPU than one of width 72 (the kernels work on blocks of 8 or 16 columns).
    """
    pad = -(v.shape[-1] + 1) % multiple
    parts = [v, v.new_ones(*v.shape[:-1], 1)]
    if pad:
        parts.append(v.new_zeros(*v.shape[:-1], pad))
    return torch.cat(parts, dim=-1)


def split(out: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``[num | den]`` (..., n, dv+1) -> ``num`` (..., n, dv), ``den`` (..., n, 1)."""
    return out[..., :-1], out[..., -1:]


#: Multiple of the compute dtype's machine epsilon: a signed map's denominator at or below this
#: many units of its magnitude bound is lost (`lost_tolerance`).
LOST_ULPS = 1


def lost_tolerance(dtype: torch.dtype) -> float:
    r"""$\tau = \varepsilon$ of ``dtype`` ($1.2 \cdot 10^{-7}$ in float32): a signed map's row with
    $|\text{den}_i| \le \tau B_i$ is lost (see `signed_lost`).

    $B_i = |\varphi(q_i)|^\top\sum_j|\psi(k_j)|$ is the magnitude of the terms that the
    denominator $\text{den}_i = \varphi(q_i)^\top\sum_j\psi(k_j)$ sums, and $\varepsilon B_i$
    the rounding unit at that magnitude: a denominator below it is not resolved (an underflow,
    $B_i$ and $\text{den}_i$ both 0 in a row that has keys, is the extreme case). Above it the
    computed denominator is off by about $0.1$ to
    $1\,\varepsilon B_i$ (measured: trigonometric maps, 2048 keys, whose roundings are
    independent) and up to $50\,\varepsilon B_i$ (Nyström, whose whitening $G^{-1/2}$ leaves
    roundings of the size of the features' norms): a relative error of the row of about
    $\varepsilon B_i / |\text{den}_i|$ times that factor.

    Examples
    --------
    >>> lost_tolerance(torch.float32) == torch.finfo(torch.float32).eps
    True
    """
    return LOST_ULPS * float(torch.finfo(dtype).eps)


def row_norms(f: torch.Tensor) -> torch.Tensor:
    """Euclidean norms of the feature rows, (..., n, F) -> (..., n), in ``f``'s dtype."""
    return torch.linalg.vector_norm(f, dim=-1)


def state_abs_mass(state: LinearAttentionState, dv: int) -> torch.Tensor:
    r"""$|z|$ (..., F, 1), a state's summed key features (column ``dv`` of ``kv``) in absolute
    value, at the state's (shared) scale, detached: what a state brings to the magnitude bound
    $B_i$ of `lost_tolerance`. The state does not store $\sum_j|\psi(k_j)|$, so the
    cancellation of its keys inside $z$ is not seen (a lower estimate of their part)."""
    return state.kv[..., dv:dv + 1].detach().abs()


def host_reads(device: torch.device) -> bool:
    """Whether a call on ``device`` may read a value into Python for the signed-map check: the
    CPU path of `kernelapprox.backends.attention_plan` (not the forced accelerator path), outside
    ``torch.compile``, with values (not ``meta``)."""
    if torch.compiler.is_compiling() or device.type == "meta":
        return False
    return backends.attention_plan(device, torch.float32, n=1 << 20, gated=False, grad=False,
                                   warn=False).path == "cpu"


def signed_lost(
    den: torch.Tensor, bound: torch.Tensor, has_key: torch.Tensor | bool = True, dtype: torch.dtype | None = None,
) -> torch.Tensor:
    r"""The lost rows of a signed map, (..., n, 1) bool: $|\text{den}_i| \le \tau B_i$
    (`lost_tolerance` of ``dtype``, the dtype whose rounding the summed terms carry, by default
    ``den``'s; ``bound`` $= B_i$ in the units of ``den``), in rows that see a key (``has_key``; a
    row without any gives 0 and is not lost). A row whose features meet none of its keys'
    ($B_i = 0$ in the compute dtype: underflow) is lost; NaN is not.

    Examples
    --------
    >>> den = torch.tensor([[1e-3], [1e-9], [0.0], [0.0]])
    >>> bound = torch.tensor([[1.0], [1.0], [0.0], [0.0]])
    >>> signed_lost(den, bound, torch.tensor([[True], [True], [True], [False]])).squeeze(-1)
    tensor([False,  True,  True, False])
    """
    return (den.abs() <= lost_tolerance(den.dtype if dtype is None else dtype) * bound) & has_key


def _user_stacklevel() -> int:
    """``stacklevel`` of the first frame outside kernelapprox and torch (the user's call), for a
    warning issued by the caller of this function."""
    pkg = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep
    skip = (pkg, os.path.dirname(torch.__file__) + os.sep)
    frame = sys._getframe(2)
    level = 2
    while frame is not None and frame.f_code.co_filename.startswith(skip):
        frame, level = frame.f_back, level + 1  # type: ignore[assignment]
    return level


def normalise(
    num: torch.Tensor, den: torch.Tensor, positive: bool, eps: float,
    lost: torch.Tensor | None = None, *, host: bool = True,
) -> torch.Tensor:
    r"""``num / den`` (num (..., n, dv), den (..., n, 1)), guarding vanishing denominators.

    Positive maps: a denominator can only vanish by underflow; it is clamped to the smallest normal
    number. Signed maps (trigonometric): ``den + 2 eps`` where ``|den| <= eps`` (the Performer guard).
    A denominator exactly 0 with a positive map is a row without any key of positive weight
    (every key padded, see ``key_padding_mask``): its numerator is 0 too, and it is divided by 1,
    so that the output is 0 and its gradient $\partial o / \partial\,\text{num}$ is 1 rather than
    ``1 / tiny`` (which would overflow the backward into NaN).

    Signed maps, with ``lost`` (..., n, 1) bool (`signed_lost`: the rows whose denominator is lost
    to cancellation or underflow): with ``host`` (the CPU) the call warns with a
    `kernelapprox.KernelApproxWarning` naming their number, and returns them as computed; without
    (accelerators, the forced accelerator path, ``torch.compile``: no host synchronisation) those
    rows are NaN. A zero denominator in a row that is not lost is a row without any key: it gives
    0 (also with ``eps = 0``).
    """
    if positive:
        den = torch.where(den == 0, torch.ones_like(den), den.clamp_min(torch.finfo(den.dtype).tiny))
    else:
        if lost is not None and den.device.type != "meta":
            if host:
                warn_lost(lost, den.dtype)
            else:
                num = torch.where(lost, torch.full_like(num, math.nan), num)
            # a zero denominator that is not lost: a row without any key (numerator 0), output 0
            den = torch.where((den == 0) & ~lost, torch.ones_like(den), den)
        den = den + 2 * eps * (den.abs() <= eps).to(den.dtype)
    return num / den


def warn_lost(lost: torch.Tensor, dtype: torch.dtype) -> None:
    """The `kernelapprox.KernelApproxWarning` of `normalise` where ``lost`` holds a row (one host
    read)."""
    count = int(lost.sum())
    if count:
        warnings.warn(
            f"{count} row(s) of linear attention with a signed feature map lost to cancellation or "
            f"underflow: |denominator| <= {lost_tolerance(dtype):.1e} x its magnitude bound "
            f"|phi(q)|^T sum_j |psi(k_j)| in {str(dtype).replace('torch.', '')}: the rounding of the terms is as "
            "large as the denominator, and these rows are not resolved (returned as computed; float64 inputs, "
            "or a positive map, avoid it)",
            KernelApproxWarning, stacklevel=_user_stacklevel())
