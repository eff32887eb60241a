"""Bad calls to every public entry point: a ``ValueError``/``TypeError`` that names the argument, at the call.

One table row per bad call: the public callable it exercises, the call, and a pattern the
message must contain (the argument's name). `test_every_public_callable_has_a_row` enumerates the
public callables of ``kernelapprox``, ``kernelapprox.theory``, ``kernelapprox.montecarlo``,
``kernelapprox.nn``, ``kernelapprox.hf`` and ``kernelapprox.sklearn`` and fails for any without a
row (or a documented exemption), so a new public function needs new rows.
"""

from __future__ import annotations

import functools
import inspect
import math
from collections.abc import Callable
from typing import Any

import pytest
import torch

import kernelapprox as ka
import kernelapprox.montecarlo as mc
import kernelapprox.nn as kann
import kernelapprox.sklearn as kask
import kernelapprox.theory as th

hf: Any
try:
    from transformers import GPT2Config, GPT2Model

    from kernelapprox import hf
except ImportError:  # pragma: no cover - transformers is an optional dependency
    hf = None

NAN = float("nan")
BAD = (ValueError, TypeError)
QK_DIM = r"q and k.*same last dimension.*got 3 and 4"  # q of width 3 against keys of width 4
# rows the library does not refuse yet are strict xfails naming the file


def q4(*shape: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(0))


def fm4() -> ka.PositiveRF:
    return ka.PositiveRF(4, 8, seed=0)


@functools.cache
def gpt2() -> Any:
    """A tiny 2-layer GPT-2 from a config (random weights, eval mode)."""
    torch.manual_seed(0)
    cfg = GPT2Config(n_embd=32, n_layer=2, n_head=4, vocab_size=99, bos_token_id=0, eos_token_id=0,
                     attn_implementation="sdpa")
    return GPT2Model(cfg).eval()


def lin(feature_map: object, **kw: Any) -> None:
    """`hf.linearize` on the shared tiny model, restored at once if the call is (wrongly) accepted."""
    hf.linearize(gpt2(), feature_map, **kw).restore()


def save_linearized_to(directory: object) -> None:
    """`hf.save_linearized` of the shared tiny model, linearised for the call and restored after it."""
    handle = hf.linearize(gpt2(), "positive", num_features=8)
    try:
        hf.save_linearized(handle, directory)
    finally:
        handle.restore()


IDS = torch.randint(0, 99, (1, 5), generator=torch.Generator().manual_seed(0))

ROWS: list[Any] = []


def row(owner: str, label: str, call: Callable[[], object], match: str, xfail: str | None = None) -> None:
    """A bad call of ``owner`` that must raise ValueError/TypeError matching ``match``."""
    marks = [pytest.mark.xfail(strict=True, reason=xfail)] if xfail else []
    ROWS.append(pytest.param(owner, call, match, id=f"{owner}:{label}", marks=marks))


# ------------------------------------------------------------------------------- kernelapprox
row("ka.Estimator", "cls-not-type", lambda: ka.Estimator("x", cls=3), "cls")
row("ka.EstimatorTheory", "components-not-callable", lambda: ka.EstimatorTheory(components=3),
    "components")
row("ka.register_estimator", "cls-not-type", lambda: ka.register_estimator(3, name="x3"), "cls")
row("ka.register_estimator", "name-not-str", lambda: ka.register_estimator(ka.PositiveRF, name=3), "name")
row("ka.unregister_estimator", "unknown", lambda: ka.unregister_estimator("no-such-map"), "no-such-map")
row("ka.get_estimator", "unknown", lambda: ka.get_estimator("no-such-map"), "no-such-map")
row("ka.get_estimator", "not-str", lambda: ka.get_estimator(3), "name")
row("ka.estimator_of", "not-map", lambda: ka.estimator_of(3), "int")
row("ka.estimators", "random-yes", lambda: ka.estimators(random="yes"), "random")
row("ka.estimators", "closed-form-bad", lambda: ka.estimators(closed_form=3), "closed_form")

row("ka.FeatureMap", "abstract", lambda: ka.FeatureMap(4, 8), "positional argument")

# random maps: one constructor, many maps (bad sizes, seeds, devices, dtypes, samplers)
RANDOM_CTORS = {
    "ka.RandomFeatureMap": ka.RandomFeatureMap,
    "ka.TrigRF": ka.TrigRF,
    "ka.PositiveRF": ka.PositiveRF,
    "ka.HyperbolicRF": ka.HyperbolicRF,
    "ka.OptimalPositiveRF": ka.OptimalPositiveRF,
    "ka.SADERF": ka.SADERF,
    "ka.SDERF": ka.SDERF,
    "ka.HybridRF": ka.HybridRF,
}
for _name, _cls in RANDOM_CTORS.items():
    row(_name, "dim-0", lambda c=_cls: c(0, 8, seed=0), "dim")
    row(_name, "dim-float", lambda c=_cls: c(4.0, 8, seed=0), "dim")
    row(_name, "dim-bool", lambda c=_cls: c(True, 8, seed=0), "dim")
    row(_name, "num-features-neg", lambda c=_cls: c(4, -8, seed=0), "num_features")
    row(_name, "seed-neg", lambda c=_cls: c(4, 8, seed=-1), "seed")
    row(_name, "seed-str", lambda c=_cls: c(4, 8, seed="0"), "seed")
    row(_name, "device-nodevice", lambda c=_cls: c(4, 8, seed=0, device="nodevice"), "device")
    row(_name, "dtype-str", lambda c=_cls: c(4, 8, seed=0, dtype="float64"), "dtype")
    row(_name, "dtype-int", lambda c=_cls: c(4, 8, seed=0, dtype=torch.int64), "dtype")
    row(_name, "sampler-unknown", lambda c=_cls: c(4, 8, seed=0, sampler="nosampler"), "sampler")
    row(_name, "batch-shape-neg", lambda c=_cls: c(4, 8, seed=0, batch_shape=(-2,)), "batch_shape")
