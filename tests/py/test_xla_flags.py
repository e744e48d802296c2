"""tests/xla_flags.py, which keeps `make test`'s XLA flags to those the jaxlib knows."""

from __future__ import annotations

import importlib.util
from pathlib import Path

SPEC = importlib.util.spec_from_file_location(
    "xla_flags", Path(__file__).resolve().parents[1] / "xla_flags.py")
xla_flags = importlib.util.module_from_spec(SPEC)
SPEC.loader.exec_module(xla_flags)


def test_an_unknown_flag_is_dropped_and_the_known_ones_kept(capfd) -> None:
    kept = xla_flags.known_flags(["--xla_hlo_amp_no_such_flag=1",
                                  "--xla_backend_optimization_level=0"])
    assert kept == ["--xla_backend_optimization_level=0"]
    assert "--xla_hlo_amp_no_such_flag=1" in capfd.readouterr().err
