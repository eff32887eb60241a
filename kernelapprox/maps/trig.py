r"""Trigonometric random features (random Fourier features) for $\exp(x^\top y)$.

References
----------
- [RR07] A. Rahimi, B. Recht. "Random Features for Large-Scale Kernel Machines", NIPS 2007.
- [SS15] D. J. Sutherland, J. Schneider. "On the Error of Random Fourier Features", UAI 2015.
- [Cho21] K. Choromanski et al. "Rethinking Attention with Performers", ICLR 2021, arXiv:2009.14794.
"""

from __future__ import annotations

import math

import torch

from .._logdomain import _gemm, _grad, _op_into
from .._validation import broadcast_shapes, check_floating
from ..registry import register_estimator
from .base import RandomFeatureMap

__all__ = ["TrigRF"]


def _sqnorm_half64(x: torch.Tensor) -> torch.Tensor:
    r"""$\|x\|^2/2$ (..., n), accumulated in float64 (the squares formed in float64 inside the
    reduction, no float64 copy of ``x``).

    The trigonometric features' scale $e^{\|x\|^2/2}$ is not shared by a row's kernel values
    but multiplies signed terms that cancel in attention: a float32 accumulation of
    $\|x\|^2/2 = 8192$ ($\|x\| = 128$) is off by up to $5\cdot10^{-4}$, a relative error of
    every key weight that a denominator cancelled 200-fold turns into 10 % of the row (measured:
    a row off by 6 instead of $7\cdot10^{-5}$ relative).
    """
    return 0.5 * torch.linalg.vector_norm(x, dim=-1, dtype=torch.float64).square()


