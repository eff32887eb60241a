"""Root conftest: doctests of modules whose optional extra is missing are not collected.

``kernelapprox/hf/``'s examples build tiny transformers models (extra ``[real]``) and
``kernelapprox/sklearn.py`` is the scikit-learn front end (extra ``[sklearn]``), ``kernelapprox/plotting.py``
draws with matplotlib (extra ``[studies]``); without their
extra they are skipped instead of failing at import.
"""

from __future__ import annotations

import importlib.util

collect_ignore = [
    path for path, module in (("kernelapprox/hf", "transformers"), ("kernelapprox/sklearn.py", "sklearn"),
                              ("kernelapprox/plotting.py", "matplotlib"))
    if importlib.util.find_spec(module) is None
]
