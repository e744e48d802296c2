"""Policy: the string grammar, errors, presets, round trips and decide() semantics."""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import hlo_amp
from hlo_amp.policy import OP_KINDS, Policy, Rule, as_policy, match_start

ALL_COMPUTE = {kind: "compute" for kind in OP_KINDS}


# ---- parsing -------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("spec", "compute", "ops"),
    [
        ("bf16", "bfloat16", ALL_COMPUTE),
        ("f16", "float16", ALL_COMPUTE),
        ("f32", "bfloat16", {}),
        ("mixed_bfloat16", "bfloat16", ALL_COMPUTE),
        ("mixed_float16", "float16", ALL_COMPUTE),
    ],
)
def test_presets_parse(spec: str, compute: str, ops: dict[str, str]) -> None:
    policy = Policy.parse(spec)
    assert policy.compute_dtype == compute
    assert dict(policy.ops) == ops
    assert dict(policy.scopes) == {}
    assert policy.backward is None
    assert policy.include_f64 is False
    assert policy.propagate is spec.startswith("mixed_")
    assert policy == Policy.preset(spec)


def test_keep_f32_results_item_and_field() -> None:
    policy = Policy.parse("mixed_float16,keep_f32_results=true")
    assert policy.keep_f32_results and policy.propagate
    assert policy == Policy("float16", ops=ALL_COMPUTE, propagate=True, keep_f32_results=True)
    assert policy != Policy.preset("mixed_float16")
    assert not Policy.preset("mixed_float16").keep_f32_results


def test_propagate_item_and_field() -> None:
    assert Policy.parse("bf16,propagate=true") == Policy.preset("mixed_bfloat16")
    assert Policy.parse("mixed_float16,propagate=false") == Policy.preset("f16")
    assert Policy.from_dict({"compute_dtype": "bfloat16", "ops": ALL_COMPUTE,
                             "propagate": True}) == Policy.preset("mixed_bfloat16")
    assert Policy("float16", ops=ALL_COMPUTE, propagate=True) == Policy.parse("mixed_float16")


def test_op_rules_accept_every_stablehlo_op_name() -> None:
    policy = Policy.parse("mixed_bfloat16,op:exponential=compute,op:stablehlo.add=float32,"
                          "op:reduce=keep,op:chlo.erf=bfloat16")
    assert dict(policy.ops) == {**ALL_COMPUTE, "exponential": "compute", "add": "float32",
                                "reduce": "keep", "erf": "bfloat16"}
    assert policy.decide((), "exponential", False) == Rule("compute", "op:exponential")
    assert Policy.parse(policy.to_string()) == policy


@pytest.mark.parametrize(
    ("spec", "fragment"),
    [
        ("mixed_bfloat16,op:exponentail=compute", "Unknown op kind 'exponentail'; accepted:"),
        ("bf16,op:exponential=compute", "add propagate=true or start from mixed_bfloat16"),
        ("mixed_bfloat16,op:add=float16", "accepted for ops other than"),
        ("mixed_bfloat16,propagate=sometimes", "accepted: true, false"),
        ("mixed_bfloat16,keep_f32_results=yes", "accepted: true, false"),
        ("bf16,keep_f32_results=true", "keep_f32_results applies to the propagation pass"),
        ("mixed_float32", "Unknown preset 'mixed_float32'"),
    ],
)
def test_propagation_rule_errors(spec: str, fragment: str) -> None:
    with pytest.raises(ValueError) as error:
        Policy.parse(spec)
    assert fragment in str(error.value)
    if "Unknown op kind" in fragment:  # the list of accepted names is complete
        assert "exponential" in str(error.value) and "dot_general" in str(error.value)


def test_parse_full_grammar() -> None:
    policy = Policy.parse(
        "bf16,scope:head=float32,scope:Block_*/attn=keep,op:convolution=keep,"
        "backward=compute,f64=true"
    )
    assert policy.compute_dtype == "bfloat16"
    assert dict(policy.ops) == {"dot_general": "compute", "dot": "compute",
                                "convolution": "keep", "ragged_dot": "compute"}
    assert dict(policy.scopes) == {"head": "float32", "Block_*/attn": "keep"}
    assert list(policy.scopes) == ["head", "Block_*/attn"]  # order is kept
    assert policy.backward == "compute"
    assert policy.include_f64 is True


def test_parse_aliases_spaces_and_overrides() -> None:
    policy = Policy.parse(" f16 , compute = bf16 , scope:head = f32 , op:dot = half ,f64=0")
    assert policy.compute_dtype == "bfloat16"
    assert policy.scopes["head"] == "float32"
    assert policy.ops["dot"] == "float16"
    assert policy.include_f64 is False
    # Without a preset the bf16 preset is the base.
    assert Policy.parse("scope:head=keep") == Policy.parse("bf16,scope:head=keep")
    assert Policy.parse("bf16,f64=1").include_f64 is True


