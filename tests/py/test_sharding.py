"""hlo_amp.compile on 8 host devices: shardings kept, results match one device.

``--xla_force_host_platform_device_count`` must be set before jax is imported, and
pytest has imported jax already, so the checks run in a subprocess that prints JSON.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import numpy as np
import pytest
from host_devices import host_devices_env

SCRIPT = textwrap.dedent("""
    import json
    import jax, jax.numpy as jnp, numpy as np, optax
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
    import hlo_amp

    results = {"devices": jax.device_count()}
    mesh = Mesh(np.array(jax.devices()).reshape(4, 2), ("data", "model"))

    def rand(key, shape, scale=1.0):
        return scale * jax.random.normal(jax.random.key(key), shape, jnp.float32)

    params = {"w1": rand(1, (8, 16), 8 ** -0.5), "w2": rand(2, (16, 4), 16 ** -0.5)}
    x, y = rand(3, (8, 8)), rand(4, (8, 4))

    def loss_fn(params, x, y):
        hidden = jnp.tanh(x @ params["w1"])
        return jnp.mean((hidden @ params["w2"] - y) ** 2)

    opt = optax.sgd(0.1)

    def step(params, opt_state, x, y):
        loss, grads = jax.value_and_grad(loss_fn)(params, x, y)
        updates, opt_state = opt.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    # single device reference (uncommitted arrays)
    ref_params, _, ref_loss = hlo_amp.compile(step, "bf16")(params, opt.init(params), x, y)

    p_shard = {"w1": NamedSharding(mesh, P(None, "model")),
               "w2": NamedSharding(mesh, P("model", None))}
    s_params = jax.device_put(params, p_shard)
    s_x = jax.device_put(x, NamedSharding(mesh, P("data")))
    s_y = jax.device_put(y, NamedSharding(mesh, P("data")))
    s_state = opt.init(s_params)

    amp = hlo_amp.compile(step, "bf16")
    out_params, _, loss = amp(s_params, s_state, s_x, s_y)
    jit_params, _, jit_loss = jax.jit(step)(s_params, s_state, s_x, s_y)

    results["sharding_equivalent"] = {
        k: out_params[k].sharding.is_equivalent_to(jit_params[k].sharding, 2)
        for k in out_params}
    results["sharding_spec"] = {k: str(out_params[k].sharding.spec) for k in out_params}
    results["jit_sharding_spec"] = {k: str(jit_params[k].sharding.spec) for k in jit_params}
    results["loss_sharding_equivalent"] = loss.sharding.is_equivalent_to(jit_loss.sharding, 0)
    results["n_devices_used"] = len(out_params["w1"].sharding.device_set)
    results["loss"] = float(loss)
    results["ref_loss"] = float(ref_loss)
    results["max_err"] = {k: float(jnp.max(jnp.abs(out_params[k] - ref_params[k])))
                          for k in out_params}
    results["scale"] = {k: float(jnp.max(jnp.abs(ref_params[k]))) for k in out_params}

    lowered = amp.lower(s_params, s_state, s_x, s_y)
    text, original = lowered.as_text(), lowered.original_text()
    # Annotations, not the sdy.sharding_constraint ops keep-shardings may add.
    for marker in ("sdy.sharding =", "mhlo.sharding =", "sdy.mesh"):
        results[marker] = [text.count(marker), original.count(marker)]
    # XLA:CPU's bf16 dot needs a layout the CPU pass relays to, except in a partitioned
    # program, where that dot is computed in f32 (its report note says so).
    results["all_low"] = all(d.low_precision or any(n.startswith("dot computed from f32")
                                                    for n in d.notes)
                             for d in lowered.report().decisions)
    results["n_low"] = sum(d.low_precision for d in lowered.report().decisions)
    results["n_decisions"] = len(lowered.report().decisions)

    # the fast mode on the same sharded step
    amp_mixed = hlo_amp.compile(step, "mixed_bfloat16")
    mixed_params, _, mixed_loss = amp_mixed(s_params, s_state, s_x, s_y)
    results["mixed_sharding_equivalent"] = {
        k: mixed_params[k].sharding.is_equivalent_to(jit_params[k].sharding, 2)
        for k in mixed_params}
    results["mixed_loss_sharding_equivalent"] = mixed_loss.sharding.is_equivalent_to(
        jit_loss.sharding, 0)
    results["mixed_max_err"] = {k: float(jnp.max(jnp.abs(mixed_params[k] - ref_params[k])))
                                for k in mixed_params}
    mixed_lowered = amp_mixed.lower(s_params, s_state, s_x, s_y)
    for marker in ("sdy.sharding =", "mhlo.sharding =", "sdy.mesh"):
        results["mixed_" + marker] = mixed_lowered.as_text().count(marker)
    rows = mixed_lowered.report().propagation["functions"]
    results["mixed_low_bytes"] = sum(r["low_bytes_after"] for r in rows)

    # shard_map body
    def local(xb, w):
        return jax.lax.psum(xb @ w, "model")

    def sm(x, w):
        return jax.shard_map(local, mesh=mesh, in_specs=(P("data", "model"), P("model", None)),
                             out_specs=P("data", None))(x, w)

    w = rand(5, (8, 4), 8 ** -0.5)
    amp_sm = hlo_amp.compile(sm, "bf16")
    sm_report = amp_sm.lower(x, w).report()
    results["shard_map_decisions"] = [
        [d.op_kind, d.low_precision, d.changed] for d in sm_report.decisions]
    sm_out = amp_sm(x, w)
    results["shard_map_err"] = float(jnp.max(jnp.abs(sm_out - x @ w)))
    results["shard_map_scale"] = float(jnp.max(jnp.abs(x @ w)))
    results["shard_map_text_bf16"] = "bf16" in amp_sm.lower(x, w).as_text()
    # The scopes around a shard_map, its backward pass and amp_stop reach the ops in
    # its body (jax names them from the body alone).
    def scoped(w, x):
        with jax.named_scope("sm"):
            return jnp.sum(sm(x, w) ** 2)

    def stopped(w, x):
        with hlo_amp.amp_stop():
            return sm(x, w)

    grad = jax.grad(scoped)
    # jax.grad of the compiled function: on uncommitted arrays outside jax.set_mesh, jax
    # refuses the program exported for the mesh's devices (named after its own
    # _forward_with_residuals); hlo_amp says what to do, and doing it works.
    amp_scoped = hlo_amp.compile(scoped, "bf16")
    try:
        jax.grad(amp_scoped)(w, x)
        results["shard_map_grad_refusal"] = None
    except ValueError as error:
        results["shard_map_grad_refusal"] = str(error)
    with jax.set_mesh(mesh):
        results["shard_map_grad_err"] = float(jnp.max(jnp.abs(
            jax.grad(amp_scoped)(w, x) - jax.grad(scoped)(w, x))))
    results["shard_map_rules"] = {
        policy: [[d.scope, d.direction, d.rule, d.low_precision]
                 for d in hlo_amp.compile(fn, policy).lower(w, x).report().decisions]
        for fn, policy in ((grad, "bf16,backward=keep"), (grad, "bf16,scope:sm=keep"),
                           (stopped, "bf16"))}

    # The fast mode paints the activations inside a shard_map body too.
    def chain(xb, w):
        return jnp.tanh((jnp.tanh(xb @ w) * 2.0 + 1.0) @ w)

    def sm_chain(x, w):
        return jax.shard_map(chain, mesh=mesh, in_specs=(P("data"), P()),
                             out_specs=P("data"))(x, w)

    xc, wc = rand(6, (16, 8)), rand(7, (8, 8), 8 ** -0.5)
    mixed_sm = hlo_amp.compile(sm_chain, "mixed_bfloat16")
    text = mixed_sm.lower(xc, wc).as_text()
    inside = text[text.index("sdy.manual_computation"):]
    results["shard_map_mixed_tanh"] = [
        "bf16" in line for line in inside.splitlines() if "stablehlo.tanh" in line]
    want = jax.jit(sm_chain)(xc, wc)
    results["shard_map_mixed_err"] = float(jnp.max(jnp.abs(mixed_sm(xc, wc) - want)))

    # An Explicit mesh (jax.make_mesh's default): the types carry shardings, which
    # shard_map checks its in_specs against and jax.typeof reads at trace time.
    emesh = jax.make_mesh((4, 2), ("data", "model"))
    traced_specs = []

    def body(h):
        return jax.lax.psum(jnp.sum(h ** 2), ("data", "model"))

    def e_loss(p, x):
        h = jnp.tanh(x @ p["w1"])
        traced_specs.append(str(jax.typeof(h).sharding.spec))
        # No mesh=: the context's (jax.set_mesh), which a compile for a target moves
        # onto the target's devices.
        summed = jax.shard_map(body, in_specs=P("data", "model"), out_specs=P())
        return summed(h) / h.size + jnp.mean(h @ p["w2"])

    def e_step(p, x):
        loss, grads = jax.value_and_grad(e_loss)(p, x)
        return jax.tree.map(lambda a, g: a - 0.1 * g, p, grads), loss

    try:  # a failure here is this test's, not the fixture's
        with jax.set_mesh(emesh):
            e_params = jax.device_put(params, {"w1": NamedSharding(emesh, P(None, "model")),
                                               "w2": NamedSharding(emesh, P())})
            e_x = jax.device_put(x, NamedSharding(emesh, P("data")))
            e_jit, e_jit_loss = jax.jit(e_step)(e_params, e_x)
            jit_specs = list(traced_specs)
            del traced_specs[:]
            e_amp, e_amp_loss = hlo_amp.compile(e_step, "mixed_bfloat16")(e_params, e_x)
            results["explicit_specs"] = [jit_specs, sorted(set(traced_specs))]
            results["explicit_loss"] = [float(e_jit_loss), float(e_amp_loss)]
            results["explicit_sharding_equivalent"] = [
                e_amp[k].sharding.is_equivalent_to(e_jit[k].sharding, 2) for k in e_amp]
            results["explicit_types"] = [str(jax.typeof(e_amp["w1"])), str(jax.typeof(e_jit["w1"]))]
            # Compiled for 8 H100s without them, under the host mesh's jax.set_mesh.
            on_gpus = hlo_amp.compile(e_step, "mixed_bfloat16").lower(
                e_params, e_x, target="h100x8").compile()
            def padded(sharding, ndim):
                return [str(a) for a in tuple(sharding.spec) + (None,) * (ndim - len(sharding.spec))]

            outs = jax.tree.leaves((e_jit, e_jit_loss))
            results["explicit_target_specs"] = [
                [padded(s, o.ndim) for s, o in zip(
                    jax.tree.leaves(on_gpus.jax_compiled.output_shardings), outs)],
                [padded(o.sharding, o.ndim) for o in outs]]
    except Exception as error:  # noqa: BLE001
        results["explicit_error"] = f"{type(error).__name__}: {str(error)[:300]}"
    print("RESULTS=" + json.dumps(results))
