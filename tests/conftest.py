"""Shared helpers for the core test suite.

Statistical tests in this suite
-------------------------------
Every Monte Carlo check uses the same statistic.  For ``S`` independent draws ``X_1..X_S`` of an
estimator of a known value ``K`` (one draw per element of ``batch_shape=(S,)``),

    z = (mean(X) - K) / se,      se = std(X, ddof=1) / sqrt(S)   (the *sample* standard error)

and we require ``|z| < Z_MAX``.  Under the null (estimator unbiased) and for ``S`` large enough that
the mean is close to normal, ``z`` is approximately N(0, 1).

Choice of ``Z_MAX = 4.5``: P(|N(0,1)| > 4.5) = 6.8e-6.  The statistical tests make about 1500
such z-checks (counting every (q, k) pair of every parametrisation), so by Bonferroni the
family-wise false-alarm probability for a *fresh* choice of seeds is below 1500 * 6.8e-6 = 1e-2.

Seeds.  Every statistical test derives *all* its seeds (projection draws and data generators) from
``BASE_SEED`` and a fixed per-test offset, through :func:`seed`.  ``BASE_SEED`` is read from the
environment variable ``KERNELAPPROX_TEST_SEED`` (default 0, so CI is deterministic); a seed sweep
such as ``KERNELAPPROX_TEST_SEED=7 pytest -m statistical`` re-runs every Monte Carlo check on fresh
draws, which is how the false-alarm rate above is checked in practice.  The statistical tests carry
the ``statistical`` marker (registered below), so ``pytest -m statistical`` runs exactly them.

Power.  A z-check that passes says nothing unless its standard error is small: each check asserts
a *power guard* ``se <= c * target`` next to ``|z| < Z_MAX``, chosen so that an error of a stated
size ``delta`` in the quantity under test shifts ``z`` by at least ``Z_MAX`` (``c = delta / Z_MAX``:
unbiasedness ``delta = 1 %`` of the kernel, ``c = 0.0022``; MSE formulas ``delta = 5 %``,
``c = 0.011``).  A shift of exactly ``Z_MAX`` is detected with probability 1/2; the measured
``se`` are below the guards (see each test), which raises that probability.

To keep the normal approximation honest, checks are only made where the estimator's variance is
finite and its distribution not too heavy-tailed.  For positive/hyperbolic features the
per-projection terms are log-normal with ``sigma^2 = |q + k|^2``: means (unbiasedness) are checked
at ``|q + k|^2 <= 1.28`` (skewness <= 6.6 per term, < 0.01 for the mean of ``S r >= 6e5`` terms);
means of *squared* errors (MSE, variance), whose standard error needs the eighth moment, at
``|q + k|^2 <= 0.3`` (see test_mse_monte_carlo.py).  Large *norms* are still tested, with ``q`` and
``k`` nearly opposite (positive features) or nearly equal (trigonometric features), which is where
each estimator is accurate.
"""

from __future__ import annotations

import contextlib
import math
import os

import pytest
import torch

Z_MAX = 4.5
F64 = torch.float64

#: Base of every seed of the statistical tests (``KERNELAPPROX_TEST_SEED``, default 0).
BASE_SEED = int(os.environ.get("KERNELAPPROX_TEST_SEED", "0"))


def seed(offset: int) -> int:
    """The seed a statistical test uses for its stream number ``offset``.

    ``seed(offset) = BASE_SEED * 7919317 + offset`` (mod 2**62): with the default ``BASE_SEED = 0``
    it is the offset itself, so the default run is deterministic; a seed sweep
    (``KERNELAPPROX_TEST_SEED=s``) moves every stream at once. The multiplier (far above any offset
    used) keeps the streams of different base seeds disjoint, so that ``seed(o) + 1``
    under base ``s`` is never ``seed(o)`` under base ``s + 1`` and the runs of a sweep are
    independent trials.
    """
    return (BASE_SEED * 7_919_317 + int(offset)) % (2**62)


