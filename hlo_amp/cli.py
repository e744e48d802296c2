"""``hlo-amp-opt``: the AMP passes on a .mlir file, in the manner of ``stablehlo-opt``.

    hlo-amp-opt [FILE|-] [-o OUT] [--policy SPEC] [--scope PATTERN=ACTION]...
                [--op KIND=ACTION]... [--report OUT.json] [--split-input-file]
                [--debug-info] [--pass NAME]... [--verify-each] [--target cpu|gpu|tpu]
                [--xla-target h100|h200|a100|CONFIG.txtpb|tpu-v4|tpu-v5e|tpu-v5p|tpu-v6e]
    hlo-amp-opt FILE --autopolicy --budget 1e-2 --xla-target h100 [--inputs IN.npz]
                [--seed N] [--depth N] [--max-compiles N] [--fp8-scaling delayed]
                [--policy BASE] [-o POLICY.txt]

``--xla-target`` also compiles the rewritten module with XLA for that GPU or TPU, on any
machine (no device, no run; needs the ``gpu`` or ``tpu`` extra), and fills the report's
kept-by-XLA verdicts from the optimized HLO. A TPU name may carry a slice
(``tpu-v5e:4x4``), a GPU name a count (``h100x8``; nodes: ``h100:2x8``): a module sharded
over N devices (``mhlo.num_partitions = N``) is partitioned by XLA over N of them.

Errors (unreadable file, text that is not MLIR, a bad policy) print one line on stderr
and exit with status 1; no output file is written.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import re
import stat
import sys
import tempfile
import threading
from collections.abc import Sequence
from typing import Any

from hlo_amp import jaxlib_internals
from hlo_amp.ir.modules import (
    ModuleError,
    drop_marks_for_the_full_pipeline,
    module_text,
    parse_module,
)
from hlo_amp.ir.shardings import partition_count, replica_count
from hlo_amp.passes import pass_names, run_pipeline
from hlo_amp.policy import SCALINGS, Policy, as_policy
from hlo_amp.quiet_stderr import fd2_muted, import_jax_for_cli
from hlo_amp.report import Report
from hlo_amp.targets import CpuTarget, Target, as_target, device_target, refuse_policy_on_device
from hlo_amp.targets.collectives import read_collectives
from hlo_amp.targets.kept_by_xla import mark_kept_by_xla
from hlo_amp.targets.topology import NoCompilerForTarget

_SPLIT_MARKER = re.compile(r"^// -----\s*$", re.MULTILINE)


class CliError(Exception):
    """A user error: printed as one line, exit status 1."""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # one line, status 1, like every other error
        raise CliError(f"hlo-amp-opt: error: {message} (see hlo-amp-opt --help)")


class _Once(argparse.Action):
    """An option given at most once: a second value was taken, the first dropped unseen
    (--policy 'bf16,scope:head=float32' --policy f16 ran f16), as the policy grammar
    refuses a repeated key."""

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace,
                 values: Any, option_string: str | None = None) -> None:
        if getattr(namespace, f"_{self.dest}_given", False):
            parser.error(f"{option_string} is given twice ({getattr(namespace, self.dest)!r} "
                         f"and {values!r}); accepted: one (--scope, --op and --pass repeat)")
        setattr(namespace, f"_{self.dest}_given", True)
        setattr(namespace, self.dest, values)


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="hlo-amp-opt",
        description="Rewrite a StableHLO module for mixed precision (hlo_amp).",
    )
    parser.add_argument("input", nargs="?", default="-", help="input .mlir file, or - for stdin")
    parser.add_argument("-o", dest="output", action=_Once, default="-", help="output file (default stdout)")
    parser.add_argument("--policy", action=_Once, default="bf16",
                        help="a preset (bf16, f16, f32, mixed_bfloat16, mixed_float16, fp8) or a "
                             "policy string, e.g. 'bf16,scope:head=float32'")
    parser.add_argument("--scope", action="append", default=[], metavar="PATTERN=ACTION",
                        help="add a scope rule; may be repeated")
    parser.add_argument("--op", action="append", default=[], metavar="KIND=ACTION",
                        help="add an op rule; may be repeated")
    parser.add_argument("--report", action=_Once, metavar="OUT.json",
                        help="write the report as JSON to this file (- for stderr)")
    parser.add_argument("--split-input-file", action="store_true",
                        help="treat '// -----' separated chunks as separate modules")
    parser.add_argument("--debug-info", action="store_true",
                        help="keep locations (scope metadata) in the output")
    parser.add_argument("--target", action=_Once, choices=("cpu", "gpu", "tpu"), default=None,
                        help="the backend the module is for: 'cpu' adds the CPU dot-layout "
                             "pass and enables the policy's only_if_faster rule; 'gpu' gives "
                             "convolutions cuDNN's 16-bit result; 'tpu' keeps bf16xbf16->f32 "
                             "dots and convolutions (in the mixed modes a matrix op in a "
                             "16-bit region returns 16 bit, as on GPU)")
    parser.add_argument("--xla-target", action=_Once, metavar="DEVICE",
                        help="also compile the rewritten module with XLA for this GPU or "
                             "TPU, without one (h100, h200, a100, a GpuTargetConfig .txtpb "
                             "file; a node h100x8 or nodes h100:2x8; tpu-v4, tpu-v5e, tpu-v5p, "
                             "tpu-v6e, or a slice such as tpu-v5e:4x4), and report whether XLA keeps each converted op "
                             "in its dtype (needs the gpu or tpu extra: pip install "
                             "'hlo_amp[gpu]' / 'hlo_amp[tpu]')")
    parser.add_argument("--autopolicy", action="store_true",
                        help="instead of rewriting, search the policy the --xla-target "
                             "device runs fastest (roofline) with the error measured here "
                             "within --budget; writes the policy string (docs/cli.md)")
    parser.add_argument("--budget", action=_Once, type=float, default=None,
                        help="--autopolicy: the error bound (as hlo_amp.autopolicy's)")
    parser.add_argument("--inputs", action=_Once, metavar="FILE.npz", default=None,
                        help="--autopolicy: main's arguments, np.savez(path, *arrays) in "
                             "argument order (default: standard normal floats from --seed)")
    parser.add_argument("--seed", action=_Once, type=int, default=None,
                        help="--autopolicy: input seed (default 0)")
    parser.add_argument("--depth", action=_Once, type=int, default=None,
                        help="--autopolicy: the name-stack depth of the scopes searched "
                             "(default 1)")
    parser.add_argument("--max-compiles", action=_Once, type=int, default=None,
                        help="--autopolicy: at most this many XLA compiles")
    parser.add_argument("--fp8-scaling", action=_Once, choices=SCALINGS, default=None,
                        help="--autopolicy: the scaling the fp8 policies are priced and "
                             "returned with (docs/fp8.md; default: --policy's)")
    parser.add_argument("--pass", dest="passes", action="append", default=[], metavar="NAME",
                        help="run only these passes, in order (default: the full pipeline)")
    parser.add_argument("--verify-each", action="store_true",
                        help="verify the module after every pass, not only at the end "
                             "(debugging: names the pass that made an invalid module; "
                             "also HLO_AMP_VERIFY_EACH=1)")
    return parser


def _policy_from(args: argparse.Namespace) -> Policy:
    spec = args.policy
    for flag, items in (("scope", args.scope), ("op", args.op)):
        for item in items:
            if "=" not in item:
                raise CliError(f"hlo-amp-opt: error: --{flag} {item!r} is not "
                               f"{'PATTERN' if flag == 'scope' else 'KIND'}=ACTION")
            if "," in item:  # it would add the policy items after the comma unseen
                raise CliError(f"hlo-amp-opt: error: --{flag} {item!r} holds ','; one rule "
                               f"per --{flag} (repeat the flag; other settings go in --policy)")
            spec += f",{flag}:{item}"
    return as_policy(spec)


def _read(path: str) -> tuple[str | bytes, str]:
    if path == "-":
        return sys.stdin.buffer.read(), "<stdin>"
    try:
        with open(path, "rb") as handle:
            return handle.read(), path
    except OSError as error:
        raise CliError(f"hlo-amp-opt: error: cannot read {path!r}: {error.strerror}") from None


def _chunks(source: str | bytes, split: bool) -> list[tuple[str | bytes, int]]:
    """(chunk, first line number - 1); padding with newlines keeps diagnostics exact."""
    if not split or isinstance(source, bytes) and source.startswith(b"ML\xefR"):
        return [(source, 0)]
    # Bytes split as bytes: a chunk that is not UTF-8 is refused as the whole file would
    # be (decoded with errors="replace", its bytes became U+FFFD in the output, exit 0).
    marker = (re.compile(_SPLIT_MARKER.pattern.encode(), re.MULTILINE)
              if isinstance(source, bytes) else _SPLIT_MARKER)
    newline = b"\n" if isinstance(source, bytes) else "\n"
    pieces, line = [], 0
    for piece in marker.split(source):
        pieces.append((newline * line + piece, line))
        line += piece.count(newline)
    # A marker at the end (or two in a row) leaves a blank piece: nothing to run, as
    # mlir-opt takes it, not an empty input.
    written = [(piece, first) for piece, first in pieces if piece.strip()]
    return written or pieces[:1]


def _start_jax() -> None:
    """Import jax (quietly, on CPU) for what needs it: ``--xla-target``'s compile and
    ``--autopolicy``'s search. The passes themselves need only jaxlib's MLIR bindings
    (hlo_amp/jaxlib_internals.py); the fused-attention pass imports jax where it lowers
    a kernel."""
    import_jax_for_cli()
    from hlo_amp import jax_internals

    try:
        jax_internals.check()
    except ImportError as error:
        raise CliError(f"hlo-amp-opt: error: {error}") from None


def run(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if not args.autopolicy:  # a search option alone was silently ignored
        given = [flag for flag, value in (
            ("--budget", args.budget), ("--inputs", args.inputs), ("--seed", args.seed),
            ("--depth", args.depth), ("--max-compiles", args.max_compiles),
            ("--fp8-scaling", args.fp8_scaling)) if value is not None]
        if given:
            raise CliError(f"hlo-amp-opt: error: {given[0]} applies to --autopolicy, "
                           f"which was not given")
    else:  # and a rewriting option beside the search
        given = [flag for flag, value in (
            ("--pass", args.passes), ("--split-input-file", args.split_input_file),
            ("--debug-info", args.debug_info), ("--verify-each", args.verify_each))
            if value]
        if given:
            raise CliError(f"hlo-amp-opt: error: {given[0]} applies to rewriting; "
                           f"--autopolicy writes a policy and takes none")
    if args.report == "":
        raise CliError("hlo-amp-opt: error: --report '' names no file (- for stderr)")
    missing = jaxlib_internals.missing_entry_points()
    if missing:
        raise CliError(f"hlo-amp-opt: error: this jaxlib lacks what hlo_amp needs: "
                       f"{'; '.join(missing)}")
    if args.xla_target is not None or args.autopolicy:
        _start_jax()
    try:
        policy = _policy_from(args)
    except ValueError as error:
        raise CliError(f"hlo-amp-opt: error: bad policy: {error}") from None
    device = _device_target(args)
    if args.autopolicy:
        return _autopolicy(args, policy, device)
    if device is not None:
        try:
            refuse_policy_on_device(policy, device)
        except ValueError as error:
            raise CliError(f"hlo-amp-opt: error: --xla-target: {error}") from None
    target = device if device is not None else as_target(args.target)
    available = pass_names(policy, target)
    unknown = [name for name in args.passes if name not in available]
    if unknown:
        raise CliError(f"hlo-amp-opt: error: unknown pass {unknown[0]!r}; accepted: "
                       f"{', '.join(available)}")
    selected = [available[name] for name in args.passes] or None
    source, source_name = _read(args.input)
    outputs: list[str] = []
    modules, chunks = [], []
    report = Report(policy=policy.to_string(), rules=policy.rule_names())
    for chunk, _ in _chunks(source, args.split_input_file):
        module = parse_module(chunk, source_name=source_name)
        chunks.append(chunk)
        if selected is None:
            drop_marks_for_the_full_pipeline(module, chunk)
        run_pipeline(module, policy, report=report, passes=selected, target=target,
                     verify_each=args.verify_each or None)
        outputs.append(module_text(module, debug_info=args.debug_info))
        modules.append(module)
    text = "// -----\n".join(outputs)
    if device is not None:
        _mark_for_device(report, modules, device, chunks, source_name)
    # A row's line tells the chunks of --split-input-file apart, and names the file.
    report.name_parsed_buffer(source_name)
    _write_outputs(args, text, report.to_json() + "\n")
    for line in report.unused_rule_lines():  # a likely typo: as hlo_amp.compile warns
        print(f"hlo-amp-opt: warning: policy rule(s) {line}", file=sys.stderr)
    return 0


def _autopolicy(args: argparse.Namespace, policy: Policy, device: Target | None) -> int:
    """``--autopolicy``: the search of hlo_amp/numerics/fastest.py on the module's main."""
    from hlo_amp.numerics.fastest import DEFAULT_MAX_COMPILES, target_autopolicy
    from hlo_amp.numerics.measure import ATOL, check_tolerance
    from hlo_amp.runtime.module_call import ModuleFunction

    if args.budget is None:
        raise CliError("hlo-amp-opt: error: --autopolicy needs --budget (e.g. 1e-2)")
    if device is None:
        raise CliError("hlo-amp-opt: error: --autopolicy needs --xla-target (h100, "
                       "tpu-v5e, ...): the device whose step time it minimises")
    if args.seed is not None and args.seed < 0:
        raise CliError(f"hlo-amp-opt: error: --seed {args.seed}; accepted: an integer >= 0")
    source, source_name = _read(args.input)
    module = parse_module(source, source_name=source_name)  # refuses what passes cannot read
    devices = partition_count(module) * replica_count(module)
    if devices > 1:  # measured on one CPU device and priced on one device of the target
        raise CliError(f"hlo-amp-opt: error: --autopolicy: {source_name} runs on {devices} "
                       f"devices (mhlo.num_partitions, mhlo.num_replicas or its mesh); "
                       f"accepted: a module of one device")
    try:
        check_tolerance(args.budget, "budget", zero_ok=False)
        # The parsed module's text: a jax.export artifact is VHLO until parse_module
        # deserializes it (ModuleFunction read its bytes as they were).
        main = ModuleFunction(module_text(module, debug_info=True))
        inputs = main.inputs_from(args.inputs, 0 if args.seed is None else args.seed)
        result = target_autopolicy(
            main.for_platform("cpu"), inputs, budget=args.budget,
            depth=1 if args.depth is None else args.depth,
            base=policy, reference="f32", atol=ATOL, target=device,
            max_compiles=(DEFAULT_MAX_COMPILES if args.max_compiles is None
                          else args.max_compiles), progress=True,
            target_fn=main.for_platform(device.platform),
            fp8_scaling=args.fp8_scaling)
    except (ValueError, TypeError) as error:
        raise CliError(f"hlo-amp-opt: error: --autopolicy: {_first_line(error)}") from None
    except NoCompilerForTarget as error:
        raise CliError(f"hlo-amp-opt: error: {error}") from None
    print(result, file=sys.stderr)
    _write_outputs(args, result.policy.to_string() + "\n", result.to_json() + "\n")
    return 0


