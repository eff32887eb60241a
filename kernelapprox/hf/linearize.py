r"""Linearisation: swap a model's softmax attention for linear or hybrid attention, reversibly.

`linearize` builds one feature map per layer (from an estimator name, a map, a factory or a
mapping layer -> map), fits learned maps on calibration text, chooses the heads kept exact, and
switches the model (`Switch`) to an attention function that runs `AttentionServer`; `Linearized`
is the handle that restores the model.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, cast

import torch

from .._validation import check_bool, check_finite_float, check_positive_int, check_seed
from ..maps.base import FeatureMap
from .capture import Capture, LayerCapture, capture, check_layers, layer_set, num_attention_calls
from .serving import AttentionServer, causal_sinks, fit_map, sequence_sinks
from .switch import Switch, allowed_mask, check_model, original_attention, repeat_kv, valid_keys

__all__ = ["Linearized", "MapSpec", "SinkSpec", "linearize"]

MapSpec = str | FeatureMap | Callable[[int, int, int], FeatureMap] | Mapping[int, FeatureMap]


def build_map(
    spec: MapSpec, layer: int, heads: int, dim: int, num_features: int | None, sampler: str | None,
    seed: int | None, options: Mapping[str, Any],
) -> FeatureMap:
    """The map of ``layer`` (`kernelapprox.maps.spec.resolve_feature_map`, the library's one
    reading of a ``feature_map=`` argument and its defaults; a factory is called as
    ``(layer, heads, d_head)``)."""
    from ..maps.spec import resolve_feature_map

    return resolve_feature_map(spec, dim=dim, heads=heads, layer=layer, num_features=num_features,
                               sampler=sampler, seed=seed, options=options, factory_args=(layer, heads, dim))


def _check_map_spec(spec: object, layers: set[int] | None, model: Any) -> None:
    """Reject a bad ``feature_map`` before the model is switched."""
    from ..registry import get_estimator

    if isinstance(spec, str):
        get_estimator(spec)  # raises on an unknown name
    elif isinstance(spec, Mapping):
        bad = {key: type(fm).__name__ for key, fm in spec.items() if not isinstance(fm, FeatureMap)}
        if bad:
            raise TypeError(f"feature_map values must be FeatureMaps, got {bad}")
        n_layers = getattr(model.config, "num_hidden_layers", None)
        wanted = layers if layers is not None else (set(range(n_layers)) if isinstance(n_layers, int) else set())
        missing = sorted(wanted - set(spec))
        if missing:
            raise KeyError(f"feature_map has no map for layers {missing} (keys {sorted(spec)}); pass layers=")
    elif not isinstance(spec, FeatureMap) and not callable(spec):
        raise TypeError(
            "feature_map must be an estimator name, a FeatureMap, a callable (layer, heads, d_head) -> "
            f"FeatureMap or a mapping layer -> FeatureMap, got {type(spec).__name__}"
        )


def _check_named_map(
    name: str, model: Any, num_features: int | None, sampler: str | None, seed: int | None,
    options: Mapping[str, Any],
) -> None:
    """Build (and discard) the map of the first layer, so that a bad ``num_features``, ``sampler``,
    ``seed`` or option raises at the call rather than at the model's first forward."""
    cfg = model.config
    heads = getattr(cfg, "num_attention_heads", None)
    hidden = getattr(cfg, "hidden_size", None)
    dim = getattr(cfg, "head_dim", None)
    if not isinstance(dim, int) and isinstance(heads, int) and isinstance(hidden, int) and heads > 0:
        dim = hidden // heads
    if not (isinstance(dim, int) and isinstance(heads, int) and dim > 0 and heads > 0):
        return  # an unusual config: the maps are checked when first built
    with torch.random.fork_rng(devices=[]):  # a seedless trial draw must not move the global RNG
        build_map(name, 0, heads, dim, num_features, sampler, seed, options)




_MAP_ATTR = "kernelapprox_feature_map"
SinkSpec = int | Sequence[int]


def _check_sinks(sinks: object) -> int | tuple[int, ...]:
    """``sinks`` as a count (int >= 0) or a tuple of positions, else a clear error naming it."""
    from ..attention.hybrid.sinks import check_sinks

    return check_sinks(sinks)



def attention_modules(model: Any) -> dict[int, torch.nn.Module]:
    """Self-attention modules by ``layer_idx`` (the first one of each index), where the model has them."""
    found: dict[int, torch.nn.Module] = {}
    for mod in model.modules():
        idx = getattr(mod, "layer_idx", None)
        if (isinstance(idx, int) and not isinstance(idx, bool) and "Attention" in type(mod).__name__
                and not getattr(mod, "is_cross_attention", False) and idx not in found):
            found[idx] = mod
    return found


