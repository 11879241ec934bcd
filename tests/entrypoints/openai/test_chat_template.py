"""Chat templates given by the user: ``--chat-template`` (a file or inline Jinja2), a request's
``chat_template`` (only on a server that trusts them) and ``chat_template_kwargs``, on the
server's chat and ``/tokenize`` routes and on ``LLM.chat``."""

import re

import pytest

from kvserve.entrypoints.chat_template import check_chat_template, check_template_kwargs, load_chat_template
from tests.adversarial.conftest import TINY_SERVER_KWARGS
from tests.server_harness import running_server

#: Shows the roles and an optional ``flavour`` variable, so a rendering proves which template
#: and which variables were used.
TEMPLATE = (
    "{% for m in messages %}<<{{ m.role }}>>{{ m.content }}{% endfor %}"
    "{% if flavour %}[{{ flavour }}]{% endif %}{% if add_generation_prompt %}<<assistant>>{% endif %}"
)
OTHER = "{% for m in messages %}{{ m.content }}|{% endfor %}"
MSGS = [{"role": "user", "content": "Hi there"}]


def _ids(tok, text):
    return tok(text, add_special_tokens=False)["input_ids"]


@pytest.fixture(scope="module", params=[False, True], ids=["untrusted", "trusted"])
def tmpl_server(request, tiny_llama_dir):
    from kvserve.config import EngineArgs

    with running_server(
        EngineArgs(model=str(tiny_llama_dir), **TINY_SERVER_KWARGS),
        "tiny",
        shutdown_grace_s=2.0,
        chat_template=TEMPLATE,
        trust_request_chat_template=request.param,
    ) as s:
        s.trusted = request.param
        yield s


def test_server_template_and_its_kwargs_render_tokenize_and_chat(tmpl_server):
    tok = tmpl_server.engine.tokenizer
    with tmpl_server.http() as h:
        plain = h.post("/tokenize", json={"messages": MSGS})
        flavoured = h.post("/tokenize", json={"messages": MSGS, "chat_template_kwargs": {"flavour": "salt"}})
        chat = h.post(
            "/v1/chat/completions",
            json={"messages": MSGS, "max_tokens": 1, "chat_template_kwargs": {"flavour": "salt"}},
        )
    assert plain.json()["tokens"] == _ids(tok, "<<user>>Hi there<<assistant>>")
    assert flavoured.json()["tokens"] == _ids(tok, "<<user>>Hi there[salt]<<assistant>>")
    assert chat.status_code == 200, chat.text
    assert chat.json()["usage"]["prompt_tokens"] == len(flavoured.json()["tokens"])


@pytest.mark.parametrize("route", ["/tokenize", "/v1/chat/completions"])
def test_reserved_template_kwargs_are_a_400_naming_the_key(tmpl_server, route):
    with tmpl_server.http() as h:
        extra = {"max_tokens": 1} if route != "/tokenize" else {}
        r = h.post(route, json={"messages": MSGS, "chat_template_kwargs": {"tokenize": True}, **extra})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == "chat_template_kwargs" and "chat_template_kwargs.tokenize" in err["message"]


def test_request_template_only_on_a_trusting_server(tmpl_server):
    tok = tmpl_server.engine.tokenizer
    with tmpl_server.http() as h:
        r = h.post("/tokenize", json={"messages": MSGS, "chat_template": OTHER})
        bad = h.post("/tokenize", json={"messages": MSGS, "chat_template": "{% for %}"})
    for resp in [r, bad] if not tmpl_server.trusted else [bad]:
        assert resp.status_code == 400, resp.text
        assert resp.json()["error"]["param"] == "chat_template"
    if tmpl_server.trusted:
        assert r.json()["tokens"] == _ids(tok, "Hi there|")
        assert "line 1" in bad.json()["error"]["message"]
    else:
        assert "--trust-request-chat-template" in r.json()["error"]["message"]


def test_load_chat_template_reads_a_file_or_inline_and_names_bad_ones(tmp_path):
    f = tmp_path / "t.jinja"
    f.write_text(TEMPLATE)
    assert load_chat_template(str(f)) == TEMPLATE
    assert load_chat_template(OTHER) == OTHER
    with pytest.raises(ValueError, match="--chat-template: 'chatml.jinja' is neither a file nor"):
        load_chat_template("chatml.jinja")
    (tmp_path / "bad.jinja").write_text("{% if %}")
    with pytest.raises(
        ValueError, match=r"--chat-template '.*bad.jinja': the chat template is not valid Jinja2"
    ):
        load_chat_template(str(tmp_path / "bad.jinja"))
    with pytest.raises(ValueError, match="x: the chat template is empty"):
        check_chat_template("  \n", "x")


