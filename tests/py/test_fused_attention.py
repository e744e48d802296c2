"""The fused-attention pass (hlo_amp/passes/fused_attention/): every way of writing
attention (tests/py/attention_programs.py) becomes cuDNN's fused kernel under a 16-bit
policy on a GPU target, nowhere else, and computes what the program computed.

Without a GPU the cuDNN kernel cannot run, so two things are checked instead: the
module with cuDNN's custom calls (their S×S values gone, XLA:GPU compiles it for an H100
and keeps the calls), and the same rewrite with the ``reference`` kernel (jax's XLA
attention behind the same interface), run on this CPU against the program as written:
the layouts, heads, masks and scale the pass wires are what the program had, within
bf16's rounding (the policy computes q, k, v in bf16).
"""

from __future__ import annotations

import functools
import json
import re
import warnings

import attention_programs as programs
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import hlo_amp
from hlo_amp.ir.modules import functions, module_text, op_key, parse_module, walk_operations
from hlo_amp.passes import default_pipeline, run_pipeline
from hlo_amp.passes.fused_attention import FusedAttention
from hlo_amp.policy import Policy
from hlo_amp.runtime.module_call import ModuleFunction
from hlo_amp.targets import device_target

H100 = device_target("h100")
BF16 = Policy.parse("bf16")
# bf16 keeps 8 bits of mantissa: q, k, v and dO each rounded once, softmax and sums in
# f32 inside either kernel (measured: 0.3% to 0.9% on every program here).
BF16_TOLERANCE = 2e-2
PROGRAMS = programs.programs()  # name -> builder


@functools.cache
def _program(name: str) -> tuple:
    """(function, arguments) of the program ``name``, built once."""
    return PROGRAMS[name]()


def _lowered_text(name: str) -> str:
    fn, args = _program(name)
    return jax.jit(fn).lower(*args).as_text(debug_info=True)


def _fuse(text: str, kernel: str = "cudnn", policy: Policy = BF16, target=H100):
    module = parse_module(text)
    report = run_pipeline(module, policy, passes=[FusedAttention(policy, target, kernel)])
    return module, report


# The ops that compute on scores (a constant mask or fill that jax hoisted out of a scan
# stays a loop-carried broadcast, which XLA drops with the loop's unused carries).
_ARITHMETIC = frozenset({"stablehlo.dot_general", "stablehlo.exponential", "stablehlo.divide",
                         "stablehlo.subtract", "stablehlo.multiply", "stablehlo.add",
                         "stablehlo.maximum", "stablehlo.reduce", "stablehlo.select",
                         "stablehlo.custom_call"})


def _live_types(module) -> list[str]:
    """The result types of the arithmetic ops in functions still called from a public
    function."""
    by_name = {fn.sym_name.value: fn for fn in functions(module)}
    reached, pending = set(), [n for n, fn in by_name.items()
                               if "sym_visibility" not in fn.attributes
                               or fn.attributes["sym_visibility"].value == "public"]
    while pending:
        name = pending.pop()
        if name in reached:
            continue
        reached.add(name)
        for call in walk_operations(by_name[name], names=frozenset({"func.call"})):
            pending.append(call.attributes["callee"].value)
    return [str(r.type) for name in reached
            for op in walk_operations(by_name[name], names=_ARITHMETIC) for r in op.results]


def _elements(tensor_type: str) -> int:
    return int(np.prod([int(d) for d in re.findall(r"(\d+)x", tensor_type)]))


@pytest.mark.parametrize("name", sorted(PROGRAMS))
def test_every_form_fuses_and_matches_the_program(name: str) -> None:
    """Each site is fused, and the rewrite (reference kernel) computes the program's
    outputs (forward values or gradients) within bf16 rounding, on the same masks."""
    text = _lowered_text(name)
    module, report = _fuse(text, kernel="reference")
    assert report.attention, "no attention site found"
    assert all(site.fused for site in report.attention), [s.reason for s in report.attention]
    fn, args = _program(name)
    expected = jax.jit(fn)(*args)
    rewritten = ModuleFunction(module_text(module)).for_platform("cpu")
    got = jax.jit(rewritten)(*jax.tree.leaves(args))
    got = jax.tree.unflatten(jax.tree.structure(expected), list(got))
    assert programs.max_relative_error(expected, got) < BF16_TOLERANCE


@pytest.mark.parametrize("name", ["dpa_causal_gqa", "llm_unrolled_remat", "nnx_causal_step",
                                  "equinox_causal_scan", "dpa_padding_mask"])
def test_the_cudnn_form_has_no_score_matrix_left(name: str) -> None:
    """With cuDNN's kernel: one forward call per site (a backward one per training
    site), and no value of the live program has both the query and key axes."""
    module, report = _fuse(_lowered_text(name))
    text = module_text(module)
    sites = report.attention
    assert sites and all(s.fused for s in sites)
    assert text.count("custom_call @__cudnn$fmha") == len(sites) + sum(
        s.direction != "forward" for s in sites)
    t = programs.T
    square = [ty for ty in _live_types(module)
              if len(re.findall(rf"(?<![0-9]){t}x", ty + "x")) >= 2]
    if name == "dpa_padding_mask":  # the kernel's bias [B, 1, T, S], no score matrix
        square = [ty for ty in square if _elements(ty) > programs.B * t * t]
    assert not square, square[:3]
    assert "stablehlo.exponential" not in text or name.startswith("llm")  # the loss's


def test_a_padding_mask_becomes_the_kernels_bias() -> None:
    module, report = _fuse(_lowered_text("dpa_padding_mask"))
    assert report.attention[0].mask == "mask"
    assert "__cudnn$fmhaScaleBiasSoftmax" in module_text(module)


def test_a_padding_mask_through_a_remat_scan_is_read_where_jax_made_it() -> None:
    """jax computes a remat'd scan's padding mask (ANDed with causal) before the loop,
    broadcast to the scores' [B, K, G, T, S], and passes it through the loop: the
    forward loop's site was left unfused ('the mask varies along more than one query
    dimension', the GQA group axis taken for a second query axis). The mask is read
    before the loop now: causal for cuDNN, and the bias [B, 1, T, S] read from the
    loop's value at the first head and group; XLA:GPU keeps both kernels."""
    fn, args = programs.dpa_scan_padding(causal=True)
    lowered = hlo_amp.compile(fn, "mixed_bfloat16").lower(*args, target="h100")
    sites = lowered.compile().report().attention
    assert [(s.fused, s.mask, s.kept_by_xla) for s in sites] == [
        (True, "causal+mask", True), (True, "causal+mask", True)]
    t = programs.T
    calls = re.findall(r"custom_call @__cudnn\$fmhaScaleBiasSoftmax.*: \((.*)\) -> ",
                       lowered.as_text())
    biases = [ty for operands in calls for ty in re.findall(
        rf"tensor<[0-9x]*x{t}x{t}xbf16>", operands)]
    assert biases == [f"tensor<{programs.B}x1x{t}x{t}xbf16>"] * 3, biases


@pytest.mark.parametrize(("name", "masks"), [
    ("dpa_scan_mask_closed_over", ["causal+mask", "causal+mask"]),
    ("dpa_scan_window_closed_over", ["causal+window+mask", "causal+window+mask"]),
    ("dpa_scan_unrolled_twice", ["causal+mask", "causal+mask"]),
    ("flax_combined_masks", ["causal+mask"])])
def test_a_masks_causal_part_is_cudnns_however_it_reaches_the_site(name, masks) -> None:
    """Review h101: a mask made before a scan of checkpointed layers reaches the
    backward loop through jax.checkpoint's optimization barrier; a scan unrolled twice
    passes the fill jax hoisted to both calls of its body; Flax's 0/1 masks pass through
    bool conversions: each site fused with the causal part (or window) in the bias,
    computing every block, or (unrolled) not at all, 'the scores are selected against a
    value that is not a large negative constant'."""
    _module, report = _fuse(_lowered_text(name))
    assert [s.mask for s in report.attention] == masks, [s.reason for s in report.attention]


def test_deviceless_h100_compile_keeps_the_kernels() -> None:
    """The whole pipeline (mixed mode) on a scanned, rematerialised decoder: XLA:GPU
    compiles it for an H100 and runs each site as cuDNN's calls (the report's check)."""
    fn, args = programs.llm_step(programs.Llm(scan=True, remat=True))
    compiled = hlo_amp.compile(fn, "mixed_bfloat16").lower(*args, target="h100").compile()
    report = compiled.report()
    assert [s.fused for s in report.attention] == [True, True]
    assert all(s.kept_by_xla for s in report.attention)
    assert "attention: 2 of 2 sites fused (cuDNN flash), kept by XLA: 2/2" in report.summary()
    assert compiled.as_text().count('custom_call_target="__cudnn$fmha') == 3
    data = json.loads(report.to_json())
    assert {"scope", "direction", "fused", "reason", "shapes", "mask"} <= set(
        data["attention"][0])


# ---- where it is not fused, and why ------------------------------------------------------------


