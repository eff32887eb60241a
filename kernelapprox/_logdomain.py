r"""The numerical kit the feature maps share: base-2 exponents ($e^u = 2^{u\log_2 e}$), dense
projections and affine rows written into buffers, stabilised (shifted) exponentials, and the
float64 row statistics ($\|x\|^2/2$, the means behind FAVOR++/FAVOR# fits).

Private to the package: every name here may change without notice. It imports nothing else from
`kernelapprox`, so any module may use it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from ._validation import broadcast_shapes

if TYPE_CHECKING:  # pragma: no cover
    from .samplers import Projection


#: $\log_2 e$: the exponential maps evaluate $e^u = 2^{u \log_2 e}$ with their exponents in base 2,
#: because ``torch.exp2`` is faster than ``torch.exp`` on CPU while as accurate (<= 1 ulp; see
#: docs/performance.md). The factor is folded into the GEMM (its ``alpha``, or the r x d weight),
#: so it costs no pass over the (n, r) features.
LOG2E = 1.4426950408889634


def _project2(proj: Projection, xc: torch.Tensor, gemm: torch.dtype | None = None) -> torch.Tensor:
    r"""$\log_2(e)\, x W^\top$: the projection in base-2 exponent units, so that
    $e^{w^\top x} = 2^{u}$ (x (..., n, d) -> (*broadcast(..., batch_shape), n, r)).

    The factor scales the smaller GEMM operand, never the (n, r) output: $W$ (r x d) for
    attention-sized inputs, ``x`` for a batch of draws against a few rows (the Monte Carlo
    layout, where $W$ is (S, r, d)) and for a projection without a dense $W$ (SORF above
    ``dense_max_dim``). Either way one rounding of the scaled operand (<= 1/2 ulp) is added.

    ``gemm``: the dtype of the GEMM operands (`kernelapprox.backends.gemm_dtype`; default that of
    ``xc``); the result is in ``xc``'s dtype either way."""
    W = proj.gemm_weight(xc.dtype)
    if W is None:
        return proj(xc * LOG2E)
    if gemm is not None and gemm != xc.dtype:
        # 16-bit operands are W and x themselves (a scaled W would be rounded again): the factor
        # goes on the float32 output
        u = _gemm(W, xc, gemm)
        return u * LOG2E if _grad(u) else u.mul_(LOG2E)
    return _dense_apply(*_log2e_operands(W, xc))


def _gemm(W: torch.Tensor, x: torch.Tensor, gemm: torch.dtype | None = None) -> torch.Tensor:
    r"""$x W^\top$ (as `_dense_apply`) with both operands rounded to ``gemm`` (a 16-bit dtype under
    the accelerator policy), accumulated and returned in ``x``'s dtype (float32).

    On an accelerator (and ``meta``) without autograd: one GEMM with 16-bit operands and a float32
    output (``torch.mm(..., out_dtype=torch.float32)``), so the exponents keep float32 precision.
    Elsewhere (the CPU, which has no such kernel, and calls that record autograd, which that
    kernel lacks): the same numbers from the 16-bit-rounded operands multiplied in float32 (the
    products of two 16-bit values are exact in float32)."""
    if gemm is None or gemm == x.dtype:
        return _dense_apply(W, x)
    Wg, xg = W.to(gemm), x.to(gemm)
    if xg.device.type == "cpu" or _grad(Wg, xg):
        return _dense_apply(Wg.to(x.dtype), xg.to(x.dtype))
    n, d = x.shape[-2:]
    r = W.shape[-2]
    if W.dim() == 2:
        u = torch.mm(xg.reshape(-1, d), Wg.mT, out_dtype=x.dtype)
        return u.view(*x.shape[:-1], r)
    lead = broadcast_shapes(x.shape[:-2], W.shape[:-2])
    xb = xg.expand(*lead, n, d).reshape(-1, n, d)
    Wb = Wg.expand(*lead, r, d).reshape(-1, r, d)
    return torch.bmm(xb, Wb.mT, out_dtype=x.dtype).view(*lead, n, r)


