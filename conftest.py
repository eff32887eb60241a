"""Root conftest: doctests of modules whose optional extra is missing are not collected.

``kernelapprox/hf.py``'s examples build tiny transformers models; without the ``[real]`` extra
(``transformers``) they are skipped instead of failing at import.
"""

from __future__ import annotations

import importlib.util

collect_ignore = [] if importlib.util.find_spec("transformers") else ["kernelapprox/hf.py"]
