"""kvserve's answers have the shapes of vLLM's: the suite of ``record_responses.py`` run against
kvserve's server (tiny model), each response's skeleton compared with the one recorded from a
real vLLM (``tests/data/vllm_skeletons.json``, its ``source`` names the version and model).

Every key vLLM returns must be in kvserve's answer with the same JSON type, statuses must match,
and errors must carry vLLM's ``type`` (and ``param`` where vLLM names one). Where kvserve
differs on purpose, ``ALLOWED`` names the difference and the documented reason; an entry that
no longer matches a difference fails the test too, so the list cannot go stale."""

import fnmatch
import importlib.util
import json
from pathlib import Path

import pytest

from kvserve.entrypoints.vllm_compat import RESPONSE_DIFFERENCES
from tests.server_harness import running_server

REPO = Path(__file__).resolve().parents[3]
RECORDED = REPO / "tests" / "data" / "vllm_skeletons.json"
MODEL = "default"

#: Values the model's output decides (a stop string matched or not, a constrained answer cut
#: short): their type may differ between vLLM's model and the tiny one, null against a value.
OUTPUT_DEPENDENT = ("*.stop_reason", "*.finish_reason")

#: (case pattern, difference) -> the entry of ``vllm_compat.RESPONSE_DIFFERENCES`` (shown in
#: docs/coming_from_vllm.md) that says why kvserve differs there on purpose. A difference is
#: ``status``, ``extra <path>``, ``type <path>``, ``error.type`` or ``error.param``.
ALLOWED: dict[tuple[str, str], str] = {
    ("bad_*", "type .error.code"): "error_code",
    ("bad_unknown_field", "status"): "unknown_field",
    ("bad_json", "error.type"): "validation_error",
    ("bad_json", "error.param"): "validation_error",
    ("bad_missing_messages", "error.type"): "validation_error",
    ("bad_missing_messages", "error.param"): "validation_error",
    ("bad_chat_top_logprobs_too_large", "error.param"): "top_logprobs_param",
    ("chat_*", "extra .choices[].message.reasoning_content"): "reasoning_content",
    ("chat_*", "extra .choices[].message.tool_calls"): "tool_calls_null",
    ("chat_tools_*", "type .choices[].message.content"): "tool_call_content",
    ("health", "type "): "health_body",
    ("health", "extra .status"): "health_body",
    ("models", "extra .data[].generation_defaults"): "model_card",
    ("models", "extra .data[].task"): "model_card",
}


