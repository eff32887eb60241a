"""The dtype rule, cell by cell: every entry point, every map dtype, input dtype and default dtype.

The rule (``kernelapprox._validation.compute_dtype``): an entry point computes in
``promote(input dtypes, map dtype)``, at least float32 (16-bit inputs and maps are promoted), and
returns the inputs' dtype (``promote(q, k, v)`` for attention, ``x.dtype`` for ``fm(x)``,
``promote(q, k)`` for ``fm.kernel``); the torch default dtype plays no role.

Matrix (``test_dtype_cell``): estimator {positive, hyperbolic, trig sin/cos, trig offset, elu}
x map dtype {float64, float32, bfloat16} (elu has no buffers: one column) x inputs {float64,
float32, bfloat16, float16} x default dtype {float32, float64} x entry point {parallel, causal
chunked (n = 13, chunk 5: not a multiple), recurrent ``step`` over every token, ``fm.kernel``,
``fm(x)``} = 4*3*4*2*5 + 4*2*5 = 520 cells. Each cell asserts: no exception, output dtype = the
inputs' dtype, and the value within a derived bound of a float64 reference, computed by the same
entry point from ``copy.deepcopy(fm).double()`` on the inputs cast to float64 (both casts are
exact, so the reference sees the very map and inputs of the cell).

Tolerance, elementwise: ``|out - ref| <= u_out |ref| + (1 + u_out) delta + tiny_out``.

* ``u_out = eps(out dtype) / 2``: the final rounding of the result to the inputs' dtype
  (3.9e-3 bfloat16, 4.9e-4 float16, 6.0e-8 float32, 1.1e-16 float64); ``tiny_out`` (the smallest
  normal number) covers a result that rounds into the subnormal range.
* ``delta = c * u_c * R``: the error of the computation in the compute dtype (unit roundoff
  ``u_c``: 6.0e-8 for float32, 1.1e-16 for float64). Standard worst-case rounding analysis: a dot
  product of length ``L`` has relative error ``<= L u_c`` of the sum of absolute terms, and
  exp/sin/cos of an argument that carries an absolute error ``a`` carries ``a`` (relative for exp,
  absolute on a bounded sin/cos) plus ``2 u_c``; the arguments are ``w.x`` and ``|x|^2/2`` with
  absolute error ``<= (d + 2) u_c A``, ``A = max(|x| @ |W|^T) + max |x|^2 / 2 + 1`` (``A = 1``
  for elu). Hence, per entry point:

  - ``fm(x)``: ``c = (d + 2) A + 4``, ``R_if = max_f' |phi(x_i)_f'|`` (row scale: trig features
    are signed and may be ~0);
  - ``fm.kernel``: ``c = 2((d + 2) A + 4) + F``, ``R_ij = sum_f |phi_f(q_i)| |phi_f(k_j)|``;
  - attention (a ratio of two such sums over ``n`` keys): ``c = 2(2((d + 2) A + 4) + F + n)``,
    ``R_ic = kappa_i (max|v| + |ref_ic|)`` with the condition number of the denominator
    ``kappa_i = sum_j |phi(q_i)| . |phi(k_j)| / |sum_j phi(q_i) . phi(k_j)|`` (``j <= i`` when
    causal; ``= 1`` for positive maps).

  With d = 8, F <= 32, n = 13 and these inputs (``A`` = 3.3-7.7) ``c * u_c`` is 1e-5 to 2.5e-5
  in float32 (the observed float32 errors are 8-270x below the bound), far below one bfloat16
  rounding (3.9e-3). Where the output is 16-bit, or float32 computed in float64, the rounding term
  ``u_out |ref|`` dominates and the observed error reaches 0.6-0.99 of the bound (round to nearest
  is exactly that tight). A computation that drops to 16 bits, or to float32 where float64 is due
  (then ``u_c`` = 1.1e-16 and the bound is ``u_out |ref|`` + ~1e-13), fails the cell.

Inputs are moderate: ``q, k ~ 0.5 N(0, I) / d^(1/4)`` (0.3 for the trigonometric maps, whose
denominators must stay away from 0), ``v ~ N(0, I)``.
"""

from __future__ import annotations

import copy
import itertools

import pytest
import torch

import kernelapprox as ka

F64, F32, BF16, F16 = torch.float64, torch.float32, torch.bfloat16, torch.float16
D, R_FEAT, N, DV, CHUNK, LEAD = 8, 16, 13, 3, 5, (2,)

ESTIMATORS = ["positive", "hyperbolic", "trig", "trig-offset", "elu"]
MAP_DTYPES = [F64, F32, BF16]
INPUT_DTYPES = [F64, F32, BF16, F16]
DEFAULT_DTYPES = [F32, F64]
ENTRY_POINTS = ["parallel", "chunked", "recurrent", "kernel", "forward"]


