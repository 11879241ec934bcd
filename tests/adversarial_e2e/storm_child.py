"""Run in a child process by the tests of this folder: one engine (the tiny random Llama,
``attacks.SERVER_KWARGS``) first takes every offline attack shape through ``LLM``, then serves
HTTP while ``storm.run_storm`` fires every HTTP attack shape and a hypothesis-drawn batch of
random bodies at it. A regression that crashes the process (a parser or the grammar compiler
overflowing a stack) then fails the tests instead of killing pytest. Prints one JSON object.

With ``dp``, the crash-class shapes instead go to a ``--data-parallel-size 2`` endpoint on a
local Ray runtime of its own (the replicas compile the constraints; the front parses the bodies).

Usage: ``python -m tests.adversarial_e2e.storm_child single MODEL_DIR NUM_RANDOM_BODIES`` or
``python -m tests.adversarial_e2e.storm_child dp MODEL_DIR``
"""

from __future__ import annotations

import json
import logging
import sys
import threading
import time


class _Errors(logging.Handler):
    """ERROR records of the engine's and the server's loggers."""

    def __init__(self):
        super().__init__(level=logging.ERROR)
        self.lines: list[str] = []
        self.mu = threading.Lock()

    def emit(self, record):
        with self.mu:
            self.lines.append(record.getMessage()[:300])


def engine_state(engine) -> dict:
    """Queues, KV blocks and live grammar matchers of an ``LLMEngine``."""
    sched = engine.scheduler
    kv = engine.get_kv_cache_stats()
    return {
        "waiting": len(sched.waiting),
        "running": len(sched.running),
        "swapped": len(sched.swapped),
        "unfinished": engine.get_num_unfinished_requests(),
        "gpu_blocks": kv["num_gpu_blocks"],
        "free_gpu_blocks": kv["num_free_gpu_blocks"],
        "cpu_blocks": kv["num_cpu_blocks"],
        "free_cpu_blocks": kv["num_free_cpu_blocks"],
        "live_matchers": engine.structured_output.num_live,
    }


def _greedy(llm, prompts: list[str]) -> list[str]:
    from kvserve import SamplingParams
    from tests.adversarial_e2e.attacks import NEIGHBOUR_MAX_TOKENS

    outs = llm.generate(
        prompts, SamplingParams(max_tokens=NEIGHBOUR_MAX_TOKENS, temperature=0), use_tqdm=False
    )
    return [o.outputs[0].text for o in outs]


def run_offline(llm) -> dict:
    """Every ``OFFLINE_ATTACKS`` shape once: what it raised (type and message) or returned."""
    from kvserve import SamplingParams, StructuredOutputsParams
    from kvserve.lora_request import LoRARequest
    from kvserve.sampling_params import BeamSearchParams
    from tests.adversarial_e2e.attacks import NEIGHBOUR_PROMPTS, OFFLINE_ATTACKS

    before = _greedy(llm, NEIGHBOUR_PROMPTS)
    results = []
    for a in OFFLINE_ATTACKS:
        res: dict = {"name": a.name, "field": a.field}
        try:
            lora = LoRARequest(a.lora, 1, "/nonexistent") if a.lora is not None else None
            if a.kind == "beam_search":
                outs = llm.beam_search(a.prompt, BeamSearchParams(**a.params))
                res["scores"] = [h.score for o in outs for h in o.sequences]
            else:
                kw = dict(a.params)
                if "structured_outputs" in kw:
                    kw["structured_outputs"] = StructuredOutputsParams(**kw["structured_outputs"])
                params = SamplingParams(**kw)
                run = llm.chat if a.kind == "chat" else llm.generate
                outs = run(a.prompt, params, use_tqdm=False, lora_request=lora)
                res["outcomes"] = [o.outcome for o in outs]
                res["finish_reasons"] = [c.finish_reason for o in outs for c in o.outputs]
                if params.prompt_logprobs is not None:
                    res["prompt_logprob_rows"] = [len(o.prompt_logprobs or []) for o in outs]
            res["raised"] = None
        except Exception as e:  # the test judges the type and the message
            res["raised"] = type(e).__name__
            res["message"] = str(e)[:500]
        res["state"] = engine_state(llm.llm_engine)
        results.append(res)
    return {"results": results, "before": before, "after": _greedy(llm, NEIGHBOUR_PROMPTS)}


