"""Muting the C-level log lines the CUDA plugin prints to fd 2 on a machine without a GPU.

With the ``gpu`` extra installed (the CUDA PJRT plugin, for compiling for a GPU without
one), importing jax and initialising its backends on a machine with no CUDA driver print
``cudart_stub.cc ... Could not find cuda drivers`` lines straight to file descriptor 2,
past Python's ``sys.stderr`` and every log-level setting. ``hlo-amp-opt`` promises one
line on stderr per error, so it mutes fd 2 while jax loads. This module imports nothing
of jax: ``hlo_amp/__init__`` uses it before jax is imported.
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Iterator


@contextlib.contextmanager
def fd2_muted() -> Iterator[None]:
    """Send file descriptor 2 to /dev/null inside the block (Python's own errors still
    surface as exceptions and are printed after it)."""
    sys.stderr.flush()
    saved = os.dup(2)
    devnull = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(devnull, 2)
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)
        os.close(devnull)


def is_cli_process() -> bool:
    """Whether this process is ``hlo-amp-opt`` (the console script or ``-m hlo_amp.cli``)."""
    script = os.path.basename(sys.argv[0]) if sys.argv else ""
    return script == "hlo-amp-opt" or list(getattr(sys, "orig_argv", [])[1:3]) == [
        "-m", "hlo_amp.cli"]


def import_jax_for_cli() -> None:
    """In ``hlo-amp-opt``, import jax on the CPU platform with fd 2 muted: the CLI runs
    nothing on a device (``--xla-target`` compiles without one)."""
    if "jax" in sys.modules or not is_cli_process():
        return
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    with fd2_muted():
        import jax  # noqa: F401
