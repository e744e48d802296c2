"""``hlo_amp.rewrite``: the pass pipeline on StableHLO text or bytecode."""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from typing import Any

from hlo_amp.modules import module_text, parse_module
from hlo_amp.passes import run_pipeline
from hlo_amp.policy import Policy, as_policy
from hlo_amp.report import Report


def rewrite(module: str | bytes, policy: Policy | str | Mapping[str, Any] = "bf16", *,
            debug_info: bool = False, return_report: bool = False
            ) -> str | tuple[str, Report]:
    """Rewrite a StableHLO module (text, bytecode or portable artifact); return text.

    With ``return_report=True`` returns ``(text, report)``.
    """
    amp_policy = as_policy(policy)
    parsed = parse_module(module)
    report = run_pipeline(parsed, amp_policy)
    warn_unused_rules(report, stacklevel=2)
    text = module_text(parsed, debug_info=debug_info)
    return (text, report) if return_report else text


def warn_unused_rules(report: Report, *, stacklevel: int = 1) -> None:
    """Warn when policy rules matched no op (a likely typo in a scope pattern).

    ``stacklevel`` counts from the caller of this function, as in ``warnings.warn``.
    """
    unused = report.unused_rules
    if unused:
        warnings.warn(
            f"hlo_amp: policy rule(s) matched no op: {', '.join(unused)} "
            f"(policy {report.policy!r})",
            UserWarning, stacklevel=stacklevel + 1)
    if _converts_nothing_unasked(report):
        warnings.warn(
            f"hlo_amp: policy {report.policy!r} converts none of the program's "
            f"{len(report.decisions)} dot/convolution ops: no rule names their op kind; "
            f"use a preset such as 'bf16' or add op rules (op:dot_general=compute)",
            UserWarning, stacklevel=stacklevel + 1)


def _converts_nothing_unasked(report: Report) -> bool:
    """True when the program has matrix ops, none is converted, and no rule explains it.

    A rule-less policy (the f32 preset, with or without flags) converts nothing on
    purpose; so do scope, backward and amp_stop rules, op rules that keep, the cost rule
    (only_if_faster), ops the program pinned to HIGHEST, and ops already in 16 bit.
    """
    decisions = report.decisions
    if not decisions or any(d.changed or d.low_precision for d in decisions):
        return False
    if not any(rule.startswith(("op:", "scope:")) for rule in report.rules):
        return False
    return all(d.rule == "default" for d in decisions)