row("ka.TrigRF", "variant-unknown", lambda: ka.TrigRF(4, 8, variant="cos"), "variant")
row("ka.OptimalPositiveRF", "A-nan", lambda: ka.OptimalPositiveRF(4, 8, A=NAN, seed=0), "A")
row("ka.SADERF", "scaling-unknown", lambda: ka.SADERF(4, 8, scaling="nope", seed=0), "scaling")
row("ka.HybridRF", "num-angular-neg", lambda: ka.HybridRF(4, 8, num_angular=-1, seed=0), "num_angular")
row("ka.PositiveRF", "from-projection-nan",
    lambda: ka.PositiveRF.from_projection(torch.full((8, 4), NAN)), "W")
row("ka.PositiveRF", "from-projection-1d",
    lambda: ka.PositiveRF.from_projection(torch.ones(8)), "W")
row("ka.PositiveRF", "call-1d", lambda: fm4()(torch.ones(4)), "x")
row("ka.PositiveRF", "call-int", lambda: fm4()(torch.ones(3, 4, dtype=torch.int64)), "x")
row("ka.PositiveRF", "call-list", lambda: fm4()([[1.0] * 4]), "x")
row("ka.PositiveRF", "kernel-wrong-dim", lambda: fm4().kernel(q4(3, 5), q4(3, 4)), "dim")

DETERMINISTIC_CTORS = {
    "ka.EluFeatures": ka.EluFeatures,
    "ka.ReluFeatures": ka.ReluFeatures,
    "ka.TaylorFeatures": ka.TaylorFeatures,
    "ka.NystromFeatures": ka.NystromFeatures,
    "ka.HedgehogFeatures": ka.HedgehogFeatures,
}
for _name, _cls in DETERMINISTIC_CTORS.items():
    row(_name, "dim-0", lambda c=_cls: c(0), "dim")
    row(_name, "dim-str", lambda c=_cls: c("4"), "dim")
    row(_name, "device-nodevice", lambda c=_cls: c(4, 8, device="nodevice"), "device")
    row(_name, "dtype-str", lambda c=_cls: c(4, 8, dtype="float64"), "dtype")
row("ka.NystromFeatures", "ridge-neg", lambda: ka.NystromFeatures(4, 8, ridge=-1.0), "ridge")
row("ka.NystromFeatures", "ridge-nan", lambda: ka.NystromFeatures(4, 8, ridge=NAN), "ridge")
row("ka.NystromFeatures", "landmarks-unknown", lambda: ka.NystromFeatures(4, 8, landmarks="nope"), "landmarks")
row("ka.NystromFeatures", "num-features-0", lambda: ka.NystromFeatures(4, 0), "num_features")
row("ka.HedgehogFeatures", "variant-unknown", lambda: ka.HedgehogFeatures(4, 8, variant="nope"), "variant")
row("ka.HedgehogFeatures", "bias-yes", lambda: ka.HedgehogFeatures(4, 8, bias="yes"), "bias")
row("ka.HedgehogFeatures", "init-unknown", lambda: ka.HedgehogFeatures(4, 8, init="nope"), "init")


def _oprf_batch2_on_batch3() -> None:
    fm = ka.OptimalPositiveRF(4, 8, seed=0)
    fm.fit(q4(2, 6, 4), q4(2, 6, 4) * 0.5)
    fm(q4(3, 6, 4))


def _oprf_fit_meta() -> None:
    fm = ka.OptimalPositiveRF(4, 8, seed=0)
    x = torch.empty(2, 6, 4, device="meta")
    fm.fit(x, x)


row("ka.OptimalPositiveRF", "fitted-batch2-applied-batch3", _oprf_batch2_on_batch3, "batch")
row("ka.OptimalPositiveRF", "fit-meta", _oprf_fit_meta, "meta")

row("ka.diagnose", "q-1d", lambda: ka.diagnose(torch.ones(4), torch.ones(4)), "q")
row("ka.diagnose", "q-list", lambda: ka.diagnose([[1.0]], q4(3, 1)), "q")
row("ka.diagnose", "k-wrong-dim", lambda: ka.diagnose(q4(5, 4), q4(5, 3)), "k")
row("ka.diagnose", "num-features-0", lambda: ka.diagnose(q4(5, 4), q4(5, 4), num_features=0), "num_features")
row("ka.diagnose", "num-features-bool", lambda: ka.diagnose(q4(5, 4), q4(5, 4), num_features=True),
    "num_features")
row("ka.diagnose", "target-nan", lambda: ka.diagnose(q4(5, 4), q4(5, 4), target=NAN), "target")
row("ka.diagnose", "target-neg", lambda: ka.diagnose(q4(5, 4), q4(5, 4), target=-1.0), "target")
row("ka.diagnose", "max-features-0", lambda: ka.diagnose(q4(5, 4), q4(5, 4), max_features=0), "max_features")
row("ka.diagnose", "max-pairs-0", lambda: ka.diagnose(q4(5, 4), q4(5, 4), max_pairs=0), "max_pairs")
row("ka.diagnose", "feature-map-unknown", lambda: ka.diagnose(q4(5, 4), q4(5, 4), "nomap"), "nomap")
row("ka.diagnose", "v-wrong-length", lambda: ka.diagnose(q4(5, 4), q4(5, 4), v=q4(6, 2)), "v")
row("ka.Diagnosis", "regime-not-dict", lambda: ka.Diagnosis(regime=3), "regime")

Q5, K5 = q4(5, 4), q4(5, 4)


def _hedgehog() -> ka.HedgehogFeatures:
    return ka.HedgehogFeatures(4, 8, seed=0)