def module_shape(mod: torch.nn.Module, cfg: Any) -> tuple[int, int] | None:
    """(heads, d_head) of an attention module, from its attributes or the config."""

    def first_int(obj: Any, names: tuple[str, ...]) -> int | None:
        for name in names:
            val = getattr(obj, name, None)
            if isinstance(val, int) and not isinstance(val, bool) and val > 0:
                return val
        return None

    heads = first_int(mod, ("num_heads", "num_attention_heads")) or first_int(cfg, ("num_attention_heads",))
    dim = first_int(mod, ("head_dim", "attention_head_size")) or first_int(cfg, ("head_dim",))
    hidden = first_int(cfg, ("hidden_size",))
    if dim is None and heads is not None and hidden is not None:
        dim = hidden // heads
    return None if heads is None or dim is None else (heads, dim)


def _check_exact_heads(exact_heads: object) -> int | dict[int, list[int]]:
    if exact_heads is None:
        return {}
    if isinstance(exact_heads, int) and not isinstance(exact_heads, bool):
        if exact_heads < 0:
            raise ValueError(f"exact_heads as a count of heads must be >= 0, got {exact_heads}")
        return exact_heads
    if not isinstance(exact_heads, Mapping):
        raise TypeError(
            f"exact_heads must be None, an int (how many heads to keep exact) or a dict layer -> [head, ...], "
            f"got {type(exact_heads).__name__}"
        )
    out: dict[int, list[int]] = {}
    for layer, heads in exact_heads.items():
        if isinstance(heads, int) and not isinstance(heads, bool):
            heads = [heads]
        if (not isinstance(layer, int) or isinstance(layer, bool) or layer < 0 or not isinstance(heads, Sequence)
                or not all(isinstance(x, int) and not isinstance(x, bool) and x >= 0 for x in heads)):
            raise TypeError(
                f"exact_heads must map a layer (int >= 0) to a list of head indices (ints >= 0), got {layer!r}: {heads!r}"
            )
        if heads:
            out[layer] = sorted(set(heads))
    return out




def _exact_softmax(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, allowed: torch.Tensor, scale: float) -> torch.Tensor:
    """Softmax attention with the boolean mask ``allowed`` (b, 1, n, m), in at least float32;
    a row with no allowed key gives 0."""
    dt = torch.promote_types(q.dtype, torch.float32)
    some = allowed.any(-1, keepdim=True)
    out = torch.nn.functional.scaled_dot_product_attention(  # an empty row reads every key, then is zeroed
        q.to(dt), k.to(dt), v.to(dt), attn_mask=allowed | ~some, scale=scale
    )
    return torch.where(some, out, torch.zeros((), dtype=dt, device=out.device))


def _head_errors(
    lc: LayerCapture, fm: FeatureMap, fit: bool, window: int | None, sinks: int | tuple[int, ...],
    chunk_size: int, predict: bool = True,
) -> tuple[torch.Tensor, str]:
    r"""Error of each head of one calibration record: ``(heads,)`` float64 and how it was obtained.

    Per sequence (its valid tokens), the relative output error $\|\hat O - O\|_F / \|O\|_F$:
    predicted, $\sqrt{\sum \mathrm{Var}(\hat o)}/\|O\|_F$ by the delta method
    (`kernelapprox.theory.attention_variance`, or
    `kernelapprox.theory.hybrid_attention.hybrid_attention_variance` with a window or sinks), for
    random maps with a closed form (iid Gaussian rows); measured against softmax attention for
    every other map; summed over the sequences.
    """
    from ..attention import linear_attention
    from ..attention.hybrid import hybrid_attention
    from ..theory import attention_variance
    from ..theory.hybrid_attention import hybrid_attention_variance

    qs, ks = lc.kernel_inputs()
    hybrid = window is not None or sinks != 0
    w = 0 if window is None else window
    valid = lc.allowed[:, 0].any(1)
    err = torch.zeros(qs.shape[1], dtype=torch.float64)
    predict = predict and fm.is_random
    for i in range(qs.shape[0]):
        idx = valid[i].nonzero().squeeze(-1)
        if idx.numel() == 0 or lc.q.shape[2] != lc.k.shape[2]:
            continue
        q, k, v = qs[i][:, idx].double(), ks[i][:, idx].double(), lc.v[i][:, idx].double()
        logits = q @ k.mT
        if lc.causal:
            logits = logits.masked_fill(torch.ones_like(logits, dtype=torch.bool).triu(1), float("-inf"))
        exact = torch.softmax(logits, -1) @ v
        norm = exact.norm(dim=(-2, -1)).clamp_min(1e-300)
        fm_i = fit_map(fm, q.float(), k.float()) if fit else fm
        sk = causal_sinks(sinks) if lc.causal else sequence_sinks(sinks, idx.numel())
        if predict:
            try:
                if hybrid:
                    var = hybrid_attention_variance(fm_i, q, k, v, window=w, sinks=sk, causal=lc.causal)
                else:
                    var = attention_variance(fm_i, q, k, v, causal=lc.causal)
            except NotImplementedError:  # no closed form for these rows: measured, for every sequence
                return _head_errors(lc, fm, fit, window, sinks, chunk_size, predict=False)
            err += var.sum((-2, -1)).sqrt() / norm
            continue
        with torch.no_grad():
            approx: Any
            if hybrid:
                approx = hybrid_attention(q.float(), k.float(), v.float(), fm_i, window=w, sinks=sk, causal=lc.causal,
                                          chunk_size=chunk_size)
            else:
                approx = linear_attention(q.float(), k.float(), v.float(), fm_i, causal=lc.causal,
                                          chunk_size=chunk_size, check=False)
        err += (cast(torch.Tensor, approx).double() - exact).norm(dim=(-2, -1)) / norm
    return err, "predicted" if predict else "measured"


