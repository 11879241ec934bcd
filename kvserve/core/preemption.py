"""Prices of the two ways to preempt a group, for ``preemption_mode=auto``.

The scheduler never times the executor: it asks an injected ``PreemptionCost`` what each way
would cost in seconds of model time and takes the cheaper. The simulator injects one built from
its calibrated cost model (``kvserve.sim.preemption_cost``); without one the scheduler uses
``LinearPreemptionCost.default(block_size)``.

* recompute: the victim's tokens are prefilled again (prompt + generated, per live sequence),
  ``recompute_s(num_tokens, num_seqs)``;
* swap: its distinct device blocks are copied to host memory and later back,
  ``swap_s(num_blocks)`` (both copies).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

#: Seconds per re-prefilled token of the default price: ``CostModel.prefill_token_s`` of the
#: simulator's built-in coefficients (a fit to SplitwiseSim's measured Llama-2-70B on H100 x4
#: rows; ``kvserve/sim/cost_model.py``).
DEFAULT_RECOMPUTE_TOKEN_S = 8.07386575e-05
#: Seconds per token slot copied one way by a swap: the simulator's built-in ``swap_block_s``
#: (2.0e-05 s per block) over its 16-token blocks. A block costs this times ``block_size``:
#: the bytes a block holds grow with the tokens it holds.
DEFAULT_SWAP_TOKEN_S = 2.0e-05 / 16


class PreemptionCost(Protocol):
    """What the scheduler asks to choose a preemption mode (seconds of model time, >= 0)."""

    def recompute_s(self, num_tokens: int, num_seqs: int) -> float:
        """Seconds to prefill ``num_tokens`` tokens again, over ``num_seqs`` sequences."""
        ...

    def swap_s(self, num_blocks: int) -> float:
        """Seconds to copy ``num_blocks`` KV blocks out to host memory and back in."""
        ...


@dataclass(frozen=True)
class LinearPreemptionCost:
    """A price linear in the counts.

    ``recompute_s = token_s * num_tokens + seq_s * num_seqs``;
    ``swap_s = 2 * block_s * num_blocks`` (out, then back in).

    Attributes (seconds, >= 0): ``token_s`` per re-prefilled token, ``seq_s`` per re-prefilled
    sequence (its chunk's fixed work), ``block_s`` per block copied one way.

    Raises:
        ValueError: a negative or non-finite coefficient.
    """

    token_s: float
    block_s: float
    seq_s: float = 0.0

    def __post_init__(self) -> None:
        for name in ("token_s", "block_s", "seq_s"):
            v = getattr(self, name)
            if not isinstance(v, (int, float)) or not 0 <= v < float("inf"):
                raise ValueError(f"LinearPreemptionCost.{name} must be a finite number >= 0, got {v!r}.")

    @classmethod
    def default(cls, block_size: int) -> LinearPreemptionCost:
        """The built-in price for blocks of ``block_size`` tokens (module constants: the
        simulator's built-in coefficients)."""
        return cls(token_s=DEFAULT_RECOMPUTE_TOKEN_S, block_s=DEFAULT_SWAP_TOKEN_S * block_size)

    def recompute_s(self, num_tokens: int, num_seqs: int) -> float:
        return self.token_s * num_tokens + self.seq_s * num_seqs

    def swap_s(self, num_blocks: int) -> float:
        return 2.0 * self.block_s * num_blocks
