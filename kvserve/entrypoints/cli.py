"""``kvserve generate | serve | doctor``: the product's commands. The ``kvserve`` console script
(``kvserve.cli``) adds the tooling's commands (``bench``, ``simulate``, ``profile``) through
``main(tools=...)``; this module never imports the tooling."""

from __future__ import annotations

import argparse
import dataclasses
import logging
import re
import sys
import time
import typing

from kvserve.config import (
    CONVERT_CHOICES,
    DTYPE_ALIASES,
    KV_CACHE_DTYPES,
    MODEL_IMPL_ALIASES,
    MODEL_IMPL_CHOICES,
    QUANTIZATION_CHOICES,
    RUNNER_CHOICES,
    EngineArgs,
    parse_tenant_weights,
)
from kvserve.core.policy import PolicyFactory
from kvserve.entrypoints.vllm_compat import FLAG_OF_FIELD, aliases_of, human_int_arg
from kvserve.lora.modules import parse_lora_module

DEMO_CHATS = [
    "What is the capital of France?",
    "Name three colours.",
    "Write a haiku about the sea.",
    "Explain what a KV cache is in one sentence.",
    "Give me a tip for learning Python.",
    "What is 7 times 8?",
]


_HELP = {
    "kv_cache_dtype": (
        "how K/V are stored: auto (the model dtype), int8, fp8 (= fp8_e4m3), fp8_e5m2: one byte "
        "a value plus a scale per token and KV head, ~1.9x the tokens of bfloat16"
    ),
    "runner": (
        "generate, pooling (embeddings and scores) or auto: pooling for an encoder-only architecture (BERT)"
    ),
    "convert": "embed: a decoder checkpoint served as an embedding model; none / auto: as it is",
    "model": "a local Hugging Face directory or a .gguf file (default: the embedded SmolLM2-135M-Instruct)",
    "dtype": "auto (float32 on CPU, bfloat16 on CUDA), float32, bfloat16, float16 (vLLM's half and float too)",
    "device": "auto (CUDA when available), cpu, cuda",
    "seed": "the engine's global RNG seed",
    "block_size": "tokens per KV-cache block",
    "num_gpu_blocks": "blocks in the device KV pool (on CPU too); None: as many as kv_cache_memory_gib holds",
    "kv_cache_memory_gib": "memory of the device KV pool when num_gpu_blocks is unset (per rank under tensor parallelism)",
    "num_cpu_blocks": "blocks in the host swap pool; None: as many as swap_space_gib holds",
    "swap_space_gib": "memory of the swap pool when num_cpu_blocks is unset; pools (on CPU: both) larger than the machine's physical memory are refused at start",
    "max_num_seqs": "most sequences in one step",
    "max_num_batched_tokens": "most tokens in one step (prompt + decode); None: 2,048 with chunked prefill on CPU, 512 with it on CUDA, else max(max_model_len, 512); the flag also takes 8k / 8K forms",
    "max_model_len": "context length (prompt + output) in tokens; None: the model's max_position_embeddings, which it may not exceed; the flag also takes 32k (x 1,000) and 32K / 1M (x 1,024) forms",
    "enable_chunked_prefill": "split long prompts over steps and mix them with decodes; None: on on CPU (as vLLM's CPU backend), off on CUDA (as vLLM V0)",
    "enable_prefix_caching": "reuse KV blocks across requests by hashed token content",
    "num_kv_offload_blocks": "blocks of the host tier; None: as many as kv_offload_gib holds",
    "preemption_mode": "recompute or swap for every group; auto: the cheaper of the two per victim (scheduling); None: recompute for one-sequence groups, swap for n > 1",
    "max_num_partial_prefills": "with chunked prefill, how many prompts may be mid-prefill at once",
    "max_decode_slowdown": "with chunked prefill, the most (a factor > 1) prompt tokens may slow the decodes beside them on average, from measured step times; None: no cap but the token budget",
    "long_prefill_token_threshold": "with chunked prefill, the most tokens one prompt takes in a step; None: 4%% of max_model_len (at least one block) when max_num_partial_prefills > 1, else the step budget",
    "max_waiting": "bound on the waiting queue (the server answers 503 past it); None: no bound",
    "watermark": "fraction of device blocks kept free when admitting prompts, in [0, 1)",
    "delay_factor": "vLLM V0's prompt delay: while requests run, new prompts wait until the oldest has waited this many times the last prompt step's latency, so more are batched together; 0 admits at once",
    "enable_lora": "multi-LoRA serving (LoRA)",
    "max_loras": "distinct adapters in one step (device slots)",
    "max_lora_rank": "the largest adapter rank accepted, 1..512",
    "max_cpu_loras": "adapters kept loaded in the CPU cache (least recently used evicted), at least max_loras; None: max_loras",
    "max_slot_preemptions": "LoRA slot turnover, 0..8: how many times one request may be preempted to free its adapter's slot for a busier waiting adapter; 0 = off",
    "data_parallel_size": "engine replicas on Ray behind one endpoint; 1 = this process only (data parallel)",
    "ray_address": "the Ray cluster to join (auto, HOST:PORT); None: a local Ray runtime",
    "router": "how a request picks its replica: prefix, least-loaded, round-robin",
    "router_balance_threshold": "prefix router: the best-matching replica is passed over for the least-loaded one when it has more than this many outstanding requests over it",
    "tensor_parallel_size": "ranks (processes) per engine (tensor parallel)",
    "enable_sleep_mode": "sleep mode: LLM.sleep(level) / wake_up(), the server's POST /sleep and /wake_up, free the KV cache and offload (level 1) or drop (level 2) the weights while idle (server)",
    "policy": (
        "queue order: fcfs = arrival order; priority = the request's priority, then arrival; "
        "fair = tenants (the request's user) share the service by weighted tokens served "
        "(virtual token counter)"
    ),
    "fair_input_weight": "fair policy: cost of one prompt (prefill) token in a tenant's counter",
    "fair_output_weight": "fair policy: cost of one generated token (2 = the VTC paper's 1:2 ratio)",
    "fair_burst_tokens": (
        "fair policy: weighted tokens per unit of weight a tenant joining a busy engine may be served ahead of the "
        "least-served busy tenant (its first burst; 0: the VTC paper's rule)"
    ),
    "scheduling_backfill": (
        "admit waiting requests that fit past one that must wait for KV blocks, without "
        "delaying it (unset: on for the fair policy, off for fcfs and priority)"
    ),
    "waiting_aware_eviction": (
        "with prefix caching, evict the cached blocks that a waiting request's prompt needs "
        "last (plain LRU when off)"
    ),
    "kv_offload_gib": (
        "host memory (GiB) for the prefix cache's host tier: cached KV blocks evicted from the "
        "device pool are kept there and swapped back in on a later prefix hit (needs "
        "--enable-prefix-caching; 0 = off)"
    ),
    "kv_offload_dir": (
        "disk tier of the prefix cache: host-tier blocks are also written to this directory in "
        "the background and read back at start, so a restarted server starts warm (needs "
        "--kv-offload-gib; files of another model, dtype or block shape are ignored)"
    ),
    "kv_offload_disk_gib": "bound of the disk tier's files (least recently used deleted first)",
    "gpu_memory_utilization": (
        "size the KV pool to fill this fraction of device memory (CUDA) or physical host memory "
        "(CPU) with weights + KV cache (vLLM's flag; replaces --kv-cache-memory-gib)"
    ),
    "generation_config": (
        "default sampling parameters: auto = the model's generation_config.json, vllm = none, "
        "or a directory holding one"
    ),
    "quantization": (
        "weight quantization (CPU): gguf = a .gguf file's blocks as they are (the default for "
        "--model x.gguf where the other flags allow: CPU, dtype float32/bfloat16, one rank, no LoRA; "
        "else it is dequantized, and the log says why); none = float weights (a .gguf dequantized "
        "once, cached); int8 / int4 = a float checkpoint quantized at load (Q8_0 / Q4_1 per 32 "
        "weights); gptq / awq / compressed-tensors = a checkpoint quantized so (also detected from "
        "its config.json when unset)"
    ),
    "model_impl": (
        "which implementation runs the architecture: auto = its native family where there is one, "
        "else the transformers fallback; native = native families only; transformers = the "
        "fallback (transformers' own modules on the paged KV cache) even for a native family"
    ),
}


