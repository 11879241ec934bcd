"""No client can hold the server's connections: read deadlines (408 and close), the write
deadline (a client that stops reading its answer is cut, a slow steady reader is not), idle keep-alive
timeout, the connection cap (503 past it), disconnects logged as one INFO line, and the shutdown
drain answering 503 on open keep-alive connections. Real sockets to 127.0.0.1, every wait
bounded (a few seconds per test)."""

import json
import logging
import socket
import threading
import time

import httpx
import pytest

from kvserve.entrypoints.openai.http_protocol import ConnectionLimits
from tests.server_harness import LogRecords, running_server

pytestmark = pytest.mark.slow

READ_TIMEOUT_S = 1.0
WRITE_TIMEOUT_S = 1.0
KEEP_ALIVE_S = 1.0
MAX_CONNECTIONS = 24
ENGINE_KWARGS = dict(block_size=8, num_gpu_blocks=64, max_model_len=256, max_num_batched_tokens=256, seed=0)


@pytest.fixture(scope="module")
def server():
    from kvserve.config import EngineArgs

    limits = ConnectionLimits(
        request_read_timeout_s=READ_TIMEOUT_S,
        response_write_timeout_s=WRITE_TIMEOUT_S,
        max_connections=MAX_CONNECTIONS,
    )
    with running_server(
        EngineArgs(**ENGINE_KWARGS), "m", limits=limits, keep_alive_timeout_s=KEEP_ALIVE_S
    ) as s:
        yield s


def _connect(port: int) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", port), timeout=5)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return sock


def _read_until_closed(sock: socket.socket, limit_s: float = 5.0) -> tuple[bytes, bool]:
    """Everything the server sends until it closes (True) or ``limit_s`` passes (False)."""
    data = b""
    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline:
        sock.settimeout(max(0.01, deadline - time.monotonic()))
        try:
            chunk = sock.recv(65536)
        except TimeoutError:
            return data, False
        except ConnectionResetError:
            return data, True
        if not chunk:
            return data, True
        data += chunk
    return data, False


def _read_response(sock: socket.socket, limit_s: float = 5.0) -> bytes:
    """One whole response (headers + ``Content-Length`` body) from a kept-alive connection."""
    data = b""
    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline:
        if b"\r\n\r\n" in data:
            _, headers, body = _parse(data)
            if len(body) >= int(headers.get("content-length", 0)):
                return data
        sock.settimeout(max(0.01, deadline - time.monotonic()))
        chunk = sock.recv(65536)
        if not chunk:
            break
        data += chunk
    raise AssertionError(f"no whole response: {data[:200]!r}")


def _parse(raw: bytes) -> tuple[int, dict[str, str], bytes]:
    head, _, body = raw.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    status = int(lines[0].split()[1])
    headers = {k.strip().lower(): v.strip() for k, _, v in (ln.partition(":") for ln in lines[1:])}
    return status, headers, body


def _request(method: str, path: str, body: bytes = b"", extra: str = "") -> bytes:
    return (
        f"{method} {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\n{extra}\r\n"
    ).encode() + body


def _health_ms(server) -> float:
    t = time.perf_counter()
    assert httpx.get(server.url + "/health", timeout=30).status_code == 200
    return (time.perf_counter() - t) * 1000


