"""The tooling (``kvserve.benchmarks``, ``kvserve.sim``) stands beside the product: no product
module imports it, the simulator does not import the benchmarks, and ``kvserve.workload`` (shared
by both) imports neither. The ``kvserve`` console script (``kvserve.cli``) is the one place that
joins them."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PKG = Path(__file__).resolve().parents[2] / "kvserve"
TOOLING = ("kvserve.benchmarks", "kvserve.sim")


def _imports(path: Path) -> set[str]:
    """Every module ``path`` imports, at any depth (lazy imports inside functions included)."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
            names.update(f"{node.module}.{a.name}" for a in node.names)
    return names


def _under(name: str, prefixes: tuple[str, ...]) -> bool:
    return any(name == p or name.startswith(p + ".") for p in prefixes)


def _modules(*parts: str) -> list[Path]:
    return sorted((PKG.joinpath(*parts)).rglob("*.py"))


def test_no_product_module_imports_the_tooling():
    top = {PKG / "cli.py", PKG / "__main__.py"}
    tooling_dirs = (PKG / "benchmarks", PKG / "sim", PKG / "workload")
    bad = {
        str(p.relative_to(PKG.parent)): sorted(
            n for n in _imports(p) if _under(n, (*TOOLING, "kvserve.workload"))
        )
        for p in _modules()
        if p not in top and not any(d in p.parents for d in tooling_dirs)
    }
    assert {k: v for k, v in bad.items() if v} == {}


@pytest.mark.parametrize(
    ("package", "forbidden"),
    [("sim", ("kvserve.benchmarks",)), ("workload", TOOLING)],
)
def test_lower_tooling_never_imports_the_higher(package, forbidden):
    bad = {
        str(p.relative_to(PKG.parent)): sorted(n for n in _imports(p) if _under(n, forbidden))
        for p in _modules(package)
    }
    assert {k: v for k, v in bad.items() if v} == {}


def test_console_script_lists_the_product_and_the_tooling_commands(capsys):
    from kvserve.cli import main

    with pytest.raises(SystemExit) as e:
        main(["--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    for command in ("generate", "serve", "doctor", "bench", "simulate", "profile"):
        assert command in out


def test_console_script_dispatches_a_tool_command_to_its_module(monkeypatch):
    import kvserve.sim.cli as sim_cli
    from kvserve.cli import main

    seen: list[list[str]] = []
    monkeypatch.setattr(sim_cli, "main", lambda argv: seen.append(argv) or 7)
    assert main(["simulate", "--num-requests", "3"]) == 7
    assert seen == [["--num-requests", "3"]]
