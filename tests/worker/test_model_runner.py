"""Our Llama-family model + paged attention against transformers on tiny random weights."""

import random

import pytest
import torch

from kvserve.sequence import ExecuteModelRequest
from tests.model_executor.helpers import (
    VOCAB,
    ToyAllocator,
    ToySeq,
    advance,
    all_logits,
    hf_logits,
    llama_config,
    make_worker,
    save_tiny,
    step_logits,
)

ATOL = 1e-4


def rand_ids(rng, n):
    return [rng.randrange(3, VOCAB) for _ in range(n)]


@pytest.fixture(params=["native", "torch", "pure_torch"])
def native(request, monkeypatch):
    """Run a test with the native decode-attention kernel, with torch decode attention, and with
    every native kernel off (``pure_torch``: what CUDA and ``KVSERVE_NATIVE=0`` run: torch
    RMSNorm, SiLU, rotary + ``index_copy_`` cache write, greedy sampling, float32 GEMMs on
    plain weights). The value says
    whether the native attention kernel is used."""
    if request.param == "pure_torch":
        from kvserve.ops import elementwise, gemm

        monkeypatch.setattr(elementwise, "supported", lambda *t: False)
        monkeypatch.setattr(gemm, "available", lambda: False)
    return request.param == "native"


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-llama")
    hf = save_tiny(path, llama_config())
    return path, hf


def test_batched_prefill_all_positions_match_hf(tiny):
    path, hf = tiny
    w = make_worker(path, block_size=4)
    rng = random.Random(1)
    seqs = [ToySeq(rand_ids(rng, n)) for n in (5, 11, 1, 17, 2)]
    alloc = ToyAllocator(64)
    md = [s.metadata(s.data.get_len(), alloc, 4) for s in seqs]
    got = all_logits(w, md)
    for s in seqs:
        ref = hf_logits(hf, s.data.get_token_ids())
        assert got[s.seq_id].shape == ref.shape
        assert torch.allclose(got[s.seq_id], ref, atol=ATOL), (got[s.seq_id] - ref).abs().max()
        assert ref.abs().max() > 0.1  # real values, not zeros


def test_chunked_prefill_and_decode_through_paged_cache(tiny, native):
    """Chunks of several sizes, mixed with decodes of another sequence in the same step."""
    path, hf = tiny
    w = make_worker(path, block_size=4, native=native)
    rng = random.Random(2)
    alloc = ToyAllocator(64, seed=3)
    a = ToySeq(rand_ids(rng, 14))
    b = ToySeq(rand_ids(rng, 6))
    # step 1: b prefilled whole, a's first chunk (5)
    # step 2: a chunk 6 + b decode; step 3: a chunk 3 (ends prompt) + b decode; then both decode
    plan = [(5, 6), (6, 1), (3, 1), (1, 1), (1, 1), (1, 1), (1, 1)]
    for ca, cb in plan:
        md = [
            a.metadata(ca, alloc, 4, do_sample=a.data.get_num_computed_tokens() + ca >= a.data.get_len()),
            b.metadata(cb, alloc, 4),
        ]
        got = all_logits(w, md)
        for s, n in ((a, ca), (b, cb)):
            c = s.data.get_num_computed_tokens()
            ref = hf_logits(hf, s.data.get_token_ids()[: c + n])[c : c + n]
            assert torch.allclose(got[s.seq_id], ref, atol=ATOL), (
                s.seq_id,
                (got[s.seq_id] - ref).abs().max(),
            )
        advance(md)
        for s in (a, b):
            if s.data.get_num_uncomputed_tokens() == 0:
                s.data.append_token_id(rng.randrange(3, VOCAB))
    assert len(a.table) >= 5  # spans several blocks


def test_sampled_rows_follow_metadata_order(tiny, native):
    """Sampler rows: groups in list order (do_sample only), seqs in seq_data order, last
    position of each chunk -- even though the runner batches decodes after prefills."""
    path, hf = tiny
    w = make_worker(path, block_size=4, native=native)
    rng = random.Random(4)
    alloc = ToyAllocator(64, seed=5)
    d = ToySeq(rand_ids(rng, 7))
    md = [d.metadata(7, alloc, 4)]
    step_logits(w, md)  # cache d's prompt
    advance(md)
    d.data.append_token_id(rng.randrange(3, VOCAB))
    p1, p2 = ToySeq(rand_ids(rng, 9)), ToySeq(rand_ids(rng, 12))
    md = [d.metadata(1, alloc, 4), p1.metadata(9, alloc, 4), p2.metadata(5, alloc, 4, do_sample=False)]
    logits = step_logits(w, md)
    assert logits.shape == (2, VOCAB) and logits.dtype == torch.float32
    assert torch.allclose(logits[0], hf_logits(hf, d.data.get_token_ids())[-1], atol=ATOL)
    assert torch.allclose(logits[1], hf_logits(hf, p1.data.get_token_ids())[-1], atol=ATOL)


