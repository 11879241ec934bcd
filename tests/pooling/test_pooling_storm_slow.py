"""The pooling routes under abuse on a tiny BERT server: clients that hang up mid-batch, 64 at
once, batches at and past the count limit, over-long inputs. Every answer is a 200 or a 4xx
naming its field, the engine ends idle with every block free, and a normal request afterwards
still equals transformers' embedding."""

import asyncio

import httpx
import pytest
import torch
import torch.nn.functional as F

from kvserve.config import EngineArgs
from kvserve.field_limits import MAX_ITEMS
from tests.pooling.tiny_bert import TEXTS, reference_embeddings, save_tiny_bert
from tests.server_harness import running_server

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def bert_dir(tmp_path_factory):
    return save_tiny_bert(tmp_path_factory.mktemp("tiny-bert-storm"), pooling="MEAN", normalize=True)


async def _hang_up(url: str, n: int) -> None:
    """``n`` clients that send a full-size batch and disconnect before the answer."""
    limit = MAX_ITEMS["prompt"]
    async with httpx.AsyncClient(timeout=0.2) as c:

        async def one(i: int) -> None:
            body = (
                {"input": [TEXTS[3]] * limit}
                if i % 2
                else {"query": TEXTS[0], "documents": [TEXTS[3]] * (limit - 1)}
            )
            try:
                await c.post(url + ("/v1/embeddings" if i % 2 else "/rerank"), json=body)
            except httpx.TimeoutException:
                pass

        await asyncio.gather(*[one(i) for i in range(n)])


async def _many(url: str, n: int) -> list[httpx.Response]:
    async with httpx.AsyncClient(timeout=300) as c:
        bodies = [
            ("/v1/embeddings", {"input": TEXTS}),
            ("/score", {"text_1": TEXTS[0], "text_2": TEXTS}),
            ("/v1/embeddings", {"input": [TEXTS[0]] * (MAX_ITEMS["prompt"] + 1)}),
            ("/v1/embeddings", {"input": " ".join(["the"] * 100)}),
        ]
        return await asyncio.gather(*[c.post(url + p, json=b) for p, b in (bodies * n)[:n]])


def test_hang_ups_and_64_clients_leave_the_engine_idle_and_correct(bert_dir):
    ref = reference_embeddings(bert_dir, TEXTS, "MEAN", normalize=True)
    with running_server(EngineArgs(model=str(bert_dir)), "tiny-bert") as s:
        asyncio.run(_hang_up(s.url, 24))
        answers = asyncio.run(_many(s.url, 64))
        for r in answers:
            assert r.status_code in (200, 400), r.text
            if r.status_code == 400:
                assert r.json()["error"]["param"] == "input", r.text
        assert sum(r.status_code == 200 for r in answers) == 32
        stats = s.wait_idle()
        assert stats["num_free_gpu_blocks"] == stats["num_gpu_blocks"]
        r = httpx.post(s.url + "/v1/embeddings", json={"input": TEXTS}, timeout=60)
        got = torch.tensor([d["embedding"] for d in r.json()["data"]])
        assert F.cosine_similarity(got, ref).min() >= 0.99999
