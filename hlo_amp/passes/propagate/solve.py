"""Painting the graph: which ops and links hold 16-bit values (steps 1-3 of the pass)."""

from __future__ import annotations

import math
from collections.abc import Iterator

from jaxlib.mlir import ir
from jaxlib.mlir.dialects import stablehlo as hlo

from hlo_amp.ir.modules import dense_value, element_count, from_constant
from hlo_amp.ir.op_classes import ALLOW, CLEAR, DENY, INFER, body_is_one_add
from hlo_amp.ir.sites import Site
from hlo_amp.passes.propagate.graph import (
    DENY_CLASS,
    LINK,
    OUT_OF_RANGE,
    SINK,
    STATE_UPDATE,
    Graph,
    Node,
)
from hlo_amp.targets.target import PaintForm

# Reasons the painting itself gives (reset when it runs again).
_FEEDS_EXACT = "feeds an op that reads f32 exactly"
_AFTER_DENY = "downstream of a deny op"
NOT_BETWEEN = "not between 16-bit ops"
_LOSS_SIDE = "forward value on its way to an f32 op that only the backward pass reads in 16 bit"
_DATA_SIDE = "forward value combining the model's output with f32 data, read by the backward pass"
_WITH_DATA = "combines the model's values with f32 data, as JAX's promotion does"
_SOLVE_REASONS = frozenset({_FEEDS_EXACT, _AFTER_DENY, NOT_BETWEEN, _LOSS_SIDE, _DATA_SIDE,
                            _WITH_DATA})
_BROADCASTS = frozenset({"broadcast_in_dim", "broadcast", "dynamic_broadcast_in_dim"})


def solve(graph: Graph, form: PaintForm) -> None:
    """Paint in ``form``; then, when only amp_stop could name a non-matrix op, check
    just the painted ops for it (locations are slow to read) and paint again if one is."""
    f32 = graph.f32
    for node in graph.nodes:
        node.readers = [graph.consumers(key) for key in node.outputs if f32(key[1])]
    try:
        _solve(graph, form, frozenset(_promoted_by_data(graph)))
    finally:  # readers point at nodes, loops make cycles: undone for refcounting
        for node in graph.nodes:
            node.readers = []


def _solve(graph: Graph, form: PaintForm, with_data: frozenset[int]) -> None:
    _paint_stored(graph, form, with_data)
    while True:
        stopped = False
        for node in graph.nodes:
            # Painted ops, and the ops that read a 16-bit matrix result: an amp_stop
            # there keeps that result f32 (a rule's region reads what was written).
            if node.deferred and (node.painted or _reads_low_matrix_result(graph, node)):
                node.deferred = False
                inst = graph.instances[node.inst]
                override = graph.policy_class(inst.ops[node.index], inst.prefix, node.kind)
                if override is not None:
                    node.cls, node.reason = override
                    stopped = True
        if not stopped:
            return
        _reset(graph)
        _paint_stored(graph, form, with_data)


def _reset(graph: Graph) -> None:
    """Start over from the build-time classes."""
    for node in graph.nodes:
        node.pinned = node.eligible = node.fwd = node.bwd = node.painted = False
        node.sums_read_low_copy = False
        if node.reason in _SOLVE_REASONS:
            node.reason = ""


def _paint_stored(graph: Graph, form: PaintForm, with_data: frozenset[int]) -> None:
    """Paint until no more values after a deny op are stored in 16 bit. A stored value
    ends the deny region it is in, as a Keras or Flax layer's 16-bit output ends its f32
    computation: the ops that read it (the activation after a batch norm, the
    activation's backward) are painted as they would be after a matrix op, which may
    store further values (Keras MobileNetV3Small, 64x64, batch 8, on H100: 8,067,656 B of
    temp painted once, 7,652,680 B so, the hand cast's 7,652,680)."""
    stored: set[int] = set()
    while True:
        more = _paint(graph, form, frozenset(stored), with_data)
        if more <= stored:
            return
        stored |= more
        _reset(graph)


