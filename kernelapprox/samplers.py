r"""Projection samplers: the random matrix $W \in \mathbb{R}^{r \times d}$ of a random feature map.

Every sampler draws on a CPU `torch.Generator` in float64, so that the same seed gives the
same projection on every device and dtype (the feature map casts and moves it afterwards), and
returns a `Projection` module. A sampler's ``row_law`` tells `kernelapprox.theory`
which closed forms apply to its rows (``"iid"``, ``"orthogonal-chi"``, ``"orthogonal-fixed"``,
``"simplex"``, or ``None`` where no closed form is claimed). Rows $w_1, \dots, w_r$ are the ``r = num_features``
random projections (the Performer convention used throughout the library).

- ``gaussian``: construction: iid $w_i \sim \mathcal N(0, I_d)$; unbiased: yes
- ``orthogonal``: construction: independent Haar-orthogonal $d\times d$ blocks, sign-corrected QR, rows rescaled by independent $\chi_d$ norms (``norms="chi"``) or $\sqrt d$ (``norms="fixed"``, biased: estimates SMREG); unbiased: yes (chi)
- ``structured``: construction: SORF: rows of $\sqrt p\, H D_1 H D_2 H D_3$ (applied as one GEMM with the cached $W$ up to $p = 1024$, by fast Walsh–Hadamard transforms above); unbiased: no (small bias)
- ``qmc``: construction: scrambled Sobol'/Halton points through $\Phi^{-1}$ (all draws scrambled at once); unbiased: yes
- ``simplex``: construction: SimRF: independent blocks of $d$ rows $\rho_i R^\top s_i$, $s_i$ the vertices of a regular simplex ($s_i^\top s_j = -\tfrac1{d-1}$), $R$ Haar, $\rho_i$ iid $\chi_d$; unbiased: yes
- ``simplex+``: construction: SimRF+: as ``simplex``, the directions first adapted to the norms; unbiased: yes

References
----------
- [Yu16] F. X. Yu, A. T. Suresh, K. Choromanski, D. Holtmann-Rice, S. Kumar. "Orthogonal Random
   Features", NeurIPS 2016, arXiv:1610.09072 (ORF eq. 2, SORF eq. 5).
- [Mez07] F. Mezzadri. "How to generate random matrices from the classical compact groups",
   Notices of the AMS 54 (2007), arXiv:math-ph/0609050 (the sign correction of QR).
- [Avr16] H. Avron, V. Sindhwani, J. Yang, M. W. Mahoney. "Quasi-Monte Carlo Feature Maps for
   Shift-Invariant Kernels", JMLR 17 (2016), arXiv:1412.8293.
- [Rei23] I. Reid, K. Choromanski, V. Likhosherstov, A. Weller. "Simplex Random Features",
   ICML 2023, arXiv:2301.13856 (SimRFs §3, SimRFs+ eq. 17).
- [Mat98] J. Matoušek. "On the L2-discrepancy for anchored boxes", J. Complexity 14 (1998)
   (random linear scrambling of digital nets).
- [Owe17] A. B. Owen. "A randomized Halton algorithm in R", arXiv:1706.02808 (2017) (random
   digit permutations).
"""

from __future__ import annotations

import functools
import math
import warnings
from collections.abc import Callable
from typing import ClassVar, cast

import numpy as np
import torch
from torch import nn

from ._logdomain import _dense_apply
from ._validation import as_batch_shape, broadcast_shapes, check_positive_int, check_seed

__all__ = [
    "Projection",
    "DenseProjection",
    "HadamardProjection",
    "Sampler",
    "GaussianSampler",
    "OrthogonalSampler",
    "StructuredSampler",
    "QMCSampler",
    "SimplexSampler",
    "GivenSampler",
    "SAMPLERS",
    "get_sampler",
    "make_generator",
    "fwht",
    "hadamard_matrix",
    "simplex_vectors",
]


def make_generator(seed: int | None = None, generator: torch.Generator | None = None) -> torch.Generator:
    """Return the CPU generator to draw from: a fresh one from ``seed``, ``generator`` itself, or
    torch's default CPU generator.

    Parameters
    ----------
    seed : int, optional
        Seed of a fresh CPU generator.
    generator : torch.Generator, optional
        A CPU generator, used as is (its state advances). Exclusive with ``seed``.
        With neither, ``torch.default_generator`` (the global CPU RNG), as ``nn.Linear``
        initialises its weight: ``torch.manual_seed`` makes the draw reproducible.

    Returns
    -------
    torch.Generator
        On CPU.

    Examples
    --------
    >>> make_generator(0).initial_seed()
    0
    """
    if seed is not None and generator is not None:
        raise ValueError("pass either seed or generator, not both")
    if generator is not None:
        if not isinstance(generator, torch.Generator):
            raise TypeError(f"generator must be a torch.Generator, got {type(generator).__name__}")
        if generator.device.type != "cpu":
            raise ValueError(
                f"generator must be a CPU generator (projections are drawn on CPU, then moved, so "
                f"the same seed gives the same projection on every device), got device {generator.device}"
            )
        return generator
    if seed is None:
        return torch.default_generator
    iseed = check_seed("seed", seed)
    g = torch.Generator(device="cpu")
    g.manual_seed(cast(int, iseed))
    return g


