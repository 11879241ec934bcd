"""LoRA adapters over HTTP (tiny random model, random PEFT adapters): ``"model": "<adapter>"``
runs the adapter (completions and chat, streamed or not, equal to the offline API's greedy
outputs); ``/v1/models`` lists the adapters with their parent; ``/v1/load_lora_adapter`` and
``/v1/unload_lora_adapter`` add and remove them at run time; every bad input is a 400/404
naming the field, the path or the limit, and the server keeps serving."""

import argparse
import json
import threading
import time

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvserve.entrypoints.openai.serving_models import LoRAModulePath, parse_lora_module
from tests.lora.adapters import lora_tensors, write_adapter
from tests.server_harness import running_server

API_KEY = "lora-key"
BASE = "tiny"
MAX_LORA_RANK = 8
PROMPT = "The capital of France is"
MESSAGES = [{"role": "user", "content": "Say something."}]
MAX_TOKENS = 8
TARGETS = ("q_proj", "v_proj", "down_proj")


def _cfg(r=4, targets=TARGETS, **kw):
    return {"peft_type": "LORA", "r": r, "lora_alpha": 16, "target_modules": list(targets), **kw}


@pytest.fixture(scope="module")
def shapes(tiny_llama_dir):
    from transformers import AutoConfig

    from kvserve.lora.peft import ModelShapes

    return ModelShapes.from_hf_config(AutoConfig.from_pretrained(tiny_llama_dir))


@pytest.fixture(scope="module")
def adapter_dir(tmp_path_factory, shapes):
    """``adapter_dir(name, r=4, seed=0)``: a random adapter of rank ``r`` in a new directory."""

    def make(name: str, r: int = 4, seed: int = 0, targets=TARGETS) -> str:
        path = tmp_path_factory.mktemp(name)
        return write_adapter(
            path, _cfg(r, targets), lora_tensors(shapes.num_layers, shapes.in_out, r, targets, seed)
        )

    return make


def _engine_args(tiny_llama_dir, enable_lora=True):
    from kvserve.config import EngineArgs

    lora = (
        dict(enable_lora=True, max_loras=2, max_lora_rank=MAX_LORA_RANK, max_cpu_loras=4)
        if enable_lora
        else {}
    )
    return EngineArgs(
        model=str(tiny_llama_dir), device="cpu", dtype="float32", num_gpu_blocks=128, seed=0, **lora
    )


@pytest.fixture(scope="module")
def modules(adapter_dir):
    return [
        LoRAModulePath("sql", adapter_dir("sql", seed=1)),
        LoRAModulePath("chat", adapter_dir("chat", seed=2)),
    ]


@pytest.fixture(scope="module")
def server(tiny_llama_dir, modules):
    with running_server(_engine_args(tiny_llama_dir), BASE, api_key=API_KEY, lora_modules=modules) as s:
        yield s


@pytest.fixture(scope="module")
def offline(tiny_llama_dir):
    from kvserve import LLM

    return LLM(
        model=str(tiny_llama_dir),
        device="cpu",
        dtype="float32",
        enable_lora=True,
        max_loras=2,
        max_lora_rank=MAX_LORA_RANK,
        max_cpu_loras=8,
    )


_offline_ids = iter(range(100, 10_000))


def _reference(offline, path: str | None, chat: bool = False) -> str:
    """The offline API's greedy text for ``PROMPT`` (or ``MESSAGES``) with the adapter at ``path``."""
    from kvserve import SamplingParams
    from kvserve.lora_request import LoRARequest

    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True)
    lora = LoRARequest(f"ref-{path}", next(_offline_ids), path) if path else None
    if chat:
        outs = offline.chat(MESSAGES, params, use_tqdm=False, lora_request=lora)
    else:
        outs = offline.generate([PROMPT], params, use_tqdm=False, lora_request=lora)
    return outs[0].outputs[0].text


def _complete(client, model: str, stream: bool = False) -> tuple[str, str]:
    """(text, response model) of a greedy completion of ``PROMPT``."""
    kw = dict(
        model=model, prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0, extra_body={"ignore_eos": True}
    )
    if not stream:
        r = client.completions.create(**kw)
        assert r.choices[0].finish_reason == "length"
        return r.choices[0].text, r.model
    chunks = list(client.completions.create(**kw, stream=True))
    assert chunks[-1].choices[0].finish_reason == "length"
    return "".join(c.choices[0].text for c in chunks if c.choices), chunks[0].model


