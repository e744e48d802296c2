"""hlo_amp: automatic mixed precision for JAX, done as a compiler pass on StableHLO."""

from hlo_amp.policy import Policy, amp_stop
from hlo_amp.report import Decision, Report
from hlo_amp.rewrite import rewrite
from hlo_amp.runtime.compile import AmpCompiled, AmpFunction, AmpLowered, compile

__all__ = [
    "AmpCompiled",
    "AmpFunction",
    "AmpLowered",
    "Decision",
    "Policy",
    "Report",
    "amp_stop",
    "compile",
    "rewrite",
]
