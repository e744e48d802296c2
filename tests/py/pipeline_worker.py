"""The crash net's worker: the pass pipeline run in a child process, so that a crash of a
pass (a segfault in the MLIR bindings) fails one test instead of killing pytest.

``PipelineWorker`` starts ``python tests/py/pipeline_worker.py`` once and sends it
modules; the child runs ``run_pipeline`` for every target form and mode asked and
answers, per run, ``ok`` or the error. When the child dies, the answer says which run
it was in, with its exit signal and the Python stack ``faulthandler`` printed, and the
next module gets a fresh child.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field

TARGETS = (None, "cpu", "gpu", "tpu")  # the pipeline's target forms (docs/design.md)
MODES = ("bf16", "f16", "mixed_bfloat16", "mixed_float16", "fp8")
SEGFAULT = "<segfault>"  # a module text that makes the child crash (the net's own test)


@dataclass
class Outcome:
    """What the child said of one module: per (target, mode) ``ok`` or an error line;
    ``crash`` describes how it died, in which run, when it did."""

    results: dict[tuple[str | None, str], str] = field(default_factory=dict)
    crash: str | None = None

    def failures(self) -> list[str]:
        found = [f"target={t} mode={m}: {r}" for (t, m), r in self.results.items() if r != "ok"]
        return found + ([self.crash] if self.crash else [])


class PipelineWorker:
    """A child process that runs the pass pipeline on the modules it is sent."""

    def __init__(self) -> None:
        self._child: subprocess.Popen | None = None
        self._stderr = None

    def _start(self) -> subprocess.Popen:
        if self._child is None or self._child.poll() is not None:
            self._stderr = tempfile.TemporaryFile()  # noqa: SIM115 - the child's, kept
            env = dict(os.environ, PYTHONFAULTHANDLER="1")
            self._child = subprocess.Popen(
                [sys.executable, os.path.abspath(__file__)], stdin=subprocess.PIPE,
                stdout=subprocess.PIPE, stderr=self._stderr, env=env, text=True)
        return self._child

    def run(self, text: str, targets=TARGETS, modes=MODES) -> Outcome:
        child = self._start()
        child.stdin.write(json.dumps({"text": text, "targets": list(targets),
                                      "modes": list(modes)}) + "\n")
        child.stdin.flush()
        outcome, current = Outcome(), None
        for line in child.stdout:
            kind, _, rest = line.rstrip("\n").partition(" ")
            if kind == "begin":
                current = tuple(json.loads(rest))
            elif kind == "end":
                outcome.results[current] = json.loads(rest)
                current = None
            elif kind == "done":
                return outcome
        code = child.wait()
        reason = (f"killed by {signal.Signals(-code).name}" if code < 0
                  else f"exited with {code}")
        self._stderr.seek(0)
        tail = self._stderr.read().decode(errors="replace").splitlines()[-25:]
        where = "between runs" if current is None else f"in target={current[0]} mode={current[1]}"
        outcome.crash = f"the pipeline's process {reason} {where}:\n" + "\n".join(tail)
        return outcome

    def close(self) -> None:
        if self._child is not None and self._child.poll() is None:
            self._child.stdin.close()
            self._child.wait()


def _serve() -> None:
    import warnings

    warnings.simplefilter("ignore")
    from hlo_amp.ir.modules import parse_module
    from hlo_amp.passes import run_pipeline
    from hlo_amp.policy import Policy

    for line in sys.stdin:
        request = json.loads(line)
        for target in request["targets"]:
            for mode in request["modes"]:
                print("begin", json.dumps([target, mode]), flush=True)
                if request["text"] == SEGFAULT:
                    import ctypes

                    ctypes.string_at(0)
                try:
                    run_pipeline(parse_module(request["text"]), Policy.parse(mode),
                                 target=target)
                    answer = "ok"
                except Exception as error:  # noqa: BLE001 - reported to the test
                    answer = f"{type(error).__name__}: {error}".splitlines()[0]
                print("end", json.dumps(answer), flush=True)
        print("done", flush=True)


if __name__ == "__main__":
    _serve()
