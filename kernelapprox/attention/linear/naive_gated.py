r"""Exact log-domain references for linear attention, and the gated recurrence written plainly.

`exact_linear_attention` is the ground truth of the survey tests: the estimator's attention
$o_i = \sum_j \hat A_{ij} v_j / \sum_j \hat A_{ij}$, $\hat A_{ij} = \varphi(q_i)^\top\psi(k_j)$,
computed in float64 and, for positive maps, in the log domain ($\log \hat A_{ij}$ by a
log-sum-exp over the features, the row normalised by a log-sum-exp over the keys), so that no
row underflows however peaked the features. `naive_gated_linear_attention` is the recurrence
that the torch and fused forms compute, one token per step: the running maximum of the key
log-features as a decay gate (after gated linear attention [Yan24]_). Both are for tests and
small problems: $O(n m F)$ memory, or a Python loop over tokens.

References
----------
.. [Yan24] S. Yang, B. Wang, Y. Shen, R. Panda, Y. Kim. "Gated linear attention transformers
   with hardware-efficient training", ICML 2024.
"""

from __future__ import annotations

import copy
import math

import torch

from ..._validation import broadcast_shapes, no_autocast
from ...exact import check_qkv
from ...maps.base import FeatureMap
from .._common import padding_mask

__all__ = ["exact_linear_attention", "log_features", "naive_gated_linear_attention", "signed_weights"]

_LN2 = math.log(2.0)


def log_features(feature_map: FeatureMap, x: torch.Tensor, side: str) -> torch.Tensor | None:
    r"""Natural-log features $\log\varphi(x)$ (``side="query"``) or $\log\psi(x)$ (``"key"``),
    (..., n, F), in ``x``'s dtype; ``None`` for a signed map.

    From the map's log2 hooks (`FeatureMap.query_log2_features`, `FeatureMap.key_log2_features`)
    where it has them; else $\log f + s$ from `FeatureMap.log_features` /
    `FeatureMap.key_log_features` (exact up to the underflow of ``f`` in ``x``'s dtype). The query
    side is exact up to an additive constant per row, which cancels in attention.

    Examples
    --------
    >>> import kernelapprox as ka
    >>> fm = ka.EluFeatures(3)
    >>> x = torch.tensor([[0.5, -1.0, 2.0]], dtype=torch.float64)
    >>> torch.allclose(log_features(fm, x, "key").exp(), fm(x))
    True
    """
    if not feature_map.positive:
        return None
    hook = feature_map.query_log2_features if side == "query" else feature_map.key_log2_features
    l2 = hook(x)
    if l2 is not None:
        return l2 * _LN2
    f, s = (feature_map.log_features if side == "query" else feature_map.key_log_features)(x)
    return torch.log(f) + s.to(f.dtype).unsqueeze(-1)


