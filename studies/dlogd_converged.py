"""dlogd-converged: the dlogd study's converged preset (see `studies.dlogd`).

The same measurement and analysis as ``dlogd`` with the wider grid: r grids from r = d (R = 0.5)
or 2d (R = 1), d = 256 and 512 for trig-orthogonal at R = 0.5, 32 draws per (d, r), and the
search budget swept to 64x the standard one (8 draws per convergence cell).
"""

from studies.dlogd import STUDY_CONVERGED as STUDY

__all__ = ["STUDY"]
