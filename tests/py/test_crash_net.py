"""The crash net: every test and benchmark workload (issue 33's hand-cast models too), and
random programs, through the whole pipeline in every target form (none, cpu, gpu, tpu)
and every mode, each run in a child process (pipeline_worker.py), so that a pass that
crashes the interpreter fails a test here instead of killing the pytest worker.

Also the case that once crashed: a decoder of several layers, each with a causal mask
(the mask's ``tril`` and ``where`` are private functions called once per layer), on
the fast mode's GPU and TPU forms: in the net (``decoder:*``, every form and mode; before
the fix the fast mode's gpu and tpu forms died of SIGSEGV), and through
``hlo_amp.compile(...).lower(target=...)`` in a subprocess that must exit 0.
"""

from __future__ import annotations

import functools
import subprocess
import sys
import textwrap
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given
from pipeline_worker import MODES, SEGFAULT, TARGETS, PipelineWorker
from test_properties import PROGRAMS, _inputs, make_fn

from benchmarks.hand_cast_workloads import NAMES as HAND_CAST_NAMES

ROOT = Path(__file__).resolve().parents[2]
LIT_INPUTS = sorted((ROOT / "tests" / "lit" / "inputs").glob("*.mlir"))

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


def decoder_step(layers: int, mask: str = "tril", seq: int = 16, dim: int = 32):
    """(step, args): an SGD step of ``layers`` causal attention layers; ``mask`` is how
    each layer writes its mask: ``tril`` (jnp.tril, a private function per call),
    ``iota`` (two iotas compared) or ``constant`` (one array every layer reads)."""

    def causal(scores):
        if mask == "tril":
            keep = jnp.tril(jnp.ones((seq, seq), bool))
        elif mask == "iota":
            keep = jnp.arange(seq)[:, None] >= jnp.arange(seq)[None, :]
        else:
            keep = jnp.asarray(np.tril(np.ones((seq, seq), bool)))
        return jnp.where(keep, scores, -1e9)

    def layer(x, w):
        s = jnp.einsum("bqd,bkd->bqk", x @ w["q"], x @ w["k"])
        return x + jax.nn.softmax(causal(s), -1) @ (x @ w["v"])

    def loss(ws, x):
        for w in ws:
            x = layer(x, w)
        return (x ** 2).mean()

    def step(ws, x):
        value, grads = jax.value_and_grad(loss)(ws, x)
        return jax.tree.map(lambda p, g: p - 0.1 * g, ws, grads), value

    key = jax.random.key(0)
    ws = [{n: jax.random.normal(jax.random.fold_in(key, 3 * i + j), (dim, dim)) / 6
           for j, n in enumerate("qkv")} for i in range(layers)]
    return step, (ws, jnp.ones((2, seq, dim)))


def _lowered(step, args) -> str:
    return jax.jit(step).lower(*args).as_text(debug_info=True)


def _lowered_abstract(build) -> str:
    """``build() -> (step, args)`` lowered on the arguments' shapes: the models are
    initialised abstractly (jax.eval_shape), which costs a fraction of running the
    initialisers on the CPU."""
    steps = []

    def arguments():
        step, args = build()
        steps.append(step)
        return args

    args = jax.eval_shape(arguments)
    return _lowered(steps[0], args)


def _gpu_workload(name: str) -> str:
    from gpu_workloads import _BUILDERS

    return _lowered_abstract(_BUILDERS[name])


def _benchmark_workload(name: str) -> str:
    from benchmarks.workloads import variant_step, workloads

    def build():
        workload = next(w for w in workloads(quick=True) if w.name == name)
        step, params, opt_state = variant_step(workload, "f32")
        return step, (params, opt_state, *workload.batch())

    return _lowered_abstract(build)


def _hand_cast_workload(name: str) -> str:
    """Issue 33's three models at tests/py's small shapes (f32 steps): Keras MobileNet's
    batch norms are where recompute_residuals rebuilds private functions' returns and
    call sites."""
    from benchmarks.hand_cast_workloads import hand_cast_case

    return _lowered(*hand_cast_case(name, "f32", small=True))


