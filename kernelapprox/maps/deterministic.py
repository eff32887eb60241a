r"""Deterministic feature maps for $e^{q^\top k}$: elu+1 and ReLU of linear attention, the
second-order Taylor map of Based and the Nyström map on landmarks.

- ``EluFeatures``: $\varphi(x)$: $\mathrm{elu}(x) + 1$; ``feature_dim``: $d$; exact for: —
- ``ReluFeatures``: $\varphi(x)$: $\max(x, 0)$; ``feature_dim``: $d$; exact for: —
- ``TaylorFeatures``: $\varphi(x)$: $[1,\ x,\ (x_ix_j)_{i<j},\ (x_i^2/\sqrt2)_i]$; ``feature_dim``: $1+d+d(d+1)/2$; exact for: —
- ``NystromFeatures``: $\varphi(x)$: $G^{-1/2}\,[e^{l_i^\top x - \|l_i\|^2/2}]_{i=1}^m$; ``feature_dim``: $m$; exact for: keys = landmarks

None is random: elu+1 and ReLU are fixed pointwise functions, Taylor features are a fixed polynomial, Nyström features a fixed function of
their landmarks (chosen from the data by `NystromFeatures.fit`). All are biased
estimators of $e^{q^\top k}$; `kernelapprox.theory.deterministic_error` gives their
error exactly.

References
----------
- [Aro24] S. Arora, S. Eyuboglu, M. Zhang, A. Timalsina, S. Alberti, D. Zinsley, J. Zou, A. Rudra,
   C. Ré. "Simple linear attention language models balance the recall-throughput tradeoff",
   ICML 2024, arXiv:2402.18668 (Based: the Taylor feature map).
- [Xio21] Y. Xiong, Z. Zeng, R. Chakraborty, M. Tan, G. Fung, Y. Li, V. Singh. "Nyströmformer: A
   Nyström-Based Algorithm for Approximating Self-Attention", AAAI 2021, arXiv:2102.03902
   (segment-means landmarks).
- [WS01] C. K. I. Williams, M. Seeger. "Using the Nyström Method to Speed Up Kernel Machines",
   NIPS 2001.
- [AV07] D. Arthur, S. Vassilvitskii. "k-means++: The Advantages of Careful Seeding", SODA 2007.
- [Kat20] A. Katharopoulos, A. Vyas, N. Pappas, F. Fleuret. "Transformers are RNNs", ICML 2020.
- [Cho21] K. Choromanski et al. "Rethinking Attention with Performers", ICLR 2021, arXiv:2009.14794.
"""

from __future__ import annotations

import math
import warnings
from typing import Any

import torch

from .._logdomain import _op_into
from .._validation import (
    as_batch_shape,
    broadcast_batch,
    broadcast_shapes,
    check_device,
    check_dtype,
    check_floating,
    check_last_dim,
    check_positive_int,
)
from ..registry import register_estimator
from ..samplers import make_generator
from .base import FeatureMap

__all__ = ["EluFeatures", "ReluFeatures", "TaylorFeatures", "NystromFeatures"]


# ---------------------------------------------------------------------------------------- Taylor


def _taylor_dim(r: int, d: int) -> int:
    return 1 + d + d * (d + 1) // 2


