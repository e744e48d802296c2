"""What a module from outside (a .mlir file, bytecode, an artifact) must be before the
passes read it: each check returns why not in words, or None.

jaxlib's Python bindings end the process (an abort or a segfault, not an exception) on
some inputs: corrupted bytecode whose diagnostic is not UTF-8, a corrupted portable
artifact, regions nested deeper than the parser's stack, a string that is not UTF-8
read by a pass, a dense attribute of complex elements read from an attribute
dictionary. Those are refused here, in one line, before anything reads them
(ir/modules.parse_module raises the ModuleError).
"""

from __future__ import annotations

import faulthandler
import os
import re
import signal
import time
import warnings
from collections.abc import Callable
from typing import Any

from jaxlib.mlir import ir

from hlo_amp.ir.sites import unescape

# MLIR's parser recurses per nested region: thousands overflow its stack (a segfault).
MAX_NESTING = 1000
# How long a forked read may take before it is taken to be stuck (then read in process).
_READ_SECONDS = 300

_QUOTED = re.compile(r'"((?:[^"\\]|\\.)*)"')
_SYMBOL = re.compile(r'@"((?:[^"\\]|\\.)*)"')


def signal_reading(read: Callable[[], Any]) -> str | None:
    """The name of the signal ``read()`` kills a forked child with, or None where it
    returns or raises (or where this platform cannot fork, or the child is stuck)."""
    if not hasattr(os, "fork"):
        return None
    with warnings.catch_warnings():  # Python 3.12 and jax warn about forking with threads:
        warnings.simplefilter("ignore")  # the child only reads, and exits
        pid = os.fork()
    if pid == 0:  # the child: its exit status is all it says
        try:
            faulthandler.disable()  # no crash dump of its own: the parent reports it
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, 2)
            read()
        except BaseException:  # noqa: BLE001 - an error is the parent's to report
            os._exit(1)
        os._exit(0)
    deadline = time.monotonic() + _READ_SECONDS
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            break
        if time.monotonic() > deadline:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            return None
        time.sleep(0.005)
    if not os.WIFSIGNALED(status):
        return None
    number = os.WTERMSIG(status)
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"


# What MLIR's parser recurses into: regions and dictionaries ({), arrays ([), tuples and
# function types ((), types and attribute parameters (<); an arrow's > closes nothing.
_OPENING, _CLOSING = frozenset("{[(<"), frozenset("}])>")
_BRACKETS = re.compile(r"->|[{}\[\]()<>]")
_COMMENT = re.compile(r"//[^\n]*")


def nesting_problem(text: str) -> str | None:
    """Regions, attributes or types nested deeper than MAX_NESTING (counted by brackets
    outside strings): 10,000 nested arrays in an attribute ended the process as deep
    regions did."""
    if sum(text.count(c) for c in _OPENING) <= MAX_NESTING:
        return None
    depth = deepest = 0
    for piece in _QUOTED.split(text)[::2]:  # the text between quoted strings
        # Less comments: a lit file's CHECK lines hold cut-off signatures, open brackets
        # that close nothing (1,100 such lines were refused as nested 1,103 deep).
        for found in _BRACKETS.findall(_COMMENT.sub("", piece)):
            if found in _OPENING:
                depth += 1
                deepest = max(deepest, depth)
            elif found in _CLOSING:
                depth -= 1
    if deepest <= MAX_NESTING:
        return None
    return (f"regions, attributes or types nested {deepest} deep ({{, [, ( or <); accepted: "
            f"at most {MAX_NESTING} (MLIR's parser would overflow its stack)")


