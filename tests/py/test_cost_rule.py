"""The only_if_faster cost rule: dots the CPU would not run faster stay in f32."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import hlo_amp
from hlo_amp.targets import cpu as cpu_target


def _mlp_grad(params, x):
    def loss(p):
        h = jnp.tanh(x @ p["w1"])
        return jnp.sum((h @ p["w2"]) ** 2)

    return jax.grad(loss)(params)


def _params():
    keys = jax.random.split(jax.random.PRNGKey(0), 3)
    return ({"w1": jax.random.normal(keys[0], (64, 64)) / 8,
             "w2": jax.random.normal(keys[1], (64, 32)) / 8},
            jax.random.normal(keys[2], (32, 64)))


@pytest.mark.parametrize("native", [False, True])
def test_cpu_cost_rule_follows_the_hardware(monkeypatch, native):
    monkeypatch.setattr(cpu_target, "cpu_has_native_bf16", lambda: native)
    params, x = _params()
    report = hlo_amp.compile(_mlp_grad, "bf16,only_if_faster=true").lower(params, x).report()
    assert len(report.decisions) == 5
    if native:  # every dot of these sizes has a fast bf16 form once relaid
        assert all(d.low_precision for d in report.decisions), str(report)
    else:
        assert not any(d.changed for d in report.decisions), str(report)
        assert all("no native bf16" in d.reason for d in report.decisions), str(report)


def test_without_the_option_every_dot_is_converted(monkeypatch):
    monkeypatch.setattr(cpu_target, "cpu_has_native_bf16", lambda: False)
    params, x = _params()
    report = hlo_amp.compile(_mlp_grad, "bf16").lower(params, x).report()
    assert all(d.low_precision for d in report.decisions), str(report)


def test_tiny_dots_stay_f32_even_with_native_bf16(monkeypatch):
    monkeypatch.setattr(cpu_target, "cpu_has_native_bf16", lambda: True)
    x = jnp.ones((4, 4))
    report = hlo_amp.compile(lambda a, b: a @ b, "bf16,only_if_faster=true").lower(x, x).report()
    (decision,) = report.decisions
    assert not decision.changed
    assert "no fast bf16 path" in decision.reason


def test_cost_rule_does_not_apply_off_cpu():
    params, x = _params()
    text = jax.jit(_mlp_grad).lower(params, x).as_text(debug_info=True)
    _, report = hlo_amp.rewrite(text, "bf16,only_if_faster=true", return_report=True)
    assert all(d.low_precision for d in report.decisions)  # no target: GPU-style, all gain


def test_cost_rule_keeps_results_exact_when_it_declines(monkeypatch):
    monkeypatch.setattr(cpu_target, "cpu_has_native_bf16", lambda: False)
    params, x = _params()
    got = hlo_amp.compile(_mlp_grad, "bf16,only_if_faster=true")(params, x)
    want = jax.jit(_mlp_grad)(params, x)
    for key in want:
        np.testing.assert_array_equal(got[key], want[key])


def test_policy_round_trips_the_option():
    policy = hlo_amp.Policy.parse("bf16,only_if_faster=true,scope:head=float32")
    assert policy.only_if_faster
    assert hlo_amp.Policy.parse(policy.to_string()) == policy
    assert hlo_amp.Policy.from_dict(policy.to_dict()) == policy
    with pytest.raises(ValueError, match="only_if_faster"):
        hlo_amp.Policy.parse("bf16,only_if_faster=maybe")
