"""``hlo_amp.autopolicy(..., target=...)`` (issue 36): the policy a device runs fastest in
the roofline's model, within an error budget measured here.

The program is test_policy_search's: three benign scopes and ``cancel``, which bf16
ruins. ``embed`` and ``mix`` are 16x32 @ 32x32 dots (fp8-eligible: m, k, n >= 16);
``head`` has n = 8 and ``cancel`` is a matrix-vector product (neither takes fp8).
"""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_policy_search import W, X, make_program

import hlo_amp
from hlo_amp import cli
from hlo_amp.ir.modules import copy_module, module_text
from hlo_amp.passes import default_pipeline, run_pipeline
from hlo_amp.passes.fused_attention import FusedAttention
from hlo_amp.runtime.module_call import ModuleFunction
from hlo_amp.targets import device_target

# One function object: its executables here are cached across the tests' searches.
PROGRAM = make_program()


def _search(budget: float, target, **kw):
    return hlo_amp.autopolicy(PROGRAM, X, W, budget=budget, target=target,
                              progress=False, **kw)


# An H100 whose HBM is a thousand times faster: every kernel is bound by its matrix
# FLOPs, so lower precision is modelled faster on every dot (the real H100 runs these
# tiny dots memory-bound, where the converts cost more than the GEMMs save).
COMPUTE_BOUND_H100 = dataclasses.replace(
    device_target("h100"), hbm_bytes_per_second=device_target("h100").hbm_bytes_per_second
    * 1e3)


def test_a_budget_below_bf16_everywhere_keeps_the_fragile_scope_f32():
    result = _search(0.01, "h100")
    bf16 = next(b for b in result.baselines if b.name == "bf16 everywhere")
    assert bf16.error > 0.01  # the budget is below bf16-everywhere's error
    assert result.choices["cancel"] == "f32"
    assert result.met and result.error <= 0.01
    assert "/cancel" not in result.policy.scopes or \
        result.policy.scopes["/cancel"] == "float32"
    # the returned policy is modelled no slower than any baseline within the budget, the
    # base policy with the scopes over budget alone kept f32 among them
    but = next(b for b in result.baselines if b.name.startswith("bf16 everywhere but"))
    assert but.name == "bf16 everywhere but cancel (over budget alone)" and but.met
    assert all(result.step_seconds <= b.step_seconds for b in result.baselines if b.met)
    # every kept move was confirmed within budget; a refused one was over it
    assert all((m.error <= 0.01) == m.kept for m in result.moves)


def test_the_top_level_note_names_what_the_returned_policy_does_with_unscoped_ops():
    """A function with no named scope: on the real H100 its tiny dots are modelled
    fastest f32, so the 'f32 everywhere' baseline is returned, whose unscoped dots run
    f32. The note said they stay at the base policy's precision (bf16)."""
    def plain(w, x):
        return jnp.tanh(x @ w) @ w

    w, x = np.ones((16, 16), np.float32) / 16, np.ones((8, 16), np.float32)
    result = hlo_amp.autopolicy(plain, w, x, budget=1e-2, target="h100", progress=False)
    top = [n for n in result.notes if "outside any named scope" in n]
    report = hlo_amp.compile(plain, result.policy).lower(w, x).report()
    low = sum(d.operands_after != ("f32", "f32") for d in report.decisions)
    said = ("run as the returned baseline 'f32 everywhere' runs every matrix op" if low == 0
            else "stay at the base policy's precision")
    assert top == [f"note: matrix ops outside any named scope {said} (no scope rule can name them)"]