class TrigRF(RandomFeatureMap):
    r"""Trigonometric random features for $\exp(x^\top y)$ [RR07]_, [Cho21]_ Lemma 2.

    ``variant="sincos"`` (default; ``feature_dim = 2r``):

    $$
    \varphi(x) = \frac{e^{\|x\|^2/2}}{\sqrt r}\,[\sin Wx, \cos Wx], \qquad
    \hat K = e^{(\|x\|^2+\|y\|^2)/2}\,\frac1r\sum_i \cos\big(w_i^\top(x-y)\big).
    $$

    ``variant="offset"`` (``feature_dim = r``; scikit-learn's ``RBFSampler`` form [SS15]_):

    $$
    \varphi(x) = e^{\|x\|^2/2}\sqrt{2/r}\,\cos(Wx + b), \quad b_i \sim U[0, 2\pi).
    $$

    Both are unbiased; the sincos form has lower variance at equal ``r`` [SS15]_. Features take
    both signs, so attention denominators can be $\le 0$. The scale
    $e^{\|x\|^2/2}$ is carried in ``log_scale`` (it overflows float32 at
    $\|x\|\approx 13.3$, and the product of two at $\|q\|=\|k\|\approx 9.4$), in float64 and
    accumulated in float64 (`_sqnorm_half64`): attention denominators of these signed features
    cancel, and turn a relative error of the key scales into a larger one of the row.

    Parameters
    ----------
    variant : {"sincos", "offset"}, default "sincos"
    **kwargs
        Those of `RandomFeatureMap`.

    Examples
    --------
    >>> fm = TrigRF(dim=16, num_features=128, seed=0)
    >>> q = torch.randn(3, 16) / 4
    >>> fm.kernel(q, q).shape
    torch.Size([3, 3])
    """

    positive = False
    offsets: torch.Tensor

    def __init__(self, dim: int, num_features: int, *, variant: str = "sincos", **kwargs) -> None:
        if variant not in ("sincos", "offset"):
            raise ValueError(f"variant must be 'sincos' or 'offset', got {variant!r}")
        self.variant = variant
        super().__init__(dim, num_features, **kwargs)

    def _init_extra(self, generator, device) -> None:
        if self.variant != "offset":
            return
        if generator is None:  # from_projection: offsets are set by _set_offsets
            return
        b = torch.rand(*self.batch_shape, self.num_features, generator=generator, dtype=torch.float64, device="cpu")
        b = (2 * math.pi * b).to(device=device, dtype=self._buffer_dtype())
        if isinstance(getattr(self, "offsets", None), torch.Tensor):
            with torch.no_grad():
                self.offsets.copy_(b)  # redraw: in place
        else:
            self.register_buffer("offsets", b)

    def _buffer_dtype(self) -> torch.dtype:
        return next(iter(self.projection.buffers())).dtype

    def _set_offsets(self, offsets):
        if self.variant != "offset":
            if offsets is not None:
                raise TypeError("offsets are only used by TrigRF(variant='offset')")
            return
        if offsets is None:
            raise ValueError("TrigRF(variant='offset').from_projection needs offsets of shape (*batch_shape, r)")
        offsets = check_floating("offsets", offsets)
        want = (*self.batch_shape, self.num_features)
        if tuple(offsets.shape) != want:
            raise ValueError(f"offsets must have shape {want}, got {tuple(offsets.shape)}")
        ref = next(iter(self.projection.buffers()))
        self.register_buffer("offsets", offsets.detach().clone().to(device=ref.device, dtype=ref.dtype))


    def _prepare_gemm(self, name: str, x: object) -> tuple[torch.Tensor, torch.dtype, torch.dtype]:
        """`_prepare` with GEMM operands in the compute dtype under every policy: the angles
        $Wx$ carry the operands' rounding into every sine, and 16-bit operands (a relative 4e-3 in
        bf16) leave the attention of these signed features off by 1.0-1.8 where float32
        operands on the same bf16 inputs give 7.5e-2 (sin/cos) and 4.7e-3 (offset); the
        accelerator rule's 16-bit GEMM is for the exponential maps."""
        xc, out_dtype = self._prepare(name, x)
        return xc, out_dtype, xc.dtype

    def _trig(self, xc: torch.Tensor, gemm: torch.dtype | None = None) -> torch.Tensor:
        """Bounded trigonometric part ``f`` (..., n, F) of the prepared input ``xc`` (``gemm``: the
        dtype of the GEMM operands, `kernelapprox.backends.gemm_dtype`)."""
        r = self.num_features
        W = self.projection.gemm_weight(xc.dtype)
        if gemm is not None and gemm != xc.dtype and W is not None:
            # 16-bit GEMM operands (accelerator policy); the angles and their sines in xc's dtype
            u = _gemm(W, xc, gemm)
            if self.variant == "sincos":
                return torch.cat((torch.sin(u), torch.cos(u)), dim=-1)
            return torch.cos(u + self.offsets.to(u.dtype).unsqueeze(-2))
        if self.variant == "sincos":
            if _grad(xc, *self.projection.buffers()):
                u = self.projection(xc)
                return torch.cat((torch.sin(u), torch.cos(u)), dim=-1)
            # Write Wx straight into the first half of the output (no separate (n, r) buffer),
            # take its cosine into the second half, then its sine in place.
            lead = broadcast_shapes(xc.shape[:-2], self.batch_shape)
            f = xc.new_empty(*lead, xc.shape[-2], 2 * r)
            u = self.projection.project_into(xc, f[..., :r])
            _op_into(torch.cos, f[..., r:], u)
            u.sin_()
            return f
        u = self.projection.affine(xc, col_bias=self.offsets)
        return torch.cos(u) if _grad(u) else u.cos_()

    def _scaled(self, xc: torch.Tensor, gemm: torch.dtype | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """``f`` (..., n, F) and the per-row log scale (..., n) of the prepared input ``xc``."""
        return self._with_log_scale(self._trig(xc, gemm), xc)

    def _with_log_scale(self, f: torch.Tensor, xc: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``f`` and the per-row log scale $\\|x\\|^2/2 + \\log c$ (..., n) of ``xc``, float64."""
        r = self.num_features
        log_c = -0.5 * math.log(r) if self.variant == "sincos" else 0.5 * math.log(2.0 / r)
        ls = _sqnorm_half64(xc) + log_c
        lead = f.shape[:-1]
        if ls.shape != lead:
            ls = ls.expand(lead)
        return f, ls

    def query_features(self, x):
        xc, out_dtype, g = self._prepare_gemm("x", x)
        f = self._trig(xc, g)
        return f if g == f.dtype else f.to(out_dtype)

    def forward(self, x):
        fast = self._fused(x, plain=True)
        if fast is not None:
            return fast
        xc, out_dtype, g = self._prepare_gemm("x", x)
        f, ls = self._scaled(xc, g)
        scale = torch.exp(ls).to(f.dtype).unsqueeze(-1)
        return (f * scale if _grad(f, scale) else f.mul_(scale)).to(out_dtype)

    def log_features(self, x, shared=False):
        fast = self._fused(x)
        xc, out_dtype, g = self._prepare_gemm("x", x)
        if fast is not None:
            # the fused kernel's sines; its log scale, a float32 sum of squares, is replaced by the
            # float64 one (the shared scale below is then applied here, as on the torch path)
            f, ls = self._with_log_scale(fast[0], xc)
        else:
            f, ls = self._scaled(xc, g)
        if shared:
            with torch.no_grad():
                m = ls.amax(-1, keepdim=True)
            w = torch.exp(ls - m).to(f.dtype).unsqueeze(-1)
            f = f * w if _grad(f, w) else f.mul_(w)
            ls = m
        return self._policy_out(f, ls, out_dtype, g)

    def extra_repr(self) -> str:
        return f"variant={self.variant!r}, " + super().extra_repr()


register_estimator(
    TrigRF, name="trig-sincos", label="trig sin/cos", params={"variant": "sincos"}, feature_dim="2r",
    theory="kernelapprox.theory.trig:TRIG_SINCOS_THEORY",
)
register_estimator(
    TrigRF, name="trig-offset", label="trig cos+offset", params={"variant": "offset"}, feature_dim="r",
    theory="kernelapprox.theory.trig:TRIG_OFFSET_THEORY",
)