row("ka.fit_feature_map", "fm-not-map", lambda: ka.fit_feature_map(3, Q5, K5), "fm")
row("ka.fit_feature_map", "steps-0", lambda: ka.fit_feature_map(_hedgehog(), Q5, K5, steps=0), "steps")
row("ka.fit_feature_map", "lr-nan", lambda: ka.fit_feature_map(_hedgehog(), Q5, K5, lr=NAN), "lr")
row("ka.fit_feature_map", "lr-neg", lambda: ka.fit_feature_map(_hedgehog(), Q5, K5, lr=-1.0), "lr")
row("ka.fit_feature_map", "causal-yes", lambda: ka.fit_feature_map(_hedgehog(), Q5, K5, causal="yes"), "causal")
row("ka.fit_feature_map", "seed-neg", lambda: ka.fit_feature_map(_hedgehog(), Q5, K5, seed=-1, steps=1), "seed")
row("ka.fit_feature_map", "q-1d", lambda: ka.fit_feature_map(_hedgehog(), torch.ones(4), K5), "q")
row("ka.distillation_loss", "causal-yes", lambda: ka.distillation_loss(_hedgehog(), Q5, K5, causal="yes"),
    "causal")
row("ka.distillation_loss", "q-1d", lambda: ka.distillation_loss(_hedgehog(), torch.ones(4), K5), "q")
row("ka.distillation_loss", "scale-nan", lambda: ka.distillation_loss(_hedgehog(), Q5, K5, scale=NAN), "scale")

row("ka.GaussianSampler", "sample-num-features-0",
    lambda: ka.GaussianSampler().sample(0, 4, generator=torch.Generator()), "num_features")
row("ka.OrthogonalSampler", "norms-unknown", lambda: ka.OrthogonalSampler(norms="nope"), "norms")
row("ka.OrthogonalSampler", "sample-dim-0",
    lambda: ka.OrthogonalSampler().sample(8, 0, generator=torch.Generator()), "dim")
row("ka.StructuredSampler", "sample-dim-float",
    lambda: ka.StructuredSampler().sample(8, 4.0, generator=torch.Generator()), "dim")
row("ka.QMCSampler", "method-unknown", lambda: ka.QMCSampler(method="nope"), "method")
row("ka.QMCSampler", "randomization-unknown", lambda: ka.QMCSampler(randomization="nope"), "randomization")
row("ka.get_sampler", "unknown", lambda: ka.get_sampler("nosampler"), "nosampler")
row("ka.get_sampler", "not-str", lambda: ka.get_sampler(3), "sampler")

row("ka.softmax_kernel", "q-1d", lambda: ka.softmax_kernel(torch.ones(4), torch.ones(4)), "q")
row("ka.softmax_kernel", "k-wrong-dim", lambda: ka.softmax_kernel(Q5, q4(5, 3)), "k")
row("ka.softmax_kernel", "q-int", lambda: ka.softmax_kernel(torch.ones(5, 4, dtype=torch.int64), K5), "q")

V5 = q4(5, 2)
row("ka.softmax_attention", "causal-yes", lambda: ka.softmax_attention(Q5, K5, V5, causal="yes"), "causal")
row("ka.softmax_attention", "v-wrong-length", lambda: ka.softmax_attention(Q5, K5, q4(6, 2)), "v")
row("ka.softmax_attention", "chunk-size-0", lambda: ka.softmax_attention(Q5, K5, V5, chunk_size=0), "chunk_size")

row("ka.linear_attention", "causal-yes", lambda: ka.linear_attention(Q5, K5, V5, fm4(), causal="yes"), "causal")
row("ka.linear_attention", "return-state-yes",
    lambda: ka.linear_attention(Q5, K5, V5, fm4(), return_state="yes"), "return_state")
row("ka.linear_attention", "eps-nan", lambda: ka.linear_attention(Q5, K5, V5, fm4(), eps=NAN), "eps")
row("ka.linear_attention", "eps-neg", lambda: ka.linear_attention(Q5, K5, V5, fm4(), eps=-1.0), "eps")
row("ka.linear_attention", "chunk-size-0",
    lambda: ka.linear_attention(Q5, K5, V5, fm4(), causal=True, chunk_size=0), "chunk_size")
row("ka.linear_attention", "fm-not-map", lambda: ka.linear_attention(Q5, K5, V5, 3), "feature_map")
row("ka.linear_attention", "q-1d", lambda: ka.linear_attention(torch.ones(4), K5, V5, fm4()), "q")
row("ka.linear_attention", "v-wrong-length", lambda: ka.linear_attention(Q5, K5, q4(6, 2), fm4()), "v")
row("ka.linear_attention", "fit-yes", lambda: ka.linear_attention(Q5, K5, V5, fm4(), fit="yes"), "fit")
row("ka.linear_attention", "check-yes", lambda: ka.linear_attention(Q5, K5, V5, fm4(), check="yes"), "check")
row("ka.parallel_linear_attention", "return-state-yes",
    lambda: ka.parallel_linear_attention(Q5, K5, V5, fm4(), return_state="yes"), "return_state")
row("ka.parallel_linear_attention", "eps-nan",
    lambda: ka.parallel_linear_attention(Q5, K5, V5, fm4(), eps=NAN), "eps")
row("ka.parallel_linear_attention", "eps-neg",
    lambda: ka.parallel_linear_attention(Q5, K5, V5, fm4(), eps=-1.0), "eps")
row("ka.parallel_linear_attention", "q-1d",
    lambda: ka.parallel_linear_attention(torch.ones(4), K5, V5, fm4()), "q")
row("ka.chunk_linear_attention", "chunk-size-0",
    lambda: ka.chunk_linear_attention(Q5, K5, V5, fm4(), chunk_size=0), "chunk_size")
row("ka.chunk_linear_attention", "return-state-yes",
    lambda: ka.chunk_linear_attention(Q5, K5, V5, fm4(), return_state="yes"), "return_state")
row("ka.chunk_linear_attention", "eps-nan",
    lambda: ka.chunk_linear_attention(Q5, K5, V5, fm4(), eps=NAN), "eps")
row("ka.naive_linear_attention", "causal-yes",
    lambda: ka.naive_linear_attention(Q5, K5, V5, fm4(), causal="yes"), "causal")
row("ka.naive_linear_attention", "q-1d", lambda: ka.naive_linear_attention(torch.ones(4), K5, V5, fm4()), "q")
row("ka.naive_recurrent_linear_attention", "q-1d",
    lambda: ka.naive_recurrent_linear_attention(torch.ones(4), K5, V5, fm4()), "q")
