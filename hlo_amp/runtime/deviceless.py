"""Compiling for a GPU or TPU this machine does not have: the arguments placed on the
target's mesh, lowering and compiling on it. The devices themselves (their config protos,
slices, topologies and meshes, peaks, refusals) are targets: hlo_amp/targets/gpu.py,
tpu.py and topology.py (`Target.mesh`, `Target.topology_devices`).

XLA compiles for a GPU described by a ``GpuTargetConfig`` text proto with no device
present: ``jax.experimental.topologies`` makes a topology (and a mesh on it) from the
proto, JAX lowers for ``"cuda"`` with arguments placed on that mesh, and XLA:GPU runs its
whole pipeline (GEMM rewriting to cuBLAS, cuDNN convolutions, fusion, buffer assignment).
Only the CUDA PJRT plugin is needed (``pip install 'hlo_amp[gpu]'``), no driver, no GPU.

What such a compile cannot tell: kernel choices a real GPU would autotune. There is no
autotuning without a device, and XLA's Triton GEMM fusion then fails on some programs
(``Couldn't find output tile sizes``), so every GEMM is compiled as a cuBLAS call
(``xla_gpu_enable_triton_gemm=false``); a real run may pick Triton for some of them.
``cost_analysis()`` is empty; ``memory_analysis()`` and the optimized HLO are XLA's own.

TPUs the same way with libtpu (``pip install 'hlo_amp[tpu]'``): ``get_topology_desc``
makes a slice (``v5e:4x4``, or a generation's smallest, ``v5e:2x2``) from its name.

A one-device target (``"h100"``, ``"tpu-v5e"``) compiles on the topology's first device
with the arguments replicated; a node, nodes or a slice (``"h100x8"``, ``"h100:2x8"``,
``"tpu-v5e:4x4"``) on all of them, arguments sharded on a mesh of that many devices
keeping their shardings, so XLA's SPMD partitioner runs as under ``jax.jit``. libtpu looks for a TPU VM's metadata server unless
``TPU_SKIP_MDS_QUERY`` is set, so it is set before the first TPU topology is made (and at
import where ``JAX_PLATFORMS`` excludes TPUs, with ``ALLOW_MULTIPLE_LIBTPU_LOAD``).
"""

from __future__ import annotations

import contextlib
import inspect
import os
import re
import warnings
from collections.abc import Mapping
from typing import Any

import jax
import numpy as np

from hlo_amp.jax_internals import cudnn_checks_answered, lowering_backend, no_persistent_cache_entry
from hlo_amp.runtime.frameworks import jax_jit_info, jit_info, shardings_given
from hlo_amp.runtime.signature import normalise_argnums, signature_of
from hlo_amp.targets import Target, device_target
from hlo_amp.targets.attention_kernels import DEVICELESS_CUDNN
from hlo_amp.targets.topology import NoCompilerForTarget

# Where JAX was told not to use a TPU, libtpu serves only deviceless compiles: it need not
# ask for a TPU VM's metadata, and several processes (a test and the CLI it runs) may load
# it without its lockfile refusing the second (set before jax initialises its backends).
if "tpu" not in os.environ.get("JAX_PLATFORMS", "tpu"):
    os.environ.setdefault("TPU_SKIP_MDS_QUERY", "1")
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")

# NoCompilerForTarget: what target_mesh and the compiles raise where the XLA backend for
# the target is missing (the targets make their topologies: targets/topology.py).
__all__ = ["CompiledForTarget", "NoCompilerForTarget", "abstract_arguments",
           "compile_for_target", "compile_lowered", "compile_module_for_target",
           "lower_for_target", "module_partitions", "not_runnable", "target_mesh"]


