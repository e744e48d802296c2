"""lit configuration: FileCheck tests of ``hlo-amp-opt`` output (``lit -v tests/lit``)."""

import os
import sys
from pathlib import Path

import lit.formats

# `config` is defined by lit when it executes this file.
config.name = "hlo_amp"  # noqa: F821
# lit's internal shell: lit 23 refuses ShTest(execute_external=True) unless forced,
# and the RUN lines need nothing beyond pipes, && and redirection.
config.test_format = lit.formats.ShTest(execute_external=False)  # noqa: F821
config.suffixes = [".mlir"]  # noqa: F821
config.excludes = ["inputs", "lit.cfg.py", "Output"]  # noqa: F821
config.test_source_root = os.path.dirname(__file__)  # noqa: F821

# lit scrubs the environment. hlo-amp-opt and filecheck live next to the interpreter
# that runs lit (.venv/bin), so put that directory first on PATH.
config.environment["PATH"] = os.pathsep.join(  # noqa: F821
    [str(Path(sys.executable).parent), os.environ.get("PATH", "")]
)
