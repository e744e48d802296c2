"""The fused-attention kernels the fused-attention pass (passes/fused_attention/) puts in
place of a softmax attention: cuDNN's flash attention, lowered by jax itself, and a
reference with the same interface for checking the rewrite on a machine without a GPU.

A kernel is two StableHLO functions, lowered once per shape (``lower_kernel``):

- ``forward(q, k, v[, bias]) -> (o, *residuals)`` (for a training step; an inference
  step's forward returns ``o`` alone), with q ``[B, T, N, H]``, k and v ``[B, S, K, H]``
  (jax's ``BTNH`` layout; K divides N: grouped-query attention), bias ``[B|1, N|1, T, S]``;
- ``backward(*residuals, do) -> (dq, dk, dv)``.

Both come from ``jax.vjp`` of the kernel's jax function: the residuals are the leaves of
the vjp function, so the pair is exactly what jax runs for
``jax.nn.dot_product_attention(implementation="cudnn")``: the same ``__cudnn$fmhaSoftmax``
/ ``...Backward`` custom calls, backend configuration and layouts, in whichever jax
version is installed (nothing here writes cuDNN's JSON). jax checks the cuDNN version and
the GPU's compute capability while it traces, which fails where there is no GPU; a
deviceless lowering answers those two checks for the target instead
(``jax_internals.cudnn_checks_answered``): cuDNN 9.10, as the deviceless GPU targets'
``dnn_version`` (targets/gpu.py).

``reference`` is jax's own XLA attention (``jax.nn.dot_product_attention(...,
implementation="xla")``) on the same arguments: a program rewritten with it runs on a
CPU and computes what the cuDNN kernel computes, which is how the tests check what the
pass wires (layouts, heads, masks, scale) without a GPU.
"""

from __future__ import annotations

import contextlib
import functools
from dataclasses import dataclass

from hlo_amp.quiet_stderr import fd2_filtered, import_jax_for_cli

# jax is imported in the functions that lower a kernel, not here: the fused-attention pass
# imports this module, and hlo-amp-opt runs passes without jax (hlo_amp/jaxlib_internals.py).

KERNELS = ("cudnn", "reference")
# The cuDNN version a deviceless lowering reports to jax (targets/gpu.py's dnn_version).
DEVICELESS_CUDNN = 91000


@dataclass(frozen=True)
class AttentionCall:
    """One fused call's shapes and options (jax's BTNH layout)."""

    batch: int
    q_len: int  # T
    kv_len: int  # S
    q_heads: int  # N
    kv_heads: int  # K (divides N)
    head_dim: int  # H (q, k and v alike)
    dtype: str  # "bfloat16" or "float16"
    scale: float
    causal: bool
    bias_shape: tuple[int, int, int, int] | None  # [B|1, N|1, T, S], in ``dtype``
    training: bool  # a backward function too, and the forward returns residuals
    # Under the causal mask, cuDNN's sliding window: keys t - window < s <= t (0: none).
    window: int = 0

    @property
    def q_shape(self) -> tuple[int, int, int, int]:
        return (self.batch, self.q_len, self.q_heads, self.head_dim)

    @property
    def kv_shape(self) -> tuple[int, int, int, int]:
        return (self.batch, self.kv_len, self.kv_heads, self.head_dim)


@dataclass(frozen=True)
class Kernel:
    """The kernel's functions as StableHLO text (each a module whose ``@main`` is it)."""

    forward: str
    backward: str | None  # None for an inference call
    residuals: int  # how many residuals the forward returns after ``o``


def lower_kernel(call: AttentionCall, kernel: str = "cudnn",
                 compute_capability: tuple[int, int] | None = None) -> Kernel:
    """``kernel``'s functions for ``call`` (cached per arguments). ``compute_capability``:
    the GPU compiled for without it (None: the GPU of this machine, asked by jax)."""
    if kernel not in KERNELS:
        raise ValueError(f"kernel={kernel!r}; accepted: {', '.join(KERNELS)}")
    import_jax_for_cli()  # quietly, on CPU, in hlo-amp-opt (a no-op elsewhere)
    return _lower(call, kernel, compute_capability)


