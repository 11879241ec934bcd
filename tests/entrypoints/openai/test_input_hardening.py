"""Server hardening against hostile input and configuration: ``--api-key ""`` refused, LoRA
adapter names and paths (character set, ``..``, one message for a path that is not an adapter,
``--allowed-lora-root``), an unexpected exception answered as a clean 500 with one log line,
JSON nested past the body's depth inside a field, and ``/health`` / ``/metrics`` answered past
``--max-connections``."""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import socket
import time
from types import SimpleNamespace

import pytest

from kvserve.entrypoints.openai import api_server
from kvserve.entrypoints.openai.errors import MAX_JSON_DEPTH, APIError, parse_json_text
from kvserve.entrypoints.openai.http_protocol import ConnectionLimits
from kvserve.entrypoints.openai.serving_engine import input_error, json_depth
from kvserve.entrypoints.openai.serving_models import OpenAIServingModels
from kvserve.field_limits import MAX_LORA_NAME_CHARS, check_lora_name, lora_name_ok
from kvserve.lora.modules import parse_lora_module
from kvserve.lora.peft import CONFIG_FILE, WEIGHTS_FILE
from kvserve.lora_request import LoRARequest
from tests.server_harness import LogRecords, running_server


# ---------------------------------------------------------------------------- --api-key
@pytest.mark.parametrize("argv", [["--api-key", ""], ["--api-key", " key"], ["--api-key", "k\u00e9y"]])
def test_an_api_key_no_client_could_send_is_a_cli_error(argv, capsys):
    with pytest.raises(SystemExit) as e:
        api_server.main(argv)
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "--api-key" in err and "API key" in err


def test_an_empty_api_key_from_the_environment_is_refused_too(monkeypatch, capsys):
    monkeypatch.setenv("KVSERVE_API_KEY", "")
    with pytest.raises(SystemExit) as e:
        api_server.main([])
    assert e.value.code == 2 and "is empty" in capsys.readouterr().err
    monkeypatch.setenv("KVSERVE_API_KEY", "s3cret key")
    assert api_server.make_arg_parser().parse_args([]).api_key == "s3cret key"
    monkeypatch.delenv("KVSERVE_API_KEY")
    assert api_server.make_arg_parser().parse_args([]).api_key is None


def test_build_app_refuses_an_empty_api_key_before_touching_the_engine():
    with pytest.raises(ValueError, match="empty"):
        api_server.build_app(None, "m", api_key="")


@pytest.mark.parametrize(
    "argv,message",
    [
        (["--allowed-lora-root", "/"], "needs --enable-lora"),
        (["--enable-lora", "--allowed-lora-root", "/no/such/dir"], "is not a directory"),
    ],
)
def test_allowed_lora_root_flag_errors(argv, message, capsys):
    with pytest.raises(SystemExit) as e:
        api_server.main(argv)
    assert e.value.code == 2 and message in capsys.readouterr().err


# ---------------------------------------------------------------------------- LoRA names
@pytest.mark.parametrize(
    "name, ok",
    [
        ("sql", True),
        ("org/adapter:v1.2_x-y", True),
        ("a" * MAX_LORA_NAME_CHARS, True),
        ("...", True),  # a segment of three dots is a name, not a parent directory
        ("", False),
        ("a" * (MAX_LORA_NAME_CHARS + 1), False),
        ("a/../b", False),
        ("..", False),
        ("../x", False),
        ("a\nINFO forged line", False),
        ("a\x00b", False),
        ("a b", False),
        ("caf\u00e9", False),
        (7, False),
    ],
)
def test_lora_name_rule(name, ok):
    assert lora_name_ok(name) is ok
    if ok:
        check_lora_name("lora_name", name)
        LoRARequest(name, 1, "/p")
        assert parse_lora_module(f"{name}=/p").name == name
    else:
        with pytest.raises(ValueError, match="lora_name must be 1 to 128 characters"):
            check_lora_name("lora_name", name)
        with pytest.raises(ValueError, match="lora_request.lora_name"):
            LoRARequest(name, 1, "/p")
        if isinstance(name, str) and name.strip() and "=" not in name:
            with pytest.raises(argparse.ArgumentTypeError, match="adapter name must be"):
                parse_lora_module(f"{name}=/p")