def target_mesh(target: str | Target, axes: Mapping[str, int] | None = None
                ) -> jax.sharding.Mesh:
    """A ``jax.sharding.Mesh`` over the abstract devices of ``target`` (``"h100x8"``,
    ``"tpu-v5e:4x4"``; nothing to run on): ``axes`` maps axis names to sizes whose product
    is the target's device count (``{"fsdp": 4, "tp": 2}`` on ``"h100x8"``); without them,
    one axis ``"device"`` over all its devices (one device for ``"h100"``, ``"tpu-v5e"``).

    Arguments placed on it (``jax.ShapeDtypeStruct(shape, dtype, sharding=NamedSharding(
    mesh, P("fsdp", "tp")))``) keep their sharding through ``.lower(..., target=...)``.
    """
    return device_target(target).mesh(axes)


def abstract_arguments(tree: Any, target: Target, placed_by_jit: bool = False,
                       context: jax.sharding.Mesh | None = None) -> Any:
    """``tree`` with every array leaf an abstract value placed on the target's devices.

    A leaf with a ``NamedSharding`` whose mesh has as many devices as the target keeps it,
    rebuilt on ``target_mesh(target, <its axes>)`` (a mesh made by ``target_mesh``, or real
    arrays sharded over this machine's devices with the same axis names and sizes), as
    ``jax.jit`` keeps an argument's sharding; every other array is replicated (with a
    warning where a mesh of several devices meets a target of another number), or, where
    the jit places its arguments itself (``placed_by_jit``: its ``in_shardings``), left
    without a sharding, as jax.jit takes a NumPy array there. ``context``: the mesh of
    ``jax.set_mesh`` on the target's devices, which replicated arguments go on (on the
    target's own mesh, an Explicit context's ops met arguments of another: jax's
    "context mesh ... should match the aval mesh").
    """
    replicated = (None if placed_by_jit else jax.sharding.NamedSharding(
        context if context is not None else target.mesh(), jax.sharding.PartitionSpec()))
    meshes: dict[tuple, jax.sharding.Mesh] = {}
    warned: set[int] = set()

    def on_target(sharding: Any) -> Any:
        if not isinstance(sharding, jax.sharding.NamedSharding):
            return replicated
        mesh = sharding.mesh
        if mesh.size != target.devices:
            if mesh.size > 1 and target.devices > 1 and mesh.size not in warned:
                # Replicated, the compiled figures describe another program (a 16-device
                # mesh's argument on a 4-device target took 16 times its bytes).
                warned.add(mesh.size)
                warnings.warn(
                    f"an argument sharded over a mesh of {mesh.size} devices "
                    f"({dict(mesh.shape)}) is replicated on the {target.devices} devices of "
                    f"target {target.name!r}; to keep its sharding, shard it over "
                    f"hlo_amp.target_mesh({target.name!r}, axes)", UserWarning, stacklevel=2)
            return replicated
        key = (tuple(mesh.shape.items()), tuple(mesh.axis_types))
        if key not in meshes:
            meshes[key] = on_target_mesh(mesh, target)
        if mesh == meshes[key]:
            return sharding
        return jax.sharding.NamedSharding(meshes[key], sharding.spec,
                                          memory_kind=sharding.memory_kind)

    def place(leaf: Any) -> Any:
        if not hasattr(leaf, "shape") or not hasattr(leaf, "dtype"):
            if isinstance(leaf, (bool, int, float, complex)):  # traced like jax.jit does
                # (Its dtype without an array: under the target's jax.set_mesh one went
                # to the GPU compiled for, "'Executable' has no attribute
                # 'local_devices'": review h95; an IntEnum's is an int's: review h97.)
                kind = next(t for t in (bool, int, float, complex) if isinstance(leaf, t))
                return jax.ShapeDtypeStruct((), jax.dtypes.canonicalize_dtype(kind),
                                            sharding=replicated, weak_type=True)
            return leaf
        return jax.ShapeDtypeStruct(leaf.shape, leaf.dtype,
                                    sharding=on_target(getattr(leaf, "sharding", None)),
                                    weak_type=bool(getattr(leaf, "weak_type", False)))

    return jax.tree_util.tree_map(place, tree)