def _chat(client, model: str, stream: bool = False) -> tuple[str, str]:
    kw = dict(
        model=model, messages=MESSAGES, max_tokens=MAX_TOKENS, temperature=0, extra_body={"ignore_eos": True}
    )
    if not stream:
        r = client.chat.completions.create(**kw)
        return r.choices[0].message.content, r.model
    chunks = list(client.chat.completions.create(**kw, stream=True))
    return "".join(c.choices[0].delta.content or "" for c in chunks if c.choices), chunks[0].model


def _error(r, status: int) -> dict:
    assert r.status_code == status, (r.status_code, r.text)
    return r.json()["error"]


def _still_serving(server) -> None:
    """A normal base-model request and an adapter request succeed afterwards."""
    with server.http() as h:
        for model in (BASE, "sql"):
            r = h.post("/v1/completions", json={"model": model, "prompt": "hi", "max_tokens": 2})
            assert r.status_code == 200, r.text
            assert len(r.json()["choices"][0]["text"]) > 0 or r.json()["usage"]["completion_tokens"] == 2


# ---------------------------------------------------------------------- serving adapters
@pytest.mark.parametrize("stream", [False, True])
def test_completions_with_an_adapter_equal_the_offline_api(server, offline, modules, stream):
    client = server.client()
    refs = {m.name: _reference(offline, m.path) for m in modules}
    refs[BASE] = _reference(offline, None)
    assert len(set(refs.values())) == 3, refs  # the adapters change the answer
    for model, ref in refs.items():
        text, reported = _complete(client, model, stream)
        assert text == ref, model
        assert reported == model


@pytest.mark.parametrize("stream", [False, True])
def test_chat_with_an_adapter_equals_the_offline_api(server, offline, modules, stream):
    client = server.client()
    refs = {m.name: _reference(offline, m.path, chat=True) for m in modules}
    refs[BASE] = _reference(offline, None, chat=True)
    assert len(set(refs.values())) == 3, refs
    for model, ref in refs.items():
        text, reported = _chat(client, model, stream)
        assert text == ref, model
        assert reported == model


def test_concurrent_requests_with_different_adapters_each_get_their_own(server, offline, modules):
    client = server.client()
    models = [BASE, "sql", "chat"] * 3
    refs = {m.name: _reference(offline, m.path) for m in modules} | {BASE: _reference(offline, None)}
    results: dict[int, str] = {}

    def run(i: int, model: str) -> None:
        results[i] = _complete(client, model, stream=i % 2 == 0)[0]

    threads = [threading.Thread(target=run, args=(i, m)) for i, m in enumerate(models)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert {i: results.get(i) for i in range(len(models))} == {i: refs[m] for i, m in enumerate(models)}
    server.wait_idle()


def test_prompt_batches_beam_search_and_tokenize_take_the_adapter(server, offline, modules):
    from kvserve import SamplingParams
    from kvserve.lora_request import LoRARequest

    sql = LoRARequest("sql-ref", next(_offline_ids), modules[0].path)
    prompts = [PROMPT, "Once upon a time"]
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True)
    refs = [o.outputs[0].text for o in offline.generate(prompts, params, use_tqdm=False, lora_request=sql)]
    with server.http() as h:
        body = {
            "model": "sql",
            "prompt": prompts,
            "max_tokens": MAX_TOKENS,
            "temperature": 0,
            "ignore_eos": True,
        }
        r = h.post("/v1/completions", json=body).json()
        assert [c["text"] for c in sorted(r["choices"], key=lambda c: c["index"])] == refs
        assert r["model"] == "sql"
        beam = {
            "model": "sql",
            "prompt": PROMPT,
            "max_tokens": 3,
            "use_beam_search": True,
            "n": 2,
            "best_of": 2,
        }
        r = h.post("/v1/completions", json=beam)
        assert r.status_code == 200 and r.json()["model"] == "sql" and len(r.json()["choices"]) == 2
        r = h.post("/tokenize", json={"model": "sql", "prompt": PROMPT})
        assert r.status_code == 200 and r.json()["count"] > 0
    assert all(a.users == 0 for a in server.app.state.models._by_id.values())
    server.wait_idle()


def test_models_lists_the_adapters_with_their_parent(server, modules):
    with server.http() as h:
        data = h.get("/v1/models").json()["data"]
        assert [m["id"] for m in data] == [BASE, "sql", "chat"]
        assert data[0]["parent"] is None
        for card, m in zip(data[1:], modules):
            assert card["parent"] == BASE and card["root"] == m.path
        one = h.get("/v1/models/sql").json()
        assert one["id"] == "sql" and one["parent"] == BASE
        assert _error(h.get("/v1/models/nope"), 404)["code"] == "model_not_found"


