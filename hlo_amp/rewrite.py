"""``hlo_amp.rewrite``: the pass pipeline on StableHLO text or bytecode."""

from __future__ import annotations

import os
import sys
import sysconfig
import warnings
from collections.abc import Mapping
from typing import Any

from hlo_amp.ir.modules import drop_marks_for_the_full_pipeline, module_text, parse_module
from hlo_amp.passes import run_pipeline
from hlo_amp.policy import Policy, as_policy
from hlo_amp.report import Report


def rewrite(module: str | bytes, policy: Policy | str | Mapping[str, Any] = "bf16", *,
            debug_info: bool = False, return_report: bool = False
            ) -> str | tuple[str, Report]:
    """Rewrite a StableHLO module (text, bytecode or portable artifact: ``str`` or
    ``bytes``, a ``bytearray`` too); return text.

    With ``return_report=True`` returns ``(text, report)``.
    """
    if isinstance(module, (bytearray, memoryview)):  # Exported.serialize()'s type
        module = bytes(module)
    if not isinstance(module, (str, bytes)):
        raise TypeError(
            f"hlo_amp.rewrite takes a StableHLO module as text (str) or as bytecode or a "
            f"portable artifact (bytes), got {type(module).__module__}."
            f"{type(module).__qualname__}: pass a jax Lowered's .as_text(), an Exported's "
            f".mlir_module_serialized, str() of an ir.Module; a function goes to "
            f"hlo_amp.compile")
    amp_policy = as_policy(policy)
    parsed = parse_module(module)
    drop_marks_for_the_full_pipeline(parsed, module)
    report = run_pipeline(parsed, amp_policy)
    warn_unused_rules(report)
    text = module_text(parsed, debug_info=debug_info)
    return (text, report) if return_report else text


def warn_unused_rules(report: Report) -> None:
    """Warn when policy rules matched no op (a likely typo in a scope pattern) or lost on
    precedence wherever they matched (docs/policies.md's order), or when
    the policy converts nothing and no rule says why; at the user's line."""
    for line in report.unused_rule_lines():
        warn_at_user_code(f"hlo_amp: policy rule(s) {line} (policy {report.policy!r})")
    if _converts_nothing_unasked(report):
        warn_at_user_code(
            f"hlo_amp: policy {report.policy!r} converts none of the program's "
            f"{len(report.decisions)} dot/convolution ops: no rule names their op kind; "
            f"use a preset such as 'bf16' or add op rules (op:dot_general=compute)")


def _library_dirs() -> tuple[str, ...]:
    import jax
    import jaxlib

    return tuple(os.path.dirname(os.path.abspath(module.__file__)) + os.sep
                 for module in (sys.modules[__package__], jax, jaxlib)) + (
        os.path.abspath(sysconfig.get_paths()["stdlib"]) + os.sep,)


def warn_at_user_code(message: str) -> None:
    """``warnings.warn`` attributed to the first frame outside hlo_amp, JAX and the
    standard library: the user's call, ``.lower()`` or traced call, however deep the
    transformation stack between them is."""
    library = _library_dirs()
    frame, level = sys._getframe(0), 1
    while frame is not None and os.path.abspath(frame.f_code.co_filename).startswith(library):
        frame, level = frame.f_back, level + 1
    warnings.warn(message, UserWarning, stacklevel=level)


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
