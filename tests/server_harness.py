"""Run kvserve's OpenAI app under a real uvicorn on 127.0.0.1 (free port, background thread)
for tests, and the handles tests use to reach it."""

import asyncio
import contextlib
import logging
import socket
import threading
import time
from dataclasses import dataclass


@dataclass
class RunningServer:
    """What tests get: the base URLs, the engine objects and the uvicorn server."""

    url: str
    port: int
    engine: object
    async_engine: object
    app: object
    server: object
    api_key: str | None = None

    @property
    def v1(self) -> str:
        return self.url + "/v1"

    def client(self, **kw):
        """The official OpenAI client, no retries."""
        import openai

        kw.setdefault("api_key", self.api_key or "unused")
        kw.setdefault("max_retries", 0)
        kw.setdefault("timeout", 120)
        return openai.OpenAI(base_url=self.v1, **kw)

    def async_client(self, **kw):
        import openai

        kw.setdefault("api_key", self.api_key or "unused")
        kw.setdefault("max_retries", 0)
        kw.setdefault("timeout", 120)
        return openai.AsyncOpenAI(base_url=self.v1, **kw)

    def http(self, **kw):
        """An httpx client with the API key."""
        import httpx

        headers = {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}
        headers.update(kw.pop("headers", {}))
        return httpx.Client(base_url=self.url, headers=headers, timeout=kw.pop("timeout", 120), **kw)

    def wait_idle(self, timeout: float = 120.0) -> dict:
        """Wait until the engine has no request and no KV block in use; return the KV stats.
        It returns as soon as that holds: the generous ``timeout`` (s) costs nothing when the
        engine is quick and keeps a loaded CI machine from failing a correct server."""
        deadline = time.time() + timeout
        stats = None
        while time.time() < deadline:
            stats = self.engine.get_kv_cache_stats()
            if (
                not self.engine.has_unfinished_requests()
                and self.async_engine.num_in_flight == 0
                and stats["num_free_gpu_blocks"] == stats["num_gpu_blocks"]
                and stats["num_free_cpu_blocks"] == stats["num_cpu_blocks"]
            ):
                return stats
            time.sleep(0.05)
        raise AssertionError(
            f"engine not idle after {timeout}s: unfinished="
            f"{self.engine.get_num_unfinished_requests()} in_flight="
            f"{self.async_engine.num_in_flight} kv={stats}"
        )

    @contextlib.contextmanager
    def engine_held(self, timeout: float = 120.0):
        """Inside the block, once a step has produced text the engine runs no further step
        until the block exits (or ``timeout`` s pass): a request that streams its first chunk
        inside the block is still running at its next check, however fast the engine and
        however slow the test's own thread. The event loop keeps serving meanwhile, and work
        queued for the engine thread (aborts, adapter calls) waits for the held step."""
        engine = self.engine
        real_step = engine.step
        patched_before = "step" in vars(engine)
        produced, release = threading.Event(), threading.Event()

        def step():
            if produced.is_set():
                release.wait(timeout)
            outs = real_step()
            # text, not just a token id: a stream sends no chunk for a token that decodes to
            # nothing yet, so holding before the first text would hold the first chunk too
            if any(c.text for o in outs for c in o.outputs):
                produced.set()
            return outs

        engine.step = step
        try:
            yield
        finally:
            if patched_before:
                engine.step = real_step
            else:
                del engine.step  # the class's method again
            release.set()


def _free_socket():
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    return sock


@contextlib.contextmanager
def running_server(
    engine_args,
    model_name: str,
    api_key: str | None = None,
    *,
    limits=None,
    keep_alive_timeout_s: float = 5.0,
    async_engine=None,
    **app_kwargs,
):
    """Build the engine from ``engine_args``, serve ``build_app(...)`` until the block exits,
    with the uvicorn config and server class ``kvserve serve`` uses (``limits``: a
    ``ConnectionLimits``; the shutdown drain of ``GracefulServer``). ``async_engine``: serve
    this one instead (e.g. a data-parallel engine; ``engine_args`` is then unused)."""
    from kvserve.engine.async_llm_engine import AsyncLLMEngine
    from kvserve.engine.llm_engine import LLMEngine
    from kvserve.entrypoints.openai.api_server import GracefulServer, build_app, uvicorn_config

    if async_engine is None:
        engine = LLMEngine.from_engine_args(engine_args)
        async_engine = AsyncLLMEngine(engine)
    else:
        engine = async_engine.engine
    app = build_app(async_engine, model_name, api_key=api_key, **app_kwargs)
    sock = _free_socket()
    port = sock.getsockname()[1]
    config = uvicorn_config(
        app,
        limits=limits,
        keep_alive_timeout_s=keep_alive_timeout_s,
        timeout_graceful_shutdown=5,
        log_level="warning",
    )
    state = app.state.server_state
    grace = app_kwargs.get("shutdown_grace_s", 5.0)
    srv = GracefulServer(
        config, state, grace_s=grace, on_grace_over=lambda: state.abort_all(async_engine)
    ).server
    thread = threading.Thread(
        target=lambda: asyncio.run(srv.serve(sockets=[sock])), daemon=True, name="uvicorn-test"
    )
    thread.start()
    deadline = time.time() + 60
    while not srv.started:
        if time.time() > deadline or not thread.is_alive():
            raise RuntimeError("uvicorn did not start")
        time.sleep(0.05)
    try:
        yield RunningServer(
            url=f"http://127.0.0.1:{port}",
            port=port,
            engine=engine,
            async_engine=async_engine,
            app=app,
            server=srv,
            api_key=api_key,
        )
    finally:
        srv.should_exit = True
        thread.join(30)
        sock.close()
        engine.shutdown()  # tensor-parallel peer ranks, if any


class LogRecords(logging.Handler):
    """Collects the records of the server's loggers while active (``with``): uvicorn's do not
    reach the root logger. ``level``: the lowest level kept; ``kvserve_info``: lower the
    ``kvserve`` logger to INFO meanwhile (restored after)."""

    def __init__(
        self,
        names: tuple[str, ...] = ("uvicorn", "uvicorn.error", "kvserve"),
        level: int = logging.DEBUG,
        kvserve_info: bool = True,
    ):
        super().__init__(level=level)
        self.names, self.kvserve_info = names, kvserve_info
        self.records: list[logging.LogRecord] = []
        self.mu = threading.Lock()

    def emit(self, record):
        with self.mu:
            self.records.append(record)

    def __enter__(self):
        self.saved = {}
        for name in self.names:
            lg = logging.getLogger(name)
            self.saved[name] = lg.level
            lg.addHandler(self)
            if name == "kvserve" and self.kvserve_info:
                lg.setLevel(logging.INFO)
        return self

    def __exit__(self, *exc):
        for name in self.names:
            lg = logging.getLogger(name)
            lg.removeHandler(self)
            lg.setLevel(self.saved[name])

    def text(self) -> str:
        with self.mu:
            return "\n".join(self.format(r) for r in self.records)

    def matching(self, s: str) -> list[logging.LogRecord]:
        with self.mu:
            return [r for r in self.records if s in r.getMessage()]