@dataclass
class Linearized:
    r"""Handle returned by `linearize`: the swapped model, its maps, and ``restore()``.

    While the model is linearised, each layer's map is a submodule of its attention module,
    ``module.kernelapprox_feature_map``: ``model.state_dict()``, ``save_pretrained``,
    ``model.parameters()`` and ``model.to(...)`` include it. ``restore()`` detaches the maps and
    switches the attention implementation back, giving the original model (outputs and
    ``state_dict`` keys).

    Attributes
    ----------
    model : transformers.PreTrainedModel
    feature_maps : dict of int to FeatureMap
        The map of each linearised layer (built at the call where the model's attention modules
        carry a ``layer_idx``, else on first use).
    layers : set of int or None
        Linearised attention calls (``None``: all).
    window : int or None
        The exact window of hybrid attention (``None``: feature map alone).
    sinks : int or tuple of int
        Sink tokens of hybrid attention (a count of leading tokens, or positions).
    exact_heads : dict of int to list of int
        Heads that keep softmax attention, per layer (sorted).
    head_errors : dict of int to Tensor
        With ``exact_heads=k``: each layer's per-head error on the calibration inputs, shape
        (heads,), float64, that chose the exact heads (``head_error_kind`` says whether predicted
        or measured).
    settings : dict
        The arguments of the swap that `kernelapprox.hf.save_linearized` writes (the estimator name
        or None, ``num_features``, ``sampler``, ``seed``, ``options``, ``layers``, ``window``,
        ``sinks``, the resolved ``exact_heads``, ``chunk_size``, ``check``).

    ``new_cache()`` gives a `kernelapprox.hf.cache.LinearizedCache` (each linearised layer keeps
    its recurrent state only); ``model.generate`` builds one on its own while the model is
    linearised.

    Examples
    --------
    >>> import torch
    >>> from transformers import GPT2Config, GPT2Model
    >>> from kernelapprox import hf
    >>> _ = torch.manual_seed(0)
    >>> model = GPT2Model(GPT2Config(n_embd=32, n_layer=2, n_head=4, vocab_size=99)).eval()
    >>> ids = torch.randint(0, 99, (1, 9))
    >>> keys = set(model.state_dict())
    >>> with torch.no_grad():
    ...     exact = model(input_ids=ids).last_hidden_state
    ...     with hf.linearize(model, "positive", num_features=64, layers=[1]) as lin:
    ...         approx = model(input_ids=ids).last_hidden_state
    ...         print(lin.active, lin.layers, {i: type(fm).__name__ for i, fm in lin.feature_maps.items()})
    ...         print(sorted(set(model.state_dict()) - keys))
    ...     restored = model(input_ids=ids).last_hidden_state
    True {1} {1: 'PositiveRF'}
    ['h.1.attn.kernelapprox_feature_map.projection._weight']
    >>> lin.active, torch.equal(restored, exact), set(model.state_dict()) == keys
    (False, True, True)
    """

    model: Any
    feature_maps: dict[int, FeatureMap]
    layers: set[int] | None
    _switch: Switch
    window: int | None = None
    sinks: int | tuple[int, ...] = 0
    exact_heads: dict[int, list[int]] = field(default_factory=dict)
    head_errors: dict[int, torch.Tensor] = field(default_factory=dict)
    head_error_kind: str | None = None
    _attached: list[torch.nn.Module] = field(default_factory=list, repr=False)
    _streams: dict[int, Any] = field(default_factory=dict, repr=False)
    _server: AttentionServer | None = field(default=None, repr=False)
    settings: dict[str, Any] = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        if not isinstance(self.feature_maps, dict):
            raise TypeError(f"feature_maps must be a dict layer -> FeatureMap, got {type(self.feature_maps).__name__}")
        if not isinstance(self._switch, Switch):
            raise TypeError(f"_switch must be the model switch made by linearize, got {type(self._switch).__name__}")

    @property
    def active(self) -> bool:
        """Whether the model currently runs linear attention."""
        return self._switch.active

    def new_cache(self) -> Any:
        """A fresh `kernelapprox.hf.cache.LinearizedCache` for this model (``model(..., cache=...)``).

        ``model.generate`` builds one on its own while the model is linearised; pass one to a
        forward to decode by hand. Each linearised layer keeps its recurrent state (and window)
        only; layers left with softmax attention, and layers with exact heads, keep their keys and
        values.

        Examples
        --------
        >>> cache = lin.new_cache()                                        # doctest: +SKIP
        >>> out = model(input_ids=ids, cache=cache, use_cache=True)       # doctest: +SKIP
        """
        from .cache import LinearizedCache

        if not self.active:
            raise ValueError("the model is restored: a LinearizedCache needs the linearised model")
        server = self._server if self._server is not None else AttentionServer()
        layers, exact = self.layers, self.exact_heads
        return LinearizedCache(server, lambda i: layers is None or i in layers, lambda i: bool(exact.get(i)))

    def restore(self) -> None:
        """Switch the model back to its original attention and detach the maps (idempotent)."""
        _unpatch_generate(self.model)
        self._switch.close()
        for mod in self._attached:
            mod._modules.pop(_MAP_ATTR, None)
        self._attached.clear()
        self._streams.clear()
        if self._server is not None:
            self._server.pending.clear()

    def __enter__(self) -> Linearized:
        return self

    def __exit__(self, *exc: object) -> None:
        self.restore()


