"""Compiling for a TPU on this CPU machine: XLA:TPU's verdicts on our rewrites.

The six train steps of tests/py/gpu_workloads.py are lowered with ``target="tpu-v5e"``
under the modes a TPU has matrix units for (bf16, mixed_bfloat16) and compiled by XLA:TPU
without a device (the ``tpu`` extra's libtpu). XLA:TPU emits every matrix op, dots
included, as a ``convolution``; the test parses the operand types of each one from the
optimized HLO, independently of ``kept_by_xla``. f16 and fp8 are refused on TPUs: XLA:TPU
compiles them (the HLO keeps the types), but no generation here has a matrix unit for them.
"""

from __future__ import annotations

import functools
import json
import re
import subprocess
import sys
from collections import Counter
from pathlib import Path

import jax
import jax.numpy as jnp
import pytest
from gpu_workloads import ABSTRACT_WORKLOADS as WORKLOADS

import hlo_amp
from hlo_amp import targets

POLICIES = ("bf16", "mixed_bfloat16")
HLO_AMP_OPT = str(Path(sys.executable).parent / "hlo-amp-opt")

# The reason of a dot the accurate mode leaves f32 on TPU (passes/insert_converts.py).
ONE_PASS = "kept f32: XLA:TPU rounds an f32 dot's operands to bf16 itself"
_DEF = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*(\w+)\[")
_CONV = re.compile(r"=\s*\w+\[[^\]]*\]\S*\s+convolution\(([^)]*)\)")
_JAX_OP = re.compile(r'op_name="(?:[^"]*/)?([^"/]*)"')


def matrix_ops(hlo: str) -> list[tuple[str, ...]]:
    """The operand element types of every convolution in XLA:TPU's optimized HLO (its
    form for dots and convolutions alike)."""
    return [types for types, _ in matrix_ops_by_jax_op(hlo)]


def matrix_ops_by_jax_op(hlo: str) -> list[tuple[tuple[str, ...], str]]:
    """(operand element types, the JAX op it came from: "dot_general", "conv_general_dilated"
    or, for a dot XLA transposed, "transpose") of every convolution in optimized HLO."""
    types = {m.group(1): m.group(2) for m in map(_DEF.match, hlo.splitlines()) if m}
    found = []
    for line in hlo.splitlines():
        match, op = _CONV.search(line), _JAX_OP.search(line)
        if match:
            found.append((tuple(types[o.strip().split()[-1].lstrip("%")]
                                for o in match.group(1).split(",")), op.group(1) if op else ""))
    return found


@functools.cache
def compiled(workload: str, policy: str) -> hlo_amp.AmpCompiled:
    step, args = WORKLOADS[workload]
    return hlo_amp.compile(step, policy).lower(*args, target="tpu-v5e").compile()


@pytest.mark.parametrize(("workload", "policy"), [(w, p) for w in WORKLOADS for p in POLICIES])
def test_v5e_verdicts_match_the_optimized_hlo(workload: str, policy: str) -> None:
    result = compiled(workload, policy)
    report = result.report()
    converted = [d for d in report.decisions if d.changed and d.low_precision]
    # The accurate mode leaves its f32 dots at DEFAULT precision f32: XLA:TPU rounds their
    # operands itself (Target.f32_dot_runs_as). It converts the convolutions; the fast
    # mode converts every matrix op.
    left = [d for d in report.decisions if d.reason.startswith(ONE_PASS)]
    assert (converted or left) and report.xla_device == "TPU v5e"
    assert len(converted) + len(left) == len(report.decisions)
    assert not left or policy == "bf16"
    assert "kept by XLA (TPU v5e, compiled without a device)" in report.summary()
    ops = matrix_ops_by_jax_op(result.as_text())
    # XLA:TPU keeps the accurate form (bf16 operands, f32 accumulation) for every
    # converted dot and convolution, forward and backward, and merges none of them: the
    # HLO has one matrix op per decided op, a bf16 one per converted op (XLA:TPU rounds
    # some of the f32 dots' operands in its HLO too), convolutions where JAX had them.
    assert all(d.kept_by_xla and d.xla_form == "XLA bf16×bf16" for d in converted)
    forms = Counter("×".join(types) for types, _ in ops)
    assert sum(forms.values()) == len(report.decisions), forms
    assert forms["bf16×bf16"] >= len(converted), forms
    assert (sum(op.startswith("conv") for _, op in ops)
            == sum(d.op_kind == "convolution" for d in converted))
    assert result.memory_analysis() is not None


def test_f32_on_tpu_is_partly_bf16_already_and_the_pass_converts_the_rest() -> None:
    """The baseline the verdicts are read against. XLA:TPU runs an f32 dot at DEFAULT
    precision as one bf16 pass, and its HLO shows some of them with bf16 operands already;
    others stay f32×f32. Under bf16 an f32 operand is left only to the dots the pass
    leaves f32 for XLA:TPU to round (``ONE_PASS``)."""
    step, args = WORKLOADS["vit"]
    f32 = matrix_ops(hlo_amp.compile(step, "f32").lower(*args, target="tpu-v5e")
                     .compile().as_text())
    bf16 = matrix_ops(compiled("vit", "bf16").as_text())
    left = [d for d in compiled("vit", "bf16").report().decisions
            if d.reason.startswith(ONE_PASS)]
    assert sum("f32" in types for types in f32) > 0
    assert sum(set(types) != {"bf16"} for types in bf16) <= len(left)
    assert sum(set(types) == {"bf16"} for types in bf16) > 0


@pytest.mark.parametrize("target", ["tpu-v4", "tpu-v5p", "tpu-v6e", "tpu-v5e:2x2"])
def test_every_generation_and_a_named_slice(target: str) -> None:
    step, args = WORKLOADS["mlp"]
    device = targets.device_target(target)
    report = hlo_amp.compile(step, "bf16").lower(*args, target=target).compile().report()
    assert report.xla_device == device.device and device.platform == "tpu"
    assert all(d.kept_by_xla for d in report.decisions if d.changed)
    assert device.topology.startswith(device.name.split("-", 1)[1].split(":")[0] + ":")


@pytest.mark.parametrize(("target", "policy", "dtype", "why"), [
    ("tpu-v5e", "f16", "float16", "XLA:TPU upcasts f16 dots"),
    ("tpu-v6e", "mixed_float16", "float16", "XLA:TPU upcasts f16 dots"),
    ("tpu-v5e", "fp8", "float8_e5m2", "e4m3fn operand .*TPU v5e's fp8 modes are e5m2 and e4m3b11"),
    ("tpu-v5p", "op:dot_general=float8_e4m3fn", "float8_e4m3fn", "TPU v5p's fp8 modes"),
    ("tpu-v4", "fp8", "float8_e5m2", "upcasts fp8 dots .*TPU v4 has no fp8 matrix unit"),
])
def test_f16_and_fp8_are_refused_with_the_reason(target: str, policy: str, dtype: str,
                                                 why: str) -> None:
    step, args = WORKLOADS["mlp"]
    with pytest.raises(ValueError, match=rf"cannot be compiled for {target}: it computes in "
                                         rf"{dtype}, and .*{why}.*; on TPU v\w+ use bf16, "
                                         r"mixed_bfloat16 or f32$"):
        hlo_amp.compile(step, policy).lower(*args, target=target)


@pytest.mark.parametrize(("policy", "dtype"), [("f16", "float16"),
                                             ("mixed_float16", "float16"),
                                             ("fp8", "float8_e5m2")])
def test_an_export_for_a_tpu_refuses_them_too(policy: str, dtype: str) -> None:
    """On a TPU, hlo_amp.compile rewrites a jax.export for "tpu" (the generation is not
    told): it took the f16 and fp8 policies a named TPU refuses (f16 dots XLA:TPU ran as
    f32 matrix-unit instructions), and among other platforms it still does."""
    step, args = WORKLOADS["mlp"]
    for platforms in (["tpu"], ["cpu", "tpu"], ["tpu", "cuda"]):
        with pytest.raises(ValueError, match=rf"cannot be compiled for tpu: it computes in "
                                             rf"{dtype}, and XLA:TPU upcasts.*; on a TPU use "
                                             r"bf16, mixed_bfloat16 or f32$"):
            jax.export.export(jax.jit(hlo_amp.compile(step, policy)),
                              platforms=platforms)(*args)


# Compiles one dot per operand-type pair for every generation with libtpu's LLO dump on
# (flags libtpu reads once, when it loads: hence a fresh process) and prints the operand
# type of the matrix-unit instructions XLA:TPU chose for each.
_MXU_PROBE = r"""
import json, os, re, sys
os.environ["LIBTPU_INIT_ARGS"] = f"--xla_jf_dump_to={sys.argv[1]} --xla_jf_dump_llo_text=true"
import jax, jax.numpy as jnp
from hlo_amp.runtime.deviceless import compile_for_target
from hlo_amp.targets import TPU_NAMES
found = {}
for target in TPU_NAMES:
    for pair in json.loads(sys.argv[2]):
        for name in os.listdir(sys.argv[1]):
            os.remove(os.path.join(sys.argv[1], name))
        a, b = (jax.ShapeDtypeStruct((256, 256), getattr(jnp, t)) for t in pair)
        compile_for_target(jax.jit(lambda x, y: jnp.dot(x, y, preferred_element_type=jnp.float32)),
                           a, b, target=target)
        llo = "".join(open(os.path.join(sys.argv[1], name)).read()
                      for name in os.listdir(sys.argv[1]) if "fusion" in name
                      and name.endswith("post-MXU-assigner.txt"))
        types = re.findall(r"\bvmatmul\.(?:mubr\.)?([a-z]+\d+\w*?)\.", llo)
        found[target + " " + "x".join(pair)] = [sorted(set(types)), len(types)]
print(json.dumps(found))
"""
_PAIRS = [("bfloat16", "bfloat16"), ("float32", "float32"), ("float16", "float16"),
          ("float8_e4m3fn", "float8_e4m3fn"), ("float8_e4m3fn", "float8_e5m2"),
          ("float8_e5m2", "float8_e5m2")]


def test_refusals_are_what_xla_tpu_runs_on_the_matrix_unit(tmp_path: Path) -> None:
    """The TPU target facts against libtpu's LLO, per generation: bf16 runs as bf16
    matrix-unit instructions; a refused dtype is one whose dots run as f32 instructions
    (f16; e4m3fn, the float8_e4m3fn action; e4m3fn with e5m2, the float8_e5m2 action's
    gradient dot); where the reason names fp8 modes, an e5m2 dot runs as fp8. An f32 dot
    at DEFAULT precision runs as many bf16 instructions as a bf16 one
    (``Target.f32_dot_runs_as``: insert_converts leaves some f32 there)."""
    proc = subprocess.run([sys.executable, "-c", _MXU_PROBE, str(tmp_path), json.dumps(_PAIRS)],
                          capture_output=True, text=True, check=False)
    assert proc.returncode == 0, proc.stderr[-2000:]
    runs = json.loads(proc.stdout.splitlines()[-1])
    for target in targets.TPU_NAMES:
        reasons = dict(targets.device_target(target).unsupported)
        device = targets.device_target(target)
        mxu = {pair: runs[f"{target} {pair}"][0] for pair in map("x".join, _PAIRS)}
        count = {pair: runs[f"{target} {pair}"][1] for pair in map("x".join, _PAIRS)}
        one_pass = mxu["float32xfloat32"] == ["bf16"] and (count["float32xfloat32"]
                                                         == count["bfloat16xbfloat16"])
        assert (device.f32_dot_runs_as("bfloat16") is not None) == one_pass, target
        assert mxu["bfloat16xbfloat16"] == ["bf16"], target
        assert ("float16" in reasons) == (mxu["float16xfloat16"] == ["f32"]), target
        assert ("float8_e4m3fn" in reasons) == (mxu["float8_e4m3fnxfloat8_e4m3fn"] == ["f32"])
        assert ("float8_e5m2" in reasons) == (mxu["float8_e4m3fnxfloat8_e5m2"] == ["f32"])
        fp8_modes = "fp8 modes are e5m2" in reasons.get("float8_e5m2", "")
        assert fp8_modes == (mxu["float8_e5m2xfloat8_e5m2"] == ["f8e5m2"]), target


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([HLO_AMP_OPT, *args], capture_output=True, text=True, check=False)


def test_cli_xla_target_tpu(tmp_path: Path) -> None:
    step, args = WORKLOADS["cnn"]
    module = tmp_path / "cnn.mlir"
    module.write_text(jax.jit(step).lower(*args).as_text(debug_info=True))
    report_path = tmp_path / "report.json"
    proc = _cli(str(module), "--policy", "bf16", "--xla-target", "tpu-v5e", "--report",
                str(report_path), "-o", str(tmp_path / "out.mlir"))
    assert proc.returncode == 0, proc.stderr
    report = json.loads(report_path.read_text())
    assert report["xla_device"] == "TPU v5e"
    verdicts = {(d["op_kind"], d["kept_by_xla"]) for d in report["decisions"] if d["changed"]}
    assert ("convolution", True) in verdicts
    assert verdicts <= {("dot_general", True), ("convolution", True)}
    # Each dot left f32 says why (XLA:TPU rounds its operands itself).
    assert all(d["reason"].startswith(ONE_PASS) for d in report["decisions"]
               if not d["changed"])
    proc = _cli(str(module), "--policy", "fp8", "--xla-target", "tpu-v5e")
    assert proc.returncode == 1 and len(proc.stderr.splitlines()) == 1
    assert "TPU v5e's fp8 modes are e5m2 and e4m3b11fnuz" in proc.stderr


def test_unknown_tpu_names_what_is_accepted() -> None:
    f = hlo_amp.compile(lambda a: a @ a, "bf16")
    with pytest.raises(ValueError, match=r"tpu-v4, tpu-v5e, tpu-v5p, tpu-v6e"):
        f.lower(jnp.ones((8, 8)), target="tpu-v9")
    # A slice libtpu does not describe ("not divisible by ... chips_per_host_bounds"):
    # the rule, and one that works.
    with pytest.raises(ValueError, match=r"'tpu-v5e:9x9' is 81 chips: a tpu-v5e slice is "
                                         r"AxB chips with A and B even.*e\.g\. tpu-v5e:2x2"):
        f.lower(jnp.ones((8, 8)), target="tpu-v5e:9x9")


def test_aot_estimate_reads_tpu_matrix_ops_and_the_variants_skip_fp8() -> None:
    """benchmarks --device tpu-v5e-aot: a dot XLA:TPU emits as a convolution counts its
    2·M·N·K FLOPs in its operands' class; no fp8 or XLA:GPU-flag variant is compiled."""
    from benchmarks.workloads import variants
    from hlo_amp import compile_for_target
    from hlo_amp.targets.roofline import estimate

    def f(a: jax.Array, b: jax.Array) -> jax.Array:
        return jnp.tanh(jnp.dot(a.astype(jnp.bfloat16), b.astype(jnp.bfloat16),
                                preferred_element_type=jnp.float32))

    compiled_dot = compile_for_target(jax.jit(f), jnp.ones((256, 512)), jnp.ones((512, 128)),
                                      target="tpu-v5e")
    found = estimate(compiled_dot.as_text(), "tpu-v5e")
    assert found.matrix_flops == 2 * 256 * 512 * 128 and found.share_16bit == 1.0
    assert found.device == "TPU v5e" and found.roofline_seconds > 0
    chosen = variants("tpu-v5e-aot")
    assert "hlo_amp fp8" not in chosen and "hlo_amp mixed_bfloat16" in chosen
    assert not any("XLA bf16 dot algorithm" in v for v in chosen)


def test_aot_estimate_counts_batched_dots_and_loops_as_xla_tpu_writes_them() -> None:
    """XLA:TPU writes a batched dot as a convolution whose batch is a window over an input
    dilated by as much (one real product per window): its FLOPs are 2·B·M·N·K, not the
    window's size times that; and its loops carry no known_trip_count: the trip count is
    read from the condition (``i < 12``, i from a constant 0)."""
    from hlo_amp import compile_for_target
    from hlo_amp.targets.roofline import estimate

    def attention(q: jax.Array, k: jax.Array) -> jax.Array:
        return jnp.einsum("bhqd,bhkd->bhqk", q.astype(jnp.bfloat16), k.astype(jnp.bfloat16),
                          preferred_element_type=jnp.float32)

    q = jax.ShapeDtypeStruct((8, 4, 17, 64), jnp.float32)
    hlo = compile_for_target(jax.jit(attention), q, q, target="tpu-v5e").as_text()
    assert "lhs_dilate" in hlo  # the form this test is about
    assert estimate(hlo, "tpu-v5e").matrix_flops == 2 * 8 * 4 * 17 * 17 * 64

    w = jnp.ones((128, 128), jnp.bfloat16)

    def scan(h: jax.Array, xs: jax.Array) -> jax.Array:
        def cell(h, x):
            h = jnp.tanh(jnp.dot(h.astype(jnp.bfloat16), w, preferred_element_type=jnp.float32)
                         + x)
            return h, h
        return jax.lax.scan(cell, h, xs)[1]

    hlo = compile_for_target(jax.jit(scan), jnp.ones((16, 128)), jnp.ones((12, 16, 128)),
                             target="tpu-v5e").as_text()
    assert "known_trip_count" not in hlo
    found = estimate(hlo, "tpu-v5e")
    assert found.matrix_flops == 12 * 2 * 16 * 128 * 128 and found.unknown_trip_counts == 0


def _roofline_against_xla(target: str, precision: str = "default") -> tuple[float, float]:
    """(the roofline's seconds, XLA:TPU's own optimal_seconds) of a 2048^3 f32 dot
    compiled for ``target``."""
    from hlo_amp import compile_for_target
    from hlo_amp.targets.roofline import estimate

    a = jax.ShapeDtypeStruct((2048, 2048), jnp.float32)
    compiled = compile_for_target(
        jax.jit(lambda w, x: jnp.dot(x, w, precision=precision)), a, a, target=target)
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, list) else cost
    return estimate(compiled.as_text(), target).roofline_seconds, cost["optimal_seconds"]