def test_parse_op_keys_stablehlo_and_primitive_names() -> None:
    policy = Policy.parse("f32,op:stablehlo.dot_general=keep,op:conv_general_dilated_p=float16")
    assert dict(policy.ops) == {"dot_general": "keep", "convolution": "float16"}
    # A primitive name maps to every StableHLO op it lowers to.
    assert dict(Policy.parse("f32,op:dot_general_p=keep").ops) == {
        "dot_general": "keep", "dot": "keep"}
    # As the unknown-kind message spells them (it listed them as accepted and refused
    # them; jax.lax has no ragged_dot_general_p for the dict form).
    assert dict(Policy.parse("f32,op:jax.lax.ragged_dot_general_p=keep").ops) == {
        "ragged_dot": "keep"}
    assert dict(Policy(ops={"jax.lax.conv_general_dilated_p": "f16"}).ops) == {
        "convolution": "float16"}


def test_jax_primitives_as_op_keys() -> None:
    policy = Policy(ops={jax.lax.dot_general_p: "keep", jax.lax.conv_general_dilated_p: "f16"})
    assert dict(policy.ops) == {"dot_general": "keep", "dot": "keep",
                                "convolution": "float16"}
    assert policy.decide((), "dot", False) == Rule("keep", "op:dot")


# ---- errors --------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("spec", "given", "accepted"),
    [
        ("bf16,op:conv=keep", "'conv'", ["dot_general", "convolution"]),
        ("bf16,op:dot_general=fast", "'fast'", ["compute", "keep", "float32"]),
        ("bf16,scope:head=int8", "'int8'", ["compute", "keep", "bfloat16"]),
        ("bf16,compute=int8", "'int8'", ["bfloat16", "float16"]),
        ("bf16,compute=float32", "'float32'", ["bfloat16", "float16"]),
        ("bf16,backward=later", "'later'", ["compute", "keep"]),
        ("bf16,foo=1", "'foo'", ["compute", "backward", "f64", "op:KIND", "scope:PATTERN"]),
        ("bf16,f64=maybe", "'maybe'", ["true", "false"]),
        ("bf16,scope:a//b=keep", "'a//b'", ["segments", "'/'"]),
        ("bf16,scope:=keep", "''", ["segments"]),
        ("bf16,scope:a b=keep", "'a b'", ["segments"]),
        ("bf16,scope:Block_[0=keep", "'Block_[0'", ["'['"]),
        ("bf16,scope:/=keep", "'/'", ["segments", "leading '/'", "trailing '$'"]),
        ("bf16,scope:$=keep", "'$'", ["segments", "leading '/'", "trailing '$'"]),
        ("bf16,scope:/$=keep", "'/$'", ["segments", "trailing '$'"]),
        ("bf16,scope://x=keep", "'//x'", ["segments", "leading '/'"]),
        ("bf16,scope:x/$=keep", "'x/$'", ["segments", "trailing '$'"]),
        ("bf16,scope:/a//b$=keep", "'/a//b$'", ["segments"]),
        ("bogus", "'bogus'", ["bf16", "f16", "f32"]),
        ("", "''", ["bf16", "f16", "f32"]),
        ("bf16,scope:head", "'scope:head'", ["KEY=VALUE"]),
    ],
)
def test_parse_errors_name_input_and_accepted(spec: str, given: str,
                                             accepted: list[str]) -> None:
    with pytest.raises(ValueError) as info:
        Policy.parse(spec)
    message = str(info.value)
    assert given in message
    for word in accepted:
        assert word in message, (word, message)


def test_unknown_key_error_quotes_the_whole_spec() -> None:
    # jmp's model: "Unknown key 'x' in 'p=f32,...'".
    with pytest.raises(ValueError, match=r"Unknown key 'mystery' in 'bf16,mystery=1'"):
        Policy.parse("bf16,mystery=1")


def test_preset_not_first_is_an_error() -> None:
    with pytest.raises(ValueError, match="'f16'"):
        Policy.parse("bf16,f16")


def test_constructor_and_dict_errors() -> None:
    with pytest.raises(ValueError, match=r"Unsupported compute_dtype 'int8'.*bfloat16, float16"):
        Policy(compute_dtype="int8")
    with pytest.raises(ValueError, match=r"Unsupported compute_dtype .*float32"):
        Policy(compute_dtype=jnp.float32)
    with pytest.raises(ValueError, match=r"Unknown key 'compute' in policy dict; accepted: "
                                         r"compute_dtype, ops, scopes"):
        Policy.from_dict({"compute": "bf16"})
    with pytest.raises(ValueError, match=r"Unknown op kind 'matmul'"):
        Policy(ops={"matmul": "compute"})
    with pytest.raises(ValueError, match=r"Unsupported primitive 'add'.*dot_general_p"):
        Policy(ops={jax.lax.add_p: "compute"})
    with pytest.raises(ValueError, match=r"Unknown action 'fast' for scope rule 'head'"):
        Policy(scopes={"head": "fast"})
    with pytest.raises(ValueError, match=r"Unknown preset 'int8'; accepted: bf16, f16, f32, "
                                         r"mixed_bfloat16, mixed_float16, fp8"):
        Policy.preset("int8")
    with pytest.raises(ValueError, match=r"Unsupported policy 42; accepted: a Policy"):
        as_policy(42)  # type: ignore[arg-type]
    # A flag is a bool: {"propagate": "false"} was the fast mode (bool("false")).
    for flag, value in (("propagate", "false"), ("include_f64", "no"),
                        ("only_if_faster", 1), ("fuse_attention", None)):
        with pytest.raises(ValueError, match=rf"{flag}={value!r}; accepted: True, False"):
            as_policy({"compute_dtype": "bfloat16", flag: value})


