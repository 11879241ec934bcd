"""The cost-model file ``kvserve profile`` writes and ``kvserve simulate --cost-model`` reads.

A JSON object (``SCHEMA_VERSION`` 1)::

    {"schema": "kvserve-cost-model", "schema_version": 1, "created": "...",
     "kvserve_version": "0.1.0",
     "model": {"name": "SmolLM2-135M-Instruct", "path": "...", "config_sha256": "...",
               "quantization": null},
     "dtype": "float32", "block_size": 16, "device": "cpu",
     "host": {"cpu": "...", "cores": 2, "affinity": 2, "threads": 2, "flags": ["avx2", ...]},
     "engine": {"enable_chunked_prefill": true, "max_num_batched_tokens": 2048, ...},
     "coefficients": {"base_s": ..., "prefill_token_s": ..., ...},
     "decode_knots": {"8": ...}, "prefill_knots": {"512": ...}, "attention_split": {"kv_heads": 3, "threads": 2},
     "fit_error": {"prefill": {"n", "mean", "p90", "max", "bias"}, "decode": ..., "all": ...},
     "profile": {"wall_s": ..., "samples": [{"shape": {...StepShape}, "t": seconds}, ...]}}

``decode_knots`` (seconds per decode past each batch size, in decode-only steps),
``prefill_knots`` (seconds per forward row up to each row count, in steps carrying prompt tokens)
and ``attention_split`` (the decode attention's work split) are optional: a file without them
simulates with none (``CostModel``'s docstring says what they model).

``engine`` holds the step-budget settings the profile ran with; the simulator takes them as
its defaults (the profiled device is this host, not the simulator's generic one). ``profile``
keeps the measurements so a file can be refitted. A simulation's model, dtype and block size
must be the profile's: ``check_engine_args`` raises a ``ValueError`` naming the field.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
from dataclasses import dataclass
from pathlib import Path

from kvserve.sim.cost_model import FEATURES, CostModel
from kvserve.sim.step_shape import StepShape

SCHEMA = "kvserve-cost-model"
SCHEMA_VERSION = 1
REQUIRED = ("model", "dtype", "block_size", "host", "kvserve_version", "coefficients", "fit_error")


def model_identity(model: str | None, quantization: str | None = None) -> dict:
    """``{"name", "path", "config_sha256", "quantization"}`` of a model as ``EngineArgs.model``
    names it: the hash is of its ``config.json`` (keys sorted), so two copies of one model
    match and a different architecture or size does not.

    Raises:
        ValueError: the model cannot be resolved (``resolve_model_dir``'s errors).
    """
    from kvserve.model_executor.model_loader import resolve_model_dir

    d = Path(resolve_model_dir(model, quantization))
    cfg = json.loads((d / "config.json").read_text())
    digest = hashlib.sha256(json.dumps(cfg, sort_keys=True).encode()).hexdigest()
    name = d.name if model is None or Path(str(model)).is_dir() else Path(str(model)).name
    if model is None:
        name = "SmolLM2-135M-Instruct (default)"
    return {"name": name, "path": str(d), "config_sha256": digest, "quantization": quantization}


def host_info() -> dict:
    """The CPU this profile was measured on: model name, cores, the thread count torch uses and
    the vector-ISA flags that decide which kernels run."""
    from kvserve.ops.cpu import cpu_flags, cpu_model

    info: dict = {
        "cpu": cpu_model(),
        "cores": os.cpu_count(),
        "affinity": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
        "flags": sorted(f for f in cpu_flags() if f.startswith(("avx512", "avx2", "amx", "fma"))),
    }
    try:
        import torch

        info["threads"] = torch.get_num_threads()
        if torch.cuda.is_available():
            info["gpu"] = torch.cuda.get_device_name(0)
    except Exception:  # torch missing: a file read on a machine without it
        pass
    return info


@dataclass
class CostModelFile:
    """A loaded cost-model file: the ``CostModel`` (with ``info`` naming model, hardware,
    dtype and the file) and the raw JSON object (``data``)."""

    cost_model: CostModel
    data: dict
    path: str

    @property
    def block_size(self) -> int:
        return int(self.data["block_size"])

    @property
    def dtype(self) -> str:
        return str(self.data["dtype"])

    @property
    def engine(self) -> dict:
        return dict(self.data.get("engine") or {})

    def samples(self) -> list[tuple[StepShape, float]]:
        """The profile's measured steps (empty when the file has none).

        Raises:
            ValueError: ``profile.samples`` is malformed: not a list of ``{"shape", "t"}``, a
                shape field that is not a count of ``StepShape`` (a finite number in
                ``[0, MAX_SHAPE_COUNT]``), a time that is not a finite number in ``[0, 3600]``.
        """
        out = []
        try:
            for i, s in enumerate((self.data.get("profile") or {}).get("samples") or []):
                where = f"{self.path}: profile.samples[{i}]"
                shape = s["shape"]
                for k in shape:  # not a dict: TypeError/AttributeError below
                    _num(shape, k, f"{where}.shape", hi=MAX_SHAPE_COUNT)
                out.append((StepShape(**shape), _num(s, "t", where)))
        except (AttributeError, KeyError, TypeError) as e:
            raise ValueError(f"{self.path}: profile.samples is malformed ({e!r})") from e
        return out

    def swap_samples(self) -> list[tuple[int, float]]:
        """The profile's measured swap calls ``(blocks, seconds)`` (empty when none).

        Raises:
            ValueError: ``profile.swap_samples`` is not a list of ``{"blocks": integer >= 0,
                "t": seconds}`` (naming the entry and the field).
        """
        out = []
        try:
            for i, s in enumerate((self.data.get("profile") or {}).get("swap_samples") or []):
                where = f"{self.path}: profile.swap_samples[{i}]"
                n = s.get("blocks")
                if isinstance(n, bool) or not isinstance(n, int) or n < 0:
                    raise ValueError(f"{where}: blocks must be an integer >= 0, got {n!r}")
                out.append((n, _num(s, "t", where)))
        except (AttributeError, TypeError) as e:
            raise ValueError(f"{self.path}: profile.swap_samples is malformed ({e!r})") from e
        return out

    def check_engine_args(self, args) -> None:
        """Raise ``ValueError`` naming the field when ``args`` (``EngineArgs``) simulate something
        other than what was profiled: ``block_size`` always; ``dtype`` unless ``auto``;
        ``model`` and ``quantization`` when set."""
        if args.block_size != self.block_size:
            raise ValueError(
                f"block_size: the cost model {self.path} was profiled with block_size {self.block_size}, "
                f"but the simulation uses {args.block_size} (pass --block-size {self.block_size} or re-profile)"
            )
        if args.dtype not in (None, "auto") and args.dtype != self.dtype:
            raise ValueError(
                f"dtype: the cost model {self.path} was profiled with dtype {self.dtype}, "
                f"but the simulation uses {args.dtype} (re-profile with --dtype {args.dtype})"
            )
        prof_q = (self.data.get("model") or {}).get("quantization")
        if args.quantization is not None and args.quantization != prof_q:
            raise ValueError(
                f"quantization: the cost model {self.path} was profiled with quantization {prof_q}, "
                f"but the simulation uses {args.quantization}"
            )
        if args.model is not None:
            want = self.data["model"]
            got = model_identity(args.model, args.quantization)
            if got["config_sha256"] != want.get("config_sha256"):
                raise ValueError(
                    f"model: the cost model {self.path} was profiled on {want.get('name')} "
                    f"({want.get('path')}), whose config differs from --model {args.model} "
                    f"(config sha256 {str(want.get('config_sha256'))[:12]} vs {got['config_sha256'][:12]})"
                )

    def check_recorded_run(self, identity: dict | None, dtype: str | None, where: str) -> None:
        """Raise ``ValueError`` when a recorded real run (``bench fidelity --json-out``: its
        model's ``model_identity`` and resolved dtype; None in files written before they were
        kept) ran another model or dtype than this profile measured. ``where`` names the file."""
        want = self.data["model"]
        if identity and identity.get("config_sha256") != want.get("config_sha256"):
            raise ValueError(
                f"model: {where} ran {identity.get('name')} ({identity.get('path')}), but the cost model "
                f"{self.path} was profiled on {want.get('name')} ({want.get('path')}), whose config differs"
            )
        if dtype and dtype != self.dtype:
            raise ValueError(
                f"dtype: {where} ran in {dtype}, but the cost model {self.path} was profiled in {self.dtype}"
            )


#: The largest coefficient a file may hold, in seconds: each is the cost of one unit of a step
#: (the step itself, a token, a sequence, a block...), so one over an hour is a corrupted or
#: mis-scaled file (milliseconds or microseconds written as seconds), not a measurement.
MAX_COEFFICIENT_S = 3600.0
#: The largest count a stored step shape may hold (tokens, sequences, thousands of attention
#: pairs): far past any step; a larger one is a corrupted file, and would overflow the fit.
MAX_SHAPE_COUNT = 1e15


def _num(obj: dict, key: str, where: str, hi: float | None = MAX_COEFFICIENT_S) -> float:
    """``obj[key]``: a finite number in ``[0, hi]`` (seconds, for ``hi``'s default).

    Raises:
        ValueError: otherwise, naming ``where`` and ``key``.
    """
    v = obj.get(key)
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0:
        raise ValueError(f"{where}: {key} must be a finite number >= 0, got {v!r}")
    if hi is not None and v > hi:
        if hi != MAX_COEFFICIENT_S:
            raise ValueError(f"{where}: {key} must be at most {hi:g} (a corrupted file), got {v!r}")
        raise ValueError(
            f"{where}: {key} must be at most {hi:g} s (a cost of one unit of a step above an hour is "
            f"not a measurement: a corrupted or mis-scaled file), got {v!r}"
        )
    return float(v)


def _knots(obj, path: str, name: str = "decode_knots", unit: str = "batch size") -> dict[int, float]:
    """``decode_knots`` (or ``prefill_knots``, keyed by row count) of a file:
    ``{"<count>": seconds, ...}`` -> ``{int: float}``."""
    if obj is None:
        return {}
    if not isinstance(obj, dict):
        raise ValueError(f"{path}: {name} must be an object of {unit} -> seconds")
    out = {}
    for k in obj:
        if not str(k).isdigit() or int(k) < 1:
            raise ValueError(f"{path}: {name}: a key must be a {unit} >= 1, got {k!r}")
        out[int(k)] = _num(obj, k, f"{path}: {name}")
    return out


def _split(obj, path: str) -> tuple[int, int] | None:
    """``attention_split`` of a file: ``{"kv_heads": n, "threads": n}`` -> ``(n, n)``."""
    if obj is None:
        return None
    if not isinstance(obj, dict):
        raise ValueError(f"{path}: attention_split must be an object with kv_heads and threads")
    vals = []
    for key in ("kv_heads", "threads"):
        v = obj.get(key)
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"{path}: attention_split.{key} must be an integer >= 1, got {v!r}")
        vals.append(v)
    return vals[0], vals[1]


def model_kv_heads(model_dir) -> int | None:
    """``num_key_value_heads`` (or ``num_attention_heads``) of the ``config.json`` in
    ``model_dir``; None when it cannot be read."""
    try:
        cfg = json.loads((Path(model_dir) / "config.json").read_text())
        return int(cfg.get("num_key_value_heads") or cfg["num_attention_heads"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def fit_extras(cm: CostModel) -> dict:
    """The file fields of ``cm``'s decode and prefill knots and attention split (those it has)."""
    out: dict = {}
    if cm.decode_knots:
        out["decode_knots"] = {str(k): v for k, v in sorted(cm.decode_knots.items())}
    if cm.prefill_knots:
        out["prefill_knots"] = {str(k): v for k, v in sorted(cm.prefill_knots.items())}
    if cm.attention_split:
        out["attention_split"] = {"kv_heads": cm.attention_split[0], "threads": cm.attention_split[1]}
    return out


def parse_cost_model(data, path: str = "<cost model>") -> CostModelFile:
    """Validate a cost-model JSON object (see module docstring).

    Raises:
        ValueError: not an object, another schema or version, a missing field, a coefficient
            or decode knot that is not a finite number in ``[0, MAX_COEFFICIENT_S]``, a block
            size that is not a positive integer, an engine setting out of range, profile ranges
            that are not finite numbers >= 0 (the message names the file and the field).
    """
    if not isinstance(data, dict):
        raise ValueError(f"{path}: a cost-model file is a JSON object, got {type(data).__name__}")
    if data.get("schema") != SCHEMA:
        raise ValueError(
            f"{path}: schema must be {SCHEMA!r}, got {data.get('schema')!r} (not a cost-model file)"
        )
    if data.get("schema_version") != SCHEMA_VERSION:
        raise ValueError(
            f"{path}: schema_version {data.get('schema_version')!r} is not supported (this kvserve reads "
            f"{SCHEMA_VERSION}; re-run `kvserve profile`)"
        )
    for key in REQUIRED:
        if key not in data:
            raise ValueError(f"{path}: missing field {key!r}")
    bs = data["block_size"]
    if isinstance(bs, bool) or not isinstance(bs, int) or bs < 1:
        raise ValueError(f"{path}: block_size must be a positive integer, got {bs!r}")
    if not isinstance(data["model"], dict) or "config_sha256" not in data["model"]:
        raise ValueError(f"{path}: model must be an object with name, path and config_sha256")
    coef = data["coefficients"]
    if not isinstance(coef, dict):
        raise ValueError(f"{path}: coefficients must be an object")
    unknown = set(coef) - {"base_s", *FEATURES}
    if unknown:
        raise ValueError(f"{path}: coefficients: unknown field(s) {sorted(unknown)}")
    values = {k: _num(coef, k, f"{path}: coefficients") for k in ("base_s", *FEATURES) if k in coef}
    if "base_s" not in values:
        raise ValueError(f"{path}: coefficients: missing field 'base_s'")
    eng = data.get("engine")
    if eng is not None:
        if not isinstance(eng, dict):
            raise ValueError(f"{path}: engine must be an object, got {type(eng).__name__}")
        for key in (
            "max_num_batched_tokens",
            "max_num_seqs",
            "max_model_len",
            "num_gpu_blocks",
            "num_cpu_blocks",
        ):
            v = eng.get(key)
            low = 0 if key == "num_cpu_blocks" else 1  # the profiled engine had a step, a cache
            if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < low):
                raise ValueError(f"{path}: engine.{key} must be an integer >= {low}, got {v!r}")
        v = eng.get("enable_chunked_prefill")
        if v is not None and not isinstance(v, bool):
            raise ValueError(f"{path}: engine.enable_chunked_prefill must be true or false, got {v!r}")
    host = data["host"] if isinstance(data["host"], dict) else {}
    hw = host.get("gpu") or f"{host.get('cpu', '?')}, {host.get('threads', '?')} threads"
    info = {
        "model": data["model"].get("name", "?"),
        "hardware": hw,
        "dtype": data["dtype"],
        "source": f"profile {path}, {data.get('created', '?')}",
    }
    fields = {k: 0.0 for k in FEATURES}
    fields.update(values)
    decode_knots = _knots(data.get("decode_knots"), path)
    prefill_knots = _knots(data.get("prefill_knots"), path, "prefill_knots", "row count")
    attention_split = _split(data.get("attention_split"), path)
    ranges = (data.get("profile") or {}).get("ranges") if isinstance(data.get("profile"), dict) else None
    if ranges is not None and (
        not isinstance(ranges, dict)
        or any(
            isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0
            for v in ranges.values()
        )
    ):
        raise ValueError(f"{path}: profile.ranges must be an object of finite numbers >= 0")
    model = CostModel(
        info=info,
        ranges=ranges,
        decode_knots=decode_knots,
        prefill_knots=prefill_knots,
        attention_split=attention_split,
        **fields,
    )
    return CostModelFile(model, data, path)


def load_cost_model(path, flag: str = "--cost-model") -> CostModelFile:
    """Read and validate a cost-model file; ``flag`` is the option that named it (errors say it).

    Raises:
        ValueError: the file is missing or a folder, not JSON, or malformed (``parse_cost_model``).
    """
    p = Path(path)
    if p.is_dir():
        raise ValueError(f"{flag} {path}: is a folder, not a cost-model file")
    if not p.is_file():
        raise ValueError(f"{flag} {path}: no such file")
    try:
        data = json.loads(p.read_text())
    except (OSError, ValueError, RecursionError) as e:
        # ValueError: not JSON (JSONDecodeError, not UTF-8, an integer past the digit limit);
        # RecursionError: arrays or objects nested past the parser's depth
        raise ValueError(f"{path}: not a JSON cost-model file ({e})") from None
    return parse_cost_model(data, str(path))


def save_cost_model(path, data: dict) -> None:
    """Write ``data`` (already in the file's layout) as JSON, after validating it."""
    parse_cost_model(data, str(path))
    from kvserve.workload.io import write_json

    write_json(path, data)
