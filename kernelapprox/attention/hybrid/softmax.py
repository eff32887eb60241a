r"""The limit ``window >= n`` of hybrid attention: every key a query attends to is in its exact set,
so the result is softmax attention (no feature map, no remainder), computed here in one masked,
max-shifted pass without a loop.

$$
o_i = \frac{\sum_{j\in J_i} e^{q_i^\top k_j - m_i} v_j}{\sum_{j\in J_i} e^{q_i^\top k_j - m_i}},
\qquad m_i = \max_{j\in J_i} q_i^\top k_j ,
$$

$J_i$ the keys that are not padded (and $j \le i$ when causal). A row without any key gives 0,
as the other hybrid forms. Causal: a non-finite value at position $j$ reaches the rows $\ge j$
only (the products use finite values, and the rows from the first non-finite one on are set to
NaN), as `kernelapprox.attention.hybrid.chunk_hybrid_attention`.
"""

from __future__ import annotations

import torch

__all__ = ["softmax_limit"]

_NEG_INF = float("-inf")


def softmax_limit(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lead: torch.Size, causal: bool,
    kpad: torch.Tensor | None, out_dtype: torch.dtype,
) -> torch.Tensor:
    """Softmax attention of checked inputs (compute dtype, ``n == m``), broadcast to ``lead``;
    ``kpad`` (..., n) True = padded key. Returns (*lead, n, dv) in ``out_dtype``."""
    n, d, dv = q.shape[-2], q.shape[-1], v.shape[-1]
    q = q.expand(*lead, n, d)
    k = k.expand(*lead, n, d)
    v = v.expand(*lead, n, dv)
    logits = torch.matmul(q, k.mT)  # (*lead, n, n)
    allowed = None
    if causal:
        allowed = torch.ones(n, n, dtype=torch.bool, device=q.device).tril()
    if kpad is not None:
        keep = ~kpad.expand(*lead, n).unsqueeze(-2)
        allowed = keep if allowed is None else allowed & keep
    poison = None
    if causal:
        bad = ~torch.isfinite(v)
        poison = torch.cumsum(bad.to(torch.int32), dim=-2) > 0
        v = v.masked_fill(bad, 0.0)
    if allowed is not None:
        logits = logits.masked_fill(~allowed, _NEG_INF)
    m = logits.detach().amax(-1, keepdim=True)
    m = torch.where(m == _NEG_INF, torch.zeros_like(m), m)  # a row without any key: weights 0
    p = torch.exp(logits - m)
    num = torch.matmul(p, v)
    den = p.sum(-1, keepdim=True)
    out = num / torch.where(den == 0, torch.ones_like(den), den)
    if poison is not None:
        out = out.masked_fill(poison, float("nan"))
    return out.to(out_dtype)
