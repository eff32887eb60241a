"""Exponential random features: positive (FAVOR+) and hyperbolic [Cho21]_.

References
----------
- [Cho21] K. Choromanski et al. "Rethinking Attention with Performers", ICLR 2021,
   arXiv:2009.14794 (Lemma 1, eq. 7: positive features; Lemma 2: MSEs; §2.4 hyperbolic).
"""

from __future__ import annotations

import math

import torch

from .._logdomain import (
    LOG2E,
    _affine_rows,
    _exp_shifted,
    _gemm,
    _grad,
    _op_into,
    _project2,
    _sqnorm_half,
)
from .._validation import broadcast_shapes
from ..registry import register_estimator
from .base import RandomFeatureMap

__all__ = ["PositiveRF", "HyperbolicRF"]


class PositiveRF(RandomFeatureMap):
    r"""Positive random features (FAVOR+) [Cho21]_ Lemma 1.

    $$
    \varphi(x) = \frac{e^{-\|x\|^2/2}}{\sqrt r}\,\big[e^{w_1^\top x}, \dots, e^{w_r^\top x}\big],
    \qquad \mathbb E\,\varphi(x)^\top\varphi(y) = e^{x^\top y}.
    $$

    ``feature_dim = r``. MSE (iid): $\frac1r e^{\|x+y\|^2}\mathrm{SM}^2(1-e^{-\|x+y\|^2})$
    (`kernelapprox.theory.positive_mse`). Stabilised form: per-row max of
    $w^\top x - \|x\|^2/2$ subtracted (queries), one max per sequence for keys. Evaluated as
    $2^{\log_2(e)(\cdot)}$: `LOG2E` folded into the GEMM, then ``exp2`` in place (faster than
    ``exp`` on CPU and as accurate; see docs/performance.md).

    Parameters are those of `RandomFeatureMap`.

    Examples
    --------
    >>> fm = PositiveRF(dim=64, num_features=256, sampler="orthogonal", seed=0)
    >>> x = torch.randn(2, 8, 100, 64) / 64 ** 0.25
    >>> fm(x).shape
    torch.Size([2, 8, 100, 256])
    """

    positive = True


    def _bias(self, xc: torch.Tensor, low: bool = False) -> torch.Tensor:
        return -_sqnorm_half(xc, low) - 0.5 * math.log(self.num_features)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        fast = self._fused(x, plain=True)
        if fast is not None:
            return fast
        xc, out_dtype, g = self._prepare_gemm("x", x)
        # 2^(log2(e) (xW^T + c)): one addmm with log2(e) as alpha and the row bias, times
        # log2(e), as its C (_affine_rows scales the (n,) vector, so the addmm runs with beta 1),
        # then exp2 in place (one pass over the output; see docs/performance.md).
        c = self._bias(xc, g != xc.dtype)
        u = _affine_rows(self.projection, xc, c, beta=LOG2E, alpha=LOG2E, gemm=g)
        if u is None:  # batched or transform projections, or 16-bit GEMM operands
            u = _project2(self.projection, xc, g)
            c2 = (c * LOG2E).to(u.dtype).unsqueeze(-1)
            u = u + c2 if _grad(u, c2) else u.add_(c2)
        return (torch.exp2(u) if _grad(u) else u.exp2_()).to(out_dtype)

    def log_features(self, x, shared=False):
        fast = self._fused(x, shared)
        if fast is not None:
            return fast
        xc, out_dtype, g = self._prepare_gemm("x", x)
        u = _project2(self.projection, xc, g)
        with torch.no_grad():
            m = u.amax(dim=-1)
        f, ls = _exp_shifted(u, m, self._bias(xc, g != xc.dtype), shared, base2=True)
        return self._policy_out(f, ls, out_dtype, g)

    def query_features(self, x):
        xc, out_dtype, g = self._prepare_gemm("x", x)
        u = _project2(self.projection, xc, g)
        with torch.no_grad():
            m = u.amax(dim=-1, keepdim=True)
        f = torch.exp2(u - m) if _grad(u) else u.sub_(m).exp2_()
        return f if g == f.dtype else f.to(out_dtype)

    def query_log2_features(self, x):
        cls = type(self)
        if cls.query_features is not PositiveRF.query_features or cls.log_features is not PositiveRF.log_features:
            return None
        xc, _, g = self._prepare_gemm("x", x)
        return _project2(self.projection, xc, g)

    def key_log2_features(self, x):
        cls = type(self)
        if cls.log_features is not PositiveRF.log_features or cls.key_log_features is not PositiveRF.key_log_features:
            return None
        xc, _, g = self._prepare_gemm("x", x)
        u = _project2(self.projection, xc, g)
        return u + (self._bias(xc, g != xc.dtype) * LOG2E).to(u.dtype).unsqueeze(-1)

    def key_features_recyclable(self) -> bool:
        # log_features returns the projection's fresh output; a subclass that overrides how
        # features are computed does not inherit the promise (nor query_features_into)
        cls = type(self)
        return all(getattr(cls, m) is getattr(PositiveRF, m)
                   for m in ("log_features", "key_log_features", "query_features", "query_features_into"))

    def query_features_into(self, x, buf):
        xc, _, g = self._prepare_gemm("x", x)
        if not PositiveRF.key_features_recyclable(self) or g != xc.dtype:
            return self.query_features(x)
        lead = broadcast_shapes(xc.shape[:-2], self.batch_shape)
        shape = (*lead, xc.shape[-2], self.num_features)
        numel = math.prod(shape)
        if (
            buf is None or buf.dtype != xc.dtype or buf.device != xc.device or not buf.is_contiguous()
            or buf.numel() < numel or _grad(xc, *self.projection.buffers()) or torch.compiler.is_compiling()
        ):
            return self.query_features(x)
        u = self.projection.project_into(xc, buf.view(-1)[:numel].view(shape), scale=LOG2E)
        return u.sub_(u.amax(dim=-1, keepdim=True)).exp2_()