@no_autocast
def exact_linear_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    feature_map: FeatureMap,
    causal: bool = False,
    key_padding_mask: torch.Tensor | None = None,
) -> torch.Tensor:
    r"""The exact answer of linear attention, in float64 (log domain for positive maps).

    $$
    o_i = \frac{\sum_{j\in J_i} e^{\ell_{ij}} v_j}{\sum_{j\in J_i} e^{\ell_{ij}}},\qquad
    \ell_{ij} = \log\sum_f e^{\log\varphi_f(q_i) + \log\psi_f(k_j)}
    $$

    ($J_i$: the unpadded keys, $j \le i$ if causal): a softmax over $j$ of log-sum-exps over
    the features, so a row is exact whatever the size of its weights. Signed maps use the plain
    formula $\hat A = \varphi(Q)\psi(K)^\top$ in float64. A row without any key gives 0. The
    map is evaluated on a float64 copy of itself; $O(nmF)$ memory.

    Parameters
    ----------
    q : Tensor, shape (..., n, d)
    k : Tensor, shape (..., m, d)
    v : Tensor, shape (..., m, dv)
    feature_map : FeatureMap
    causal : bool, default False
    key_padding_mask : Tensor, optional
        Bool, ``True`` = padded key, as in `kernelapprox.linear_attention`.

    Returns
    -------
    Tensor, shape (..., n, dv), float64.

    Examples
    --------
    Peaked Hedgehog features whose float32 products underflow: the exact rows.

    >>> import kernelapprox as ka
    >>> fm = ka.HedgehogFeatures(4, 4)
    >>> with torch.no_grad():
    ...     _ = fm.weight.mul_(40)
    >>> q = torch.tensor([[2.0, 0, 0, 0], [2.0, 0, 0, 0]])
    >>> k = torch.tensor([[0, 2.0, 0, 0], [0, 0, 2.0, 0]])
    >>> v = torch.tensor([[1.0], [3.0]])
    >>> exact_linear_attention(q, k, v, fm, causal=True).squeeze(-1)
    tensor([1., 2.], dtype=torch.float64)
    """
    if not isinstance(feature_map, FeatureMap):
        raise TypeError(f"feature_map must be a kernelapprox FeatureMap, got {type(feature_map).__name__}")
    check_qkv(q, k, v, causal=causal)
    pad = padding_mask(key_padding_mask, k.shape)
    fm = copy.deepcopy(feature_map).to(torch.float64)
    q64, k64, v64 = q.detach().double(), k.detach().double(), v.detach().double()
    with torch.no_grad():
        lq = log_features(fm, q64, "query")
        n, m = q.shape[-2], k.shape[-2]
        keep = torch.ones(n, m, dtype=torch.bool, device=q.device)
        if causal:
            keep = keep.tril()
        if pad is not None:
            keep = keep & ~pad.unsqueeze(-2)
        if lq is None:
            A = signed_weights(fm, q64, k64, keep)
            den = A.sum(-1, keepdim=True)
            num = A @ v64
            return torch.where(den == 0, torch.zeros_like(num), num / torch.where(den == 0, 1.0, den))
        lk = log_features(fm, k64, "key")
        assert lk is not None  # a positive map
        ell = torch.logsumexp(lq.unsqueeze(-2) + lk.unsqueeze(-3), dim=-1)  # (..., n, m)
        ell = ell.masked_fill(~keep, float("-inf"))
        top = ell.amax(-1, keepdim=True)
        empty = top == float("-inf")
        w = torch.exp(ell - torch.where(empty, 0.0, top))
        out = (w @ v64) / torch.where(empty, 1.0, w.sum(-1, keepdim=True))
        return torch.where(empty, torch.zeros_like(out), out)


def signed_weights(
    feature_map: FeatureMap, q: torch.Tensor, k: torch.Tensor, keep: torch.Tensor
) -> torch.Tensor:
    r"""$\hat A_{ij} = \varphi(q_i)^\top\psi(k_j)$ up to a positive factor per row, zero where
    ``keep`` is false: ``f_q f_k^T`` times $e^{s_j - \max_{j'} s_{j'}}$ from the maps' stabilised
    features (`FeatureMap.log_features`), so that nothing overflows where $\varphi$ itself would.

    Examples
    --------
    >>> import kernelapprox as ka
    >>> fm = ka.TrigRF(3, 8, seed=0).double()
    >>> q, k = torch.randn(2, 4, 3, dtype=torch.float64).unbind(0)
    >>> A = signed_weights(fm, q, k, torch.ones(4, 4, dtype=torch.bool))
    >>> B = fm(q) @ fm(k).T
    >>> torch.allclose(A / A.sum(-1, keepdim=True), B / B.sum(-1, keepdim=True))
    True
    """
    fq, _ = feature_map.log_features(q)
    fk, sk = feature_map.key_log_features(k)
    sk = sk.to(fk.dtype).unsqueeze(-2).masked_fill(~keep, float("-inf"))  # (..., n, m)
    top = sk.amax(-1, keepdim=True)
    top = torch.where(top == float("-inf"), torch.zeros_like(top), top)
    return (fq @ fk.mT) * torch.exp(sk - top)