def test_where_a_baseline_is_returned_each_row_says_so():
    """Where a baseline beats where the moves ended, every scope's level is the
    baseline's: the rows said "no lower level is modelled faster" beside a choice the
    search had not made."""
    keys = jax.random.split(jax.random.key(0), 8)
    w = {n: jax.random.normal(keys[i], (32, 32)) / np.sqrt(32)
         for i, n in enumerate(["q", "k", "v", "o", "m1", "m2"])}
    x = jax.random.normal(keys[7], (2, 16, 32))

    def model(w, x):
        for i in range(2):
            with jax.named_scope(f"blocks/{i}"):
                q, k, v = x @ w["q"], x @ w["k"], x @ w["v"]
                a = jax.nn.softmax(jnp.einsum("btd,bsd->bts", q, k) / np.sqrt(32), -1)
                x = x + jnp.einsum("bts,bsd->btd", a, v) @ w["o"]
                x = x + jax.nn.gelu(x @ w["m1"]) @ w["m2"]
        with jax.named_scope("head"):
            return jnp.mean((x @ w["o"]) ** 2)

    result = hlo_amp.autopolicy(model, w, x, budget=1e-2, depth=2, target="h100",
                                progress=False)
    returned = [n for n in result.notes if "it is the one returned" in n]
    assert len(returned) == 1, result.notes
    name = returned[0].split("'")[1]
    assert [row.why for row in result.scopes] == [
        f"set by the returned baseline {name!r}"] * len(result.scopes)


def test_where_the_moves_end_over_budget_a_baseline_within_it_is_returned():
    """A dot that bf16 ruins outside any named scope: no move can reach the budget. The
    'f32 everywhere' baseline meets it at the same modelled time, and was not returned
    (only a faster one was): the result was over budget, met=False."""
    def cancelling(w, x):
        y = jnp.tanh(x @ w)
        return ((y + 1e-3) @ w - y @ w) * 1000

    w = jax.random.normal(jax.random.key(0), (32, 32))
    x = jax.random.normal(jax.random.key(1), (16, 32))
    result = hlo_amp.autopolicy(cancelling, w, x, budget=1e-2, target="h100",
                                progress=False)
    assert result.met and result.error <= 1e-2
    f32 = next(b for b in result.baselines if b.name == "f32 everywhere")
    assert f32.met and str(result.policy) == f32.policy
    assert "note: the baseline 'f32 everywhere' is within budget and where the moves " \
           "ended is not; it is the one returned" in result.notes


@pytest.mark.parametrize("base", ["fp8", "f32"])
def test_a_base_whose_dots_are_not_16_bit_is_searched_at_each_level_it_names(base):
    """The 16-bit level of a scope and the '16-bit everywhere' baseline were the base
    itself: under fp8 a scope "at bf16" ran fp8 (and was kept f32 for fp8's error), under
    f32 every level ran f32."""
    result = hlo_amp.autopolicy(PROGRAM, X, W, budget=0.05, base=base,
                                target=COMPUTE_BOUND_H100, progress=False)
    for name, policy in [("bf16 everywhere", next(
            b.policy for b in result.baselines if b.name == "bf16 everywhere")),
            ("chosen", str(result.policy))]:
        report = hlo_amp.compile(PROGRAM, policy).lower(X, W).report()
        levels = {d.scope.split("/")[0]: d.operands_after[0] for d in report.decisions}
        for scope, choice in (result.choices.items() if name == "chosen"
                              else dict.fromkeys(levels, "bf16").items()):
            want = {"f32": "f32", "bf16": "bf16", "fp8": "f8E4M3FN"}[choice]
            assert levels[scope] == want, (name, scope, choice, levels)


def test_a_program_without_matrix_ops_is_said_to_have_none():
    # Without a target autopolicy says so; with one it gave an empty table and no note.
    result = hlo_amp.autopolicy(lambda x: jnp.tanh(x) * 2, jnp.ones((4, 4)), budget=0.01,
                                target="h100", progress=False)
    assert result.met and not result.scopes
    assert result.notes == [("note: fn has no dot_general or convolution op: no policy "
                             "changes it, and each runs fn as written")]


