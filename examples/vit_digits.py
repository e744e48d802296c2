"""Train a small Vision Transformer on scikit-learn's 8×8 digits three ways and compare.

    python examples/vit_digits.py [--steps 1000] [--batch 64] [--lr 1e-3] [--out out]

The same model, seed, data order and step count are trained with

* ``f32``      — ``jax.jit(step)``, the reference;
* ``hlo_amp bf16`` — ``hlo_amp.compile(step, "bf16")``: the train step's matmuls are
  rewritten to bf16 with f32 accumulation, no model code changes;
* ``hlo_amp f16``  — ``hlo_amp.compile(step, "f16")`` with the dynamic loss scaler; a
  step with non-finite gradients is skipped (``select_tree``).

It prints one table (test accuracy, final loss, step time, XLA temp memory, pass and
compile time) and writes the bf16 step's rewritten StableHLO, its report and a plot of
the loss curves under ``--out``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # `make demo` runs this file

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split

import hlo_amp
from examples.models import ViT
from hlo_amp.runtime.scaler import (
    DynamicScalerState,
    all_finite,
    dynamic_scale_value_and_grad,
    select_tree,
)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--steps", type=int, default=1000, help="train steps per variant")
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--lr", type=float, default=2e-3, help="peak learning rate (cosine decay)")
    p.add_argument("--warmup", type=int, default=100, help="linear warm-up steps")
    p.add_argument("--dim", type=int, default=64, help="embedding width")
    p.add_argument("--depth", type=int, default=4, help="encoder blocks")
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--mlp-dim", type=int, default=128)
    p.add_argument("--patch", type=int, default=2)
    p.add_argument("--dropout", type=float, default=0.1)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--log-every", type=int, default=250, help="progress line every N steps")
    p.add_argument("--out", type=Path, default=Path("out"), help="where artefacts go")
    p.add_argument("--variants", default="f32,bf16,f16",
                   help="comma-separated subset of f32,bf16,f16")
    return p.parse_args(argv)


# ---- data ------------------------------------------------------------------------------


def load_data(seed: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """scikit-learn's bundled digits (1797 8×8 images, 0..16), 80/20 stratified split."""
    digits = load_digits()
    images = (digits.images.astype(np.float32) / 16.0)[..., None]  # (n, 8, 8, 1) in [0, 1]
    images = (images - images.mean()) / images.std()
    labels = digits.target.astype(np.int32)
    return train_test_split(images, labels, test_size=0.2, random_state=seed, stratify=labels)


def batches(n: int, batch: int, steps: int, seed: int) -> np.ndarray:
    """Index of each step's batch: shuffled epochs, the same for every variant."""
    rng = np.random.default_rng(seed)
    out: list[np.ndarray] = []
    while len(out) < steps:
        perm = rng.permutation(n)
        out.extend(perm[i:i + batch] for i in range(0, n - batch + 1, batch))
    return np.stack(out[:steps])


# ---- the functional train step -----------------------------------------------------------


def make_fns(graphdef: Any, tx: optax.GradientTransformation
             ) -> tuple[Callable, Callable, Callable]:
    """Pure functions of arrays: train step, f16 train step (loss scaled), eval."""

    def loss_fn(params: Any, x: jax.Array, y: jax.Array, key: jax.Array) -> jax.Array:
        model = nnx.merge(graphdef, params)
        logits = model(x, train=True, key=key)
        return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()

    def step(params: Any, opt_state: Any, x: jax.Array, y: jax.Array, key: jax.Array
             ) -> tuple[Any, Any, jax.Array]:
        loss, grads = jax.value_and_grad(loss_fn)(params, x, y, key)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    scaled = dynamic_scale_value_and_grad(loss_fn)

    def step_scaled(params: Any, opt_state: Any, scaler: DynamicScalerState, x: jax.Array,
                    y: jax.Array, key: jax.Array) -> tuple[Any, Any, DynamicScalerState, jax.Array]:
        scaler, (loss, grads) = scaled(params, x, y, key, dynamic_scaler_state=scaler)
        updates, new_opt_state = tx.update(grads, opt_state, params)
        new_params = optax.apply_updates(params, updates)
        params, opt_state = select_tree(all_finite(grads), (new_params, new_opt_state),
                                        (params, opt_state))
        return params, opt_state, scaler, loss

    def evaluate(params: Any, x: jax.Array, y: jax.Array) -> jax.Array:
        logits = nnx.merge(graphdef, params)(x, train=False)
        return (jnp.argmax(logits, -1) == y).mean()

    return step, step_scaled, evaluate