def test_numpy_and_jnp_dtypes_are_accepted() -> None:
    policy = Policy(compute_dtype=jnp.float16, scopes={"head": jnp.float32})
    assert policy.compute_dtype == "float16"
    assert policy.scopes["head"] == "float32"


# ---- presets, immutability, as_policy ------------------------------------------------


def test_f32_preset_decides_nothing() -> None:
    policy = Policy.preset("f32")
    for kind in OP_KINDS:
        assert policy.decide(("Block_0", "attn"), kind, False) == Rule(None, "default")


def test_policy_is_frozen_and_hashable() -> None:
    policy = Policy.parse("bf16,scope:head=keep")
    assert hash(policy) == hash(Policy.parse("bf16,scope:head=keep"))
    with pytest.raises(TypeError):
        policy.scopes["head"] = "compute"  # type: ignore[index]
    with pytest.raises(AttributeError):
        policy.compute_dtype = "float16"  # type: ignore[misc]


def test_as_policy_accepts_every_form() -> None:
    expected = Policy.parse("bf16,scope:head=float32")
    assert as_policy(None) == Policy.preset("bf16")
    assert as_policy(expected) is expected
    assert as_policy("bf16,scope:head=float32") == expected
    assert as_policy(expected.to_dict()) == expected


def test_a_policy_pickles_and_copies() -> None:
    """deepcopy and pickle rebuilt its rule tables item by item, which they refuse
    ("read-only"): no compiled function could be deep-copied either."""
    import copy
    import pickle

    policy = Policy.parse("fp8,scope:head=float32,op:exponential=compute")
    assert pickle.loads(pickle.dumps(policy)) == policy
    assert copy.deepcopy(policy) == policy
    with pytest.raises(TypeError, match="read-only"):
        copy.deepcopy(policy).scopes["head"] = "keep"


def test_spaces_around_an_items_colon_are_ignored() -> None:
    # "scope :head" and "op : dot_general" were unknown keys.
    spaced = Policy.parse("bf16, scope : head = float32, op : dot_general = keep")
    assert spaced == Policy.parse("bf16,scope:head=float32,op:dot_general=keep")


# ---- round trips ---------------------------------------------------------------------


@pytest.mark.parametrize(
    "spec",
    ["bf16", "f16", "f32", "bf16,scope:head=float32,scope:Block_*/attn=keep",
     "bf16,scope:/head$=float32,scope:/Block_*/attn=keep,scope:mlp$=compute,scope:head=keep",
     "f32,op:convolution=compute,compute=float16,backward=keep,f64=true",
     "bf16,op:dot=float16,scope:amp_stop=compute",
     "mixed_bfloat16,scope:head=float32,op:exponential=compute",
     "mixed_float16,op:add=keep", "f32,op:dot_general=compute,propagate=true",
     "mixed_bfloat16,keep_f32_results=true",
     "bf16,scope:/lr=0.1$=float32"],  # a scope named "lr=0.1": its '=' is the pattern's
)
def test_string_and_dict_round_trips(spec: str) -> None:
    policy = Policy.parse(spec)
    assert "lr=" not in spec or policy.scopes == {"/lr=0.1$": "float32"}
    assert Policy.parse(policy.to_string()) == policy
    assert Policy.parse(str(policy)) == policy
    assert Policy.from_dict(policy.to_dict()) == policy
    assert Policy.from_dict(json.loads(json.dumps(policy.to_dict()))) == policy


_ACTIONS = st.sampled_from(["compute", "keep", "bfloat16", "float16", "float32", "float64"])
_SEGMENT = st.text(alphabet="abcXYZ019_*?-.", min_size=1, max_size=6)
_PATTERN = st.builds(lambda first, parts, last: ("/" if first else "") + "/".join(parts)
                     + ("$" if last else ""),
                     st.booleans(), st.lists(_SEGMENT, min_size=1, max_size=3), st.booleans())
_POLICIES = st.builds(
    Policy,
    compute_dtype=st.sampled_from(["bfloat16", "float16"]),
    ops=st.dictionaries(st.sampled_from(OP_KINDS), _ACTIONS, max_size=3),
    scopes=st.dictionaries(_PATTERN, _ACTIONS, max_size=4),
    backward=st.none() | _ACTIONS,
    include_f64=st.booleans(),
    propagate=st.booleans(),
)
_SCOPES = st.lists(st.sampled_from(["a", "b", "X", "amp_stop", "c_1", "Y.9"]), max_size=4)


@settings(max_examples=50, deadline=None)
@given(policy=_POLICIES, scope=_SCOPES, kind=st.sampled_from(OP_KINDS),
       backward=st.booleans())
def test_round_trips_preserve_rules_and_decisions(policy: Policy, scope: list[str],
                                                  kind: str, backward: bool) -> None:
    from_string = Policy.parse(policy.to_string())
    from_dict = Policy.from_dict(json.loads(json.dumps(policy.to_dict())))
    for other in (from_string, from_dict):
        assert other == policy
        assert list(other.scopes) == list(policy.scopes)  # order decides ties
        assert other.decide(tuple(scope), kind, backward) == policy.decide(
            tuple(scope), kind, backward)


# ---- decide() --------------------------------------------------------------------------


