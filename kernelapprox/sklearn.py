r"""scikit-learn front end: random-feature transformers in the style of ``sklearn.kernel_approximation``.

`RandomFeatures` maps an array ``X`` of shape ``(n_samples, n_features)`` to random features
$\Phi(X)$ of shape ``(n_samples, n_components)`` with $\Phi(X)\Phi(Y)^\top \approx K(X, Y)$, for

* ``kernel="rbf"``: the Gaussian kernel $K(x, y) = e^{-\gamma\|x-y\|^2}$ (bounded, $K \le 1$),
  scikit-learn's `sklearn.kernel_approximation.RBFSampler` kernel;
* ``kernel="softmax"``: the softmax kernel $K(x, y) = e^{\gamma\, x^\top y}$, which is *unbounded*;
  the features estimate it as it is, without any normalisation (no attention denominator).

Any symmetric random estimator of the registry (``ka.estimators()``) and any sampler
(``"gaussian"``, ``"orthogonal"``, ``"structured"``, ``"qmc"``, ``"simplex"``, ``"simplex+"``)
can be combined. The two kernels are one identity apart,

$$
e^{-\gamma\|x-y\|^2} = e^{-\gamma\|x\|^2}\, e^{-\gamma\|y\|^2}\, e^{\tilde x^\top \tilde y},
\qquad \tilde x = \sqrt{2\gamma}\, x,
$$

so an unbiased feature map $\varphi$ of $e^{\tilde x^\top\tilde y}$ gives the RBF features
$e^{-\gamma\|x\|^2}\varphi(\tilde x)$ and the softmax features are $\varphi(\sqrt\gamma\, x)$.
With the trigonometric estimators the factor $e^{-\gamma\|x\|^2}$ cancels the map's own
$e^{\|\tilde x\|^2/2}$ exactly, leaving Rahimi and Recht's random Fourier features with rows
$\sqrt{2\gamma}\,w_i$: ``estimator="trig-offset"`` with ``sampler="gaussian"`` is
``RBFSampler``'s estimator ($\sqrt{2/r}\cos(Wx + b)$), ``"trig-sincos"`` its
$[\sin Wx, \cos Wx]/\sqrt r$ form.

Requires scikit-learn (the ``[sklearn]`` extra); ``kernelapprox`` itself does not import this module.

References
----------
- [RR07] A. Rahimi, B. Recht. "Random Features for Large-Scale Kernel Machines", NIPS 2007.
- [SS15] D. J. Sutherland, J. Schneider. "On the Error of Random Fourier Features", UAI 2015.
- [Yu16] F. X. Yu, A. T. Suresh, K. Choromanski, D. Holtmann-Rice, S. Kumar. "Orthogonal Random
   Features", NeurIPS 2016.
- [Avr16] H. Avron, V. Sindhwani, J. Yang, M. W. Mahoney. "Quasi-Monte Carlo Feature Maps for
   Shift-Invariant Kernels", JMLR 17 (2016).
- [Cho21] K. Choromanski et al. "Rethinking Attention with Performers", ICLR 2021.
"""

from __future__ import annotations

import copy
import math
import warnings
from numbers import Integral, Real
from typing import Any, cast

import numpy as np
import torch
from sklearn.base import (  # type: ignore[import-untyped]
    BaseEstimator,
    ClassNamePrefixFeaturesOutMixin,
    TransformerMixin,
    _fit_context,
)
from sklearn.utils import check_random_state  # type: ignore[import-untyped]
from sklearn.utils._param_validation import Interval, StrOptions  # type: ignore[import-untyped]
from sklearn.utils.validation import check_is_fitted, validate_data  # type: ignore[import-untyped]

from ._logdomain import _sqnorm_half
from .maps.spec import resolve_feature_map
from .registry import DEFAULT_SAMPLER, Estimator, estimators, get_estimator
from .samplers import SAMPLERS, Sampler, get_sampler

__all__ = ["RandomFeatures", "supported_estimators"]

#: The estimator each kernel uses when ``estimator=None`` (RBF: for an odd ``n_components``,
#: ``"trig-offset"``, as ``"trig-sincos"`` needs an even output width).
DEFAULT_ESTIMATOR = {"rbf": "trig-sincos", "softmax": "positive"}