def _reasons(fn, args, policy, target) -> list[str]:
    lowered = hlo_amp.compile(fn, policy).lower(*args, target=target)
    return [s.reason for s in lowered.report().attention if not s.fused]


def _attend(q, k, v):
    return jax.nn.dot_product_attention(q, k, v, is_causal=True)


def _qkv() -> tuple:
    """q, k, v of as many key/value heads as query heads (made on first use, not when
    pytest collects the file)."""
    return programs._qkv(kv_heads=programs.N)


@pytest.mark.parametrize(("target", "why"), [(None, "CPU"), ("tpu-v5e", "TPU")])
def test_not_on_cpu_or_tpu(target, why) -> None:
    reasons = _reasons(_attend, _qkv(), "mixed_bfloat16", target)
    assert reasons and why in reasons[0]


def test_not_where_a_scope_rule_keeps_it_f32() -> None:
    def scoped(q, k, v):
        with jax.named_scope("attn"):
            return _attend(q, k, v)

    reasons = _reasons(scoped, _qkv(), "mixed_bfloat16,scope:attn=float32", "h100")
    assert reasons == ["the policy keeps it f32 (scope:attn)"]

    def stopped(q, k, v):
        with hlo_amp.amp_stop():
            return _attend(q, k, v)

    assert "amp_stop" in _reasons(stopped, _qkv(), "bf16", "h100")[0]


def test_not_where_backward_or_an_end_rule_keeps_a_matmul_f32() -> None:
    """backward=, first_matrix_op= and last_matrix_op= keep the site's matmuls f32 as
    they keep an unfused site's: fused, its backward (and first and last) matmuls ran
    in bf16, and the rule was warned about as matching no op."""
    def step(q, k, v):
        return jax.grad(lambda q, k, v: jnp.sum(_attend(q, k, v) ** 2), argnums=(0, 1, 2))(
            q, k, v)

    assert _reasons(step, _qkv(), "bf16,backward=keep", "h100") == [
        "the policy keeps it f32 (backward)"]
    assert _reasons(_attend, _qkv(), "bf16,first_matrix_op=float32", "h100") == [
        "the policy keeps it f32 (first_matrix_op)"]
    assert _reasons(_attend, _qkv(), "bf16,last_matrix_op=keep", "h100") == [
        "the policy keeps it f32 (last_matrix_op)"]
    assert _reasons(step, _qkv(), "fp8", "h100") == []  # its ends compute in bf16: fused

    # A site in a called layer between projections is no end: the rules matched the
    # projections, and the site was left unfused naming them.
    core = jax.jit(_attend)

    def projected(q, k, v):
        return core(q @ jnp.eye(q.shape[-1]), k, v) @ jnp.eye(q.shape[-1])

    for policy in ("bf16,first_matrix_op=float32", "bf16,last_matrix_op=float32"):
        assert _reasons(projected, _qkv(), policy, "h100") == [], policy

    # Nor is a site before or after a called layer: that layer holds the end (the site
    # was taken for it, as only the public function's own ops were looked at).
    proj = jax.jit(lambda x: x @ jnp.eye(x.shape[-1]))
    assert _reasons(lambda q, k, v: _attend(proj(q), k, v), _qkv(),
                    "bf16,first_matrix_op=float32", "h100") == []
    assert _reasons(lambda q, k, v: proj(_attend(q, k, v)), _qkv(),
                    "bf16,last_matrix_op=float32", "h100") == []
    nested = jax.jit(lambda x: jax.nn.relu(proj(x)))  # the end one call deeper
    assert _reasons(lambda q, k, v: _attend(nested(q), k, v), _qkv(),
                    "bf16,first_matrix_op=float32", "h100") == []


@pytest.mark.parametrize(("dtype", "policy"), [(jnp.bfloat16, "f16"), (jnp.float16, "bf16")])
def test_a_16bit_site_keeps_its_own_type(dtype, policy) -> None:
    """Already-16-bit ops are never moved to the other 16-bit type: a bf16 attention
    under an f16 policy was fused in f16, its q, k and v converted (inf past 65504)."""
    def by_hand(q, k, v):  # jax's dot_product_attention pins its matmuls' type itself
        scores = jnp.einsum("btnh,bsnh->bnts", q, k) / 8.0
        return jnp.einsum("bnts,bsnh->btnh", jax.nn.softmax(scores, -1), v)

    qkv = [x.astype(dtype) for x in _qkv()]
    lowered = hlo_amp.compile(by_hand, policy).lower(*qkv, target="h100")
    (site,) = lowered.report().attention
    assert site.fused and site.dtype == jnp.dtype(dtype).name
    other = "f16" if dtype == jnp.bfloat16 else "bf16"
    assert f"x{other}>" not in lowered.as_text()
    # q and k in one 16-bit type, v f32 the policy computes in the other: not one type
    # (v went to q's type, past its range).
    mixed = [qkv[0], qkv[1], _qkv()[2]]
    computed = "float16" if policy == "f16" else "bfloat16"
    want = (f"its q, k and v are {jnp.dtype(dtype).name} and f32, which the policy "
            f"computes in {computed}: not one 16-bit type")
    assert _reasons(by_hand, mixed, policy, "h100") == [want]


def test_not_when_turned_off() -> None:
    lowered = hlo_amp.compile(_attend, "bf16,fuse_attention=false").lower(*_qkv(), target="h100")
    assert lowered.report().attention == []
    assert "fmha" not in lowered.as_text()


def test_not_when_the_probabilities_have_another_reader() -> None:
    def returned(q, k, v):
        scores = jnp.einsum("btnh,bsnh->bnts", q, k) / 8.0
        probs = jax.nn.softmax(scores, axis=-1)
        return jnp.einsum("bnts,bsnh->btnh", probs, v), probs

    assert "another reader" in _reasons(returned, _qkv(), "bf16", "h100")[0]

    def regularised(q, k, v):
        scores = jnp.einsum("btnh,bsnh->bnts", q, k) / 8.0
        probs = jax.nn.softmax(scores, axis=-1)
        out = jnp.einsum("bnts,bsnh->btnh", probs, v)
        return jnp.sum(out ** 2) + jnp.sum(probs * jnp.log(probs + 1e-6))

    grads = jax.grad(regularised, argnums=(0, 1, 2))
    reasons = _reasons(grads, _qkv(), "bf16", "h100")
    assert reasons and all("another reader" in r for r in reasons)


@pytest.mark.parametrize(("name", "mask", "written"), [
    ("dpa_two_sided_window_padding", "constant+mask", []),
    ("einsum_prefix_lm", "constant", [f"{programs.T}x{programs.T}"]),
    ("dpa_causal_chunk_of_queries", "constant", []),
    ("dpa_gqa_decode_step", "constant", [f"1x{programs.T}"]),
    ("dpa_constant_key_lengths", "constant", [f"1x{programs.T}"]),
    ("dpa_constant_query_and_key_lengths", "constant", [f"{programs.T}x1", f"1x{programs.T}"]),
    ("dpa_causal_constant_key_lengths", "causal+constant", [f"1x{programs.T}"]),
    ("dpa_sliding_window_constant_key_lengths", "causal+window+constant",
     [f"1x{programs.T}"])])
def test_a_constant_mask_other_than_causal_becomes_the_kernels_bias(name, mask,
                                                                    written) -> None:
    """A sliding window, a prefix-LM mask, causal over fewer queries than keys (a chunked
    prefill, a decode step), constant sequence lengths were left unfused ('a constant
    mask that is not causal', 'a causal mask over queries and keys of different
    lengths'): the kernel takes them in its bias, a band computed from positions, a mask
    along the keys alone written out as [1, S] (a T x S constant, and T x S arrays to
    read it, made a long context's lowering take gigabytes: review h81; query and key
    lengths together were one T x S constant: review h83), another written out
    (test_every_form_fuses_and_matches_the_program checks the values)."""
    module, report = _fuse(_lowered_text(name))
    assert [(s.fused, s.mask) for s in report.attention] == [(True, mask)]
    text = module_text(module)
    assert "__cudnn$fmhaScaleBiasSoftmax" in text
    constants = re.findall(r"stablehlo.constant dense<(?!true>|false>)[^>]*> : tensor<([0-9x]+)"
                           r"xi1>", text)
    assert sorted(constants) == written, constants