def _device_target(args: argparse.Namespace) -> Target | None:
    if args.xla_target is None:
        return None
    if isinstance(as_target(args.target), CpuTarget):
        raise CliError("hlo-amp-opt: error: --xla-target compiles for a GPU or TPU; it "
                       "cannot be combined with --target cpu")
    try:
        device = device_target(args.xla_target)
    except (TypeError, ValueError) as error:
        raise CliError(f"hlo-amp-opt: error: --xla-target: {error}") from None
    # --xla-target sets the target facts; a --target naming another platform was ignored.
    if args.target is not None and as_target(args.target).platform != device.platform:
        raise CliError(f"hlo-amp-opt: error: --target {args.target} and --xla-target "
                       f"{args.xla_target} name different platforms; --xla-target alone sets "
                       f"the target facts")
    return device


def _mark_for_device(report: Report, modules: list, device: Target, chunks: list[str],
                     source_name: str) -> None:
    """Compile each rewritten module for ``device`` and fill the report's verdicts
    (``chunks``: the input texts the modules were parsed from)."""
    from hlo_amp.runtime.deviceless import compile_module_for_target

    texts = []
    for module, chunk in zip(modules, chunks, strict=True):
        try:
            with fd2_muted():  # the CUDA plugin's driver probes, libtpu's host probes
                executable = compile_module_for_target(module, device)
        except NoCompilerForTarget as error:
            raise CliError(f"hlo-amp-opt: error: {error}") from None
        except ValueError as error:  # a module partitioned over more devices than these
            raise CliError(f"hlo-amp-opt: error: --xla-target {device.name}: {error}"
                           ) from None
        except Exception as error:  # noqa: BLE001 - XLA's refusal, in one line
            given = _refusal_of_the_input(chunk, source_name, device)
            whose = ("the module as given (before any rewrite)" if given is not None
                     else "the rewritten module")
            raise CliError(f"hlo-amp-opt: error: XLA could not compile {whose} for "
                           f"{device.description}: {_first_line(error) if given is None else given}"
                           ) from None
        texts.extend(hlo.to_string() for hlo in executable.hlo_modules())
    mark_kept_by_xla(report, "\n".join(texts), device, device=device.device)
    report.collectives = [c for text in texts for c in read_collectives(text)]


