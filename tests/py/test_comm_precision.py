"""Communication precision (passes/comm_precision.py) on sharded programs.

The sharded checks run in a subprocess (``--xla_force_host_platform_device_count`` must
be set before jax is imported) that prints JSON. Collective bytes are read from XLA's
optimized HLO for 8 H100s compiled without the devices: XLA:CPU upcasts every bf16
collective to f32 (a hand-cast bf16 program gathers f32 there too), so its HLO cannot
show the precision. Numerics run on 8 CPU host devices.
"""

from __future__ import annotations

import re
import textwrap

import jax
import jax.numpy as jnp
import pytest
from host_devices import run_on_host_devices
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import hlo_amp
from hlo_amp.policy import Policy

SCRIPT = textwrap.dedent("""
    import json, re
    import jax, jax.numpy as jnp, numpy as np
    from jax.experimental import topologies
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
    import hlo_amp
    from hlo_amp.policy import as_policy
    from hlo_amp.runtime.compile import rewrite_lowered
    from hlo_amp.targets.gpu import DEVICELESS_GPU_OPTIONS, gpu_device

    H100 = gpu_device("h100")
    topology = topologies.get_topology_desc(platform="cuda", target_config=H100.target_config,
                                            topology="1x1x8")
    BYTES = {"f32": 4, "bf16": 2}
    COLLECTIVE = re.compile(r"= (.*?) (all-gather|all-reduce|reduce-scatter)(-start)?\\(")

    def collectives(text):
        out = []
        for line in text.splitlines():
            m = COLLECTIVE.search(line)
            if m:
                shapes = re.findall(r"(bf16|f32)\\[([0-9,]*)\\]", m.group(1))
                if m.group(3) and m.group(2) == "all-gather":
                    shapes = shapes[len(shapes) // 2:]  # (operands, results): the results
                for dtype, dims in shapes:
                    size = int(np.prod([int(d) for d in dims.split(",") if d]))
                    out.append((m.group(2), dtype, size * BYTES[dtype]))
        return out

    def h100x8(fn, args, policy):
        lowered = jax.jit(fn).lower(*args)
        original = lowered
        if policy is not None:
            lowered, _, _ = rewrite_lowered(lowered, as_policy(policy), H100)
        return original, lowered, lowered.compile(DEVICELESS_GPU_OPTIONS)

    results = {}
    # ---- sequence-parallel attention: K, V sequence-sharded, constrained to replicated
    mesh = topologies.make_mesh(topology, (8,), ("seq",))

    def rope(x):
        n = x.shape[-1] // 2
        pos = jnp.arange(x.shape[0], dtype=jnp.float32)[:, None]
        angle = pos / (10000.0 ** (jnp.arange(n, dtype=jnp.float32) / n))
        c, s = jnp.cos(angle), jnp.sin(angle)
        return jnp.concatenate([x[:, :n] * c - x[:, n:] * s, x[:, :n] * s + x[:, n:] * c], -1)

    def attention(x, wq, wk, wv):
        q, k, v = rope(x @ wq), rope(x @ wk), x @ wv
        replicated = NamedSharding(mesh, P())
        k = jax.lax.with_sharding_constraint(k, replicated)
        v = jax.lax.with_sharding_constraint(v, replicated)
        return jax.nn.softmax(q @ k.T / 8.0, -1) @ v

    x = jax.ShapeDtypeStruct((512, 64), jnp.float32, sharding=NamedSharding(mesh, P("seq")))
    w = jax.ShapeDtypeStruct((64, 64), jnp.float32, sharding=NamedSharding(mesh, P()))
    for policy in ("bf16", "mixed_bfloat16"):
        original, lowered, compiled = h100x8(attention, (x, w, w, w), policy)
        text = lowered.as_text()
        results[policy + "/constraints"] = re.findall(
            r"sdy.sharding_constraint .* : tensor<512x64x(\\w+)>", text)
        results[policy + "/original_constraints"] = re.findall(
            r"sdy.sharding_constraint .* : tensor<512x64x(\\w+)>", original.as_text())
        results[policy + "/all_gathers"] = [c for c in collectives(compiled.as_text())
                                            if c[0] == "all-gather"]
        results[policy + "/out"] = [str(lowered.out_info.dtype), str(lowered.out_info.shape),
                                    str(original.out_info.dtype), str(original.out_info.shape)]
        results[policy + "/out_sharding"] = [str(compiled.output_shardings),
                                             str(jax.jit(attention).lower(x, w, w, w).compile(
                                                 DEVICELESS_GPU_OPTIONS).output_shardings)]

    # ---- data-parallel MLP train step: gradient all-reduce bytes
    def loss_fn(params, x, y):
        h = jnp.tanh(x @ params["w1"])
        return jnp.mean((h @ params["w2"] - y) ** 2)

    def grads(params, x, y):
        return jax.grad(loss_fn)(params, x, y)

    shapes = {"w1": (64, 128), "w2": (128, 32)}
    data = topologies.make_mesh(topology, (8,), ("data",))
    rep, batch = NamedSharding(data, P()), NamedSharding(data, P("data"))
    args = ({k: jax.ShapeDtypeStruct(s, jnp.float32, sharding=rep) for k, s in shapes.items()},
            jax.ShapeDtypeStruct((256, 64), jnp.float32, sharding=batch),
            jax.ShapeDtypeStruct((256, 32), jnp.float32, sharding=batch))
    for policy in (None, "bf16", "bf16,reduce=bfloat16", "mixed_bfloat16,reduce=float32"):
        _, lowered, compiled = h100x8(grads, args, policy)
        results[f"{policy}/reductions"] = [c for c in collectives(compiled.as_text())
                                           if c[0] != "all-gather"]
        results[f"{policy}/grad_dtypes"] = [str(a.dtype) for a in
                                            jax.tree.leaves(lowered.out_info)]

    # ---- numerics on 8 CPU host devices
    cpu = Mesh(np.array(jax.devices("cpu")), ("data",))
    keys = jax.random.split(jax.random.key(0), 4)
    params = {k: jax.device_put(jax.random.normal(key, s) / np.sqrt(s[0]),
                                NamedSharding(cpu, P()))
              for (k, s), key in zip(shapes.items(), keys)}
    xs = jax.device_put(jax.random.normal(keys[2], (256, 64)), NamedSharding(cpu, P("data")))
    ys = jax.device_put(jax.random.normal(keys[3], (256, 32)), NamedSharding(cpu, P("data")))
    reference = jax.jit(grads)(params, xs, ys)
    for policy in ("mixed_bfloat16,reduce=bfloat16",):
        decisions = hlo_amp.compile(grads, policy).lower(params, xs, ys).report().decisions
        results[f"{policy}/result_notes"] = [[d.result_after, list(d.notes)] for d in decisions]
    for policy in ("bf16", "bf16,reduce=bfloat16"):
        amp = hlo_amp.compile(grads, policy)
        out = amp(params, xs, ys)
        results[f"{policy}/relative_error"] = {
            k: float(jnp.linalg.norm(out[k] - reference[k]) / jnp.linalg.norm(reference[k]))
            for k in out}
        results[f"{policy}/sharding_equivalent"] = all(
            out[k].sharding.is_equivalent_to(reference[k].sharding, 2) for k in out)
        results[f"{policy}/notes"] = [n for n in amp.lower(params, xs, ys).report().notes
                                      if n.startswith("comm-precision")]
    results["devices"] = jax.device_count()
    print("RESULTS=" + json.dumps(results))
""")


