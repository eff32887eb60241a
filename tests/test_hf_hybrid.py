"""kernelapprox.hf.linearize with hybrid attention (window, sinks), exact heads, and maps as state.

What is pinned here, on the tiny random BERT, GPT-2 and LLaMA (grouped-query) models of
``test_hf``:

* ``window >= n`` is the model's softmax attention (padded and unpadded batches), a short window
  is not;
* layer 0 of the linearised model equals `kernelapprox.hybrid_attention` computed by hand on the
  original model's capture, per sequence on its valid tokens (sinks ``[0, -1]`` are each BERT
  sequence's [CLS] and its last valid token);
* padding invariance: a padded sequence gives the outputs of the same tokens alone (padded keys
  are never in a window, a sink or a sum);
* ``exact_heads``: the chosen heads are softmax attention, the others are not; ``exact_heads=k``
  keeps the ``k`` heads with the largest calibration error (predicted for Gaussian rows, measured
  otherwise);
* the maps are submodules while linearised: ``state_dict`` holds them, a fresh copy linearised
  with another seed and loaded from it gives identical outputs, ``save_pretrained`` works, and
  ``restore()`` gives back the original ``state_dict`` keys and outputs bit for bit;
* bad arguments raise ``TypeError``/``ValueError`` naming them, at the call.

Tolerances as in ``test_hf``: float32 models with outputs O(0.1-1), rounding below 1e-6 measured;
the checks use 1e-5, the approximations they are told apart from differ by >= 1e-4 (asserted).
"""

from __future__ import annotations

import copy
import math

import pytest
import torch

pytest.importorskip("transformers")

from test_hf import ARCHS, CAUSAL, DH, HEADS, LAYERS, N, attn_module, build, hidden, inputs, project  # noqa: E402

import kernelapprox as ka  # noqa: E402
from kernelapprox import hf  # noqa: E402
from kernelapprox.attention.hybrid import hybrid_attention  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")


def padded(arch: str) -> dict[str, torch.Tensor]:
    """Row 1 padded: on the right (BERT, as a tokenizer pads) or on the left (decoders, as batched
    generation pads)."""
    inp = inputs(pad=True)
    if CAUSAL[arch]:
        inp["attention_mask"] = inp["attention_mask"].flip(-1)
    return inp


def module_output(model, arch: str, inp: dict[str, torch.Tensor], **kw) -> torch.Tensor:
    """Layer 0's attention-module output under linearize(**kw)."""
    got = {}
    hook = attn_module(model, arch, 0).register_forward_hook(lambda m, a, out: got.setdefault("o", out[0]))
    try:
        with hf.linearize(model, **kw), torch.no_grad():
            model(**inp)
    finally:
        hook.remove()
    return got["o"]


@pytest.mark.parametrize("pad", [False, True], ids=["unpadded", "padded"])
@pytest.mark.parametrize("arch", ARCHS)
def test_a_window_covering_the_sequence_is_the_softmax_model(arch, pad):
    model = build(arch)
    inp = padded(arch) if pad else inputs(pad=False)
    ref = hidden(model, **inp)
    valid = inp["attention_mask"].bool()
    for window, sinks in ((N, 0), (N, [0, 2]), (100, 1)):
        with hf.linearize(model, "positive", num_features=16, window=window, sinks=sinks) as lin:
            out = hidden(model, **inp)
        assert lin.window == window and lin.sinks == (sinks if isinstance(sinks, int) else tuple(sinks))
        assert (out - ref)[valid].abs().max() <= 1e-5
    # the check can fail: a window of 2 keys leaves the feature map most of the row
    with hf.linearize(model, "positive", num_features=16, window=2):
        short = hidden(model, **inp)
    assert (short - ref)[valid].abs().max() > 1e-4


