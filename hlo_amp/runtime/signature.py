"""The cache key of one argument leaf and the positions of static arguments, shared by the
compiled-function objects."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax


def leaf_signature(leaf: Any) -> Any:
    """Shape, dtype, weak type and sharding of an array leaf; type and value of a
    Python scalar (what a new executable is compiled for)."""
    if hasattr(leaf, "shape") and hasattr(leaf, "dtype"):
        sharding = getattr(leaf, "sharding", None) if isinstance(leaf, jax.Array) else None
        return (tuple(leaf.shape), str(leaf.dtype), bool(getattr(leaf, "weak_type", False)),
                sharding)
    return (type(leaf).__name__, leaf if isinstance(leaf, (bool, int, float, complex)) else None)


def normalise_argnums(argnums: int | Sequence[int], count: int) -> tuple[int, ...]:
    """``argnums`` as positions among ``count`` positional arguments; those beyond them
    (an argument given by keyword or left to its default) are dropped, as jax.jit does."""
    if isinstance(argnums, int):
        argnums = (argnums,)
    return tuple(sorted({a + count if a < 0 else a for a in argnums} & set(range(count))))