def test_scope_patterns_match_whole_segments() -> None:
    policy = Policy.parse("bf16,scope:attn=keep")
    assert policy.decide(("Block_0", "attn", "query"), "dot_general", False) == Rule(
        "keep", "scope:attn")
    assert policy.decide(("Block_0", "attn_norm"), "dot_general", False) == Rule(
        "compute", "op:dot_general")
    assert policy.decide(("self_attn",), "dot_general", False).rule == "op:dot_general"


def test_a_glob_class_may_hold_a_bracket() -> None:
    """fnmatch's classes: '[[b]' holds '[' and 'b' (counting brackets refused it)."""
    policy = Policy.parse("bf16,scope:a[[b]]=float32")
    assert policy.decide(("a[]",), "dot_general", False) == Rule("float32", "scope:a[[b]]")


def test_glob_patterns() -> None:
    policy = Policy.parse("f32,scope:Block_*/attn=keep,scope:enc?=float16")
    assert policy.decide(("Block_3", "attn", "q"), "dot_general", False) == Rule(
        "keep", "scope:Block_*/attn")
    # Consecutive segments only, each matched whole.
    assert policy.decide(("Block_3", "mlp", "attn"), "dot_general", False).action is None
    assert policy.decide(("MyBlock_3", "attn"), "dot_general", False).action is None
    assert policy.decide(("enc1", "x"), "dot", False) == Rule("float16", "scope:enc?")
    assert policy.decide(("enc12",), "dot", False).action is None


@pytest.mark.parametrize("order", [("outer", "inner"), ("inner", "outer")])
def test_outermost_scope_wins_whatever_the_rule_order(order: tuple[str, str]) -> None:
    actions = {"outer": "keep", "inner": "float32"}
    policy = Policy(ops={"dot_general": "compute"},
                    scopes={name: actions[name] for name in order})
    assert policy.decide(("outer", "inner"), "dot_general", False) == Rule(
        "keep", "scope:outer")
    assert policy.decide(("inner", "outer"), "dot_general", False) == Rule(
        "float32", "scope:inner")


def test_longer_pattern_wins_at_the_same_start() -> None:
    policy = Policy(scopes={"a": "keep", "a/b": "float32"})
    assert policy.decide(("a", "b"), "dot_general", False) == Rule("float32", "scope:a/b")
    assert policy.decide(("a", "c"), "dot_general", False) == Rule("keep", "scope:a")
    # the order the rules are written in does not change that
    flipped = Policy(scopes={"a/b": "float32", "a": "keep"})
    assert flipped.decide(("a", "b"), "dot_general", False) == Rule("float32", "scope:a/b")


def test_equal_length_patterns_at_the_same_start_first_written_wins() -> None:
    for first, second in (("c", "c*"), ("c*", "c")):
        policy = Policy(scopes={first: "keep", second: "float32"})
        assert policy.decide(("c", "d"), "dot_general", False) == Rule("keep", f"scope:{first}")


@pytest.mark.parametrize(("pattern", "scope", "start"), [
    ("/head", ("head",), 0),
    ("/head", ("head", "dense"), 0),
    ("/head", ("blocks", "0", "head"), None),  # unanchored "head" matches here, at 2
    ("head", ("blocks", "0", "head"), 2),
    ("head$", ("blocks", "0", "head"), 2),
    ("head$", ("head", "dense"), None),
    ("head$", ("head", "x", "head"), 2),  # the innermost, not the first "head"
    ("dense$", ("head", "dense"), 1),
    ("/head$", ("head",), 0),
    ("/head$", ("head", "dense"), None),
    ("/head$", ("blocks", "head"), None),
    ("/head/dense$", ("head", "dense"), 0),
    ("/Block_*/attn", ("Block_3", "attn", "q"), 0),
    ("/Block_*/attn", ("enc", "Block_3", "attn"), None),
    ("Block_*/attn$", ("enc", "Block_3", "attn"), 1),
    ("Block_*/attn$", ("Block_3", "attn", "q"), None),
    ("/Block_?$", ("Block_3",), 0),
    ("/Block_?$", ("Block_33",), None),
    ("/a/b", ("a",), None),  # longer than the scope
    ("a$b", ("a$b",), 0),  # '$' inside a segment is literal
    ("a[$]", ("x", "a$"), 1),  # and a literal trailing '$' is written '[$]'
])
def test_anchored_patterns(pattern: str, scope: tuple[str, ...], start: int | None) -> None:
    assert match_start(pattern, scope) == start
    action = Policy(ops={}, scopes={pattern: "keep"}).decide(scope, "dot_general", False)
    assert action == (Rule(None, "default") if start is None else Rule("keep", f"scope:{pattern}"))