def _paint(graph: Graph, form: PaintForm, stored: frozenset[int],
           with_data: frozenset[int]) -> set[int]:
    """One round of the painting, ``stored`` (node ids) in 16 bit from the start and
    ``with_data`` (``_promoted_by_data``) f32; the ids of the values after a deny op it
    paints."""
    low_results, pin_at_deny = form.low_results, form.pin_at_deny
    # Only readers that must see the exact f32 value pin it: converts to another
    # type, public returns, ops outside the graph. Deny and unknown ops convert their
    # own 16-bit inputs up (TensorFlow's and PyTorch autocast's way), so they pin
    # nothing; with ``pin_at_deny`` (CPU) they and the ops outside the table pin what
    # they read, and deny spreads nowhere (its readers' regions start at f32 values).
    for node in graph.nodes:
        node.pinned = DENY in _readers(node) or (pin_at_deny and any(
            isinstance(r, Node) and r.cls not in (INFER, CLEAR, LINK, ALLOW)
            for r in _readers(node)))
    denied = _downstream_of_deny(graph, stored, table_deny=not pin_at_deny)
    for node in graph.nodes:
        if node.cls in (INFER, CLEAR, LINK) and not node.reason:
            if node.pinned:
                node.reason = _FEEDS_EXACT
            elif id(node) in with_data:  # not a deny region's: stored in 16 bit
                node.reason = _WITH_DATA
            elif id(node) in denied:
                node.reason = _AFTER_DENY
            else:
                node.eligible = True
    # The values stored in 16 bit in an earlier round (``_paint_stored``) stay so.
    after_deny = {id(node) for node in graph.nodes if node.reason == _AFTER_DENY}
    for node in graph.nodes:
        if id(node) in stored:
            node.painted = True
    # Forward: reachable from an allow op (or a stored value) through eligible nodes.
    pending = [n for n in graph.nodes if (n.cls == ALLOW and not n.pinned) or id(n) in stored]
    while pending:
        node = pending.pop()
        for reader in _readers(node):
            if isinstance(reader, Node) and reader.eligible and not reader.fwd:
                reader.fwd = True
                pending.append(reader)
    # Backward: reaches a sink through eligible nodes, or through the f32 ops after
    # a deny op that convert their own inputs (a layer norm in front of a matrix op);
    # with ``pin_at_deny`` through eligible nodes only.
    through_f32 = not pin_at_deny
    pending = []
    seen: set[int] = set()
    for node in graph.nodes:
        if node.cls != ALLOW and SINK in _readers(node) and (node.eligible or through_f32):
            node.bwd = node.eligible
            seen.add(id(node))
            pending.append(node)
    while pending:
        node = pending.pop()
        for key in node.inputs:
            producer = graph.producer.get(key)
            if producer is None or id(producer) in seen:
                continue
            if producer.cls == ALLOW:
                # A matrix result that f32 ops read on their way to another matrix op
                # (they convert their own inputs) sits between 16-bit ops as well: the
                # activation gradient entering a layer norm's or a softmax's backward.
                # Not when a rule keeps the reader f32: rules bound regions.
                producer.bwd = producer.bwd or id(node) in denied or _deny_class(node)
                continue
            if not (producer.eligible or (through_f32 and (
                    id(producer) in denied or producer.cls == DENY))):
                continue
            seen.add(id(producer))
            producer.bwd = producer.eligible
            pending.append(producer)
    loss_side = _loss_side(graph)
    for node in graph.nodes:
        if node.eligible and node.fwd and node.bwd and node.readers:
            if id(node) in loss_side:
                node.reason = loss_side[id(node)]
            else:
                node.painted = True
        elif node.eligible and not node.reason:
            node.reason = NOT_BETWEEN
    # An f32 value downstream of a deny op that a matrix op reads (through data
    # movement) and f32 ops read as well is stored once, in 16 bit, as a Flax or Keras
    # layer's output is: the activation gradient a layer norm's backward adds to the
    # residual stream, which the next block's backward adds to again. XLA computes the
    # op in f32 and rounds once (excess precision). Read only by the matrix op and by
    # deny ops, a value gains nothing from it: XLA fuses its convert into the readers.
    # Not a statistic (``_is_statistic``): a softmax's sum broadcast, which a painted
    # divide reads through a convert (in the pass's own output) and the backward reads.
    for node in graph.nodes:
        if node.reason == _AFTER_DENY and any(
                isinstance(r, Node) and r.cls in (INFER, CLEAR, LINK)
                for r in _readers(node)) and _feeds_matrix_op(node) and (
                not _is_statistic(graph, node)):
            node.painted, node.reason = True, ""
    # A residual: a full-shape f32 value computed after a deny op in the forward pass
    # that the backward pass reads and that leads, through forward ops, to a matrix op
    # (a batch norm's output, the activation after it, which a squeeze-excite's pooling
    # and multiply read). Keras and Flax store it in 16 bit, as their norm layer's
    # output and the activation after it are; kept f32, XLA holds it in f32 from the
    # forward to the backward pass (Keras MobileNetV3Small, 64x64, batch 8, on H100:
    # 8.48 MiB of temp with it f32, 8.07 MiB painted; the hand cast's 7.65). Not a
    # statistic (``_is_statistic``): a softmax's sum, broadcast, which the forward's
    # divide and the backward read, stays f32, or every probability is divided by a
    # rounded sum. As for the values above, XLA computes the op in f32 and rounds once.
    # Not on CPU: nothing is downstream of deny there.
    backward: dict[int, bool] = {}
    for node in graph.nodes:
        if (node.reason == _AFTER_DENY and not node.painted and node.readers
                and (node.cls == LINK or len(node.outputs) == 1)
                and not _is_statistic(graph, node)
                and not _in_backward(graph, node, backward)
                and _read_by_backward(graph, node, backward)
                and _leads_to_matrix_op(graph, node, backward)):
            node.painted, node.reason = True, ""
    # An f32 value downstream of a deny op that only matrix ops (through their converts)
    # and sums read: the logits gradient, which the head's two GEMMs and its bias
    # gradient read. XLA keeps the f32 value for the sum (it folds the sum's round trip
    # through 16 bit back to f32) and writes a 16-bit copy for the GEMMs besides: 128 MiB
    # more at a decoder's peak. The sums read the 16-bit copy instead (through a barrier
    # XLA does not fold): computed in f32, rounded once, stored once in 16 bit, and
    # summed in f32 from the 16-bit values, as every sum of the mode is. GPU only
    # (``sum_copies``): XLA:TPU fuses the convert into the matrix op's operand instead.
    for node in graph.nodes if form.sum_copies else ():
        if (node.reason == _AFTER_DENY and node.cls != LINK and not node.painted
                and len(node.outputs) == 1):
            readers = list(_readers(node))
            sums = [r for r in readers if _is_sum(graph, r)]
            if SINK in readers and sums and len(sums) + readers.count(SINK) == len(readers):
                node.sums_read_low_copy = True
    # An f32 value with nothing 16-bit upstream that a painted op reads is stored once,
    # in 16 bit, as Flax stores a bf16 embedding's output: a decoder's token embedding
    # plus positions, which block 0's residual add reads and its layer norm reads in
    # f32. Otherwise XLA keeps the f32 value for the layer norm's backward and a 16-bit
    # copy for the add (4 MiB more at the decoder's peak). Not a value that only
    # matrix operands (converts, not painted ops) read: f32 parameters stay f32. Data
    # movement and barrier links too (not a statistic): the lookup's rows behind a
    # sharding constraint, and jax.checkpoint's barrier on them; the gather reads a 16-bit
    # table (the same values: rounding commutes with picking rows), so XLA's partitioner
    # gathers and exchanges them in 16 bit, as the hand cast's (Llama step on 8 H100s:
    # 128 MiB of f32 all-reduce and all-to-all per device become 64 of bf16).
    for node in graph.nodes:
        if (node.reason == NOT_BETWEEN and not node.fwd
                and (node.cls == INFER or (
                    (node.cls == CLEAR or (node.cls == LINK and node.kind == "barrier"))
                    and not _is_statistic(graph, node)))
                and any(map(_is_painted, _readers(node)))):
            node.painted, node.reason = True, ""
    # Allow ops: a 16-bit result where a region reads it; with ``low_results`` also
    # where only f32 ops read it (a weight gradient read by the optimizer, the logits
    # read by the loss), as TensorFlow's and PyTorch's AMP write every matrix result:
    # the f32 readers convert it up themselves, and the op writes half the bytes. Not
    # where a rule keeps a reader f32 (a scope rule, an op rule, amp_stop): the ops the
    # user kept read the f32 value the program wrote.
    for node in graph.nodes:
        if node.cls == ALLOW and not node.pinned:
            node.painted = (
                (low_results and not any(_kept_by_rule(graph, r) for r in _readers(node)))
                or node.bwd or any(r == SINK or _is_painted(r) for r in _readers(node)))
    # With 16-bit matrix results: data movement that only reorders or narrows one (the
    # transpose JAX writes after a weight-gradient dot) moves 16-bit values, so the f32
    # readers' convert comes after it. XLA folds a transpose that directly follows a dot
    # into the GEMM, as in Flax's program; a convert between them splits the optimizer's
    # fusion around a transpose instead.
    if low_results:
        for node in graph.nodes:
            if (node.cls == CLEAR and node.eligible and not node.painted and node.readers
                    and _moves_low_matrix_result(graph, node)):
                node.painted = True
    equalities = set()
    for node in graph.nodes:  # compares (no float result) of 16-bit values
        if node.painted or node.readers:
            continue
        floats = [key for key in node.inputs if graph.f32(key[1])]
        if not any(_is_low(graph, key) for key in floats):
            continue
        # An equality test rounds every operand, after a deny op too: jax's gradient of
        # maximum, minimum and clip asks whether an operand is the result, and a painted
        # result is made from the operand rounded (unrounded, it never is: that
        # gradient was lost). Other compares: a constant operand is exact enough.
        if (node.eligible or node.reason == _AFTER_DENY) and _tests_equality(graph, node):
            node.painted, node.reason = True, ""
            equalities.add(id(node))
        elif node.eligible and all(_is_low(graph, key) or from_constant(key[1])
                                   for key in floats):
            node.painted, node.reason = True, ""
    # Data movement read only by painted ops moves in 16 bit too, so the convert
    # lands on its (smaller) input: a bias before its broadcast, not after; a sum's
    # broadcast too, where a value after a deny op is painted (as the pass run again
    # on its own output would paint it).
    for node in reversed(graph.nodes):
        if (node.cls == CLEAR and (node.eligible or node.reason == _AFTER_DENY)
                and not node.painted and node.readers
                and all(r == SINK or _is_painted(r) for r in _readers(node))):
            node.painted = True
    for node in graph.nodes:
        if node.painted:
            node.reason = ""
    # (an equality test after a deny op stores nothing: it has no float result)
    return {id(node) for node in graph.nodes
            if node.painted and id(node) in after_deny and id(node) not in equalities}


