"""hlo_amp: automatic mixed precision for JAX, done as a compiler pass on StableHLO."""

from hlo_amp.quiet_stderr import is_cli_process as _is_cli_process

# hlo-amp-opt runs the passes on a .mlir file with jaxlib's MLIR bindings alone and imports
# jax only where it traces or compiles (hlo_amp/cli.py ``_start_jax``): in that
# process the API below, which needs jax, is not imported (half a second of every run).
if not _is_cli_process():
    from hlo_amp.quiet_stderr import start_jax as _start_jax

    _start_jax()  # before jax starts: no CUDA/libtpu errors without a GPU or TPU

    from hlo_amp import jax_internals as _jax_internals

    _jax_internals.check()  # an unsupported jax fails here, in one line, not deep in a call

    from hlo_amp.ir.modules import PassError
    from hlo_amp.jaxamp_compat import amp
    from hlo_amp.module_scopes import module_scopes
    from hlo_amp.numerics import (
        Attribution,
        AutoPolicy,
        Comparison,
        TargetAutoPolicy,
        attribute,
        autopolicy,
        compare,
    )
    from hlo_amp.policy import Policy, amp_stop
    from hlo_amp.report import Decision, Report
    from hlo_amp.rewrite import rewrite
    from hlo_amp.runtime.compile import AmpCompiled, AmpFunction, AmpLowered, compile
    from hlo_amp.runtime.deviceless import compile_for_target, target_mesh
    from hlo_amp.runtime.scaler import (
        DynamicScalerState,
        all_finite,
        dynamic_scale_grad,
        dynamic_scale_value_and_grad,
        select_tree,
    )

__all__ = [
    "AmpCompiled",
    "AmpFunction",
    "AmpLowered",
    "Attribution",
    "AutoPolicy",
    "Comparison",
    "Decision",
    "DynamicScalerState",
    "PassError",
    "Policy",
    "Report",
    "TargetAutoPolicy",
    "all_finite",
    "amp",
    "amp_stop",
    "attribute",
    "autopolicy",
    "compare",
    "compile",
    "compile_for_target",
    "dynamic_scale_grad",
    "dynamic_scale_value_and_grad",
    "module_scopes",
    "rewrite",
    "select_tree",
    "target_mesh",
]
