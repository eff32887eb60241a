r"""Linear attention in three forms, beside an exact quadratic reference.

Layout (after flash-linear-attention's ``ops/<op>/``): one folder per operation, ``linear/`` and
``hybrid/``, each with its ``naive`` quadratic reference beside the torch forms; ``state`` holds the
decoding states and ``_common`` the checks and normalisation the forms share. The forms compute attention only: the closed-form check of a
map lives in `kernelapprox.diagnose` (``warn_if_hopeless``), run by the layers that build maps
(`kernelapprox.nn`, `kernelapprox.hf.linearize`) and here on request (``check=True``).
"""

from __future__ import annotations

import math
from typing import Literal

import torch

from .. import backends
from .._validation import check_bool, no_autocast
from ..maps.base import FeatureMap
from ._common import check_options, padding_mask, run_input_checks
from .hybrid import (
    HybridAttentionState,
    RecurrentHybridAttention,
    chunk_hybrid_attention,
    exact_set_mask,
    hybrid_attention,
    naive_hybrid_attention,
    parallel_hybrid_attention,
)
from .linear.chunk import chunk_linear_attention
from .linear.fla import fla_linear_attention, fla_mode
from .linear.naive import naive_linear_attention, naive_recurrent_linear_attention
from .linear.parallel import parallel_linear_attention
from .linear.recurrent import RecurrentLinearAttention
from .state import LinearAttentionState

# The forms without their own autocast guard: linear_attention already runs inside one.
_chunk = chunk_linear_attention.__wrapped__  # type: ignore[attr-defined]
_parallel = parallel_linear_attention.__wrapped__  # type: ignore[attr-defined]

__all__ = [
    "linear_attention",
    "parallel_linear_attention",
    "chunk_linear_attention",
    "naive_linear_attention",
    "naive_recurrent_linear_attention",
    "RecurrentLinearAttention",
    "LinearAttentionState",
    "hybrid_attention",
    "parallel_hybrid_attention",
    "chunk_hybrid_attention",
    "naive_hybrid_attention",
    "RecurrentHybridAttention",
    "HybridAttentionState",
    "exact_set_mask",
]