@dataclass
class Run:
    """What one variant measured."""

    name: str
    losses: list[float] = field(default_factory=list)
    step_seconds: list[float] = field(default_factory=list)
    accuracy: float = float("nan")
    temp_bytes: int = 0
    pass_seconds: float | None = None
    compile_seconds: float = 0.0
    skipped: int = 0
    error: str | None = None


def train(name: str, args: argparse.Namespace, data: tuple, order: np.ndarray) -> tuple[Run, Any]:
    """Train one variant from the same initial parameters; returns the run and lowered step."""
    x_train, x_test, y_train, y_test = (jnp.asarray(a) for a in data)
    model = ViT(image_size=8, channels=1, patch=args.patch, dim=args.dim, depth=args.depth,
                heads=args.heads, mlp_dim=args.mlp_dim, classes=10, dropout=args.dropout,
                rngs=nnx.Rngs(args.seed))
    graphdef, params = nnx.split(model, nnx.Param)
    schedule = optax.warmup_cosine_decay_schedule(0.0, args.lr, args.warmup, args.steps,
                                                  end_value=args.lr * 0.01)
    tx = optax.adamw(schedule, weight_decay=1e-4)
    opt_state = tx.init(params)
    step, step_scaled, evaluate = make_fns(graphdef, tx)
    run = Run(name)
    key0 = jax.random.PRNGKey(args.seed + 1)
    scaler = DynamicScalerState()
    xb, yb = x_train[order[0]], y_train[order[0]]
    lowered_amp = None

    if name == "f32":
        start = time.perf_counter()
        compiled = jax.jit(step).lower(params, opt_state, xb, yb, key0).compile()
        run.compile_seconds = time.perf_counter() - start
        eval_fn = jax.jit(evaluate)
    else:
        fn = step if name == "bf16" else step_scaled
        amp = hlo_amp.compile(fn, name)
        lower_args = ((params, opt_state, xb, yb, key0) if name == "bf16"
                      else (params, opt_state, scaler, xb, yb, key0))
        lowered_amp = amp.lower(*lower_args)
        compiled = lowered_amp.compile()
        run.pass_seconds = lowered_amp.pass_seconds
        run.compile_seconds = compiled.compile_seconds
        eval_fn = hlo_amp.compile(evaluate, name)
    run.temp_bytes = int(compiled.memory_analysis().temp_size_in_bytes)

    try:
        _loop(name, args, run, compiled, params, opt_state, scaler, x_train, y_train, x_test,
              y_test, order, key0, eval_fn)
    except jax.errors.JaxRuntimeError as error:  # shown in the table, the other variants go on
        run.error = str(error).splitlines()[0]
        print(f"  [{name:>4}] FAILED at run time: {run.error}", flush=True)
    return run, lowered_amp


def _loop(name: str, args: argparse.Namespace, run: Run, compiled: Any, params: Any,
          opt_state: Any, scaler: DynamicScalerState, x_train: jax.Array, y_train: jax.Array,
          x_test: jax.Array, y_test: jax.Array, order: np.ndarray, key0: jax.Array,
          eval_fn: Callable) -> None:
    """The timed train loop, then test accuracy; fills ``run``."""
    for i in range(args.steps):
        idx = order[i]
        xb, yb = x_train[idx], y_train[idx]
        key = jax.random.fold_in(key0, i)
        start = time.perf_counter()
        if name == "f16":
            params, opt_state, scaler, loss = compiled(params, opt_state, scaler, xb, yb, key)
        else:
            params, opt_state, loss = compiled(params, opt_state, xb, yb, key)
        loss = float(jax.block_until_ready(loss))
        run.step_seconds.append(time.perf_counter() - start)
        run.losses.append(loss)
        if (i + 1) % args.log_every == 0 or i + 1 == args.steps:
            extra = f"  loss scale {float(scaler.scaler):g}" if name == "f16" else ""
            print(f"  [{name:>4}] step {i + 1:5d}/{args.steps}  loss {loss:.4f}  "
                  f"{1e3 * statistics.median(run.step_seconds):.2f} ms/step{extra}", flush=True)
    run.accuracy = float(eval_fn(params, x_test, y_test))
    if name == "f16":
        run.skipped = int(scaler.total_resets)