row("ka.naive_recurrent_linear_attention", "fm-not-map",
    lambda: ka.naive_recurrent_linear_attention(Q5, K5, V5, 3), "feature_map")
row("ka.RecurrentLinearAttention", "fm-not-map", lambda: ka.RecurrentLinearAttention(3), "feature_map")
row("ka.RecurrentLinearAttention", "eps-nan", lambda: ka.RecurrentLinearAttention(fm4(), eps=NAN), "eps")
row("ka.RecurrentLinearAttention", "eps-neg", lambda: ka.RecurrentLinearAttention(fm4(), eps=-1.0), "eps")
row("ka.RecurrentLinearAttention", "step-wrong-dim",
    lambda: ka.RecurrentLinearAttention(fm4()).step(q4(3), q4(3), q4(2)), r"q_t and k_t.*dim=4.*\(3,\)")
row("ka.RecurrentLinearAttention", "state-other-batch",  # a state of batch 2 stepped with batch 3
    lambda: ka.RecurrentLinearAttention(fm4(), state=ka.LinearAttentionState(torch.zeros(2, 8, 5), torch.zeros(2, 1, 1)))
    .step(q4(3, 4), q4(3, 4), q4(3, 4)), r"state has batch shape \(2,\).*inputs' batch shape \(3,\)")
row("ka.linear_attention", "initial-state-other-batch",
    lambda: ka.linear_attention(q4(3, 5, 4), q4(3, 5, 4), q4(3, 5, 4), fm4(), causal=True,
                                initial_state=ka.LinearAttentionState(torch.zeros(2, 8, 5), torch.zeros(2, 1, 1))),
    r"initial_state has batch shape \(2,\).*inputs' batch shape \(3,\)")
row("ka.LinearAttentionState", "kv-not-tensor", lambda: ka.LinearAttentionState(3, torch.zeros(())), "kv")
row("ka.LinearAttentionState", "log-scale-not-tensor",
    lambda: ka.LinearAttentionState(torch.zeros(8, 2), 3), "log_scale")

row("ka.hybrid_attention", "fm-not-map", lambda: ka.hybrid_attention(Q5, K5, V5, 3, window=2), "feature_map")
row("ka.hybrid_attention", "q-1d", lambda: ka.hybrid_attention(torch.ones(4), K5, V5, fm4(), window=2), "q")
row("ka.hybrid_attention", "v-other-device",
    lambda: ka.hybrid_attention(Q5[None], K5[None], V5[None].to("meta"), fm4(), window=2), "v on meta")
row("ka.linear_attention", "k-other-device",
    lambda: ka.linear_attention(Q5[None], K5[None].to("meta"), V5[None], fm4()), "k on meta")
row("ka.PositiveRF", "device-cuda-unavailable", lambda: ka.PositiveRF(4, 8, device="cuda"), "torch.cuda.is_available")
row("ka.RecurrentHybridAttention", "fm-not-map", lambda: ka.RecurrentHybridAttention(3, window=2), "feature_map")
row("ka.HybridAttentionState", "kv-not-tensor",
    lambda: ka.HybridAttentionState(3, torch.zeros(1, 1), *(torch.zeros(0, 4),) * 4, (), 0, 2), "kv")

# ------------------------------------------------------------------------------------- theory
for _fname in ("bias", "variance", "mse", "relative_mse", "deterministic_error"):
    _f = getattr(th, _fname)
    _fm = ka.EluFeatures if _fname == "deterministic_error" else fm4
    row(f"theory.{_fname}", "fm-not-map", lambda f=_f: f(3, Q5, K5), "fm")
    row(f"theory.{_fname}", "q-wrong-dim", lambda f=_f, m=_fm: f(m(4) if m is ka.EluFeatures else m(), q4(5, 3), K5),
        QK_DIM)
row("theory.estimator_moments", "kind-unknown", lambda: th.estimator_moments("nomap", Q5, K5, 8), "nomap")
row("theory.estimator_moments", "num-features-0", lambda: th.estimator_moments("positive", Q5, K5, 0),
    "num_features")
row("theory.feature_map_kind", "not-map", lambda: th.feature_map_kind(3), "fm.*FeatureMap.*int")
row("theory.orf_pair_count", "num-features-0", lambda: th.orf_pair_count(0, 4), "num_features")
row("theory.orf_pair_count", "dim-bool", lambda: th.orf_pair_count(8, True), "dim")
for _fname in ("trig_sincos_mse", "trig_offset_mse", "positive_mse", "oprf_mse", "hyperbolic_mse"):
    _f = getattr(th, _fname)
    row(f"theory.{_fname}", "num-features-0", lambda f=_f: f(Q5, K5, 0), "num_features")
    row(f"theory.{_fname}", "orthogonal-unknown", lambda f=_f: f(Q5, K5, 8, orthogonal="nope"), "orthogonal")
    row(f"theory.{_fname}", "q-wrong-dim", lambda f=_f: f(q4(5, 3), K5, 8), QK_DIM)
row("theory.oprf_optimal_A", "d-0", lambda: th.oprf_optimal_A(1.0, 0), "d")
row("theory.oprf_optimal_A", "t-nan", lambda: th.oprf_optimal_A(NAN, 4), "t")
for _fname in ("trig_bias", "positive_bias", "hyperbolic_bias"):
    _f = getattr(th, _fname)
    row(f"theory.{_fname}", "orthogonal-unknown", lambda f=_f: f(Q5, K5, orthogonal="nope"), "orthogonal")
    row(f"theory.{_fname}", "q-wrong-dim", lambda f=_f: f(q4(5, 3), K5), QK_DIM)
for _fname in ("smreg_kernel", "fixed_norm_trig_kernel"):
    _f = getattr(th, _fname)
    row(f"theory.{_fname}", "q-wrong-dim", lambda f=_f: f(q4(5, 3), K5), QK_DIM)
