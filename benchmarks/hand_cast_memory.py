"""XLA temp memory of hlo_amp's two 16-bit modes against f32 and the hand cast (issue 33,
item 4), at the models' own sizes: Keras MobileNetV3Small (64x64, batch 8), flax's
examples/vae (784 features, 500 hidden, 20 latents, batch 128) and flax's examples/mnist
CNN (28x28, batch 128), each train step compiled without a device for every target named.
tests/py/test_memory_vs_hand_cast.py asserts the same two checks on small shapes:

- ``mixed_bfloat16 <= hand cast``;
- each mode ``<= f32 + a 16-bit copy of every parameter``.

    JAX_PLATFORMS=cpu python -m benchmarks.hand_cast_memory [h100,h100+triton,tpu-v5e]

Figures are ``memory_analysis().temp_size_in_bytes``, compile outputs: the host CPU does
not change them (printed all the same). MobileNet's compiles take a minute each here.
"""

from __future__ import annotations

import argparse
import time
from typing import Any

import jax

import hlo_amp
from benchmarks.autopolicy_target import cpu_line
from benchmarks.cli_args import check_names, comma_names, split_names
from benchmarks.hand_cast_workloads import NAMES, hand_cast_case, param_bytes_16bit

# A target name -> (the device compiled for, XLA flags over its defaults).
COMPILES = {"h100": ("h100", {}), "tpu-v5e": ("tpu-v5e", {}),
            "h100+triton": ("h100", {"xla_gpu_enable_triton_gemm": True})}
VARIANTS = ("f32", "peer", "bf16", "mixed_bfloat16")


def compile_variant(name: str, target: str, variant: str, small: bool = False) -> Any:
    """One variant ("f32", "peer" or an hlo_amp mode) of model ``name`` compiled for
    ``target`` (a key of COMPILES) without the device."""
    device, flags = COMPILES[target]
    step, args = hand_cast_case(name, "peer" if variant == "peer" else "f32", small)
    if variant in ("f32", "peer"):
        return hlo_amp.compile_for_target(jax.jit(step), *args, target=device,
                                          compiler_options=flags)
    return hlo_amp.compile(step, variant).lower(*args, target=device).compile(flags)


def temp_bytes(name: str, target: str, variant: str, small: bool = False) -> int:
    """XLA temp bytes of ``compile_variant``'s executable."""
    compiled = compile_variant(name, target, variant, small)
    return int(compiled.memory_analysis().temp_size_in_bytes)


def parameter_copies(name: str, small: bool = False) -> int:
    """Bytes of a 16-bit copy of the model's trainable parameters (Keras: the trainable
    variables; the batch-norm statistics are never cast)."""
    args = hand_cast_case(name, "f32", small)[1]
    return param_bytes_16bit((args[0][0],) if name == "mobilenet" else args)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m benchmarks.hand_cast_memory",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("targets", nargs="?", type=comma_names, default="h100,h100+triton,tpu-v5e",
                   help=f"comma-separated, of {', '.join(COMPILES)} (default: all)")
    targets = split_names(p.parse_args(argv).targets)
    check_names(p, "targets", targets, COMPILES)
    print(f"- compiled on {cpu_line()}; jax {jax.__version__}; temp bytes per step\n")
    print("| model | target | f32 | hand cast | bf16 | mixed_bfloat16 | f32 + 16-bit "
          "parameters | mixed <= hand cast | modes <= f32 + parameters | seconds |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for name in NAMES:
        budget_extra = parameter_copies(name)
        for target in targets:
            start = time.perf_counter()
            temp = {v: temp_bytes(name, target, v) for v in VARIANTS}
            budget = temp["f32"] + budget_extra
            fast = "met" if temp["mixed_bfloat16"] <= temp["peer"] else "NOT MET"
            modes = ("met" if max(temp["bf16"], temp["mixed_bfloat16"]) <= budget
                     else "NOT MET")
            cells = " | ".join(f"{temp[v]:,}" for v in VARIANTS)
            print(f"| {name} | {target} | {cells} | {budget:,} | {fast} | {modes} | "
                  f"{time.perf_counter() - start:.0f} |", flush=True)


if __name__ == "__main__":
    main()
