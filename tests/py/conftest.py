"""Shared pytest setup for tests/py. Keep it small: fixtures used by one file live there."""

from __future__ import annotations

import gc
import os
from collections.abc import Callable

import pytest

from hlo_amp.report import Decision


def _pin_xdist_worker_to_one_cpu() -> None:
    """With as many pytest-xdist workers as CPUs, worker i runs on CPU i only. XLA sizes
    its CPU thread pools from the CPUs a process may use, so each worker's XLA gets one
    thread instead of every worker's pool contending for every core (on 2 cores, with
    gpu_workloads built lazily: pytest 434 s -> 402 s, 5x fewer context switches).
    Runs before any test initialises a JAX backend; subprocesses inherit it."""
    worker = os.environ.get("PYTEST_XDIST_WORKER", "")
    count = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "0"))
    cpus = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
    if worker.startswith("gw") and count and count == len(cpus):
        os.sched_setaffinity(0, {cpus[int(worker[2:]) % len(cpus)]})


_pin_xdist_worker_to_one_cpu()

# A pytest worker holds every module it compiled and jax's caches: Python's collector,
# at its default thresholds (700, 10, 10), walked that heap often enough to be a tenth of
# the profile (py-spy). Collecting young objects 70 times less often: test_gpu_target,
# test_propagate and test_fused_attention in one process 107 -> 100 s of CPU, twice each.
gc.set_threshold(50_000, 20, 100)

# The slowest files, slowest first (their tests' wall time summed per file, in a
# `make test` run on a 2-core AMD EPYC, 2026-12-02; every file of 6 s or more). Under
# `make test` pytest-xdist hands whole files to its workers in collection order
# (--dist loadfile --no-loadscope-reorder), longest first here: a long file that started
# last would keep one worker busy after the other is done (test_sharding, 17 s and last
# alphabetically, ended one worker 16 s after the other).
SLOW_FILES_FIRST = ("test_demo_mixed.py", "test_crash_net.py", "test_partition_plan.py",
                    "test_propagate.py", "test_framework_steps.py", "test_gpu_target.py",
                    "test_tpu_target.py", "test_fp8_delayed.py", "test_fused_attention.py",
                    "test_memory_vs_hand_cast.py", "test_autopolicy_target.py",
                    "test_cli.py", "test_compile.py", "test_llm_benchmark.py",
                    "test_sharding.py", "test_transforms.py",
                    "test_partition_plan_properties.py", "test_module_scopes.py",
                    "test_fp8_fast_mode.py", "test_scaler.py", "test_fp8.py",
                    "test_third_party.py", "test_bad_input.py", "test_compile_cost.py",
                    "test_sharded_decoder.py", "test_multiprocess.py",
                    "test_policy_search.py", "test_mesh_targets.py", "test_mesh_fast_mode.py",
                    "test_comm_precision.py", "test_pass_cost.py", "test_fp8_differential.py")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """SLOW_FILES_FIRST to the front in that order; every other order kept."""
    rank = {name: index for index, name in enumerate(SLOW_FILES_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))


@pytest.fixture
def converted_decision() -> Callable[[str], Decision]:
    """A report decision at a location: a dot_general converted to bf16 operands."""

    def make(location: str) -> Decision:
        return Decision(function="main", op_kind="dot_general", scope="",
                        direction="forward", operands_before=("f32", "f32"),
                        operands_after=("bf16", "bf16"), result_before="f32",
                        result_after="f32", action="compute", rule="op:dot_general",
                        changed=True, reason="", flops=0, location=location)

    return make