@pytest.mark.parametrize("arch", ARCHS)
def test_layer0_equals_hybrid_attention_by_hand_per_sequence(arch):
    """Window 3, sinks: one leading token (decoders) or [CLS] and the last valid token (BERT), on a
    padded batch: each sequence's valid query rows equal hybrid_attention on its valid tokens."""
    model = build(arch)
    inp = padded(arch)
    cap = hf.capture(model, **inp)
    lc = cap.layers[0]
    fm = ka.PositiveRF(dim=DH, num_features=16, batch_shape=(HEADS,), seed=0)
    sinks = 1 if CAUSAL[arch] else [0, -1]
    got = module_output(model, arch, inp, feature_map={0: fm}, layers=[0], window=3, sinks=sinks)
    q, k = lc.kernel_inputs()
    valid = inp["attention_mask"].bool()
    for i in range(q.shape[0]):
        idx = valid[i].nonzero().squeeze(-1)
        L = idx.numel()
        sk = 1 if CAUSAL[arch] else [0, L - 1]  # the sequence's own last valid token
        o = hybrid_attention(q[i][:, idx], k[i][:, idx], lc.v[i][:, idx], fm, window=3, sinks=sk,
                             causal=CAUSAL[arch])
        ref = project(model, arch, o.unsqueeze(0))[0]
        assert (got[i, idx] - ref).abs().max() <= 1e-5
        # the check can fail: the padded positions' sinks (n - 1 instead of L - 1), or no sinks
        wrong = hybrid_attention(q[i][:, idx], k[i][:, idx], lc.v[i][:, idx], fm, window=3, sinks=0,
                                 causal=CAUSAL[arch])
        assert (got[i, idx] - project(model, arch, wrong.unsqueeze(0))[0]).abs().max() > 1e-5


@pytest.mark.parametrize("arch", ARCHS)
def test_padded_keys_are_never_in_the_window_or_the_sinks(arch):
    """Row 1 of a padded batch gives the outputs of its valid tokens run alone."""
    model = build(arch)
    inp = padded(arch)
    valid = inp["attention_mask"][1].bool()
    alone = {"input_ids": inp["input_ids"][1:, valid]}
    if arch == "llama" or arch == "gpt2":  # positions of the valid tokens, as generation gives them
        alone["position_ids"] = torch.arange(int(valid.sum()))[None]
        inp = {**inp, "position_ids": (inp["attention_mask"].cumsum(-1) - 1).clamp_min(0)}
    kw = dict(num_features=16, window=3, sinks=1 if CAUSAL[arch] else [0, -1])
    with hf.linearize(model, "positive", **kw):
        batch = hidden(model, **inp)[1, valid]
        single = hidden(model, **alone)[0]
    assert (batch - single).abs().max() <= 1e-5
    # the check can fail: the padded batch without its mask mixes the padded keys in
    with hf.linearize(model, "positive", **kw):
        leak = hidden(model, **{k: v for k, v in inp.items() if k != "attention_mask"})[1, valid]
    assert (leak - single).abs().max() > 1e-4


@pytest.mark.parametrize("arch", ARCHS)
def test_exact_heads_keep_softmax_attention(arch):
    model = build(arch)
    inp = padded(arch)
    ref = hidden(model, **inp)
    valid = inp["attention_mask"].bool()
    every = {layer: list(range(HEADS)) for layer in range(LAYERS)}
    with hf.linearize(model, "positive", num_features=16, exact_heads=every) as lin:
        out = hidden(model, **inp)
    assert lin.exact_heads == every
    assert (out - ref)[valid].abs().max() <= 1e-5
    # one head: that head of layer 0 is the model's own, the others are not
    cap = hf.capture(model, record_output=True, **inp)
    soft = cap.layers[0].output  # (b, h, n, d_head)
    got = module_output(model, arch, inp, feature_map="positive", num_features=16, window=2,
                        exact_heads={0: [2], 1: 0})
    if arch == "bert":  # BERT's module output is the heads side by side
        heads = got.reshape(*got.shape[:2], HEADS, DH).transpose(1, 2)
        per_head = (heads - soft).abs().masked_fill(~valid[:, None, :, None], 0).amax((0, 2, 3))
        assert per_head[2] <= 1e-5 and (per_head[[0, 1, 3]] > 1e-5).all(), per_head
    else:  # after the output projection: only the whole layer can be compared
        assert (got - project(model, arch, soft))[valid].abs().max() > 1e-5