@no_autocast
def linear_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    feature_map: FeatureMap,
    *,
    causal: bool = False,
    chunk_size: int = 64,
    initial_state: LinearAttentionState | None = None,
    return_state: bool = False,
    eps: float = 1e-6,
    fit: bool = False,
    check: bool = False,
    key_padding_mask: torch.Tensor | None = None,
    scale: float | None = None,
    layout: Literal["bhtd", "bthd"] = "bhtd",
) -> torch.Tensor | tuple[torch.Tensor, LinearAttentionState]:
    r"""Linear attention with feature map $\varphi$ (queries and keys use the same map).

    $$
    o_i = \frac{\varphi(\sqrt s\, q_i)^\top \sum_{j \in J_i} \varphi(\sqrt s\, k_j) v_j^\top}
               {\varphi(\sqrt s\, q_i)^\top \sum_{j \in J_i} \varphi(\sqrt s\, k_j)},
    \qquad J_i = \{j \text{ not padded}\}\ (\cap\ \{j \le i\} \text{ if causal}),
    $$

    the estimate of softmax attention $\operatorname{softmax}_{j \in J_i}(s\, q_i^\top k_j)$
    (``scale`` $= s$, default 1).

    computed by associativity: $O(nFd_v)$ time instead of $O(n^2 d)$
    [Kat20]_, [Cho21]_. Non-causal: one state $\varphi(K)^\top[V, 1]$. Causal: chunk-wise
    (`chunk_linear_attention`), memory linear in ``n``.

    Numerics: features come from `FeatureMap.log_features`; the per-query scale cancels in
    the ratio and keys share one scale per sequence, so nothing overflows for finite inputs.
    16-bit inputs are computed in float32 and the output is cast back.

    Layout. ``(..., heads, n, d)`` (``layout="bhtd"``, the layout of
    `torch.nn.functional.scaled_dot_product_attention`), or ``(batch, n, heads, d)`` with
    ``layout="bthd"`` (flash-linear-attention's ``(B, T, H, K)``; transposed views in and out, no
    copy). The two cannot be told apart from the shapes alone; where they can (a map with one
    projection per head, ``batch_shape=(H,)``, and inputs whose dimension -2, not -3, has size
    ``H``), reading the other layout raises a ``ValueError`` instead of computing silently.

    Grouped-query attention. Keys and values with $H_{kv}$ heads (dimension -3) and queries with
    $H_q$ heads, $H_{kv}$ dividing $H_q$: query head $h$ reads KV head
    $\lfloor h / (H_q/H_{kv}) \rfloor$, as ``k.repeat_interleave(H_q // H_kv, dim=-3)`` would
    give (and as in SDPA's ``enable_gqa`` and the Hugging Face models). With a map shared by all
    heads the KV heads are not copied: the queries are viewed as (..., $H_{kv}$, $H_q/H_{kv}$,
    n, d) and broadcast against (..., $H_{kv}$, 1, m, d), so each KV head's features and state
    are computed once; a map with one projection per query head needs $\varphi_h(k)$ per query
    head, and the KV heads are repeated.

    Parameters
    ----------
    q : Tensor, shape (..., n, d)
    k : Tensor, shape (..., m, d)
    v : Tensor, shape (..., m, dv)
        Leading dimensions broadcast with each other and with ``feature_map.batch_shape``
        (dimension -3 of ``k`` and ``v`` may also divide that of ``q``: grouped-query heads).
    feature_map : FeatureMap
    causal : bool, default False
        Token ``i`` attends to keys ``j <= i`` (``n == m``).
    chunk_size : int, default 64
        Tokens per chunk of the causal form.
    initial_state : LinearAttentionState, optional
        State of a preceding segment (e.g. a prompt), continued here.
    return_state : bool, default False
        Also return the state after the last token (hand it to `RecurrentLinearAttention`).
    eps : float, default 1e-6
        Guard for signed (trigonometric) maps, applied to the *stabilised* denominator
        $\varphi(q_i)^\top z\, e^{-(s_{q_i} + M_i)}$ (query scale $s_{q_i}$, key scale
        $M_i$ = running maximum of the key log-scales, the same in all three forms): where
        it is $\le \varepsilon$ in absolute value it becomes $den + 2\varepsilon$.
        Positive maps are only guarded against underflow. Whatever ``eps``, a signed map's row
        whose denominator is lost, $|\text{den}_i| \le \varepsilon_{\text{dtype}}\,
        |\varphi(q_i)|^\top\sum_j|\varphi(k_j)|$ (cancellation below the rounding of its
        terms, or features that meet none of the keys' in the compute dtype), is never returned
        silently: on the CPU a `kernelapprox.KernelApproxWarning` names their number (the rows
        are returned as computed); on accelerators, the forced accelerator path and under
        ``torch.compile`` (no host read) they are NaN. See ``docs/attention.md``, "Signed maps".
    fit : bool, default False
        First choose the map's data-dependent parameters from this batch,
        ``feature_map.fit(q, k)`` (in place; a no-op for maps without any), as the FAVOR++/FAVOR#
        code does per batch. With ``causal=True`` the statistics then include future keys (the
        official code does the same); fit on a calibration batch instead where that matters.
    check : bool, default False
        Also run `kernelapprox.diagnose.warn_if_hopeless` on this call: a
        `kernelapprox.KernelApproxWarning` (pointing at the caller) when the map's closed form
        predicts a relative kernel MSE above 1 on this batch ($O(nd)$ statistics and one host
        synchronisation; skipped inside ``torch.compile``). Off by default: this function computes
        attention only. The layers of `kernelapprox.nn` check once per map by default.
    key_padding_mask : Tensor, optional
        Keys to ignore, with the polarity of `torch.nn.MultiheadAttention`: bool, ``True`` =
        padded (ignored); or float, ``0`` = kept and ``-inf`` = padded (other values raise).
        Shape ``(batch, m)`` (broadcast over the heads) or any shape broadcasting with
        ``k.shape[:-1]``. A padded key contributes nothing: it is replaced by a zero key (so
        non-finite padding is harmless and gets no gradient), its row of the weighted values
        $[V, 1]$ is zero in every form (numerator and denominator), and its log-scale is
        $-\infty$, outside every key-scale maximum (a padded key of huge norm would otherwise
        underflow the real keys' weights). A query with no valid key (a fully padded sequence,
        or causal rows before the first valid key) gives 0, without NaN. Padded *queries* are
        computed like any other (mask their outputs downstream, as with softmax attention).
    scale : float, optional
        $s > 0$ multiplying $q^\top k$, as SDPA's ``scale``: the kernel estimated is
        $e^{s\,q^\top k}$. Default 1: the library's maps approximate $e^{q^\top k}$, so
        ``scale=None`` is SDPA's ``scale=1``, not SDPA's default $1/\sqrt d$ (pass
        ``scale=d**-0.5`` for that). Implemented by feeding $\sqrt s\,q$ and $\sqrt s\,k$ to
        the map, exact for every map: $\exp((\sqrt s q)^\top(\sqrt s k)) = \exp(s\,q^\top k)$, and
        the symmetric split keeps queries and keys on the same footing (the variance of random
        maps and the fit of data-dependent maps depend on both norms).
    layout : {"bhtd", "bthd"}, default "bhtd"
        ``"bhtd"``: (..., heads, n, d); ``"bthd"``: (batch, n, heads, d), output (batch, n, heads, dv)
        (see Layout above). ``key_padding_mask`` is (batch, m) in both.

    Returns
    -------
    out : Tensor, shape (..., n, dv), dtype ``promote(q, k, v)``
        (batch, n, heads, dv) with ``layout="bthd"``.
    state : LinearAttentionState, if ``return_state``

    Examples
    --------
    >>> import kernelapprox as ka
    >>> q, k, v = torch.randn(3, 2, 4, 128, 16).unbind(0)
    >>> fm = ka.PositiveRF(dim=16, num_features=64, seed=0)
    >>> out = ka.linear_attention(q, k, v, fm, causal=True, scale=16**-0.5)
    >>> out.shape
    torch.Size([2, 4, 128, 16])

    Padding: the real tokens' outputs do not depend on the padded keys.

    >>> mask = torch.zeros(2, 128, dtype=torch.bool)
    >>> mask[1, 100:] = True                                 # sequence 1 has 100 tokens
    >>> out = ka.linear_attention(q, k, v, fm, key_padding_mask=mask, scale=0.25)
    >>> ref = ka.linear_attention(q[1:, :, :100], k[1:, :, :100], v[1:, :, :100], fm, scale=0.25)
    >>> bool(torch.allclose(out[1:, :, :100], ref, atol=1e-5))
    True

    Grouped-query heads (8 query heads, 2 KV heads) and flash-linear-attention's layout:

    >>> q8 = torch.randn(2, 8, 128, 16)
    >>> ka.linear_attention(q8, k[:, :2], v[:, :2], fm, scale=0.25).shape
    torch.Size([2, 8, 128, 16])
    >>> ka.linear_attention(q8.transpose(1, 2), k[:, :2].transpose(1, 2), v[:, :2].transpose(1, 2),
    ...                     fm, scale=0.25, layout="bthd").shape
    torch.Size([2, 128, 8, 16])
    """
    check_bool("fit", fit)
    check_bool("check", check)
    check_bool("causal", causal)
    check_options(return_state, eps)
    if layout not in ("bhtd", "bthd"):
        raise ValueError(f"layout must be 'bhtd' (..., heads, n, d) or 'bthd' (batch, n, heads, d), got {layout!r}")
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if layout == "bthd":
        for name, t in (("q", q), ("k", k), ("v", v)):
            if t.dim() < 3:
                raise ValueError(f"layout='bthd' needs {name} of shape (..., n, heads, d), got shape {tuple(t.shape)}")
        res = linear_attention(
            q.transpose(-3, -2), k.transpose(-3, -2), v.transpose(-3, -2), feature_map, causal=causal,
            chunk_size=chunk_size, initial_state=initial_state, return_state=return_state, eps=eps, fit=fit,
            check=check, key_padding_mask=key_padding_mask, scale=scale,
        )
        if return_state:
            out, state = res
            return out.transpose(-3, -2), state
        return res.transpose(-3, -2)  # type: ignore[union-attr]
    _check_layout(q, k, feature_map)
    if scale is not None:
        s = _check_scale(scale)
        if s != 1.0:
            root = math.sqrt(s)
            q, k = q * root, k * root
    pad = padding_mask(key_padding_mask, k.shape)
    grouped = _grouped_heads(q, k, v)
    if grouped is not None:
        return _grouped_attention(
            q, k, v, feature_map, grouped, pad, causal=causal, chunk_size=chunk_size,
            initial_state=initial_state, return_state=return_state, eps=eps, fit=fit, check=check,
        )
    if fit:
        if not isinstance(feature_map, FeatureMap):
            raise TypeError(f"feature_map must be a kernelapprox FeatureMap, got {type(feature_map).__name__}")
        feature_map.fit(q, k)
    if check:
        run_input_checks(feature_map, q, k)
    if causal:
        fast = _device_path(q, k, v, feature_map, pad, initial_state, return_state, eps)
        if fast is not None:
            return fast
        return _chunk(
            q, k, v, feature_map, chunk_size=chunk_size, initial_state=initial_state,
            return_state=return_state, eps=eps, key_padding_mask=pad,
        )
    return _parallel(
        q, k, v, feature_map, initial_state=initial_state, return_state=return_state, eps=eps,
        key_padding_mask=pad,
    )


