"""``Report.flops_by_scope`` and ``Report.plot``: where the FLOPs are, by precision
(issue 13 item 4)."""

from __future__ import annotations

import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import hlo_amp
from hlo_amp.report import PRECISIONS

LOW, BY_POLICY, UPCAST = PRECISIONS


def _model(w, x):
    with jax.named_scope("enc"):
        with jax.named_scope("attn"):
            x = jnp.tanh(x @ w)
        with jax.named_scope("mlp"):
            x = jnp.tanh(x @ w) @ w
    with jax.named_scope("head"):
        return (x @ w).sum()


W = jnp.ones((64, 64)) / 64
X = jnp.ones((32, 64))
DOT_FLOPS = 2 * 32 * 64 * 64


def _report(policy: str):
    return hlo_amp.compile(_model, policy).lower(W, X).compile().report()


def test_flops_by_scope_splits_by_depth_and_precision():
    report = _report("bf16,scope:enc/mlp=float32")
    by_two = report.flops_by_scope(depth=2)
    assert by_two == {
        "enc/mlp": {LOW: 0, BY_POLICY: 2 * DOT_FLOPS, UPCAST: 0},
        "enc/attn": {LOW: DOT_FLOPS, BY_POLICY: 0, UPCAST: 0},
        "head": {LOW: DOT_FLOPS, BY_POLICY: 0, UPCAST: 0},
    }
    assert next(iter(by_two)) == "enc/mlp"  # biggest first
    by_one = report.flops_by_scope()
    assert by_one["enc"] == {LOW: DOT_FLOPS, BY_POLICY: 2 * DOT_FLOPS, UPCAST: 0}


def test_ops_xla_upcast_are_their_own_part():
    # XLA:CPU computes f16 dots in f32: each converted op lands in the upcast part.
    report = _report("f16,scope:head=float32")
    rows = report.flops_by_scope()
    assert rows["enc"] == {LOW: 0, BY_POLICY: 0, UPCAST: 3 * DOT_FLOPS}
    assert rows["head"] == {LOW: 0, BY_POLICY: DOT_FLOPS, UPCAST: 0}


def test_an_int8_gemm_the_program_wrote_is_narrow_not_f32():
    """An int8 x int8 -> int32 dot is left alone ("not a float op"); its FLOPs went to
    "f32 by policy", and a model of int8 GEMMs read 0% in 16-bit or narrower."""
    def int8_model(x, w):
        with jax.named_scope("int8_mm"):
            return jnp.einsum("md,df->mf", x, w, preferred_element_type=jnp.int32)

    x, w = jnp.ones((16, 32), jnp.int8), jnp.ones((32, 64), jnp.int8)
    report = hlo_amp.compile(int8_model, "bf16").lower(x, w).report()
    assert report.flops_by_scope()["int8_mm"] == {LOW: 2 * 16 * 32 * 64, BY_POLICY: 0,
                                                  UPCAST: 0}
    assert "100% of FLOPs in 16-bit or narrower" in report.summary()


def test_an_int8_gemm_lends_no_form_to_an_op_xla_upcast():
    """Beside the program's int8 GEMM, an f16 dot XLA:CPU upcasts reads XLA's f32 form:
    counted narrow, the int8 decision reserved nothing it could take (XLA says s8, the
    decision i8) and its free s8 GEMM was shown as the upcast op's form."""
    w_int8, w = jnp.ones((64, 64), jnp.int8), jnp.ones((64, 64)) * 0.01

    def model(x):
        with jax.named_scope("blk"):
            acc = jax.lax.dot_general(x.astype(jnp.int8), w_int8, (((1,), (0,)), ((), ())),
                                      preferred_element_type=jnp.int32)
            return acc.astype(jnp.float32) + x @ w

    def reading_the_upcast_op(x):  # XLA prints the s8 GEMM first here
        with jax.named_scope("blk"):
            return jax.lax.dot_general((x @ w).astype(jnp.int8), w_int8,
                                       (((1,), (0,)), ((), ())),
                                       preferred_element_type=jnp.int32)

    for fn in (model, reading_the_upcast_op):
        report = hlo_amp.compile(fn, "f16").lower(jnp.ones((32, 64))).compile().report()
        (upcast,) = [d for d in report.decisions if d.changed]
        assert upcast.kept_by_xla is False and upcast.xla_form == "XLA f32×f32"


def test_plot_writes_a_png(tmp_path):
    report = _report("bf16,scope:head=float32")
    path = report.plot(tmp_path / "flops.png", depth=2)
    data = (tmp_path / "flops.png").read_bytes()
    assert path == tmp_path / "flops.png" and data.startswith(b"\x89PNG")
    # The long tail folds into one bar: the picture still draws with top=1.
    report.plot(tmp_path / "top1.png", depth=2, top=1)
    assert (tmp_path / "top1.png").read_bytes() != data
    report.plot(tmp_path / "top1_numpy.png", depth=2, top=np.int64(1))  # a NumPy integer too
    assert (tmp_path / "top1_numpy.png").read_bytes() == (tmp_path / "top1.png").read_bytes()


@pytest.mark.parametrize("depth", [0, -1, 1.5, "2", True])
def test_bad_depth_is_one_clear_error(depth):
    report = _report("bf16")
    with pytest.raises(ValueError, match=r"depth must be a whole number >= 1.*got"):
        report.flops_by_scope(depth)


@pytest.mark.parametrize("top", [0, -1, 2.5, "3", True])
def test_bad_top_is_one_clear_error(top, tmp_path):
    """top=-1 drew a tail bar named '(4 more)' holding one scope; 2.5 raised a bare
    TypeError from a slice."""
    with pytest.raises(ValueError, match=r"top must be a whole number >= 1.*got"):
        _report("bf16").plot(tmp_path / "x.png", top=top)
    assert not (tmp_path / "x.png").exists()


def test_the_legend_keeps_off_the_axis_label(tmp_path, monkeypatch):
    """With one to a few scopes the legend was drawn over the x axis's label."""
    import matplotlib.figure

    overlaps = []
    save = matplotlib.figure.Figure.savefig

    def checked(figure, *args, **kwargs):
        saved = save(figure, *args, **kwargs)  # measured at the dpi it is saved with
        renderer = figure.canvas.get_renderer()
        label = figure.axes[0].xaxis.label.get_window_extent(renderer)
        legends = figure.legends + [figure.axes[0].get_legend()] * bool(
            figure.axes[0].get_legend())
        overlaps.append([label.overlaps(legend.get_window_extent(renderer))
                         for legend in legends])
        return saved

    monkeypatch.setattr(matplotlib.figure.Figure, "savefig", checked)
    report = _report("bf16")
    for depth in (1, 2):
        report.plot(tmp_path / f"depth{depth}.png", depth=depth)
    report.plot(tmp_path / "top1.png", depth=2, top=1)
    assert overlaps == [[False]] * 3


def test_plot_without_matplotlib_says_what_to_install(monkeypatch, tmp_path):
    report = _report("bf16")
    for name in list(sys.modules):
        if name == "matplotlib" or name.startswith("matplotlib."):
            monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib fails
    with pytest.raises(ImportError, match="Report.plot needs matplotlib.*pip install"):
        report.plot(tmp_path / "x.png")
    assert not (tmp_path / "x.png").exists()