def _promoted_by_data(graph: Graph) -> set[int]:
    """The ids of the forward ops and links that combine the model's values with f32
    data on the way to a matrix op, and of the forward ops and links that read their
    values: f32, as JAX's promotion of a 16-bit value with an f32 array computes them
    (a hand cast's). Data is a full-shape f32 value (no number or parameter broadcast)
    made from the functions' arguments without a matrix op, a lookup, a parameter or
    an array held as a constant (``Graph.made_from_arguments``): a residual stream that
    starts at the inputs, a reparameterised sample's noise. Painted, a stream of states
    near 100 was rounded to bf16 (steps of 0.5) at each layer: the loss 61% off, a hand
    cast's 0.08% (hunt h118). A token embedding's lookup is the model's: stored in 16
    bit below, as Flax's bf16 embedding's output is; so is a learned position table the
    step returns a gradient for, and a sinusoidal one held as a constant (at batch 1
    they are full-shape: 29% more temp for a scanned, remat'd model, review h127). In
    remat's recomputed forward too. Only ops jax's name stack places: in a module
    printed without it no backward op is known as one (a logits gradient's ``probs -
    one_hot`` reads data)."""
    def raw_data(node: Node, key: tuple[int, ir.Value]) -> bool:
        return (graph.f32(key[1]) and not _broadcast(graph, key)
                and element_count(key[1]) == element_count(node.outputs[0][1])
                and graph.made_from_arguments(key, lookup=False))

    def carried_on(link: Node) -> bool:  # the carry comes back without a matrix op:
        # a stream (``s + f(s)``), not a state the body replaces (an RNN's tanh(h @ W))
        pending, seen = [link], {id(link)}
        while pending:
            for reader in _readers(pending.pop()):
                if reader is link:
                    return True
                if (isinstance(reader, Node) and id(reader) not in seen
                        and reader.cls in (INFER, CLEAR, LINK)):
                    seen.add(id(reader))
                    pending.append(reader)
        return False

    def site(node: Node) -> Site:
        return graph.site(node.inst, node.index, node.kind)

    found: set[int] = set()
    pending: list[Node] = []
    for node in graph.nodes:
        # Where an op sits is known before any value's origins are walked (the walk is
        # most of the pass's time): a backward op's are not.
        if ((node.cls == INFER or (node.cls == LINK and node.kind == "while"))
                and node.readers and node.outputs
                and site(node).name and not site(node).gradient_pass
                and graph.reaches_forward_matrix_op(node, recomputed=site(node).recomputed)
                and any(raw_data(node, key) for key in node.inputs)
                and any(graph.f32(key[1]) and graph.made_by_model(key)
                        for key in node.inputs)
                and (node.cls == INFER or carried_on(node))):
            found.add(id(node))
            pending.append(node)
    while pending:
        for reader in _readers(pending.pop()):
            if (isinstance(reader, Node) and id(reader) not in found
                    and reader.cls in (INFER, CLEAR, LINK) and not site(reader).gradient_pass):
                found.add(id(reader))
                pending.append(reader)
    return found


