"""Grammar compilation can never kill or hold the engine: constraints past a ``GrammarLimits``
bound, too deep for a thread's stack, or that can never be matched are a ValueError (a 400)
naming the field, and a matcher that fails mid-generation ends only its own request."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from kvserve import LLM, SamplingParams, StructuredOutputsParams
from kvserve.structured_output import DEFAULT_LIMITS, GrammarCompiler, GrammarLimits, check_constraint
from kvserve.structured_output.limits import (
    _longest_ref_chain,
    grammar_expansion,
    regex_repeat,
    rules_that_never_end,
)
from tests.structured_output.deep_child import deep_defs_schema, deep_json_text, deep_lark

L = DEFAULT_LIMITS
P = StructuredOutputsParams


def _chain(n: int) -> dict:
    return deep_defs_schema(n)


def _props(n: int, required: int = 0) -> dict:
    """An object of ``n + required`` integer properties, the first ``required`` of them required."""
    names = [f"p{i}" for i in range(n + required)]
    return {
        "type": "object",
        "properties": {k: {"type": "integer"} for k in names},
        "required": names[:required],
    }


def _alternatives(n: int, rule: str = "start") -> str:
    return f"{rule}: " + " | ".join(f'"w{i}"' for i in range(n))


# (constraint, text the error must contain); every error also names the field
PAST_A_LIMIT = [
    (P(json=deep_defs_schema()), f"more than {L.max_defs} (limit)"),
    # root -> d0 -> ... -> d(n): n + 1 references
    (P(json=_chain(L.max_ref_chain + 10)), f"$ref chains are {L.max_ref_chain + 11} references long"),
    (
        P(
            json={
                "type": "object",
                "properties": {"inner": _props(L.max_optional_properties + 1, required=5)},
                "required": ["inner"],
            }
        ),
        f"properties at #/properties/inner has {L.max_optional_properties + 1} optional properties",
    ),
    (P(grammar=_alternatives(L.max_alternatives + 1)), f"has {L.max_alternatives + 1} alternatives"),
    (P(grammar=_alternatives(20_000)), "grammar rule start has 20000 alternatives"),
    (P(json=deep_json_text(), origin="guided_json"), f"deeper than {L.max_json_depth} levels"),
    (P(json=json.loads(deep_json_text(L.max_json_depth))), f"deeper than {L.max_json_depth} levels"),
    (P(json={"type": "string", "description": "x" * L.max_bytes}), f"longer than {L.max_bytes} bytes"),
    (P(json={"anyOf": [{"const": i} for i in range(L.max_alternatives + 1)]}), "anyOf at # has"),
    (P(json={"enum": list(range(L.max_alternatives + 1))}), "enum at # has"),
    (P(json={"type": "integer", "minimum": 1e30}), "outside the 64-bit integer range"),
    (P(json={"type": ["integer", "null"], "maximum": -(2**63) - 1}), "outside the 64-bit integer range"),
    (P(json={"type": "integer", "exclusiveMaximum": 2**64}), "outside the 64-bit integer range"),
    (P(json='{"type": "number", "maximum": 1e999}'), "not a finite number"),
    (P(json={"type": "string", "maxLength": L.max_repeat + 1}), "maxLength at # is"),
    (P(json={"type": "array", "minItems": 10**9}), "minItems at # is"),
    (P(json={"type": "string", "pattern": "a{100000}"}), "pattern at # repeats 100000 times"),
    (P(regex="a{1000000}"), f"repeats 1000000 times, more than {L.max_repeat} (limit)"),
    (P(regex="(a{1000}){1000}"), "repeats 1000000 times"),
    (P(grammar=deep_lark()), f"more than {L.max_rules} (limit)"),
    (P(grammar='start: "x"{20000}'), "repeats 20000 times"),
    (P(grammar="start: /[0-9]{0,20000}/"), "repeats 20000 times"),
    (P(choice=[f"c{i}" for i in range(L.max_choices + 1)]), f"more than {L.max_choices} (limit)"),
    (P(choice=["a" * (L.max_choice_chars + 1)]), f"more than {L.max_choice_chars} (limit)"),
    (P(json_object=True, whitespace_pattern=" {0,99999}"), "whitespace_pattern repeats 99999"),
    (
        P(
            structural_tag=json.dumps(
                {
                    "structures": [
                        {"begin": "<f>", "schema": {"type": "integer", "maximum": 1e20}, "end": "</f>"}
                    ],
                    "triggers": ["<f>"],
                }
            )
        ),
        "structures[0].schema: maximum at # is",
    ),
]


@pytest.mark.parametrize("so, text", PAST_A_LIMIT, ids=range(len(PAST_A_LIMIT)))
def test_a_constraint_past_a_limit_is_a_value_error_naming_the_field_and_the_limit(so, text):
    with pytest.raises(ValueError) as e:
        check_constraint(so)
    message = str(e.value)
    assert message.startswith(so.field_name) and message[len(so.field_name)] in ":.", message
    assert text in message, message


@pytest.mark.parametrize(
    "so",
    [
        P(json=_chain(L.max_ref_chain - 2)),  # root + chain + the last definition: exactly the limit
        P(json=json.loads(deep_json_text(L.max_json_depth // 2 - 1))),
        # recursion (a tree) counts its group once, however often it is followed
        P(json={"type": "object", "properties": {"kids": {"type": "array", "items": {"$ref": "#"}}}}),
        P(json={"type": "number", "minimum": -1e30, "maximum": 1e30}),  # not an integer schema
        P(json={"type": "integer", "minimum": -(2**63), "maximum": 2**63 - 1}),
        P(json={"type": "string", "maxLength": L.max_repeat}),
        P(regex=r"a\{99999\}[{]{3}"),  # escaped braces and a class are not repetitions
        P(regex="(a{100}){100}"),
        P(grammar="start: \"{99999}\" | '{99999}'"),  # quoted: text, not a repetition
        P(choice=[f"c{i}" for i in range(L.max_choices)]),
        P(
            grammar="start: r0\n"
            + "".join(f'r{i}: "x" r{i + 1}\n' for i in range(L.max_rules - 2))
            + f'r{L.max_rules - 2}: "y"\n'
        ),
    ],
)
def test_a_constraint_within_the_limits_passes_the_checks(so):
    check_constraint(so)


def test_limits_are_configurable():
    tight = GrammarLimits(max_choices=2)
    with pytest.raises(ValueError, match=r"3 choices, more than 2 \(limit\)"):
        check_constraint(P(choice=["a", "b", "c"]), tight)
    check_constraint(P(choice=["a", "b"]), tight)


def test_regex_repeat_multiplies_nested_counts():
    assert regex_repeat("(a{10}){20}") == 200
    assert regex_repeat("(a{10}|b{30}){2,5}") == 150
    assert regex_repeat("x{7,}") == 7
    assert regex_repeat(r"[a{99}]\d{3}") == 3
    assert regex_repeat("a*b+c?") == 1


def test_ref_chain_counts_each_recursive_group_once():
    # a -> b -> c, c <-> d (a group of 2): 2 + 2 = 4 on the longest path from a
    edges = {"a": {"b"}, "b": {"c"}, "c": {"d"}, "d": {"c"}}
    assert _longest_ref_chain(edges) == 5 - 1
    assert _longest_ref_chain({"x": {"x"}}) == 1
    assert _longest_ref_chain({"r": set()}) == 1


def test_ref_chain_counts_references():
    check_constraint(P(json=_chain(L.max_ref_chain - 1)))  # exactly max_ref_chain references
    with pytest.raises(ValueError, match=f"chains are {L.max_ref_chain + 1} references long"):
        check_constraint(P(json=_chain(L.max_ref_chain)))


NEVER_ENDS = [
    # a required property that is the definition again
    {
        "$ref": "#/$defs/n",
        "$defs": {"n": {"type": "object", "properties": {"c": {"$ref": "#/$defs/n"}}, "required": ["c"]}},
    },
    {"type": "object", "properties": {"c": {"$ref": "#"}}, "required": ["c"]},
    # through a non-empty array, an allOf, both anyOf alternatives, and two definitions
    {"type": "array", "minItems": 1, "items": {"allOf": [{"$ref": "#"}]}},
    {
        "anyOf": [{"$ref": "#/$defs/a"}, {"type": "array", "prefixItems": [{"$ref": "#"}], "minItems": 1}],
        "$defs": {
            "a": {"type": "object", "properties": {"b": {"$ref": "#/$defs/b"}}, "required": ["b"]},
            "b": {"oneOf": [{"$ref": "#/$defs/a"}]},
        },
    },
    # an optional property that enters a definition which never ends
    {
        "type": "object",
        "properties": {"x": {"$ref": "#/definitions/a"}},
        "definitions": {
            "a": {"type": "object", "properties": {"a": {"$ref": "#/definitions/a"}}, "required": ["a"]}
        },
    },
]
ENDS = [
    {"type": "object", "properties": {"c": {"$ref": "#"}}},  # c optional
    {"type": "object", "properties": {"c": {"anyOf": [{"type": "null"}, {"$ref": "#"}]}}, "required": ["c"]},
    {"type": "object", "properties": {"c": {"type": "array", "items": {"$ref": "#"}}}, "required": ["c"]},
    {"anyOf": [True, {"$ref": "#"}]},
    {"type": "object", "properties": {"c": {"not": {"$ref": "#"}}}, "required": ["c"]},
]


@pytest.mark.parametrize("schema", NEVER_ENDS, ids=range(len(NEVER_ENDS)))
def test_a_required_ref_cycle_can_never_be_matched(schema):
    with pytest.raises(ValueError, match=r"^structured_outputs.json: .*can never be matched"):
        check_constraint(P(json=schema))


@pytest.mark.parametrize("schema", ENDS, ids=range(len(ENDS)))
def test_a_ref_cycle_with_a_way_out_passes(schema):
    check_constraint(P(json=schema))


def _fan_out(n: int, prefix: str = "") -> str:
    return f"start: {prefix}r0\n" + "".join(f"r{i}: r{i + 1} r{i + 1}\n" for i in range(n)) + f'r{n}: "a"'


def test_grammar_expansion_follows_references():
    assert grammar_expansion('start: b{100}\nb: c{100}\nc: "a"{100}') == 10**6
    assert grammar_expansion(_fan_out(10)) == 2**10
    assert grammar_expansion('start: "a" ~ 3..5 "b"{2,4} | "c"') == 9
    # recursion and unbounded repetition are not fixed expansions
    assert grammar_expansion('start: a\na: "x" a | "y"') == 2
    assert grammar_expansion('start: "x"* "y"+ "z"{7,}') == 9
    assert grammar_expansion('start: "a"\n%regex {}') == 0  # syntax not modelled


# past the repetition limit only across rules, behind a first token (so the first-token check
# would not see it)
ACROSS_RULES = [
    P(grammar='start: ("q" | "z") b{100}\nb: c{100}\nc: "a"{100}'),
    P(grammar=_fan_out(60, '("q" | "z") ')),
    P(grammar='root ::= "q" b{100}\nb ::= c{101}\nc ::= "a"', origin="guided_grammar"),
]


@pytest.mark.parametrize("so", ACROSS_RULES, ids=range(len(ACROSS_RULES)))
def test_repetition_across_rules_past_the_limit_is_a_value_error(compiler, so):
    with pytest.raises(ValueError) as e:
        compiler.compile(so)
    message = str(e.value)
    assert message.startswith(so.field_name + ":") and f"more than {L.max_repeat} (limit)" in message, message
    assert "across its rules" in message, message


def test_rules_that_never_end():
    assert rules_that_never_end('start: a\na: "x" a') == ["a", "start"]
    assert rules_that_never_end('start: a | "y"\na: "x" a') == ["a"]
    assert rules_that_never_end('start: x*\nx: "(" x ")"') == ["x"]
    assert rules_that_never_end('start: "(" start ")" | N\nN: /[0-9]+/') == []
    assert rules_that_never_end('start: x{1,3}\nx: "(" x ")" | "q"') == []
    # an unused rule that never ends is not reachable from start: not reported
    assert rules_that_never_end('start: "a"\nu: "x" u') == []
    # syntax the analysis does not model: nothing is reported
    assert rules_that_never_end('start: a\na: "x" a\n%regex {}') == []


# ---------------------------------------------------------------- the compiler (llguidance)
@pytest.fixture(scope="module")
def compiler(default_tokenizer_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(default_tokenizer_dir)
    c = GrammarCompiler(tok, len(tok), tok.eos_token_id)
    c.warm_up().join()
    return c


NEVER_MATCHED = [
    P(regex=r"[^\s\S]"),
    P(regex=r"a[^\s\S]"),
    P(regex=r"x{0}[^\s\S]", origin="guided_regex"),
    P(json={"$ref": "#/$defs/a", "$defs": {"a": {"$ref": "#/$defs/a"}}}),
    P(
        json={
            "$ref": "#/$defs/a",
            "$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"allOf": [{"$ref": "#/$defs/a"}]}},
        }
    ),
    P(grammar='start: a\na: "x" a'),
    P(grammar='root ::= a\na ::= "x" a', origin="guided_grammar"),
]


@pytest.mark.parametrize("so", NEVER_MATCHED, ids=range(len(NEVER_MATCHED)))
def test_a_constraint_that_can_never_be_matched_is_a_value_error_naming_the_field(compiler, so):
    with pytest.raises(ValueError) as e:
        compiler.compile(so)
    message = str(e.value)
    assert message.startswith(so.field_name + ":") and "can never be matched" in message, message
    assert "<" not in message and "state" not in message.lower(), message  # no parser internals


# within every pre-check limit, but past llguidance's parser limits once the first token is consumed
PAST_THE_PARSER_LIMITS = [
    P(json=_props(L.max_optional_properties + 100), origin="guided_json"),
    P(grammar=_fan_out(60)),
    P(grammar='start: b{100}\nb: c{100}\nc: "a"{100}'),
    P(
        grammar="start: a | b\n"
        + _alternatives(1000, "a")
        + "\n"
        + _alternatives(1000, "b").replace("w", "v")
    ),
]


@pytest.mark.parametrize("so", PAST_THE_PARSER_LIMITS, ids=range(len(PAST_THE_PARSER_LIMITS)))
def test_past_the_parser_limits_at_the_first_token_is_a_value_error(compiler, so):
    relaxed = GrammarCompiler(
        compiler._hf_tokenizer,
        compiler.vocab_size,
        compiler.eos_token_id,
        limits=GrammarLimits(max_optional_properties=10_000, max_repeat=10**30),
    )
    with pytest.raises(ValueError) as e:
        relaxed.compile(so)
    message = str(e.value)
    assert message.startswith(so.field_name + ":") and "limits at its first token" in message, message
    assert "<" not in message, message


def test_many_properties_within_the_limit_compile_and_walk(compiler):
    # the most optional properties allowed, plus required ones: every property can be emitted
    schema = _props(L.max_optional_properties, required=200)
    m = compiler.new_matcher(P(json=schema))
    tok = compiler._hf_tokenizer
    text = json.dumps({k: i for i, k in enumerate(schema["properties"])}, separators=(",", ":"))
    for t in tok.encode(text, add_special_tokens=False):
        assert m.consume_token(t) and not m.is_error(), m.get_error()
    assert m.is_accepting()


def test_compile_errors_carry_no_parser_state(compiler):
    with pytest.raises(ValueError) as e:
        compiler.compile(P(regex="(a"))
    assert "unclosed group" in str(e.value) and "<state>" not in str(e.value)


def test_a_constraint_whose_language_is_empty_output_still_compiles(compiler):
    # accepting at once (only EOS allowed) is matchable: the output is empty
    m = compiler.new_matcher(P(regex="a{0}b{0}"))
    assert m.is_accepting() and not m.is_error()


def test_a_compile_past_the_timeout_is_a_value_error_and_the_caller_does_not_wait(compiler, monkeypatch):
    import threading

    release = threading.Event()
    real = GrammarCompiler._compile_now

    def slow(self, params):
        release.wait(30)
        return real(self, params)

    c = GrammarCompiler(
        compiler._hf_tokenizer, compiler.vocab_size, compiler.eos_token_id, compile_timeout_s=0.2
    )
    monkeypatch.setattr(GrammarCompiler, "_compile_now", slow)
    try:
        with pytest.raises(
            ValueError,
            match=r"structured_outputs.regex: compiling the regex constraint took longer than 0.2 s",
        ):
            c.compile(P(regex="[a-c]{2}"))
        assert c.num_compiled == 0
    finally:
        release.set()


def test_compiles_run_on_a_large_stack_thread(compiler, monkeypatch):
    import threading

    seen = {}
    real = GrammarCompiler._compile_now

    def spy(self, params):
        seen["thread"] = threading.current_thread()
        seen["stack"] = threading.stack_size()
        return real(self, params)

    before = threading.stack_size()
    monkeypatch.setattr(GrammarCompiler, "_compile_now", spy)
    compiler.compile(P(regex="[a-c]{3,4}q"))
    assert seen["thread"] is not threading.current_thread()
    assert seen["thread"].name == "kvserve-grammar-compile"
    assert threading.stack_size() == before  # restored for every other thread


# ---------------------------------------------------------------- the deep shapes, in a child
@pytest.fixture(scope="module")
def deep(tiny_llama_dir):
    """The child's results (``deep_child.py``); a crash there fails these tests, not pytest."""
    root = Path(__file__).resolve().parents[2]
    env = dict(os.environ, PYTHONPATH=str(root))
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "tests.structured_output.deep_child",
            str(tiny_llama_dir),
        ],
        cwd=root,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, f"child exited {proc.returncode}:\n{proc.stderr[-3000:]}"
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_the_compiler_survives_deep_grammars_even_without_the_checks(deep):
    # compiled on the large-stack thread: they compile (no crash) even past every limit; the
    # chains (items of every level in one parser row) then fail the first-token check, as a
    # ValueError
    for shape in ("unchecked_defs", "unchecked_lark"):
        outcome = deep[shape]
        assert not outcome["ok"] and "limits at its first token" in outcome["error"], outcome


