r"""Projection samplers: the random matrix $W \in \mathbb{R}^{r \times d}$ of a random feature map.

Every sampler draws on a CPU `torch.Generator` in float64, so that the same seed gives the
same projection on every device and dtype (the feature map casts and moves it afterwards), and
returns a `Projection` module. A sampler's ``row_law`` tells `kernelapprox.theory`
which closed forms apply to its rows (``"iid"``, ``"orthogonal-chi"``, ``"orthogonal-fixed"``,
``"simplex"``, or ``None`` where no closed form is claimed). Rows $w_1, \dots, w_r$ are the ``r = num_features``
random projections (the Performer convention used throughout the library).

- ``gaussian``: construction: iid $w_i \sim \mathcal N(0, I_d)$; unbiased: yes
- ``orthogonal``: construction: independent Haar-orthogonal $d\times d$ blocks, sign-corrected QR, rows rescaled by independent $\chi_d$ norms (``norms="chi"``) or $\sqrt d$ (``norms="fixed"``, biased: estimates SMREG); unbiased: yes (chi)
- ``structured``: construction: SORF: rows of $\sqrt p\, H D_1 H D_2 H D_3$ (fast Walsh–Hadamard); unbiased: no (small bias)
- ``qmc``: construction: scrambled Sobol'/Halton points through $\Phi^{-1}$; unbiased: yes
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
"""

from __future__ import annotations

import functools
import math
import warnings
from collections.abc import Callable

import numpy as np
import torch
from torch import nn

from ._validation import as_batch_shape, check_positive_int

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
    if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)):
        raise TypeError(f"seed must be an int or None, got {seed!r}")
    g = torch.Generator(device="cpu")
    g.manual_seed(int(seed))
    return g