def test_a_long_bad_name_is_quoted_cut_short():
    with pytest.raises(ValueError) as e:
        check_lora_name("lora_name", "\n" * 100_000)
    assert len(str(e.value)) < 400 and "100000 characters" in str(e.value)


@pytest.mark.parametrize("path", ["/p\x00q", "/p\nq", "/" + "p" * 5000])
def test_lora_request_refuses_control_characters_and_huge_paths(path):
    with pytest.raises(ValueError, match="lora_request.lora_path"):
        LoRARequest("ok", 1, path)


class _FakeAsyncEngine:
    """Accepts every adapter; records the paths it was asked to read."""

    def __init__(self):
        self.paths: list[str] = []
        self.engine = SimpleNamespace(lora_config=SimpleNamespace(max_loras=4), add_lora=self._add)

    def _add(self, req) -> bool:
        self.paths.append(req.lora_path)
        return True

    async def add_lora(self, req) -> bool:
        return self._add(req)


def _adapter_dir(path) -> str:
    path.mkdir(parents=True)
    (path / CONFIG_FILE).write_text("{}")
    (path / WEIGHTS_FILE).write_bytes(b"")
    return str(path)


def _load(models, name, path):
    async def run():
        return await models.load_lora_adapter(name, path)

    return asyncio.run(run())


def _load_error(models, name, path) -> APIError:
    with pytest.raises(APIError) as e:
        _load(models, name, path)
    assert e.value.status == 400
    return e.value


def test_one_message_whatever_makes_a_path_not_an_adapter(tmp_path):
    models = OpenAIServingModels(_FakeAsyncEngine(), ["base"])
    (tmp_path / "a-file").write_text("x")
    (tmp_path / "empty").mkdir()
    (tmp_path / "config-only").mkdir()
    (tmp_path / "config-only" / CONFIG_FILE).write_text("{}")
    messages = set()
    for kind in ("missing", "a-file", "empty", "config-only", "missing/deeper"):
        path = str(tmp_path / kind)
        err = _load_error(models, "x", path)
        assert err.param == "lora_path" and err.code == "invalid_lora_adapter"
        assert path in err.message
        messages.add(err.message.replace(path, "<path>"))
    assert len(messages) == 1, messages  # nothing tells which of them exist
    assert "is not a loadable LoRA adapter" in messages.pop()
    assert _load(models, "x", _adapter_dir(tmp_path / "good")).lora_path == str(tmp_path / "good")


def test_allowed_lora_root_keeps_run_time_loads_under_it(tmp_path):
    root, outside = tmp_path / "root", tmp_path / "outside"
    _adapter_dir(root / "good")
    _adapter_dir(outside)
    os.symlink(outside, root / "link")
    os.symlink(root / "good", root / "inner-link")
    eng = _FakeAsyncEngine()
    models = OpenAIServingModels(eng, ["base"], allowed_lora_root=str(root))

    # relative paths are under the root; the engine reads the resolved path
    assert _load(models, "a", "good").lora_path == os.path.realpath(root / "good")
    assert _load(models, "b", str(root / "inner-link")).lora_path == os.path.realpath(root / "good")
    for path in (str(outside), "../outside", "good/../../outside", "/"):
        err = _load_error(models, "c", path)
        assert "outside the allowed LoRA root" in err.message and err.param == "lora_path"
    # a symlink out of the root reads like any other path that is not an adapter
    err = _load_error(models, "c", "link")
    assert "is not a loadable LoRA adapter" in err.message and "under the allowed LoRA root" in err.message
    assert eng.paths == [os.path.realpath(root / "good")] * 2
    with pytest.raises(ValueError, match="allowed-lora-root"):
        OpenAIServingModels(eng, ["base"], allowed_lora_root=str(tmp_path / "nope"))


