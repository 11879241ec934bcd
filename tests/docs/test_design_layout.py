"""docs/DESIGN.md describes the tree as it is: every path it names exists, its file table names
every module of the package, and its layer table matches the direction of the imports."""

from __future__ import annotations

import ast
import fnmatch
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "DESIGN.md"
PKG = ROOT / "kvserve"
#: Top-level folders whose paths the page writes from the repository root.
ROOTED = ("kvserve", "tests", "benchmarks", "scripts")
#: `kvserve/...`, `tests/...`: not preceded by a path character (so not `../kvserve/...` of a
#: link, nor a URL), a placeholder such as `<family>` ending the match.
_ROOTED_PATH = re.compile(r"(?<![\w./-])((?:" + "|".join(ROOTED) + r")/[\w./*-]*)")
_CODE_SPAN = re.compile(r"`([^`\n]+)`")
_PATH_TOKEN = re.compile(r"[\w.*-]+(?:/[\w.*-]*)+|[\w.*-]+\.(?:py|c|h)\b")


def _text() -> str:
    return DOC.read_text()


def _modules() -> list[str]:
    """Every ``kvserve/**/*.py`` but the ``__init__.py`` files, from the repository root."""
    return sorted(
        p.relative_to(ROOT).as_posix()
        for p in PKG.rglob("*.py")
        if p.name != "__init__.py" and "__pycache__" not in p.parts
    )


def _tree() -> list[str]:
    """Every file and folder under the rooted top-level folders and ``docs``."""
    out = []
    for top in (*ROOTED, "docs"):
        for p in (ROOT / top).rglob("*"):
            if "__pycache__" not in p.parts:
                out.append(p.relative_to(ROOT).as_posix())
    return out


def rooted_paths(text: str) -> set[str]:
    """The paths the page writes from the repository root (``kvserve/...``, ``tests/...``,
    ``benchmarks/...``, ``scripts/...``), placeholders (``<name>``) left out."""
    out = set()
    for m in _ROOTED_PATH.finditer(text):
        end = m.end()
        if text[end : end + 1] == "<":  # `kvserve/benchmarks/<name>.py`: a pattern, not a path
            continue
        out.add(m.group(1).rstrip(".,:;"))
    return out


def _exists(path: str) -> bool:
    if any(c in path for c in "*?["):
        return any(True for _ in ROOT.glob(path))
    return (ROOT / path).exists()


def relative_paths(text: str) -> set[str]:
    """Paths written relative to some folder inside a code span (``core/scheduler.py``,
    ``ops/quant.QuantWeight``, ``errors.py``): a token with a ``/`` whose first part is a folder of
    the tree, or a token ending in ``.py`` / ``.c`` / ``.h``; placeholders left out."""
    folders = {Path(p).name for p in _tree() if (ROOT / p).is_dir()} | set(ROOTED) | {"docs"}
    out = set()
    for span in _CODE_SPAN.findall(text):
        if "<" in span:
            continue
        for token in _PATH_TOKEN.findall(span):
            if token.split("/")[0] in ROOTED:
                continue  # rooted: checked exactly by the other test
            token = token.rstrip("./")
            if "/" in token and token.split("/")[0] not in folders:
                continue  # `can_swap_in/out`, `q/k`: not a path
            out.add(token)
    return out


def resolves(token: str, tree: list[str]) -> bool:
    """Whether ``token`` names a file or folder of the tree, read as a path relative to some
    folder: itself, or with trailing ``.attribute`` parts dropped (``ops/quant.QuantWeight`` ->
    ``ops/quant.py``)."""
    parts = token.split("/")
    pieces = parts[-1].split(".")
    candidates = {token}
    for k in range(len(pieces), 0, -1):
        base = "/".join([*parts[:-1], ".".join(pieces[:k])])
        candidates |= {base, base + ".py"}
    return any(
        f == c or f.endswith("/" + c) or fnmatch.fnmatch(f, "*/" + c) for c in candidates for f in tree
    )


def test_every_path_from_the_repository_root_exists():
    paths = rooted_paths(_text())
    assert paths, "the scan found no kvserve/, tests/, benchmarks/ or scripts/ path at all"
    missing = sorted(p for p in paths if not _exists(p))
    assert not missing, f"docs/DESIGN.md names paths that do not exist: {missing}"


def test_every_relative_path_names_a_file_of_the_tree():
    tree = _tree()
    tokens = relative_paths(_text())
    assert "core/scheduler.py" in tokens, "the scan missed the request path's file names"
    unknown = sorted(t for t in tokens if not resolves(t, tree))
    assert not unknown, f"docs/DESIGN.md names files no folder of the tree holds: {unknown}"


def test_the_file_table_names_every_module_of_the_package():
    named = rooted_paths(_text())
    missing = [m for m in _modules() if m not in named]
    assert not missing, (
        f"modules docs/DESIGN.md does not name (add each to its file table, '## Files'): {missing}"
    )


