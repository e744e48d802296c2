"""The collectives of a compiled step (hlo_amp/targets/collectives.py), in the report and
in the roofline's time.

The sharded steps compile on 8 host devices (and for 8 H100s without a device), which
``--xla_force_host_platform_device_count`` must give before jax is imported: they run
in one subprocess that prints JSON. The parsers also read hand-written HLO in XLA:GPU's
async form, XLA:TPU's fused form and with loops. Expected bytes come from the shapes.
"""

from __future__ import annotations

import dataclasses
import json
import textwrap

import pytest
from host_devices import run_on_host_devices

from hlo_amp.report import Report
from hlo_amp.targets import device_target
from hlo_amp.targets.collectives import group_size, link_factor, read_collectives
from hlo_amp.targets.roofline import estimate

D, FSDP, TP, LAYERS = 256, 2, 4, 3

SCRIPT = textwrap.dedent(f"""
import dataclasses, json
import jax, jax.numpy as jnp, numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
import hlo_amp

D, FSDP, TP, LAYERS = {D}, {FSDP}, {TP}, {LAYERS}

def loss(params, x, y):
    h = x
    for i, w in enumerate(params):
        with jax.named_scope(f"layer{{i}}"):
            h = jnp.tanh(h @ w)
    return jnp.mean((h - y) ** 2)

def step(params, x, y):
    grads = jax.grad(loss)(params, x, y)
    return [w - 0.1 * g for w, g in zip(params, grads)]

def records(report):
    return [dataclasses.asdict(c) for c in report.collectives]

results = {{}}
mesh = Mesh(np.array(jax.devices()).reshape(FSDP, TP), ("fsdp", "tp"))
weights = NamedSharding(mesh, P("fsdp", "tp"))
rows = NamedSharding(mesh, P("fsdp", None))
params = [jax.device_put(jnp.full((D, D), 0.01, jnp.float32), weights) for _ in range(LAYERS)]
x = jax.device_put(jnp.ones((64, D)), rows)
amp_step = hlo_amp.compile(step, "bf16")
report = amp_step.lower(params, x, x).compile().report()
results["cpu"] = records(report)
from hlo_amp.targets.collectives import Collective
results["cpu_json"] = json.loads(report.to_json())["collectives"]
results["cpu_round_trip"] = [Collective.from_dict(c) for c in results["cpu_json"]] == (
    report.collectives)
results["cpu_summary"] = report.summary()
results["cpu_text"] = str(report)

single = [jnp.full((D, D), 0.01, jnp.float32) for _ in range(LAYERS)]
unsharded = hlo_amp.compile(step, "bf16").lower(single, jnp.ones((64, D)),
                                                  jnp.ones((64, D))).compile().report()
results["unsharded"] = records(unsharded)
results["unsharded_text"] = str(unsharded)

# XLA:GPU for 8 H100s, no device: XLA:CPU moves 16-bit collectives in f32, XLA:GPU does not.
from jax.experimental import topologies
from hlo_amp.runtime.compile import AmpCompiled, rewrite_lowered
from hlo_amp.targets import device_target
h100 = dataclasses.replace(device_target("h100"), devices=8, link_bytes_per_second=450e9)
topology = topologies.get_topology_desc(platform="cuda", target_config=h100.target_config,
                                        topology="1x1x8")
gpu_mesh = topologies.make_mesh(topology, (FSDP, TP), ("fsdp", "tp"))
abstract = [jax.ShapeDtypeStruct((D, D), jnp.float32,
                                 sharding=NamedSharding(gpu_mesh, P("fsdp", "tp")))
            for _ in range(LAYERS)]
gx = jax.ShapeDtypeStruct((64, D), jnp.float32, sharding=NamedSharding(gpu_mesh, P("fsdp")))
lowered = jax.jit(step).trace(abstract, gx, gx).lower(lowering_platforms=("cuda",))
rewritten, pass_report, seconds = rewrite_lowered(lowered, amp_step.policy, h100)
gpu = AmpCompiled(rewritten.compile(h100.compiler_options), pass_report, seconds, h100, h100)
results["gpu"] = records(gpu.report())
plain = AmpCompiled(lowered.compile(h100.compiler_options), Report(), 0.0, h100, h100)
results["gpu_f32"] = records(plain.report())
print("RESULTS=" + json.dumps(results))
""").replace("Report()", "hlo_amp.Report()")


