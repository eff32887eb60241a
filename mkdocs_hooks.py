"""MkDocs hook: the site header names the package version read from ``pyproject.toml``."""

from __future__ import annotations

import tomllib
from pathlib import Path
from typing import Any


def on_config(config: Any, **kwargs: Any) -> Any:
    """``site_name`` becomes ``"kernelapprox <version>"`` (the version of ``pyproject.toml``)."""
    meta = tomllib.loads((Path(__file__).resolve().parent / "pyproject.toml").read_text())["project"]
    config["site_name"] = f"{meta['name']} {meta['version']}"
    return config
