r"""Linear attention in the seed's three forms, beside an exact quadratic reference.

Layout (after flash-linear-attention): ``naive`` (quadratic reference), ``parallel`` (non-causal),
``chunk`` (causal, chunk-wise with a carried state), ``recurrent`` (one token per step).
"""

from __future__ import annotations

import warnings

import torch

from .._validation import no_autocast
from ..maps.base import FeatureMap
from .chunk import chunk_linear_attention
from .naive import naive_linear_attention, naive_recurrent_linear_attention
from .parallel import parallel_linear_attention
from .recurrent import RecurrentLinearAttention
from .state import LinearAttentionState


def _checkable(q: object, k: object, fm: FeatureMap) -> bool:
    """Whether the closed-form check runs: valid-looking inputs (the attention forms validate and
    raise otherwise), not on the meta device, and on an accelerator only at a map's first call
    (the decision to warn needs the host: one synchronisation, not one per call)."""
    if not (isinstance(q, torch.Tensor) and isinstance(k, torch.Tensor) and q.is_floating_point()
            and k.is_floating_point() and q.dim() >= 2 and k.dim() >= 2 and q.shape[-1] == fm.dim
            and k.shape[-1] == fm.dim and q.shape[-2] > 0 and k.shape[-2] > 0):
        return False
    try:
        torch.broadcast_shapes(q.shape[:-2], k.shape[:-2])
    except RuntimeError:
        return False
    if q.device.type == "meta":
        return False
    if q.device.type != "cpu":
        if getattr(fm, "_kernelapprox_checked", False):
            return False
        object.__setattr__(fm, "_kernelapprox_checked", True)  # a plain flag, not a module attribute
    return True


def _warn_if_hopeless(fm: FeatureMap, q: torch.Tensor, k: torch.Tensor) -> None:
    from ..diagnose import WARN_RELATIVE_MSE, KernelApproxWarning, quick_relative_mse

    rel = quick_relative_mse(fm, q, k)
    if rel > WARN_RELATIVE_MSE:
        warnings.warn(
            KernelApproxWarning(
                f"{type(fm).__name__} with r = {fm.num_features}: the closed form predicts a relative "
                f"kernel MSE of {rel:.3g} on this batch (at the mean |q + k|^2; > {WARN_RELATIVE_MSE:g}), "
                "so linear attention will be far from softmax attention. Inputs scaled by d^(-1/4)? "
                "See ka.diagnose(q, k) for every estimator and the r each needs; silence with "
                "check=False or warnings.filterwarnings('ignore', category=ka.KernelApproxWarning)."
            ),
            stacklevel=4,  # _warn_if_hopeless < linear_attention < no_autocast wrapper < caller
        )


__all__ = [
    "linear_attention",
    "parallel_linear_attention",
    "chunk_linear_attention",
    "naive_linear_attention",
    "naive_recurrent_linear_attention",
    "RecurrentLinearAttention",
    "LinearAttentionState",
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
    check: bool = True,
) -> torch.Tensor | tuple[torch.Tensor, LinearAttentionState]:
    r"""Linear attention with feature map $\varphi$ (queries and keys use the same map).

    $$
    o_i = \frac{\varphi(q_i)^\top \sum_{j} \varphi(k_j) v_j^\top}{\varphi(q_i)^\top \sum_j \varphi(k_j)}
    \qquad (j \le i \text{ if causal}),
    $$

    computed by associativity: $O(nFd_v)$ time instead of $O(n^2 d)$
    [Kat20]_, [Cho21]_. Non-causal: one state $\varphi(K)^\top[V, 1]$. Causal: chunk-wise
    (`chunk_linear_attention`), memory linear in ``n``.

    Numerics: features come from `FeatureMap.log_features`; the per-query scale cancels in
    the ratio and keys share one scale per sequence, so nothing overflows for finite inputs.
    16-bit inputs are computed in float32 and the output is cast back.

    Parameters
    ----------
    q : Tensor, shape (..., n, d)
    k : Tensor, shape (..., m, d)
    v : Tensor, shape (..., m, dv)
        Leading dimensions broadcast with each other and with ``feature_map.batch_shape``.
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
        Positive maps are only guarded against underflow.
    fit : bool, default False
        First choose the map's data-dependent parameters from this batch,
        ``feature_map.fit(q, k)`` (in place; a no-op for maps without any), as the FAVOR++/FAVOR#
        code does per batch. With ``causal=True`` the statistics then include future keys (the
        official code does the same); fit on a calibration batch instead where that matters.
    check : bool, default True
        Warn (`kernelapprox.KernelApproxWarning`, once per call site under Python's default
        filter) when the map's closed form predicts a relative kernel MSE above
        ``kernelapprox.diagnose.WARN_RELATIVE_MSE`` (1.0) on this batch
        (`kernelapprox.diagnose.quick_relative_mse`: $O(nd)$ statistics, one
        closed-form evaluation; maps without closed-form moments are not checked; on an accelerator
        only the first call of each map is checked, since the decision needs one host
        synchronisation; inside ``torch.compile`` it is skipped, as a warning decided on the host
        would break the graph). ``False``, or
        ``warnings.filterwarnings("ignore", category=ka.KernelApproxWarning)``, turns it off.

    Returns
    -------
    out : Tensor, shape (..., n, dv), dtype ``promote(q, k, v)``
    state : LinearAttentionState, if ``return_state``

    Examples
    --------
    >>> import kernelapprox as ka
    >>> q, k, v = torch.randn(3, 2, 4, 128, 16).unbind(0)
    >>> fm = ka.PositiveRF(dim=16, num_features=64, seed=0)
    >>> out = ka.linear_attention(q / 2, k / 2, v, fm, causal=True)
    >>> out.shape
    torch.Size([2, 4, 128, 16])
    """
    if not isinstance(fit, bool):
        raise TypeError(f"fit must be a bool, got {fit!r}")
    if not isinstance(check, bool):
        raise TypeError(f"check must be a bool, got {check!r}")
    if fit:
        if not isinstance(feature_map, FeatureMap):
            raise TypeError(f"feature_map must be a kernelapprox FeatureMap, got {type(feature_map).__name__}")
        feature_map.fit(q, k)
    if (check and isinstance(feature_map, FeatureMap) and feature_map.is_random
            and not torch.compiler.is_compiling() and _checkable(q, k, feature_map)):
        _warn_if_hopeless(feature_map, q, k)
    if causal:
        return chunk_linear_attention(
            q, k, v, feature_map, chunk_size=chunk_size, initial_state=initial_state,
            return_state=return_state, eps=eps,
        )
    return parallel_linear_attention(
        q, k, v, feature_map, initial_state=initial_state, return_state=return_state, eps=eps
    )
