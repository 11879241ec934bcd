"""No request can kill the server or hold its engine: one server (tiny random Llama, 64 KV
blocks of 8 tokens) takes every known attack shape at once (``attacks.ATTACKS``: the deep and
unmatchable constraints, extreme fields, the heavy-but-legal requests at their caps,
disconnects and aborts, bad LoRA names) plus a hypothesis-drawn batch of random bodies, while
four greedy neighbour streams run over and over and a poller asks ``/health`` every 0.2 s.

The server runs in a child process (``storm_child.py``), so a request that crashes it fails
these tests instead of killing pytest."""

import re

import pytest

from kvserve.entrypoints.openai.errors import error_type
from tests.adversarial_e2e.attacks import (
    ATTACKS,
    CRASH_CLASS,
    LOGPROB_PROMPTS,
    MAX_NUM_SEQS,
    MAX_REQUEST_SEQUENCES,
    NEIGHBOUR_PROMPTS,
    SERVER_KWARGS,
)
from tests.adversarial_e2e.conftest import NUM_RANDOM_BODIES, require_alive
from tests.adversarial_e2e.storm import HEALTH_LATENCY_BOUND_S, neighbour_problems


@pytest.fixture(scope="module")
def run(single_run):
    return require_alive(single_run)


@pytest.fixture(scope="module")
def storm(run):
    return run["server"]


def _by_name(storm) -> dict:
    return {r["name"]: r for r in storm["attacks"]}


def test_no_request_killed_the_process(single_run):
    run = require_alive(single_run)  # a crash is a non-zero exit status
    storm = run["server"]
    assert storm["server_thread_alive"]
    # it still answers after the storm, with the same greedy outputs as before it
    assert storm["after"] == storm["solo"]
    assert all(r["status"] == 200 and r["finish_reason"] == "length" for r in storm["after"].values())


def test_every_attack_shape_got_its_answer(storm):
    assert [r["name"] for r in storm["attacks"]] == [a.name for a in ATTACKS]
    assert {a.name for a in CRASH_CLASS} <= set(_by_name(storm))
    assert [(r["name"], r["problem"]) for r in storm["attacks"] if r["problem"]] == []


def test_no_5xx_and_every_rejection_names_its_field(storm):
    assert storm["counts"]["5xx"] == 0, storm["counts"]
    for a, r in zip(ATTACKS, storm["attacks"]):
        if a.status >= 400:
            assert r["status"] == a.status and r["param"] == a.param, (a.name, r)
            assert r["type"] == error_type(r["status"]), (a.name, r)
            assert re.search(rf"(?<![A-Za-z_]){re.escape(a.param)}(?![A-Za-z_])", r["message"]), (a.name, r)
            assert r["body_bytes"] < 4096, (a.name, r["body_bytes"])


def test_random_bodies_never_5xx(storm):
    raw = storm["raw"]
    assert len(raw) == NUM_RANDOM_BODIES
    assert [r["problem"] for r in raw if r["problem"]] == []
    assert {r["route"] for r in raw} == {"/v1/completions", "/v1/chat/completions"}
    assert any(400 <= r["status"] < 500 for r in raw) and any(r["status"] == 200 for r in raw)


def test_heavy_legal_requests_did_their_work(storm, run):
    got = _by_name(storm)
    logprobs = got[f"prompt_logprobs 20 on {LOGPROB_PROMPTS} long prompts"]
    assert logprobs["prompt_logprob_rows"] == run["long_prompt_lens"]
    widest = got[
        f"{MAX_REQUEST_SEQUENCES // MAX_NUM_SEQS} prompts x n {MAX_NUM_SEQS} ({MAX_REQUEST_SEQUENCES} sequences)"
    ]
    assert widest["num_choices"] == MAX_REQUEST_SEQUENCES
    assert set(widest["finish_reasons"]) <= {"length", "stop"}
    for name in ("length_penalty +f32 max, beam", "length_penalty -f32 max, beam", "best_of 10, beam"):
        assert got[name]["num_choices"] == 1 and got[name]["finish_reasons"][0] in ("length", "stop"), got[
            name
        ]
    for name in ("disconnect after the first chunk", "disconnect after the first chat chunk"):
        assert got[name]["status"] == 200 and got[name]["first_chunk"] is True, got[name]


def test_neighbours_got_their_solo_outputs_throughout(storm, run):
    assert set(storm["neighbours"]) == set(NEIGHBOUR_PROMPTS)
    assert neighbour_problems(storm["neighbours"], storm["solo"]) == []
    # the server's solo streams are the offline API's greedy outputs
    assert [storm["solo"][p]["text"] for p in NEIGHBOUR_PROMPTS] == run["offline"]["before"]


def test_health_answered_throughout(storm, capsys):
    health = storm["health"]
    with capsys.disabled():
        print(
            f"\nstorm: {storm['seconds']:.1f} s, {storm['counts']}, /health max latency "
            f"{health['max_latency_s']:.3f} s over {health['polls']} polls"
        )
    assert health["failures"] == []
    assert health["polls"] >= 1 and health["max_latency_s"] < HEALTH_LATENCY_BOUND_S


def test_nothing_is_left_after_the_storm(storm):
    state = storm["state"]
    assert (state["waiting"], state["running"], state["swapped"], state["unfinished"]) == (0, 0, 0, 0)
    assert state["free_gpu_blocks"] == state["gpu_blocks"] == SERVER_KWARGS["num_gpu_blocks"]
    assert state["free_cpu_blocks"] == state["cpu_blocks"] == SERVER_KWARGS["num_cpu_blocks"]
    assert state["live_matchers"] == 0
    assert storm["errors_logged"] == []


def test_every_engine_request_ended_finished_or_aborted(storm):
    reasons = storm["finished_by_reason"]
    assert set(reasons) <= {"length", "stop", "abort"}, reasons  # none failed
    # the two streams whose clients left after the first chunk (and the client that gave up,
    # unless its answer came first)
    assert 2 <= reasons.get("abort", 0) <= 3, reasons


def test_constrained_steps_do_not_import_torch_dynamo(storm):
    """The first constrained step once imported llguidance.torch on the grammar thread, whose
    torch.compile kernel imports torch._dynamo: seconds during which that step waited for its
    masks and every running request was held. The storm's constrained requests (the ones at
    the limits) have run; nothing of the serving path imports it."""
    got = _by_name(storm)
    assert got["anyOf of 1000"]["status"] == 200 and got["anyOf of 1000"]["num_choices"] == 1
    assert not storm["dynamo_imported"]
