"""One process of tests/py/test_multiprocess.py: a sharded train step under hlo_amp.compile.

    python multiprocess_worker.py --num-processes 2 --process-id 0 --port 12345 --out DIR
    python multiprocess_worker.py --num-processes 1 --out DIR          # the 8-device reference

With ``--num-processes 2`` each process has 4 CPU devices and joins the other through
``jax.distributed.initialize`` (gloo collectives); with 1 it has 8 devices and no
distributed runtime. Either way the program sees the same global (4, 2) ("data", "model")
mesh over 8 devices and runs the same steps on the same global arrays: a small MLP
(data x model sharded) under hlo_amp bf16 and jax.jit, then the tiny Llama-style decoder
of benchmarks/llm.py under hlo_amp bf16, its parameters FSDP-sharded over a global
(fsdp=4, tp=2) mesh whose fsdp axis spans both processes. Each process writes
``process_<id>.npz`` (losses and final parameters, gathered to host; the decoder's
prefixed ``decoder_``) and ``process_<id>.json`` (device counts and what the pass did)
under ``--out``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

TOTAL_DEVICES = 8
STEPS = 3
LR = 0.1
DECODER_STEPS = 2


def _widened(decision) -> bool:
    """Whether the CPU layout pass computed the dot in f32 (a partitioned program)."""
    return any(note.startswith("dot computed from f32 copies") for note in decision.notes)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--num-processes", type=int, required=True)
    parser.add_argument("--process-id", type=int, default=0)
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--out", required=True)
    args = parser.parse_args(argv)

    local_devices = TOTAL_DEVICES // args.num_processes
    # Must be set before jax is imported.
    # LLVM at -O0 halves the decoder's compile time (three processes compile it at once).
    # XLA's optimized HLO is the same; the machine code may round differently at the ulp
    # level (FMA contraction, say), alike in every process compared.
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                               f" --xla_force_host_platform_device_count={local_devices}"
                               " --xla_backend_optimization_level=0"
                               " --xla_llvm_disable_expensive_passes=true")
    os.environ["JAX_PLATFORMS"] = "cpu"

    import jax

    if args.num_processes > 1:
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
        jax.distributed.initialize(coordinator_address=f"localhost:{args.port}",
                                   num_processes=args.num_processes,
                                   process_id=args.process_id,
                                   initialization_timeout=60)

    import jax.numpy as jnp
    import numpy as np
    from jax.experimental import multihost_utils
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    import hlo_amp

    meta = {"process_index": jax.process_index(), "process_count": jax.process_count(),
            "device_count": jax.device_count(), "local_device_count": jax.local_device_count()}

    mesh = Mesh(np.array(jax.devices()).reshape(4, 2), ("data", "model"))

    # The global values, computed the same way in every process (numpy, fixed seed).
    rng = np.random.default_rng(0)
    host = {
        "w1": (rng.standard_normal((16, 32)) / 4).astype(np.float32),
        "b1": np.zeros((32,), np.float32),
        "w2": (rng.standard_normal((32, 8)) / 6).astype(np.float32),
    }
    host_x = rng.standard_normal((32, 16)).astype(np.float32)
    host_y = rng.standard_normal((32, 8)).astype(np.float32)

    shardings = {"w1": NamedSharding(mesh, P(None, "model")),
                 "b1": NamedSharding(mesh, P("model")),
                 "w2": NamedSharding(mesh, P("model", None))}
    batch_sharding = NamedSharding(mesh, P("data", None))

    def global_array(value: np.ndarray, sharding: NamedSharding) -> jax.Array:
        # Each process fills only the shards its own devices hold.
        return jax.make_array_from_callback(value.shape, sharding, lambda index: value[index])

    params = {k: global_array(v, shardings[k]) for k, v in host.items()}
    x = global_array(host_x, batch_sharding)
    y = global_array(host_y, batch_sharding)
    meta["x_addressable_rows"] = sum(s.data.shape[0] for s in x.addressable_shards
                                     if s.replica_id == 0)

    def loss_fn(params, x, y):
        hidden = jnp.tanh(x @ params["w1"] + params["b1"])
        return jnp.mean((hidden @ params["w2"] - y) ** 2)

    def step(params, x, y):
        loss, grads = jax.value_and_grad(loss_fn)(params, x, y)
        return jax.tree.map(lambda p, g: p - LR * g, params, grads), loss

    amp = hlo_amp.compile(step, "bf16")
    lowered = amp.lower(params, x, y)
    decisions = lowered.report().decisions
    # A dot XLA:CPU takes in bf16 only once relaid is computed in f32 in a partitioned
    # program (passes/dot_layout.py): "f32 by the layout pass".
    meta["decisions"] = [[d.op_kind, bool(d.low_precision) or _widened(d), bool(d.changed)]
                         for d in decisions]
    meta["low_decisions"] = sum(d.low_precision for d in decisions)
    meta["rewritten_has_bf16"] = "bf16" in lowered.as_text()
    meta["original_has_bf16"] = "bf16" in lowered.original_text()

    def run(fn, name):
        p, losses = params, []
        for _ in range(STEPS):
            p, loss = fn(p, x, y)
            losses.append(loss)
        meta[name + "_w1_spec"] = str(p["w1"].sharding.spec)
        # Parameters are sharded over "model" (and the loss replicated); gather the global
        # values to every host before reading them.
        gathered = multihost_utils.process_allgather(p, tiled=True)
        return ({k: np.asarray(v) for k, v in gathered.items()},
                np.asarray(multihost_utils.process_allgather(jnp.stack(losses), tiled=True)))

    amp_params, amp_losses = run(amp, "amp")
    jit_params, jit_losses = run(jax.jit(step), "jit")

    arrays = {"losses": amp_losses, "jit_losses": jit_losses}
    arrays.update({f"param_{k}": v for k, v in amp_params.items()})
    arrays.update({f"jit_param_{k}": v for k, v in jit_params.items()})
    arrays.update(train_decoder(global_array, meta))
    pid = jax.process_index()
    np.savez(os.path.join(args.out, f"process_{pid}.npz"), **arrays)
    with open(os.path.join(args.out, f"process_{pid}.json"), "w") as f:
        json.dump(meta, f)
    print(f"process {pid}: done", file=sys.stderr)


def train_decoder(global_array, meta: dict) -> dict:
    """The tiny decoder's AdamW step under hlo_amp bf16 on the global (fsdp=4, tp=2) mesh,
    ``DECODER_STEPS`` steps: its losses and final parameters as host arrays."""
    import dataclasses

    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    import hlo_amp

    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
    from benchmarks import llm

    # tests/py/test_llm_benchmark.py's one-block model; a batch of 8 sequences of 16 + 1.
    # Unrolled: its one block is params["blocks"][0] (test_llm_benchmark checks the
    # scanned form against this one).
    config = dataclasses.replace(llm.SMALL, layers=1, dim=128, hidden=256, vocab=512,
                                 seq=16, batch=8, scan_layers=False)
    # Devices 0-3 are process 0's, 4-7 process 1's: fsdp's 4 rows span both processes,
    # tp's pairs stay inside one.
    mesh = Mesh(np.array(jax.devices()).reshape(4, 2), ("fsdp", "tp"))
    meta["decoder_fsdp_processes"] = sorted({d.process_index for d in mesh.devices[:, 0]})
    shardings = jax.tree.map(lambda a: a.sharding, llm.abstract_state(config, mesh))
    # The same values in every process (numpy, fixed seed; llm.init_params's normal(0.02)
    # weights and unit norms, without compiling its RNG in three processes), then each
    # process fills its own shards.
    rng = np.random.default_rng(1)
    host_params = jax.tree.map(
        lambda shape: (np.ones(shape, np.float32) if len(shape) == 1 else
                       (0.02 * rng.standard_normal(shape)).astype(np.float32)),
        llm.param_shapes(config), is_leaf=lambda x: isinstance(x, tuple))
    host_tokens = rng.integers(0, config.vocab, (config.batch, config.seq + 1), np.int32)
    zeros = jax.tree.map(np.zeros_like, host_params)
    host_state = (host_params, {"count": np.zeros((), np.int32), "mu": zeros, "nu": zeros},
                  host_tokens)
    params, opt_state, tokens = jax.tree.map(global_array, host_state, shardings)
    wq = params["blocks"][0]["wq"]
    meta["decoder_wq_addressable_rows"] = len({s.index[0].start for s in
                                               wq.addressable_shards}) * wq.shape[0] // 4

    # One trace, one pass and one compile serve the report and the steps.
    lowered = hlo_amp.compile(llm.make_train_step(config, jnp.float32, mesh), "bf16").lower(
        params, opt_state, tokens)
    meta["decoder_dots"] = [["widened"] if _widened(d) else list(d.operands_after)
                            for d in lowered.report().decisions if d.op_kind == "dot_general"]
    step = lowered.compile()
    losses = []
    for _ in range(DECODER_STEPS):
        params, opt_state, loss = step(params, opt_state, tokens)
        losses.append(float(loss))  # replicated: every process holds it
    meta["decoder_spec_kept"] = (
        jax.tree.map(lambda a: str(a.sharding.spec), params)
        == jax.tree.map(lambda s: str(s.spec), shardings[0]))
    # Every parameter replicated to every device in one program, then read locally.
    gathered = jax.jit(lambda tree: tree, out_shardings=NamedSharding(mesh, P()))(params)
    arrays = {"decoder_losses": np.array(losses, np.float32)}
    for path, value in jax.tree_util.tree_flatten_with_path(gathered)[0]:
        name = "_".join(str(getattr(k, "key", getattr(k, "idx", k))) for k in path)
        arrays[f"decoder_{name}"] = np.asarray(value)
    return arrays


if __name__ == "__main__":
    main()