def _refusal_of_the_input(chunk: str, source_name: str, device: Target) -> str | None:
    """The first line of XLA's refusal of the input ``chunk`` itself for ``device`` (a
    tuple or an unranked argument, an unbounded dynamic shape: the rewrite is not to
    blame), or None where XLA compiles it."""
    from hlo_amp.runtime.deviceless import compile_module_for_target

    try:
        with fd2_muted():
            compile_module_for_target(parse_module(chunk, source_name=source_name), device)
    except Exception as error:  # noqa: BLE001 - any refusal of the input as given
        return _first_line(error)
    return None


def _first_line(error: BaseException) -> str:
    return next((line for line in str(error).splitlines() if line.strip()),
                type(error).__name__)


def _write_outputs(args: argparse.Namespace, text: str, report: str) -> None:
    """The output and, if asked, the report: both or neither (an unwritable report
    left the output written)."""
    files = [(args.output, text)]
    if args.report == "-" and _stderr_closed.is_set():
        raise CliError("hlo-amp-opt: error: cannot write the report: stderr is closed; "
                       "give --report FILE")
    if args.report and args.report != "-":
        files.append((args.report, report))
        _refuse_same_file(args, args.report)
    _write(files)
    if args.report == "-":  # after the output: a failed write showed the whole report
        sys.stderr.write(report)