@pytest.fixture(scope="module")
def results() -> dict:
    return run_on_host_devices(SCRIPT)


@pytest.mark.parametrize("policy", ["bf16", "mixed_bfloat16"])
def test_constraint_moves_bf16(results: dict, policy: str) -> None:
    # JAX wrote both constraints on f32 values; the pass moves K's and V's converts
    # before them, so what the partitioner gathers there is bf16.
    assert results[f"{policy}/original_constraints"] == ["f32", "f32"]
    assert results[f"{policy}/constraints"] == ["bf16", "bf16"]
    gathers = results[f"{policy}/all_gathers"]
    assert gathers and all(dtype == "bf16" for _, dtype, _ in gathers), gathers


@pytest.mark.parametrize("policy", ["bf16", "mixed_bfloat16"])
def test_signature_and_shardings_kept(results: dict, policy: str) -> None:
    dtype, shape, original_dtype, original_shape = results[f"{policy}/out"]
    assert (dtype, shape) == (original_dtype, original_shape)
    rewritten, jit = results[f"{policy}/out_sharding"]
    assert rewritten == jit


def _bytes(results: dict, policy: str | None) -> int:
    # The scalar loss is not reduced here (grads only); count every reduction.
    return sum(size for _, _, size in results[f"{policy}/reductions"])


def test_reduce_bfloat16_halves_gradient_reductions(results: dict) -> None:
    f32, default = _bytes(results, None), _bytes(results, "bf16")
    reduced = _bytes(results, "bf16,reduce=bfloat16")
    assert f32 > 0 and default == f32  # the accurate mode reduces in f32, as jax.jit
    assert all(dtype == "f32" for _, dtype, _ in results["bf16/reductions"])
    assert all(dtype == "bf16" for _, dtype, _ in results["bf16,reduce=bfloat16/reductions"])
    assert 2 * reduced == default
    # The fast mode with reduce=float32 keeps the f32 reductions.
    assert _bytes(results, "mixed_bfloat16,reduce=float32") == f32
    # The gradients the function returns stay f32 whatever crosses devices.
    for policy in (None, "bf16", "bf16,reduce=bfloat16", "mixed_bfloat16,reduce=float32"):
        assert results[f"{policy}/grad_dtypes"] == ["float32", "float32"]


def test_gradients_match_f32(results: dict) -> None:
    assert results["devices"] == 8
    for policy in ("bf16", "bf16,reduce=bfloat16"):
        errors = results[f"{policy}/relative_error"]
        assert max(errors.values()) < 2e-2, (policy, errors)
        assert results[f"{policy}/sharding_equivalent"]
    assert not results["bf16/notes"] or "return" not in results["bf16/notes"][0]
    assert "2 dot(s)" in results["bf16,reduce=bfloat16/notes"][0]