row("theory.performer_theorem2_bound", "num-features-0", lambda: th.performer_theorem2_bound(Q5, K5, 0),
    "num_features")
row("theory.failure_probability", "eps-neg", lambda: th.failure_probability(fm4(), -1.0, Q5, K5), "eps")
row("theory.failure_probability", "method-unknown",
    lambda: th.failure_probability(fm4(), 0.1, Q5, K5, method="nope"), "method")
row("theory.required_features", "delta-2", lambda: th.required_features(fm4(), 0.1, 2.0, Q5, K5), "delta")
row("theory.required_features", "eps-nan", lambda: th.required_features(fm4(), NAN, 0.1, Q5, K5), "eps")
row("theory.required_features", "reduce-unknown",
    lambda: th.required_features(fm4(), 0.1, 0.1, Q5, K5, reduce="nope"), "reduce")
row("theory.required_features", "q-nan",
    lambda: th.required_features(fm4(), 0.1, 0.1, torch.full((5, 4), NAN), K5), "q must be finite")
row("theory.mse", "k-nan", lambda: th.mse(fm4(), Q5, torch.full((5, 4), NAN)), "k must be finite")
for _fname in ("rahimi_recht_features", "sutherland_schneider_features", "sriperumbudur_szabo_features",
               "performer_theorem4_features", "derived_sincos_features"):
    _f = getattr(th, _fname)
    row(f"theory.{_fname}", "eps-0", lambda f=_f: f(0.0, 0.1, 4, 1.0), "eps")
    row(f"theory.{_fname}", "delta-nan", lambda f=_f: f(0.1, NAN, 4, 1.0), "delta")
    row(f"theory.{_fname}", "dim-0", lambda f=_f: f(0.1, 0.1, 0, 1.0), "dim")
    row(f"theory.{_fname}", "radius-neg", lambda f=_f: f(0.1, 0.1, 4, -1.0), "radius")
row("theory.derived_sincos_failure_probability", "eps_g-0",
    lambda: th.derived_sincos_failure_probability(0.0, 8, 4, 1.0), "eps_g")
row("theory.derived_sincos_failure_probability", "eps_g-nan",
    lambda: th.derived_sincos_failure_probability(NAN, 8, 4, 1.0), "eps_g")
row("theory.derived_sincos_failure_probability", "num_projections-0",
    lambda: th.derived_sincos_failure_probability(0.1, 0, 4, 1.0), "num_projections")
row("theory.derived_sincos_failure_probability", "dim-0",
    lambda: th.derived_sincos_failure_probability(0.1, 8, 0, 1.0), "dim")
row("theory.derived_sincos_failure_probability", "radius-neg",
    lambda: th.derived_sincos_failure_probability(0.1, 8, 4, -1.0), "radius")
row("theory.sutherland_schneider_features", "variant-unknown",
    lambda: th.sutherland_schneider_features(0.1, 0.1, 4, 1.0, variant="nope"), "variant")
row("theory.required_features_uniform", "bound-unknown",
    lambda: th.required_features_uniform("trig-sincos", 0.1, 0.1, 4, 1.0, bound="nope"), "bound")
row("theory.required_features_uniform", "eps-0",
    lambda: th.required_features_uniform("trig-sincos", 0.0, 0.1, 4, 1.0), "eps")
for _fname in ("attention_variance", "normaliser_relative_variance"):
    _f = getattr(th, _fname)
    _args = (Q5, K5, V5) if _fname == "attention_variance" else (Q5, K5)
    row(f"theory.{_fname}", "fm-not-map", lambda f=_f, a=_args: f(3, *a), "fm")
    row(f"theory.{_fname}", "causal-yes", lambda f=_f, a=_args: f(fm4(), *a, causal="yes"), "causal")
    row(f"theory.{_fname}", "q-1d", lambda f=_f, a=_args: f(fm4(), torch.ones(4), *a[1:]), "q")
row("theory.kernel_covariance", "fm-not-map", lambda: th.kernel_covariance(3, Q5, K5), "fm")
row("theory.kernel_covariance", "q-1d", lambda: th.kernel_covariance(fm4(), torch.ones(4), K5), "q")
row("theory.exact_mass", "q-1d", lambda: th.exact_mass(torch.ones(4), K5, window=2), "q")
for _fname in ("hybrid_attention_variance", "hybrid_numerator_variance", "hybrid_numerator_mse",
               "hybrid_normaliser_variance", "hybrid_normaliser_mse"):
    _f = getattr(th, _fname)
    _args = (Q5, K5, V5) if "normaliser" not in _fname else (Q5, K5)
    row(f"theory.{_fname}", "fm-not-map", lambda f=_f, a=_args: f(3, *a, window=2), "fm",
        None)
    row(f"theory.{_fname}", "q-1d", lambda f=_f, a=_args: f(fm4(), torch.ones(4), *a[1:], window=2), "q")
row("theory.hybrid_error_identity", "p-list", lambda: th.hybrid_error_identity([1.0], V5, V5, V5), "p")

# --------------------------------------------------------------------------------- montecarlo
for _fname in ("relative_error", "relative_rms", "relative_frobenius", "max_abs_error",
               "attention_relative_error", "total_variation"):
    _f = getattr(mc, _fname)
    row(f"mc.{_fname}", "shape-mismatch", lambda f=_f: f(q4(3, 4), q4(3, 5)), r"estimate.*\(3, 4\).*exact")
    row(f"mc.{_fname}", "estimate-list", lambda f=_f: f([1.0], torch.ones(1)), "estimate")
for _fname in ("mean_ci", "variance_ci"):
    _f = getattr(mc, _fname)
    row(f"mc.{_fname}", "confidence-1", lambda f=_f: f(q4(10), confidence=1.0), "confidence")
    row(f"mc.{_fname}", "confidence-nan", lambda f=_f: f(q4(10), confidence=NAN), "confidence")
    row(f"mc.{_fname}", "axis-out-of-range", lambda f=_f: f(q4(10), axis=3), "axis")
    row(f"mc.{_fname}", "axis-float", lambda f=_f: f(q4(10), axis=0.0), "axis")
    row(f"mc.{_fname}", "x-str", lambda f=_f: f("abc"), "x")
