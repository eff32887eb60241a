"""``torch.compile`` of every registered map and of linear attention, in inference.

Every map's ``forward`` and ``log_features``, and linear attention (non-causal and causal) with
every map, trace into one graph (no graph break, also checked with ``fullgraph=True``); the causal
form compiled with ``dynamic=True`` compiles once for sequence lengths that are multiples of the
chunk size and lengths that are not; compiled results match eager ones.

Compilation is slow, so the shapes are tiny and most cases use a backend without code
generation: ``eager`` (Dynamo's graph run as is) or, for the maps that write into slices of a
preallocated buffer in eager mode, ``aot_eager`` (adds AOTAutograd's functionalisation, where
in-place and ``out=`` writes are rewritten). A few cases use Inductor, the default backend.
"""

from __future__ import annotations

import warnings

import pytest
import torch
import torch._dynamo as dynamo
from torch._dynamo.testing import CompileCounter

import kernelapprox as ka

D, R, CHUNK = 8, 16, 16
NAMES = [e.name for e in ka.estimators()]
# eager mode writes into slices of one buffer (sin/cos, [u, -u], Taylor blocks, Hedgehog halves)
SLICE_WRITERS = {"trig-sincos", "hyperbolic", "taylor", "hedgehog", "hedgehog-lolcats"}
# lengths of the causal form: multiples of the chunk size and not
LENGTHS = (32, 48, 40, 77)


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    dynamo.reset()
    yield
    dynamo.reset()


def _data(n: int = 24, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(2, n, D, generator=g) / 2 for _ in range(3))
    return q, k, v


def _build(name: str) -> ka.FeatureMap:
    fm = ka.get_estimator(name).build(D, R, seed=0)
    if fm.data_dependent:
        q, k, _ = _data(32, seed=1)
        fm.fit(q, k)
    return fm.eval()


def _cases(fm: ka.FeatureMap) -> dict:
    return {
        "forward": lambda x, k, v: fm(x),
        "log_features": lambda x, k, v: fm.log_features(x),
        "attention": lambda q, k, v: ka.linear_attention(q, k, v, fm),
        "causal": lambda q, k, v: ka.linear_attention(q, k, v, fm, causal=True, chunk_size=CHUNK),
    }


def _close(a, b, tol=1e-5):
    if isinstance(a, tuple):
        for x, y in zip(a, b, strict=True):
            _close(x, y, tol)
        return
    assert a.dtype == b.dtype and a.shape == b.shape
    torch.testing.assert_close(a, b, rtol=tol, atol=tol)


@pytest.mark.parametrize("name", NAMES)
def test_no_graph_breaks(name):
    """Zero graph breaks (``torch._dynamo.explain``) for the map and both attention forms."""
    fm = _build(name)
    args = _data()
    counts = {}
    with torch.no_grad():
        for case, fn in _cases(fm).items():
            dynamo.reset()
            e = dynamo.explain(fn)(*args)
            counts[case] = (e.graph_break_count, [str(b.reason).split("\n")[0] for b in e.break_reasons])
    assert all(c == 0 for c, _ in counts.values()), counts


@pytest.mark.parametrize("name", NAMES)
def test_fullgraph_matches_eager(name):
    """``torch.compile(fullgraph=True)`` runs (raises on any graph break) and matches eager."""
    fm = _build(name)
    args = _data()
    backend = "aot_eager" if name in SLICE_WRITERS else "eager"
    cfm = torch.compile(fm, fullgraph=True, backend=backend)
    with torch.no_grad():
        _close(cfm(args[0]), fm(args[0]))
        for case, fn in _cases(fm).items():
            if case == "forward":
                continue
            _close(torch.compile(fn, fullgraph=True, backend=backend)(*args), fn(*args))


# Two of the maps that write into slices of a buffer in eager mode, compiled with Inductor.
@pytest.mark.parametrize("name", ["trig-sincos", "hyperbolic"])
def test_inductor_matches_eager(name):
    fm = _build(name)
    args = _data()
    with torch.no_grad():
        _close(torch.compile(fm, fullgraph=True)(args[0]), fm(args[0]))


@pytest.mark.parametrize("name", ["positive"])
def test_causal_inductor_dynamic(name):
    """Causal attention under Inductor with a dynamic length (a multiple of the chunk size and
    not): one compile, matches eager."""
    fm = _build(name)
    cnt = CompileCounter()
    fn = _cases(fm)["causal"]
    compiled = torch.compile(fn, fullgraph=True, dynamic=True)
    with torch.no_grad():
        for n in (32, 40):
            args = _data(n)
            _close(compiled(*args), fn(*args))
    dynamo.reset()
    counted = torch.compile(fn, fullgraph=True, dynamic=True, backend=cnt)
    with torch.no_grad():
        for n in (32, 40):
            counted(*_data(n))
    assert cnt.frame_count == 1


@pytest.mark.parametrize("name", NAMES)
def test_causal_compiles_once_across_lengths(name):
    """``dynamic=True``: one graph for lengths that are multiples of the chunk size and lengths that
    are not (the padding is unconditional and the scan over chunks is one operator)."""
    fm = _build(name)
    cnt = CompileCounter()
    fn = _cases(fm)["causal"]
    compiled = torch.compile(fn, fullgraph=True, dynamic=True, backend=cnt)
    with torch.no_grad():
        for n in LENGTHS:
            args = _data(n)
            _close(compiled(*args), fn(*args))
    assert cnt.frame_count == 1, cnt.frame_count


def test_check_warning_still_fires_in_eager():
    """The opt-in closed-form check (``check=True``) is skipped under ``torch.compile`` (no graph
    break, no warning) and still runs in eager mode."""
    fm = ka.TrigRF(D, 4, seed=0)
    q, k, v = (3 * t for t in _data())
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        out = torch.compile(lambda q, k, v: ka.linear_attention(q, k, v, fm, check=True),
                            fullgraph=True, backend="eager")(q, k, v)
    assert not any(issubclass(x.category, ka.KernelApproxWarning) for x in w)
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        _close(out, ka.linear_attention(q, k, v, fm, check=True))
    assert any(issubclass(x.category, ka.KernelApproxWarning) for x in w)


def test_compiled_map_still_validates_in_eager():
    """Validation keeps raising the same errors in eager after a map was compiled."""
    fm = _build("positive")
    torch.compile(fm, fullgraph=True, backend="aot_eager")(_data()[0])
    with pytest.raises(ValueError, match="expected dim=8"):
        fm(torch.randn(3, 5))
    with pytest.raises(TypeError, match="real floating dtype"):
        fm(torch.ones(3, 8, dtype=torch.int64))