def test_worker_greedy_generation_matches_hf_generate(tiny, native):
    path, hf = tiny
    w = make_worker(path, block_size=4, native=native)
    rng = random.Random(6)
    alloc = ToyAllocator(64, seed=7)
    seqs = [ToySeq(rand_ids(rng, n)) for n in (3, 10)]
    md = [s.metadata(s.data.get_len(), alloc, 4) for s in seqs]
    for _ in range(8):
        outs = w.execute_model(ExecuteModelRequest(md))
        advance(md)
        for s, o in zip(seqs, outs):
            assert len(o.samples) == 1 and o.samples[0].parent_seq_id == s.seq_id
            s.data.append_token_id(o.samples[0].output_token)
        md = [s.metadata(1, alloc, 4) for s in seqs]
    for s in seqs:
        prompt = s.data.prompt_token_ids
        with torch.no_grad():
            ref = hf.generate(
                torch.tensor([prompt], device=hf.device),
                max_new_tokens=8,
                min_new_tokens=8,
                do_sample=False,
                pad_token_id=0,
                attention_mask=torch.ones(1, len(prompt), dtype=torch.long, device=hf.device),
            )
        assert s.data.output_token_ids == ref[0, len(prompt) :].tolist()


def test_swap_out_and_in_to_other_blocks_then_decode(tiny, native):
    """Blocks swapped to CPU and back into different device blocks keep the sequence exact."""
    path, hf = tiny
    w = make_worker(path, block_size=4, num_gpu_blocks=32, num_cpu_blocks=8, native=native)
    rng = random.Random(8)
    alloc = ToyAllocator(32, seed=9)
    s = ToySeq(rand_ids(rng, 13))
    md = [s.metadata(13, alloc, 4)]
    step_logits(w, md)
    advance(md)
    s.data.append_token_id(rng.randrange(3, VOCAB))
    old = list(s.table)
    w.execute_model(ExecuteModelRequest([], blocks_to_swap_out={g: i for i, g in enumerate(old)}))
    w.cache_engine.device_cache[:, :, :, old] = 0.0  # the device copy is gone
    new = [alloc.free.pop() for _ in old]
    s.table = new
    md = [s.metadata(1, alloc, 4)]
    req = ExecuteModelRequest(md, blocks_to_swap_in={i: g for i, g in enumerate(new)})
    w.cache_engine.swap_in(req.blocks_to_swap_in)
    logits = step_logits(w, md)
    assert torch.allclose(logits[0], hf_logits(hf, s.data.get_token_ids())[-1], atol=ATOL)


def test_copy_on_write_block_then_diverge(tiny, native):
    """A forked sequence: shared full blocks, last partial block copied, then each decodes."""
    path, hf = tiny
    w = make_worker(path, block_size=4, native=native)
    rng = random.Random(10)
    alloc = ToyAllocator(64, seed=11)
    parent = ToySeq(rand_ids(rng, 10))  # 3 blocks, last one partial
    md = [parent.metadata(10, alloc, 4)]
    step_logits(w, md)
    advance(md)
    child = ToySeq([])
    child.data = parent.data.copy()
    fresh = alloc.free.pop()
    child.table = parent.table[:-1] + [fresh]
    parent.data.append_token_id(5)
    child.data.append_token_id(9)
    md = [parent.metadata(1, alloc, 4), child.metadata(1, alloc, 4)]
    outs = w.execute_model(ExecuteModelRequest(md, blocks_to_copy={parent.table[-1]: [fresh]}))
    assert [len(o.samples) for o in outs] == [1, 1]
    for s in (parent, child):
        logits = step_logits(w, [s.metadata(1, alloc, 4)])  # recompute the same token: same slots
        assert torch.allclose(logits[0], hf_logits(hf, s.data.get_token_ids())[-1], atol=ATOL)