def test_a_v4_device_is_priced_as_the_tensorcore_xla_compiles_for() -> None:
    """libtpu's v4 devices are single TensorCores, two per chip: priced at the whole
    chip's peak, a v4 roofline was 0.41x XLA:TPU's own estimate where v5e's is 0.84x."""
    v4, v4_xla = _roofline_against_xla("tpu-v4")
    v5e, v5e_xla = _roofline_against_xla("tpu-v5e")
    assert 0.75 < (v4 / v4_xla) / (v5e / v5e_xla) < 1.33, (v4 / v4_xla, v5e / v5e_xla)


def test_high_and_highest_f32_dots_take_their_bf16_passes() -> None:
    """XLA:TPU runs an f32 dot at HIGH in 3 bf16 passes and at HIGHEST in 6: they were
    priced as one (DEFAULT's), so bf16 saved only bytes in the model."""
    default, _ = _roofline_against_xla("tpu-v5e")
    high, _ = _roofline_against_xla("tpu-v5e", "high")
    highest, _ = _roofline_against_xla("tpu-v5e", "highest")
    assert 2 * default < high < highest and 5 * default < highest
    # Per-operand precisions: XLA:TPU runs (DEFAULT, HIGHEST) and (HIGHEST, DEFAULT) as
    # HIGH (libtpu's LLO); the first operand's alone priced them 1 and 6 passes.
    mixed = [_roofline_against_xla("tpu-v5e", order)[0] for order in (
        (jax.lax.Precision.DEFAULT, jax.lax.Precision.HIGHEST),
        (jax.lax.Precision.HIGHEST, jax.lax.Precision.DEFAULT))]
    assert mixed == [high, high], (mixed, high)