def _broadcast(graph: Graph, key: tuple[int, ir.Value]) -> bool:
    """Whether the value is a smaller one broadcast (a bias, a number, a positional
    embedding over the batch), seen through reshapes and transposes."""
    node = graph.producer.get(key)
    while node is not None and node.kind in ("reshape", "transpose") and node.inputs:
        node = graph.producer.get(node.inputs[0])
    if node is None or node.kind not in _BROADCASTS or not node.outputs:
        return False
    size = element_count(node.outputs[0][1])
    return size is None or any((n := element_count(k[1])) is None or n < size
                               for k in node.inputs)


def _downstream_of_deny(graph: Graph, stored: frozenset[int], *, table_deny: bool
                        ) -> set[int]:
    """ids of the infer, clear and link nodes a deny op's value reaches through infer,
    clear and link nodes other than ``stored`` ones: what a deny op computes stays f32
    downstream (TensorFlow's forward deny propagation) up to a value stored in 16 bit.
    As there, data movement is entered only when it leads (through data movement) to
    arithmetic, so a transpose between a sum and a matrix op may still move 16-bit
    values. The table's deny ops spread only with ``table_deny`` (not on CPU); those
    kept f32 for the 16-bit range (OUT_OF_RANGE: a square under f16, a mask's fill) in
    every form, as their values may not fit it."""
    sources = [n for n in graph.nodes if (table_deny and _deny_class(n)) or (
        n.cls == DENY and (n.reason.startswith(OUT_OF_RANGE) or n.reason == STATE_UPDATE))]
    if not sources:
        return set()
    leads: set[int] = set()  # clear/link nodes upstream of arithmetic via clear/link
    pending = [n for n in graph.nodes if n.cls not in (CLEAR, LINK, ALLOW)]
    while pending:
        node = pending.pop()
        for key in node.inputs:
            producer = graph.producer.get(key)
            if (producer is not None and producer.cls in (CLEAR, LINK)
                    and id(producer) not in leads):
                leads.add(id(producer))
                pending.append(producer)
    denied: set[int] = set()
    pending = sources
    while pending:
        node = pending.pop()
        if id(node) in stored:
            continue
        for reader in _readers(node):
            if (isinstance(reader, Node) and id(reader) not in denied
                    and (reader.cls == INFER or id(reader) in leads)):
                denied.add(id(reader))
                pending.append(reader)
    return denied