@functools.lru_cache(maxsize=64)
def _lower(call: AttentionCall, kernel: str,
           compute_capability: tuple[int, int] | None) -> Kernel:
    import jax
    import jax.numpy as jnp

    from hlo_amp import jax_internals as internals

    dtype = jnp.dtype(call.dtype)
    q = jax.ShapeDtypeStruct(call.q_shape, dtype)
    kv = jax.ShapeDtypeStruct(call.kv_shape, dtype)
    bias = (jax.ShapeDtypeStruct(call.bias_shape, dtype) if call.bias_shape is not None
            else None)
    attend = _cudnn(call) if kernel == "cudnn" else _reference(call)
    platform = "cuda" if kernel == "cudnn" else "cpu"
    inputs = (q, kv, kv) + ((bias,) if bias is not None else ())

    def with_bias(q, k, v, *bias_arg):  # the bias, if any: an input, never differentiated
        return attend(q, k, v, *(bias_arg or (None,)))

    # Lowering cuDNN's call starts jax's CUDA backend, whose stub prints "Could not find
    # cuda drivers" where there is no GPU: dropped (hlo_amp/quiet_stderr.py).
    quiet = (fd2_filtered() if kernel == "cudnn" and compute_capability is not None
             else contextlib.nullcontext())
    with quiet, _outside_any_mesh(), internals.cudnn_checks_answered(
            compute_capability, DEVICELESS_CUDNN, active=kernel == "cudnn"):
        if not call.training:
            forward, _outputs = _text(with_bias, inputs, platform)
            return Kernel(forward, None, 0)
        tree_box = []

        def forward_fn(q, k, v, *bias_arg):
            out, vjp = jax.vjp(lambda q, k, v: with_bias(q, k, v, *bias_arg), q, k, v)
            leaves, tree = jax.tree.flatten(vjp)
            tree_box.append(tree)
            return (out, *leaves)

        forward, outputs = _text(forward_fn, inputs, platform)
        residual_avals = [jax.ShapeDtypeStruct(x.shape, x.dtype) for x in outputs[1:]]
        tree = tree_box[-1]

        def backward_fn(*args):
            *residuals, d_out = args
            return tuple(jax.tree.unflatten(tree, residuals)(d_out))

        backward, _outputs = _text(backward_fn, (*residual_avals, q), platform)
    return Kernel(forward, backward, len(residual_avals))


def _outside_any_mesh() -> contextlib.AbstractContextManager:
    """No jax.set_mesh mesh while a kernel is lowered: its functions serve every module
    (cached), and under an Explicit mesh they held sharding constraints naming a mesh
    another module lacks ("'sdy.sharding_constraint' op unknown mesh: @mesh")."""
    import jax

    try:
        return jax.set_mesh(None)
    except ValueError:  # inside a trace: no mesh of jax.set_mesh's to leave
        return contextlib.nullcontext()


def _text(function, inputs: tuple, platform: str) -> tuple[str, list]:
    """``function`` lowered for ``platform``: its StableHLO text (every argument kept,
    locations in) and its outputs' shapes, from one trace."""
    import jax

    traced = jax.jit(function, keep_unused=True).trace(*inputs)
    lowered = traced.lower(lowering_platforms=(platform,))
    return lowered.as_text(debug_info=True), jax.tree.leaves(traced.out_info)


def _cudnn(call: AttentionCall):
    """jax's cuDNN attention (what ``jax.nn.dot_product_attention(implementation=
    "cudnn")`` calls), BTNH, with the call's scale, mask type and bias."""
    from hlo_amp import jax_internals as internals

    cudnn = internals.cudnn_attention_module()
    mask_type = cudnn.MaskType.CAUSAL if call.causal else cudnn.MaskType.NO_MASK

    def attend(q, k, v, bias):
        return cudnn.dot_product_attention(q, k, v, bias, scale=call.scale,
                                           mask_type=mask_type, qkv_layout="BTNH",
                                           sliding_window_length=call.window or None)

    return attend


def _reference(call: AttentionCall):
    """XLA's attention with the cuDNN kernel's arguments and result. In f16 it runs on
    f32 copies: jax's XLA attention asks for an F16_F16_F32 dot algorithm, which
    XLA:CPU refuses; the products and f32 sums are the same, the probabilities stay f32
    where an f16 P·V rounds them (2^-11)."""
    import jax
    import jax.numpy as jnp

    def attend(q, k, v, bias):
        wide = q.dtype == jnp.float16
        if wide:
            q, k, v = (x.astype(jnp.float32) for x in (q, k, v))
            bias = None if bias is None else bias.astype(jnp.float32)
        # cuDNN's window, the left one, exclusive (jax's own conversion of
        # local_window_size in jax.nn.dot_product_attention).
        window = (call.window - 1, 0) if call.window else None
        out = jax.nn.dot_product_attention(q, k, v, bias=bias, scale=call.scale,
                                           is_causal=call.causal, local_window_size=window,
                                           implementation="xla")
        return out.astype(jnp.float16) if wide else out

    return attend
