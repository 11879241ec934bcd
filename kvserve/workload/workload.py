"""Workloads, traces and arrival processes for the benchmarks (pure Python + numpy, no model).

* A **workload** file (``shared/workloads/w64.jsonl``) is one JSON object per line with
  ``prompt_token_ids``, ``prompt`` (text), ``prompt_len``, ``output_len``, ``arrival_s``.
* A **trace** gives arrival times and token counts but no text. Supported formats (auto-detected):
  Azure LLM 2023 CSV (``TIMESTAMP,ContextTokens,GeneratedTokens``), Vidur CSV
  (``arrived_at,num_prefill_tokens,num_decode_tokens``), Mooncake JSONL (``timestamp`` in ms,
  ``input_length``, ``output_length``, ``hash_ids`` of 512-token blocks) and the length-only CSVs
  (``num_prefill_tokens,num_decode_tokens,...``: no arrival times, pair them with generated
  arrivals).
* Prompts for a trace are **synthesised** from a corpus of real token ids (the workload files'
  prompts, i.e. text of the default model's tokenizer): a window of the corpus of the trace's
  length. With Mooncake ``hash_ids`` each 512-token block is chosen by its id, so requests that share
  a hash-id prefix share a token prefix (prefix caching sees the same sharing as in the trace).
* **Clipping** to the model's context (``clip_lengths``): the output length is capped at
  ``max_output_len`` (if given) and at ``max_model_len - 1``; the input is then capped at
  ``max_input_len`` (if given) and at ``max_model_len - output_len``, so every request fits
  ``input + output <= max_model_len``. Every clipped request is counted in the run's JSON.
* **LoRA adapters** (the simulator): an optional ``lora_id`` column (CSV) or key (JSONL traces
  and workload files) gives each request's adapter id, an integer >= 0 (0 or empty = the base
  model).
* **Tenants** (the simulator, the ``fair`` policy): an optional ``tenant`` column (CSV) or key
  (JSONL traces and workload files) names who each request is served for, a string of at most
  ``MAX_TENANT_CHARS`` characters (empty or missing = the default tenant).
"""

from __future__ import annotations

import csv
import json
import math
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

from kvserve.envs import shared_dir
from kvserve.field_limits import MAX_TENANT_CHARS

MOONCAKE_BLOCK_TOKENS = 512


def default_workload_path(name: str = "w64.jsonl") -> Path:
    return shared_dir() / "workloads" / name


@dataclass
class BenchRequest:
    """One request to send: token ids (and text when known), output length, arrival time (s
    from the run's start, or from request ``after_id``'s first token when that is set)."""

    prompt_token_ids: list[int]
    output_len: int
    prompt: str | None = None
    arrival_s: float = 0.0
    id: int = 0
    lora_id: int = 0  # LoRA adapter id (0 = the base model)
    tenant: str | None = None  # who it is served for (None = the default tenant)
    # arrival_s counts from this request's first token (or its end, if it has none) instead of
    # the run's start: a scenario stated in engine events holds on a host of any speed
    after_id: int | None = None

    @property
    def prompt_len(self) -> int:
        return len(self.prompt_token_ids)


@dataclass
class TraceRecord:
    """One trace row: arrival (s from the first row, None when the file has no times), lengths,
    its ``lora_id`` column (0 = the base model, also when the file has none) and ``tenant``
    column (None = the default tenant)."""

    arrival_s: float | None
    input_len: int
    output_len: int
    hash_ids: list[int] | None = None
    lora_id: int = 0
    tenant: str | None = None


def parse_lora_id(value, where: str) -> int:
    """A ``lora_id`` cell: an integer >= 0; empty or missing is 0 (the base model).

    Raises:
        ValueError: anything else, naming ``where`` (file and row) and the value.
    """
    if value is None or (isinstance(value, str) and not value.strip()):
        return 0
    try:
        n = int(value)
    except (TypeError, ValueError, OverflowError):  # OverflowError: inf (1e999 in JSON)
        n = -1
    if isinstance(value, bool) or n < 0 or (isinstance(value, float) and value != n):
        raise ValueError(f"{where}: lora_id must be an integer >= 0 (0 = no adapter), got {value!r}")
    return n