@pytest.mark.parametrize("sampler, kind", [("gaussian", "predicted"), ("orthogonal", "measured")])
def test_exact_heads_by_count_keeps_the_worst_heads_on_calibration(sampler, kind):
    model = build("gpt2")
    cal = dict(input_ids=inputs(pad=False, seed=7, n=12)["input_ids"])
    with hf.linearize(model, "positive", num_features=8, sampler=sampler, window=2, exact_heads=3,
                      calibration=cal) as lin:
        assert lin.head_error_kind == kind
        assert sum(len(h) for h in lin.exact_heads.values()) == 3
        errs = {(layer, h): float(e) for layer, err in lin.head_errors.items() for h, e in enumerate(err)}
        assert set(errs) == {(layer, h) for layer in range(LAYERS) for h in range(HEADS)}
        kept = {(layer, h) for layer, hs in lin.exact_heads.items() for h in hs}
        assert min(errs[x] for x in kept) >= max(errs[x] for x in errs if x not in kept)
        assert all(e > 0 and math.isfinite(e) for e in errs.values())
        assert all(hs == sorted(hs) for hs in lin.exact_heads.values())
    if kind == "measured":  # the hybrid layer's error on the calibration text, summed over sequences
        lc = hf.capture(model, **cal).layers[1]
        q, k = lc.kernel_inputs()
        with hf.linearize(model, "positive", num_features=8, sampler=sampler, window=2) as plain:
            fm = plain.feature_maps[1]
        o = hybrid_attention(q, k, lc.v, fm, window=2, causal=True).double()
        exact = lc.softmax_attention()
        rel = ((o - exact).norm(dim=(-2, -1)) / exact.norm(dim=(-2, -1))).sum(0)
        torch.testing.assert_close(lin.head_errors[1], rel, rtol=1e-4, atol=0)
    else:  # the delta method's relative output error, summed over sequences
        from kernelapprox.theory.hybrid_attention import hybrid_attention_variance

        lc = hf.capture(model, **cal).layers[1]
        q, k = (t.double() for t in lc.kernel_inputs())
        var = hybrid_attention_variance(lin.feature_maps[1], q, k, lc.v.double(), window=2, causal=True)
        exact = lc.softmax_attention()
        pred = (var.sum((-2, -1)).sqrt() / exact.norm(dim=(-2, -1))).sum(0)
        torch.testing.assert_close(lin.head_errors[1], pred, rtol=1e-6, atol=0)


def test_maps_are_part_of_the_model_state_while_linearised(tmp_path):
    model = build("llama")
    fresh = copy.deepcopy(model)
    inp = inputs(pad=True)
    ref = hidden(model, **inp)
    keys = list(model.state_dict())
    lin = hf.linearize(model, "positive", num_features=16, window=3, seed=0)
    added = sorted(set(model.state_dict()) - set(keys))
    assert added == [f"layers.{i}.self_attn.kernelapprox_feature_map.projection._weight" for i in range(LAYERS)]
    assert attn_module(model, "llama", 1).kernelapprox_feature_map is lin.feature_maps[1]
    out = hidden(model, **inp)
    sd = model.state_dict()
    model.save_pretrained(tmp_path)
    lin.restore()
    assert list(model.state_dict()) == keys  # the same keys, in the same order
    assert torch.equal(hidden(model, **inp), ref)
    # a fresh copy linearised with other maps, then loaded: the same outputs
    with hf.linearize(fresh, "positive", num_features=16, window=3, seed=5):
        other = hidden(fresh, **inp)
        assert (other - out).abs().max() > 1e-4  # the seed matters
        fresh.load_state_dict(sd)
        assert torch.equal(hidden(fresh, **inp), out)
    assert list(fresh.state_dict()) == keys


def test_learned_maps_reach_the_state_dict():
    model = build("bert")
    cal = dict(input_ids=inputs(pad=False, seed=7, n=12)["input_ids"])
    with hf.linearize(model, "hedgehog", num_features=8, calibration=cal, fit_steps=5) as lin:
        sd = model.state_dict()
        w = sd["encoder.layer.0.attention.self.kernelapprox_feature_map.weight"]
        assert torch.equal(w, lin.feature_maps[0].weight)
        names = {n for n, _ in model.named_parameters()}
        assert "encoder.layer.1.attention.self.kernelapprox_feature_map.weight" in names