#: Integer fields that also take vLLM's 32k / 1M forms (``vllm_compat.parse_human_int``).
_HUMAN_INT_FIELDS = ("max_model_len", "max_num_batched_tokens")


def flag_of(field_name: str) -> str:
    """The command-line flag of an ``EngineArgs`` field (``FLAG_OF_FIELD``'s vLLM spellings; the
    field's own spelling stays as an alias)."""
    return FLAG_OF_FIELD.get(field_name, "--" + field_name.replace("_", "-"))


def _tenant_weights(text: str) -> dict[str, float]:
    """A ``--tenant-weights`` value (``a=2,b=1``) as a dict (argparse ``type``)."""
    try:
        return parse_tenant_weights(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _dtype(text: str) -> str:
    """A ``--dtype`` value with vLLM's spellings (``half``, ``float``) as kvserve's names."""
    return DTYPE_ALIASES.get(text, text)


def _model_impl(text: str) -> str:
    """A ``--model-impl`` value with vLLM's spelling (``vllm``) as kvserve's name (``native``)."""
    return MODEL_IMPL_ALIASES.get(text, text)


def add_engine_args(parser: argparse.ArgumentParser, help_overrides: dict[str, str] | None = None) -> None:
    """One ``--kebab-case`` flag per ``EngineArgs`` field, typed from its annotation (with
    vLLM's short aliases, ``-tp``, and value forms: ``--max-model-len 32k``, ``--dtype half``);
    ``help_overrides``: field name -> help text where a command uses the field its own way."""
    helps = {**_HELP, **(help_overrides or {})}
    hints = typing.get_type_hints(EngineArgs)
    for f in dataclasses.fields(EngineArgs):
        flag = flag_of(f.name)
        names = [flag, *aliases_of(flag)]
        if flag != "--" + f.name.replace("_", "-"):
            names.append("--" + f.name.replace("_", "-"))
        hint = hints[f.name]
        base = next((a for a in typing.get_args(hint) if a is not type(None)), hint)
        if base is bool:
            parser.add_argument(
                *names, action=argparse.BooleanOptionalAction, default=f.default, help=helps.get(f.name)
            )
        elif f.name in ("speculative_config", "override_generation_config", "pooler_config"):
            parser.add_argument(
                *names,
                type=str,
                default=None,
                metavar="JSON",
                help={
                    "speculative_config": 'speculative decoding, e.g. \'{"method": "ngram", "num_speculative_tokens": 4}\'',
                    "override_generation_config": "generation_config.json values to set over the file's, "
                    "e.g. '{\"temperature\": 0.5}'",
                    "pooler_config": 'pooling models: the pooler over the checkpoint\'s, e.g. \'{"pooling_type": "MEAN"}\'',
                }[f.name],
            )
        elif f.name == "tenant_weights":
            parser.add_argument(
                *names,
                dest=f.name,
                type=_tenant_weights,
                default=None,
                metavar="NAME=WEIGHT,...",
                help="fair policy: share weights of tenants (the request's user), e.g. a=2,b=1; "
                "1 for a tenant not listed",
            )
        else:
            parser.add_argument(
                *names,
                dest=f.name,
                type=human_int_arg
                if f.name in _HUMAN_INT_FIELDS
                else {"dtype": _dtype, "model_impl": _model_impl}.get(f.name, base),
                default=f.default,
                choices={
                    "device": ["auto", "cpu", "cuda"],
                    "dtype": ["auto", "float32", "bfloat16", "float16"],
                    "kv_cache_dtype": list(KV_CACHE_DTYPES),
                    "preemption_mode": ["recompute", "swap", "auto"],
                    "quantization": list(QUANTIZATION_CHOICES),
                    "model_impl": list(MODEL_IMPL_CHOICES),
                    "router": ["prefix", "least-loaded", "round-robin"],
                    "policy": PolicyFactory.names(),
                    "runner": list(RUNNER_CHOICES),
                    "convert": list(CONVERT_CHOICES),
                }.get(f.name),
                help=helps.get(f.name),
            )


def engine_args_from(ns: argparse.Namespace) -> EngineArgs:
    """The ``EngineArgs`` of ``add_engine_args``'s flags in ``ns``.

    Raises:
        ValueError: a setting out of its range (worded with the field's name).
    """
    return EngineArgs(**{f.name: getattr(ns, f.name) for f in dataclasses.fields(EngineArgs)})


def checked_engine_args(ns: argparse.Namespace) -> EngineArgs | None:
    """``engine_args_from(ns)``, or None after printing ``error: ...`` (the error worded with
    the flags typed) to stderr: a command then exits 2 instead of showing a traceback."""
    try:
        return engine_args_from(ns)
    except ValueError as e:
        print(f"error: {flag_names(str(e))}", file=sys.stderr)
        return None


def _is_bool_field(hint) -> bool:
    return bool in (hint, *typing.get_args(hint))


def _flag_patterns() -> list[tuple[re.Pattern, str]]:
    out = []
    hints = typing.get_type_hints(EngineArgs)
    for f in dataclasses.fields(EngineArgs):
        flag = flag_of(f.name)
        name = re.escape(f.name)
        if _is_bool_field(hints[f.name]):  # a switch: ``name=True`` is ``--flag``, False ``--no-flag``
            out.append((re.compile(rf"(?<![\w.\-'\"]){name}=True\b"), flag))
            out.append((re.compile(rf"(?<![\w.\-'\"]){name}=False\b"), "--no-" + flag[2:]))
        # ``name='v'`` / ``name=v``: the flag and its value as typed
        value = r"=(?:'([^']*)'|\"([^\"]*)\"|([^\s,;)]+))"
        out.append((re.compile(rf"(?<![\w.\-'\"]){name}{value}"), flag))
        # the bare name: only an identifier with an underscore is surely the field (``model``,
        # ``device`` or ``quantization`` alone are also plain words), those only before "must"
        bare = rf"{name}(?!\w|\.\w|=)" if "_" in f.name else rf"{name}(?= must\b)"
        out.append((re.compile(rf"(?<![\w.\-'\"]){bare}"), flag))
    return out


_FLAG_PATTERNS: list[tuple[re.Pattern, str]] | None = None


def flag_names(message: str) -> str:
    """``message`` (an engine error worded for ``LLM(...)``) with each ``EngineArgs`` keyword
    written as the command-line flag the user typed: ``tensor_parallel_size=3`` ->
    ``--tensor-parallel-size 3``, ``quantization='gptq'`` -> ``--quantization gptq``,
    ``enable_prefix_caching=True`` -> ``--enable-prefix-caching`` (``=False``: ``--no-...``),
    ``data_parallel_size must`` -> ``--data-parallel-size must``. Longer identifiers
    (``quantization_config``, ``speculative_config.method``) stay as they are."""
    global _FLAG_PATTERNS
    if _FLAG_PATTERNS is None:
        _FLAG_PATTERNS = _flag_patterns()

    def sub(flag: str):
        def repl(m: re.Match) -> str:
            vals = [g for g in m.groups() if g is not None]
            return f"{flag} {vals[0]}" if vals else flag

        return repl

    for pattern, flag in _FLAG_PATTERNS:
        message = pattern.sub(sub(flag), message)
    return message


def _generate_lora_request(ns: argparse.Namespace):
    """The ``LoRARequest`` ``kvserve generate`` runs every prompt with, from ``--lora-modules``
    and ``--lora-name`` (the only module when one is given and no name), or None.

    Raises:
        ValueError: ``--lora-modules`` without ``--enable-lora``, ``--lora-name`` without
            ``--lora-modules`` or naming none of them, several modules and no ``--lora-name``,
            or a name given twice.
    """
    from kvserve.lora_request import LoRARequest

    modules = ns.lora_modules or []
    if not modules:
        if ns.lora_name is not None:
            raise ValueError(f"--lora-name {ns.lora_name!r} needs --lora-modules NAME=PATH (none given).")
        return None
    if not ns.enable_lora:
        raise ValueError("--lora-modules needs --enable-lora (LoRA is off).")
    names = [m.name for m in modules]
    dup = sorted({n for n in names if names.count(n) > 1})
    if dup:
        raise ValueError(f"--lora-modules: adapter name(s) {dup} given more than once.")
    if ns.lora_name is None:
        if len(modules) > 1:
            raise ValueError(
                f"--lora-modules gives {len(modules)} adapters {names}: pick one with --lora-name."
            )
        chosen = modules[0]
    else:
        found = [m for m in modules if m.name == ns.lora_name]
        if not found:
            raise ValueError(f"--lora-name {ns.lora_name!r} is not among --lora-modules {names}.")
        chosen = found[0]
    return LoRARequest(chosen.name, 1, chosen.path)


class _AdapterError(ValueError):
    """A ``--lora-modules`` adapter that does not load (its message names the module)."""


def _cmd_generate(ns: argparse.Namespace) -> int:
    from kvserve import LLM, SamplingParams

    try:
        params = SamplingParams(
            max_tokens=ns.max_tokens,
            temperature=ns.temperature,
            top_p=ns.top_p,
            top_k=ns.top_k,
            n=ns.n,
            seed=ns.sampling_seed,
            stop=ns.stop or None,
            ignore_eos=ns.ignore_eos,
        )
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    try:
        lora = _generate_lora_request(ns)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    t_start, wall_start = time.perf_counter(), time.time()
    weights = _WeightsLine()
    try:
        with weights:
            llm = LLM(**dataclasses.asdict(engine_args_from(ns)))
        if lora is not None:  # read and validated now: a bad adapter fails before generating
            try:
                llm.llm_engine.add_lora(lora)
            except ValueError as e:  # as `kvserve serve` names a bad module
                raise _AdapterError(f"--lora-modules {lora.lora_name}={lora.lora_path}: {e}") from None
    except _AdapterError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except ValueError as e:  # a bad engine setting (named in the message, as its flag)
        print(f"error: {flag_names(str(e))}", file=sys.stderr)
        return 2
    t_loaded = time.perf_counter()
    for line in weights.lines:
        print(f"({line})")
    if ns.prompt:
        outs = llm.generate(ns.prompt, params, use_tqdm=False, lora_request=lora)
        labels = ns.prompt
    else:
        chats = [[{"role": "user", "content": c}] for c in DEMO_CHATS]
        outs = llm.chat(chats, params, use_tqdm=False, lora_request=lora)
        labels = DEMO_CHATS
    if lora is not None:
        print(f"(LoRA adapter {lora.lora_name!r} from {lora.lora_path})")
    t_done = time.perf_counter()
    n_tokens = 0
    for label, out in zip(labels, outs):
        print(f"\n>>> {label}")
        if out.error:  # rejected, or cut short (the output below says which)
            print(f"[{out.outcome}] {out.error}")
        for c in out.outputs:
            n_tokens += len(c.token_ids)
            prefix = f"[{c.index}] " if len(out.outputs) > 1 else ""
            print(f"{prefix}{c.text.strip()}  ({len(c.token_ids)} tokens, finish_reason={c.finish_reason})")
    first = min(
        (o.metrics.first_token_time for o in outs if o.metrics and o.metrics.first_token_time), default=None
    )
    gen_s = t_done - t_loaded
    print(
        f"\n{len(outs)} request{'s' if len(outs) != 1 else ''} in one continuous batch: {n_tokens} output tokens in {gen_s:.2f} s "
        f"= {n_tokens / max(gen_s, 1e-9):.1f} tokens/s (model load {t_loaded - t_start:.1f} s"
        + (f", first token {first - wall_start:.1f} s after start" if first else "")
        + ")"
    )
    if ns.speculative_config:
        drafts = sum(o.spec_num_draft_tokens for o in outs)
        accepted = sum(o.spec_num_accepted_tokens for o in outs)
        rate = f" ({accepted / drafts:.0%} accepted)" if drafts else ""
        line = f"speculative decoding: {drafts} draft tokens proposed, {accepted} accepted{rate}"
        skipped = sum(o.spec_num_skipped_steps for o in outs)
        if skipped:  # say why drafts were few (the policy's log line is INFO: not shown here)
            stats = getattr(llm.llm_engine, "stats", None)
            reasons = dict(getattr(stats, "spec_skipped_by_reason", None) or {})
            why = ", ".join(f"{r}: {n}" for r, n in sorted(reasons.items(), key=lambda kv: -kv[1]))
            line += f"; {skipped} decode steps with lookahead slots drafted nothing" + (
                f" ({why})" if why else ""
            )
            if reasons.get("goodput"):
                line += (
                    "; goodput: the dynamic policy expected drafts to lower tokens/s "
                    "(speculative_config.dynamic=false forces them)"
                )
        print(line)
    return 0


class _WeightsLine(logging.Handler):
    """While active (``with``), keeps the engine's INFO lines that say which weights a GGUF
    runs on (``GGUF weights: ...``), for ``kvserve generate`` to print: it configures no
    logging, so they would not be shown."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines: list[str] = []
        self._logger = logging.getLogger("kvserve.engine")
        self._level = self._logger.level

    def emit(self, record: logging.LogRecord) -> None:
        msg = record.getMessage()
        if msg.startswith("GGUF weights:"):
            self.lines.append(msg)

    def __enter__(self) -> _WeightsLine:
        self._level = self._logger.level
        if not self._logger.isEnabledFor(logging.INFO):
            self._logger.setLevel(logging.INFO)  # no handler prints INFO: only this one sees it
        self._logger.addHandler(self)
        return self

    def __exit__(self, *exc) -> None:
        self._logger.removeHandler(self)
        self._logger.setLevel(self._level)


def main(argv: list[str] | None = None, tools: typing.Sequence[tuple[str, str, str]] = ()) -> int:
    """Run one ``kvserve`` command line; returns the exit status.

    ``tools`` are extra ``(command, module, help)`` entries: ``command``'s arguments go to
    ``module.main(argv)``, imported only when that command runs.
    """
    parser = argparse.ArgumentParser(prog="kvserve", description="LLM inference and serving engine.")
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="generate completions offline (demo chat prompts when no --prompt)")
    gen.add_argument("--prompt", action="append", help="a raw prompt (repeatable); default: demo chats")
    gen.add_argument("--max-tokens", type=int, default=64)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--top-k", type=int, default=-1)
    gen.add_argument("--n", type=int, default=1)
    gen.add_argument("--sampling-seed", type=int, default=None)
    gen.add_argument("--stop", action="append")
    gen.add_argument("--ignore-eos", action="store_true")
    gen.add_argument(
        "--lora-modules",
        nargs="+",
        type=parse_lora_module,
        default=None,
        metavar="NAME=PATH",
        help="LoRA adapters (needs --enable-lora), as `kvserve serve` takes them: name=path or JSON",
    )
    gen.add_argument(
        "--lora-name",
        default=None,
        metavar="NAME",
        help="the --lora-modules adapter every prompt runs with (default: the only one given)",
    )
    add_engine_args(gen)
    gen.set_defaults(func=_cmd_generate)

    for name, module, helptext in (
        ("serve", "kvserve.entrypoints.openai.api_server", "OpenAI-compatible HTTP server"),
        (
            "doctor",
            "kvserve.entrypoints.doctor",
            "which kernels this host builds and uses, and the thread count",
        ),
        *tools,
    ):
        p = sub.add_parser(name, help=helptext, add_help=False)
        p.set_defaults(module=module)

    ns, rest = parser.parse_known_args(argv)
    if hasattr(ns, "module"):
        import importlib

        try:
            mod = importlib.import_module(ns.module)
        except ModuleNotFoundError as e:
            print(f"error: `kvserve {ns.command}` is not available in this build ({e}).", file=sys.stderr)
            return 2
        return mod.main(rest)
    if rest:
        parser.error(f"unrecognized arguments: {' '.join(rest)}")
    try:
        return ns.func(ns)
    except ValueError as e:
        print(f"error: {flag_names(str(e))}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
