"""A first run prints no plugin errors: `make demo`'s environment, a user's script."""

from __future__ import annotations

import math
import os
import shlex
import subprocess
import sys
from pathlib import Path

from hlo_amp import quiet_stderr

ROOT = Path(__file__).resolve().parents[2]

# A user's script: jax imported first, an AMP step run here and compiled for an H100 and a
# TPU v5e without the device (the `gpu` and `tpu` extras `make test` installs).
USER_SCRIPT = """
import jax, jax.numpy as jnp
import hlo_amp

step = hlo_amp.compile(lambda w, x: jnp.tanh(x @ w).sum(), policy="bf16")
w, x = jnp.ones((8, 8)), jnp.ones((4, 8))
print(jax.default_backend(), float(step(w, x)))
for target in ("h100", "tpu-v5e"):
    print(step.lower(w, x, target=target).compile().report().summary())
"""

NOISE = ("Traceback", "plugin configuration error", "Unable to load CUDA", "host bounds",
         "worker hostname")


def _run(script: str) -> subprocess.CompletedProcess:
    """``script`` in a fresh Python with `make demo`'s environment: no JAX_PLATFORMS
    (`make test` sets it for pytest, the demo does not)."""
    env = {k: v for k, v in os.environ.items() if k != "JAX_PLATFORMS"}
    return subprocess.run([sys.executable, "-c", script], check=False, cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=120)


def test_user_script_prints_no_plugin_errors_and_compiles_for_gpu_and_tpu():
    result = _run(USER_SCRIPT)
    accelerator = quiet_stderr.accelerator_devices()
    if not accelerator:  # jax's own import prints the stub's lines before hlo_amp loads
        assert [n for n in NOISE if n in result.stderr] == [], result.stderr
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    if accelerator:  # a GPU or TPU here: jax must still pick it
        assert lines[0].split()[0] in ("gpu", "tpu"), result.stdout
        return
    backend, value = lines[0].split()
    # 32 x tanh(8) (8 is exact in bf16): 32.0 with LLVM at -O1, 31.999998 at -O0
    assert backend == "cpu" and abs(float(value) - 32 * math.tanh(8.0)) < 1e-5, result.stdout
    assert "kept by XLA (H100, compiled without a device): 1/1" in lines[1]
    # XLA:TPU runs the f32 dot as one bf16 pass itself: the accurate mode leaves it so.
    assert "TPU v5e, compiled without a device" in lines[2]
    assert "1 f32 op left to XLA's own bf16 pass (100% of FLOPs)" in lines[2]


def test_hlo_amp_imported_first_leaves_stderr_empty():
    result = _run("import hlo_amp, jax, jax.numpy as jnp\n"
                  "print(jax.default_backend(), float(jnp.ones(3).sum()))")
    assert result.returncode == 0, result.stderr
    if quiet_stderr.accelerator_devices():
        assert result.stdout.split()[0] in ("gpu", "tpu"), result.stdout
        return
    assert result.stdout == "cpu 3.0\n"
    assert result.stderr == ""


def test_a_script_with_stderr_closed_imports_and_compiles_for_a_gpu():
    """`import hlo_amp` with stderr closed (2>&-) raised: the filter flushed Python's
    stderr, which is None then, and dup'ed the closed fd 2. A compile for an H100 reads
    XLA's log from fd 2 the same way."""
    script = ("import hlo_amp, jax.numpy as jnp\n"
              "f = hlo_amp.compile(lambda x: x @ x, 'bf16')\n"
              "print(float(f(jnp.ones((2, 2))).sum()))\n"
              "print(f.lower(jnp.ones((16, 16)), target='h100').compile().device.device)")
    result = subprocess.run(f"{sys.executable} -c {shlex.quote(script)} 2>&-", shell=True,
                            text=True, stdout=subprocess.PIPE, timeout=300, check=False,
                            env=dict(os.environ, JAX_PLATFORMS="cpu"))
    assert (result.returncode, result.stdout) == (0, "8.0\nH100\n")


def test_a_machine_with_an_accelerator_keeps_jaxs_own_start():
    """Where a GPU's device file exists, jax chooses its platforms itself (it picks the GPU)."""
    script = f"""
import importlib.util, os, sys
spec = importlib.util.spec_from_file_location("q", {str(ROOT / "hlo_amp/quiet_stderr.py")!r})
q = importlib.util.module_from_spec(spec)
spec.loader.exec_module(q)
q._DEVICE_PATTERNS = (os.devnull,)  # stands for /dev/nvidia0
q.start_jax()
import jax
print(os.environ.get("JAX_PLATFORMS"), jax.config.jax_platforms)
"""
    result = _run(script)
    assert result.returncode == 0, result.stderr
    assert result.stdout == "None None\n"


def test_the_filter_drops_only_the_cuda_stub_lines(capfd):
    stub = (b"WARNING: All log messages before absl::InitializeLog() is called are written to"
            b" STDERR\nI0000 00:00:1795686416.514846    4064 cudart_stub.cc:31] Could not find"
            b" cuda drivers on your machine, GPU will not be used.\n")
    with quiet_stderr.fd2_filtered():
        os.write(2, stub + b"E0000 a real error\n" + stub + b"no newline at the end")
    assert capfd.readouterr().err == "E0000 a real error\nno newline at the end"
