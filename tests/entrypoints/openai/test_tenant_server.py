"""The OpenAI ``user`` field is the request's tenant (``SequenceGroup.tenant``) on completions,
chat and responses: it reaches the scheduler (the per-tenant /metrics series count its tokens),
and one longer than ``MAX_TENANT_CHARS`` is a 400 naming ``user``. Offline, ``LLM.generate``'s
greedy tokens are the same under ``fcfs`` and ``fair``."""

from __future__ import annotations

import pytest

from kvserve.field_limits import MAX_TENANT_CHARS
from tests.server_harness import running_server

MODEL = "tiny"
MSGS = [{"role": "user", "content": "Hi"}]


@pytest.fixture(scope="module")
def server(tiny_llama_dir):
    from kvserve.config import EngineArgs

    args = EngineArgs(
        model=str(tiny_llama_dir), device="cpu", dtype="float32", num_gpu_blocks=128, seed=0, policy="fair"
    )
    with running_server(args, MODEL) as s:
        yield s


def _served(server, tenant: str) -> float:
    with server.http() as h:
        text = h.get("/metrics").text
    key = f'kvserve:tenant_served_tokens_total{{model_name="{MODEL}",tenant="{tenant}"}}'
    lines = [ln for ln in text.splitlines() if ln.startswith(key)]
    return float(lines[0].split()[-1]) if lines else 0.0


@pytest.mark.parametrize(
    "route,body",
    [
        ("/v1/completions", {"prompt": "Hello", "max_tokens": 3}),
        ("/v1/chat/completions", {"messages": MSGS, "max_tokens": 3}),
        ("/v1/responses", {"input": "Hi", "max_output_tokens": 3}),
    ],
)
def test_user_is_the_tenant_and_its_length_is_bounded(server, route, body):
    tenant = "tenant" + route.replace("/", "-")
    with server.http() as h:
        r = h.post(route, json={"model": MODEL, **body, "user": tenant})
        assert r.status_code == 200, r.text
        usage = r.json()["usage"]
        served = usage.get("total_tokens")
        assert served and _served(server, tenant) == served
        r = h.post(route, json={"model": MODEL, **body, "user": "u" * (MAX_TENANT_CHARS + 1)})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == "user"
    assert f"at most {MAX_TENANT_CHARS} characters" in err["message"]
    assert "u" * 100 not in err["message"]  # the value is not echoed back
    with server.http() as h:
        ok = h.post(route, json={"model": MODEL, **body, "user": "v" * MAX_TENANT_CHARS})
    assert ok.status_code == 200, ok.text


def test_greedy_tokens_are_the_same_under_fcfs_and_fair(tiny_llama_dir):
    from kvserve import LLM, SamplingParams

    prompts = [f"Request {i}: tell me about {w}" for i, w in enumerate(["cats", "dogs", "sea", "sky"] * 3)]
    tenants = ["a"] * 8 + ["b", "c", "b", "c"]
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    outs = {}
    for policy in ("fcfs", "fair"):
        llm = LLM(
            model=str(tiny_llama_dir),
            device="cpu",
            dtype="float32",
            num_gpu_blocks=24,  # small: requests queue and some are preempted
            block_size=4,
            max_num_seqs=4,
            seed=0,
            policy=policy,
        )
        res = llm.generate(prompts, params, use_tqdm=False, tenant=tenants)
        outs[policy] = [list(r.outputs[0].token_ids) for r in res]
        assert all(len(t) == 8 for t in outs[policy])
        with pytest.raises(ValueError, match="tenant has 2 entries for 12 prompts"):
            llm.generate(prompts, params, use_tqdm=False, tenant=["a", "b"])
    assert outs["fair"] == outs["fcfs"]


@pytest.mark.parametrize(
    "tenant,match",
    [
        (5, "tenant must be a string, a list of strings .* got int"),
        ({"a": 1}, "tenant must be a string, a list of strings .* got dict"),
        (["a"], "tenant has 1 entries for 2 prompts"),
        (["a", 3], "tenant must be a string or None, got int"),
    ],
)
def test_offline_tenant_of_the_wrong_type_is_a_value_error(tiny_llm_fair, tenant, match):
    from kvserve import SamplingParams

    with pytest.raises(ValueError, match=match):
        tiny_llm_fair.generate(["a", "b"], SamplingParams(max_tokens=1), tenant=tenant, use_tqdm=False)
    assert not tiny_llm_fair.llm_engine.has_unfinished_requests()


@pytest.fixture(scope="module")
def tiny_llm_fair(tiny_llama_dir):
    from kvserve import LLM

    llm = LLM(model=str(tiny_llama_dir), device="cpu", dtype="float32", num_gpu_blocks=16, policy="fair")
    yield llm
    llm.shutdown()


def test_an_empty_tenant_is_the_default_tenant(tiny_llm_fair):
    from kvserve import SamplingParams

    engine = tiny_llm_fair.llm_engine
    engine.add_request("empty-tenant", "hello", SamplingParams(max_tokens=1), tenant="")
    group = next(g for g in engine.scheduler.waiting if g.request_id == "empty-tenant")
    engine.add_request("no-tenant", "hello", SamplingParams(max_tokens=1))
    group2 = next(g for g in engine.scheduler.waiting if g.request_id == "no-tenant")
    assert group.tenant is None and group2.tenant is None
    engine.abort_request(["empty-tenant", "no-tenant"])
    for _ in range(3):  # the aborts are reported by the next step
        if engine.has_unfinished_requests():
            engine.step()
    assert not engine.has_unfinished_requests()
