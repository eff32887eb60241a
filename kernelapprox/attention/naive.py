"""Plain quadratic references for linear attention (the ground truth of the fast forms' tests)."""

from __future__ import annotations

import torch

from .._validation import no_autocast
from ..features import FeatureMap
from ._common import prepare
from .recurrent import RecurrentLinearAttention


@no_autocast
def naive_linear_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, feature_map: FeatureMap, causal: bool = False
) -> torch.Tensor:
    r"""Materialise :math:`\hat A = \varphi(Q)\varphi(K)^\top` (masked if causal) and normalise rows.

    .. math:: o_i = \frac{\sum_j \hat A_{ij} v_j}{\sum_j \hat A_{ij}}.

    :math:`O(n^2)` memory: for tests and small problems only. Uses :meth:`FeatureMap.kernel`.

    Parameters
    ----------
    q : Tensor, shape (..., n, d)
    k : Tensor, shape (..., m, d)
    v : Tensor, shape (..., m, dv)
    feature_map : FeatureMap
    causal : bool

    Returns
    -------
    Tensor, shape (..., n, dv)
    """
    q, k, v, out_dtype, _ = prepare(q, k, v, feature_map, causal, None)
    A = feature_map.kernel(q, k)
    if causal:
        n = A.shape[-1]
        A = A.masked_fill(~torch.ones(n, n, dtype=torch.bool, device=A.device).tril(), 0.0)
    return (torch.matmul(A, v) / A.sum(-1, keepdim=True)).to(out_dtype)


def naive_recurrent_linear_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, feature_map: FeatureMap
) -> torch.Tensor:
    """Causal linear attention by :class:`RecurrentLinearAttention` steps, one token at a time.

    Shapes as :func:`naive_linear_attention`; ``n == m``.
    """
    rnn = RecurrentLinearAttention(feature_map)
    outs = [rnn.step(q[..., t, :], k[..., t, :], v[..., t, :]) for t in range(q.shape[-2])]
    return torch.stack(outs, dim=-2)