def parse_tenant(value, where: str) -> str | None:
    """A ``tenant`` cell: a string of at most ``MAX_TENANT_CHARS`` characters; empty or missing
    is None (the default tenant).

    Raises:
        ValueError: anything else, naming ``where`` (file and row) and the limit.
    """
    if value is None or (isinstance(value, str) and not value.strip()):
        return None
    if not isinstance(value, str) or len(value) > MAX_TENANT_CHARS:
        shown = f"{len(value)} characters" if isinstance(value, str) else repr(value)
        raise ValueError(
            f"{where}: tenant must be a string of at most {MAX_TENANT_CHARS} characters, got {shown}"
        )
    return value


@dataclass
class ClipReport:
    num_requests: int = 0
    input_clipped: int = 0
    output_clipped: int = 0
    max_model_len: int = 0
    max_input_len: int | None = None
    max_output_len: int | None = None
    input_tokens_before: int = 0
    input_tokens_after: int = 0
    output_tokens_before: int = 0
    output_tokens_after: int = 0

    def as_dict(self) -> dict:
        return dict(self.__dict__)


# ---------------------------------------------------------------- workload files
def load_workload(path, num_prompts: int | None = None) -> list[BenchRequest]:
    """Requests of a workload JSONL file (the first ``num_prompts`` when given).

    Raises:
        ValueError: an unreadable file, a line that is not a JSON object, one without
            ``prompt_token_ids`` (a list of integers >= 0) or ``output_len`` (an integer >= 1),
            or a bad ``arrival_s`` / ``id`` / ``lora_id`` (naming the file, line and field).
    """
    reqs: list[BenchRequest] = []
    for i, line in _text_lines(path, "workload"):
        if not line.strip():
            continue
        where = f"{path}:{i}"
        obj = _json_object(line, where, "a workload line")
        if "prompt_token_ids" not in obj or "output_len" not in obj:
            raise ValueError(f"{where}: a workload line needs prompt_token_ids and output_len")
        ids = obj["prompt_token_ids"]
        if not isinstance(ids, list) or any(
            isinstance(t, bool) or not isinstance(t, int) or t < 0 for t in ids
        ):
            raise ValueError(f"{where}: prompt_token_ids must be a list of integers >= 0")
        reqs.append(
            BenchRequest(
                prompt_token_ids=list(ids),
                output_len=_count_field(obj.get("output_len"), "output_len", where, lo=1),
                prompt=obj.get("prompt"),
                arrival_s=_time_field(obj.get("arrival_s", 0.0) or 0.0, "arrival_s", where),
                id=_count_field(obj.get("id", len(reqs)), "id", where, lo=0),
                lora_id=parse_lora_id(obj.get("lora_id"), where),
                tenant=parse_tenant(obj.get("tenant"), where),
            )
        )
        if num_prompts is not None and len(reqs) >= num_prompts:
            break
    return reqs


def load_corpus(paths: Sequence | None = None) -> list[int]:
    """Token ids to cut synthetic prompts from: the prompts of the workload files, concatenated
    (default: ``w256.jsonl``, else ``w64.jsonl``, from the shared workloads)."""
    if paths is None:
        paths = [
            p
            for p in (default_workload_path("w256.jsonl"), default_workload_path("w64.jsonl"))
            if p.is_file()
        ][:1]
    ids: list[int] = []
    for p in paths:
        for r in load_workload(p):
            ids.extend(r.prompt_token_ids)
    if not ids:
        raise ValueError(
            f"no corpus token ids: no workload file found (looked for w256.jsonl / w64.jsonl in "
            f"{shared_dir() / 'workloads'}; set KVSERVE_SHARED_DIR to the shared data folder)"
        )
    return ids


def corpus_window(corpus: Sequence[int], offset: int, length: int) -> list[int]:
    """``length`` tokens of ``corpus`` starting at ``offset``, wrapping around."""
    n = len(corpus)
    offset %= n
    out: list[int] = []
    while len(out) < length:
        take = min(length - len(out), n - offset)
        out.extend(corpus[offset : offset + take])
        offset = 0
    return out


