"""The simulator's cost model as the scheduler's price of preemption (``preemption_mode=auto``).

The scheduler (``kvserve.core``) cannot import the simulator; the simulator hands it this
adapter, so ``auto`` weighs recompute against swap with the same coefficients that time the
simulated steps.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvserve.sim.cost_model import CostModel


@dataclass(frozen=True)
class CostModelPreemptionCost:
    """``kvserve.core.preemption.PreemptionCost`` from a ``CostModel``.

    * ``recompute_s(tokens, seqs)``: what those tokens add to the steps that prefill them:
      ``prefill_token_s`` per token, ``prefill_seq_s`` per sequence, and the causal attention
      pairs of one chunk per sequence (``tokens / seqs`` long: ``L * (L + 1) / 2`` pairs,
      ``prefill_attn_s`` per 1,000) -- an upper bound when the prefill is cut into chunks;
      ``base_s`` is left out (the steps run anyway).
    * ``swap_s(blocks)``: ``2 * swap_block_s * blocks`` (out, then back in).
    """

    cost_model: CostModel

    def recompute_s(self, num_tokens: int, num_seqs: int) -> float:
        cm = self.cost_model
        t = cm.prefill_token_s * num_tokens + cm.prefill_seq_s * num_seqs
        if cm.prefill_attn_s and num_seqs > 0:
            length = num_tokens / num_seqs
            t += cm.prefill_attn_s * num_seqs * length * (length + 1) / 2 / 1000
        return t

    def swap_s(self, num_blocks: int) -> float:
        return 2.0 * self.cost_model.swap_block_s * num_blocks
