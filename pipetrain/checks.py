"""Argument checks shared across pipetrain, each raising one ValueError wording.

Each check returns the value it accepted, so a caller can check and assign in one line::

    self.runs = positive_int("runs", runs)
"""

from __future__ import annotations

import math
import numbers
from typing import TypeGuard


def is_int(value: object) -> TypeGuard[int]:
    """Whether ``value`` is an ``int`` and not a ``bool`` (``True`` is no count of anything)."""
    return isinstance(value, int) and not isinstance(value, bool)


def positive_int(name: str, value: object) -> int:
    """``value`` if it is an integer >= 1; otherwise ValueError ``"<name> must be a positive
    integer, got <value>"``."""
    if not is_int(value) or value < 1:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")
    return value


def non_negative_int(name: str, value: object) -> int:
    """``value`` if it is an integer >= 0; otherwise ValueError naming ``name``."""
    if not is_int(value) or value < 0:
        raise ValueError(f"{name} must be a non-negative integer, got {value!r}")
    return value


def non_negative_number(name: str, value: object) -> float:
    """``value`` as a float if it is a finite real number >= 0 (not a bool); otherwise
    ValueError naming ``name``."""
    if (
        isinstance(value, bool)
        or not isinstance(value, numbers.Real)
        or not math.isfinite(value)
        or value < 0
    ):
        raise ValueError(f"{name} must be a finite number >= 0, got {value!r}")
    return float(value)