def _unsupported_reason(est: Estimator) -> str | None:
    """Why ``est`` cannot serve as a transformer (``None``: it can)."""
    if not est.is_random:
        return "it is deterministic (not a random-feature estimator of the kernel)"
    if est.learned:
        return "it is learned (train it with ka.fit_feature_map instead)"
    if not getattr(est.cls, "symmetric", True):
        return "it is asymmetric (queries and keys use different maps; a transformer has one map)"
    if est.feature_dim_rule not in ("r", "2r"):
        return f"its feature dimension rule {est.feature_dim_rule!r} is not 'r' or '2r'"
    return None


def supported_estimators() -> list[str]:
    """Names of the registered estimators `RandomFeatures` accepts, in registration order.

    They are the random, symmetric, non-learned estimators whose output width is $r$ or $2r$.

    Examples
    --------
    >>> from kernelapprox.sklearn import supported_estimators
    >>> supported_estimators()[:4]
    ['positive', 'hyperbolic', 'trig-sincos', 'trig-offset']
    """
    return [e.name for e in estimators() if _unsupported_reason(e) is None]


def _caller_stacklevel() -> int:
    """``stacklevel`` (for a `warnings.warn` in the caller of this function) of the first frame
    outside kernelapprox and scikit-learn: the user's ``fit`` or pipeline call."""
    import os
    import sys

    import sklearn  # type: ignore[import-untyped]

    skip = (os.path.dirname(os.path.dirname(__file__)) + os.sep + "kernelapprox" + os.sep,
            os.path.dirname(sklearn.__file__) + os.sep)
    frame: Any = sys._getframe(2)
    level = 2
    while frame is not None and frame.f_code.co_filename.startswith(skip):
        frame, level = frame.f_back, level + 1
    return level