def test_the_path_scans_catch_a_stale_name():
    """The checks above can fail: a removed module, written either way, is reported."""
    text = "`kvserve/lora/ops.py` and `models/native_decode.py`, `lora/ops.py`"
    assert not _exists("kvserve/lora/ops.py")
    tree = _tree()
    assert {t for t in relative_paths(text) if not resolves(t, tree)} == {
        "models/native_decode.py",
        "lora/ops.py",
    }
    assert "kvserve/lora/ops.py" in rooted_paths(text)


# -- layers -------------------------------------------------------------------------------------


def layer_rows(text: str) -> list[tuple[int, list[str], set[int]]]:
    """The rows of the table under ``## Layers``: (row number, the module paths it names,
    the rows its modules may import besides their own).

    Raises:
        AssertionError: the section or its table is missing, or a cell does not parse.
    """
    lines = text.splitlines()
    heads = [i for i, line in enumerate(lines) if line.strip() == "## Layers"]
    assert heads, "no '## Layers' section in docs/DESIGN.md"
    rows = []
    for line in lines[heads[0] + 1 :]:
        if line.startswith("## "):
            break
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if not line.startswith("|") or not cells[0].isdigit():
            continue
        assert len(cells) == 4, f"a layer row needs row | layer | modules | imports from rows: {line}"
        allowed: set[int] = set()
        if cells[3] != "none":
            for part in cells[3].split(","):
                lo, _, hi = part.strip().partition("-")
                allowed |= set(range(int(lo), int(hi or lo) + 1))
        modules = [p.rstrip(".,") for p in _CODE_SPAN.findall(cells[2])]
        assert modules, f"a layer row names no module: {line}"
        rows.append((int(cells[0]), modules, allowed))
    assert rows, "no layer table under '## Layers'"
    return rows


def _row_of(path: str, rows) -> int | None:
    """The row of the longest table entry that is ``path`` or a folder holding it."""
    best, best_len = None, -1
    for n, modules, _ in rows:
        for m in modules:
            if (path == m or (m.endswith("/") and path.startswith(m))) and len(m) > best_len:
                best, best_len = n, len(m)
    return best


def _module_file(dotted: str) -> str:
    """``kvserve.a.b`` -> the file that defines it (``kvserve/a/b.py`` or ``kvserve/a/b/__init__.py``);
    a name that is no module (``kvserve.LLM``) -> the file of the package it is an attribute of."""
    parts = dotted.split(".")
    while parts:
        p = ROOT.joinpath(*parts)
        if p.with_suffix(".py").is_file():
            return p.with_suffix(".py").relative_to(ROOT).as_posix()
        if (p / "__init__.py").is_file():
            return (p / "__init__.py").relative_to(ROOT).as_posix()
        parts.pop()
    raise AssertionError(f"not a kvserve module: {dotted}")


def _kvserve_imports(path: Path) -> list[tuple[int, str]]:
    """Every kvserve module ``path`` imports (at any depth: lazy and type-only imports too)."""
    out = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            # `from kvserve import envs` imports kvserve.envs; `from kvserve.x import y` imports
            # kvserve.x (and kvserve.x.y when that is a module: the same file's row or below)
            names = (
                [f"{node.module}.{a.name}" for a in node.names] if node.module == "kvserve" else [node.module]
            )
        else:
            continue
        out += [(node.lineno, n) for n in names if n == "kvserve" or n.startswith("kvserve.")]
    return out


def test_every_module_is_in_one_layer():
    rows = layer_rows(_text())
    every = sorted(p.relative_to(ROOT).as_posix() for p in PKG.rglob("*.py") if "__pycache__" not in p.parts)
    missing = [m for m in every if _row_of(m, rows) is None]
    assert not missing, f"modules in no row of docs/DESIGN.md's '## Layers' table: {missing}"


def test_imports_go_only_to_the_rows_the_layer_table_allows():
    rows = layer_rows(_text())
    allowed = {n: a for n, _, a in rows}
    bad = []
    for path in sorted(PKG.rglob("*.py")):
        if "__pycache__" in path.parts:
            continue
        rel = path.relative_to(ROOT).as_posix()
        row = _row_of(rel, rows)
        if row is None:
            continue  # reported by the test above
        for lineno, name in _kvserve_imports(path):
            target = _module_file(name)
            to = _row_of(target, rows)
            if to is not None and to != row and to not in allowed[row]:
                bad.append(f"{rel}:{lineno} (row {row}) imports {name} (row {to})")
    assert not bad, "imports against docs/DESIGN.md's layer table:\n" + "\n".join(bad)


def test_the_layer_check_catches_an_upward_import():
    """The check above can fail: the kernels' row (``kvserve/ops/``) may not import the model."""
    rows = layer_rows(_text())
    allowed = {n: a for n, _, a in rows}
    ops = _row_of("kvserve/ops/gemm.py", rows)
    model = _row_of(_module_file("kvserve.model_executor.layers.linear"), rows)
    assert ops is not None and model is not None and model != ops
    assert model not in allowed[ops]
