"""A device compiled for without having it, as XLA sees it: its topology's abstract devices
(``jax.experimental.topologies``, made by `GpuTarget.topology_devices` from its
``GpuTargetConfig`` proto and by `TpuTarget.topology_devices` from its slice's name) and a
mesh over them (`Target.mesh`). What they are made from is in targets/gpu.py and tpu.py;
here is what both share: the error for a compiler that is not installed, the device
count check, and the mesh.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any


class NoCompilerForTarget(RuntimeError):
    """The XLA backend for the target is not installed (the CUDA PJRT plugin, libtpu)."""


def first_devices(target: Any, devices: tuple) -> tuple:
    """``target``'s share of the ``devices`` its topology made: the first for a one-device
    target, all of them for a node, nodes or a slice (which must have as many)."""
    if target.devices > 1 and len(devices) != target.devices:
        raise NoCompilerForTarget(f"{target.description}: the topology XLA made has "
                                  f"{len(devices)} devices, not {target.devices}")
    return devices[:target.devices]


def mesh_of(target: Any, axes: Mapping[str, int] | None = None) -> Any:
    """`Target.mesh`: a ``jax.sharding.Mesh`` over ``target.topology_devices()`` with the
    ``axes`` (names to sizes whose product is the device count; one axis ``"device"``
    without them), checked before the topology is made."""
    import jax

    if axes is None:
        axes = {"device": target.devices}
    if not isinstance(axes, Mapping) or not all(
            isinstance(name, str) and isinstance(size, int) and size > 0
            for name, size in axes.items()):
        raise TypeError(f"axes={axes!r}: expected a dict of axis names to positive sizes, "
                        "e.g. {'fsdp': 4, 'tp': 2}")
    shape = tuple(axes.values())
    if math.prod(shape) != target.devices:
        raise ValueError(
            f"axes={dict(axes)!r} make a mesh of {math.prod(shape)} devices; target "
            f"{target.name!r} has {target.devices}: their sizes must multiply to "
            f"{target.devices}")
    return jax.sharding.Mesh(_device_grid(target.topology_devices(), shape), tuple(axes))


def _device_grid(devices: tuple, shape: tuple[int, ...]) -> Any:
    """``devices`` arranged as ``shape``: in the physical layout's order where JAX knows
    it (TPU torus axes, GPUs node by node), as ``jax.make_mesh`` does; else in order."""
    import numpy as np
    from jax.experimental import mesh_utils

    if len(devices) > 1:
        try:
            return mesh_utils.create_device_mesh(shape, list(devices),
                                                 allow_split_physical_axes=True)
        except (AssertionError, ValueError, NotImplementedError):
            pass  # v4's libtpu topology has one device per TensorCore, not per chip
    return np.array(devices, dtype=object).reshape(shape)
