r"""Dense-exponential positive random features: OPRF (FAVOR++) and FAVOR# (SADERF, SDERF).

All three generalise FAVOR+ (`kernelapprox.PositiveRF`) by a quadratic term in the
projection $\omega \sim \mathcal N(0, I_d)$, chosen from the data to minimise the variance,
and stay **unbiased** for $e^{x^\top y}$ for every admissible choice:

- ``OptimalPositiveRF``: $\varphi(x)$ (query side; keys: see each class): $\frac{D}{\sqrt r} e^{A\|\omega_i\|^2 + \sqrt{1-4A}\,\omega_i^\top x - \|x\|^2/2}$, $D=(1-4A)^{d/4}$; fitted: scalar $A$
- ``SADERF``: $\varphi(x)$ (query side; keys: see each class): OPRF on $\Psi x$ (queries) and $\Psi^{-1} y$ (keys), $\Psi$ diagonal; fitted: $\Psi, A$
- ``SDERF``: $\varphi(x)$ (query side; keys: see each class): $\frac{D}{\sqrt r} e^{\omega_i^\top \mathrm{diag}(A)\omega_i + \omega_i^\top B x - \|x\|^2/2}$, $B = \mathrm{diag}(\sqrt{1-4A_l})Q^\top$; fitted: $Q, A_l$

Unbiasedness (GERF family, [LCD22]_ Thm 3.1, re-derived in ``docs/stronger-estimators.md``): for
$\omega\sim\mathcal N(0,I)$ and $1 - 4A > 0$,
$E\,e^{2A\|\omega\|^2 + B\omega^\top z} = (1-4A)^{-d/2} e^{B^2\|z\|^2/(2(1-4A))}$, so with
$B^2 = 1-4A$ and $D^2 = (1-4A)^{d/2}$, $E\,\varphi(x)^\top\varphi(y) = e^{-(\|x\|^2
+\|y\|^2)/2} e^{\|x+y\|^2/2} = e^{x^\top y}$. The variance is finite for $A < 1/8$.

Fitting (``fit(q, k)``, in place, statistics detached from autograd as in the reference code):
the parameters minimise the *pair-averaged log second moment* $\frac1{nm}\sum_{ij}\log
E\hat K_{ij}^2$ [LCD22]_ [LCD23]_, which depends on the data only through

* OPRF: $\bar t = \overline{\|x\|^2} + \overline{\|y\|^2} + 2\bar x^\top\bar y$ (the mean of
  $\|x_i + y_j\|^2$ over all pairs), giving
  $A^* = \frac{d - 2\bar t - \sqrt{(2\bar t + d)^2 + 8d\bar t}}{16d} \le 0$;
* SADERF: $\Psi^*_{ll} = \big(\overline{y_l^2}/\overline{x_l^2}\big)^{1/4}$ (it minimises
  $\bar t$ of the scaled data, since $(\Psi x)^\top(\Psi^{-1}y) = x^\top y$), then
  $A^*$ on the scaled data. The reference implementation (``exparf_`` in
  google-research ``imp/max``) applies the reciprocal $(\overline{x_l^2}/\overline{y_l^2})^{1/4}$,
  which never lowers $\bar t$ and raises it whenever the per-dimension energies differ:
  ``scaling="reciprocal"`` reproduces it for comparison;
* SDERF: $P = M_x + M_y + \mu_x\mu_y^\top + \mu_y\mu_x^\top$ (the pair average of
  $(x+y)(x+y)^\top$, $M$ second moments, $\mu$ means),
  $P = Q\,\mathrm{diag}(\sigma)Q^\top$, and per direction the one-dimensional
  $A_l = A^*(\bar t = \sigma_l, d = 1)$; $D = \prod_l(1-4A_l)^{1/4}$ is kept (the reference
  ``expsharp_`` drops it: harmless after attention normalisation, a bias $D^{-2}$ of the
  raw kernel). The eigenbasis is optimal because the per-direction optimum is a concave function
  of $\sigma_l$ (a minimum of affine functions), and diagonals are majorised by eigenvalues.

Before ``fit`` (or with ``A=0``) every map here is FAVOR+. The maps are data-dependent: fitting
on a batch and estimating on it (``ka.linear_attention(..., fit=True)``) is what the FAVOR++ code
does per batch; the estimate is then unbiased conditionally on the fitted parameters.

Cost: OPRF and SADERF as FAVOR+ plus $O(nd)$; SDERF folds $B$ into the projection
($W\,\mathrm{diag}(\sqrt{1-4A})Q^\top$, $O(rd^2)$ per fitted batch) so the per-token
cost is FAVOR+'s; its fit is one ``eigh`` of a $d\times d$ matrix per batch element.

References
----------
- [LCD22] V. Likhosherstov, K. Choromanski, A. Dubey, F. Liu, T. Sarlos, A. Weller. "Chefs' Random
   Tables: Non-Trigonometric Random Features", NeurIPS 2022, arXiv:2205.15317.
- [LCD23] V. Likhosherstov, K. Choromanski, A. Dubey, F. Liu, T. Sarlos, A. Weller.
   "Dense-Exponential Random Features: Sharp Positive Estimators of the Gaussian Kernel",
   NeurIPS 2023, arXiv:2302.00787 (first titled "FAVOR#").
"""