def synthetic_requests(
    num_prompts: int, input_len: int, output_len: int, corpus: Sequence[int], seed: int = 0
) -> list[BenchRequest]:
    """``num_prompts`` prompts of exactly ``input_len`` corpus tokens at seeded offsets."""
    import numpy as np

    rng = np.random.default_rng(seed)
    return [
        BenchRequest(
            prompt_token_ids=corpus_window(corpus, int(rng.integers(len(corpus))), input_len),
            output_len=output_len,
            id=i,
        )
        for i in range(num_prompts)
    ]


# ---------------------------------------------------------------- arrivals
def generate_arrivals(n: int, rate: float, burstiness: float = 1.0, seed: int = 0) -> list[float]:
    """Send times (s) of ``n`` requests at mean ``rate`` req/s; the first is at 0.

    Inter-arrival gaps are gamma distributed with shape ``burstiness`` and mean ``1/rate``
    (``burstiness == 1`` is a Poisson process; below 1 is burstier, above 1 more regular; the
    coefficient of variation is ``1/sqrt(burstiness)``). ``rate == inf`` sends all at once.

    Raises:
        ValueError: rate or burstiness not positive.
    """
    if not rate > 0:
        raise ValueError(f"request rate must be > 0 (or inf), got {rate}")
    if not burstiness > 0:
        raise ValueError(f"burstiness must be > 0, got {burstiness}")
    if math.isinf(rate) or n == 0:
        return [0.0] * n
    import numpy as np

    rng = np.random.default_rng(seed)
    gaps = rng.gamma(shape=burstiness, scale=1.0 / (rate * burstiness), size=max(n - 1, 0))
    times = [0.0]
    for g in gaps:
        times.append(times[-1] + float(g))
    return times


# ---------------------------------------------------------------- traces
#: the columns (keys) each trace format needs, as ``detect_trace_format`` tells them apart
TRACE_COLUMNS = {
    "azure": ("TIMESTAMP", "ContextTokens", "GeneratedTokens"),
    "vidur": ("arrived_at", "num_prefill_tokens", "num_decode_tokens"),
    "lengths": ("num_prefill_tokens", "num_decode_tokens"),
    "mooncake": ("timestamp", "input_length", "output_length"),
}


def _text_lines(path, what: str):
    """``(line number, line)`` of a text file, read whole first.

    Raises:
        ValueError: the file cannot be read or is not UTF-8 text (naming it).
    """
    try:
        text = Path(path).read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ValueError(f"{path}: no such {what} file") from None
    except IsADirectoryError:
        raise ValueError(f"{path}: is a folder, not a {what} file") from None
    except OSError as e:
        raise ValueError(f"{path}: cannot read the {what} file ({e.strerror or e})") from None
    except UnicodeDecodeError as e:
        raise ValueError(f"{path}: not a UTF-8 text {what} file ({e.reason} at byte {e.start})") from None
    return enumerate(text.splitlines(), 1)


def _json_object(line: str, where: str, what: str) -> dict:
    """One JSONL line, which must be an object.

    Raises:
        ValueError: not JSON, or not an object (naming ``where``: file and line).
    """
    try:
        obj = json.loads(line)
    except json.JSONDecodeError as e:
        raise ValueError(f"{where}: not valid JSON ({e.msg} at column {e.colno})") from None
    except (ValueError, RecursionError) as e:
        # ValueError: an integer past Python's digit limit; RecursionError: arrays or objects
        # nested past the parser's depth
        raise ValueError(f"{where}: not valid JSON ({e})") from None
    if not isinstance(obj, dict):
        raise ValueError(f"{where}: {what} must be a JSON object, got {type(obj).__name__}")
    return obj


