r"""The contract of every feature map $\varphi:\mathbb R^d \to \mathbb R^F$ with
$\varphi(q)^\top\varphi(k) \approx \exp(q^\top k)$ (`FeatureMap`), and the base of the random maps,
which own a drawn projection (`RandomFeatureMap`). The estimators themselves live one family per
module in `kernelapprox.maps`; the built-in ones of [Cho21]_ and [Kat20]_:

Random maps hold a projection $W$ of shape ``(*batch_shape, r, d)`` whose rows are the
``r = num_features`` random projections $w_1..w_r$ (the Performer convention, used everywhere
in the library); ``feature_dim`` is the length of the output vector.

- ``TrigRF`` sincos: $\varphi(x)$: $e^{\|x\|^2/2} r^{-1/2} [\sin Wx, \cos Wx]$; feature_dim: 2r; unbiased: yes
- ``TrigRF`` offset: $\varphi(x)$: $e^{\|x\|^2/2} \sqrt{2/r}\, \cos(Wx + b)$, $b_i\sim U[0,2\pi)$; feature_dim: r; unbiased: yes
- ``PositiveRF``: $\varphi(x)$: $e^{-\|x\|^2/2} r^{-1/2} \exp(Wx)$ (FAVOR+); feature_dim: r; unbiased: yes
- ``HyperbolicRF``: $\varphi(x)$: $e^{-\|x\|^2/2} (2r)^{-1/2} [\exp(Wx), \exp(-Wx)]$; feature_dim: 2r; unbiased: yes
- ``EluFeatures``: $\varphi(x)$: $\mathrm{elu}(x) + 1$; feature_dim: d; unbiased: no
- ``ReluFeatures``: $\varphi(x)$: $\max(x, 0)$; feature_dim: d; unbiased: no

"Unbiased" holds for the ``gaussian``, ``orthogonal`` (chi norms) and ``qmc`` samplers; see
`kernelapprox.samplers`. Closed-form bias, variance and MSE live in `kernelapprox.theory`
under the same names (``positive_mse`` next to ``PositiveRF``, and so on).

Numerics. Every map also returns its features in a stabilised log-domain form,
``f, log_scale = fm.log_features(x)`` with $\varphi(x) = f\, e^{\text{log\_scale}}$, where
``f`` is bounded ($|f| \le 1$ for the random maps). `FeatureMap.kernel` and
`kernelapprox.linear_attention` work from this form, so the scale factors
$e^{\pm\|x\|^2/2}$ never overflow on their own. Inputs in bfloat16/float16 are computed in
float32; float64 stays float64.

References
----------
- [Cho21] K. Choromanski et al. "Rethinking Attention with Performers", ICLR 2021,
   arXiv:2009.14794 (Lemma 1, eq. 7: positive features; Lemma 2: MSEs; §2.4 hyperbolic).
- [RR07] A. Rahimi, B. Recht. "Random Features for Large-Scale Kernel Machines", NIPS 2007.
- [SS15] D. J. Sutherland, J. Schneider. "On the Error of Random Fourier Features", UAI 2015.
- [Kat20] A. Katharopoulos, A. Vyas, N. Pappas, F. Fleuret. "Transformers are RNNs", ICML 2020.
"""

from __future__ import annotations

import inspect
import math
from typing import TYPE_CHECKING, Any, ClassVar, cast

import torch
from torch import nn

from .. import backends
from .._validation import (
    as_batch_shape,
    broadcast_batch,
    broadcast_shapes,
    check_device,
    check_dtype,
    check_floating,
    check_last_dim,
    check_positive_int,
    compute_dtype,
    inputs_validated,
    no_autocast,
    validation_skipped,
)
from ..samplers import (
    DenseProjection,
    GivenSampler,
    Projection,
    Sampler,
    get_sampler,
    make_generator,
)

if TYPE_CHECKING:  # pragma: no cover
    from ..registry import Estimator

__all__ = ["FeatureMap", "RandomFeatureMap"]

_MISSING = object()


