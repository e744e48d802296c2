"""Targets: everything the passes, the deviceless compiles and the report know about what
XLA:CPU, XLA:GPU and XLA:TPU do with the modules hlo_amp writes.

A `Target` (targets/target.py) per backend family: `CpuTarget` (targets/cpu.py),
`GpuTarget` (targets/gpu.py), `TpuTarget` (targets/tpu.py); a device compiled for
without having it is one of those with its device fields set, and makes its own
topology and mesh (`Target.topology_devices`, `Target.mesh`; targets/topology.py). The
passes hold a `Target` and ask it; the public entry points take the strings they always
took and `as_target` turns them into one, here and nowhere else.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from hlo_amp.targets.cpu import CPU, CpuTarget
from hlo_amp.targets.gpu import GPU, GPU_NAMES, GpuTarget, gpu_device, gpu_from_config_file
from hlo_amp.targets.target import Target
from hlo_amp.targets.tpu import TPU, TPU_NAMES, TpuTarget, tpu_device

__all__ = ["CPU", "GPU", "GPU_NAMES", "NO_TARGET", "TPU", "TPU_NAMES", "CpuTarget",
           "GpuTarget", "Target", "TpuTarget", "as_target", "device_target",
           "platforms_target", "refuse_policy_on_device"]

# No target facts: several platforms, or ``hlo_amp.rewrite`` without a target.
NO_TARGET = Target()

_FAMILIES: dict[str, Target] = {"cpu": CPU, "gpu": GPU, "tpu": TPU}
# JAX's platform names per family.
_PLATFORMS = {"cpu": CPU, "cuda": GPU, "rocm": GPU, "gpu": GPU, "tpu": TPU}


def as_target(target: str | Target | None) -> Target:
    """The `Target` for what a public entry point was given: None (no target facts),
    ``"cpu"``, ``"gpu"``, ``"tpu"``, a device name (``"h100"``, ``"tpu-v5e:2x2"``), a
    ``GpuTargetConfig`` file's path, or a `Target` already."""
    if target is None:
        return NO_TARGET
    if isinstance(target, str) and target in _FAMILIES:
        return _FAMILIES[target]
    return device_target(target)


def device_target(target: str | Target) -> Target:
    """A device to compile for without having it: ``"h100"``, ``"h200"``, ``"a100"``, the
    path of a ``GpuTargetConfig`` text proto, or a TPU generation (``"tpu-v5e"``); or
    several: a node of GPUs (``"h100x8"``), nodes (``"h100:2x8"``), a TPU slice
    (``"tpu-v5e:4x4"``)."""
    if isinstance(target, Target):
        return target
    if not isinstance(target, str):
        raise TypeError(f"target={target!r}: expected one of {', '.join(GPU_NAMES + TPU_NAMES)}"
                        " or the path of a GpuTargetConfig .txtpb file")
    key = target.strip().lower()
    found: Target | None = tpu_device(key) or gpu_device(key)
    if found is not None:
        return found
    path = Path(target)
    if not path.is_file():
        raise ValueError(f"target={target!r} is neither a known GPU ({', '.join(GPU_NAMES)}), "
                         "a node or nodes of them (h100x8, h100:2x8), "
                         f"a TPU ({', '.join(TPU_NAMES)}, optionally with a slice such as "
                         "tpu-v5e:4x4) nor an existing GpuTargetConfig text-proto file")
    return gpu_from_config_file(path)


def platforms_target(platforms: Sequence[str]) -> Target:
    """The target of a program lowered for ``platforms`` (JAX's names: ``cuda`` and
    ``rocm`` are GPUs): that family's when they are one kind of device; the CPU's when
    the CPU is among several (the one module runs there too: a bf16 dot XLA:CPU cannot
    run failed its CPU call, ``platforms=["cpu", "cuda"]``); else no target."""
    found = {_PLATFORMS.get(p) for p in platforms}
    if len(found) > 1 and _PLATFORMS.get("cpu") in found:
        return _PLATFORMS["cpu"]
    only = found.pop() if len(found) == 1 else None
    return only if only is not None else NO_TARGET


def refuse_policy_on_device(policy: Any, target: Target) -> None:
    """A ValueError when ``policy`` computes in a dtype ``target`` has no matrix unit for
    (f16 and fp8 on TPUs), naming what is accepted."""
    dtypes = {policy.compute_dtype, *(a for a in policy.actions if isinstance(a, str))}
    why = target.refusal(dtypes)
    if why:
        where = target.device or f"a {target.platform.upper()}"  # a family: "a TPU"
        raise ValueError(f"policy {policy.to_string()!r} cannot be compiled for "
                         f"{target.name}: {why}; on {where} use bf16, "
                         "mixed_bfloat16 or f32")