@pytest.mark.parametrize("name", ["a/../b", "a\nINFO x", "", "x" * 129, "..", "tab\tname"])
def test_bad_adapter_names_are_refused_at_load(tmp_path, name):
    models = OpenAIServingModels(_FakeAsyncEngine(), ["base"])
    err = _load_error(models, name, _adapter_dir(tmp_path / "good"))
    assert err.param == "lora_name" and err.code == "invalid_value" and "1 to 128 characters" in err.message
    assert models.num_adapters() == 0


def test_a_request_model_no_adapter_could_have_is_404_with_the_rule():
    models = OpenAIServingModels(_FakeAsyncEngine(), ["base"])
    for name in ("a\n../b\x00", "m" * 100_000):
        with pytest.raises(APIError) as e:
            models.resolve(name)
        assert e.value.status == 404 and e.value.param == "model"
        assert "1 to 128 characters" in e.value.message and len(e.value.message) < 600
        assert "\n" not in e.value.message
    with pytest.raises(APIError) as e:
        models.resolve("gpt-4o")
    assert "1 to 128" not in e.value.message and "'gpt-4o' does not exist" in e.value.message


# ---------------------------------------------------------------------------- JSON given as text
def test_json_text_gets_the_body_depth_limit():
    assert json_depth(parse_json_text("[" * MAX_JSON_DEPTH + "]" * MAX_JSON_DEPTH, "f")) == MAX_JSON_DEPTH
    for text in ("[" * 100_000, '{"a":' * 300 + "1" + "}" * 300):
        with pytest.raises(APIError) as e:
            parse_json_text(text, "guided_json")
        assert e.value.status == 400 and e.value.param == "guided_json"
        assert f"more than {MAX_JSON_DEPTH} levels" in e.value.message
    with pytest.raises(ValueError):  # not JSON: the caller decides
        parse_json_text("{not json", "f")
    assert json_depth(1) == 0 and json_depth([]) == 1 and json_depth({"a": [[{}]]}) == 4


def test_json_depth_measures_any_depth_without_recursion():
    deep: list = []
    node = deep
    for _ in range(100_000):
        node.append([])
        node = node[0]
    assert json_depth(deep) == 100_001


@pytest.mark.parametrize(
    "exc, text",
    [
        (RecursionError("maximum recursion depth exceeded"), "nested too deeply"),
        (MemoryError(), "too large to process"),
        (OverflowError("int too large to convert"), "int too large to convert"),
        (UnicodeEncodeError("utf-8", "\ud800", 0, 1, "surrogates not allowed"), "surrogates not allowed"),
        (ZeroDivisionError(), "ZeroDivisionError"),
    ],
)
def test_input_errors_are_400_naming_the_field(exc, text):
    err = input_error(exc, "prompt")
    assert err.status == 400 and err.param == "prompt" and text in err.message and "'prompt'" in err.message


# ---------------------------------------------------------------------------- a running server
MAX_CONNECTIONS = 3


@pytest.fixture(scope="module")
def server(tiny_llama_dir):
    from kvserve.config import EngineArgs

    limits = ConnectionLimits(request_read_timeout_s=2.0, max_connections=MAX_CONNECTIONS)
    args = EngineArgs(model=str(tiny_llama_dir), block_size=4, num_gpu_blocks=32, max_model_len=64, seed=0)
    with running_server(args, "tiny", limits=limits, shutdown_grace_s=2.0) as s:
        yield s


def test_an_unexpected_error_is_a_clean_500_and_one_log_line(server, monkeypatch):
    def boom(name):
        raise KeyError("internal detail 0xdeadbeef")

    with LogRecords(("kvserve.server", "uvicorn.error"), kvserve_info=False) as records:
        monkeypatch.setattr(server.app.state.models, "resolve", boom)
        with server.http() as h:
            r = h.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2})
        monkeypatch.undo()
    assert r.status_code == 500
    err = r.json()["error"]
    assert err["type"] == "internal_server_error" and err["code"] == "internal_error"
    assert "KeyError" in err["message"] and "deadbeef" not in err["message"]
    errors = [rec for rec in records.records if rec.levelno >= logging.ERROR]
    assert len(errors) == 1, [rec.getMessage() for rec in errors]
    line = errors[0].getMessage()
    assert "\n" not in line and "KeyError" in line and "/v1/completions" in line and not errors[0].exc_info
    with server.http() as h:  # and nothing else is affected
        assert h.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2}).status_code == 200
    server.wait_idle()