def _number(value, field: str, where: str, want: str) -> float:
    """A cell / value as a finite float (strings are parsed, bools refused).

    Raises:
        ValueError: missing, empty, not a number, nan or inf (naming ``where`` and ``field``).
    """
    if value is None or (isinstance(value, str) and not value.strip()):
        raise ValueError(f"{where}: missing value for {field} ({want})")
    try:
        if isinstance(value, bool):
            raise TypeError
        x = float(value)
    except (TypeError, ValueError):
        raise ValueError(f"{where}: {field} must be {want}, got {value!r}") from None
    if not math.isfinite(x):
        raise ValueError(f"{where}: {field} must be {want}, got {value!r}")
    return x


def _count_field(value, field: str, where: str, lo: int = 0) -> int:
    """A token count (``>= lo``; a CSV's ``100.0`` is 100, a fraction is truncated as before).

    Raises:
        ValueError: not a finite number >= ``lo`` (naming ``where`` and ``field``).
    """
    want = f"an integer >= {lo}"
    x = _number(value, field, where, want)
    if x < lo:
        raise ValueError(f"{where}: {field} must be {want}, got {value!r}")
    return int(x)


def _time_field(value, field: str, where: str) -> float:
    """An arrival time: a finite number >= 0.

    Raises:
        ValueError: otherwise (naming ``where`` and ``field``).
    """
    x = _number(value, field, where, "a finite number >= 0")
    if x < 0:
        raise ValueError(f"{where}: {field} must be a finite number >= 0, got {value!r}")
    return x


def detect_trace_format(path) -> str:
    """``azure`` | ``vidur`` | ``mooncake`` | ``lengths`` from the header / first line.

    Raises:
        ValueError: an unreadable or empty file, or an unknown layout (naming the columns a
            near format lacks).
    """
    first = next((line.strip() for _, line in _text_lines(path, "trace")), "")
    if not first:
        raise ValueError(f"{path}: empty trace file (the first line must be a CSV header or a JSON object)")
    if first.startswith(("{", "[")):
        obj = _json_object(first, f"{path}:1", "a JSONL trace line")
        missing = [k for k in TRACE_COLUMNS["mooncake"] if k not in obj]
        if not missing:
            return "mooncake"
        raise ValueError(f"{path}:1: JSONL trace line lacks field(s) {', '.join(missing)}")
    cols = {c.strip() for c in first.split(",")}
    for fmt in ("azure", "vidur", "lengths"):
        if set(TRACE_COLUMNS[fmt]) <= cols:
            return fmt
    # the format whose columns it shares most: name what it lacks
    near = max(("azure", "vidur"), key=lambda f: len(set(TRACE_COLUMNS[f]) & cols))
    missing = [c for c in TRACE_COLUMNS[near] if c not in cols]
    hint = (
        f"; {'an Azure' if near == 'azure' else 'a Vidur'} trace lacks column(s) {', '.join(missing)}"
        if len(missing) < len(TRACE_COLUMNS[near])
        else ""
    )
    raise ValueError(f"{path}: unknown trace format (header {first[:120]!r}{hint})")


def _parse_azure_time(s: str) -> float:
    # "2023-11-16 18:17:03.9799600": 7 fractional digits, more than datetime's 6.
    s = s.strip()
    main, _, frac = s.partition(".")
    t = datetime.strptime(main, "%Y-%m-%d %H:%M:%S").timestamp()
    if frac and not frac.isdigit():
        raise ValueError(f"fractional seconds {frac!r}")
    return t + (float("0." + frac) if frac else 0.0)


def _azure_time(value, where: str) -> float:
    if value is None or not value.strip():
        raise ValueError(f"{where}: missing value for TIMESTAMP")
    try:
        return _parse_azure_time(value)
    except ValueError:
        raise ValueError(
            f"{where}: TIMESTAMP must be a time like 2023-11-16 18:17:03.9799600, got {value!r}"
        ) from None


