"""A request body the JSON parser cannot hold, or a batch too large for one request, is a 400
naming the field (adversarial finds: a 5000-digit number was a 400 naming nothing; a batch of
20,000 prompts queued 20,000 engine requests behind one HTTP request)."""

import pytest

from tests.entrypoints.openai.conftest import MODEL


@pytest.mark.parametrize("field", ["max_tokens", "seed", "n", "top_k", "priority"])
def test_a_number_too_long_for_the_json_parser_names_its_field(server, field):
    body = f'{{"model": "{MODEL}", "prompt": "hi", "{field}": {"9" * 5000}}}'
    with server.http() as h:
        r = h.post("/v1/completions", content=body, headers={"content-type": "application/json"})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == field, err
    assert len(r.text) < 2000  # the number is not echoed back


def test_a_batch_past_the_prompt_limit_is_a_400_and_at_the_limit_runs(server):
    with server.http() as h:
        r = h.post("/v1/completions", json={"model": MODEL, "prompt": ["hi"] * 1025, "max_tokens": 1})
        assert r.status_code == 400, r.text
        assert r.json()["error"]["param"] == "prompt" and "1024" in r.json()["error"]["message"]
        r = h.post("/v1/completions", json={"model": MODEL, "prompt": ["hi"] * 3, "max_tokens": 1})
        assert r.status_code == 200 and len(r.json()["choices"]) == 3, r.text


def test_a_stop_list_past_the_limit_is_a_400_naming_stop(server):
    with server.http() as h:
        r = h.post("/v1/completions", json={"model": MODEL, "prompt": "hi", "stop": ["zz"] * 65})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == "stop", r.json()
