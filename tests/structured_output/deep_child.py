"""Run in a child process by ``test_grammar_limits.py``: constraints deep enough to overflow a
default thread stack in the grammar compiler, sent to the compiler, ``LLM.generate`` and the
HTTP server. A regression that crashes the process then fails the test instead of killing
pytest. Prints one JSON object: what each call gave.

Usage: ``python -m tests.structured_output.deep_child MODEL_DIR``
"""

from __future__ import annotations

import json
import sys
import time

#: Links of the deep shapes (each past its limit; a chain of this many ``$ref`` s overflowed an
#: 8 MiB stack in the compiler before it ran on its own thread).
DEPTH = 3000


def deep_defs_schema(n: int = DEPTH) -> dict:
    """``d0 -> d1 -> ... -> dn``: each ``anyOf`` null or the next definition."""
    defs = {f"d{i}": {"anyOf": [{"type": "null"}, {"$ref": f"#/$defs/d{i + 1}"}]} for i in range(n)}
    defs[f"d{n}"] = {"type": "null"}
    return {"$ref": "#/$defs/d0", "$defs": defs}


def deep_lark(n: int = DEPTH) -> str:
    """``start -> r0 -> r1 -> ... -> rn``, each rule ``"x"`` or the next one."""
    return "start: r0\n" + "".join(f'r{i}: "x" | r{i + 1}\n' for i in range(n)) + f'r{n}: "y"\n'


def deep_json_text(n: int = DEPTH) -> str:
    """A schema of ``n`` nested arrays, as JSON text."""
    return '{"type": "array", "items": ' * n + "{}" + "}" * n


def _outcome(fn) -> dict:
    try:
        return {"ok": True, "value": fn()}
    except ValueError as e:
        return {"ok": False, "error": str(e)}


def main(model_dir: str) -> None:
    from kvserve import LLM, SamplingParams, StructuredOutputsParams
    from kvserve.structured_output import GrammarCompiler, GrammarLimits

    out: dict = {}
    llm = LLM(model=model_dir, device="cpu", dtype="float32", num_gpu_blocks=64, seed=0)
    compiler = llm.llm_engine.structured_output.compiler
    tok = llm.llm_engine.tokenizer  # the tiny model's copy of the default tokenizer
    # nothing here asks the engine's compiler for its view: only its warm-up builds it
    deadline = time.monotonic() + 120
    while compiler.tokenizer_thread is None and time.monotonic() < deadline:
        time.sleep(0.05)
    out["tokenizer_thread"] = compiler.tokenizer_thread
    # The pre-checks off: the deep shapes reach llguidance, which must survive on its thread.
    off = GrammarLimits(
        max_bytes=10**8, max_json_depth=10**6, max_defs=10**6, max_ref_chain=10**6, max_rules=10**6
    )
    # a loaded machine must not turn "survived" into "timed out"
    unchecked = GrammarCompiler(tok, len(tok), tok.eos_token_id, limits=off, compile_timeout_s=300)
    out["unchecked_defs"] = _outcome(
        lambda: bool(unchecked.compile(StructuredOutputsParams(json=deep_defs_schema())))
    )
    out["unchecked_lark"] = _outcome(
        lambda: bool(unchecked.compile(StructuredOutputsParams(grammar=deep_lark())))
    )

    shapes = {
        "defs": StructuredOutputsParams(json=deep_defs_schema()),
        "lark": StructuredOutputsParams(grammar=deep_lark()),
        "json_text": StructuredOutputsParams(json=deep_json_text()),
    }
    for name, so in shapes.items():
        params = SamplingParams(max_tokens=4, structured_outputs=so)
        out[f"offline_{name}"] = _outcome(lambda p=params: llm.generate(["x"], p)[0].outputs[0].text)
    good = SamplingParams(max_tokens=6, structured_outputs=StructuredOutputsParams(regex="z+"))
    out["offline_after"] = _outcome(lambda: llm.generate(["x"], good)[0].outputs[0].text)

    from kvserve.engine.async_llm_engine import AsyncLLMEngine
    from tests.server_harness import running_server

    bodies = {
        "defs": {
            "response_format": {
                "type": "json_schema",
                "json_schema": {"name": "d", "schema": deep_defs_schema()},
            }
        },
        "lark": {"guided_grammar": deep_lark()},
        "json_text": {"guided_json": deep_json_text()},
    }
    # the same engine behind the server (one model load)
    with running_server(None, "tiny", async_engine=AsyncLLMEngine(llm.llm_engine)) as s, s.http() as h:
        for name, extra in bodies.items():
            r = h.post("/v1/completions", json={"prompt": "x", "max_tokens": 4, **extra})
            out[f"server_{name}"] = {"status": r.status_code, "error": r.json().get("error", {})}
        r = h.post("/v1/completions", json={"prompt": "x", "max_tokens": 6, "guided_regex": "z+"})
        out["server_after"] = {"status": r.status_code, "text": r.json()["choices"][0]["text"]}
        s.wait_idle()
    print(json.dumps(out))


if __name__ == "__main__":
    main(sys.argv[1])