row("mc.quantile_ci", "q-2", lambda: mc.quantile_ci(q4(10), 2.0), "q")
row("mc.quantile_ci", "q-nan", lambda: mc.quantile_ci(q4(10), NAN), "q")
row("mc.quantile_ci", "confidence-0", lambda: mc.quantile_ci(q4(10), 0.5, confidence=0.0), "confidence")
row("mc.quantile_ci", "x-2d", lambda: mc.quantile_ci(q4(10, 2), 0.5), "x")
row("mc.ratio_of_means_ci", "shape-mismatch", lambda: mc.ratio_of_means_ci(q4(10, 3), q4(10, 4)), "shape")
row("mc.ratio_of_means_ci", "confidence-2", lambda: mc.ratio_of_means_ci(q4(10), q4(10), confidence=2.0),
    "confidence")
row("mc.StreamingMoments", "update-str", lambda: mc.StreamingMoments().update("abc"), "x must be.*str")
row("mc.StreamingMoments", "update-shape-change",
    lambda: (s := mc.StreamingMoments(), s.update(q4(3, 2)), s.update(q4(3, 4))), "shape")
row("mc.batched_draws", "draws-0", lambda: list(mc.batched_draws(fm4(), 0, chunk_size=2)), "draws")
row("mc.batched_draws", "chunk-size-0", lambda: list(mc.batched_draws(fm4(), 4, chunk_size=0)), "chunk_size")
row("mc.batched_draws", "seed-neg", lambda: list(mc.batched_draws(fm4(), 4, chunk_size=2, seed=-1)), "seed")
row("mc.batched_draws", "dtype-str",
    lambda: list(mc.batched_draws(fm4(), 4, chunk_size=2, dtype="float64")), "dtype")
row("mc.batched_draws", "device-nodevice",
    lambda: list(mc.batched_draws(fm4(), 4, chunk_size=2, device="nodevice")), "device")
row("mc.batched_draws", "fm-not-map", lambda: list(mc.batched_draws(3, 4, chunk_size=2)), "fm")
row("mc.kernel_error", "dtype-str", lambda: mc.kernel_error(fm4(), Q5, K5, 8, dtype="float64"), "dtype")
row("mc.kernel_error", "device-nodevice",
    lambda: mc.kernel_error(fm4(), Q5, K5, 8, device="nodevice"), "device")
row("mc.kernel_error", "seed-neg", lambda: mc.kernel_error(fm4(), Q5, K5, 8, seed=-1), "seed")
row("mc.kernel_error", "seed-bool", lambda: mc.kernel_error(fm4(), Q5, K5, 8, seed=True), "seed")
row("mc.kernel_error", "q-nan", lambda: mc.kernel_error(fm4(), torch.full((5, 4), NAN), K5, 8), "q must be finite")
row("mc.mean_ci", "x-nan", lambda: mc.mean_ci(torch.tensor([1.0, NAN, 2.0])), "NaN draws")
row("mc.mean_ci", "nan-policy-unknown", lambda: mc.mean_ci(q4(10), nan_policy="omit"), "nan_policy")
row("mc.kernel_error", "draws-0", lambda: mc.kernel_error(fm4(), Q5, K5, 0), "draws")
row("mc.kernel_error", "draws-float", lambda: mc.kernel_error(fm4(), Q5, K5, 8.0), "draws")
row("mc.kernel_error", "q-1d", lambda: mc.kernel_error(fm4(), torch.ones(4), K5, 8), "q")
row("mc.kernel_error", "k-wrong-dim", lambda: mc.kernel_error(fm4(), Q5, q4(5, 3), 8), "k")
row("mc.kernel_error", "confidence-nan", lambda: mc.kernel_error(fm4(), Q5, K5, 8, confidence=NAN),
    "confidence")
row("mc.kernel_error", "quantiles-2", lambda: mc.kernel_error(fm4(), Q5, K5, 8, quantiles=(2.0,)), "quantiles")
row("mc.kernel_error", "max-bytes-0", lambda: mc.kernel_error(fm4(), Q5, K5, 8, max_bytes=0), "max_bytes")
row("mc.kernel_error", "chunk-size-0", lambda: mc.kernel_error(fm4(), Q5, K5, 8, chunk_size=0), "chunk_size")
row("mc.kernel_error", "fm-not-map", lambda: mc.kernel_error(3, Q5, K5, 8), "fm")
row("mc.kernel_error", "q-meta",
    lambda: mc.kernel_error(fm4(), torch.empty(5, 4, device="meta"), K5, 8), "q")
row("mc.attention_error", "causal-yes", lambda: mc.attention_error(fm4(), Q5, K5, V5, 8, causal="yes"), "causal")
row("mc.attention_error", "dtype-str",
    lambda: mc.attention_error(fm4(), Q5, K5, V5, 8, dtype="float64"), "dtype")
row("mc.attention_error", "device-nodevice",
    lambda: mc.attention_error(fm4(), Q5, K5, V5, 8, device="nodevice"), "device")
row("mc.attention_error", "seed-neg", lambda: mc.attention_error(fm4(), Q5, K5, V5, 8, seed=-1), "seed")
row("mc.attention_error", "draws-0", lambda: mc.attention_error(fm4(), Q5, K5, V5, 0), "draws")
row("mc.attention_error", "v-wrong-length", lambda: mc.attention_error(fm4(), Q5, K5, q4(6, 2), 8), "v")
row("mc.attention_error", "v-1d", lambda: mc.attention_error(fm4(), Q5, K5, torch.ones(5), 8), "v")