def test_anchored_and_unanchored_patterns_follow_the_same_precedence() -> None:
    # the outermost start wins: "/blocks" at 0 over "head" at 2
    policy = Policy(scopes={"head": "float32", "/blocks": "keep"})
    assert policy.decide(("blocks", "0", "head"), "dot_general", False).rule == "scope:/blocks"
    assert policy.decide(("head",), "dot_general", False).rule == "scope:head"
    # at the same start, more parts win, anchors not counted as parts: "a/b" beats "/a"
    for scopes in ({"/a": "keep", "a/b": "float32"}, {"a/b": "float32", "/a": "keep"}):
        policy = Policy(scopes=scopes)
        assert policy.decide(("a", "b"), "dot_general", False) == Rule("float32", "scope:a/b")
        assert policy.decide(("a", "c"), "dot_general", False) == Rule("keep", "scope:/a")
    # at the same start with as many parts, the first written wins, anchored or not
    for first, second in (("head", "/head$"), ("/head$", "head")):
        policy = Policy(scopes={first: "keep", second: "float32"})
        assert policy.decide(("head",), "dot_general", False) == Rule("keep", f"scope:{first}")


def test_an_anchored_amp_stop_rule_names_the_ops_inside_it() -> None:
    policy = Policy.parse("bf16,scope:amp_stop$=compute")
    assert policy.decide(("x", "amp_stop"), "dot_general", False) == Rule(
        "compute", "scope:amp_stop$")
    assert policy.decide(("amp_stop", "x"), "dot_general", False) == Rule("keep", "amp_stop")


@pytest.mark.parametrize(("pattern", "scope"), [
    ("amp_stop/inner", ("amp_stop", "inner")), ("/amp_stop/inner$", ("amp_stop", "inner")),
    ("outer/amp_stop", ("outer", "amp_stop", "x")), ("amp_stop", ("outer", "amp_stop", "x")),
    # an amp_stop nested in another (a library's inside the user's): the pattern names
    # the inner one too (only the outermost match was tried, and it lost to the inner)
    ("amp_stop", ("amp_stop", "amp_stop")), ("amp_stop", ("amp_stop", "b", "amp_stop")),
    ("mlp/amp_stop", ("mlp", "amp_stop", "mlp", "amp_stop", "x"))])
def test_a_rule_naming_the_amp_stop_segment_names_the_ops_inside_it(pattern, scope) -> None:
    """``amp_stop`` alone reached inside; a longer pattern naming the same segment lost
    to amp_stop (and was warned about as lost on precedence)."""
    policy = Policy.parse(f"bf16,scope:{pattern}=compute")
    assert policy.decide(scope, "dot_general", False) == Rule("compute", f"scope:{pattern}")
    # A pattern that names another segment outside the amp_stop still does not reach in.
    assert Policy.parse("bf16,scope:outer=compute").decide(
        ("outer", "amp_stop", "x"), "dot_general", False) == Rule("keep", "amp_stop")


def test_scope_rule_order_is_part_of_equality() -> None:
    """Of two patterns matching alike the one written first wins, so two policies that
    differ only in that order decide differently: they compared and hashed equal."""
    first = Policy.parse("bf16,scope:l?=float16,scope:l[1]=keep")
    second = Policy.parse("bf16,scope:l[1]=keep,scope:l?=float16")
    assert first.decide(("l1",), "dot_general", False) != second.decide(
        ("l1",), "dot_general", False)
    assert first != second and len({first, second}) == 2
    assert first == Policy.parse(first.to_string()) and hash(first) == hash(
        Policy.parse(first.to_string()))


@pytest.mark.parametrize(("make", "match"), [
    (lambda: Policy(scopes={"head": "keep", " head ": "float32"}),
     r"scope pattern 'head' is given twice in scopes"),
    (lambda: Policy.parse("bf16,compute=bfloat16,compute_dtype=float16"),
     r"compute is given twice in .* \(as compute and compute_dtype\)"),
    (lambda: Policy.parse("fp8,scaling=delayed,amax_history=99999999999999999999"),
     r"amax_history must be an int from 1 to 65536"),
    (lambda: Policy.parse("fp8,scaling=delayed,amax_history=10000000000000"),
     r"amax_history must be an int from 1 to 65536")])
def test_repeats_and_lengths_past_memory_are_refused(make, match) -> None:
    """Two spellings of one scope pattern or of compute: the later won, unseen; an
    amax_history of 10**13 was taken, then ended the first call (std::bad_alloc)."""
    with pytest.raises(ValueError, match=match):
        make()


def test_numpy_flags_and_integers_are_taken() -> None:
    """np.True_ (NumPy 2's type is named 'bool') was refused as 'propagate=True;
    accepted: True, False'; np.int64(5) as amax_history too."""
    assert Policy(propagate=np.True_).propagate is True
    policy = Policy(ops={"dot_general": "float8_e4m3fn"}, scaling="delayed",
                    amax_history=np.int64(5))
    assert policy.amax_history == 5 and type(policy.amax_history) is int


@pytest.mark.parametrize("spec", ["bf16,amax_history=16", "fp8,amax_history=16"])
def test_amax_history_without_delayed_scaling_is_refused(spec) -> None:
    """It was accepted, and spelled out by to_string(), and did nothing."""
    with pytest.raises(ValueError, match=r"amax_history=16 applies to delayed scaling"):
        Policy.parse(spec)
    assert Policy.parse("fp8,scaling=delayed,amax_history=16").amax_history == 16


def test_scope_rules_beat_op_rules() -> None:
    policy = Policy.parse("bf16,op:convolution=float16,scope:head=keep")
    assert policy.decide(("head",), "dot_general", False) == Rule("keep", "scope:head")
    assert policy.decide(("head",), "convolution", False) == Rule("keep", "scope:head")
    assert policy.decide(("body",), "convolution", False) == Rule("float16", "op:convolution")


