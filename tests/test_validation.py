"""Bad input gives a ValueError/TypeError whose message names the argument and the offending value."""

from __future__ import annotations

import pytest
import torch
from conftest import warns_unfitted

import kernelapprox as ka

RANDOM_MAPS = {e.name: (lambda *a, e=e, **kw: e.build(*a, **kw)) for e in ka.estimators(random=True)}


@pytest.fixture(params=[e.name for e in ka.estimators()])
def fm6(request):
    """Every registered estimator with dim = 6 (a distinctive number for the messages)."""
    return ka.get_estimator(request.param).build(6, 8, seed=0)


def test_last_dim_mismatch(fm6):
    x = torch.randn(3, 7)
    for call in (lambda: fm6(x), lambda: fm6.kernel(x, x), lambda: fm6.log_features(x)):
        with pytest.raises(ValueError, match=r"dim") as info:
            call()
        assert "6" in str(info.value) and "7" in str(info.value)


def test_last_dim_mismatch_in_attention(fm6):
    q = k = torch.randn(2, 5, 7)
    v = torch.randn(2, 5, 3)
    with pytest.raises(ValueError, match=r"dim") as info:
        ka.linear_attention(q, k, v, fm6)
    assert "6" in str(info.value) and "7" in str(info.value)


@pytest.mark.parametrize("causal", [False, True])
def test_mismatched_qkv_shapes(causal):
    fm = ka.PositiveRF(4, 8, seed=0)
    q = torch.randn(2, 5, 4)
    # k and v of different lengths
    with pytest.raises(ValueError, match=r"\bv\b") as info:
        ka.linear_attention(q, torch.randn(2, 5, 4), torch.randn(2, 6, 3), fm, causal=causal)
    assert "(2, 6, 3)" in str(info.value)
    # q and k of different feature dims
    with pytest.raises(ValueError, match=r"\bk\b"):
        ka.linear_attention(q, torch.randn(2, 5, 3), torch.randn(2, 5, 3), fm, causal=causal)
    # leading dims that do not broadcast
    with pytest.raises(ValueError, match=r"broadcast"):
        ka.linear_attention(q, torch.randn(3, 5, 4), torch.randn(3, 5, 3), fm, causal=causal)
    # the exact reference validates the same way
    with pytest.raises(ValueError, match=r"\bv\b"):
        ka.softmax_attention(q, torch.randn(2, 5, 4), torch.randn(2, 6, 3), causal=causal)


def test_causal_needs_equal_lengths():
    fm = ka.PositiveRF(4, 8, seed=0)
    with pytest.raises(ValueError, match=r"causal"):
        ka.linear_attention(torch.randn(5, 4), torch.randn(6, 4), torch.randn(6, 2), fm, causal=True)


def test_recurrent_step_bad_dim():
    rnn = ka.RecurrentLinearAttention(ka.PositiveRF(4, 8, seed=0))
    with pytest.raises(ValueError, match=r"dim") as info:
        rnn.step(torch.randn(2, 5), torch.randn(2, 5), torch.randn(2, 3))
    assert "4" in str(info.value) and "5" in str(info.value)


@pytest.mark.parametrize("r", [0, -3])
@pytest.mark.parametrize("name", list(RANDOM_MAPS))
def test_num_features_not_positive(name, r):
    with pytest.raises(ValueError, match=r"num_features") as info:
        RANDOM_MAPS[name](4, r, seed=0)
    assert str(r) in str(info.value)


@pytest.mark.parametrize("name", list(RANDOM_MAPS))
def test_num_features_and_dim_types(name):
    with pytest.raises(TypeError, match=r"num_features"):
        RANDOM_MAPS[name](4, 2.5, seed=0)
    with pytest.raises(ValueError, match=r"\bdim\b"):
        RANDOM_MAPS[name](0, 8, seed=0)
    with pytest.raises(ValueError, match=r"\bdim\b"):
        ka.EluFeatures(0)


@pytest.mark.parametrize("dtype", [torch.int64, torch.int32, torch.bool, torch.complex64, torch.complex128])
def test_non_real_float_inputs(fm6, dtype):
    x = torch.ones(3, 6, dtype=dtype)
    with pytest.raises(TypeError, match=r"dtype|float") as info:
        fm6(x)
    assert str(dtype) in str(info.value)
    with pytest.raises(TypeError, match=r"\bq\b"):
        fm6.kernel(x, torch.ones(3, 6))
    with pytest.raises(TypeError, match=r"\bv\b"):
        ka.linear_attention(torch.ones(3, 6), torch.ones(3, 6), torch.ones(3, 2, dtype=dtype), fm6)


@pytest.mark.parametrize("dtype", [torch.int32, torch.complex64])
def test_non_real_float_parameter_dtype(dtype):
    with pytest.raises(TypeError, match=r"dtype"):
        ka.PositiveRF(4, 8, seed=0, dtype=dtype)
    with pytest.raises(TypeError, match=r"\bW\b"):
        ka.PositiveRF.from_projection(torch.ones(8, 4, dtype=dtype))