# ----------------------------------------------------------------------------------------- nn
row("nn.LinearAttention", "dim-0", lambda: kann.LinearAttention(0), "dim")
row("nn.LinearAttention", "heads-0", lambda: kann.LinearAttention(32, heads=0), "heads")
row("nn.LinearAttention", "heads-bool", lambda: kann.LinearAttention(32, heads=True), "heads")
row("nn.LinearAttention", "causal-yes", lambda: kann.LinearAttention(32, heads=4, causal="yes"), "causal")
row("nn.LinearAttention", "num-features-0", lambda: kann.LinearAttention(32, heads=4, num_features=0),
    "num_features")
row("nn.LinearAttention", "feature-map-unknown",
    lambda: kann.LinearAttention(32, heads=4, feature_map="nomap"), "nomap")
row("nn.LinearAttention", "sampler-unknown",
    lambda: kann.LinearAttention(32, heads=4, sampler="nosampler"), "sampler")
row("nn.LinearAttention", "seed-neg", lambda: kann.LinearAttention(32, heads=4, seed=-1), "seed")
row("nn.LinearAttention", "device-nodevice", lambda: kann.LinearAttention(32, heads=4, device="nodevice"),
    "device")
row("nn.LinearAttention", "dtype-str", lambda: kann.LinearAttention(32, heads=4, dtype="float64"), "dtype")
row("nn.LinearAttention", "forward-wrong-dim", lambda: kann.LinearAttention(32, heads=4)(q4(2, 5, 31)),
    r"x must have shape.*dim=32.*\(2, 5, 31\)")
row("nn.LinearAttention", "forward-1d", lambda: kann.LinearAttention(32, heads=4)(q4(32)),
    r"x must have shape.*got shape \(32,\)")
row("nn.LinearAttentionHeads", "dim-head-0", lambda: kann.LinearAttentionHeads(0), "dim_head")
row("nn.LinearAttentionHeads", "causal-yes", lambda: kann.LinearAttentionHeads(8, causal="yes"), "causal")
row("nn.LinearAttentionHeads", "seed-neg", lambda: kann.LinearAttentionHeads(8, seed=-1), "seed")
row("nn.LinearAttentionHeads", "device-nodevice", lambda: kann.LinearAttentionHeads(8, device="nodevice"),
    "device")
row("nn.LinearAttentionHeads", "forward-wrong-dim",
    lambda: kann.LinearAttentionHeads(8)(q4(2, 1, 5, 7), q4(2, 1, 5, 7), q4(2, 1, 5, 7)),
    "last dimension 7.*dim=8")
row("nn.MultiheadLinearAttention", "heads-not-dividing", lambda: kann.MultiheadLinearAttention(32, 5),
    "dim=32.*heads=5")
row("nn.MultiheadLinearAttention", "num-heads-0", lambda: kann.MultiheadLinearAttention(32, 0), "num_heads")
row("nn.MultiheadLinearAttention", "dropout-2", lambda: kann.MultiheadLinearAttention(32, 4, dropout=2.0),
    "dropout")
row("nn.MultiheadLinearAttention", "dropout-nan", lambda: kann.MultiheadLinearAttention(32, 4, dropout=NAN),
    "dropout")
row("nn.MultiheadLinearAttention", "batch-first-yes",
    lambda: kann.MultiheadLinearAttention(32, 4, batch_first="yes"), "batch_first")
row("nn.MultiheadLinearAttention", "device-nodevice",
    lambda: kann.MultiheadLinearAttention(32, 4, device="nodevice"), "device")
row("nn.MultiheadLinearAttention", "dtype-str", lambda: kann.MultiheadLinearAttention(32, 4, dtype="float64"),
    "dtype")
row("nn.default_num_features", "dim-head-0", lambda: kann.default_num_features(0), "dim_head")
row("nn.default_num_features", "dim-head-float", lambda: kann.default_num_features(8.0), "dim_head")