# ---------------------------------------------------------------------------- read deadline
def test_half_body_gets_408_and_the_connection_closed(server):
    body = json.dumps({"prompt": "hi", "max_tokens": 2}).encode()
    with LogRecords() as rec:
        sock = _connect(server.port)
        t0 = time.monotonic()
        # Content-Length promises the whole body; only half of it is sent
        sock.sendall(_request("POST", "/v1/completions", body)[: -len(body) // 2])
        raw, closed = _read_until_closed(sock)
        elapsed = time.monotonic() - t0
        sock.close()
        time.sleep(0.2)
    # one INFO line saying what happened (the handler's disconnect is not logged again)
    assert len(rec.records) == 1 and rec.records[0].levelno == logging.INFO, rec.text()
    assert "body not received within 1 s" in rec.records[0].getMessage()
    assert closed, raw
    status, headers, payload = _parse(raw)
    assert status == 408 and headers["connection"] == "close"
    assert json.loads(payload)["error"]["code"] == "request_timeout"
    assert READ_TIMEOUT_S * 0.9 <= elapsed < READ_TIMEOUT_S + 2
    server.wait_idle()


def test_half_headers_get_408_and_the_connection_closed(server):
    sock = _connect(server.port)
    t0 = time.monotonic()
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Le")
    raw, closed = _read_until_closed(sock)
    sock.close()
    assert closed and time.monotonic() - t0 < READ_TIMEOUT_S + 2
    status, headers, payload = _parse(raw)
    assert status == 408 and "headers" in json.loads(payload)["error"]["message"]


def test_a_slow_body_cannot_extend_its_deadline_by_dribbling(server):
    body = json.dumps({"prompt": "x" * 200, "max_tokens": 2}).encode()
    sock = _connect(server.port)
    sock.sendall(_request("POST", "/v1/completions", body)[: -len(body)])
    t0 = time.monotonic()
    closed = False
    for i in range(len(body)):  # one byte every 0.1 s: never idle, never done in time
        try:
            sock.sendall(body[i : i + 1])
        except OSError:
            closed = True
            break
        time.sleep(0.1)
        if time.monotonic() - t0 > READ_TIMEOUT_S + 1.5:
            break
    raw, closed2 = _read_until_closed(sock, 2)
    sock.close()
    assert closed or closed2
    assert raw.startswith(b"HTTP/1.1 408"), raw[:100]
    assert time.monotonic() - t0 < READ_TIMEOUT_S + 3


def test_a_connection_that_never_speaks_is_closed(server):
    sock = _connect(server.port)
    t0 = time.monotonic()
    raw, closed = _read_until_closed(sock)
    sock.close()
    assert closed and raw == b""
    assert READ_TIMEOUT_S * 0.9 <= time.monotonic() - t0 < READ_TIMEOUT_S + 2


def test_idle_keep_alive_connection_is_closed_after_the_keep_alive_timeout(server):
    sock = _connect(server.port)
    sock.sendall(_request("GET", "/health"))
    t0 = time.monotonic()
    raw, closed = _read_until_closed(sock, KEEP_ALIVE_S + 3)
    sock.close()
    assert closed and _parse(raw)[0] == 200
    assert time.monotonic() - t0 >= KEEP_ALIVE_S * 0.9


def test_keep_alive_connection_serves_several_requests_within_deadlines(server):
    # the read deadline is per request: a connection used steadily is not cut. 8 gaps of 0.3 s
    # outlast both 1 s deadlines together, each gap well inside them (0.7 s of slack for a
    # loaded machine's latency: 0.7 s gaps left 0.3 s)
    sock = _connect(server.port)
    t0 = time.monotonic()
    for _ in range(8):
        sock.sendall(_request("GET", "/health"))
        data = _read_response(sock)
        assert data.startswith(b"HTTP/1.1 200"), data[:60]
        time.sleep(READ_TIMEOUT_S * 0.3)
    assert time.monotonic() - t0 > 2 * max(READ_TIMEOUT_S, KEEP_ALIVE_S)
    sock.close()


# ---------------------------------------------------------------------------- connection cap
def test_connections_past_max_connections_get_503_and_are_closed(server):
    socks = []
    try:
        for _ in range(MAX_CONNECTIONS):
            socks.append(_connect(server.port))
        extra = _connect(server.port)
        # a client that sends its request at once still reads the refusal (no reset)
        extra.sendall(_request("POST", "/v1/completions", b"{}" * 5000))
        time.sleep(0.3)  # the refusal and the server's close are done before the client reads
        raw, closed = _read_until_closed(extra, 3)
        extra.close()
        assert closed, raw
        status, headers, payload = _parse(raw)
        assert status == 503 and headers["retry-after"] == "1" and headers["connection"] == "close"
        err = json.loads(payload)["error"]
        assert err["code"] == "too_many_connections" and str(MAX_CONNECTIONS) in err["message"]
    finally:
        for s in socks:
            s.close()
    # the cap frees up as soon as the connections are gone
    deadline = time.monotonic() + 60
    while True:
        try:
            assert _health_ms(server) < 5000
            break
        except (httpx.HTTPError, AssertionError):
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)


def test_many_half_sent_requests_are_all_cut_and_health_stays_fast(server):
    # more clients than the cap, each sending half a request: the ones over the cap are refused
    # at once, the rest are cut at the read deadline; the server answers /health throughout
    socks = []
    body = json.dumps({"prompt": "hi", "max_tokens": 2}).encode()
    with LogRecords() as rec:
        for _ in range(MAX_CONNECTIONS * 3):
            try:
                s = _connect(server.port)
                s.sendall(_request("POST", "/v1/completions", body)[:-5])
                socks.append(s)
            except OSError:
                pass
        statuses = []
        for s in socks:
            raw, closed = _read_until_closed(s, READ_TIMEOUT_S + 3)
            s.close()
            assert closed
            statuses.append(_parse(raw)[0] if raw else None)
        assert set(statuses) <= {408, 503}, statuses
        assert statuses.count(408) <= MAX_CONNECTIONS and statuses.count(503) >= MAX_CONNECTIONS
        assert _health_ms(server) < 1000
    # refusals and timeouts are rate-limited: a few lines, not one per connection
    assert len(rec.records) < 10, rec.text()
    assert not any(r.exc_info for r in rec.records)
    server.wait_idle()


# ---------------------------------------------------------------------------- disconnects
def test_client_disconnect_mid_body_is_one_info_line_without_traceback(server):
    body = json.dumps({"prompt": "hello " * 50, "max_tokens": 2}).encode()
    n = 30
    with LogRecords() as rec:
        for _ in range(n):
            s = _connect(server.port)
            s.sendall(_request("POST", "/v1/completions", body)[:-20])
            time.sleep(0.01)  # let the handler start reading the body
            s.close()
        deadline = time.monotonic() + 60
        while len(rec.matching("disconnected mid-body")) < n and time.monotonic() < deadline:
            time.sleep(0.05)
        lines = rec.matching("disconnected mid-body")
        assert len(lines) == n, rec.text()
        assert all(r.levelno == logging.INFO for r in lines)
        assert "POST /v1/completions" in lines[0].getMessage()
        assert not any(r.exc_info or r.levelno >= logging.ERROR for r in rec.records), rec.text()
        assert len(rec.text()) < n * 300
    assert _health_ms(server) < 1000
    server.wait_idle()


def test_client_disconnect_mid_stream_is_logged_once_without_traceback(server):
    payload = {"prompt": "Tell me a story.", "max_tokens": 200, "ignore_eos": True, "stream": True}
    with LogRecords() as rec:
        # held after its first token: the request is still running when the client hangs up
        # (it cannot have finished its 200 tokens first, however slow this thread is)
        with server.engine_held():
            with httpx.stream("POST", server.url + "/v1/completions", json=payload, timeout=60) as r:
                assert r.status_code == 200
                for line in r.iter_lines():
                    if line.startswith("data: {"):
                        break  # one chunk, then hang up
        server.wait_idle()
        finished = [r for r in rec.matching('"event":"request_finished"')]
        deadline = time.monotonic() + 60
        while not finished and time.monotonic() < deadline:
            time.sleep(0.05)
            finished = rec.matching('"event":"request_finished"')
        assert len(finished) == 1 and '"status":"client_disconnected"' in finished[0].getMessage()
        assert not any(r.exc_info or r.levelno >= logging.ERROR for r in rec.records), rec.text()


# ---------------------------------------------------------------------------- shutdown
def test_shutdown_answers_503_on_an_open_keep_alive_connection(tmp_path):
    from kvserve.config import EngineArgs

    with running_server(EngineArgs(**ENGINE_KWARGS), "m", shutdown_grace_s=2.0) as s:
        result = {}
        started = threading.Event()

        def stream():
            body = {"prompt": "Once upon a time", "max_tokens": 240, "ignore_eos": True, "stream": True}
            reasons = []
            with httpx.stream("POST", s.url + "/v1/completions", json=body, timeout=120) as r:
                result["status"] = r.status_code
                for line in r.iter_lines():
                    if line.startswith("data: {"):
                        started.set()
                        reasons.append(json.loads(line[6:])["choices"][0].get("finish_reason"))
            result["finish_reason"] = next((x for x in reasons if x), None)

        t = threading.Thread(target=stream, daemon=True)
        t.start()
        assert started.wait(30)
        keep = _connect(s.port)
        keep.sendall(_request("GET", "/health"))
        assert _read_response(keep).startswith(b"HTTP/1.1 200")
        s.server.should_exit = True  # what SIGTERM does, minus the signal
        # uvicorn's main loop sees it within ~0.1 s, then drains: wait for that, not a guess
        deadline = time.monotonic() + 30
        while not s.app.state.server_state.draining:
            assert time.monotonic() < deadline, "the server never started draining"
            time.sleep(0.01)
        body = json.dumps({"prompt": "hi", "max_tokens": 2}).encode()
        keep.sendall(_request("POST", "/v1/completions", body))
        raw, closed = _read_until_closed(keep, 5)
        keep.close()
        assert closed and raw, raw
        status, headers, payload = _parse(raw)
        assert status == 503 and headers["connection"] == "close"
        assert json.loads(payload)["error"]["code"] == "shutting_down"
        t.join(60)
        # the in-flight stream was not cut by the drain; the grace ran out, so it was aborted
        assert result == {"status": 200, "finish_reason": "abort"}, result


# ---------------------------------------------------------------------------- write deadline
# one token per digit: a ~6 MB /tokenize answer, more than the kernel's socket buffers on
# loopback (4 MB at most) can hold, so the server really has a backlog for the client
_DIGITS = "0123456789" * 150_000


def _tokenize_without_reading(port: int) -> socket.socket:
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # set before connect: no autotuning
    sock.settimeout(60)  # the first bytes wait for ~1 s of tokenization (more on a loaded machine)
    sock.connect(("127.0.0.1", port))
    sock.sendall(_request("POST", "/tokenize", json.dumps({"prompt": _DIGITS}).encode()))
    return sock


def test_client_that_never_reads_its_answer_is_cut_after_the_write_timeout(server):
    with LogRecords() as rec:
        sock = _tokenize_without_reading(server.port)
        try:
            deadline = time.monotonic() + 60
            while not rec.matching("took none of") and time.monotonic() < deadline:
                time.sleep(0.1)
            assert rec.matching("took none of"), rec.text()[-2000:]
            data, closed = _read_until_closed(sock, limit_s=5)
        finally:
            sock.close()
    assert closed
    assert len(data) < 4 * len(_DIGITS)  # cut short: the whole answer never came
    lines = rec.matching("took none of")
    assert len(lines) == 1 and lines[0].levelno == logging.INFO and not lines[0].exc_info
    assert f"within {WRITE_TIMEOUT_S:g} s" in lines[0].getMessage()
    assert _health_ms(server) < 1000


def test_slow_but_steady_reader_keeps_its_connection_past_the_write_timeout(server):
    with LogRecords() as rec:
        sock = _tokenize_without_reading(server.port)
        try:
            data = b""
            t0 = time.monotonic()
            while time.monotonic() - t0 < 3 * WRITE_TIMEOUT_S + 2:  # 16 KB per 50 ms
                time.sleep(0.05)
                chunk = sock.recv(16384)
                assert chunk, "closed while the client was reading"
                data += chunk
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1 << 20)
            deadline = time.monotonic() + 20
            while time.monotonic() < deadline:  # then take the rest at full speed
                if b"\r\n\r\n" in data:
                    _, headers, body = _parse(data)
                    if len(body) >= int(headers["content-length"]):
                        break
                chunk = sock.recv(1 << 20)
                assert chunk, "closed before the whole answer"
                data += chunk
        finally:
            sock.close()
    assert not rec.matching("took none of"), rec.text()[-2000:]
    status, _, body = _parse(data)
    assert status == 200
    assert json.loads(body)["count"] == len(_DIGITS)


