"""hlo_amp.module_scopes: one scope rule naming one module instance, in five frameworks.

Each framework builds the same two-block model (attention with q/k projections and two
einsums, an MLP, a head). A rule naming block 1's attention by that framework's path keeps
exactly that instance's forward and backward dots in f32 and every other dot in bf16; the
helper leaves outputs and gradients bit-identical, works under jit, grad and scans over
stacked layers, and leaves nothing patched or scoped after its context ends.
"""

from __future__ import annotations

import os
import pathlib
import re
import subprocess
import sys
import threading
import warnings
from collections.abc import Callable
from typing import Any

os.environ.setdefault("KERAS_BACKEND", "jax")  # before keras is imported anywhere

import equinox as eqx
import flax.linen as nn
import haiku as hk
import jax
import jax.numpy as jnp
import keras
import numpy as np
import optax
import pytest
from flax import nnx

import hlo_amp

B, T, D, H = 2, 3, 4, 8  # batch, tokens, width, MLP hidden width
ATTN_FORWARD_DOTS = 4  # q, k, scores, weighted values
X = jax.random.normal(jax.random.PRNGKey(7), (B, T, D))


def _attend(q: jax.Array, k: jax.Array, v: jax.Array) -> jax.Array:
    scores = jnp.einsum("...td,...sd->...ts", q, k)
    return jnp.einsum("...ts,...sd->...td", jax.nn.softmax(scores, axis=-1), v)


def _under(scope: str, path: str) -> bool:
    """Whether ``path``'s segments appear, consecutive and whole, in ``scope``."""
    return f"/{path}/" in f"/{scope}/"


def _decisions(fn: Callable[..., Any], policy: str, *args: Any, xla: bool = False
               ) -> list[hlo_amp.Decision]:
    """The report's decisions; ``xla``: after XLA compiled the program (slower)."""
    lowered = hlo_amp.compile(fn, policy).lower(*args)
    return (lowered.compile() if xla else lowered).report().decisions


def _check_one_instance(fn: Callable[..., Any], args: tuple, path: str, twin: str, *,
                        xla: bool = False) -> None:
    """The rule ``scope:path=float32`` keeps exactly that instance's dots in f32."""
    decisions = _decisions(fn, f"bf16,scope:{path}=float32", *args, xla=xla)
    mine = [d for d in decisions if _under(d.scope, path)]
    twins = [d for d in decisions if _under(d.scope, twin)]
    rest = [d for d in decisions if not _under(d.scope, path)]
    assert sum(d.direction == "forward" for d in mine) == ATTN_FORWARD_DOTS, mine
    assert any(d.direction == "backward" for d in mine), mine
    assert all(not d.low_precision and d.rule == f"scope:{path}" for d in mine), mine
    # The same module in block 0 has its dots too, all bf16: the rule picked one instance.
    # (Fewer backward ones: nothing needs the gradient of the model's input.)
    assert sum(d.direction == "forward" for d in twins) == ATTN_FORWARD_DOTS, twins
    assert any(d.direction == "backward" for d in twins), twins
    assert all(d.low_precision for d in twins), twins
    assert len(rest) > len(mine) and all(d.low_precision for d in rest), rest


def _text(lowered: Any) -> str:
    """Lowered text with transform wrappers dropped: ``transpose(jvp(blocks))/1`` reads
    ``blocks/1``, as policies match it."""
    return re.sub(r"[a-z_]+\(|\)", "", lowered.as_text(debug_info=True))


def _assert_same(a: Any, b: Any) -> None:
    leaves_a, leaves_b = jax.tree.leaves(a), jax.tree.leaves(b)
    assert len(leaves_a) == len(leaves_b) > 1
    for x, y in zip(leaves_a, leaves_b):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def _forward_scopes(fn: Callable[..., Any], *args: Any) -> set[str]:
    return {d.scope for d in _decisions(fn, "bf16", *args) if d.direction == "forward"}


# ---- Flax NNX -----------------------------------------------------------------------------


