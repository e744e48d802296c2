"""Running a script on several CPU host devices: ``--xla_force_host_platform_device_count``
must be set before jax is imported, so the sharded checks run in a subprocess."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from typing import Any

RESULTS = "RESULTS="


def host_devices_env(devices: int = 8) -> dict[str, str]:
    """This process's environment for a child on ``devices`` CPU devices. The XLA flags
    already set are kept (``make test``'s faster LLVM level among them)."""
    flags = f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count={devices}"
    return dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS=flags.strip())


def run_on_host_devices(script: str, devices: int = 8, timeout: float = 300) -> Any:
    """The JSON ``script`` printed on its last ``RESULTS=`` line, run on ``devices`` CPU
    devices; a failure shows the script's stderr."""
    env = host_devices_env(devices)
    proc = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True,
                          text=True, timeout=timeout, check=False)
    lines = [line for line in proc.stdout.splitlines() if line.startswith(RESULTS)]
    assert proc.returncode == 0 and lines, proc.stdout[-2000:] + proc.stderr[-3000:]
    return json.loads(lines[-1].removeprefix(RESULTS))
