r"""Hybrid random features: the angular hybrid of hyperbolic and trigonometric features [HRF22]_.

Positive (hyperbolic) features estimate $e^{x^\top y}$ exactly at $x = -y$ and are
poor near $x = y$; trigonometric features are exact at $x = y$ and poor near
$x = -y$. The angular hybrid weighs the two by an unbiased estimate of
$\theta_{x,y}/\pi$, which is 0 at $x \parallel y$ and 1 at $x \parallel -y$:

$$
\hat K(x, y) = \hat\lambda(x, y)\,\hat K_{\text{hyp}}(x, y)
+ \big(1 - \hat\lambda(x, y)\big)\,\hat K_{\text{trig}}(x, y),\qquad
\hat\lambda(x, y) = \frac12 - \frac1{2n}\sum_{l=1}^n
\operatorname{sgn}(g_l^\top x)\operatorname{sgn}(g_l^\top y).
$$

`HybridRF` is registered as ``"hybrid"``; its closed-form MSE is
`kernelapprox.theory.hybrid.hybrid_mse`.

References
----------
- [HRF22] K. Choromanski, H. Chen, H. Lin, Y. Ma, A. Sehanobish, D. Jain, M. S. Ryoo, J. Varley,
   A. Zeng, V. Likhosherstov, D. Kalashnikov, V. Sindhwani, A. Weller. "Hybrid Random Features",
   ICLR 2022, arXiv:2110.04367.
- [Cho21] K. Choromanski et al. "Rethinking Attention with Performers", ICLR 2021,
   arXiv:2009.14794.
"""

from __future__ import annotations

import math
from typing import Any, cast

import torch

from .._logdomain import _grad, _sqnorm_half
from .._validation import broadcast_shapes, check_floating, check_positive_int, inputs_validated
from ..registry import register_estimator
from ..samplers import Sampler
from .base import RandomFeatureMap

__all__ = ["HybridRF", "default_num_angular"]

#: Cap of the default number of angular vectors (see `default_num_angular`).
MAX_DEFAULT_ANGULAR = 8


def default_num_angular(num_features: int, dim: int) -> int:
    r"""The default ``num_angular`` of `HybridRF`: $n = \min(r, 8)$, whatever ``dim``.

    The feature dimension is $4r(n + 1)$ (a tensor product), so $n$ multiplies the
    cost of attention. At a fixed feature budget the MSE of `kernelapprox.theory.hybrid.hybrid_mse`
    is $\propto (n + 1)\,(M_\infty + \lambda(1-\lambda)\mathrm{Var}(A - B)/n)$, minimal at
    $n^* = \sqrt{\lambda(1-\lambda)\mathrm{Var}(A-B)/M_\infty}$: about 1 for generic pairs
    ($\theta \approx \pi/2$) and a few for nearly aligned ones
    ($n^* \to \sqrt{(1-\lambda)/\lambda}$), so a small constant keeps ``feature_dim`` linear
    in ``r``; ``r`` itself below 8 keeps tiny maps tiny. Registered rule:
    ``feature_dim(r, d) = 4 r (min(r, 8) + 1)`` (the registry's rule sees only ``(r, d)``; a map built
    with another ``num_angular`` reports its own ``feature_dim``).

    Examples
    --------
    >>> default_num_angular(4, 16), default_num_angular(256, 64)
    (4, 8)
    """
    return min(int(num_features), MAX_DEFAULT_ANGULAR)


def _feature_dim(r: int, d: int) -> int:
    return 4 * r * (default_num_angular(r, d) + 1)


def _times_exp(G: torch.Tensor, logs: torch.Tensor) -> torch.Tensor:
    r"""$G\,e^{\text{logs}}$ without overflow of the scale alone (as `FeatureMap.kernel`).

    One rounding where $e^{\text{logs}}$ is representable; elsewhere
    $\operatorname{sign}(G)\exp(\log|G| + \text{logs})$ with a safe log (zeros give 0 with
    a zero gradient).
    """
    fi = torch.finfo(logs.dtype)
    ok = (logs <= math.log(fi.max)) & (logs >= math.log(fi.tiny))
    direct = G * torch.exp(torch.where(ok, logs, torch.zeros_like(logs)))
    nz = G != 0
    mag = torch.exp(torch.log(torch.where(nz, G.abs(), torch.ones_like(G))) + logs)
    via_log = torch.where(nz, torch.sign(G) * mag, torch.zeros_like(mag))
    return torch.where(ok, direct, via_log)