#: Test modules marked ``slow`` as a whole: the study runs, the real-model and compile tests, the
#: wheel build and the largest Monte Carlo grids. ``-m "not slow"`` is the quick subset (the
#: README says how long each part takes); CI runs everything.
SLOW_MODULES = frozenset({
    "test_studies.py", "test_studies_b.py", "test_studies_capacity_gain.py", "test_studies_cli.py",
    "test_studies_diagnose.py", "test_studies_dlogd.py", "test_studies_executor.py",
    "test_studies_league.py", "test_studies_real.py", "test_studies_repro.py", "test_hf.py",
    "test_compile.py", "test_packaging.py", "test_mse_monte_carlo.py", "test_docs.py",
})


def pytest_configure(config):
    config.addinivalue_line(
        "markers",
        "statistical: Monte Carlo / z-test checks whose seeds follow KERNELAPPROX_TEST_SEED "
        "(run them alone with -m statistical)",
    )


def pytest_collection_modifyitems(config, items):
    """Mark every test of a module in `SLOW_MODULES` ``slow``."""
    for item in items:
        if item.path.name in SLOW_MODULES:
            item.add_marker(pytest.mark.slow)


def pytest_report_header(config):
    return f"kernelapprox statistical tests: KERNELAPPROX_TEST_SEED={BASE_SEED}"


def zscores(draws: torch.Tensor, target: torch.Tensor | float) -> tuple[torch.Tensor, torch.Tensor]:
    """z-statistic and sample standard error of the mean over dim 0 of ``draws`` (S, ...)."""
    draws = draws.to(F64)
    S = draws.shape[0]
    mean = draws.mean(0)
    se = draws.std(0, unbiased=True) / math.sqrt(S)
    target = torch.as_tensor(target, dtype=F64)
    return (mean - target) / se, se


def orthonormal(d: int, k: int, seed: int) -> torch.Tensor:
    """``k`` orthonormal vectors in R^d (rows), float64, deterministic."""
    g = torch.Generator().manual_seed(seed)
    A = torch.randn(d, k, generator=g, dtype=F64)
    Q, R = torch.linalg.qr(A)
    Q = Q * torch.sign(torch.diagonal(R)).unsqueeze(0)
    return Q.T.contiguous()


def randn(*shape, seed: int, dtype=F64, scale: float = 1.0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (scale * torch.randn(*shape, generator=g, dtype=F64)).to(dtype)


def with_norm(x: torch.Tensor, norm: float) -> torch.Tensor:
    return x / x.norm(dim=-1, keepdim=True) * norm


def warns_unfitted(fm):
    """The data-dependent maps (Nyström, FAVOR++, FAVOR#) warn once when used before ``fit(q, k)``:
    a test that uses one unfitted on purpose wraps its first use in this (``pytest.warns``),
    a no-op for every other map."""
    if getattr(fm, "fitted", True) is False:
        return pytest.warns(UserWarning, match="used before fit")
    return contextlib.nullcontext()


def softmax_attn_ref(q, k, v, causal: bool) -> torch.Tensor:
    s = q @ k.mT
    if causal:
        n, m = s.shape[-2:]
        s = s.masked_fill(~torch.ones(n, m, dtype=torch.bool).tril(), float("-inf"))
    return torch.softmax(s, dim=-1) @ v


def _threads_per_process() -> int:
    """At most 2 torch threads, and no more than the cores per xdist worker (``-n 2`` on 2 cores: 1)."""
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    return max(1, min(2, (os.cpu_count() or 1) // workers))


@pytest.fixture(autouse=True)
def _few_threads():
    """The suite is sized for 2 CPU cores; keep torch from oversubscribing them."""
    old = torch.get_num_threads()
    torch.set_num_threads(min(old, _threads_per_process()))
    yield
    torch.set_num_threads(old)


@pytest.fixture
def one_thread():
    """One intra-op thread, for files of tiny tensors (threads only cost there, and are slow on a
    loaded 2-core machine). Use with ``pytestmark = pytest.mark.usefixtures("one_thread")``."""
    old = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(old)
