r"""Learned feature maps (Hedgehog) and their distillation from softmax attention.

A learned map $\varphi_\theta$ has trainable parameters $\theta$ (an ``nn.Module`` with
``nn.Parameter`` s, ``learned = True``), fitted so that linear attention with
$\varphi_\theta$ reproduces the *attention weights* of softmax attention on calibration
data (`fit_feature_map`). It is not random and not an estimator of $e^{q^\top k}$:
there is no unbiasedness or variance theory; its fidelity is measured (`distillation_loss`,
attention-output errors against `kernelapprox.softmax_attention`).

- ``hedgehog`` (``variant="fla"``): $\varphi(x)$, $z = Wx + b$: $\mathrm{softmax}([2z, -2z])$ (one normalisation, 2f entries); feature_dim: 2f
- ``hedgehog-lolcats``: $\varphi(x)$, $z = Wx + b$: $[\mathrm{softmax}(z), \mathrm{softmax}(-z)]$ (two); feature_dim: 2f

References
----------
- [Zha24] M. Zhang, K. Bhatia, H. Kumbong, C. Ré. "The Hedgehog & the Porcupine: Expressive
   Linear Attentions with Softmax Mimicry", ICLR 2024, arXiv:2402.04347 (eq. 5: the distillation
   loss; the map as implemented in flash-linear-attention's ``HedgehogFeatureMap``).
- [Zha25] M. Zhang, S. Arora, R. Chalamala, A. Wu, B. Spector, A. Singhal, K. Ramesh, C. Ré.
   "LoLCATs: On Low-Rank Linearizing of Large Language Models", ICLR 2025, arXiv:2410.10254 (the
   ``SoftmaxDim`` feature map of the HazyResearch/lolcats code).
"""

from __future__ import annotations

import importlib
import math
from collections.abc import Iterable
from typing import Any, ClassVar, cast

import torch
from torch import nn

from .._logdomain import LOG2E, _grad, _op_into
from .._validation import (
    as_batch_shape,
    check_device,
    check_dtype,
    check_floating,
    check_last_dim,
    check_positive_int,
    inputs_validated,
    no_autocast,
)
from ..registry import register_estimator
from ..samplers import make_generator
from .base import FeatureMap

__all__ = ["HedgehogFeatures", "fit_feature_map", "distillation_loss"]

VARIANTS = ("fla", "lolcats")
INITS = ("identity", "kaiming")
OPTIMIZERS = ("adam", "sgd")