def on_target_mesh(mesh: Any, target: Target) -> jax.sharding.Mesh:
    """``mesh``'s axes (names, sizes, types: Explicit ones kept) on the target's devices."""
    return jax.sharding.Mesh(target.mesh(dict(mesh.shape)).devices, mesh.axis_names,
                             axis_types=mesh.axis_types)


def split_device_target(fn: Any, kwargs: dict) -> tuple[Target | None, dict]:
    """(the device of ``.lower(..., target=...)``, the keyword arguments for ``fn``).

    ``target=`` is ``fn``'s own argument when ``fn`` declares a parameter of that name
    (``loss(params, x, target)``), or takes ``**kwargs`` and the value is no device name,
    as under ``jax.jit(fn).lower``; the device is then given with ``lower_for``.
    """
    if "target" not in kwargs:
        return None, kwargs
    value = kwargs["target"]
    signature = signature_of(fn)  # None: a callable without one has no such parameter
    parameters = signature.parameters if signature is not None else {}
    named = parameters.get("target")
    if named is not None and named.kind is not inspect.Parameter.POSITIONAL_ONLY:
        return None, kwargs
    if (any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values())
            and not isinstance(value, (str, os.PathLike, Target))):
        return None, kwargs
    rest = {k: v for k, v in kwargs.items() if k != "target"}
    return (None if value is None else device_target(value)), rest


def lower_for_target(jitted: Any, args: tuple, kwargs: dict, target: Target,
                     inner: Any = None) -> Any:
    """``jitted`` (a ``jax.jit`` function) traced on abstract arguments and lowered for
    ``target``: a JAX ``Lowered`` whose ``compile(target.compiler_options)`` runs XLA for
    that device. A mesh set with ``jax.set_mesh`` whose size is the target's is set on
    the target's devices for the trace (its arguments' types name those devices).
    ``inner``: a ``jax.jit`` function that ``jitted`` calls (hlo_amp.compile of a jit
    with shardings, compiled nested); its shardings place the arguments, as they would
    at the top level, where replicating them on the target's own mesh conflicted."""
    context = jax.sharding.get_abstract_mesh()
    if not context.empty and context.size != target.devices:
        raise ValueError(
            f"the mesh set with jax.set_mesh has {context.size} device(s) "
            f"({dict(context.shape)}); target {target.name!r} has {target.devices}: lower "
            f"outside it, or set a mesh of its {target.devices} device(s) "
            f"(hlo_amp.target_mesh(target, axes))")
    context_mesh = None if context.empty else on_target_mesh(context, target)
    scope = jax.set_mesh(context_mesh) if context_mesh is not None else contextlib.nullcontext()
    # jax checks the cuDNN version and the GPU while it traces
    # dot_product_attention(implementation="cudnn"): answered for the GPU compiled for
    # (without it every such program failed here with "cuDNN not found").
    capability = getattr(target, "compute_capability", None)
    with scope, cudnn_checks_answered(capability, DEVICELESS_CUDNN):
        placed_args, placed_kwargs = abstract_arguments(
            (args, kwargs), target,
            placed_by_jit=_has_in_shardings(jitted) or _has_shardings(inner),
            context=context_mesh)
        # Static arguments stay what they are: a Python number made an abstract scalar
        # reached the function (train=False as a ShapeDtypeStruct: "len() of unsized
        # object").
        info = jit_info(jitted)
        static = normalise_argnums(getattr(info, "static_argnums", ()), len(args))
        names = set(getattr(info, "static_argnames", ()))
        args = tuple(arg if n in static else placed for n, (arg, placed) in
                     enumerate(zip(args, placed_args)))
        kwargs = {k: kwargs[k] if k in names else placed_kwargs[k] for k in kwargs}
        try:
            traced = jitted.trace(*args, **kwargs)
        except RuntimeError as error:
            if capability is not None or "cuDNN" not in str(error):
                raise
            # jax's own check of cuDNN attention, made while tracing: on a TPU it said
            # only "cuDNN not found".
            raise ValueError(
                f"{getattr(jitted, '__name__', 'the function')} calls cuDNN "
                f"(jax.nn.dot_product_attention(implementation='cudnn')), which runs on "
                f"NVIDIA GPUs only; compiled for {target.name} it cannot be: use "
                f"implementation='xla' or None there ({error})") from None
        try:
            lowered = traced.lower(lowering_platforms=(target.platform,))
        except RuntimeError as error:
            # jax lowers a host callback through the live backend of its platform.
            callback = _HOST_CALLBACK.search(str(traced.jaxpr))
            if callback is None or "Unknown backend" not in str(error):
                raise
            raise ValueError(
                f"{getattr(jitted, '__name__', 'the function')} calls back into Python "
                f"({callback.group(1)}: jax.debug.print, jax.debug.callback, io_callback or "
                f"pure_callback), which jax lowers only on a machine with the device; "
                f"compiled for {target.name} without one it cannot be: compile it without "
                f"the callbacks, or for this machine") from None
    backend = lowering_backend(lowered)
    if backend == "cpu":
        # A jax.jit's own in_shardings/out_shardings on this machine's devices place
        # the program there: XLA:CPU compiled it (bf16 dots upcast, f32 collectives),
        # and the report read as the target's.
        raise ValueError(
            f"{getattr(jitted, '__name__', 'the function')} is a jax.jit whose shardings "
            f"name this machine's cpu devices, so it compiles for them, not for "
            f"{target.name}: build its in_shardings/out_shardings on "
            f"hlo_amp.target_mesh({target.name!r}, axes), or drop them and pass arguments "
            f"sharded on that mesh")
    return lowered