def test_deep_constraints_offline_are_value_errors_and_the_engine_serves_on(deep):
    assert not deep["offline_defs"]["ok"] and "structured_outputs.json:" in deep["offline_defs"]["error"]
    assert not deep["offline_lark"]["ok"] and "structured_outputs.grammar:" in deep["offline_lark"]["error"]
    assert not deep["offline_json_text"]["ok"] and "nests deeper" in deep["offline_json_text"]["error"]
    after = deep["offline_after"]
    assert after["ok"] and after["value"] and set(after["value"]) == {"z"}


def test_deep_constraints_over_http_are_400_naming_the_field(deep):
    for name, param in (
        ("defs", "response_format"),
        ("lark", "guided_grammar"),
        ("json_text", "guided_json"),
    ):
        got = deep[f"server_{name}"]
        assert got["status"] == 400 and got["error"]["param"] == param, (name, got)
        assert "deep" in got["error"]["message"] or "(limit)" in got["error"]["message"], got
    assert deep["server_after"]["status"] == 200 and set(deep["server_after"]["text"]) == {"z"}


def test_the_tokenizer_view_is_built_at_start_not_by_the_first_request(deep):
    assert deep["tokenizer_thread"] == "kvserve-grammar-warmup"


# ---------------------------------------------------------------- the engine
@pytest.fixture(scope="module")
def llm(tiny_llama_dir):
    return LLM(model=str(tiny_llama_dir), device="cpu", dtype="float32", num_gpu_blocks=64, seed=0)


