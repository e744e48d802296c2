"""Numerics you can see: ``compare``, ``attribute`` and ``autopolicy``.

``compare`` runs a function as written (f32), under a policy and in f64, and measures the
error of every output leaf; ``attribute`` measures it per scope of the report;
``autopolicy`` finds the policy with the fewest f32 scopes whose error stays within a
budget. All three lower the function once and, per candidate policy, copy the module,
run the pass pipeline on the copy and compile it: an executable per policy string, cached
per function and input signature, so a later call reuses what an earlier one compiled.

Errors are measured in the scaled form: a leaf passes when
``max|a - e| <= atol + rtol * max|e|`` (element-wise tolerances fail every 16-bit dot
whose result cancels to ~0). A result's ``error`` is the smallest ``rtol`` every float
leaf passes with, ``max((max|a - e| - atol)+ / max|e|)``, which is what a budget bounds.

Parts, each importing only those before it: ``measure`` (the lowering cache, sessions,
leaf errors and tolerances), ``render`` (table numbers, JSON), ``compare``,
``attribute`` (with its plot), ``fastest`` (``autopolicy`` for a target: the fastest
policy on a device within a budget) and ``autopolicy``.
"""

from hlo_amp.numerics.attribute import TOP_LEVEL, Attribution, ScopeError, attribute, with_scopes
from hlo_amp.numerics.autopolicy import AutoPolicy, Trial, autopolicy
from hlo_amp.numerics.compare import Comparison, compare
from hlo_amp.numerics.fastest import Baseline, Move, ScopeChoice, TargetAutoPolicy
from hlo_amp.numerics.measure import (
    ATOL,
    REFERENCES,
    RTOL,
    LeafError,
    run_dtypes,
    tolerance,
)

__all__ = [
    "ATOL",
    "REFERENCES",
    "RTOL",
    "TOP_LEVEL",
    "Attribution",
    "AutoPolicy",
    "Baseline",
    "Comparison",
    "LeafError",
    "Move",
    "ScopeChoice",
    "ScopeError",
    "TargetAutoPolicy",
    "Trial",
    "attribute",
    "autopolicy",
    "compare",
    "run_dtypes",
    "tolerance",
    "with_scopes",
]