def test_a_delayed_base_is_priced_under_current_scaling_without_its_history_length():
    """with_scaling kept amax_history=16 beside scaling=current, which the policy now
    refuses (autopolicy with a delayed base raised, blaming the user's history length)."""
    from hlo_amp.numerics.fastest import with_scaling

    base = hlo_amp.Policy.parse("fp8,scaling=delayed,amax_history=16")
    current = with_scaling(base, "current")
    assert (current.scaling, current.amax_history) == ("current", 1024)
    assert with_scaling(current, "delayed").scaling == "delayed"


@pytest.mark.parametrize("base", ["fp8,scaling=delayed", "fp8,scaling=delayed,amax_history=16"])
def test_a_search_from_a_delayed_base_completes(base):
    """Its bf16 baseline (every dot at the compute type) kept scaling=delayed, which a
    policy without fp8 actions refuses: the search raised after it had run, blaming the
    base ('scaling=delayed applies to fp8 actions')."""
    result = _search(0.1, "h100", base=base, max_compiles=60)
    assert result.error <= 0.1
    assert "bf16 everywhere" in {b.name for b in result.baselines}


def test_a_scope_no_rule_can_name_is_in_a_note():
    """A scope named with a space holds two thirds of the FLOPs: the search's table
    left it out and no note named it (attribute says no rule can keep it f32)."""
    def f(w, x):
        with jax.named_scope("a"):
            x = jnp.tanh(x @ w)
        with jax.named_scope("my block"):
            return jnp.tanh(x @ w) @ w

    w = jax.random.normal(jax.random.key(0), (32, 32)) / 6
    x = jax.random.normal(jax.random.key(1), (32, 32))
    result = hlo_amp.autopolicy(f, w, x, budget=1e-2, target="h100", max_compiles=40,
                                progress=False)
    assert any("'my block': no scope rule can name these ops" in n for n in result.notes)


def test_policies_that_rewrite_alike_compile_once_for_the_target():
    """A search's state of every scope at the base's level is written apart from the
    base (``bf16,...,scope:block=compute``) and rewrites the program alike: its step
    time is the base's, from one deviceless compile (there were two)."""
    from hlo_amp.numerics.attribute import with_scopes
    from hlo_amp.numerics.fastest import _TargetModel

    def f(w, x):
        with jax.named_scope("block"):
            return jnp.tanh(x @ w).sum()

    model = _TargetModel(f, (jnp.ones((64, 64)), jnp.ones((32, 64))), device_target("h100"))
    base = hlo_amp.Policy.parse("bf16")
    scoped = with_scopes(base, {"block": "compute"})
    assert scoped.to_string() != base.to_string()
    assert model.step_seconds(scoped) == model.step_seconds(base)
    assert model.compiles == 1
    # a policy that rewrites it otherwise is compiled
    assert model.step_seconds(hlo_amp.Policy.parse("f32")) != model.step_seconds(base)
    assert model.compiles == 2


def test_max_compiles_takes_a_numpy_integer():
    """As depth and budget do (it was 'Invalid max_compiles np.int64(40)')."""
    assert _search(0.1, "h100", max_compiles=np.int64(40)).compiles <= 40


def test_a_mesh_target_is_searched_like_one_device():
    # 8 H100s (the arguments replicated over them): the same contract, the device named
    node = _search(0.01, "h100x8")
    assert node.met and node.choices["cancel"] == "f32"
    assert node.target == "H100" and node.step_seconds > 0
    assert all(node.step_seconds <= b.step_seconds for b in node.baselines if b.met)