def _device_path(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, feature_map: FeatureMap, pad: torch.Tensor | None,
    initial_state: LinearAttentionState | None, return_state: bool, eps: float,
) -> torch.Tensor | tuple[torch.Tensor, LinearAttentionState] | None:
    """The causal call through flash-linear-attention where `kernelapprox.backends.attention_plan`
    chooses it (an accelerator with fla-core), else ``None`` (the torch forms). Inputs (B, H, T, d),
    handed to fla as (B, T, H, d) views."""
    if q.dim() != 4 or k.shape != q.shape or v.shape[:-1] != q.shape[:-1]:
        return None
    if not isinstance(feature_map, FeatureMap) or fla_mode(feature_map) is None:
        return None
    grad = torch.is_grad_enabled() and (
        q.requires_grad or k.requires_grad or v.requires_grad or any(p.requires_grad for p in feature_map.parameters()))
    plan = backends.attention_plan(q.device, q.dtype, n=q.shape[-2], gated=fla_mode(feature_map) == "gla", grad=grad)
    if plan.path != "fla":
        return None
    B, H, T, _ = q.shape
    kpm = None
    if pad is not None:
        if pad.numel() != B * T:
            return None
        kpm = pad.reshape(B, T)
    res = fla_linear_attention(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), feature_map, initial_state=initial_state,
        return_state=return_state, key_padding_mask=kpm, eps=eps,
    )
    if return_state:
        out, state = res
        return out.transpose(1, 2), state
    return res.transpose(1, 2)  # type: ignore[union-attr]


