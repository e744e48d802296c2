"""A StableHLO module's text as a function JAX can call, trace and lower (for
``hlo-amp-opt --autopolicy``, which measures a ``.mlir`` file the way
``hlo_amp.autopolicy`` measures a Python function).

The module's ``main`` becomes a ``jax.export.Exported``: one exported for a stand-in
function of the same signature, with the module's bytecode in its place. Calling it
inlines the module into the caller's lowering, locations (scopes) included. An Exported
serves the platforms it names, so there is one per platform (``for_platform``).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from hlo_amp.ir.modules import NUMPY_TYPES as _DTYPES


def _host_callback(module: Any) -> str | None:
    """The target of a custom call into the lowering process's Python (a host callback,
    whose handle is that process's: run elsewhere it crashes), or None."""
    from hlo_amp.ir.modules import call_target, walk_operations

    for op in walk_operations(module.operation, names=frozenset({"stablehlo.custom_call"})):
        target = call_target(op)
        if "python" in target and "callback" in target:
            return target
    return None


class ModuleFunction:
    """``main`` of a module, callable on arrays of its argument types."""

    def __init__(self, source: str | bytes) -> None:
        from jax._src.interpreters import mlir as jax_mlir
        from jax._src.lib.mlir import ir

        with jax_mlir.make_ir_context():
            try:
                module = ir.Module.parse(source)
            except Exception as error:  # noqa: BLE001 - MLIR's parse error, in one line
                first = (str(error).strip().splitlines() or [type(error).__name__])[0]
                raise ValueError(f"cannot parse the module: {first}") from None
            main = next((op for op in module.body.operations
                         if "sym_name" in op.attributes
                         and ir.StringAttr(op.attributes["sym_name"]).value == "main"), None)
            if main is None:
                raise ValueError("the module has no function named main; accepted: a module "
                                 "as jax.jit(f).lower(...).as_text() writes it")
            callback = _host_callback(module)
            if callback is not None:
                raise ValueError(
                    f"the module calls back into the Python process that lowered it "
                    f"(custom_call @{callback}: jax.debug.print, pure_callback, "
                    f"io_callback), which no other process can run; accepted: a module "
                    f"without host callbacks")
            signature = ir.FunctionType(ir.TypeAttr(main.attributes["function_type"]).value)
            self.inputs = [_spec(t, f"argument {i}") for i, t in enumerate(signature.inputs)]
            self.outputs = [_spec(t, f"result {i}") for i, t in enumerate(signature.results)]
            bytecode = jax_mlir.module_to_bytecode(module)
        outputs = self.outputs

        def stand_in(*args: Any) -> tuple:
            return tuple(jnp.zeros(o.shape, o.dtype) for o in outputs)

        exported = jax.export.export(jax.jit(stand_in), platforms=("cpu",))(*self.inputs)
        self._exported = dataclasses.replace(
            exported, mlir_module_serialized=bytecode,
            module_kept_var_idx=tuple(range(len(self.inputs))))

    def for_platform(self, platform: str) -> Any:
        """The function, for lowering on ``platform`` (JAX's name: "cpu", "cuda", "tpu")."""
        return dataclasses.replace(self._exported, platforms=(platform,)).call

    def inputs_from(self, path: str | None, seed: int) -> tuple[np.ndarray, ...]:
        """The arguments: ``path``'s ``.npz`` arrays in argument order (``arr_0``,
        ``arr_1``, ... as ``np.savez(path, *arrays)`` names them, or any names in the
        order stored), else standard normal floats (and zero integers) from ``seed``."""
        if path is None:
            rng = np.random.default_rng(seed)
            return tuple(
                rng.standard_normal(s.shape).astype(s.dtype)
                if jnp.issubdtype(s.dtype, jnp.floating) else np.zeros(s.shape, s.dtype)
                for s in self.inputs)
        try:
            with np.load(Path(path)) as stored:
                names = sorted(stored.files, key=_argument_index) if all(
                    _argument_index(n) >= 0 for n in stored.files) else list(stored.files)
                arrays = [stored[n] for n in names]
        except (OSError, ValueError) as error:
            raise ValueError(f"cannot read inputs {path!r}: {error}; accepted: an .npz file "
                             "written by np.savez(path, *arrays), arrays in argument "
                             "order") from None
        want = ", ".join(f"{s.dtype.name}{list(s.shape)}" for s in self.inputs)
        got = ", ".join(f"{a.dtype.name}{list(a.shape)}" for a in arrays)
        if len(arrays) != len(self.inputs) or any(
                a.shape != s.shape or a.dtype != s.dtype for a, s in zip(arrays, self.inputs)):
            raise ValueError(f"inputs {path!r} hold {got or 'no arrays'}; main takes {want}")
        return tuple(arrays)


def _argument_index(name: str) -> int:
    return int(name[4:]) if name.startswith("arr_") and name[4:].isdigit() else -1


def _spec(ir_type: Any, what: str) -> jax.ShapeDtypeStruct:
    from jax._src.lib.mlir import ir

    text = str(ir_type)
    try:
        tensor = ir.RankedTensorType(ir_type)
    except ValueError:
        raise ValueError(f"main's {what} is {text}; accepted: ranked tensors") from None
    element = str(tensor.element_type)
    if not tensor.has_static_shape or element not in _DTYPES:
        raise ValueError(f"main's {what} is {text}; accepted: static shapes of "
                         f"{', '.join(_DTYPES)}")
    return jax.ShapeDtypeStruct(tuple(tensor.shape), _DTYPES[element])