def _mooncake_record(o: dict, where: str) -> TraceRecord:
    for key in TRACE_COLUMNS["mooncake"]:
        if key not in o:
            raise ValueError(f"{where}: missing field {key!r}")
    hash_ids = o.get("hash_ids")
    if hash_ids is not None and (
        not isinstance(hash_ids, list)
        or any(isinstance(h, bool) or not isinstance(h, int) or h < 0 for h in hash_ids)
    ):
        raise ValueError(f"{where}: hash_ids must be a list of integers >= 0")
    return TraceRecord(
        _time_field(o["timestamp"], "timestamp", where) / 1000.0,
        _count_field(o["input_length"], "input_length", where),
        _count_field(o["output_length"], "output_length", where),
        list(hash_ids or []) or None,
        parse_lora_id(o.get("lora_id"), where),
        parse_tenant(o.get("tenant"), where),
    )


def _csv_record(fmt: str, row: dict, where: str) -> TraceRecord:
    if None in row:  # more cells than the header has columns
        raise ValueError(f"{where}: {len(row) - 1 + len(row[None])} cells, the header has {len(row) - 1}")
    if fmt == "azure":
        return TraceRecord(
            _azure_time(row["TIMESTAMP"], where),
            _count_field(row["ContextTokens"], "ContextTokens", where),
            _count_field(row["GeneratedTokens"], "GeneratedTokens", where),
        )
    if fmt in ("vidur", "lengths"):
        return TraceRecord(
            _time_field(row["arrived_at"], "arrived_at", where) if fmt == "vidur" else None,
            _count_field(row["num_prefill_tokens"], "num_prefill_tokens", where),
            _count_field(row["num_decode_tokens"], "num_decode_tokens", where),
        )
    raise ValueError(f"unknown trace format {fmt!r}")


def load_trace(path, fmt: str = "auto") -> list[TraceRecord]:
    """Rows of a trace file in file order, arrival times relative to the first row (s).

    Raises:
        ValueError: an unreadable or empty file, an unknown format, a trace without rows, or a
            malformed row: a missing or extra cell, a value that is not a number, a negative
            length or time, nan or inf, a row arriving before the one above it (naming the
            file, the line and the field).
    """
    fmt = detect_trace_format(path) if fmt == "auto" else fmt
    records: list[TraceRecord] = []
    wheres: list[str] = []
    lines = _text_lines(path, "trace")
    if fmt == "mooncake":
        for n, line in lines:
            if line.strip():
                wheres.append(where := f"{path}:{n}")
                records.append(_mooncake_record(_json_object(line, where, "a JSONL trace line"), where))
    else:
        numbered = [(n, line) for n, line in lines if line.strip()]
        reader = csv.DictReader(line for _, line in numbered)
        for (n, _), row in zip(numbered[1:], reader):
            wheres.append(where := f"{path}:{n}")
            records.append(_csv_record(fmt, row, where))
            records[-1].lora_id = parse_lora_id(row.get("lora_id"), where)
            records[-1].tenant = parse_tenant(row.get("tenant"), where)
    if not records:
        raise ValueError(f"{path}: the trace has no rows (only a header)")
    for k in range(1, len(records) if records[0].arrival_s is not None else 0):
        # rows out of order would be re-based and cut (--num-requests) in file order: negative
        # arrival times, a selection that is not the first arrivals
        if _arrival(records[k]) < _arrival(records[k - 1]):
            raise ValueError(
                f"{wheres[k]}: arrives before the row above it (a trace's rows must be in arrival order)"
            )
    if records[0].arrival_s is not None:
        t0 = min(_arrival(r) for r in records)
        for r in records:
            r.arrival_s = _arrival(r) - t0
    return records


def _arrival(r: TraceRecord) -> float:
    """``r.arrival_s`` in a trace whose rows carry times (a format gives every row one or none).

    Raises:
        ValueError: the row has no arrival time.
    """
    if r.arrival_s is None:
        raise ValueError("a trace row without an arrival time among rows with one")
    return r.arrival_s