class _DeterministicMap(FeatureMap):
    """Deterministic maps: no projection, ``num_features = feature_dim = dim``.

    The constructor takes the random maps' arguments (``num_features``, ``sampler``, ``seed``,
    ``generator``, ``batch_shape``, ``device``, ``dtype``) so that generic code can build any map
    the same way; they have no effect here (there is nothing to draw), and ``redraw`` is a no-op.

    Parameters
    ----------
    dim : int
        Input dimension $d$ (also the feature dimension).
    num_features : int, optional
        Accepted for a uniform constructor; must be a positive int if given; ignored.
    sampler, seed, generator, batch_shape, device, dtype
        The random maps' arguments, accepted and ignored (nothing is drawn).
    """

    is_random = False

    def __init__(
        self,
        dim: int,
        num_features: int | None = None,
        *,
        sampler: object = None,
        seed: int | None = None,
        generator: torch.Generator | None = None,
        batch_shape: tuple[int, ...] = (),
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        self.dim = check_positive_int("dim", dim)
        if num_features is not None:
            check_positive_int("num_features", num_features)
        as_batch_shape(batch_shape)
        check_device("device", device)
        check_dtype("dtype", dtype)
        self.num_features = self.dim
        self.batch_shape = ()


    def _phi(self, xc: torch.Tensor) -> torch.Tensor:  # pragma: no cover - abstract
        raise NotImplementedError

    def forward(self, x):
        xc, out_dtype = self._prepare("x", x)
        return self._phi(xc).to(out_dtype)

    def log_features(self, x, shared=False):
        xc, _ = self._prepare("x", x)
        f = self._phi(xc)
        shape = (*f.shape[:-2], 1) if shared else f.shape[:-1]
        return f, f.new_zeros(shape)

    def extra_repr(self) -> str:
        return f"dim={self.dim}"


class TaylorFeatures(_DeterministicMap):
    r"""The second-order Taylor map of Based [Aro24]_: $\varphi(q)^\top\varphi(k) = 1 + q^\top k + \tfrac12(q^\top k)^2$.

    $$
    \varphi(x) = \Big[1,\ x_1, \dots, x_d,\ \big(x_ix_j\big)_{i<j},\ \big(x_i^2/\sqrt2\big)_{i}\Big],
    $$

    the upper triangle of $x x^\top/\sqrt2$ with the off-diagonal entries counted twice
    (weight $\sqrt2$), so that $\sum_{i\le j}\varphi_{ij}(q)\varphi_{ij}(k) =
    \tfrac12(q^\top k)^2$ exactly: ``feature_dim`` $= 1 + d + d(d+1)/2$ (instead of
    $1 + d + d^2$ for the full Kronecker square).

    Scaling. The library approximates $e^{q^\top k}$; attention with temperature
    $1/\sqrt d$ passes $q d^{-1/4}, k d^{-1/4}$ (Performer convention). Based writes
    its map for raw inputs as $[1, x/d^{1/4}, (x\otimes x)/(\sqrt2\sqrt d)]$, i.e. exactly
    this map applied to $x d^{-1/4}$: its $d^{-1/4}$ and $1/\sqrt d$ factors are
    the user's pre-scaling here.

    The kernel $1 + u + u^2/2 \ge \tfrac12$ is positive, but the features take both signs
    (``positive = False``, so attention applies the signed-denominator guard ``|den| <= eps`` to
    the stabilised denominator $\sum_j K(q, k_j)/(\|\varphi(q)\|\max_j\|\varphi(k_j)\|)$:
    of order one for many keys, measured >= 2.7 for 64 random keys up to $\|x\| = 30$, but
    below ``1e-6`` for e.g. a single key orthogonal to the query at $\|x\| \gtrsim 38$). Its error is $1 + u + u^2/2 - e^u = -e^{\xi}u^3/6$ for some
    $\xi$ between 0 and $u$ (Lagrange remainder): an underestimate for $u > 0$,
    an overestimate for $u < 0$, $\approx -u^3/6$ near 0
    (`kernelapprox.theory.deterministic_error`).

    Numerics. ``log_features`` returns $f = \varphi(x)/\|\varphi(x)\|$ (``|f| <= 1``) and
    ``log_scale`` $= \tfrac12\log(1 + \|x\|^2 + \|x\|^4/2)$ (float64), with
    $\|\varphi(x)\|^2 = 1 + \|x\|^2 + \|x\|^4/2$ exactly; the quadratic block is formed from
    $x/\|\varphi(x)\|^{1/2}$, so nothing overflows for finite inputs.

    Parameters
    ----------
    dim : int
    num_features, sampler, seed, generator, batch_shape, device, dtype :
        Accepted and ignored, as for every deterministic map (generic code builds any map the same
        way); ``num_features`` is set to ``dim``.

    References
    ----------
    Arora et al., "Simple linear attention language models balance the recall-throughput
    tradeoff", ICML 2024, arXiv:2402.18668 (§3, Taylor feature map).

    Examples
    --------
    >>> fm = TaylorFeatures(3)
    >>> fm.feature_dim
    10
    >>> q, k = torch.tensor([[0.3, -0.2, 0.5]]), torch.tensor([[0.1, 0.4, -0.2]])
    >>> u = float(q @ k.T)
    >>> round(float(fm(q) @ fm(k).T), 6) == round(1 + u + u * u / 2, 6)
    True
    """

    positive = False

    def _scaled_phi(self, xc: torch.Tensor, log_rho: torch.Tensor) -> torch.Tensor:
        r"""$\varphi(x)/\rho$ for ``log_rho`` $= \log\rho$ (..., n) float64, without
        overflow: the linear block is $(x\rho^{-1/2})\rho^{-1/2}$, the quadratic one is
        formed from $x\rho^{-1/2}$."""
        d = self.dim
        inv = torch.exp(-log_rho).to(xc.dtype).unsqueeze(-1)  # 1 / rho
        half = torch.exp(-0.5 * log_rho).to(xc.dtype).unsqueeze(-1)  # rho^{-1/2}
        xs = xc * half
        out = xs.new_empty(*xs.shape[:-1], 1 + d + d * (d + 1) // 2)
        out[..., :1] = inv
        out[..., 1 : 1 + d] = xs * half
        # the upper triangle of xs xs^T row by row (order of torch.triu_indices), written in place:
        # row a holds x_a x_b for b >= a, the diagonal term scaled by 1/sqrt(2); no gathers
        off = 1 + d
        diag = math.sqrt(0.5)
        for a in range(d):
            blk = out[..., off : off + d - a]
            _op_into(torch.mul, blk, xs[..., a : a + 1], xs[..., a:]) if not _needs_grad(xs) else blk.copy_(
                xs[..., a : a + 1] * xs[..., a:])
            blk[..., :1].mul_(diag)
            off += d - a
        return out

    def _phi(self, xc: torch.Tensor) -> torch.Tensor:
        return self._scaled_phi(xc, torch.zeros(xc.shape[:-1], dtype=torch.float64, device=xc.device))

    def log_features(self, x, shared=False):
        xc, _ = self._prepare("x", x)
        with torch.no_grad():
            # |x|^2 in float64 from an upcast copy (x_i^2 overflows float32 at |x_i| ~ 1.8e19; the
            # copy is small next to the d(d+1)/2 features)
            n2 = (xc.detach().double() ** 2).sum(-1)
            ls = 0.5 * torch.log1p(n2 + 0.5 * n2 * n2)  # log |phi(x)|
            if shared:
                ls = ls.amax(dim=-1, keepdim=True)
        f = self._scaled_phi(xc, ls.expand(xc.shape[:-1]) if shared else ls)
        return f, ls


def _needs_grad(t: torch.Tensor) -> bool:
    return torch.is_grad_enabled() and t.requires_grad


register_estimator(TaylorFeatures, name="taylor", label="Taylor (2nd order)", feature_dim=_taylor_dim)


# --------------------------------------------------------------------------------------- Nyström

LANDMARK_RULES = ("segment-means", "kmeans++")
_FALLBACK_WARNING = (
    "NystromFeatures used before fit(q, k): its landmarks are the data-free fallback drawn from "
    "N(0, I/sqrt(d)) at construction. Call fm.fit(q, k) (or linear_attention(..., fit=True)), or "
    "pass landmarks=<tensor>, to place them on the data."
)


def _segment_means(k: torch.Tensor, m: int) -> torch.Tensor:
    """Means of ``m`` contiguous segments of the keys (..., n, d) -> (..., m, d) (sizes differ by <= 1)."""
    return torch.stack([seg.mean(dim=-2) for seg in torch.tensor_split(k, m, dim=-2)], dim=-2)


def _kmeans_pp(k: torch.Tensor, m: int, generator: torch.Generator) -> torch.Tensor:
    """k-means++ seeding [AV07]_ on the keys (..., n, d), independently per leading index: the first
    centre uniform, each next one with probability proportional to the squared distance to the
    nearest centre chosen so far (uniform if every key coincides with a centre)."""
    lead, (n, d) = k.shape[:-2], k.shape[-2:]
    kk = k.reshape(-1, n, d).double()
    B = kk.shape[0]
    rows = torch.arange(B, device=kk.device)
    idx = torch.randint(n, (B,), generator=generator).to(kk.device)
    centres = [kk[rows, idx]]
    dist = ((kk - centres[0][:, None, :]) ** 2).sum(-1)  # (B, n)
    for _ in range(1, m):
        w = dist.clamp_min(0)
        w = torch.where(w.sum(-1, keepdim=True) > 0, w, torch.ones_like(w))
        idx = torch.multinomial(w.cpu(), 1, generator=generator).squeeze(-1)
        c = kk[rows, idx.to(kk.device)]
        centres.append(c)
        dist = torch.minimum(dist, ((kk - c[:, None, :]) ** 2).sum(-1))
    return torch.stack(centres, dim=-2).reshape(*lead, m, d).to(k.dtype)


class NystromFeatures(FeatureMap):
    r"""Nyström features on $m$ landmarks $l_1..l_m$ [WS01]_, [Xio21]_:
    $\varphi(q)^\top\varphi(k) = e^{q^\top L^\top}\,K_{LL}^{-1}\,e^{Lk}$, $K_{LL} = e^{LL^\top}$.

    Write $e^{l_i^\top x} = e^{\|l_i\|^2/2}\,e^{l_i^\top x - \|l_i\|^2/2}$ and
    $K_{LL} = D\,G\,D$ with $D = \mathrm{diag}(e^{\|l_i\|^2/2})$ and
    $G_{ij} = e^{-\|l_i - l_j\|^2/2}$ the Gaussian Gram matrix (unit diagonal). Then

    $$
    \varphi(x) = G^{-1/2}\,\big[e^{l_i^\top x - \|l_i\|^2/2}\big]_{i=1}^m
    = G^{-1/2} D^{-1} e^{Lx},
    $$

    which differs from $K_{LL}^{-1/2}e^{Lx}$ by an orthogonal matrix (same kernel), and
    ``feature_dim = m = num_features``. The estimate is exact for keys among the landmarks:
    $\hat K(q, l_j) = e^{q^\top l_j}$; with the keys themselves as landmarks, attention is
    exactly softmax attention.

    Numerics (float64 for $G$, the compute dtype for the features). $G^{-1/2}$ comes
    from an eigendecomposition $G = U\Lambda U^\top$:
    $G^{-1/2} = U\,\mathrm{diag}(w)\,U^\top$ with $w_i = (\lambda_i + \rho)^{-1/2}$ for
    $\lambda_i > \texttt{rcond}\cdot\lambda_{\max}$ and $w_i = 0$ below (a
    pseudo-inverse: duplicate or nearly coincident landmarks are harmless). Defaults: ridge
    $\rho = 0$ and $\texttt{rcond} = m\,\varepsilon_{64}$. Per row,
    $a_i(x) = l_i^\top x - \|l_i\|^2/2$, $\mu(x) = \max_i a_i(x)$,
    $y = G^{-1/2}e^{a - \mu}$, $\nu = \max|y|$: ``f = y / nu`` ($|f| \le 1$)
    and ``log_scale`` $= \mu + \log\nu$ (float64). The per-row scale
    $e^{\pm\|x\|^2/2}$ never appears, so nothing overflows for finite inputs.
    `query_features` (what attention uses for queries) rescales each row so that stabilised
    attention denominators are of order one (see there). Accuracy limit: a feature vector carries
    an absolute rounding of the size of its row scale, and a key's scale grows like
    $e^{\|k\|^2/2}$, so an entry is resolved only to about
    $\varepsilon\,e^{(\|k_j\|^2 - \|l_{i^*}\|^2)/2}$ relative to the row's largest kernel
    value ($l_{i^*}$ the landmark nearest the query in $l^\top q - \|l\|^2/2$). With
    the keys as landmarks (``d = 8``, keys and queries $s\,\mathcal N(0, I)d^{-1/4}$) attention
    matches softmax attention to 1e-14 at $s = 1$, 2e-10 (non-causal) and 6e-9 (causal) at
    $s = 2$, and only to 6e-2 / 1.7 at $s = 3$ (float64). Causal attention is the more
    fragile: a query's scale is set by its nearest landmark, possibly a *future* key.

    Landmarks. ``fit(q, k)`` places them on the keys (queries are only validated):
    ``"segment-means"`` (Nyströmformer: means of $m$ contiguous segments of the sequence,
    sizes differing by at most one; needs $n \ge m$ keys), or ``"kmeans++"`` (k-means++
    seeding on the keys, from a seed fixed at construction, so a fit is a deterministic function of
    the keys). Keys of shape ``(..., n, d)`` give landmarks of shape
    ``(*broadcast(k.shape[:-2], batch_shape), m, d)`` (per head and per batch element), and
    ``batch_shape`` becomes those leading dimensions; ``batch_shape`` in that rule is always the
    one the map was built with, so a fitted map refits on batches of any size (a smaller last
    batch). ``load_state_dict`` follows the same rule: fitted landmarks ``(*lead, m, d)`` load
    into a map built the same way (``lead`` must broadcast its built ``batch_shape``, else the
    usual size-mismatch error), which then has ``batch_shape = lead``. A tensor ``landmarks`` is
    used as given, and `fit` leaves it alone. `fit` rejects non-finite ``q`` or ``k``
    (``ValueError``).

    Before `fit` (choice). Every registered estimator can be built and called as is
    (``ka.get_estimator(name).build(d, r, seed=...)``, which the generic code and the studies
    do), so an unfitted map does not raise: it uses a *data-free fallback*, landmarks drawn at
    construction from $\mathcal N(0, I/\sqrt d)$ (the law of keys
    $\mathcal N(0, I)\,d^{-1/4}$ in the library's convention) with ``seed`` / ``generator``
    (torch's default generator if neither), shape ``(*batch_shape, m, d)``. It is a valid Nyström
    map, but placed without the data, its error is that of a random design; the first use of an
    unfitted map therefore emits a ``UserWarning`` saying to call ``fit(q, k)`` or pass
    ``landmarks``. ``fm.fitted`` tells which case holds. ``is_random`` is false: given its
    landmarks the map is deterministic (``redraw`` is a no-op).

    Parameters
    ----------
    dim : int
    num_features : int, optional
        ``m``, the number of landmarks (default: the number of rows of a tensor ``landmarks``).
    landmarks : {"segment-means", "kmeans++"} or Tensor, default "segment-means"
        How `fit` chooses landmarks, or the landmarks ``(*batch_shape, m, d)`` themselves.
    ridge : float, default 0.0
        $\rho \ge 0$ added to the eigenvalues of $G$ (unit diagonal, so an absolute
        Tikhonov term relative to the mean eigenvalue 1); 0 is the plain pseudo-inverse.
    rcond : float, optional
        Relative eigenvalue cutoff of the pseudo-inverse; default $m\varepsilon_{64}$.
    seed, generator :
        Draw the fallback landmarks and the k-means++ seed (as for the random maps).
    batch_shape : tuple of int, default ()
        Leading shape of the fallback (or given) landmarks.
    device, dtype : optional
        Of the landmark buffer ``landmarks_``.
    sampler :
        Accepted and ignored (generic code passes it to every map).

    References
    ----------
    Xiong et al., "Nyströmformer", AAAI 2021, arXiv:2102.03902; Williams & Seeger, NIPS 2001;
    Arthur & Vassilvitskii, SODA 2007 (k-means++).

    Examples
    --------
    >>> import kernelapprox as ka
    >>> k = torch.randn(2, 16, 4, dtype=torch.float64) / 2
    >>> fm = NystromFeatures(4, landmarks=k)          # the keys as landmarks: exact
    >>> q = torch.randn(2, 5, 4, dtype=torch.float64) / 2
    >>> bool(torch.allclose(fm.kernel(q, k), ka.softmax_kernel(q, k), rtol=1e-8))
    True
    >>> fm = NystromFeatures(4, 8).fit(q, k)          # 8 segment means of the keys, per sequence
    >>> fm.landmarks_.shape, fm.batch_shape, fm.fitted
    (torch.Size([2, 8, 4]), (2,), True)
    """

    is_random = False
    positive = False
    data_dependent = True

    landmarks_: torch.Tensor
    fitted_: torch.Tensor
    landmarks: str | torch.Tensor

    def __init__(
        self,
        dim: int,
        num_features: int | None = None,
        *,
        landmarks: str | torch.Tensor = "segment-means",
        ridge: float = 0.0,
        rcond: float | None = None,
        seed: int | None = None,
        generator: torch.Generator | None = None,
        batch_shape: tuple[int, ...] = (),
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
        sampler: object = None,
    ) -> None:
        super().__init__()
        self.dim = check_positive_int("dim", dim)
        device = check_device("device", device)
        dtype = check_dtype("dtype", dtype)
        if isinstance(ridge, bool) or not isinstance(ridge, (int, float)) or not (ridge >= 0 and math.isfinite(ridge)):
            raise ValueError(f"ridge must be a finite float >= 0, got {ridge!r}")
        if rcond is not None and (
            isinstance(rcond, bool) or not isinstance(rcond, (int, float)) or not 0 <= rcond < 1
        ):
            raise ValueError(f"rcond must be a float in [0, 1) or None, got {rcond!r}")
        self.ridge = float(ridge)
        self.rcond = None if rcond is None else float(rcond)
        self._cache: tuple[Any, ...] | None = None
        self._checked = False
        if isinstance(landmarks, torch.Tensor):
            L = check_floating("landmarks", landmarks)
            if L.dim() < 2 or L.shape[-1] != self.dim or L.shape[-2] == 0:
                raise ValueError(
                    f"landmarks must have shape (*batch_shape, m, {self.dim}) with m >= 1, got {tuple(L.shape)}"
                )
            if num_features is not None and check_positive_int("num_features", num_features) != L.shape[-2]:
                raise ValueError(
                    f"num_features={num_features} does not match the {L.shape[-2]} landmarks given"
                )
            self.num_features = int(L.shape[-2])
            self.batch_shape = tuple(L.shape[:-2])
            if L.device.type != "meta" and not bool(torch.isfinite(L).all()):  # construction may sync
                raise ValueError(
                    f"landmarks must be finite, got {int((~torch.isfinite(L)).sum())} NaN or Inf entries "
                    f"(shape {tuple(L.shape)})"
                )
            self.landmarks = L
            fitted = True
            L = L.detach().clone().to(device=device, dtype=dtype or L.dtype)
            self._fit_seed = 0
        else:
            if not isinstance(landmarks, str) or landmarks not in LANDMARK_RULES:
                raise ValueError(f"landmarks must be one of {LANDMARK_RULES} or a tensor, got {landmarks!r}")
            if num_features is None:
                raise ValueError("num_features (the number of landmarks m) is required unless landmarks is a tensor")
            self.num_features = check_positive_int("num_features", num_features)
            self.batch_shape = as_batch_shape(batch_shape)
            self.landmarks = landmarks
            fitted = False
            g = make_generator(seed, generator)
            L = torch.randn(*self.batch_shape, self.num_features, self.dim, generator=g, dtype=torch.float64)
            L = (L * self.dim**-0.25).to(device=device, dtype=dtype or torch.get_default_dtype())
            self._fit_seed = int(torch.randint(0, 2**62, (1,), generator=g))
        self.register_buffer("landmarks_", L)
        # a buffer, so that a loaded state dict carries it along with the landmarks
        self.register_buffer("fitted_", torch.tensor(fitted, device=L.device))
        #: the host's copy of ``fitted_`` (set by the constructor, `fit` and loading), so that a
        #: feature call never reads the device flag
        self._fitted_host = fitted
        #: the batch_shape the map was built with: every fit broadcasts the keys against it
        self._built_batch_shape = tuple(self.batch_shape)

    @property
    def fitted(self) -> bool:
        """Whether the landmarks come from `fit` or were given (false: the data-free fallback)."""
        return self._fitted_host

    # ------------------------------------------------------------------ landmarks
    def fit(self, q: torch.Tensor, k: torch.Tensor) -> NystromFeatures:
        """Place the landmarks on the keys (see the class docstring). Returns ``self``.

        Parameters
        ----------
        q : Tensor, shape (..., n, d)
            Validated only.
        k : Tensor, shape (..., n_k, d)
            The keys; ``n_k >= m`` for ``"segment-means"``.
        """
        for name, x in (("q", q), ("k", k)):
            check_floating(name, x)
            check_last_dim(name, x, self.dim)
            if (x.device.type == "meta") != (self.landmarks_.device.type == "meta"):
                raise ValueError(f"fit needs {name} on the map's device ({self.landmarks_.device}), got {name} on "
                                 f"{x.device} (a map built on the meta device fits meta tensors)")
            if x.device.type != "meta" and not bool(torch.isfinite(x).all()):
                raise ValueError(f"NystromFeatures.fit needs finite {name}, got {name} with a NaN or Inf entry")
        if isinstance(self.landmarks, torch.Tensor):
            return self  # given landmarks are kept
        lead = broadcast_batch("k", k.shape[:-2], self._built_batch_shape)
        m, n = self.num_features, int(k.shape[-2])
        kk = k.detach().to(torch.float64)
        if kk.device.type == "meta":  # shapes without values (a model built on the meta device)
            if n < m:
                raise ValueError(f"{self.landmarks} landmarks need at least num_features={m} keys, got k with {n} "
                                 f"(shape {tuple(k.shape)})")
            L = torch.empty(*kk.shape[:-2], m, self.dim, dtype=torch.float64, device="meta")
        elif self.landmarks == "segment-means":
            if n < m:
                raise ValueError(
                    f"segment-means landmarks need at least num_features={m} keys, got k with {n} "
                    f"(shape {tuple(k.shape)})"
                )
            L = _segment_means(kk, m)
        else:
            if n < m:
                raise ValueError(
                    f"kmeans++ landmarks need at least num_features={m} keys, got k with {n} "
                    f"(shape {tuple(k.shape)})"
                )
            L = _kmeans_pp(kk, m, torch.Generator().manual_seed(self._fit_seed))
        L = L.expand(*lead, m, self.dim)
        ref = self.landmarks_
        self.landmarks_ = L.to(device=ref.device, dtype=ref.dtype).contiguous()
        self.batch_shape = tuple(lead)
        self.fitted_.fill_(True)
        self._fitted_host = True
        return self

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys,
                              unexpected_keys, error_msgs):
        # Fitted landmarks have the leading shape of the data they were fitted on (the rule of
        # `fit`): a map built the same way takes that shape from the state dict.
        L = state_dict.get(prefix + "landmarks_")
        if isinstance(L, torch.Tensor) and L.shape != self.landmarks_.shape:
            lead = tuple(L.shape[:-2])
            ok = L.dim() >= 2 and tuple(L.shape[-2:]) == tuple(self.landmarks_.shape[-2:])
            try:
                ok = ok and broadcast_shapes(lead, self._built_batch_shape) == torch.Size(lead)
            except RuntimeError:
                ok = False
            if not ok:
                error_msgs.append(
                    f"size mismatch for {prefix}landmarks_: expected (*lead, {self.num_features}, {self.dim}) "
                    f"with lead broadcasting the map's batch_shape {self._built_batch_shape}, got {tuple(L.shape)}"
                )
                return
            self.landmarks_ = torch.empty(L.shape, dtype=self.landmarks_.dtype, device=self.landmarks_.device)
            self.batch_shape = lead
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys,
                                      unexpected_keys, error_msgs)
        flag = state_dict.get(prefix + "fitted_")
        if isinstance(flag, torch.Tensor) and flag.device.type != "meta":
            self._fitted_host = bool(flag)  # loading may sync; feature calls then read the host copy
            self._checked = False

    def _whitener(self) -> tuple[torch.Tensor, torch.Tensor]:
        r"""``(W, h)``: $G^{-1/2}$ (..., m, m) and $\|l_i\|^2/2$ (..., m), float64, cached
        until the landmark buffer changes.

        Inside ``torch.compile`` the cache (keyed by the buffer's data pointer and version, which
        the compiler cannot trace) is bypassed: the $m \times m$ eigendecomposition is part of the
        graph, so a compiled map follows any change of the landmarks."""
        L = self.landmarks_
        if torch.compiler.is_compiling():
            return self._whitener_of(L)
        key = (L.data_ptr(), L._version, tuple(L.shape), L.dtype, L.device, self.ridge, self.rcond)
        if self._cache is not None and self._cache[0] == key:
            return self._cache[1], self._cache[2]
        W, h = self._whitener_of(L)
        self._cache = (key, W, h)
        return W, h

    def _whitener_of(self, L: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(W, h)`` of `_whitener` for landmarks ``L``, computed afresh."""
        with torch.no_grad():
            L64 = L.double()
            h = 0.5 * (L64 * L64).sum(-1)
            half_sq = h.unsqueeze(-1) + h.unsqueeze(-2) - L64 @ L64.mT  # |l_i - l_j|^2 / 2
            G = torch.exp(-half_sq.clamp_min(0))
            G.diagonal(dim1=-2, dim2=-1).fill_(1.0)
            lam, U = torch.linalg.eigh(G)
            m = G.shape[-1]
            rcond = m * torch.finfo(torch.float64).eps if self.rcond is None else self.rcond
            keep = lam > rcond * lam[..., -1:]
            w = torch.where(keep, torch.rsqrt(lam.clamp_min(0) + self.ridge), torch.zeros_like(lam))
            W = (U * w.unsqueeze(-2)) @ U.mT
            W = 0.5 * (W + W.mT)
        return W, h

    # ------------------------------------------------------------------ features
    def _raw(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """``y = G^{-1/2} e^{a - mu}`` (L, n, m), ``mu = max_i a_i`` (L, n), ``a`` and ``h`` (m,) for the
        prepared input (module docstring of the class)."""
        xc, _ = self._prepare("x", x)
        # once per map (reading the flag may synchronise a device); not inside torch.compile,
        # where reading the flag and warning would break the graph
        if not torch.compiler.is_compiling() and not self._checked:
            self._checked = True
            if not self._fitted_host:
                warnings.warn(_FALLBACK_WARNING, UserWarning, stacklevel=4)
        W, h = self._whitener()
        dt = xc.dtype
        a = torch.matmul(xc, self.landmarks_.to(dt).mT) - h.to(dt).unsqueeze(-2)  # (L, n, m)
        with torch.no_grad():
            mu = a.amax(dim=-1)
        g = torch.exp(a - mu.unsqueeze(-1))
        y = torch.matmul(g, W.to(dt))  # W is symmetric
        return y, mu, a, h

    def log_features(self, x, shared=False):
        y, mu, _, _ = self._raw(x)
        dt = y.dtype
        with torch.no_grad():
            nu = y.abs().amax(dim=-1)
            nu = torch.where((nu > 0) & torch.isfinite(nu), nu, torch.ones_like(nu))
        ls = mu.double() + torch.log(nu.double())
        if shared:
            with torch.no_grad():
                M = ls.amax(dim=-1, keepdim=True)
            # f e^M = y e^mu: f = y e^{mu - M}, |f| = nu e^{mu - M} = e^{ls - M} <= 1
            return y * torch.exp(mu.double() - M).to(dt).unsqueeze(-1), M
        return y / nu.unsqueeze(-1), ls

    def query_features(self, x):
        r"""$\varphi(x)$ up to a positive factor per row, scaled for attention.

        The row factor is $e^{-s(x)}$ with $s(x) = \max_i l_i^\top x - \max_i
        \|l_i\|^2/2$, the log-size of $\varphi(x)^\top\varphi(k)$ for a key $k$ at the
        landmark of largest norm, which is about the shared key scale of attention. The stabilised
        denominators $\varphi(q)^\top z\,e^{-(s(q) + M)}$ are then of order one instead of
        $e^{-(\|l\|^2_{\max} - \|l\|^2_{\min})/2}$ for queries aligned with small-norm keys,
        which the signed-map guard of `kernelapprox.linear_attention` (``|den| <= eps``)
        would otherwise treat as vanishing. $|f| \le \max|y|\,e^{40}$ (the exponent is
        capped: finite in float32).
        """
        y, mu, a, h = self._raw(x)
        with torch.no_grad():
            lq = (a + h.to(a.dtype).unsqueeze(-2)).amax(dim=-1).double()  # max_i l_i.x
            shift = (mu.double() - lq + h.amax(dim=-1, keepdim=True)).clamp(max=40.0)
        return y * torch.exp(shift).to(y.dtype).unsqueeze(-1)

    def extra_repr(self) -> str:
        rule = "tensor" if isinstance(self.landmarks, torch.Tensor) else repr(self.landmarks)
        s = f"dim={self.dim}, num_features={self.num_features}, landmarks={rule}, fitted={self.fitted}"
        if self.ridge:
            s += f", ridge={self.ridge}"
        if self.batch_shape:
            s += f", batch_shape={self.batch_shape}"
        return s


register_estimator(NystromFeatures, name="nystrom", label="Nyström", feature_dim="r")


class EluFeatures(_DeterministicMap):
    r"""The elu+1 map of linear attention [Kat20]_: $\varphi(x) = \mathrm{elu}(x) + 1$.

    Deterministic (no projection; ``redraw`` is a no-op), positive, ``feature_dim = d``: maps
    x (..., n, d) to (..., n, d). Computed
    branch-wise as $x + 1$ for $x \ge 0$ and $e^{x}$ below, so it does not
    round to 0 in bfloat16 for $x \le -8$ (flash-linear-attention issue #1261). As an
    estimator of $\exp(q^\top k)$ it is biased; `kernelapprox.theory.deterministic_error`
    gives the error.

    Examples
    --------
    >>> EluFeatures(4)(torch.tensor([[-1.0, 0.0, 1.0, 2.0]]))
    tensor([[0.3679, 1.0000, 2.0000, 3.0000]])
    """

    positive = True

    def _phi(self, xc):
        return torch.where(xc >= 0, xc + 1, torch.exp(torch.clamp(xc, max=0)))


register_estimator(EluFeatures, name="elu", label="elu+1", feature_dim="d")


class ReluFeatures(_DeterministicMap):
    r"""The ReLU map $\varphi(x) = \max(x, 0)$ (Performer-ReLU, [Cho21]_ App. A.4).

    Deterministic, non-negative, ``feature_dim = d``: maps x (..., n, d) to (..., n, d). Rows can
    be all zero, so attention
    denominators can vanish; `kernelapprox.linear_attention` guards them.

    Examples
    --------
    >>> ReluFeatures(3)(torch.tensor([[-1.0, 0.5, 2.0]]))
    tensor([[0.0000, 0.5000, 2.0000]])
    """

    positive = True

    def _phi(self, xc):
        return torch.relu(xc)


register_estimator(ReluFeatures, name="relu", label="relu", feature_dim="d")
