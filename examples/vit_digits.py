"""Train a small Vision Transformer on scikit-learn's 8×8 digits four ways and compare.

    python examples/vit_digits.py [--steps 1000] [--batch 64] [--lr 2e-3] [--out out]
    python examples/vit_digits.py --autopolicy 0.016   # + a policy found for that budget

The model (``examples/models.py``) and ``train_step`` are written as the Flax NNX guide
writes them: ``nnx.Dropout`` layers holding their RNG streams, a stateful
``nnx.Optimizer``, ``model.train()`` / ``model.eval()``. The same model, seed, data order
and step count are trained with

* ``f32``      — ``nnx.jit(train_step)``, the reference;
* ``hlo_amp bf16`` — ``hlo_amp.compile(train_step, "bf16")``: the step's matmuls are
  rewritten to bf16 with f32 accumulation; that line is the only difference from f32;
* ``hlo_amp f16``  — ``hlo_amp.compile(train_step_scaled, "f16")``: f16 needs the
  dynamic loss scaler, so this step takes its gradient through it, and the optimizer
  skips a step whose gradients are not finite (``optax.apply_if_finite``);
* ``hlo_amp mixed_bfloat16`` — ``hlo_amp.compile(train_step, "mixed_bfloat16")``: bf16
  matmuls and the activations between them kept in bf16;
* ``hlo_amp mixed_float16`` (``--variants ...,mixed_f16``, not in the default) —
  ``hlo_amp.compile(train_step_scaled, "mixed_float16")``, like ``f16``;
* ``hlo_amp fp8`` (``--variants f32,bf16,fp8``, not in the default) —
  ``hlo_amp.compile(train_step, "fp8")``: per-tensor-scaled fp8 dots (on CPU a numerics
  preview, computed in f32; see docs/fp8.md).

With ``--autopolicy BUDGET`` it first runs ``hlo_amp.autopolicy`` on the train step (its
first batch, scopes at ``--autopolicy-depth``, default 2), prints the attribution table and
the chosen policy, writes them and a bar chart under ``--out``, and trains that policy as
one more variant, ``hlo_amp autopolicy``.

It prints one table (test accuracy, final loss, step time, XLA temp memory, pass and
compile time) and writes the bf16 step's rewritten StableHLO, its report, the report's
picture of FLOPs per scope by precision (``vit_bf16_flops.png``) and a plot of the loss
curves under ``--out``. ``run_variant("mixed_bf16", steps=1000)`` trains one
variant from Python (a test) and returns its test accuracy.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # `make demo` runs this file

# hlo_amp before jax: without a GPU or TPU it starts jax on CPU and drops the CUDA stub's
# lines jax's import prints (README, "Checking a GPU or TPU you do not have").
import hlo_amp  # noqa: I001
import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split

from benchmarks.cli_args import check_out_dir, non_negative_int, positive_int
from benchmarks.run import cpu_bf16_line, machine
from examples.models import ViT
from hlo_amp import DynamicScalerState, dynamic_scale_value_and_grad

# Variant name (``--variants``) -> hlo_amp policy; ``f32`` is plain ``nnx.jit``.
POLICIES = {"bf16": "bf16", "f16": "f16", "mixed_bf16": "mixed_bfloat16",
            "mixed_f16": "mixed_float16", "fp8": "fp8"}
LABELS = {"f32": "f32", "bf16": "hlo_amp bf16", "f16": "hlo_amp f16",
          "mixed_bf16": "hlo_amp mixed_bfloat16", "mixed_f16": "hlo_amp mixed_float16",
          "fp8": "hlo_amp fp8"}
SCALED = frozenset({"f16", "mixed_f16"})  # trained with the dynamic loss scaler
AUTO = "auto"  # the --autopolicy variant; main() adds it to POLICIES and LABELS
DEFAULT_VARIANTS = ("f32", "bf16", "f16", "mixed_bf16")
IMAGE_SIZE = 8  # the digits are 8 x 8
TRAIN_IMAGES = 1437  # load_data's 80% of the 1797 digits


def parse_args(argv: list[str] | None = None, check_out: bool = True) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--steps", type=positive_int, default=1000, help="train steps per variant")
    p.add_argument("--batch", type=positive_int, default=64,
                   help=f"at most the {TRAIN_IMAGES} training images")
    p.add_argument("--lr", type=float, default=2e-3, help="peak learning rate (cosine decay)")
    p.add_argument("--warmup", type=non_negative_int, default=100, help="linear warm-up steps")
    p.add_argument("--dim", type=positive_int, default=64, help="embedding width")
    p.add_argument("--depth", type=positive_int, default=4, help="encoder blocks")
    p.add_argument("--heads", type=positive_int, default=4, help="dividing --dim")
    p.add_argument("--mlp-dim", type=positive_int, default=128,
                   help="hidden width of each block's MLP")
    p.add_argument("--patch", type=positive_int, default=2,
                   help=f"dividing the image size, {IMAGE_SIZE}")
    p.add_argument("--dropout", type=float, default=0.1,
                   help="dropout rate in [0, 1) (training only)")
    p.add_argument("--seed", type=non_negative_int, default=0,
                   help="seed of the initial weights (dropout draws from the next)")
    p.add_argument("--log-every", type=positive_int, default=250,
                   help="progress line every N steps")
    p.add_argument("--out", type=Path, default=Path("out"), help="where artefacts go")
    p.add_argument("--variants", default=",".join(DEFAULT_VARIANTS),
                   help=f"comma-separated subset of {','.join(LABELS)}")
    p.add_argument("--autopolicy", type=float, default=None, metavar="BUDGET",
                   help="also train the policy hlo_amp.autopolicy finds for this error "
                        "budget (max over the step's outputs of max|a-e|/max|e| vs f32)")
    p.add_argument("--autopolicy-depth", type=positive_int, default=2,
                   help="name-stack depth of the scopes --autopolicy may keep f32")
    args = p.parse_args(argv)
    check_args(args, p.error)
    if check_out:  # before any training (the runs trained, and mkdir failed at the end)
        check_out_dir(p, "--out", args.out)
    return args


def check_args(args: argparse.Namespace, error: Callable[[str], Any]) -> None:
    """Checked before any training (``parse_args``' values, and ``run_variant``'s
    options, which skip argparse): a bad value is one line, not a traceback from the
    model, the data or the last step, nor a loop that never ends."""
    for name in ("steps", "batch", "dim", "depth", "heads", "mlp_dim", "patch", "log_every"):
        if not getattr(args, name) >= 1:
            error(f"--{name.replace('_', '-')} {getattr(args, name)} is below 1")
    if args.batch > TRAIN_IMAGES:  # batches() would never fill a step
        error(f"--batch {args.batch} is more than the {TRAIN_IMAGES} training images")
    if args.dim % args.heads:
        error(f"--heads {args.heads} does not divide --dim {args.dim}")
    if IMAGE_SIZE % args.patch:
        error(f"--patch {args.patch} does not divide the image size {IMAGE_SIZE}")
    if not 0 <= args.dropout < 1:
        error(f"--dropout {args.dropout} is not in [0, 1)")
    if not 0 < args.lr < math.inf:  # inf trained to a NaN loss
        error(f"--lr {args.lr} is not a positive finite number")
    if not 0 <= args.seed < 2**32:  # scikit-learn's split takes a 32-bit seed
        error(f"--seed {args.seed} is not in [0, 2**32)")
    if args.autopolicy is not None and not args.autopolicy > 0:
        error(f"--autopolicy {args.autopolicy} is not a positive error budget")


# ---- data ------------------------------------------------------------------------------


def load_data(seed: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """scikit-learn's bundled digits (1797 8×8 images, 0..16), 80/20 stratified split
    (``TRAIN_IMAGES`` to train on)."""
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


# ---- the train step, written once as the Flax NNX guide writes it -------------------------


def loss_fn(model: ViT, x: jax.Array, y: jax.Array) -> jax.Array:
    logits = model(x)
    return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()


def train_step(model: ViT, optimizer: nnx.Optimizer, x: jax.Array, y: jax.Array
               ) -> jax.Array:
    """One AdamW step; the model and optimizer are updated in place."""
    loss, grads = nnx.value_and_grad(loss_fn)(model, x, y)
    optimizer.update(model, grads)
    return loss


def eval_step(model: ViT, x: jax.Array, y: jax.Array) -> jax.Array:
    """Accuracy of ``model`` (in eval mode: no dropout) on a batch."""
    return (jnp.argmax(model(x), -1) == y).mean()


def train_step_scaled(model: ViT, optimizer: nnx.Optimizer, scaler: DynamicScalerState,
                      x: jax.Array, y: jax.Array) -> tuple[jax.Array, DynamicScalerState]:
    """``train_step`` with the dynamic loss scaler that f16 needs.

    The scaler differentiates with ``jax.value_and_grad``, which takes arrays, not NNX
    modules: the parameters are split out of the model, the loss is taken on a copy
    merged from them, and the copy's other state (its dropout RNG counts) is written
    back. The optimizer skips non-finite gradients (``make_optimizer(scaled=True)``).
    """
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)

    def loss_of_params(params: nnx.State, rest: nnx.State) -> tuple[jax.Array, nnx.State]:
        copy = nnx.merge(graphdef, params, rest, copy=True)
        return loss_fn(copy, x, y), nnx.state(copy, nnx.Not(nnx.Param))

    scaler, ((loss, rest), grads) = dynamic_scale_value_and_grad(
        loss_of_params, has_aux=True)(params, rest, dynamic_scaler_state=scaler)
    nnx.update(model, rest)
    optimizer.update(model, grads)
    return loss, scaler


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
    report: Any = None  # hlo_amp variants: the pass's report after XLA compiled the step


def make_model(args: argparse.Namespace) -> ViT:
    """The ViT, initialised from ``--seed``; its dropout layers draw from the next seed."""
    return ViT(image_size=8, channels=1, patch=args.patch, dim=args.dim, depth=args.depth,
               heads=args.heads, mlp_dim=args.mlp_dim, classes=10, dropout=args.dropout,
               rngs=nnx.Rngs(params=args.seed, dropout=args.seed + 1))


def make_optimizer(model: ViT, args: argparse.Namespace, *, scaled: bool = False
                   ) -> nnx.Optimizer:
    """AdamW, linear warm-up then cosine decay. ``scaled``: a step whose gradients are not
    finite (the loss scaler backs off) updates nothing."""
    # A run shorter than the warm-up (a quick check) warms up for half its steps.
    warmup = args.warmup if args.warmup < args.steps else args.steps // 2
    schedule = optax.warmup_cosine_decay_schedule(0.0, args.lr, warmup, args.steps,
                                                  end_value=args.lr * 0.01)
    tx = optax.adamw(schedule, weight_decay=1e-4)
    if scaled:
        # More than the 15 halvings from the scaler's 2**15 to its floor of 1: gradients
        # still not finite after that are divergence, and should show.
        tx = optax.apply_if_finite(tx, max_consecutive_errors=20)
    return nnx.Optimizer(model, tx, wrt=nnx.Param)


def jit_variant(name: str) -> tuple[Callable, Callable]:
    """The variant's train and eval steps: ``nnx.jit`` for f32, ``hlo_amp.compile`` with
    the variant's policy for the others. The steps themselves are the same functions."""
    if name == "f32":
        return nnx.jit(train_step), nnx.jit(eval_step)
    step = train_step_scaled if name in SCALED else train_step
    return hlo_amp.compile(step, POLICIES[name]), hlo_amp.compile(eval_step, POLICIES[name])