""")


@pytest.fixture(scope="module")
def results() -> dict:
    proc = subprocess.run([sys.executable, "-c", SCRIPT], env=host_devices_env(8), capture_output=True, check=False,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    line = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULTS=")]
    assert line, proc.stdout[-2000:] + proc.stderr[-2000:]
    return json.loads(line[-1].removeprefix("RESULTS="))


def test_eight_devices(results):
    assert results["devices"] == 8
    assert results["n_devices_used"] == 8


def test_output_shardings_like_jax_jit(results):
    assert results["sharding_equivalent"] == {"w1": True, "w2": True}, (
        results["sharding_spec"], results["jit_sharding_spec"])
    assert results["loss_sharding_equivalent"]
    assert results["sharding_spec"]["w1"] == results["jit_sharding_spec"]["w1"]


def test_sharded_matches_single_device(results):
    for k, err in results["max_err"].items():
        assert err <= 1e-2 * results["scale"][k], (k, err)
    assert abs(results["loss"] - results["ref_loss"]) <= 1.6e-2 * abs(results["ref_loss"])


def test_rewritten_module_keeps_sharding_annotations(results):
    present = False
    for marker in ("sdy.sharding =", "mhlo.sharding =", "sdy.mesh"):
        rewritten, original = results[marker]
        assert rewritten == original, marker
        present = present or original > 0
    assert present
    assert results["n_decisions"] >= 5 and results["all_low"] and results["n_low"] >= 2


def test_shard_map_body_rewritten(results):
    decisions = results["shard_map_decisions"]
    assert decisions, "no dot found inside the shard_map body"
    assert all(kind == "dot_general" and low and changed for kind, low, changed in decisions)
    assert results["shard_map_text_bf16"]
    assert results["shard_map_err"] <= 1e-2 * results["shard_map_scale"] + 1e-6
    # mixed_bfloat16: the first tanh (read by a dot) is 16-bit inside the body; the
    # last, the body's result, keeps the program's f32
    assert results["shard_map_mixed_tanh"] == [True, False]
    assert results["shard_map_mixed_err"] <= 2e-2


def test_the_gradient_of_a_compiled_shard_map_names_its_devices(results):
    assert results["shard_map_grad_refusal"].startswith(
        "hlo_amp.compile(scoped) runs on 8 devices (a shard_map's mesh) and is called "
        "under a transformation")
    assert "jax.set_mesh(mesh)" in results["shard_map_grad_refusal"]
    assert results["shard_map_grad_err"] < 0.05


def test_rules_reach_into_a_shard_map_body(results):
    """Scope rules, backward= and amp_stop around a shard_map apply to the ops in its
    body: each op was at top level, forward, rule op:dot_general, bf16 (and the rules
    "matched no op")."""
    rules = results["shard_map_rules"]
    backward = rules["bf16,backward=keep"]
    assert sorted(r[:3] for r in backward) == [
        ["sm", "backward", "backward"], ["sm", "forward", "op:dot_general"]]
    assert [r[3] for r in sorted(backward)] == [False, True]
    assert rules["bf16,scope:sm=keep"] == [["sm", d, "scope:sm", False]
                                           for d in ("forward", "backward")]
    assert rules["bf16"] == [["amp_stop", "forward", "amp_stop", False]]


def test_mixed_mode_keeps_shardings_and_paints(results):
    assert results["mixed_sharding_equivalent"] == {"w1": True, "w2": True}
    assert results["mixed_loss_sharding_equivalent"]
    for marker in ("sdy.sharding =", "mhlo.sharding =", "sdy.mesh"):
        assert results["mixed_" + marker] == results[marker][1], marker
    for k, err in results["mixed_max_err"].items():
        assert err <= 1.6e-2 * results["scale"][k], (k, err)
    assert results["mixed_low_bytes"] > 0  # the tanh between the dots is 16-bit


def test_explicit_mesh_types_are_traced_with_their_shardings(results):
    """On jax.make_mesh's default Explicit axes the function is traced with the argument
    types' shardings, as jax.jit traces it: a shard_map's in_specs match them (they did
    not: the trace saw unsharded types and shard_map refused), jax.typeof reads the same
    sharding, and the outputs keep jax.jit's shardings, also compiled for h100x8 under
    the host mesh's jax.set_mesh."""
    assert "explicit_error" not in results, results["explicit_error"]
    jit_specs, amp_specs = results["explicit_specs"]
    assert jit_specs and amp_specs == sorted(set(jit_specs)) == ["P('data', 'model')"]
    jit_loss, amp_loss = results["explicit_loss"]
    assert abs(amp_loss - jit_loss) <= 2e-2 * abs(jit_loss)
    assert results["explicit_sharding_equivalent"] == [True, True]
    assert results["explicit_types"][0] == results["explicit_types"][1]
    # The same step compiles for h100x8 under the host mesh's jax.set_mesh (the trace
    # failed: "context mesh ... platform=cpu should match the aval mesh").
    on_target, on_host = results["explicit_target_specs"]
    assert on_target == on_host and ["None", "model"] in on_host