@pytest.mark.parametrize("window", [1, 4, 9])
def test_a_causal_sliding_window_is_cudnns_own(window) -> None:
    """A causal sliding window (jax's local_window_size=(w - 1, 0), Mistral's and
    Gemma's local layers) was the kernel's bias, which computes every block of the
    scores: it is cuDNN's causal mask with its own sliding_window_length (jax's own
    conversion for implementation="cudnn"), no bias, and the roofline counts the scores
    inside the window alone."""
    from hlo_amp.targets.roofline import estimate

    t, h = 64, 16
    q, k, v = (jax.random.normal(key, (1, t, 2, h), jnp.bfloat16)
               for key in jax.random.split(jax.random.key(0), 3))

    def attend(window_size):
        return jax.jit(lambda q, k, v: jax.nn.dot_product_attention(
            q, k, v, is_causal=True, local_window_size=window_size))

    lowered = hlo_amp.compile(attend((window - 1, 0)), "bf16").lower(q, k, v, target="h100")
    assert [(s.fused, s.mask) for s in lowered.report().attention] == [
        (True, "causal+window")]
    text = lowered.as_text()
    assert "__cudnn$fmhaSoftmax(" in text and "Bias" not in text
    assert re.findall(r"sliding_window_length\\22: (\d+)", text) == [str(window)]
    compiled = lowered.compile()
    assert compiled.report().attention[0].kept_by_xla

    def attention_flops(compiled_text):
        kernels = [k for k in estimate(compiled_text, "h100").kernels if k.matrix == "attention"]
        return sum(k.flops for k in kernels)

    causal = hlo_amp.compile(attend(None), "bf16").lower(q, k, v, target="h100")
    full = 2 * 2 * 2 * t * t * h  # Q·Kᵀ and P·V over two heads
    assert attention_flops(causal.compile().as_text()) == full // 2
    seen = int(np.sum(np.tri(t, t, dtype=bool) & ~np.tri(t, t, -window, dtype=bool)))
    assert attention_flops(compiled.as_text()) == full * seen // (t * t)


@pytest.mark.parametrize("form", ["query_lengths", "left_padded_keys"])
def test_causal_with_constant_lengths_is_no_window(form) -> None:
    """Causal with constant query lengths, or with its first keys padded, hides row
    T - 1's first key: it was read as a sliding window of the keys row T - 1 still
    sees (review h94), a window the program does not have."""
    t = np.arange(16)
    left_padded = jnp.asarray((t[None] <= t[:, None]) & (t[None] >= 3))[None, None]

    def attend(q, k, v):
        if form == "query_lengths":
            return jax.nn.dot_product_attention(q, k, v, is_causal=True,
                                                query_seq_lengths=jnp.array([10]),
                                                implementation="xla")
        return jax.nn.dot_product_attention(q, k, v, mask=left_padded, implementation="xla")

    q, k, v = (jax.random.normal(key, (1, 16, 2, 8)) for key in jax.random.split(
        jax.random.key(0), 3))
    lowered = hlo_amp.compile(attend, "bf16").lower(q, k, v, target="h100")
    assert [s.mask for s in lowered.report().attention] == ["causal+constant"]
    assert re.findall(r"sliding_window_length\\22: (\d+)", lowered.as_text()) == ["0"]


@pytest.mark.parametrize(("fill", "scale_after"),
                         [(-1e4, 1e-4), (-1e9, -1.0), (float("nan"), 1.0)])
def test_not_where_a_scale_after_the_mask_undoes_its_fill(fill, scale_after) -> None:
    """The softmax reads the fill times the scales after the select: -1e4 * 1e-4 is -1
    and -1e9 * -1 is +1e9, no mask at all (it was fused as causal: the kernel's output
    differed from the program's by 565%). A NaN fill makes the program's rows NaN (it
    was fused: finite numbers where jax.jit gives NaN)."""
    causal = jnp.tril(jnp.ones((programs.T, programs.T), bool))

    def masked_then_scaled(q, k, v):
        scores = jnp.einsum("btnh,bsnh->bnts", q, k)
        scores = jnp.where(causal, scores, fill) * scale_after
        return jnp.einsum("bnts,bsnh->btnh", jax.nn.softmax(scores, -1), v)

    reasons = _reasons(masked_then_scaled, _qkv(), "bf16", "h100")
    assert reasons and "a mask's fill) where the softmax reads it" in reasons[0]


@pytest.mark.parametrize("through_exp", [
    lambda i: jnp.floor(jnp.exp((i + 8700) / 1024)) != 4963,
    lambda i: jnp.exp((i + 8700) / 1024) < 4963,
    lambda i: jnp.floor(i / 41.0) == 0], ids=["floor_of_exp", "exp_compared", "divided"])
def test_a_mask_through_exp_is_not_evaluated_unlike_xla(through_exp) -> None:
    """exp, log and rsqrt were evaluated correctly rounded, which XLA's approximations
    are not (exp((14 + 8700) / 1024) is 4963.0 in XLA:CPU, 4962.9995 here): a mask
    comparing or flooring one was read wrong and fused as another (42% and 68% off;
    review h90). So was a division by a constant, which XLA computes as a multiply by
    its reciprocal (41 / 41 floors to 0 there; 118% off; review h91). Such a mask is the
    program's own now, read as it computes it."""
    t, h = 64, 16  # at 16 XLA folds the mask as numpy does
    q, k, v = (jax.random.normal(key, (1, t, 2, h)) for key in jax.random.split(
        jax.random.key(0), 3))
    keys = jax.lax.broadcasted_iota(jnp.float32, (t, t), 1)

    def attend(q, k, v):
        mask = (jax.lax.broadcasted_iota(jnp.float32, (t, t), 0) >= keys) & through_exp(keys)
        scores = jnp.where(mask, jnp.einsum("btnh,bsnh->bnts", q, k) * h ** -0.5, -1e9)
        return jnp.einsum("bnts,bsnh->btnh", jax.nn.softmax(scores, -1), v)

    module, report = _fuse(jax.jit(attend).lower(q, k, v).as_text(), kernel="reference")
    assert [(s.fused, s.mask) for s in report.attention] == [(True, "causal+mask")]
    rewritten = ModuleFunction(module_text(module)).for_platform("cpu")
    assert programs.max_relative_error(jax.jit(attend)(q, k, v), jax.jit(rewritten)(
        q, k, v)[0]) < BF16_TOLERANCE


def test_a_mask_of_subnormal_values_is_not_evaluated() -> None:
    """XLA flushes subnormals to zero ((k + 1) * 1e-20 * 1e-19 is 0 there), where they
    were evaluated as non-zero: the mask was read as causal alone (review h91)."""
    t = 64
    q = jnp.ones((1, t, 2, 16))
    keys = jax.lax.broadcasted_iota(jnp.float32, (t, t), 1)

    def attend(q, k, v):
        tiny = (keys + 1) * 1e-20 * 1e-19
        mask = (jax.lax.broadcasted_iota(jnp.float32, (t, t), 0) >= keys) & (tiny != 0)
        scores = jnp.where(mask, jnp.einsum("btnh,bsnh->bnts", q, k), -1e9)
        return jnp.einsum("bnts,bsnh->btnh", jax.nn.softmax(scores, -1), v)

    _module, report = _fuse(jax.jit(attend).lower(q, q, q).as_text())
    assert [(s.fused, s.mask) for s in report.attention] == [(True, "causal+mask")]


def _iota(dtype, dimension):
    return jax.lax.broadcasted_iota(dtype, (programs.T, programs.T), dimension)