def test_a_dot_retyped_for_reduce_says_why(results: dict) -> None:
    """On CPU the fast mode keeps matrix-op results f32: a bf16 result there is reduce='s
    (the note blamed the fast mode, and under bf16 no note said why)."""
    notes = results["mixed_bfloat16,reduce=bfloat16/result_notes"]
    retyped = [n for result, n in notes if result == "bf16"]
    assert retyped and all(
        n == ["result stored as bf16: reduce= sums it across devices in bf16"] for n in retyped)
    assert all(result == "f32" for result, n in notes if not n)


def test_reduce_in_the_policy_grammar() -> None:
    policy = Policy.parse("bf16,reduce=bf16")
    assert policy.reduce == "bfloat16"
    assert Policy.parse(policy.to_string()) == policy
    assert Policy.from_dict(policy.to_dict()) == policy
    assert "reduce=bfloat16" in policy.to_string()
    assert Policy.parse("mixed_bfloat16,reduce=float32").reduce == "float32"
    assert Policy.parse("bf16").reduce is None
    assert "reduce" not in Policy.parse("bf16").to_string()
    with pytest.raises(ValueError, match=r"Unsupported reduce 'float16'; accepted: float32, "
                                         r"bfloat16"):
        Policy.parse("bf16,reduce=float16")
    with pytest.raises(ValueError, match=r"Unsupported reduce 'int8'"):
        Policy(reduce="int8")


def _weight_gradient_sums(fn, args, policy: str) -> tuple[list[str], str]:
    """The element types of the all-reduces of arrays (not an fp8 amax's scalar) XLA
    compiles ``jax.grad(fn)`` with, for 8 H100s without a device, and the report's
    summary."""
    compiled = hlo_amp.compile(jax.grad(fn), policy).lower(*args, target="h100x8").compile()
    sums = re.findall(r"= (\w+)\[[\d,]+\]\S* all-reduce(?:-start)?\(", compiled.as_text())
    return sums, compiled.report().summary()


def test_reduce_reaches_the_gradients_after_a_lookup_and_fp8_gemms() -> None:
    """reduce= sums every data-parallel weight gradient in its type: after an embedding
    lookup (a gather: its batch-sharded result was read as unsharded, and no gradient
    after it counted as summed) and under fp8 (an fp8 GEMM's result was never retyped,
    and the fp8 pass's clamp to the format's range hid the batch sharding from every
    later dot: 3 of 4 sums kept the other type)."""
    mesh = hlo_amp.target_mesh("h100x8", {"data": 8})
    replicated, batch = NamedSharding(mesh, P()), NamedSharding(mesh, P("data"))
    table = jax.ShapeDtypeStruct((1024, 256), jnp.float32, sharding=replicated)
    weight = jax.ShapeDtypeStruct((256, 256), jnp.float32, sharding=replicated)
    ids = jax.ShapeDtypeStruct((64, 32), jnp.int32, sharding=batch)

    def after_lookup(w, table, ids):
        return jnp.mean((table[ids] @ w) ** 2)

    sums, _ = _weight_gradient_sums(after_lookup, (weight, table, ids), "bf16,reduce=bfloat16")
    assert sums == ["bf16"], sums

    def mlp(ws, x):
        for w in ws:
            x = jnp.tanh(x @ w)
        return jnp.mean(x ** 2)

    x = jax.ShapeDtypeStruct((1024, 256), jnp.float32, sharding=batch)
    for policy, wanted in (("fp8,reduce=float32", "f32"),
                           ("fp8,propagate=false,reduce=bfloat16", "bf16")):
        sums, summary = _weight_gradient_sums(mlp, ([weight] * 4, x), policy)
        assert sums and set(sums) == {wanted}, (policy, sums)
        assert "fp8 GEMMs kept by XLA: 6/6" in summary, summary


def test_reduce_under_an_outer_partitioned_jit_warns() -> None:
    """jax.jit(compiled, in_shardings=...) exports the compiled function for one device
    and partitions it after the rewrite: reduce= never reached the all-reduces, silently
    (XLA's gradient all-reduce stayed f32 where the report of the step compiled whole
    says bf16)."""
    mesh = hlo_amp.target_mesh("h100x2", {"data": 2})
    batch, replicated = NamedSharding(mesh, P("data")), NamedSharding(mesh, P())
    w = jax.ShapeDtypeStruct((64, 64), jnp.float32, sharding=replicated)
    x = jax.ShapeDtypeStruct((16, 64), jnp.float32, sharding=batch)

    def step(w, x):
        return w - 0.1 * jax.grad(lambda w: jnp.sum(jnp.tanh(x @ w) ** 2))(w)

    outer = jax.jit(hlo_amp.compile(step, "bf16,reduce=bfloat16"),
                    in_shardings=(replicated, batch))
    with pytest.warns(UserWarning, match=r"partitioned over 2 devices.*reduce=bfloat16 does "
                                         r"not reach them"):
        outer.trace(w, x).lower(lowering_platforms=("cuda",))