def test_on_a_compute_bound_device_fp8_is_taken_where_eligible_and_within_budget():
    tight = _search(0.01, COMPUTE_BOUND_H100)
    # fp8 was tried on the two eligible scopes and refused: its measured error is over
    assert tight.choices == {"embed": "bf16", "mix": "bf16", "cancel": "f32", "head": "bf16"}
    refused = {m.scope for m in tight.moves if m.to == "fp8" and not m.kept}
    assert refused == {"embed", "mix"}
    assert all(m.error > 0.01 for m in tight.moves if not m.kept)
    middle = _search(0.1, COMPUTE_BOUND_H100)  # above fp8's error, below cancel's bf16
    assert middle.choices == {"embed": "fp8", "mix": "fp8", "cancel": "f32", "head": "bf16"}
    assert middle.met and middle.step_seconds < tight.step_seconds
    rows = {row.scope: row for row in middle.scopes}
    assert rows["embed"].fp8_dots == 1 and rows["head"].fp8_dots == 0
    assert rows["cancel"].levels == ("f32", "bf16")  # a matrix-vector product: no fp8
    assert rows["head"].levels == ("f32", "bf16")  # n = 8: no fp8
    assert all(rows[s].saved_seconds > 0 for s in ("embed", "mix", "head"))
    assert middle.policy.scopes["/cancel"] == "float32"
    assert middle.policy.scopes["/embed"] == "float8_e5m2"
    fp8_everywhere = next(b for b in middle.baselines if b.name == "fp8 everywhere eligible")
    assert not fp8_everywhere.met  # it takes cancel down too


def test_delayed_fp8_scaling_is_priced_with_its_amax_history():
    """fp8_scaling="delayed": every policy with fp8 the search prices carries
    scaling=delayed and is compiled as hlo_amp.compile runs it, the amax history in and
    out. Priced on jax.jit's lowering (no history) the fp8 pass fell back to current
    scaling, and the two searches modelled the same step time."""
    current = _search(0.1, COMPUTE_BOUND_H100)
    delayed = _search(0.1, COMPUTE_BOUND_H100, fp8_scaling="delayed")
    assert delayed.choices == current.choices  # the errors are current scaling's
    assert delayed.policy.scaling == "delayed" and current.policy.scaling == "current"
    assert delayed.step_seconds != current.step_seconds
    fp8 = {b.name: b for b in delayed.baselines}["fp8 everywhere eligible"]
    assert hlo_amp.Policy.parse(fp8.policy).scaling == "delayed"
    bf16 = {b.name: b for b in delayed.baselines}["bf16 everywhere"]
    assert "scaling" not in bf16.policy  # no fp8 action, no scaling
    # The errors are current scaling's: said as autopolicy without a target says it.
    from hlo_amp.numerics.measure import DELAYED_NOTE

    assert (DELAYED_NOTE in delayed.notes) == delayed.policy.uses_fp8
    assert DELAYED_NOTE not in current.notes


def test_a_delayed_base_is_searched_and_returned_with_delayed_scaling():
    """Without fp8_scaling the base's scaling is priced and returned (a delayed base was
    priced, and returned, with current scaling: hunt h106); asked for another, one line.
    A chosen policy with no fp8 dot left is returned without scaling=delayed, which
    would make its step stateful for nothing."""
    loose = _search(0.1, COMPUTE_BOUND_H100, base="fp8,scaling=delayed")
    assert "fp8" in loose.choices.values() and loose.policy.scaling == "delayed"
    fp8 = {b.name: b for b in loose.baselines}["fp8 everywhere eligible"]
    assert hlo_amp.Policy.parse(fp8.policy).scaling == "delayed"
    tight = _search(0.01, COMPUTE_BOUND_H100, base="fp8,scaling=delayed")
    assert "fp8" not in tight.choices.values()
    assert tight.policy.uses_fp8 and tight.policy.scaling == "current"
    assert any("returned without scaling=delayed" in n for n in tight.notes)
    with pytest.raises(ValueError, match=r"has scaling=delayed and fp8_scaling='current'"):
        _search(0.1, "h100", base="fp8,scaling=delayed", fp8_scaling="current")
    # Without a target the same rule: the base's own scaling is accepted, another refused
    # (it took 'current' and returned a delayed policy, and refused 'delayed': h107).
    plain = hlo_amp.autopolicy(PROGRAM, X, W, budget=0.1, base="fp8,scaling=delayed",
                               fp8_scaling="delayed", progress=False)
    assert plain.policy.scaling == "delayed"
    with pytest.raises(ValueError, match=r"has scaling=delayed and fp8_scaling='current'"):
        hlo_amp.autopolicy(PROGRAM, X, W, budget=0.1, base="fp8,scaling=delayed",
                           fp8_scaling="current", progress=False)


