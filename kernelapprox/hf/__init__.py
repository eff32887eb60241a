"""Real attention from Hugging Face models (the package; its modules are below)."""

from .linearize import *  # noqa: F403
from .linearize import __all__, __doc__, _transformers, _valid_keys  # noqa: F401