class HedgehogFeatures(FeatureMap):
    r"""Hedgehog's trainable softmax feature map [Zha24]_, in its two published forms.

    With $z = Wx + b$ ($W \in \mathbb R^{f\times d}$, $b \in \mathbb R^f$,
    one pair per entry of ``batch_shape``):

    * ``variant="fla"`` (flash-linear-attention's ``HedgehogFeatureMap``; estimator
        ``"hedgehog"``): one softmax over the $2f$ entries,

        $$
        \varphi(x) = \mathrm{softmax}\big([2z, -2z]\big),\qquad
        \varphi(x)_j = \frac{e^{\pm 2 z_j}}{\sum_{l=1}^f 2\cosh(2 z_l)},\qquad
        \textstyle\sum_j \varphi(x)_j = 1;
        $$

    * ``variant="lolcats"`` (LoLCATs' ``SoftmaxDim`` [Zha25]_; estimator ``"hedgehog-lolcats"``):
        two separate softmaxes,

        $$
        \varphi(x) = \big[\mathrm{softmax}(z), \mathrm{softmax}(-z)\big],
        \qquad \text{each half sums to 1.}
        $$

    ``feature_dim = 2f``. The two are different kernels: in linear attention the per-query factor
    cancels, the per-key one does not, and the key normalisers differ
    ($\sum_l 2\cosh 2z_l$ once, versus $\sum_l e^{z_l}$ and $\sum_l e^{-z_l}$
    weighting the two halves separately), so no rescaling of $W$ maps one onto the other.

    Features are positive and bounded ($0 < \varphi_j \le 1$): `log_features` returns
    ``f`` = the features and ``log_scale = 0``. Queries and keys share the map. Gradients reach
    ``weight`` and ``bias`` through every entry point (``fm(x)``, ``fm.kernel``,
    `kernelapprox.linear_attention`).

    Parameters
    ----------
    dim : int
        Input dimension ``d``.
    num_features : int, optional
        ``f``, the number of rows of $W$ (default ``d``); ``feature_dim = 2f``.
    variant : {"fla", "lolcats"}, default "fla"
    bias : bool, optional
        Learn $b$. Default: the reference of the variant (``nn.Linear`` with a bias for
        ``"fla"``; no bias for ``"lolcats"``).
    init : {"identity", "kaiming"}, default "identity"
        ``"identity"``: $W = I_{f\times d}$ (ones on the diagonal, zero elsewhere:
        $W = I$ when ``f = d``; both references start there). ``"kaiming"``: ``nn.Linear``'s
        $U(-1/\sqrt d, 1/\sqrt d)$ entries, drawn from ``seed``/``generator``. $b = 0$
        in both.
    batch_shape : tuple of int, default ()
        Independent maps, $W$ of shape ``(*batch_shape, f, d)``, broadcast against the
        input's leading dimensions: ``(H,)`` for one map per head of a ``(B, H, n, d)`` input.
    seed : int, optional
        Seed of the ``"kaiming"`` draw (a fresh CPU generator); ``None`` draws from torch's
        default generator, as ``nn.Linear`` does. Unused by ``"identity"``.
    generator : torch.Generator, optional
        A CPU generator to draw from instead of ``seed``.
    device, dtype : optional
        Where and in which dtype the parameters live (default: CPU, the default dtype). Inputs in
        16 bits are computed in float32, as everywhere in the library.
    sampler : optional
        Accepted and ignored (generic code builds every estimator the same way).

    Attributes
    ----------
    weight : nn.Parameter, shape (*batch_shape, f, d)
    bias : nn.Parameter of shape (*batch_shape, f), or None

    References
    ----------
    [Zha24]_ (arXiv:2402.04347), [Zha25]_ (arXiv:2410.10254).

    Examples
    --------
    >>> fm = HedgehogFeatures(4)  # identity init: phi(x) = softmax([2x, -2x])
    >>> x = torch.tensor([[1.0, 0.0, 0.0, 0.0]])
    >>> phi = fm(x).detach()
    >>> phi.shape, round(float(phi.sum()), 6)
    (torch.Size([1, 8]), 1.0)
    >>> lol = HedgehogFeatures(4, variant="lolcats")  # [softmax(x), softmax(-x)]
    >>> halves = lol(x).detach().split(4, dim=-1)
    >>> [round(float(h.sum()), 6) for h in halves]
    [1.0, 1.0]
    """

    is_random: ClassVar[bool] = False
    positive: ClassVar[bool] = True
    learned: ClassVar[bool] = True
    symmetric: ClassVar[bool] = True

    weight: nn.Parameter
    bias: nn.Parameter | None

    def __init__(
        self,
        dim: int,
        num_features: int | None = None,
        *,
        variant: str = "fla",
        bias: bool | None = None,
        init: str = "identity",
        batch_shape: tuple[int, ...] = (),
        seed: int | None = None,
        generator: torch.Generator | None = None,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
        sampler: object = None,
    ) -> None:
        super().__init__()
        self.dim = check_positive_int("dim", dim)
        self.num_features = self.dim if num_features is None else check_positive_int("num_features", num_features)
        if not isinstance(variant, str) or variant not in VARIANTS:
            raise ValueError(f"variant must be one of {VARIANTS}, got {variant!r}")
        if not isinstance(init, str) or init not in INITS:
            raise ValueError(f"init must be one of {INITS}, got {init!r}")
        if bias is None:
            bias = variant == "fla"
        if not isinstance(bias, bool):
            raise TypeError(f"bias must be a bool or None, got {bias!r}")
        device = check_device("device", device)
        dtype = check_dtype("dtype", dtype)
        self.variant = variant
        self.init = init
        self.batch_shape = as_batch_shape(batch_shape)
        dt = dtype or torch.get_default_dtype()
        f, d = self.num_features, self.dim
        self.weight = nn.Parameter(torch.empty(*self.batch_shape, f, d, device=device, dtype=dt))
        if bias:
            self.bias = nn.Parameter(torch.empty(*self.batch_shape, f, device=device, dtype=dt))
        else:
            self.register_parameter("bias", None)
        self.reset_parameters(seed=seed, generator=generator)

    def reset_parameters(self, seed: int | None = None, generator: torch.Generator | None = None) -> HedgehogFeatures:
        """Re-initialise ``weight`` and ``bias`` in place with the map's ``init`` rule. Returns ``self``.

        ``seed`` and ``generator`` as in the constructor (used by ``init="kaiming"`` only).
        """
        g = make_generator(seed, generator)  # validates seed/generator for both inits
        f, d = self.num_features, self.dim
        if self.init == "identity":
            W = torch.eye(f, d, dtype=torch.float64).expand(*self.batch_shape, f, d)
        else:
            bound = 1.0 / math.sqrt(d)
            W = (2 * torch.rand(*self.batch_shape, f, d, generator=g, dtype=torch.float64) - 1) * bound
        with torch.no_grad():
            self.weight.copy_(W)
            if self.bias is not None:
                self.bias.zero_()
        return self

    # ------------------------------------------------------------------ computation
    def _project(self, xc: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
        """$z = \\text{scale}\\cdot(Wx + b)$, shape (*broadcast(lead, batch_shape), n, f), in ``xc``'s
        dtype (``scale`` folded into the f x d weight, not applied to the output)."""
        W = self.weight.to(xc.dtype)
        z = torch.matmul(xc, W.mT if scale == 1.0 else (W * scale).mT)
        if self.bias is not None:
            b = self.bias.to(xc.dtype)
            b = (b if scale == 1.0 else b * scale).unsqueeze(-2)
            z = z.add_(b) if not _grad(z, b) and z.shape == torch.broadcast_shapes(z.shape, b.shape) else z + b
        return z

    def _no_grad(self, xc: torch.Tensor) -> bool:
        """Whether autograd records nothing here (the in-place, base-2 paths may run)."""
        return not _grad(xc, *self.parameters())

    def _phi(self, xc: torch.Tensor) -> torch.Tensor:
        if self.variant == "lolcats" and self._no_grad(xc):
            # [softmax(z), softmax(-z)] in one buffer, in place (no concatenation of two
            # softmaxes); z in base-2 units (LOG2E folded into W and b), so exp2 (faster
            # than exp on CPU, docs/performance.md) gives the same exp(z - max z)
            z = self._project(xc, LOG2E)
            lo, hi = torch.aminmax(z, dim=-1, keepdim=True)
            f = z.shape[-1]
            out = z.new_empty(*z.shape[:-1], 2 * f)
            _op_into(torch.sub, out[..., :f], z, hi)
            _op_into(torch.sub, out[..., f:], lo, z)
            out.exp2_()
            out[..., :f].div_(out[..., :f].sum(-1, keepdim=True))
            out[..., f:].div_(out[..., f:].sum(-1, keepdim=True))
            return out
        z = self._project(xc)
        if self.variant == "fla":
            return torch.softmax(torch.cat((2 * z, -2 * z), dim=-1), dim=-1)
        return torch.cat((torch.softmax(z, dim=-1), torch.softmax(-z, dim=-1)), dim=-1)

    def forward(self, x):
        xc, out_dtype = self._prepare("x", x)
        e = self._fla_unnormalised(xc)
        if e is None:
            return self._phi(xc).to(out_dtype)
        return e.div_(e.sum(-1, keepdim=True)).to(out_dtype)

    def _fla_unnormalised(self, xc: torch.Tensor) -> torch.Tensor | None:
        """``exp(u - max u)`` for ``u = [2z, -2z]`` (fla variant, no autograd), else ``None``.

        Written into one buffer, exponentiated in place: the softmax without its per-row
        normalisation, which attention either cancels (queries) or carries in the log scale (keys).
        """
        if self.variant != "fla" or not self._no_grad(xc):
            return None
        z = self._project(xc, LOG2E)  # base 2: exp2 below
        lo, hi = torch.aminmax(z, dim=-1)
        neg_m = (-2.0 * torch.maximum(hi, -lo)).unsqueeze(-1)
        f = z.shape[-1]
        out = z.new_empty(*z.shape[:-1], 2 * f)
        _op_into(torch.add, out[..., :f], neg_m, z, alpha=2.0)  # 2z - m
        _op_into(torch.add, out[..., f:], neg_m, z, alpha=-2.0)  # -2z - m
        return out.exp2_()

    def log_features(self, x, shared=False):
        xc, _ = self._prepare("x", x)
        e = self._fla_unnormalised(xc)
        if e is None:
            f = self._phi(xc)
            shape = (*f.shape[:-2], 1) if shared else f.shape[:-1]
            return f, f.new_zeros(shape)
        # phi = e / sum(e): bounded e, per-row log scale -log sum(e) (in [-log 2f, 0])
        ls = -torch.log(e.sum(-1).double())  # sum in [1, 2f]: float32 accumulation is exact enough
        if not shared:
            return e, ls
        M = ls.amax(-1, keepdim=True)
        return e.mul_(torch.exp(ls - M).to(e.dtype).unsqueeze(-1)), M

    def query_features(self, x):
        xc = self._prepare("x", x)[0]
        e = self._fla_unnormalised(xc)  # the per-query normalisation cancels in attention
        return self._phi(xc) if e is None else e

    def get_params(self) -> dict[str, Any]:
        """Constructor arguments that rebuild an equivalent map (freshly initialised, not trained).

        Examples
        --------
        >>> HedgehogFeatures(4, 6, variant="lolcats").get_params()["bias"]
        False
        """
        out = super().get_params()
        out["bias"] = self.bias is not None
        out["device"] = self.weight.device
        return out

    def extra_repr(self) -> str:
        s = f"dim={self.dim}, num_features={self.num_features}, variant={self.variant!r}, bias={self.bias is not None}"
        if self.batch_shape:
            s += f", batch_shape={self.batch_shape}"
        return s


register_estimator(
    HedgehogFeatures, name="hedgehog", label="hedgehog (fla)", params={"variant": "fla"}, feature_dim="2r",
)
register_estimator(
    HedgehogFeatures, name="hedgehog-lolcats", label="hedgehog (lolcats)", params={"variant": "lolcats"},
    feature_dim="2r",
)


# ---------------------------------------------------------------------------------- distillation


def _check_real(name: str, value: object, *, positive: bool) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        try:
            value = float(cast(Any, value))  # numpy scalars, 0-d tensors
        except (TypeError, ValueError):
            raise TypeError(f"{name} must be a real number, got {value!r} ({type(value).__name__})") from None
    v = float(value)
    if not math.isfinite(v) or (positive and v <= 0):
        raise ValueError(f"{name} must be a {'positive ' if positive else ''}finite number, got {value!r}")
    return v


def _check_bool(name: str, value: object) -> bool:
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be a bool, got {value!r}")
    return value


def _validate(fm: object, q: object, k: object, causal: object, scale: object) -> tuple[FeatureMap, float]:
    """Shared checks of `distillation_loss` and `fit_feature_map`."""
    if not isinstance(fm, FeatureMap):
        raise TypeError(f"fm must be a kernelapprox FeatureMap, got {type(fm).__name__}")
    if not fm.positive:
        raise TypeError(
            f"fm must have positive features (the distillation loss takes log phi(q).phi(k)); "
            f"{type(fm).__name__} is signed"
        )
    q, k = check_floating("q", q), check_floating("k", k)
    check_last_dim("q", q, fm.dim)
    check_last_dim("k", k, fm.dim)
    causal = _check_bool("causal", causal)
    if causal and q.shape[-2] != k.shape[-2]:
        raise ValueError(
            f"causal distillation needs as many queries as keys, got q {tuple(q.shape)} and k {tuple(k.shape)}"
        )
    try:
        torch.broadcast_shapes(q.shape[:-2], k.shape[:-2], fm.batch_shape)
    except RuntimeError:
        raise ValueError(
            f"leading dimensions of q {tuple(q.shape[:-2])}, k {tuple(k.shape[:-2])} and the feature "
            f"map's batch_shape {fm.batch_shape} do not broadcast"
        ) from None
    return fm, _check_real("scale", scale, positive=False)


def _row_losses(
    fm: FeatureMap, q: torch.Tensor, k: torch.Tensor, rows: torch.Tensor | None, causal: bool, scale: float
) -> torch.Tensor:
    r"""Cross-entropy $-\sum_j A_{ij}\log\hat A_{ij}$ of the query rows ``rows`` (all if None).

    ``q``, ``k`` validated and in the compute dtype. Shape (*broadcast(lead, batch_shape), n_rows).
    """
    qs = q if rows is None else q.index_select(-2, rows)
    with torch.no_grad():
        target_logits = scale * torch.matmul(qs, k.mT)
        mask = None
        if causal:
            i = torch.arange(q.shape[-2], device=q.device) if rows is None else rows
            j = torch.arange(k.shape[-2], device=q.device)
            mask = j.unsqueeze(0) > i.unsqueeze(1)  # (n_rows, m): key after query
            target_logits = target_logits.masked_fill(mask, float("-inf"))
        A = torch.softmax(target_logits, dim=-1)
    with inputs_validated():
        fq, _ = fm.log_features(qs)  # per-query scale: cancels in the row normalisation
        fk, sk = fm.key_log_features(k)  # per-key scale: kept
    G = torch.matmul(fq, fk.mT)
    logits = torch.log(G.clamp_min(torch.finfo(G.dtype).tiny)) + sk.to(G.dtype).unsqueeze(-2)
    if mask is not None:
        logits = logits.masked_fill(mask, float("-inf"))
    log_hat = torch.log_softmax(logits, dim=-1)
    if mask is not None:
        log_hat = log_hat.masked_fill(mask, 0.0)  # A = 0 there: no 0 * (-inf)
    return -(A.to(log_hat.dtype) * log_hat).sum(-1)


@no_autocast
def distillation_loss(
    fm: FeatureMap, q: torch.Tensor, k: torch.Tensor, *, causal: bool = False, scale: float = 1.0
) -> torch.Tensor:
    r"""Hedgehog's distillation loss [Zha24]_ eq. 5: cross-entropy of linear-attention weights
    against softmax-attention weights, averaged over query rows (and all leading dimensions).

    $$
    A_{ij} = \operatorname{softmax}_j\big(\text{scale}\cdot q_i^\top k_j\big),\qquad
    \hat A_{ij} = \frac{\varphi(q_i)^\top\varphi(k_j)}{\sum_l \varphi(q_i)^\top\varphi(k_l)},\qquad
    \mathcal L = -\frac1n\sum_i\sum_j A_{ij}\log\hat A_{ij}
    $$

    ($j, l \le i$ when causal). Its minimum over $\hat A$ is the entropy of
    $A$, reached at $\hat A = A$. Computed in the log domain ($\log\hat A$ by a
    log-softmax over $\log\varphi(q_i)^\top\varphi(k_j)$), in the library's compute dtype;
    differentiable with respect to the map's parameters.

    Parameters
    ----------
    fm : FeatureMap
        A map with positive features (any: learned, random or deterministic).
    q : Tensor, shape (..., n, d)
    k : Tensor, shape (..., m, d)
        Leading dimensions broadcast with each other and with ``fm.batch_shape``. The map sees
        ``q`` and ``k`` as given.
    causal : bool, default False
        Mask keys ``j > i`` in both attentions (``n == m``).
    scale : float, default 1.0
        Multiplies the logits of the *target* only: ``scale=1`` is
        `kernelapprox.softmax_attention` on the same ``q, k`` (the library's convention:
        inputs already carry $d^{-1/4}$ each); raw projections with ``scale=d**-0.5`` give
        the usual transformer attention.

    Returns
    -------
    Tensor, 0-d, dtype the compute dtype (at least float32).

    Examples
    --------
    >>> q = k = torch.eye(4, dtype=torch.float64)
    >>> fm = HedgehogFeatures(4, dtype=torch.float64)
    >>> loss = distillation_loss(fm, q, k)
    >>> loss.shape, bool(loss > 0)
    (torch.Size([]), True)
    """
    fm, scale = _validate(fm, q, k, causal, scale)
    cdt = fm.compute_dtype(q.dtype, k.dtype)
    return _row_losses(fm, q.to(cdt), k.to(cdt), None, causal, scale).mean()


@no_autocast
def fit_feature_map(
    fm: FeatureMap,
    q: torch.Tensor,
    k: torch.Tensor,
    *,
    steps: int = 200,
    lr: float = 1e-2,
    batch_size: int | None = None,
    causal: bool = False,
    scale: float = 1.0,
    seed: int | None = None,
    progress: bool = True,
    optimizer: str = "adam",
) -> list[float]:
    r"""Fit a learned feature map by distilling softmax attention into linear attention [Zha24]_.

    Minimises `distillation_loss` (the cross-entropy between the exact attention rows
    $A_{i\cdot}$ and the linearised rows $\hat A_{i\cdot}$, [Zha24]_ eq. 5) over the
    map's trainable parameters, in place, with ``steps`` steps of Adam (or SGD).

    Heads: with ``fm.batch_shape = (H,)`` each head has its own parameters; the objective is the
    *sum over the map's batch entries* of their mean row losses, so each head receives exactly the
    gradient it would get if fitted alone (the heads are fitted independently, in one batched
    computation).

    Parameters
    ----------
    fm : FeatureMap
        A learned map (``fm.learned`` true, e.g. `HedgehogFeatures`) with positive features.
    q : Tensor, shape (..., n, d)
    k : Tensor, shape (..., m, d)
        Calibration queries and keys, as passed to attention (see ``scale``); not modified.
    steps : int, default 200
        Optimiser steps.
    lr : float, default 1e-2
        Learning rate.
    batch_size : int, optional
        Query rows per step, drawn without replacement (the same rows in every leading
        dimension); every key is used. ``None`` (or ``>= n``): all rows, full-batch.
    causal : bool, default False
        Distil causal attention (keys ``j <= i``; ``n == m``).
    scale : float, default 1.0
        Multiplies the logits of the target attention only (the map always sees ``q`` and ``k``
        as given): ``1.0`` matches `kernelapprox.softmax_attention` on the same inputs.
    seed : int, optional
        Seed of the row subsampling (a fresh CPU generator). With a seed the fit is deterministic:
        bit-identical parameters and history on the same machine. ``None``: torch's default
        generator. Unused without ``batch_size``.
    progress : bool, default True
        Show a tqdm progress bar (if tqdm is installed) with the current loss.
    optimizer : {"adam", "sgd"}, default "adam"

    Returns
    -------
    list of float
        The loss history: entry ``t`` is the mean row cross-entropy (over the step's rows and all
        leading dimensions, heads included) at the parameters *before* step ``t``'s update.

    Raises
    ------
    TypeError
        ``fm`` is not a learned map (``fm.learned`` false: nothing to train) or has signed
        features; bad argument types.
    ValueError
        Bad ``steps``, ``lr``, ``batch_size``, ``scale`` or ``optimizer``; non-finite ``q`` or
        ``k``; shapes that do not match; a map whose parameters are all frozen.
    FloatingPointError
        The loss became non-finite (lower ``lr``); the parameters are left as they were before
        that step.

    Notes
    -----
    The map's train/eval mode, the ``requires_grad`` flags and any ``.grad`` of its parameters
    are restored on return; only the parameter values change. Runs under ``torch.enable_grad``
    (callable from inside ``torch.no_grad``).

    Examples
    --------
    >>> g = torch.Generator().manual_seed(0)
    >>> k = torch.randn(32, 4, generator=g, dtype=torch.float64)
    >>> q = k + 0.1 * torch.randn(32, 4, generator=g, dtype=torch.float64)
    >>> fm = HedgehogFeatures(4, dtype=torch.float64)
    >>> hist = fit_feature_map(fm, q, k, steps=30, lr=0.05, seed=0, progress=False)
    >>> len(hist), hist[-1] < hist[0]
    (30, True)
    """
    if isinstance(fm, FeatureMap) and not fm.learned:
        raise TypeError(
            f"fm must be a learned feature map (fm.learned true, e.g. HedgehogFeatures); "
            f"{type(fm).__name__} has no trainable parameters"
        )
    fm, scale = _validate(fm, q, k, causal, scale)
    steps = check_positive_int("steps", steps)
    lr = _check_real("lr", lr, positive=True)
    n = q.shape[-2]
    if batch_size is not None:
        batch_size = check_positive_int("batch_size", batch_size)
    rows_per_step = n if batch_size is None else min(batch_size, n)
    progress = _check_bool("progress", progress)
    if not isinstance(optimizer, str) or optimizer not in OPTIMIZERS:
        raise ValueError(f"optimizer must be one of {OPTIMIZERS}, got {optimizer!r}")
    g = make_generator(seed, None)
    for name, t in (("q", q), ("k", k)):
        if not bool(torch.isfinite(t).all()):
            raise ValueError(f"{name} contains non-finite values (NaN or Inf): cannot fit on them")
    params = [p for p in fm.parameters() if p.requires_grad]
    if not params:
        raise ValueError(f"fm ({type(fm).__name__}) has no parameter with requires_grad=True: nothing to fit")

    cdt = fm.compute_dtype(q.dtype, k.dtype)
    qc, kc = q.detach().to(cdt), k.detach().to(cdt)
    copies = math.prod(fm.batch_shape)  # the objective sums the map copies' mean losses
    opt: torch.optim.Optimizer = (
        torch.optim.Adam(params, lr=lr) if optimizer == "adam" else torch.optim.SGD(params, lr=lr)
    )
    was_training = fm.training
    saved_grads = [p.grad for p in params]
    for p in params:
        p.grad = None
    history: list[float] = []
    bar = _progress(range(steps), progress)
    try:
        fm.train()
        with torch.enable_grad():
            for t in bar:
                rows = None
                if rows_per_step < n:
                    rows = torch.randperm(n, generator=g)[:rows_per_step].to(qc.device)
                per_row = _row_losses(fm, qc, kc, rows, causal, scale)
                mean = per_row.mean()
                value = float(mean.detach())
                if not math.isfinite(value):
                    raise FloatingPointError(
                        f"the distillation loss became non-finite at step {t} (lr={lr}); the "
                        "parameters are those before this step"
                    )
                history.append(value)
                opt.zero_grad(set_to_none=True)
                (mean * copies).backward()
                opt.step()
                if hasattr(bar, "set_postfix"):
                    bar.set_postfix(loss=f"{value:.4g}", refresh=False)
    finally:
        if hasattr(bar, "close"):
            bar.close()
        fm.train(was_training)
        for p, gr in zip(params, saved_grads, strict=True):
            p.grad = gr
    return history


def _progress(it: Iterable[int], enabled: bool) -> Any:
    """A tqdm bar over ``it`` (disabled unless ``enabled``); the bare iterable without tqdm."""
    try:
        tqdm = importlib.import_module("tqdm.auto").tqdm  # optional dependency, untyped
    except ImportError:  # pragma: no cover - tqdm is optional
        return it
    return tqdm(it, desc="fit_feature_map", unit="step", disable=not enabled, leave=False, dynamic_ncols=True)
