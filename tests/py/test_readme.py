"""The examples run as written: the README's NNX-guide train step, and docs/compile.md's
pytree train step and vmap over a compiled function."""

from __future__ import annotations

import pathlib
import re

import jax
import numpy as np
import optax
from flax import nnx

ROOT = pathlib.Path(__file__).parents[2]
README = ROOT / "README.md"
COMPILE_DOC = ROOT / "docs" / "compile.md"


def _python_blocks(path: pathlib.Path, heading: str) -> list[str]:
    """The python code blocks of the section under ``heading``, up to the next one."""
    text = path.read_text()
    start = text.index(heading)
    end = text.find("\n## ", start + len(heading))
    section = text[start:end if end != -1 else len(text)]
    return re.findall(r"```python\n(.*?)```", section, re.DOTALL)


def _example_blocks() -> list[str]:
    readme = _python_blocks(README, "## Example")
    assert len(readme) == 1  # the NNX step
    pytree = _python_blocks(COMPILE_DOC, "## Without a framework")
    assert len(pytree) == 2  # the pytree step, vmap over a compiled loss
    return readme + pytree


def test_readme_nnx_example_differs_from_f32_by_the_decorator_alone():
    nnx_block = _example_blocks()[0]
    decorators = [re.sub(r"\s+#.*", "", line.strip()) for line in nnx_block.splitlines()
                  if line.strip().lstrip("# ").startswith("@")]
    assert decorators == ["# @nnx.jit", '@hlo_amp.compile(policy="mixed_bfloat16")']
    scope: dict = {}
    exec(compile(nnx_block, str(README), "exec"), scope)  # noqa: S102
    model, optimizer, loss = scope["model"], scope["optimizer"], scope["loss"]
    assert np.isfinite(float(loss))
    # the caller's objects were updated in place: three steps, three dropout draws
    assert int(optimizer.step[...]) == 3
    assert int(model.drop.rngs.count[...]) == 3
    fresh = scope["Net"](nnx.Rngs(params=0, dropout=1))
    assert not np.allclose(model.body.kernel[...], fresh.body.kernel[...])
    # the report's scopes are the model's module paths, with no wrapper
    report = scope["train_step"].lower(model, optimizer, scope["x"], scope["y"]).report()
    dots = [d for d in report.decisions if d.op_kind == "dot_general"]
    assert {d.scope for d in dots} == {"body", "head"}
    assert all(d.low_precision for d in dots)
    # the same step under nnx.jit (the f32 run) trains to the same losses, within bf16's
    want_optimizer = nnx.Optimizer(fresh, optax.adamw(1e-3), wrt=nnx.Param)
    f32_step = nnx.jit(scope["train_step"].fn)
    want = [float(f32_step(fresh, want_optimizer, scope["x"], scope["y"])) for _ in range(3)]
    np.testing.assert_allclose(float(loss), want[-1], rtol=5e-2)


def test_compile_doc_pytree_example_runs_and_vmaps_the_compiled_loss():
    blocks = _example_blocks()[1:]
    scope: dict = {}
    exec(compile("\n".join(blocks), str(COMPILE_DOC), "exec"), scope)  # noqa: S102
    params, per_batch = scope["params"], scope["per_batch"]
    assert per_batch.shape == (8,)
    grads = scope["per_example_grads"]
    assert jax.tree_util.tree_map(np.shape, grads) == {
        "w1": (128, *params["w1"].shape), "w2": (128, *params["w2"].shape)}
    report = scope["step"].lower(params, scope["opt_state"], scope["x"], scope["y"]).report()
    head = [d for d in report.decisions if d.scope == "head"]
    assert head and not any(d.low_precision for d in head)  # scope:head=float32
    # the vmapped compiled loss agrees with the plain loss within bf16's tolerance
    expected = jax.vmap(scope["loss_fn"], in_axes=(None, 0, 0))(params, scope["xs"],
                                                                 scope["ys"])
    np.testing.assert_allclose(per_batch, expected, rtol=0, atol=1.6e-2 * np.abs(expected).max())