_GENERATE_HOOK = "_prepare_cache_for_generation"


def _patch_generate(lin: Linearized) -> None:
    """Make ``lin.model.generate`` build a `LinearizedCache` (the instance's cache preparation,
    undone by ``restore``); static and other cache implementations are refused with a clear error."""
    model = lin.model
    if getattr(model.config, "is_encoder_decoder", False) or not hasattr(type(model), _GENERATE_HOOK):
        return
    original = getattr(model, _GENERATE_HOOK)

    def prepare(generation_config: Any, model_kwargs: dict, *args: Any, **kwargs: Any) -> Any:
        from transformers.cache_utils import StaticCache

        user = model_kwargs.get("cache")
        impl = generation_config.cache_implementation
        if isinstance(user, StaticCache) or (user is None and impl not in (None, "dynamic")):
            raise ValueError(
                f"a linearised model decodes on a constant-size state per layer (kernelapprox.hf.cache.LinearizedCache, "
                f"the default): cache_implementation={impl!r} / cache={type(user).__name__} is not supported; "
                "leave both unset (or pass cache=lin.new_cache())"
            )
        if user is None and generation_config.use_cache is not False:
            model_kwargs["cache"] = lin.new_cache()
            return None
        return original(generation_config, model_kwargs, *args, **kwargs)

    setattr(model, _GENERATE_HOOK, prepare)


def _unpatch_generate(model: Any) -> None:
    model.__dict__.pop(_GENERATE_HOOK, None)