CALL_SEES_SHARDINGS = textwrap.dedent("""
    import json
    import jax, jax.numpy as jnp, numpy as np
    from jax.sharding import NamedSharding, PartitionSpec as P
    import hlo_amp

    mesh = jax.make_mesh((4, 2), ("data", "model"), axis_types=(jax.sharding.AxisType.Auto,) * 2)
    put = lambda x, spec: jax.device_put(x, NamedSharding(mesh, spec))
    results = {}

    # A label pick's gradient read by a dot: its output's sharding is not constrained.
    def pick(h, w, labels):
        grad = jax.grad(lambda lg: jnp.sum(jnp.take_along_axis(lg, labels[..., None], -1)))(h @ w)
        return grad, grad @ w.T

    labels = put(jax.random.randint(jax.random.key(4), (8, 4), 0, 32), P("model"))
    h = put(jax.random.normal(jax.random.key(5), (8, 4, 16)), P())
    w = put(jax.random.normal(jax.random.key(6), (16, 32)), P(None, "data"))
    expected = jax.jit(pick)(h, w, labels)
    got = hlo_amp.compile(pick, "mixed_bfloat16")(h, w, labels)
    results["pick_shardings"] = [g.sharding.is_equivalent_to(e.sharding, e.ndim)
                                 for g, e in zip(got, expected)]

    # A data-parallel weight gradient under reduce=bfloat16: the call runs the program
    # .lower() reports, bit for bit.
    def grad_w(w, x):
        return jax.grad(lambda w: jnp.mean(jnp.tanh(x @ w) ** 2))(w)

    x = put(jax.random.normal(jax.random.key(1), (64, 16)), P("data"))
    w = put(jax.random.normal(jax.random.key(2), (16, 8)) * 0.3, P())
    step = hlo_amp.compile(grad_w, "bf16,reduce=bfloat16")
    called, lowered = step(w, x), step.lower(w, x).compile()(w, x)
    results["same_as_lowered"] = bool(np.array_equal(np.asarray(called), np.asarray(lowered)))
    results["reduced_dots"] = [line.split("->")[-1].strip() for line in
                               step.lower(w, x).as_text().splitlines()
                               if "dot_general" in line and "8x16" in line.split("->")[-1]]

    # As many executables as jax.jit holds for the same calls (a refused trace of the
    # dispatch, for sharded arguments, was counted as one).
    amp, jitted, sizes = hlo_amp.compile(grad_w, "bf16"), jax.jit(grad_w), []
    w1 = jnp.ones((16, 8))
    for args in ((w1, jnp.ones((64, 16))), (w, x), (w, x), (w1, x)):
        amp(*args), jitted(*args)
        sizes.append([amp.cache_size(), jitted._cache_size()])
    results["cache_sizes"] = sizes
    print("RESULTS=" + json.dumps(results))
""")


