"""A quiet start of jax on a machine without a GPU or TPU, with the deviceless compilers in.

With the ``gpu`` extra (the CUDA PJRT plugin) and the ``tpu`` extra (libtpu) installed for
compiling for a GPU or TPU without one, jax on a machine with neither prints:

* at ``import jax``: ``cudart_stub.cc ... Could not find cuda drivers`` lines, each after
  absl's ``WARNING: All log messages before absl::InitializeLog()``, once per CUDA plugin
  extension jaxlib loads; C++ logging, straight to file descriptor 2 (no log level or
  environment variable turns it off);
* at its first computation, when ``JAX_PLATFORMS`` is unset: ``Jax plugin configuration
  error`` and a traceback ending ``Unable to load CUDA`` (``xla_bridge.discover_pjrt_plugins``
  logging the plugin's failed CUDA version check; the plugin is then not registered and
  ``target="h100"`` fails), and libtpu's ``Failed to find host bounds`` and ``unexpected
  worker hostname`` lines (jax initialising the ``tpu`` backend it tries on every machine).

``JAX_PLATFORMS=cpu`` avoids the second group: the plugin skips its version check and
registers (deviceless GPU compiles work), and libtpu loads only for a TPU topology.
``start_jax()`` (run by ``hlo_amp/__init__`` before anything else) chooses that itself
where no accelerator device exists and the user chose no platform, and drops exactly the
stub lines; every other byte on fd 2 still reaches stderr. Where a GPU or TPU device file
exists, or a jax plugin for other hardware is installed, it changes nothing: jax starts as
it always does, its errors included. ``hlo-amp-opt`` also mutes fd 2 while jax loads so
that its stderr is one line per error. This module imports nothing of jax at import.
"""

from __future__ import annotations

import contextlib
import glob
import os
import sys
import tempfile
import threading
from collections.abc import Callable, Iterator

# Device files of accelerators jax would use: NVIDIA (jax's own list: hardware_utils), WSL2,
# AMD (ROCm's kfd), TPUs (v4 and older as /dev/accel*, v5e and newer as VFIO groups).
_DEVICE_PATTERNS = ("/dev/nvidia[0-9]*", "/dev/nvidiactl", "/dev/dxg", "/dev/kfd",
                    "/dev/accel*", "/dev/vfio/[0-9]*")
# TPU chips by PCI ids, as jax's hardware_utils finds them (Google's vendor id; its gVNIC
# network card shares the vendor, so the device id decides).
_GOOGLE_PCI_VENDOR = "0x1ae0"
_TPU_PCI_DEVICES = {"0x0027", "0x0056", "0x005e", "0x0062", "0x0063", "0x006f", "0x0076"}
# Plugins whose hardware the device files above stand for (jax_plugins.xla_cuda12, ...).
_KNOWN_PLUGINS = ("xla_cuda", "xla_rocm")


def accelerator_devices() -> list[str]:
    """The GPU and TPU device files (and TPU PCI devices) of this machine; cheap, no jax."""
    found = [path for pattern in _DEVICE_PATTERNS for path in glob.glob(pattern)]
    for vendor in glob.glob("/sys/bus/pci/devices/*/vendor"):
        try:
            with open(vendor) as v, open(os.path.join(os.path.dirname(vendor), "device")) as d:
                if v.read().strip() == _GOOGLE_PCI_VENDOR and d.read().strip() in _TPU_PCI_DEVICES:
                    found.append(os.path.dirname(vendor))
        except OSError:
            continue
    return found


def _other_plugins() -> list[str]:
    """Installed jax plugins other than CUDA's and ROCm's: hardware we cannot detect. Only
    the ``jax_plugins`` namespace package, where plugins install themselves (their
    ``jax_plugins`` entry points would cost a scan of every installed package's metadata,
    0.1 s per process)."""
    import importlib.util
    import pkgutil

    spec = importlib.util.find_spec("jax_plugins")
    if spec is None or not spec.submodule_search_locations:
        return []
    names = [m.name for m in pkgutil.iter_modules(spec.submodule_search_locations)]
    return [name for name in names if not name.startswith(_KNOWN_PLUGINS)]


def _no_accelerator() -> bool:
    """Linux (the CUDA plugin's only platform), no accelerator device, no other plugin, and
    no request to initialise a TPU anyway."""
    return (sys.platform.startswith("linux") and "JAX_FORCE_TPU_INIT" not in os.environ
            and not accelerator_devices() and not _other_plugins())