# The primitives of jax's host callbacks, as a jaxpr prints them.
_HOST_CALLBACK = re.compile(r"\b(debug_callback|debug_print|io_callback|pure_callback)\[")


def _has_in_shardings(jitted: Any) -> bool:
    """Whether the ``jax.jit`` function was given ``in_shardings``."""
    return bool(getattr(jit_info(jitted), "user_specified_in_shardings", False))


def _has_shardings(jitted: Any) -> bool:
    """Whether ``jitted`` is a ``jax.jit`` function given ``in_shardings`` or
    ``out_shardings``."""
    info = jax_jit_info(jitted)
    return info is not None and shardings_given(info, unknown=False)


def compile_for_target(jitted: Any, *args: Any, target: str | Target = "h100",
                       compiler_options: dict[str, Any] | None = None, **kwargs: Any) -> Any:
    """A ``jax.jit`` function (or a plain one, compiled as ``jax.jit`` of it) compiled for
    ``target`` without the device: JAX's ``Compiled`` (``as_text()``,
    ``memory_analysis()``); the peer of ``AmpFunction.lower(..., target=...).compile()``
    for comparisons on one footing. ``compiler_options`` override the target's XLA flags."""
    # hlo_amp.compile's own object (a method of its class: jax.jit of one copies its
    # attributes, policy included, and was refused though it compiles as any jax.jit)
    if hasattr(jitted, "policy") and hasattr(jitted, "lower_for"):
        raise TypeError(
            f"compile_for_target takes a jax.jit function, got hlo_amp.compile's "
            f"{getattr(jitted, '__name__', type(jitted).__name__)}: use its "
            f".lower(*args, target={target!r}).compile()")
    if not hasattr(jitted, "trace"):
        if not callable(jitted):
            raise TypeError(f"compile_for_target takes a jax.jit function, got {jitted!r}")
        jitted = jax.jit(jitted)
    device = device_target(target)
    options = {**device.compiler_options, **(compiler_options or {})}
    return CompiledForTarget(compile_lowered(lower_for_target(jitted, args, kwargs, device),
                                             options), device)


