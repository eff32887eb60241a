r"""The student's attention: one call for (window, sinks, causal) over padded batches.

A linearised layer (`kernelapprox.nn`, `kernelapprox.hf.linearize`, `kernelapprox.recover` and the
map training of `kernelapprox.training`) computes, per head,

$$
\hat o_i = \frac{\sum_{j\in S_i} e^{q_i^\top k_j} v_j + \varphi(q_i)^\top\sum_{j\in R_i}\varphi(k_j)v_j^\top}
{\sum_{j\in S_i} e^{q_i^\top k_j} + \varphi(q_i)^\top\sum_{j\in R_i}\varphi(k_j)},
$$

with $S_i$ the exact set (the window and the sinks, empty without a window: linear attention
[Kat20]_) and $R_i$ the keys query $i$ attends to outside it ($j \le i$ if causal, padded keys
never). `padded_attention` is that output (`kernelapprox.linear_attention` without a window,
`kernelapprox.hybrid_attention` with one); `attention_log_weights` is its weights
$\log \hat A_{ij}$ beside the softmax weights $A_{ij}$, the two sides of the distillation losses.

References
----------
.. [Kat20] A. Katharopoulos, A. Vyas, N. Pappas, F. Fleuret. "Transformers are RNNs: fast autoregressive
   transformers with linear attention", ICML 2020.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Literal, cast

import torch

from .._validation import inputs_validated
from ..maps.base import FeatureMap
from . import linear_attention
from .hybrid import HybridAttentionState, exact_set_mask, hybrid_attention
from .hybrid.sinks import check_sinks
from .state import LinearAttentionState

__all__ = ["padded_attention", "attention_log_weights", "check_window_sinks"]


def check_window_sinks(sinks: object, window: int | None) -> int | tuple[int, ...]:
    """``sinks`` as a count or positions (`check_sinks`), refused without a ``window``.

    Parameters
    ----------
    sinks : int or sequence of int
        A count of leading positions or a list of positions.
    window : int or None
        The exact window; sinks other than ``0`` / ``[]`` need one (``window=0`` for sinks alone).

    Returns
    -------
    int or tuple of int

    Examples
    --------
    >>> check_window_sinks([0, 2], 4), check_window_sinks(0, None)
    ((0, 2), 0)
    """
    out = check_sinks(sinks)
    if window is None and out not in (0, ()):
        raise ValueError(
            f"sinks={sinks!r} needs window= (hybrid attention: exact window and sinks, the feature map for the "
            "rest); pass window=0 for exact sinks alone"
        )
    return out


def _repeat_heads(t: torch.Tensor, heads: int) -> torch.Tensor:
    """Grouped key/value heads repeated to ``heads`` query heads (a single head broadcasts)."""
    if t.shape[1] != heads and t.shape[1] != 1:
        return t.repeat_interleave(heads // t.shape[1], dim=1)
    return t


def padded_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    feature_map: FeatureMap,
    *,
    key_padding_mask: torch.Tensor | None = None,
    window: int | None = None,
    sinks: int | Sequence[int] = 0,
    causal: bool = False,
    chunk_size: int = 64,
    window_mode: str = "token",
    initial_state: LinearAttentionState | HybridAttentionState | None = None,
    return_state: bool = False,
    check: bool = False,
) -> Any:
    r"""The student's attention of a padded batch: linear without a ``window``, hybrid with one.

    $$
    \hat o_i = \frac{\sum_{j\in S_i} e^{q_i^\top k_j} v_j + \varphi(q_i)^\top\sum_{j\in R_i}\varphi(k_j)v_j^\top}
    {\sum_{j\in S_i} e^{q_i^\top k_j} + \varphi(q_i)^\top\sum_{j\in R_i}\varphi(k_j)}
    $$

    ($S_i$ empty without a window; padded keys in neither set). Inputs are the scaled kernel
    inputs (the temperature already applied).

    Parameters
    ----------
    q : Tensor, shape (batch, heads, n, d)
    k : Tensor, shape (batch, kv_heads, m, d)
        ``kv_heads`` divides ``heads`` (grouped-query attention); with a window they are repeated
        to the query heads and ``m == n`` (self-attention).
    v : Tensor, shape (batch, kv_heads, m, dv)
    feature_map : FeatureMap
    key_padding_mask : Tensor, optional
        (batch, m) bool, ``True`` = padded key.
    window : int, optional
        The exact window (`kernelapprox.hybrid_attention`); ``None``: linear attention.
    sinks : int or sequence of int, default 0
        Exact sink tokens (a count or positions, `check_window_sinks`); need a window.
    causal : bool, default False
    chunk_size : int, default 64
    window_mode : {"token", "block"}, default "token"
    initial_state : LinearAttentionState or HybridAttentionState, optional
    return_state : bool, default False
    check : bool, default False
        Run `kernelapprox.diagnose.warn_if_hopeless` on the map first (linear attention only).

    Returns
    -------
    out : Tensor, shape (batch, heads, n, dv)
    state : the decoding state, if ``return_state``.

    Examples
    --------
    >>> import torch, kernelapprox as ka
    >>> from kernelapprox.attention.padded import padded_attention
    >>> q, k, v = torch.randn(3, 1, 2, 6, 4).unbind(0)
    >>> fm = ka.PositiveRF(4, 16, seed=0)
    >>> padded_attention(q, k, v, fm, window=2, sinks=1, causal=True).shape
    torch.Size([1, 2, 6, 4])
    """
    sk = check_window_sinks(sinks, window)
    if window is None:
        return linear_attention(
            q, k, v, feature_map, causal=causal, chunk_size=chunk_size, initial_state=cast(Any, initial_state),
            return_state=return_state, key_padding_mask=key_padding_mask, check=check,
        )
    k = _repeat_heads(k, q.shape[1])
    v = _repeat_heads(v, q.shape[1])
    if q.shape[-2] != k.shape[-2]:
        raise ValueError(
            f"window={window} (hybrid attention) needs self-attention, as many keys as queries: got "
            f"q of shape {tuple(q.shape)} and k of shape {tuple(k.shape)}"
        )
    return hybrid_attention(
        q, k, v, feature_map, window=window, sinks=sk if isinstance(sk, int) else list(sk), causal=causal,
        chunk_size=chunk_size, initial_state=cast(Any, initial_state), return_state=return_state,
        key_padding_mask=key_padding_mask, window_mode=window_mode,
    )


def attention_log_weights(
    q: torch.Tensor,
    k: torch.Tensor,
    feature_map: FeatureMap,
    *,
    window: int | None = None,
    sinks: int | Sequence[int] = 0,
    causal: bool = False,
    exact: Literal["softmax", "exclude"] = "softmax",
    rows: torch.Tensor | None = None,
    scale: float = 1.0,
    exact_set: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    r"""The student's attention weights $\log\hat A$ beside the softmax weights $A$ of one unpadded batch.

    With ``exact="softmax"`` (the model's weights): $\hat A_{ij} \propto e^{s q_i^\top k_j}$ on the
    exact set $S_i$ and $\propto \varphi(q_i)^\top\varphi(k_j)$ elsewhere, one normaliser; $A$ is
    softmax attention over every attended key. With ``exact="exclude"`` (the weights a map is
    trained on [Zha24]_): both rows are restricted to the remainder $R_i$ and renormalised there.
    Entries outside a row (future keys if causal, excluded exact keys) are ``0`` in both.

    Parameters
    ----------
    q : Tensor, shape (..., n, d)
    k : Tensor, shape (..., m, d)
    feature_map : FeatureMap
        A positive map (the logarithm of its kernel is taken).
    window : int, optional
    sinks : int or sequence of int, default 0
    causal : bool, default False
    exact : {"softmax", "exclude"}, default "softmax"
    rows : Tensor, optional
        1-d index of the query rows to return (all if None).
    scale : float, default 1.0
        Temperature $s$ of the softmax logits $s\,q^\top k$ (the map sees ``q``, ``k`` as given).
    exact_set : Tensor, optional
        The (n, m) bool exact sets, when the caller has built them (else from ``window``/``sinks``).

    Returns
    -------
    log_hat : Tensor, shape (..., n_rows, m)
    A : Tensor, shape (..., n_rows, m), without gradient

    References
    ----------
    .. [Zha24] M. Zhang, K. Bhatia, H. Kumbong, C. Ré. "The Hedgehog & the Porcupine: Expressive
       Linear Attentions with Softmax Mimicry", ICLR 2024, arXiv:2402.04347 (eq. 5: the distillation
       loss; the map as implemented in flash-linear-attention's ``HedgehogFeatureMap``).

    Examples
    --------
    >>> import torch, kernelapprox as ka
    >>> from kernelapprox.attention.padded import attention_log_weights
    >>> q, k = torch.randn(2, 5, 4).unbind(0)
    >>> log_hat, A = attention_log_weights(q, k, ka.PositiveRF(4, 32, seed=0), causal=True)
    >>> log_hat.shape, bool(torch.allclose(A.sum(-1), torch.ones(5)))
    (torch.Size([5, 5]), True)
    """
    n, m = q.shape[-2], k.shape[-2]
    S = exact_set
    if S is None and window is not None:
        S = exact_set_mask(n, window=window, sinks=sinks, causal=causal, device=q.device)
    if exact == "exclude":
        qs = q if rows is None else q.index_select(-2, rows)
        with torch.no_grad():
            target_logits = scale * torch.matmul(qs, k.mT)
            mask = None
            if causal:
                i = torch.arange(n, device=q.device) if rows is None else rows
                j = torch.arange(m, device=q.device)
                mask = j.unsqueeze(0) > i.unsqueeze(1)  # (n_rows, m): key after query
            if S is not None:
                e = S if rows is None else S.index_select(0, rows)
                mask = e if mask is None else mask | e
            if mask is not None:
                target_logits = target_logits.masked_fill(mask, float("-inf"))
            A = torch.softmax(target_logits, dim=-1)
        with inputs_validated():
            fq, _ = feature_map.log_features(qs)  # per-query scale: cancels in the row normalisation
            fk, sk = feature_map.key_log_features(k)  # per-key scale: kept
        G = torch.matmul(fq, fk.mT)
        logits = torch.log(G.clamp_min(torch.finfo(G.dtype).tiny)) + sk.to(G.dtype).unsqueeze(-2)
        if mask is not None:
            logits = logits.masked_fill(mask, float("-inf"))
        log_hat = torch.log_softmax(logits, dim=-1)
        if mask is not None:
            log_hat = log_hat.masked_fill(mask, 0.0)  # A = 0 there: no 0 * (-inf)
        return log_hat, A
    if rows is not None:
        raise ValueError("rows= is only supported with exact='exclude'")
    exact_logits = q @ k.mT
    if scale != 1.0:
        exact_logits = scale * exact_logits
    with inputs_validated():
        fq, sq = feature_map.log_features(q)
        fk, sk = feature_map.key_log_features(k)
    G = fq @ fk.mT
    lin_logits = torch.log(G.clamp_min(torch.finfo(G.dtype).tiny)) + sq.unsqueeze(-1) + sk.unsqueeze(-2)
    if S is not None:
        lin_logits = torch.where(S, exact_logits, lin_logits)
    if causal:
        future = torch.ones(n, m, dtype=torch.bool, device=q.device).triu(1)
        exact_logits = exact_logits.masked_fill(future, float("-inf"))
        lin_logits = lin_logits.masked_fill(future, float("-inf"))
    log_hat = torch.log_softmax(lin_logits, dim=-1)
    if causal:
        log_hat = log_hat.masked_fill(future, 0.0)  # A = 0 there: no 0 * (-inf)
    return log_hat, torch.softmax(exact_logits.detach(), dim=-1)
