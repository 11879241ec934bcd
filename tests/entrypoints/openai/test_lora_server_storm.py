"""Load/unload storms over HTTP while requests run: the same path under several names, odd
names, streams cut by an unload: never a 5xx or a hang, the stable adapter's text never
changes, and afterwards the engine is idle with only the startup adapters loaded."""

import threading

import pytest

from tests.entrypoints.openai.test_lora_server import (  # noqa: F401 (fixtures)
    BASE,
    _engine_args,
    adapter_dir,
    modules,
    shapes,
)
from tests.server_harness import running_server


@pytest.fixture(scope="module")
def server(tiny_llama_dir, modules):  # noqa: F811
    with running_server(_engine_args(tiny_llama_dir), BASE, lora_modules=modules) as s:
        yield s


def _text(h, model, max_tokens=6, stream=False):
    body = {
        "model": model,
        "prompt": "Hello there",
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
    }
    if not stream:
        r = h.post("/v1/completions", json=body)
        return r.status_code, (r.json()["choices"][0]["text"] if r.status_code == 200 else r.text)
    with h.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
        return r.status_code, "".join(r.iter_text())


def test_load_unload_storm_with_requests_never_5xx_and_leaves_the_engine_idle(server, adapter_dir):  # noqa: F811
    path = adapter_dir("storm", seed=9)
    startup = set(server.engine.list_loras())
    with server.http() as h:
        ref_sql = _text(h, "sql")
        ref_base = _text(h, BASE)
        ref_chat = _text(h, "chat")
    assert ref_sql[0] == 200 and ref_base[0] == 200
    statuses: list[int] = []
    wrong: list[tuple] = []
    lock = threading.Lock()

    def note(model, got, ref=None):
        with lock:
            statuses.append(got[0])
            if ref is not None and got != ref:
                wrong.append((model, got, ref))

    def loader(t):
        with server.http(timeout=60) as h:
            for i in range(4):
                name = f"s{t}"
                r = h.post("/v1/load_lora_adapter", json={"lora_name": name, "lora_path": path})
                note(name, (r.status_code, ""))
                got = _text(h, name, max_tokens=20, stream=(i % 2 == 1))
                note(name, (got[0], ""))
                r = h.post("/v1/unload_lora_adapter", json={"lora_name": name})
                note(name, (r.status_code, ""))

    def racer():
        # a stream on a shared name that another thread unloads: 200 (finished with the
        # adapter) or 404 (unloaded first), never anything else
        with server.http(timeout=60) as h:
            for _ in range(4):
                h.post("/v1/load_lora_adapter", json={"lora_name": "shared", "lora_path": path})
                note("shared", (_text(h, "shared", max_tokens=12, stream=True)[0], ""))
                h.post("/v1/unload_lora_adapter", json={"lora_name": "shared"})

    def user(model, ref):
        with server.http(timeout=60) as h:
            for _ in range(4):
                note(model, _text(h, model), ref)

    def odd_names():
        with server.http(timeout=60) as h:
            for name in ["a/b", "名前", "x" * 500, " ", "a\nb", "..", "sql\u0000"]:
                r = h.post("/v1/load_lora_adapter", json={"lora_name": name, "lora_path": path})
                note(name, (r.status_code, ""))
                if r.status_code == 200:
                    note(name, (_text(h, name)[0], ""))
                    note(name, (h.post("/v1/unload_lora_adapter", json={"lora_name": name}).status_code, ""))

    threads = [threading.Thread(target=loader, args=(t,)) for t in range(3)]
    threads += [threading.Thread(target=racer) for _ in range(2)]
    threads += [
        threading.Thread(target=user, args=("sql", ref_sql)),
        threading.Thread(target=user, args=(BASE, ref_base)),
    ]
    threads.append(threading.Thread(target=odd_names))
    for th in threads:
        th.start()
    for th in threads:
        th.join(timeout=240)
    assert not any(th.is_alive() for th in threads), "a client hung"
    assert all(s in (200, 400, 404) for s in statuses), sorted(set(statuses))
    assert not wrong, wrong[:2]
    server.wait_idle()
    # the engine's cache is an LRU (max_cpu_loras): a startup adapter may have been evicted,
    # but nothing unloaded stays
    assert set(server.engine.list_loras()) <= startup
    assert set(server.app.state.models._adapters) == {"sql", "chat"}
    with server.http() as h:
        assert _text(h, "chat") == ref_chat and _text(h, "sql") == ref_sql
    server.wait_idle()


def test_loading_a_nan_adapter_is_400_naming_the_tensor(server, tmp_path, shapes):  # noqa: F811
    from tests.lora.adapters import lora_tensors, write_adapter

    t = lora_tensors(shapes.num_layers, shapes.in_out, 4, ("q_proj",))
    t["base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight"][1, 2] = float("nan")
    cfg = {"peft_type": "LORA", "r": 4, "lora_alpha": 16, "target_modules": ["q_proj"]}
    path = write_adapter(tmp_path / "nan", cfg, t)
    with server.http() as h:
        r = h.post("/v1/load_lora_adapter", json={"lora_name": "nan", "lora_path": path})
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert err["param"] == "lora_path" and "q_proj: lora_B is not finite" in err["message"]
        assert "nan" not in [m["id"] for m in h.get("/v1/models").json()["data"]]
        assert (
            h.post("/v1/completions", json={"model": "nan", "prompt": "hi", "max_tokens": 2}).status_code
            == 404
        )
    server.wait_idle()
