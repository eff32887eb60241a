r"""Learned feature maps (Hedgehog).

A learned map $\varphi_\theta$ has trainable parameters $\theta$ (an ``nn.Module`` with
``nn.Parameter`` s, ``learned = True``), fitted so that linear attention with
$\varphi_\theta$ reproduces the *attention weights* of softmax attention on calibration
data (`kernelapprox.training.fit_feature_map`, a module above attention). It is not random and not an estimator of $e^{q^\top k}$:
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

import math
from typing import Any, ClassVar

import torch
from torch import nn

from .._logdomain import LOG2E, _grad, _op_into
from .._validation import (
    as_batch_shape,
    broadcast_shapes,
    check_device,
    check_dtype,
    check_positive_int,
)
from ..registry import register_estimator
from ..samplers import make_generator
from .base import FeatureMap

__all__ = ["HedgehogFeatures"]

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
    ``f`` = the features and ``log_scale = 0`` (``= g`` with a gain). Queries and keys share the map. Gradients reach
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
    gain : bool, default False
        Add a learned overall scale $e^{g}$ ($g$ = ``log_gain``, one per batch entry, initially
        0): $\varphi_g(x) = e^{g}\varphi(x)$, $\hat K = e^{2g}\varphi(q)^\top\varphi(k)$.
        It cancels in linear attention and matters where the kernel meets exact
        $e^{q^\top k}$ terms: in `kernelapprox.hybrid_attention` it sets the remainder's mass
        against the exact window's (the window factor of LoLCATs [Zha25]_, on the linear term).
        `fit_gain` sets it (`fit_feature_map` with a window calls it). Caveat: $\varphi(q)^\top\varphi(k)\le 1$
        for these maps, so without a gain their kernel is far below $e^{q^\top k}$ wherever
        the logits are large; with it the kernel's scale is fitted to data, a learned kernel rather
        than an approximation of $e^{q^\top k}$.

    Attributes
    ----------
    weight : nn.Parameter, shape (*batch_shape, f, d)
    bias : nn.Parameter of shape (*batch_shape, f), or None
    log_gain : nn.Parameter of shape batch_shape, or None
        $g$ (``gain=True``).

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
    log_gain: nn.Parameter | None

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
        gain: bool = False,
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
        if not isinstance(gain, bool):
            raise TypeError(f"gain must be a bool, got {gain!r}")
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
        if gain:
            self.log_gain = nn.Parameter(torch.zeros(self.batch_shape, device=device, dtype=dt))
        else:
            self.register_parameter("log_gain", None)
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
            if self.log_gain is not None:
                self.log_gain.zero_()
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
            z = z.add_(b) if not _grad(z, b) and z.shape == broadcast_shapes(z.shape, b.shape) else z + b
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

    def _gain(self, like: torch.Tensor) -> torch.Tensor | None:
        """``log_gain`` as a column ``(*batch_shape, 1)`` in ``like``'s dtype, or ``None`` without a gain."""
        if self.log_gain is None:
            return None
        return self.log_gain.to(like.dtype).unsqueeze(-1)

    def forward(self, x):
        xc, out_dtype = self._prepare("x", x)
        e = self._fla_unnormalised(xc)
        phi = self._phi(xc) if e is None else e.div_(e.sum(-1, keepdim=True))
        g = self._gain(phi)
        if g is not None:
            phi = phi * torch.exp(g).unsqueeze(-1)
        return phi.to(out_dtype)

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
        f, ls = self._log_features(x, shared)
        g = self._gain(ls)
        return (f, ls) if g is None else (f, ls + g)

    def _log_features(self, x: torch.Tensor, shared: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """`log_features` without the gain."""
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

    def _log2_phi(self, x: torch.Tensor) -> torch.Tensor:
        r"""$\log_2\varphi(x)$ (without the gain), (..., n, 2f): log-softmax in base 2."""
        z = self._project(self._prepare("x", x)[0])
        if self.variant == "fla":
            u = torch.cat((2 * z, -2 * z), dim=-1)
            return (u - torch.logsumexp(u, dim=-1, keepdim=True)) * LOG2E
        return torch.cat((torch.log_softmax(z, dim=-1), torch.log_softmax(-z, dim=-1)), dim=-1) * LOG2E

    def query_log2_features(self, x):
        return self._log2_phi(x)

    def key_log2_features(self, x):
        lf = self._log2_phi(x)
        g = self._gain(lf)
        return lf if g is None else lf + (g * LOG2E).unsqueeze(-1)

    def query_features(self, x):
        xc = self._prepare("x", x)[0]
        e = self._fla_unnormalised(xc)  # the per-query normalisation (and the gain) cancels in attention
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
        if self.log_gain is not None:  # absent: the default, no gain
            out["gain"] = True
        out["device"] = self.weight.device
        return out

    def extra_repr(self) -> str:
        s = f"dim={self.dim}, num_features={self.num_features}, variant={self.variant!r}, bias={self.bias is not None}"
        if self.log_gain is not None:
            s += ", gain=True"
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
