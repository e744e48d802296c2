"""Shared pytest setup for tests/py. Keep it small: fixtures used by one file live there."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from hlo_amp.report import Decision


@pytest.fixture
def converted_decision() -> Callable[[str], Decision]:
    """A report decision at a location: a dot_general converted to bf16 operands."""

    def make(location: str) -> Decision:
        return Decision(function="main", op_kind="dot_general", scope="",
                        direction="forward", operands_before=("f32", "f32"),
                        operands_after=("bf16", "bf16"), result_before="f32",
                        result_after="f32", action="compute", rule="op:dot_general",
                        changed=True, reason="", flops=0, location=location)

    return make