def _is_stub_noise(line: bytes) -> bool:
    """The CUDA stub's line on a machine without a CUDA driver, or absl's preamble to it."""
    return (b"cudart_stub.cc" in line and b"Could not find cuda drivers" in line
            or line.startswith(b"WARNING: All log messages before absl::InitializeLog()"))


def _write_all(fd: int, data: bytes) -> None:
    while data:
        data = data[os.write(fd, data):]


@contextlib.contextmanager
def fd2_filtered() -> Iterator[None]:
    """Inside the block fd 2 goes through a pipe whose reader forwards every line to the
    real stderr as it arrives (a crash loses nothing but a partial line), except the CUDA
    stub's lines. With fd 2 closed (2>&-) there is nothing to filter."""
    _flush_stderr()
    try:
        saved = os.dup(2)
    except OSError:  # fd 2 closed: `import hlo_amp` raised here
        yield
        return
    read_end, write_end = os.pipe()

    def forward() -> None:
        pending = b""
        while chunk := os.read(read_end, 65536):
            *lines, pending = (pending + chunk).split(b"\n")
            _write_all(saved, b"".join(line + b"\n" for line in lines
                                       if not _is_stub_noise(line)))
        if pending and not _is_stub_noise(pending):
            _write_all(saved, pending)

    reader = threading.Thread(target=forward, name="hlo_amp-fd2-filter", daemon=True)
    reader.start()
    os.dup2(write_end, 2)
    os.close(write_end)
    try:
        yield
    finally:
        _flush_stderr()
        os.dup2(saved, 2)  # the pipe's last write end closes: the reader sees EOF
        reader.join(timeout=10)
        if not reader.is_alive():  # else a child holds the pipe: the reader keeps both fds
            os.close(read_end)
            os.close(saved)


@contextlib.contextmanager
def _fd2_to(fd: int) -> Iterator[None]:
    """File descriptor 2 sent to ``fd`` inside the block (closed again after it, where
    it was closed before)."""
    _flush_stderr()
    try:
        saved: int | None = os.dup(2)
    except OSError:  # fd 2 closed (2>&-)
        saved = None
    try:
        os.dup2(fd, 2)
        yield
    finally:
        _flush_stderr()
        if saved is None:
            os.close(2)
        else:
            os.dup2(saved, 2)
            os.close(saved)


def _flush_stderr() -> None:
    """Python's stderr flushed before fd 2 moves; it is None where fd 2 was closed."""
    if sys.stderr is not None:
        sys.stderr.flush()


@contextlib.contextmanager
def fd2_muted() -> Iterator[None]:
    """Send file descriptor 2 to /dev/null inside the block (Python's own errors still
    surface as exceptions and are printed after it)."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    try:
        with _fd2_to(devnull):
            yield
    finally:
        os.close(devnull)


@contextlib.contextmanager
def fd2_captured() -> Iterator[Callable[[], str]]:
    """Keep what is written to file descriptor 2 inside the block (XLA's log lines);
    the block gets a function that returns it so far."""
    with tempfile.TemporaryFile() as log, _fd2_to(log.fileno()):
        def written() -> str:
            log.seek(0)
            return log.read().decode(errors="replace")
        yield written


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
        import jax

        jax.devices()  # the backends start here, their plugin lines muted too


def start_jax() -> None:
    """Import jax for hlo_amp; without an accelerator, on CPU and quietly (module docstring).

    Works when the user imported jax first, as long as no computation has run yet: jax
    reads ``jax_platforms`` and discovers its plugins at the first one, not at import."""
    if is_cli_process():  # it mutes fd 2 around its own compiles too
        import_jax_for_cli()
        return
    if not _no_accelerator():
        return
    chosen = "JAX_PLATFORMS" in os.environ or (
        "jax" in sys.modules and sys.modules["jax"].config.jax_platforms is not None)
    if not chosen:  # the environment too: runtime/deviceless.py and child processes read it
        os.environ["JAX_PLATFORMS"] = "cpu"
    with fd2_filtered():
        import jax
    try:  # private: a jax without it starts as it always did, noise and all
        from jax._src import xla_bridge
    except ImportError:
        return
    if getattr(xla_bridge, "backends_are_initialized", lambda: True)():
        return  # too late: jax has started, and printed whatever it prints
    if not chosen:
        jax.config.update("jax_platforms", "cpu")
    discover = getattr(xla_bridge, "_discover_and_register_pjrt_plugins", None)
    if jax.config.jax_platforms == "cpu" and discover is not None:
        # What the first computation would do, now, to drop the stub line the CUDA plugin
        # prints as it registers; with CPU asked for it skips its CUDA version check.
        with fd2_filtered():
            discover()