def test_unknown_model_is_404_like_before(server):
    with server.http() as h:
        for path, body in (
            ("/v1/completions", {"model": "nope", "prompt": "hi", "max_tokens": 2}),
            ("/v1/chat/completions", {"model": "nope", "messages": MESSAGES, "max_tokens": 2}),
        ):
            err = _error(h.post(path, json=body), 404)
            assert err["code"] == "model_not_found" and err["param"] == "model"
            assert "'nope'" in err["message"] and "'sql'" in err["message"]
    _still_serving(server)


# ---------------------------------------------------------------------- load / unload
def test_load_use_unload_then_404(server, offline, adapter_dir):
    path = adapter_dir("runtime", seed=5)
    ref = _reference(offline, path)
    client = server.client()
    with server.http() as h:
        r = h.post("/v1/load_lora_adapter", json={"lora_name": "runtime", "lora_path": path})
        assert r.status_code == 200 and "runtime" in r.text
        assert "runtime" in [m["id"] for m in h.get("/v1/models").json()["data"]]
        assert _complete(client, "runtime") == (ref, "runtime")
        lora_id = server.app.state.models.resolve("runtime").lora_int_id
        assert lora_id in server.engine.list_loras()
        r = h.post("/v1/unload_lora_adapter", json={"lora_name": "runtime"})
        assert r.status_code == 200 and "runtime" in r.text and "running" not in r.text
        assert lora_id not in server.engine.list_loras()
        assert "runtime" not in [m["id"] for m in h.get("/v1/models").json()["data"]]
        err = _error(
            h.post("/v1/completions", json={"model": "runtime", "prompt": "hi", "max_tokens": 2}), 404
        )
        assert err["code"] == "model_not_found"
        assert (
            _error(h.post("/v1/unload_lora_adapter", json={"lora_name": "runtime"}), 404)["param"]
            == "lora_name"
        )
        # the same name again is a new adapter (a new id, never a reused one)
        r = h.post("/v1/load_lora_adapter", json={"lora_name": "runtime", "lora_path": path})
        assert r.status_code == 200
        assert server.app.state.models.resolve("runtime").lora_int_id > lora_id
        assert _complete(client, "runtime") == (ref, "runtime")
        assert h.post("/v1/unload_lora_adapter", json={"lora_name": "runtime"}).status_code == 200
    _still_serving(server)


def test_unloading_an_adapter_in_use_lets_its_requests_finish(server, offline, adapter_dir):
    """The name goes at once (404 for new requests); the running stream finishes with the
    adapter's weights (the same text as offline); the engine drops them afterwards."""
    path = adapter_dir("busy", seed=7)
    from kvserve import SamplingParams
    from kvserve.lora_request import LoRARequest

    long = 120
    ref = (
        offline.generate(
            [PROMPT],
            SamplingParams(max_tokens=long, temperature=0, ignore_eos=True),
            use_tqdm=False,
            lora_request=LoRARequest("busy-ref", next(_offline_ids), path),
        )[0]
        .outputs[0]
        .text
    )
    with server.http() as h:
        assert (
            h.post("/v1/load_lora_adapter", json={"lora_name": "busy", "lora_path": path}).status_code == 200
        )
        lora_id = server.app.state.models.resolve("busy").lora_int_id
        client = server.client()
        # held after its first token: the unload meets the stream still running, however
        # quickly the tiny model could produce the other 119 tokens
        with server.engine_held():
            stream = client.completions.create(
                model="busy",
                prompt=PROMPT,
                max_tokens=long,
                temperature=0,
                stream=True,
                extra_body={"ignore_eos": True},
            )
            it = iter(stream)
            first = next(it)
            r = h.post("/v1/unload_lora_adapter", json={"lora_name": "busy"})
            # the stream has 119 tokens to go: the unload is deferred until it ends
            assert r.status_code == 200 and "1 running request(s) finish with it first" in r.text
            err = _error(
                h.post("/v1/completions", json={"model": "busy", "prompt": "hi", "max_tokens": 2}), 404
            )
            assert err["code"] == "model_not_found"
        rest = list(it)
        text = "".join(c.choices[0].text for c in [first, *rest] if c.choices)
        assert rest[-1].choices[0].finish_reason == "length"
        assert text == ref
    deadline = time.time() + 60
    while lora_id in server.engine.list_loras() and time.time() < deadline:
        time.sleep(0.05)
    assert lora_id not in server.engine.list_loras()
    server.wait_idle()
    _still_serving(server)