@pytest.mark.parametrize(("mask", "causal"), [
    # Block-causal (query block >= key block): integer division, on int32 and uint32.
    (lambda: jax.lax.div(_iota(jnp.int32, 0), 4) >= jax.lax.div(_iota(jnp.int32, 1), 4),
     False),
    (lambda: _iota(jnp.uint32, 0) // 4 >= _iota(jnp.uint32, 1) // 4, False),
    # Causal through unsigned wrap-around: i - j < T only where j <= i.
    (lambda: (_iota(jnp.uint32, 0) - _iota(jnp.uint32, 1)) < programs.T, True),
    # Causal and a bitwise condition: not causal.
    (lambda: (_iota(jnp.int32, 0) >= _iota(jnp.int32, 1))
     & ((_iota(jnp.int32, 0) & 3) >= (_iota(jnp.int32, 1) & 3)), False),
    # A float difference converted to uint8 saturates at 0 (numpy wraps to 255): i - j
    # + 1 > 0 is causal, i - j < 128 holds everywhere.
    (lambda: (_iota(jnp.float32, 0) - _iota(jnp.float32, 1) + 1).astype(jnp.uint8) > 0,
     True),
    (lambda: (_iota(jnp.float32, 0) - _iota(jnp.float32, 1)).astype(jnp.uint8) < 128,
     None),
    # bf16 positions past 256 round two neighbours to one number (257 to 256): not
    # causal, where float64 arithmetic read them as causal (23% off).
    (lambda: _iota(jnp.bfloat16, 0) + 256 >= _iota(jnp.bfloat16, 1) + 256, False),
    # Chunked causal masks (Llama 4's local attention) written with jnp's floor division
    # (sign, select, remainder) or floor, and a causal mask cut from a longer one: they
    # were taken for masks of the program's (review h89).
    (lambda: (_iota(jnp.int32, 1) <= _iota(jnp.int32, 0))
     & ((_iota(jnp.int32, 0) - 7) // 4 == (_iota(jnp.int32, 1) - 7) // 4), False),
    (lambda: (_iota(jnp.float32, 1) <= _iota(jnp.float32, 0))
     & (jnp.floor(_iota(jnp.float32, 0) / 4) == jnp.floor(_iota(jnp.float32, 1) / 4)), False),
    (lambda: jnp.tril(jnp.ones((4 * programs.T, 4 * programs.T), bool))[:programs.T,
                                                                         :programs.T], True),
], ids=["block_div", "block_uint", "causal_uint_wrap", "bitwise_and", "saturated_causal",
        "saturated_none", "bf16_positions", "chunk_floor_divide", "chunk_floor",
        "sliced_causal"])
def test_a_constant_mask_of_integer_arithmetic_is_read_as_the_program_computes_it(
        mask, causal) -> None:
    """Integer division was true division, and/or/xor logical, unsigned values int64,
    floats float64: block-causal masks were fused as causal (122% off), a causal one
    written with unsigned wrap-around as no mask (100% off), bf16 positions that round
    together as causal (23% off)."""
    def attend(q, k, v):
        scores = jnp.einsum("btnh,bsnh->bnts", q, k) * programs.H ** -0.5
        scores = jnp.where(mask(), scores, -1e9)
        return jnp.einsum("bnts,bsnh->btnh", jax.nn.softmax(scores, -1), v)

    (site,) = hlo_amp.compile(attend, "bf16").lower(*_qkv(), target="h100").report().attention
    assert (site.fused, site.mask) == (
        True, "none" if causal is None else "causal" if causal else "constant"), site
    # A mask that is not causal goes to the kernel's bias as it was read: the values say
    # whether it was read as the program computes it.
    module, _report = _fuse(jax.jit(attend).lower(*_qkv()).as_text(debug_info=True),
                            kernel="reference")
    rewritten = ModuleFunction(module_text(module)).for_platform("cpu")
    assert programs.max_relative_error(jax.jit(attend)(*_qkv()), jax.jit(rewritten)(
        *_qkv())[0]) < BF16_TOLERANCE


def test_not_for_a_head_dimension_cudnn_does_not_take() -> None:
    q = jnp.ones((2, 16, 4, 12))
    assert "head dimension 12" in _reasons(_attend, (q, q, q), "bf16", "h100")[0]


def test_not_where_jax_refuses_cudnn_for_the_shape() -> None:
    """jax's own cuDNN checks (an odd sequence length in training) are reasons too."""
    q = programs._normal(0, (2, 15, 4, 8))
    grads = jax.grad(lambda q: jnp.sum(_attend(q, q, q)))
    assert "cuDNN does not take it: Unsupported sequence length Q 15" in _reasons(
        grads, (q,), "bf16", "h100")[0]


def test_fp8_policies_keep_attention_16_bit() -> None:
    # fp8's first/last-matrix-op rules find no dot (the attention's are the kernel's):
    # normal for a program without a stem or head matrix op, so no unused-rule warning.
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        lowered = hlo_amp.compile(_attend, "fp8").lower(*_qkv(), target="h100")
    [site] = lowered.report().attention
    assert site.fused and site.dtype == "bfloat16"



def test_a_second_run_finds_the_site_its_first_run_left_unfused() -> None:
    """Attention the pass leaves in the program (here: XLA:CPU, no fused kernel) keeps
    its matmuls 16-bit under fp8; the pipeline's own output, where the fast mode put a
    convert between the 16-bit subtract and the f32 exp, still shows the site: a
    second run quantised its matmuls to fp8."""
    def attend(q, k, v):
        scores = jnp.einsum("bqd,bkd->bqk", q, k) / 8.0
        return jnp.einsum("bqk,bkd->bqd", jax.nn.softmax(scores, axis=-1), v)

    qkv = [jax.ShapeDtypeStruct((2, 16, 64), jnp.float32)] * 3
    policy = "fp8,first_matrix_op=none,last_matrix_op=none"
    first = hlo_amp.rewrite(jax.jit(attend).lower(*qkv).as_text(debug_info=True), policy,
                            debug_info=True)
    second, report = hlo_amp.rewrite(first, policy, debug_info=True, return_report=True)
    assert "f8E4M3FN" not in first and "f8E4M3FN" not in second
    assert [site.fused for site in report.attention] == [False]

def test_cudnn_implementation_on_f32_arrays_runs_under_a_16bit_policy() -> None:
    """jax refuses f32 arrays for implementation="cudnn"; under hlo_amp.compile it runs
    (XLA's attention on this CPU, cuDNN's kernel in bf16 on a GPU target)."""
    def cudnn(q, k, v):
        return jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation="cudnn")

    with pytest.raises(Exception):  # noqa: B017 - jax's own refusal, any kind
        jax.jit(cudnn).lower(*_qkv()).compile()(*_qkv())
    out = hlo_amp.compile(cudnn, "mixed_bfloat16")(*_qkv())
    expected = _attend(*_qkv())
    assert float(jnp.max(jnp.abs(out - expected))) < BF16_TOLERANCE * float(
        jnp.max(jnp.abs(expected)))
    [site] = hlo_amp.compile(cudnn, "bf16").lower(*_qkv(), target="h100").report().attention
    assert site.fused and site.mask == "causal"


def test_the_pipeline_runs_it_first_only_under_16bit_policies() -> None:
    names = [p.name for p in default_pipeline(BF16, H100)]
    assert names[0] == "hlo-amp-fused-attention"
    assert "hlo-amp-fused-attention" not in [
        p.name for p in default_pipeline(Policy.parse("f32"), H100)]


def test_scan_without_checkpoint_is_reported() -> None:
    """A scanned training step without jax.checkpoint carries the probabilities from the
    forward loop to the backward one: not fused, and the report says so."""
    fn, args = programs.llm_step(programs.Llm(scan=True, remat=False))
    reasons = _reasons(fn, args, "bf16", "h100")
    assert reasons and "another reader" in reasons[0]


def test_not_in_a_program_partitioned_over_devices() -> None:
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    mesh = hlo_amp.target_mesh("h100x2", {"data": 2})
    sharded = [jax.ShapeDtypeStruct(x.shape, x.dtype,
                                    sharding=NamedSharding(mesh, P("data"))) for x in _qkv()]
    reasons = _reasons(_attend, sharded, "bf16", "h100x2")
    assert reasons and "partitioned over 2 devices" in reasons[0]


def test_not_in_a_compiled_function_an_outer_jit_partitions() -> None:
    """jax.jit(compiled, in_shardings=...) exports the compiled function for one device,
    then partitions it: its attention was fused, and XLA gathered q, k and v onto every
    device to run the kernel on the whole batch. The export is told the caller's devices
    now (runtime/amp_call.py), as a program compiled whole is (above)."""
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    mesh = hlo_amp.target_mesh("h100x2", {"data": 2})
    batch = NamedSharding(mesh, P("data"))
    sharded = [jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=batch) for x in _qkv()]

    def lowered_text(in_shardings):
        outer = jax.jit(hlo_amp.compile(_attend, "bf16"), in_shardings=in_shardings)
        return outer.trace(*sharded).lower(lowering_platforms=("cuda",)).as_text()

    assert "__cudnn$fmha" not in lowered_text((batch,) * 3)
    assert "__cudnn$fmha" in jax.jit(hlo_amp.compile(_attend, "bf16")).trace(*_qkv()).lower(
        lowering_platforms=("cuda",)).as_text()  # one device: fused


def test_a_rounding_of_the_scores_is_no_saved_marker() -> None:
    """Only a reduce_precision to the values' own format is jax's mark of a saved value:
    f16 scores rounded to bf16's format in a forward pass read as 'saved for the backward
    pass'."""
    def rounded(q, k, v):
        scores = jax.lax.reduce_precision(_scores(q, k), exponent_bits=8, mantissa_bits=7)
        return jnp.einsum("bnts,bsnh->btnh", jax.nn.softmax(scores, -1), v)

    qkv = [x.astype(jnp.float16) for x in _qkv()]
    sites = hlo_amp.compile(rounded, "bf16").lower(*qkv, target="h100").report().attention
    assert not any("saved" in s.reason for s in sites), sites


def test_a_gqa_decode_steps_causal_mask_is_read_along_its_query() -> None:
    """A query of length 1 with a GQA group of 2: the group was taken for the query
    position ('a constant mask that varies along the batch or heads'); the mask is
    jax's causal one over 1 query and 16 keys (the first key alone)."""
    q = jnp.ones((2, 1, 4, 8))
    kv = jnp.ones((2, 16, 2, 8))
    sites = hlo_amp.compile(lambda q, k, v: jax.nn.dot_product_attention(
        q, k, v, is_causal=True), "bf16").lower(q, kv, kv, target="h100").report().attention
    assert [(s.fused, s.mask, s.shapes) for s in sites] == [
        (True, "constant", "q 2x1x4x8, k/v 2x16x2x8 (BTNH)")]


def test_a_matcher_error_leaves_the_site_and_says_so(monkeypatch) -> None:
    """Matching only reads the module: an error in it (a form it does not know) leaves
    the attention as written, the compile goes on, and the report names the error."""
    import hlo_amp.passes.fused_attention as pass_module

    def broken(view, op):
        raise KeyError("unknown form")

    monkeypatch.setattr(pass_module, "match_site", broken)
    lowered = hlo_amp.compile(_attend, "bf16").lower(*_qkv(), target="h100")
    reasons = [s.reason for s in lowered.report().attention]
    assert reasons and all(r.startswith("not analysed (KeyError") for r in reasons)
    assert "fmha" not in lowered.as_text()


def test_a_bf16_program_pinning_bf16_bf16_f32_is_fused() -> None:
    """jax's own attention on bf16 arrays pins its matmuls to BF16_BF16_F32: what the
    kernel does, so a hand-cast program under hlo_amp is fused; HIGHEST is a pin against
    it and stays."""
    q, k, v = (x.astype(jnp.bfloat16) for x in _qkv())
    [site] = hlo_amp.compile(_attend, "bf16").lower(q, k, v, target="h100").report().attention
    assert site.fused and site.dtype == "bfloat16"

    def highest(q, k, v):
        scores = jnp.einsum("btnh,bsnh->bnts", q, k, precision="highest") / 8.0
        probs = jax.nn.softmax(scores, axis=-1)
        return jnp.einsum("bnts,bsnh->btnh", probs, v, precision="highest")

    assert "HIGHEST" in _reasons(highest, _qkv(), "bf16", "h100")[0]
    # BF16_BF16_F32_X3 and _X6 are several bf16 passes, near f32: pins that stay (they
    # were fused as one bf16 pass).
    for preset in ("BF16_BF16_F32_X3", "BF16_BF16_F32_X6"):
        algorithm = getattr(jax.lax.DotAlgorithmPreset, preset)

        def pinned(q, k, v, algorithm=algorithm):
            scores = jnp.einsum("btnh,bsnh->bnts", q, k, precision=algorithm) / 8.0
            probs = jax.nn.softmax(scores, axis=-1)
            return jnp.einsum("bnts,bsnh->btnh", probs, v, precision=algorithm)

        assert _reasons(pinned, _qkv(), "mixed_bfloat16", "h100") == [
            "kept: the program asked for an explicit dot algorithm"], preset


def test_a_softmax_whose_sum_starts_elsewhere_or_whose_scores_are_rounded_stays() -> None:
    """lax.reduce(e, 1.0, add) is 1 + sum(e), and a convert to int32 and back rounds the
    scores: both were fused as a plain softmax of the scores (56% and 19% off)."""
    def shifted(q, k, v):
        s = jnp.einsum("btnh,bsnh->bnts", q, k) / 8.0
        e = jnp.exp(s - jax.lax.stop_gradient(s.max(-1, keepdims=True)))
        total = jax.lax.reduce(e, jnp.float32(1.0), jax.lax.add, (3,))[..., None]
        return jnp.einsum("bnts,bsnh->btnh", e / total, v)

    def rounded(q, k, v):
        s = jnp.einsum("btnh,bsnh->bnts", q, k) / 8.0
        s = (s * 4).astype(jnp.int32).astype(jnp.float32)
        return jnp.einsum("bnts,bsnh->btnh", jax.nn.softmax(s, -1), v)

    assert "divides by its sum plus a term" in _reasons(shifted, _qkv(), "bf16", "h100")[0]
    assert not any(site.fused for site in hlo_amp.compile(rounded, "bf16").lower(
        *_qkv(), target="h100").report().attention)


@jax.custom_vjp
def _clip_gradient(x):
    return x


_clip_gradient.defvjp(lambda x: (x, None), lambda _, g: (jnp.clip(g, -1e-3, 1e-3),))


def _halve_gradient_fwd(x):
    return x, None


@jax.custom_vjp
def _halve_gradient(x):
    return x


_halve_gradient.defvjp(_halve_gradient_fwd, lambda _, g: (g * 0.5,))


def _gradient_changed(change):
    @jax.custom_vjp
    def changed(x):
        return x

    changed.defvjp(lambda x: (x, None), lambda _, g: (change(g),))
    return changed


def _gradient_weighted_by_scores(change):
    """A custom_vjp on the scores whose backward reads them (its residual)."""
    @jax.custom_vjp
    def changed(x):
        return x

    changed.defvjp(lambda x: (x, x), lambda x, g: (change(x, g),))
    return changed


_WEIGHTS = jnp.linspace(0.1, 2.0, programs.T * programs.T).reshape(programs.T, programs.T)


@pytest.mark.parametrize(("change", "what"), [
    (lambda s: _clip_gradient(s), "maximum after dP"),  # jnp.clip: a max and a min
    (lambda s: _halve_gradient(s), "a factor of 0.5"),
    (None, "add of a term not from dP"),  # + 0.05 * sum(s ** 2) in the loss
    (_gradient_changed(lambda g: jnp.where(g > 1e-3, 1e-3, g)),
     "a select of the gradient against another value"),
    (_gradient_changed(lambda g: g + g), "add of a term with itself"),
    (_gradient_changed(lambda g: g * g), "multiply of two gradient terms"),
    (_gradient_changed(lambda g: g * _WEIGHTS), "a factor from outside the attention"),
    # The scale is 1/8: a factor equal to it, or to its reciprocal, was taken for it
    # (here the 0.125 is matched first and the scale's own division by 8 is the extra).
    (_gradient_changed(lambda g: g * 0.125), "a factor of 8"),
    (_gradient_changed(lambda g: g * 8.0), "a factor of 8"),
    # Gated or weighted by the scores themselves (a forward value, but not P's).
    (_gradient_weighted_by_scores(lambda x, g: jnp.where(jnp.abs(x) < 2.0, g, 0.0)),
     "a select of the gradient against another value"),
    (_gradient_weighted_by_scores(lambda x, g: g / (1 + x * x)),
     "a factor computed from the scores"),
    (_gradient_weighted_by_scores(lambda x, g: -g * x), "a factor computed from the scores"),
    # Zeroed, or added to itself through a factor of one.
    (_gradient_changed(lambda g: g * 0.0), "a factor of 0"),
    (_gradient_changed(lambda g: g + 1.0 * g), "add of a term with itself"),
    # Gated by the row's argmax, or weighted through an 'indicator' x == x: a max's
    # indicators route only the row max's own gradient.
    (_gradient_weighted_by_scores(
        lambda x, g: jnp.where(x == x.max(-1, keepdims=True), g, 0.0)),
     "a select of the gradient against another value"),
    (_gradient_weighted_by_scores(
        lambda x, g: g * ((x == x) * _WEIGHTS)),  # noqa: PLR0124 - x == x is the point
     "a factor computed from the scores"),
    # A select by a mask that is not the forward's: a frozen head, a masked row sum.
    (_gradient_changed(lambda g: jnp.where(
        (jnp.arange(programs.N) % 2 == 0)[None, :, None, None], g, 0.0)),
     "a select of the gradient against another value"),
    (_gradient_changed(lambda g: g + jnp.where(
        jnp.arange(programs.T) == 0, g, 0.0).sum(-1, keepdims=True)),
     "a select of the gradient against another value"),
    # Reductions other than the softmax's sum along the keys.
    (_gradient_changed(lambda g: g - g.max(-1, keepdims=True)),
     "a reduction other than a sum along the keys"),
    (_gradient_changed(lambda g: g - g.sum(-2, keepdims=True)),
     "a reduction other than a sum along the keys"),
], ids=["custom_vjp_clip", "custom_vjp_halve", "penalty", "where_clip", "doubled",
        "squared", "weighted", "times_the_scale", "times_its_reciprocal", "gated_by_scores",
        "divided_by_scores", "times_scores", "zeroed", "plus_one_times_itself",
        "argmax_gate", "weighted_by_an_indicator", "frozen_head", "masked_row_sum",
        "row_max_of_the_gradient", "sum_along_queries"])
def test_a_term_added_to_the_scores_gradient_is_left_unfused(change, what) -> None:
    """The backward was fused once its exits contracted the right axes: a custom_vjp
    clipping or halving the scores' gradient, or the gradient of a penalty on the scores
    (under jax.grad alone, where the penalty's forward is dead), was lost (dq and dk
    60% to 160% off); so was one multiplying it by the scale or its reciprocal, or gating
    or weighting it by the scores (100% to 320% off)."""
    def loss(q, k, v):
        s = jnp.einsum("btnh,bsnh->bnts", q, k) / 8.0
        s = s if change is None else change(s)
        causal = jnp.tril(jnp.ones((programs.T, programs.T), bool))
        s = jnp.where(causal, s, -1e9)
        out = jnp.einsum("bnts,bsnh->btnh", jax.nn.softmax(s, -1), v)
        penalty = 0.05 * jnp.sum(s ** 2) if change is None else 0.0
        return jnp.sum(out * jnp.cos(out)) + penalty

    reasons = _reasons(jax.grad(loss, argnums=(0, 1, 2)), _qkv(), "bf16", "h100")
    assert reasons and reasons[0].startswith(
        f"the gradient of the scores has a term the softmax's does not ({what})"), reasons


def _row_max(s):
    return s.max(-1, keepdims=True)


def _softmax_with_backward(backward):
    """A softmax whose custom_vjp backward is ``backward(p, x, g)``."""
    @jax.custom_vjp
    def softmax(x):
        e = jnp.exp(x - jax.lax.stop_gradient(_row_max(x)))
        return e / e.sum(-1, keepdims=True)

    def forward(x):
        p = softmax(x)
        return p, (p, x)

    softmax.defvjp(forward, lambda res, g: (backward(*res, g),))
    return softmax


def _row_term(p, g):  # the softmax's own row term, sum(g * p) along the keys
    return (g * p).sum(-1, keepdims=True)


@pytest.mark.parametrize(("backward", "fused"), [
    (lambda p, x, g: p * (g - _row_term(p, g)), True),  # the softmax's own gradient
    (lambda p, x, g: p * (g - 0.5 * _row_term(p, g)), False),
    (lambda p, x, g: p * (g - _row_term(p, g) * _row_max(x)), False),
    (lambda p, x, g: p * (g - jnp.where(_row_max(p) > 0.3, _row_term(p, g), 0.0)), False),
], ids=["exact", "row_term_halved", "row_term_times_the_row_max", "row_term_gated"])
def test_only_the_row_maxs_gradient_may_be_scaled_or_gated(backward, fused) -> None:
    """9eb6413 let any term that does not vary along the keys be scaled or gated, as the
    row max's gradient (zero) may be; the softmax's own row term sum(g * p) is not
    zero, and a backward scaling it was fused (24% to 41% off)."""
    softmax = _softmax_with_backward(backward)

    def attend(q, k, v):
        scores = jnp.einsum("btnh,bsnh->bnts", q, k) * 0.25
        return jnp.einsum("bnts,bsnh->btnh", softmax(scores), v)

    step = jax.grad(lambda q, k, v: jnp.sum(jnp.sin(attend(q, k, v))), argnums=(0, 1, 2))
    (site,) = hlo_amp.compile(step, "bf16").lower(*_qkv(), target="h100").report().attention
    assert site.fused == fused, site


@pytest.mark.parametrize("shifted", [
    lambda s: s - jnp.where(jnp.isneginf(_row_max(s)), 0.0, _row_max(s)),  # a guard
    lambda s: s - jnp.max(s, -1, keepdims=True, initial=-jnp.inf),
    lambda s: s - jnp.maximum(_row_max(s), -1e30),  # a floor
    lambda s: s * 0.35 - _row_max(s) * 0.35,  # the scale after the max
], ids=["guard", "initial", "floor", "scale_after_max"])
def test_a_softmax_whose_row_max_is_guarded_still_fuses(shifted) -> None:
    """The gradient through a softmax's row max (not stop_gradient'ed) is zero whatever
    is computed on it: a guard, initial=, a floor or a scale there was taken for a term
    the softmax's gradient has not (refused after 03acd88)."""
    causal = jnp.tril(jnp.ones((programs.T, programs.T), bool))

    def attend(q, k, v):
        s = jnp.where(causal, jnp.einsum("btnh,bsnh->bnts", q, k), -jnp.inf)
        e = jnp.exp(shifted(s))
        return jnp.einsum("bnts,bsnh->btnh", e / e.sum(-1, keepdims=True), v)

    step = jax.grad(lambda q, k, v: jnp.sum(jnp.sin(attend(q, k, v))), argnums=(0, 1, 2))
    sites = hlo_amp.compile(step, "bf16").lower(*_qkv(), target="h100").report().attention
    assert [(s.fused, s.reason) for s in sites] == [(True, "")], sites


_POWER = "a power of the probabilities other than the softmax's"


@pytest.mark.parametrize(("on", "change", "what"), [
    ("p", lambda p, g: g * p, _POWER),
    ("p", lambda p, g: g * (p > 0.1), "a factor computed from the scores"),
    ("p", lambda p, g: g / (p + 1.0), "a factor computed from the scores"),
    ("e", lambda e, g: g * e.sum(-1, keepdims=True), _POWER),
    ("e", lambda e, g: g / e.sum(-1, keepdims=True), _POWER),
], ids=["times_p", "gated_by_p", "divided_by_p_plus_1", "e_times_its_sum",
        "e_over_its_sum"])
def test_a_custom_vjp_on_the_probabilities_is_left_unfused(on, change, what) -> None:
    """A custom_vjp on P multiplying its gradient by a function of P was fused (the
    softmax's own gradient multiplies by P, and any value made from P passed for one):
    dq and dk 26% to 285% off; so was one on the exponential weighting its gradient by
    the exponential's sum, which counted as no power of P (68% to 78% off)."""
    @jax.custom_vjp
    def hooked(x):
        return x

    hooked.defvjp(lambda x: (x, x), lambda x, g: (change(x, g),))

    def attend(q, k, v):
        s = jnp.einsum("btnh,bsnh->bnts", q, k) * 0.25
        if on == "p":
            return jnp.einsum("bnts,bsnh->btnh", hooked(jax.nn.softmax(s, -1)), v)
        e = hooked(jnp.exp(s - jax.lax.stop_gradient(s.max(-1, keepdims=True))))
        return jnp.einsum("bnts,bsnh->btnh", e / e.sum(-1, keepdims=True), v)

    reasons = _reasons(jax.grad(lambda q, k, v: jnp.sum(jnp.sin(attend(q, k, v))),
                                argnums=(0, 1, 2)), _qkv(), "bf16", "h100")
    assert reasons and reasons[0].startswith(
        f"the gradient of the scores has a term the softmax's does not ({what}"), reasons


@pytest.mark.parametrize("gate", [
    lambda m, g: jnp.where(m[:, None, :, None], g, 0.0),  # the padding along the queries
    lambda m, g: jnp.where(m[:, None, None, :], 0.0, g),  # inverted
], ids=["along_the_queries", "inverted"])
def test_a_gradient_selected_by_the_forward_mask_laid_out_otherwise_is_left_unfused(
        gate) -> None:
    """A custom_vjp selecting the scores' gradient by the forward's own padding mask,
    broadcast along the other axis or with the sides swapped, was fused: its root is the
    forward mask's (dq 56% off; inverted: zero gradients came out full)."""
    b, t = programs.B, programs.T
    pad = jnp.arange(t)[None, :] < jnp.array([5] + [t] * (b - 1))[:, None]

    @jax.custom_vjp
    def hooked(s, m):
        return s

    hooked.defvjp(lambda s, m: (s, m), lambda m, g: (gate(m, g), None))

    def attend(q, k, v, m):
        s = jnp.where(m[:, None, None, :], jnp.einsum("btnh,bsnh->bnts", q, k) * 0.35, -1e9)
        return jnp.einsum("bnts,bsnh->btnh", jax.nn.softmax(hooked(s, m), -1), v)

    step = jax.grad(lambda q, k, v, m: jnp.sum(jnp.sin(attend(q, k, v, m))), argnums=(0, 1, 2))
    reasons = _reasons(step, (*_qkv(), pad), "bf16", "h100")
    assert reasons and reasons[0].startswith(
        "the gradient of the scores has a term the softmax's does not (a select"), reasons


def test_a_softmax_whose_sum_is_held_constant_is_left_unfused() -> None:
    """e / stop_gradient(sum(e)): the scores' gradient is P·dP alone, with no row term,
    and cuDNN's backward subtracts it (dq 88% off, fused before)."""
    def attend(q, k, v):
        s = jnp.einsum("btnh,bsnh->bnts", q, k) * 0.35
        e = jnp.exp(s - jax.lax.stop_gradient(s.max(-1, keepdims=True)))
        p = e / jax.lax.stop_gradient(e.sum(-1, keepdims=True))
        return jnp.einsum("bnts,bsnh->btnh", p, v)

    reasons = _reasons(jax.grad(lambda q, k, v: jnp.sum(jnp.sin(attend(q, k, v))),
                                argnums=(0, 1, 2)), _qkv(), "bf16", "h100")
    assert reasons and "e^1 s^-1" in reasons[0], reasons


def test_dropout_on_the_probabilities_is_named() -> None:
    """NNX attention with dropout in training: cuDNN would draw other random numbers."""
    from flax import nnx

    layer = nnx.MultiHeadAttention(num_heads=4, in_features=32, qkv_features=32,
                                   decode=False, dropout_rate=0.1, rngs=nnx.Rngs(0))

    @hlo_amp.compile(policy="bf16")
    def step(model, x):
        return nnx.grad(lambda model: jnp.sum(model(x, deterministic=False) ** 2))(model)

    report = step.lower(layer, jnp.ones((2, 16, 32)), target="h100").report()
    assert [s.reason for s in report.attention] == [
        "dropout on the probabilities (cuDNN's dropout draws its own random numbers)"]


def _scores(q, k):
    return jnp.einsum("btnh,bsnh->bnts", q, k) / 8.0


def _dropout_forward(q, k, v):
    probs = jax.nn.softmax(_scores(q, k), axis=-1)
    keep = jax.random.bernoulli(jax.random.key(0), 0.9, probs.shape)
    return jnp.einsum("bnts,bsnh->btnh", jnp.where(keep, probs / 0.9, 0), v)


def _softmax_where(q, k, v):
    causal = jnp.tril(jnp.ones((programs.T, programs.T), bool))
    probs = jax.nn.softmax(_scores(q, k), axis=-1, where=causal)
    return jnp.einsum("bnts,bsnh->btnh", probs, v)


def _plain(q, k, v):
    return jnp.einsum("bnts,bsnh->btnh", jax.nn.softmax(_scores(q, k), axis=-1), v)


def _soft_capped(q, k, v):  # Gemma 2's attention logit soft-capping
    probs = jax.nn.softmax(30.0 * jnp.tanh(_scores(q, k) / 30.0), axis=-1)
    return jnp.einsum("bnts,bsnh->btnh", probs, v)


def _sum_plus_eps(q, k, v):
    scores = _scores(q, k)
    e = jnp.exp(scores - jax.lax.stop_gradient(scores.max(-1, keepdims=True)))
    return jnp.einsum("bnts,bsnh->btnh", e / (e.sum(-1, keepdims=True) + 1e-6), v)


def _softmax_over_queries(q, k, v):
    return jnp.einsum("bnts,bsnh->btnh", jax.nn.softmax(_scores(q, k), axis=-2), v)


@pytest.mark.parametrize(("fn", "reason", "direction"), [
    (_dropout_forward, "dropout on the probabilities", "forward"),
    (programs._grad_of(_dropout_forward), "dropout on the probabilities", "backward"),
    (_softmax_where, "softmax(where=) masks the softmax's sum", "forward"),
    (programs._grad_of(_softmax_where), "softmax(where=) masks the softmax's sum", "backward"),
    (programs._grad_of(jax.checkpoint(_plain, policy=jax.checkpoint_policies.dots_saveable)),
     "the scores are saved for the backward pass", "forward and backward"),
    # jax marks what these save with a reduce_precision to the values' own format (in a
    # scan, and every value under everything_saveable): the sites were missing.
    (programs._grad_of(lambda q, k, v: jax.lax.scan(
        lambda h, _: (jax.checkpoint(_plain, policy=jax.checkpoint_policies.dots_saveable)(
            h, k, v), None), q, None, length=2)[0]),
     "the scores are saved for the backward pass", "forward and backward"),
    (programs._grad_of(jax.checkpoint(
        _plain, policy=jax.checkpoint_policies.everything_saveable)),
     "the softmax's exponential and its sum are saved for the backward pass",
     "forward and backward"),
    (programs._grad_of(_plain, 1),
     "only part of the attention's backward reads it (the gradient of q or k alone)",
     "backward"),
    (jax.grad(lambda v, q, k: jnp.sum(_plain(q, k, v) ** 2)),
     "only part of the attention's backward reads it (dv, out)", "forward and backward"),
    (jax.grad(lambda q, k, v: jnp.sum(jax.jit(_plain)(q, k, v) ** 2), argnums=(0, 1, 2)),
     ("the scores or probabilities have another reader: its function returns them to "
      "another function's backward"), "forward and backward"),
    (_soft_capped, "the scores pass through tanh before the softmax", "forward"),
    (programs._grad_of(_soft_capped), "the scores pass through tanh before the softmax",
     "backward"),
    (jax.grad(lambda q, k, v: jnp.sum(_soft_capped(q, k, v) ** 2), argnums=(0, 1, 2)),
     "the scores pass through tanh before the softmax", "forward and backward"),
    (_sum_plus_eps, "the softmax divides by its sum plus a term", "forward"),
    (programs._grad_of(_sum_plus_eps), "the softmax divides by its sum plus a term",
     "backward"),
    (_softmax_over_queries, "the softmax runs along the queries", "forward"),
    (programs._grad_of(_softmax_over_queries), "the softmax runs along the queries",
     "backward"),
    (jax.grad(lambda q, k, v: jnp.sum(_softmax_over_queries(q, k, v) ** 2), argnums=(0, 1, 2)),
     "the softmax runs along the queries", "forward and backward"),
    # jax.jvp: the tangents' matrix ops read the probabilities too ("backward" before).
    (lambda q, k, v: jax.jvp(_plain, (q, k, v), (q, k, v)),
     "two matrix ops read the attention as its out", "forward"),
    # In q alone: "forward and backward", "only part of the attention's backward reads it".
    (lambda q, k, v: jax.jvp(lambda q: _plain(q, k, v), (q,), (q,)),
     "jax.jvp's tangents read the attention (forward-mode differentiation)", "forward"),
], ids=["dropout_forward", "dropout_training", "softmax_where", "softmax_where_training",
        "dots_saveable", "dots_saveable_scan", "everything_saveable", "grad_of_q", "grad_of_v", "inner_jit", "soft_capped",
        "soft_capped_training", "soft_capped_squared_loss", "sum_plus_eps", "sum_plus_eps_training",
        "softmax_over_queries", "softmax_over_queries_training",
        "softmax_over_queries_squared_loss", "jvp", "jvp_in_q"])
def test_sites_left_unfused_are_listed_with_their_reason(fn, reason, direction) -> None:
    """Each is an attention the kernel cannot take; the report lists it, with why and the
    pass it is in (these were missing from the report, and a refused training step's
    site said "forward"; a jax.jit attention's gradient said "forward", "the function
    returns them"; a soft-capped or sum-plus-eps attention was not listed, or listed as
    a backward reading part of it, and so was a softmax over the queries; in a training
    step that one read "only part of the attention's backward reads it", or, when the
    loss read the output, matched as an attention that only a later check refused)."""
    sites = hlo_amp.compile(fn, "bf16").lower(*_qkv(), target="h100").report().attention
    assert [(s.fused, s.direction) for s in sites] == [(False, direction)], sites
    assert sites[0].reason.startswith(reason)


def test_an_attention_whose_softmax_is_far_from_its_scores_is_still_listed() -> None:
    """A matrix op that no exponential follows is told cheaply (the probe before the
    cluster's walk); one whose chain goes on past the probe's reach is the walk's to
    tell: thirty bias adds left the attention out of the report."""
    bias = jnp.full((30, programs.T, programs.T), 0.01)

    def attend(q, k, v, bias):
        scores = _scores(q, k)
        for i in range(30):
            scores = scores + bias[i]
        return jnp.einsum("bnts,bsnh->btnh", jax.nn.softmax(scores, axis=-1), v)

    sites = hlo_amp.compile(attend, "bf16").lower(*_qkv(), bias, target="h100").report(
        ).attention
    assert [(s.fused, s.reason.split(" (")[0]) for s in sites] == [
        (False, "an additive bias on the scores")]


@pytest.mark.parametrize("grad", [False, True], ids=["forward", "training"])
def test_a_fused_sites_matmuls_count_in_the_flop_share(grad) -> None:
    """The kernel's matmuls run in 16 bit: their FLOPs (the program's matmuls it
    replaces) count in the summary's share and in flops_by_scope, as they do where the
    attention is not fused. With the projections kept f32 the share was 0% for an H100
    (the attention's matmuls, most of the FLOPs, are no decisions there) and 91% on CPU."""
    def attend(x, w):
        with jax.named_scope("proj"):
            q, k, v = (jnp.einsum("btd,dnh->btnh", x, w[i]) for i in range(3))
        with jax.named_scope("attn"):
            return _plain(q, k, v)

    fn = jax.grad(lambda x, w: jnp.sum(attend(x, w) ** 2), argnums=1) if grad else attend
    x, w = jnp.ones((2, programs.T, 64)), jnp.ones((3, 64, 2, 64)) * 0.1
    policy = "bf16,scope:proj=float32"
    cpu = hlo_amp.compile(fn, policy).lower(x, w).report()
    gpu = hlo_amp.compile(fn, policy).lower(x, w, target="h100").report()
    assert [s.fused for s in gpu.attention] == [True] and not cpu.attention[0].fused
    share = re.compile(r"(\d+)% of FLOPs in 16-bit")
    assert share.search(gpu.summary()).group(1) == share.search(cpu.summary()).group(1) != "0"
    assert gpu.flops_by_scope()["attn"] == cpu.flops_by_scope()["attn"]


def test_a_checkpoint_policy_saving_no_scores_fuses() -> None:
    policy = jax.checkpoint_policies.nothing_saveable
    fn = programs._grad_of(jax.checkpoint(_plain, policy=policy))
    sites = hlo_amp.compile(fn, "bf16").lower(*_qkv(), target="h100").report().attention
    assert [s.fused for s in sites] == [True]


def test_a_softmax_classifier_is_no_attention_site() -> None:
    """A softmax cross-entropy's gradient reads the softmax with matrix ops too, and draws
    its dropout from random bits: it is not listed."""
    def loss(w, x, labels):
        keep = jax.random.bernoulli(jax.random.key(1), 0.9, x.shape)
        logits = jnp.where(keep, x / 0.9, 0) @ w
        probs = jax.nn.softmax(logits, axis=-1)
        return -jnp.mean(jnp.log(jnp.take_along_axis(probs, labels[:, None], axis=-1)))

    args = (jnp.ones((32, 10)), jnp.ones((8, 32)), jnp.arange(8) % 10)
    lowered = hlo_amp.compile(jax.grad(loss), "bf16").lower(*args, target="h100")
    assert lowered.report().attention == []


def test_a_scanned_sites_flops_count_every_layer() -> None:
    """A fused site in a scanned layer reported one layer's FLOPs (a quarter of four
    layers' on H100, where the CPU form and an unrolled stack count all four)."""
    layers = 4

    def layer(h, w):
        qkv, out = w
        with jax.named_scope("proj"):
            q, k, v = (jnp.einsum("btd,dnh->btnh", h, qkv[i]) for i in range(3))
        with jax.named_scope("attn"):
            return h + jnp.einsum("btnh,nhd->btd", _plain(q, k, v), out), None

    def loss(w, x):
        h, _ = jax.lax.scan(jax.checkpoint(layer), x, w)
        return jnp.mean(h ** 2)

    x = jnp.ones((2, programs.T, 64))
    keys = jax.random.split(jax.random.key(0))
    w = (jax.random.normal(keys[0], (layers, 3, 64, 2, 64)) * 0.05,
         jax.random.normal(keys[1], (layers, 2, 64, 64)) * 0.05)
    policy = "bf16,scope:proj=float32"
    cpu = hlo_amp.compile(jax.grad(loss), policy).lower(w, x).report()
    gpu = hlo_amp.compile(jax.grad(loss), policy).lower(w, x, target="h100").report()
    assert gpu.attention and all(s.fused for s in gpu.attention)
    assert gpu.flops_by_scope()["attn"] == cpu.flops_by_scope()["attn"]
    # Per layer: the forward's Q·Kᵀ and P·V, and the backward's recomputed Q·Kᵀ and P·V,
    # dP, dV, dQ, dK; each 2·B·N·T·S·H.
    one_layer = (2 + 6) * 2 * 2 * 2 * programs.T * programs.T * 64
    assert sum(s.flops for s in gpu.attention) == layers * one_layer


def test_one_kv_head_under_a_constant_output_gradient_fuses() -> None:
    """A loss linear in the output (dO a constant) with one kv head: jax's backward gives
    v without the kv-head dimension. The rewrite raised half-way on it (PassError: the
    compile failed), then the site was refused; the kernel's reshape now puts the size-1
    dimension back (its numbers: attention_programs' ``dpa_one_kv_head_linear_loss``)."""
    q, kv = jnp.ones((2, programs.T, 4, 64)), jnp.ones((2, programs.T, 1, 64))
    step = jax.grad(lambda q, k, v: jnp.sum(jax.nn.dot_product_attention(q, k, v)),
                    argnums=(0, 1, 2))
    lowered = hlo_amp.compile(step, "mixed_bfloat16").lower(q, kv, kv, target="h100")
    sites = lowered.report().attention
    assert sites and all(s.fused for s in sites), [s.reason for s in sites]
    assert "__cudnn$fmhaSoftmaxBackward" in lowered.compile().as_text()


@pytest.mark.parametrize("name", sorted(PROGRAMS))
def test_every_matrix_op_that_starts_an_attention_is_an_exponentials_source(name: str) -> None:
    """The pass asks only the matrix ops an exponential follows (``exponential_sources``,
    found walking back from each exponential): it asked every one, through a probe and
    often a walk of up to 400 ops, 0.23 of a 12-layer step's 0.46 s of passes. No site
    the matcher finds may be left out, and the MLP's matrix ops are not asked."""
    from hlo_amp.passes.fused_attention.calls import CallView
    from hlo_amp.passes.fused_attention.match import exponential_sources, match_site
    from hlo_amp.passes.fused_attention.roles import NotFused

    module = parse_module(_lowered_text(name))
    view = CallView(module)
    sources = exponential_sources(view, module)
    assert sources is not None
    dots = [op for op in walk_operations(module, names=frozenset({"stablehlo.dot_general"}))]
    starts = 0
    for op in dots:
        try:
            match_site(view, op)
        except NotFused as error:
            if not error.attention:
                continue
        starts += 1
        assert op_key(op) in sources, (name, str(op.location))
    assert starts >= 1
    assert len(sources) < len(dots) or len(dots) <= 4 * starts


def test_a_transformer_asks_its_attention_matmuls_only() -> None:
    """Two layers of attention and an MLP on a residual stream, with a gradient: the MLP's
    and projections' matrix ops reach no exponential, however far the stream goes."""
    from hlo_amp.passes.fused_attention.calls import CallView
    from hlo_amp.passes.fused_attention.match import exponential_sources

    def layer(p, x):
        q, k, v = x @ p["q"], x @ p["k"], x @ p["v"]
        x = x + jax.nn.softmax(q @ k.T / 4.0, axis=-1) @ v @ p["o"]
        return x + jnp.tanh(x @ p["up"]) @ p["down"]

    def loss(ps, x):
        for p in ps:
            x = layer(p, x)
        return jnp.mean(x ** 2)

    ps = [{n: jnp.ones((16, 16)) * 0.1 for n in ("q", "k", "v", "o", "up", "down")}] * 2
    module = parse_module(jax.jit(jax.grad(loss)).lower(ps, jnp.ones((8, 16))).as_text())
    sources = exponential_sources(CallView(module), module)
    dots = walk_operations(module, names=frozenset({"stablehlo.dot_general"}))
    scores = [op for op in dots if op_key(op) in sources]
    # Each layer's q @ k.T (the softmax's backward reads the exponential's result: it
    # makes none of its own), of 45 matrix ops.
    assert len(scores) == 2, [str(op.location) for op in scores]
    assert len(dots) >= 30


def test_an_exponential_of_a_long_chain_leaves_every_matrix_op_asked() -> None:
    """A walk back that outgrows its budget (an exponential of 500 elementwise ops) gives
    no filter: every matrix op is asked, and the attention beside it is still found."""
    from hlo_amp.passes.fused_attention.calls import CallView
    from hlo_amp.passes.fused_attention.match import exponential_sources

    def fn(q, k, v, x):
        out = jax.nn.softmax(q @ k.T, axis=-1) @ v
        for _ in range(250):
            x = x * 1.01 + 0.5
        return out, jnp.exp(x)

    args = (jnp.ones((16, 32)), jnp.ones((16, 32)), jnp.ones((16, 32)), jnp.ones((4,)))
    text = jax.jit(fn).lower(*args).as_text()
    module = parse_module(text)
    assert exponential_sources(CallView(module), module) is None
    _, report = _fuse(text)
    assert [site.fused for site in report.attention] == [True]


def _router(x, w, experts):
    p = jax.nn.softmax(jnp.einsum("btd,de->bte", x, w), -1)
    return jnp.einsum("bte,bted->btd", p, experts)


def _value_per_query(q, k, v):
    p = jax.nn.softmax(jnp.einsum("btd,bsd->bts", q, k), -1)
    return jnp.einsum("bts,btsd->btd", p, v)


def _decode_without_query_axis(q, k, v):
    s = jnp.einsum("bnh,bsnh->bns", q, k) * 16 ** -0.5
    return jnp.einsum("bns,bsnh->bnh", jax.nn.softmax(s, -1), v)


@pytest.mark.parametrize(("fn", "shapes", "reason"), [
    # a mixture of experts' router weighting each token's expert outputs: compiled for
    # an H100 the rewritten module failed to verify ("number of output elements"); no
    # attention, no site
    (_router, [(2, 16, 16), (16, 8), (2, 16, 8, 16)], None),
    (_value_per_query, [(2, 16, 16), (2, 16, 16), (2, 16, 16, 16)], None),
    # q [B, N, H] against a cache: "not analysed (ValueError: max() arg is an empty
    # sequence)"
    (_decode_without_query_axis, [(2, 4, 16), (2, 16, 4, 16), (2, 16, 4, 16)],
     "the query has no query-length dimension"),
], ids=["router", "value_per_query", "decode_without_query_axis"])
def test_a_softmax_mix_the_kernel_cannot_compute_is_left_with_its_reason(fn, shapes,
                                                                         reason) -> None:
    args = [jax.random.normal(jax.random.key(i), shape) for i, shape in enumerate(shapes)]
    compiled = hlo_amp.compile(fn, "mixed_bfloat16").lower(*args, target="h100").compile()
    if reason is None:
        assert compiled.report().attention == []
    else:
        [site] = compiled.report().attention
        assert not site.fused and site.reason.startswith(reason), site.reason
    np.testing.assert_allclose(hlo_amp.compile(fn, "mixed_bfloat16")(*args), jax.jit(fn)(*args),
                               rtol=3e-2, atol=3e-2)


def test_an_attention_inside_a_composite_is_ruled_by_the_composites_scope() -> None:
    """A composite's decomposition is named under the composite's scope: the attention
    inside one under named_scope("attn") was fused in bf16 with scope '' although
    scope:attn=float32 asked to keep it, and the rule read "matched no op"."""
    sdpa = jax.lax.composite(
        lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=True), name="my.attn")

    def net(q, k, v):
        with jax.named_scope("attn"):
            return sdpa(q, k, v)

    q = jax.random.normal(jax.random.key(0), (2, 128, 4, 64))
    for policy, fused in (("bf16", True), ("bf16,scope:attn=float32", False)):
        sites = hlo_amp.compile(net, policy).lower(q, q, q, target="h100").report().attention
        assert [(s.scope, s.fused) for s in sites] == [("attn", fused)], sites