def test_amp_stop_keeps_unless_a_rule_inside_names_the_op() -> None:
    policy = Policy.parse("bf16,scope:lora=compute")
    assert policy.decide(("amp_stop",), "dot_general", False) == Rule("keep", "amp_stop")
    assert policy.decide(("Block_0", "amp_stop", "mlp"), "dot_general", False) == Rule(
        "keep", "amp_stop")
    # A rule matching inside the amp_stop names the op.
    assert policy.decide(("amp_stop", "lora"), "dot_general", False) == Rule(
        "compute", "scope:lora")
    # A rule matching outside it does not reach in.
    assert policy.decide(("lora", "amp_stop"), "dot_general", False) == Rule(
        "keep", "amp_stop")
    # ... but the same pattern matching inside it too names the op (it was kept: only
    # the outermost match was looked at).
    assert policy.decide(("lora", "amp_stop", "lora"), "dot_general", False) == Rule(
        "compute", "scope:lora")
    # amp_stop holds even where no op rule would have applied.
    assert Policy.preset("f32").decide(("amp_stop",), "dot", False) == Rule("keep", "amp_stop")
    # A rule on amp_stop itself is a rule inside it.
    explicit = Policy.parse("bf16,scope:amp_stop=float16")
    assert explicit.decide(("amp_stop",), "dot", False) == Rule("float16", "scope:amp_stop")


def test_nested_amp_stop_shields_from_rules_between_them() -> None:
    policy = Policy.parse("bf16,scope:lora=compute")
    assert policy.decide(("amp_stop", "lora", "amp_stop"), "dot_general", False) == Rule(
        "keep", "amp_stop")


def test_backward_follows_forward_unless_backward_is_set() -> None:
    plain = Policy.parse("bf16,scope:head=float32")
    for backward in (False, True):
        assert plain.decide(("head",), "dot_general", backward) == Rule(
            "float32", "scope:head")
        assert plain.decide(("mlp",), "dot_general", backward) == Rule(
            "compute", "op:dot_general")
    split = Policy.parse("bf16,scope:head=float32,backward=keep")
    assert split.decide(("mlp",), "dot_general", False) == Rule("compute", "op:dot_general")
    assert split.decide(("mlp",), "dot_general", True) == Rule("keep", "backward")
    assert split.decide(("head",), "dot_general", True) == Rule("keep", "backward")


@pytest.mark.parametrize(("policy", "dtype"), [
    ("bf16,scope:s=float16", jnp.bfloat16), ("bf16,op:dot_general=float16", jnp.bfloat16),
    ("f16,scope:s=bfloat16", jnp.float16)])
def test_a_16bit_action_leaves_a_16bit_dot_alone(policy: str, dtype) -> None:
    """As the compute action does: a bf16 dot of the program went to f16 under
    scope:s=float16 (and an f16 one to bf16)."""
    def fn(x, w):
        with jax.named_scope("s"):
            return x @ w

    x = jnp.ones((16, 32), dtype)
    [decision] = hlo_amp.compile(fn, policy).lower(x, jnp.ones((32, 8), dtype)).report(
        ).decisions
    assert not decision.changed and decision.reason == "already low precision"


@pytest.mark.parametrize("policy", ["bf16,scope:s=float16", "bf16,op:dot_general=float16",
                                    "bf16,scope:s=f16"])
def test_a_16bit_action_leaves_a_16bit_dot_with_an_f32_result_alone(policy: str) -> None:
    """A bf16 x bf16 -> f32 dot (preferred_element_type, a model with bf16 parameters)
    went to f16 operands and result under a 16-bit action: 8e6 came out inf."""
    def fn(x):
        with jax.named_scope("s"):
            return jax.lax.dot_general(x, x, (((1,), (1,)), ((), ())),
                                       preferred_element_type=jnp.float32)

    x = jnp.full((4, 8), 1000.0, jnp.bfloat16)
    compiled = hlo_amp.compile(fn, policy)
    [decision] = compiled.lower(x).report().decisions
    assert not decision.changed and decision.reason == "already low precision"
    np.testing.assert_array_equal(compiled(x), jax.jit(fn)(x))


@pytest.mark.parametrize("policy", ["bf16,scope:s=bfloat16", "bf16,op:dot_general=float16",
                                    "bf16,scope:s=float32"])
def test_an_f64_dot_is_left_alone_without_f64_true_whatever_the_action(policy: str) -> None:
    def fn(x, w):
        with jax.named_scope("s"):
            return x @ w

    jax.config.update("jax_enable_x64", True)
    try:
        x, w = jnp.ones((16, 32), jnp.float64), jnp.ones((32, 8), jnp.float64)
        [decision] = hlo_amp.compile(fn, policy).lower(x, w).report().decisions
        [with_flag] = hlo_amp.compile(fn, policy + ",f64=true").lower(x, w).report().decisions
    finally:
        jax.config.update("jax_enable_x64", False)
    assert not decision.changed and "not asked: f64=true" in decision.reason
    assert with_flag.changed


def test_op_kind_absent_from_op_rules_is_left_alone() -> None:
    policy = Policy(ops={"convolution": "compute"})
    assert policy.decide(("Block_0",), "dot_general", False) == Rule(None, "default")
    assert policy.decide((), "reduce", False) == Rule(None, "default")
    assert policy.decide((), "convolution", False) == Rule("compute", "op:convolution")