def name_problem(module: ir.Module) -> str | None:
    """A location name or file, or a symbol name (a function's, a custom call's target),
    that is not UTF-8 (a ``\\FF`` escape in the text, corrupted bytecode): jaxlib's
    bindings abort the process, or fail inside a pass, when a pass reads it. Read from
    the printed form, which escapes every byte that is not printable ASCII."""
    text = module.operation.get_asm(enable_debug_info=True, large_elements_limit=16)
    for line in text.splitlines():
        if "\\" not in line:
            continue
        at = line.find("loc(")
        found = [("a location name or file", q) for q in _QUOTED.findall(line[at:])
                 ] if at >= 0 else []
        found += [("a symbol name (a function or custom call target)", q)
                  for q in _SYMBOL.findall(line[:at] if at >= 0 else line)]
        for what, quoted in found:
            try:
                unescape(quoted)
            except UnicodeDecodeError:
                return (f'{what} is not UTF-8 ("{quoted}"); accepted: names as jax '
                        f"writes them (UTF-8 text)")
    return None


def attribute_problem(module: ir.Module) -> str | None:
    """What no pass can read: a module or function-argument attribute the bindings cannot
    read (a dense attribute of complex elements), a partition or replica count that is no
    integer, a function declared without a body."""
    attributes = module.operation.attributes
    for name in ("mhlo.num_partitions", "mhlo.num_replicas"):
        if name in attributes and not _readable(lambda n=name: ir.IntegerAttr(attributes[n])):
            return (f"the module's {name} is not an integer ({_text(attributes, name)}); "
                    f"accepted: an integer attribute such as {name} = 8 : i32")
        # XLA aborts the process on a count below one (a failed CHECK, no message).
        count = ir.IntegerAttr(attributes[name]).value if name in attributes else 1
        if count < 1:
            return (f"the module's {name} is {count}; accepted: a positive integer such "
                    f"as {name} = 8 : i32")
    for index in range(len(attributes)):
        name = attributes[index].name
        if not _readable(lambda name=name: attributes[name]):
            return _unreadable(f"the module's attribute {name}")
    for op in module.body.operations:
        if op.operation.name != "func.func":
            continue
        symbol = ir.StringAttr(op.attributes["sym_name"]).value
        if not op.regions[0].blocks:
            return (f"@{symbol} is declared without a body; accepted: a module that "
                    f"defines every function it calls, as jax lowers it")
        for key, what in (("arg_attrs", "argument"), ("res_attrs", "result")):
            if key not in op.attributes:
                continue
            for index, entry in enumerate(ir.ArrayAttr(op.attributes[key])):
                dictionary = ir.DictAttr(entry)
                for i in range(len(dictionary)):
                    name = dictionary[i].name
                    if not _readable(lambda d=dictionary, n=name: d[n]):
                        return _unreadable(f"attribute {name} of @{symbol}'s {what} {index}")
    return None


def _readable(read: Callable[[], Any]) -> bool:
    try:
        read()
    except (TypeError, ValueError):
        return False
    return True


def _text(attributes: Any, name: str) -> str:
    try:
        return str(attributes[name])
    except TypeError:
        return "unreadable"


def _unreadable(where: str) -> str:
    return (f"{where} cannot be read by jaxlib's bindings (a dense attribute of complex "
            f"elements); accepted: such values as the operand of a stablehlo.constant")


def recursion_problem(calls: dict[str, list[str]]) -> str | None:
    """A function that calls itself, directly or through others (``calls``: each
    function's callees, in order): StableHLO programs do not recurse, and the passes
    that follow calls would not end."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    for root in calls:
        if state.get(root):
            continue
        path, pending = [root], [iter(calls.get(root, ()))]
        state[root] = 1
        while pending:
            callee = next(pending[-1], None)
            if callee is None:
                state[path.pop()] = 2
                pending.pop()
            elif state.get(callee) == 1:
                cycle = path[path.index(callee):] + [callee]
                return (f"@{callee} calls itself ({' -> '.join('@' + c for c in cycle)}); "
                        f"accepted: a module without recursive calls, as jax lowers it")
            elif not state.get(callee):
                state[callee] = 1
                path.append(callee)
                pending.append(iter(calls.get(callee, ())))
    return None