@pytest.mark.parametrize("kw, match", [
    ({"fp8_scaling": "later", "target": "h100"}, "Invalid fp8_scaling 'later'; accepted"),
    ({"fp8_scaling": "delayed"}, "give target= too")])
def test_bad_fp8_scaling(kw, match):
    with pytest.raises(ValueError, match=match):
        hlo_amp.autopolicy(PROGRAM, X, W, budget=0.1, progress=False, **kw)


def test_a_loose_budget_picks_fp8_where_eligible_on_h100_and_never_on_tpu():
    gpu = _search(10.0, COMPUTE_BOUND_H100)
    assert {s for s, c in gpu.choices.items() if c == "fp8"} == {"embed", "mix"}
    tpu = _search(10.0, "tpu-v5e")
    assert "fp8" not in tpu.choices.values()
    assert all(row.levels == ("f32", "bf16") for row in tpu.scopes)
    assert all("fp8" not in b.name for b in tpu.baselines)
    assert not tpu.policy.uses_fp8
    assert any("fp8 not searched on TPU v5e" in n for n in tpu.notes)


def test_table_json_and_progress(capsys):
    result = hlo_amp.autopolicy(PROGRAM, X, W, budget=0.01, target="tpu-v5e")
    err = capsys.readouterr().err
    assert "autopolicy TPU v5e:" in err and f"/{120} compiles" in err
    text = str(result)
    for name in ("cancel", "f32 everywhere", "bf16 everywhere", "time saved alone"):
        assert name in text
    data = json.loads(result.to_json())
    assert hlo_amp.Policy.parse(data["policy"]) == result.policy
    assert {row["scope"] for row in data["scopes"]} == {"embed", "mix", "cancel", "head"}
    assert data["compiles"] == result.compiles >= data["target_compiles"] > 0
    _search(0.01, "tpu-v5e")
    assert capsys.readouterr().err == ""  # progress=False


def test_max_compiles_bounds_the_search():
    with pytest.raises(ValueError, match=r"max_compiles 5.*accepted: an int >= \d+"):
        _search(0.01, "h100", max_compiles=5)
    # step 1 and step 3 take 12 + 2 per level below f32 (embed, mix 2 each, cancel, head 1)
    needed = 12 + 2 * (2 + 2 + 1 + 1)
    fresh = make_program()  # nothing cached: every compile counts
    result = hlo_amp.autopolicy(fresh, X, W, budget=10.0, target=COMPUTE_BOUND_H100,
                                max_compiles=needed + 1, progress=False)
    assert result.compiles <= needed + 1
    assert any("stopped at max_compiles" in n for n in result.notes)
    assert result.met  # a search cut short still returns a policy within budget


@pytest.mark.parametrize("budget", [0, -1.0, math.nan, "0.1", None])
def test_bad_budget(budget):
    with pytest.raises(ValueError, match="Invalid budget"):
        _search(budget, "h100")


@pytest.mark.parametrize(("target", "match"), [
    ("h999", r"target='h999' is neither a known GPU"),
    (7, r"target=7: expected one of"),
])
def test_bad_target(target, match):
    with pytest.raises(ValueError, match=match):
        _search(0.01, target)


def test_target_without_peaks_and_f16_on_tpu_are_refused(tmp_path):
    config = tmp_path / "my_gpu.txtpb"
    config.write_text(device_target("h100").target_config)
    with pytest.raises(ValueError, match="no published peaks"):
        _search(0.01, str(config))
    with pytest.raises(ValueError, match="cannot be compiled for tpu-v5e"):
        _search(0.01, "tpu-v5e", base="f16")