def fwht(x: torch.Tensor) -> torch.Tensor:
    r"""Unnormalised fast Walsh–Hadamard transform over the last dimension.

    Computes $x H_p$ with $H_p$ the Sylvester–Hadamard matrix (entries $\pm 1$),
    in $O(p \log p)$ for ``p = x.shape[-1]`` a power of two.

    Parameters
    ----------
    x : Tensor, shape (..., p)

    Returns
    -------
    Tensor, shape (..., p)

    Examples
    --------
    >>> fwht(torch.tensor([1.0, 0.0, 0.0, 0.0]))
    tensor([1., 1., 1., 1.])
    """
    p = x.shape[-1]
    if p & (p - 1):
        raise ValueError(f"fwht needs a power-of-two last dimension, got {p}")
    lead = x.shape[:-1]
    h = 1
    while h < p:
        y = x.reshape(*lead, p // (2 * h), 2, h)
        a, b = y[..., 0, :], y[..., 1, :]
        x = torch.stack((a + b, a - b), dim=-2).reshape(*lead, p)
        h *= 2
    return x


class Projection(nn.Module):
    r"""A (batch of) projection(s) $W$ of shape ``(*batch_shape, r, d)``.

    ``forward(x)`` returns $x W^\top$, shape ``(*broadcast(x.shape[:-2], batch_shape), n, r)``.
    """

    num_features: int
    dim: int
    batch_shape: tuple[int, ...]

    @property
    def weight(self) -> torch.Tensor:  # pragma: no cover - abstract
        """The dense projection $W$, shape ``(*batch_shape, r, d)``."""
        raise NotImplementedError

    def project_into(self, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """Write $xW^\\top$ into ``out`` (shape (..., n, r), possibly a strided view); return ``out``."""
        return out.copy_(self(x))

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
            u = u.add_(b) if inplace and u.shape == torch.broadcast_shapes(u.shape, b.shape) else u + b
        return u


class DenseProjection(Projection):
    """A materialised projection; ``weight`` is a buffer (moves with ``.to()``, saved in ``state_dict``).

    Parameters
    ----------
    weight : Tensor, shape (*batch_shape, r, d)
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

    def project_into(self, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """Write x W^T into ``out`` (a GEMM with a strided output when shapes allow)."""
        W = self._weight.to(x.dtype)
        if x.shape[:-2] == out.shape[:-2] and W.dim() == 2 and not torch.compiler.is_compiling():
            # (an out= into a strided slice breaks torch.compile's graph: copy there instead)
            return torch.matmul(x, W.mT, out=out)
        return out.copy_(self(x))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x W^T: x (..., n, d) -> (*broadcast(..., batch_shape), n, r)."""
        W = self._weight.to(x.dtype)
        if W.dim() > 2 and x[..., 0, 0].numel() == 1:
            # Many draws, one input (the Monte Carlo layout): one (S r, d) x (d, n) GEMM instead of
            # S tiny batched products.
            n, d = x.shape[-2:]
            lead = torch.broadcast_shapes(x.shape[:-2], W.shape[:-2])
            u = torch.matmul(W.reshape(-1, d), x.reshape(n, d).mT)  # (S r, n)
            return u.reshape(*W.shape[:-2], W.shape[-2], n).mT.reshape(*lead, n, W.shape[-2])
        return torch.matmul(x, W.mT)


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
    """

    signs: torch.Tensor

    def __init__(self, signs: torch.Tensor, dim: int, num_features: int) -> None:
        super().__init__()
        self.register_buffer("signs", signs)
        self.dim = int(dim)
        self.num_features = int(num_features)
        self.batch_shape = tuple(signs.shape[:-3])
        self.padded_dim = int(signs.shape[-1])

    def _apply_transform(self, x: torch.Tensor) -> torch.Tensor:
        """x W^T by three FWHTs: x (..., n, d) -> (*broadcast(..., batch_shape), n, r)."""
        p = self.padded_dim
        if x.shape[-1] < p:
            x = torch.nn.functional.pad(x, (0, p - x.shape[-1]))
        s = self.signs.to(x.dtype).unsqueeze(-4)  # (*B, 1, nb, 3, p) against x (..., n, 1, p)
        y = x.unsqueeze(-2) * s[..., 2, :]
        y = fwht(y) * s[..., 1, :]
        y = fwht(y) * s[..., 0, :]
        y = fwht(y) / p  # sqrt(p) * (H_p / sqrt(p))^3 = H_p^3 / p
        y = y.reshape(*y.shape[:-2], -1)
        return y[..., : self.num_features]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x W^T without forming W: x (..., n, d) -> (*broadcast(..., batch_shape), n, r)."""
        return self._apply_transform(x)

    @property
    def weight(self) -> torch.Tensor:
        """The materialised $W$, shape ``(*batch_shape, r, d)`` (built on demand)."""
        eye = torch.eye(self.padded_dim, dtype=self.signs.dtype, device=self.signs.device)
        cols = self(eye)  # (*B, p, r): row j is W e_j
        return cols.mT[..., : self.dim].contiguous()


class Sampler:
    """Base class of projection samplers.

    Subclasses implement `sample`, returning a `Projection` of shape
    ``(*batch_shape, r, d)`` in float64 on CPU.
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

    ``t_1..t_r`` are the first ``r`` points of a scrambled Sobol' (``method="sobol"``) or Halton
    sequence from `scipy.stats.qmc`, one independent scrambling per batch element. Scrambling
    makes each point uniform on $[0,1)^d$, so each row is marginally $\mathcal N(0, I_d)$
    and the estimators stay unbiased; rows are negatively dependent (low discrepancy). No
    closed-form variance is claimed (use `kernelapprox.montecarlo`).

    Parameters
    ----------
    method : {"sobol", "halton"}, default "sobol"
    randomization : {"scramble", "shift"}, default "scramble"
        ``"scramble"``: an independently scrambled sequence per batch element (Owen-type
        scrambling from scipy; about 1 ms per draw, a Python loop over draws *at sampling time*).
        ``"shift"``: the unscrambled sequence plus an independent uniform shift modulo 1 per batch
        element (Cranley–Patterson rotation), vectorised — for very many Monte Carlo draws. Both
        make every row marginally $\mathcal N(0, I_d)$, and draws are independent.
    """

    name = "qmc"
    label = "QMC"

    def __init__(self, method: str = "sobol", randomization: str = "scramble") -> None:
        if method not in ("sobol", "halton"):
            raise ValueError(f"method must be 'sobol' or 'halton', got {method!r}")
        if randomization not in ("scramble", "shift"):
            raise ValueError(f"randomization must be 'scramble' or 'shift', got {randomization!r}")
        self.method = method
        self.randomization = randomization

    def __repr__(self) -> str:
        return f"QMCSampler(method={self.method!r}, randomization={self.randomization!r})"

    def _engine(self, d: int, scramble: bool, rng=None):
        from scipy.stats import qmc  # imported here: scipy.stats costs ~0.4-1 s at import

        cls = qmc.Sobol if self.method == "sobol" else qmc.Halton
        return cls(d, scramble=scramble, rng=rng)

    def sample(self, num_features, dim, *, batch_shape=(), generator):
        r = check_positive_int("num_features", num_features)
        d = check_positive_int("dim", dim)
        B = as_batch_shape(batch_shape)
        count = math.prod(B)
        eps = np.finfo(np.float64).eps
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)  # Sobol' balance warning for r != 2^m
            if self.randomization == "shift":
                base = torch.from_numpy(self._engine(d, scramble=False).random(r))
                shift = torch.rand(count, 1, d, generator=generator, dtype=torch.float64, device="cpu")
                pts = torch.remainder(base + shift, 1.0)
            else:
                seeds = torch.randint(0, 2**62, (count,), generator=generator, device="cpu").tolist()
                arr = np.empty((count, r, d))
                for i, s in enumerate(seeds):
                    arr[i] = self._engine(d, scramble=True, rng=np.random.default_rng(s)).random(r)
                pts = torch.from_numpy(arr)
        out = torch.special.ndtri(pts.clamp(eps, 1 - eps))
        return DenseProjection(out.reshape(*B, r, d).contiguous())


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
    """

    name = "given"
    label = "given"
    unbiased = False

    def sample(self, num_features, dim, *, batch_shape=(), generator):
        raise ValueError(
            "this feature map was built from a given projection; pass sampler=... to "
            "from_projection (or to redraw) to draw new projections"
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