def _name(dt: torch.dtype | None) -> str:
    return "none" if dt is None else str(dt).removeprefix("torch.")


pytestmark = pytest.mark.usefixtures("one_thread")  # tiny tensors: threads only cost


@pytest.fixture(autouse=True)
def _default_dtype_unchanged():
    """No test of this file leaves another default dtype behind (also when it fails)."""
    before = torch.get_default_dtype()
    yield
    after = torch.get_default_dtype()
    torch.set_default_dtype(before)
    assert after == before, f"the test left the default dtype at {after}"


@pytest.fixture
def default_dtype(request):
    """Set the torch default dtype for the test; restored whatever happens."""
    old = torch.get_default_dtype()
    torch.set_default_dtype(request.param)
    try:
        yield request.param
    finally:
        torch.set_default_dtype(old)


def build(name: str, dtype: torch.dtype | None):
    """The map under test, built with ``dtype=`` (under whatever default dtype is current)."""
    if name == "positive":
        return ka.PositiveRF(D, R_FEAT, sampler="orthogonal", seed=0, dtype=dtype)
    if name == "hyperbolic":
        return ka.HyperbolicRF(D, R_FEAT, seed=1, dtype=dtype)
    if name == "trig":
        return ka.TrigRF(D, R_FEAT, seed=2, dtype=dtype)
    if name == "trig-offset":
        return ka.TrigRF(D, R_FEAT, variant="offset", seed=3, dtype=dtype)
    if name == "elu":
        return ka.EluFeatures(D, dtype=dtype)
    raise AssertionError(name)


def inputs(name: str, dtype: torch.dtype, seed: int = 0):
    """q, k (LEAD, N, D) ~ s N(0, I) / D^(1/4), v (LEAD, N, DV) ~ N(0, I), drawn in float64 and cast."""
    g = torch.Generator().manual_seed(seed)
    s = (0.3 if name.startswith("trig") else 0.5) / D**0.25
    q = s * torch.randn(*LEAD, N, D, generator=g, dtype=F64)
    k = s * torch.randn(*LEAD, N, D, generator=g, dtype=F64)
    v = torch.randn(*LEAD, N, DV, generator=g, dtype=F64)
    return q.to(dtype), k.to(dtype), v.to(dtype)


def run_entry(entry: str, fm, q, k, v) -> torch.Tensor:
    if entry == "parallel":
        return ka.linear_attention(q, k, v, fm)
    if entry == "chunked":
        assert N % CHUNK != 0
        return ka.linear_attention(q, k, v, fm, causal=True, chunk_size=CHUNK)
    if entry == "recurrent":
        rnn = ka.RecurrentLinearAttention(fm)
        return torch.stack([rnn.step(q[..., t, :], k[..., t, :], v[..., t, :]) for t in range(N)], dim=-2)
    if entry == "kernel":
        return fm.kernel(q, k)
    if entry == "forward":
        return fm(q)
    raise AssertionError(entry)


def expected_dtype(entry: str, q, k, v) -> torch.dtype:
    if entry == "forward":
        return q.dtype
    if entry == "kernel":
        return torch.promote_types(q.dtype, k.dtype)
    return torch.promote_types(torch.promote_types(q.dtype, k.dtype), v.dtype)


def rule_compute_dtype(*dtypes: torch.dtype | None) -> torch.dtype:
    """The rule written out independently of the library: promote, at least float32."""
    out = F32
    for dt in dtypes:
        if dt is not None:
            out = torch.promote_types(out, dt)
    return out


def unit_roundoff(dt: torch.dtype) -> float:
    return torch.finfo(dt).eps / 2


def error_bound(entry, fm64, q64, k64, v64, ref, out_dtype, compute_dtype) -> torch.Tensor:
    """The elementwise bound of the module docstring, computed in float64 from the float64 map."""
    weight = getattr(fm64, "weight", None)
    if weight is None:
        A = 1.0
    else:
        x = torch.cat((q64, k64), dim=-2).abs()
        A = float((x @ weight.abs().mT).max() + 0.5 * (x * x).sum(-1).max() + 1)
    chain = (D + 2) * A + 4  # one feature: projection, its argument, exp/sin/cos and the scale
    u_c, u_out = unit_roundoff(compute_dtype), unit_roundoff(out_dtype)
    if entry == "forward":
        delta = chain * u_c * ref.abs().amax(-1, keepdim=True)
    else:
        pq, pk = fm64(q64).abs(), fm64(k64).abs()
        R_abs = pq @ pk.mT  # sum_f |phi_f(q_i)| |phi_f(k_j)|
        if entry == "kernel":
            delta = (2 * chain + fm64.feature_dim) * u_c * R_abs
        else:
            K = fm64(q64) @ fm64(k64).mT
            if entry != "parallel":
                keep = torch.ones(N, N, dtype=torch.bool).tril()
                R_abs, K = R_abs * keep, K * keep
            kappa = R_abs.sum(-1, keepdim=True) / K.sum(-1, keepdim=True).abs()
            c = 2 * (2 * chain + fm64.feature_dim + N)
            delta = c * u_c * kappa * (v64.abs().max() + ref.abs())
    return u_out * ref.abs() + (1 + u_out) * delta + torch.finfo(out_dtype).tiny


