"""Which LoRA adapter each simulated request runs with.

Adapters come from a trace or workload column (``lora_id``: an integer, 0 or empty = the base
model), or are drawn per request from a distribution over ``num_loras`` adapters with ids
``1..num_loras``: ``uniform``, or ``zipf`` (adapter ``k`` with weight ``k ** -alpha``: a few
popular adapters and a long tail, the shape S-LoRA and Punica evaluate with). Draws are
seeded, so a simulation repeats.
"""

from __future__ import annotations

import random

from kvserve.lora_request import LoRARequest

#: ``--lora-dist`` choices.
LORA_DISTRIBUTIONS = ("uniform", "zipf")


def draw_lora_ids(
    n: int, num_loras: int, dist: str = "uniform", alpha: float = 1.0, seed: int = 0
) -> list[int]:
    """``n`` adapter ids in ``1..num_loras`` drawn from ``dist``.

    Raises:
        ValueError: ``num_loras`` < 1, an unknown ``dist``, or ``alpha`` <= 0 (naming the flag).
    """
    if not isinstance(num_loras, int) or num_loras < 1:
        raise ValueError(f"--num-loras must be an integer >= 1, got {num_loras!r}.")
    if dist not in LORA_DISTRIBUTIONS:
        raise ValueError(f"--lora-dist must be one of {', '.join(LORA_DISTRIBUTIONS)}, got {dist!r}.")
    if not alpha > 0 or alpha == float("inf"):
        raise ValueError(f"--lora-zipf-alpha must be a finite number > 0, got {alpha!r}.")
    rng = random.Random(seed)
    ids = list(range(1, num_loras + 1))
    weights = None if dist == "uniform" else [k**-alpha for k in ids]
    return rng.choices(ids, weights=weights, k=n)


def sim_lora_request(lora_id: int) -> LoRARequest | None:
    """The simulator's stand-in adapter for id ``lora_id`` (None for 0: the base model); its
    path is never read."""
    if lora_id == 0:
        return None
    return LoRARequest(f"sim-lora-{lora_id}", lora_id, f"sim://lora/{lora_id}")
