"""Fused attention: under a 16-bit policy on a GPU with cuDNN's flash attention, every
softmax attention of the program, however it was written (``jax.nn.dot_product_attention``,
an einsum, Flax's, Equinox's), forward and backward, runs as cuDNN's fused kernel, the
one ``jax.nn.dot_product_attention(implementation="cudnn")`` runs, with q, k and v in the
policy's 16-bit type: the S×S scores and probabilities leave the program.

The pass runs first (the other passes then see the kernel's 16-bit inputs and outputs as
converts around it). For each ``dot_general`` it asks `match.match_site` whether an
attention starts there; for each one found it decides:

- fused, when the target can run the kernel (``Target.fused_attention_obstacle``), the
  program is not partitioned over several devices (XLA cannot partition the kernel's
  custom call), the policy computes the scores' and the output's matmuls in a 16-bit
  type (``bf16``/``f16``, the mixed modes; an fp8 policy's attention runs in its
  16-bit compute type), cuDNN takes the shapes (head dimension a multiple of 8, at most
  128, or 256 from compute capability 9.0; q, k and v of one head dimension) and the
  mask is none, causal or a boolean mask (a bias);
- else left as it is, and the report says why.

Each site, fused or not, is one `AttentionSite` of the report (``Report.attention``).
The kernel comes from targets/attention_kernels.py: ``cudnn``, or ``reference``
(jax's XLA attention with the same interface, for checking the rewrite on a CPU, and for
measuring on a CPU what a GPU's program computes: ``default_pipeline``'s ``fused_as``).
Either is fused where ``target`` can run cuDNN's kernel; the reference kernel's matmuls
are marked as the kernel's own (``modules.mark_kernel_matmul``): no pass decides them.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace

from jaxlib.mlir import ir

from hlo_amp.ir.loops import LoopCounts, function_runs, op_runs
from hlo_amp.ir.modules import (
    element_type,
    function_name,
    functions,
    is_attention_matmul,
    is_discarded,
    is_public,
    mark_attention,
    op_key,
    walk_operations,
)
from hlo_amp.ir.program_hints import caller_devices, forward_ends
from hlo_amp.ir.shardings import partition_count
from hlo_amp.ir.sites import Site, asks_for_precision, location_name, site_of
from hlo_amp.passes.fused_attention.calls import CallView
from hlo_amp.passes.fused_attention.match import exponential_sources, match_site
from hlo_amp.passes.fused_attention.rewrite import (
    Layout,
    bias_shape_of,
    call_of,
    discard_dead,
    layout_of,
    rewrite,
)
from hlo_amp.passes.fused_attention.roles import H_ROLE, S_ROLE, NotFused
from hlo_amp.passes.fused_attention.site import Match
from hlo_amp.passes.insert_converts.call_graph import CallGraph
from hlo_amp.policy import COMPUTE, COMPUTE_DTYPES, DTYPE_TO_ELEMENT, Policy, is_fp8
from hlo_amp.report import AttentionSite, Report
from hlo_amp.targets import NO_TARGET, Target
from hlo_amp.targets.attention_kernels import KERNELS, AttentionCall, lower_kernel

_KERNEL_NAMES = {"cudnn": "cuDNN flash", "reference": "XLA reference"}
_SIXTEEN_BIT = {"bf16": "bfloat16", "f16": "float16"}


# What fusing one site takes: its match, the kernel's layout and call, the 16-bit type.
_Planned = tuple[Match, Layout, AttentionCall, str]


@dataclass(frozen=True)
class FusedAttention:
    """Softmax attention → a fused attention kernel, where policy and target allow."""

    policy: Policy
    target: Target = NO_TARGET
    kernel: str = "cudnn"  # or "reference" (KERNELS)
    name: str = "hlo-amp-fused-attention"

    def run(self, module: ir.Module, report: Report | None = None) -> None:
        if self.kernel not in KERNELS:
            raise ValueError(f"kernel={self.kernel!r}; accepted: {', '.join(KERNELS)}")
        view = CallView(module)
        prefixes = view.call_prefixes()
        # The reference kernel stands in for cuDNN's where the target would run it.
        obstacle = self.target.fused_attention_obstacle()
        # An outer jax.jit with shardings partitions a program exported for one device.
        partitions = max(partition_count(module), caller_devices(module))
        if obstacle is None and partitions > 1:
            obstacle = (f"the program is partitioned over {partitions} devices (XLA cannot "
                        "partition the kernel's custom call)")
        fused = 0
        # A site in a scanned layer runs once per layer: its FLOPs count every run, as
        # a matrix op's decision does (they counted one, a quarter of four layers').
        loops = LoopCounts()
        runs = function_runs(module, loops)
        # Only a matrix op an exponential follows can start a softmax attention.
        sources = exponential_sources(view, module)
        ends = self._program_ends(module)
        unfused: set[tuple[str, str, str] | None] = set()  # _name_of unfused matmuls
        for fn in functions(module):
            name = function_name(fn)
            prefix = prefixes.get(name, "")
            for op in walk_operations(fn, names=frozenset({"stablehlo.dot_general"})):
                if is_discarded(op) or sources is not None and op_key(op) not in sources:
                    continue
                found = self._site(view, op, prefix, obstacle, name, ends)
                if found is None:
                    continue
                site, planned, matmuls, split = found
                times = op_runs(runs, loops, name, op).count
                if planned is not None:
                    try:
                        self._fuse(*planned, site.kernel_name)
                        fused += 1
                        matmuls = []
                    except NotFused as error:
                        site = replace(site, fused=False, reason=error.reason, kernel="",
                                       dtype="")
                # Found, not fused: its matmuls stay attention's (never fp8: a refused
                # site's went fp8 under an fp8 policy, P·V with e4m3 probabilities).
                for matmul in matmuls:
                    mark_attention(matmul)
                    if split:
                        unfused.add(_name_of(site_of(matmul.location, "dot_general",
                                                     prefix)))
                if report is not None:
                    report.attention.append(replace(site, flops=site.flops * times))
        _mark_their_backward(module, prefixes, unfused)
        if report is not None and fused:
            report.notes.append(f"fused-attention: {fused} attention site(s) run as "
                                f"{_KERNEL_NAMES[self.kernel]} attention")

    def _site(self, view: CallView, op: ir.Operation, prefix: str, obstacle: str | None,
              fn_name: str, ends: dict[int, tuple[str, ...]]
              ) -> tuple[AttentionSite, _Planned | None, list[ir.Operation], bool] | None:
        """The report's entry for the attention at ``op`` (None: no attention starts
        there), what fusing it takes when it is to be fused, its matmuls (as far as the
        matcher found them), and whether its backward is in another function."""
        site = site_of(op.location, "dot_general", prefix)
        try:
            match = match_site(view, op)
        except NotFused as error:
            if not error.attention:
                return None
            return (replace(_entry(op, site, fn_name, None, False, error.reason),
                            direction=error.direction or "forward"), None, error.matmuls,
                    error.split_backward)
        except Exception as error:  # noqa: BLE001 - matching only reads the module
            # A form the matcher does not know must not cost the user the compile: the
            # site stays as written and the report says why (a rewrite's error still
            # fails the pass: the module is half-written then).
            reason = f"not analysed ({type(error).__name__}: {error})"
            return _entry(op, site, fn_name, None, False, reason), None, [op], False
        reason = obstacle
        dtype = ""
        if reason is None:
            dtype, reason = self._dtype(match, prefix, ends)
        if reason is None:
            reason = _cudnn_obstacle(match, self.target)
        layout = layout_of(match)
        call = call_of(match, layout, dtype or "bfloat16", bias_shape_of(match, layout))
        entry = _entry(op, site, fn_name, (match, call), reason is None, reason or "",
                       dtype, _KERNEL_NAMES[self.kernel])
        return entry, ((match, layout, call, dtype) if reason is None else None), \
            _matmuls_of(view, match), False

    def _dtype(self, match: Match, prefix: str, ends: dict[int, tuple[str, ...]]
               ) -> tuple[str, str | None]:
        """The 16-bit type the policy computes the site in, or why none: every matmul of
        the site, its backward's under ``backward=``, and the program's first and last
        matrix op under their rules (a rule keeping one f32 kept it there unfused, and
        fused the site ran it in 16 bit); a site whose matmuls are 16-bit already keeps
        that type (a bf16 one went to f16 under an f16 policy: inf past 65504)."""
        actions, pinned_types = [], set()
        ops = [match.scores] + [exit_.op for exit_ in match.exits.values()]
        for op in ops:
            site = site_of(op.location, "dot_general", prefix)
            # A matmul the program pinned to 16-bit operands with f32 accumulation (jax's
            # own attention on bf16 arrays: DotAlgorithmPreset.BF16_BF16_F32) asks for
            # what the kernel does: not a pin against it.
            sixteen = _sixteen_bit_algorithm(op)
            if sixteen is not None:
                pinned_types.add(sixteen)
            rule = self.policy.decide(site.scope, "dot_general", site.gradient_pass,
                                      ends.get(op_key(op), ()),
                                      None if sixteen else asks_for_precision(op))
            actions.append(rule)
        for rule in actions:
            action = rule.action
            if action is None or action not in (COMPUTE, *COMPUTE_DTYPES) and not is_fp8(action):
                why = rule.reason or f"the policy keeps it f32 ({rule.rule})"
                return "", why
        chosen = pinned_types or {a.action if a.action in COMPUTE_DTYPES
                                  else self.policy.compute_dtype for a in actions}
        # q, k and v 16-bit already: that type (its other values, if f32, go to it too
        # only where the policy computes them in it).
        values = [v for v in (match.q, match.k, match.v) if v is not None]
        own = {_SIXTEEN_BIT.get(str(element_type(v))) for v in values}
        if None not in own and len(own) == 1:
            chosen = set(own)
        elif len(own - {None}) == 1 and own - {None} != chosen:
            return "", (f"its q, k and v are {', '.join(sorted(own - {None}))} and f32, "
                        f"which the policy computes in {', '.join(sorted(chosen))}: not one "
                        f"16-bit type")
        if len(chosen) != 1 or next(iter(chosen)) not in COMPUTE_DTYPES:
            return "", (f"the policy computes it in {', '.join(sorted(chosen))}, not one "
                        "16-bit type")
        return chosen.pop(), None

    def _program_ends(self, module: ir.Module) -> dict[int, tuple[str, ...]]:
        """The program's first and last matrix ops, and their backward's, by op, as
        insert_converts finds them (``CallGraph.find_ends``), when the policy has a rule
        for one: a site holding one is decided under that rule."""
        if (self.policy.first_matrix_op, self.policy.last_matrix_op) == (None, None):
            return {}
        graph = CallGraph(self.policy)
        for fn in functions(module):
            graph.by_name[function_name(fn)] = fn
        graph.find_ends([fn for fn in functions(module) if is_public(fn)],
                        forward_ends(module))
        return graph.end_positions()

    def _fuse(self, match: Match, layout: Layout, call: AttentionCall, dtype: str,
              name: str) -> None:
        # jax checks cuDNN itself on a GPU of this machine; compiled for a GPU without
        # it, its checks are answered for that GPU (Target.lowering_capability).
        try:
            kernel = lower_kernel(call, self.kernel, self.target.lowering_capability)
        except (NotImplementedError, ValueError) as error:  # jax's own cuDNN checks
            first = (str(error).strip().splitlines() or [type(error).__name__])[0]
            who = "cuDNN" if self.kernel == "cudnn" else "the reference kernel"
            raise NotFused(f"{who} does not take it: {first}") from None
        with match.scores.context:
            rewrite(match, kernel, call, layout, dtype, name)
            discard_dead([match.scores, *match.home_ops,
                          *(e.op for e in match.exits.values())])


def _name_of(site: Site) -> tuple[str, str, str] | None:
    """A matmul's scope, einsum and source line, which its backward's matmuls (jax's
    transpose of it) share; None where the location has no source line."""
    return None if site.source is None else (site.scope_path, site.einsum or "", site.source)


def _mark_their_backward(module: ir.Module, prefixes: dict[str, str],
                         unfused: set[tuple[str, str, str] | None]) -> None:
    """Mark the backward matmuls of unfused attentions whose backward is in another
    function that no site's analysis reached: a scan body without jax.checkpoint stacks
    its probabilities for a backward loop, a checkpointed one saving its scores or
    probabilities its saved copy (they went fp8 under an fp8 policy). Found by name: a
    backward matmul (remat's recomputed forward included) with the scope, einsum and
    source line of such an attention's matmul."""
    unfused.discard(None)
    if not unfused:
        return
    named = []  # each matmul, its site and its name
    for fn in functions(module):
        prefix = prefixes.get(function_name(fn), "")
        for op in walk_operations(fn, names=frozenset({"stablehlo.dot_general"})):
            # A fused site's matmuls, discarded but still in the module until cleanup,
            # share the names of the same attention code refused elsewhere: they are no
            # projection's (review h112).
            if is_discarded(op):
                continue
            site = site_of(op.location, "dot_general", prefix)
            named.append((op, site, _name_of(site)))
    # A name another forward matmul has too names no attention alone: a projection's
    # on the line of an attention written with @, or in the same helper (review h95).
    unfused -= {name for op, site, name in named
                if not is_attention_matmul(op) and not site.backward}
    for op, site, name in named:
        if site.backward and name in unfused:  # remat's recomputed forward too
            mark_attention(op)


def _matmuls_of(view: CallView, match: Match) -> list[ir.Operation]:
    """The matmuls of a matched attention: the scores', the output's and, in a training
    step, their backward's (the exits, and dP = dO·Vᵀ, the matmul that reads dO besides
    dV's, seen through sharding constraints)."""
    ops = [match.scores, *match.home_ops, *(e.op for e in match.exits.values())]
    if match.d_out is not None:
        ops += [reader for reader, _number, _stack in view.readers(match.d_out, ())]
    return [op for op in ops if op.operation.name == "stablehlo.dot_general"]


# MLIR's element type names of the 16-bit compute types ("bf16" -> "bfloat16").
_ALGORITHM_TYPES = {DTYPE_TO_ELEMENT[d]: d for d in COMPUTE_DTYPES}


def _sixteen_bit_algorithm(op: ir.Operation) -> str | None:
    """"bfloat16" or "float16" when ``op`` names an explicit dot algorithm with operands
    of that type, f32 accumulation and one pass; None otherwise (BF16_BF16_F32_X3 and
    _X6 split each f32 operand into 3 or 6 bf16 products, near f32: they were fused as
    one bf16 pass)."""
    if "algorithm" not in op.attributes:
        return None
    text = str(op.attributes["algorithm"])
    found = re.search(r"lhs_precision_type = (\w+), rhs_precision_type = (\w+), "
                      r"accumulation_type = (\w+)", text)
    passes = re.search(r"num_primitive_operations = (\d+)", text)
    if (found is None or found[3] != "f32" or found[1] != found[2]
            or (passes is not None and passes[1] != "1")):
        return None
    return _ALGORITHM_TYPES.get(found[1])


def _cudnn_obstacle(match: Match, target: Target) -> str | None:
    """What cuDNN's flash attention does not take (jax's check_is_flash_attention)."""
    head = match.sizes[H_ROLE]
    capability = target.compute_capability or (8, 0)
    largest = 256 if capability >= (9, 0) else 128
    if head % 8 or head > largest:
        return f"head dimension {head}: cuDNN takes a multiple of 8 up to {largest}"
    if match.has_bias and match.training and (
            match.sizes[match.t_role] % 2 or match.sizes[S_ROLE] % 2):
        return "an odd sequence length with a mask (cuDNN's bias needs even lengths)"
    return None


def _entry(op: ir.Operation, site: Site, fn_name: str,
           found: tuple[Match, AttentionCall] | None, fused: bool, reason: str,
           dtype: str = "", kernel: str = "") -> AttentionSite:
    """The report's entry for the site at ``op`` (``site``: its Site), with the kernel's
    shapes where it was matched."""
    scope_name = site.name.rsplit("/", 1)[0] if "/" in site.name else site.name
    # The kernel's ops are named after the scores' matmul's own name (without the call
    # prefix: XLA adds the names of the calls it inlines).
    own = location_name(op.location)
    kernel_name = (own.rsplit("/", 1)[0] if "/" in own else own) + "/cudnn_attention"
    shapes = q_shape = kv_shape = mask = ""
    direction = "forward"
    flops = 0
    if found is not None:
        match, call = found
        q_shape = "x".join(map(str, call.q_shape))
        kv_shape = "x".join(map(str, call.kv_shape))
        shapes = f"q {q_shape}, k/v {kv_shape} (BTNH)"
        parts = (["causal"] if match.causal else []) + (
            ["window"] if match.window else []) + (
            ["constant"] if match.constant_mask else []) + (
            ["mask"] if match.mask_leaves else [])
        mask = "+".join(parts) or "none"
        # A training step whose loss does not read the output itself (jax drops P·V)
        # has the backward alone; jax.checkpoint's recomputation reads it again.
        direction = ("forward and backward" if "out" in match.exits and match.training
                     else "backward" if match.training else "forward")
        if fused:
            # The program's matmuls the kernel replaces, 2·B·N·T·S·H each: Q·Kᵀ and P·V
            # forward, dP, dV, dQ, dK backward (a backward alone recomputes Q·Kᵀ).
            batch, queries, heads, head_dim = call.q_shape
            keys = call.kv_shape[1]
            matmuls = {"forward": 2, "backward": 5, "forward and backward": 6}[direction]
            flops = 2 * matmuls * batch * heads * queries * keys * head_dim
    return AttentionSite(function=fn_name, scope=site.scope_path, direction=direction,
                         fused=fused, reason=reason if not fused else "",
                         kernel=kernel if fused else "", dtype=dtype if fused else "",
                         shapes=shapes, mask=mask, location=scope_name,
                         source=site.source, kernel_name=kernel_name, flops=flops)
