#!/usr/bin/env python
"""The shapes of an offline script's results, from vLLM or from kvserve, as JSON.

    /work/vllm-venv/bin/python benchmarks/vllm_cpu/record_offline.py vllm --model DIR \
        --out tests/data/vllm_offline_skeletons.json
    .venv/bin/python benchmarks/vllm_cpu/record_offline.py kvserve --model DIR

Runs one short script a vLLM user writes (``generate`` with output and prompt logprobs, ``n=2``
sampling, ``chat`` with ``tools``, ``beam_search``) through the named engine's ``LLM`` and writes
each result's *skeleton*: attribute and key names with the JSON type of their values, recursively
(a list or dict by its first element). Values are left out, so skeletons of different models
compare. tests/entrypoints/test_vllm_offline_shapes.py runs the same script on kvserve and
holds its skeleton against the recorded vLLM one.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from typing import Any

#: Attributes a skeleton leaves out: engine internals with no counterpart to compare.
PRIVATE_PREFIX = "_"

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The weather in a city.",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}},
                "required": ["city"],
            },
        },
    }
]


def skeleton(obj: Any, depth: int = 0) -> Any:
    """The shape of ``obj``: a scalar's type name (``"int"``, ``"float"``, ``"str"``, ``"bool"``,
    ``"NoneType"``); ``[shape of its first item that is not None]`` for a sequence (``[]`` when
    empty; prompt logprobs start with None); ``{"<key>": key type, "<value>": shape}`` for a
    dict, by its first item; ``{attribute: shape}`` for any other object (a dataclass's fields,
    else its public instance attributes). Depth is capped at 8."""
    if depth > 8:
        return "..."
    if obj is None or isinstance(obj, (bool, int, float, str)):
        return type(obj).__name__
    if isinstance(obj, (list, tuple)):
        if not obj:
            return []
        return [skeleton(next((x for x in obj if x is not None), None), depth + 1)]
    if isinstance(obj, dict):
        if not obj:
            return {}
        key, value = next(iter(obj.items()))
        return {"<key>": type(key).__name__, "<value>": skeleton(value, depth + 1)}
    if hasattr(obj, "tolist"):  # a tensor or an array: by its element type
        return [skeleton(obj.tolist()[0], depth + 1)] if len(obj) else []
    if dataclasses.is_dataclass(obj):
        names = [f.name for f in dataclasses.fields(obj)]
    else:
        names = list(getattr(obj, "__dict__", {}))
        names += [n for n in getattr(type(obj), "__slots__", ()) if n not in names]
    return {
        n: skeleton(getattr(obj, n), depth + 1)
        for n in sorted(names)
        if not n.startswith(PRIVATE_PREFIX) and hasattr(obj, n)
    }


def run_script(llm: Any, sampling_params: Any, beam_search_params: Any) -> dict[str, Any]:
    """The user's script on an ``LLM`` (vLLM's or kvserve's; ``sampling_params`` and
    ``beam_search_params`` are that engine's classes); returns ``{case: skeleton}``."""
    greedy = sampling_params(max_tokens=4, temperature=0, logprobs=2, prompt_logprobs=1)
    sampled = sampling_params(n=2, max_tokens=4, temperature=0.8, seed=1)
    chat = [{"role": "user", "content": "What is the weather in Paris?"}]
    out = {
        "generate_logprobs": llm.generate(["The capital of France is"], greedy)[0],
        "generate_n2": llm.generate(["Hello"], sampled)[0],
        "chat_tools": llm.chat(chat, sampling_params(max_tokens=4, temperature=0), tools=TOOLS)[0],
        "beam_search": llm.beam_search(
            [{"prompt": "The capital of France is"}], beam_search_params(beam_width=2, max_tokens=4)
        )[0],
    }
    return {case: skeleton(result) for case, result in out.items()}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("engine", choices=["vllm", "kvserve"])
    ap.add_argument("--model", required=True, help="a local model directory")
    ap.add_argument("--out", help="write the skeletons here (default: stdout)")
    args = ap.parse_args(argv)
    if args.engine == "vllm":
        import importlib.metadata as md

        from vllm import LLM, SamplingParams
        from vllm.sampling_params import BeamSearchParams

        llm = LLM(model=args.model, dtype="float32", max_model_len=512, seed=0)
        source = f"vllm-cpu {md.version('vllm-cpu')}"
    else:
        from kvserve import LLM, SamplingParams
        from kvserve.sampling_params import BeamSearchParams

        llm = LLM(model=args.model, dtype="float32", max_model_len=512)
        source = "kvserve"
    result = {"source": source, "model": args.model.rstrip("/").split("/")[-1], "cases": {}}
    result["cases"] = run_script(llm, SamplingParams, BeamSearchParams)
    text = json.dumps(result, indent=1, sort_keys=True)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")
    else:
        sys.stdout.write(text + "\n")


if __name__ == "__main__":
    main()
