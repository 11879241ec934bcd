"""A linear step-latency model for the simulator, and a virtual clock.

``CostModel.step_time(num_prefill_tokens, num_decode_seqs, num_context_tokens)`` returns the
seconds one engine step takes::

    t = base_s + prefill_token_s * prefill_tokens + decode_seq_s * decode_seqs
        + context_token_s * context_tokens

where ``context_tokens`` is the number of KV positions the decodes attend over (sum of their
lengths). Swapping adds ``swap_block_s`` per block moved. A speculative verification is a
decode whose forward also takes its ``m`` drafts: those extra query tokens
(``num_verify_tokens``) cost ``prefill_token_s`` each, what any token processed in a forward
costs, while its context is read once (``context_tokens`` counts it once).

Multi-LoRA: a step holding ``num_loras`` distinct adapters adds ``lora_adapter_s`` per adapter
(the batched LoRA linear runs one segment per adapter in every layer). The default 0.5 ms is a
PLACEHOLDER, not a measurement: set it from a measured run before trusting LoRA what-ifs.

Default coefficients: a least-squares fit (weighted by 1/t, i.e. relative error) to the
measured Llama-2-70B, H100-80GB, tensor-parallel 4 rows of SplitwiseSim's performance model
(``../shared/traces/calibration/splitwise_sim_perf_model.csv``; Patel et al., "Splitwise",
ISCA'24; MIT). Each CSV row gives two samples: a prefill batch (``batch_size * prompt_size``
prefill tokens -> ``prompt_time``) and a decode step (``batch_size`` seqs over
``batch_size * (prompt_size + token_size / 2)`` context tokens -> ``token_time``). Rows with
more than 16,384 prefill tokens per batch are left out of the fit (prefill turns superlinear
there). Mean absolute relative error of the fit on the rows used: 8.6% (max 29%); across
all 105 rows: 9.0%. ``fit_splitwise_csv`` refits for any model/hardware/TP in the file.
"""

from __future__ import annotations

import csv
from dataclasses import dataclass

from kvserve.shared_data import shared_dir

SPLITWISE_CSV = str(shared_dir() / "traces" / "calibration" / "splitwise_sim_perf_model.csv")


@dataclass
class CostModel:
    """Seconds per step from token/sequence counts (see module docstring).

    Attributes (seconds): ``base_s`` fixed per-step cost; ``prefill_token_s`` per prefill
    token; ``decode_seq_s`` per decoding sequence; ``context_token_s`` per KV position read by
    decodes; ``swap_block_s`` per block swapped in or out; ``lora_adapter_s`` per distinct
    LoRA adapter in the step (a placeholder until measured; see the module docstring).
    """

    base_s: float = 2.79450670e-02
    prefill_token_s: float = 8.07386575e-05
    decode_seq_s: float = 1.92680266e-04
    context_token_s: float = 2.72815994e-07
    swap_block_s: float = 2.0e-05
    lora_adapter_s: float = 5.0e-04

    def step_time(
        self,
        num_prefill_tokens: int,
        num_decode_seqs: int,
        num_context_tokens: int,
        num_swapped_blocks: int = 0,
        num_verify_tokens: int = 0,
        num_loras: int = 0,
    ) -> float:
        """Seconds for one step. All counts are >= 0; an empty step costs 0.
        ``num_verify_tokens``: drafts verified this step (query tokens beyond each decode's
        one); ``num_loras``: distinct LoRA adapters the step's groups run with."""
        if num_prefill_tokens == 0 and num_decode_seqs == 0 and num_swapped_blocks == 0:
            return 0.0
        return (
            self.base_s
            + self.prefill_token_s * num_prefill_tokens
            + self.decode_seq_s * num_decode_seqs
            + self.context_token_s * num_context_tokens
            + self.swap_block_s * num_swapped_blocks
            + self.prefill_token_s * num_verify_tokens
            + self.lora_adapter_s * num_loras
        )


def fit_splitwise_csv(
    path: str = SPLITWISE_CSV,
    model: str = "llama2-70b",
    hardware: str = "h100-80gb",
    tensor_parallel: int = 4,
    max_prefill_tokens: int = 16384,
) -> CostModel:
    """Fit ``CostModel`` coefficients to one configuration of SplitwiseSim's perf model.

    Raises:
        ValueError: no row matches (model, hardware, tensor_parallel).
    """
    import numpy as np

    xs, ys = [], []
    with open(path, newline="") as f:
        for r in csv.DictReader(f):
            if (r["model"], r["hardware"], int(r["tensor_parallel"])) != (model, hardware, tensor_parallel):
                continue
            b, p, t = int(r["batch_size"]), int(r["prompt_size"]), int(r["token_size"])
            if b * p <= max_prefill_tokens:
                xs.append([1.0, b * p, 0.0, 0.0])
                ys.append(float(r["prompt_time"]) / 1000.0)
            xs.append([1.0, 0.0, b, b * (p + t / 2)])
            ys.append(float(r["token_time"]) / 1000.0)
    if not xs:
        raise ValueError(
            f"no rows for model={model!r} hardware={hardware!r} tensor_parallel={tensor_parallel} in {path}"
        )
    x, y = np.array(xs), np.array(ys)
    w = 1.0 / y
    coef, *_ = np.linalg.lstsq(x * w[:, None], y * w, rcond=None)
    return CostModel(
        base_s=float(coef[0]),
        prefill_token_s=float(coef[1]),
        decode_seq_s=float(coef[2]),
        context_token_s=float(coef[3]),
    )


class VirtualClock:
    """Simulated time in seconds. Callable (``clock()``) so it can be passed wherever a
    ``time.time``-like clock is expected; ``now()`` reads it; ``advance(dt)`` moves it."""

    def __init__(self, start: float = 0.0) -> None:
        self._now = float(start)

    def now(self) -> float:
        return self._now

    def __call__(self) -> float:
        return self._now

    def advance(self, dt: float) -> float:
        """Move time forward by ``dt`` >= 0 seconds. Raises ValueError if negative."""
        if dt < 0:
            raise ValueError(f"cannot move the clock backwards (dt={dt})")
        self._now += dt
        return self._now

    def set(self, t: float) -> None:
        """Jump forward to ``t`` (idle until the next arrival). Raises ValueError if in the past."""
        if t < self._now:
            raise ValueError(f"cannot move the clock backwards ({t} < {self._now})")
        self._now = float(t)


def default_cost_model(cost_model: CostModel | None = None) -> CostModel:
    return cost_model if cost_model is not None else CostModel()