def test_deep_json_inside_fields_is_a_400_naming_the_field(server):
    deep = "[" * 100_000
    cases = [
        ("/v1/completions", {"prompt": "hi", "max_tokens": 2, "guided_json": deep}, "guided_json"),
        (
            "/v1/completions",
            {"prompt": "hi", "max_tokens": 2, "structured_outputs": {"json": '{"a":' * 5000}},
            "structured_outputs",
        ),
        (
            "/v1/chat/completions",
            {
                "messages": [
                    {"role": "user", "content": "x"},
                    {
                        "role": "assistant",
                        "tool_calls": [{"id": "c", "function": {"name": "f", "arguments": deep}}],
                    },
                ],
                "max_tokens": 2,
            },
            "messages",
        ),
    ]
    with server.http() as h:
        for path, body, param in cases:
            r = h.post(path, json=body)
            assert r.status_code == 400, r.text[:300]
            err = r.json()["error"]
            assert err["param"] == param and f"more than {MAX_JSON_DEPTH} levels" in err["message"]
        # nested into the body itself: pydantic's parser refuses it first
        r = h.post(
            "/v1/completions",
            content=('{"prompt": "hi", "x": ' + deep + "]" * 100_000 + "}").encode(),
            headers={"content-type": "application/json"},
        )
        assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_json"
        assert f"more than {MAX_JSON_DEPTH} levels" in r.json()["error"]["message"]


def _raw(port: int, request: bytes, limit_s: float = 10.0) -> bytes:
    """Send ``request`` on a new connection; everything the server sends until it closes the
    connection (which the test requires: it fails if ``limit_s`` passes first)."""
    sock = socket.create_connection(("127.0.0.1", port), timeout=limit_s)
    try:
        if request:
            sock.sendall(request)
        data = b""
        deadline = time.monotonic() + limit_s
        while time.monotonic() < deadline:
            sock.settimeout(max(0.01, deadline - time.monotonic()))
            try:
                chunk = sock.recv(65536)
            except TimeoutError:
                break
            except ConnectionResetError:
                return data
            if not chunk:
                return data
            data += chunk
        raise AssertionError(f"the server did not close the connection: {data[:200]!r}")
    finally:
        sock.close()


def _status(raw: bytes) -> int:
    return int(raw.split(b" ", 2)[1])


def test_health_and_metrics_answer_past_max_connections(server):
    held = [socket.create_connection(("127.0.0.1", server.port), timeout=5) for _ in range(MAX_CONNECTIONS)]
    try:
        time.sleep(0.2)  # the server has accepted them all
        get = "GET {} HTTP/1.1\r\nHost: x\r\n\r\n"
        health = _raw(server.port, get.format("/health").encode())
        assert _status(health) == 200 and b'"status":"ok"' in health
        assert b"connection: close" in health.lower()  # one probe per exempt connection
        metrics = _raw(server.port, get.format("/metrics?x=1").encode())
        assert _status(metrics) == 200 and b"kvserve:" in metrics
        body = json.dumps({"prompt": "hi", "max_tokens": 2}).encode()
        refused = _raw(
            server.port,
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            + f"Content-Length: {len(body)}\r\n\r\n".encode()
            + body,
        )
        assert _status(refused) == 503 and b"too_many_connections" in refused
        assert _status(_raw(server.port, b"POST /health HTTP/1.1\r\nHost: x\r\n\r\n")) == 503
        silent = _raw(server.port, b"")  # says nothing: still answered (after a second), and closed
        assert _status(silent) == 503
    finally:
        for s in held:
            s.close()
    with server.http() as h:
        deadline = time.monotonic() + 30
        while h.get("/health").status_code != 200 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert h.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2}).status_code == 200
