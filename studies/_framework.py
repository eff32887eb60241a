"""The former single-module home of the studies engine, kept so that ``from studies._framework
import ...`` keeps working; the code lives in :mod:`studies._engine`."""

from studies._engine import *  # noqa: F403
from studies._engine import __all__  # noqa: F401
from studies._engine.cache import cell_key as _cell_key  # noqa: F401
from studies._engine.executors import compute_cell, study_ref, worker_info  # noqa: F401
from studies._engine.provenance import command_line, git_commit, package_version, provenance  # noqa: F401
