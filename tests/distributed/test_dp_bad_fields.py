"""Bad request fields through the ``--data-parallel-size 2`` endpoint get the same status,
``param`` and ``code`` as from one engine (checked on the engine side or in the replica), and
neither endpoint is left with a request or a block in use."""

import pytest

from tests.distributed.test_dp_server import API_KEY, MODEL, _engine_args, _wait_idle
from tests.server_harness import running_server

pytestmark = pytest.mark.slow

BAD = [
    {"prompt": [[10**9]], "max_tokens": 2},
    {"prompt": [[]], "max_tokens": 2},
    {"prompt": "hi", "max_tokens": 2, "logprobs": 21},
    {"prompt": "hi", "max_tokens": 2, "seed": 2**70},
    {"prompt": "hi", "max_tokens": 2, "min_tokens": 5},
    {"prompt": "hi", "max_tokens": 2, "top_k": 10**7},
    {"prompt": "hi", "max_tokens": 300},
    {"prompt": "hi", "max_tokens": 2, "n": 3, "best_of": 2},
    {"prompt": "hi", "max_tokens": 2, "structured_outputs": {"regex": "("}},
    {"prompt": "hi", "max_tokens": 2, "guided_regex": "[^\\s\\S]"},
    {"prompt": "hi", "max_tokens": 2, "guided_json": {"type": "integer", "maximum": 1e30}},
    {"prompt": "hi", "max_tokens": 2, "stop": [""] * 3},
    {"prompt": "hi", "max_tokens": 2, "model": "no-such-adapter"},
    {"prompt": "hi", "max_tokens": 2, "stream": True, "temperature": 1e39},
    {"prompt": "hi", "max_tokens": "two"},
]


def _answers(server):
    out = []
    with server.http() as h:
        for body in BAD:
            r = h.post("/v1/completions", json={"model": MODEL, **body})
            err = (
                r.json().get("error", {})
                if r.headers.get("content-type", "").startswith("application/json")
                else {}
            )
            out.append((r.status_code, err.get("param"), err.get("code")))
    return out


def test_dp_bad_fields_answer_as_one_engine(ray_runtime, tiny_llama_dir):
    from kvserve.distributed import start_data_parallel_engine

    with running_server(_engine_args(tiny_llama_dir), MODEL, api_key=API_KEY) as one:
        ref = _answers(one)
        one.wait_idle()
    assert all(400 <= s < 500 for s, _, _ in ref), list(zip(BAD, ref))
    dp = start_data_parallel_engine(_engine_args(tiny_llama_dir, data_parallel_size=2), MODEL)
    with running_server(None, MODEL, api_key=API_KEY, async_engine=dp) as s:
        got = _answers(s)
        _wait_idle(dp)
    assert [(b, g) for b, g, r in zip(BAD, got, ref) if g != r] == []