def test_a_call_with_sharded_arrays_sees_their_shardings() -> None:
    """A call with arrays sharded outside an Explicit mesh rewrites the program jax.jit
    lowers for them, as ``.lower()`` does. It exported their types alone, a one-device
    program: the passes that read shardings did not run (``reduce=``, the label pick's
    sharding), and the call computed another program than the report described."""
    from host_devices import run_on_host_devices

    results = run_on_host_devices(CALL_SEES_SHARDINGS)
    assert all(ours == jits for ours, jits in results["cache_sizes"]), results["cache_sizes"]
    assert results["pick_shardings"] == [True, True]
    assert results["reduced_dots"] == ["tensor<8x16xbf16>"], results["reduced_dots"]
    assert results["same_as_lowered"]


AUTO_AXES_GRAD = textwrap.dedent("""
    import json
    import jax, jax.numpy as jnp, numpy as np
    from jax.sharding import PartitionSpec as P, auto_axes
    import hlo_amp

    mesh = jax.make_mesh((4, 2), ("data", "model"))  # Explicit axes
    results = {}

    def layer(w, x):
        return auto_axes(lambda a, b: jnp.tanh(a @ b), out_sharding=P("data", None))(x, w)

    with jax.set_mesh(mesh):
        w = jax.device_put(jax.random.normal(jax.random.key(0), (32, 64)) * 0.1, P(None, "model"))
        x = jax.device_put(jax.random.normal(jax.random.key(1), (16, 32)), P("data"))
        want = jax.grad(lambda w: jnp.sum(jax.jit(layer)(w, x) ** 2))(w)
        for policy in ("bf16", "mixed_bfloat16"):
            amp = hlo_amp.compile(layer, policy)
            try:
                got = jax.grad(lambda w: jnp.sum(amp(w, x) ** 2))(w)
                results[policy] = [float(jnp.max(jnp.abs(got - want)) / jnp.max(jnp.abs(want))),
                                   str(jax.typeof(got)) == str(jax.typeof(want))]
            except Exception as error:  # noqa: BLE001
                results[policy] = f"{type(error).__name__}: {str(error)[:300]}"
    print("RESULTS=" + json.dumps(results))
""")


