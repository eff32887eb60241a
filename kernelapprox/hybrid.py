"""Placeholder: filled by the estimators issue."""

from __future__ import annotations

__all__: list[str] = []