def naive_gated_linear_attention(
    lq: torch.Tensor,
    lk: torch.Tensor,
    v: torch.Tensor,
    log_state: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
    r"""Causal linear attention as the gated recurrence, one token per step (per-feature gates).

    With key log-features $a_{t,f}$ (``lk``), $m_{t,f} = \max(m_{t-1,f}, a_{t,f})$ the running
    maximum, $g_t = m_{t-1} - m_t \le 0$ and query log-features $b_t$ (``lq``):
    $$
    \tilde S_t = e^{g_t} \circ \tilde S_{t-1} + e^{a_t - m_t} [v_t, 1]^\top,\qquad
    [\text{num}, \text{den}]_t = \big(e^{b_t + m_t - M_t}\big)^\top \tilde S_t,\qquad
    M_t = \max_f (b_{t,f} + m_{t,f}),
    $$
    and $o_t = \text{num}_t / \text{den}_t$. Every factor is in $[0, 1]$ and the feature at
    the maximiser of $M_t$ holds a term 1, so $\text{den}_t \ge 1$ for a row that has seen a key:
    no row underflows. A feature no key has reached yet ($m = -\infty$) has a zero state and
    gate 0 (the first key it meets sets its scale). $m$ and $g$ are constants for autograd
    ($e^{-m_t}$ cancels in the ratio). A plain loop over tokens: the reference of the chunked
    and fused forms.

    Parameters
    ----------
    lq : Tensor, shape (..., n, F)
        $\log\varphi(q_t)$ up to a constant per row.
    lk : Tensor, shape (..., n, F)
        $\log\psi(k_t)$ ($-\infty$ for a padded key).
    v : Tensor, shape (..., n, dv)
    log_state : (Tensor (..., F, dv + 1), Tensor (..., F)), optional
        A state $(\tilde S, m)$ to continue.

    Returns
    -------
    out : Tensor, shape (..., n, dv)
        0 in a row that has seen no key.
    log_state : (Tensor (..., F, dv + 1), Tensor (..., F))
        $(\tilde S_n, m_n)$.

    Examples
    --------
    >>> lq = torch.tensor([[200.0, -200.0], [0.0, -400.0]])
    >>> lk = torch.tensor([[-400.0, 0.0], [-400.0, 0.0]])
    >>> v = torch.tensor([[1.0], [3.0]])
    >>> naive_gated_linear_attention(lq, lk, v)[0].squeeze(-1)
    tensor([1., 2.])
    """
    lead = broadcast_shapes(lq.shape[:-2], lk.shape[:-2], v.shape[:-2])
    n, Fd, dv = lk.shape[-2], lk.shape[-1], v.shape[-1]
    v1 = torch.cat([v, torch.ones_like(v[..., :1])], dim=-1).expand(*lead, n, dv + 1)
    lq, lk = lq.expand(*lead, n, Fd), lk.expand(*lead, n, Fd)
    ninf = float("-inf")
    if log_state is None:
        S = v1.new_zeros(*lead, Fd, dv + 1)
        mm = lk.new_full((*lead, Fd), ninf)
    else:
        S, mm = log_state[0].expand(*lead, Fd, dv + 1), log_state[1].expand(*lead, Fd)
    outs = []
    for t in range(n):
        a = lk[..., t, :]
        with torch.no_grad():
            new = torch.maximum(mm, a)
            ref = torch.where(new == ninf, torch.zeros_like(new), new)
            gate = torch.where(mm == ninf, torch.zeros_like(mm), torch.exp(mm - ref))
        S = gate.unsqueeze(-1) * S + torch.exp(a - ref).unsqueeze(-1) * v1[..., t, :].unsqueeze(-2)
        mm = new
        b = lq[..., t, :] + ref
        with torch.no_grad():
            top = torch.where(new == ninf, torch.full_like(b, ninf), b).amax(-1, keepdim=True)
            top = torch.where(top == ninf, torch.zeros_like(top), top)
        o = (torch.exp(b - top).unsqueeze(-2) @ S).squeeze(-2)
        num, den = o[..., :dv], o[..., dv:]
        outs.append(torch.where(den > 0, num / torch.where(den > 0, den, torch.ones_like(den)), torch.zeros_like(num)))
    return torch.stack(outs, dim=-2), (S, mm)

