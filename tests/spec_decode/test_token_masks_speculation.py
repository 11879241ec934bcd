"""``bad_words`` and ``allowed_token_ids`` under speculative decoding: every verified position
is masked with the output as it stands there (drafts before it included), so greedy output
equals transformers' greedy with the same masks, drafts accepted or not."""

import torch

from kvserve import SamplingParams
from kvserve.config import EngineArgs
from kvserve.engine.input_processor import bad_words_token_ids
from kvserve.engine.llm_engine import LLMEngine
from kvserve.sequence import ExecuteModelRequest
from kvserve.spec_decode.interfaces import Proposal, Proposer
from tests.engine.test_e2e_tiny import run_engine
from tests.engine.test_sampling_fields import PROMPT, hf_greedy

MAX_NEW = 12


class _Oracle(Proposer):
    """Drafts the expected continuation (``answer``), so whole chunks are verified at once."""

    def __init__(self, answer: list[int]):
        self.answer = answer

    def propose(self, req: ExecuteModelRequest, k: int) -> dict[int, Proposal]:
        out = {}
        for md in req.seq_group_metadata_list:
            m = min(k, md.num_speculative_tokens)
            if md.is_prompt or m < 1:
                continue
            for sid, data in md.seq_data.items():
                done = data.get_output_len()
                drafts = self.answer[done : done + m]
                if drafts:
                    out[sid] = Proposal(drafts)
        return out


def test_masks_hold_at_every_verified_position(tiny_llama_dir, tiny_hf_model):
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
    plain = hf_greedy(tiny_hf_model, PROMPT, MAX_NEW)
    words = [eng.tokenizer.decode(plain[2:4]), eng.tokenizer.decode(plain[6:7])]
    seqs = bad_words_token_ids(words, eng.tokenizer, 49152)
    allowed = sorted(set(range(100, 40000, 37)) | set(plain))
    keep = torch.zeros(49152, dtype=torch.bool)
    keep[allowed] = True

    def mask(x, out):
        x = x.masked_fill(~keep, float("-inf"))
        for s in seqs:
            if len(s) == 1 or (len(out) >= len(s) - 1 and out[len(out) - len(s) + 1 :] == s[:-1]):
                x[s[-1]] = float("-inf")
        return x

    ref = hf_greedy(tiny_hf_model, PROMPT, MAX_NEW, mask)
    assert ref != plain
    # drafting the answer verifies chunks whose later positions need the drafts as output;
    # drafting the unmasked answer offers the banned tokens, which must be rejected
    for answer in (ref, plain):
        eng.executor.proposer = _Oracle(answer)
        params = SamplingParams(
            max_tokens=MAX_NEW, temperature=0, ignore_eos=True, bad_words=words, allowed_token_ids=allowed
        )
        out = run_engine(eng, [("r", PROMPT, params)])["r"]
        assert out.spec_num_draft_tokens > 0
        assert out.outputs[0].token_ids == ref, answer is ref
    eng.shutdown()
