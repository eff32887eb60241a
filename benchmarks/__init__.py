"""Speed benchmarks of kernelapprox, run from a clone: ``python -m benchmarks [NAME [ARGS...]]``.

``python -m benchmarks`` lists them; ``python -m benchmarks NAME ARGS...`` runs one with its own
arguments (``python -m benchmarks core --device cuda --dtype bfloat16``). Each benchmark is one
module of this package with a ``main(argv)``; its docstring describes what it measures:

- ``core``: ratios of the core (feature maps, attention, memory, the estimator league, ...);
- ``mc``: the Monte Carlo drivers against their batched-matmul floor;
- ``sklearn``: the scikit-learn front end against ``RBFSampler``;
- ``train``: a small causal transformer with linear attention, eager, compiled and bf16;
- ``decode``: per-token time of ``generate()`` after a long prompt, linearised or not.

Like ``studies/``, this folder is not part of the installed package.
"""

from __future__ import annotations

import importlib
from collections.abc import Sequence

#: Benchmark name -> one-line description (the order of ``python -m benchmarks``).
BENCHMARKS: dict[str, str] = {
    "core": "core performance ratios: feature maps, attention, memory, recurrent step, league",
    "mc": "Monte Carlo drivers against their batched-matmul floor",
    "sklearn": "the scikit-learn front end against sklearn's RBFSampler",
    "train": "training a small causal transformer with linear attention: eager, compiled, bf16",
    "decode": "per-token decoding time of a tiny LLaMA, linearised or not",
}

__all__ = ["BENCHMARKS", "run"]


def run(name: str, argv: Sequence[str] | None = None) -> int:
    """Run benchmark ``name`` with command-line arguments ``argv`` and return an exit status.

    Parameters
    ----------
    name : str
        A key of `BENCHMARKS`.
    argv : sequence of str, optional
        The benchmark's arguments (``None``: ``sys.argv[1:]``, as its ``main`` reads them).

    Returns
    -------
    int
        The status ``main`` returned where it returns one (``sklearn``, ``train``, ``decode``),
        else 0 (``core`` and ``mc`` return their results as a dict).
    """
    if name not in BENCHMARKS:
        raise ValueError(f"unknown benchmark {name!r}; one of {', '.join(BENCHMARKS)}")
    mod = importlib.import_module(f"benchmarks.{name}")
    out = mod.main(None if argv is None else list(argv))
    return out if isinstance(out, int) else 0