# ---------------------------------------------------------------------------- settings
def test_serve_flags_and_their_defaults():
    from kvserve.entrypoints.openai.api_server import make_arg_parser

    ns = make_arg_parser().parse_args([])
    assert (ns.request_read_timeout_s, ns.max_connections, ns.keep_alive_timeout_s) == (10.0, 2048, 5.0)
    assert ns.response_write_timeout_s == 30.0
    ns = make_arg_parser().parse_args(
        ["--request-read-timeout-s", "2.5", "--max-connections", "7", "--keep-alive-timeout-s", "1"]
        + ["--response-write-timeout-s", "4"]
    )
    assert (ns.request_read_timeout_s, ns.max_connections, ns.keep_alive_timeout_s) == (2.5, 7, 1.0)
    assert ns.response_write_timeout_s == 4.0


@pytest.mark.parametrize(
    "kwargs, field",
    [
        (dict(request_read_timeout_s=0), "request_read_timeout_s"),
        (dict(request_read_timeout_s=float("nan")), "request_read_timeout_s"),
        (dict(max_connections=0), "max_connections"),
        (dict(response_write_timeout_s=0), "response_write_timeout_s"),
        (dict(response_write_timeout_s=float("nan")), "response_write_timeout_s"),
    ],
)
def test_connection_limits_reject_bad_values_naming_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        ConnectionLimits(**kwargs)


def test_uvicorn_config_rejects_a_bad_keep_alive_timeout():
    from kvserve.entrypoints.openai.api_server import uvicorn_config

    with pytest.raises(ValueError, match="keep_alive_timeout_s"):
        uvicorn_config(object(), keep_alive_timeout_s=0)