def _params_match(fm: object, params: Any) -> bool:
    """Whether ``fm``'s attributes equal the constructor ``params`` that select an estimator."""
    return all(getattr(fm, k, _MISSING) == v for k, v in params.items())


class FeatureMap(nn.Module):
    r"""Base class of feature maps $\varphi: \mathbb R^d \to \mathbb R^F$.

    A subclass implements `log_features` (and may override `forward` and
    `query_features` with faster direct paths), then registers its identity once with
    `kernelapprox.register_estimator`; attention, theory, Monte Carlo and the studies use only
    the public methods below and that identity.

    Dtypes (one rule for every entry point of the library). Computations run in
    ``promote(input dtypes, map dtype)``, and at least float32 (bfloat16/float16 are promoted);
    results come back in the inputs' dtype (``promote(q, k, v)`` for attention). The torch default
    dtype plays no role beyond the dtype a map is built with when ``dtype=None``.

    Attributes
    ----------
    dim : int
        Input dimension ``d``.
    num_features : int
        ``r``: number of random projections (``d`` for the deterministic maps).
    feature_dim : int
        Length ``F`` of $\varphi(x)$, from the rule registered with the estimator.
    batch_shape : tuple of int
        Shape of the batch of independent projections (``()`` for deterministic maps).
    is_random, positive : bool
        Whether the map is random, and whether its features are always non-negative.

    Examples
    --------
    A new deterministic map is `log_features` and one registration; the kernel, attention and
    the checks of `kernelapprox.testing` then work on it:

    >>> import torch, kernelapprox as ka
    >>> class Elu1(ka.FeatureMap):
    ...     '''elu(x) + 1, written as a new map.'''
    ...     def __init__(self, dim, num_features=None, **kwargs):
    ...         super().__init__()
    ...         self.dim = self.num_features = dim
    ...     def log_features(self, x, shared=False):
    ...         f = torch.nn.functional.elu(x) + 1
    ...         return f, torch.zeros(f.shape[:-1], dtype=f.dtype)
    >>> _ = ka.register_estimator(Elu1, name="elu1", feature_dim="d")
    >>> q, k = torch.randn(2, 3, 4, generator=torch.Generator().manual_seed(0)).unbind(0)
    >>> fm = Elu1(4)
    >>> fm(q).shape, fm.kernel(q, k).shape, fm.feature_dim
    (torch.Size([3, 4]), torch.Size([3, 3]), 4)
    >>> torch.allclose(fm.kernel(q, k), ka.EluFeatures(4).kernel(q, k))
    True
    >>> ka.unregister_estimator("elu1")
    """

    is_random: ClassVar[bool] = False
    positive: ClassVar[bool] = True
    #: Parameters chosen from the data by `fit` (OPRF/FAVOR++, FAVOR#, Nyström landmarks).
    data_dependent: ClassVar[bool] = False
    #: Trainable parameters, fitted by `kernelapprox.fit_feature_map` (Hedgehog).
    learned: ClassVar[bool] = False
    #: Queries and keys use the same map. Asymmetric estimators (FAVOR#'s SADERF, which scales
    #: queries by $\Psi$ and keys by $\Psi^{-1}$; hybrid features, whose weights are
    #: an indefinite kernel) set it false and override `key_log_features`; every key-side
    #: computation of the library goes through `key_log_features` / `key_features`.
    symmetric: ClassVar[bool] = True
    #: The estimators registered for exactly this class (one per selecting ``params``), kept
    #: in the class's own ``__dict__`` by `kernelapprox.register_estimator`; empty until then.
    registrations: ClassVar[tuple[Estimator, ...]] = ()

    dim: int
    num_features: int
    batch_shape: tuple[int, ...] = ()

    def __init_subclass__(cls, **kwargs: Any) -> None:
        # Every map computes its float32 internals in float32, also inside torch.autocast.
        super().__init_subclass__(**kwargs)
        for name in ("forward", "log_features", "query_features", "kernel", "key_log_features", "key_features"):
            if name in cls.__dict__:
                setattr(cls, name, no_autocast(cls.__dict__[name]))

    # ------------------------------------------------------------------ identity
    @property
    def estimator(self) -> Estimator:
        """The registered identity of this map (`kernelapprox.estimator_of`).

        Read from `registrations` of the map's own class (exact class, params matching): a
        subclass of a registered map is a different estimator until registered itself.
        """
        for est in type(self).__dict__.get("registrations", ()):
            if _params_match(self, est.params):
                return est
        raise LookupError(
            f"{type(self).__name__} is not a registered estimator (a subclass of a registered map is a "
            "different estimator); register it once with ka.register_estimator("
            f"{type(self).__name__}, name=...)"
        )

    @property
    def feature_dim(self) -> int:
        """Length ``F`` of $\\varphi(x)$: the registered rule of the estimator at ``(r, d)``.

        The rule of the map's own registration, else that of the nearest registered base class
        with matching params (``feature_dim`` is structural, so it is inherited).
        """
        for klass in type(self).__mro__:
            for est in klass.__dict__.get("registrations", ()):
                if _params_match(self, est.params):
                    return est.feature_dim(self.num_features, self.dim)
        raise NotImplementedError(
            f"{type(self).__name__} is not registered: register it with "
            "ka.register_estimator(..., feature_dim=...) or define a feature_dim property"
        )

    @property
    def param_dtype(self) -> torch.dtype | None:
        """Dtype of the map's floating buffers and parameters (``None`` for maps without any)."""
        for t in self.buffers():
            if t.is_floating_point():
                return t.dtype
        for t in self.parameters():
            if t.is_floating_point():
                return t.dtype
        return None

    def compute_dtype(self, *dtypes: torch.dtype) -> torch.dtype:
        """The dtype this map computes in for inputs of ``dtypes``: ``promote(dtypes, param_dtype)``,
        at least float32."""
        return compute_dtype(*dtypes, self.param_dtype)

    def get_params(self) -> dict[str, Any]:
        """Constructor arguments that rebuild an equivalent map (scikit-learn style).

        Every named argument of the constructors along the class hierarchy that the map stores as
        an attribute of the same name, plus ``dtype`` and ``device`` read from its buffers;
        ``seed`` and ``generator`` are left out (a rebuilt random map draws anew).

        Examples
        --------
        >>> from kernelapprox import PositiveRF
        >>> PositiveRF(4, 8, sampler="orthogonal", seed=0).get_params()["sampler"]
        OrthogonalSampler(norms='chi')
        """
        out: dict[str, Any] = {}
        for klass in type(self).__mro__:
            init = klass.__dict__.get("__init__")
            if init is None:
                continue
            params = list(inspect.signature(init).parameters.values())[1:]
            for p in params:
                if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD) or p.name.startswith("_") or p.name in out:
                    continue
                if p.name in ("seed", "generator"):
                    continue
                if p.name == "dtype":
                    if self.param_dtype is not None:
                        out["dtype"] = self.param_dtype
                elif p.name == "device":
                    ref = next(iter(self.buffers()), None)
                    if ref is not None:
                        out["device"] = ref.device
                elif hasattr(self, p.name):
                    out[p.name] = getattr(self, p.name)
            if not any(p.kind == p.VAR_KEYWORD for p in params):
                break
        return out

    # ------------------------------------------------------------------ helpers
    def _prepare(self, name: str, x: object) -> tuple[torch.Tensor, torch.dtype]:
        """Validate ``x`` (..., n, d) (unless a caller already did) and cast it to the compute dtype."""
        if not validation_skipped():
            x = check_floating(name, x)
            check_last_dim(name, x, self.dim)
            broadcast_batch(name, x.shape[:-2], self.batch_shape)
        x = cast(torch.Tensor, x)  # validated above, or by the calling entry point
        return x.to(self.compute_dtype(x.dtype)), x.dtype

    def _fused(self, x: object, shared: bool = False, key: bool = False, plain: bool = False) -> Any:
        """The fused kernels' result for ``x`` (`kernelapprox.backends.use_fused_maps`: CUDA with
        Triton), or ``None``: the torch path. ``plain``: ``forward``/``key_features``, else
        ``log_features``/``key_log_features``."""
        if not backends.use_fused_maps(x):
            return None
        if not validation_skipped():
            x = check_floating("x", x)
            check_last_dim("x", x, self.dim)
            broadcast_batch("x", x.shape[:-2], self.batch_shape)
        x = cast(torch.Tensor, x)
        if plain:
            return backends.fused_features(self, x, key)
        return backends.fused_log_features(self, x, shared, key)

    def _prepare_gemm(self, name: str, x: object) -> tuple[torch.Tensor, torch.dtype, torch.dtype]:
        """`_prepare`, plus the dtype of the GEMM operands (`kernelapprox.backends.gemm_dtype`):
        ``xc.dtype`` under the CPU policy, the 16-bit input dtype under the accelerator policy."""
        xc, out_dtype = self._prepare(name, x)
        return xc, out_dtype, backends.gemm_dtype(out_dtype, xc.device, xc.dtype)

    @staticmethod
    def _policy_out(
        f: torch.Tensor, log_scale: torch.Tensor, out_dtype: torch.dtype, gemm: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(f, log_scale)`` of `log_features` under the dtype policy: unchanged under the CPU
        policy; the bounded ``f`` in the input's 16-bit dtype and ``log_scale`` float32 under the
        accelerator policy (``gemm`` 16-bit)."""
        if gemm == f.dtype:
            return f, log_scale
        return f.to(out_dtype), log_scale.to(torch.float32)

    def _kernel_dtypes(
        self, q: object, k: object, compute_dtype: torch.dtype | None
    ) -> tuple[torch.dtype, torch.dtype]:
        """Validate the inputs of `kernel`; return (output dtype, compute dtype)."""
        q = check_floating("q", q)
        k = check_floating("k", k)
        check_last_dim("q", q, self.dim)
        check_last_dim("k", k, self.dim)
        if q.device != k.device:
            raise ValueError(f"q and k must be on one device, got q on {q.device} and k on {k.device}")
        try:
            broadcast_shapes(q.shape[:-2], k.shape[:-2], self.batch_shape)
        except RuntimeError:
            raise ValueError(
                f"leading dimensions of q {tuple(q.shape[:-2])}, k {tuple(k.shape[:-2])} and the "
                f"feature map's batch_shape {self.batch_shape} do not broadcast"
            ) from None
        cdt = torch.float64 if compute_dtype is None else compute_dtype
        if not isinstance(cdt, torch.dtype) or not cdt.is_floating_point:
            raise TypeError(f"compute_dtype must be a floating torch.dtype, got {compute_dtype!r}")
        return torch.promote_types(q.dtype, k.dtype), self.compute_dtype(cdt)

    # ------------------------------------------------------------------ API
    @no_autocast
    def log_features(self, x: torch.Tensor, shared: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        r"""Stabilised features: $\varphi(x) = f \cdot e^{\text{log\_scale}}$.

        Parameters
        ----------
        x : Tensor, shape (..., n, d)
        shared : bool, default False
            If True, one scale per sequence (shape ``(..., 1)``), shared by all ``n`` rows, so
            that ratios between rows are preserved (what keys need in attention). If False, one
            scale per row (shape ``(..., n)``).

        Returns
        -------
        f : Tensor, shape (*broadcast(x.shape[:-2], batch_shape), n, feature_dim)
            Bounded features in the compute dtype (see the class docstring).
        log_scale : Tensor, shape (..., n) or (..., 1)
            Natural log of the per-row (or shared) scale, in float64 for the random maps (it holds
            terms like $\|x\|^2/2$ whose float32 rounding would show in the kernel).
            Stabilising shifts that cancel in $f e^{\text{log\_scale}}$ are detached from
            autograd; gradients of any function of $\varphi$ are exact.
        """
        raise NotImplementedError

    @no_autocast
    def query_features(self, x: torch.Tensor) -> torch.Tensor:
        r"""$\varphi(x)$ up to a positive factor per row: ``f`` of `log_features`.

        What attention needs for its queries: a per-query positive factor cancels between the
        numerator and the denominator of $o_i$. Subclasses may skip computing the scale.

        Parameters
        ----------
        x : Tensor, shape (..., n, d)

        Returns
        -------
        Tensor, shape (*broadcast(x.shape[:-2], batch_shape), n, feature_dim), compute dtype.
        """
        return self.log_features(x)[0]

    def query_log2_features(self, x: torch.Tensor) -> torch.Tensor | None:
        r"""$\log_2\varphi(x)$ up to an additive constant per row, (..., n, F), or ``None``.

        For maps whose features are exponentials (``exp2`` of these exponents, before any
        shift): attention then chooses each query's shift itself, against the key state
        (`kernelapprox.attention._common.shift_queries`). ``None`` (the default) where the map
        has no such form; attention then uses `query_features`.
        """
        return None

    def key_log2_features(self, x: torch.Tensor) -> torch.Tensor | None:
        r"""$\log_2\psi(x)$ (key side, every term included), (..., m, F), or ``None``.

        The key counterpart of `query_log2_features`: attention then shifts each feature
        (column) by its maximum over the keys.
        """
        return None

    def key_features_recyclable(self) -> bool:
        """Whether `key_log_features` returns a fresh tensor that nothing else references, so
        that a caller done with it may recycle its memory for `query_features_into`.

        Non-causal linear attention asks this once per call: after forming
        $\varphi(K)^\top V$ it writes the query features into the key features' buffer.
        ``False`` by default; a map that overrides how its features are computed must not
        inherit the promise (`PositiveRF` checks that its methods are its own).

        Returns
        -------
        bool

        Examples
        --------
        >>> import kernelapprox as ka
        >>> ka.PositiveRF(4, 8, seed=0).key_features_recyclable(), ka.EluFeatures(4).key_features_recyclable()
        (True, False)
        """
        return False

    def query_features_into(self, x: torch.Tensor, buf: torch.Tensor | None) -> torch.Tensor:
        r"""`query_features`, written into the memory of ``buf`` where the map can.

        ``buf`` is a dead contiguous tensor (the key features of the same call, which the
        non-causal attention no longer needs once $\varphi(K)^\top V$ is formed). Writing into
        it spares a fresh allocation of the same size, whose first touch costs page faults on
        CPU (see docs/performance.md). Maps that cannot ignore ``buf`` (the default), as do calls
        that record autograd, run under ``torch.compile`` or the accelerator dtype policy.

        Parameters
        ----------
        x : Tensor, shape (..., n, d)
        buf : Tensor or None
            Contiguous, of the compute dtype and device, with at least as many elements as the
            features; its contents are overwritten.

        Returns
        -------
        Tensor, shape (..., n, feature_dim): the query features (a view of ``buf`` when written there).

        Examples
        --------
        >>> import torch, kernelapprox as ka
        >>> fm = ka.PositiveRF(4, 8, seed=0)
        >>> x = torch.randn(5, 4)
        >>> buf = torch.empty(5, 8)
        >>> torch.allclose(fm.query_features_into(x, buf), fm.query_features(x))
        True
        """
        return self.query_features(x)

    @no_autocast
    def key_log_features(self, x: torch.Tensor, shared: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        r"""Stabilised *key* features $\psi(y) = f\,e^{\text{log\_scale}}$, with
        $\hat K(x, y) = \varphi(x)^\top\psi(y)$.

        Same contract as `log_features`, which it is for symmetric maps (the default).

        Parameters
        ----------
        x : Tensor, shape (..., m, d)
        shared : bool, default False

        Returns
        -------
        f : Tensor, shape (*broadcast(x.shape[:-2], batch_shape), m, feature_dim)
        log_scale : Tensor, shape (..., m) or (..., 1)
        """
        return self.log_features(x, shared)

    @no_autocast
    def key_features(self, x: torch.Tensor) -> torch.Tensor:
        r"""$\psi(x)$, the plain key-side features (`forward` for symmetric maps).

        Parameters
        ----------
        x : Tensor, shape (..., m, d)

        Returns
        -------
        Tensor, shape (*broadcast(x.shape[:-2], batch_shape), m, feature_dim), dtype of ``x``.
        """
        if self.symmetric:
            return self(x)
        xc, out_dtype = self._prepare("x", x)
        with inputs_validated():
            f, ls = self.key_log_features(xc)
        return (f * ls.exp().to(f.dtype).unsqueeze(-1)).to(out_dtype)

    @no_autocast
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        r"""$\varphi(x)$, the plain (unstabilised) features (query side; see `key_features`).

        Parameters
        ----------
        x : Tensor, shape (..., n, d)

        Returns
        -------
        Tensor, shape (*broadcast(x.shape[:-2], batch_shape), n, feature_dim), dtype of ``x``.
            May overflow where $\varphi(x)$ itself is not representable (e.g. trigonometric
            features at $\|x\| \gtrsim 13$ in float32); use `kernel` or
            `log_features` there.
        """
        xc, out_dtype = self._prepare("x", x)
        with inputs_validated():
            f, ls = self.log_features(xc)
        return (f * ls.exp().to(f.dtype).unsqueeze(-1)).to(out_dtype)

    @no_autocast
    def kernel(
        self, q: torch.Tensor, k: torch.Tensor, *, compute_dtype: torch.dtype | None = None
    ) -> torch.Tensor:
        r"""The kernel estimate $\hat K = \varphi(q)\varphi(k)^\top$, computed in the log domain.

        $\hat K_{ij} = G_{ij} e^{s_i + t_j}$ with $G = f_q f_k^\top$ and
        $(f, s)$ from `log_features`; where $e^{s_i + t_j}$ alone over- or
        underflows, $\operatorname{sign}(G_{ij}) \exp(\log|G_{ij}| + s_i + t_j)$, so that no
        scale factor overflows unless $\hat K_{ij}$ itself does.

        Parameters
        ----------
        q : Tensor, shape (..., n, d)
        k : Tensor, shape (..., m, d)
        compute_dtype : torch.dtype, optional
            Dtype of the computation. Default float64: this is the verification path, and in
            float32 the projection $Wx$ alone carries a relative rounding of ~1e-5 into
            $\hat K$ at $\|x\| = 10$, $d = 64$. Pass ``torch.float32`` for
            speed (``linear_attention`` never materialises $\hat K$). It is promoted with
            the map's dtype like every computation (at least float32).

        Returns
        -------
        Tensor, shape (*broadcast(q.shape[:-2], k.shape[:-2], batch_shape), n, m),
            dtype ``promote(q.dtype, k.dtype)``.

        Examples
        --------
        >>> from kernelapprox import PositiveRF
        >>> fm = PositiveRF(dim=4, num_features=64, seed=0)
        >>> q, k = torch.randn(5, 4) / 2, torch.randn(7, 4) / 2
        >>> fm.kernel(q, k).shape
        torch.Size([5, 7])
        """
        out_dtype, cdt = self._kernel_dtypes(q, k, compute_dtype)
        with inputs_validated():
            fq, sq = self.log_features(q.to(cdt))
            fk, sk = self.key_log_features(k.to(cdt))
        G = torch.matmul(fq, fk.mT)
        logs = sq.unsqueeze(-1) + sk.unsqueeze(-2)  # float64 for the random maps
        # Where the scale e^{s_i + t_j} is representable: one rounding. Elsewhere (the scale alone
        # over- or underflows) through the log of |G|, with a safe log: exact zeros (disjoint
        # supports, underflow) give 0 with a zero gradient. Both branches are kept finite, so the
        # unselected one cannot turn a zero gradient into NaN.
        fi = torch.finfo(logs.dtype)
        ok = (logs <= math.log(fi.max)) & (logs >= math.log(fi.tiny))
        direct = G * torch.exp(torch.where(ok, logs, torch.zeros_like(logs)))
        nz = G != 0
        mag = torch.exp(torch.log(torch.where(nz, G.abs(), torch.ones_like(G))) + logs)
        via_log = torch.where(nz, mag if self.positive else torch.sign(G) * mag, torch.zeros_like(mag))
        return torch.where(ok, direct, via_log).to(out_dtype)

    def redraw(self, seed: int | None = None, generator: torch.Generator | None = None) -> FeatureMap:
        """Draw a new projection in place (a no-op for deterministic maps). Returns ``self``."""
        return self

    def fit(self, q: torch.Tensor, k: torch.Tensor) -> FeatureMap:
        """Choose the data-dependent parameters from queries and keys. Returns ``self``.

        A no-op for maps whose parameters do not depend on the data (``data_dependent`` false),
        so generic code may call it on any map (``linear_attention(..., fit=True)`` does).

        Parameters
        ----------
        q : Tensor, shape (..., n, d)
        k : Tensor, shape (..., m, d)
        """
        return self


class RandomFeatureMap(FeatureMap):
    r"""Base of the random maps: owns the projection (a buffer) and its sampler.

    Parameters
    ----------
    dim : int
        Input dimension ``d``.
    num_features : int
        ``r``, the number of random projections $w_1..w_r$.
    sampler : str or Sampler, default "gaussian"
        ``"gaussian"``, ``"orthogonal"``, ``"structured"``, ``"qmc"`` or a
        `kernelapprox.samplers.Sampler` (e.g. ``OrthogonalSampler(norms="fixed")``).
    seed : int, optional
        Seed of a fresh CPU generator the projection is drawn from. ``None`` (with no
        ``generator``) draws from torch's default CPU generator, as ``nn.Linear`` initialises its
        weight: ``torch.manual_seed(0)`` then makes a model that builds feature maps reproducible.
    generator : torch.Generator, optional
        A CPU generator to draw from instead of ``seed`` (its state advances).
    batch_shape : tuple of int, default ()
        Independent projections of shape ``(*batch_shape, r, d)``, broadcast against the input's
        leading dimensions: ``(H,)`` for one draw per head, ``(S, 1, 1)`` for ``S`` Monte Carlo draws
        of a ``(B, H, n, d)`` input.
    device, dtype : optional
        Where and in which dtype the projection buffer lives (default: CPU, default dtype).
        Moving the map to a 16-bit dtype rounds the stored projection (the estimator changes);
        16-bit *inputs* need no such move: they are computed in float32 anyway.

    Examples
    --------
    >>> import torch, kernelapprox as ka
    >>> fm = ka.PositiveRF(8, 16, sampler="orthogonal", seed=0, batch_shape=(2,))
    >>> fm.weight.shape, fm.sampler.row_law
    (torch.Size([2, 16, 8]), 'orthogonal-chi')
    >>> x = torch.randn(2, 5, 8, generator=torch.Generator().manual_seed(1))
    >>> fm(x).shape  # one projection per leading index (e.g. per head)
    torch.Size([2, 5, 16])
    >>> w = fm.weight.clone()
    >>> bool((fm.redraw().weight != w).any())
    True
    """

    is_random = True
    projection: Projection

    def __init__(
        self,
        dim: int,
        num_features: int,
        *,
        sampler: str | Sampler = "gaussian",
        seed: int | None = None,
        generator: torch.Generator | None = None,
        batch_shape: tuple[int, ...] = (),
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
        _projection: Projection | None = None,
    ) -> None:
        super().__init__()
        self.dim = check_positive_int("dim", dim)
        self.num_features = check_positive_int("num_features", num_features)
        self.batch_shape = as_batch_shape(batch_shape)
        self.sampler = get_sampler(sampler)
        device = check_device("device", device)
        dtype = check_dtype("dtype", dtype)
        self._init_dtype = dtype or torch.get_default_dtype()
        g = None
        if _projection is None:
            g = make_generator(seed, generator)
            _projection = self.sampler.sample(
                self.num_features, self.dim, batch_shape=self.batch_shape, generator=g
            )
        self.projection = _projection.to(device=device, dtype=self._init_dtype)
        self._init_extra(g, device)

    def _init_extra(self, generator: torch.Generator | None, device) -> None:
        """Hook for extra random buffers (the offsets of ``TrigRF(variant="offset")``)."""

    @property
    def weight(self) -> torch.Tensor:
        """The dense projection $W$, shape ``(*batch_shape, r, d)`` (materialised for SORF)."""
        return self.projection.weight

    @classmethod
    def from_projection(
        cls,
        W: torch.Tensor,
        *,
        offsets: torch.Tensor | None = None,
        sampler: str | Sampler | None = None,
        **kwargs,
    ) -> RandomFeatureMap:
        r"""Build the map around a given projection ``W`` of shape ``(*batch_shape, r, d)``.

        Parameters
        ----------
        W : Tensor, shape (*batch_shape, r, d)
            Used as is (its dtype and device, unless ``dtype``/``device`` are given).
        offsets : Tensor, shape (*batch_shape, r), optional
            Phases for ``TrigRF(variant="offset")`` (required there).
        sampler : str or Sampler, optional
            How ``W`` was drawn, if known: used by `redraw` and by `kernelapprox.theory`.
            Default: unknown provenance (``GivenSampler``; theory then refuses to guess).
        **kwargs
            Other constructor arguments (``variant=``, ``dtype=``, ``device=``).

        Examples
        --------
        >>> from kernelapprox import PositiveRF
        >>> W = torch.randn(16, 4, dtype=torch.float64)
        >>> fm = PositiveRF.from_projection(W, sampler="gaussian")
        >>> fm.num_features, fm.weight.dtype
        (16, torch.float64)
        """
        W = check_floating("W", W)
        if W.dim() < 2:
            raise ValueError(f"W must have shape (*batch_shape, r, d), got {tuple(W.shape)}")
        if W.device.type != "meta" and not bool(torch.isfinite(W).all()):
            raise ValueError(f"W must be finite, got {int((~torch.isfinite(W)).sum())} non-finite entries "
                             f"(shape {tuple(W.shape)})")
        kwargs.setdefault("dtype", W.dtype)
        kwargs.setdefault("device", W.device)
        for bad in ("seed", "generator", "batch_shape"):
            if bad in kwargs:
                raise TypeError(f"from_projection() takes no {bad!r}: the projection is given")
        obj = cls(
            W.shape[-1],
            W.shape[-2],
            sampler=GivenSampler() if sampler is None else sampler,
            batch_shape=tuple(W.shape[:-2]),
            _projection=DenseProjection(W.detach().clone()),
            **kwargs,
        )
        obj._set_offsets(offsets)
        return obj

    def _set_offsets(self, offsets: torch.Tensor | None) -> None:
        if offsets is not None:
            raise TypeError(f"{type(self).__name__} takes no offsets")

    def redraw(self, seed: int | None = None, generator: torch.Generator | None = None) -> RandomFeatureMap:
        """Draw a new projection (and offsets) *in place*, keeping device and dtype. Returns ``self``.

        The new values are copied into the existing buffers, so references held elsewhere
        (optimisers, hooks, ``torch.compile`` graphs, ``fm.weight`` of a dense projection) see
        them. ``seed`` and ``generator`` as in the constructor (``None``: torch's default
        generator).

        Examples
        --------
        >>> from kernelapprox import PositiveRF
        >>> fm = PositiveRF(4, 8, seed=0)
        >>> W = fm.weight
        >>> _ = fm.redraw(seed=1)
        >>> W.data_ptr() == fm.weight.data_ptr() and bool((W == fm.weight).all())
        True
        """
        g = make_generator(seed, generator)
        ref = next(iter(self.projection.buffers()))
        new = self.sampler.sample(self.num_features, self.dim, batch_shape=self.batch_shape, generator=g)
        new = new.to(device=ref.device, dtype=ref.dtype)
        if not self.projection.copy_from(new):
            # another projection structure (a given projection redrawn with a structured sampler)
            self.projection = new
        self._init_extra(g, ref.device)
        return self

    def extra_repr(self) -> str:
        s = f"dim={self.dim}, num_features={self.num_features}, sampler={self.sampler!r}"
        if self.batch_shape:
            s += f", batch_shape={self.batch_shape}"
        return s