from __future__ import annotations

import math
import warnings

import torch

from .._logdomain import LOG2E, _exp_shifted, _gemm, _grad, _log2e_operands, _mean_stats, _sqnorm_half
from .._validation import broadcast_shapes, check_floating, check_last_dim
from ..registry import register_estimator
from .base import RandomFeatureMap

__all__ = ["OptimalPositiveRF", "SADERF", "SDERF", "optimal_A"]


def optimal_A(t: torch.Tensor | float, dim: int) -> torch.Tensor:
    r"""The variance-optimal OPRF parameter $A^*(t, d)$ [LCD22]_.

    $$
    A^* = \frac{d - 2t - \sqrt{(2t + d)^2 + 8dt}}{16 d} \in (-\infty, 0],
    $$

    the admissible root of $16dA^2 + (4t - 2d)A - t = 0$, which minimises the second moment
    of one OPRF term at $t = \|x + y\|^2$ (and, with $t = \bar t$, the pair-averaged
    log second moment). $A^*(0) = 0$ (FAVOR+); $A^* \to -\infty$ as $t\to\infty$.

    Parameters
    ----------
    t : Tensor or float, any shape, >= 0
    dim : int
        ``d``.

    Returns
    -------
    Tensor, float64, shape of ``t``.

    Examples
    --------
    >>> round(float(optimal_A(1.0, 1)), 6)  # (1 - 2 - sqrt(17)) / 16
    -0.320194
    """
    t = torch.as_tensor(t, dtype=torch.float64)
    if t.device.type != "meta" and (bool((t < 0).any()) or not bool(torch.isfinite(t).all())):
        raise ValueError("t must be finite and >= 0")
    d = float(dim)
    # (d - 2t - sqrt((2t+d)^2 + 8dt)) / (16 d), written without cancellation:
    # d - 2t - S = ((d - 2t)^2 - S^2) / (d - 2t + S) = -16 d t / (d - 2t + S)
    S = torch.sqrt((2 * t + d) ** 2 + 8 * d * t)
    return -t / (d - 2 * t + S)


def _check_qk(fm: RandomFeatureMap, q: object, k: object) -> tuple[torch.Tensor, torch.Tensor]:
    """Validated, detached q and k in at least float32 (no copy for float32/float64 inputs).

    ``meta`` tensors are accepted: a fit on them sets the fitted statistics' shapes (a model built
    on the ``meta`` device), without values."""
    q = check_floating("q", q)
    k = check_floating("k", k)
    check_last_dim("q", q, fm.dim)
    check_last_dim("k", k, fm.dim)
    dev = next(iter(fm.projection.buffers())).device
    for name, t in (("q", q), ("k", k)):
        if (t.device.type == "meta") != (dev.type == "meta"):
            raise ValueError(f"fit needs {name} on the map's device ({dev}), got {name} on {t.device} "
                             "(a map built on the meta device fits meta tensors; move the map or the data)")
    if q.shape[-2] == 0 or k.shape[-2] == 0:
        raise ValueError(f"fit needs at least one query and one key, got q {tuple(q.shape)}, k {tuple(k.shape)}")
    try:
        broadcast_shapes(q.shape[:-2], k.shape[:-2])
    except RuntimeError:
        raise ValueError(
            f"leading dimensions of q {tuple(q.shape[:-2])} and k {tuple(k.shape[:-2])} do not broadcast"
        ) from None
    dt = torch.promote_types(torch.promote_types(q.dtype, k.dtype), torch.float32)
    return q.detach().to(dt), k.detach().to(dt)