def compile_lowered(lowered: Any, compiler_options: dict[str, Any] | None) -> Any:
    """``lowered.compile(compiler_options)`` for a target without its device, writing no
    persistent compilation cache entry: no process can read one back (jax's compile-only
    client cannot deserialise an executable), so each later hit cost a UserWarning
    ("PjRtCompiler must be constructed with a Client") and the compile again."""
    with no_persistent_cache_entry():
        return lowered.compile(compiler_options)


def not_runnable(device: Target, readers: str, instead: str) -> str:
    """The error of calling a function compiled for ``device`` without it."""
    return (f"this function was compiled for {device.description} (target={device.name!r}) "
            f"without a device; it can be read (as_text(), memory_analysis(), {readers}) "
            f"but not run here. {instead}, to run on this machine's {jax.default_backend()}")


class CompiledForTarget:
    """``compile_for_target``'s result: JAX's ``Compiled`` for a device this machine
    lacks, every attribute read through; calling it raises what ``AmpCompiled`` does
    (it raised "'Executable' object has no attribute 'local_devices'")."""

    def __init__(self, compiled: Any, device: Target):
        self.jax_compiled = compiled
        self.device = device

    def __getattr__(self, name: str) -> Any:
        return getattr(self.jax_compiled, name)

    def __call__(self, /, *args: Any, **kwargs: Any) -> Any:
        raise RuntimeError(not_runnable(self.device, "input_shardings",
                                        "Call the jax.jit function itself"))


def compile_module_for_target(module: Any, target: Target) -> Any:
    """A StableHLO ``ir.Module`` (as ``hlo-amp-opt`` reads it) compiled by XLA for
    ``target``: an executable with ``hlo_modules()`` and ``get_compiled_memory_stats()``;
    nothing to run. A module with ``mhlo.num_partitions = N`` (``jax.jit(...).lower``'s on
    an N-device mesh) is partitioned by XLA over the first N of the target's devices."""
    from jax._src import compiler
    from jax._src.lib import xla_client

    partitions = module_partitions(module)
    devices = target.topology_devices()
    if partitions > len(devices):
        raise ValueError(
            f"the module is partitioned over {partitions} devices (mhlo.num_partitions); "
            f"target {target.name!r} has {len(devices)}: compile it for a target with "
            f"{partitions} devices ({', '.join(_examples(partitions))})")
    chosen = tuple(devices[:partitions])
    options = compiler.get_compile_options(
        1, partitions, device_assignment=np.array([chosen]),
        env_options_overrides=target.compiler_options)
    if partitions > 1:  # the shardings the module carries are Shardy's or GSPMD's
        options.executable_build_options.use_shardy_partitioner = _has_shardy_shardings(
            module)
    return chosen[0].client.compile(module, xla_client.DeviceList(chosen), options)


def module_partitions(module: Any) -> int:
    """``mhlo.num_partitions`` of a StableHLO module (1 when absent)."""
    from jaxlib.mlir import ir

    attributes = module.operation.attributes
    if "mhlo.num_partitions" not in attributes:
        return 1
    return ir.IntegerAttr(attributes["mhlo.num_partitions"]).value


def _has_shardy_shardings(module: Any) -> bool:
    """Whether the module's shardings are Shardy's (an ``sdy.mesh``, ``sdy.sharding``
    attributes) rather than GSPMD's (``mhlo.sharding``)."""
    for op in module.body.operations:
        if op.operation.name.startswith("sdy."):
            return True
        if op.operation.name == "func.func" and "sdy." in str(op.operation.attributes):
            return True
    return False


def _examples(devices: int) -> list[str]:
    """Target names with ``devices`` devices, for messages."""
    names = [f"h100x{devices}"] if devices <= 8 else (
        [f"h100:{devices // 8}x8"] if devices % 8 == 0 else [])
    sides = [(a, devices // a) for a in range(2, devices, 2)
             if devices % a == 0 and (devices // a) % 2 == 0 and a <= devices // a]
    if sides:
        names.append("tpu-v5e:{}x{}".format(*sides[-1]))
    return names or [f"a target of {devices} devices"]
