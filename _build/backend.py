"""The build backend: setuptools' own, with a clean ``build/`` for every wheel.

setuptools copies the package into ``build/lib`` and keeps that folder between builds, so a wheel
built in the working tree after a module was deleted (or moved) would still ship the old file.
Removing ``build/`` first makes every wheel hold exactly the modules of the tree.
"""

from __future__ import annotations

import shutil
from pathlib import Path

from setuptools import build_meta as _setuptools
from setuptools.build_meta import *  # noqa: F403 - every other hook is setuptools' own

_ROOT = Path(__file__).resolve().parent.parent


def build_wheel(wheel_directory, config_settings=None, metadata_directory=None):  # type: ignore[no-untyped-def]
    """setuptools' ``build_wheel`` after removing a stale ``build/`` folder."""
    shutil.rmtree(_ROOT / "build", ignore_errors=True)
    return _setuptools.build_wheel(wheel_directory, config_settings, metadata_directory)