register_estimator(
    PositiveRF, name="positive", label="positive", feature_dim="r",
    theory="kernelapprox.theory.exponential:POSITIVE_THEORY",
)


class HyperbolicRF(RandomFeatureMap):
    r"""Hyperbolic (antithetic positive) random features [Cho21]_ Lemma 2 / §2.4.

    $$
    \varphi(x) = \frac{e^{-\|x\|^2/2}}{\sqrt{2r}}\,\big[e^{Wx}, e^{-Wx}\big],\qquad
    \hat K = \frac{e^{-(\|x\|^2+\|y\|^2)/2}}{r}\sum_i \cosh\big(w_i^\top(x+y)\big).
    $$

    ``feature_dim = 2r``. MSE (iid): $\tfrac12(1-e^{-\|x+y\|^2})$ times that of
    `PositiveRF` with the same ``r`` (`kernelapprox.theory.hyperbolic_mse`).

    Examples
    --------
    >>> fm = HyperbolicRF(dim=8, num_features=32, seed=0)
    >>> fm(torch.randn(10, 8)).shape
    torch.Size([10, 64])
    """

    positive = True


    def _bias(self, xc: torch.Tensor, low: bool = False) -> torch.Tensor:
        return -_sqnorm_half(xc, low) - 0.5 * math.log(2 * self.num_features)

    @staticmethod
    def _pm(u: torch.Tensor) -> torch.Tensor:
        """``[u, -u]`` along the last dim."""
        if _grad(u):
            return torch.cat((u, -u), dim=-1)
        r = u.shape[-1]
        out = u.new_empty(*u.shape[:-1], 2 * r)
        out[..., :r] = u
        _op_into(torch.neg, out[..., r:], u)
        return out

    def forward(self, x):
        fast = self._fused(x, plain=True)
        if fast is not None:
            return fast
        xc, out_dtype, g = self._prepare_gemm("x", x)
        low = g != xc.dtype
        W = self.projection.gemm_weight(xc.dtype)
        if torch.compiler.is_compiling():
            # one GEMM with [W; -W], then the bias and the exp as one fused epilogue over 2r
            # columns: 2.2x the r-wide GEMM compiled, where the addmm/cat forms below compiled to
            # 3.4-3.9x (inductor does not fuse the concatenation into the exp)
            c = (self._bias(xc, low) * LOG2E).unsqueeze(-1)
            if W is not None:
                u = _gemm(torch.cat((W, -W), dim=-2) * LOG2E, xc, g)
            else:
                u = self._pm(_project2(self.projection, xc, g))
            return torch.exp2(u + c.to(u.dtype)).to(out_dtype)
        if W is not None and W.dim() == 2 and not low:
            # Base 2 (LOG2E): [L(u + c), L(c - u)], c = -(|x|^2 + log 2r)/2 = -C/2: L(u + c) from
            # one addmm (bias folded in with beta = -L/2, alpha = L) and L(c - u) = -L C - L(u + c),
            # then one exp2 over the whole (..., n, 2r) buffer: no copies, no cat.
            r = self.num_features
            C = torch.einsum("...d,...d->...", xc, xc).add_(math.log(2 * r))
            negC = (C * -LOG2E).reshape(-1, 1)
            if _grad(xc, C, W):
                a = _affine_rows(self.projection, xc, C, beta=-0.5 * LOG2E, alpha=LOG2E)
                if a is None:  # unreachable: W is one dense 2-D matrix here
                    raise RuntimeError("HyperbolicRF: the dense projection path lost its GEMM weight")
                a = a.reshape(-1, r)
                o = torch.cat((a, negC - a), dim=-1)
            else:
                o = xc.new_empty(negC.shape[0], 2 * r)
                a = _affine_rows(self.projection, xc, C, out=o[:, :r], beta=-0.5 * LOG2E, alpha=LOG2E)
                if a is None:  # unreachable: W is one dense 2-D matrix here
                    raise RuntimeError("HyperbolicRF: the dense projection path lost its GEMM weight")
                torch.sub(negC, a, out=o[:, r:])
            return (torch.exp2(o) if _grad(o) else o.exp2_()).view(*xc.shape[:-1], 2 * r).to(out_dtype)
        c = self._bias(xc, low)
        u = self._pm(_project2(self.projection, xc, g))
        c = (c * LOG2E).to(u.dtype).unsqueeze(-1)
        if _grad(u, c):
            return torch.exp2(u + c).to(out_dtype)
        return u.add_(c).exp2_().to(out_dtype)

    def log_features(self, x, shared=False):
        fast = self._fused(x, shared)
        if fast is not None:
            return fast
        xc, out_dtype, g = self._prepare_gemm("x", x)
        u = _project2(self.projection, xc, g)
        with torch.no_grad():
            lo, hi = torch.aminmax(u, dim=-1)
            m = torch.maximum(hi, -lo)
        f, ls = _exp_shifted(self._pm(u), m, self._bias(xc, g != xc.dtype), shared, base2=True)
        return self._policy_out(f, ls, out_dtype, g)

    def query_log2_features(self, x):
        if type(self).log_features is not HyperbolicRF.log_features:
            return None
        xc, _, g = self._prepare_gemm("x", x)
        return self._pm(_project2(self.projection, xc, g))

    def key_log2_features(self, x):
        if type(self).key_log_features is not HyperbolicRF.key_log_features:
            return None
        xc, _, g = self._prepare_gemm("x", x)
        u = self._pm(_project2(self.projection, xc, g))
        return u + (self._bias(xc, g != xc.dtype) * LOG2E).to(u.dtype).unsqueeze(-1)


register_estimator(
    HyperbolicRF, name="hyperbolic", label="hyperbolic", feature_dim="2r",
    theory="kernelapprox.theory.exponential:HYPERBOLIC_THEORY",
)
