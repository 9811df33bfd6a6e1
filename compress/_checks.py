"""Argument checks shared by the library's entry points."""

from __future__ import annotations

import numbers


def positive_int(where: str, key: str, value: int) -> int:
    """value as a Python int (numpy ints too: they would reach a saved config), else a ValueError naming where."""
    if not isinstance(value, numbers.Integral) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{where}: {key} must be a positive int, got {value!r}")
    return int(value)