def table(runs: list[Run]) -> str:
    base = (statistics.median(runs[0].step_seconds)
            if runs and runs[0].name == "f32" and runs[0].step_seconds else None)
    head = ("variant", "test acc", "final loss", "step ms", "vs f32", "XLA temp",
            "pass ms", "XLA compile s")
    rows = []
    for r in runs:
        if r.error:
            rows.append((r.name if r.name == "f32" else f"hlo_amp {r.name}", "FAILED", "-", "-",
                         "-", f"{r.temp_bytes / 2**20:.2f} MiB",
                         "-" if r.pass_seconds is None else f"{1e3 * r.pass_seconds:.1f}",
                         f"{r.compile_seconds:.2f}"))
            continue
        med = statistics.median(r.step_seconds)
        final = statistics.mean(r.losses[-20:])  # last 20 steps: dropout makes one step noisy
        rows.append((
            r.name if r.name == "f32" else f"hlo_amp {r.name}",
            f"{100 * r.accuracy:.2f}%",
            f"{final:.5f}",
            f"{1e3 * med:.2f}",
            f"{base / med:.2f}x" if base else "-",
            f"{r.temp_bytes / 2**20:.2f} MiB",
            "-" if r.pass_seconds is None else f"{1e3 * r.pass_seconds:.1f}",
            f"{r.compile_seconds:.2f}",
        ))
    widths = [max(len(str(c)) for c in col) for col in zip(head, *rows)]
    lines = ["  ".join(str(c).rjust(w) for c, w in zip(row, widths)) for row in (head, *rows)]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def plot(runs: list[Run], path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    k = 1
    for r in runs:
        if r.error or not r.losses:
            continue
        losses = np.asarray(r.losses)
        k = max(1, len(losses) // 100)
        smooth = np.convolve(losses, np.ones(k) / k, mode="valid")
        ax.plot(np.arange(len(smooth)) + k, smooth,
                label=r.name if r.name == "f32" else f"hlo_amp {r.name}")
    ax.set_xlabel("step")
    ax.set_ylabel(f"train loss (moving mean, {k} steps)")
    ax.set_yscale("log")
    ax.set_title("ViT on sklearn digits: f32 vs hlo_amp bf16 / f16")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    unknown = set(variants) - {"f32", "bf16", "f16"}
    if unknown:
        raise SystemExit(f"--variants: unknown {sorted(unknown)}; accepted: f32, bf16, f16")
    data = load_data(args.seed)
    order = batches(len(data[0]), args.batch, args.steps, args.seed)
    print(f"jax {jax.__version__} on {jax.devices()[0].platform}; digits: "
          f"{len(data[0])} train / {len(data[1])} test images; ViT dim {args.dim}, "
          f"depth {args.depth}, heads {args.heads}, patch {args.patch}; "
          f"{args.steps} steps of batch {args.batch}", flush=True)
    runs: list[Run] = []
    lowered_bf16 = None
    for name in variants:
        print(f"training {name} ...", flush=True)
        run, lowered = train(name, args, data, order)
        runs.append(run)
        if name == "bf16":
            lowered_bf16 = lowered
    print()
    print(table(runs))
    for r in runs:
        if r.name == "f16" and not r.error:
            print(f"f16: {r.skipped} step(s) skipped for non-finite gradients (loss scaler)")
        if r.error:
            print(f"{r.name}: FAILED: {r.error}")

    args.out.mkdir(parents=True, exist_ok=True)
    written = []
    if lowered_bf16 is not None:
        mlir = args.out / "vit_bf16_step.mlir"
        mlir.write_text(lowered_bf16.as_text(debug_info=True))
        report = lowered_bf16.compile().report()
        (args.out / "vit_bf16_report.txt").write_text(str(report) + "\n")
        (args.out / "vit_bf16_report.json").write_text(_json_text(report.to_json()))
        written += [mlir, args.out / "vit_bf16_report.txt", args.out / "vit_bf16_report.json"]
        print()
        print("bf16 report summary:", report.summary())
    png = args.out / "loss_curves.png"
    plot(runs, png)
    written.append(png)
    print()
    print("wrote:")
    for path in written:
        print(f"  {path}")


def _json_text(value: Any) -> str:
    return value if isinstance(value, str) else json.dumps(value, indent=2)


if __name__ == "__main__":
    main()
