r"""Drop-in linear-attention layers: multi-head attention with any feature map $\varphi$.

Two modules, one computation (`kernelapprox.linear_attention`):

* `LinearAttention`: a complete attention layer, input ``(batch, n, dim)``: query, key and
  value projections, ``heads`` heads, the output projection; its `LinearAttention.forward_heads`
  takes per-head tensors instead.
* `LinearAttentionHeads`: the attention of per-head tensors ``(batch, heads, n, dim_head)``
  alone, without projections: the counterpart of performer-pytorch's ``FastAttention``.
* `MultiheadLinearAttention`: `LinearAttention` behind `torch.nn.MultiheadAttention`'s
  constructor and call signature, returning ``(out, None)``: it replaces the ``self_attn`` of a
  `torch.nn.TransformerEncoderLayer` (or any code calling ``attn(query, key, value,
  key_padding_mask=..., attn_mask=...)``).

Each head computes

$$
o_i = \frac{\varphi(s^{1/2} q_i)^\top \sum_{j} \varphi(s^{1/2} k_j)\, v_j^\top}
           {\varphi(s^{1/2} q_i)^\top \sum_{j} \varphi(s^{1/2} k_j)}
\qquad (j \le i \text{ if causal}),
$$

so that $\varphi(s^{1/2}q)^\top\varphi(s^{1/2}k)$ estimates the kernel $e^{s\,q^\top k}$ of
softmax attention with temperature $s$ (default $s = d_h^{-1/2}$, i.e. inputs scaled by
$d_h^{-1/4}$ as in the Performer code). Random maps draw one projection per head
(``batch_shape=(heads,)``) and can be redrawn on a schedule (``redraw_every``). Migration from
performer-pytorch and the exact redraw semantics: ``docs/attention-layer.md``.
"""

from __future__ import annotations

import functools
import hashlib
import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any, cast

import torch
from torch import nn

from ._validation import check_device, check_dtype, check_positive_int
from .attention import LinearAttentionState
from .attention._common import padding_mask
from .attention.hybrid import HybridAttentionState, check_window, check_window_mode
from .attention.padded import check_window_sinks, padded_attention
from .maps.base import FeatureMap
from .maps.spec import default_num_features, resolve_feature_map
from .samplers import GivenSampler, Sampler

__all__ = ["LinearAttention", "LinearAttentionHeads", "MultiheadLinearAttention", "default_num_features"]

FeatureMapSpec = str | FeatureMap | Callable[[int, int], FeatureMap]

#: Attribute set on a feature map once a layer has checked it (`LinearAttentionHeads`, ``check``).
_CHECKED = "_kernelapprox_checked"


def _check_bool(name: str, value: object) -> bool:
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be a bool, got {value!r} ({type(value).__name__})")
    return value


def _check_optional_int(name: str, value: object) -> int | None:
    return None if value is None else check_positive_int(name, value)


def _check_scale(scale: object, dim_head: int) -> float:
    if scale is None:
        return dim_head**-0.5
    if isinstance(scale, bool) or not isinstance(scale, (int, float)):
        raise TypeError(f"scale must be a positive float or None, got {scale!r} ({type(scale).__name__})")
    s = float(scale)
    if not (math.isfinite(s) and s > 0):
        raise ValueError(f"scale must be a positive finite float, got {scale!r}")
    return s


def _check_dropout(p: object) -> float:
    if isinstance(p, bool) or not isinstance(p, (int, float)):
        raise TypeError(f"dropout must be a float in [0, 1), got {p!r} ({type(p).__name__})")
    if not 0 <= float(p) < 1:
        raise ValueError(f"dropout must be a float in [0, 1), got {p!r}")
    return float(p)


def resolve_attn_mask(
    attn_mask: torch.Tensor | None, batch: int, heads: int, n: int, m: int
) -> tuple[bool, torch.Tensor | None]:
    r"""Read an attention mask as (causal, key padding): the two patterns linear attention has.

    ``attn_mask`` follows `torch.nn.MultiheadAttention`: bool, ``True`` = *not* allowed, or
    float, added to the scores (``0`` allowed, ``-inf`` not; other values raise: an arbitrary
    bias on $q_i^\top k_j$ has no linear-attention form); shape (n, m), (batch, n, m) or
    (batch * heads, n, m) (the heads must then agree). With $A_{ij}$ = "query $i$ may see key
    $j$" and $p_j = \exists i\, A_{ij}$ (key $j$ is not padding), the mask must be
    $A_{ij} = p_j$ (key padding) or $A_{ij} = p_j \wedge (j \le i)$ (causal, ``n == m``,
    with key padding); anything else (sliding windows, block-diagonal packing, ...) raises a
    ``ValueError``. One host synchronisation per call with a mask; under ``torch.compile`` the
    layers read the pattern on the device instead (no graph break, no host synchronisation: both
    the causal and the non-causal form are computed and one is kept, unless ``is_causal=True``
    says which; a mask of another pattern then fails a device-side assertion).

    Returns
    -------
    causal : bool
    key_padding_mask : Tensor, shape (1 or batch, m), bool (True = padded), or None
    """
    if attn_mask is None:
        return False, None
    if not isinstance(attn_mask, torch.Tensor):
        raise TypeError(f"attn_mask must be a torch.Tensor or None, got {type(attn_mask).__name__}")
    shape = tuple(attn_mask.shape)
    if attn_mask.dtype.is_floating_point:
        if not bool(((attn_mask == 0) | (attn_mask == float("-inf"))).all()):
            raise ValueError(
                f"attn_mask (shape {shape}) is a float mask with values other than 0 and -inf: linear attention "
                "takes 0/-inf (or bool) masks only, an arbitrary additive bias has no linear-attention form"
            )
        blocked = attn_mask == float("-inf")
    elif attn_mask.dtype == torch.bool:
        blocked = attn_mask
    else:
        raise TypeError(f"attn_mask must be a bool or float tensor (True/-inf = not allowed), got dtype {attn_mask.dtype}")
    want = f"({n}, {m}), ({batch}, {n}, {m}) or ({batch * heads}, {n}, {m}) = (n, m), (batch, n, m) or (batch * heads, n, m)"
    if blocked.dim() not in (2, 3) or shape[-2:] != (n, m):
        raise ValueError(f"attn_mask has shape {shape}; expected {want}")
    if blocked.dim() == 2:
        blocked = blocked.unsqueeze(0)
    elif shape[0] == batch * heads and heads > 1:
        per_head = blocked.reshape(batch, heads, n, m)
        if not bool((per_head == per_head[:, :1]).all()):
            raise ValueError(
                f"attn_mask of shape {shape} differs between heads: linear attention takes one causal or "
                "key-padding pattern per sequence"
            )
        blocked = per_head[:, 0]
    elif shape[0] not in (1, batch):
        raise ValueError(f"attn_mask has shape {shape}; expected {want}")
    allowed = ~blocked
    valid = allowed.any(dim=-2)  # (B', m): keys some query may see
    padding = valid.unsqueeze(-2).expand_as(allowed)
    if bool((allowed == padding).all()):
        causal = False
    elif n == m and bool((allowed == (padding & torch.ones(n, m, dtype=torch.bool, device=allowed.device).tril())).all()):
        causal = True
    else:
        raise ValueError(
            f"attn_mask (shape {shape}) is neither causal (True above the diagonal) nor a key-padding pattern "
            "(whole key columns masked), nor both: linear attention has no form for other patterns (sliding "
            "windows, packed sequences); pass key_padding_mask and causal for what it can do"
        )
    pad = None if bool(valid.all()) else ~valid
    return causal, pad