def test_a_client_gone_after_the_unload_releases_the_adapter(server, adapter_dir):
    """A stream whose adapter was unloaded meanwhile, then dropped by its client: the request
    is aborted, and the engine drops the adapter; no KV block stays in use."""
    path = adapter_dir("drop", seed=9)
    with server.http() as h:
        assert (
            h.post("/v1/load_lora_adapter", json={"lora_name": "drop", "lora_path": path}).status_code == 200
        )
        lora_id = server.app.state.models.resolve("drop").lora_int_id
        # held after its first token: the request is still running at the unload and when
        # its client goes (the abort is applied once the hold ends)
        with server.engine_held():
            stream = server.client().completions.create(
                model="drop",
                prompt=PROMPT,
                max_tokens=200,
                temperature=0,
                stream=True,
                extra_body={"ignore_eos": True},
            )
            next(iter(stream))
            r = h.post("/v1/unload_lora_adapter", json={"lora_name": "drop"})
            assert r.status_code == 200 and "1 running request(s)" in r.text
            assert lora_id in server.engine.list_loras()
            stream.close()
    deadline = time.time() + 60
    while lora_id in server.engine.list_loras() and time.time() < deadline:
        time.sleep(0.05)
    assert lora_id not in server.engine.list_loras()
    server.wait_idle()
    _still_serving(server)


def test_a_request_admitted_before_the_unload_is_refused_with_404(server, adapter_dir):

    from kvserve.entrypoints.openai.serving_engine import APIError

    models = server.app.state.models
    with server.http() as h:
        path = adapter_dir("gone", seed=8)
        assert (
            h.post("/v1/load_lora_adapter", json={"lora_name": "gone", "lora_path": path}).status_code == 200
        )
        lora = models.resolve("gone")
        assert h.post("/v1/unload_lora_adapter", json={"lora_name": "gone"}).status_code == 200
    with pytest.raises(APIError) as e:
        models.acquire(lora)
    assert e.value.status == 404 and "unloaded" in e.value.message
    _still_serving(server)


_NOT_LOADABLE = "is not a loadable LoRA adapter"


@pytest.mark.parametrize(
    "kind, check",
    [
        ("rank", lambda err, path: f"max_lora_rank={MAX_LORA_RANK}" in err["message"]),
        # one message whatever is missing, so the endpoint does not tell which paths exist
        ("no-weights", lambda err, path: path in err["message"] and _NOT_LOADABLE in err["message"]),
        ("no-config", lambda err, path: path in err["message"] and _NOT_LOADABLE in err["message"]),
        ("missing-dir", lambda err, path: path in err["message"] and _NOT_LOADABLE in err["message"]),
        ("target", lambda err, path: "embed_tokens" in err["message"]),
        # nested past the JSON parser's depth: was a RecursionError, a 500
        ("deep-json", lambda err, path: path in err["message"] and "not readable JSON" in err["message"]),
        ("alora", lambda err, path: "alora_invocation_tokens" in err["message"]),
    ],
)
def test_bad_adapter_load_is_400_naming_the_limit_or_path(server, tmp_path, shapes, kind, check):
    path = str(tmp_path / kind)
    if kind == "rank":
        write_adapter(path, _cfg(16), lora_tensors(shapes.num_layers, shapes.in_out, 16, TARGETS))
    elif kind == "no-weights":
        write_adapter(path, _cfg(), None)
    elif kind == "no-config":
        (tmp_path / kind).mkdir()
    elif kind == "target":
        write_adapter(path, _cfg(targets=["q_proj", "embed_tokens"]), {})
    elif kind == "deep-json":
        (tmp_path / kind).mkdir()
        (tmp_path / kind / "adapter_config.json").write_text("[" * 100_000 + "]" * 100_000)
        (tmp_path / kind / "adapter_model.safetensors").write_bytes(b"")
    elif kind == "alora":
        t = lora_tensors(shapes.num_layers, shapes.in_out, 4, TARGETS)
        write_adapter(path, _cfg(alora_invocation_tokens=[5, 6]), t)
    loaded = set(server.engine.list_loras())
    with server.http() as h:
        err = _error(
            h.post("/v1/load_lora_adapter", json={"lora_name": f"bad-{kind}", "lora_path": path}), 400
        )
        assert err["param"] == "lora_path" and err["code"] == "invalid_lora_adapter"
        assert check(err, path), err
        assert f"bad-{kind}" not in [m["id"] for m in h.get("/v1/models").json()["data"]]
        _error(h.post("/v1/completions", json={"model": f"bad-{kind}", "prompt": "hi", "max_tokens": 2}), 404)
    assert set(server.engine.list_loras()) == loaded
    _still_serving(server)