@pytest.mark.parametrize("arch", ["bert", "gpt2"])
def test_learned_maps_are_fitted_to_the_remainder_when_hybrid(arch):
    """With a window, each layer's Hedgehog map equals `fit_feature_map(..., window=, sinks=)` on
    the calibration capture (same seed: the same steps bit for bit), not the whole-row fit; a
    window covering every calibration key falls back to whole rows."""
    from kernelapprox.maps.hedgehog import HedgehogFeatures
    from kernelapprox.training import fit_feature_map

    model = build(arch)
    cal = dict(input_ids=inputs(pad=False, seed=7, n=12)["input_ids"])
    sinks = 1 if CAUSAL[arch] else [0, -1]
    qc, kc = hf.capture(model, **cal).layers[0].kernel_inputs()

    def fitted(**kw):
        fm = HedgehogFeatures(DH, 8, batch_shape=(HEADS,))
        with hf.linearize(model, lambda layer, h, d: fm if layer == 0 else HedgehogFeatures(d, 8, batch_shape=(h,)),
                          calibration=cal, fit_steps=3, seed=0, **kw):
            return fm.weight.detach().clone()

    def by_hand(**kw):
        ref = HedgehogFeatures(DH, 8, batch_shape=(HEADS,))
        ref.load_state_dict(init.state_dict())
        fit_feature_map(ref, qc.float(), kc.float(), steps=3, lr=1e-2, batch_size=128, causal=CAUSAL[arch],
                        seed=0, progress=False, **kw)
        return ref.weight.detach()

    torch.manual_seed(0)
    init = HedgehogFeatures(DH, 8, batch_shape=(HEADS,))
    torch.manual_seed(0)
    got = fitted(window=3, sinks=sinks)
    want = by_hand(window=3, sinks=sinks)
    whole = by_hand()
    assert torch.equal(got, want)
    assert (got - whole).abs().max() > 1e-4  # the remainder fit is a different fit
    torch.manual_seed(0)
    assert torch.equal(fitted(window=64, sinks=sinks), whole)  # window >= n: whole rows


def test_linearize_twice_without_restore_is_refused():
    model = build("gpt2")
    with hf.linearize(model, "positive", num_features=16):
        with pytest.raises(ValueError, match="already"):
            hf.linearize(model, "positive", num_features=16)


@pytest.mark.parametrize(
    "kw, err, match",
    [
        (dict(window=-1), ValueError, "window"),
        (dict(window="3"), TypeError, "window"),
        (dict(sinks=-2), ValueError, "sinks"),
        (dict(sinks=[0, 1.5]), TypeError, "sinks"),
        (dict(sinks="a"), TypeError, "sinks"),
        (dict(exact_heads={0: [HEADS]}), ValueError, "exact_heads"),
        (dict(exact_heads={0: ["a"]}), TypeError, "exact_heads"),
        (dict(exact_heads={5: [0]}), ValueError, "exact_heads"),
        (dict(exact_heads={1: [0]}, layers=[0]), ValueError, "exact_heads"),
        (dict(exact_heads=2), ValueError, "calibration"),
        (dict(exact_heads=-1), ValueError, "exact_heads"),
        (dict(exact_heads="all"), TypeError, "exact_heads"),
    ],
)
def test_bad_arguments_raise_at_the_call(kw, err, match):
    model = build("gpt2")
    impl = model.config._attn_implementation
    with pytest.raises(err, match=match):
        hf.linearize(model, "positive", num_features=16, **kw)
    assert model.config._attn_implementation == impl
    assert not any("kernelapprox" in k for k in model.state_dict())


def test_negative_sinks_of_a_causal_model_raise_clearly():
    model = build("gpt2")
    with hf.linearize(model, "positive", num_features=16, window=2, sinks=[-1]):
        with pytest.raises(ValueError, match="sinks of a causal model"):
            hidden(model, **inputs(pad=False))