def _module_file(tmp_path: Path) -> Path:
    path = tmp_path / "prog.mlir"
    path.write_text(jax.jit(PROGRAM).lower(X, W).as_text(debug_info=True))
    return path


def test_cli_autopolicy_writes_the_policy(tmp_path, capsys):
    np.savez(tmp_path / "inputs.npz", *[np.asarray(v) for v in jax.tree_util.tree_leaves((X, W))])
    status = cli.main([str(_module_file(tmp_path)), "--autopolicy", "--budget", "1e-2",
                       "--xla-target", "tpu-v5e", "--inputs", str(tmp_path / "inputs.npz"),
                       "-o", str(tmp_path / "policy.txt"),
                       "--report", str(tmp_path / "table.json")])
    err = capsys.readouterr().err
    assert status == 0, err
    assert "f32 everywhere" in err  # the table
    policy = hlo_amp.Policy.parse((tmp_path / "policy.txt").read_text().strip())
    data = json.loads((tmp_path / "table.json").read_text())
    assert data["met"] and data["error"] <= 1e-2
    assert hlo_amp.Policy.parse(data["policy"]) == policy
    assert {row["scope"] for row in data["scopes"]} == {"embed", "mix", "cancel", "head"}
    assert next(r for r in data["scopes"] if r["scope"] == "cancel")["choice"] == "f32"


def test_cli_autopolicy_prices_delayed_fp8_scaling(tmp_path, capsys):
    """--fp8-scaling delayed: the fp8 policies of the module's search are priced as the
    stateful step (the module's main, called, under hlo_amp.compile) and carry
    scaling=delayed in the report."""
    status = cli.main([str(_module_file(tmp_path)), "--autopolicy", "--budget", "0.1",
                       "--xla-target", "h100", "--fp8-scaling", "delayed",
                       "-o", str(tmp_path / "policy.txt"),
                       "--report", str(tmp_path / "table.json")])
    assert status == 0, capsys.readouterr().err
    data = json.loads((tmp_path / "table.json").read_text())
    fp8 = next(b for b in data["baselines"] if b["name"] == "fp8 everywhere eligible")
    assert hlo_amp.Policy.parse(fp8["policy"]).scaling == "delayed"


@pytest.mark.parametrize(("args", "match"), [
    (["--autopolicy", "--xla-target", "tpu-v5e"], "--autopolicy needs --budget"),
    (["--autopolicy", "--budget", "-1", "--xla-target", "tpu-v5e"], "Invalid budget"),
    (["--autopolicy", "--budget", "0.1"], "--autopolicy needs --xla-target"),
    (["--autopolicy", "--budget", "0.1", "--xla-target", "h999"], "h999"),
    (["--autopolicy", "--budget", "0.1", "--xla-target", "tpu-v5e", "--inputs", "nope.npz"],
     "cannot read inputs 'nope.npz'"),
    (["--autopolicy", "--budget", "0.1", "--xla-target", "tpu-v5e", "--max-compiles", "0"],
     "Invalid max_compiles 0"),
    # numpy's "expected non-negative integer", naming neither the option nor the value
    (["--autopolicy", "--budget", "0.1", "--xla-target", "tpu-v5e", "--seed", "-5"],
     "--seed -5; accepted: an integer >= 0"),
])
def test_cli_autopolicy_bad_arguments(tmp_path, capsys, args, match):
    """Each a user error: one line on stderr, status 1."""
    assert cli.main([str(_module_file(tmp_path)), *args]) == 1
    err = capsys.readouterr().err
    assert match in err and "Traceback" not in err
    assert len(err.strip().splitlines()) == 1