def _third_party(name: str) -> str:
    import test_third_party as tp

    def build():
        if name.startswith("equinox"):
            loss_fn, params, batch = tp._equinox_case(use_attention=name == "equinox_attention")
            extra = {}
        else:
            model, params, extra, batch = tp._linen_case(name.removeprefix("linen_"))
            loss_fn = tp.linen_loss(model, name == "linen_resnet")
        return tp.make_step(loss_fn), (params, extra, tp.TX.init(params), batch)

    return _lowered_abstract(build)



def _complex_step() -> str:
    """A train step with complex values beside its dots (a complex constant, an FFT):
    jaxlib's bindings cannot read a complex constant's value (TypeError on every read,
    an abort through a NamedAttribute), so no pass may read it as it reads others."""
    def loss(ws, x):
        spectrum = jnp.fft.fft(x + 1j * (x @ ws[0]))
        h = jnp.abs(spectrum) / x.shape[-1]
        for w in ws[1:]:
            h = jnp.tanh(h @ w)
        return jnp.sum(h * jnp.real(spectrum * (2 - 1j)))

    ws = [jnp.full((32, 32), 0.1)] * 3
    return _lowered(jax.value_and_grad(loss), (ws, jnp.ones((16, 32))))

MODULES = {
    **{f"lit:{path.stem}": functools.partial(path.read_text) for path in LIT_INPUTS},
    **{f"tests:{name}": functools.partial(_gpu_workload, name)
       for name in ("mlp", "cnn", "vit", "linen_transformer", "scan_rnn", "remat_block")},
    **{f"benchmarks:{name}": functools.partial(_benchmark_workload, name)
       for name in ("mlp", "vit", "cnn", "decoder")},
    **{f"hand_cast:{name}": functools.partial(_hand_cast_workload, name)
       for name in HAND_CAST_NAMES},
    **{f"third_party:{name}": functools.partial(_third_party, name)
       for name in ("linen_attention", "linen_resnet", "linen_lstm", "linen_remat",
                    "equinox_conv_mlp", "equinox_attention")},
    **{f"decoder:{layers}x{mask}": functools.partial(
        lambda layers, mask: _lowered(*decoder_step(layers, mask)), layers, mask)
       for layers, mask in ((1, "tril"), (2, "tril"), (3, "tril"), (2, "iota"),
                            (2, "constant"))},
    "special:complex": _complex_step,
}


@pytest.fixture(scope="module")
def worker():
    child = PipelineWorker()
    yield child
    child.close()


def test_the_net_holds_every_test_and_benchmark_workload():
    """The list above names every lit input and every workload of tests/py/gpu_workloads.py
    and benchmarks/workloads.py: a new workload is in the net without a new line."""
    from gpu_workloads import _BUILDERS

    from benchmarks.workloads import workloads

    names = {key.split(":", 1)[1] for key in MODULES if key.startswith("tests:")}
    assert names == set(_BUILDERS)
    names = {key.split(":", 1)[1] for key in MODULES if key.startswith("benchmarks:")}
    assert names == {w.name for w in workloads(quick=True)}
    names = {key.split(":", 1)[1] for key in MODULES if key.startswith("hand_cast:")}
    assert names == set(HAND_CAST_NAMES)
    assert len(LIT_INPUTS) >= 10


@pytest.mark.parametrize("name", sorted(MODULES))
def test_every_target_form_and_mode(worker, name):
    outcome = worker.run(MODULES[name]())
    assert outcome.failures() == []
    assert set(outcome.results) == {(t, m) for t in TARGETS for m in MODES}


@given(program=PROGRAMS)
def test_random_programs_in_every_form(worker, program):
    """A random program's train step (forward and gradients) in every form."""
    fn = make_fn(program)
    x, w, k = _inputs()
    step = jax.value_and_grad(lambda w, k, x: fn(x, w, k).sum(), argnums=(0, 1))
    outcome = worker.run(_lowered(step, (w, k, x)))
    assert outcome.failures() == [], program


def test_the_worker_reports_a_crash_and_recovers(worker):
    """A child that dies mid-run is reported with the run it died in; the next module
    gets a fresh child (so the net itself would catch a segfault)."""
    outcome = worker.run(SEGFAULT, targets=["gpu"], modes=["bf16"])
    assert outcome.crash is not None and "SIGSEGV" in outcome.crash
    assert "target=gpu mode=bf16" in outcome.crash
    outcome = worker.run(MODULES["decoder:1xtril"](), targets=["gpu"], modes=["bf16"])
    assert outcome.failures() == [] and outcome.results == {("gpu", "bf16"): "ok"}