def _attn_mask_traced(
    attn_mask: torch.Tensor, batch: int, heads: int, n: int, m: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """`resolve_attn_mask` under ``torch.compile``: the same reading with no host synchronisation.

    The shape checks are the same (shapes are static); the pattern is read into tensors,
    ``causal`` a 0-dim bool tensor and the key padding a (1 or batch, m) bool tensor, and a mask
    that is neither pattern (or a float mask with other values than 0 and -inf) fails a
    device-side ``torch._assert_async``.
    """
    if not isinstance(attn_mask, torch.Tensor):
        raise TypeError(f"attn_mask must be a torch.Tensor or None, got {type(attn_mask).__name__}")
    shape = tuple(attn_mask.shape)
    if attn_mask.dtype.is_floating_point:
        ok = ((attn_mask == 0) | (attn_mask == float("-inf"))).all()
        blocked = attn_mask == float("-inf")
    elif attn_mask.dtype == torch.bool:
        ok = torch.ones((), dtype=torch.bool, device=attn_mask.device)
        blocked = attn_mask
    else:
        raise TypeError(f"attn_mask must be a bool or float tensor (True/-inf = not allowed), got dtype {attn_mask.dtype}")
    want = f"({n}, {m}), ({batch}, {n}, {m}) or ({batch * heads}, {n}, {m}) = (n, m), (batch, n, m) or (batch * heads, n, m)"
    if blocked.dim() not in (2, 3) or shape[-2:] != (n, m):
        raise ValueError(f"attn_mask has shape {shape}; expected {want}")
    if blocked.dim() == 2:
        blocked = blocked.unsqueeze(0)
    elif shape[0] == batch * heads and heads > 1:
        per_head = blocked.reshape(batch, heads, n, m)
        ok = ok & (per_head == per_head[:, :1]).all()
        blocked = per_head[:, 0]
    elif shape[0] not in (1, batch):
        raise ValueError(f"attn_mask has shape {shape}; expected {want}")
    allowed = ~blocked
    valid = allowed.any(dim=-2)
    padding = valid.unsqueeze(-2).expand_as(allowed)
    is_pad = (allowed == padding).all()
    causal = ~is_pad
    if n == m:
        tril = torch.ones(n, m, dtype=torch.bool, device=allowed.device).tril()
        causal = causal & (allowed == (padding & tril)).all()
    torch._assert_async(
        ok & (is_pad | causal),
        "attn_mask is neither causal nor a key-padding pattern (or a float mask with values other than 0 and -inf)",
    )
    return causal, ~valid


def _merge_padding(a: torch.Tensor | None, b: torch.Tensor | None) -> torch.Tensor | None:
    if a is None:
        return b
    if b is None:
        return a
    return a | b


def _derived_seed(seed: int, index: int) -> int:
    """Seed of redraw number ``index`` of a layer seeded with ``seed``: a hash, so that the redraw
    streams of two layers (``seed=0`` and ``seed=1``) never coincide."""
    digest = hashlib.blake2b(f"kernelapprox.nn:{seed}:{index}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") % (2**62)


def _build_feature_map(
    feature_map: object,
    *,
    dim_head: int,
    heads: int,
    num_features: int | None,
    sampler: str | Sampler | None,
    feature_map_kwargs: Mapping[str, Any] | None,
    seed: int | None,
    device: torch.device | str | None,
    dtype: torch.dtype | None,
) -> FeatureMap:
    """The layer's map: built by name, taken as given, or from a factory (`resolve_feature_map`); then validated."""
    if isinstance(feature_map, FeatureMap):
        extra = {
            "num_features": num_features, "sampler": sampler, "feature_map_kwargs": feature_map_kwargs,
        }
        given = [k for k, v in extra.items() if v is not None]
        if given:
            raise TypeError(
                f"{', '.join(given)} only apply to a feature map built by name; got a "
                f"{type(feature_map).__name__} instance (configure it when building it)"
            )
    elif not isinstance(feature_map, str) and callable(feature_map):
        if num_features is not None or sampler is not None or feature_map_kwargs is not None:
            raise TypeError(
                "num_features, sampler and feature_map_kwargs only apply to a feature map built by "
                "name; a factory feature_map(dim_head, heads) configures the map itself"
            )
    elif not isinstance(feature_map, str):
        raise TypeError(
            "feature_map must be an estimator name (e.g. 'positive'), a kernelapprox FeatureMap or a "
            f"factory feature_map(dim_head, heads) -> FeatureMap, got {type(feature_map).__name__}"
        )
    fm = resolve_feature_map(
        feature_map, dim=dim_head, heads=heads, num_features=num_features, sampler=sampler, seed=seed,
        options=feature_map_kwargs, device=device, dtype=dtype,
    )
    if fm.dim != dim_head:
        raise ValueError(f"feature_map has dim={fm.dim}, but the heads have dim_head={dim_head}")
    bs = tuple(fm.batch_shape)
    if bs not in ((), (1,), (heads,)):
        raise ValueError(
            f"feature_map has batch_shape={bs}; a layer with heads={heads} needs () (one map shared "
            f"by all heads) or ({heads},) (one per head)"
        )
    return fm


@functools.cache
def _eager_tick() -> Callable[[LinearAttentionHeads], None]:
    """`LinearAttentionHeads._count_call` run outside ``torch.compile`` graphs. Built on first
    use: ``torch.compiler.disable`` imports ``torch._dynamo``, which ``import kernelapprox`` must
    not load."""
    return torch.compiler.disable(LinearAttentionHeads._count_call)


class LinearAttentionHeads(nn.Module):
    r"""Linear attention on per-head tensors ``(batch, heads, n, dim_head)``, with a redraw schedule.

    The counterpart of performer-pytorch's ``FastAttention``: no projections, only the attention
    of given queries, keys and values, computed by `kernelapprox.linear_attention` with the
    queries and keys scaled by $s^{1/2}$, so that the kernel estimated is $e^{s\,q^\top k}$:

    $$
    o_i = \frac{\sum_{j} \hat K_{ij}\, v_j}{\sum_{j} \hat K_{ij}},\qquad
    \hat K_{ij} = \varphi(s^{1/2} q_i)^\top \varphi(s^{1/2} k_j) \approx e^{s\, q_i^\top k_j}
    \qquad (j \le i \text{ if causal}).
    $$

    Parameters
    ----------
    dim_head : int
        $d_h$, the last dimension of ``q`` and ``k``.
    heads : int, default 1
        Number of heads $H$. Maps built by name or by a factory get one independent draw per head
        (``batch_shape=(heads,)``).
    causal : bool, default False
        Token ``i`` attends to keys ``j <= i`` only.
    feature_map : str, FeatureMap or callable, default "positive"
        An estimator name (``ka.estimators()``; built with ``ka.get_estimator(name).build(dim_head,
        num_features, sampler=..., seed=seed, batch_shape=(heads,), **feature_map_kwargs)``), a
        `kernelapprox.FeatureMap` with ``dim == dim_head`` and ``batch_shape`` ``()``
        (shared by all heads) or ``(heads,)``, used as is (not copied), or a factory
        ``feature_map(dim_head, heads) -> FeatureMap``.
    num_features : int, optional
        $r$ for a map built by name. Default for random maps: `default_num_features`,
        $\lfloor d_h \ln d_h\rfloor$ (performer-pytorch's default).
    sampler : str or Sampler, optional
        Sampler of a random map built by name. Default ``ka.DEFAULT_SAMPLER = "orthogonal"``
        (FAVOR+'s orthogonal rows, with the QR sign correction and chi norms: unbiased).
    feature_map_kwargs : mapping, optional
        Further constructor arguments of a map built by name (``{"variant": "offset"}``, ...).
    scale : float, optional
        The temperature $s$ of the kernel $e^{s\,q^\top k}$. Default $d_h^{-1/2}$.
    redraw_every : int, optional
        Redraw a random map's projection, in place, every ``redraw_every`` *training-mode forward
        calls*: training-mode call number $t = 1, 2, \dots$ uses draw number
        $\lfloor (t - 1)/N \rfloor$ (draw 0 is the initial one), i.e. the map is redrawn at the
        start of calls $N + 1, 2N + 1, \dots$, before it is used. Calls in eval mode
        (``module.eval()``) neither count nor redraw. A call counts once whatever it does after
        (no backward, ``torch.no_grad()``, gradient accumulation): with $m$ forward calls per
        optimiser step, pass ``m * steps``. ``None``: never redraw. Needs a random map that can
        draw (not one from ``from_projection`` without a ``sampler``). The count is saved in
        ``state_dict`` (extra state), so a resumed run keeps the schedule.
    seed : int, optional
        Seed of the initial draw of a map built by name (a given map or a factory's map is drawn
        by its maker) and of every redraw: redraw number $j$ uses a seed hashed from
        ``(seed, j)``, the same after a reload. ``None``: torch's global generator, like
        ``nn.Linear``'s initialisation (``torch.manual_seed`` makes it reproducible).
    fit : bool, default False
        Call ``feature_map.fit(q, k)`` on every call (data-dependent maps: OPRF/FAVOR++,
        FAVOR#, Nyström), see `kernelapprox.linear_attention`.
    check : bool, default True
        On the first call of each map (the first in eager mode, per `FeatureMap` object), run
        `kernelapprox.diagnose.warn_if_hopeless` on the scaled queries and keys: a
        `kernelapprox.KernelApproxWarning` when the map's closed form predicts a relative kernel
        MSE above 1 on that batch (the map cannot approximate softmax attention there; inputs not
        scaled, or r far too small). One $O(nd)$ evaluation and one host synchronisation per map,
        none per call; skipped inside ``torch.compile``. ``False`` turns it off.
    chunk_size : int, default 64
        Tokens per chunk of the causal form.
    dropout : float, default 0.0
        Attention dropout in training mode: each key (per head and sequence) is dropped with
        probability $p$ for every query, its value scaled by $1/(1 - p)$ and its
        denominator term kept,
        $o_i = \sum_j a_{ij}\, \frac{\delta_j}{1-p}\, v_j$ with $\delta_j \sim
        \mathrm{Bernoulli}(1-p)$ and $a_{ij}$ the normalised weights: $E[o_i]$ is the
        output without dropout, as with `torch.nn.MultiheadAttention`'s dropout of the weights
        (which draws $\delta_{ij}$ per weight; one draw per key is what a linear form can apply
        without forming the weights). Off in eval mode.
    window : int, optional
        Hybrid attention (`kernelapprox.hybrid_attention`): softmax is exact on a window of
        ``window`` keys ($0 \le i - j < w$ causal, $|i - j| < w$ non-causal) and on the
        ``sinks``, the feature map estimates the rest, one normaliser for both:
        $o_i = (\sum_{j\in S_i} e^{s q_i^\top k_j} v_j + \hat\varphi_i^\top\sum_{j\in R_i}
        \hat\varphi_j v_j^\top) / (\dots)$. ``window >= n`` is softmax attention. Default
        ``None``: plain linear attention. Self-attention only (``n == m``).
    sinks : int or sequence of int, default 0
        With a ``window``: a count of leading positions (``1``: a BOS token) or positions
        (non-causal: negative ones count from the end, ``[0, -1]`` for [CLS] and [SEP]), exact for
        every query that attends to them (`kernelapprox.attention.hybrid.resolve_sinks`).
        Padded keys (``key_padding_mask``) are left out of the window and the sinks too.
    window_mode : {"token", "block"}, default "token"
        With a ``window``: the sliding window, or the block-aligned one (blocks of ``window``
        tokens, exact on a query's block and its neighbours; causal: its block up to itself and
        the previous block), see `kernelapprox.hybrid_attention`. ``"block"`` has no decoding
        state (``return_state``/``initial_state`` raise).
    device, dtype : optional
        Where and in which dtype a map built by name lives (a given map is moved if given).

    Attributes
    ----------
    feature_map : FeatureMap
        The map (a submodule; its projection is a buffer, saved in ``state_dict``).
    training_calls : int
        Training-mode forward calls so far (inside ``torch.compile``, counted only when a redraw
        schedule is set).
    redraws : int
        Redraws made by the schedule or by `redraw` so far.

    Examples
    --------
    >>> import torch
    >>> from kernelapprox.nn import LinearAttentionHeads
    >>> attn = LinearAttentionHeads(16, heads=4, causal=True, num_features=32, seed=0)
    >>> q, k, v = torch.randn(3, 2, 4, 10, 16).unbind(0)       # (batch, heads, n, dim_head)
    >>> attn(q, k, v).shape
    torch.Size([2, 4, 10, 16])
    >>> attn.feature_map.weight.shape                           # one projection per head
    torch.Size([4, 32, 16])
    """

    def __init__(
        self,
        dim_head: int,
        *,
        heads: int = 1,
        causal: bool = False,
        feature_map: FeatureMapSpec = "positive",
        num_features: int | None = None,
        sampler: str | Sampler | None = None,
        feature_map_kwargs: Mapping[str, Any] | None = None,
        scale: float | None = None,
        redraw_every: int | None = None,
        seed: int | None = None,
        fit: bool = False,
        check: bool = True,
        chunk_size: int = 64,
        dropout: float = 0.0,
        window: int | None = None,
        sinks: int | Sequence[int] = 0,
        window_mode: str = "token",
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        self.dim_head = check_positive_int("dim_head", dim_head)
        self.window = None if window is None else check_window(window)
        self.sinks = check_window_sinks(sinks, self.window)
        self.window_mode = check_window_mode(window_mode)
        device = check_device("device", device)
        check_dtype("dtype", dtype)
        self.dropout = _check_dropout(dropout)
        self.heads = check_positive_int("heads", heads)
        self.causal = _check_bool("causal", causal)
        self.fit = _check_bool("fit", fit)
        self.check = _check_bool("check", check)
        self.chunk_size = check_positive_int("chunk_size", chunk_size)
        self.scale = _check_scale(scale, self.dim_head)
        if seed is not None:
            if isinstance(seed, bool) or not isinstance(seed, int):
                raise TypeError(f"seed must be a non-negative int or None, got {seed!r} ({type(seed).__name__})")
            if seed < 0:
                raise ValueError(f"seed must be a non-negative int or None, got {seed}")
        self.seed = seed
        num_features = _check_optional_int("num_features", num_features)
        self.feature_map = _build_feature_map(
            feature_map, dim_head=self.dim_head, heads=self.heads, num_features=num_features,
            sampler=sampler, feature_map_kwargs=feature_map_kwargs, seed=seed, device=device, dtype=dtype,
        )
        self.training_calls = 0
        self.redraws = 0
        self.redraw_every = redraw_every  # validated by the property setter

    # ------------------------------------------------------------------ redraw schedule
    @property
    def redraw_every(self) -> int | None:
        """Redraw period in training-mode forward calls (``None``: never); settable."""
        return self._redraw_every

    @redraw_every.setter
    def redraw_every(self, value: int | None) -> None:
        value = _check_optional_int("redraw_every", value)
        if value is not None:
            self._check_can_redraw(f"redraw_every={value}")
            _eager_tick()  # built here, in eager mode, before any compiled call needs it
        self._redraw_every = value

    def _check_can_redraw(self, what: str) -> None:
        fm = self.feature_map
        if not fm.is_random:
            raise ValueError(
                f"{what} needs a random feature map; {type(fm).__name__} is not random (nothing to redraw)"
            )
        if isinstance(getattr(fm, "sampler", None), GivenSampler):
            raise ValueError(
                f"{what}: the feature map was built from a given projection without a sampler, so it "
                "cannot draw; build it with from_projection(W, sampler='orthogonal') (or another sampler)"
            )

    @torch.no_grad()
    def redraw(self, seed: int | None = None) -> LinearAttentionHeads:
        """Redraw the map's projection now, in place (as the schedule does). Returns ``self``.

        Parameters
        ----------
        seed : int, optional
            Seed of this draw. Default: derived from the layer's ``seed`` and the redraw count
            (torch's global generator if the layer has no seed).

        Examples
        --------
        >>> attn = LinearAttentionHeads(8, heads=2, num_features=16, seed=0)
        >>> W = attn.feature_map.weight.clone()
        >>> bool((attn.redraw().feature_map.weight != W).any()), attn.redraws
        (True, 1)
        """
        self._check_can_redraw("redraw()")
        self.redraws += 1
        if seed is None and self.seed is not None:
            seed = _derived_seed(self.seed, self.redraws)
        self.feature_map.redraw(seed=seed)
        return self

    def _tick(self) -> None:
        """Count a training-mode call; redraw first when the schedule says so.

        Inside ``torch.compile`` the count runs outside the graph (a graph break) when a schedule
        is set; without one there is nothing to redraw, and compiled calls are not counted, so
        that a compiled model has no graph break here.
        """
        if not self.training:
            return
        if torch.compiler.is_compiling():
            if self._redraw_every is not None:
                _eager_tick()(self)
            return
        self._count_call()

    def _count_call(self) -> None:
        every = self._redraw_every
        if every is not None and self.training_calls > 0 and self.training_calls % every == 0:
            self.redraw()
        self.training_calls += 1

    def get_extra_state(self) -> dict[str, int]:
        """The schedule's counters, saved in ``state_dict``."""
        return {"training_calls": self.training_calls, "redraws": self.redraws}

    def set_extra_state(self, state: dict[str, int]) -> None:
        """Restore the counters saved by `get_extra_state`."""
        if not isinstance(state, Mapping) or not {"training_calls", "redraws"} <= set(state):
            raise ValueError(f"extra state must be a dict with training_calls and redraws, got {state!r}")
        self.training_calls = int(state["training_calls"])
        self.redraws = int(state["redraws"])

    # ------------------------------------------------------------------ attention
    def _check_heads(self, name: str, t: object, kv: bool = False) -> torch.Tensor:
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 4:
            raise ValueError(
                f"{name} must have shape (batch, heads, n, features) with 4 dimensions, got shape {tuple(t.shape)}"
            )
        if kv and self.heads % t.shape[1] == 0:  # grouped-query heads (see linear_attention)
            return t
        if tuple(self.feature_map.batch_shape) == (self.heads,) and self.heads != 1 and t.shape[1] != self.heads:
            raise ValueError(
                f"{name} has {t.shape[1]} heads (shape {tuple(t.shape)}), but the feature map holds "
                f"one projection per head for heads={self.heads}"
            )
        return t

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        *,
        key_padding_mask: torch.Tensor | None = None,
        initial_state: LinearAttentionState | HybridAttentionState | None = None,
        return_state: bool = False,
    ) -> torch.Tensor | tuple[torch.Tensor, LinearAttentionState | HybridAttentionState]:
        r"""Attention of per-head queries, keys and values (one training-mode call of the schedule).

        Parameters
        ----------
        q : Tensor, shape (batch, heads, n, dim_head)
        k : Tensor, shape (batch, heads, m, dim_head)
        v : Tensor, shape (batch, heads, m, dv)
            ``m == n`` if causal. ``k`` and ``v`` may have fewer heads, dividing ``heads``
            (grouped-query attention, `kernelapprox.linear_attention`).
        key_padding_mask : Tensor, optional
            Shape (batch, m), bool ``True`` = padded key (or float 0/-inf), as in
            `torch.nn.MultiheadAttention`; see `kernelapprox.linear_attention`.
        initial_state : LinearAttentionState, optional
            The state returned by a previous call on the preceding tokens (``return_state=True``),
            continued here: two segments with the state give the result of one pass (decoding:
            segments of one token). Valid only with the projection it was computed with (the
            schedule redraws in training mode only). With a ``window``: the
            `kernelapprox.attention.hybrid.HybridAttentionState` of a causal call.
        return_state : bool, default False
            Also return the state after the last token.

        Returns
        -------
        out : Tensor, shape (batch, heads, n, dv), dtype ``promote(q, k, v)``
        state : LinearAttentionState, if ``return_state``; ``kv`` of shape
            (batch, heads, feature_dim, dv + 1). With a ``window``: a ``HybridAttentionState``.
        """
        q = self._check_heads("q", q)
        k = self._check_heads("k", k, kv=True)
        v = self._check_heads("v", v, kv=True)
        _check_bool("return_state", return_state)
        pad = padding_mask(key_padding_mask, k.shape)
        self._tick()
        return self._attend(q, k, v, initial_state, return_state, pad)

    def _attend(self, q, k, v, initial_state, return_state, key_padding_mask=None, causal=None):
        if self.dropout > 0 and self.training:  # one draw per key (see dropout), numerator only
            keep = torch.empty((*v.shape[:-1], 1), dtype=v.dtype, device=v.device).bernoulli_(1 - self.dropout)
            v = v * keep / (1 - self.dropout)
        if self.scale != 1.0:
            root = self.scale**0.5
            q, k = q * root, k * root
        fm = self.feature_map
        if self.fit:
            fm.fit(q, k)
        if self.check and not torch.compiler.is_compiling() and not getattr(fm, _CHECKED, False):
            from .diagnose import warn_if_hopeless  # the statistics load on the first check only

            # padded keys (any content) out of the statistics: zero keys, of kernel value 1
            kc = k if key_padding_mask is None else k.masked_fill(key_padding_mask.unsqueeze(-1), 0.0)
            warn_if_hopeless(fm, q, kc)
            object.__setattr__(fm, _CHECKED, True)  # a plain flag: once per map, not per layer or call
        return padded_attention(
            q, k, v, fm, window=self.window, sinks=self.sinks, causal=self.causal if causal is None else causal,
            chunk_size=self.chunk_size, initial_state=initial_state, return_state=return_state,
            key_padding_mask=key_padding_mask, window_mode=self.window_mode,
        )

    def _hybrid_repr(self) -> str:
        if self.window is None:
            return ""
        mode = "" if self.window_mode == "token" else f", window_mode={self.window_mode!r}"
        return f", window={self.window}, sinks={self.sinks}{mode}"

    def extra_repr(self) -> str:
        s = f"dim_head={self.dim_head}, heads={self.heads}, causal={self.causal}, scale={self.scale:.4g}"
        s += self._hybrid_repr()
        if self.dropout:
            s += f", dropout={self.dropout}"
        if self._redraw_every is not None:
            s += f", redraw_every={self._redraw_every}"
        return s


class LinearAttention(nn.Module):
    r"""Multi-head linear attention layer: a drop-in replacement of softmax attention.

    $$
    Q = XW_Q,\ K = CW_K,\ V = CW_V \text{ (split into } H \text{ heads)},\qquad
    \mathrm{out} = \big[\mathrm{LA}(Q_h, K_h, V_h)\big]_{h=1}^{H}\, W_O + b_O,
    $$

    with $C = X$ (self-attention) or the ``context`` (cross-attention), and $\mathrm{LA}$ the
    linear attention of `LinearAttentionHeads` (kernel $e^{s\,q^\top k}$ estimated by
    $\varphi$, $s = d_h^{-1/2}$ by default, the scale of `torch.nn.MultiheadAttention`). Cost
    $O(n F d_h)$ per head instead of $O(n^2 d_h)$; causal decoding carries a fixed-size state.
    `MultiheadLinearAttention` wraps it behind `torch.nn.MultiheadAttention`'s signature.

    Parameters
    ----------
    dim : int
        Model dimension (last dimension of the input and of the output).
    heads : int, default 8
    dim_head : int, optional
        Default ``dim // heads`` (then ``dim`` must be a multiple of ``heads``).
    causal : bool, default False
    feature_map, num_features, sampler, feature_map_kwargs, scale, redraw_every, seed, fit, check, chunk_size, dropout
        As in `LinearAttentionHeads` (``redraw_every`` counts calls of `forward`
        and `forward_heads` in training mode).
    window, sinks, window_mode : optional
        Hybrid attention, as in `LinearAttentionHeads`: softmax exact on a window of ``window``
        keys and on the sinks, the feature map for the rest (self-attention only: ``context=``
        raises). ``window=None`` (default): linear attention.
    qkv_bias : bool, default False
        Biases of the query, key and value projections (performer-pytorch's default).
    out_bias : bool, default True
        Bias of the output projection.
    kdim, vdim : int, optional
        Last dimension of the keys' and the values' input (cross-attention on a context of another
        width); default ``dim``. As in `torch.nn.MultiheadAttention`.
    batch_first : bool, default True
        Inputs and outputs (batch, n, dim); ``False``: (n, batch, dim), transposed on the way in
        and out (masks stay (batch, m)).
    device, dtype : optional
        Of the projections and of a map built by name.

    Attributes
    ----------
    to_q, to_k, to_v : nn.Linear
        ``dim -> heads * dim_head`` (``kdim``, ``vdim`` for keys and values; the names of
        performer-pytorch's ``Attention``).
    to_out : nn.Linear
        ``heads * dim_head -> dim``.
    attention : LinearAttentionHeads
        The per-head attention, owning the feature map and the redraw schedule.

    Examples
    --------
    >>> import torch
    >>> from kernelapprox.nn import LinearAttention
    >>> _ = torch.manual_seed(0)
    >>> layer = LinearAttention(32, heads=4, causal=True, num_features=16, redraw_every=100)
    >>> x = torch.randn(2, 10, 32)                            # (batch, n, dim)
    >>> out, state = layer(x[:, :6], return_state=True)       # a prompt ...
    >>> out2 = layer(x[:, 6:], initial_state=state)           # ... continued
    >>> full = layer(x)
    >>> out2.shape, bool(torch.allclose(full[:, 6:], out2, atol=1e-5))
    (torch.Size([2, 4, 32]), True)

    Padding and cross-attention:

    >>> mask = torch.zeros(2, 10, dtype=torch.bool)
    >>> mask[0, 7:] = True                                    # sequence 0 has 7 tokens
    >>> bool(torch.allclose(layer(x, key_padding_mask=mask)[0, :7], layer(x[:1, :7])[0], atol=1e-5))
    True
    >>> cross = LinearAttention(32, heads=4, num_features=16, kdim=12, vdim=12)
    >>> cross(x, context=torch.randn(2, 30, 12)).shape
    torch.Size([2, 10, 32])
    """

    def __init__(
        self,
        dim: int,
        *,
        heads: int = 8,
        dim_head: int | None = None,
        causal: bool = False,
        feature_map: FeatureMapSpec = "positive",
        num_features: int | None = None,
        sampler: str | Sampler | None = None,
        feature_map_kwargs: Mapping[str, Any] | None = None,
        scale: float | None = None,
        redraw_every: int | None = None,
        seed: int | None = None,
        fit: bool = False,
        check: bool = True,
        chunk_size: int = 64,
        dropout: float = 0.0,
        qkv_bias: bool = False,
        out_bias: bool = True,
        kdim: int | None = None,
        vdim: int | None = None,
        batch_first: bool = True,
        window: int | None = None,
        sinks: int | Sequence[int] = 0,
        window_mode: str = "token",
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        self.dim = check_positive_int("dim", dim)
        self.heads = check_positive_int("heads", heads)
        device = check_device("device", device)
        check_dtype("dtype", dtype)
        if dim_head is None:
            if self.dim % self.heads:
                raise ValueError(
                    f"dim={self.dim} is not a multiple of heads={self.heads}; pass dim_head explicitly"
                )
            dim_head = self.dim // self.heads
        self.dim_head = check_positive_int("dim_head", dim_head)
        self.kdim = self.dim if kdim is None else check_positive_int("kdim", kdim)
        self.vdim = self.dim if vdim is None else check_positive_int("vdim", vdim)
        self.batch_first = _check_bool("batch_first", batch_first)
        inner = self.heads * self.dim_head
        _check_bool("qkv_bias", qkv_bias)
        _check_bool("out_bias", out_bias)
        factory = {"device": device, "dtype": dtype}
        self.to_q = nn.Linear(self.dim, inner, bias=qkv_bias, **factory)
        self.to_k = nn.Linear(self.kdim, inner, bias=qkv_bias, **factory)
        self.to_v = nn.Linear(self.vdim, inner, bias=qkv_bias, **factory)
        self.to_out = nn.Linear(inner, self.dim, bias=out_bias, **factory)
        self.attention = LinearAttentionHeads(
            self.dim_head, heads=self.heads, causal=causal, feature_map=feature_map,
            num_features=num_features, sampler=sampler, feature_map_kwargs=feature_map_kwargs,
            scale=scale, redraw_every=redraw_every, seed=seed, fit=fit, check=check,
            chunk_size=chunk_size, dropout=dropout, window=window, sinks=sinks, window_mode=window_mode,
            device=device, dtype=dtype,
        )

    @property
    def feature_map(self) -> FeatureMap:
        """The feature map (``self.attention.feature_map``)."""
        return self.attention.feature_map

    @property
    def causal(self) -> bool:
        """Whether token ``i`` attends to ``j <= i`` only."""
        return self.attention.causal

    @property
    def window(self) -> int | None:
        """Window of hybrid attention (``self.attention.window``; ``None``: linear attention)."""
        return self.attention.window

    @property
    def sinks(self) -> int | tuple[int, ...]:
        """Sinks of hybrid attention (``self.attention.sinks``)."""
        return self.attention.sinks

    @property
    def redraw_every(self) -> int | None:
        """Redraw period in training-mode calls (``self.attention.redraw_every``); settable."""
        return self.attention.redraw_every

    @redraw_every.setter
    def redraw_every(self, value: int | None) -> None:
        self.attention.redraw_every = value

    def redraw(self, seed: int | None = None) -> LinearAttention:
        """Redraw the feature map's projection now, in place (`LinearAttentionHeads.redraw`)."""
        self.attention.redraw(seed)
        return self

    def split_heads(self, t: torch.Tensor) -> torch.Tensor:
        """(batch, n, heads * dim_head) -> (batch, heads, n, dim_head)."""
        b, n, _ = t.shape
        return t.reshape(b, n, self.heads, self.dim_head).transpose(1, 2)

    def merge_heads(self, t: torch.Tensor) -> torch.Tensor:
        """(batch, heads, n, dim_head) -> (batch, n, heads * dim_head)."""
        b, h, n, dh = t.shape
        return t.transpose(1, 2).reshape(b, n, h * dh)

    def forward(
        self,
        x: torch.Tensor,
        context: torch.Tensor | None = None,
        *,
        key_padding_mask: torch.Tensor | None = None,
        attn_mask: torch.Tensor | None = None,
        initial_state: LinearAttentionState | None = None,
        return_state: bool = False,
    ) -> torch.Tensor | tuple[torch.Tensor, LinearAttentionState]:
        r"""Self-attention of a sequence, or cross-attention to a ``context``.

        Parameters
        ----------
        x : Tensor, shape (batch, n, dim)
            (n, batch, dim) if ``batch_first=False``.
        context : Tensor, shape (batch, m, kdim), optional
            Keys and values come from it (cross-attention; ``kdim == vdim``, else use
            `MultiheadLinearAttention` with separate key and value). Not with ``causal=True``.
        key_padding_mask : Tensor, shape (batch, m), optional
            ``True`` (or ``-inf``) where the key is padding, as in `torch.nn.MultiheadAttention`:
            the real tokens' outputs are those of the unpadded sequence.
        attn_mask : Tensor, optional
            `torch.nn.MultiheadAttention`'s ``attn_mask`` (bool ``True`` = not allowed, or float
            0/-inf; (n, m), (batch, n, m) or (batch * heads, n, m)), where it is causal or a
            key-padding pattern (`resolve_attn_mask`); other patterns raise ``ValueError``. A
            causal mask makes this call causal; a causal layer stays causal.
        initial_state : LinearAttentionState, optional
            State returned for the preceding tokens (``return_state=True``): the layer continues
            that sequence (causal decoding: one token at a time, at a cost independent of the
            position).
        return_state : bool, default False
            Also return the attention state after the last token.

        Returns
        -------
        out : Tensor, shape (batch, n, dim)
            (n, batch, dim) if ``batch_first=False``.
        state : LinearAttentionState, if ``return_state``; ``kv`` of shape
            (batch, heads, feature_dim, dim_head + 1).
        """
        if context is not None:
            if self.kdim != self.vdim:
                raise ValueError(
                    f"context= gives keys and values from one tensor, but kdim={self.kdim} != vdim={self.vdim}; "
                    "call MultiheadLinearAttention (or _forward) with separate key and value"
                )
            if self.causal:
                raise ValueError("context= (cross-attention) with a causal layer: causal attention is self-attention")
            if self.window is not None:
                raise ValueError(
                    f"context= (cross-attention) with window={self.window}: the window of hybrid attention is a "
                    "set of positions of the same sequence (self-attention); build the cross-attention layer "
                    "with window=None"
                )
        kv = x if context is None else context
        return self._forward(x, kv, kv, key_padding_mask=key_padding_mask, attn_mask=attn_mask,
                             initial_state=initial_state, return_state=return_state)

    def _forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        *,
        key_padding_mask: torch.Tensor | None = None,
        attn_mask: torch.Tensor | None = None,
        is_causal: bool = False,
        initial_state: LinearAttentionState | None = None,
        return_state: bool = False,
    ) -> torch.Tensor | tuple[torch.Tensor, LinearAttentionState]:
        """`forward` with separate key and value inputs (the path of `MultiheadLinearAttention`)."""
        layout = "(batch, n, " if self.batch_first else "(n, batch, "
        checks = (("x", query, "dim", self.dim), ("key", key, "kdim", self.kdim), ("value", value, "vdim", self.vdim))
        for name, t, dim_name, width in checks:
            if not isinstance(t, torch.Tensor):
                raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
            if t.dim() != 3 or t.shape[-1] != width:
                raise ValueError(f"{name} must have shape {layout}{dim_name}={width}), got shape {tuple(t.shape)}")
            if not t.is_floating_point():
                raise TypeError(
                    f"{name} must be a floating-point tensor (the layer computes in {self.to_q.weight.dtype}), got "
                    f"dtype {t.dtype}; token ids go through an embedding first"
                )
            if t.shape[1 if self.batch_first else 0] == 0:
                raise ValueError(
                    f"{name} is an empty sequence (shape {tuple(t.shape)}, batch_first={self.batch_first}); "
                    "need n >= 1 tokens"
                )
        _check_bool("return_state", return_state)
        if self.window is not None and key is not query:
            raise ValueError(
                f"window={self.window} (hybrid attention) needs self-attention: key must be the query tensor "
                "itself (the window is a set of positions of one sequence); got a different key tensor. "
                "Build cross-attention layers with window=None"
            )
        if not self.batch_first:  # sequence-first in, sequence-first out
            query, key, value = (t.transpose(0, 1) for t in (query, key, value))
        b, n = query.shape[:2]
        m = key.shape[1]
        if key.shape[:2] != value.shape[:2] or key.shape[0] != b:
            raise ValueError(
                f"key and value must share (batch, m) with batch = {b} of the queries; got key {tuple(key.shape)} "
                f"and value {tuple(value.shape)} (batch_first={self.batch_first})"
            )
        causal_t: torch.Tensor | None = None  # the mask's pattern, read on the device under torch.compile
        pad: torch.Tensor | None
        if attn_mask is not None and torch.compiler.is_compiling():
            causal_t, pad = _attn_mask_traced(attn_mask, b, self.heads, n, m)
            causal = False
        else:
            causal, pad = resolve_attn_mask(attn_mask, b, self.heads, n, m)
        if key_padding_mask is not None:
            kpm = padding_mask(key_padding_mask, torch.Size((b, m, 1)))
            pad = _merge_padding(pad, kpm)
        causal = self.causal or causal or bool(is_causal)
        if causal:
            causal_t = None
        elif causal_t is not None and (return_state or initial_state is not None):
            raise ValueError(
                "attn_mask with return_state or initial_state under torch.compile: the mask's pattern (causal or "
                "key padding) is read on the device there; pass is_causal=True (or build the layer with "
                "causal=True) for a causal mask, or key_padding_mask for a padding one"
            )
        q = self.split_heads(self.to_q(query))
        k = self.split_heads(self.to_k(key))
        v = self.split_heads(self.to_v(value))
        if pad is not None:
            pad = pad.reshape(pad.shape[0], 1, m)  # (batch, 1, m): all heads
        self.attention._tick()
        if causal_t is not None:  # both forms, chosen on the device: no graph break, no host sync
            heads_out = torch.where(
                causal_t,
                self.attention._attend(q, k, v, None, False, pad, True),
                self.attention._attend(q, k, v, None, False, pad, False),
            )
            state = None
        else:
            res = self.attention._attend(q, k, v, initial_state, return_state, pad, causal)
            heads_out, state = res if return_state else (res, None)
        out = self.to_out(self.merge_heads(heads_out))
        if not self.batch_first:
            out = out.transpose(0, 1)
        if state is not None:
            return out, cast(LinearAttentionState, state)
        return cast(torch.Tensor, out)

    def forward_heads(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        *,
        key_padding_mask: torch.Tensor | None = None,
        initial_state: LinearAttentionState | None = None,
        return_state: bool = False,
    ) -> torch.Tensor | tuple[torch.Tensor, LinearAttentionState]:
        """Attention of per-head tensors, bypassing the projections (`LinearAttentionHeads.forward`).

        Parameters
        ----------
        q : Tensor, shape (batch, heads, n, dim_head)
        k : Tensor, shape (batch, heads, m, dim_head)
        v : Tensor, shape (batch, heads, m, dv)
        key_padding_mask : Tensor, shape (batch, m), optional
        initial_state : LinearAttentionState, optional
        return_state : bool, default False

        Returns
        -------
        out : Tensor, shape (batch, heads, n, dv)
        state : LinearAttentionState, if ``return_state``

        Examples
        --------
        >>> layer = LinearAttention(32, heads=4, num_features=16, seed=0)
        >>> q, k, v = torch.randn(3, 1, 4, 7, 8).unbind(0)
        >>> layer.forward_heads(q, k, v).shape
        torch.Size([1, 4, 7, 8])
        """
        return self.attention(q, k, v, key_padding_mask=key_padding_mask, initial_state=initial_state,
                              return_state=return_state)

    def extra_repr(self) -> str:
        s = f"dim={self.dim}, heads={self.heads}, dim_head={self.dim_head}"
        s += self.attention._hybrid_repr()
        if (self.kdim, self.vdim) != (self.dim, self.dim):
            s += f", kdim={self.kdim}, vdim={self.vdim}"
        if not self.batch_first:
            s += ", batch_first=False"
        return s


class MultiheadLinearAttention(nn.Module):
    r"""`LinearAttention` with `torch.nn.MultiheadAttention`'s signature: a drop-in ``self_attn``.

    ``MultiheadLinearAttention(embed_dim, num_heads, dropout, bias, kdim=, vdim=, batch_first=)``
    builds ``LinearAttention(embed_dim, heads=num_heads, qkv_bias=bias, out_bias=bias, ...)``
    (further keyword arguments, ``feature_map=``, ``num_features=``, ``causal=``, ... go to it),
    and ``forward(query, key, value, key_padding_mask=None, need_weights=True, attn_mask=None,
    average_attn_weights=True, is_causal=False)`` returns ``(out, None)``: linear attention never
    forms the $n \times m$ weights, so none are returned whatever ``need_weights`` says. The
    scale is MultiheadAttention's $d_h^{-1/2}$. Masks: ``key_padding_mask`` as in
    `kernelapprox.linear_attention`, ``attn_mask`` where it is causal or a key-padding pattern
    (`resolve_attn_mask`; others raise ``ValueError``); ``is_causal=True`` makes the call causal.
    ``batch_first`` defaults to ``False``, as in MultiheadAttention.

    It replaces the attention of `torch.nn.TransformerEncoderLayer` (and the self-attention of
    `torch.nn.TransformerDecoderLayer`): ``layer.self_attn = MultiheadLinearAttention(d_model,
    nhead, batch_first=layer.self_attn.batch_first)``. The layer's fused fast path (inference
    only) needs MultiheadAttention's packed ``in_proj_weight``; ``in_proj_bias`` is ``None`` here,
    which sends the layer down its ordinary path, calling this module.

    Differences from MultiheadAttention: no ``add_bias_kv``/``add_zero_attn`` (``True``
    raises), no attention weights, dropout per key (`LinearAttentionHeads`), and the projections
    are separate ``nn.Linear`` (``layer.to_q``, ...; a MultiheadAttention ``state_dict`` does not
    load as is: split ``in_proj_weight`` into three).

    Parameters
    ----------
    embed_dim, num_heads : int
    dropout : float, default 0.0
    bias : bool, default True
        Biases of the input and output projections.
    add_bias_kv, add_zero_attn : bool, default False
        Not supported (``True`` raises).
    kdim, vdim : int, optional
    batch_first : bool, default False
    device, dtype : optional
    **kwargs
        Passed to `LinearAttention` (``feature_map``, ``num_features``, ``causal``, ``seed``, ...).

    Attributes
    ----------
    layer : LinearAttention
    embed_dim, num_heads, head_dim, batch_first, kdim, vdim, dropout
        As in MultiheadAttention.

    Examples
    --------
    >>> import torch
    >>> from torch import nn
    >>> from kernelapprox.nn import MultiheadLinearAttention
    >>> enc = nn.TransformerEncoderLayer(32, 4, dim_feedforward=64, batch_first=True)
    >>> enc.self_attn = MultiheadLinearAttention(32, 4, batch_first=True, num_features=16, seed=0)
    >>> x = torch.randn(2, 10, 32)
    >>> pad = torch.zeros(2, 10, dtype=torch.bool)
    >>> pad[1, 6:] = True
    >>> enc(x, src_key_padding_mask=pad).shape
    torch.Size([2, 10, 32])
    >>> out, weights = enc.self_attn(x, x, x)
    >>> out.shape, weights
    (torch.Size([2, 10, 32]), None)
    """

    in_proj_weight: None
    in_proj_bias: None
    bias_k: None
    bias_v: None

    def __init__(
        self,
        embed_dim: int,
        num_heads: int,
        dropout: float = 0.0,
        bias: bool = True,
        add_bias_kv: bool = False,
        add_zero_attn: bool = False,
        kdim: int | None = None,
        vdim: int | None = None,
        batch_first: bool = False,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__()
        check_positive_int("embed_dim", embed_dim)
        check_positive_int("num_heads", num_heads)
        if add_bias_kv or add_zero_attn:
            raise ValueError(
                "add_bias_kv and add_zero_attn are not supported by MultiheadLinearAttention "
                f"(got add_bias_kv={add_bias_kv!r}, add_zero_attn={add_zero_attn!r})"
            )
        _check_bool("bias", bias)
        for name in ("heads", "dim", "qkv_bias", "out_bias"):
            if name in kwargs:
                raise TypeError(f"{name}= is set by MultiheadAttention's arguments; pass embed_dim, num_heads, bias")
        self.layer = LinearAttention(
            embed_dim, heads=num_heads, dropout=dropout, qkv_bias=bias, out_bias=bias, kdim=kdim, vdim=vdim,
            batch_first=batch_first, device=device, dtype=dtype, **kwargs,
        )
        self.embed_dim = self.layer.dim
        self.num_heads = self.layer.heads
        self.head_dim = self.layer.dim_head
        self.kdim, self.vdim = self.layer.kdim, self.layer.vdim
        self.batch_first = self.layer.batch_first
        self.dropout = self.layer.attention.dropout
        self._qkv_same_embed_dim = self.kdim == self.embed_dim and self.vdim == self.embed_dim
        self.add_zero_attn = False
        # MultiheadAttention's packed-projection attributes, absent here (None keeps the
        # Transformer layers off their fused fast path)
        self.in_proj_weight = None
        self.in_proj_bias = None
        self.bias_k = self.bias_v = None

    @property
    def out_proj(self) -> nn.Linear:
        """The output projection (``self.layer.to_out``), MultiheadAttention's name."""
        return self.layer.to_out

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        key_padding_mask: torch.Tensor | None = None,
        need_weights: bool = True,
        attn_mask: torch.Tensor | None = None,
        average_attn_weights: bool = True,
        is_causal: bool = False,
    ) -> tuple[torch.Tensor, None]:
        """MultiheadAttention's call: ``(out, None)``.

        Parameters
        ----------
        query : Tensor, shape (batch, n, embed_dim)
            (n, batch, embed_dim) if ``batch_first=False``.
        key : Tensor, shape (batch, m, kdim)
        value : Tensor, shape (batch, m, vdim)
        key_padding_mask : Tensor, shape (batch, m), optional
            ``True`` / ``-inf`` = padded.
        need_weights, average_attn_weights : bool
            Accepted; no weights are formed (``None`` is returned).
        attn_mask : Tensor, optional
            Causal or key-padding pattern only (`resolve_attn_mask`).
        is_causal : bool, default False
            Causal attention (with or without ``attn_mask``).

        Returns
        -------
        out : Tensor, shape of ``query``
        weights : None
        """
        out = self.layer._forward(query, key, value, key_padding_mask=key_padding_mask, attn_mask=attn_mask,
                                  is_causal=is_causal)
        return cast(torch.Tensor, out), None

    def extra_repr(self) -> str:
        s = f"embed_dim={self.embed_dim}, num_heads={self.num_heads}, batch_first={self.batch_first}"
        return s + self.layer.attention._hybrid_repr()