def random_bodies(n: int) -> list[tuple[str, str]]:
    """``n`` request bodies (route, JSON text) drawn by hypothesis from the field fuzz test's
    strategies: a deep, extreme or malformed value at a random field of a valid completion or
    chat body (derandomized: the same bodies every run)."""
    from hypothesis import HealthCheck, Phase, given, settings
    from hypothesis import strategies as st

    from kvserve.entrypoints.openai.protocol import ChatCompletionRequest, CompletionRequest
    from tests.adversarial import test_fuzz_fields as fz

    completion = st.builds(
        lambda path, value, extra: ("/v1/completions", fz._body(fz.COMPLETION_BASE, path, value, extra)),
        st.sampled_from([(p,) for p in fz._paths(CompletionRequest)] + fz.COMPLETION_NESTED),
        fz.VALUES,
        fz.EXTRAS,
    )
    chat = st.builds(
        lambda path, value, extra: ("/v1/chat/completions", fz._body(fz.CHAT_BASE, path, value, extra)),
        st.sampled_from([(p,) for p in fz._paths(ChatCompletionRequest)] + fz.CHAT_NESTED),
        fz.VALUES,
        fz.CHAT_EXTRAS,
    )
    got: list[tuple[str, str]] = []

    @settings(
        max_examples=n,
        derandomize=True,
        database=None,
        phases=[Phase.generate],
        deadline=None,
        suppress_health_check=list(HealthCheck),
    )
    @given(completion | chat)
    def draw(body):
        got.append(body)

    draw()
    return got


def single(model_dir: str, num_random: int) -> dict:
    """The offline shapes, then the HTTP storm, on one engine."""
    from kvserve import LLM
    from kvserve.engine.async_llm_engine import AsyncLLMEngine
    from tests.adversarial_e2e import storm
    from tests.adversarial_e2e.attacks import ATTACKS, LONG_PROMPTS, SERVER_KWARGS, check_shapes_within_caps
    from tests.server_harness import running_server

    errors = _Errors()
    for name in ("kvserve", "uvicorn.error"):
        logging.getLogger(name).addHandler(errors)
    out: dict = {}
    llm = LLM(model=model_dir, device="cpu", dtype="float32", **SERVER_KWARGS)
    engine = llm.llm_engine
    check_shapes_within_caps(engine.tokenizer.encode)
    out["long_prompt_lens"] = [len(engine.tokenizer.encode(p)) for p in LONG_PROMPTS]
    t0 = time.monotonic()
    out["offline"] = run_offline(llm)
    out["offline"]["seconds"] = time.monotonic() - t0
    out["offline"]["errors_logged"] = list(errors.lines)
    del errors.lines[:]

    bodies = random_bodies(num_random)
    # the same engine behind the server (one model load)
    with running_server(None, "tiny", async_engine=AsyncLLMEngine(engine), shutdown_grace_s=2.0) as s:
        solo = storm.solo(s.url)
        finished_before = dict(engine.stats.finished_by_reason)
        result = storm.run_storm(s.url, ATTACKS, bodies)
        result["solo"] = solo
        result["after"] = storm.solo(s.url)  # the server still answers, as before
        s.wait_idle()
        result["state"] = engine_state(engine)
        # how the storm's engine requests ended (finish reason -> count)
        result["finished_by_reason"] = {
            k: v - finished_before.get(k, 0) for k, v in engine.stats.finished_by_reason.items()
        }
        # torch._dynamo (seconds to import) came in with llguidance.torch on the grammar thread
        # while the first constrained step waited for its masks, holding every running request
        result["dynamo_imported"] = "torch._dynamo" in sys.modules
        result["server_thread_alive"] = any(
            t.name == "uvicorn-test" and t.is_alive() for t in threading.enumerate()
        )
        result["counts"] = storm.counts(result)
    result["errors_logged"] = list(errors.lines)
    out["server"] = result
    return out


def data_parallel(model_dir: str) -> dict:
    """The crash-class shapes against a ``--data-parallel-size 2`` endpoint, with neighbours
    and the health poller; each replica's process id and restarts before and after."""
    import ray

    from kvserve.config import EngineArgs
    from kvserve.distributed import start_data_parallel_engine
    from tests.adversarial_e2e import storm
    from tests.adversarial_e2e.attacks import CRASH_CLASS, SERVER_KWARGS
    from tests.distributed.test_dp_server import _wait_idle
    from tests.server_harness import running_server

    kwargs = {k: v for k, v in SERVER_KWARGS.items() if "lora" not in k}
    # a runtime of its own, never one another process of the test run started
    ray.init(address="local", num_cpus=2, include_dashboard=False, logging_level="warning")
    try:
        dp = start_data_parallel_engine(EngineArgs(model=model_dir, data_parallel_size=2, **kwargs), "tiny")
        pids = [r.pid for r in dp.replicas]
        with running_server(None, "tiny", async_engine=dp, shutdown_grace_s=2.0) as s:
            solo = storm.solo(s.url)
            result = storm.run_storm(s.url, CRASH_CLASS)
            result["solo"] = solo
            result["after"] = storm.solo(s.url)
            _wait_idle(dp)
            result["in_flight"] = dp.num_in_flight
            result["counts"] = storm.counts(result)
        result["replicas"] = {
            "pids_before": pids,
            "pids_after": [r.pid for r in dp.replicas],
            "restarts": [r.restarts for r in dp.replicas],
            "states": dp.replica_states(),
        }
        dp.shutdown()
    finally:
        ray.shutdown()
    return {"dp": result}


if __name__ == "__main__":
    mode = sys.argv[1]
    out = single(sys.argv[2], int(sys.argv[3])) if mode == "single" else data_parallel(sys.argv[2])
    print(json.dumps(out))