@pytest.mark.parametrize(
    "so",
    [
        P(regex=r"[^\s\S]"),
        P(json={"type": "integer", "minimum": 1e30, "maximum": 1e31}),
        P(regex="a{1000000}"),
    ],
    ids=["empty", "int64", "repeat"],
)
def test_offline_bad_constraint_is_a_value_error_and_nothing_is_left(llm, so):
    with pytest.raises(ValueError, match=r"^structured_outputs\.(regex|json): "):
        llm.generate(["x"], SamplingParams(max_tokens=4, structured_outputs=so))
    eng = llm.llm_engine
    assert eng.structured_output.num_live == 0 and not eng.scheduler.waiting and not eng.scheduler.running


def _no_bisection(monkeypatch):
    import kvserve.engine.llm_engine as mod

    def fail(*a, **k):
        raise AssertionError("the batch was re-run in halves")

    monkeypatch.setattr(mod, "bisect_failures", fail)


def test_a_matcher_that_fails_mid_generation_ends_only_its_request(llm, monkeypatch):
    """A choice list past the grammar engine's row limit (the pre-check and the compile-time
    first-token check relaxed to let it through) fails when its first token is appended: that
    request ends ``failed`` with a clean reason; the other request in the batch is untouched and
    nothing is bisected."""
    import kvserve.structured_output.compiler as compiler_module

    _no_bisection(monkeypatch)
    eng = llm.llm_engine
    compiler = eng.structured_output.compiler
    monkeypatch.setattr(compiler, "limits", GrammarLimits(max_choices=10**4))
    monkeypatch.setattr(compiler_module, "FIRST_TOKENS_PROBED", 0)
    many = SamplingParams(max_tokens=4, structured_outputs=P(choice=[f"c{i}" for i in range(5000)]))
    plain = SamplingParams(max_tokens=4, temperature=0)
    eng.add_request("many", "x", many)
    eng.add_request("plain", "x", plain)
    finals = {}
    while eng.has_unfinished_requests():
        for out in eng.step():
            if out.finished:
                finals[out.request_id] = out
    assert finals["many"].outcome == "failed", finals["many"]
    error = finals["many"].error
    assert error.startswith("request many failed: its grammar does not allow token"), error
    assert "<" not in error and "internal" not in error, error
    assert finals["plain"].outcome == "finished" and len(finals["plain"].outputs[0].token_ids) == 4
    assert eng.structured_output.num_live == 0