def _check_scale(scale: object) -> float:
    if isinstance(scale, bool) or not isinstance(scale, (int, float)):
        raise TypeError(f"scale must be a positive float or None, got {scale!r} ({type(scale).__name__})")
    s = float(scale)
    if not (math.isfinite(s) and s > 0):
        raise ValueError(
            f"scale must be a positive finite float (it multiplies q.k; the kernel exp(s q.k) is split "
            f"as sqrt(s) q, sqrt(s) k), got {scale!r}"
        )
    return s


def _check_layout(q: torch.Tensor, k: torch.Tensor, feature_map: object) -> None:
    """Raise where a (B, T, H, K) tensor is detectably read as (B, H, T, K): a per-head map
    (``batch_shape[-1] = H > 1``) whose ``H`` is not dimension -3 of the inputs but dimension -2."""
    bs = tuple(getattr(feature_map, "batch_shape", ()))
    if not bs or bs[-1] == 1:
        return
    h = bs[-1]
    for name, t in (("q", q),):  # (k, v may have fewer heads: grouped-query attention)
        if t.dim() >= 3 and t.shape[-3] not in (1, h) and t.shape[-2] == h:
            raise ValueError(
                f"{name} has shape {tuple(t.shape)}: its dimension -2 has the feature map's {h} heads "
                f"(batch_shape={bs}) and dimension -3 does not; this looks like the (batch, n, heads, d) "
                "layout of flash-linear-attention: pass layout='bthd' (the default layout is "
                "(..., heads, n, d))"
            )