def _refuse_same_file(args: argparse.Namespace, report: str) -> None:
    """One file for the report and the output (or the input): one would replace the
    other."""
    for flag, other in (("-o", args.output), ("the input", args.input)):
        if other != "-" and os.path.realpath(other) == os.path.realpath(report):
            raise CliError(f"hlo-amp-opt: error: --report {report!r} is the same file as "
                           f"{flag}; give the report a file of its own")


def _write(files: list[tuple[str, str]]) -> None:
    """Write each (path, text) so a failure leaves no output file, partial or whole:
    every text for a file goes to a temporary file beside its target first, then a FIFO
    or device is written directly ("-" is stdout), and only then do the temporary files
    replace their targets. A target keeps its mode (a new one gets the umask's, as a
    shell's ``>`` gives it; mkstemp's is 0600), and a symbolic link is written through
    (``/dev/stdout`` to a pipe is written to)."""
    staged: list[tuple[str, str, str]] = []  # (temporary, target, path as given)
    direct: list[tuple[str, str]] = []
    current = files[0][0]
    try:
        for current, text in files:
            # os.path reads through links: /dev/stdout is the pipe or file it names.
            if current == "-" or (os.path.exists(current) and not os.path.isfile(current)):
                direct.append((current, text))
                continue
            with contextlib.suppress(FileNotFoundError):  # a new file, or a dangling link
                os.stat(current)  # a loop of links fails here, as a shell's > fails
            target = os.path.realpath(current)
            mode = (stat.S_IMODE(os.stat(target).st_mode) if os.path.exists(target)
                    else 0o666 & ~_umask())
            handle, temporary = tempfile.mkstemp(dir=os.path.dirname(target),
                                                 prefix=".hlo-amp-opt-")
            staged.append((temporary, target, current))
            with os.fdopen(handle, "w") as out:
                out.write(text)
            os.chmod(temporary, mode)
        # The output last (stdout, /dev/stdout): a report to a device or directory that
        # cannot be written fails before it.
        for current, text in sorted(direct, key=lambda pair: pair[0] == files[0][0]):
            if current != "-":
                with open(current, "w") as out:
                    out.write(text)
            elif sys.stdout is None:  # started with stdout closed (>&-)
                raise CliError("hlo-amp-opt: error: cannot write the output: stdout is "
                               "closed; give -o FILE")
            else:
                sys.stdout.write(text)
                sys.stdout.flush()
        for temporary, target, current in staged:
            os.replace(temporary, target)
        staged = []
    except OSError as error:
        raise CliError(f"hlo-amp-opt: error: cannot write {current!r}: {error.strerror}"
                       ) from None
    finally:
        for temporary, _, _ in staged:
            with contextlib.suppress(OSError):
                os.unlink(temporary)


