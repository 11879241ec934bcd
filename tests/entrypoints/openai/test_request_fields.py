"""Every request field of the official client's ``completions.create`` and
``chat.completions.create`` is implemented (works), harmless (accepted, ignored as documented)
or a 400 naming it; echo + logprobs and ``prompt_logprobs`` return the prompt's logprobs;
``use_beam_search`` equals transformers' beam search on the default model."""

import inspect

import openai
import pytest
import torch

from kvserve.entrypoints.openai.protocol import HARMLESS_FIELDS
from tests.entrypoints.openai.conftest import MODEL

pytestmark = pytest.mark.slow

SKIP = {"self", "extra_headers", "extra_query", "extra_body", "timeout"}
#: Structured outputs: covered by their own tests (tests/structured_output/).
OTHER_WORK = {"response_format"}
MSGS = [{"role": "user", "content": "Hi"}]


def client_params(create) -> set[str]:
    return {p for p in inspect.signature(create).parameters if p not in SKIP}


# field -> (value, check of the response or "400")
COMPLETION_FIELDS = {
    "model": (MODEL, None),
    "prompt": ("Hello", None),
    "best_of": (1, None),
    "echo": (True, lambda r: r.choices[0].text.startswith("Hello")),
    "frequency_penalty": (0.5, None),
    "logit_bias": ({"1": 5}, None),
    "logprobs": (
        2,
        lambda r: len(r.choices[0].logprobs.tokens) == len(r.choices[0].logprobs.token_logprobs) > 0,
    ),
    "max_tokens": (2, lambda r: r.usage.completion_tokens <= 2),
    "n": (2, lambda r: len(r.choices) == 2),
    "presence_penalty": (0.5, None),
    "seed": (3, None),
    "stop": (["zzz"], None),
    "stream": (True, "stream"),
    "stream_options": ({"include_usage": True}, "stream_usage"),
    "suffix": ("!", "400"),
    "temperature": (0.5, None),
    "top_p": (0.9, None),
    "user": ("u-1", None),
}
CHAT_FIELDS = {
    "messages": (MSGS, None),
    "model": (MODEL, None),
    "audio": ({"voice": "alloy", "format": "wav"}, "400"),
    "frequency_penalty": (0.5, None),
    "function_call": ("auto", "400"),
    "functions": ([{"name": "f", "parameters": {}}], "400"),
    "logit_bias": ({"1": 5}, None),
    "logprobs": (True, lambda r: r.choices[0].logprobs.content),
    "max_completion_tokens": (2, lambda r: r.usage.completion_tokens <= 2),
    "max_tokens": (2, lambda r: r.usage.completion_tokens <= 2),
    "metadata": ({"k": "v"}, None),
    "modalities": (["text"], "400"),
    "moderation": ({}, "400"),
    "n": (2, lambda r: len(r.choices) == 2),
    "prediction": ({"type": "content", "content": "x"}, "400"),
    "presence_penalty": (0.5, None),
    "prompt_cache_key": ("k", None),
    "prompt_cache_options": ({}, None),
    "prompt_cache_retention": ("24h", None),
    "reasoning_effort": ("low", "400"),
    "safety_identifier": ("s", None),
    "seed": (3, None),
    "service_tier": ("auto", None),
    "stop": (["zzz"], None),
    "store": (False, None),
    "stream": (True, "stream"),
    "stream_options": ({"include_usage": True}, "stream_usage"),
    "temperature": (0.5, None),
    "top_logprobs": (2, lambda r: len(r.choices[0].logprobs.content[0].top_logprobs) == 2),
    "top_p": (0.9, None),
    "user": ("u-1", None),
    "verbosity": ("low", "400"),
    "web_search_options": ({}, "400"),
    # tools alone: tool_choice "auto" (the default model's template ignores tools, so it answers
    # in text); tool_choice / parallel_tool_calls without tools are a 400 naming them
    "tools": (
        [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}],
        lambda r: r.choices[0].finish_reason in ("stop", "length", "tool_calls"),
    ),
    "tool_choice": ("required", "400"),
    "parallel_tool_calls": (False, "400"),
}