def _grouped_heads(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> int | None:
    """``H_q / H_kv`` when ``k``, ``v`` have fewer heads (dimension -3) than ``q``, which they
    divide (grouped-query attention); ``None`` when the heads match or broadcast."""
    if q.dim() < 3 or k.dim() < 3 or v.dim() < 3:
        return None
    hq, hk, hv = q.shape[-3], k.shape[-3], v.shape[-3]
    if hk != hv:
        if hk == 1 or hv == 1:  # one of them broadcasts: group by the other
            hk = max(hk, hv)
        else:
            raise ValueError(f"k and v must have the same number of heads (dimension -3), got {tuple(k.shape)} "
                             f"and {tuple(v.shape)}")
    if hk in (1, hq):
        return None
    if hq % hk:
        raise ValueError(
            f"q has {hq} heads (dimension -3) and k, v have {hk}: the leading dimensions do not "
            f"broadcast, and grouped-query attention needs the key/value heads to divide the query "
            f"heads (shapes q {tuple(q.shape)}, k {tuple(k.shape)})"
        )
    return hq // hk


def _grouped_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, feature_map: FeatureMap, group: int,
    pad: torch.Tensor | None, **kwargs,
) -> torch.Tensor | tuple[torch.Tensor, LinearAttentionState]:
    """Grouped-query attention (see `linear_attention`): a broadcasting view for a map shared by
    the heads, without state arguments and with a head-free mask; the repetition otherwise."""
    hq = q.shape[-3]
    bs = tuple(getattr(feature_map, "batch_shape", ()))
    view = (
        bs in ((), (1,)) and kwargs["initial_state"] is None and not kwargs["return_state"]
        and (pad is None or pad.dim() < 2 or pad.shape[-2] == 1)
    )
    if not view:
        def rep(t: torch.Tensor) -> torch.Tensor:
            if t.shape[-3] == hq:
                return t
            h = t.shape[-3]
            return t.unsqueeze(-3).expand(*t.shape[:-2], hq // h, *t.shape[-2:]).reshape(
                *t.shape[:-3], hq, *t.shape[-2:])
        return linear_attention(q, rep(k), rep(v), feature_map, key_padding_mask=pad, **kwargs)
    hk = hq // group
    qg = q.unflatten(-3, (hk, group))  # (..., H_kv, g, n, d): a view
    kg, vg = (t.unsqueeze(-3) for t in (k, v))  # (..., H_kv, 1, m, .): views
    pg = None if pad is None else pad.unsqueeze(-2)
    out = linear_attention(qg, kg, vg, feature_map, key_padding_mask=pg, **kwargs)
    return out.flatten(-4, -3)  # type: ignore[union-attr]