def test_check_template_kwargs_keeps_free_names_and_refuses_reserved():
    assert check_template_kwargs({"enable_thinking": False}, "x") == {"enable_thinking": False}
    assert check_template_kwargs(None, "x") == {}
    with pytest.raises(ValueError, match="x.messages"):
        check_template_kwargs({"messages": []}, "x")


def test_llm_chat_takes_a_template_and_its_kwargs(tiny_llama_dir):
    from kvserve import LLM, SamplingParams

    llm = LLM(model=str(tiny_llama_dir), max_model_len=128, num_gpu_blocks=16, block_size=8)
    tok = llm.get_tokenizer()
    out = llm.chat(
        MSGS,
        SamplingParams(max_tokens=1),
        use_tqdm=False,
        chat_template=TEMPLATE,
        chat_template_kwargs={"flavour": "salt"},
    )
    assert out[0].prompt_token_ids == _ids(tok, "<<user>>Hi there[salt]<<assistant>>")
    with pytest.raises(ValueError, match="chat_template_kwargs.tokenize"):
        llm.chat(MSGS, chat_template_kwargs={"tokenize": False})


def test_llm_chat_passes_tools_to_the_template(tiny_llama_dir):
    from kvserve import LLM, SamplingParams

    template = (
        "{% for t in tools or [] %}[{{ t.function.name }}:{{ t.function.parameters.type }}]{% endfor %}"
        "{% for m in messages %}{{ m.content }}{% endfor %}"
    )
    tools = [{"type": "function", "function": {"name": "wave", "parameters": {"type": "object"}}}]
    llm = LLM(model=str(tiny_llama_dir), max_model_len=128, num_gpu_blocks=16, block_size=8)
    tok = llm.get_tokenizer()
    out = llm.chat(MSGS, SamplingParams(max_tokens=1), use_tqdm=False, chat_template=template, tools=tools)
    assert out[0].prompt_token_ids == _ids(tok, "[wave:object]Hi there")
    with pytest.raises(ValueError, match=r"tools\[0\]\.function"):
        llm.chat(MSGS, chat_template=template, tools=[{"type": "function"}])


def test_llm_takes_vllms_chat_template_keyword_as_chats_default(tiny_llama_dir):
    from kvserve import LLM, SamplingParams

    llm = LLM(
        model=str(tiny_llama_dir), chat_template=TEMPLATE, max_model_len=128, num_gpu_blocks=16, block_size=8
    )
    tok = llm.get_tokenizer()
    out = llm.chat(
        MSGS, SamplingParams(max_tokens=1), use_tqdm=False, chat_template_kwargs={"flavour": "salt"}
    )
    assert out[0].prompt_token_ids == _ids(tok, "<<user>>Hi there[salt]<<assistant>>")
    assert out[0].prompt == "<<user>>Hi there[salt]<<assistant>>"  # the rendered text, as vLLM gives it
    own = llm.chat(
        MSGS, SamplingParams(max_tokens=1), use_tqdm=False, chat_template="{{ messages[0].content }}"
    )
    assert own[0].prompt_token_ids == _ids(tok, "Hi there")  # a call's own template wins
    llm.shutdown()
    with pytest.raises(ValueError, match="chat_template"):
        LLM(model=str(tiny_llama_dir), chat_template="{% for %}")  # fails before the engine loads


def test_llm_chat_without_any_template_names_the_model_and_the_keyword(tiny_llama_dir):
    from kvserve import LLM, SamplingParams

    llm = LLM(model=str(tiny_llama_dir), max_model_len=128, num_gpu_blocks=16, block_size=8)
    tok = llm.get_tokenizer()
    tok.chat_template = None  # a base model's tokenizer, as a pretrained GGUF gives it
    with pytest.raises(
        ValueError, match=re.escape(str(tiny_llama_dir)) + r".*no chat template.*chat_template="
    ):
        llm.chat(MSGS, SamplingParams(max_tokens=1), use_tqdm=False)
    out = llm.chat(
        MSGS, SamplingParams(max_tokens=1), use_tqdm=False, chat_template="{{ messages[0].content }}"
    )
    assert out[0].prompt_token_ids == _ids(tok, "Hi there")