class HybridRF(RandomFeatureMap):
    r"""Angular hybrid random features (HRF) [HRF22]_: hyperbolic and sin/cos features mixed by
    an estimate of the angle.

    With $r$ projections $w_i$ (rows of $W$, shared by both parts) and
    $n$ = ``num_angular`` independent vectors $g_l$ (rows of ``angular``, drawn by the
    same sampler, independently of $W$):

    $$
    \hat K = \hat\lambda\,\underbrace{\frac{\Lambda}{r}\sum_i\cosh\big(w_i^\top(x+y)\big)}_{A\ (\text{hyperbolic})}
    + (1-\hat\lambda)\,\underbrace{\frac{1}{\Lambda r}\sum_i\cos\big(w_i^\top(x-y)\big)}_{B\ (\text{sin/cos})},
    \qquad \hat\lambda = \frac12 - \frac1{2n}\sum_l \operatorname{sgn}(g_l^\top x)\operatorname{sgn}(g_l^\top y),
    $$

    $\Lambda = e^{-(\|x\|^2+\|y\|^2)/2}$. $\mathbb E\hat\lambda = \theta_{x,y}/\pi$
    (Goemans–Williamson) and $\hat\lambda$ is independent of $A, B$, so
    $\mathbb E\hat K = e^{x^\top y}$: unbiased for iid, χ-norm orthogonal and QMC rows.

    Which part gets $\hat\lambda$. At $\theta = 0$ every sign product is
    $+1$ and $\hat\lambda \equiv 0$; at $\theta = \pi$, $\hat\lambda \equiv 1$.
    The sin/cos estimator is exact at $x = y$ and the hyperbolic one at $x = -y$, so
    the weight $\hat\lambda$ goes to the *hyperbolic* part: then $\hat K$ is exact at
    both extremes (equal norms), with variance 0. The reversed assignment (trigonometric part
    weighted by $\hat\lambda$, as in the official HRF notebook) is exact nowhere and has a
    far larger MSE near both extremes (measured in ``tests/maps/test_hybrid.py``).

    Features. The kernel $1 - \hat\lambda = c(x)^\top c(y)$ with
    $c(x) = \tfrac1{\sqrt2}[1, \operatorname{sgn}(Gx)/\sqrt n]$ is positive semi-definite, but
    $\hat\lambda = \tilde c(x)^\top c(y)$, $\tilde c(x) = \tfrac1{\sqrt2}[1,
    -\operatorname{sgn}(Gx)/\sqrt n]$, is not: the map is asymmetric (``symmetric = False``).
    Queries and keys get tensor-product features

    $$
    \varphi(x) = \big[c(x)\otimes\varphi_{\text{hyp}}(x),\ c(x)\otimes\varphi_{\text{trig}}(x)\big],
    \qquad
    \psi(y) = \big[\tilde c(y)\otimes\varphi_{\text{hyp}}(y),\ c(y)\otimes\varphi_{\text{trig}}(y)\big],
    $$

    (`log_features`, `key_log_features`), which differ in the sign of the
    $\operatorname{sgn}(Gx)\otimes\varphi_{\text{hyp}}$ block, and
    $\hat K = \varphi(x)^\top\psi(y)$. ``feature_dim`` $= (n+1)\cdot 4r$.

    Numerics. $\varphi_{\text{hyp}}$ scales like $e^{-\|x\|^2/2}$ and
    $\varphi_{\text{trig}}$ like $e^{+\|x\|^2/2}$. With
    $\ell_A = \max_i|w_i^\top x| - \|x\|^2/2 - \tfrac12\log 4r$ and
    $\ell_B = \|x\|^2/2 - \tfrac12\log 2r$, each row has
    ``log_scale`` $L = \max(\ell_A, \ell_B)$ (float64) and
    $f = [c\otimes e^{\pm Wx - \max|Wx|}e^{\ell_A - L},\ c\otimes[\sin Wx, \cos Wx]\,e^{\ell_B - L}]$,
    $|f| \le 1$: the larger block is bounded and the smaller one may underflow to 0, its
    honest value relative to the other (``shared=True``: one $L$ per sequence). In the
    product $\varphi(x)^\top\psi(y)$ the two blocks of $c$ cancel exactly only in
    exact arithmetic: where $\hat\lambda \in \{0, 1\}$ the rounding of the other part (of
    the size of its scale, $e^{(\|x\|^2+\|y\|^2)/2}$ for the trigonometric one) remains.
    `kernel` therefore computes $\hat\lambda$, $A$ and $B$ separately
    ($\hat\lambda$ exactly, each part in the log domain; $O(nm(r + n))$ instead of a
    product of ``feature_dim``-long vectors), the same value up to that rounding, exact at the
    extremes at any norm.

    Parameters
    ----------
    dim, num_features :
        ``d`` and ``r`` as for `kernelapprox.RandomFeatureMap`.
    num_angular : int, optional
        ``n``, the number of angular vectors; default `default_num_angular` ``= min(r, 8)``.
    **kwargs
        ``sampler``, ``seed``, ``generator``, ``batch_shape``, ``device``, ``dtype`` of
        `kernelapprox.RandomFeatureMap`. The sampler draws $W$ and then the angular
        vectors (``(*batch_shape, n, d)``, buffer ``angular``) from the same generator.

    Notes
    -----
    MSE (iid rows and vectors, `kernelapprox.theory.hybrid.hybrid_mse`):
    $(\lambda^2+v)(V_A+V_B-2C)+2\lambda(C-V_B)+V_B$ with $\lambda=\theta/\pi$,
    $v = \lambda(1-\lambda)/n$ and $C=\mathrm{Cov}(A,B)=\frac{\mathrm{SM}^2}r(\cos(\|x\|^2-\|y\|^2)-1)$.
    It is not an average of per-projection terms, so it is not registered as an
    `kernelapprox.EstimatorTheory` (``ka.theory.mse`` raises ``NotImplementedError``).
    Far from both extremes with large norms the hyperbolic part's relative variance
    $\sim e^{\|x+y\|^2}/r$ enters with weight $\lambda^2$: the estimator is then as
    heavy-tailed as positive features there.

    References
    ----------
    Choromanski et al., "Hybrid Random Features", ICLR 2022, arXiv:2110.04367, §3 (angular
    hybrid); Choromanski et al., ICLR 2021, arXiv:2009.14794 (hyperbolic and sin/cos features).

    Examples
    --------
    >>> import kernelapprox as ka
    >>> fm = HybridRF(dim=4, num_features=16, seed=0, dtype=torch.float64)
    >>> fm.num_angular, fm.feature_dim
    (8, 576)
    >>> x = torch.tensor([[0.9, -0.3, 0.2, 1.1]], dtype=torch.float64)
    >>> K = fm.kernel(torch.cat([x, x]), torch.cat([x, -x]))  # exact at y = x and y = -x
    >>> bool(torch.allclose(torch.diagonal(K), ka.softmax_kernel(torch.cat([x, x]), torch.cat([x, -x])).diagonal()))
    True
    """

    positive = False
    symmetric = False
    angular: torch.Tensor

    def __init__(self, dim: int, num_features: int, *, num_angular: int | None = None, **kwargs: Any) -> None:
        d = check_positive_int("dim", dim)
        r = check_positive_int("num_features", num_features)
        self.num_angular = (
            default_num_angular(r, d) if num_angular is None else check_positive_int("num_angular", num_angular)
        )
        super().__init__(dim, num_features, **kwargs)

    # ------------------------------------------------------------------ construction
    def _init_extra(self, generator: torch.Generator | None, device: Any) -> None:
        if generator is None:  # from_projection: the angular vectors are given
            return
        G = self.sampler.sample(self.num_angular, self.dim, batch_shape=self.batch_shape, generator=generator).weight
        ref = next(iter(self.projection.buffers()))
        G = G.detach().to(device=ref.device, dtype=ref.dtype)
        if isinstance(getattr(self, "angular", None), torch.Tensor):
            with torch.no_grad():
                self.angular.copy_(G)  # redraw: in place
        else:
            self.register_buffer("angular", G)

    @classmethod
    def from_projection(
        cls,
        W: torch.Tensor,
        *,
        offsets: torch.Tensor | None = None,
        sampler: str | Sampler | None = None,
        angular: torch.Tensor | None = None,
        **kwargs: Any,
    ) -> HybridRF:
        r"""Build the map around given projections ``W`` (``(*batch_shape, r, d)``) and angular
        vectors ``angular`` (``(*batch_shape, n, d)``), used as is.

        Examples
        --------
        >>> W, G = torch.randn(16, 4, dtype=torch.float64), torch.randn(3, 4, dtype=torch.float64)
        >>> fm = HybridRF.from_projection(W, angular=G, sampler="gaussian")
        >>> fm.num_angular, fm.feature_dim
        (3, 256)
        """
        if angular is None:
            raise ValueError("HybridRF.from_projection needs angular=G, a tensor of shape (*batch_shape, n, d)")
        angular = check_floating("angular", angular)
        if angular.dim() < 2 or angular.shape[-2] == 0:
            raise ValueError(f"angular must have shape (*batch_shape, n, d) with n >= 1, got {tuple(angular.shape)}")
        obj = cast(
            HybridRF,
            super().from_projection(W, offsets=offsets, sampler=sampler, num_angular=int(angular.shape[-2]), **kwargs),
        )
        want = (*obj.batch_shape, obj.num_angular, obj.dim)
        if tuple(angular.shape) != want:
            raise ValueError(f"angular must have shape {want} (W's batch_shape and d), got {tuple(angular.shape)}")
        ref = next(iter(obj.projection.buffers()))
        obj.register_buffer("angular", angular.detach().clone().to(device=ref.device, dtype=ref.dtype))
        return obj

    @property
    def feature_dim(self) -> int:
        """``(num_angular + 1) * 4 r`` (the registered rule holds for the default ``num_angular``)."""
        return 4 * self.num_features * (self.num_angular + 1)

    # ------------------------------------------------------------------ parts
    def _parts(
        self, xc: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """Bounded parts of the prepared input ``xc`` (..., N, d).

        Returns ``h`` (L, N, 2r) = exp(±Wx - max|Wx|), ``trig`` (L, N, 2r) = [sin Wx, cos Wx],
        ``sg`` (L, N, n) = sgn(Gx), and the float64 log scales ``lA = max|Wx| - |x|^2/2 - log(2r)/2``
        and ``lB = |x|^2/2 - log(r)/2`` (L, N) of the hyperbolic and sin/cos features, with
        ``L = broadcast(x.shape[:-2], batch_shape)``.
        """
        r = self.num_features
        u = self.projection(xc)
        with torch.no_grad():
            lo, hi = torch.aminmax(u, dim=-1)
            m = torch.maximum(hi, -lo)
        pm = torch.cat((u, -u), dim=-1)
        h = torch.exp(pm - m.unsqueeze(-1)) if _grad(pm) else pm.sub_(m.unsqueeze(-1)).exp_()
        trig = torch.cat((torch.sin(u), torch.cos(u)), dim=-1)
        sg = torch.sign(torch.matmul(xc, self.angular.to(xc.dtype).mT))
        # |x|^2/2 accumulated in float64 for lower-precision inputs: the sin/cos block's scale
        # multiplies signed terms that cancel in attention (as for `TrigRF`, whose float32
        # accumulation at |x| = 128 moved a cancelled row by 6)
        half = (_sqnorm_half(xc) if xc.dtype == torch.float64
                else 0.5 * torch.linalg.vector_norm(xc, dim=-1, dtype=torch.float64).square())
        lA = m.double() - half - 0.5 * math.log(2 * r)
        lB = (half - 0.5 * math.log(r)).expand(lA.shape)
        lead = broadcast_shapes(h.shape[:-1], sg.shape[:-1])
        return h.expand(*lead, h.shape[-1]), trig.expand(*lead, trig.shape[-1]), sg.expand(*lead, sg.shape[-1]), lA, lB

    def _stabilised(self, x: torch.Tensor, shared: bool, key: bool) -> tuple[torch.Tensor, torch.Tensor]:
        xc, _ = self._prepare("x", x)
        h, trig, sg, lA, lB = self._parts(xc)
        # the two blocks of c carry 1/sqrt(2) each side: -log(2)/2 in both log scales
        lA = lA - 0.5 * math.log(2.0)
        lB = lB - 0.5 * math.log(2.0)
        with torch.no_grad():
            L = torch.maximum(lA, lB)
            if shared:
                L = L.amax(dim=-1, keepdim=True)
        dt = h.dtype
        wA = torch.exp(lA - L).to(dt).unsqueeze(-1)
        wB = torch.exp(lB - L).to(dt).unsqueeze(-1)
        s = sg / math.sqrt(self.num_angular)
        one = torch.ones_like(sg[..., :1])
        c = torch.cat((one, s), dim=-1)
        cA = torch.cat((one, -s), dim=-1) if key else c
        fA = (cA.unsqueeze(-1) * (h * wA).unsqueeze(-2)).flatten(-2)
        fB = (c.unsqueeze(-1) * (trig * wB).unsqueeze(-2)).flatten(-2)
        return torch.cat((fA, fB), dim=-1), L

    # ------------------------------------------------------------------ API
    def log_features(self, x: torch.Tensor, shared: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        r"""Query features $\varphi(x) = f e^{\text{log\_scale}}$ (class docstring).

        Parameters
        ----------
        x : Tensor, shape (..., n, d)
        shared : bool, default False
            One scale per sequence (``(..., 1)``) instead of one per row.

        Returns
        -------
        f : Tensor, shape (*broadcast(x.shape[:-2], batch_shape), n, feature_dim), $|f| \le 1$
        log_scale : Tensor, shape (..., n) or (..., 1), float64
        """
        return self._stabilised(x, shared, key=False)

    def key_log_features(self, x: torch.Tensor, shared: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        r"""Key features $\psi(y) = f e^{\text{log\_scale}}$: the query features with the
        sign of the $\operatorname{sgn}(Gy)\otimes\varphi_{\text{hyp}}$ block flipped.

        Parameters
        ----------
        x : Tensor, shape (..., m, d)
        shared : bool, default False

        Returns
        -------
        f : Tensor, shape (*broadcast(x.shape[:-2], batch_shape), m, feature_dim), $|f| \le 1$
        log_scale : Tensor, shape (..., m) or (..., 1), float64
        """
        return self._stabilised(x, shared, key=True)

    def kernel(
        self, q: torch.Tensor, k: torch.Tensor, *, compute_dtype: torch.dtype | None = None
    ) -> torch.Tensor:
        r"""$\hat K = \hat\lambda A + (1 - \hat\lambda) B$ from its parts (class docstring).

        Equal to $\varphi(q)^\top\psi(k)$ up to rounding; $\hat\lambda$ is exact
        (integer sign sums) and each part is formed in the log domain, so the estimate is exact at
        $k = q$ and $k = -q$ at any norm. Wherever $\hat\lambda < 1$ the estimate carries the
        sin/cos part's noise, of size $e^{(\|q\|^2+\|k\|^2)/2}/\sqrt r$: a float32 result is
        then ``inf`` from $\|q\|^2 + \|k\|^2 \approx 180$ on (the estimate itself exceeds the
        float32 range) even where $e^{q^\top k}$ does not; pass float64 inputs there.

        Parameters
        ----------
        q : Tensor, shape (..., n, d)
        k : Tensor, shape (..., m, d)
        compute_dtype : torch.dtype, optional
            Default float64 (as `FeatureMap.kernel`).

        Returns
        -------
        Tensor, shape (*broadcast(q.shape[:-2], k.shape[:-2], batch_shape), n, m),
            dtype ``promote(q.dtype, k.dtype)``.
        """
        out_dtype, cdt = self._kernel_dtypes(q, k, compute_dtype)
        with inputs_validated():
            hq, tq, sq, aq, bq = self._parts(self._prepare("q", q.to(cdt))[0])
            hk, tk, sk, ak, bk = self._parts(self._prepare("k", k.to(cdt))[0])
        lam = 0.5 - torch.matmul(sq, sk.mT) / (2 * self.num_angular)  # exact: integer sums
        la = aq.unsqueeze(-1) + ak.unsqueeze(-2)
        lb = bq.unsqueeze(-1) + bk.unsqueeze(-2)
        wa, wb = lam, 1 - lam  # the weights of the hyperbolic part A and the sin/cos part B
        # one log scale per pair, that of the parts with a non-zero weight (at lam in {0, 1} the
        # other part's scale may overflow alone: 0 * inf), then wa A + wb B in the log domain
        with torch.no_grad():
            L = torch.where(wb == 0, la, torch.where(wa == 0, lb, torch.maximum(la, lb)))
        sa = wa * torch.exp((la - L).clamp(max=0.0)).to(lam.dtype)
        sb = wb * torch.exp((lb - L).clamp(max=0.0)).to(lam.dtype)
        S = sa * torch.matmul(hq, hk.mT) + sb * torch.matmul(tq, tk.mT)
        return _times_exp(S, L).to(out_dtype)

    def extra_repr(self) -> str:
        return f"num_angular={self.num_angular}, " + super().extra_repr()


register_estimator(
    HybridRF, name="hybrid", label="hybrid (angular)", feature_dim=_feature_dim,
    theory="kernelapprox.theory.hybrid:HYBRID_THEORY",
)
