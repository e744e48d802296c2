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
    # A policy that converts nothing, where no rule or explicit precision asked for that:
    # e.g. a Policy built with ops={} and only f32 scope rules that match nothing.
    asked = [d for d in report.decisions
             if d.rule.startswith(("scope:", "backward")) or d.rule == "amp_stop"
             or d.reason.startswith("kept: the program asked")]
    if (report.decisions and not asked
            and not any(d.changed or d.low_precision for d in report.decisions)
            and report.policy != Policy.preset("f32").to_string()):
        warnings.warn(
            f"hlo_amp: policy {report.policy!r} converts none of the program's "
            f"{len(report.decisions)} dot/convolution ops (see the report's reasons); "
            f"use a preset such as 'bf16' or add op rules (op:dot_general=compute)",
            UserWarning, stacklevel=stacklevel + 1)
