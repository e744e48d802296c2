"""Print the XLA flags given as arguments that the installed jaxlib knows (make test).

XLA aborts a process whose ``XLA_FLAGS`` names a flag it does not know ("Unknown flag in
XLA_FLAGS"), and the flags that speed up the tests come and go between the jaxlib versions
pyproject.toml allows (``--xla_cpu_use_fusion_emitters`` is in 0.10.2 and 0.12.0.1, not in
0.11.2, where every pytest worker died at start). One child process tries them all; each
flag it rejects is dropped, with a note on stderr, and the rest are tried again.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys

PROBE = "import jax; jax.devices('cpu')"


def known_flags(flags: list[str]) -> list[str]:
    """``flags`` less those the installed XLA rejects as unknown."""
    flags = list(flags)
    while flags:
        env = dict(os.environ, XLA_FLAGS=" ".join(flags), JAX_PLATFORMS="cpu")
        proc = subprocess.run([sys.executable, "-c", PROBE], env=env, capture_output=True,
                              text=True, timeout=300, check=False)
        if proc.returncode == 0:
            return flags
        unknown = re.search(r"Unknown flags? in XLA_FLAGS: (\S+)", proc.stderr)
        if unknown is None or unknown.group(1) not in flags:
            sys.exit(f"xla_flags.py: XLA failed with XLA_FLAGS={' '.join(flags)!r}:\n"
                     f"{proc.stderr[-2000:]}")
        print(f"xla_flags.py: this jaxlib does not know {unknown.group(1)}; the tests run "
              f"without it", file=sys.stderr)
        flags.remove(unknown.group(1))
    return flags


if __name__ == "__main__":
    print(" ".join(known_flags(sys.argv[1:])))
