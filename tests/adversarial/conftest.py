"""A real uvicorn server over the tiny random-weight Llama with a small KV cache, for the
adversarial server tests (cheap: no default-model forward passes)."""
import asyncio
import socket
import threading
import time
from dataclasses import dataclass

import pytest

TINY_SERVER_KWARGS = dict(block_size=4, num_gpu_blocks=24, num_cpu_blocks=8, max_model_len=128,
                          max_num_batched_tokens=128, max_num_seqs=8, watermark=0.0, seed=0)


@dataclass
class TinyServer:
    url: str
    engine: object
    async_engine: object

    def http(self, **kw):
        import httpx

        return httpx.Client(base_url=self.url, timeout=kw.pop("timeout", 60), **kw)

    def wait_idle(self, timeout: float = 20.0) -> dict:
        deadline = time.time() + timeout
        stats = None
        while time.time() < deadline:
            stats = self.engine.get_kv_cache_stats()
            if (not self.engine.has_unfinished_requests() and self.async_engine.num_in_flight == 0
                    and stats["num_free_gpu_blocks"] == stats["num_gpu_blocks"]
                    and stats["num_free_cpu_blocks"] == stats["num_cpu_blocks"]):
                return stats
            time.sleep(0.05)
        raise AssertionError(f"engine not idle after {timeout}s: kv={stats}")


@pytest.fixture(scope="module")
def tiny_server(tiny_llama_dir):
    import uvicorn

    from kvserve.config import EngineArgs
    from kvserve.engine.async_llm_engine import AsyncLLMEngine
    from kvserve.engine.llm_engine import LLMEngine
    from kvserve.entrypoints.openai.api_server import build_app

    engine = LLMEngine.from_engine_args(EngineArgs(model=str(tiny_llama_dir), **TINY_SERVER_KWARGS))
    async_engine = AsyncLLMEngine(engine)
    app = build_app(async_engine, "tiny", shutdown_grace_s=2.0)
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    srv = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="on",
                                        timeout_graceful_shutdown=3))
    thread = threading.Thread(target=lambda: asyncio.run(srv.serve(sockets=[sock])), daemon=True)
    thread.start()
    deadline = time.time() + 60
    while not srv.started:
        if time.time() > deadline or not thread.is_alive():
            raise RuntimeError("uvicorn did not start")
        time.sleep(0.05)
    yield TinyServer(url=f"http://127.0.0.1:{port}", engine=engine, async_engine=async_engine)
    srv.should_exit = True
    thread.join(30)
    sock.close()
