"""What the fused kernel needs of one attention site (match.py finds it, rewrite.py
replaces it)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np
from jaxlib.mlir import ir

from hlo_amp.passes.fused_attention.roles import Role


class MaskLeaf(NamedTuple):
    """A mask value of the home block and the role of each of its dimensions (None: of
    size 1, or read at index 0 alone: ``first_only``)."""

    value: ir.Value
    roles: list[Role | None]
    # Dimensions the value repeats itself along, of which the bias reads index 0 (a
    # mask jax broadcast to the scores' shape before a loop: masks.py).
    first_only: tuple[int, ...] = ()


@dataclass
class Exit:
    """One exit ``dot_general`` and the roles of its result's dimensions."""

    op: ir.Operation
    roles: list[Role]


@dataclass
class Match:
    """An attention site as the fused kernel sees it (all values in the home block)."""

    home: ir.Block
    scores: ir.Operation  # S = Q·Kᵀ
    q: ir.Value
    k: ir.Value
    q_roles: list[Role]
    k_roles: list[Role]
    sizes: dict[Role, int]
    scale: float
    causal: bool
    # Values of the home block whose AND is where attention may look; empty: nowhere
    # masked.
    mask_leaves: list[MaskLeaf]
    exits: dict[str, Exit]
    # Constant masks that are not causal, each [T, S], [T, 1] or [1, S] (ANDed with the
    # leaves in the bias).
    constant_mask: tuple[np.ndarray, ...] = ()
    # Under a causal mask, cuDNN's sliding window: keys t - window < s <= t (0: none).
    window: int = 0
    v: ir.Value | None = None
    v_roles: list[Role] = field(default_factory=list)
    d_out: ir.Value | None = None  # dO, the gradient of the output (a training step)
    d_out_roles: list[Role] = field(default_factory=list)
    t_role: Role = ("Q", 0)  # the query position among the query's free dimensions
    # The cluster's ops in the home block: dead once the exits are replaced.
    home_ops: list[ir.Operation] = field(default_factory=list)

    @property
    def has_bias(self) -> bool:
        """Whether the kernel takes a bias: a mask the program computes, or a constant
        one that is not causal."""
        return bool(self.mask_leaves) or bool(self.constant_mask)

    @property
    def training(self) -> bool:
        return "dq" in self.exits
