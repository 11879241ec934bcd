"""docs/configuration.md names exactly the engine settings and ``kvserve serve`` flags the code
defines, each with its real default (and, for ``EngineArgs``, its annotated type), and exactly
the environment variables ``kvserve.envs`` declares."""

from __future__ import annotations

import argparse
import ast
import dataclasses
import re
from pathlib import Path

import pytest

from kvserve import envs
from kvserve.config import EngineArgs
from kvserve.entrypoints.cli import flag_of

DOC = Path(__file__).resolve().parents[2] / "docs" / "configuration.md"

_UNESCAPED_PIPE = re.compile(r"(?<!\\)\|")


def _code(cell: str) -> str:
    """The text of the first backticked span of a table cell.

    Raises:
        AssertionError: the cell has no backticked span.
    """
    m = re.search(r"`([^`]*)`", cell)
    assert m, f"no `code` in cell {cell!r}"
    return m.group(1).replace("\\|", "|")


def table_rows(markdown: str, section: str) -> list[list[str]]:
    """The body rows of the first table under the ``## section`` heading, as lists of cells
    (``\\|`` inside a cell kept as part of it).

    Raises:
        AssertionError: the section or its table is missing.
    """
    lines = markdown.splitlines()
    heads = [i for i, line in enumerate(lines) if line.startswith("## ") and line[3:].strip() == section]
    assert heads, f"no '## {section}' section in {DOC}"
    rows: list[list[str]] = []
    in_table = False
    for line in lines[heads[0] + 1 :]:
        if line.startswith("## "):
            break
        if line.startswith("|"):
            cells = [c.strip() for c in _UNESCAPED_PIPE.split(line.strip().strip("|"))]
            if in_table and not set("".join(cells)) <= set("-: "):
                rows.append(cells)
            in_table = True
        elif in_table:
            break
    assert rows, f"no table under '## {section}' in {DOC}"
    return rows


def _engine_rows() -> list[list[str]]:
    return table_rows(DOC.read_text(), "Engine settings (`EngineArgs`)")


def _serve_rows() -> list[list[str]]:
    return table_rows(DOC.read_text(), "`kvserve serve` flags")


@pytest.fixture
def serve_parser(monkeypatch) -> argparse.ArgumentParser:
    """``kvserve serve``'s parser with ``KVSERVE_API_KEY`` unset (``--api-key``'s default)."""
    monkeypatch.delenv("KVSERVE_API_KEY", raising=False)
    from kvserve.entrypoints.openai.api_server import make_arg_parser

    return make_arg_parser()


def _options(parser: argparse.ArgumentParser) -> dict[str, argparse.Action]:
    """Each option's first long name (``--enable-lora`` for ``--enable-lora/--no-enable-lora``)
    -> its action; ``--help``, the positional MODEL and vLLM's hidden flags left out (those two
    are docs/coming_from_vllm.md's, checked by tests/entrypoints/test_vllm_compat.py)."""
    from kvserve.entrypoints.vllm_compat import is_compat_action

    out = {}
    for action in parser._actions:
        if isinstance(action, argparse._HelpAction) or not action.option_strings or is_compat_action(action):
            continue
        out[next(s for s in action.option_strings if s.startswith("--"))] = action
    return out


def test_engine_table_names_every_engine_args_field_once_with_its_flag_type_and_default():
    fields = {f.name: f for f in dataclasses.fields(EngineArgs)}
    rows = _engine_rows()
    documented = [_code(r[0]) for r in rows]
    assert len(documented) == len(set(documented)), f"a field listed twice: {documented}"
    assert set(documented) == set(fields), (
        f"missing from docs/configuration.md: {sorted(set(fields) - set(documented))}; "
        f"not EngineArgs fields: {sorted(set(documented) - set(fields))}"
    )
    for row in rows:
        assert len(row) == 5, f"row needs field | flag | type | default | meaning: {row}"
        name, flag, typ, default, meaning = row
        f = fields[_code(name)]
        assert _code(flag) == flag_of(f.name), row
        assert _code(typ) == str(f.type), f"{f.name}: documented type {typ}, annotated {f.type}"
        assert ast.literal_eval(_code(default)) == f.default, (
            f"{f.name}: documented {default}, real {f.default!r}"
        )
        assert meaning, f"{f.name}: no meaning given"


def test_engine_flags_of_kvserve_serve_take_the_documented_defaults(serve_parser):
    options = _options(serve_parser)
    for row in _engine_rows():
        flag, default = _code(row[1]), ast.literal_eval(_code(row[3]))
        assert flag in options, f"{flag} is documented but `kvserve serve` has no such flag"
        assert options[flag].default == default, (
            f"{flag}: documented {default!r}, parser {options[flag].default!r}"
        )


def test_serve_table_and_engine_table_together_name_every_kvserve_serve_flag(serve_parser):
    options = _options(serve_parser)
    engine_flags = {_code(r[1]) for r in _engine_rows()}
    rows = _serve_rows()
    serve_flags = [_code(r[0]) for r in rows]
    assert len(serve_flags) == len(set(serve_flags)), f"a flag listed twice: {serve_flags}"
    assert not engine_flags & set(serve_flags), f"listed in both tables: {engine_flags & set(serve_flags)}"
    documented = engine_flags | set(serve_flags)
    assert documented == set(options), (
        f"`kvserve serve` flags missing from docs/configuration.md: {sorted(set(options) - documented)}; "
        f"documented but not defined: {sorted(documented - set(options))}"
    )
    for row in rows:
        assert len(row) == 4, f"row needs flag | type | default | meaning: {row}"
        flag, _typ, default, meaning = row
        real = options[_code(flag)].default
        assert ast.literal_eval(_code(default)) == real, f"{flag}: documented {default}, parser {real!r}"
        assert meaning, f"{flag}: no meaning given"


def test_environment_table_names_every_declared_variable_once():
    rows = table_rows(DOC.read_text(), "Environment variables")
    documented = [_code(r[0]) for r in rows]
    assert len(documented) == len(set(documented)), f"a variable listed twice: {documented}"
    declared = set(envs.VARIABLES)
    assert set(documented) == declared, (
        f"declared in kvserve/envs.py but missing from docs/configuration.md: {sorted(declared - set(documented))}; "
        f"documented but not declared: {sorted(set(documented) - declared)}"
    )
    for row in rows:
        assert len(row) == 3 and row[2], f"row needs variable | default | meaning: {row}"


def test_table_parser_finds_a_missing_row():
    """The check above can fail: a table without one field's row no longer names every field."""
    rows = _engine_rows()
    text = DOC.read_text()
    dropped = next(line for line in text.splitlines() if line.startswith("| `seed` |"))
    trimmed = text.replace(dropped + "\n", "")
    names = {_code(r[0]) for r in table_rows(trimmed, "Engine settings (`EngineArgs`)")}
    assert names == {_code(r[0]) for r in rows} - {"seed"}