class NnxAttn(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.q = nnx.Linear(D, D, rngs=rngs)
        self.k = nnx.Linear(D, D, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        return _attend(self.q(x), self.k(x), x)


class NnxMlp(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.fc1 = nnx.Linear(D, H, rngs=rngs)
        self.fc2 = nnx.Linear(H, D, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.fc2(jax.nn.gelu(self.fc1(x)))


class NnxBlock(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.attn = NnxAttn(rngs)
        self.mlp = NnxMlp(rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        x = x + self.attn(x)
        return x + self.mlp(x)


class NnxModel(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.blocks = nnx.List([NnxBlock(rngs) for _ in range(2)])
        self.heads = nnx.Dict({"cls": nnx.Linear(D, 2, rngs=rngs)})

    def __call__(self, x: jax.Array) -> jax.Array:
        for block in self.blocks:
            x = block(x)
        return self.heads["cls"](x)


class NnxStacked(nnx.Module):
    """Two blocks as one stacked module, run by nnx.scan."""

    def __init__(self, rngs: nnx.Rngs):
        @nnx.split_rngs(splits=2)
        @nnx.vmap(in_axes=(0,), out_axes=0)
        def make(rngs: nnx.Rngs) -> NnxBlock:
            return NnxBlock(rngs)

        self.blocks = make(rngs)
        self.heads = nnx.Dict({"cls": nnx.Linear(D, 2, rngs=rngs)})

    def __call__(self, x: jax.Array) -> jax.Array:
        @nnx.scan(in_axes=(nnx.Carry, 0), out_axes=nnx.Carry)
        def run(x: jax.Array, block: NnxBlock) -> jax.Array:
            return block(x)

        return self.heads["cls"](run(x, self.blocks))


def _nnx_step(model: nnx.Module) -> tuple[Callable[..., Any], tuple]:
    """loss and grads of (params, x); the model is rebuilt by nnx.merge, as in a train step."""
    graphdef, params = nnx.split(model)

    def loss_and_grad(params: Any, x: jax.Array) -> Any:
        def loss(params: Any) -> jax.Array:
            return jnp.mean(nnx.merge(graphdef, params)(x) ** 2)

        return jax.value_and_grad(loss)(params)

    return loss_and_grad, (params, X)


NNX_CLASSES = (NnxModel, NnxBlock, NnxAttn, NnxMlp, nnx.Linear)


def test_nnx_rule_names_one_instance() -> None:
    model = NnxModel(nnx.Rngs(0))
    step, args = _nnx_step(model)
    _check_one_instance(hlo_amp.module_scopes(model)(step), args, "blocks/1/attn",
                        "blocks/0/attn", xla=True)
    # NNX pushes no scopes of its own: without the helper the rule matches nothing.
    with pytest.warns(UserWarning, match="matched no op"):
        plain = _decisions(step, "bf16,scope:blocks/1/attn=float32", *args)
    assert plain and all(d.low_precision and d.scope == "" for d in plain)


def test_nnx_paths_are_relative_to_the_root() -> None:
    model = NnxModel(nnx.Rngs(0))
    step, args = _nnx_step(model)
    want = {f"blocks/{i}/{part}" for i in range(2)
            for part in ("attn", "attn/q", "attn/k", "mlp/fc1", "mlp/fc2")} | {"heads/cls"}
    assert _forward_scopes(hlo_amp.module_scopes(model)(step), *args) == want


def test_op_sources_stay_the_model_lines() -> None:
    """The report's source column names the model's lines, not the helper's wrapper."""
    model = NnxModel(nnx.Rngs(0))
    step, args = _nnx_step(model)
    plain = [d.source for d in _decisions(step, "bf16", *args)]
    scoped = [d.source for d in _decisions(hlo_amp.module_scopes(model)(step), "bf16", *args)]
    assert scoped == plain and all(s and "test_module_scopes.py" in s for s in scoped)


def test_nnx_submodule_called_from_the_root_gets_its_full_path() -> None:
    model = NnxModel(nnx.Rngs(0))
    with hlo_amp.module_scopes(model):
        scopes = _forward_scopes(lambda x: model.blocks[1].attn(model.blocks[0].attn.q(x)), X)
    assert scopes == {"blocks/0/attn/q", "blocks/1/attn", "blocks/1/attn/q", "blocks/1/attn/k"}


class _SharedBlock(nnx.Module):
    def __init__(self, rngs: nnx.Rngs, shared: nnx.Linear):
        self.own = nnx.Linear(D, D, rngs=rngs)
        self.shared = shared

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.shared(self.own(x))


class _SharedProjection(nnx.Module):
    """A projection the root calls and its blocks hold too: ``proj`` sorts after
    ``blocks``, so NNX's walk meets it first at ``blocks/0/shared``."""

    def __init__(self, rngs: nnx.Rngs):
        self.proj = nnx.Linear(D, D, rngs=rngs)
        self.blocks = nnx.List([_SharedBlock(rngs, self.proj) for _ in range(2)])

    def __call__(self, x: jax.Array) -> jax.Array:
        for block in self.blocks:
            x = block(x)
        return self.proj(x)


def test_nnx_shared_module_takes_the_path_its_caller_holds_it_at() -> None:
    """Each call of a shared module is named through its caller's attribute. All took the
    first path NNX's walk met: block 1's was blocks/1/blocks/0/shared, and the root's own
    call of self.proj was blocks/0/shared (both rules naming them matched no op)."""
    model = _SharedProjection(nnx.Rngs(0))
    step, args = _nnx_step(model)
    assert _forward_scopes(hlo_amp.module_scopes(model)(step), *args) == {
        "blocks/0/own", "blocks/0/shared", "blocks/1/own", "blocks/1/shared", "proj"}
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # both rules match
        decisions = _decisions(hlo_amp.module_scopes(model)(step),
                               "bf16,scope:/proj=keep,scope:blocks/1/shared=keep", *args)
    kept = {d.scope for d in decisions if d.rule.startswith("scope:")}
    assert kept == {"proj", "blocks/1/shared"}


def test_nnx_bit_identical_under_jit_and_grad() -> None:
    model = NnxModel(nnx.Rngs(0))
    step, args = _nnx_step(model)
    scoped = hlo_amp.module_scopes(model)(step)
    assert "blocks/1/attn/q" in _text(jax.jit(scoped).lower(*args))
    _assert_same(jax.jit(scoped)(*args), jax.jit(step)(*args))


def test_nnx_transforms_rebuild_the_model() -> None:
    """nnx.value_and_grad and nnx.jit hand the function copies of the model."""
    model = NnxModel(nnx.Rngs(0))
    graphdef, params = nnx.split(model)

    def step(params: Any, x: jax.Array) -> Any:
        def loss(m: NnxModel) -> jax.Array:
            return jnp.mean(m(x) ** 2)

        return nnx.value_and_grad(loss)(nnx.merge(graphdef, params))

    _check_one_instance(hlo_amp.module_scopes(model)(step), (params, X), "blocks/1/attn",
                        "blocks/0/attn")

    @nnx.jit
    def jitted(m: NnxModel, x: jax.Array) -> Any:
        return nnx.value_and_grad(lambda m: jnp.mean(m(x) ** 2))(m)

    with hlo_amp.module_scopes(model):
        got = jitted(model, X)
    _assert_same(got, nnx.jit(lambda m, x: nnx.value_and_grad(
        lambda m: jnp.mean(m(x) ** 2))(m))(model, X))


def test_nnx_scan_over_stacked_layers() -> None:
    model = NnxStacked(nnx.Rngs(0))
    step, args = _nnx_step(model)
    scoped = hlo_amp.module_scopes(model)(step)
    # One path for every layer: the scan body is traced once.
    assert _forward_scopes(scoped, *args) == {
        "blocks/attn", "blocks/attn/q", "blocks/attn/k", "blocks/mlp/fc1", "blocks/mlp/fc2",
        "heads/cls"}
    decisions = _decisions(scoped, "bf16,scope:blocks/attn=float32", *args)
    mine = [d for d in decisions if _under(d.scope, "blocks/attn")]
    assert sum(d.direction == "forward" for d in mine) == ATTN_FORWARD_DOTS
    assert any(d.direction == "backward" for d in mine)
    assert all(not d.low_precision for d in mine)
    assert all(d.low_precision for d in decisions if d not in mine)
    _assert_same(jax.jit(scoped)(*args), jax.jit(step)(*args))


class NnxRematBlock(NnxBlock):
    def __call__(self, x: jax.Array) -> jax.Array:
        return nnx.remat(lambda block, x: NnxBlock.__call__(block, x))(self, x)


class NnxRematModel(NnxModel):
    def __init__(self, rngs: nnx.Rngs, *, inside: bool):
        super().__init__(rngs)
        self.inside = inside
        self.blocks = nnx.List([(NnxRematBlock if inside else NnxBlock)(rngs)
                                for _ in range(2)])

    def __call__(self, x: jax.Array) -> jax.Array:
        for block in self.blocks:
            x = block(x) if self.inside else nnx.remat(lambda b, x: b(x))(block, x)
        return self.heads["cls"](x)


@pytest.mark.parametrize("inside", [True, False])
def test_nnx_remat_copies_of_a_block(inside: bool) -> None:
    """A block copied by nnx.remat inside its own __call__ keeps its index; one of two
    identical blocks copied by the root cannot be told apart and adds no segment."""
    model = NnxRematModel(nnx.Rngs(0), inside=inside)
    step, args = _nnx_step(model)
    parts = ("attn", "attn/q", "attn/k", "mlp/fc1", "mlp/fc2")
    want = ({f"blocks/{i}/{part}" for i in range(2) for part in parts} if inside
            else set(parts))
    assert _forward_scopes(hlo_amp.module_scopes(model)(step), *args) == want | {"heads/cls"}


class NnxProj(nnx.Module):
    def __init__(self, din: int, dout: int, rngs: nnx.Rngs):
        self.fc = nnx.Linear(din, dout, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        return jax.nn.gelu(self.fc(x))


class NnxLookAlikes(nnx.Module):
    """Modules of one class and structure but other sizes, copied by transformations the
    root applies: nnx.remat of an encoder and a decoder, nnx.scan of a stack."""

    def __init__(self, rngs: nnx.Rngs):
        self.enc = NnxProj(D, H, rngs)
        self.dec = NnxProj(H, D, rngs)

        @nnx.split_rngs(splits=2)
        @nnx.vmap(in_axes=(0,), out_axes=0)
        def make(rngs: nnx.Rngs) -> NnxProj:
            return NnxProj(D, D, rngs)

        self.stack = make(rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        x = nnx.remat(lambda m, x: m(x))(self.dec, nnx.remat(lambda m, x: m(x))(self.enc, x))

        @nnx.scan(in_axes=(nnx.Carry, 0), out_axes=nnx.Carry)
        def run(x: jax.Array, layer: NnxProj) -> jax.Array:
            return layer(x)

        return run(x, self.stack)


def test_nnx_look_alikes_of_other_sizes_keep_their_paths() -> None:
    """A copy matches the one module of its structure whose arrays have its shapes (or
    stack them): before, the three look-alikes' copies all lost their segment."""
    model = NnxLookAlikes(nnx.Rngs(0))
    step, args = _nnx_step(model)
    scoped = hlo_amp.module_scopes(model)(step)
    assert _forward_scopes(scoped, *args) == {"enc/fc", "dec/fc", "stack/fc"}
    decisions = _decisions(scoped, "bf16,scope:dec=float32", *args)
    mine = [d for d in decisions if _under(d.scope, "dec")]
    assert mine and all(not d.low_precision for d in mine)
    assert all(d.low_precision for d in decisions if d not in mine)


def test_nnx_a_module_outside_the_model_gets_no_path() -> None:
    """A module of the model's class that the step closes over (a probe of other sizes)
    is not a copy of the model's one module of that class: it took the path 'enc' and
    the rule scope:enc computed its dot in f32."""

    class Net(nnx.Module):
        def __init__(self, rngs: nnx.Rngs) -> None:
            self.enc = nnx.Linear(8, 16, rngs=rngs)

        def __call__(self, x: jax.Array) -> jax.Array:
            return jnp.tanh(self.enc(x))

    model, probe = Net(nnx.Rngs(0)), nnx.Linear(16, 3, rngs=nnx.Rngs(1))
    decisions = _decisions(lambda m, x: probe(m(x)).sum(), "bf16,scope:enc=float32",
                           model, jnp.ones((2, 8)))
    assert {(d.shape, d.scope, d.low_precision) for d in decisions} == {
        ("2x16", "enc", False), ("2x3", "", True)}


def test_nnx_no_scopes_or_patches_after_exit() -> None:
    model = NnxModel(nnx.Rngs(0))
    step, args = _nnx_step(model)
    before = {cls: cls.__dict__["__call__"] for cls in NNX_CLASSES}
    with hlo_amp.module_scopes(model):
        assert all(cls.__dict__["__call__"] is not before[cls] for cls in NNX_CLASSES)
        with hlo_amp.module_scopes(model):  # nested: the outer one still patches on exit
            pass
        assert all(cls.__dict__["__call__"] is not before[cls] for cls in NNX_CLASSES)
        inside = _text(jax.jit(lambda p, x: step(p, x)).lower(*args))
    with pytest.raises(ZeroDivisionError), hlo_amp.module_scopes(model):
        _ = 1 / 0
    assert all(cls.__dict__["__call__"] is before[cls] for cls in NNX_CLASSES)
    after = _text(jax.jit(lambda p, x: step(p, x)).lower(*args))
    assert "blocks/1/attn" in inside
    assert "blocks/" not in after and "heads/" not in after


def test_nnx_other_threads_see_no_scopes() -> None:
    model = NnxModel(nnx.Rngs(0))
    step, args = _nnx_step(model)
    texts = []
    with hlo_amp.module_scopes(model):
        thread = threading.Thread(target=lambda: texts.append(
            _text(jax.jit(lambda p, x: step(p, x)).lower(*args))))
        thread.start()
        thread.join()
        texts.append(_text(jax.jit(lambda p, x: step(p, x)).lower(*args)))
    assert "blocks/" not in texts[0] and "blocks/1/attn" in texts[1]


# ---- Equinox ------------------------------------------------------------------------------


class EqxAttn(eqx.Module):
    q: eqx.nn.Linear
    k: eqx.nn.Linear

    def __init__(self, key: jax.Array):
        kq, kk = jax.random.split(key)
        self.q, self.k = eqx.nn.Linear(D, D, key=kq), eqx.nn.Linear(D, D, key=kk)

    def __call__(self, x: jax.Array) -> jax.Array:  # x: (tokens, width)
        return _attend(jax.vmap(self.q)(x), jax.vmap(self.k)(x), x)


class EqxMlp(eqx.Module):
    fc1: eqx.nn.Linear
    fc2: eqx.nn.Linear

    def __init__(self, key: jax.Array):
        k1, k2 = jax.random.split(key)
        self.fc1, self.fc2 = eqx.nn.Linear(D, H, key=k1), eqx.nn.Linear(H, D, key=k2)

    def __call__(self, x: jax.Array) -> jax.Array:
        return jax.vmap(self.fc2)(jax.nn.gelu(jax.vmap(self.fc1)(x)))


class EqxBlock(eqx.Module):
    attn: EqxAttn
    mlp: EqxMlp

    def __init__(self, key: jax.Array):
        ka, km = jax.random.split(key)
        self.attn, self.mlp = EqxAttn(ka), EqxMlp(km)

    def __call__(self, x: jax.Array) -> jax.Array:
        x = x + self.attn(x)
        return x + self.mlp(x)


class EqxModel(eqx.Module):
    blocks: list[EqxBlock]
    heads: dict[str, eqx.nn.Linear]

    def __init__(self, key: jax.Array):
        k0, k1, kh = jax.random.split(key, 3)
        self.blocks = [EqxBlock(k0), EqxBlock(k1)]
        self.heads = {"cls": eqx.nn.Linear(D, 2, key=kh)}

    def __call__(self, x: jax.Array) -> jax.Array:
        for block in self.blocks:
            x = block(x)
        return jax.vmap(self.heads["cls"])(x)


class EqxStacked(eqx.Module):
    """Two blocks made by eqx.filter_vmap as one stacked module, run by jax.lax.scan."""

    blocks: EqxBlock
    heads: dict[str, eqx.nn.Linear]

    def __init__(self, key: jax.Array):
        kb, kh = jax.random.split(key)
        self.blocks = eqx.filter_vmap(EqxBlock)(jax.random.split(kb, 2))
        self.heads = {"cls": eqx.nn.Linear(D, 2, key=kh)}

    def __call__(self, x: jax.Array) -> jax.Array:
        arrays, static = eqx.partition(self.blocks, eqx.is_array)

        def body(x: jax.Array, layer: Any) -> tuple[jax.Array, None]:
            return eqx.combine(layer, static)(x), None

        x, _ = jax.lax.scan(body, x, arrays)
        return jax.vmap(self.heads["cls"])(x)


def _eqx_loss(model: eqx.Module, x: jax.Array) -> jax.Array:
    return jnp.mean(jax.vmap(model)(x) ** 2)


def _eqx_step(model: eqx.Module, x: jax.Array) -> Any:
    return eqx.filter_value_and_grad(_eqx_loss)(model, x)


EQX_CLASSES = (EqxModel, EqxBlock, EqxAttn, EqxMlp, eqx.nn.Linear)


def test_equinox_rule_names_one_instance() -> None:
    model = EqxModel(jax.random.PRNGKey(0))
    _check_one_instance(hlo_amp.module_scopes(model)(_eqx_step), (model, X), "blocks/1/attn",
                        "blocks/0/attn", xla=True)
    # An Equinox model among a compiled function's arguments gets module paths with no
    # wrapper (runtime/frameworks.py); traced by jax.jit alone, Equinox scopes only its
    # built-in layers, by class, and no rule reaches one instance.
    plain = {d.scope for d in _decisions(_eqx_step, "bf16", model, X)}
    wrapped = {d.scope for d in _decisions(hlo_amp.module_scopes(model)(_eqx_step), "bf16",
                                           model, X)}
    assert plain == wrapped and "blocks/1/attn" in plain
    unscoped = _text(jax.jit(_eqx_step).lower(model, X))
    assert "blocks/1/attn" not in unscoped and "eqx.nn.Linear" in unscoped


def test_equinox_paths_are_relative_to_the_root() -> None:
    model = EqxModel(jax.random.PRNGKey(0))
    want = {f"blocks/{i}/{part}" for i in range(2)
            for part in ("attn", "attn/q/eqx.nn.Linear", "attn/k/eqx.nn.Linear",
                         "mlp/fc1/eqx.nn.Linear", "mlp/fc2/eqx.nn.Linear")}
    want.add("heads/cls/eqx.nn.Linear")
    assert _forward_scopes(hlo_amp.module_scopes(model)(_eqx_step), model, X) == want


def test_equinox_bit_identical_under_filter_jit_and_grad() -> None:
    model = EqxModel(jax.random.PRNGKey(0))
    scoped = hlo_amp.module_scopes(model)(_eqx_step)
    assert "blocks/1/attn/q" in _text(jax.jit(scoped).lower(model, X))
    _assert_same(eqx.filter_jit(scoped)(model, X), eqx.filter_jit(_eqx_step)(model, X))


def test_equinox_scan_and_filter_vmap_over_stacked_layers() -> None:
    model = EqxStacked(jax.random.PRNGKey(0))
    scoped = hlo_amp.module_scopes(model)(_eqx_step)
    assert _forward_scopes(scoped, model, X) == {
        "blocks/attn", "blocks/attn/q/eqx.nn.Linear", "blocks/attn/k/eqx.nn.Linear",
        "blocks/mlp/fc1/eqx.nn.Linear", "blocks/mlp/fc2/eqx.nn.Linear",
        "heads/cls/eqx.nn.Linear"}
    decisions = _decisions(scoped, "bf16,scope:blocks/attn=float32", model, X)
    mine = [d for d in decisions if _under(d.scope, "blocks/attn")]
    assert sum(d.direction == "forward" for d in mine) == ATTN_FORWARD_DOTS
    assert any(d.direction == "backward" for d in mine)
    assert all(not d.low_precision for d in mine)
    assert all(d.low_precision for d in decisions if d not in mine)
    _assert_same(eqx.filter_jit(scoped)(model, X), eqx.filter_jit(_eqx_step)(model, X))

    def ensemble(model: EqxStacked, x: jax.Array) -> jax.Array:  # every layer on the same x
        return eqx.filter_vmap(lambda block, x: block(x), in_axes=(eqx.if_array(0), None))(
            model.blocks, x[0])

    with hlo_amp.module_scopes(model):
        assert _forward_scopes(ensemble, model, X) == {
            "blocks/attn", "blocks/attn/q/eqx.nn.Linear", "blocks/attn/k/eqx.nn.Linear",
            "blocks/mlp/fc1/eqx.nn.Linear", "blocks/mlp/fc2/eqx.nn.Linear"}


class EqxProj(eqx.Module):
    fc: eqx.nn.Linear

    def __init__(self, din: int, dout: int, key: jax.Array):
        self.fc = eqx.nn.Linear(din, dout, key=key)

    def __call__(self, x: jax.Array) -> jax.Array:
        return jax.nn.gelu(jax.vmap(self.fc)(x))


class EqxLookAlikes(eqx.Module):
    enc: EqxProj
    dec: EqxProj

    def __init__(self, key: jax.Array):
        ke, kd = jax.random.split(key)
        self.enc, self.dec = EqxProj(D, H, ke), EqxProj(H, D, kd)

    def __call__(self, x: jax.Array) -> jax.Array:
        run = eqx.filter_checkpoint(lambda m, x: m(x))
        return run(self.dec, run(self.enc, x))


def test_equinox_look_alikes_of_other_sizes_keep_their_paths() -> None:
    model = EqxLookAlikes(jax.random.PRNGKey(0))
    scoped = hlo_amp.module_scopes(model)(_eqx_step)
    assert _forward_scopes(scoped, model, X) == {"enc/fc/eqx.nn.Linear",
                                                 "dec/fc/eqx.nn.Linear"}


def test_equinox_a_module_outside_the_model_gets_no_path() -> None:
    """As with NNX: a closed-over eqx.nn.Linear of other sizes took the model's one
    Linear's path."""

    class Net(eqx.Module):
        enc: eqx.nn.Linear

        def __call__(self, x: jax.Array) -> jax.Array:
            return jnp.tanh(self.enc(x))

    model = Net(eqx.nn.Linear(8, 16, key=jax.random.PRNGKey(0)))
    probe = eqx.nn.Linear(16, 3, key=jax.random.PRNGKey(1))
    decisions = _decisions(lambda m, x: jax.vmap(lambda v: probe(m(v)))(x).sum(),
                           "bf16,scope:enc=float32", model, jnp.ones((2, 8)))
    assert {(d.shape, d.scope, d.low_precision) for d in decisions} == {
        ("16x2", "enc/eqx.nn.Linear", False), ("3x2", "eqx.nn.Linear", True)}


def test_equinox_no_scopes_or_patches_after_exit() -> None:
    model = EqxModel(jax.random.PRNGKey(0))
    before = {cls: cls.__dict__["__call__"] for cls in EQX_CLASSES}
    scoped = hlo_amp.module_scopes(model)(_eqx_step)
    inside = _text(jax.jit(scoped).lower(model, X))
    assert all(cls.__dict__["__call__"] is before[cls] for cls in EQX_CLASSES)
    after = _text(jax.jit(lambda m, x: _eqx_step(m, x)).lower(model, X))
    assert "blocks/1/attn" in inside
    assert "blocks/" not in after and "heads/" not in after


# ---- Flax Linen: names its modules itself ---------------------------------------------------


class LinenAttn(nn.Module):
    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        return _attend(nn.Dense(D, name="q")(x), nn.Dense(D, name="k")(x), x)


class LinenMlp(nn.Module):
    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        return nn.Dense(D, name="fc2")(jax.nn.gelu(nn.Dense(H, name="fc1")(x)))


class LinenBlock(nn.Module):
    def setup(self) -> None:
        self.attn = LinenAttn()
        self.mlp = LinenMlp()

    def __call__(self, x: jax.Array) -> jax.Array:
        x = x + self.attn(x)
        return x + self.mlp(x)


class LinenModel(nn.Module):
    def setup(self) -> None:
        self.blocks = [LinenBlock() for _ in range(2)]  # named blocks_0, blocks_1
        self.head = nn.Dense(2)

    def __call__(self, x: jax.Array) -> jax.Array:
        for block in self.blocks:
            x = block(x)
        return self.head(x)


class LinenLayer(nn.Module):
    @nn.compact
    def __call__(self, x: jax.Array, _: Any) -> tuple[jax.Array, None]:  # nn.scan's signature
        x = x + LinenAttn(name="attn")(x)
        return x + LinenMlp(name="mlp")(x), None


class LinenStacked(nn.Module):
    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        layers = nn.scan(LinenLayer, variable_axes={"params": 0}, split_rngs={"params": True},
                         length=2)
        x, _ = layers(name="blocks")(x, None)
        return nn.Dense(2, name="head")(x)


def _linen_step(model: nn.Module) -> tuple[Callable[..., Any], tuple]:
    params = model.init(jax.random.PRNGKey(0), X)

    def loss_and_grad(params: Any, x: jax.Array) -> Any:
        return jax.value_and_grad(lambda p: jnp.mean(model.apply(p, x) ** 2))(params)

    return loss_and_grad, (params, X)


def test_linen_rule_names_one_instance() -> None:
    model = LinenModel()
    step, args = _linen_step(model)
    scoped = hlo_amp.module_scopes(model)(step)
    _check_one_instance(scoped, args, "blocks_1/attn", "blocks_0/attn")
    assert "LinenModel/blocks_1/attn/q" in _forward_scopes(scoped, *args)
    _assert_same(jax.jit(scoped)(*args), jax.jit(step)(*args))


def test_linen_named_calls_turned_on_inside_only() -> None:
    model = LinenModel()
    step, args = _linen_step(model)
    nn.disable_named_call()  # what flax_profile=False does
    try:
        assert _forward_scopes(step, *args) == {""}
        assert "LinenModel/blocks_1/attn" in _forward_scopes(
            hlo_amp.module_scopes(model)(step), *args)
        assert _forward_scopes(lambda p, x: step(p, x), *args) == {""}
    finally:
        nn.enable_named_call()


def test_linen_scan_over_stacked_layers() -> None:
    model = LinenStacked()
    step, args = _linen_step(model)
    scopes = _forward_scopes(hlo_amp.module_scopes(model)(step), *args)
    assert {"LinenStacked/blocks/attn/q", "LinenStacked/blocks/mlp/fc1"} <= scopes


# ---- Haiku: names its modules itself ------------------------------------------------------


class HkAttn(hk.Module):
    def __call__(self, x: jax.Array) -> jax.Array:
        return _attend(hk.Linear(D, name="q")(x), hk.Linear(D, name="k")(x), x)


class HkMlp(hk.Module):
    def __call__(self, x: jax.Array) -> jax.Array:
        return hk.Linear(D, name="fc2")(jax.nn.gelu(hk.Linear(H, name="fc1")(x)))


class HkBlock(hk.Module):
    def __call__(self, x: jax.Array) -> jax.Array:
        x = x + HkAttn(name="attn")(x)
        return x + HkMlp(name="mlp")(x)


def _hk_model(x: jax.Array) -> jax.Array:
    for i in range(2):
        x = HkBlock(name=f"blocks_{i}")(x)
    return hk.Linear(2, name="head")(x)


def _hk_stacked(x: jax.Array) -> jax.Array:
    x = hk.layer_stack(2, name="blocks")(lambda x: HkBlock(name="block")(x))(x)
    return hk.Linear(2, name="head")(x)


def _hk_step(forward: Callable[[jax.Array], jax.Array]) -> tuple[Any, Callable[..., Any], tuple]:
    net = hk.without_apply_rng(hk.transform(forward))
    params = net.init(jax.random.PRNGKey(0), X)

    def loss_and_grad(params: Any, x: jax.Array) -> Any:
        return jax.value_and_grad(lambda p: jnp.mean(net.apply(p, x) ** 2))(params)

    return net, loss_and_grad, (params, X)


def test_haiku_rule_names_one_instance() -> None:
    net, step, args = _hk_step(_hk_model)
    scoped = hlo_amp.module_scopes(net)(step)
    _check_one_instance(scoped, args, "blocks_1/attn", "blocks_0/attn")
    assert "blocks_1/attn/q" in _forward_scopes(scoped, *args)
    _assert_same(jax.jit(scoped)(*args), jax.jit(step)(*args))


def test_haiku_layer_stack_adds_no_segment() -> None:
    net, step, args = _hk_step(_hk_stacked)
    scopes = _forward_scopes(hlo_amp.module_scopes(net)(step), *args)
    assert {"block/attn/q", "block/mlp/fc1", "head"} <= scopes  # not blocks/block/...


# ---- Keras 3 (JAX backend): names its layers itself ---------------------------------------


class KerasAttn(keras.layers.Layer):
    def __init__(self, **kwargs: Any):
        super().__init__(**kwargs)
        self.q = keras.layers.Dense(D, name="q")
        self.k = keras.layers.Dense(D, name="k")

    def call(self, x: jax.Array) -> jax.Array:
        return _attend(self.q(x), self.k(x), x)


class KerasMlp(keras.layers.Layer):
    def __init__(self, **kwargs: Any):
        super().__init__(**kwargs)
        self.fc1 = keras.layers.Dense(H, activation="gelu", name="fc1")
        self.fc2 = keras.layers.Dense(D, name="fc2")

    def call(self, x: jax.Array) -> jax.Array:
        return self.fc2(self.fc1(x))


class KerasBlock(keras.layers.Layer):
    def __init__(self, **kwargs: Any):
        super().__init__(**kwargs)
        self.attn = KerasAttn(name="attn")
        self.mlp = KerasMlp(name="mlp")

    def call(self, x: jax.Array) -> jax.Array:
        x = x + self.attn(x)
        return x + self.mlp(x)


class KerasModel(keras.Model):
    def __init__(self, **kwargs: Any):
        super().__init__(**kwargs)
        self.blocks = [KerasBlock(name=f"blocks_{i}") for i in range(2)]
        self.head = keras.layers.Dense(2, name="head")

    def call(self, x: jax.Array) -> jax.Array:
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def test_keras_rule_names_one_instance() -> None:
    assert keras.backend.backend() == "jax"
    model = KerasModel(name="model")
    model(X)  # builds the weights
    trainable = [v.value for v in model.trainable_variables]

    def step(trainable: list[jax.Array], x: jax.Array) -> Any:
        def loss(trainable: list[jax.Array]) -> jax.Array:
            y, _ = model.stateless_call(trainable, [], x)
            return jnp.mean(y ** 2)

        return jax.value_and_grad(loss)(trainable)

    scoped = hlo_amp.module_scopes(model)(step)
    _check_one_instance(scoped, (trainable, X), "blocks_1/attn", "blocks_0/attn")
    assert "blocks_1/attn/q" in _forward_scopes(scoped, trainable, X)
    _assert_same(jax.jit(scoped)(trainable, X), jax.jit(step)(trainable, X))
    # Calling the model itself adds its own name in front.
    assert "model/blocks_1/attn/q" in _forward_scopes(lambda x: model(x), X)


# ---- the docs' example, imports, bad input --------------------------------------------------------------------------------


@pytest.mark.parametrize("given, named", [
    (object(), "builtins.object"),
    # It named the metaclass ("a class of type flax.nnx...ModuleMeta").
    (NnxModel, f"the class {NnxModel.__module__}.NnxModel, not a model; pass an instance"),
    (lambda x: x, "builtins.function"),
    ({"w": jnp.ones(2)}, "builtins.dict"),
])
def test_unknown_model_type_is_a_type_error(given: Any, named: str) -> None:
    with pytest.raises(TypeError, match="module_scopes got") as info:
        hlo_amp.module_scopes(given)
    message = str(info.value)
    assert named in message and "accepted: a Flax NNX or Equinox module" in message
    assert "\n" not in message


def test_demo_vit_train_step_paths() -> None:
    """The demo's ViT pushes no scopes itself; its stateful train step, given the model and
    optimizer as examples/vit_digits.py gives them, gets its parts' paths."""
    from examples.models import ViT
    from examples.vit_digits import train_step

    model = ViT(image_size=4, channels=1, patch=2, dim=8, depth=2, heads=2, mlp_dim=8,
                classes=3, dropout=0.1, rngs=nnx.Rngs(0))
    optimizer = nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param)
    x, y = jnp.ones((2, 4, 4, 1)), jnp.arange(2)
    assert _forward_scopes(train_step, model, optimizer, x, y) == {"patch_embed", "head"} | {
        f"blocks/{i}/{part}" for i in range(2)
        for part in ("attn", "attn/qkv", "attn/out", "mlp/fc1", "mlp/fc2")}
    graphdef, state = nnx.split((model, optimizer))

    def pure_step(state: Any, x: jax.Array, y: jax.Array) -> jax.Array:
        return train_step(*nnx.merge(graphdef, state), x, y)

    assert _forward_scopes(pure_step, state, x, y) == {""}


def test_docs_example_runs_and_names_one_instance() -> None:
    text = (pathlib.Path(__file__).parents[2] / "docs" / "module_scopes.md").read_text()
    code = text.split("```python\n")[1].split("```")[0]
    scope = {"hlo_amp": hlo_amp, "jax": jax, "nnx": nnx, "eqx": eqx, "optax": optax,
             "model": NnxModel(nnx.Rngs(0)), "eqx_model": EqxModel(jax.random.PRNGKey(0)),
             "x": X, "y": jnp.zeros((B, T), jnp.int32)}
    exec(code, scope)  # noqa: S102 - the documented example, as written
    assert np.isfinite(float(scope["loss"]))
    _check_one_instance(scope["grad_fn"], (scope["params"], X, scope["y"]), "blocks/1/attn",
                        "blocks/0/attn")


def test_import_hlo_amp_imports_no_framework() -> None:
    code = ("import sys, hlo_amp; "
            "print([m for m in ('flax', 'equinox', 'haiku', 'keras') if m in sys.modules])")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, env={**os.environ, "JAX_PLATFORMS": "cpu"})
    assert out.stdout.strip() == "[]", out.stderr