def test_grad_through_auto_axes_on_an_explicit_mesh() -> None:
    """jax.grad of a compiled function that computes inside ``jax.sharding.auto_axes``
    on an Explicit mesh: the residuals made on the Auto mesh come back out of the
    forward program typed on the caller's Explicit mesh, and the backward is traced
    with their forward types again. It raised jax's "context mesh ... should match the
    aval mesh" in the backward's trace."""
    from host_devices import run_on_host_devices

    results = run_on_host_devices(AUTO_AXES_GRAD)
    for policy in ("bf16", "mixed_bfloat16"):
        assert isinstance(results[policy], list), results[policy]
        error, same_type = results[policy]
        assert error <= 2e-2 and same_type, (policy, results[policy])


DEVICE_CLASH = textwrap.dedent("""
    import json
    import jax, jax.numpy as jnp, numpy as np
    import hlo_amp

    def matmul(w, x):
        return x @ w

    w = jax.device_put(np.ones((8, 8), np.float32), jax.devices()[3])
    x = jax.device_put(np.ones((4, 8), np.float32), jax.devices()[5])
    results = {}
    for name, fn in (("jit", jax.jit(matmul)), ("amp", hlo_amp.compile(matmul, "bf16"))):
        try:
            fn(w, x)
            results[name] = "ran"
        except ValueError as error:
            results[name] = str(error)
    print("RESULTS=" + json.dumps(results))
""")


def test_arguments_on_two_devices_are_refused_naming_the_function() -> None:
    """As jax.jit: "Got argument w of matmul ..."; it named the dispatch's closure
    ("argument w of AmpFunction.__init__.<locals>.dispatched")."""
    from host_devices import run_on_host_devices

    results = run_on_host_devices(DEVICE_CLASH)
    assert "incompatible devices" in results["jit"], results
    assert results["amp"] == results["jit"]
    assert "argument w of matmul" in results["amp"]


JIT_PLACEMENT = textwrap.dedent("""
    import json, warnings
    import jax, jax.numpy as jnp, numpy as np
    from jax.sharding import PartitionSpec as P, AxisType, SingleDeviceSharding
    import hlo_amp

    warnings.simplefilter("ignore", DeprecationWarning)  # jax.jit's device=

    def f(x, w):
        h = jnp.tanh(x @ w)
        return {"h": h, "loss": jnp.mean(h ** 2, axis=1)}

    def placed(out):
        return {k: [str(jax.typeof(v)), sorted(d.id for d in v.devices())]
                for k, v in out.items()}

    x = np.ones((8, 16), np.float32)
    w = np.ones((16, 32), np.float32) / 16
    on_2 = SingleDeviceSharding(jax.devices()[2])
    steps = {"out_shardings on device 2": jax.jit(f, out_shardings=on_2),
             "in_shardings on device 2": jax.jit(f, in_shardings=(on_2, on_2)),
             "device 2": jax.jit(f, device=jax.devices()[2])}
    results = {}
    for name, step in steps.items():
        amp = hlo_amp.compile(step, "bf16")
        results[name] = [placed(step(x, w)), placed(amp(x, w)),
                         placed(amp.lower(x, w).compile()(x, w))]
    # A static argument given to hlo_amp.compile beside the step's in_shardings, one per
    # dynamic argument of the step: jax refused the tuple's length.
    scaled = jax.jit(lambda x, n, w: {k: v * n for k, v in f(x, w).items()},
                     in_shardings=(on_2, on_2, on_2))
    for static in (1, -2):  # by position from the end too
        amp = hlo_amp.compile(scaled, "bf16", static_argnums=static)
        results[f"in_shardings and an extra static argument {static}"] = [
            placed(scaled(x, 3.0, w)), placed(amp(x, 3.0, w)),
            placed(amp.lower(x, 3.0, w).compile()(x, w))]
    mesh = jax.make_mesh((2, 2), ("x", "y"), axis_types=(AxisType.Explicit,) * 2)
    step = jax.jit(f, out_shardings={"h": P(None, "y"), "loss": P()})
    with jax.set_mesh(mesh):
        xs = jax.device_put(x, P("x", None))
        ws = jax.device_put(w, P())
        amp = hlo_amp.compile(step, "mixed_bfloat16")
        results["explicit mesh out_shardings"] = [
            placed(step(xs, ws)), placed(amp(xs, ws)),
            placed(amp.lower(xs, ws).compile()(xs, ws))]
    print("RESULTS=" + json.dumps(results))
""")