def _umask() -> int:
    current = os.umask(0)
    os.umask(current)
    return current


# Set while a run of main() has no stderr (2>&-, or sys.stderr None in-process).
_stderr_closed = threading.Event()


def _cover_closed_fd2() -> None:
    """Where fd 2 itself is closed (2>&-), /dev/null takes it, so no file the tool
    opens does (XLA's and jaxlib's C++ logs write there)."""
    try:
        os.fstat(2)
    except OSError:
        fd = os.open(os.devnull, os.O_WRONLY)
        if fd != 2:
            os.dup2(fd, 2)
            os.close(fd)


def main(argv: Sequence[str] | None = None) -> int:
    # With no stderr, Python's sys.stderr is None and print(..., file=None) writes to
    # stdout: warnings and errors went into the module written there. They are dropped
    # instead, as the shell asked, for this run (an in-process caller's sys.stderr and
    # fd 2 are given back as they were).
    given = sys.stderr
    if given is None:
        _stderr_closed.set()
        _cover_closed_fd2()
        sys.stderr = open(os.devnull, "w")  # noqa: SIM115 - closed below
    else:
        _stderr_closed.clear()
    try:
        return _main(argv)
    finally:
        if given is None:
            sys.stderr.close()
            sys.stderr = given
            _stderr_closed.clear()


def _main(argv: Sequence[str] | None) -> int:
    try:
        return run(argv)
    except CliError as error:
        print(error, file=sys.stderr)
    except ModuleError as error:
        print(f"hlo-amp-opt: {error}", file=sys.stderr)
    except KeyboardInterrupt:
        print("hlo-amp-opt: interrupted", file=sys.stderr)
    except Exception as error:  # noqa: BLE001 - a bug in hlo_amp: one line, no traceback
        first_line = (str(error).splitlines() or [""])[0]
        print(f"hlo-amp-opt: internal error: {type(error).__name__}: {first_line}",
              file=sys.stderr)
    return 1


if __name__ == "__main__":
    sys.exit(main())
