"""What a tensor-parallel peer receives each step (``tp_executor.for_peers``): the runner builds
the same inputs from it as from the driver's full metadata (same tokens, positions, rows that
get logits, prompt-logprob targets), and its pickled size does not grow with the context."""

from __future__ import annotations

import pickle
import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvserve.sampling_params import SamplingParams
from kvserve.sequence import ExecuteModelRequest, SequenceData, SequenceGroupMetadata
from kvserve.worker.tp_executor import SequenceWindow, for_peers
from tests.model_executor.helpers import llama_config

BS = 4


def _runner():
    from kvserve.model_executor.models.llama import LlamaForCausalLM
    from kvserve.worker.model_runner import ModelRunner

    model = LlamaForCausalLM(llama_config(num_hidden_layers=1))
    return ModelRunner(model, BS, 512, None, sampler=None, device="cpu", use_native=False)


@st.composite
def _groups(draw):
    """Metadata of 1-4 groups: prompts of 1-40 tokens, 0-10 outputs, some computed prefix,
    a chunk up to the end, sometimes asking for prompt logprobs."""
    mds = []
    for g in range(draw(st.integers(1, 4))):
        prompt = draw(st.lists(st.integers(0, 255), min_size=1, max_size=40))
        outputs = draw(st.lists(st.integers(0, 255), max_size=10)) if draw(st.booleans()) else []
        data = SequenceData(prompt, outputs)
        total = data.get_len()
        c = draw(st.integers(0, total - 1))
        data.set_num_computed_tokens(c)
        n = draw(st.integers(1, total - c))
        pl = draw(st.sampled_from([None, 1, 3]))
        plf = draw(st.integers(0, len(prompt))) if pl is not None else None
        mds.append(
            SequenceGroupMetadata(
                request_id=f"g{g}",
                is_prompt=c < len(prompt),
                seq_data={g: data},
                sampling_params=SamplingParams(temperature=0.0, prompt_logprobs=pl),
                block_tables={g: list(range(g * 20, g * 20 + -(-(c + n) // BS)))},
                token_chunk_size=n,
                do_sample=c + n == total or draw(st.booleans()),
                prompt_logprobs_from=plf,
            )
        )
    return mds


def _same(a, b) -> bool:
    if a is None or b is None:
        return a is b
    return torch.equal(a, b)


@settings(max_examples=60, deadline=None)
@given(mds=_groups())
def test_peers_build_the_same_step_inputs_from_windows(mds):
    runner = _runner()
    full = runner.prepare_inputs(mds)
    peer_mds = for_peers(ExecuteModelRequest(seq_group_metadata_list=mds)).seq_group_metadata_list
    assert all(isinstance(d, SequenceWindow) for md in peer_mds for d in md.seq_data.values())
    peer = runner.prepare_inputs(pickle.loads(pickle.dumps(peer_mds)))
    assert torch.equal(full.input_ids, peer.input_ids)
    assert torch.equal(full.positions, peer.positions)
    assert torch.equal(full.sample_rows, peer.sample_rows)  # the same rows get logits
    assert _same(full.prompt_rows, peer.prompt_rows)
    assert _same(full.prompt_targets, peer.prompt_targets)
    assert full.seq_rows == peer.seq_rows


def test_peer_step_size_does_not_grow_with_context():
    """32 decoding sequences: the peers' step is the same few KiB at 128 and 4,096 tokens of
    context but for the block tables (the whole token lists were 19 KiB and 406 KiB)."""
    rng = random.Random(0)

    def step(ctx: int) -> int:
        mds = []
        for i in range(32):
            d = SequenceData([rng.randrange(49000) for _ in range(ctx)], [rng.randrange(49000)])
            d.set_num_computed_tokens(ctx)
            md = SequenceGroupMetadata(f"r{i}", False, {i: d}, SamplingParams(), {i: [i]}, token_chunk_size=1)
            mds.append(md)
        return len(pickle.dumps(for_peers(ExecuteModelRequest(seq_group_metadata_list=mds))))

    short, long = step(128), step(4096)
    assert long < short * 1.2, (short, long)
    assert long < 8 * 1024


def test_window_refuses_reads_outside_the_step():
    d = SequenceData(list(range(10)), [10, 11])
    d.set_num_computed_tokens(4)
    w = SequenceWindow(d, 3)
    assert (w.get_len(), w.get_prompt_len(), w.get_num_computed_tokens()) == (12, 10, 4)
    assert w.token_range(4, 8) == [4, 5, 6, 7]  # the chunk and the token after it
    assert w.token_at(5) == 5
    with pytest.raises(IndexError, match=r"tokens 3..5 are outside this step's window 4..8"):
        w.token_range(3, 5)
    with pytest.raises(IndexError):
        w.token_at(8)
    end = SequenceData([1, 2, 3], [4])
    end.set_num_computed_tokens(3)
    assert SequenceWindow(end, 1).token_range(3, 5) == [4]  # clipped at the end, like a slice


@settings(max_examples=50, deadline=None)
@given(
    prompt=st.lists(st.integers(0, 9), min_size=1, max_size=8),
    out=st.lists(st.integers(0, 9), max_size=8),
    lo=st.integers(0, 16),
    hi=st.integers(0, 16),
)
def test_token_range_is_a_slice_of_the_token_ids(prompt, out, lo, hi):
    d = SequenceData(prompt, out)
    assert d.token_range(lo, hi) == d.get_token_ids()[lo:hi]
    if lo < d.get_len():
        assert d.token_at(lo) == d.get_token_ids()[lo]