def _fwht_butterfly(x: torch.Tensor) -> torch.Tensor:
    r"""The $\log_2 p$ butterfly passes of the FWHT (the reference path of `fwht`)."""
    p = x.shape[-1]
    lead = x.shape[:-1]
    h = 1
    while h < p:
        y = x.reshape(*lead, p // (2 * h), 2, h)
        a, b = y[..., 0, :], y[..., 1, :]
        x = torch.stack((a + b, a - b), dim=-2).reshape(*lead, p)
        h *= 2
    return x


@functools.lru_cache(maxsize=32)
def _sylvester_cached(p: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    H = torch.ones(1, 1, dtype=dtype, device=device)
    while H.shape[0] < p:
        H = torch.cat((torch.cat((H, H), 1), torch.cat((H, -H), 1)), 0)
    return H


def hadamard_matrix(p: int, dtype: torch.dtype = torch.float64, device: torch.device | str = "cpu") -> torch.Tensor:
    r"""The Sylvester–Hadamard matrix $H_p$ (entries $\pm 1$, $H_{2p} = \begin{pmatrix}H_p & H_p\\ H_p & -H_p\end{pmatrix}$).

    Cached per ``(p, dtype, device)`` (at most 32 entries); do not modify the returned tensor.

    Parameters
    ----------
    p : int
        A power of two.
    dtype, device : optional

    Returns
    -------
    Tensor, shape (p, p)

    Examples
    --------
    >>> hadamard_matrix(2)
    tensor([[ 1.,  1.],
            [ 1., -1.]], dtype=torch.float64)
    """
    p = check_positive_int("p", p)
    if p & (p - 1):
        raise ValueError(f"p must be a power of two, got {p}")
    return _sylvester_cached(p, dtype, torch.device(device))


#: Largest Hadamard size applied as one dense GEMM by `fwht` (``method="auto"``); larger sizes
#: are factored as $H_p = H_a \otimes H_b$ into batched GEMMs with $a, b \le$ this size.
#: Measured on a shared 2-core AVX-512 CPU (float32, 1M entries): the GEMM path is 1.4-20x
#: faster than the butterflies for p = 256..16384 (noisy; 64, 128 and 256 perform alike).
FWHT_GEMM_MAX = 128


def _fwht_gemm(x: torch.Tensor) -> torch.Tensor:
    r"""$x H_p$ by dense GEMMs: one for ``p <= FWHT_GEMM_MAX``, else $H_a X H_b$ on ``x`` reshaped
    to (..., a, b), recursively (Sylvester: $H_{ab} = H_a \otimes H_b$, index ``i = i_a b + i_b``)."""
    p = x.shape[-1]
    if p <= FWHT_GEMM_MAX:
        return torch.matmul(x, hadamard_matrix(p, x.dtype, x.device))
    b = FWHT_GEMM_MAX
    a = p // b
    y = torch.matmul(x.reshape(*x.shape[:-1], a, b), hadamard_matrix(b, x.dtype, x.device))
    if a <= FWHT_GEMM_MAX:
        y = torch.matmul(hadamard_matrix(a, x.dtype, x.device), y)  # H_a along the a axis
    else:
        y = _fwht_gemm(y.mT).mT  # (H_a is symmetric)
    return y.reshape(x.shape)


def fwht(x: torch.Tensor, method: str = "auto") -> torch.Tensor:
    r"""Unnormalised fast Walsh–Hadamard transform over the last dimension.

    Computes $x H_p$ with $H_p$ the Sylvester–Hadamard matrix (entries $\pm 1$,
    `hadamard_matrix`) for ``p = x.shape[-1]`` a power of two.

    Parameters
    ----------
    x : Tensor, shape (..., p)
    method : {"auto", "gemm", "butterfly"}, default "auto"
        ``"butterfly"``: $\log_2 p$ passes of $(a, b) \mapsto (a + b, a - b)$, $O(p \log p)$
        flops per row. ``"gemm"``: dense products with cached $H$ matrices (one GEMM for
        ``p <= FWHT_GEMM_MAX``, else the Kronecker factorisation $H_a \otimes H_b$): more
        flops, but GEMM speed, and much faster on CPU at the sizes of attention heads.
        ``"auto"`` is ``"gemm"``. Both give the same values up to rounding (the entries of
        $H_p$ are exact; only the order of the sums differs).

    Returns
    -------
    Tensor, shape (..., p)

    Examples
    --------
    >>> fwht(torch.tensor([1.0, 0.0, 0.0, 0.0]))
    tensor([1., 1., 1., 1.])
    """
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"x must be a torch.Tensor, got {type(x).__name__}")
    p = x.shape[-1]
    if p < 1 or p & (p - 1):
        raise ValueError(f"fwht needs a power-of-two last dimension, got {p}")
    if method == "butterfly":
        return _fwht_butterfly(x)
    if method in ("auto", "gemm"):
        return _fwht_gemm(x)
    raise ValueError(f"method must be 'auto', 'gemm' or 'butterfly', got {method!r}")


class Projection(nn.Module):
    r"""A (batch of) projection(s) $W$ of shape ``(*batch_shape, r, d)``.

    ``forward(x)`` returns $x W^\top$, shape ``(*broadcast(x.shape[:-2], batch_shape), n, r)``.

    Examples
    --------
    >>> import torch
    >>> P = get_sampler("orthogonal").sample(6, 4, batch_shape=(2,), generator=make_generator(0))
    >>> isinstance(P, Projection), P.weight.shape, (P.batch_shape, P.num_features, P.dim)
    (True, torch.Size([2, 6, 4]), ((2,), 6, 4))
    >>> x = torch.randn(3, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    >>> P(x).shape, torch.allclose(P(x), x @ P.weight.mT)
    (torch.Size([2, 3, 6]), True)
    """

    num_features: int
    dim: int
    batch_shape: tuple[int, ...]

    @property
    def weight(self) -> torch.Tensor:  # pragma: no cover - abstract
        """The dense projection $W$, shape ``(*batch_shape, r, d)``."""
        raise NotImplementedError

    def gemm_weight(self, dtype: torch.dtype) -> torch.Tensor | None:
        """The dense $W$ (*batch_shape, r, d) in ``dtype`` when this projection is best applied as
        one GEMM (the feature maps then fold their bias into it), else ``None``."""
        return None

    def project_into(self, x: torch.Tensor, out: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
        """Write ``scale`` $\\cdot xW^\\top$ into ``out`` (shape (..., n, r), possibly a strided view);
        return ``out``. The factor scales $W$ (r x d), not the output."""
        W = self.gemm_weight(x.dtype)
        if W is not None and x.shape[:-2] == out.shape[:-2] and W.dim() == 2 and not torch.compiler.is_compiling():
            # (an out= into a strided slice breaks torch.compile's graph: copy there instead)
            return torch.matmul(x, W.mT if scale == 1.0 else (W * scale).mT, out=out)
        return out.copy_(self(x) if scale == 1.0 else self(x * scale))

    @torch.no_grad()
    def copy_from(self, other: Projection) -> bool:
        """Copy ``other``'s buffers into this projection's, in place; ``False`` (nothing copied) if
        the two differ in type or buffer shapes."""
        mine, theirs = dict(self.named_buffers()), dict(other.named_buffers())
        if type(self) is not type(other) or mine.keys() != theirs.keys():
            return False
        if any(mine[k].shape != theirs[k].shape for k in mine):
            return False
        for k, b in mine.items():
            b.copy_(theirs[k])
        return True

    def affine(
        self,
        x: torch.Tensor,
        row_bias: torch.Tensor | None = None,
        col_bias: torch.Tensor | None = None,
    ) -> torch.Tensor:
        r"""$x W^\top + b_{\text{row}} \mathbf 1^\top + \mathbf 1 b_{\text{col}}^\top$.

        Parameters
        ----------
        x : Tensor, shape (..., n, d)
        row_bias : Tensor, shape (..., n), optional
            Added to every feature of a row (e.g. $-\|x\|^2/2$).
        col_bias : Tensor, shape (*batch_shape, r), optional
            Added to every row (e.g. random phases).
        """
        u = self(x)
        inplace = not (u.requires_grad and torch.is_grad_enabled())
        if row_bias is not None:
            u = u.add_(row_bias.unsqueeze(-1)) if inplace else u + row_bias.unsqueeze(-1)
        if col_bias is not None:
            b = col_bias.to(u.dtype).unsqueeze(-2)
            u = u.add_(b) if inplace and u.shape == broadcast_shapes(u.shape, b.shape) else u + b
        return u


class DenseProjection(Projection):
    """A materialised projection; ``weight`` is a buffer (moves with ``.to()``, saved in ``state_dict``).

    Parameters
    ----------
    weight : Tensor, shape (*batch_shape, r, d)

    Examples
    --------
    >>> import torch
    >>> P = DenseProjection(torch.randn(4, 8, 3, generator=torch.Generator().manual_seed(0)))
    >>> P.batch_shape, P.num_features, P.dim
    ((4,), 8, 3)
    >>> P(torch.zeros(4, 10, 3)).shape          # one projection per leading index
    torch.Size([4, 10, 8])
    """

    _weight: torch.Tensor

    def __init__(self, weight: torch.Tensor) -> None:
        super().__init__()
        if not isinstance(weight, torch.Tensor) or weight.dim() < 2:
            raise ValueError(
                f"weight must be a tensor of shape (*batch_shape, r, d), got "
                f"{getattr(weight, 'shape', type(weight).__name__)}"
            )
        self.register_buffer("_weight", weight)
        self.num_features = int(weight.shape[-2])
        self.dim = int(weight.shape[-1])
        self.batch_shape = tuple(weight.shape[:-2])

    @property
    def weight(self) -> torch.Tensor:
        """The projection buffer, shape ``(*batch_shape, r, d)``."""
        return self._weight

    def gemm_weight(self, dtype: torch.dtype) -> torch.Tensor | None:
        """$W$ in ``dtype`` (the buffer itself when the dtype matches)."""
        return self._weight.to(dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x W^T: x (..., n, d) -> (*broadcast(..., batch_shape), n, r)."""
        return _dense_apply(self._weight.to(x.dtype), x)


class HadamardProjection(Projection):
    r"""Structured orthogonal projection (SORF) applied with a fast Walsh–Hadamard transform.

    Block $b$ has rows of $M_b = \sqrt p\, H D_{1b} H D_{2b} H D_{3b}$ with
    $H = H_p/\sqrt p$ the normalised Walsh–Hadamard matrix, $D_{ib}$ diagonal
    Rademacher, $p = 2^{\lceil \log_2 d \rceil}$; inputs are zero-padded to length ``p``.
    ``forward`` costs $O(n \cdot n_{\text{blocks}} \cdot p \log p)$ and never forms $W$.

    Parameters
    ----------
    signs : Tensor, shape (*batch_shape, n_blocks, 3, p), entries +-1
    dim : int
        Input dimension ``d <= p``.
    num_features : int
        ``r <= n_blocks * p``.

    Examples
    --------
    >>> import torch
    >>> g = torch.Generator().manual_seed(0)
    >>> signs = (2 * torch.randint(0, 2, (2, 3, 8), generator=g) - 1).double()   # 2 blocks, p = 8
    >>> P = HadamardProjection(signs, 5, 12)
    >>> P.weight.shape
    torch.Size([12, 5])
    >>> x = torch.randn(3, 5, dtype=torch.float64, generator=g)
    >>> torch.allclose(P(x), x @ P.weight.mT)     # the fast transform is the dense product
    True
    >>> full = HadamardProjection(signs, 8, 8).weight   # a full block: orthogonal rows, norm sqrt(p)
    >>> torch.allclose(full @ full.mT, 8 * torch.eye(8, dtype=torch.float64))
    True
    """

    signs: torch.Tensor

    #: Largest padded dimension ``p`` applied through the materialised $W$ (one dense GEMM,
    #: $r d$ flops per input row; $W$ built once and cached); above it, three fast
    #: Walsh–Hadamard transforms ($O(r \log p)$ per row, never forming $W$). Measured
    #: (2-core CPU, float32, r = d = p, 2048 rows): transform / dense GEMM = 6.4 at p = 256, 1.9 at
    #: 1024, 0.74 at 2048.
    dense_max_dim: ClassVar[int] = 1024

    def __init__(self, signs: torch.Tensor, dim: int, num_features: int) -> None:
        super().__init__()
        self.register_buffer("signs", signs)
        self.dim = int(dim)
        self.num_features = int(num_features)
        self.batch_shape = tuple(signs.shape[:-3])
        self.padded_dim = int(signs.shape[-1])
        self._dense_cache: tuple[tuple, torch.Tensor] | None = None

    def _apply_transform(self, x: torch.Tensor, method: str = "auto") -> torch.Tensor:
        """x W^T by three FWHTs: x (..., n, d) -> (*broadcast(..., batch_shape), n, r)."""
        p = self.padded_dim
        if x.shape[-1] < p:
            x = torch.nn.functional.pad(x, (0, p - x.shape[-1]))
        return _sorf_transform(self.signs.to(x.dtype), x, self.num_features, method)

    def _materialise(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        """$W$ (*batch_shape, r, d) from the signs, computed in float64 (exact entries
        $k / p$) and cast to ``dtype`` (default: the signs' dtype)."""
        eye = torch.eye(self.padded_dim, dtype=torch.float64, device=self.signs.device)
        cols = _sorf_transform(self.signs.to(torch.float64), eye, self.num_features, "auto")  # (*B, p, r)
        return cols.mT[..., : self.dim].to(dtype or self.signs.dtype).contiguous()

    def gemm_weight(self, dtype: torch.dtype) -> torch.Tensor | None:
        """The cached dense $W$ in ``dtype`` when ``padded_dim <= dense_max_dim`` (else ``None``).

        The cache is keyed on the signs' storage, version counter (bumped by every in-place
        write: `redraw`, ``load_state_dict``), dtype and device, so it never serves a stale $W$.
        Under ``torch.compile`` the matrix is rebuilt inside the graph instead.
        """
        if self.padded_dim > self.dense_max_dim:
            return None
        if torch.compiler.is_compiling():
            return self._materialise(dtype)
        sg = self.signs
        key = (sg.data_ptr(), sg._version, sg.device, dtype)
        cache = getattr(self, "_dense_cache", None)  # (absent on maps pickled before the cache)
        if cache is None or cache[0] != key:
            with torch.no_grad():
                cache = (key, self._materialise(dtype))
            self._dense_cache = cache
        return cache[1]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x W^T: x (..., n, d) -> (*broadcast(..., batch_shape), n, r); one GEMM with the cached
        $W$ up to ``dense_max_dim``, three fast Walsh–Hadamard transforms above."""
        W = self.gemm_weight(x.dtype)
        if W is not None:
            return _dense_apply(W, x)
        return self._apply_transform(x)

    @property
    def weight(self) -> torch.Tensor:
        """The materialised $W$, shape ``(*batch_shape, r, d)`` (built on demand, in the
        signs' dtype)."""
        return self._materialise()


def _sorf_transform(signs: torch.Tensor, x: torch.Tensor, r: int, method: str) -> torch.Tensor:
    r"""Rows of $\sqrt p\, H D_1 H D_2 H D_3$ applied to x (..., n, p) (already padded):
    signs (*B, nb, 3, p) -> (*broadcast(..., B), n, r)."""
    p = signs.shape[-1]
    s = signs.unsqueeze(-4)  # (*B, 1, nb, 3, p) against x (..., n, 1, p)
    y = x.unsqueeze(-2) * s[..., 2, :]
    y = fwht(y, method) * s[..., 1, :]
    y = fwht(y, method) * s[..., 0, :]
    y = fwht(y, method) / p  # sqrt(p) * (H_p / sqrt(p))^3 = H_p^3 / p
    return y.reshape(*y.shape[:-2], -1)[..., :r]


class Sampler:
    """Base class of projection samplers.

    Subclasses implement `sample`, returning a `Projection` of shape
    ``(*batch_shape, r, d)`` in float64 on CPU.

    Examples
    --------
    A sampler of your own, usable by every random map:

    >>> import torch, kernelapprox as ka
    >>> class HalfNormRows(Sampler):
    ...     '''iid Gaussian rows scaled by 1/2: an estimator of exp(q.k / 4), not exp(q.k).'''
    ...     name, unbiased, row_law = "half-norm", False, None
    ...     def sample(self, num_features, dim, *, batch_shape=(), generator):
    ...         w = torch.randn(*batch_shape, num_features, dim, generator=generator, dtype=torch.float64)
    ...         return DenseProjection(w / 2)
    >>> fm = ka.PositiveRF(4, 8, sampler=HalfNormRows(), seed=0)
    >>> fm.weight.shape, torch.allclose(2 * fm.weight, ka.PositiveRF(4, 8, seed=0).weight)
    (torch.Size([8, 4]), True)
    """

    #: Registry name (``get_sampler(name)``).
    name: str = "sampler"
    #: Short label for legends.
    label: str = "sampler"
    #: Whether every random estimator built on these rows is unbiased.
    unbiased: bool = True
    #: The law of the rows as far as `kernelapprox.theory` is concerned: ``"iid"`` (iid
    #: Gaussian), ``"orthogonal-chi"``, ``"orthogonal-fixed"``, ``"simplex"``, or ``None`` (no
    #: closed form claimed).
    row_law: str | None = None

    def sample(
        self,
        num_features: int,
        dim: int,
        *,
        batch_shape: tuple[int, ...] = (),
        generator: torch.Generator,
    ) -> Projection:  # pragma: no cover - abstract
        """Draw a projection.

        Parameters
        ----------
        num_features : int
            ``r``, the number of rows (random projections).
        dim : int
            ``d``, the input dimension.
        batch_shape : tuple of int
            Independent draws: the projection has shape ``(*batch_shape, r, d)``.
        generator : torch.Generator
            CPU generator (see `make_generator`).

        Returns
        -------
        Projection
            In float64 on CPU; the feature map casts and moves it.
        """
        raise NotImplementedError

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"

    def __eq__(self, other: object) -> bool:
        return type(self) is type(other) and vars(self) == vars(other)

    def __hash__(self) -> int:
        return hash((type(self).__name__, tuple(sorted(vars(self).items()))))


class GaussianSampler(Sampler):
    r"""iid rows $w_i \sim \mathcal N(0, I_d)$.

    Examples
    --------
    >>> P = GaussianSampler().sample(8, 4, generator=make_generator(0))
    >>> P.weight.shape
    torch.Size([8, 4])
    """

    name = "gaussian"
    label = "iid"
    row_law = "iid"

    def sample(self, num_features, dim, *, batch_shape=(), generator):
        r = check_positive_int("num_features", num_features)
        d = check_positive_int("dim", dim)
        B = as_batch_shape(batch_shape)
        return DenseProjection(torch.randn(*B, r, d, generator=generator, dtype=torch.float64, device="cpu"))


def haar_orthogonal(shape: tuple[int, ...], d: int, generator: torch.Generator) -> torch.Tensor:
    r"""Haar-distributed orthogonal matrices of shape ``(*shape, d, d)`` (float64, CPU).

    QR of a Gaussian matrix with the sign correction $Q \operatorname{diag}(\operatorname{sign} R_{ii})$
    [Mez07]_; without it, LAPACK's Householder QR ties column signs to $R_{ii}$ and
    the rows of a block are *not* uniformly distributed (the Performer ORF bias).
    """
    G = torch.randn(*shape, d, d, generator=generator, dtype=torch.float64, device="cpu")
    Q, R = torch.linalg.qr(G)
    diag = torch.diagonal(R, dim1=-2, dim2=-1)
    sign = torch.where(diag >= 0, 1.0, -1.0).to(Q.dtype)
    return Q * sign.unsqueeze(-2)


class OrthogonalSampler(Sampler):
    r"""Block-orthogonal random features (ORF) [Yu16]_.

    ``sample(r, d, batch_shape=B, generator=g)`` returns a projection of shape ``(*B, r, d)``.

    ``n_blocks = ceil(r / d)`` independent Haar-orthogonal $d \times d$ blocks (sign-corrected
    QR [Mez07]_); block $b$ gives rows $bd, \dots, bd + d - 1$, the last block keeps
    only its first ``r - (n_blocks - 1) d`` rows. Rows are rescaled:

    * ``norms="chi"``: by independent $\chi_d$ variables, independent of the directions, so
      every row is marginally $\mathcal N(0, I_d)$ and every estimator stays unbiased;
    * ``norms="fixed"``: to norm $\sqrt d$ (Yu's ORF′; positive features then estimate the
      regularised kernel SMREG, not $\exp(q^\top k)$).

    Parameters
    ----------
    norms : {"chi", "fixed"}, default "chi"

    Examples
    --------
    >>> W = OrthogonalSampler().sample(8, 4, generator=make_generator(0)).weight
    >>> G = W[:4] @ W[:4].T  # first block: diagonal
    >>> bool(torch.allclose(G, torch.diag(torch.diagonal(G))))
    True
    """

    name = "orthogonal"
    label = "orthogonal"

    def __init__(self, norms: str = "chi") -> None:
        if norms not in ("chi", "fixed"):
            raise ValueError(f"norms must be 'chi' or 'fixed', got {norms!r}")
        self.norms = norms
        self.unbiased = norms == "chi"
        self.row_law = f"orthogonal-{norms}"

    def __repr__(self) -> str:
        return f"OrthogonalSampler(norms={self.norms!r})"

    def sample(self, num_features, dim, *, batch_shape=(), generator):
        r = check_positive_int("num_features", num_features)
        d = check_positive_int("dim", dim)
        B = as_batch_shape(batch_shape)
        nb = -(-r // d)
        Q = haar_orthogonal((*B, nb), d, generator)
        W = Q.mT.reshape(*B, nb * d, d)[..., :r, :]  # rows of Q^T (= columns of Q) as directions
        if self.norms == "chi":
            norms = torch.randn(*B, r, d, generator=generator, dtype=torch.float64, device="cpu").norm(dim=-1)
        else:
            norms = torch.full((*B, r), math.sqrt(d), dtype=torch.float64, device="cpu")
        return DenseProjection((W * norms.unsqueeze(-1)).contiguous())


class StructuredSampler(Sampler):
    r"""Structured orthogonal random features (SORF) [Yu16]_ eq. (5).

    ``sample(r, d, batch_shape=B, generator=g)`` returns a projection of shape ``(*B, r, d)``.

    Rows of $\sqrt p\, H D_1 H D_2 H D_3$ per block (``p`` = next power of two ``>= d``),
    applied in $O(r \log d)$ per input through `fwht`. The rows of a full
    $p$-dimensional block are orthogonal with norm $\sqrt p$; when $d < p$ only
    their first $d$ coordinates act on the (zero-padded) input, and those are *not* orthogonal. The estimators built on it are slightly *biased*
    (Yu et al. Thm 3: $|\mathbb E K_{\mathrm{SORF}} - K| \le 6z/\sqrt d$), and no closed-form
    variance is claimed for them (use `kernelapprox.montecarlo`).

    Examples
    --------
    >>> import torch, kernelapprox as ka
    >>> P = StructuredSampler().sample(12, 5, batch_shape=(2,), generator=make_generator(0))
    >>> type(P).__name__, P.weight.shape, P.signs.shape      # 2 blocks of p = 8 rows
    ('HadamardProjection', torch.Size([2, 12, 5]), torch.Size([2, 2, 3, 8]))
    >>> fm = ka.PositiveRF(5, 12, sampler="structured", seed=0)
    >>> fm.sampler.unbiased, fm.sampler.row_law
    (False, None)
    """

    name = "structured"
    label = "SORF"
    unbiased = False

    def sample(self, num_features, dim, *, batch_shape=(), generator):
        r = check_positive_int("num_features", num_features)
        d = check_positive_int("dim", dim)
        B = as_batch_shape(batch_shape)
        p = 1 << (d - 1).bit_length()
        nb = -(-r // p)
        bits = torch.randint(0, 2, (*B, nb, 3, p), generator=generator, device="cpu")
        signs = (2 * bits - 1).to(torch.float64)
        return HadamardProjection(signs, d, r)


class QMCSampler(Sampler):
    r"""Randomised quasi-Monte Carlo rows [Avr16]_: $w_i = \Phi^{-1}(t_i)$ coordinate-wise.

    ``sample(r, d, batch_shape=B, generator=g)`` returns a projection of shape ``(*B, r, d)``.

    ``t_1..t_r`` are the first ``r`` points of a randomised Sobol' (``method="sobol"``) or Halton
    sequence, one independent randomisation per batch element, all drawn at once (vectorised,
    from ``generator``). Randomisation makes each point uniform on $[0,1)^d$, so each row is
    marginally $\mathcal N(0, I_d)$ and the estimators stay unbiased; rows are negatively
    dependent (low discrepancy). No closed-form variance is claimed (use
    `kernelapprox.montecarlo`).

    Parameters
    ----------
    method : {"sobol", "halton"}, default "sobol"
    randomization : {"scramble", "shift"}, default "scramble"
        ``"scramble"``: Sobol': a random linear matrix scramble plus a random digital shift
        [Mat98]_ (the "LMS+shift" of `scipy.stats.qmc.Sobol`), on 52-bit digits; Halton: an
        independent random permutation of each base-$b$ digit [Owe17]_ (as
        `scipy.stats.qmc.Halton`; the trailing digits, zero for all ``r`` points, add up to one
        uniform number per draw and coordinate, drawn directly). Either preserves the
        low discrepancy of the sequence (the net structure for Sobol') and makes every point
        uniform. ``"shift"``: the unscrambled sequence plus an independent uniform shift modulo 1
        per batch element (Cranley–Patterson rotation). Both make every row marginally
        $\mathcal N(0, I_d)$, and draws are independent.

    Examples
    --------
    >>> import torch, kernelapprox as ka
    >>> s = QMCSampler(method="halton", randomization="shift")
    >>> s
    QMCSampler(method='halton', randomization='shift')
    >>> s.sample(16, 4, batch_shape=(3,), generator=make_generator(0)).weight.shape
    torch.Size([3, 16, 4])
    >>> fm = ka.PositiveRF(4, 16, sampler="qmc", seed=0)        # Sobol', scrambled
    >>> fm.sampler.unbiased, bool(fm.weight.isfinite().all())
    (True, True)
    """

    name = "qmc"
    label = "QMC"
    #: Binary digits of the scrambled Sobol' points (float64 resolution: $2^{-52}$).
    SOBOL_BITS: ClassVar[int] = 52

    def __init__(self, method: str = "sobol", randomization: str = "scramble") -> None:
        if method not in ("sobol", "halton"):
            raise ValueError(f"method must be 'sobol' or 'halton', got {method!r}")
        if randomization not in ("scramble", "shift"):
            raise ValueError(f"randomization must be 'scramble' or 'shift', got {randomization!r}")
        self.method = method
        self.randomization = randomization

    def __repr__(self) -> str:
        return f"QMCSampler(method={self.method!r}, randomization={self.randomization!r})"

    def _engine(self, d: int, scramble: bool, rng=None, bits: int | None = None):
        from scipy.stats import qmc  # imported here: scipy.stats costs ~0.4-1 s at import

        if self.method == "sobol":
            return qmc.Sobol(d, scramble=scramble, rng=rng, bits=bits)
        return qmc.Halton(d, scramble=scramble, rng=rng)

    def points(self, num_points: int, dim: int, count: int, generator: torch.Generator) -> torch.Tensor:
        """``count`` independently randomised point sets in $[0, 1)^d$, shape (count, n, d), float64.

        Parameters
        ----------
        num_points : int
            ``n``, the first points of the sequence.
        dim : int
            ``d``.
        count : int
            Number of independent randomisations.
        generator : torch.Generator
            CPU generator the randomisations are drawn from.
        """
        n = check_positive_int("num_points", num_points)
        d = check_positive_int("dim", dim)
        count = check_positive_int("count", count)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)  # Sobol' balance warning for n != 2^m
            if self.randomization == "shift":
                base = torch.from_numpy(self._engine(d, scramble=False).random(n))
                shift = torch.rand(count, 1, d, generator=generator, dtype=torch.float64, device="cpu")
                return torch.remainder(base + shift, 1.0)
            if self.method == "sobol":
                return self._sobol_scrambled(n, d, count, generator)
            return self._halton_scrambled(n, d, count, generator)

    def _sobol_scrambled(self, n: int, d: int, count: int, generator: torch.Generator) -> torch.Tensor:
        r"""LMS + digital shift of the first ``n`` Sobol' points, for ``count`` draws at once.

        With $B$ bits, point $i$ is $x_i = \bigoplus_k g_k(i)\, v_k$ (XOR of the direction
        numbers $v_k$ selected by the Gray code $g(i) = i \oplus (i \gg 1)$). A linear scramble
        $M$ (a random $B\times B$ binary matrix, unit diagonal, each output digit mixing in the
        more significant input digits) commutes with the XOR: $M x_i = \bigoplus_k g_k(i)\, M v_k$,
        so only the $m = \lceil\log_2 n\rceil$ direction numbers in use are scrambled (per draw
        and dimension); the points follow by the Gray-code doubling
        $x_{2^k + i} = v_k \oplus x_{2^k - 1 - i}$ (one XOR per point), then a uniform random
        $B$-bit shift is XORed in.
        """
        # The integer work runs in numpy (single-threaded): these are many small elementwise ops,
        # which torch's intra-op thread pool slows down 10-20x on a loaded machine. The random
        # bits come from ``generator``.
        B = self.SOBOL_BITS
        m = max(1, (n - 1).bit_length())
        base = self._engine(d, scramble=False, bits=B).random(1 << m)  # exact multiples of 2^-B
        ints = np.ldexp(base, B).astype(np.int64)  # (2^m, d)
        # v_k is the point of index 2^{k+1} - 1 (its Gray code is 2^k)
        v = np.ascontiguousarray(ints[(1 << np.arange(1, m + 1)) - 1].T)  # (d, m)
        # Column p of M (input bit p, counted from the least significant) as a word: bit p set,
        # the bits below p uniform random (the output digits it mixes into), those above clear.
        rnd = torch.randint(0, 1 << B, (B, count, d, 1), generator=generator, dtype=torch.int64, device="cpu").numpy()
        p = np.arange(B, dtype=np.int64).reshape(B, 1, 1, 1)
        cols = (rnd & ((1 << p) - 1)) | (1 << p)  # (B, count, d, 1)
        vs = np.zeros((count, d, m), dtype=np.int64)
        for j in range(B):  # M v = XOR of the columns selected by the bits of v (-1: all bits set)
            vs ^= cols[j] & -((v >> j) & 1)
        shift = torch.randint(0, 1 << B, (count, 1, d), generator=generator, dtype=torch.int64, device="cpu").numpy()
        pts = np.empty((count, 1 << m, d), dtype=np.int64)
        pts[:, :1] = shift
        for k in range(m):
            h = 1 << k
            np.bitwise_xor(pts[:, h - 1 :: -1] if h > 1 else pts[:, :1], vs[:, None, :, k], out=pts[:, h : 2 * h])
        return torch.from_numpy(np.ldexp(pts[:, :n].astype(np.float64), -B))

    def _halton_scrambled(self, n: int, d: int, count: int, generator: torch.Generator) -> torch.Tensor:
        r"""Random-digit-permutation Halton points, ``count`` draws at once.

        Coordinate $j$ (base $b_j$, the $j$-th prime) of point $i$ is
        $\sum_{k} \pi_{jk}(a_k(i))\, b_j^{-k-1}$, with $a_k(i)$ the base-$b_j$ digits of $i$ and
        $\pi_{jk}$ independent uniform permutations of $\{0..b_j-1\}$ [Owe17]_. Trailing zero
        digits are permuted too: for $k \ge K = \lceil\log_{b_j} n\rceil$ every point has
        $a_k = 0$, and the iid uniform digits $\pi_{jk}(0)$ add up to one uniform number on
        $[0, b_j^{-K})$ per draw and dimension, drawn directly. Each coordinate is therefore
        uniform on $[0, 1)$.
        """
        # numpy for the arithmetic (single-threaded; see `_sobol_scrambled`), torch for the draws
        out = np.empty((count, n, d), dtype=np.float64)
        i = np.arange(n, dtype=np.int64)
        tail = torch.rand(count, 1, d, generator=generator, dtype=torch.float64, device="cpu").numpy()
        for j, b in enumerate(_primes(d)):
            K = 1
            while b**K < n:
                K += 1
            digits = np.stack([(i // b**k) % b for k in range(K)])  # (K, n)
            u = torch.rand(count, K, b, generator=generator, dtype=torch.float64, device="cpu").numpy()
            perm = np.argsort(u, axis=-1)  # (count, K, b): uniform random permutations
            vals = np.take_along_axis(perm, np.broadcast_to(digits, (count, K, n)), axis=2)
            w = float(b) ** -np.arange(1, K + 1, dtype=np.float64)
            out[:, :, j] = np.einsum("skn,k->sn", vals.astype(np.float64), w) + tail[:, :, j] * float(b) ** -K
        return torch.from_numpy(out)

    def sample(self, num_features, dim, *, batch_shape=(), generator):
        r = check_positive_int("num_features", num_features)
        d = check_positive_int("dim", dim)
        B = as_batch_shape(batch_shape)
        pts = self.points(r, d, math.prod(B), generator)
        eps = np.finfo(np.float64).eps
        out = torch.special.ndtri(pts.clamp(eps, 1 - eps))
        return DenseProjection(out.reshape(*B, r, d).contiguous())


def _parity(x: torch.Tensor) -> torch.Tensor:
    """Parity (0 or 1) of the set bits of non-negative int64 ``x``, elementwise."""
    for s in (32, 16, 8, 4, 2, 1):
        x = x ^ (x >> s)
    return x & 1


def _primes(count: int) -> list[int]:
    """The first ``count`` primes (the Halton bases)."""
    out: list[int] = []
    c = 2
    while len(out) < count:
        if all(c % p for p in out if p * p <= c):
            out.append(c)
        c += 1
    return out


def simplex_vectors(dim: int) -> torch.Tensor:
    r"""The $d$ unit vertices of a regular simplex centred at 0, as rows (float64, CPU).

    $$
    s_i = \sqrt{\tfrac d{d-1}}\, e_i - \frac{\sqrt d + 1}{(d-1)^{3/2}}\,\mathbf 1' \quad (i < d),
    \qquad s_d = \frac{\mathbf 1'}{\sqrt{d-1}},
    $$

    with $\mathbf 1'$ the all-ones vector with its last entry 0. Then
    $\|s_i\| = 1$, $s_i^\top s_j = -\tfrac1{d-1}$ ($i \ne j$) and
    $\sum_i s_i = 0$: the Gram matrix is $SS^\top = \tfrac d{d-1} I - \tfrac1{d-1}\mathbf 1\mathbf 1^\top$.
    The vertices span the first $d - 1$ coordinates (the last column is 0).

    Parameters
    ----------
    dim : int
        ``d >= 2`` (``d = 1`` raises ``ValueError``: one unit vector cannot sum to 0).

    Returns
    -------
    Tensor, shape (d, d)
        Row ``i`` is $s_{i+1}$.

    References
    ----------
    Reid, Choromanski, Likhosherstov, Weller, "Simplex Random Features", ICML 2023,
    arXiv:2301.13856, §3.

    Examples
    --------
    >>> S = simplex_vectors(3)
    >>> bool(torch.allclose(S @ S.T, torch.tensor([[1.0, -0.5, -0.5], [-0.5, 1.0, -0.5], [-0.5, -0.5, 1.0]], dtype=torch.float64)))
    True
    """
    d = check_positive_int("dim", dim)
    if d < 2:
        raise ValueError(
            f"dim must be >= 2 for simplex random features (d unit vectors with pairwise "
            f"inner products -1/(d-1) need d >= 2), got {d}"
        )
    ones = torch.ones(d, dtype=torch.float64)
    ones[-1] = 0.0
    S = torch.empty(d, d, dtype=torch.float64)
    S[: d - 1] = (
        math.sqrt(d / (d - 1)) * torch.eye(d, dtype=torch.float64)[: d - 1]
        - ((math.sqrt(d) + 1.0) / (d - 1) ** 1.5) * ones
    )
    S[d - 1] = ones / math.sqrt(d - 1)
    return S


def _simplex_plus_directions(rho: torch.Tensor, S: torch.Tensor, iterations: int) -> torch.Tensor:
    r"""SimRF+ directions [Rei23]_ eq. (17): ``iterations`` sweeps of
    $s_i \leftarrow -v_i/\|v_i\|$, $v_i = \sum_{j\ne i}\rho_j s_j$, rows in order
    (each update is the exact minimiser of $\|\sum_j \rho_j s_j\|^2$ over the unit vector
    $s_i$, so the objective never increases). ``rho``: (..., d) norms (0 for rows a partial
    block drops: they take no part); ``S``: (..., d, d) starting directions. A row whose
    $v_i$ vanishes (a block of one row) keeps its direction."""
    d = S.shape[-1]
    lead = rho.shape[:-1]
    dirs = [S[..., i, :].expand(*lead, d).contiguous() for i in range(d)]  # contiguous rows: fast
    norms = [rho[..., i : i + 1].contiguous() for i in range(d)]
    total = sum((n * u for n, u in zip(norms, dirs, strict=True)), torch.zeros_like(dirs[0]))
    tiny = 1e-12 * rho.sum(-1, keepdim=True)
    for _ in range(iterations):
        for i in range(d):
            v = total - norms[i] * dirs[i]
            n = v.norm(dim=-1, keepdim=True)
            ok = n > tiny
            dirs[i] = torch.where(ok, v / torch.where(ok, -n, -1.0), dirs[i])
            total = v + norms[i] * dirs[i]
    return torch.stack(dirs, dim=-2)


class SimplexSampler(Sampler):
    r"""Simplex random features: SimRF, or SimRF+ with ``plus=True`` [Rei23]_.

    ``sample(r, d, batch_shape=B, generator=g)`` returns a projection of shape ``(*B, r, d)``.

    ``n_blocks = ceil(r / d)`` independent blocks; block rows are

    $$
    w_i = \rho_i\, R^\top s_i, \qquad i = 1..d,
    $$

    with $s_i$ the unit vertices of a regular simplex (`simplex_vectors`:
    $s_i^\top s_j = -\tfrac1{d-1}$, $\sum_i s_i = 0$), $R$ a Haar-orthogonal
    matrix (sign-corrected QR, as `OrthogonalSampler`) and $\rho_i$ iid
    $\chi_d$, independent of $R$. The last block keeps its first
    ``r - (n_blocks - 1) d`` rows. Each row is marginally $\mathcal N(0, I_d)$
    (its direction $R^\top s_i$ is uniform on the sphere and independent of its norm), so
    every estimator stays unbiased; two rows of a block have the fixed angle
    $\cos = -\tfrac1{d-1}$ (ORF: 0), which lowers the MSE of positive features further
    (`kernelapprox.theory.simplex`).

    ``plus=True`` (SimRF+, eq. 17): given the norms of a block, the directions start at the simplex
    and take ``iterations`` sweeps of $s_i \leftarrow -\sum_{j\ne i}\rho_j s_j /
    \|\sum_{j\ne i}\rho_j s_j\|$ (in row order, each step minimising $\|\sum_j\rho_j s_j\|$),
    then are rotated by $R$. The directions now depend on the norms, but $R$ still
    makes each row's direction uniform and independent of *all* the norms, so each row is
    still $\mathcal N(0, I_d)$ and the estimators unbiased. Its pair law depends on the
    norms: ``row_law`` is ``None`` (no closed form; use `kernelapprox.montecarlo`).

    Parameters
    ----------
    plus : bool, default False
        SimRF+ (weight-dependent directions) instead of SimRF.
    iterations : int, default 5
        Sweeps of the SimRF+ update (ignored for SimRF).

    Raises
    ------
    ValueError
        From `sample` if ``d = 1`` (no simplex).

    Examples
    --------
    >>> W = SimplexSampler().sample(4, 4, generator=make_generator(0)).weight
    >>> U = W / W.norm(dim=-1, keepdim=True)
    >>> G = U @ U.T  # off-diagonal: -1/(d-1)
    >>> bool(torch.allclose(G, torch.full((4, 4), -1 / 3, dtype=torch.float64) + 4 / 3 * torch.eye(4, dtype=torch.float64)))
    True
    >>> get_sampler("simplex+")
    SimplexSampler(plus=True)
    """

    def __init__(self, plus: bool = False, iterations: int = 5) -> None:
        if not isinstance(plus, (bool, np.bool_)):
            raise TypeError(f"plus must be a bool, got {plus!r}")
        if isinstance(iterations, bool) or not isinstance(iterations, (int, np.integer)) or iterations < 1:
            raise ValueError(f"iterations must be a positive int, got {iterations!r}")
        self.plus = bool(plus)
        self.iterations = int(iterations)
        self.name = "simplex+" if self.plus else "simplex"
        self.label = "SimRF+" if self.plus else "SimRF"
        self.row_law = None if self.plus else "simplex"

    def __repr__(self) -> str:
        if not self.plus:
            return "SimplexSampler()"
        it = "" if self.iterations == 5 else f", iterations={self.iterations}"
        return f"SimplexSampler(plus=True{it})"

    def sample(self, num_features, dim, *, batch_shape=(), generator):
        r = check_positive_int("num_features", num_features)
        d = check_positive_int("dim", dim)
        if d < 2:
            raise ValueError(
                f"dim must be >= 2 for the {self.name!r} sampler (a simplex of d unit vectors "
                f"summing to 0 needs d >= 2), got {d}"
            )
        B = as_batch_shape(batch_shape)
        nb = -(-r // d)
        R = haar_orthogonal((*B, nb), d, generator)  # (*B, nb, d, d)
        rho = torch.randn(*B, nb, d, d, generator=generator, dtype=torch.float64, device="cpu").norm(dim=-1)
        S = simplex_vectors(d)
        if self.plus:
            keep = torch.ones(nb, d, dtype=torch.float64)
            keep[-1, r - (nb - 1) * d :] = 0.0  # rows the partial block drops take no part
            S = _simplex_plus_directions(rho * keep, S.expand(*B, nb, d, d), self.iterations)
        W = (rho.unsqueeze(-1) * S) @ R  # row i of a block: rho_i s_i^T R = (rho_i R^T s_i)^T
        return DenseProjection(W.reshape(*B, nb * d, d)[..., :r, :].contiguous())


class GivenSampler(Sampler):
    """Marks a projection supplied by the caller (``from_projection``): provenance unknown.

    It cannot draw: ``redraw`` on such a map needs an explicit sampler.

    Examples
    --------
    >>> import torch, kernelapprox as ka
    >>> fm = ka.PositiveRF.from_projection(torch.randn(8, 4, dtype=torch.float64))
    >>> fm.sampler, fm.sampler.unbiased
    (GivenSampler(), False)
    >>> try:
    ...     fm.redraw()
    ... except ValueError:
    ...     print("cannot redraw a given projection")
    cannot redraw a given projection
    """

    name = "given"
    label = "given"
    unbiased = False

    def sample(self, num_features, dim, *, batch_shape=(), generator):
        raise ValueError(
            "this feature map was built from a given projection of unknown provenance, so redraw() "
            "cannot draw a new one; pass sampler=... to from_projection (how W was drawn, e.g. "
            "sampler='gaussian'), or build the map with a sampler, e.g. PositiveRF(dim, r, sampler='gaussian')"
        )


#: Registered sampler names -> a factory of the default instance (a class, or a class with
#: arguments: ``"simplex+"`` is ``SimplexSampler(plus=True)``).
SAMPLERS: dict[str, Callable[[], Sampler]] = {
    "gaussian": GaussianSampler,
    "orthogonal": OrthogonalSampler,
    "structured": StructuredSampler,
    "qmc": QMCSampler,
    "simplex": SimplexSampler,
    "simplex+": functools.partial(SimplexSampler, plus=True),
}


def get_sampler(sampler: str | Sampler) -> Sampler:
    """Resolve a sampler name (``"gaussian"``, ``"orthogonal"``, ``"structured"``, ``"qmc"``,
    ``"simplex"``, ``"simplex+"``) or object.

    The sampler's ``sample(r, d, batch_shape=B, generator=g)`` draws projections of shape ``(*B, r, d)``.

    Parameters
    ----------
    sampler : str or Sampler
        A name in ``SAMPLERS`` (the default instance is built), or a `Sampler` (returned as is).

    Returns
    -------
    Sampler

    Raises
    ------
    ValueError
        Unknown name (the message lists the valid ones).
    TypeError
        Neither a str nor a `Sampler`.

    Examples
    --------
    >>> get_sampler("orthogonal")
    OrthogonalSampler(norms='chi')
    """
    if isinstance(sampler, Sampler):
        return sampler
    if isinstance(sampler, str):
        if sampler not in SAMPLERS:
            raise ValueError(f"unknown sampler {sampler!r}; valid names: {sorted(SAMPLERS)}")
        return SAMPLERS[sampler]()
    raise TypeError(f"sampler must be a name in {sorted(SAMPLERS)} or a Sampler, got {type(sampler).__name__}")