def test_cli_autopolicy_refuses_a_module_of_several_devices(tmp_path, capsys):
    """Measured on one CPU device and priced on one device of the target, a partitioned
    module got a policy without a word (or jax's mesh error, or an internal error for a
    shard_map)."""
    path = tmp_path / "sharded.mlir"
    path.write_text(_module_file(tmp_path).read_text().replace(
        "mhlo.num_partitions = 1 : i32", "mhlo.num_partitions = 2 : i32"))
    assert cli.main([str(path), "--autopolicy", "--budget", "0.1", "--xla-target",
                     "h100"]) == 1
    err = capsys.readouterr().err
    assert f"--autopolicy: {path} runs on 2 devices" in err
    assert "accepted: a module of one device" in err and len(err.strip().splitlines()) == 1


def test_cli_autopolicy_reads_a_jax_export_artifact(tmp_path, capsys):
    """The rewrite takes jax.export's serialized module; --autopolicy read its bytes as
    MLIR and failed on the VHLO ("Cannot cast attribute to StringAttr")."""
    path = tmp_path / "step.bin"
    path.write_bytes(jax.export.export(jax.jit(PROGRAM))(X, W).mlir_module_serialized)
    status = cli.main([str(path), "--autopolicy", "--budget", "1e-2", "--xla-target",
                       "tpu-v5e", "--report", str(tmp_path / "table.json"),
                       "-o", str(tmp_path / "policy.txt")])
    assert status == 0, capsys.readouterr().err
    data = json.loads((tmp_path / "table.json").read_text())
    assert {row["scope"] for row in data["scopes"]} == {"embed", "mix", "cancel", "head"}


def test_cli_autopolicy_refuses_text_that_is_not_mlir(tmp_path, capsys):
    path = tmp_path / "bad.mlir"
    path.write_text("this is not mlir")
    assert cli.main([str(path), "--autopolicy", "--budget", "0.1", "--xla-target",
                     "tpu-v5e"]) == 1
    err = capsys.readouterr().err
    # As a rewrite reads it (ir/modules.parse_module): with the file, line and column.
    assert f"{path}:1:1: error: custom op 'this' is unknown" in err
    assert len(err.strip().splitlines()) == 1


def test_cli_inputs_that_do_not_match_main_are_refused(tmp_path, capsys):
    np.savez(tmp_path / "short.npz", np.zeros((3,), np.float32))
    assert cli.main([str(_module_file(tmp_path)), "--autopolicy", "--budget", "0.1",
                     "--xla-target", "tpu-v5e", "--inputs", str(tmp_path / "short.npz")]) == 1
    err = capsys.readouterr().err
    assert "hold float32[3]; main takes float32[16, 32]" in err


def _projected_attention(wq, x):
    with jax.named_scope("block"):
        q = (x @ wq).reshape(2, 32, 4, 16)
        with jax.named_scope("core"):
            return jax.nn.dot_product_attention(q, q, q)


