r"""Plain quadratic references for linear attention: the ground truth of the fast forms' tests.

Following flash-linear-attention's layout, these are the plainest formulas, sharing no code with
the fast paths (`.parallel`, `.chunk`, `.recurrent`): the features are the plain
$\varphi(x)$ of ``feature_map(x)`` (no log-domain stabilisation, so they overflow where
$\varphi$ itself does -- use moderate inputs, in float64), the kernel matrix is materialised,
and nothing is guarded. $O(n^2)$ memory (`naive_linear_attention`) or a Python loop
over tokens (`naive_recurrent_linear_attention`): for tests and small problems only.
"""

from __future__ import annotations

import torch

from ..._validation import broadcast_shapes, compute_dtype, no_autocast
from ...exact import check_qkv
from ...maps.base import FeatureMap


def _plain_features(q, k, v, feature_map, causal):
    if not isinstance(feature_map, FeatureMap):
        raise TypeError(f"feature_map must be a kernelapprox FeatureMap, got {type(feature_map).__name__}")
    check_qkv(q, k, v, causal=causal)
    out_dtype = torch.promote_types(torch.promote_types(q.dtype, k.dtype), v.dtype)
    cdt = compute_dtype(out_dtype, feature_map.param_dtype)
    return feature_map(q.to(cdt)), feature_map.key_features(k.to(cdt)), v.to(cdt), out_dtype


@no_autocast
def naive_linear_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, feature_map: FeatureMap, causal: bool = False
) -> torch.Tensor:
    r"""Materialise $\hat A = \varphi(Q)\varphi(K)^\top$ (lower-triangular if causal) and
    normalise its rows.

    $$
    o_i = \frac{\sum_j \hat A_{ij} v_j}{\sum_j \hat A_{ij}} \qquad (j \le i \text{ if causal}).
    $$

    Parameters
    ----------
    q : Tensor, shape (..., n, d)
    k : Tensor, shape (..., m, d)
    v : Tensor, shape (..., m, dv)
    feature_map : FeatureMap
    causal : bool, default False
        Keep $j \le i$ only (``n == m``).

    Returns
    -------
    Tensor, shape (..., n, dv), dtype ``promote(q, k, v)``.

    Examples
    --------
    >>> import kernelapprox as ka
    >>> q, k, v = torch.randn(3, 6, 4, dtype=torch.float64).unbind(0)
    >>> fm = ka.EluFeatures(4)
    >>> A = fm(q) @ fm(k).T
    >>> torch.allclose(naive_linear_attention(q, k, v, fm), (A @ v) / A.sum(-1, keepdim=True))
    True
    """
    phi_q, phi_k, v, out_dtype = _plain_features(q, k, v, feature_map, causal)
    A = phi_q @ phi_k.mT
    if causal:
        n = A.shape[-1]
        A = A.masked_fill(~torch.ones(n, n, dtype=torch.bool, device=A.device).tril(), 0.0)
    return ((A @ v) / A.sum(-1, keepdim=True)).to(out_dtype)


@no_autocast
def naive_recurrent_linear_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, feature_map: FeatureMap
) -> torch.Tensor:
    r"""Causal linear attention as the plain recurrence, one token at a time.

    $$
    S_t = S_{t-1} + \varphi(k_t) v_t^\top,\quad z_t = z_{t-1} + \varphi(k_t),\quad
    o_t = \frac{S_t^\top\varphi(q_t)}{z_t^\top\varphi(q_t)}.
    $$

    Parameters
    ----------
    q, k : Tensor, shape (..., n, d)
    v : Tensor, shape (..., n, dv)
    feature_map : FeatureMap

    Returns
    -------
    Tensor, shape (..., n, dv), dtype ``promote(q, k, v)``.

    Examples
    --------
    >>> import kernelapprox as ka
    >>> q, k, v = torch.randn(3, 5, 4, dtype=torch.float64).unbind(0)
    >>> fm = ka.EluFeatures(4)
    >>> torch.allclose(naive_recurrent_linear_attention(q, k, v, fm),
    ...                naive_linear_attention(q, k, v, fm, causal=True))
    True
    """
    phi_q, phi_k, v, out_dtype = _plain_features(q, k, v, feature_map, True)
    lead = broadcast_shapes(phi_q.shape[:-2], phi_k.shape[:-2], v.shape[:-2])
    S = phi_k.new_zeros(*lead, phi_k.shape[-1], v.shape[-1])
    z = phi_k.new_zeros(*lead, phi_k.shape[-1])
    outs = []
    for t in range(q.shape[-2]):
        S = S + phi_k[..., t, :, None] * v[..., t, None, :]
        z = z + phi_k[..., t, :]
        pq = phi_q[..., t, :]
        outs.append((pq.unsqueeze(-2) @ S).squeeze(-2) / (pq * z).sum(-1, keepdim=True))
    return torch.stack(outs, dim=-2).to(out_dtype)
