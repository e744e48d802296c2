"""Benchmark workloads: train steps on random data, built four ways from one definition.

A `Workload` builds a Flax NNX model at a given computation dtype (params always f32),
random inputs with a fixed seed, and an adam train step that is a pure function of
arrays. `variant_step` turns it into the step each benchmark variant runs:

* ``f32``          — the model at f32, ``jax.jit``;
* ``flax bf16``    — the model written with ``dtype=jnp.bfloat16, param_dtype=jnp.float32``;
* ``jmp bf16``     — the model at inferred dtype; params and inputs cast to bf16 at the
  boundary with ``jmp.get_policy('params=float32,compute=bfloat16,output=float32')``;
* ``hlo_amp bf16`` — the f32 step, unchanged, through ``hlo_amp.compile(step, "bf16")``.

``python -m benchmarks.workloads stress --layers 24`` lowers and rewrites a deep
transformer train step in a fresh process and prints JSON (pass time, op count, peak RSS).
"""

from __future__ import annotations

import argparse
import json
import re
import resource
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from examples.models import CNN, MLP, ViT


@dataclass(frozen=True)
class Workload:
    """A model family, its size, and its random batch."""

    name: str
    build: Callable[[Any], nnx.Module]  # dtype -> model
    input_shape: tuple[int, ...]
    classes: int
    description: str

    def model(self, dtype: Any) -> tuple[Any, Any]:
        return nnx.split(self.build(dtype), nnx.Param)

    def batch(self, seed: int = 0) -> tuple[jax.Array, jax.Array]:
        kx, ky = jax.random.split(jax.random.PRNGKey(seed))
        x = jax.random.normal(kx, self.input_shape, jnp.float32)
        y = jax.random.randint(ky, self.input_shape[:1], 0, self.classes)
        return x, y


def workloads(quick: bool) -> list[Workload]:
    """The MLP, ViT and CNN train steps; ``quick`` shrinks them to run in seconds."""
    if quick:
        mlp = {"features": 256, "width": 512, "depth": 4, "batch": 64}
        vit = {"dim": 128, "mlp_dim": 512, "depth": 2, "heads": 4, "batch": 16}
        cnn = {"widths": (16, 32, 64), "batch": 16}
    else:
        mlp = {"features": 1024, "width": 2048, "depth": 4, "batch": 256}
        vit = {"dim": 384, "mlp_dim": 1536, "depth": 6, "heads": 8, "batch": 128}
        cnn = {"widths": (32, 64, 128), "batch": 128}
    return [
        Workload(
            "mlp",
            lambda dt: MLP(features=mlp["features"], width=mlp["width"], depth=mlp["depth"],
                           classes=10, dtype=dt, rngs=nnx.Rngs(0)),
            (mlp["batch"], mlp["features"]), 10,
            f"MLP {mlp['features']}→{mlp['depth']}×{mlp['width']}→10, batch {mlp['batch']}"),
        Workload(
            "vit",
            lambda dt: ViT(image_size=32, channels=3, patch=4, dim=vit["dim"], depth=vit["depth"],
                           heads=vit["heads"], mlp_dim=vit["mlp_dim"], classes=10, dtype=dt,
                           rngs=nnx.Rngs(0)),
            (vit["batch"], 32, 32, 3), 10,
            f"ViT embed {vit['dim']}, MLP {vit['mlp_dim']}, {vit['depth']} layers, "
            f"{vit['heads']} heads, patch 4, 32×32×3, batch {vit['batch']}"),
        Workload(
            "cnn",
            lambda dt: CNN(channels=3, image_size=32, widths=cnn["widths"], classes=10,
                           dtype=dt, rngs=nnx.Rngs(0)),
            (cnn["batch"], 32, 32, 3), 10,
            f"CNN 3×conv3×3 {cnn['widths']} + avg-pool, 32×32×3, batch {cnn['batch']}"),
    ]