def check_cell(entry, fm, q, k, v):
    """Run ``entry`` on the cell and on its float64 twin; assert dtype and the error bound."""
    out = run_entry(entry, fm, q, k, v)
    want = expected_dtype(entry, q, k, v)
    assert out.dtype == want, f"output dtype {out.dtype}, expected {want}"
    fm64 = copy.deepcopy(fm).double()
    q64, k64, v64 = q.double(), k.double(), v.double()  # exact casts
    ref = run_entry(entry, fm64, q64, k64, v64)
    assert ref.dtype == F64 and out.shape == ref.shape
    assert torch.isfinite(ref).all()
    cdt = rule_compute_dtype(q.dtype, k.dtype, v.dtype, fm.param_dtype)
    bound = error_bound(entry, fm64, q64, k64, v64, ref, want, cdt)
    err = (out.double() - ref).abs()
    worst = float((err / bound).max())
    assert worst <= 1.0, (
        f"error {float(err.max()):.3e} exceeds the bound (max err/bound = {worst:.3g}; "
        f"compute dtype {cdt}, output dtype {want})"
    )
    return out


def _cells():
    for est, mdt, idt, ddt, entry in itertools.product(
        ESTIMATORS, MAP_DTYPES, INPUT_DTYPES, DEFAULT_DTYPES, ENTRY_POINTS
    ):
        if est == "elu":  # no buffers: the map dtype has no effect, one column is enough
            if mdt is not F32:
                continue
            mdt = None
        yield pytest.param(
            est, mdt, idt, ddt, entry,
            id=f"{est}-map_{_name(mdt)}-in_{_name(idt)}-default_{_name(ddt)}-{entry}",
        )


CELLS = list(_cells())
assert len(CELLS) == 520


@pytest.mark.parametrize("est, map_dtype, input_dtype, default_dtype, entry", CELLS, indirect=["default_dtype"])
def test_dtype_cell(est, map_dtype, input_dtype, default_dtype, entry):
    """One cell of the matrix (module docstring). Protects against an entry point that crashes on
    a dtype combination (mixed float32/float64 matmuls, a buffer created in the default dtype),
    returns another dtype than its inputs', or computes in the wrong precision (16 bits where
    float32 is due, float32 where float64 is due)."""
    assert torch.get_default_dtype() == default_dtype
    fm = build(est, map_dtype)
    if map_dtype is not None:
        assert fm.param_dtype == map_dtype
    else:
        assert fm.param_dtype is None
    q, k, v = inputs(est, input_dtype)
    check_cell(entry, fm, q, k, v)


@pytest.mark.parametrize("entry", ENTRY_POINTS)
@pytest.mark.parametrize("est", ["positive", "trig", "elu"])
@pytest.mark.parametrize("build_default, call_default", [(F64, F64), (F64, F32), (F32, F64)])
def test_map_built_with_default_dtype(est, entry, build_default, call_default):
    """``dtype=None``: the map takes the default dtype current at construction; called later (under
    the same or another default) with float32 inputs it computes in promote(float32, map dtype)
    and returns float32. Protects against the crash of the chunked form for a map built under
    default float64 with float32 inputs (a float32 tensor meeting a float64 one in a matmul)."""
    old = torch.get_default_dtype()
    try:
        torch.set_default_dtype(build_default)
        fm = build(est, None)
        assert fm.param_dtype == (None if est == "elu" else build_default)
        torch.set_default_dtype(call_default)
        q, k, v = inputs(est, F32, seed=1)
        out = check_cell(entry, fm, q, k, v)
        assert out.dtype == F32
    finally:
        torch.set_default_dtype(old)


@pytest.mark.parametrize("entry", ENTRY_POINTS)
@pytest.mark.parametrize("map_dtype", [F64, BF16])
def test_mixed_input_dtypes(entry, map_dtype):
    """q, k and v of different dtypes: the output has ``promote`` of the inputs involved
    (float32 here for attention and the kernel, q's bfloat16 for ``fm(x)``), computed in
    promote(inputs, map) at least float32."""
    fm = build("positive", map_dtype)
    q, _, _ = inputs("positive", F64, seed=2)
    _, k, v = inputs("positive", F64, seed=3)
    q, k, v = q.to(BF16), k.to(F16), v.to(F32)
    out = check_cell(entry, fm, q, k, v)
    assert out.dtype == (BF16 if entry == "forward" else F32)
