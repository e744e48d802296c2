"""The demo ViT (examples/vit_digits.py, real digits data, its default model and learning
rate schedule) trained STEPS steps in the mixed_* modes reaches f32's test accuracy within
one point, and with "fp8" within two (issue 11's bound for 8-bit dots).

The slowest test here: four STEPS-step trainings of the NNX ViT on the 1,437 training
images, scored on the 360 held-out ones. 300 steps (the schedule's warm-up and cosine
decay fitted to them) is past the point where f32 scores over 80%: here f32, mixed_bf16,
mixed_f16 and fp8 all score 84.2% (303 of 360) at 300 steps; at 500, 91.9%, 91.1%, 91.9%
and 91.4%, for two thirds more of `make test`'s time.

They draw dropout masks with jax's original threefry layout
(``jax.threefry_partitionable(False)``). XLA:CPU takes about three times as long for the
default, partitionable one: 21 of a 38 ms f32 step here against 7 of 25. Every variant
draws from the same stream either way, which is what the comparison needs.
"""

from __future__ import annotations

from collections.abc import Iterator

import jax
import pytest

from examples.vit_digits import run_variant

STEPS = 300


@pytest.fixture(scope="module", autouse=True)
def threefry_layout_xla_cpu_computes_fastest() -> Iterator[None]:
    with jax.threefry_partitionable(False):
        yield


@pytest.fixture(scope="module")
def f32_accuracy() -> float:
    return run_variant("f32", steps=STEPS)


@pytest.mark.parametrize("variant", ["mixed_bf16", "mixed_f16"])
def test_mixed_modes_train_to_f32_accuracy(variant: str, f32_accuracy: float) -> None:
    accuracy = run_variant(variant, steps=STEPS)  # mixed_f16 runs with the loss scaler
    assert f32_accuracy > 0.8  # the reference itself learned (10 classes: chance is 0.1)
    assert abs(accuracy - f32_accuracy) <= 0.01, (variant, accuracy, f32_accuracy)


def test_fp8_trains_to_within_two_points_of_f32(f32_accuracy: float) -> None:
    accuracy = run_variant("fp8", steps=STEPS)
    assert f32_accuracy > 0.8
    assert abs(accuracy - f32_accuracy) <= 0.02, (accuracy, f32_accuracy)