def test_a_matcher_in_an_error_state_at_the_mask_fill_ends_only_its_request(llm, monkeypatch):
    """A matcher that is in an error state when the step fills its mask (forced here) ends its
    group after the step without re-running the batch; a constrained neighbour finishes."""
    _no_bisection(monkeypatch)
    eng = llm.llm_engine
    so = P(regex="[a-c]{3}")
    eng.add_request("broken", "x", SamplingParams(max_tokens=4, structured_outputs=so))
    eng.add_request("fine", "x", SamplingParams(max_tokens=4, structured_outputs=so))
    seq = eng._groups["broken"].get_seqs()[0]
    matcher = eng.structured_output._matchers[seq.seq_id]
    # EOS before the grammar accepts: the matcher enters its error state
    assert not matcher.consume_token(eng.eos_token_id) and matcher.is_error()
    finals = {}
    while eng.has_unfinished_requests():
        for out in eng.step():
            if out.finished:
                finals[out.request_id] = out
    assert finals["broken"].outcome == "failed"
    assert finals["broken"].error.startswith("request broken failed: its grammar matcher failed")
    assert finals["fine"].outcome == "finished"
    assert len(finals["fine"].outputs[0].text) == 3 and set(finals["fine"].outputs[0].text) <= set("abc")


# ---------------------------------------------------------------- data parallelism
class _Remote:
    def __init__(self, fn):
        self.fn = fn
        self.calls = 0

    def remote(self, *args):
        self.calls += 1

        async def call():
            return self.fn(*args)

        return call()


