"""Fields a request would have ignored are a 400 naming them: ``priority`` under a policy that
does not read it, ``length_penalty`` without beam search, message fields on the wrong role, a
text part without text; and the probes operators send (HEAD, ``/ping``) are answered."""

import pytest

from tests.adversarial.conftest import TINY_SERVER_KWARGS
from tests.server_harness import running_server

MSGS = [{"role": "user", "content": "Hi"}]


@pytest.fixture(scope="module")
def fcfs_server(tiny_llama_dir):
    from kvserve.config import EngineArgs

    with running_server(EngineArgs(model=str(tiny_llama_dir), **TINY_SERVER_KWARGS), "tiny") as s:
        yield s


@pytest.mark.parametrize(
    "route,body,param",
    [
        ("/v1/completions", {"prompt": "Hi", "priority": 5}, "priority"),
        ("/v1/chat/completions", {"messages": MSGS, "priority": -1}, "priority"),
        ("/v1/completions", {"prompt": "Hi", "length_penalty": 2.0}, "length_penalty"),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": "Hi", "tool_call_id": "x"}]},
            "messages[0].tool_call_id",
        ),
        (
            "/v1/chat/completions",
            {
                "messages": [
                    {
                        "role": "user",
                        "content": "Hi",
                        "tool_calls": [
                            {"id": "a", "type": "function", "function": {"name": "f", "arguments": "{}"}}
                        ],
                    }
                ]
            },
            "messages[0].tool_calls",
        ),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": [{"type": "text"}]}]},
            "messages[0].content[0].text",
        ),
    ],
    ids=["priority-cmpl", "priority-chat", "length_penalty", "tool_call_id", "tool_calls", "text-missing"],
)
def test_ignored_fields_are_a_400_naming_them(fcfs_server, route, body, param):
    with fcfs_server.http() as h:
        r = h.post(route, json={"model": "tiny", "max_tokens": 2, **body})
        plain = {"messages": MSGS} if "chat" in route else {"prompt": "Hi"}
        ok = h.post(route, json={"model": "tiny", "max_tokens": 2, "priority": 0, **plain})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param, r.json()
    assert ok.status_code == 200, ok.text  # priority 0 (the default) is accepted
    fcfs_server.wait_idle()


def test_best_of_below_n_is_a_400(fcfs_server):
    with fcfs_server.http() as h:
        body = {"model": "tiny", "prompt": "Hi", "n": 3, "best_of": 2, "max_tokens": 2}
        r = h.post("/v1/completions", json=body)
    assert r.status_code == 400 and r.json()["error"]["param"] == "best_of"
    assert ">= n (3)" in r.json()["error"]["message"]


@pytest.mark.parametrize(
    "method,path", [("HEAD", "/health"), ("HEAD", "/metrics"), ("GET", "/ping"), ("POST", "/ping")]
)
def test_probes_are_answered(fcfs_server, method, path):
    with fcfs_server.http() as h:
        r = h.request(method, path)
    assert r.status_code == 200, (method, path, r.status_code)
