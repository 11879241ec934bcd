"""``OpenAIServingModels`` without a model: ids are never reused, an unload waits for the
requests using the adapter (the engine drops it once, only when none is left), and every bad
call is an ``APIError`` that changes nothing."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvserve.entrypoints.openai.serving_engine import APIError
from kvserve.entrypoints.openai.serving_models import OpenAIServingModels
from kvserve.lora.peft import CONFIG_FILE, WEIGHTS_FILE


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    """Adapter-looking directories (the fake engine fails the one named ``bad``)."""
    root = tmp_path_factory.mktemp("adapters")
    out = {}
    for kind in ("ok", "bad"):
        (root / kind).mkdir()
        (root / kind / CONFIG_FILE).write_text("{}")
        (root / kind / WEIGHTS_FILE).write_bytes(b"")
        out[kind] = str(root / kind)
    return out


class FakeAsyncEngine:
    """Records the engine's adapter calls; ``remove_lora`` checks nobody uses the adapter."""

    def __init__(self, enabled: bool = True):
        self.loaded: set[int] = set()
        self.removed: list[int] = []
        self.in_use: dict[int, int] = {}  # lora_int_id -> live requests (kept by the test)
        self.engine = SimpleNamespace(
            lora_config=SimpleNamespace(max_loras=2) if enabled else None,
            add_lora=self._add,
            remove_lora=self._remove,
        )

    def _add(self, req) -> bool:
        if "bad" in req.lora_path:
            raise ValueError(f"lora_path {req.lora_path!r} has no adapter_config.json.")
        assert req.lora_int_id not in self.loaded and req.lora_int_id not in self.removed
        self.loaded.add(req.lora_int_id)
        return True

    def _remove(self, lora_int_id: int) -> bool:
        assert self.in_use.get(lora_int_id, 0) == 0, "adapter dropped while a request uses it"
        assert lora_int_id not in self.removed, "adapter dropped twice"
        self.removed.append(lora_int_id)
        self.loaded.discard(lora_int_id)
        return True

    def submit(self, fn, *args) -> asyncio.Future:
        fut = asyncio.get_running_loop().create_future()
        try:
            fut.set_result(fn(*args))
        except Exception as e:
            fut.set_exception(e)
        return fut

    async def add_lora(self, req) -> bool:
        return await self.submit(self._add, req)


NAMES = ["a", "b", "c"]
OPS = st.lists(
    st.tuples(st.sampled_from(["load", "unload", "start", "finish"]), st.sampled_from(NAMES), st.booleans()),
    max_size=40,
)


@settings(max_examples=150, deadline=None)
@given(ops=OPS)
def test_random_load_unload_and_requests_keep_the_invariants(dirs, ops):
    eng = FakeAsyncEngine()
    models = OpenAIServingModels(eng, ["base"])
    live: list = []  # LoRARequests of running requests
    ids: list[int] = []

    async def run():
        for op, name, good in ops:
            if op == "load":
                taken = name in [r.lora_name for r, _ in models.adapters()]
                try:
                    req = await models.load_lora_adapter(name, dirs["ok" if good else "bad"])
                except APIError as e:
                    assert e.status == 400
                    assert e.param == ("lora_name" if taken else "lora_path")
                    assert taken or not good
                    continue
                assert good and not taken
                assert not ids or req.lora_int_id > max(ids)  # never reused
                ids.append(req.lora_int_id)
            elif op == "unload":
                known = name in [r.lora_name for r, _ in models.adapters()]
                try:
                    await models.unload_lora_adapter(name)
                except APIError as e:
                    assert e.status == 404 and not known and e.param == "lora_name"
                    continue
                assert known
                with pytest.raises(APIError):
                    models.resolve(name)
            elif op == "start":
                try:
                    req = models.resolve(name)
                except APIError as e:
                    assert e.status == 404
                    continue
                models.acquire(req)
                eng.in_use[req.lora_int_id] = eng.in_use.get(req.lora_int_id, 0) + 1
                live.append(req)
            elif live:
                req = live.pop(0 if good else -1)
                eng.in_use[req.lora_int_id] -= 1
                models.release(req)
            await asyncio.sleep(0)
        served = {r.lora_int_id for r, _ in models.adapters()}
        # every id not served any more and not in use was dropped exactly once
        assert set(eng.removed) == {i for i in ids if i not in served and eng.in_use.get(i, 0) == 0}
        while live:
            req = live.pop()
            eng.in_use[req.lora_int_id] -= 1
            models.release(req)
        assert sorted(eng.removed) == sorted(i for i in ids if i not in served)
        assert eng.loaded == served
        assert models.resolve("base") is None and models.resolve(None) is None

    asyncio.run(run())


def test_lora_off_refuses_load_and_unload_with_400():
    models = OpenAIServingModels(FakeAsyncEngine(enabled=False), ["base"])

    async def run():
        for call in (models.load_lora_adapter("a", "/ok"), models.unload_lora_adapter("a")):
            with pytest.raises(APIError) as e:
                await call
            assert e.value.status == 400 and e.value.code == "lora_not_enabled"

    asyncio.run(run())
    with pytest.raises(ValueError, match="--lora-modules needs --enable-lora"):
        from kvserve.entrypoints.openai.serving_models import LoRAModulePath

        models.load_startup([LoRAModulePath("a", "/ok")])


def test_a_failed_load_frees_the_name_and_burns_its_id(dirs):
    eng = FakeAsyncEngine()
    models = OpenAIServingModels(eng, ["base"])

    async def run():
        with pytest.raises(APIError) as e:
            await models.load_lora_adapter("a", dirs["bad"])
        assert e.value.code == "invalid_lora_adapter" and dirs["bad"] in e.value.message
        req = await models.load_lora_adapter("a", dirs["ok"])
        assert req.lora_int_id == 2 and models.resolve("a") == req

    asyncio.run(run())


def test_an_empty_model_name_is_the_served_model_and_others_are_404():
    models = OpenAIServingModels(FakeAsyncEngine(), ["base"])
    assert models.resolve("") is None and models.resolve(None) is None and models.resolve("base") is None
    with pytest.raises(APIError) as e:
        models.resolve(" ")
    assert e.value.status == 404 and e.value.code == "model_not_found"