def test_a_jax_jit_steps_shardings_and_device_place_the_call() -> None:
    """A ``jax.jit`` step's own placement is the call's, as under jax.jit: a step pinned
    to device 2 (by ``device=``, ``in_shardings`` or ``out_shardings``) ran on device 0
    when called (its ``.lower().compile()`` on device 2), and on an Explicit mesh its
    ``out_shardings`` typed no result (``h`` came back ``8@x``, ``loss`` sharded): the
    nested jit that carried them is not the top-level call."""
    from host_devices import run_on_host_devices

    results = run_on_host_devices(JIT_PLACEMENT, devices=4)
    for name, (want, called, ahead_of_time) in results.items():
        assert called == want and ahead_of_time == want, (name, results[name])
    assert results["device 2"][0]["h"][1] == [2]
    assert "@y" in results["explicit mesh out_shardings"][0]["h"][0]


SEQUENCE_SHARDED = textwrap.dedent("""
    import json
    import jax, jax.numpy as jnp, numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
    import hlo_amp

    mesh = Mesh(np.array(jax.devices()).reshape(2, 4), ("data", "model"))
    w = jax.device_put(jax.random.normal(jax.random.key(0), (64, 64)) / 8,
                       NamedSharding(mesh, P(None, "model")))
    x = jax.device_put(jax.random.normal(jax.random.key(1), (4, 32, 64)),
                       NamedSharding(mesh, P(None, "data")))

    def f(w, x):
        return jnp.tanh(x @ w) @ w.T  # the second dot reads a transposed weight

    want = jax.jit(f)(w, x)
    results = {"want": str(want.sharding.spec)}
    for policy in ("bf16", "mixed_bfloat16"):
        amp = hlo_amp.compile(f, policy)
        got = amp(w, x)
        notes = [n for d in amp.lower(w, x).report().decisions for n in d.notes]
        results[policy] = [str(got.sharding.spec),
                           float(jnp.max(jnp.abs(got - want)) / jnp.max(jnp.abs(want))),
                           sorted({n.split(":")[0] for n in notes})]
    print("RESULTS=" + json.dumps(results))
""")


def test_a_dot_xla_cpu_would_upcast_keeps_the_shardings_of_a_partitioned_program() -> None:
    """On several CPU devices a dot the CPU layout pass relays (its weight transposed)
    is computed in f32 instead: the relay reshaped the activation 4x32x64 to 128x64,
    merging its sharded sequence axis, and the result came back replicated (P() where
    jax.jit gives P(None, 'data'))."""
    from host_devices import run_on_host_devices

    results = run_on_host_devices(SEQUENCE_SHARDED)
    assert results["want"] == "P(None, 'data')", results
    for policy in ("bf16", "mixed_bfloat16"):
        spec, error, notes = results[policy]
        assert spec == results["want"], (policy, results)
        assert error < 2e-2, (policy, error)
        assert any(n.startswith("dot computed from f32 copies") for n in notes), notes


