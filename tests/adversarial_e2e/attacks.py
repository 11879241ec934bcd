"""Every known attack shape on the serving path, once, as data: HTTP request bodies with the
answer each must get, and the same shapes for the offline API with the field its ValueError must
name. ``storm.py`` fires them at a running server; ``storm_child.py`` runs them in a child process
(a crash there fails a test instead of killing pytest).

Expected answers are the project's rules for bad input: a 400 (404 for a ``model`` no adapter
can have) whose OpenAI-style body names the field, or a normal 200 for a request that is heavy
but within every limit. The server these shapes are built for runs ``SERVER_KWARGS``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from kvserve.field_limits import (
    FLOAT32_MAX,
    MAX_ITEMS,
    MAX_LOGPROBS,
    MAX_PROMPT_LOGPROB_ENTRIES,
    MAX_REQUEST_PREFILL_COST,
    MAX_REQUEST_SEQUENCES,
    MAX_STOP_CHARS,
    prefill_cost,
    prompt_logprob_entries,
)
from kvserve.structured_output import DEFAULT_LIMITS
from tests.structured_output.deep_child import deep_defs_schema, deep_json_text, deep_lark

#: Engine settings of the attacked server (tiny random Llama): a small KV pool (64 blocks of 8
#: tokens) that the heavy requests overrun, so preemption and queueing happen during the storm.
SERVER_KWARGS = dict(
    block_size=8,
    num_gpu_blocks=64,
    num_cpu_blocks=16,
    max_model_len=128,
    max_num_batched_tokens=128,
    max_num_seqs=8,
    watermark=0.0,
    seed=0,
    enable_lora=True,
    max_loras=1,
    max_lora_rank=8,
    max_cpu_loras=2,
)
MAX_MODEL_LEN = SERVER_KWARGS["max_model_len"]
MAX_NUM_SEQS = SERVER_KWARGS["max_num_seqs"]
#: Widest beam (``field_limits.LIMITS["beam_width"]``: each step asks for 2 x width logprobs).
MAX_BEAM_WIDTH = MAX_LOGPROBS // 2

#: The neighbours: greedy streams of fixed prompts that run through the whole storm.
NEIGHBOUR_PROMPTS = [
    "The quick brown fox",
    "Once upon a time in a land",
    "def add(a, b):",
    "Paris is the capital of",
]
NEIGHBOUR_MAX_TOKENS = 16

#: A prompt of under ``LONG_PROMPT_TOKENS`` tokens of the default tokenizer (long for
#: ``MAX_MODEL_LEN``; ``check_shapes_within_caps`` checks the bound).
LONG_PROMPT = " ".join(f"word{i}" for i in range(35))
LONG_PROMPT_TOKENS = 100
#: ``prompt_logprobs`` 20 on this many long prompts in one request.
LOGPROB_PROMPTS = 8
LONG_PROMPTS = [f"{i} {LONG_PROMPT}" for i in range(LOGPROB_PROMPTS)]

LORA_NAMES = {"dotdot": "../../etc", "nul": "a\x00b", "newline": "a\nINFO forged", "100k": "m" * 100_000}

DEEP_TOOL_ARGUMENTS = "[" * 100_000  # JSON text nested 100k deep, as a tool call's arguments


@dataclass(frozen=True)
class Attack:
    """One HTTP attack.

    Attributes:
        name: unique, for reports.
        route: the POST path.
        body: the JSON body (a dict) or JSON text (str).
        status: the answer it must get (200, 400 or 404).
        param: the ``error.param`` a rejection must name (None: no field to name).
        mode: ``"plain"``; ``"disconnect"`` (stream, close after the first chunk) or ``"abort"``
            (the client gives up after ``ABORT_AFTER_S`` without reading the answer).
        crash_class: a shape that once could crash the process (deep recursion in a parser or
            the grammar compiler); run where a crash cannot kill the test runner.
    """

    name: str
    route: str
    body: dict | str
    status: int
    param: str | None = None
    mode: str = "plain"
    crash_class: bool = False


#: Seconds an ``abort`` attack's client waits before it closes the connection.
ABORT_AFTER_S = 0.3
COMPLETIONS = "/v1/completions"
CHAT = "/v1/chat/completions"
LOAD_LORA = "/v1/load_lora_adapter"


def _c(name, extra, status=400, param=None, **kw) -> Attack:
    return Attack(name, COMPLETIONS, {"prompt": "x", "max_tokens": 4, **extra}, status, param, **kw)


def _schema_format(schema) -> dict:
    return {"response_format": {"type": "json_schema", "json_schema": {"name": "s", "schema": schema}}}


REF_LOOP = {"$ref": "#/$defs/a", "$defs": {"a": {"$ref": "#/$defs/a"}}}
NEVER_ENDING_LARK = 'start: a\na: "x" a'

#: The shapes that once could crash the process: deep recursion in a parser or the compiler.
CRASH_CLASS = [
    _c(
        "deep $defs chain (3000)",
        _schema_format(deep_defs_schema()),
        param="response_format",
        crash_class=True,
    ),
    _c("3000-rule Lark grammar", {"guided_grammar": deep_lark()}, param="guided_grammar", crash_class=True),
    _c("deep guided_json text", {"guided_json": deep_json_text()}, param="guided_json", crash_class=True),
    _c("guided_json '[' x 100k", {"guided_json": "[" * 100_000}, param="guided_json", crash_class=True),
    _c("unmatchable regex", {"guided_regex": r"[^\s\S]"}, param="guided_regex", crash_class=True),
    _c("$ref loop", {"guided_json": REF_LOOP}, param="guided_json", crash_class=True),
    _c(
        "never-ending grammar",
        {"guided_grammar": NEVER_ENDING_LARK},
        param="guided_grammar",
        crash_class=True,
    ),
    _c(
        "3000-rule Lark grammar, streamed",
        {"guided_grammar": deep_lark(), "stream": True},
        param="guided_grammar",
        crash_class=True,
    ),
    Attack(
        "deep $defs chain (3000), chat, streamed",
        CHAT,
        {
            "messages": [{"role": "user", "content": "x"}],
            "max_tokens": 4,
            "stream": True,
            **_schema_format(deep_defs_schema()),
        },
        400,
        "response_format",
        crash_class=True,
    ),
    _c(
        "3000-rule Lark in structured_outputs",
        {"structured_outputs": {"grammar": deep_lark()}},
        param="structured_outputs.grammar",
        crash_class=True,
    ),
    Attack(
        "deep $defs chain (3000) in a tool's parameters, tool_choice required",
        CHAT,
        {
            "messages": [{"role": "user", "content": "x"}],
            "max_tokens": 4,
            "tools": [{"type": "function", "function": {"name": "f", "parameters": deep_defs_schema()}}],
            "tool_choice": "required",
        },
        400,
        "tools",
        crash_class=True,
    ),
    Attack(
        "100k-deep JSON in tool_call arguments",
        CHAT,
        {
            "messages": [
                {"role": "user", "content": "x"},
                {
                    "role": "assistant",
                    "tool_calls": [
                        {
                            "id": "c",
                            "type": "function",
                            "function": {"name": "f", "arguments": DEEP_TOOL_ARGUMENTS},
                        }
                    ],
                },
            ],
            "max_tokens": 4,
        },
        400,
        "messages",
        crash_class=True,
    ),
]


def _choices(n: int) -> list[str]:
    return [f"c{i}" for i in range(n)]


def _many_prompts(n: int) -> list[str]:
    return [f"{i}" for i in range(n)]


def _attacks() -> list[Attack]:
    stop_at_limit = [chr(0x4E00 + i) * MAX_STOP_CHARS for i in range(MAX_ITEMS["stop"])]
    beam = {"use_beam_search": True, "best_of": 2, "max_tokens": 3}
    per_prompt = MAX_REQUEST_SEQUENCES // MAX_NUM_SEQS
    L = DEFAULT_LIMITS
    at_limit_lark = (
        "start: r0\n"
        + "".join(f'r{i}: "x{i}" | r{i + 1}\n' for i in range(L.max_rules - 2))
        + f'r{L.max_rules - 2}: "y"\n'
    )
    out = [
        # constraints at their limits: compiled and matched while everything else runs
        _c(
            f"{L.max_choices} choices, n {MAX_NUM_SEQS}",
            {"guided_choice": _choices(L.max_choices), "n": MAX_NUM_SEQS},
            200,
        ),
        _c(
            f"anyOf of {L.max_alternatives}",
            {"guided_json": {"anyOf": [{"const": f"v{i}"} for i in range(L.max_alternatives)]}},
            200,
        ),
        _c(f"$ref chain of {L.max_ref_chain}", _schema_format(deep_defs_schema(L.max_ref_chain - 2)), 200),
        _c(f"{L.max_rules}-rule Lark grammar", {"guided_grammar": at_limit_lark}, 200),
        _c(f"regex repeating {L.max_repeat} times", {"guided_regex": f"[ab]{{{L.max_repeat}}}"}, 200),
        _c("a{1000000}", {"guided_regex": "a{1000000}"}, param="guided_regex"),
        _c("5000 choices", {"guided_choice": [f"c{i}" for i in range(5000)]}, param="guided_choice"),
        _c(
            "int64-overflowing minimum",
            {"guided_json": {"type": "integer", "minimum": 1e30}},
            param="guided_json",
        ),
        _c(
            "int64-overflowing maximum",
            _schema_format({"type": ["integer", "null"], "maximum": -(2**63) - 1}),
            param="response_format",
        ),
        _c("length_penalty +f32 max, beam", {**beam, "length_penalty": FLOAT32_MAX}, 200),
        _c("length_penalty -f32 max, beam", {**beam, "length_penalty": -FLOAT32_MAX}, 200),
        Attack(
            f"prompt_logprobs {MAX_LOGPROBS} on {LOGPROB_PROMPTS} long prompts",
            COMPLETIONS,
            {"prompt": LONG_PROMPTS, "max_tokens": 1, "prompt_logprobs": MAX_LOGPROBS},
            200,
        ),
        Attack(
            f"echo + logprobs {MAX_LOGPROBS}",
            COMPLETIONS,
            {"prompt": LONG_PROMPT, "max_tokens": 4, "echo": True, "logprobs": MAX_LOGPROBS},
            200,
        ),
        _c(f"logprobs {MAX_LOGPROBS + 1}", {"logprobs": MAX_LOGPROBS + 1}, param="logprobs"),
        _c(
            f"prompt_logprobs {MAX_LOGPROBS + 1}",
            {"prompt_logprobs": MAX_LOGPROBS + 1},
            param="prompt_logprobs",
        ),
        _c(f"n {MAX_NUM_SEQS} (max_num_seqs)", {"n": MAX_NUM_SEQS, "max_tokens": 2}, 200),
        _c(f"n {MAX_NUM_SEQS + 1}", {"n": MAX_NUM_SEQS + 1}, param="n"),
        Attack(
            f"{per_prompt} prompts x n {MAX_NUM_SEQS} ({MAX_REQUEST_SEQUENCES} sequences)",
            COMPLETIONS,
            {"prompt": _many_prompts(per_prompt), "n": MAX_NUM_SEQS, "max_tokens": 1},
            200,
        ),
        Attack(
            f"{per_prompt + 1} prompts x n {MAX_NUM_SEQS}",
            COMPLETIONS,
            {"prompt": _many_prompts(per_prompt + 1), "n": MAX_NUM_SEQS, "max_tokens": 1},
            400,
            "n",
        ),
        _c(f"best_of {MAX_BEAM_WIDTH}, beam", {**beam, "best_of": MAX_BEAM_WIDTH}, 200),
        _c(f"best_of {MAX_BEAM_WIDTH + 1}, beam", {**beam, "best_of": MAX_BEAM_WIDTH + 1}, param="best_of"),
        _c("best_of < n, sampling", {"n": 2, "best_of": 1}, param="best_of"),
        _c(f"max_tokens {MAX_MODEL_LEN + 1}", {"max_tokens": MAX_MODEL_LEN + 1}, param="max_tokens"),
        _c("max_tokens 2**63", {"max_tokens": 2**63}, param="max_tokens"),
        Attack("empty prompt", COMPLETIONS, {"prompt": "", "max_tokens": 4}, 400, "prompt"),
        Attack("empty chat", CHAT, {"messages": [], "max_tokens": 4}, 400, "messages"),
        _c(
            f"stop list at the limit ({len(stop_at_limit)} x {MAX_STOP_CHARS} chars)",
            {"stop": stop_at_limit},
            200,
        ),
        _c("stop list past the limit", {"stop": stop_at_limit + ["x"]}, param="stop"),
        _c("stop string past the limit", {"stop": ["y" * (MAX_STOP_CHARS + 1)]}, param="stop"),
        Attack(
            "disconnect after the first chunk",
            COMPLETIONS,
            {"prompt": "Tell me", "max_tokens": 100, "ignore_eos": True, "stream": True},
            200,
            mode="disconnect",
        ),
        Attack(
            "disconnect after the first chat chunk",
            CHAT,
            {
                "messages": [{"role": "user", "content": "hi"}],
                "max_tokens": 64,
                "ignore_eos": True,
                "stream": True,
                "logprobs": True,
                "top_logprobs": MAX_LOGPROBS,
            },
            200,
            mode="disconnect",
        ),
        _c(
            "abort: client gives up",
            {"prompt": LONG_PROMPT, "max_tokens": 20, "ignore_eos": True},
            200,
            mode="abort",
        ),
    ]
    for key, name in LORA_NAMES.items():
        out.append(_c(f"model = LoRA name {key}", {"model": name}, 404, "model"))
        out.append(
            Attack(
                f"load LoRA name {key}", LOAD_LORA, {"lora_name": name, "lora_path": "/tmp"}, 400, "lora_name"
            )
        )
    return out


#: The crash-class shapes first, then the rest.
ATTACKS: list[Attack] = CRASH_CLASS + _attacks()


def check_shapes_within_caps(tokenize) -> None:
    """The heavy-but-legal shapes stay within the request caps for this tokenizer
    (``tokenize(text) -> list[int]``); raises AssertionError otherwise."""
    lens = [len(tokenize(p)) for p in LONG_PROMPTS]
    assert max(lens) <= LONG_PROMPT_TOKENS < MAX_MODEL_LEN, lens
    assert prompt_logprob_entries(lens, MAX_LOGPROBS) <= MAX_PROMPT_LOGPROB_ENTRIES
    assert prefill_cost(lens, MAX_LOGPROBS) <= MAX_REQUEST_PREFILL_COST


# ---------------------------------------------------------------------------- offline
@dataclass(frozen=True)
class OfflineAttack:
    """One offline call.

    Attributes:
        kind: ``"generate"``, ``"chat"`` (``prompt`` a conversation) or ``"beam_search"``.
        params: keyword arguments of ``SamplingParams`` (``structured_outputs`` as the keyword
            arguments of ``StructuredOutputsParams``), or of ``BeamSearchParams``.
        field: the field the ValueError's message must name; None: the call must succeed.
        lora: a ``LoRARequest`` name to send with it.
    """

    name: str
    field: str | None
    params: dict
    kind: str = "generate"
    prompt: object = "x"
    lora: str | None = None
    crash_class: bool = False


def _so(name, field_name, crash=False, **so) -> OfflineAttack:
    return OfflineAttack(name, field_name, {"max_tokens": 4, "structured_outputs": so}, crash_class=crash)


OFFLINE_ATTACKS: list[OfflineAttack] = [
    _so("deep $defs chain (3000)", "structured_outputs.json", True, json=deep_defs_schema()),
    _so("3000-rule Lark grammar", "structured_outputs.grammar", True, grammar=deep_lark()),
    _so("deep JSON text", "structured_outputs.json", True, json=deep_json_text()),
    _so("unmatchable regex", "structured_outputs.regex", True, regex=r"[^\s\S]"),
    _so("$ref loop", "structured_outputs.json", True, json=REF_LOOP),
    _so("never-ending grammar", "structured_outputs.grammar", True, grammar=NEVER_ENDING_LARK),
    _so("a{1000000}", "structured_outputs.regex", regex="a{1000000}"),
    _so("5000 choices", "structured_outputs.choice", choice=[f"c{i}" for i in range(5000)]),
    _so("int64-overflowing bounds", "structured_outputs.json", json={"type": "integer", "minimum": 1e30}),
    OfflineAttack(
        "chat + deep $defs chain",
        "structured_outputs.json",
        {"max_tokens": 4, "structured_outputs": {"json": deep_defs_schema()}},
        kind="chat",
        prompt=[{"role": "user", "content": "x"}],
        crash_class=True,
    ),
    OfflineAttack(
        "chat + never-ending grammar",
        "structured_outputs.grammar",
        {"max_tokens": 4, "structured_outputs": {"grammar": NEVER_ENDING_LARK}},
        kind="chat",
        prompt=[{"role": "user", "content": "x"}],
        crash_class=True,
    ),
    OfflineAttack(f"n {MAX_NUM_SEQS + 1}", "n", {"n": MAX_NUM_SEQS + 1, "max_tokens": 2}),
    OfflineAttack(f"max_tokens {MAX_MODEL_LEN + 1}", "max_tokens", {"max_tokens": MAX_MODEL_LEN + 1}),
    OfflineAttack("max_tokens 2**63", "max_tokens", {"max_tokens": 2**63}),
    OfflineAttack(f"logprobs {MAX_LOGPROBS + 1}", "logprobs", {"logprobs": MAX_LOGPROBS + 1}),
    OfflineAttack(
        f"prompt_logprobs {MAX_LOGPROBS + 1}", "prompt_logprobs", {"prompt_logprobs": MAX_LOGPROBS + 1}
    ),
    OfflineAttack("stop list past the limit", "stop", {"stop": ["s"] * (MAX_ITEMS["stop"] + 1)}),
    OfflineAttack("empty prompt", "prompt", {"max_tokens": 2}, prompt=""),
    OfflineAttack(
        "beam length_penalty inf",
        "length_penalty",
        {"beam_width": 2, "max_tokens": 3, "length_penalty": float("inf")},
        kind="beam_search",
    ),
    OfflineAttack(
        f"beam_width {MAX_BEAM_WIDTH + 1}",
        "beam_width",
        {"beam_width": MAX_BEAM_WIDTH + 1, "max_tokens": 3},
        kind="beam_search",
    ),
    *[
        OfflineAttack(f"LoRA name {key}", "lora_request.lora_name", {"max_tokens": 2}, lora=name)
        for key, name in LORA_NAMES.items()
    ],
    # heavy but legal: these must succeed
    OfflineAttack(
        "beam length_penalty +f32 max",
        None,
        {"beam_width": 2, "max_tokens": 3, "length_penalty": FLOAT32_MAX},
        kind="beam_search",
    ),
    OfflineAttack(
        "beam length_penalty -f32 max",
        None,
        {"beam_width": 2, "max_tokens": 3, "length_penalty": -FLOAT32_MAX},
        kind="beam_search",
    ),
    OfflineAttack(
        f"prompt_logprobs {MAX_LOGPROBS} on {LOGPROB_PROMPTS} long prompts",
        None,
        {"max_tokens": 1, "prompt_logprobs": MAX_LOGPROBS},
        prompt=LONG_PROMPTS,
    ),
    OfflineAttack(
        f"n {MAX_NUM_SEQS}", None, {"n": MAX_NUM_SEQS, "max_tokens": 2, "temperature": 1.0, "seed": 1}
    ),
]


def body_text(attack: Attack) -> str:
    """The attack's body as JSON text."""
    return attack.body if isinstance(attack.body, str) else json.dumps(attack.body)