def test_field_tables_cover_the_installed_client():
    """A new client parameter must be classified here (implemented, harmless or 400)."""
    from openai.resources.chat.completions import Completions as Chat
    from openai.resources.completions import Completions

    assert client_params(Completions.create) == set(COMPLETION_FIELDS)
    assert client_params(Chat.create) - OTHER_WORK == set(CHAT_FIELDS)


def _call(create, base, name, value, expect):
    kw = dict(base)
    kw[name] = value
    if name == "stream_options":
        kw["stream"] = True
    if name == "top_logprobs":
        kw["logprobs"] = True
    if expect == "400":
        with pytest.raises(openai.BadRequestError) as ei:
            create(**kw)
        err = ei.value.body
        assert err["param"] == name and name in err["message"], err
        return
    r = create(**kw)
    if expect in ("stream", "stream_usage"):
        chunks = list(r)
        assert chunks and any(c.choices for c in chunks)
        if expect == "stream_usage":
            assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens > 0
        return
    assert r.choices, r
    if callable(expect):
        assert expect(r), (name, r)


@pytest.mark.parametrize("name", list(COMPLETION_FIELDS))
def test_completion_field(server, name):
    value, expect = COMPLETION_FIELDS[name]
    c = server.client()
    base = dict(model=MODEL, prompt="Hello", max_tokens=3)
    _call(c.completions.create, base, name, value, expect)
    if name in HARMLESS_FIELDS["completions"]:
        assert expect is None


@pytest.mark.parametrize("name", list(CHAT_FIELDS))
def test_chat_field(server, name):
    value, expect = CHAT_FIELDS[name]
    c = server.client()
    base = dict(model=MODEL, messages=MSGS, max_tokens=3)
    _call(c.chat.completions.create, base, name, value, expect)
    if name in HARMLESS_FIELDS["chat"]:
        assert expect is None


@pytest.mark.parametrize(
    "route,body",
    [
        ("/v1/completions", {"prompt": "x", "use_beam_search": True, "stream": True, "max_tokens": 2}),
        ("/tokenize", {"prompt": "x", "return_token_strs": True}),
        ("/v1/completions", {"prompt": "x", "guided_decoding_backend": "xgrammar"}),
    ],
)
def test_unimplemented_vllm_fields_are_a_400(server, route, body):
    with server.http() as h:
        r = h.post(route, json={"model": MODEL, **body})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] in body, err


# ---------------------------------------------------------------------------- prompt logprobs
def test_echo_with_logprobs_returns_the_prompt_first(server, default_hf_model):
    """OpenAI's shape (what lm-evaluation-harness reads): the prompt's tokens and logprobs,
    the first one null, then the completion's."""
    ids = server.engine.tokenizer("The capital of France is Paris", add_special_tokens=False).input_ids
    r = server.client().completions.create(
        model=MODEL, prompt=ids, echo=True, logprobs=2, max_tokens=1, temperature=0
    )
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(ids) + 1 == len(lp.token_logprobs) == len(lp.top_logprobs)
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    with torch.inference_mode():
        ref = torch.log_softmax(default_hf_model(torch.tensor([ids])).logits[0].float(), dim=-1)
    for i in range(1, len(ids)):
        assert lp.token_logprobs[i] == pytest.approx(float(ref[i - 1, ids[i]]), abs=1e-3)
        assert lp.tokens[i] in lp.top_logprobs[i] and len(lp.top_logprobs[i]) in (2, 3)
    assert lp.text_offset == sorted(lp.text_offset) and lp.text_offset[0] == 0
    assert r.choices[0].text.startswith("The capital of France is Paris")
    # the completion's own token: greedy = the top logprob of the last position
    assert lp.token_logprobs[-1] == pytest.approx(float(ref[-1].max()), abs=1e-3)


