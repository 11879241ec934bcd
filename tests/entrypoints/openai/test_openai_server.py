"""The OpenAI-compatible server against a real uvicorn (one per module) on the default model,
with the official ``openai`` client. Short ``max_tokens`` and a small KV cache (see conftest)
keep the module fast on 2 CPU cores."""

import asyncio
import json
import logging
import socket
import threading
import time

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.entrypoints.openai.conftest import API_KEY, MAX_BODY_BYTES, MODEL

pytestmark = pytest.mark.slow

PARIS_PROMPT = "The capital of France is"


# ---------------------------------------------------------------------------- helpers
def ids_of(server, text, add_special_tokens=False):
    return server.engine.tokenizer(text, add_special_tokens=add_special_tokens).input_ids


def n_ids(server, n):
    """A valid prompt of exactly ``n`` token ids."""
    base = ids_of(server, "The quick brown fox jumps over the lazy dog. ")
    return (base * (n // len(base) + 1))[:n]


def assert_error(resp, status, param=None, contains=()):
    assert resp.status_code == status, (resp.status_code, resp.text)
    body = resp.json()
    assert set(body) == {"error"}, body
    err = body["error"]
    assert set(err) == {"message", "type", "param", "code"}, err
    if status == 400:
        assert err["type"] == "BadRequestError"
    if param is not None:
        assert err["param"] == param, err
    for s in contains:
        assert s in err["message"], (s, err["message"])
    return err


def still_serving(server):
    """The engine keeps serving: a normal request returns 200 with text."""
    r = server.client().completions.create(model=MODEL, prompt="Hello", max_tokens=2, temperature=0)
    assert r.choices[0].text and r.usage.completion_tokens == 2


def gen_tokens(server):
    return server.engine.stats.num_generation_tokens


def scrape(server):
    """``{sample name (+ labels other than model_name as JSON): value}``; buckets left out."""
    text = server.http().get("/metrics").text
    samples = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.name.endswith("_bucket"):
                continue
            labels = {k: v for k, v in s.labels.items() if k != "model_name"}
            samples[s.name + (json.dumps(labels, sort_keys=True) if labels else "")] = s.value
    return text, samples


# ---------------------------------------------------------------------------- basics
def test_models_health_version_tokenize(server):
    c = server.client()
    assert [m.id for m in c.models.list().data] == [MODEL]
    h = server.http()
    assert h.get("/health").status_code == 200
    assert "version" in h.get("/version").json()
    assert h.get(f"/v1/models/{MODEL}").json()["id"] == MODEL
    assert_error(h.get("/v1/models/nope"), 404)
    tok = h.post("/tokenize", json={"prompt": PARIS_PROMPT, "add_special_tokens": False}).json()
    assert tok["tokens"] == ids_of(server, PARIS_PROMPT) and tok["count"] == len(tok["tokens"])
    assert tok["max_model_len"] == 1024
    assert h.post("/detokenize", json={"tokens": tok["tokens"]}).json()["prompt"] == PARIS_PROMPT
    chat_tok = h.post("/tokenize", json={"messages": [{"role": "user", "content": "hi"}]}).json()
    assert chat_tok["count"] > 3
    assert_error(h.post("/detokenize", json={"tokens": [10**9]}), 400, "tokens")
    assert_error(h.post("/tokenize", json={}), 400, "prompt")


def test_completion_and_usage(server):
    c = server.client()
    r = c.completions.create(model=MODEL, prompt=PARIS_PROMPT, max_tokens=6, temperature=0, logprobs=0)
    ch = r.choices[0]
    assert r.object == "text_completion" and r.id.startswith("cmpl-") and r.model == MODEL
    assert "Paris" in ch.text and ch.finish_reason == "length" and ch.index == 0
    assert r.usage.prompt_tokens == len(ids_of(server, PARIS_PROMPT))
    assert r.usage.completion_tokens == 6 == len(ch.logprobs.tokens)
    assert r.usage.total_tokens == r.usage.prompt_tokens + 6
    assert "".join(ch.logprobs.tokens) == ch.text
    raw = server.client().completions.with_raw_response.create(model=MODEL, prompt=PARIS_PROMPT, max_tokens=1)
    assert raw.headers["x-request-id"] == raw.parse().id
    # token-id prompt gives the same greedy text
    r2 = c.completions.create(model=MODEL, prompt=ids_of(server, PARIS_PROMPT), max_tokens=6, temperature=0)
    assert r2.choices[0].text == ch.text
    # echo prepends the prompt
    r3 = c.completions.create(model=MODEL, prompt=PARIS_PROMPT, max_tokens=6, temperature=0, echo=True)
    assert r3.choices[0].text == PARIS_PROMPT + ch.text


def test_completion_stream_equals_non_stream_same_seed(server):
    c = server.client()
    kw = dict(model=MODEL, prompt="Once upon a time", max_tokens=12, temperature=0.9, seed=1234, top_p=0.95)
    full = c.completions.create(**kw)
    chunks = list(c.completions.create(stream=True, stream_options={"include_usage": True}, **kw))
    text = "".join(ch.choices[0].text for ch in chunks if ch.choices)
    assert text == full.choices[0].text
    finals = [ch.choices[0].finish_reason for ch in chunks if ch.choices and ch.choices[0].finish_reason]
    assert finals == [full.choices[0].finish_reason]
    assert chunks[-1].choices == [] and chunks[-1].usage == full.usage
    assert all(ch.usage is None for ch in chunks[:-1])


def test_batch_prompts_and_n(server):
    c = server.client()
    r = c.completions.create(model=MODEL, prompt=[PARIS_PROMPT, "1, 2, 3,"], max_tokens=4, temperature=0)
    assert [ch.index for ch in r.choices] == [0, 1]
    single = c.completions.create(model=MODEL, prompt="1, 2, 3,", max_tokens=4, temperature=0)
    assert r.choices[1].text == single.choices[0].text
    assert r.usage.prompt_tokens == len(ids_of(server, PARIS_PROMPT)) + len(ids_of(server, "1, 2, 3,"))
    r = c.completions.create(
        model=MODEL,
        prompt=[ids_of(server, "Hi"), ids_of(server, "Bye")],
        n=2,
        max_tokens=3,
        temperature=1.0,
        seed=7,
        extra_body={"ignore_eos": True},
    )
    assert sorted(ch.index for ch in r.choices) == [0, 1, 2, 3]
    assert r.usage.completion_tokens == 12
    # n > 1 streamed: every choice gets exactly one finish_reason
    chunks = list(
        c.completions.create(
            model=MODEL,
            prompt="Colors:",
            n=3,
            max_tokens=4,
            temperature=1.0,
            seed=3,
            extra_body={"ignore_eos": True},
            stream=True,
        )
    )
    finished = sorted(ch.choices[0].index for ch in chunks if ch.choices[0].finish_reason)
    assert finished == [0, 1, 2]
    server.wait_idle()


def test_chat_non_stream_and_stream(server):
    c = server.client()
    msgs = [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": [{"type": "text", "text": "What is the capital of France?"}]},
    ]
    r = c.chat.completions.create(
        model=MODEL, messages=msgs, max_completion_tokens=10, temperature=0, logprobs=True, top_logprobs=3
    )
    ch = r.choices[0]
    assert r.object == "chat.completion" and ch.message.role == "assistant" and ch.message.content
    assert ch.finish_reason in ("stop", "length")
    assert len(ch.logprobs.content) == r.usage.completion_tokens
    assert all(len(t.top_logprobs) == 3 and t.logprob <= 0 for t in ch.logprobs.content)
    assert all(t.top_logprobs[0].logprob >= t.top_logprobs[-1].logprob for t in ch.logprobs.content)
    prompt_ids = server.http().post("/tokenize", json={"messages": msgs}).json()["tokens"]
    assert r.usage.prompt_tokens == len(prompt_ids)

    stream = c.chat.completions.create(
        model=MODEL,
        messages=msgs,
        max_tokens=10,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    # the role rides on the first token's chunk (no role-only chunk before the prefill)
    first = chunks[0].choices[0].delta
    assert first.role == "assistant" and first.content and ch.message.content.startswith(first.content)
    assert all(x.choices[0].delta.role is None for x in chunks[1:] if x.choices)
    content = "".join(x.choices[0].delta.content or "" for x in chunks if x.choices)
    assert content == ch.message.content
    fin = [x.choices[0].finish_reason for x in chunks if x.choices and x.choices[0].finish_reason]
    assert fin == [ch.finish_reason]
    assert chunks[-1].usage.completion_tokens == r.usage.completion_tokens
    # n = 2 with the role first for each choice
    r2 = c.chat.completions.create(model=MODEL, messages=msgs, n=2, max_tokens=4, temperature=1.0, seed=5)
    assert sorted(x.index for x in r2.choices) == [0, 1]


def test_chat_errors(server):
    h = server.http()
    body = {"model": MODEL, "max_tokens": 4}
    assert_error(h.post("/v1/chat/completions", json=dict(body, messages=[])), 400, "messages")
    assert_error(
        h.post("/v1/chat/completions", json=dict(body, messages=[{"role": "wizard", "content": "x"}])),
        400,
        "messages",
    )
    assert_error(
        h.post("/v1/chat/completions", json=dict(body, messages=[{"content": "x"}])), 400, "messages"
    )
    assert_error(
        h.post(
            "/v1/chat/completions",
            json=dict(body, messages=[{"role": "user", "content": "x"}], top_logprobs=2),
        ),
        400,
        "top_logprobs",
    )
    assert_error(
        h.post(
            "/v1/chat/completions",
            json=dict(body, messages=[{"role": "user", "content": "x"}], max_completion_tokens=0),
        ),
        400,
        "max_completion_tokens",
    )
    # too large for the context: charged to the field the request used (not the engine's name)
    assert_error(
        h.post(
            "/v1/chat/completions",
            json=dict(body, messages=[{"role": "user", "content": "x"}], max_completion_tokens=10**9),
        ),
        400,
        "max_completion_tokens",
    )
    assert_error(h.post("/v1/chat/completions", json=dict(body, model="gpt-4", messages=[])), 404, "model")
    still_serving(server)


# ---------------------------------------------------------------------------- stop strings (B19)
@pytest.fixture(scope="module")
def paris(server):
    """Greedy output of PARIS_PROMPT; it starts with the one-token word ' Paris'."""
    out = server.client().completions.create(model=MODEL, prompt=PARIS_PROMPT, max_tokens=30, temperature=0)
    text = out.choices[0].text
    assert text.startswith(" Paris"), text
    assert len(ids_of(server, " Paris")) == 1
    return text


def _stream_text(server, **kw):
    chunks = list(server.client().completions.create(stream=True, **kw))
    return "".join(c.choices[0].text for c in chunks), [c.choices[0].finish_reason for c in chunks]


@pytest.mark.parametrize(
    "stop,include,expected",
    [
        ("Pari", False, " "),  # (a) a prefix of the one-token word
        ("s.", False, " Pari"),  # (b) spans ' Paris' + '.'
        ("Pari", True, " Pari"),  # (c) kept in the output
    ],
)
def test_B19_server_stop_string_off_token_boundary(server, paris, stop, include, expected):
    kw = dict(
        model=MODEL,
        prompt=PARIS_PROMPT,
        max_tokens=30,
        temperature=0,
        stop=[stop],
        extra_body={"include_stop_str_in_output": include},
    )
    r = server.client().completions.create(**kw)
    assert r.choices[0].text == expected and r.choices[0].finish_reason == "stop"
    assert r.usage.completion_tokens < 5
    # (d) streamed: the deltas never carry a character of the stop string and add up to the same text
    text, reasons = _stream_text(server, **kw)
    assert text == expected and reasons[-1] == "stop" and reasons.count("stop") == 1
    server.wait_idle()


def test_B19_server_chat_stop_streamed(server):
    c = server.client()
    kw = dict(
        model=MODEL,
        messages=[{"role": "user", "content": "What is the capital of France?"}],
        max_tokens=20,
        temperature=0,
    )
    base = c.chat.completions.create(**kw).choices[0].message.content
    assert "Paris" in base
    stop = "ari"
    full = c.chat.completions.create(stop=stop, **kw).choices[0]
    assert full.message.content == base[: base.index(stop)] and full.finish_reason == "stop"
    chunks = list(c.chat.completions.create(stop=stop, stream=True, **kw))
    assert "".join(x.choices[0].delta.content or "" for x in chunks) == full.message.content


# ---------------------------------------------------------------------------- validation errors
def test_B05_empty_prompt_is_400_and_engine_survives(server):
    h = server.http()
    added = server.engine.stats.num_requests_added
    for prompt in ("", [""], [], [[]]):
        err = assert_error(
            h.post(
                "/v1/completions", json={"model": MODEL, "prompt": prompt, "max_tokens": 20, "temperature": 0}
            ),
            400,
            "prompt",
        )
        assert "at least 1 token" in err["message"]
    assert server.engine.stats.num_requests_added == added  # never reached the scheduler
    with pytest.raises(openai.BadRequestError):
        server.client().completions.create(model=MODEL, prompt="", max_tokens=20)
    still_serving(server)


@pytest.mark.parametrize("value", [0, -1, 2.5, "10", True])
def test_B06_server_invalid_max_tokens(server, value):
    body = {"model": MODEL, "prompt": n_ids(server, 8), "max_tokens": value, "temperature": 0}
    err = assert_error(server.http().post("/v1/completions", json=body), 400, "max_tokens")
    assert "max_tokens" in err["message"] and "an integer in [1, 2**63 - 1]" in err["message"]


def test_B06_server_context_window(server):
    h = server.http()
    # (e) 8 + 1017 > 1024
    err = assert_error(
        h.post(
            "/v1/completions",
            json={"model": MODEL, "prompt": n_ids(server, 8), "max_tokens": 1017, "temperature": 0},
        ),
        400,
        "max_tokens",
    )
    assert "1025" in err["message"] and "1024" in err["message"]
    # (d) within max_model_len but past what this server's 48 x 8-token KV cache holds: a 400
    # naming max_tokens and its largest value; that value is accepted (streamed; we leave
    # after the first chunk)
    err = assert_error(
        h.post(
            "/v1/completions",
            json={"model": MODEL, "prompt": n_ids(server, 8), "max_tokens": 1016, "temperature": 0},
        ),
        400,
        "max_tokens",
    )
    assert "KV cache" in err["message"]
    most = int(err["message"].split("max_tokens can be at most ")[1].split()[0].rstrip(","))
    assert 8 + most <= 48 * 8 + 1
    before = gen_tokens(server)
    with h.stream(
        "POST",
        "/v1/completions",
        json={
            "model": MODEL,
            "prompt": n_ids(server, 8),
            "max_tokens": most,
            "temperature": 0,
            "ignore_eos": True,
            "stream": True,
        },
    ) as resp:
        assert resp.status_code == 200
        for line in resp.iter_lines():
            if line.startswith("data: {"):
                break
    server.wait_idle()
    assert gen_tokens(server) - before < 200
    # (f) omitted: the completions default (16, as in the OpenAI API)
    r = server.client().completions.create(
        model=MODEL, prompt=n_ids(server, 8), temperature=0, extra_body={"ignore_eos": True}
    )
    assert r.usage.completion_tokens == 16 and r.choices[0].finish_reason == "length"
    still_serving(server)


@pytest.mark.parametrize(
    "field,value",
    [
        ("temperature", -1),
        ("temperature", "hot"),
        ("top_p", 0),
        ("top_p", 1.5),
        ("n", 0),
        ("n", 33),
        ("logprobs", 21),
        ("stop", 5),
        ("presence_penalty", 3),
        ("frequency_penalty", -2.5),
        ("seed", 1.5),
        ("top_k", 0),
        ("min_p", 2),
        ("repetition_penalty", 0),
        ("logit_bias", {"x": 1}),
        ("logit_bias", {"5": 500}),
        ("stop_token_ids", [-1]),
        ("min_tokens", -1),
        ("best_of", 0),
        ("prompt", [1.5]),
        ("prompt", 5),
        ("echo", "yes"),
    ],
)
def test_invalid_fields_are_400_naming_the_field(server, field, value):
    body = {"model": MODEL, "prompt": "Hi", "max_tokens": 2, field: value}
    err = assert_error(server.http().post("/v1/completions", json=body), 400, field)
    assert field in err["message"]


def test_token_ids_outside_vocab_and_bad_json(server):
    h = server.http()
    assert_error(
        h.post("/v1/completions", json={"model": MODEL, "prompt": [1, 10**7], "max_tokens": 2}),
        400,
        "prompt",
        ["49152"],
    )
    assert_error(
        h.post("/v1/completions", content=b"{not json", headers={"content-type": "application/json"}), 400
    )
    assert_error(h.post("/v1/completions", json=[1, 2]), 400)
    assert_error(h.post("/v1/completions", json={"model": MODEL}), 400, "prompt")
    assert_error(h.get("/v1/nowhere"), 404)
    still_serving(server)


def test_B01_server_prompt_over_prompt_limit(server):
    h = server.http()
    added = server.engine.stats.num_requests_added
    err = assert_error(
        h.post(
            "/v1/completions",
            json={"model": MODEL, "prompt": n_ids(server, 600), "max_tokens": 4, "temperature": 0},
        ),
        400,
        "prompt",
    )
    assert "600" in err["message"] and "512" in err["message"]
    assert server.engine.stats.num_requests_added == added
    # R2 right behind it runs normally
    r = server.client().completions.create(
        model=MODEL, prompt=n_ids(server, 8), max_tokens=4, temperature=0, extra_body={"ignore_eos": True}
    )
    assert r.usage.completion_tokens == 4
    assert server.wait_idle()["num_free_gpu_blocks"] == 48


def test_B03_server_prompt_bigger_than_kv_pool(server):
    h = server.http()
    err = assert_error(
        h.post(
            "/v1/completions",
            json={"model": MODEL, "prompt": n_ids(server, 400), "max_tokens": 2, "temperature": 0},
        ),
        400,
        "prompt",
    )
    assert "50" in err["message"] and "48" in err["message"]
    # streamed: still a 400 before any byte of the stream
    assert_error(
        h.post(
            "/v1/completions",
            json={"model": MODEL, "prompt": n_ids(server, 400), "max_tokens": 2, "stream": True},
        ),
        400,
        "prompt",
        ["50"],
    )
    # chat is held to the same limit
    long_msg = "word " * 420
    assert_error(
        h.post(
            "/v1/chat/completions",
            json={"model": MODEL, "max_tokens": 2, "messages": [{"role": "user", "content": long_msg}]},
        ),
        400,
        "messages",
    )
    still_serving(server)


def test_auth_model_and_body_size(server):
    import httpx as _h

    url = server.url + "/v1/completions"
    body = {"model": MODEL, "prompt": "Hi", "max_tokens": 2}
    assert_error(_h.post(url, json=body), 401)
    assert_error(_h.post(url, json=body, headers={"Authorization": "Bearer wrong"}), 401)
    with pytest.raises(openai.AuthenticationError):
        server.client(api_key="wrong").completions.create(model=MODEL, prompt="Hi", max_tokens=2)
    assert _h.get(server.url + "/health").status_code == 200  # health needs no key
    with pytest.raises(openai.NotFoundError):
        server.client().completions.create(model="gpt-4", prompt="Hi", max_tokens=2)
    err = assert_error(
        server.http().post("/v1/completions", json=dict(body, prompt="x" * (MAX_BODY_BYTES + 10))), 413
    )
    assert str(MAX_BODY_BYTES) in err["message"]
    still_serving(server)


def test_max_waiting_gives_503_with_retry_after(server):
    engine = server.engine
    engine.scheduler_config.max_waiting = 2
    results = []
    started = threading.Event()

    def blocker():
        # 250 prompt tokens (+ up to 30) hold 32..35 of the 48 KV blocks for ~30 steps, so the
        # 150-token requests of the burst (19 blocks each) must stay in `waiting` meanwhile.
        with server.http().stream(
            "POST",
            "/v1/completions",
            json={
                "model": MODEL,
                "prompt": n_ids(server, 250),
                "max_tokens": 30,
                "temperature": 0,
                "ignore_eos": True,
                "stream": True,
            },
        ) as resp:
            for line in resp.iter_lines():
                if line.startswith("data: {"):
                    started.set()
            results.append(resp.status_code)

    answered: list = []
    four_answered = threading.Event()

    async def fire():
        async with httpx.AsyncClient(
            base_url=server.url, headers={"Authorization": f"Bearer {API_KEY}"}, timeout=120
        ) as ac:

            async def one():
                r = await ac.post(
                    "/v1/completions", json={"model": MODEL, "prompt": n_ids(server, 150), "max_tokens": 2}
                )
                answered.append(r)
                if len(answered) == 4:
                    four_answered.set()
                return r

            return await asyncio.gather(*[one() for _ in range(6)])

    burst_out: list = []
    try:
        t = threading.Thread(target=blocker)
        burst = threading.Thread(target=lambda: burst_out.extend(asyncio.run(fire())))
        # held after the blocker's first token until four of the burst are answered: the burst
        # meets the blocker still holding its blocks, however fast it could finish its 30
        # tokens (the two admitted requests then wait for the engine, answered after the hold)
        with server.engine_held():
            t.start()
            assert started.wait(60)
            burst.start()
            assert four_answered.wait(120), [r.status_code for r in answered]
        burst.join(120)
        responses = burst_out
        t.join(60)
    finally:
        engine.scheduler_config.max_waiting = None
    codes = [r.status_code for r in responses]
    assert sorted(codes) == [200, 200, 503, 503, 503, 503], codes
    r503 = next(r for r in responses if r.status_code == 503)
    assert r503.headers["retry-after"] == "1"
    assert assert_error(r503, 503)["code"] == "queue_full"
    assert results == [200]
    server.wait_idle()
    still_serving(server)


# ---------------------------------------------------------------------------- disconnects
def test_non_streaming_disconnect_aborts(server):
    before = gen_tokens(server)
    body = json.dumps(
        {
            "model": MODEL,
            "prompt": "Tell me a long story.",
            "max_tokens": 400,
            "temperature": 0,
            "ignore_eos": True,
        }
    ).encode()
    s = socket.create_connection(("127.0.0.1", server.port))
    s.sendall(
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        + f"Authorization: Bearer {API_KEY}\r\nContent-Length: {len(body)}\r\n\r\n".encode()
        + body
    )
    deadline = time.time() + 10
    while gen_tokens(server) - before < 3 and time.time() < deadline:
        time.sleep(0.01)
    s.close()
    server.wait_idle()
    assert gen_tokens(server) - before < 100


def test_B18_server_disconnect_n2_stream(server):
    before = gen_tokens(server)
    stream = server.client().completions.create(
        model=MODEL,
        prompt=n_ids(server, 6),
        n=2,
        temperature=0.3,
        seed=1,
        max_tokens=180,  # within the 48 x 8-token cache for both sequences
        stream=True,
        extra_body={"ignore_eos": True},
    )
    seen = 0
    for _chunk in stream:
        seen += 1
        if seen >= 3:
            break
    stream.close()
    stats = server.wait_idle()
    assert gen_tokens(server) - before < 100  # 2 x 180 would have been generated otherwise
    assert stats["num_free_gpu_blocks"] == stats["num_gpu_blocks"]
    assert not server.engine._groups and not server.async_engine._streams
    still_serving(server)


def test_64_concurrent_streams_quarter_disconnect(server):
    before_finished = sum(server.engine.stats.finished_by_reason.values())

    async def run():
        client = server.async_client(timeout=180)

        async def one(i):
            stream = await client.completions.create(
                model=MODEL, prompt=f"Count from {i}:", max_tokens=5, temperature=0, stream=True
            )
            text, reason = "", None
            async for chunk in stream:
                text += chunk.choices[0].text
                reason = chunk.choices[0].finish_reason or reason
                if i % 4 == 0 and text:
                    await stream.close()
                    return ("gone", text, None)
            return ("done", text, reason)

        try:
            return await asyncio.gather(*[one(i) for i in range(64)])
        finally:
            await client.close()

    t0 = time.time()
    results = asyncio.run(run())
    done = [r for r in results if r[0] == "done"]
    assert len(done) == 48 and all(r[2] in ("stop", "length") and r[1] for r in done)
    stats = server.wait_idle()
    assert stats["num_free_gpu_blocks"] == stats["num_gpu_blocks"] == 48
    assert sum(server.engine.stats.finished_by_reason.values()) - before_finished == 64
    print(f"64 streams in {time.time() - t0:.1f}s")
    still_serving(server)


# ---------------------------------------------------------------------------- metrics and logs
def test_metrics_parse_and_move(server):
    text, before = scrape(server)
    for name in (
        "kvserve:num_requests_running",
        "kvserve:num_requests_waiting",
        "kvserve:num_requests_swapped",
        "kvserve:gpu_cache_usage_perc",
        "kvserve:cpu_cache_usage_perc",
        "kvserve:gpu_prefix_cache_hit_rate",
        "kvserve:num_preemptions_total",
        "kvserve:prompt_tokens_total",
        "kvserve:generation_tokens_total",
        "kvserve:time_to_first_token_seconds_count",
        "kvserve:time_per_output_token_seconds_count",
        "kvserve:e2e_request_latency_seconds_count",
        "kvserve:request_queue_time_seconds_count",
    ):
        assert name in before, name
    r = server.client().completions.create(
        model=MODEL, prompt=PARIS_PROMPT, max_tokens=5, temperature=0, extra_body={"ignore_eos": True}
    )
    _, after = scrape(server)
    assert (
        after["kvserve:prompt_tokens_total"] - before["kvserve:prompt_tokens_total"] == r.usage.prompt_tokens
    )
    assert after["kvserve:generation_tokens_total"] - before["kvserve:generation_tokens_total"] == 5
    for h in (
        "time_to_first_token_seconds",
        "e2e_request_latency_seconds",
        "request_queue_time_seconds",
        "time_per_output_token_seconds",
    ):
        assert after[f"kvserve:{h}_count"] == before[f"kvserve:{h}_count"] + 1, h
    key = 'kvserve:request_success_total{"finished_reason": "length"}'
    assert after[key] == before.get(key, 0) + 1
    assert after["kvserve:num_requests_running"] == 0 and after["kvserve:gpu_cache_usage_perc"] == 0
    ok = 'kvserve:http_responses_total{"endpoint": "/v1/completions", "status": "200"}'
    assert after[ok] >= before.get(ok, 0) + 1


def test_request_log_line(server, caplog):
    caplog.set_level(logging.INFO, logger="kvserve.server.requests")
    secret = "SECRET-PROMPT-TEXT"
    r = server.client().completions.create(
        model=MODEL, prompt=secret, max_tokens=3, temperature=0, extra_body={"ignore_eos": True}
    )
    c = server.client().chat.completions.create(model=MODEL, messages=_USER, max_tokens=2, user="team-a")
    lines = [json.loads(rec.getMessage()) for rec in caplog.records if rec.name == "kvserve.server.requests"]
    mine = [ln for ln in lines if ln["request_id"] == r.id]
    assert len(mine) == 1
    line = mine[0]
    assert line["output_tokens"] == 3 and line["prompt_tokens"] == r.usage.prompt_tokens
    assert line["finish_reasons"] == ["length"] and line["ttft_s"] is not None and line["e2e_s"] > 0
    assert "tenant" not in line  # no user: the default tenant
    assert [ln["tenant"] for ln in lines if ln["request_id"] == c.id] == ["team-a"]
    assert secret not in caplog.text


# ---------------------------------------------------------------------------- odd input never 500s
_USER = [{"role": "user", "content": "hi"}]


@pytest.mark.parametrize(
    "path,body",
    [
        ("/v1/completions", {"prompt": "hi", "temperature": float("nan")}),
        ("/v1/completions", {"prompt": "hi", "top_p": float("inf")}),
        ("/v1/completions", {"prompt": "hi", "seed": 2**70}),
        ("/v1/completions", {"prompt": "hi", "seed": 2**70, "stream": True}),
        ("/v1/completions", {"prompt": "hi", "n": 10**9}),
        ("/v1/completions", {"prompt": "hi", "logit_bias": {"99999999999": 1}}),
        ("/v1/completions", {"prompt": "hi", "logit_bias": {"-3": 1}}),
        ("/v1/completions", {"prompt": "hi", "stop_token_ids": [10**12]}),
        ("/v1/completions", {"prompt": "hi", "stream_options": "x"}),
        ("/v1/completions", {"prompt": {"a": 1}}),
        ("/v1/completions", {"prompt": [[1, 2], "x"]}),
        ("/v1/completions", {"prompt": [[1, 2], []]}),
        ("/v1/completions", {"prompt": "hi", "max_tokens": 10**12}),
        ("/v1/completions", {"prompt": "hi", "priority": "high"}),
        ("/v1/completions", {"prompt": "hi", "user": 5}),
        ("/v1/completions", {"prompt": "hi", "min_tokens": 5, "max_tokens": 2}),
        ("/v1/completions", {"prompt": "hi", "guided_regex": "(unclosed"}),
        ("/v1/completions", {"prompt": "hi", "suffix": "x"}),
        ("/v1/completions", {"prompt": "hi", "stop": [""]}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}),
        ("/v1/chat/completions", {"messages": "hello"}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": 5}]}),
        ("/v1/chat/completions", {"messages": _USER, "tools": [{"type": "function"}]}),
        ("/v1/chat/completions", {"messages": _USER, "logprobs": True, "top_logprobs": 50}),
        ("/v1/chat/completions", {"messages": _USER, "logprobs": 3}),
        ("/v1/chat/completions", {"messages": _USER, "max_tokens": 2000}),
        ("/v1/chat/completions", {"messages": _USER, "stream": True, "n": 0}),
        ("/tokenize", {"prompt": 5}),
        ("/detokenize", {"tokens": ["a"]}),
    ],
)
def test_odd_input_is_a_clean_400(server, path, body):
    if path.startswith("/v1"):
        body = dict({"model": MODEL, "max_tokens": 2}, **body)
    resp = server.http().post(
        path,
        content=json.dumps(body).encode(),  # NaN / Infinity as Python writes them
        headers={"content-type": "application/json"},
    )
    err = assert_error(resp, 400)
    assert err["param"], err


def test_streamed_logprobs_match_non_streamed(server):
    c = server.client()
    kw = dict(model=MODEL, prompt=PARIS_PROMPT, max_tokens=5, temperature=0, logprobs=2)
    full = c.completions.create(**kw).choices[0].logprobs
    chunks = list(c.completions.create(stream=True, **kw))
    tokens = [t for ch in chunks for t in ch.choices[0].logprobs.tokens]
    lps = [t for ch in chunks for t in ch.choices[0].logprobs.token_logprobs]
    tops = [t for ch in chunks for t in ch.choices[0].logprobs.top_logprobs]
    assert tokens == full.tokens and lps == pytest.approx(full.token_logprobs)
    assert all(2 <= len(t) <= 3 for t in tops)
    chat = list(
        c.chat.completions.create(
            model=MODEL,
            messages=_USER,
            max_tokens=4,
            temperature=0,
            logprobs=True,
            top_logprobs=1,
            stream=True,
        )
    )
    toks = [t for ch in chat if ch.choices and ch.choices[0].logprobs for t in ch.choices[0].logprobs.content]
    assert len(toks) == 4 and all(len(t.top_logprobs) == 1 for t in toks)
    still_serving(server)


def test_no_pending_admission_is_leaked(server):
    """Every reservation taken at admission is consumed or given back (also on errors and
    disconnects): once idle, nothing counts against max_waiting."""
    server.wait_idle()
    assert server.app.state.server_state.pending.value == 0
    assert not server.app.state.server_state.inflight


def test_metrics_gauges_while_a_request_runs(server):
    # held after its first token: the scrape cannot race the engine finishing the request
    with server.engine_held():
        stream = server.client().completions.create(
            model=MODEL,
            prompt=PARIS_PROMPT,
            max_tokens=40,
            temperature=0,
            stream=True,
            extra_body={"ignore_eos": True},
        )
        it = iter(stream)
        next(it)
        _, during = scrape(server)
        assert during["kvserve:num_requests_running"] == 1
        assert 0 < during["kvserve:gpu_cache_usage_perc"] <= 1
        assert during["kvserve:num_free_gpu_blocks"] < during["kvserve:num_gpu_blocks"]
        stream.close()
    server.wait_idle()
    _, after = scrape(server)
    assert after["kvserve:num_requests_running"] == 0 and after["kvserve:gpu_cache_usage_perc"] == 0
    assert after['kvserve:request_success_total{"finished_reason": "abort"}'] >= 1