@pytest.mark.parametrize(
    "rope",
    [
        {"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0},
        {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
            "rope_theta": 500000.0,
        },
    ],
)
def test_rope_scaling_matches_hf(tmp_path, rope):
    hf = save_tiny(tmp_path, llama_config(rope_parameters=rope, head_dim=32, num_attention_heads=4))
    w = make_worker(tmp_path, block_size=8)
    rng = random.Random(12)
    s = ToySeq(rand_ids(rng, 90))
    alloc = ToyAllocator(64)
    got = all_logits(w, [s.metadata(90, alloc, 8)])[s.seq_id]
    assert torch.allclose(got, hf_logits(hf, s.data.get_token_ids()), atol=ATOL)


def test_long_prefill_chunks_the_mlp(tiny, monkeypatch):
    from kvserve.model_executor.models.llama import LlamaMLP

    monkeypatch.setattr(LlamaMLP, "CHUNK_ROWS", 7)
    path, hf = tiny
    w = make_worker(path, block_size=4)
    rng = random.Random(19)
    seqs = [ToySeq(rand_ids(rng, n)) for n in (23, 9)]
    alloc = ToyAllocator(64)
    got = all_logits(w, [s.metadata(s.data.get_len(), alloc, 4) for s in seqs])
    for s in seqs:
        assert torch.allclose(got[s.seq_id], hf_logits(hf, s.data.get_token_ids()), atol=ATOL)


def test_tied_embeddings(tmp_path):
    hf = save_tiny(tmp_path, llama_config(tie_word_embeddings=True))
    w = make_worker(tmp_path)
    s = ToySeq([5, 6, 7, 8, 9, 10])
    got = all_logits(w, [s.metadata(6, ToyAllocator(64), 4)])[s.seq_id]
    assert torch.allclose(got, hf_logits(hf, s.data.get_token_ids()), atol=ATOL)


def test_qwen2_gqa_with_bias(tmp_path, native):
    from transformers import Qwen2Config

    cfg = Qwen2Config(
        vocab_size=VOCAB,
        hidden_size=96,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=6,
        num_key_value_heads=2,
        max_position_embeddings=256,
        tie_word_embeddings=False,
        use_sliding_window=False,
        rope_theta=1e6,
    )
    hf = save_tiny(tmp_path, cfg)
    w = make_worker(tmp_path, block_size=4, native=native)
    assert w.model.layers[0].self_attn.qkv_bias is not None
    rng = random.Random(13)
    alloc = ToyAllocator(64)
    s = ToySeq(rand_ids(rng, 9))
    md = [s.metadata(9, alloc, 4)]
    got = all_logits(w, md)[s.seq_id]
    assert torch.allclose(got, hf_logits(hf, s.data.get_token_ids()), atol=ATOL)
    advance(md)
    for _ in range(4):
        s.data.append_token_id(rng.randrange(3, VOCAB))
        md = [s.metadata(1, alloc, 4)]
        got = step_logits(w, md)[0]
        advance(md)
        assert torch.allclose(got, hf_logits(hf, s.data.get_token_ids())[-1], atol=ATOL)


def test_mistral_sliding_window_decode_past_window(tmp_path, native):
    """Window 6, block size 4: decode far past the window, with the block-table entries of
    blocks wholly outside the window pointing at another sequence's (live) blocks."""
    from transformers import MistralConfig

    W = 6
    cfg = MistralConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        sliding_window=W,
        tie_word_embeddings=False,
    )
    hf = save_tiny(tmp_path, cfg)
    w = make_worker(tmp_path, block_size=4, sliding_window=W, native=native)
    assert w.sliding_window == W
    rng = random.Random(14)
    alloc = ToyAllocator(64, seed=15)
    other = ToySeq(rand_ids(rng, 16))
    s = ToySeq(rand_ids(rng, 11))
    md = [other.metadata(16, alloc, 4), s.metadata(11, alloc, 4)]
    got = all_logits(w, md)
    for q in (other, s):  # prefill longer than the window: windowed causal mask
        assert torch.allclose(got[q.seq_id], hf_logits(hf, q.data.get_token_ids()), atol=ATOL)
    advance(md)
    for step in range(10):
        s.data.append_token_id(rng.randrange(3, VOCAB))
        pos = s.data.get_len() - 1
        md = [s.metadata(1, alloc, 4)]
        for b in range((pos - W + 1) // 4):  # blocks wholly outside the window: recycled
            md[0].block_tables[s.seq_id][b] = other.table[b % len(other.table)]
        got = step_logits(w, md)[0]
        advance(md)
        ref = hf_logits(hf, s.data.get_token_ids())[-1]
        assert torch.allclose(got, ref, atol=ATOL), (step, (got - ref).abs().max())
    # a chunked prefill whose chunk starts past the window
    t = ToySeq(rand_ids(rng, 20))
    for n in (9, 7, 4):
        md = [t.metadata(n, alloc, 4)]
        c = t.data.get_num_computed_tokens()
        got = all_logits(w, md)[t.seq_id]
        assert torch.allclose(got, hf_logits(hf, t.data.get_token_ids())[c : c + n], atol=ATOL)
        advance(md)


def test_bad_metadata_raises(tiny):
    path, _ = tiny
    w = make_worker(path, block_size=4)
    s = ToySeq([3, 4, 5, 6, 7])
    md = s.metadata(5, ToyAllocator(64), 4)
    md.block_tables[s.seq_id] = md.block_tables[s.seq_id][:1]
    with pytest.raises(ValueError, match="block table"):
        w.runner.prepare_inputs([md])
    md = s.metadata(6, ToyAllocator(64), 4)
    with pytest.raises(ValueError, match="past the sequence length"):
        w.runner.prepare_inputs([md])


def test_many_decodes_of_varied_lengths_use_buckets(tiny, native):
    """Decodes are sorted by length and split into buckets; every row still matches."""
    path, hf = tiny
    w = make_worker(path, block_size=4, num_gpu_blocks=256, native=native)
    rng = random.Random(16)
    alloc = ToyAllocator(256, seed=17)
    lens = [2, 60, 7, 33, 3, 58, 18, 41, 5, 64, 12, 27]
    seqs = [ToySeq(rand_ids(rng, n)) for n in lens]
    md = [s.metadata(s.data.get_len(), alloc, 4) for s in seqs]
    step_logits(w, md)
    advance(md)
    for _ in range(2):
        for s in seqs:
            s.data.append_token_id(rng.randrange(3, VOCAB))
        md = [s.metadata(1, alloc, 4) for s in seqs]
        inp = w.runner.prepare_inputs(md)
        if native:
            assert inp.attn.native_decode is not None and not inp.attn.decode_buckets
        else:
            assert len(inp.attn.decode_buckets) > 1
        got = step_logits(w, md)
        advance(md)
        for s, row in zip(seqs, got):  # sampler order == metadata order
            ref = hf_logits(hf, s.data.get_token_ids())[-1]
            assert torch.allclose(row, ref, atol=ATOL), (s.data.get_len(), (row - ref).abs().max())


def test_split_buckets_is_optimal():
    import itertools

    import numpy as np

    from kvserve.worker.model_runner import split_buckets

    rng = random.Random(18)
    for _ in range(30):
        a = np.sort(np.array([rng.randint(1, 40) for _ in range(rng.randint(1, 9))]))
        overhead = rng.choice([0, 5, 24, 100])

        def cost(ends, a=a, overhead=overhead):
            c, s = 0, 0
            for e in ends:
                c += (e - s) * a[e - 1] + overhead
                s = e
            return c

        best = min(
            cost(list(cuts) + [len(a)])
            for k in range(4)
            for cuts in itertools.combinations(range(1, len(a)), k)
        )
        ends = split_buckets(a, overhead, 4)
        assert ends[-1] == len(a) and ends == sorted(set(ends)) and len(ends) <= 4
        assert cost(ends) == best


def test_bfloat16_decode_native_and_torch_paths_agree_with_hf(tiny):
    """bfloat16 decodes of varied lengths: both attention paths stay within bfloat16 noise of
    the float32 HF logits, and of each other (the native kernel widens K/V to float32)."""
    path, hf = tiny
    rng = random.Random(19)
    lens = [3, 41, 9, 64, 17]
    prompts = [rand_ids(rng, n) for n in lens]
    nexts = [rng.randrange(3, VOCAB) for _ in lens]
    got = {}
    for native in (True, False):
        w = make_worker(path, block_size=4, num_gpu_blocks=128, native=native, dtype="bfloat16")
        alloc = ToyAllocator(128, seed=20)
        seqs = [ToySeq(list(p)) for p in prompts]
        md = [s.metadata(s.data.get_len(), alloc, 4) for s in seqs]
        step_logits(w, md)
        advance(md)
        for s, t in zip(seqs, nexts):
            s.data.append_token_id(t)
        md = [s.metadata(1, alloc, 4) for s in seqs]
        assert (w.runner.prepare_inputs(md).attn.native_decode is not None) == native
        got[native] = step_logits(w, md)
    for i, (p, t) in enumerate(zip(prompts, nexts)):
        ref = hf_logits(hf, p + [t])[-1].float().cpu()
        scale = ref.abs().max()
        for native in (True, False):
            err = (got[native][i].cpu() - ref).abs().max()
            assert err < 0.03 * scale, (native, lens[i], float(err), float(scale))
        assert (got[True][i] - got[False][i]).abs().max() < 0.03 * scale