def train(name: str, args: argparse.Namespace, data: tuple, order: np.ndarray, *,
          measure: bool = True) -> tuple[Run, Any]:
    """Train one variant from the same initial model; returns the run and, for hlo_amp
    variants measured, the lowered step.

    ``measure``: also lower and compile the step ahead of time for the table's compile
    and memory columns and the report (one XLA compile more than training needs).
    """
    # Batches are cut on the host, as a data loader does: indexing a jax array would
    # dispatch a gather and its index ops eagerly at every step (about 2 s of a 28 s
    # 300-step f32 training on a 2-core CPU).
    x_train, y_train = np.asarray(data[0]), np.asarray(data[2])
    x_test, y_test = jnp.asarray(data[1]), jnp.asarray(data[3])
    model = make_model(args)
    optimizer = make_optimizer(model, args, scaled=name in SCALED)
    scaler = DynamicScalerState() if name in SCALED else None
    model.train()  # dropout on, as the step is lowered and trained
    run = Run(name)
    step, evaluate = jit_variant(name)
    extra = (scaler,) if name in SCALED else ()
    lowered_amp = None
    if measure:
        batch = (x_train[order[0]], y_train[order[0]])
        try:
            start = time.perf_counter()
            lowered = step.lower(model, optimizer, *extra, *batch)
            compiled = lowered.compile()
        except Exception as error:  # noqa: BLE001 - shown in the table, the others go on
            run.error = f"failed to compile: {str(error).splitlines()[0]}"
            print(f"  [{name:>4}] {run.error}", flush=True)
            return run, None
        if name == "f32":
            run.compile_seconds = time.perf_counter() - start  # lowering included
        else:
            lowered_amp = lowered
            run.pass_seconds = lowered.pass_seconds
            run.compile_seconds = compiled.compile_seconds
            run.report = compiled.report()
        run.temp_bytes = int(compiled.memory_analysis().temp_size_in_bytes)

    # Flax's advice for training loops: nnx.cached_partial splits the model's and the
    # optimizer's object graph once, not at every call; the same step, the same numbers
    # (the steps' Python share is a fifth to a quarter less).
    step_on_model = nnx.cached_partial(step, model, optimizer)
    try:
        since, last = time.perf_counter(), 0  # for the progress lines of an unmeasured run
        for i in range(args.steps):
            xb, yb = x_train[order[i]], y_train[order[i]]
            start = time.perf_counter()
            if name in SCALED:
                loss, scaler = step_on_model(scaler, xb, yb)
            else:
                loss = step_on_model(xb, yb)
            if measure:  # the table's per-step times: wait for each step
                loss = float(jax.block_until_ready(loss))
                run.step_seconds.append(time.perf_counter() - start)
            # Unmeasured, steps are dispatched ahead: Python's share of a step overlaps
            # XLA's compute of the one before (about 15% of a step on 2 CPU cores).
            run.losses.append(loss)
            if i == 0 and not measure:  # the first call compiles: timed from the second
                jax.block_until_ready(loss)
                since, last = time.perf_counter(), 1
            if (i + 1) % args.log_every == 0 or i + 1 == args.steps:
                loss = float(loss)
                if measure:
                    per_step = _step_median(run)
                else:
                    per_step = ((time.perf_counter() - since) / (i + 1 - last)
                                if i + 1 > last else None)
                    since, last = time.perf_counter(), i + 1
                timing = ("  first step (compiles)" if per_step is None
                          else f"  {1e3 * per_step:.2f} ms/step")
                scale = f"  loss scale {float(scaler.scaler):g}" if name in SCALED else ""
                print(f"  [{name:>4}] step {i + 1:5d}/{args.steps}  loss {loss:.4f}"
                      f"{timing}{scale}", flush=True)
        run.losses = [float(loss) for loss in run.losses]
        model.eval()
        run.accuracy = float(evaluate(model, x_test, y_test))
    except Exception as error:  # noqa: BLE001 - shown in the table, the others go on
        run.error = str(error).splitlines()[0]
        print(f"  [{name:>4}] FAILED: {run.error}", flush=True)
    if name in SCALED:
        run.skipped = int(scaler.total_resets)
    return run, lowered_amp


