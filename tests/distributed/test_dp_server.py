"""``--data-parallel-size 2`` behind one OpenAI endpoint, on a local Ray runtime: the same greedy
outputs as the single-process server (completions and streams), requests spread over both
replicas, shared prefixes kept on one replica, errors / API key / disconnects as with one
engine, ``/metrics`` per replica, and a replica whose process is killed mid-run: the other's
requests finish and the endpoint keeps serving while Ray replaces it."""

import concurrent.futures as cf
import os
import signal
import time

import pytest

from tests.distributed.conftest import ENGINE_KWARGS
from tests.server_harness import running_server

# ~75 s on 2 shared cores: a Ray runtime, two replicas, a reference server
pytestmark = pytest.mark.slow

API_KEY = "dp-key"
MODEL = "tiny-dp"
PROMPTS = [
    "The quick brown fox",
    "Once upon a time in a land",
    "def add(a, b):",
    "Paris is the capital of",
]


def _engine_args(model_dir, **kw):
    from kvserve.config import EngineArgs

    return EngineArgs(model=str(model_dir), **{**ENGINE_KWARGS, **kw})


def _greedy(server, prompt, max_tokens=12, stream=False):
    client = server.client()
    if not stream:
        r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=max_tokens, temperature=0)
        return r.choices[0].text, r.choices[0].finish_reason
    text, reason = "", None
    for chunk in client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=max_tokens, temperature=0, stream=True
    ):
        text += chunk.choices[0].text
        reason = chunk.choices[0].finish_reason or reason
    return text, reason


@pytest.fixture(scope="module")
def reference(tiny_llama_dir):
    """The single-process server's greedy answers."""
    with running_server(_engine_args(tiny_llama_dir), MODEL, api_key=API_KEY) as s:
        return {p: _greedy(s, p) for p in PROMPTS}


@pytest.fixture(scope="module")
def dp_server(ray_runtime, tiny_llama_dir, reference):
    from kvserve.distributed import start_data_parallel_engine

    dp = start_data_parallel_engine(_engine_args(tiny_llama_dir, data_parallel_size=2), MODEL)
    with running_server(None, MODEL, api_key=API_KEY, async_engine=dp) as s:
        yield s


def _replica_stats(dp):
    ray = dp._ray
    return [ray.get(r.actor.kv_cache_stats.remote(), timeout=30) for r in dp.replicas]


def _wait_idle(dp, timeout=120.0):
    """Every replica has no request and no KV block in use; returns their KV stats."""
    ray = dp._ray
    deadline = time.time() + timeout
    while time.time() < deadline:
        loads = [ray.get(r.actor.load.remote(), timeout=30) for r in dp.replicas if r.healthy]
        stats = _replica_stats(dp)
        if (
            dp.num_in_flight == 0
            and all(sum(x.values()) == 0 for x in loads)
            and all(s["num_free_gpu_blocks"] == s["num_gpu_blocks"] for s in stats)
        ):
            return stats
        time.sleep(0.05)
    raise AssertionError(f"replicas not idle after {timeout}s")


def test_dp_completions_and_streams_equal_single_process_greedy(dp_server, reference):
    for p in PROMPTS:
        assert _greedy(dp_server, p) == reference[p]
        assert _greedy(dp_server, p, stream=True) == reference[p]
    _wait_idle(dp_server.async_engine)


def test_dp_concurrent_requests_spread_over_both_replicas(dp_server, reference):
    dp = dp_server.async_engine
    before = [r.routed for r in dp.replicas]
    prompts = [f"{p} number {i}" for i in range(3) for p in PROMPTS]
    with cf.ThreadPoolExecutor(8) as pool:
        outs = list(pool.map(lambda p: _greedy(dp_server, p, max_tokens=24), prompts))
    assert all(reason == "length" for _, reason in outs)
    routed = [r.routed - b for r, b in zip(dp.replicas, before)]
    assert sum(routed) == len(prompts)
    assert min(routed) >= 3, routed  # distinct prompts: spread by load
    _wait_idle(dp)