def make_step(graphdef: Any, tx: optax.GradientTransformation,
              cast: Callable[[Any, Any], tuple[Any, Any]] | None = None,
              out_cast: Callable[[Any], Any] | None = None) -> Callable:
    """Adam train step (params, opt_state, x, y) -> (params, opt_state, loss)."""

    def loss_fn(params: Any, x: jax.Array, y: jax.Array) -> jax.Array:
        if cast is not None:
            params, x = cast(params, x)
        logits = nnx.merge(graphdef, params)(x)
        if out_cast is not None:
            logits = out_cast(logits)
        logits = logits.astype(jnp.float32)
        return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()

    def step(params: Any, opt_state: Any, x: jax.Array, y: jax.Array) -> tuple[Any, Any, Any]:
        loss, grads = jax.value_and_grad(loss_fn)(params, x, y)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    return step


VARIANTS = ("f32", "flax bf16", "jmp bf16", "hlo_amp bf16", "hlo_amp bf16 only_if_faster",
            "jaxamp")
# The policy each hlo_amp variant compiles with.
HLO_AMP_POLICIES = {"hlo_amp bf16": "bf16",
                    "hlo_amp bf16 only_if_faster": "bf16,only_if_faster=true"}


def variant_step(workload: Workload, variant: str) -> tuple[Callable, Any, Any]:
    """(step, params, opt_state) for one variant; raises ImportError if it is unavailable."""
    tx = optax.adam(1e-4)
    if variant == "f32" or variant in HLO_AMP_POLICIES:
        graphdef, params = workload.model(jnp.float32)
        step = make_step(graphdef, tx)
    elif variant == "flax bf16":
        graphdef, params = workload.model(jnp.bfloat16)
        step = make_step(graphdef, tx)
    elif variant == "jmp bf16":
        import jmp

        policy = jmp.get_policy("params=float32,compute=bfloat16,output=float32")
        graphdef, params = workload.model(None)
        step = make_step(graphdef, tx, cast=lambda p, x: policy.cast_to_compute((p, x)),
                         out_cast=policy.cast_to_output)
    elif variant == "jaxamp":
        import jaxamp  # noqa: F401  (not installed in this environment)

        raise ImportError("jaxamp variant not wired up")
    else:
        raise ValueError(f"unknown variant {variant!r}; accepted: {', '.join(VARIANTS)}")
    return step, params, tx.init(params)


# ---- the deep-transformer stress: lower + rewrite only -------------------------------------


def _max_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB


def stress(layers: int, dim: int, batch: int) -> dict[str, Any]:
    """Lower a `layers`-deep ViT train step and run the pass; no XLA compile."""
    import hlo_amp

    model = ViT(image_size=32, channels=3, patch=4, dim=dim, depth=layers, heads=8,
                mlp_dim=4 * dim, classes=10, rngs=nnx.Rngs(0))
    graphdef, params = nnx.split(model, nnx.Param)
    tx = optax.adam(1e-4)
    opt_state = jax.eval_shape(tx.init, params)
    params = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), params)
    del model
    x = jax.ShapeDtypeStruct((batch, 32, 32, 3), jnp.float32)
    y = jax.ShapeDtypeStruct((batch,), jnp.int32)
    rss_before = _max_rss_mib()
    lowered = hlo_amp.compile(make_step(graphdef, tx), "bf16").lower(params, opt_state, x, y)
    text = lowered.as_text()
    ops = len(re.findall(r"^\s*(?:%[\w#:, %]+ = )?\"?(?:stablehlo|func|chlo)\.", text, re.MULTILINE))
    decisions = lowered.report().decisions
    return {
        "layers": layers, "dim": dim, "batch": batch,
        "ops": ops,
        "dots_convs": len(decisions),
        "converted": sum(1 for d in decisions if d.low_precision and d.changed),
        "lower_seconds": lowered.lower_seconds,
        "pass_seconds": lowered.pass_seconds,
        "max_rss_before_mib": rss_before,
        "max_rss_mib": _max_rss_mib(),
    }


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m benchmarks.workloads")
    sub = p.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("stress", help="lower + rewrite a deep transformer step, print JSON")
    s.add_argument("--layers", type=int, default=24)
    s.add_argument("--dim", type=int, default=384)
    s.add_argument("--batch", type=int, default=128)
    args = p.parse_args(argv)
    print(json.dumps(stress(args.layers, args.dim, args.batch)))


if __name__ == "__main__":
    main()