def _finite(name: str, **stats: tuple[torch.Tensor, ...]) -> None:
    # Statistics are sums over the data: any NaN or Inf in q or k shows here, at O(d) cost
    # instead of a pass over the inputs. ``stats`` maps each argument to the statistics of it.
    # Under torch.compile the check is skipped: it needs a host read (a graph break per call);
    # on ``meta`` tensors (shapes without values) there is nothing to read.
    if torch.compiler.is_compiling() or any(t.device.type == "meta" for ts in stats.values() for t in ts):
        return
    for arg, ts in stats.items():
        if not all(bool(torch.isfinite(t).all()) for t in ts):
            raise ValueError(
                f"{name}.fit needs finite {arg}, got {arg} with a NaN or Inf entry "
                "(a non-finite statistic would poison every feature)"
            )


def _t_bar(name: str, q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """Mean of |q_i + k_j|^2 over all pairs, float64, shape broadcast(q lead, k lead).

    Non-negative (clamped at 0: its exact value is 0 when, e.g., k = -q for one token, and
    rounding of the three terms may leave about -1e-17 there). ``ValueError`` naming ``q`` or
    ``k`` if either holds a non-finite entry."""
    nq, nk, cross = _mean_stats(q, k)
    _finite(name, q=(nq,), k=(nk,))
    return (nq + nk + 2.0 * cross).clamp_min(0.0)


class _DenseExponentialRF(RandomFeatureMap):
    """Shared machinery: log features u + c with u = x W_eff^T + a (``a`` per feature) and
    c = -|x'|^2 / 2 + log D - log(r) / 2 (per row), stabilised by ``_exp_shifted``.

    Subclasses give ``_weights(xc, key) -> (W_eff (*lead, r, d), a (*lead, r), c (..., n) float64)``
    in the compute dtype; ``u`` is one GEMM plus one in-place pass for ``a`` (folding ``a`` into the
    GEMM through a column of ones was measured slower: ``K = d + 1`` breaks the GEMM's alignment).
    """

    positive = True
    data_dependent = True
    #: The fitted statistics: persistent float64 buffers (see `_fitted_buffers`).
    _fitted_names: tuple[str, ...] = ()
    fitted_: torch.Tensor

    def _fitted_buffers(self, **init: torch.Tensor) -> None:
        r"""Register the fitted statistics (and the flag ``fitted_``) as persistent buffers.

        So ``state_dict()`` holds them, ``.to(device)`` moves them and ``load_state_dict``
        restores the fit. Their shapes follow the data they were fitted on (the broadcast leading
        dimensions of ``q`` and ``k``), so loading takes the shapes of the state dict; they stay
        float64 under ``.to(dtype)`` / ``.half()`` (the parameters of the estimator, not
        activations), and only move with the device."""
        dev = self._ref().device
        for name, t in init.items():
            self.register_buffer(name, t.to(device=dev, dtype=torch.float64))
        self.register_buffer("fitted_", torch.tensor(False, device=dev))
        #: the host's copy of ``fitted_`` (set by `fit` and by loading), so that reading
        #: `fitted` never synchronises a device
        self._fitted_host = False
        self._fitted_names = tuple(init)

    @property
    def fitted(self) -> bool:
        """Whether the parameters were chosen from data by `fit` (``False``: FAVOR+).

        The fit travels with the map: ``state_dict()`` holds the fitted statistics (float64
        buffers, of the shape of the data fitted on) and this flag, so loading it into a map
        built the same way restores the fit (``torch.load(..., weights_only=True)`` suffices).

        Examples
        --------
        >>> import torch, kernelapprox as ka
        >>> x = torch.randn(2, 50, 8) / 2
        >>> fm = ka.SDERF(8, 16, seed=0).fit(x, x)
        >>> fresh = ka.SDERF(8, 16, seed=1)
        >>> _ = fresh.load_state_dict(fm.state_dict())
        >>> fresh.fitted, fresh.Q_.shape, bool(torch.equal(fresh(x), fm(x)))
        (True, torch.Size([2, 8, 8]), True)
        """
        return self._fitted_host

    def _ref(self) -> torch.Tensor:
        return next(iter(self.projection.buffers()))

    @property
    def param_dtype(self) -> torch.dtype | None:
        """Dtype of the projection (the float64 fitted statistics do not set the compute dtype)."""
        return self._ref().dtype

    def _apply(self, fn, recurse=True):
        # keep the fitted statistics float64 under a dtype cast; follow device moves
        own = {id(self._buffers[n]) for n in self._fitted_names if self._buffers.get(n) is not None}

        def keep64(t: torch.Tensor) -> torch.Tensor:
            out = fn(t)
            if id(t) in own and out.dtype != torch.float64:
                out = t.to(device=out.device)
            return out

        return super()._apply(keep64, recurse)

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys,
                              unexpected_keys, error_msgs):
        # a fit sets shapes from the data: take those of the state dict (values copied by torch)
        for name in self._fitted_names:
            t, cur = state_dict.get(prefix + name), self._buffers.get(name)
            if isinstance(t, torch.Tensor) and cur is not None and t.shape != cur.shape:
                self._buffers[name] = torch.empty(t.shape, dtype=torch.float64, device=self._ref().device)
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys,
                                      unexpected_keys, error_msgs)
        flag = state_dict.get(prefix + "fitted_")
        if isinstance(flag, torch.Tensor) and flag.device.type != "meta":
            self._fitted_host = bool(flag)  # loading may sync; `fitted` then reads the host copy

    def _weights(
        self, xc: torch.Tensor, key: bool, low: bool = False
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # pragma: no cover
        raise NotImplementedError

    @staticmethod
    def _affine(
        xc: torch.Tensor, W: torch.Tensor, a: torch.Tensor, row: torch.Tensor | None = None,
        gemm: torch.dtype | None = None,
    ) -> torch.Tensor:
        """x W^T + a (+ row): (..., n, d) x (*lead, r, d) -> (*broadcast, n, r); in place on the
        GEMM output without autograd (one pass per term, as FAVOR+'s row bias). ``gemm``: the
        dtype of the GEMM operands (`kernelapprox.backends.gemm_dtype`)."""
        u = torch.matmul(xc, W.mT) if gemm is None or gemm == xc.dtype else _gemm(W, xc, gemm)
        inplace = not _grad(u)
        terms = [a.unsqueeze(-2)] + ([] if row is None else [row.to(u.dtype).unsqueeze(-1)])
        for t in terms:
            u = u.add_(t) if inplace and u.shape == broadcast_shapes(u.shape, t.shape) else u + t
        return u

    @classmethod
    def _affine2(
        cls, xc: torch.Tensor, W: torch.Tensor, a: torch.Tensor, row: torch.Tensor | None = None,
        gemm: torch.dtype | None = None,
    ) -> torch.Tensor:
        """`_affine` times ``LOG2E`` (base-2 exponents for ``exp2``): the factor scales the smaller
        of ``W`` and ``xc`` (as `kernelapprox._logdomain._project2`), and the vectors ``a``, ``row``."""
        if gemm is not None and gemm != xc.dtype:
            # 16-bit operands: the factor on the float32 output (a scaled W would round again)
            u = cls._affine(xc, W, a, row, gemm)
            return u * LOG2E if _grad(u) else u.mul_(LOG2E)
        W, xc = _log2e_operands(W, xc)
        return cls._affine(xc, W, a * LOG2E, None if row is None else row * LOG2E, gemm)

    def _weights_g(self, xc: torch.Tensor, key: bool, gemm: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """`_weights`, with the row term ``c`` float32 and computed without a GEMM under the
        accelerator policy (``gemm`` 16-bit)."""
        low = gemm != xc.dtype
        W, a, c = self._weights(xc, key, low)
        return W, a, (c.to(torch.float32) if low else c)

    def _log_features(self, x: torch.Tensor, shared: bool, key: bool) -> tuple[torch.Tensor, torch.Tensor]:
        fast = self._fused(x, shared, key)
        if fast is not None:
            return fast
        xc, out_dtype, g = self._prepare_gemm("x", x)
        W, a, c = self._weights_g(xc, key, g)
        u = self._affine2(xc, W, a, gemm=g)  # base-2 exponents (_logdomain.LOG2E: exp2 is faster)
        with torch.no_grad():
            m = u.amax(dim=-1)
        if c.shape != m.shape:
            c = c.expand(broadcast_shapes(c.shape, m.shape))
            if m.shape != c.shape:
                m = m.expand(c.shape)
                u = u.expand(*c.shape, u.shape[-1])
                if not _grad(u):
                    u = u.contiguous()
        f, ls = _exp_shifted(u, m, c, shared, base2=True)
        return self._policy_out(f, ls, out_dtype, g)

    def _plain(self, x: torch.Tensor, key: bool) -> torch.Tensor:
        fast = self._fused(x, key=key, plain=True)
        if fast is not None:
            return fast
        xc, out_dtype, g = self._prepare_gemm("x", x)
        W, a, c = self._weights_g(xc, key, g)
        u = self._affine2(xc, W, a, c, gemm=g)
        return (torch.exp2(u) if _grad(u) else u.exp2_()).to(out_dtype)

    def log_features(self, x, shared=False):
        return self._log_features(x, shared, key=False)

    def key_log_features(self, x, shared=False):
        return self._log_features(x, shared, key=True)

    def query_log2_features(self, x):
        if type(self).log_features is not _DenseExponentialRF.log_features:
            return None
        xc, _, g = self._prepare_gemm("x", x)
        W, a, _ = self._weights_g(xc, False, g)
        return self._affine2(xc, W, a, gemm=g)  # the row term c cancels with the shift

    def key_log2_features(self, x):
        if type(self).key_log_features is not _DenseExponentialRF.key_log_features:
            return None
        xc, _, g = self._prepare_gemm("x", x)
        W, a, c = self._weights_g(xc, True, g)
        return self._affine2(xc, W, a, c, gemm=g)

    def forward(self, x):
        return self._plain(x, key=False)

    def key_features(self, x):
        return self._plain(x, key=True)


def _fitted(t: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """A fitted float64 statistic on the device of ``like``."""
    return t.to(device=like.device)


def _check_fitted_batch(fm: RandomFeatureMap, xc: torch.Tensor, fitted_batch: torch.Size) -> None:
    """``ValueError`` unless the input's leading dimensions broadcast with those `fit` saw; a
    ``UserWarning`` (once per map, as `NystromFeatures`) when the map is used before `fit`."""
    # once per map (reading the flag may synchronise a device); not inside torch.compile
    if not torch.compiler.is_compiling() and not getattr(fm, "_fit_checked", False):
        fm.__dict__["_fit_checked"] = True  # a plain attribute (not state): once per map object
        if not fm.fitted:
            name = type(fm).__name__
            warnings.warn(
                f"{name} used before fit(q, k): its parameters are the data-free defaults (A = 0, no "
                f"rotation or scaling: FAVOR+, PositiveRF's estimator). Call fm.fit(q, k) (or "
                f"linear_attention(..., fit=True)) to choose them from the data"
                + (", or pass A=<float>" if name == "OptimalPositiveRF" else "") + ".",
                UserWarning, stacklevel=8,
            )
    try:
        broadcast_shapes(xc.shape[:-2], fitted_batch)
    except RuntimeError:
        raise ValueError(
            f"x has leading dimensions {tuple(xc.shape[:-2])} which do not broadcast with the batch "
            f"shape {tuple(fitted_batch)} that {type(fm).__name__}.fit saw (refit on data of this "
            "batch shape, or apply the map to inputs of the fitted one)"
        ) from None


class OptimalPositiveRF(_DenseExponentialRF):
    r"""Optimal positive random features, OPRF / FAVOR++ [LCD22]_.

    $$
    \varphi(x) = \frac{D}{\sqrt r}\Big[e^{A\|\omega_i\|^2 + \sqrt{1-4A}\,\omega_i^\top x
    - \|x\|^2/2}\Big]_{i=1}^r,\qquad D = (1-4A)^{d/4},\qquad
    \mathbb E\,\varphi(x)^\top\varphi(y) = e^{x^\top y}.
    $$

    ``A = 0`` is FAVOR+ (`kernelapprox.PositiveRF`). For $A < 0$ the features are
    bounded in $\omega$. Variance of one term (iid rows), with $t = \|x+y\|^2$:

    $$
    \mathrm{Var} = e^{-\|x\|^2-\|y\|^2}\Big[(1-4A)^d(1-8A)^{-d/2}
    e^{\frac{2(1-4A)t}{1-8A}} - e^t\Big]
    $$

    (`kernelapprox.theory.oprf_mse`, iid and block-orthogonal rows), minimised at
    $A^*(t)$ (`optimal_A`). ``feature_dim = r``.

    Parameters
    ----------
    dim, num_features
        ``d`` and ``r``.
    A : float, optional
        A fixed parameter, ``A < 1/8`` (finite variance; unbiased for ``A < 1/4``). ``None``
        (default): chosen from data by `fit`, with $A^*(\bar t)$ per batch element
        (the FAVOR++ rule); FAVOR+ (``A = 0``) until fitted.
    **kwargs
        As `kernelapprox.RandomFeatureMap` (``sampler``, ``seed``, ``generator``,
        ``batch_shape``, ``device``, ``dtype``). ``sampler="orthogonal"`` (χ norms) keeps the
        estimator unbiased and lowers its variance (FAVOR++ = OPRF + ORF).

    Attributes
    ----------
    A_ : Tensor, float64, shape ``batch`` of the data last fitted on (``()`` for a float ``A``)
        The parameter in use.

    Examples
    --------
    >>> import torch, kernelapprox as ka
    >>> q, k = torch.randn(2, 8, 100, 64).unbind(0)
    >>> fm = ka.OptimalPositiveRF(64, 256, sampler="orthogonal", seed=0).fit(q / 8**0.5, k / 8**0.5)
    >>> fm.A_.shape, bool((fm.A_ < 0).all())
    (torch.Size([8]), True)
    >>> ka.linear_attention(q / 8**0.5, k / 8**0.5, torch.randn(8, 100, 16), fm).shape
    torch.Size([8, 100, 16])
    """

    def __init__(self, dim: int, num_features: int, *, A: float | None = None, **kwargs) -> None:
        if A is not None:
            if isinstance(A, bool) or not isinstance(A, (int, float)) or not math.isfinite(A):
                raise TypeError(f"A must be a finite float or None, got {A!r}")
            if A >= 0.125:
                raise ValueError(f"A must be < 1/8 (finite variance; unbiased needs 1 - 4A > 0), got {A}")
        super().__init__(dim, num_features, **kwargs)
        self.A = None if A is None else float(A)
        self._fitted_buffers(A_=torch.tensor(0.0 if A is None else float(A), dtype=torch.float64))

    @property
    def fitted(self) -> bool:
        """Whether `A_` was chosen from data (always true for a fixed ``A``)."""
        return self.A is not None or self._fitted_host

    def fit(self, q: torch.Tensor, k: torch.Tensor) -> OptimalPositiveRF:
        r"""Set $A = A^*(\bar t)$ per batch element from queries and keys (no-op for a fixed ``A``).

        Parameters
        ----------
        q : Tensor, shape (..., n, d)
        k : Tensor, shape (..., m, d)
            Leading dimensions broadcast; `A_` gets their broadcast shape.

        Returns
        -------
        self
        """
        qd, kd = _check_qk(self, q, k)
        tb = _t_bar(type(self).__name__, qd, kd)  # validates q and k also for a fixed A
        if self.A is None:
            self.A_ = optimal_A(tb, self.dim)
            self.fitted_.fill_(True)
            self._fitted_host = True
        return self

    def _weights(self, xc, key, low=False):
        _check_fitted_batch(self, xc, self.A_.shape)
        A = _fitted(self.A_, xc)  # (*fb) float64
        W = self.weight.to(xc.dtype)  # (*bs, r, d)
        one4 = 1.0 - 4.0 * A
        wn2 = torch.einsum("...rd,...rd->...r", W, W)  # (*bs, r)
        Weff = W * torch.sqrt(one4).to(xc.dtype)[..., None, None]
        a = A.to(xc.dtype)[..., None] * wn2  # A |w_i|^2
        logc = 0.25 * self.dim * torch.log(one4) - 0.5 * math.log(self.num_features)
        return Weff, a, -_sqnorm_half(xc, low) + logc[..., None]

    def extra_repr(self) -> str:
        return super().extra_repr() + (f", A={self.A}" if self.A is not None else ", A=fitted")


register_estimator(
    OptimalPositiveRF, name="oprf", label="OPRF (FAVOR++)", feature_dim="r",
    theory="kernelapprox.theory.dense_exponential:OPRF_THEORY",
)


class SADERF(_DenseExponentialRF):
    r"""Simplified asymmetric dense-exponential random features, SADERF (FAVOR#) [LCD23]_.

    OPRF applied to $\Psi x$ for queries and $\Psi^{-1}y$ for keys, with
    $\Psi = \mathrm{diag}(\psi)$ and OPRF's scalar $A$ (`OptimalPositiveRF`):

    $$
    \varphi(x) = f_{A}(\Psi x),\quad \psi(y) = f_{A}(\Psi^{-1}y),\qquad
    (\Psi x)^\top(\Psi^{-1}y) = x^\top y,
    $$

    so every $\Psi$ and $A < 1/8$ give an unbiased estimator. `fit` sets the
    variance-optimal $\psi_l = (\overline{y_l^2}/\overline{x_l^2})^{1/4}$, then
    $A^*$ on the scaled data; the objective (pair-averaged log second moment) is then at
    most OPRF's, with equality iff the per-dimension energies of queries and keys agree.
    A dimension with zero energy on either side keeps $\psi_l = 1$.

    Parameters
    ----------
    dim, num_features
        ``d`` and ``r``.
    scaling : {"optimal", "reciprocal"}, default "optimal"
        ``"reciprocal"`` uses $\psi_l = (\overline{x_l^2}/\overline{y_l^2})^{1/4}$, the choice
        of the reference code (google-research ``imp/max`` ``exparf_``): still unbiased, but with a
        larger $\bar t$ than no scaling at all whenever the energies differ. For comparisons.
    **kwargs
        As `kernelapprox.RandomFeatureMap`.

    Attributes
    ----------
    psi_ : Tensor, float64, shape (*batch, d)
    A_ : Tensor, float64, shape (*batch)

    Examples
    --------
    >>> import torch, kernelapprox as ka
    >>> q = torch.randn(100, 16) * torch.linspace(0.1, 0.5, 16)
    >>> k = torch.randn(100, 16) * torch.linspace(0.5, 0.1, 16)
    >>> fm = ka.SADERF(16, 64, seed=0).fit(q, k)
    >>> fm.kernel(q, k).shape, bool(fm.psi_[0] > 1 > fm.psi_[-1])
    (torch.Size([100, 100]), True)
    """

    symmetric = False

    def __init__(self, dim: int, num_features: int, *, scaling: str = "optimal", **kwargs) -> None:
        if scaling not in ("optimal", "reciprocal"):
            raise ValueError(f"scaling must be 'optimal' or 'reciprocal', got {scaling!r}")
        super().__init__(dim, num_features, **kwargs)
        self.scaling = scaling
        self._fitted_buffers(
            psi_=torch.ones(self.dim, dtype=torch.float64), A_=torch.tensor(0.0, dtype=torch.float64)
        )

    def fit(self, q: torch.Tensor, k: torch.Tensor) -> SADERF:
        r"""Set $\Psi$ and $A$ from queries and keys (per batch element).

        Parameters
        ----------
        q : Tensor, shape (..., n, d)
        k : Tensor, shape (..., m, d)

        Returns
        -------
        self
        """
        qd, kd = _check_qk(self, q, k)
        # per-dimension energies (..., d), accumulated in the inputs' precision, then float64
        ex = torch.linalg.vector_norm(qd, dim=-2).double() ** 2 / qd.shape[-2]
        ey = torch.linalg.vector_norm(kd, dim=-2).double() ** 2 / kd.shape[-2]
        _finite(type(self).__name__, q=(ex,), k=(ey,))
        ok = (ex > 0) & (ey > 0)
        ratio = torch.where(ok, ey / torch.where(ok, ex, 1.0), 1.0)
        if self.scaling == "reciprocal":
            ratio = 1.0 / ratio
        psi = ratio ** 0.25
        lead = broadcast_shapes(qd.shape[:-2], kd.shape[:-2])
        psi = psi.expand(*lead, self.dim)
        self.psi_ = psi.contiguous()
        # t_bar of (Psi q, Psi^-1 k) from the statistics: sum_l psi_l^2 E x_l^2 + E y_l^2 / psi_l^2
        # + 2 mean(x) . mean(y) (the cross term is invariant)
        cross = (qd.mean(-2).double() * kd.mean(-2).double()).sum(-1)
        tb = (psi * psi * ex).sum(-1) + (ey / (psi * psi)).sum(-1) + 2.0 * cross
        # >= 0 exactly (a mean of |Psi q_i + Psi^-1 k_j|^2); rounding can leave -1e-17 at k = -q
        self.A_ = optimal_A(tb.clamp_min(0.0), self.dim)
        self.fitted_.fill_(True)
        self._fitted_host = True
        return self

    def _weights(self, xc, key, low=False):
        _check_fitted_batch(self, xc, self.A_.shape)
        A = _fitted(self.A_, xc)  # (*fb)
        psi = _fitted(self.psi_, xc)  # (*fb, d)
        scale = 1.0 / psi if key else psi
        W = self.weight.to(xc.dtype)
        one4 = 1.0 - 4.0 * A
        wn2 = torch.einsum("...rd,...rd->...r", W, W)
        Weff = W * (scale * torch.sqrt(one4)[..., None]).to(xc.dtype).unsqueeze(-2)  # (*lead, r, d)
        a = A.to(xc.dtype)[..., None] * wn2
        # |Psi x|^2 / 2, accumulated in the compute dtype, returned in float64 (as _sqnorm_half)
        s2 = (scale * scale).to(xc.dtype)
        if low:  # float32, without a GEMM (accelerator policy)
            half = 0.5 * (xc * xc * s2.unsqueeze(-2)).sum(-1)
        else:
            half = 0.5 * torch.matmul(xc * xc, s2.unsqueeze(-1)).squeeze(-1).double()
        logc = 0.25 * self.dim * torch.log(one4) - 0.5 * math.log(self.num_features)
        return Weff, a, -half + logc[..., None]


register_estimator(
    SADERF, name="saderf", label="SADERF (FAVOR#)", feature_dim="r",
    theory="kernelapprox.theory.dense_exponential:SADERF_THEORY",
)


class SDERF(_DenseExponentialRF):
    r"""Symmetric dense-exponential random features, SDERF (FAVOR#) [LCD23]_.

    $$
    \varphi(x) = \frac{D}{\sqrt r}\Big[e^{\omega_i^\top\mathrm{diag}(A)\,\omega_i
    + \omega_i^\top B x - \|x\|^2/2}\Big]_i,\qquad B = \mathrm{diag}(\sqrt{1 - 4A_l})\,Q^\top,
    \qquad D = \prod_l (1-4A_l)^{1/4},
    $$

    with $Q$ orthogonal: $B^\top(I - 4\,\mathrm{diag}(A))^{-1}B = I$, so the estimator
    is unbiased for every $Q$ and $A_l < 1/8$. `fit` takes $Q$ from the
    eigendecomposition of $P = M_x + M_y + \mu_x\mu_y^\top + \mu_y\mu_x^\top$ and
    $A_l = A^*(\sigma_l, 1)$ per eigenvalue. Variance of one term (iid rows), with
    $z' = Q^\top(x + y)$:

    $$
    \mathrm{Var} = e^{-\|x\|^2-\|y\|^2}\Big[\prod_l \frac{1-4A_l}{\sqrt{1-8A_l}}
    e^{\frac{2(1-4A_l)}{1-8A_l} z_l'^2} - e^{\|z'\|^2}\Big]
    $$

    (`kernelapprox.theory.sderf_mse`). The constant $D$ matters for the raw kernel
    (the reference code omits it; attention's normalisation hides that). ``feature_dim = r``.

    Parameters are those of `kernelapprox.RandomFeatureMap`.

    Attributes
    ----------
    Q_ : Tensor, float64, shape (*batch, d, d)
    A_ : Tensor, float64, shape (*batch, d)

    Examples
    --------
    >>> import torch, kernelapprox as ka
    >>> x = torch.randn(64, 8) @ torch.randn(8, 8) / 4
    >>> fm = ka.SDERF(8, 32, seed=0).fit(x, x)
    >>> fm.Q_.shape, fm(x).shape
    (torch.Size([8, 8]), torch.Size([64, 32]))
    """

    def __init__(self, dim: int, num_features: int, **kwargs) -> None:
        super().__init__(dim, num_features, **kwargs)
        self._fitted_buffers(
            Q_=torch.eye(self.dim, dtype=torch.float64), A_=torch.zeros(self.dim, dtype=torch.float64)
        )

    def fit(self, q: torch.Tensor, k: torch.Tensor) -> SDERF:
        r"""Set $Q$ and $A_l$ from queries and keys (one ``eigh`` per batch element).

        Parameters
        ----------
        q : Tensor, shape (..., n, d)
        k : Tensor, shape (..., m, d)

        Returns
        -------
        self
        """
        qd, kd = _check_qk(self, q, k)
        mx, my = qd.mean(-2).double(), kd.mean(-2).double()  # (..., d)
        Mx = (qd.mT @ qd).double() / qd.shape[-2]  # second moments: d x d GEMMs in the input precision
        My = (kd.mT @ kd).double() / kd.shape[-2]
        _finite(type(self).__name__, q=(Mx,), k=(My,))
        cross = mx.unsqueeze(-1) * my.unsqueeze(-2)
        P = Mx + My + cross + cross.mT
        sigma, Q = torch.linalg.eigh(P)
        self.Q_ = Q.contiguous()  # eigh returns a column-major Q; a loaded buffer is row-major
        self.A_ = optimal_A(sigma.clamp_min(0.0), 1)
        self.fitted_.fill_(True)
        self._fitted_host = True
        return self

    def _weights(self, xc, key, low=False):
        _check_fitted_batch(self, xc, self.A_.shape[:-1])
        A = _fitted(self.A_, xc)  # (*fb, d)
        Q = _fitted(self.Q_, xc)  # (*fb, d, d)
        W = self.weight.to(torch.float64)  # (*bs, r, d)
        one4 = 1.0 - 4.0 * A
        # effective projection W diag(sqrt(1 - 4A)) Q^T and the quadratic term sum_l A_l w_il^2
        # (O(r d^2) per fitted batch element, in float64)
        Weff = ((W * torch.sqrt(one4).unsqueeze(-2)) @ Q.mT).to(xc.dtype)  # (*lead, r, d)
        a = ((W * W) @ A.unsqueeze(-1)).squeeze(-1).to(xc.dtype)  # (*lead, r)
        logc = 0.25 * torch.log(one4).sum(-1) - 0.5 * math.log(self.num_features)
        return Weff, a, -_sqnorm_half(xc, low) + logc[..., None]


register_estimator(
    SDERF, name="sderf", label="SDERF (FAVOR#)", feature_dim="r",
    theory="kernelapprox.theory.dense_exponential:SDERF_THEORY",
)