def test_rule_names_list_every_rule() -> None:
    policy = Policy.parse("f32,op:dot=keep,scope:head=float32,backward=compute")
    assert policy.rule_names() == ["op:dot", "scope:head", "backward"]


# ---- amp_stop in lowered programs ----------------------------------------------------


def _lowered(fn: object, *args: jax.Array) -> str:
    return jax.jit(fn).lower(*args).as_text(debug_info=True)


def test_amp_stop_context_manager_names_the_ops_inside() -> None:
    def f(x: jax.Array, w: jax.Array) -> jax.Array:
        y = x @ w
        with hlo_amp.amp_stop():
            return y @ w

    text = _lowered(f, jnp.ones((2, 2)), jnp.ones((2, 2)))
    assert 'loc("jit(f)/amp_stop/dot_general"' in text
    assert 'loc("jit(f)/dot_general"' in text


@pytest.mark.parametrize("parentheses", [True, False])
def test_amp_stop_decorator_names_the_ops_inside(parentheses) -> None:
    """``@hlo_amp.amp_stop`` without parentheses raised "amp_stop() takes 0 positional
    arguments" (jaxamp's own took both forms)."""
    def head(x: jax.Array, w: jax.Array) -> jax.Array:
        return x @ w

    head = hlo_amp.amp_stop()(head) if parentheses else hlo_amp.amp_stop(head)

    def f(x: jax.Array, w: jax.Array) -> jax.Array:
        with jax.named_scope("Block_0"):
            return head(x, w)

    text = _lowered(f, jnp.ones((2, 2)), jnp.ones((2, 2)))
    assert 'loc("jit(f)/Block_0/amp_stop/dot_general"' in text


# ---- Policy defaults and explicit precision (issue 10, items 4 and 5) ------------------


def test_constructor_without_ops_has_the_presets_op_rules() -> None:
    built = Policy(compute_dtype="bfloat16", scopes={"head": "float32"})
    assert dict(built.ops) == ALL_COMPUTE
    assert built == Policy.parse("bf16,scope:head=float32")
    assert built == Policy.from_dict({"compute_dtype": "bfloat16", "scopes": {"head": "float32"}})
    assert dict(Policy(ops={}).ops) == {}  # explicitly none
    assert Policy(ops={}) == Policy.preset("f32")


def test_explicit_precision_item() -> None:
    policy = Policy.parse("bf16,explicit_precision=ignore")
    assert policy.explicit_precision == "ignore"
    assert Policy.parse(policy.to_string()) == policy
    assert Policy.from_dict(policy.to_dict()) == policy
    assert Policy.parse("bf16").explicit_precision == "keep"
    with pytest.raises(ValueError) as error:
        Policy.parse("bf16,explicit_precision=maybe")
    assert "Unknown explicit_precision 'maybe'; accepted: keep, ignore" in str(error.value)


# ---- fp8 (issue 11, item 2) -------------------------------------------------------------


def test_fp8_preset() -> None:
    policy = Policy.parse("fp8")
    assert policy == Policy.preset("fp8")
    assert policy.compute_dtype == "bfloat16"
    assert dict(policy.ops) == {"dot_general": "float8_e5m2", "dot": "compute",
                                "convolution": "compute", "ragged_dot": "float8_e5m2"}
    assert (policy.first_matrix_op, policy.last_matrix_op) == ("compute", "compute")
    assert policy.uses_fp8 and not Policy.parse("bf16").uses_fp8
    assert policy.to_string() == "fp8,compute=bfloat16"
    # Each preset prints under its own name (f16 printed as "bf16,compute=float16").
    for name in ("bf16", "f16", "mixed_bfloat16", "mixed_float16"):
        assert Policy.parse(name).to_string().split(",")[0] == name
    assert "first_matrix_op" in policy.rule_names() and "last_matrix_op" in policy.rule_names()
    # The fast mode by default (issue 47): 16-bit activations, as mixed_bfloat16.
    assert policy.propagate and not policy.keep_f32_results
    accurate = Policy.parse("fp8,propagate=false")
    assert not accurate.propagate and accurate != policy
    assert accurate.to_string() == "fp8,compute=bfloat16,propagate=false"
    assert Policy.parse("fp8,propagate=true") == policy


@pytest.mark.parametrize(
    "spec",
    [
        "fp8",
        "fp8,scope:attn=bfloat16",
        "fp8,first_matrix_op=none,last_matrix_op=none",
        "fp8,first_matrix_op=float32,last_matrix_op=keep",
        "fp8,compute=float16,propagate=true",
        "fp8,propagate=false",
        "fp8,propagate=false,first_matrix_op=none,scope:attn=bfloat16",
        "fp8,compute=float16,propagate=false",
        "fp8,keep_f32_results=true",
        "fp8,op:exponential=compute",
        "fp8,op:dot_general=float8_e4m3fn",
        "bf16,scope:mlp=float8_e4m3fn,scope:Block_*/attn=float8_e5m2",
        "bf16,backward=float8_e5m2,last_matrix_op=compute",
        "mixed_bfloat16,op:dot_general=e4m3fn,op:exponential=compute",
        "f32,op:dot_general=f8e5m2",
    ],
)
def test_fp8_string_and_dict_round_trips(spec: str) -> None:
    policy = Policy.parse(spec)
    assert Policy.parse(policy.to_string()) == policy
    assert Policy.from_dict(policy.to_dict()) == policy
    assert Policy.from_dict(json.loads(json.dumps(policy.to_dict()))) == policy
    assert Policy(**policy.to_dict()) == policy