def _load_recorder():
    path = REPO / "benchmarks" / "vllm_cpu" / "record_responses.py"
    spec = importlib.util.spec_from_file_location("record_responses", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


rr = _load_recorder()


def _types(s: dict) -> set[str]:
    return set(s["type"].split("|"))


def _compare(want: dict | None, got: dict | None, path: str, diffs: list[str], allow_extra=frozenset()):
    """Append the differences of skeleton ``got`` from ``want`` under ``path``."""
    if want is None:
        return
    if got is None:
        diffs.append(f"missing {path}")
        return
    wt, gt = _types(want), _types(got)
    if any(fnmatch.fnmatch(path, p) for p in OUTPUT_DEPENDENT):
        wt, gt = wt - {"null"}, gt - {"null"}
        if not (wt and gt):  # null on one side: the output decided
            wt = gt
    if wt != gt:
        diffs.append(f"type {path}")
    wk, gk = want.get("keys", {}), got.get("keys", {})
    for key, sub in wk.items():
        _compare(sub, gk.get(key), f"{path}.{key}", diffs, allow_extra)
    for key in gk:
        if key not in wk and f"{path}.{key}" not in allow_extra:
            diffs.append(f"extra {path}.{key}")
    if "items" in want:
        _compare(want["items"], got.get("items"), f"{path}[]", diffs, allow_extra)
    if "values" in want:
        _compare(want["values"], got.get("values"), f"{path}{{}}", diffs, allow_extra)


def _paths(s: dict | None, path: str, out: set[str]) -> set[str]:
    if s is None:
        return out
    out.add(path)
    for key, sub in s.get("keys", {}).items():
        _paths(sub, f"{path}.{key}", out)
    if "items" in s:
        _paths(s["items"], f"{path}[]", out)
    if "values" in s:
        _paths(s["values"], f"{path}{{}}", out)
    return out


def differences(want: dict, got: dict) -> list[str]:
    """How response skeleton ``got`` (kvserve) differs from ``want`` (vLLM)."""
    diffs: list[str] = []
    if want["status"] != got["status"]:
        return ["status"]  # a different answer altogether: its body is not compared
    if "stream" in want:
        ws, gs = want["stream"], got.get("stream")
        if gs is None:
            return ["not a stream"]
        for flag in ("ends_with_done", "usage_in_last_only", "num_chunks_nonzero"):
            if ws.get(flag) != gs.get(flag):
                diffs.append(f"stream {flag}")
        # kvserve sends every key of the stream in each chunk; vLLM leaves some out of some
        anywhere = frozenset(_paths(ws.get("any"), "", set()))
        for part in ("first", "middle", "last"):
            _compare(ws.get(part), gs.get(part), "", diffs, anywhere)
        return [f"{d} (stream)" for d in diffs]
    want_body, got_body = want["body"], got["body"]
    if "error" in want:
        # param is compared by value below (vLLM's is null where it names no field, and
        # kvserve may name one there)
        for s in (want_body, got_body):
            s.get("keys", {}).get("error", {}).get("keys", {}).pop("param", None)
        werr, gerr = want["error"], got.get("error") or {}
        if werr["type"] != gerr.get("type"):
            diffs.append("error.type")
        if werr["param"] is not None and werr["param"] != gerr.get("param"):
            diffs.append("error.param")
    _compare(want_body, got_body, "", diffs)
    return diffs


def _allowed(case: str, diff: str) -> tuple[str, str] | None:
    for key in ALLOWED:
        pattern, what = key
        if fnmatch.fnmatch(case, pattern) and (diff == what or diff == f"{what} (stream)"):
            return key
    return None


@pytest.fixture(scope="module")
def tiny_server(tiny_llama_dir):
    from kvserve.config import EngineArgs

    args = EngineArgs(model=str(tiny_llama_dir), max_model_len=256, seed=0, num_gpu_blocks=128, block_size=8)
    with running_server(args, MODEL) as s:
        yield s


@pytest.fixture(scope="module")
def kvserve_skeletons(tiny_server):
    return rr.record(tiny_server.url, MODEL)


def test_every_vllm_shape_holds_in_kvserve(kvserve_skeletons):
    recorded = json.loads(RECORDED.read_text())
    assert set(recorded["cases"]) == set(rr.SUITE), "re-record: the suite changed"
    unexplained, used = [], set()
    for case, want in recorded["cases"].items():
        got = json.loads(json.dumps(kvserve_skeletons[case]))
        for diff in differences(json.loads(json.dumps(want)), got):
            key = _allowed(case, diff)
            if key is None:
                unexplained.append(f"{case}: {diff}")
            else:
                used.add(key)
    assert not unexplained, "kvserve differs from vLLM:\n" + "\n".join(unexplained)
    assert set(ALLOWED) - used == set(), f"allowed differences no longer seen: {set(ALLOWED) - used}"
    # every difference the docs list is one the suite sees (the stream's extra keys are
    # allowed by the rule in ``differences``, and shown below)
    assert set(ALLOWED.values()) | {"stream_keys"} == set(RESPONSE_DIFFERENCES)


def test_errors_carry_vllm_types(kvserve_skeletons):
    """The values themselves, for the cases vLLM answers with an error."""
    got = kvserve_skeletons
    assert got["bad_temperature"]["error"] == {
        "type": "BadRequestError",
        "param": "temperature",
        "code": "invalid_value",
    }
    assert got["bad_unknown_model"]["status"] == 404
    assert got["bad_unknown_model"]["error"]["type"] == "NotFoundError"
    assert got["bad_max_tokens_over_context"]["error"]["param"] == "max_tokens"
    assert got["bad_unknown_field"]["error"]["param"] == "no_such_field"


def test_streams_end_with_done_and_usage_last(kvserve_skeletons):
    s = kvserve_skeletons["chat_stream_usage"]["stream"]
    assert s["ends_with_done"] and s["usage_in_last_only"]
    last = s["last"]["keys"]
    assert last["choices"]["items"] is None  # the usage chunk has no choices
    first_choice = s["first"]["keys"]["choices"]["items"]["keys"]
    assert first_choice["finish_reason"]["type"] == "null" and first_choice["logprobs"]["type"] == "null"
    # every chunk carries the stream's keys (vLLM: system_fingerprint in the last one only)
    assert all(
        s[part]["keys"]["system_fingerprint"]["type"] == "string" for part in ("first", "middle", "last")
    )


def test_comparison_finds_a_missing_key_and_a_wrong_type():
    want = rr.response_skeleton(200, "application/json", '{"a": {"b": 1, "c": "x"}, "d": [1.5]}')
    got = rr.response_skeleton(200, "application/json", '{"a": {"b": "1"}, "d": [1.5], "e": null}')
    assert sorted(differences(want, got)) == ["extra .e", "missing .a.c", "type .a.b"]
    assert differences(want, rr.response_skeleton(400, "application/json", "{}")) == ["status"]


def test_stream_skeleton_reads_chunks_and_done():
    text = (
        'data: {"choices": [{"index": 0, "text": "a"}]}\n\n'
        'data: {"choices": [{"index": 0, "text": "b"}]}\n\n'
        'data: {"choices": [], "usage": {"total_tokens": 3}}\n\ndata: [DONE]\n\n'
    )
    s = rr.response_skeleton(200, "text/event-stream; charset=utf-8", text)["stream"]
    assert s["ends_with_done"] and s["usage_in_last_only"]
    assert s["middle"]["keys"]["choices"]["items"]["keys"]["text"] == {"type": "string"}
    assert s["last"]["keys"]["usage"]["keys"] == {"total_tokens": {"type": "integer"}}


def test_echo_with_logprobs_also_fills_prompt_logprobs(tiny_server):
    """As vLLM does: each prompt position's entry holds the prompt token's own logprob, the
    one the echoed ``token_logprobs`` show (the first position: null in both)."""
    body = {
        "model": MODEL,
        "prompt": rr.PROMPT,
        "max_tokens": 2,
        "echo": True,
        "logprobs": 1,
        "temperature": 0,
    }
    with tiny_server.http() as h:
        choice = h.post("/v1/completions", json=body).json()["choices"][0]
        ids = h.post("/tokenize", json={"model": MODEL, "prompt": rr.PROMPT}).json()["tokens"]
    prompt_lps, echoed = choice["prompt_logprobs"], choice["logprobs"]["token_logprobs"]
    assert len(prompt_lps) == len(ids) and prompt_lps[0] is None and echoed[0] is None
    for i, tid in enumerate(ids[1:], start=1):
        assert prompt_lps[i][str(tid)]["logprob"] == pytest.approx(echoed[i], abs=1e-5)