def linearize(
    model: Any,
    feature_map: MapSpec,
    *,
    layers: int | Sequence[int] | None = None,
    num_features: int | None = None,
    sampler: str | None = None,
    seed: int | None = 0,
    window: int | None = None,
    sinks: SinkSpec = 0,
    exact_heads: int | Mapping[int, Sequence[int]] | None = None,
    calibration: Mapping[str, Any] | Capture | None = None,
    fit_steps: int = 300,
    fit_batch_size: int | None = 128,
    fit_lr: float = 1e-2,
    chunk_size: int = 64,
    progress: bool = False,
    check: bool = True,
    **options: Any,
) -> Linearized:
    r"""Swap the model's softmax attention for linear (or hybrid) attention, reversibly.

    In every linearised layer, head $h$ computes, with $\tilde q = \sqrt s\,q$,
    $\tilde k = \sqrt s\,k$ ($s$ the model's own scaling) and $J_i$ the keys its mask allows
    ($j \le i$ where the model is causal; padded keys excluded),

    $$
    o_i = \frac{\sum_{j \in S_i} e^{\tilde q_i^\top \tilde k_j} v_j
    + \varphi_h(\tilde q_i)^\top \sum_{j \in J_i \setminus S_i} \varphi_h(\tilde k_j) v_j^\top}
    {\sum_{j \in S_i} e^{\tilde q_i^\top \tilde k_j}
    + \varphi_h(\tilde q_i)^\top \sum_{j \in J_i \setminus S_i} \varphi_h(\tilde k_j)},
    $$

    where the exact set $S_i$ is empty by default (`kernelapprox.linear_attention`), and with
    ``window``/``sinks`` the window ($0 \le i - j < w$ causal, $|i - j| < w$ bidirectional)
    plus the sink tokens, as in `kernelapprox.hybrid_attention` [Che21]_ [Zha25]_. Heads in
    ``exact_heads`` keep softmax attention ($S_i = J_i$). Random maps get an independent draw
    per head (``batch_shape=(heads,)``) and per layer; data-dependent maps (``fm.data_dependent``:
    FAVOR++, FAVOR#, Nyström) are fitted on every batch they see, as in use (Nyström: per
    sequence on its valid keys, with ``min(num_features, valid keys)`` landmarks, so a sequence
    of at most ``num_features`` tokens gets exact softmax attention); learned maps (Hedgehog) are
    fitted per head on ``calibration`` inputs by `kernelapprox.fit_feature_map` before the swap
    (with ``window``/``sinks``: to the remainder, ``fit_feature_map(..., window=, sinks=)``, the
    part of each row the map carries; whole rows where the exact set covers every calibration key).
    Dropout on attention weights is not applied (use the model in eval mode). Masks other than
    causal/bidirectional with key padding (sliding windows, packed sequences) raise
    ``NotImplementedError``.

    **Padding.** Padded keys are never in any sum, window or sink. With a window or sinks,
    positions are those of each sequence's own (non-padded) tokens: the window of a token is the
    $w - 1$ valid tokens before it (and after it, bidirectional), ``sinks=1`` is each sequence's
    first valid token (a BOS), and for bidirectional encoders negative positions count from each
    sequence's last valid token (``sinks=[0, -1]``: BERT's [CLS] and [SEP] at whatever position
    padding leaves them); positions beyond a sequence are ignored. The outputs at padded query
    positions (read by no valid token) use the feature map alone over the keys the model's mask
    gives them.

    **Decoding.** Causal layers keep, per layer, the state of what they have consumed: the
    $F \times (d_v + 1)$ linear-attention state (`kernelapprox.LinearAttentionState`), or with a
    window the ring buffer of the last $w$ keys and values plus that state
    (`kernelapprox.attention.hybrid.HybridAttentionState`). While the model is linearised,
    ``model.generate()`` decodes on a `kernelapprox.hf.cache.LinearizedCache`
    (``Linearized.new_cache()``), a transformers ``Cache`` that holds these states and nothing
    else in the linearised layers (memory constant in the sequence length; exact heads and layers
    left with softmax keep their keys and values): each call advances the state by its new tokens,
    beam search reorders the states, and static caches are refused. With a transformers
    ``DynamicCache`` (a forward with ``use_cache=True``), a call with $n < m$ queries that
    continues the previous call of the layer (same batch size, $m - n$ equal to the keys consumed,
    the same padding, the same first and last cached key bit for bit, and in the first layer,
    whose keys depend on their token and position only, every cached key: reordered beams are
    seen) advances the state by the ``n`` new tokens only, with no arithmetic on the cache; any
    other call rebuilds the state from the cached prefix (O(m)). Either way decoding runs at a
    nearly constant cost per token and equals a full forward; exact heads read the cached keys
    (their softmax is O(m)). Outside a `LinearizedCache`, states are kept only without autograd
    (``torch.no_grad()``, as ``generate`` runs); with gradients every call recomputes from the
    keys it receives. Data-dependent maps keep the fit of the prefill while decoding (a full
    forward of the longer sequence fits them on all its keys, so the two then differ by the
    refit). `kernelapprox.hf.save_linearized` / `kernelapprox.hf.load_linearized` write and
    rebuild the linearised model.

    Parameters
    ----------
    model : transformers.PreTrainedModel
        Attention implementation ``"sdpa"`` or ``"eager"``.
    feature_map : str, FeatureMap, callable or mapping
        An estimator name from `kernelapprox.estimators` (a map is built per layer with
        ``dim=d_head``, ``num_features`` and, for random maps, ``batch_shape=(heads,)``); one
        `FeatureMap` for every layer; ``callable(layer, heads, d_head) -> FeatureMap``; or
        ``{layer: FeatureMap}``.
    layers : int or sequence of int, optional
        Attention calls to linearise (``None``: all); the others keep softmax attention.
    num_features : int, optional
        ``r`` for maps built from a name (default: $\lfloor d\ln d\rfloor$ projections for a
        random map, the estimator's own otherwise; `kernelapprox.maps.spec.resolve_feature_map`,
        the defaults `kernelapprox.nn` and `kernelapprox.sklearn` use too).
    sampler : str, optional
        Projection sampler for random maps built from a name (default: ``"orthogonal"``, as in
        `kernelapprox.nn`).
    seed : int or None, default 0
        Seed of the maps built from a name (layer ``l`` uses ``seed * 1000003 + l``); ``None``
        follows torch's global RNG.
    window : int, optional
        Hybrid attention: keys in this window of each query are exact (see above; ``window >= n``
        is the model's softmax attention, ``0`` an empty window). ``None``: no window.
    sinks : int or sequence of int, default 0
        Hybrid attention: sink tokens, exact for every query that attends to them; a count of
        leading tokens or positions (non-negative for causal models). Non-zero sinks without a
        window use ``window=0``.
    exact_heads : int or dict of int to list of int, optional
        Heads that keep softmax attention: ``{layer: [head, ...]}``, or an int ``k``: the ``k``
        heads (over all linearised layers) with the largest error on ``calibration``, predicted
        by the delta method (`kernelapprox.theory.attention_variance`,
        `kernelapprox.theory.hybrid_attention.hybrid_attention_variance`) for random maps with a
        closed form (iid Gaussian rows), measured against softmax attention on the calibration
        capture for every other map (orthogonal rows, deterministic, fitted and learned maps);
        ``Linearized.head_errors`` holds the errors.
    calibration : dict of model inputs or Capture, optional
        Text the learned maps are fitted on and ``exact_heads=k`` is chosen on (required for
        those; never the evaluation text).
    fit_steps, fit_batch_size, fit_lr : int, int or None, float
        Distillation settings of `kernelapprox.fit_feature_map` for learned maps.
    chunk_size : int, default 64
        Chunk length of the causal form.
    progress : bool, default False
        Progress bars while fitting learned maps.
    check : bool, default True
        On the first call of each linearised layer, `kernelapprox.diagnose.warn_if_hopeless` on
        its scaled queries and keys (after fitting a data-dependent map): a
        `kernelapprox.KernelApproxWarning` when the map's closed form predicts a relative kernel
        MSE above 1 there. Once per layer, not per call.
    **options
        Extra constructor arguments of the maps built from a name (e.g. ``variant="lolcats"``).

    Returns
    -------
    Linearized
        ``.restore()`` (or ``with``) switches the model back; ``.feature_maps``, ``.window``,
        ``.sinks``, ``.exact_heads``, ``.layers`` describe the swap.

    Notes
    -----
    Each linearised attention call receives q (batch, heads, n, d_head), k and v
    (batch, kv_heads, m, d_head) with ``heads`` a multiple of ``kv_heads`` (grouped-query
    attention: k, v repeated to the query heads) and returns (batch, n, heads, d_v), as the
    model's own implementation; ``n < m`` when decoding with a KV cache.

    References
    ----------
    .. [Che21] B. Chen et al., "Scatterbrain: unifying sparse and low-rank attention
       approximation", NeurIPS 2021.
    .. [Zha25] M. Zhang et al., "LoLCATs: on low-rank linearizing of large language models",
       ICLR 2025.

    Examples
    --------
    A tiny LLaMA with grouped-query attention, a window of 4 tokens and one sink, one head kept
    exact; greedy generation runs on the recurrent state:

    >>> import torch
    >>> from transformers import LlamaConfig, LlamaForCausalLM
    >>> from kernelapprox import hf
    >>> _ = torch.manual_seed(0)
    >>> cfg = LlamaConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
    ...                   num_key_value_heads=2, intermediate_size=37, vocab_size=99)
    >>> model = LlamaForCausalLM(cfg).eval()
    >>> ids = torch.randint(1, 99, (1, 12))
    >>> with hf.linearize(model, "positive", num_features=32, window=4, sinks=1,
    ...                   exact_heads={1: [0]}) as lin:
    ...     out = model.generate(input_ids=ids, max_new_tokens=5, do_sample=False, pad_token_id=0)
    ...     print(lin.window, lin.sinks, lin.exact_heads, sorted(lin.feature_maps))
    4 1 {1: [0]} [0, 1]
    >>> out.shape
    torch.Size([1, 17])
    """
    from ..attention.hybrid import check_window
    from ..training import fit_feature_map

    impl = check_model(model)
    keep_layers = layer_set(layers)
    check_layers(keep_layers, model)
    for name, value in (("fit_steps", fit_steps), ("chunk_size", chunk_size)):
        check_positive_int(name, value)
    if fit_batch_size is not None:
        check_positive_int("fit_batch_size", fit_batch_size)
    check_finite_float("fit_lr", fit_lr, min=0.0, min_open=True)
    check_bool("check", check)
    check_bool("progress", progress)
    if num_features is not None:
        num_features = check_positive_int("num_features", num_features)
    seed = check_seed("seed", seed)
    if sampler is not None and not isinstance(sampler, str):
        raise TypeError(f"sampler must be a sampler name or None, got {sampler!r} ({type(sampler).__name__})")
    if window is not None:
        window = check_window(window)
    sink_spec = _check_sinks(sinks)
    hybrid = window is not None or sink_spec != 0
    w = 0 if window is None else window
    exact_spec = _check_exact_heads(exact_heads)
    if calibration is not None and not isinstance(calibration, Capture | Mapping):
        raise TypeError(
            f"calibration must be a dict of model inputs, a Capture or None, got {type(calibration).__name__}"
        )
    if isinstance(exact_spec, int) and exact_spec > 0 and calibration is None:
        raise ValueError(
            f"exact_heads={exact_spec} chooses the heads on calibration inputs: pass calibration=dict(input_ids=...)"
        )
    _check_map_spec(feature_map, keep_layers, model)
    if isinstance(feature_map, str):
        _check_named_map(feature_map, model, num_features, sampler, seed, options)
    elif options:
        raise TypeError(f"options {sorted(options)} only apply to maps built from a name, got feature_map={feature_map!r}")
    modules = attention_modules(model)
    for mod in modules.values():
        if _MAP_ATTR in mod._modules:
            raise ValueError(
                f"{type(mod).__name__} already holds a {_MAP_ATTR}: the model is linearised; call .restore() "
                "on that Linearized first"
            )
    n_calls = num_attention_calls(model)
    heads_of: dict[int, int] = {}
    for layer, mod in modules.items():
        shape = module_shape(mod, model.config)
        if shape is not None:
            heads_of[layer] = shape[0]
    if isinstance(exact_spec, dict):
        for layer, hs in exact_spec.items():
            if (keep_layers is not None and layer not in keep_layers) or (n_calls is not None and layer >= n_calls):
                raise ValueError(
                    f"exact_heads names layer {layer}, which is not linearised (layers={sorted(keep_layers or [])} "
                    f"of {n_calls})"
                )
            if layer in heads_of and hs[-1] >= heads_of[layer]:
                raise ValueError(f"exact_heads[{layer}] must be head indices in [0, {heads_of[layer]}), got {hs}")

    maps: dict[int, FeatureMap] = {}
    attached: list[torch.nn.Module] = []
    checked: set[int] = set()

    def attach(layer: int, module: torch.nn.Module | None) -> None:
        if module is not None and _MAP_ATTR not in module._modules:
            module.add_module(_MAP_ATTR, maps[layer])
            attached.append(module)

    def map_for(layer: int, heads: int, dim: int, module: torch.nn.Module | None = None) -> FeatureMap:
        if layer not in maps:
            maps[layer] = build_map(feature_map, layer, heads, dim, num_features, sampler, seed, options)
        attach(layer, module)
        return maps[layer]

    # Maps built now (in layer order) and attached to their attention modules, so that the
    # model's state_dict holds them from the start.
    for layer in sorted(modules):
        if keep_layers is not None and layer not in keep_layers:
            continue
        shape = module_shape(modules[layer], model.config)
        if shape is not None:
            map_for(layer, *shape, modules[layer])

    # Learned maps: fit per head on the calibration text before switching.
    if isinstance(feature_map, str):
        from ..registry import get_estimator

        learned = get_estimator(feature_map).learned
    else:  # one map, a mapping or a callable: learned maps among them are fitted if calibration is given
        learned = False
    if learned and calibration is None:
        raise ValueError("learned feature maps need calibration inputs: pass calibration=dict(input_ids=...)")
    resolved_heads: dict[int, list[int]] = exact_spec if isinstance(exact_spec, dict) else {}
    head_errors: dict[int, torch.Tensor] = {}
    head_error_kind: str | None = None
    if calibration is not None:
        cal = calibration if isinstance(calibration, Capture) else capture(model, layers=layers, **calibration)
        for lc in cal.layers:
            if keep_layers is not None and lc.layer not in keep_layers:
                continue
            fm = map_for(lc.layer, lc.q.shape[1], lc.q.shape[-1], modules.get(lc.layer))
            if fm.learned and not isinstance(feature_map, FeatureMap):  # one shared map: fitted by the user
                qc, kc = lc.kernel_inputs()
                # hybrid: fitted to the remainder, the part of each row the map will carry (whole
                # rows when the exact set covers every calibration key)
                remainder = hybrid and w < qc.shape[-2]
                fit_feature_map(
                    fm, qc.float(), kc.float(), steps=fit_steps, lr=fit_lr, batch_size=fit_batch_size,
                    causal=lc.causal, seed=seed, progress=progress,
                    window=w if remainder else None, sinks=sink_spec if remainder else 0,
                )
                fm.requires_grad_(False)
        if isinstance(exact_spec, int) and exact_spec > 0:
            scores: list[tuple[float, int, int]] = []
            kinds = set()
            for lc in cal.layers:
                if keep_layers is not None and lc.layer not in keep_layers:
                    continue
                fm = maps[lc.layer]
                fit = bool(fm.data_dependent and not fm.learned)
                err, kind = _head_errors(lc, fm, fit, window, sink_spec, chunk_size)
                kinds.add(kind)
                head_errors[lc.layer] = err
                scores += [(float(e), lc.layer, hd) for hd, e in enumerate(err.tolist())]
            if exact_spec > len(scores):
                raise ValueError(f"exact_heads={exact_spec} is more than the {len(scores)} linearised heads")
            for _, layer, hd in sorted(scores, key=lambda t: (-t[0], t[1], t[2]))[:exact_spec]:
                resolved_heads.setdefault(layer, []).append(hd)
            resolved_heads = {layer: sorted(hs) for layer, hs in sorted(resolved_heads.items())}
            head_error_kind = kinds.pop() if len(kinds) == 1 else "mixed"

    server = AttentionServer(window=window, sinks=sink_spec, chunk_size=chunk_size)
    order: dict[int, int] = {}

    def attend(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
        layer = getattr(module, "layer_idx", None)
        if not isinstance(layer, int):  # modules without an index: order of first call
            layer = order.setdefault(id(module), len(order))
        if keep_layers is not None and layer not in keep_layers:
            return original_attention(impl, module)(
                module, query, key, value, attention_mask, scaling=scaling, dropout=dropout, **kwargs
            )
        b, h, n, d = query.shape
        m = key.shape[2]
        causal = bool(kwargs.get("is_causal", getattr(module, "is_causal", False)))
        if causal and n > m:
            raise ValueError(f"causal attention with more queries ({n}) than keys ({m})")
        if not causal and hybrid and n != m:
            raise NotImplementedError(
                f"bidirectional hybrid attention needs as many queries as keys (a window is a set of positions), "
                f"got {n} queries and {m} keys"
            )
        s = float(scaling) if scaling is not None else d**-0.5
        fm = map_for(layer, h, d, module)
        if fm.dim != d:
            raise ValueError(f"the feature map of layer {layer} has dim={fm.dim}, but the layer's heads have d_head={d}")
        r = math.sqrt(s)
        qs = query * r
        fit = bool(fm.data_dependent and not fm.learned)
        if check and layer not in checked:
            from ..diagnose import warn_if_hopeless

            checked.add(layer)
            if fm.is_random:  # only random maps have the closed form the check evaluates
                ks = repeat_kv(key, h) * r
                # judged as fitted (the attention below fits it again on its valid keys)
                warn_if_hopeless(fit_map(fm, qs, ks) if fit else fm, qs, ks)
        slot = server.pending.pop(layer, None)  # a LinearizedCache's state: key holds the new keys only
        if slot is not None:
            if not causal:
                raise NotImplementedError("a LinearizedCache holds the states of causal layers; this layer is bidirectional")
            if slot.new != n or m != n:
                raise RuntimeError(
                    f"layer {layer} received {m} keys for {n} queries from a LinearizedCache that handed over {slot.new}"
                )
            m = slot.seen
        # no mask: the plain causal (or full) pattern without padding
        allowed = None if attention_mask is None else allowed_mask(attention_mask, b, n, m, causal, query.device)
        valid = None if allowed is None else valid_keys(allowed, causal)
        if slot is not None:
            out, slot.stream = server.advance(key, value, qs, r, fm, fit=fit, valid=valid, prev=slot.stream,
                                              offset=m - n)
            if slot.keys is not None:  # exact heads read every key
                key, value = slot.keys, slot.values
        elif causal:
            store = not (torch.is_grad_enabled() and any(t.requires_grad for t in (query, key, value)))
            out = server.causal(layer, key, value, qs, r, fm, fit=fit, valid=valid, store=store)
        else:
            out = server.bidirectional(qs, repeat_kv(key, h) * r, repeat_kv(value, h), fm, fit=fit, valid=valid)
        heads = resolved_heads.get(layer)
        if heads:
            if allowed is None:
                allowed = allowed_mask(None, b, n, m, causal, query.device)
            exact = _exact_softmax(query[:, heads], repeat_kv(key, h)[:, heads], repeat_kv(value, h)[:, heads],
                                   allowed, s)
            out = out.clone()
            out[:, heads] = exact.to(out.dtype)
        return out.transpose(1, 2).contiguous(), None

    # SDPA models: the SDPA mask (the layers left as they were receive what SDPA receives)
    switch = Switch(model, attend, "linear", skip_plain=impl == "sdpa")
    switch.__enter__()
    lin = Linearized(model=model, feature_maps=maps, layers=keep_layers, _switch=switch, window=window,
                     sinks=sink_spec, exact_heads=resolved_heads, head_errors=head_errors,
                     head_error_kind=head_error_kind, _attached=attached, _streams=server.streams,
                     _server=server, settings=dict(
                         feature_map=feature_map if isinstance(feature_map, str) else None,
                         num_features=num_features, sampler=sampler, seed=seed, options=dict(options),
                         layers=None if keep_layers is None else sorted(keep_layers), window=window,
                         sinks=list(sink_spec) if isinstance(sink_spec, tuple) else sink_spec,
                         exact_heads={int(k): list(v) for k, v in resolved_heads.items()},
                         chunk_size=chunk_size, check=check))
    _patch_generate(lin)
    return lin