@pytest.mark.parametrize("base", ["bf16", "f16"])
def test_a_scope_holding_a_fused_attention_is_measured_as_the_target_runs_it(base):
    """Under the scope's fp8 rule the H100 keeps the attention fused in bf16 (cuDNN);
    measured here, where nothing is fused, its matmuls ran fp8: the search reported
    fp8 at 0.10, within a 0.12 budget, for a program that measures 0.17. The errors are
    now the target's program's: attention fused as on the H100, with the reference
    kernel (jax's XLA attention on the same bf16 inputs; in f16 on f32 copies, as
    XLA:CPU has no f16 dot with f32 accumulation: the f16 base's measurement fused
    nothing, review h80)."""
    keys = jax.random.split(jax.random.key(0), 2)
    wq = jax.random.normal(keys[0], (64, 64)) / 2
    x = jax.random.normal(keys[1], (2, 32, 64))
    result = hlo_amp.autopolicy(_projected_attention, wq, x, budget=1.0, base=base,
                                target=COMPUTE_BOUND_H100, progress=False)
    assert result.choices == {"block": "fp8"}
    policy = result.policy
    want = np.asarray(jax.jit(_projected_attention)(wq, x), np.float64)

    def error(got) -> float:
        return (float(np.abs(np.asarray(got, np.float64) - want).max()) - 1e-5) / float(
            np.abs(want).max())

    lowered = jax.jit(_projected_attention).lower(wq, x).compiler_ir("stablehlo")
    as_on_h100 = [FusedAttention(policy, device_target("h100"), "reference"),
                  *default_pipeline(policy, "cpu")[1:]]
    module = copy_module(lowered)
    report = run_pipeline(module, policy, passes=as_on_h100)
    assert [s.fused for s in report.attention] == [True]
    # The kernel's matmuls are its own: the projection is the one decided (fp8).
    assert [d.operands_after for d in report.decisions] == [("f8E4M3FN", "f8E4M3FN")]
    target_error = error(jax.jit(ModuleFunction(module_text(module)).for_platform("cpu"))(
        wq, x)[0])
    here = hlo_amp.compile(_projected_attention, policy)
    assert sum(d.fp8 for d in here.lower(wq, x).report().decisions) == 3
    here_error = error(here(wq, x))
    assert abs(here_error - target_error) > 0.2 * target_error  # the two programs differ
    assert result.error == pytest.approx(target_error, rel=1e-3)


def test_on_a_mesh_the_attention_is_measured_unfused_as_the_target_runs_it():
    """The target's program partitioned over two devices leaves its attention unfused
    (fp8 matmuls under the scope's rule): the measurement fused it (0.17 reported for
    a program that measures 0.10, review h80)."""
    keys = jax.random.split(jax.random.key(0), 2)
    wq = jax.random.normal(keys[0], (64, 64)) / 2
    x = jax.random.normal(keys[1], (2, 32, 64))
    mesh = device_target("h100x2")
    mesh = dataclasses.replace(mesh, hbm_bytes_per_second=mesh.hbm_bytes_per_second * 1e3)
    result = hlo_amp.autopolicy(_projected_attention, wq, x, budget=1.0, target=mesh,
                                progress=False)
    assert result.choices == {"block": "fp8"}
    on_mesh = hlo_amp.compile(_projected_attention, result.policy).lower(
        wq, x, target="h100x2").report()
    assert [s.fused for s in on_mesh.attention] == [False]
    want = np.asarray(jax.jit(_projected_attention)(wq, x), np.float64)
    got = np.asarray(hlo_amp.compile(_projected_attention, result.policy)(wq, x), np.float64)
    unfused = (float(np.abs(got - want).max()) - 1e-5) / float(np.abs(want).max())
    assert result.error == pytest.approx(unfused, rel=1e-3)


def test_a_scope_holding_an_attention_alone_is_searched():
    """Its matmuls are no decisions where the attention is fused: the scope was not
    searched, so no policy could keep the attention f32, and 'every scope f32' ran it
    fused in bf16 (review h80)."""
    keys = jax.random.split(jax.random.key(0), 3)
    params = {"wq": jax.random.normal(keys[0], (64, 64)) / 4,
              "wo": jax.random.normal(keys[1], (64, 64)) / 8}
    x = jax.random.normal(keys[2], (2, 32, 64))

    def f(p, x):
        with jax.named_scope("proj"):
            q = (x @ p["wq"]).reshape(2, 32, 4, 16)
        with jax.named_scope("attn"):
            o = jax.nn.dot_product_attention(q, q, q, is_causal=True)
        with jax.named_scope("out"):
            return o.reshape(2, 32, 64) @ p["wo"]

    result = hlo_amp.autopolicy(f, params, x, budget=1.0, target=COMPUTE_BOUND_H100,
                                progress=False)
    assert [row.scope for row in result.scopes] == ["proj", "attn", "out"]
    assert {m.scope for m in result.moves} >= {"attn"}
    every_f32 = next(b for b in result.baselines if b.name == "f32 everywhere")
    assert every_f32.error == 0