def select_trace(
    records: list[TraceRecord],
    start_s: float = 0.0,
    duration_s: float | None = None,
    num_requests: int | None = None,
) -> list[TraceRecord]:
    """Rows arriving in ``[start_s, start_s + duration_s)`` (then at most ``num_requests``), with
    arrivals re-based so the first selected row arrives at 0. Rows without times are only cut by count."""
    if records and records[0].arrival_s is not None:
        end = math.inf if duration_s is None else start_s + duration_s
        sel = [
            TraceRecord(r.arrival_s, r.input_len, r.output_len, r.hash_ids, r.lora_id, r.tenant)
            for r in records
            if start_s <= _arrival(r) < end
        ]
        if sel:
            t0 = _arrival(sel[0])
            for r in sel:
                r.arrival_s = _arrival(r) - t0
    else:
        sel = list(records)
    return sel[:num_requests] if num_requests is not None else sel


def scale_arrivals(records: list[TraceRecord], time_scale: float) -> list[TraceRecord]:
    """Multiplies every arrival time by ``time_scale`` (0.5 = twice the trace's request rate,
    as Vidur's ``time_scale_factor``). Returns new records.

    Raises:
        ValueError: ``time_scale`` < 0.
    """
    if time_scale < 0:
        raise ValueError(f"time scale must be >= 0, got {time_scale}")
    return [
        TraceRecord(
            None if r.arrival_s is None else r.arrival_s * time_scale,
            r.input_len,
            r.output_len,
            r.hash_ids,
            r.lora_id,
            r.tenant,
        )
        for r in records
    ]


def clip_lengths(
    input_len: int,
    output_len: int,
    max_model_len: int,
    max_input_len: int | None = None,
    max_output_len: int | None = None,
):
    """``(input_len, output_len)`` clipped so that ``input + output <= max_model_len`` (see module doc).

    Raises:
        ValueError: ``max_model_len < 2``.
    """
    if max_model_len < 2:
        raise ValueError(f"max_model_len must be >= 2, got {max_model_len}")
    out_cap = max_model_len - 1 if max_output_len is None else min(max_output_len, max_model_len - 1)
    out = max(1, min(output_len, out_cap))
    in_cap = max_model_len - out if max_input_len is None else min(max_input_len, max_model_len - out)
    inp = max(1, min(input_len, in_cap))
    return inp, out


def trace_to_requests(
    records: Sequence[TraceRecord],
    corpus: Sequence[int],
    max_model_len: int,
    max_input_len: int | None = None,
    max_output_len: int | None = None,
    seed: int = 0,
):
    """``(requests, ClipReport)``: prompts synthesised from ``corpus`` with the trace's (clipped)
    lengths and arrival times (0 for rows without times; the caller then sets them)."""
    import numpy as np

    rng = np.random.default_rng(seed)
    report = ClipReport(
        max_model_len=max_model_len, max_input_len=max_input_len, max_output_len=max_output_len
    )
    span = max(len(corpus) - MOONCAKE_BLOCK_TOKENS, 1)
    reqs: list[BenchRequest] = []
    for i, r in enumerate(records):
        inp, out = clip_lengths(r.input_len, r.output_len, max_model_len, max_input_len, max_output_len)
        report.num_requests += 1
        report.input_clipped += inp < r.input_len
        report.output_clipped += out < r.output_len
        report.input_tokens_before += r.input_len
        report.input_tokens_after += inp
        report.output_tokens_before += r.output_len
        report.output_tokens_after += out
        if r.hash_ids:
            ids: list[int] = []
            for h in r.hash_ids:
                if len(ids) >= inp:
                    break
                # A block's tokens depend only on its id: equal hash-id prefixes -> equal token prefixes.
                ids.extend(corpus_window(corpus, (h * 1_000_003) % span, MOONCAKE_BLOCK_TOKENS))
            ids = ids[:inp]
            if len(ids) < inp:
                ids.extend(corpus_window(corpus, int(rng.integers(len(corpus))), inp - len(ids)))
        else:
            ids = corpus_window(corpus, int(rng.integers(len(corpus))), inp)
        reqs.append(
            BenchRequest(
                prompt_token_ids=ids,
                output_len=out,
                arrival_s=r.arrival_s or 0.0,
                id=i,
                lora_id=r.lora_id,
                tenant=r.tenant,
            )
        )
    return reqs, report