def test_dp_shared_system_prompt_lands_on_one_replica(dp_server):
    dp = dp_server.async_engine
    system = "You are a helpful assistant who answers briefly and precisely. " * 4
    before = [r.routed for r in dp.replicas]
    hits_before = [s["prefix_cache_hits"] for s in _replica_stats(dp)]
    for i in range(6):  # one after another: the load never passes the threshold
        _greedy(dp_server, system + f"Question {i}: what is {i} plus {i}?", max_tokens=4)
    routed = [r.routed - b for r, b in zip(dp.replicas, before)]
    assert sorted(routed) == [0, 6], routed
    stats = _replica_stats(dp)
    target = routed.index(6)
    hits = stats[target]["prefix_cache_hits"] - hits_before[target]
    prompt_len = len(dp.engine.tokenizer.encode(system))
    # 5 of the 6 requests reuse (about) the whole system prompt, as one engine would
    assert hits >= 5 * (prompt_len // ENGINE_KWARGS["block_size"] - 1) * ENGINE_KWARGS["block_size"]


def test_dp_errors_api_key_and_models_as_single_process(dp_server):
    import openai

    client = dp_server.client()
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL, prompt="hi " * 400, max_tokens=4)
    assert e.value.body["param"] == "prompt"
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL, prompt="hi", max_tokens=4, temperature=-1)
    assert e.value.body["param"] == "temperature"
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="other", prompt="hi", max_tokens=4)
    with pytest.raises(openai.AuthenticationError):
        dp_server.client(api_key="wrong").completions.create(model=MODEL, prompt="hi", max_tokens=4)
    assert [m.id for m in client.models.list().data] == [MODEL]
    chat = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=5, temperature=0, n=2
    )
    assert [c.finish_reason for c in chat.choices] == ["length", "length"]
    assert chat.choices[0].message.content == chat.choices[1].message.content  # greedy, twice
    choice = client.completions.create(
        model=MODEL,
        prompt="Pick one:",
        max_tokens=8,
        extra_body={"structured_outputs": {"choice": ["red", "blue"]}},
    )
    assert choice.choices[0].text in ("red", "blue")
    with dp_server.http() as h:
        assert h.get("/health").json() == {"status": "ok"}
        tok = h.post("/tokenize", json={"prompt": "hello world"}).json()
        assert tok["count"] == len(dp_server.engine.tokenizer.encode("hello world"))


def test_dp_client_disconnect_aborts_on_the_replica(dp_server):
    client = dp_server.client()
    stream = client.completions.create(
        model=MODEL, prompt="A long story:", max_tokens=200, temperature=0, stream=True
    )
    next(iter(stream))
    stream.close()  # the client goes away mid-stream
    _wait_idle(dp_server.async_engine)  # aborted on its replica, every block freed


def test_dp_metrics_aggregate_replicas_with_a_replica_label(dp_server):
    _greedy(dp_server, "metrics please")
    with dp_server.http() as h:
        text = h.get("/metrics").text
    for i in (0, 1):
        assert f'kvserve:num_requests_running{{model_name="{MODEL}",replica="{i}"}}' in text
        assert f'vllm:num_requests_running{{model_name="{MODEL}",replica="{i}"}}' in text
        assert f'kvserve:dp_replica_up{{replica="{i}"}} 1.0' in text
    assert 'kvserve:http_responses_total{endpoint="/v1/completions",status="200"}' in text
    # the replicas' success counters add up to the requests the router sent
    total = sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith("kvserve:request_success_total{")
    )
    routed = sum(r.routed for r in dp_server.async_engine.replicas)
    assert total == routed


def test_dp_killed_replica_others_finish_and_endpoint_keeps_serving(dp_server):
    """Kill replica 1's process while four streams run (two per replica): replica 0's finish
    in full, replica 1's end with an error event; new requests are served meanwhile; Ray
    replaces the process and the replica serves again."""
    import openai

    dp = dp_server.async_engine
    victim = dp.replicas[1]
    old_pid = victim.pid
    started = cf.ThreadPoolExecutor(4)
    first_chunk = [0]

    def stream(i):
        client = dp_server.client()
        n = 0
        try:
            for chunk in client.completions.create(
                model=MODEL,
                prompt=f"Story {i}: once",
                max_tokens=200,
                temperature=0,
                stream=True,
                extra_body={"ignore_eos": True},
            ):
                if n == 0:
                    first_chunk[0] += 1
                n += 1
                time.sleep(0.01)  # a slow reader keeps the request running
                if chunk.choices and chunk.choices[0].finish_reason:
                    return ("ok", chunk.choices[0].finish_reason)
        except openai.APIError as e:
            return ("error", str(e))
        return ("cut", n)

    futures = [started.submit(stream, i) for i in range(4)]
    deadline = time.time() + 60
    while first_chunk[0] < 4 and time.time() < deadline:
        time.sleep(0.01)
    assert [r.outstanding for r in dp.replicas] == [2, 2]
    os.kill(old_pid, signal.SIGKILL)
    # the endpoint keeps serving while the replica is replaced
    text, reason = _greedy(dp_server, "still there?", max_tokens=4)
    assert reason == "length" and text
    results = [f.result(timeout=120) for f in futures]
    started.shutdown()
    assert sorted(r[0] for r in results) == ["error", "error", "ok", "ok"], results
    assert all(r[1] == "length" for r in results if r[0] == "ok")
    assert all("replica 1 died" in r[1] for r in results if r[0] == "error"), results
    deadline = time.time() + 300  # Ray restarts the actor: a new process loads the model
    while not (victim.healthy and victim.restarts >= 1) and time.time() < deadline:
        time.sleep(0.2)
    assert victim.healthy and victim.pid != old_pid and victim.restarts >= 1
    before = victim.routed
    with cf.ThreadPoolExecutor(4) as pool:
        outs = list(
            pool.map(lambda p: _greedy(dp_server, p, max_tokens=24), [f"again {i}" for i in range(4)])
        )
    assert all(r == "length" for _, r in outs)
    assert victim.routed > before  # the replacement takes requests again
    _wait_idle(dp)