UNREDUCED = textwrap.dedent("""
    import json
    import jax, jax.numpy as jnp, numpy as np
    from jax.sharding import PartitionSpec as P, AxisType
    import hlo_amp

    mesh = jax.make_mesh((8,), ("m",), axis_types=(AxisType.Explicit,))

    def row_parallel(x, w):  # partial sums left unreduced, summed at the reshard
        y = jnp.matmul(x, w, out_sharding=P(None, None, unreduced={"m"}))
        return jax.reshard(y, P(None, None)).astype(jnp.bfloat16)

    def transposed(x, w):  # the partial sums transposed before the reshard: the bf16
        # dot's result reached a transpose through jax's constraints, unrelaid, and
        # XLA:CPU failed (DotThunk: BF16 x BF16 = F32)
        y = jnp.matmul(x, w, out_sharding=P(None, None, unreduced={"m"}))
        return jax.reshard(y.T, P(None, None))

    def reduced_step(w, x):  # a reduced parameter's gradient comes back unreduced
        g = jax.grad(lambda w, x: jnp.sum(jnp.tanh(x @ w)))(w, x)
        return jax.reshard(g, P(None, None))

    keys = jax.random.split(jax.random.key(0), 4)
    results = {}
    with jax.set_mesh(mesh):
        x = jax.device_put(jax.random.normal(keys[0], (32, 512)), P(None, "m"))
        w = jax.device_put(jax.random.normal(keys[1], (512, 32)) / 16, P("m", None))
        xs = jax.device_put(jax.random.normal(keys[2], (512, 32)), P("m", None))
        wr = jax.device_put(jax.random.normal(keys[3], (32, 32)) / 4,
                            P(None, None, reduced={"m"}))
        for name, fn, args in (("row_parallel", row_parallel, (x, w)),
                               ("transposed", transposed, (x, w)),
                               ("reduced_step", reduced_step, (wr, xs))):
            want = np.asarray(jax.jit(fn)(*args), np.float32)
            for policy in ("bf16", "f16", "mixed_bfloat16", "bf16,reduce=bfloat16",
                           "mixed_bfloat16,reduce=float32", "fp8"):
                got = np.asarray(hlo_amp.compile(fn, policy)(*args), np.float32)
                results[f"{name} {policy}"] = float(
                    np.abs(got - want).max() / np.abs(want).max())
        text = hlo_amp.compile(row_parallel, "bf16").lower(x, w).as_text()
        results["partial sums"] = sorted({line.rsplit(":", 1)[1].strip() for line in
                                          text.splitlines() if "unreduced=" in line})
    print("RESULTS=" + json.dumps(results))
""")


def test_partial_sums_left_unreduced_are_summed_once() -> None:
    """A dot whose partial sums jax leaves ``unreduced`` (Explicit mesh) keeps that
    sharding on the dot: a convert or an fp8 scale written between them made Shardy sum
    at the dot, and the reshard summed again (8x the value on 8 devices); the accurate
    mode's convert after the sum was also moved above it (the sum in bf16)."""
    from host_devices import run_on_host_devices

    results = run_on_host_devices(UNREDUCED)
    partial_sums = results.pop("partial sums")
    for case, error in results.items():
        assert error < (6e-2 if case.endswith("fp8") else 1e-2), (case, results)
    assert partial_sums == ["tensor<32x32xf32>"], partial_sums  # bf16 sums f32, as jax.jit


CALL_CONTEXT = textwrap.dedent("""
    import json
    import jax, jax.numpy as jnp, numpy as np
    from jax.sharding import Mesh, PartitionSpec as P, AxisType
    import hlo_amp

    d0, d1 = jax.devices()[:2]
    meshes = [Mesh(np.array(devices), ("d",), axis_types=(AxisType.Auto,))
              for devices in ([d0, d1], [d1, d0], [d0])]

    def constrained(x, w):  # reads the mesh jax.set_mesh gives
        y = jax.lax.with_sharding_constraint(x @ w, P("d"))
        return y, jnp.float32(jax.sharding.get_abstract_mesh().size)

    def with_callback(x, w):  # dispatched from hlo_amp's own cache
        jax.debug.callback(lambda v: None, x.sum())
        return x @ w

    x, w = jnp.ones((4, 8)), jnp.ones((8, 8))
    results = {}
    for name, fn in (("jit", jax.jit(constrained)),
                     ("amp", hlo_amp.compile(constrained, "bf16"))):
        seen = []
        for mesh in meshes:
            with jax.set_mesh(mesh):
                y, size = fn(x, w)
            seen.append([[d.id for d in y.sharding.mesh.devices.flat], float(size)])
        results[name] = seen
    # One call under a mesh: calls outside it keep their dispatch and program (every
    # later call went through jax.jit's lowering, and lowered its program again).
    plain = hlo_amp.compile(lambda x, w: jnp.tanh(x @ w), "bf16")
    plain(x, w)
    with jax.set_mesh(jax.make_mesh((2,), ("m",), axis_types=(AxisType.Explicit,))):
        plain(x, w)
    after_mesh = plain.lowerings
    plain(x, w)
    plain(x, w)
    results["lowerings after the mesh call"] = plain.lowerings - after_mesh
    for name, fn in (("jit committed", jax.jit(with_callback)),
                     ("amp committed", hlo_amp.compile(with_callback, "bf16"))):
        first = fn(jax.device_put(x, d0), jax.device_put(w, d0)).committed
        results[name] = [first, fn(x, w).committed]
    print("RESULTS=" + json.dumps(results))
""")


