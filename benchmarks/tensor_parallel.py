"""Tensor-parallel step time: TP=T against TP=1 at a few batch shapes, with the all-reduce and
gather shares.

Each engine (``LLMEngine``, float32 on CPU; gloo between the ranks) runs, per shape:

* ``decode:B``: B sequences of a ``--context``-token prompt, all decoding; the figure is the
  median of ``--steps`` pure-decode steps;
* ``prefill:N``: one N-token prompt; the figure is the median over ``--steps`` prompts of the
  one step that prefills it.

The all-reduce share is what the driver (rank 0) spent inside ``TensorParallelGroup.all_reduce``
(two per layer: after o and after down; one more after the embedding where it is sharded, on
CUDA or with ``KVSERVE_TP_SHARD_EMBEDDING=1``) over those steps, divided by their wall time. It includes the wait for the slower rank, so on an
oversubscribed machine it also measures load imbalance, not only the transfer; the "transfer"
column times the same all-reduces (same shape, same count) with every rank doing nothing else
(``Worker.time_all_reduce``). The gather share is the same for ``TensorParallelGroup.gather``:
the vocab-parallel LM head's ``[rows, vocab / T]`` float32 logits slices collected on the
driver, one per step (only the sampled rows: B for ``decode:B``, 1 for ``prefill:N``), with its
idle transfer time from ``Worker.time_gather``.

The model is a random-weight Llama (default: 8 heads / 4 KV heads of 64, hidden 512,
intermediate 1536, ``--layers`` 30, vocab 49152: SmolLM2-135M's size with head counts that
divide by 2 and 4) with the default model's tokenizer, or ``--model DIR`` (a HF directory).

    python benchmarks/tensor_parallel.py --json-out tp.json                       # full run
    python benchmarks/tensor_parallel.py --layers 2 --shapes decode:4,prefill:64 --steps 3   # smoke

``KVSERVE_NUM_THREADS`` sets the threads of every rank (default: the cores split evenly).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run from a checkout


def build_model(path: str, layers: int) -> str:
    """Save the random-weight benchmark Llama (and the default tokenizer) into ``path``."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig

    from kvserve.model_executor.model_loader import resolve_model_dir

    cfg = LlamaConfig(
        vocab_size=49152,
        hidden_size=512,
        intermediate_size=1536,
        num_hidden_layers=layers,
        num_attention_heads=8,
        num_key_value_heads=4,
        max_position_embeddings=4096,
        tie_word_embeddings=True,
        bos_token_id=1,
        eos_token_id=2,
    )
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).save_pretrained(path)
    AutoTokenizer.from_pretrained(resolve_model_dir(None)).save_pretrained(path)
    return path


def _engine(model: str, tp: int, max_len: int):
    from kvserve.config import EngineArgs
    from kvserve.engine.llm_engine import LLMEngine

    return LLMEngine.from_engine_args(
        EngineArgs(
            model=model,
            dtype="float32",
            device="cpu",
            tensor_parallel_size=tp,
            max_model_len=max_len,
            max_num_batched_tokens=max(2048, max_len),
            num_gpu_blocks=max_len // 16 * 70,
        )
    )


def _ar(engine) -> tuple[int, float, int, float]:
    """The driver's ``(all-reduce calls, seconds, gather calls, seconds)`` so far."""
    tp = getattr(engine.executor, "tp", None)
    if tp is None:
        return (0, 0.0, 0, 0.0)
    return (tp.stats.calls, tp.stats.seconds, tp.gather_stats.calls, tp.gather_stats.seconds)