@pytest.mark.parametrize("stream", [False, True])
def test_echo_logprobs_streamed_equals_whole(server, stream):
    c = server.client()
    kw = dict(model=MODEL, prompt="One two three", echo=True, logprobs=1, max_tokens=3, temperature=0)
    whole = c.completions.create(**kw).choices[0]
    if not stream:
        return
    chunks = [ch.choices[0] for ch in c.completions.create(stream=True, **kw) if ch.choices]
    assert "".join(ch.text for ch in chunks) == whole.text
    tokens = [t for ch in chunks if ch.logprobs for t in ch.logprobs.token_logprobs]
    assert tokens == whole.logprobs.token_logprobs
    offsets = [t for ch in chunks if ch.logprobs for t in ch.logprobs.text_offset]
    assert offsets == whole.logprobs.text_offset


@pytest.mark.parametrize("route", ["completions", "chat"])
def test_prompt_logprobs_field_on_both_routes(server, default_hf_model, route):
    c = server.client()
    if route == "completions":
        ids = server.engine.tokenizer("Hello there, friend", add_special_tokens=False).input_ids
        r = c.completions.create(model=MODEL, prompt=ids, max_tokens=1, extra_body={"prompt_logprobs": 1})
        pl = r.model_extra.get("prompt_logprobs") if r.model_extra else None
        pl = pl or r.choices[0].model_extra["prompt_logprobs"]
    else:
        ids = server.engine.tokenizer.apply_chat_template(MSGS, add_generation_prompt=True, tokenize=True)
        if not isinstance(ids, list):
            ids = ids["input_ids"]
        r = c.chat.completions.create(
            model=MODEL, messages=MSGS, max_tokens=1, extra_body={"prompt_logprobs": 1}
        )
        pl = r.model_extra["prompt_logprobs"]
    assert len(pl) == len(ids) and pl[0] is None
    with torch.inference_mode():
        ref = torch.log_softmax(default_hf_model(torch.tensor([ids])).logits[0].float(), dim=-1)
    for i in range(1, len(ids)):
        entry = pl[i][str(ids[i])]
        assert entry["logprob"] == pytest.approx(float(ref[i - 1, ids[i]]), abs=1e-3)
        assert entry["rank"] >= 1 and isinstance(entry["decoded_token"], str)
        assert len(pl[i]) in (1, 2)


# ---------------------------------------------------------------------------- beam search
def test_use_beam_search_equals_transformers(server, default_hf_model):
    ids = server.engine.tokenizer("The capital of France is", add_special_tokens=False).input_ids
    r = server.client().completions.create(
        model=MODEL, prompt=ids, max_tokens=4, n=2, best_of=3, extra_body={"use_beam_search": True}
    )
    with torch.inference_mode():
        out = default_hf_model.generate(
            torch.tensor([ids]),
            attention_mask=torch.ones(1, len(ids), dtype=torch.long),
            num_beams=3,
            num_return_sequences=2,
            do_sample=False,
            max_new_tokens=4,
            eos_token_id=server.engine.eos_token_id,
            pad_token_id=0,
        )
    tok = server.engine.tokenizer
    expected = [tok.decode(row[len(ids) :], skip_special_tokens=True) for row in out.tolist()]
    assert [ch.text for ch in r.choices] == expected
    assert [ch.index for ch in r.choices] == [0, 1]
    server.wait_idle()


@pytest.mark.parametrize(
    "extra,param",
    [({"temperature": 0.7}, "temperature"), ({"n": 3, "best_of": 2}, "n"), ({"best_of": 11}, "best_of")],
)
def test_use_beam_search_refuses_what_it_does_not_use(server, extra, param):
    with server.http() as h:
        r = h.post(
            "/v1/completions",
            json={"model": MODEL, "prompt": "x", "max_tokens": 2, "use_beam_search": True, **extra},
        )
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param
