r"""Per-feature log-domain shifts for the remainder of hybrid attention (positive maps).

With natural-log features $\ell^q_{if} = \log\varphi_f(q_i) + c_i$ ($c_i$ any per-row constant)
and $\ell^k_{jf} = \log\psi_f(k_j)$ ($-\infty$ for the keys left out of the remainder: sinks,
padding), each feature is shifted by its maximum over the keys and each query by its maximum
after that:

$$
t_f = \max_j \ell^k_{jf},\qquad s_i = \max_f(\ell^q_{if} + t_f),\qquad
\tilde\psi_{jf} = e^{\ell^k_{jf} - t_f},\qquad \tilde\varphi_{if} = e^{\ell^q_{if} + t_f - s_i},
$$

so $\varphi(q_i)^\top\psi(k_j) = e^{s_i - c_i}\,\tilde\varphi_i^\top\tilde\psi_j$ with every
feature in $[0, 1]$ and, at the maximiser $f^*$ of $s_i$, $\tilde\varphi_{if^*} = 1$ and
$\sum_j\tilde\psi_{jf^*} \ge 1$: the remainder's normaliser $\tilde\varphi_i^\top\sum_j
\tilde\psi_j \ge 1$ cannot underflow, whatever the norms (one shared key scale lets it fall to
0 from $\|q\| \approx 32$ in float32, a row silently 0). The hybrid forms then merge
$s_i$ with the exact part's log-sum-exp under one shift. The shifts are constants for autograd.
"""

from __future__ import annotations

import math

import torch

from ..._validation import inputs_validated
from ...maps.base import FeatureMap

__all__ = ["key_log_features", "log_features_pair", "query_log_features", "shift_per_feature"]

_NEG_INF = float("-inf")


def _safe_log(f: torch.Tensor) -> torch.Tensor:
    """``log f`` with ``-inf`` (and a zero gradient) where ``f <= 0``."""
    pos = f > 0
    return torch.where(pos, torch.where(pos, f, torch.ones_like(f)).log(), torch.full_like(f, _NEG_INF))


def log_features_pair(fm: FeatureMap, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    r"""Natural-log query and key features of a positive map, $\log\varphi(q_i)$ and
    $\log\psi(k_j)$, (..., n, F) each, on the absolute scale of $e^{q^\top k}$ (the exact part
    of hybrid attention shares the normaliser, so no per-row constant may be dropped): the map's
    log2 hooks where it has them (the query hook's row constant restored from `log_features` at
    the row's largest feature), else the logarithm of its stabilised features plus their scale."""
    with inputs_validated():
        fq, sq = fm.log_features(q)
        lq2 = fm.query_log2_features(q)
        lk2 = fm.key_log2_features(k) if lq2 is not None else None
        if lk2 is None:
            fk, sk = fm.key_log_features(k)
    sq = sq.to(fq.dtype).unsqueeze(-1)
    if lq2 is not None and lk2 is not None:
        lq = lq2 * math.log(2.0)
        idx = fq.detach().argmax(dim=-1, keepdim=True)  # f = 1 there: log phi = sq
        lq = lq + (sq + _safe_log(fq.gather(-1, idx)) - lq.gather(-1, idx.expand(*lq.shape[:-1], 1)))
        return lq, lk2 * math.log(2.0)
    return _safe_log(fq) + sq, _safe_log(fk) + sk.to(fk.dtype).unsqueeze(-1)


def query_log_features(fm: FeatureMap, q: torch.Tensor) -> torch.Tensor:
    r"""Natural-log query features $\log\varphi(q_i)$, (..., n, F), on the absolute scale, as in
    `log_features_pair`, without the keys' (a decoding step reads its query alone)."""
    with inputs_validated():
        fq, sq = fm.log_features(q)
        lq2 = fm.query_log2_features(q)
    sq = sq.to(fq.dtype).unsqueeze(-1)
    if lq2 is None:
        return _safe_log(fq) + sq
    lq = lq2 * math.log(2.0)
    # the row constant at the largest feature, where both forms are exact: log phi = log f + sq
    return lq + (sq + _safe_log(fq.amax(dim=-1, keepdim=True)) - lq.amax(dim=-1, keepdim=True))


def key_log_features(fm: FeatureMap, k: torch.Tensor) -> torch.Tensor:
    r"""Natural-log key features $\log\psi(k_j)$, (..., m, F), as in `log_features_pair` (the
    map's log2 hook where it has one, else the logarithm of its stabilised features plus their
    scale), without the queries' (for a state, which holds keys only)."""
    with inputs_validated():
        lk2 = fm.key_log2_features(k)
        if lk2 is not None:
            return lk2 * math.log(2.0)
        fk, sk = fm.key_log_features(k)
    return _safe_log(fk) + sk.to(fk.dtype).unsqueeze(-1)


def shift_per_feature(
    lq: torch.Tensor, lk: torch.Tensor, drop: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    r"""$(\tilde\varphi, \tilde\psi, s)$ of the module docstring.

    Parameters
    ----------
    lq : Tensor, shape (..., n, F)
    lk : Tensor, shape (..., m, F)
    drop : Tensor of bool, shape broadcasting with (..., m), optional
        Keys left out of the remainder (their $\tilde\psi$ rows are 0).

    Returns
    -------
    phi : Tensor, shape (..., n, F)
    psi : Tensor, shape (..., m, F)
    s : Tensor, shape (..., n), float64
        The query shifts (0 for a query whose features meet no key).
    """
    if drop is not None:
        lk = lk.masked_fill(drop.unsqueeze(-1), _NEG_INF)
    with torch.no_grad():
        t = lk.detach().amax(dim=-2, keepdim=True)  # (..., 1, F)
        t = torch.where(torch.isfinite(t), t, torch.zeros_like(t))  # unreached (or non-finite) features
    a = lq + t
    with torch.no_grad():
        s = a.detach().amax(dim=-1, keepdim=True)
        s = torch.where(torch.isfinite(s), s, torch.zeros_like(s))
    return torch.exp(a - s), torch.exp(lk - t), s.squeeze(-1).double()