@pytest.mark.parametrize(
    "route, body, status, param, code",
    [
        ("load", {"lora_name": "sql", "lora_path": "/x"}, 400, "lora_name", "lora_already_loaded"),
        ("load", {"lora_name": BASE, "lora_path": "/x"}, 400, "lora_name", "invalid_value"),
        ("load", {"lora_name": "x"}, 400, "lora_path", "missing_field"),
        ("load", {"lora_path": "/x"}, 400, "lora_name", "missing_field"),
        ("load", {"lora_name": "", "lora_path": "/x"}, 400, "lora_name", "invalid_value"),
        ("load", {"lora_name": "x", "lora_path": 3}, 400, "lora_path", "invalid_value"),
        (
            "load",
            {"lora_name": "x", "lora_path": "/x", "lora_int_id": 3},
            400,
            "lora_int_id",
            "unsupported_field",
        ),
        ("unload", {"lora_name": "never-loaded"}, 404, "lora_name", "lora_not_found"),
        ("unload", {}, 400, "lora_name", "missing_field"),
        ("unload", {"lora_name": "sql", "extra": 1}, 400, "extra", "unsupported_field"),
    ],
)
def test_bad_load_and_unload_bodies(server, route, body, status, param, code):
    with server.http() as h:
        err = _error(h.post(f"/v1/{route}_lora_adapter", json=body), status)
        assert (err["param"], err["code"]) == (param, code), err
        assert param in err["message"] or "'" in err["message"]
        assert [m["id"] for m in h.get("/v1/models").json()["data"]][:3] == [BASE, "sql", "chat"]
    _still_serving(server)


def test_both_routes_need_the_api_key(server):
    import httpx

    with httpx.Client(base_url=server.url, timeout=120) as h:
        for route, body in (
            ("load", {"lora_name": "k", "lora_path": "/x"}),
            ("unload", {"lora_name": "sql"}),
        ):
            for headers in ({}, {"Authorization": "Bearer wrong"}):
                err = _error(h.post(f"/v1/{route}_lora_adapter", json=body, headers=headers), 401)
                assert err["code"] == "invalid_api_key"
    assert "sql" in [c.id for c in server.client().models.list().data]


def test_metrics_show_loaded_adapters_and_lora_requests_info(server):
    with server.http() as h:
        text = h.get("/metrics").text
    loaded = [line for line in text.splitlines() if line.startswith("kvserve:lora_adapters_loaded{")]
    assert loaded and float(loaded[0].split()[-1]) == server.app.state.models.num_adapters() >= 2
    info = [line for line in text.splitlines() if line.startswith("vllm:lora_requests_info{")]
    assert info and 'max_lora="2"' in info[0] and 'running_lora_adapters=""' in info[0]
    assert any(line.startswith("kvserve:lora_requests_info{") for line in text.splitlines())


_BODY = st.dictionaries(
    st.sampled_from(["lora_name", "lora_path", "model", "lora_int_id", ""]),
    st.one_of(
        st.none(), st.integers(-3, 3), st.text(max_size=8), st.sampled_from(["sql", BASE, "/nonexistent"])
    ),
    max_size=3,
)


@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(route=st.sampled_from(["load", "unload"]), body=st.one_of(_BODY, st.lists(st.integers(), max_size=2)))
def test_fuzzed_adapter_bodies_are_4xx_and_change_nothing(server, route, body):
    """Whatever the body (no valid adapter path in it), the answer is a 400/404 error body
    naming a field, nothing is loaded or unloaded, and the base model and adapters serve."""
    if route == "unload" and isinstance(body, dict) and body.get("lora_name") in ("sql", "chat"):
        body = {**body, "lora_name": "x-" + body["lora_name"]}
    before = [m.id for m in server.client().models.list().data]
    with server.http() as h:
        r = h.post(f"/v1/{route}_lora_adapter", content=json.dumps(body))
        assert r.status_code in (400, 404), (body, r.text)
        assert r.json()["error"]["message"]
    assert [m.id for m in server.client().models.list().data] == before


def test_serving_continues_after_the_bad_inputs(server):
    _still_serving(server)
    server.wait_idle()