def _dense_apply(W: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    r"""$x W^\top$ for W (*B, r, d), x (..., n, d) -> (*broadcast(..., B), n, r)."""
    if W.dim() > 2 and x[..., 0, 0].numel() == 1:
        # Many draws, one input (the Monte Carlo layout): one (S r, d) x (d, n) GEMM instead of
        # S tiny batched products.
        n, d = x.shape[-2:]
        lead = broadcast_shapes(x.shape[:-2], W.shape[:-2])
        u = torch.matmul(W.reshape(-1, d), x.reshape(n, d).mT)  # (S r, n)
        return u.reshape(*W.shape[:-2], W.shape[-2], n).mT.reshape(*lead, n, W.shape[-2])
    return torch.matmul(x, W.mT)


def _log2e_operands(W: torch.Tensor, xc: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(W, xc)`` with the smaller of the two multiplied by ``LOG2E`` (see `_project2`)."""
    return (W * LOG2E, xc) if W.numel() <= xc.numel() else (W, xc * LOG2E)


def _sqnorm_half(x: torch.Tensor, low: bool = False) -> torch.Tensor:
    """$\\|x\\|^2/2$, shape (..., n), returned in float64 (``low``: in ``x``'s dtype, float32
    under the accelerator policy, and without a GEMM).

    A per-row vector, so float64 costs nothing here, while a float32 log scale of
    $\\|x\\|^2/2 = 50$ would carry a rounding of ~3e-6 into every kernel entry. The dot
    product is accumulated in the input's precision (a batched dot, not an upcast copy of ``x``).
    """
    if low:
        return 0.5 * torch.linalg.vector_norm(x, dim=-1).square()
    return 0.5 * torch.einsum("...d,...d->...", x, x).double()


def _grad(*ts: torch.Tensor) -> bool:
    return torch.is_grad_enabled() and any(t.requires_grad for t in ts)


def _affine_rows(
    proj: Projection,
    xc: torch.Tensor,
    c: torch.Tensor,
    out: torch.Tensor | None = None,
    beta: float = 1.0,
    alpha: float = 1.0,
    gemm: torch.dtype | None = None,
) -> torch.Tensor | None:
    r"""$u = \alpha\, x W^\top + \beta\, c\,\mathbf 1^\top$ as one ``addmm`` (the row bias is the GEMM's
    $C$ input, so no separate pass adds it), when the projection is one dense 2-D $W$ (dense, or
    a small SORF through its cached $W$); ``None`` otherwise (batched projections, large SORF).

    Parameters
    ----------
    proj : Projection
    xc : Tensor, shape (..., n, d)
        Prepared input (compute dtype).
    c : Tensor, shape (..., n)
        Row bias (any floating dtype; cast to ``xc.dtype``).
    out : Tensor, shape (N, r), optional
        Where to write $u$ (``N`` the number of rows of ``xc``; may be a strided view), without
        autograd; ignored when autograd records or under ``torch.compile``.
    beta : float, default 1
        Factor of the bias.
    alpha : float, default 1
        Factor of the product (``LOG2E`` for base-2 exponents).

    gemm : torch.dtype, optional
        The dtype of the GEMM operands; one other than ``xc``'s (the accelerator policy) gives
        ``None`` (the bias is then added in ``xc``'s dtype by the caller).

    Returns
    -------
    Tensor, shape (..., n, r) (``out`` itself when given and used), or ``None``.
    """
    W = proj.gemm_weight(xc.dtype)
    if W is None or W.dim() != 2 or (gemm is not None and gemm != xc.dtype):
        return None
    d, r = xc.shape[-1], W.shape[-2]
    x2 = xc.reshape(-1, d)
    # beta applied to the (n,) vector here, not by addmm: an addmm with beta != 1 costs an extra
    # pass over its (n, r) output (see docs/performance.md)
    c2 = (c if beta == 1.0 else c * beta).to(xc.dtype).reshape(-1, 1)
    if out is not None and not _grad(x2, c2, W) and not torch.compiler.is_compiling():
        return torch.addmm(c2, x2, W.mT, alpha=alpha, out=out)
    return torch.addmm(c2, x2, W.mT, alpha=alpha).view(*xc.shape[:-1], r)


def _op_into(op: Any, out: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
    """``op(*args, out=out, **kwargs)``: the result written into ``out`` (often a strided slice of
    a larger buffer). Under ``torch.compile``, where an ``out=`` into a non-contiguous tensor
    breaks the graph, the same values are computed then copied in (the compiler fuses the copy)."""
    if torch.compiler.is_compiling():
        return out.copy_(op(*args, **kwargs))
    return op(*args, out=out, **kwargs)


def _exp_shifted(
    u: torch.Tensor, m: torch.Tensor, c: torch.Tensor, shared: bool, base2: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    r"""Stabilised $\exp(u + c)$ for $\log\varphi = u + c$ (``u`` (..., n, F), ``c`` (..., n)).

    ``m`` (..., n) is the (detached) row max of ``u``. Per row: ``f = exp(u - m)``,
    ``log_scale = m + c``. Shared: ``M = max_rows(m + c)`` (detached), ``f = exp(u + c - M)``,
    ``log_scale = M``. The bias ``c`` keeps its gradient; the shifts are constants.

    With ``base2``, ``u`` and ``m`` are in base-2 units ($\log_2 e$ times the natural exponent,
    from `_project2`) and ``f = exp2(u - shift)``; ``c`` and ``log_scale`` stay natural logs.
    """
    if c.shape != m.shape:
        c = c.expand(m.shape)
    k = LOG2E if base2 else 1.0
    m_nat = m.to(c.dtype) / k if base2 else m
    if shared:
        with torch.no_grad():
            M = (m_nat + c).amax(dim=-1, keepdim=True)
        # shift = M - c (in u's units), written as m - ((m + c) - M): exactly m on the row
        # attaining M (so its features stay <= 1 also where |c| >> |m| would cancel m out of
        # M - c); carries the gradient of c.
        d = (m_nat + c) - M
        shift = (m - (d * k if base2 else d)).to(u.dtype)
        ls = M
    else:
        shift = m
        ls = m_nat.to(c.dtype) + c
    exp, exp_ = (torch.exp2, torch.Tensor.exp2_) if base2 else (torch.exp, torch.Tensor.exp_)
    if _grad(u, shift):
        f = exp(u - shift.unsqueeze(-1))
    else:
        f = exp_(u.sub_(shift.unsqueeze(-1)))
    return f, ls


def _mean_stats(q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Means over rows of |q|^2 and |k|^2, and mean(q).mean(k), float64, shape (...) each.

    Sums are accumulated in the inputs' precision (at least float32: a relative rounding of
    ~1e-6 in the statistic, negligible in the fitted parameter) and finished in float64.
    """
    nq = torch.linalg.vector_norm(q, dim=(-2, -1)).double() ** 2 / q.shape[-2]  # one pass, no copy
    nk = torch.linalg.vector_norm(k, dim=(-2, -1)).double() ** 2 / k.shape[-2]
    cross = (q.mean(-2).double() * k.mean(-2).double()).sum(-1)
    return nq, nk, cross