def test_softmax_references_reject_integer_inputs():
    with pytest.raises(TypeError, match=r"\bq\b"):
        ka.softmax_kernel(torch.ones(3, 4, dtype=torch.int64), torch.ones(3, 4))
    with pytest.raises(TypeError, match=r"\bk\b"):
        ka.softmax_attention(torch.ones(3, 4), torch.ones(3, 4, dtype=torch.int64), torch.ones(3, 2))


@pytest.mark.parametrize("name", list(RANDOM_MAPS))
def test_batch_shape_not_broadcasting(name):
    fm = RANDOM_MAPS[name](4, 8, seed=0, batch_shape=(3,))
    with warns_unfitted(fm):  # data-dependent maps are used unfitted here
        x = torch.randn(2, 5, 4)  # leading (2,) vs batch_shape (3,)
        with pytest.raises(ValueError, match=r"batch_shape") as info:
            fm(x)
        assert "(3,)" in str(info.value) and "(2,)" in str(info.value)
        with pytest.raises(ValueError, match=r"batch_shape"):
            fm.kernel(x, x)
        with pytest.raises(ValueError, match=r"batch_shape"):
            ka.linear_attention(x, x, torch.randn(2, 5, 2), fm)
        # broadcasting shapes are fine
        assert fm(torch.randn(5, 4)).shape[0] == 3
        assert fm(torch.randn(2, 1, 5, 4)).shape[:2] == (2, 3)


def test_bad_batch_shape_values():
    with pytest.raises(ValueError, match=r"batch_shape"):
        ka.PositiveRF(4, 8, seed=0, batch_shape=(0,))
    with pytest.raises((TypeError, ValueError), match=r"batch_shape"):
        ka.PositiveRF(4, 8, seed=0, batch_shape="abc")


@pytest.mark.parametrize("name", list(RANDOM_MAPS))
def test_unknown_sampler_lists_valid_names(name):
    with pytest.raises(ValueError, match=r"sampler") as info:
        RANDOM_MAPS[name](4, 8, sampler="orthgonal", seed=0)
    msg = str(info.value)
    assert "orthgonal" in msg
    for valid in ("gaussian", "orthogonal", "structured", "qmc"):
        assert valid in msg
    with pytest.raises(TypeError, match=r"sampler"):
        RANDOM_MAPS[name](4, 8, sampler=3, seed=0)


def test_sampler_options():
    with pytest.raises(ValueError, match=r"norms"):
        ka.OrthogonalSampler(norms="unit")
    with pytest.raises(ValueError, match=r"method"):
        ka.QMCSampler(method="lattice")
    with pytest.raises(ValueError, match=r"variant"):
        ka.TrigRF(4, 8, variant="cos", seed=0)


def test_from_projection_bad_shapes():
    with pytest.raises(ValueError, match=r"\bW\b"):
        ka.PositiveRF.from_projection(torch.randn(8))
    with pytest.raises(ValueError, match=r"offsets"):
        ka.TrigRF.from_projection(torch.randn(8, 4), variant="offset", offsets=torch.rand(7))
    with pytest.raises(ValueError, match=r"offsets"):
        ka.TrigRF.from_projection(torch.randn(8, 4), variant="offset")  # offsets required


@pytest.mark.parametrize("chunk_size", [0, -1, 2.5])
def test_bad_chunk_size(chunk_size):
    fm = ka.PositiveRF(4, 8, seed=0)
    x = torch.randn(5, 4)
    with pytest.raises(ValueError, match=r"chunk_size"):
        ka.linear_attention(x, x, x, fm, causal=True, chunk_size=chunk_size)


def test_bad_feature_map_and_seed():
    x = torch.randn(5, 4)
    with pytest.raises(TypeError, match=r"feature_map"):
        ka.linear_attention(x, x, x, torch.nn.Identity())
    with pytest.raises(TypeError, match=r"seed"):
        ka.PositiveRF(4, 8, seed="zero")


def test_initial_state_mismatch():
    fm = ka.PositiveRF(4, 8, seed=0)
    x = torch.randn(5, 4)
    _, st = ka.linear_attention(x, x, torch.randn(5, 3), fm, causal=True, return_state=True)
    with pytest.raises(ValueError, match=r"initial_state"):
        ka.linear_attention(x, x, torch.randn(5, 2), fm, causal=True, initial_state=st)  # dv 2 vs 3


def test_broadcast_shapes_is_torchs():
    """The library's plain-Python `broadcast_shapes` gives torch's result, and torch's error, on
    20000 random shape tuples (sizes 0 to 3, up to 4 dimensions, 1 to 4 shapes; seeded)."""
    import random

    from kernelapprox._validation import broadcast_shapes

    rng = random.Random(0)
    n_errors = 0
    for _ in range(20000):
        shapes = [tuple(rng.choice([0, 1, 1, 2, 3]) for _ in range(rng.randint(0, 4)))
                  for _ in range(rng.randint(1, 4))]
        try:
            want = torch.broadcast_shapes(*shapes)
        except RuntimeError:
            n_errors += 1
            with pytest.raises(RuntimeError):
                broadcast_shapes(*shapes)
            continue
        got = broadcast_shapes(*shapes)
        assert got == want and isinstance(got, torch.Size), shapes
    assert 2000 < n_errors < 18000  # both outcomes are exercised
    with pytest.raises(ValueError, match="negative"):  # as torch's
        broadcast_shapes((-1,), (2,))