class RandomFeatures(ClassNamePrefixFeaturesOutMixin, TransformerMixin, BaseEstimator):
    r"""Random features of the RBF or softmax kernel, as a scikit-learn transformer.

    ``transform`` maps ``X`` of shape ``(n_samples, n_features)`` to $\Phi$ of shape
    ``(n_samples, n_components)`` with $\mathbb E\,\Phi\Phi^\top = K$ entrywise (for the unbiased
    samplers), where

    $$
    K_{ij} = e^{-\gamma\|x_i - x_j\|^2} \quad(\texttt{kernel="rbf"}), \qquad
    K_{ij} = e^{\gamma\, x_i^\top x_j} \quad(\texttt{kernel="softmax"}).
    $$

    The rows $w_1..w_r$ of the projection come from ``sampler``; the features are those of the
    library's feature map ``estimator`` applied to $\sqrt{2\gamma}\,x$ (RBF, times
    $e^{-\gamma\|x\|^2}$) or $\sqrt{\gamma}\,x$ (softmax); see `kernelapprox.sklearn`.
    The softmax kernel is unbounded: its features are *not* normalised and their variance grows
    like $e^{\gamma\|x+y\|^2}$ (positive) or faster, so scale the data (``gamma``) until
    $\gamma\|x\|^2$ is of order one.

    Parameters
    ----------
    kernel : {"rbf", "softmax"}, default="rbf"
        The kernel approximated.
    estimator : str, default=None
        A registered estimator name (`supported_estimators`): ``"trig-sincos"``,
        ``"trig-offset"``, ``"positive"`` (FAVOR+), ``"hyperbolic"``, ``"oprf"`` (FAVOR++),
        ``"sderf"``, ... ``None``: ``"trig-sincos"`` for ``"rbf"`` (``"trig-offset"`` if
        ``n_components`` is odd), ``"positive"`` for ``"softmax"``. At equal ``n_components``
        the sin/cos form has the lower variance for the RBF kernel [SS15]_ (its variance minus the
        offset form's is $(e^{-4\gamma\|x-y\|^2}/2 - e^{-2\gamma\|x-y\|^2})/F < 0$ for iid rows). Data-dependent estimators (``"oprf"``, ``"sderf"``) choose their
        parameters from the training data in `fit`. For the RBF kernel the trigonometric
        estimators are the natural choice (bounded features); the positive ones are valid but
        their variance grows with $\|x + y\|$.
    sampler : str or Sampler, default="orthogonal"
        How the rows $w_i$ are drawn: ``"gaussian"`` (iid, as ``RBFSampler``),
        ``"orthogonal"`` (block-orthogonal with $\chi_d$ norms, unbiased; the library's
        ``DEFAULT_SAMPLER``), ``"structured"``
        (SORF, slightly biased), ``"qmc"`` (scrambled Sobol'), ``"simplex"``, ``"simplex+"``
        (need ``n_features >= 2``), or a `kernelapprox.samplers.Sampler`.
    n_components : int, default=100
        Output width $F$ (the number of features). It maps to the number of random
        projections $r$ by the estimator's rule: $r = F$ for ``"trig-offset"``, ``"positive"``,
        ``"oprf"``; $r = F/2$ for ``"trig-sincos"`` and ``"hyperbolic"`` (then $F$ must be even).
    gamma : "scale" or float, default=1.0
        Kernel parameter $\gamma > 0$. ``"scale"``: $1 / (\texttt{n\_features}\cdot
        \mathrm{Var}(X))$ of the training data, as ``RBFSampler``.
    random_state : int, RandomState instance or None, default=None
        Seeds the draw: an integer is drawn from ``check_random_state(random_state)`` and seeds
        the torch generator of the projection (and offsets). Pass an int for reproducible output.

    Attributes
    ----------
    n_features_in_ : int
        Number of features seen during `fit`.
    feature_names_in_ : ndarray of shape (n_features_in_,)
        Names of features seen during `fit` (only when ``X`` has string column names).
    gamma_ : float
        The $\gamma$ in use (resolved from ``"scale"``).
    estimator_ : str
        The estimator's registered name (resolved from ``None``).
    num_projections_ : int
        $r$, the number of random projections.
    random_weights_ : ndarray of shape (n_features_in_, num_projections_), float64
        The scaled projection $\sqrt{2\gamma}\,W^\top$ (RBF) or $\sqrt\gamma\,W^\top$ (softmax),
        laid out as ``RBFSampler.random_weights_``; for inspection (``transform`` uses
        ``feature_map_``).
    random_offset_ : ndarray of shape (num_projections_,) or None
        The phases $b_i \sim U[0, 2\pi)$ of ``"trig-offset"``; ``None`` for the other estimators.
    feature_map_ : kernelapprox.FeatureMap
        The library's feature map (float64 buffers) that computes the features.

    See Also
    --------
    sklearn.kernel_approximation.RBFSampler : iid random Fourier features (``estimator="trig-offset"``,
        ``sampler="gaussian"`` here).
    kernelapprox.TrigRF, kernelapprox.PositiveRF : the feature maps underneath.

    Notes
    -----
    ``transform`` computes in float32 for float32 input and in float64 otherwise (integer input
    is converted to float64), and returns an array of that dtype; the projection is drawn in
    float64 and rounded for float32 input. Each row's features depend on that row only.

    References
    ----------
    - [RR07] A. Rahimi, B. Recht. "Random Features for Large-Scale Kernel Machines", NIPS 2007.
    - [Yu16] F. X. Yu et al. "Orthogonal Random Features", NeurIPS 2016.
    - [Avr16] H. Avron, V. Sindhwani, J. Yang, M. W. Mahoney. "Quasi-Monte Carlo Feature Maps for
       Shift-Invariant Kernels", JMLR 17 (2016).
    - [Cho21] K. Choromanski et al. "Rethinking Attention with Performers", ICLR 2021.
    - [SS15] D. J. Sutherland, J. Schneider. "On the Error of Random Fourier Features", UAI 2015.

    Examples
    --------
    >>> import numpy as np
    >>> from sklearn.metrics.pairwise import rbf_kernel
    >>> from kernelapprox.sklearn import RandomFeatures
    >>> X = np.random.default_rng(0).normal(size=(50, 8))
    >>> rf = RandomFeatures(kernel="rbf", sampler="orthogonal", n_components=512, gamma=0.05,
    ...                     random_state=0)
    >>> Z = rf.fit_transform(X)
    >>> Z.shape, Z.dtype
    ((50, 512), dtype('float64'))
    >>> K = rbf_kernel(X, gamma=0.05)
    >>> bool(np.linalg.norm(Z @ Z.T - K) / np.linalg.norm(K) < 0.1)
    True
    >>> list(rf.get_feature_names_out()[:3])
    ['randomfeatures0', 'randomfeatures1', 'randomfeatures2']
    >>> rf.transform(X.astype(np.float32)).dtype
    dtype('float32')
    """

    _parameter_constraints: dict = {
        "kernel": [StrOptions({"rbf", "softmax"})],
        "estimator": [str, Estimator, None],
        "sampler": [StrOptions(set(SAMPLERS)), Sampler],
        "n_components": [Interval(Integral, 1, None, closed="left")],
        "gamma": [StrOptions({"scale"}), Interval(Real, 0.0, None, closed="neither")],
        "random_state": ["random_state"],
    }

    def __init__(
        self,
        *,
        kernel: str = "rbf",
        estimator: str | None = None,
        sampler: str | Sampler = DEFAULT_SAMPLER,
        n_components: int = 100,
        gamma: float | str = 1.0,
        random_state: Any = None,
    ) -> None:
        self.kernel = kernel
        self.estimator = estimator
        self.sampler = sampler
        self.n_components = n_components
        self.gamma = gamma
        self.random_state = random_state

    # ------------------------------------------------------------------ validation
    def _resolve_estimator(self) -> Estimator:
        name = self.estimator
        if name is None:
            name = DEFAULT_ESTIMATOR[self.kernel]
            if self.kernel == "rbf" and int(self.n_components) % 2:
                name = "trig-offset"
        try:
            est = get_estimator(name)
        except ValueError:
            raise ValueError(
                f"The 'estimator' parameter of {type(self).__name__} must be one of "
                f"{supported_estimators()} or None. Got {name!r} instead."
            ) from None
        why = _unsupported_reason(est)
        if why is not None:
            raise ValueError(
                f"The 'estimator' parameter of {type(self).__name__} got {est.name!r}, which cannot "
                f"be used here: {why}. Supported: {supported_estimators()}."
            )
        return est

    def _num_projections(self, est: Estimator) -> int:
        F = int(self.n_components)
        if est.feature_dim_rule == "2r":
            if F % 2:
                raise ValueError(
                    f"The 'n_components' parameter of {type(self).__name__} must be even for "
                    f"estimator {est.name!r} (its output width is 2r). Got {F} instead."
                )
            return F // 2
        return F

    # ------------------------------------------------------------------ API
    @_fit_context(prefer_skip_nested_validation=True)
    def fit(self, X, y=None):
        """Draw the random projection (and fit a data-dependent estimator's parameters on ``X``).

        Parameters
        ----------
        X : array-like of shape (n_samples, n_features)
            Training data. Only its width (and, for ``gamma="scale"`` or a data-dependent
            estimator, its values) is used.
        y : None
            Ignored.

        Returns
        -------
        self : RandomFeatures
            The fitted transformer.
        """
        est = self._resolve_estimator()
        r = self._num_projections(est)
        sampler = get_sampler(self.sampler)
        needs_two = getattr(sampler, "name", "") in ("simplex", "simplex+")
        X = validate_data(self, X, dtype=[np.float64, np.float32], ensure_min_features=2 if needs_two else 1)
        if self.gamma == "scale":
            var = float(np.var(X, dtype=np.float64))
            gamma = 1.0 / (X.shape[1] * var) if var > 0 else 1.0
        else:
            gamma = float(self.gamma)
        rng = check_random_state(self.random_state)
        seed = int(rng.randint(np.iinfo(np.int32).max))
        fm = resolve_feature_map(est.name, dim=X.shape[1], num_features=r, sampler=sampler, seed=seed,
                                 dtype=torch.float64)
        scale = math.sqrt((2.0 if self.kernel == "rbf" else 1.0) * gamma)
        if est.data_dependent:
            xs = torch.from_numpy(np.asarray(X, dtype=np.float64) * scale)
            fm.fit(xs, xs)
        if self.kernel == "softmax":
            self._warn_if_hopeless(fm, torch.from_numpy(np.asarray(X, dtype=np.float64) * scale), gamma)
        self.gamma_ = gamma
        self.estimator_ = est.name
        self.num_projections_ = r
        self.feature_map_ = fm
        W = cast(torch.Tensor, fm.weight)  # (r, d), materialised for SORF
        self.random_weights_ = (scale * W.detach().to(torch.float64).cpu().numpy()).T.copy()
        offsets = getattr(fm, "offsets", None)
        self.random_offset_ = None if offsets is None else offsets.detach().to(torch.float64).cpu().numpy().copy()
        self._n_features_out = int(self.n_components)
        return self

    @staticmethod
    def _warn_if_hopeless(fm: Any, xs: torch.Tensor, gamma: float) -> None:
        """The regime check of the layers (`kernelapprox.diagnose.quick_relative_mse`): a
        `KernelApproxWarning` when the closed form predicts a relative kernel MSE above
        `kernelapprox.diagnose.WARN_RELATIVE_MSE` on the training data."""
        from .diagnose import WARN_RELATIVE_MSE, KernelApproxWarning, quick_relative_mse

        rel = quick_relative_mse(fm, xs, xs)
        if math.isfinite(rel) and rel <= WARN_RELATIVE_MSE:
            return
        if math.isnan(rel):
            return  # no closed form for this estimator: nothing to say
        sq = float((xs**2).sum(-1).mean())
        warnings.warn(
            f"RandomFeatures(kernel='softmax', gamma={gamma:.3g}): the closed form predicts a relative kernel MSE "
            f"of {rel:.3g} on X (gamma*|x|^2 = {sq:.3g} on average), so the features approximate nothing; "
            "scale the data until gamma*|x|^2 is of order one (a smaller gamma, e.g. gamma='scale' or "
            "1/n_features), or see kernelapprox.diagnose(X, X) for every estimator and the number of features "
            "each needs",
            KernelApproxWarning, stacklevel=_caller_stacklevel())

    def transform(self, X):
        """Map ``X`` to its random features.

        Parameters
        ----------
        X : array-like of shape (n_samples, n_features)
            float32 input is computed and returned in float32; anything else in float64.

        Returns
        -------
        X_new : ndarray of shape (n_samples, n_components)
            $\\Phi(X)$, with $\\Phi(X)\\Phi(Y)^\\top \\approx K(X, Y)$.
        """
        check_is_fitted(self)
        X = validate_data(self, X, dtype=[np.float64, np.float32], reset=False)
        dt = torch.float32 if X.dtype == np.float32 else torch.float64
        fm = self.feature_map_
        if fm.param_dtype != dt:
            fm = copy.deepcopy(fm).to(dt)  # a temporary copy: transform leaves the estimator unchanged
        rbf = self.kernel == "rbf"
        with torch.no_grad():
            # a new (writable) array: torch.from_numpy shares memory and warns on read-only input
            xs = torch.from_numpy(np.ascontiguousarray(X * X.dtype.type(math.sqrt((2.0 if rbf else 1.0) * self.gamma_))))
            f, ls = fm.log_features(xs)
            if rbf:
                ls = ls - _sqnorm_half(xs)  # e^{-gamma |x|^2} = e^{-|x~|^2 / 2}, computed as in the map
            out = f.mul_(torch.exp(ls).to(f.dtype).unsqueeze(-1)).numpy()
        if not np.isfinite(out).all():
            warnings.warn(
                f"{type(self).__name__}: some features overflowed {out.dtype} (the softmax kernel "
                f"exp(gamma x.y) is unbounded); lower gamma or standardise X",
                RuntimeWarning,
                stacklevel=2,
            )
        return out

    def __sklearn_tags__(self):
        tags = super().__sklearn_tags__()
        tags.transformer_tags.preserves_dtype = ["float64", "float32"]
        return tags