def test_a_call_keys_on_the_context_mesh_and_on_committed_arguments() -> None:
    """As jax.jit's cache: a call under another jax.set_mesh mesh (other devices' order,
    another size) traces anew (the first mesh's program ran: its devices, its size read
    in the function), and a function dispatched from hlo_amp's own cache (a host
    callback) keys on whether its arguments are committed (uncommitted arrays after
    committed ones came back committed)."""
    from host_devices import run_on_host_devices

    results = run_on_host_devices(CALL_CONTEXT, devices=2)
    assert results["amp"] == results["jit"] == [[[0, 1], 2.0], [[1, 0], 2.0], [[0], 1.0]]
    assert results["amp committed"] == results["jit committed"] == [True, False]
    assert results["lowerings after the mesh call"] == 0


INSIDE_SHARD_MAP = textwrap.dedent("""
    import json, warnings
    import jax, jax.numpy as jnp, numpy as np
    from jax.sharding import PartitionSpec as P
    import hlo_amp

    mesh = jax.make_mesh((4,), ("d",), axis_types=(jax.sharding.AxisType.Auto,))

    def f(a, w):
        return jnp.sum(jnp.tanh(a @ w))

    def with_psum(a, w):
        return jax.lax.psum(jnp.sum(jnp.tanh(a @ w)), "d")[None]

    x = jax.random.normal(jax.random.key(0), (32, 16))
    w = jax.random.normal(jax.random.key(1), (16, 8)) / 4
    results = {}
    for name, g in (("jit", jax.jit(f)), ("f32", hlo_amp.compile(f, "f32")),
                    ("bf16", hlo_amp.compile(f, "bf16"))):
        types = []

        def body(a, w):
            out = g(a, w)
            types.append(str(jax.typeof(out)))
            return out[None]

        sm = jax.shard_map(body, mesh=mesh, in_specs=(P("d"), P()), out_specs=P("d"))
        grads = jax.jit(jax.grad(lambda a, w: sm(a, w).sum(), argnums=(0, 1)))(x, w)
        results[name] = [types[0], [np.asarray(g).tolist() for g in grads]]
        try:
            jax.shard_map(g, mesh=mesh, in_specs=(P("d"), P()), out_specs=P())(x, w)
            results[name + " replicated out"] = "accepted"
        except ValueError as error:
            results[name + " replicated out"] = "refused"
    for name, g in (("jit psum", jax.jit(with_psum)), ("amp psum", hlo_amp.compile(with_psum, "bf16"))):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            out = jax.shard_map(g, mesh=mesh, in_specs=(P("d"), P()), out_specs=P("d"))(x, w)
        results[name] = [np.asarray(out).tolist(), [str(c.message)[:60] for c in caught]]

    def over_vmap_axis(x, w):  # a collective over an inner vmap's axis, not pmap's
        return jax.lax.pmean(jnp.tanh(x @ w), "b")

    xs = x.reshape(4, 2, 4, 16)
    for name, g in (("jit vmap", jax.jit(over_vmap_axis)),
                    ("amp vmap", hlo_amp.compile(over_vmap_axis, "bf16"))):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            out = jax.pmap(lambda x: jax.vmap(g, in_axes=(0, None), axis_name="b")(x, w),
                           axis_name="i")(xs)
        results[name] = [np.asarray(out).tolist(), len(caught)]
    print("RESULTS=" + json.dumps(results))
""")


def test_a_compiled_function_inside_shard_map_varies_as_jax_jits_does() -> None:
    """Inside jax.shard_map its outputs vary along the axes its inputs vary along: they
    were typed invariant, so a replicated weight's gradient was device 0's residuals'
    times 4, out_specs=P() on a varying output was taken, and a sharded argument's
    gradient failed ("Expected cotangent type float32[8,16]{V:d}"). One with a psum over
    the shard_map's axis warns and runs unchanged (jax's bare AssertionError); one over
    an inner vmap's axis is rewritten."""
    from host_devices import run_on_host_devices

    results = run_on_host_devices(INSIDE_SHARD_MAP, devices=4)
    want_type, want_grads = results["jit"]
    for policy, tolerance in (("f32", 1e-5), ("bf16", 3e-2)):
        got_type, got_grads = results[policy]
        assert got_type == want_type, (policy, got_type)
        for got, want in zip(got_grads, want_grads, strict=True):
            np.testing.assert_allclose(got, want, rtol=tolerance, atol=tolerance)
        assert results[policy + " replicated out"] == results["jit replicated out"] == "refused"
    np.testing.assert_allclose(results["amp psum"][0], results["jit psum"][0], rtol=2e-2)
    assert [m.startswith("hlo_amp: cannot rewrite with_psum inside jax.shard_map")
            for m in results["amp psum"][1]] == [True]
    # Under pmap, a collective over an inner vmap's own axis is the vmap's: rewritten, no
    # warning (the fallback took every failed export inside pmap for its own axes).
    got, warned = results["amp vmap"]
    want, _ = results["jit vmap"]
    assert warned == 0 and not np.array_equal(got, want)
    np.testing.assert_allclose(got, want, rtol=3e-2, atol=3e-2)