def _feeds_matrix_op(node: Node) -> bool:
    """Whether a convert to the compute dtype (a matrix op's operand) reads ``node``'s
    value, directly or through data movement."""
    pending, seen = [node], {id(node)}
    while pending:
        for reader in _readers(pending.pop()):
            if reader == SINK:
                return True
            if (isinstance(reader, Node) and reader.cls in (CLEAR, LINK)
                    and id(reader) not in seen):
                seen.add(id(reader))
                pending.append(reader)
    return False


def _loss_side(graph: Graph) -> dict[int, str]:
    """The forward pass's eligible values between a matrix op and the f32 ops it ends in
    (a loss, a metric) that reach a 16-bit op only through the backward pass: a
    regression's ``pred * std + mean - y``, whose residual the loss's gradient reads. As
    in the program without its gradient, and as JAX's promotion of a 16-bit prediction
    with f32 targets computes them, they stay f32 (painted, the f32 targets and
    statistics were rounded to 16 bit and the residual cancelled away: the loss 72% off;
    review h113). Under ``jax.grad`` alone, where jax drops the loss and no forward f32
    op reads them, the values that combine the model's output with f32 data
    (``_reads_data``) and those on the way to them. Not a value only backward ops read
    (a GELU's derivative, computed in the forward pass): that is stored for the backward
    pass in 16 bit, as before. By id, the reason each stays f32."""
    backward: dict[int, bool] = {}
    found: set[int] = set()
    by_data: set[int] = set()  # found under jax.grad alone only
    feeds_f32: set[int] = set()
    recomputed: list[Node] = []
    loss_names: set[tuple] = set()
    tail: dict[int, Node] = {}  # forward values that reach no forward matrix op
    pending: list[Node] = []  # the loss side's, seen upward for those that lead to it
    for node in graph.nodes:
        if not (node.eligible and node.fwd and node.readers):
            continue
        if _in_backward(graph, node, backward):
            if node.bwd:
                recomputed.append(node)
        elif not graph.reaches_forward_matrix_op(node):
            tail[id(node)] = node
            if _feeds_forward_f32(graph, node, backward):
                pending.append(node)
                feeds_f32.add(id(node))
            elif _reads_data(graph, node):
                pending.append(node)
    for key in _made_from(graph, pending, tail):
        node = tail[key]
        loss_names.add(graph.recomputed_name(node)[1])
        if node.bwd:
            found.add(key)
            if key not in feeds_f32:
                by_data.add(key)
    # Under jax.checkpoint the backward pass computes the loss's residual again for the
    # gradient (the forward's copy feeds the loss only): the recomputed op, by the name
    # it has in the forward pass, stays f32 as that one does (review h115). Under
    # jax.grad alone the forward pass has no copy of a checkpointed loss's residual: the
    # recomputed values that lead to no recomputed matrix op and read data are found as
    # the forward's are.
    again = {id(node): node for node in recomputed if graph.recomputed_name(node)[0]}
    again_tail = {key: node for key, node in again.items()
                  if not graph.reaches_forward_matrix_op(node, recomputed=True)}
    # (A remat'd hidden layer's recomputed ``x @ w + b`` reads a bias, data too, and is
    # kept f32 with them: XLA converts it back for its 16-bit readers. Taking only data
    # no forward matrix op reads painted a checkpointed autoencoder's ``recon - x``,
    # whose ``x`` the model reads too: 12.5% off, review h124.)
    by_data |= _made_from(graph, [node for node in again_tail.values()
                                  if _reads_data(graph, node)], {**tail, **again_tail})
    found |= by_data
    for node in again.values() if loss_names else ():
        if graph.recomputed_name(node)[1] in loss_names:
            found.add(id(node))
    # And the data movement and links that carry only loss-side values: jax.checkpoint's
    # barrier taking one to the recomputation (a checkpointed MSE of a prediction made
    # outside it: painted, the prediction near 288 was rounded to bf16 there, dW 60% off;
    # review h117), a scan's stack of it for the backward loop and the loop carries that
    # hold the stack (the same MSE in a scan over microbatches, 61%: review h119).
    if found:
        found |= _carrying_only(graph, found)
    return {key: _DATA_SIDE if key in by_data else _LOSS_SIDE for key in found}


