"""A seeded sampled request's random stream under speculation must not depend on the other
rows of its step. ``rejection_sample`` drew ``k`` uniforms per row with ``k`` the step's
largest draft count, so a seeded row verified beside a row with more drafts consumed more of
its generator than alone, and its later tokens changed (found with dynamic draft lengths,
where the neighbours' lengths follow the machine's timings: the same seed gave another text
on a second run). Each row now draws ``draws_per_row`` uniforms (the worker passes
``num_speculative_tokens``) whatever the batch."""

import pytest
import torch

from kvserve import SamplingParams
from kvserve.config import EngineArgs
from kvserve.engine.llm_engine import LLMEngine
from kvserve.sequence import ExecuteModelRequest
from kvserve.spec_decode.interfaces import Proposal, Proposer
from kvserve.spec_decode.rejection_sampler import rejection_sample
from tests.engine.test_e2e_tiny import run_engine

V, K_MAX = 7, 5


def _dists(gen, n):
    return torch.softmax(torch.randn(n, V, generator=gen), dim=-1)


def _seeded_row(neighbour_drafts: int):
    """Row 0: seeded, 2 drafts; row 1: unseeded with ``neighbour_drafts`` drafts. Returns row
    0's tokens, accepted count and its generator's next draw."""
    gen = torch.Generator().manual_seed(3)
    rows = torch.stack([_dists(gen, K_MAX + 1), _dists(gen, K_MAX + 1)])  # the same in every call
    k = max(2, neighbour_drafts)
    drafts = torch.zeros(2, k, dtype=torch.long)
    drafts[0, :2] = torch.tensor([1, 4])
    drafts[1, :neighbour_drafts] = 2
    seeded = torch.Generator().manual_seed(99)
    counts = torch.tensor([2, neighbour_drafts])
    toks, acc = rejection_sample(rows[:, : k + 1], drafts, None, [seeded, None], counts, draws_per_row=K_MAX)
    row = toks[0, : int(acc[0]) + 1].tolist()
    return row, int(acc[0]), torch.rand(1, generator=seeded).item()


def test_seeded_row_consumes_the_same_randomness_whatever_its_neighbours_draft():
    torch.manual_seed(0)
    # the seeded row's own distributions are the same in both (first row, first 3 positions)
    alone = _seeded_row(0)
    for n in (1, 2, 4, K_MAX):
        assert _seeded_row(n) == alone, n


def test_draws_per_row_below_the_step_k_is_refused():
    t = torch.full((1, 3, V), 1.0 / V)
    with pytest.raises(ValueError, match="draws_per_row"):
        rejection_sample(t, torch.zeros(1, 2, dtype=torch.long), None, [None], draws_per_row=1)


class _FixedProposer(Proposer):
    """Drafts ``drafts[first prompt token]`` tokens (guesses: token 5 repeated) per step."""

    def __init__(self, drafts: dict[int, int]):
        self.drafts = drafts

    def propose(self, req: ExecuteModelRequest, k: int) -> dict[int, Proposal]:
        out = {}
        for md in req.seq_group_metadata_list:
            m = min(k, md.num_speculative_tokens)
            if md.is_prompt or m < 1:
                continue
            for sid, data in md.seq_data.items():
                out[sid] = Proposal([5] * min(m, self.drafts[data.prompt_token_ids[0]]))
        return out


def test_seeded_text_does_not_depend_on_a_neighbours_drafts(tiny_llama_dir):
    """Engine: a seeded sampled request (1 draft a step) alone, and beside an unseeded sampled
    one drafting 4 a step, gives the same tokens."""
    spec = {
        "method": "ngram",
        "num_speculative_tokens": 4,
        "dynamic": False,
        "disable_below_acceptance_rate": 0.0,
    }
    eng = LLMEngine.from_engine_args(
        EngineArgs(
            model=str(tiny_llama_dir), num_gpu_blocks=128, block_size=4, seed=0, speculative_config=spec
        )
    )
    eng.executor.proposer = _FixedProposer({11: 1, 5: 4})
    seeded = SamplingParams(max_tokens=16, temperature=0.8, seed=7, ignore_eos=True)
    prompt = [11, 12, 13] * 6
    alone = run_engine(eng, [("a", prompt, seeded)])["a"]
    assert alone.spec_num_draft_tokens > 0
    busy = SamplingParams(max_tokens=16, temperature=1.0, ignore_eos=True)
    for i in range(3):
        outs = run_engine(eng, [(f"s{i}", prompt, seeded), (f"n{i}", [5, 6, 7, 8] * 8, busy)])
        assert outs[f"n{i}"].spec_num_draft_tokens > outs[f"s{i}"].spec_num_draft_tokens
        assert outs[f"s{i}"].outputs[0].token_ids == alone.outputs[0].token_ids
