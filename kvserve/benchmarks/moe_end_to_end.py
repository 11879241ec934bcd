"""``kvserve bench moe --end-to-end``: tiny MoE checkpoints run whole, their MoE layers on the
grouped path against the per-expert torch loop, in one process.

For each family (a tiny Mixtral and a tiny Qwen3-MoE built from transformers' config classes,
random weights, the default model's tokenizer) it writes the checkpoint to a temporary folder,
loads it once, and runs the same greedy requests (the first ``--num-prompts`` of the workload,
64 by default: w64's prompts, each output capped at ``--max-tokens``) with every MoE layer
(``FusedMoE.mode``) set in turn to:

- ``per_expert``: ``fused_moe.per_expert_loop`` after torch routing, what transformers' own MoE
  block does (per expert: its tokens indexed, the gate/up and down ``F.linear``, an
  ``index_add_`` back);
- ``auto``: what the model runs (on CPU the native routing and one native call for all experts).

The two runs alternate for ``--rounds`` rounds after one warm-up run each. Reported per run:
wall seconds, output tokens/s, and the seconds spent inside the MoE layers (forward hooks; the
router included); ``moe speedup`` is per-expert MoE seconds / auto MoE seconds (best round of
each), the figure the 2x target is about. The greedy outputs of both are compared: sequences
equal token for token (float rounding differs between the two paths, so a near-tie may turn).
"""

from __future__ import annotations

import tempfile
import time
from pathlib import Path

import torch

#: ``name -> (transformers config class name, fields)`` of the tiny checkpoints (the default
#: tokenizer's vocabulary, hidden 64, two sparse layers).
FAMILIES = {
    "tiny-mixtral": (
        "MixtralConfig",
        dict(intermediate_size=128, num_local_experts=8, num_experts_per_tok=2),
    ),
    "tiny-qwen3-moe": (
        "Qwen3MoeConfig",
        dict(
            head_dim=16,
            intermediate_size=128,
            moe_intermediate_size=32,
            num_experts=32,
            num_experts_per_tok=4,
            norm_topk_prob=True,
            decoder_sparse_step=1,
        ),
    ),
}
BASE = dict(
    vocab_size=49152,
    hidden_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=1024,
    tie_word_embeddings=False,
    bos_token_id=1,
    eos_token_id=2,
)
IMPLS = ("per_expert", "auto")


def write_checkpoint(name: str, out: Path, tokenizer_dir: Path, seed: int = 0) -> Path:
    """A tiny random-weight checkpoint of family ``name`` (``FAMILIES``) with the tokenizer of
    ``tokenizer_dir``, saved into ``out``; returns ``out``."""
    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer

    cls_name, fields = FAMILIES[name]
    cfg = getattr(transformers, cls_name)(**BASE, **fields)
    torch.manual_seed(seed)
    hf = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    hf.save_pretrained(out)
    AutoTokenizer.from_pretrained(tokenizer_dir).save_pretrained(out)
    return out


class _MoeClock:
    """Seconds spent inside every ``FusedMoE`` of ``model`` (forward hooks)."""

    def __init__(self, model: torch.nn.Module):
        from kvserve.model_executor.layers.fused_moe import FusedMoE

        self.layers = [m for m in model.modules() if isinstance(m, FusedMoE)]
        self.seconds = 0.0
        self._t0 = 0.0
        for m in self.layers:
            m.register_forward_pre_hook(self._pre)
            m.register_forward_hook(self._post)

    def _pre(self, *_):
        self._t0 = time.perf_counter()

    def _post(self, *_):
        self.seconds += time.perf_counter() - self._t0

    def set_mode(self, mode: str) -> None:
        for m in self.layers:
            m.mode = mode


def run_family(
    name: str,
    requests: list,
    dtype: str,
    max_tokens: int,
    rounds: int,
    tokenizer_dir: Path,
    log=print,
) -> dict:
    """Both implementations on family ``name``: ``{"per_expert": [run, ...], "auto": [...],
    "equal_sequences": n, "sequences": m}``, each run ``{"wall_s", "moe_s", "output_tokens"}``."""
    from kvserve import LLM, SamplingParams

    with tempfile.TemporaryDirectory(prefix=f"kvserve-{name}-") as tmp:
        path = write_checkpoint(name, Path(tmp), tokenizer_dir)
        llm = LLM(model=str(path), dtype=dtype, device="cpu", seed=0, enable_prefix_caching=False)
        try:
            clock = _MoeClock(llm.llm_engine.executor.model)
            prompts = [{"prompt_token_ids": r.prompt_token_ids} for r in requests]
            params = [
                SamplingParams(max_tokens=min(r.output_len, max_tokens), temperature=0.0, ignore_eos=True)
                for r in requests
            ]
            result: dict = {impl: [] for impl in IMPLS}
            tokens: dict = {}
            for rnd in range(rounds + 1):  # round 0: warm-up
                for impl in IMPLS:
                    clock.set_mode(impl)
                    clock.seconds = 0.0
                    t = time.perf_counter()
                    outs = llm.generate(prompts, params, use_tqdm=False)
                    wall = time.perf_counter() - t
                    toks = [list(o.outputs[0].token_ids) for o in outs]
                    tokens[impl] = toks
                    if rnd == 0:
                        continue
                    run = {"wall_s": wall, "moe_s": clock.seconds, "output_tokens": sum(map(len, toks))}
                    result[impl].append(run)
                    log(f"  {name} {impl:10s} round {rnd}: {wall:.2f} s, MoE layers {clock.seconds:.3f} s")
            a, b = tokens["auto"], tokens["per_expert"]
            result["equal_sequences"] = sum(x == y for x, y in zip(a, b))
            result["sequences"] = len(a)
            result["layers"] = len(clock.layers)
        finally:
            llm.shutdown()
    return result