def _step_median(run: Run) -> float | None:
    """The median step, the first left out: an hlo_amp step compiles again on its first
    call (2.4 s against 86 ms in a 2-step run). None for a run of one step, whose only
    call compiled (its 'vs f32' compared a compile with f32's step: 0.02x)."""
    return statistics.median(run.step_seconds[1:]) if len(run.step_seconds) > 1 else None


def table(runs: list[Run]) -> str:
    # Against the f32 run wherever it is in the list (listed second, no ratio was given).
    f32 = next((r for r in runs if r.name == "f32" and not r.error and r.step_seconds), None)
    base = _step_median(f32) if f32 is not None else None
    head = ("variant", "test acc", "final loss", "step ms", "vs f32", "XLA temp",
            "pass ms", "XLA compile s")
    rows = []
    for r in runs:
        if r.error:
            rows.append((LABELS[r.name], "FAILED", "-", "-",
                         "-", f"{r.temp_bytes / 2**20:.2f} MiB",
                         "-" if r.pass_seconds is None else f"{1e3 * r.pass_seconds:.1f}",
                         f"{r.compile_seconds:.2f}"))
            continue
        med = _step_median(r)
        final = statistics.mean(r.losses[-20:])  # last 20 steps: dropout makes one step noisy
        rows.append((
            LABELS[r.name],
            f"{100 * r.accuracy:.2f}%",
            f"{final:.5f}",
            "-" if med is None else f"{1e3 * med:.2f}",
            f"{base / med:.2f}x" if base and med else "-",
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
        ax.plot(np.arange(len(smooth)) + k, smooth, label=LABELS[r.name])
    ax.set_xlabel("step")
    ax.set_ylabel(f"train loss (moving mean, {k} steps)")
    ax.set_yscale("log")
    ax.set_title("ViT on sklearn digits: train loss, f32 nnx.jit vs hlo_amp policies")
    if ax.lines:  # every variant failed: an empty plot, and no legend to warn about
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def parse_variants(spec: str) -> list[str]:
    """``"f32,bf16"`` -> ``["f32", "bf16"]``; SystemExit on an unknown name."""
    variants = [v.strip() for v in spec.split(",") if v.strip()]
    unknown = set(variants) - set(LABELS)
    if unknown or not variants:  # none named trained nothing and exited 0
        raise SystemExit(f"--variants: {f'unknown {sorted(unknown)}' if unknown else 'none named'}"
                         f"; accepted: {', '.join(LABELS)}")
    return variants


def run_variant(name: str, steps: int = 1000, **options: Any) -> float:
    """Train one variant (``f32``, ``bf16``, ``f16``, ``mixed_bf16``, ``mixed_f16``, ``fp8``) and
    return its test accuracy in [0, 1]; ``options`` override the other CLI defaults
    (for example ``batch=32``, ``seed=1``, or ``log_every=10**9`` for the last step's
    progress line alone).

    Raises RuntimeError if the variant failed to compile or to run.
    """
    if name not in LABELS:
        raise ValueError(f"unknown variant {name!r}; accepted: {', '.join(LABELS)}")
    # The defaults, not sys.argv; nothing is written, so --out is not checked (a file
    # named "out" in the working directory made argparse exit).
    args = parse_args([], check_out=False)
    args.steps = steps
    for key, value in options.items():
        if not hasattr(args, key):
            raise TypeError(f"run_variant: unknown option {key!r}")
        setattr(args, key, value)

    def refuse(message: str) -> None:
        raise ValueError(f"run_variant: {message}")

    check_args(args, refuse)  # batch=2000 looped forever, steps=0 raised numpy's error
    data = load_data(args.seed)
    order = batches(len(data[0]), args.batch, args.steps, args.seed)
    run, _ = train(name, args, data, order, measure=False)
    if run.error:
        raise RuntimeError(f"{LABELS[name]}: {run.error}")
    return run.accuracy


def choose_policy(args: argparse.Namespace, data: tuple, order: np.ndarray) -> Any:
    """``hlo_amp.autopolicy`` on the train step and its first batch, from bf16; the chosen
    policy becomes the ``auto`` variant.

    autopolicy takes arrays and pytrees, as ``jax.jit`` does, not NNX objects: it gets the
    same ``train_step`` as a pure function of the model's and optimizer's state (whose
    updated parameters and AdamW moments are among the outputs it measures), traced under
    ``hlo_amp.module_scopes`` so its scopes are the model's paths.
    """
    x_train, y_train = jnp.asarray(data[0]), jnp.asarray(data[2])
    model = make_model(args)
    model.train()
    graphdef, state = nnx.split((model, make_optimizer(model, args)))

    def pure_step(state: nnx.State, x: jax.Array, y: jax.Array) -> tuple[nnx.State, jax.Array]:
        model, optimizer = nnx.merge(graphdef, state)
        loss = train_step(model, optimizer, x, y)
        return nnx.state((model, optimizer)), loss

    result = hlo_amp.autopolicy(hlo_amp.module_scopes(model)(pure_step), state,
                                x_train[order[0]], y_train[order[0]],
                                budget=args.autopolicy, depth=args.autopolicy_depth,
                                base="bf16")
    POLICIES[AUTO] = result.policy.to_string()
    LABELS[AUTO] = "hlo_amp autopolicy"
    return result


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    variants = parse_variants(args.variants)
    data = load_data(args.seed)
    order = batches(len(data[0]), args.batch, args.steps, args.seed)
    print(f"jax {jax.__version__} on {jax.devices()[0].platform}; digits: "
          f"{len(data[0])} train / {len(data[1])} test images; ViT dim {args.dim}, "
          f"depth {args.depth}, heads {args.heads}, patch {args.patch}; "
          f"{args.steps} steps of batch {args.batch}", flush=True)
    if jax.devices()[0].platform == "cpu":  # timings compare only on like CPUs
        print(cpu_bf16_line(machine("cpu")).removeprefix("- "), flush=True)
    chosen = None
    if args.autopolicy is not None:
        print(f"autopolicy: budget {args.autopolicy:g}, scopes at depth "
              f"{args.autopolicy_depth} of the bf16 train step ...", flush=True)
        try:
            chosen = choose_policy(args, data, order)
        except ValueError as error:  # a depth beyond the step's deepest scope, ...
            raise SystemExit(f"vit_digits.py: error: --autopolicy-depth "
                             f"{args.autopolicy_depth}: {error}") from None
        print(chosen.attribution)
        print(chosen)
        variants = [*variants, AUTO]
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
        if r.name in SCALED and not r.error:
            print(f"{r.name}: {r.skipped} step(s) skipped for non-finite gradients (loss scaler)")
        if r.error:
            print(f"{r.name}: FAILED: {r.error}")

    args.out.mkdir(parents=True, exist_ok=True)
    written = []
    by_name = {r.name: r for r in runs}
    if lowered_bf16 is not None:
        mlir = args.out / "vit_bf16_step.mlir"
        mlir.write_text(lowered_bf16.as_text(debug_info=True))
        report = by_name["bf16"].report
        (args.out / "vit_bf16_report.txt").write_text(str(report) + "\n")
        (args.out / "vit_bf16_report.json").write_text(_json_text(report.to_json()))
        flops_png = report.plot(args.out / "vit_bf16_flops.png", depth=3)  # blocks/i/attn
        written += [mlir, args.out / "vit_bf16_report.txt", args.out / "vit_bf16_report.json",
                    flops_png]
        print()
        print("bf16 report summary:", report.summary())
    others = [r for r in runs if r.name != "bf16" and r.report is not None]
    if others and lowered_bf16 is None:
        print()
    for run in others:  # the other hlo_amp variants' summaries (fp8: its kept-by-XLA line)
        print(f"{LABELS[run.name].removeprefix('hlo_amp ')} report summary:",
              run.report.summary())
    if chosen is not None:
        stem = args.out / "vit_autopolicy"
        stem.with_suffix(".txt").write_text(f"{chosen.attribution}\n\n{chosen}\n")
        stem.with_suffix(".json").write_text(chosen.to_json())
        chosen.attribution.plot(args.out / "vit_attribution.png", budget=chosen.budget)
        written += [stem.with_suffix(".txt"), stem.with_suffix(".json"),
                    args.out / "vit_attribution.png"]
        print(f"autopolicy variant trained with: {POLICIES[AUTO]}")
    png = args.out / "loss_curves.png"
    plot(runs, png)
    written.append(png)
    print()
    print("wrote:")
    for path in written:
        print(f"  {path}")
    failed = [r.name for r in runs if r.error]
    if failed:
        raise SystemExit(f"failed: {', '.join(failed)} (above)")


def _json_text(value: Any) -> str:
    return value if isinstance(value, str) else json.dumps(value, indent=2)


if __name__ == "__main__":
    main()
