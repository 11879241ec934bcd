"""The KV cache as a context limit at admission: a request whose sequences at prompt +
max_tokens can never fit the pool is a ValueError naming ``max_tokens`` (offline; a 400 over
HTTP), instead of an answer cut short with ``finish_reason="length"``; a request without
``max_tokens`` runs to where the cache is full. A model whose every layer slides a window keeps
only the window's blocks and is not checked; one whose windows differ per layer keeps every
block and is."""

from __future__ import annotations

import pytest

from kvserve import LLM, SamplingParams
from kvserve.engine.kv_capacity import KVCapacity
from tests.golden import TEST_DEVICE

# 8 blocks of 16 tokens: 128 token slots (a sequence of 129 tokens: its last is never cached),
# well under max_model_len 256
CACHE = dict(device=TEST_DEVICE, dtype="float32", block_size=16, num_gpu_blocks=8, max_model_len=256, seed=0)
PROMPT = [5 + (37 * i) % 2000 for i in range(100)]


def greedy(max_tokens, **kw):
    return SamplingParams(**{"max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True, **kw})


@pytest.fixture(scope="module")
def llm(tiny_llama_dir):
    engine = LLM(model=str(tiny_llama_dir), **CACHE)
    yield engine
    engine.shutdown()


def test_blocks_needed_counts_shared_prompt_blocks_once():
    cap = KVCapacity(num_blocks=8, block_size=16, num_total_blocks=8, watermark_blocks=0)
    assert cap.num_tokens == 128
    assert cap.blocks_needed(100, 29, 1) == 8 and cap.blocks_needed(100, 30, 1) == 9
    # n=2: 6 full prompt blocks shared, each sequence its own copy of block 7 (and on)
    assert cap.blocks_needed(100, 13, 2) == 6 + 2 * 1 and cap.blocks_needed(100, 14, 2) == 6 + 2 * 2
    assert cap.max_new_tokens(100, 1) == 29 and cap.max_new_tokens(100, 2) == 13
    assert cap.max_new_tokens(128, 1) == 1  # a full cache still yields its one token
    # identical (greedy) sequences: every full block shared, one partial block per extra sequence
    assert (
        cap.blocks_needed(90, 23, 2, identical=True) == 7 + 1
        and cap.max_new_tokens(90, 2, identical=True) == 23
    )


def test_max_tokens_past_the_cache_is_a_value_error(llm):
    with pytest.raises(ValueError, match=r"max_tokens \(50\) = 150 > 129 tokens.*at most 29"):
        llm.generate([{"prompt_token_ids": PROMPT}], greedy(50), use_tqdm=False)
    out = llm.generate([{"prompt_token_ids": PROMPT}], greedy(29), use_tqdm=False)[0]
    assert len(out.outputs[0].token_ids) == 29 and out.outputs[0].finish_reason == "length"


def test_n_sequences_are_counted_as_the_block_manager_holds_them(llm):
    with pytest.raises(ValueError, match=r"each of n=2 sequences, 10 KV blocks > .*at most 13"):
        llm.generate([{"prompt_token_ids": PROMPT}], greedy(14, n=2, temperature=1.0), use_tqdm=False)
    # the largest that passes really runs to the end in both sequences
    out = llm.generate([{"prompt_token_ids": PROMPT}], greedy(13, n=2, temperature=1.0), use_tqdm=False)[0]
    assert [len(c.token_ids) for c in out.outputs] == [13, 13]


def test_greedy_sequences_share_their_blocks_through_a_recompute(llm):
    prompt = PROMPT[:90]  # 5 full blocks + 10 tokens
    # sampled: each sequence holds its own blocks after the 5 shared ones -> (8 - 5) // 2 = 1 each
    with pytest.raises(ValueError, match=r"at most 7 here"):
        llm.generate([{"prompt_token_ids": prompt}], greedy(8, n=2, temperature=1.0), use_tqdm=False)
    # greedy: the same tokens, so a recompute shares every full block; one partial block each
    with pytest.raises(ValueError, match=r"at most 23 here"):
        llm.generate([{"prompt_token_ids": prompt}], greedy(24, n=2), use_tqdm=False)
    out = llm.generate([{"prompt_token_ids": prompt}], greedy(23, n=2), use_tqdm=False)[0]
    assert [len(c.token_ids) for c in out.outputs] == [23, 23]
    assert out.outputs[0].token_ids == out.outputs[1].token_ids


def test_default_max_tokens_stops_where_the_cache_is_full(llm):
    out = llm.generate([{"prompt_token_ids": PROMPT}], greedy(None), use_tqdm=False)[0]
    assert len(out.outputs[0].token_ids) == 129 - 100 and out.outputs[0].finish_reason == "length"
    assert out.outcome == "finished"


def test_a_prompt_past_the_whole_cache_is_still_rejected_by_admission(llm):
    out = llm.generate([{"prompt_token_ids": PROMPT * 2}], greedy(4), use_tqdm=False)[0]
    assert out.outcome == "rejected" and "13 KV blocks > 8" in out.error


def _save(tmp_path, config, tokenizer_dir):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path)
    AutoTokenizer.from_pretrained(tokenizer_dir).save_pretrained(tmp_path)
    return tmp_path


def test_a_window_on_every_layer_is_not_held_to_the_whole_sequence(tmp_path, default_tokenizer_dir):
    from transformers import MistralConfig

    config = MistralConfig(
        vocab_size=49152,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        sliding_window=32,
        tie_word_embeddings=False,
    )
    llm = LLM(model=str(_save(tmp_path, config, default_tokenizer_dir)), **CACHE)
    try:
        assert llm.llm_engine.kv_capacity() is None
        # 150 tokens in a 128-slot cache: the blocks behind the window are dropped as it goes
        out = llm.generate([{"prompt_token_ids": PROMPT}], greedy(50), use_tqdm=False)[0]
        assert len(out.outputs[0].token_ids) == 50 and out.outputs[0].finish_reason == "length"
    finally:
        llm.shutdown()


def test_windows_that_differ_per_layer_are_held_to_the_whole_sequence(tmp_path, default_tokenizer_dir):
    from transformers import Gemma3TextConfig

    config = Gemma3TextConfig(
        vocab_size=49152,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        sliding_window=8,
        layer_types=["sliding_attention", "full_attention"],
        max_position_embeddings=256,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    )
    llm = LLM(model=str(_save(tmp_path, config, default_tokenizer_dir)), **CACHE)
    try:
        with pytest.raises(ValueError, match=r"150 > 129 tokens"):
            llm.generate([{"prompt_token_ids": PROMPT}], greedy(50), use_tqdm=False)
        out = llm.generate([{"prompt_token_ids": PROMPT}], greedy(29), use_tqdm=False)[0]
        assert len(out.outputs[0].token_ids) == 29
    finally:
        llm.shutdown()


def test_tenant_with_a_control_character_is_a_value_error(llm):
    with pytest.raises(ValueError, match=r"tenant must not contain control characters.*U\+0000"):
        llm.generate([{"prompt_token_ids": PROMPT}], greedy(2), tenant="a\x00b", use_tqdm=False)
