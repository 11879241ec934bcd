"""Speculative decoding behind the OpenAI server (real uvicorn on 127.0.0.1, tiny Llama):
streamed and whole answers agree with speculation off, and /metrics carries the counters."""

import pytest

from kvserve import SamplingParams
from kvserve.config import EngineArgs
from kvserve.engine.llm_engine import LLMEngine
from tests.server_harness import running_server

PROMPT = [3000, 4000, 5000] * 4 + [6000]
SPEC = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
ENGINE = dict(device="cpu", dtype="float32", block_size=4, num_gpu_blocks=128, enable_chunked_prefill=False)


@pytest.fixture(scope="module")
def reference_text(tiny_llama_dir):
    eng = LLMEngine.from_engine_args(EngineArgs(model=str(tiny_llama_dir), **ENGINE))
    eng.add_request(
        "ref", {"prompt_token_ids": PROMPT}, SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    )
    out = None
    while eng.has_unfinished_requests():
        for o in eng.step():
            out = o
    return out.outputs[0].text


@pytest.fixture(scope="module")
def server(tiny_llama_dir):
    spec = dict(SPEC, disable_below_acceptance_rate=0.0)
    with running_server(
        EngineArgs(model=str(tiny_llama_dir), speculative_config=spec, **ENGINE), "tiny"
    ) as s:
        yield s


def test_streamed_and_whole_answers_equal_speculation_off(server, reference_text):
    c = server.client()
    body = dict(model="tiny", prompt=PROMPT, max_tokens=40, temperature=0, extra_body={"ignore_eos": True})
    whole = c.completions.create(**body)
    assert whole.choices[0].text == reference_text
    assert whole.usage.completion_tokens == 40
    pieces = [ch.choices[0].text for ch in c.completions.create(stream=True, **body) if ch.choices]
    assert "".join(pieces) == reference_text
    server.wait_idle()
    metrics = server.http().get("/metrics").text
    drafted = [ln for ln in metrics.splitlines() if ln.startswith("vllm:spec_decode_num_draft_tokens_total")]
    accepted = [
        ln for ln in metrics.splitlines() if ln.startswith("kvserve:spec_decode_num_accepted_tokens_total")
    ]
    assert drafted and float(drafted[0].split()[-1]) > 0
    assert accepted and float(accepted[0].split()[-1]) > 0
    assert "vllm:spec_decode_num_accepted_tokens_per_pos_total" in metrics
    # the dynamic policy's choice: drafted tokens per decode sequence-step that had slots
    values = {
        ln.split("{")[0].split()[0]: float(ln.split()[-1])
        for ln in metrics.splitlines()
        if ln.startswith("kvserve:spec_decode_") and "position=" not in ln
    }
    opportunities = values["kvserve:spec_decode_num_draft_opportunities_total"]
    assert opportunities > 0
    assert values["kvserve:spec_decode_mean_draft_length"] == pytest.approx(
        values["kvserve:spec_decode_num_draft_tokens_total"] / opportunities
    )
    assert 0 < values["kvserve:spec_decode_mean_draft_length"] <= 4


def test_abort_by_disconnect_mid_stream_frees_blocks(server):
    c = server.client()
    stream = c.completions.create(
        model="tiny",
        prompt=PROMPT,
        max_tokens=200,
        temperature=0,
        stream=True,
        extra_body={"ignore_eos": True},
    )
    for i, _ in enumerate(stream):
        if i == 3:
            break
    stream.close()
    stats = server.wait_idle()
    assert stats["num_free_gpu_blocks"] == stats["num_gpu_blocks"]