@pytest.fixture(scope="module")
def results() -> dict:
    return run_on_host_devices(SCRIPT, timeout=240)


# What each argument of the step an all-gather moves over the fsdp axis assembles on every
# device (elements), and the scope that reads it: a weight's full rows and its tp shard of
# the columns; the input's whole batch (jax 0.11.2's XLA:CPU gathers x for layer0's weight
# gradient, where jax 0.10.2's exchanges it all-to-all).
GATHERED = {f"params[{i}]": (D * (D // TP), f"layer{i}") for i in range(LAYERS)}
GATHERED["x"] = (64 * D, "layer0")


def _argument_gathers(found: list[dict], width: int) -> list[dict]:
    """The all-gathers of the step's arguments, each checked against the shapes, in
    ``width`` bytes an element (a combined gather holds several), and the scopes that
    read them; every weight is gathered."""
    gathers = [c for c in found if c["kind"] == "all-gather" and c["parameters"]]
    for c in gathers:
        assert c["group_size"] == FSDP, c
        assert set(c["parameters"]) <= set(GATHERED), c
        assert c["bytes"] == sum(GATHERED[p][0] for p in c["parameters"]) * width, c
        assert set(c["scopes"]) >= {GATHERED[p][1] for p in c["parameters"]}, c
    moved = {p for c in gathers for p in c["parameters"]}
    assert moved >= {f"params[{i}]" for i in range(LAYERS)}, gathers
    return gathers


def test_sharded_step_on_cpu_devices(results) -> None:
    found = results["cpu"]
    kinds = {c["kind"] for c in found}
    assert {"all-gather", "all-reduce"} <= kinds, kinds
    # XLA:CPU has no 16-bit collectives: it moves the bf16 weights as f32.
    _argument_gathers(found, 4)
    for c in found:
        assert c["count"] == 1 and c["bytes"] > 0 and c["name"]


def test_report_json_and_summary(results) -> None:
    found = results["cpu"]
    assert results["cpu_json"] == json.loads(json.dumps(found))
    assert results["cpu_round_trip"]  # Collective.from_dict of the JSON: equal records
    total = sum(c["count"] for c in found)
    assert f"collectives: {total} per step" in results["cpu_summary"]
    assert "0% of bytes in 16-bit" in results["cpu_summary"]  # f32 on XLA:CPU, see above
    assert "collectives per kind" in results["cpu_text"]


def test_no_collectives_without_sharding(results) -> None:
    assert results["unsharded"] == []
    assert "collectives" not in results["unsharded_text"]


def test_gpu_gathers_the_weights_hlo_amp_cast(results) -> None:
    amp = [c for c in results["gpu"] if c["kind"] == "all-gather"]
    f32 = [c for c in results["gpu_f32"] if c["kind"] == "all-gather"]
    assert amp and all(c["element_types"] == ["bf16"] and
                       c["bytes_16bit"] == c["bytes"] for c in amp)
    assert f32 and all(c["element_types"] == ["f32"] and c["bytes_16bit"] == 0 for c in f32)
    _argument_gathers(results["gpu"], 2)
    _argument_gathers(results["gpu_f32"], 4)
    # Every gather of the step (weights and activations) moves half the bytes in bf16.
    assert 2 * sum(c["bytes"] * c["count"] for c in amp) == sum(
        c["bytes"] * c["count"] for c in f32)


GPU_ASYNC = """\
HloModule gpu_step

%add (x: f32[], y: f32[]) -> f32[] {
  %x = f32[] parameter(0)
  %y = f32[] parameter(1)
  ROOT %sum = f32[] add(%x, %y)
}

ENTRY %main (w: bf16[128,64], v: bf16[64,32], g: f32[64,128]) -> (bf16[256,64], f32[64,128]) {
  %w = bf16[128,64]{1,0} parameter(0), metadata={op_name="w"}
  %v = bf16[64,32]{1,0} parameter(1), metadata={op_name="v"}
  %g = f32[64,128]{1,0} parameter(2), metadata={op_name="g"}
  %cast = bf16[128,64]{1,0} fusion(%w), kind=kLoop, calls=%add
  %ag-start = ((bf16[128,64]{1,0}, bf16[64,32]{1,0}), (bf16[256,64]{1,0}, bf16[128,32]{1,0})) all-gather-start(%cast, %v), channel_id=1, replica_groups=[4,2]<=[8], dimensions={0}, use_global_device_ids=true, metadata={op_name="jit(step)/(jvp(mlp/up)/dot_general:jvp(mlp/down)/dot_general)" source_file="/src/model.py" source_line=12}
  %ag-done = (bf16[256,64]{1,0}, bf16[128,32]{1,0}) all-gather-done(%ag-start)
  %ar-start = f32[64,128]{1,0} all-reduce-start(%g), channel_id=2, replica_groups={{0,1,2,3,4,5,6,7}}, use_global_device_ids=true, to_apply=%add, metadata={op_name="jit(step)/transpose(jvp(mlp/up))/dot_general"}
  %ar-done = f32[64,128]{1,0} all-reduce-done(%ar-start)
  %cp-start = (f32[64,128]{1,0}, f32[64,128]{1,0}) collective-permute-start(%ar-done), channel_id=3, source_target_pairs={{0,1},{1,0}}
  %cp-done = f32[64,128]{1,0} collective-permute-done(%cp-start)
  %gte = bf16[256,64]{1,0} get-tuple-element(%ag-done), index=0
  ROOT %out = (bf16[256,64]{1,0}, f32[64,128]{1,0}) tuple(%gte, %cp-done)
}
"""


def test_gpu_async_forms() -> None:
    gather, reduce, permute = read_collectives(GPU_ASYNC)
    assert gather.kind == "all-gather" and gather.element_types == ("bf16",)
    assert gather.bytes == (256 * 64 + 128 * 32) * 2 == gather.bytes_16bit  # results
    assert gather.group_size == 2 and gather.count == 1
    assert gather.scopes == ("mlp/up", "mlp/down")
    assert gather.parameters == ("w", "v") and gather.source == "/src/model.py:12"
    assert (reduce.kind, reduce.bytes, reduce.group_size) == ("all-reduce", 64 * 128 * 4, 8)
    assert reduce.scopes == ("mlp/up",) and reduce.parameters == ("g",)
    assert (permute.kind, permute.bytes, permute.group_size) == (
        "collective-permute", 64 * 128 * 4, None)


# A combined gather of two f32 weights whose op_name names no scope (none, or its arguments':
# jax 0.11.2's XLA:GPU wrote no scope for the f32 step's weight gather), read by two dots,
# one through a fusion without metadata.
UNSCOPED = """\
HloModule gpu_step

%widen (p: f32[128,32]) -> f32[128,32] {
  %p = f32[128,32]{1,0} parameter(0)
  ROOT %n = f32[128,32]{1,0} negate(%p)
}

ENTRY %main (w: f32[128,64], v: f32[64,32], x: f32[16,256]) -> (f32[16,64], f32[16,32]) {
  %w = f32[128,64]{1,0} parameter(0), metadata={op_name="w"}
  %v = f32[64,32]{1,0} parameter(1), metadata={op_name="v"}
  %x = f32[16,256]{1,0} parameter(2), metadata={op_name="x"}
  %ag-start = ((f32[128,64]{1,0}, f32[64,32]{1,0}), (f32[256,64]{1,0}, f32[128,32]{1,0})) all-gather-start(%w, %v), channel_id=1, replica_groups=[4,2]<=[8], dimensions={0}, use_global_device_ids=true%META
  %ag-done = (f32[256,64]{1,0}, f32[128,32]{1,0}) all-gather-done(%ag-start)%META
  %gw = f32[256,64]{1,0} get-tuple-element(%ag-done), index=0%META
  %gv = f32[128,32]{1,0} get-tuple-element(%ag-done), index=1%META
  %up = f32[16,64]{1,0} custom-call(%x, %gw), custom_call_target="__cublas$gemm", metadata={op_name="jit(step)/jvp(mlp/up)/dot_general"}
  %h = f32[16,128]{1,0} slice(%x), slice={[0:16], [0:128]}
  %fv = f32[128,32]{1,0} fusion(%gv), kind=kLoop, calls=%widen
  %down = f32[16,32]{1,0} custom-call(%h, %fv), custom_call_target="__cublas$gemm", metadata={op_name="jit(step)/transpose(jvp(mlp/down))/dot_general"}
  ROOT %out = (f32[16,64]{1,0}, f32[16,32]{1,0}) tuple(%up, %down)
}
"""


@pytest.mark.parametrize("metadata", ["", ', metadata={op_name="(w:v)"}',
                                      ', metadata={op_name="jit(step)"}'],
                         ids=["none", "arguments", "no_scope"])
def test_a_collective_without_scopes_has_its_readers(metadata: str) -> None:
    (gather,) = read_collectives(UNSCOPED.replace("%META", metadata))
    assert gather.scopes == ("mlp/up", "mlp/down")
    assert gather.parameters == ("w", "v") and gather.bytes == (256 * 64 + 128 * 32) * 4


# XLA:GPU's gradient reduce-scatter (as for an FSDP step on h100x8): no metadata, read by
# the optimizer's unscoped update; its operands come from the backward dots' results.
GRADIENT_SCATTER = """\
HloModule gpu_step

ENTRY %main (x: f32[16,1024], d: f32[16,512], w: f32[256,512]) -> f32[256,512] {
  %x = f32[16,1024]{1,0} parameter(0), metadata={op_name="x"}
  %d = f32[16,512]{1,0} parameter(1), metadata={op_name="d"}
  %w = f32[256,512]{1,0} parameter(2), metadata={op_name="w"}
  %dw = (f32[1024,512]{1,0}, s8[4]{0}) custom-call(%x, %d), custom_call_target="__cublas$gemm", metadata={op_name="jit(step)/transpose(jvp(layer1))/dot_general"}
  %g = f32[1024,512]{1,0} get-tuple-element(%dw), index=0
  %g2 = f32[1024,512]{1,0} copy(%g)
  %rs-start = ((f32[1024,512]{1,0}), f32[256,512]{1,0}) reduce-scatter-start(%g2), channel_id=9, replica_groups=[2,4]<=[4,2]T(1,0), use_global_device_ids=true, dimensions={0}, to_apply=%add, metadata={scheduling_name="rs"}
  %rs-done = f32[256,512]{1,0} reduce-scatter-done(%rs-start)
  ROOT %new = f32[256,512]{1,0} subtract(%w, %rs-done), metadata={op_name="jit(step)/sub"}
}
"""


def test_a_collective_without_scoped_readers_has_its_producers_scopes() -> None:
    """Its scopes were empty (a reduce-scatter on h100x8: 'scopes': [])."""
    (scatter,) = read_collectives(GRADIENT_SCATTER)
    assert scatter.kind == "reduce-scatter" and scatter.scopes == ("layer1",)
    assert scatter.bytes == 1024 * 512 * 4


def test_collectives_sharing_a_channel_id_each_count() -> None:
    """XLA:GPU numbers a shard_map's collectives all ``channel_id=1``: two equal gathers
    at the top level are two collectives (only XLA:TPU's fused copies count once)."""
    lines = GPU_ASYNC.splitlines()
    gather = [ln for ln in lines if "%ag-" in ln.split("=")[0]]
    again = [ln.replace("%ag-", "%ag2-") for ln in gather]
    at = lines.index(gather[-1]) + 1
    twice = "\n".join(lines[:at] + again + lines[at:])
    found = read_collectives(twice)
    assert [c.name for c in found if c.kind == "all-gather"] == ["ag-start", "ag2-start"]


TPU_FUSED = """\
HloModule tpu_step

%start_part (p0: bf16[32,64]) -> bf16[64,64] {
  %p0 = bf16[32,64]{1,0:T(8,128)(2,1)} parameter(0)
  ROOT %all-gather.1 = bf16[64,64]{1,0:T(8,128)(2,1)} all-gather(%p0), channel_id=7, replica_groups=mesh['axis_0'=2,'axis_1'=4] {'axis_0'}, dimensions={0}, use_global_device_ids=true, metadata={op_name="jit(step)/while/body/closed_call/jvp(attn)/dot_general"}
}

%done_part (p1: bf16[32,64]) -> bf16[64,64] {
  %p1 = bf16[32,64]{1,0:T(8,128)(2,1)} parameter(0)
  ROOT %all-gather.2 = bf16[64,64]{1,0:T(8,128)(2,1)} all-gather(%p1), channel_id=7, replica_groups=mesh['axis_0'=2,'axis_1'=4] {'axis_0'}, dimensions={0}, use_global_device_ids=true, metadata={op_name="jit(step)/while/body/closed_call/jvp(attn)/dot_general"}
}

%body (loop: (s32[], bf16[32,64], f32[16,16])) -> (s32[], bf16[32,64], f32[16,16]) {
  %loop = (s32[], bf16[32,64]{1,0}, f32[16,16]{1,0}) parameter(0)
  %i = s32[] get-tuple-element(%loop), index=0
  %h = bf16[32,64]{1,0} get-tuple-element(%loop), index=1
  %s = f32[16,16]{1,0} get-tuple-element(%loop), index=2
  %one = s32[] constant(1)
  %next = s32[] add(%i, %one)
  %started = bf16[64,64]{1,0} fusion(%h), kind=kCustom, calls=%start_part
  %finished = bf16[64,64]{1,0} fusion(%h), kind=kCustom, calls=%done_part
  %cp = (f32[16,16]{1,0}, f32[16,16]{1,0}, u32[]{:S(2)}, u32[]{:S(2)}) collective-permute-start(%s), channel_id=8, source_target_pairs={{0,1},{1,2},{2,3},{3,0}}
  %cp-done = f32[16,16]{1,0} collective-permute-done(%cp)
  %all-reduce.3 = (f32[16,16]{1,0}, bf16[32,64]{1,0}) all-reduce(%cp-done, %h), channel_id=9, replica_groups={}, to_apply=%sum
  ROOT %t = (s32[], bf16[32,64]{1,0}, f32[16,16]{1,0}) tuple(%next, %h, %cp-done)
}

%cond (c: (s32[], bf16[32,64], f32[16,16])) -> pred[] {
  %c = (s32[], bf16[32,64]{1,0}, f32[16,16]{1,0}) parameter(0)
  %ci = s32[] get-tuple-element(%c), index=0
  %limit = s32[] constant(5)
  ROOT %lt = pred[] compare(%ci, %limit), direction=LT
}

ENTRY %main (h0: bf16[32,64], s0: f32[16,16]) -> (s32[], bf16[32,64], f32[16,16]) {
  %h0 = bf16[32,64]{1,0} parameter(0)
  %s0 = f32[16,16]{1,0} parameter(1)
  %zero = s32[] constant(0)
  %init = (s32[], bf16[32,64]{1,0}, f32[16,16]{1,0}) tuple(%zero, %h0, %s0)
  ROOT %w = (s32[], bf16[32,64]{1,0}, f32[16,16]{1,0}) while(%init), condition=%cond, body=%body
}
"""


def test_tpu_fused_forms_and_a_loop_read_from_its_condition() -> None:
    found = read_collectives(TPU_FUSED)
    assert [c.kind for c in found] == ["all-gather", "collective-permute", "all-reduce"]
    gather, permute, reduce = found
    assert all(c.count == 5 for c in found)  # i < 5 from 0, no known_trip_count (TPU)
    # One all-gather written into two fusions under one channel_id counts once.
    assert (gather.bytes, gather.group_size, gather.scopes) == (64 * 64 * 2, 2, ("attn",))
    assert permute.bytes == 16 * 16 * 4 and permute.element_types == ("f32",)  # no contexts
    assert reduce.bytes == 16 * 16 * 4 + 32 * 64 * 2 and reduce.bytes_16bit == 32 * 64 * 2
    assert reduce.group_size is None and reduce.element_types == ("f32", "bf16")


GPU_LOOP = GPU_ASYNC.replace(
    "ENTRY %main (w: bf16[128,64], v: bf16[64,32], g: f32[64,128])",
    "%body (w: bf16[128,64], v: bf16[64,32], g: f32[64,128])") + """
%cond (c: (bf16[128,64], bf16[64,32], f32[64,128])) -> pred[] {
  ROOT %t = pred[] constant(true)
}

ENTRY %outer (a: bf16[128,64], b: bf16[64,32], c: f32[64,128]) -> f32[64,128] {
  %a = bf16[128,64]{1,0} parameter(0)
  %b = bf16[64,32]{1,0} parameter(1)
  %c = f32[64,128]{1,0} parameter(2)
  %init = (bf16[128,64]{1,0}, bf16[64,32]{1,0}, f32[64,128]{1,0}) tuple(%a, %b, %c)
  %loop = (bf16[256,64]{1,0}, f32[64,128]{1,0}) while(%init), condition=%cond, body=%body, backend_config={"known_trip_count":{"n":"6"}}
  ROOT %r = f32[64,128]{1,0} get-tuple-element(%loop), index=1
}
"""


def test_loop_counts_and_parameters_inside_a_loop() -> None:
    found = read_collectives(GPU_LOOP)
    assert [c.count for c in found] == [6, 6, 6]
    # Inside the body, "w" is the body's parameter, not an argument of the step.
    assert all(c.parameters == () for c in found)


def test_group_size_spellings() -> None:
    assert group_size("replica_groups={{0,2},{1,3}}, dimensions={0}") == 2
    assert group_size("replica_groups=[2,4]<=[8], to_apply=%add") == 4
    assert group_size("replica_groups=mesh['a'=2,'b'=2,'c'=2] {'a','c'}, x=1") == 4
    assert group_size("replica_groups=mesh['axis_0'=4,'axis_1'=2], device_ids=([2,4]T(1,0))"
                      " {'axis_0'}, dimensions={0}") == 4
    assert group_size("replica_groups={}, to_apply=%add") is None


def test_roofline_adds_collective_time() -> None:
    link = 450e9
    h100x8 = dataclasses.replace(device_target("h100"), devices=8, link_bytes_per_second=link)
    found = read_collectives(GPU_LOOP)
    expected = sum(c.count * c.bytes * factor for c, factor in zip(
        found, (1 / 2, 2 * 7 / 8, 1.0))) / link  # groups of 2, of 8, a permute
    priced = estimate(GPU_LOOP, h100x8)
    assert priced.collective_seconds == pytest.approx(expected)
    assert priced.roofline_seconds == pytest.approx(priced.kernel_seconds + expected)
    assert priced.collective_bytes == sum(c.bytes * c.count for c in found)
    # A device without a published link bandwidth (a user's GpuTargetConfig file).
    unpriced = estimate(GPU_LOOP, dataclasses.replace(h100x8, link_bytes_per_second=None))
    assert unpriced.collective_seconds == 0.0 and unpriced.unpriced_collectives == 18
    assert unpriced.kernel_seconds == pytest.approx(priced.kernel_seconds)


def test_roofline_without_collectives_is_the_kernels_time() -> None:
    h100x8 = dataclasses.replace(device_target("h100"), devices=8, link_bytes_per_second=450e9)
    plain = GPU_ASYNC.split("ENTRY")[0] + """ENTRY %main (a: f32[64,128]) -> f32[64,128] {
  %a = f32[64,128]{1,0} parameter(0)
  ROOT %n = f32[64,128]{1,0} negate(%a)
}
"""
    result = estimate(plain, h100x8)
    assert result.collectives == [] and result.collective_seconds == 0.0
    assert result.roofline_seconds == result.kernel_seconds > 0


def test_link_factors_of_the_ring() -> None:
    assert link_factor("all-reduce", 4) == 1.5
    assert link_factor("all-gather", 4) == link_factor("reduce-scatter", 4) == 0.75
    assert link_factor("all-to-all", 8) == 7 / 8
    assert link_factor("collective-permute", 8) == 1.0
    assert link_factor("all-reduce", 1) == 0.0


def test_report_summary_clause() -> None:
    report = Report(policy="bf16")
    assert "collectives" not in report.summary() and "collectives" not in str(report)
    report.collectives = read_collectives(GPU_ASYNC)
    low = (256 * 64 + 128 * 32) * 2  # the bf16 all-gather's results
    total = low + 2 * 64 * 128 * 4  # and an f32 all-reduce and permute
    share = round(100 * low / total)
    assert report.summary().endswith(
        f"; collectives: 3 per step, {total / 2 ** 20:.2g} MiB per device, {share}% of "
        f"bytes in 16-bit")
    assert "  all-gather: 1, " in str(report)


def test_an_async_collective_is_one_hbm_kernel() -> None:
    """Its start reads the operands and writes the results (its tuple repeats the
    operands, not written again); its done launches nothing."""
    kernels = {k.name: k for k in estimate(GPU_ASYNC, "h100").kernels}
    assert not {"ag-done", "ar-done", "cp-done"} & set(kernels)
    operands, results = (128 * 64 + 64 * 32) * 2, (256 * 64 + 128 * 32) * 2
    assert kernels["ag-start"].bytes == operands + results
    assert kernels["ar-start"].bytes == kernels["cp-start"].bytes == 2 * 64 * 128 * 4