def measure(engine, shape: str, context: int, steps: int, seed: int) -> dict:
    """One shape's ``{step_ms, all_reduce_ms, all_reduce_share, all_reduce_calls, gather_ms,
    gather_share, gather_calls, ...}`` (medians of the step time; collective totals over the
    timed steps divided by their count)."""
    import random

    from kvserve.sampling_params import SamplingParams

    rng = random.Random(seed)
    kind, n = shape.split(":")
    n = int(n)
    times: list[float] = []
    tot = [0, 0.0, 0, 0.0]  # all-reduce calls, seconds, gather calls, seconds

    def timed_step():
        before = _ar(engine)
        t = time.perf_counter()
        engine.step()
        dt = time.perf_counter() - t
        return dt, [b - a for a, b in zip(before, _ar(engine))]

    prompt = lambda k: {"prompt_token_ids": [rng.randrange(3, 49000) for _ in range(k)]}  # noqa: E731
    if kind == "decode":
        params = SamplingParams(max_tokens=steps + 4, temperature=0.0, ignore_eos=True)
        for i in range(n):
            engine.add_request(f"d{i}", prompt(context), params)
        while any(g.is_prefill() for g in engine.scheduler.running) or engine.scheduler.waiting:
            engine.step()
        engine.step()  # first all-decode step (warm)
        for _ in range(steps):
            dt, d = timed_step()
            times.append(dt)
            tot = [x + y for x, y in zip(tot, d)]
        engine.abort_request([f"d{i}" for i in range(n)])
        while engine.has_unfinished_requests():
            engine.step()
    elif kind == "prefill":
        params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
        for i in range(steps + 1):
            engine.add_request(f"p{i}", prompt(n), params)
            dt, d = timed_step()
            while engine.has_unfinished_requests():
                engine.step()
            if i:  # the first is warm-up
                times.append(dt)
                tot = [x + y for x, y in zip(tot, d)]
    else:
        raise ValueError(f"shape {shape!r}: expected decode:B or prefill:N")
    # every shape's step has n rows (n decodes, or one n-token prompt) and samples
    # n rows (decode) or 1 (prefill)
    pure = engine.executor.time_all_reduce(n)
    pure_gather = engine.executor.time_gather(n if kind == "decode" else 1)
    step = statistics.median(times)
    mean = sum(times) / len(times)
    k = len(times)
    ar_calls, ar_s, g_calls, g_s = tot[0] // k, tot[1] / k, tot[2] // k, tot[3] / k

    def share(seconds: float) -> float:
        return seconds / mean if mean else 0.0

    return {
        "step_ms": step * 1e3,
        "all_reduce_ms": ar_s * 1e3,
        "all_reduce_share": share(ar_s),
        "all_reduce_calls": ar_calls,
        # the same all-reduces with every rank idle: the transfer alone (the rest is waiting)
        "all_reduce_transfer_ms": pure * ar_calls * 1e3,
        "all_reduce_transfer_share": share(pure * ar_calls),
        "gather_ms": g_s * 1e3,
        "gather_share": share(g_s),
        "gather_calls": g_calls,
        "gather_transfer_ms": pure_gather * g_calls * 1e3,
        "gather_transfer_share": share(pure_gather * g_calls),
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=None, help="HF directory (default: the random benchmark Llama)")
    ap.add_argument("--layers", type=int, default=30)
    ap.add_argument("--tp", default="1,2", help="comma-separated tensor-parallel sizes")
    ap.add_argument("--shapes", default="decode:1,decode:8,decode:32,prefill:128,prefill:512")
    ap.add_argument("--context", type=int, default=128, help="prompt tokens of each decode sequence")
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--json-out", default=None)
    ns = ap.parse_args(argv)
    shapes = [s.strip() for s in ns.shapes.split(",") if s.strip()]
    sizes = [int(x) for x in ns.tp.split(",")]
    max_len = max(
        [ns.context + ns.steps + 8] + [int(s.split(":")[1]) + 8 for s in shapes if s.startswith("prefill")]
    )
    max_len = -(-max_len // 16) * 16
    tmp = None
    model = ns.model
    if model is None:
        tmp = tempfile.TemporaryDirectory(prefix="kvserve-tp-bench-")
        model = build_model(tmp.name, ns.layers)
    rows = []
    for tp in sizes:
        engine = _engine(model, tp, max_len)
        try:
            for shape in shapes:
                r = measure(engine, shape, ns.context, ns.steps, seed=1)
                r.update(tp=tp, shape=shape)
                rows.append(r)
                print(f"tp={tp} {shape}: {r['step_ms']:.1f} ms/step", file=sys.stderr)
        finally:
            engine.shutdown()
    base = {r["shape"]: r["step_ms"] for r in rows if r["tp"] == 1}
    print(
        "\n| shape | TP | step ms | vs TP=1 | all-reduce ms/step (share) | of which transfer "
        "(share) | calls/step | gather ms/step (share) | of which transfer (share) | calls/step |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        rel = f"{base[r['shape']] / r['step_ms']:.2f}x" if r["shape"] in base else "-"
        print(
            f"| {r['shape']} | {r['tp']} | {r['step_ms']:.1f} | {rel} | {r['all_reduce_ms']:.1f} "
            f"({100 * r['all_reduce_share']:.0f}%) | {r['all_reduce_transfer_ms']:.1f} "
            f"({100 * r['all_reduce_transfer_share']:.0f}%) | {r['all_reduce_calls']} "
            f"| {r['gather_ms']:.2f} ({100 * r['gather_share']:.1f}%) | {r['gather_transfer_ms']:.2f} "
            f"({100 * r['gather_transfer_share']:.1f}%) | {r['gather_calls']} |"
        )
    if ns.json_out:
        meta = {
            "layers": ns.layers,
            "model": ns.model or "random Llama 8/4 heads x 64, hidden 512, inter 1536",
            "context": ns.context,
            "steps": ns.steps,
            "cpus": len(os.sched_getaffinity(0)),
            "threads_env": os.environ.get("KVSERVE_NUM_THREADS"),
        }
        with open(ns.json_out, "w") as f:
            json.dump({"meta": meta, "rows": rows}, f, indent=1)
    if tmp is not None:
        tmp.cleanup()
    return 0


if __name__ == "__main__":
    sys.exit(main())
