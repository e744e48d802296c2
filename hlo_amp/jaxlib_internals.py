"""Every jaxlib MLIR API hlo_amp uses that jaxlib does not promise to keep, imported
without jax.

The passes work on jaxlib's MLIR bindings (``jaxlib.mlir``: the very modules
``jax.extend.mlir`` re-exports). Importing them through jax runs jax's whole start-up,
half a second that ``hlo-amp-opt`` on a ``.mlir`` file does not need, so everything the
pass path needs comes from jaxlib here and jax is imported only where a program is
traced or compiled (hlo_amp/jax_internals.py lists that side).

Each entry and why we need it:

- ``jaxlib.mlir._mlir_libs._jax_mlir_ext.register_dialects`` and the ``register_dialect``
  functions of ``sdy``, ``mpmd`` (where present), ``mhlo`` (``register_mhlo_dialect``),
  ``chlo`` and ``stablehlo``: ``make_ir_context`` builds the context jax's own
  ``interpreters.mlir.make_ir_context`` builds, with the dialects a JAX module holds.
- ``ir.Operation._CAPIPtr`` (the MLIR bindings' C API capsule): ``operation_address``,
  an op's address, the only key that names an op for as long as it lives (an
  ``ir.Operation``'s own hash follows its contents; hlo_amp/ir/modules.py ``op_key``).
- Shardy's ``sdy-propagation-pipeline``, registered in jaxlib's MLIR pass registry and
  run through ``jaxlib.mlir.passmanager``: a pass that replaces an op in a sharded module
  reads the sharding XLA's partitioner would give the op's result
  (hlo_amp/ir/shardings.py). ``shardy_propagation()`` returns None where a jaxlib lacks
  it, and those passes then leave such ops as they are.

``missing_entry_points()`` names what this jaxlib lacks; ``jax_internals.check()`` and
the CLI turn that into one clear error.
"""

from __future__ import annotations

import ctypes
from typing import Any

from jaxlib.mlir import ir, passmanager
from jaxlib.mlir.dialects import chlo, mhlo, sdy
from jaxlib.mlir.dialects import stablehlo as hlo

try:
    from jaxlib.mlir._mlir_libs import _jax_mlir_ext
except ImportError:  # reported by missing_entry_points()
    _jax_mlir_ext = None
try:  # jax registers it too (MPMD programs); a jaxlib without it has no such modules
    from jaxlib.mlir.dialects import mpmd
except ImportError:
    mpmd = None

# name -> the object, or None where this jaxlib lacks it.
ENTRY_POINTS: dict[str, Any] = {
    "jaxlib.mlir._mlir_libs._jax_mlir_ext.register_dialects":
        getattr(_jax_mlir_ext, "register_dialects", None),
    "jaxlib.mlir.dialects.sdy.register_dialect": getattr(sdy, "register_dialect", None),
    "jaxlib.mlir.dialects.mhlo.register_mhlo_dialect":
        getattr(mhlo, "register_mhlo_dialect", None),
    "jaxlib.mlir.dialects.chlo.register_dialect": getattr(chlo, "register_dialect", None),
    "jaxlib.mlir.dialects.stablehlo.register_dialect": getattr(hlo, "register_dialect", None),
    "jaxlib.mlir.ir.Operation._CAPIPtr": getattr(ir.Operation, "_CAPIPtr", None),
}

_upstream_dialects: Any = None  # one registry for every context, as jax keeps one
# One thread pool for every context, as jax shares one: a context's own would start
# threads of its own, for each module parsed.
_thread_pool: Any = None


class _Context(ir.Context):
    """A context that loads only the dialects registered below: ``ir.Context.__init__``
    would load every dialect linked into jaxlib (jax's ``JaxIrContext`` does the same)."""

    def __init__(self) -> None:
        super(ir.Context, self).__init__()


def make_ir_context(threads: bool = True) -> ir.Context:
    """An MLIR context with the dialects JAX lowers to (stablehlo, chlo, func, sdy...).
    ``threads=False``: one that never uses a thread pool (in a forked child, whose copy
    of the shared pool has no threads: its verifier would wait on them for ever)."""
    global _upstream_dialects, _thread_pool
    if _upstream_dialects is None:
        _upstream_dialects = ir.DialectRegistry()
        _jax_mlir_ext.register_dialects(_upstream_dialects)
        _thread_pool = ir.ThreadPool() if hasattr(ir, "ThreadPool") else None
    context = _Context()
    if not threads:
        context.enable_multithreading(False)
    context.append_dialect_registry(_upstream_dialects)
    context.load_all_available_dialects()
    if threads and _thread_pool is not None:
        context.set_thread_pool(_thread_pool)
    sdy.register_dialect(context)
    if mpmd is not None:
        mpmd.register_dialect(context)
    mhlo.register_mhlo_dialect(context)
    chlo.register_dialect(context)
    hlo.register_dialect(context)
    return context


_capsule_pointer = ctypes.pythonapi.PyCapsule_GetPointer
_capsule_pointer.restype = ctypes.c_void_p
_capsule_pointer.argtypes = [ctypes.py_object, ctypes.c_char_p]
_capsule_name = ctypes.pythonapi.PyCapsule_GetName
_capsule_name.restype = ctypes.c_char_p
_capsule_name.argtypes = [ctypes.py_object]


def operation_address(operation: Any) -> int:
    """The address of the MLIR operation an ``ir.Operation`` wraps (read from its C API
    capsule, whose name differs between jaxlib builds)."""
    capsule = operation._CAPIPtr
    return _capsule_pointer(capsule, _capsule_name(capsule))


SHARDY_PROPAGATION = "builtin.module(sdy-propagation-pipeline)"


def shardy_propagation(context: Any) -> Any:
    """A pass manager running Shardy's propagation in ``context``, or None where this
    jaxlib does not register the pipeline."""
    with context:
        try:
            return passmanager.PassManager.parse(SHARDY_PROPAGATION)
        except (ValueError, ir.MLIRError):
            return None


def missing_entry_points() -> list[str]:
    """Each entry point this jaxlib lacks."""
    return [f"{name} is gone" for name, found in ENTRY_POINTS.items() if found is None]