def _made_from(graph: Graph, seeds: list[Node], within: dict[int, Node]) -> set[int]:
    """The ids of ``seeds`` and of the ``within`` nodes they are made from, through links
    (remat's barrier, loop carries, call arguments) and data movement (a scan's stack of
    the prediction, sliced by the backward loop; review h125): each value a loss-side value is made
    from, back to the matrix op, is loss side too (a ``pred + 288.0`` in front of ``- y``:
    JAX's promotion computes it in f32 where the step computes the loss; under jax.grad
    alone it feeds the backward pass only; for a checkpointed MSE, in front of the
    barrier: 60% off when painted, review h124)."""
    found = {id(node) for node in seeds}
    pending = list(seeds)
    passed: set[int] = set()
    while pending:
        for key in pending.pop().inputs:
            producer = graph.producer.get(key)
            if producer is None or id(producer) in found or id(producer) in passed:
                continue
            if producer.cls in (LINK, CLEAR):
                # Carried, not computed: kept f32 by ``_carrying_only`` where it carries
                # only loss-side values. Found here, a scan's stack of a bf16 matrix result
                # went f32, 11% more temp for nothing (review h126).
                passed.add(id(producer))
                pending.append(producer)
            elif id(producer) in within:
                found.add(id(producer))
                pending.append(producer)
    return found


def _reads_data(graph: Graph, node: Node) -> bool:
    """Whether the op reads an f32 value, no number broadcast, that the functions'
    arguments or arrays held as constants make without the model
    (``Graph.made_from_arguments``): a regression's targets or statistics, passed in or
    closed over, which ``pred * std + mean - y`` combines with the model's output. Under
    ``jax.grad`` alone jax drops the loss, and the residual, read by the backward pass
    only, feeds no forward f32 op: painted, its f32 targets were rounded to bf16 and the
    weight gradients came out 77% and 95% off (review h121; closed-over targets until
    review h122)."""
    return any(graph.f32(key[1]) and not _one_number(graph, key)
               and graph.made_from_arguments(key) for key in node.inputs)