# ----------------------------------------------------------------------------------------- hf
if hf is not None:
    row("hf.capture", "layers-out-of-range", lambda: hf.capture(gpt2(), layers=[7], input_ids=IDS), "layers")
    row("hf.capture", "layers-neg", lambda: hf.capture(gpt2(), layers=[-1], input_ids=IDS), "layers")
    row("hf.capture", "layers-str", lambda: hf.capture(gpt2(), layers="0", input_ids=IDS), "layers")
    row("hf.capture", "record-output-yes",
        lambda: hf.capture(gpt2(), record_output="yes", input_ids=IDS), "record_output")
    row("hf.capture", "to-nodevice", lambda: hf.capture(gpt2(), to="nodevice", input_ids=IDS), "to")
    row("hf.capture", "model-not-model", lambda: hf.capture(3, input_ids=IDS), "model")
    row("hf.stream", "layers-out-of-range", lambda: list(hf.stream(gpt2(), layers=[7], input_ids=IDS)), "layers")
    row("hf.stream", "record-output-yes",
        lambda: list(hf.stream(gpt2(), record_output="yes", input_ids=IDS)), "record_output")
    row("hf.stream", "to-nodevice", lambda: list(hf.stream(gpt2(), to="nodevice", input_ids=IDS)), "to")
    row("hf.stream", "model-not-model", lambda: list(hf.stream(3, input_ids=IDS)), "model")
    row("hf.linearize", "layers-out-of-range",
        lambda: lin("positive", layers=[5], num_features=8), "layers")
    row("hf.linearize", "num-features-0", lambda: lin("positive", num_features=0), "num_features")
    row("hf.linearize", "num-features-str",
        lambda: lin("positive", num_features="8"), "num_features")
    row("hf.linearize", "sampler-unknown",
        lambda: lin("positive", num_features=8, sampler="nosampler"), "sampler")
    row("hf.linearize", "seed-neg", lambda: lin("positive", num_features=8, seed=-1), "seed")
    row("hf.linearize", "seed-str", lambda: lin("positive", num_features=8, seed="0"), "seed")
    row("hf.linearize", "option-unknown",
        lambda: lin("positive", num_features=8, nonsense=1), "nonsense")
    row("hf.linearize", "feature-map-unknown", lambda: lin("nomap", num_features=8), "nomap")
    row("hf.linearize", "chunk-size-0",
        lambda: lin("positive", num_features=8, chunk_size=0), "chunk_size")
    row("hf.linearize", "check-yes", lambda: lin("positive", num_features=8, check="yes"),
        "check")
    row("hf.linearize", "progress-yes",
        lambda: lin("positive", num_features=8, progress="yes"), "progress")
    row("hf.linearize", "fit-lr-nan", lambda: lin("positive", num_features=8, fit_lr=NAN),
        "fit_lr")
    row("hf.linearize", "fit-batch-size-0",
        lambda: lin("positive", num_features=8, fit_batch_size=0), "fit_batch_size")
    row("hf.Capture", "layers-not-list", lambda: hf.Capture(layers=3), "layers")
    row("hf.Capture", "empty-stack", lambda: hf.Capture().q, "capture is empty")
    row("hf.LayerCapture", "q-not-tensor",
        lambda: hf.LayerCapture(0, 3, K5, V5, 1.0, torch.ones(5, 5, dtype=torch.bool), False), "q")
    row("hf.Linearized", "feature-maps-not-dict", lambda: hf.Linearized(gpt2(), 3, None, None), "feature_maps")
    row("hf.load_minilm", "attn-implementation-unknown",
        lambda: hf.load_minilm(attn_implementation="nope"), "attn_implementation")
    row("hf.load_minilm", "device-nodevice", lambda: hf.load_minilm(device="nodevice"), "device")
    row("hf.pydoc_text", "split-unknown", lambda: hf.pydoc_text("nope"), "split")
    row("hf.pydoc_text", "calibration-fraction-2",
        lambda: hf.pydoc_text(calibration_fraction=2.0), "calibration_fraction")
    row("hf.pydoc_text", "calibration-fraction-nan",
        lambda: hf.pydoc_text(calibration_fraction=NAN), "calibration_fraction")
    row("hf.token_chunks", "length-0", lambda: hf.token_chunks(None, "text", length=0), "length")
    row("hf.token_chunks", "max-chunks-0", lambda: hf.token_chunks(None, "text", max_chunks=0), "max_chunks")
    row("hf.token_chunks", "text-not-str", lambda: hf.token_chunks(None, 3), "text")
    row("hf.sentence_embeddings", "model-not-model", lambda: hf.sentence_embeddings(3, input_ids=IDS), "model")
    row("hf.save_linearized", "lin-not-handle", lambda: hf.save_linearized(3, "unused"), "lin")
    row("hf.save_linearized", "directory-int", lambda: save_linearized_to(3), "directory")
    row("hf.load_linearized", "directory-int", lambda: hf.load_linearized(3), "directory")
    row("hf.load_linearized", "directory-not-saved", lambda: hf.load_linearized("/nonexistent-dir"), "directory")

# ------------------------------------------------------------------------------------ sklearn
row("sk.RandomFeatures", "n-components-0", lambda: kask.RandomFeatures(n_components=0).fit(q4(5, 4)),
    "n_components")
row("sk.RandomFeatures", "gamma-nan", lambda: kask.RandomFeatures(gamma=NAN).fit(q4(5, 4)), "gamma")
row("sk.RandomFeatures", "gamma-neg", lambda: kask.RandomFeatures(gamma=-1.0).fit(q4(5, 4)), "gamma")
row("sk.RandomFeatures", "kernel-unknown", lambda: kask.RandomFeatures(kernel="nope").fit(q4(5, 4)), "kernel")
row("sk.RandomFeatures", "estimator-unknown",
    lambda: kask.RandomFeatures(estimator="nomap").fit(q4(5, 4)), "estimator")
row("sk.RandomFeatures", "sampler-unknown",
    lambda: kask.RandomFeatures(sampler="nosampler").fit(q4(5, 4)), "sampler")
row("sk.RandomFeatures", "random-state-neg", lambda: kask.RandomFeatures(random_state=-1).fit(q4(5, 4)),
    "random_state")
row("sk.RandomFeatures", "random-state-str", lambda: kask.RandomFeatures(random_state="0").fit(q4(5, 4)),
    "random_state")
row("sk.RandomFeatures", "transform-wrong-width",
    lambda: kask.RandomFeatures(random_state=0).fit(q4(5, 4).numpy()).transform(q4(5, 3).numpy()),
    "3 features.*expecting 4")
row("sk.RandomFeatures", "fit-1d", lambda: kask.RandomFeatures(random_state=0).fit(q4(5).numpy()),
    "Expected 2D array, got 1D")
row("sk.supported_estimators", "takes-no-arguments", lambda: kask.supported_estimators(3),
    "takes 0 positional arguments")


# --------------------------------------------------------------------------------------- tests
@pytest.mark.parametrize(("owner", "call", "match"), ROWS)
def test_bad_call(owner: str, call: Callable[[], object], match: str) -> None:
    with pytest.raises(BAD, match=match):
        call()


# Public callables that take no arguments to get wrong: result containers built by the library.
EXEMPT: dict[str, str] = {
    "theory.Components": "a result container the closed forms fill (arrays of any shape)",
    "theory.Moments": "a named tuple of results (bias, variance, mse of any type)",
    "ka.KernelApproxWarning": "a warning category (any message)",
}


def _public_callables() -> set[str]:
    out = set()
    modules: list[tuple[str, Any]] = [("ka", ka), ("theory", th), ("mc", mc), ("nn", kann), ("sk", kask)]
    if hf is not None:
        modules.append(("hf", hf))
    for prefix, mod in modules:
        for name in mod.__all__:
            obj = getattr(mod, name)
            if callable(obj) and not inspect.ismodule(obj):
                out.add(f"{prefix}.{name}")
    return out


def test_every_public_callable_has_a_row() -> None:
    covered = {p.values[0] for p in ROWS}
    missing = sorted(_public_callables() - covered - set(EXEMPT))
    assert not missing, f"public callables without a bad-input row: {missing}"
    stale = sorted(covered - _public_callables())
    assert not stale, f"rows for names that are not public: {stale}"


def test_table_size() -> None:
    assert len(ROWS) >= 300 and not math.isnan(len(ROWS))
