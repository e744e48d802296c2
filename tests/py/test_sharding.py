"""hlo_amp.compile on 8 host devices: shardings kept, results match one device.

``--xla_force_host_platform_device_count`` must be set before jax is imported, and
pytest has imported jax already, so the checks run in a subprocess that prints JSON.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

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
    results["all_low"] = all(d.low_precision for d in lowered.report().decisions)
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
    assert results["n_decisions"] >= 5 and results["all_low"]


def test_shard_map_body_rewritten(results):
    decisions = results["shard_map_decisions"]
    assert decisions, "no dot found inside the shard_map body"
    assert all(kind == "dot_general" and low and changed for kind, low, changed in decisions)
    assert results["shard_map_text_bf16"]
    assert results["shard_map_err"] <= 1e-2 * results["shard_map_scale"] + 1e-6


def test_mixed_mode_keeps_shardings_and_paints(results):
    assert results["mixed_sharding_equivalent"] == {"w1": True, "w2": True}
    assert results["mixed_loss_sharding_equivalent"]
    for marker in ("sdy.sharding =", "mhlo.sharding =", "sdy.mesh"):
        assert results["mixed_" + marker] == results[marker][1], marker
    for k, err in results["mixed_max_err"].items():
        assert err <= 1.6e-2 * results["scale"][k], (k, err)
    assert results["mixed_low_bytes"] > 0  # the tanh between the dots is 16-bit