class _Replica:
    def __init__(self, fn):
        self.compile_constraint = _Remote(fn)


class _Front:
    """A front engine whose grammar compiler must never be touched."""

    @property
    def structured_output(self):
        raise AssertionError("the front process ran the grammar compiler")


def test_data_parallel_front_has_a_replica_compile_and_never_compiles_itself():
    import asyncio

    ray = pytest.importorskip("ray")
    from kvserve.distributed.dp_engine import DataParallelAsyncEngine
    from kvserve.entrypoints.openai.serving_engine import APIError, OpenAIServing

    def dead(so):
        raise ray.exceptions.RayActorError()

    def refuses(so):
        raise ray.exceptions.RayTaskError(
            "compile_constraint", "", ValueError(f"{so.field_name}: nope (limit).")
        )

    def accepts(so):
        return None

    so = P(regex="[^\\s\\S]", origin="guided_regex")
    replicas = [_Replica(dead), _Replica(refuses)]
    dp = DataParallelAsyncEngine(_Front(), replicas, [{"pid": 1, "node": "n"}] * 2, router=None)
    serving = OpenAIServing(dp, ["m"], models=object())
    with pytest.raises(APIError) as e:
        asyncio.run(serving.compile_constraint(so))
    assert e.value.status == 400 and e.value.param == "guided_regex", vars(e.value)
    # the dead replica was passed over; the next one answered
    assert [r.compile_constraint.calls for r in replicas] == [1, 1]
    replicas[1].compile_constraint.fn = accepts
    asyncio.run(serving.compile_constraint(so))
    assert replicas[1].compile_constraint.calls == 2
