"""Rendering shared by the numerics results: short numbers and standard JSON."""

from __future__ import annotations

import math
from typing import Any


def short(value: float | None) -> str:
    """A number in a table cell: "-" for none, "0", else three significant digits."""
    if value is None:
        return "-"
    if value == 0:
        return "0"
    return f"{value:.2e}"


def json_number(value: Any) -> Any:
    """inf and NaN as strings, so the JSON is standard."""
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, dict):
        return {k: json_number(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_number(v) for v in value]
    return value