def test_fp8_action_spellings() -> None:
    for spelling in ("float8_e4m3fn", "F8E4M3FN", "e4m3fn", jnp.float8_e4m3fn):
        assert Policy(ops={"dot_general": spelling}).ops["dot_general"] == "float8_e4m3fn"
    for spelling in ("float8_e5m2", "f8e5m2", "E5M2", jnp.float8_e5m2):
        assert Policy(scopes={"a": spelling}).scopes["a"] == "float8_e5m2"
    assert Policy.parse("bf16,first_matrix_op=e4m3fn").first_matrix_op == "float8_e4m3fn"


@pytest.mark.parametrize(
    ("spec", "fragment"),
    [
        ("fp8,op:dot_general=float8_e4m3", ("Unknown fp8 format 'float8_e4m3' for op rule "
                                            "'dot_general'; accepted fp8 actions: "
                                            "float8_e4m3fn, float8_e5m2")),
        ("bf16,scope:attn=fp8", ("Unknown fp8 format 'fp8' for scope rule 'attn'; accepted "
                                 "fp8 actions: float8_e4m3fn, float8_e5m2")),
        ("fp8,scope:a=float8_e4m3fnuz", "Unknown fp8 format 'float8_e4m3fnuz'"),
        ("fp8,backward=f8E3M4", "Unknown fp8 format 'f8E3M4' for backward"),
        ("fp8,last_matrix_op=e4m3", "Unknown fp8 format 'e4m3' for last_matrix_op"),
        ("fp8,first_matrix_op=fast", ("Unknown action 'fast' for first_matrix_op; accepted: "
                                      "compute, keep, bfloat16, float16, float32, float64, "
                                      "float8_e4m3fn, float8_e5m2")),
        ("bf16,compute=float8_e4m3fn", ("Unsupported compute_dtype 'float8_e4m3fn'; accepted: "
                                        "bfloat16, float16 (fp8 is an action")),
        ("mixed_bfloat16,op:add=float8_e4m3fn", ("Unsupported action 'float8_e4m3fn' for op "
                                                 "rule 'add'")),
        ("fp9", "Unknown preset 'fp9'"),
    ],
)
def test_fp8_errors_name_the_input_and_the_accepted(spec: str, fragment: str) -> None:
    with pytest.raises(ValueError) as error:
        Policy.parse(spec)
    assert fragment in str(error.value)


def test_unknown_fp8_dtype_object_is_an_error() -> None:
    with pytest.raises(ValueError, match="Unknown fp8 format .*accepted fp8 actions: "
                                         "float8_e4m3fn, float8_e5m2"):
        Policy(ops={"dot_general": jnp.float8_e4m3fnuz})


def test_first_and_last_matrix_op_rules_in_decide() -> None:
    policy = Policy.parse("fp8,scope:head=float32")
    first, last = ("first_matrix_op",), ("last_matrix_op",)
    assert policy.decide(("stem",), "dot_general", False, first) == Rule(
        "compute", "first_matrix_op")
    assert policy.decide(("stem",), "dot_general", True, first) == Rule(
        "compute", "first_matrix_op")
    assert policy.decide(("out",), "convolution", False, last) == Rule(
        "compute", "last_matrix_op")
    assert policy.decide(("mlp",), "dot_general", False) == Rule("float8_e5m2",
                                                                 "op:dot_general")
    # Scope rules and amp_stop beat them; they beat op rules; backward= beats all.
    assert policy.decide(("head",), "dot_general", False, last) == Rule("float32",
                                                                        "scope:head")
    assert policy.decide(("amp_stop",), "dot_general", False, first) == Rule("keep", "amp_stop")
    both = Policy.parse("fp8,first_matrix_op=float16,last_matrix_op=none,backward=keep")
    assert both.decide((), "dot_general", False, first + last) == Rule("float16",
                                                                        "first_matrix_op")
    assert both.decide((), "dot_general", False, last) == Rule("float8_e5m2",
                                                               "op:dot_general")
    assert both.decide((), "dot_general", True, first) == Rule("keep", "backward")


@pytest.mark.parametrize("kind", ["sort", "bitcast_convert", "custom_call", "composite"])
def test_op_rules_refuse_16bit_for_ops_read_by_their_types(kind):
    """The propagation retypes what it paints: a sort's comparator, a bitcast's bits and
    a custom call's buffers were left as written (an invalid module, an internal error;
    a LAPACK call given a bf16 buffer failed at run time). keep and float32 stay."""
    for action in ("compute", "bfloat16"):
        with pytest.raises(ValueError, match=rf"op rule '{kind}': {kind} cannot run in 16 bit"):
            Policy.parse(f"mixed_bfloat16,op:{kind}={action}")
    for action in ("keep", "float32"):
        assert Policy.parse(f"mixed_bfloat16,op:{kind}={action}").ops[kind] == action
