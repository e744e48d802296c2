"""The README's example section runs as written, vmap over a compiled function included."""

from __future__ import annotations

import pathlib
import re

import jax
import numpy as np

README = pathlib.Path(__file__).parents[2] / "README.md"


def test_readme_example_runs_and_vmaps_the_compiled_loss():
    text = README.read_text()
    section = text[text.index("## Example"):text.index("## Policies")]
    blocks = re.findall(r"```python\n(.*?)```", section, re.DOTALL)
    assert len(blocks) == 2  # the train step, then vmap over a compiled loss
    scope: dict = {}
    exec(compile("\n".join(blocks), str(README), "exec"), scope)  # noqa: S102
    params, per_batch = scope["params"], scope["per_batch"]
    assert per_batch.shape == (8,)
    grads = scope["per_example_grads"]
    assert jax.tree_util.tree_map(np.shape, grads) == {
        "w1": (128, *params["w1"].shape), "w2": (128, *params["w2"].shape)}
    # the vmapped compiled loss agrees with the plain loss within bf16's tolerance
    expected = jax.vmap(scope["loss_fn"], in_axes=(None, 0, 0))(params, scope["xs"],
                                                                 scope["ys"])
    np.testing.assert_allclose(per_batch, expected, rtol=0, atol=1.6e-2 * np.abs(expected).max())
