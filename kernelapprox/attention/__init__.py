r"""Linear attention in three forms, beside an exact quadratic reference.

Layout (after flash-linear-attention): ``naive`` (quadratic reference), ``parallel`` (non-causal),
``chunk`` (causal: a dispatcher over ``chunk_shared`` and ``chunk_runmax``, one algorithm each),
``recurrent`` (one token per step). The forms compute attention only: the closed-form check of a
map lives in `kernelapprox.diagnose` (``warn_if_hopeless``), run by the layers that build maps
(`kernelapprox.nn`, `kernelapprox.hf.linearize`) and here on request (``check=True``).
"""

from __future__ import annotations

import torch

from .._validation import no_autocast
from ..features import FeatureMap
from ._common import run_input_checks
from .chunk import chunk_linear_attention
from .naive import naive_linear_attention, naive_recurrent_linear_attention
from .parallel import parallel_linear_attention
from .recurrent import RecurrentLinearAttention
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
    check : bool, default False
        Also run `kernelapprox.diagnose.warn_if_hopeless` on this call: a
        `kernelapprox.KernelApproxWarning` (pointing at the caller) when the map's closed form
        predicts a relative kernel MSE above 1 on this batch ($O(nd)$ statistics and one host
        synchronisation; skipped inside ``torch.compile``). Off by default: this function computes
        attention only. The layers of `kernelapprox.nn` check once per map by default.

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
    if check:
        run_input_checks(feature_map, q, k)
    if causal:
        return _chunk(
            q, k, v, feature_map, chunk_size=chunk_size, initial_state=initial_state,
            return_state=return_state, eps=eps,
        )
    return _parallel(q, k, v, feature_map, initial_state=initial_state, return_state=return_state, eps=eps)