_LOWER = textwrap.dedent("""
    import sys, warnings
    warnings.simplefilter("ignore")
    sys.path.insert(0, sys.argv[1])
    import hlo_amp
    from test_crash_net import decoder_step
    step, args = decoder_step(2)
    for target in sys.argv[2:]:
        for mode in ("bf16", "mixed_bfloat16"):
            report = hlo_amp.compile(step, mode).lower(*args, target=target).report()
            # On TPU the accurate mode leaves its f32 dots f32: XLA:TPU rounds their
            # operands to bf16 itself (insert_converts, Target.f32_dot_runs_as).
            left_to_xla = mode == "bf16" and target.startswith("tpu")
            assert all(d.operands_after[0] == "bf16" or left_to_xla and
                       d.reason.startswith("kept f32: XLA:TPU rounds")
                       for d in report.decisions), report
            # On a GPU each attention's matmuls became cuDNN's fused kernel (no decision).
            fused = sum(site.fused for site in report.attention)
            print(target, mode, len(report.decisions), fused, len(report.attention),
                  flush=True)
""")
DOTS = "stablehlo.dot_general"
DEVICES = ("h100", "tpu-v5e")


@pytest.fixture(scope="module")
def lowered_for_devices() -> subprocess.CompletedProcess:
    """One subprocess lowers the decoder for every device of DEVICES (one Python and
    jax start instead of one per device); each line it prints names its device."""
    return subprocess.run([sys.executable, "-c", _LOWER, str(Path(__file__).parent), *DEVICES],
                          capture_output=True, text=True, cwd=ROOT, check=False)


@pytest.mark.parametrize("target", DEVICES)
def test_causal_decoder_lowered_for_a_device_exits_0(target, lowered_for_devices):
    """The user's path of the crash: ``hlo_amp.compile(step, mode).lower(..., target=)``
    on a 2-layer causal decoder, in a subprocess that must exit 0 with every dot bf16
    (or, in the accurate mode on TPU, left to XLA:TPU's own bf16 pass, saying so); on
    the GPU its two attentions run as cuDNN's fused kernel, their matmuls gone."""
    done = lowered_for_devices
    assert done.returncode == 0, done.stderr[-3000:]
    dots = _lowered(*decoder_step(2)).count(f"= {DOTS}")
    lines = [line.split()[1:] for line in done.stdout.splitlines() if line.split()[0] == target]
    assert dots and [line[0] for line in lines] == ["bf16", "mixed_bfloat16"]
    for _mode, decisions, fused, sites in lines:
        assert int(sites) > 0
        if target.startswith("tpu"):
            assert (int(decisions), int(fused)) == (dots, 0)
        else:
            assert fused == sites and 0 < int(decisions) < dots


_DELAYED = textwrap.dedent("""
    import re, warnings
    warnings.simplefilter("ignore")
    from benchmarks.llm import Config, compile_variant
    config = Config(vocab=256, dim=64, layers=3, heads=4, kv_heads=2, hidden=128, seq=64,
                    batch=2)
    report = compile_variant("hlo_amp fp8 delayed", "h100", config).report()
    (note,) = [n for n in report.notes if n.startswith("fp8:")]
    quantised = int(re.search(r"; (\\d+) tensor", note).group(1))
    per_iteration = int(re.search(r"one per loop iteration for (\\d+)", note).group(1))
    print(report.fp8_state_columns, quantised, per_iteration, flush=True)
""")


def test_delayed_fp8_of_a_scanned_remat_decoder_compiled_for_a_gpu_in_a_child():
    """Delayed scaling's history threaded into a scan's body and the remat'd functions it
    calls, a column per layer (the iteration number passed in, the amax written at its
    column), then the whole pipeline and XLA's GPU compile: in a child that must exit 0,
    with every layer's tensors taking one column per layer."""
    done = subprocess.run([sys.executable, "-c", _DELAYED], capture_output=True, text=True,
                          cwd=ROOT, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    columns, quantised, per_iteration = map(int, done.stdout.split()[-3:])
    assert 0 < per_iteration <= quantised
    assert columns == quantised + 2 * per_iteration  # 3 layers: two more columns each