# ---------------------------------------------------------------------- LoRA off, startup
def test_lora_routes_without_enable_lora_are_400(tiny_llama_dir):
    with running_server(_engine_args(tiny_llama_dir, enable_lora=False), BASE) as s, s.http() as h:
        for route, body in (("load", {"lora_name": "a", "lora_path": "/x"}), ("unload", {"lora_name": "a"})):
            err = _error(h.post(f"/v1/{route}_lora_adapter", json=body), 400)
            assert err["code"] == "lora_not_enabled" and "--enable-lora" in err["message"]
        r = h.post("/v1/completions", json={"model": BASE, "prompt": "hi", "max_tokens": 2})
        assert r.status_code == 200
        assert "lora_requests_info" not in h.get("/metrics").text


def test_build_app_refuses_lora_modules_without_lora_and_bad_modules(tiny_llama_dir, tmp_path):
    from kvserve.engine.async_llm_engine import AsyncLLMEngine
    from kvserve.engine.llm_engine import LLMEngine
    from kvserve.entrypoints.openai.api_server import build_app

    plain = AsyncLLMEngine(LLMEngine.from_engine_args(_engine_args(tiny_llama_dir, enable_lora=False)))
    with pytest.raises(ValueError, match="--lora-modules needs --enable-lora"):
        build_app(plain, BASE, lora_modules=[LoRAModulePath("a", str(tmp_path))])
    lora = AsyncLLMEngine(LLMEngine.from_engine_args(_engine_args(tiny_llama_dir)))
    with pytest.raises(ValueError, match=r"--lora-modules a=.*has no adapter_config.json"):
        build_app(lora, BASE, lora_modules=[LoRAModulePath("a", str(tmp_path))])
    with pytest.raises(ValueError, match="--lora-modules tiny=.*base model's name"):
        build_app(lora, BASE, lora_modules=[LoRAModulePath(BASE, str(tmp_path))])


def test_serve_cli_lora_modules_errors(tiny_llama_dir, tmp_path, capsys):
    from kvserve.entrypoints.openai.api_server import main

    with pytest.raises(SystemExit) as e:
        main(["--model", str(tiny_llama_dir), "--lora-modules", f"a={tmp_path}"])
    assert e.value.code == 2 and "--lora-modules needs --enable-lora" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:
        main(["--enable-lora", "--lora-modules", "no-equals-sign"])
    assert e.value.code == 2 and "--lora-modules" in capsys.readouterr().err
    argv = ["--model", str(tiny_llama_dir), "--device", "cpu", "--dtype", "float32", "--enable-lora"]
    rc = main(argv + ["--max-lora-rank", "8", "--lora-modules", f"bad={tmp_path}/missing"])
    err = capsys.readouterr().err
    assert rc == 2 and f"--lora-modules bad={tmp_path}/missing" in err and "not a directory" in err


def test_parse_lora_module_forms():
    assert parse_lora_module("sql=/p/a") == LoRAModulePath("sql", "/p/a")
    assert parse_lora_module("a=b=c") == LoRAModulePath("a", "b=c")
    assert parse_lora_module('{"name": "sql", "path": "/p", "base_model_name": "base"}') == LoRAModulePath(
        "sql", "/p", "base"
    )
    for bad, match in (
        ("sql", "expected name=path"),
        ("=/p", "name is empty"),
        ("sql=", "path is empty"),
        ('{"name": "a"}', "path is empty"),
        ('{"name": "a", "path": "/p", "rank": 4}', "unknown key"),
        ("{not json", "not valid JSON"),
        ('{"name": "a", "path": "/p", "base_model_name": 3}', "base_model_name"),
    ):
        with pytest.raises(argparse.ArgumentTypeError, match=match):
            parse_lora_module(bad)


@given(st.text(max_size=40))
def test_parse_lora_module_returns_or_raises_argument_type_error(text):
    try:
        m = parse_lora_module(text)
    except argparse.ArgumentTypeError:
        return
    assert m.name and m.path and m.name == m.name.strip()


def test_json_module_parent_is_reported(tiny_llama_dir, adapter_dir):
    m = parse_lora_module(json.dumps({"name": "j", "path": adapter_dir("j"), "base_model_name": "my-base"}))
    with running_server(_engine_args(tiny_llama_dir), BASE, lora_modules=[m]) as s, s.http() as h:
        data = h.get("/v1/models").json()["data"]
        assert [(c["id"], c["parent"]) for c in data] == [(BASE, None), ("j", "my-base")]