def _one_number(graph: Graph, key: tuple[int, ir.Value]) -> bool:
    """Whether the value is a splat constant (a ``10.0`` or ``288.0`` broadcast)."""
    op = graph.constant_op(*key)
    held = None if op is None else dense_value(op)
    return held is not None and held.is_splat


def _carrying_only(graph: Graph, found: set[int]) -> set[int]:
    """The eligible data movement and link nodes between 16-bit ops whose f32 inputs are
    all ``found`` values, constants or such nodes (loop carries read themselves back:
    the largest such set), and that a ``found`` value reaches."""
    carriers = {id(node): node for node in graph.nodes
                if node.cls in (CLEAR, LINK) and node.eligible and node.fwd and node.bwd
                and node.readers and id(node) not in found}
    # Each carrier's f32 inputs that are no constant (an index, a stack's zeros are
    # neither): their producers' ids, None for an argument. Read once, not per round.
    sources = {key: [None if producer is None else id(producer)
                     for producer in (graph.producer.get(input_key)
                                      for input_key in node.inputs
                                      if graph.f32(input_key[1])
                                      and graph.constant_op(*input_key) is None)]
               for key, node in carriers.items()}
    changed = True
    while changed:
        changed = False
        for key in list(carriers):
            # An argument or a value of the model among its inputs: no carrier.
            if any(source is None or (source not in found and source not in carriers)
                   for source in sources[key]):
                del carriers[key]
                changed = True
    reached: set[int] = set()
    pending = [node for node in graph.nodes if id(node) in found]
    while pending:
        for reader in _readers(pending.pop()):
            if isinstance(reader, Node) and id(reader) in carriers and id(reader) not in reached:
                reached.add(id(reader))
                pending.append(reader)
    return reached


def _feeds_forward_f32(graph: Graph, node: Node, cache: dict[int, bool]) -> bool:
    """Whether the node's value reaches, through forward eligible nodes, a forward op
    that computes in f32 (a deny op, an op kept f32, an f32 return)."""
    pending, seen = [node], {id(node)}
    while pending:
        for reader in _readers(pending.pop()):
            if reader == SINK:
                continue
            if not isinstance(reader, Node):
                return True  # an f32 reader outside the graph (a return, a convert up)
            if id(reader) in seen or _in_backward(graph, reader, cache):
                continue
            if not reader.eligible:
                return True
            seen.add(id(reader))
            pending.append(reader)
    return False


def _in_backward(graph: Graph, node: Node, cache: dict[int, bool]) -> bool:
    """Whether the op (for a link: the loop, branch or call) is in the backward pass
    (``transpose(...)`` in its name stack, the caller's included)."""
    found = cache.get(id(node))
    if found is None:
        found = cache[id(node)] = graph.in_backward(node)
    return found


def _read_by_backward(graph: Graph, node: Node, cache: dict[int, bool]) -> bool:
    """Whether a backward op reads the node's value (through forward links)."""
    pending, seen = [node], {id(node)}
    while pending:
        for reader in _readers(pending.pop()):
            if not isinstance(reader, Node) or id(reader) in seen:
                continue
            if _in_backward(graph, reader, cache):
                return True
            if reader.cls == LINK:
                seen.add(id(reader))
                pending.append(reader)
    return False


def _leads_to_matrix_op(graph: Graph, node: Node, cache: dict[int, bool]) -> bool:
    """Whether the node's value reaches a matrix op's operand (a convert to the compute
    dtype, or a painted op) through forward infer, clear and link nodes."""
    pending, seen = [node], {id(node)}
    while pending:
        for reader in _readers(pending.pop()):
            if reader == SINK:
                return True
            if (not isinstance(reader, Node) or id(reader) in seen
                    or reader.cls not in (INFER, CLEAR, LINK)
                    or _in_backward(graph, reader, cache)):
                continue
            if reader.painted:
                return True
            seen.add(id(reader))
            pending.append(reader)
    return False


def _is_statistic(graph: Graph, node: Node) -> bool:
    """Whether the node's value is a statistic: a broadcast of a smaller value (a
    softmax's sum, a norm's mean or scale), or a value a broadcast spreads (a sum's
    reciprocal). Only full-shape activations are residuals to store in 16 bit; a
    statistic is small, and rounding it rounds every value it scales."""
    size = element_count(node.outputs[0][1]) if node.outputs else None
    if size is None:
        return True
    if node.kind in _BROADCASTS and any(
            ((n := element_count(key[1])) is None or n < size)
            and not _is_activation(graph, key)
            for key in node.inputs if graph.f32(key[1])):
        return True
    return any(isinstance(r, Node) and r.kind in _BROADCASTS and r.outputs
               and ((n := element_count(r.outputs[0][1])) is None or n > size)
               for r in _readers(node)) and not any(
        _is_activation(graph, key) for key in node.outputs[:1])


def _is_activation(graph: Graph, key: tuple[int, ir.Value]) -> bool:
    """Whether the value is made from a matrix op's result by elementwise and data
    movement ops alone, no reduction between: GQA's repeat of the roped K broadcasts an
    activation, not a statistic (kept f32 as one, the repeat ran in f32 and a scan
    stacked the repeated K in f32 where the hand cast stacks it in 16 bit)."""
    seen: set[int] = set()
    pending = [graph.producer.get(key)]
    while pending:
        node = pending.pop()
        if node is None or id(node) in seen or len(seen) > 64:
            continue
        seen.add(id(node))
        if node.cls == ALLOW:
            return True
        if node.cls in (INFER, CLEAR) and node.kind not in _BROADCASTS:
            pending += [graph.producer.get(k) for k in node.inputs if graph.f32(k[1])]
    return False


def _readers(node: Node) -> Iterator[Node | str]:
    """Every reader of the node's f32 results: nodes, or the SINK and DENY markers."""
    return (reader for group in node.readers for reader in group)


def _is_painted(reader: Node | str) -> bool:
    return isinstance(reader, Node) and reader.painted


def _kept_by_rule(graph: Graph, reader: Node | str) -> bool:
    """A reader that a rule (scope, op, amp_stop) keeps f32. A deny-table op keeps its
    table reason when a rule names it too, so the rules are asked for it here."""
    if not isinstance(reader, Node) or reader.cls != DENY:
        return False
    if reader.reason.startswith("rule "):
        return True
    if reader.reason != DENY_CLASS:
        return False
    inst = graph.instances[reader.inst]
    override = graph.policy_class(inst.ops[reader.index], inst.prefix, reader.kind)
    return override is not None and override[0] == DENY


def _reads_low_matrix_result(graph: Graph, node: Node) -> bool:
    """Whether ``node`` reads the 16-bit result of an allow op."""
    for key in node.inputs:
        producer = graph.producer.get(key)
        if producer is not None and producer.cls == ALLOW and producer.painted:
            return True
    return False


def _moves_low_matrix_result(graph: Graph, node: Node) -> bool:
    """Whether ``node`` reads one float value, a 16-bit matrix result (or such a value
    moved already), and writes no more elements than it reads."""
    floats = [key for key in node.inputs if graph.f32(key[1])]
    if len(floats) != 1 or len(node.outputs) != 1:
        return False
    producer = graph.producer.get(floats[0])
    if producer is None or not producer.painted or producer.cls not in (ALLOW, CLEAR):
        return False
    if producer.cls == CLEAR and not _moves_low_matrix_result(graph, producer):
        return False
    source, result = (ir.ShapedType(key[1].type) for key in (floats[0], node.outputs[0]))
    return (source.has_static_shape and result.has_static_shape
            and math.prod(result.shape) <= math.prod(source.shape))


def _is_sum(graph: Graph, reader: Node | str) -> bool:
    """An add reduce the op table (not a rule) keeps f32."""
    if not (isinstance(reader, Node) and reader.kind == "reduce" and _deny_class(reader)):
        return False
    return body_is_one_add(graph.instances[reader.inst].ops[reader.index])


def _deny_class(node: Node) -> bool:
    """An op the op table (not a rule) keeps f32: it converts its own 16-bit inputs."""
    return node.cls == DENY and node.reason == DENY_CLASS


def _tests_equality(graph: Graph, node: Node) -> bool:
    """Whether ``node`` is an EQ or NE compare."""
    if node.kind != "compare":
        return False
    op = graph.instances[node.inst].ops[node.index]
    return hlo.ComparisonDirectionAttr(op.attributes["comparison_direction"]).value in (
        "EQ", "NE")


def _is_low(graph: Graph, key: tuple[int, ir.Value]) -> bool:
    producer = graph.producer.get(key)
    return producer is not None and producer.painted
