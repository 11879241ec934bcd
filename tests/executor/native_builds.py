"""Builds of the kernel libraries under test-only compiler flags, shared by every test of a
session.

Each flag set is compiled once, all libraries at a time, in a subprocess (the flags travel in
``$KVSERVE_NATIVE_CFLAGS`` and never reach this process's own builds) into one session folder
used as ``$KVSERVE_CACHE_DIR``. A test subprocess started with ``env(flags)`` computes the same
build key (``NativeLibrary.build``: sources, command line, CPU) and loads those builds instead of
compiling again: the AVX2 int8-activation check reuses the ``-Werror`` AVX2 build, for one.
"""

from __future__ import annotations

import atexit
import json
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path

from kvserve.model_executor.layers import native_lib

REPO = Path(__file__).resolve().parents[2]
WARNINGS = "-Wall -Wextra -Werror"
#: -march targets of the warnings-as-errors builds, each with its extra flags (appended to
#: ``native_lib.CFLAGS``): the host; AVX2 only (the fallback of kv_vec.h, two registers per
#: vector); Sapphire Rapids (the AMX and AVX512-BF16 paths, compiled even where this CPU lacks
#: them). GCC spends ~90 s at -O3 splitting prefill attention's 16-lane vectors for AVX2; -O1
#: still runs the flow analyses behind -Wmaybe-uninitialized and friends.
WERROR_FLAGS = {
    "native": f"{WARNINGS} -march=native",
    "x86-64-v3": f"{WARNINGS} -march=x86-64-v3 -O1",
    "sapphirerapids": f"{WARNINGS} -march=sapphirerapids",
}
#: The older targets of the int8-activation dot products (``quant_dot8.h``): AVX2 (the
#: ``-Werror`` AVX2 build, reused) and scalar (x86-64-v2 has neither AVX2 nor VNNI). The scalar
#: build is -O0: at -O1 GCC spends ~4x longer (about a minute on 2 cores) splitting the other
#: kernels' 16-lane vectors into SSE registers, and the check compares results, not codegen.
ACT8_FALLBACK_FLAGS = {"avx2": WERROR_FLAGS["x86-64-v3"], "scalar": "-O0 -march=x86-64-v2"}
#: The sanitizer build the kernel tests run under (AddressSanitizer and UBSan).
SANITIZE = "-O1 -g -fno-omit-frame-pointer -fsanitize=address,undefined -fno-sanitize-recover=undefined"

_BUILD = """
import json, subprocess, sys
from concurrent.futures import ThreadPoolExecutor
from kvserve.model_executor.layers import native_lib

workers, sources = int(sys.argv[1]), set(sys.argv[2:])
libs = [lib for lib in native_lib.all_libraries() if not sources or lib.source in sources]

def build(lib):
    try:
        lib.build()
    except subprocess.CalledProcessError as e:
        return lib.source + ":\\n" + (e.stderr or b"").decode(errors="replace")[-3000:]
    return None

with ThreadPoolExecutor(max_workers=workers) as pool:
    print(json.dumps([f for f in pool.map(build, libs) if f]))
"""

_dir: Path | None = None
_built: dict[tuple[str, tuple[str, ...]], list[str]] = {}


def cache_dir() -> Path:
    """The session's build folder (made on first use, removed when the interpreter exits)."""
    global _dir
    if _dir is None:
        _dir = Path(tempfile.mkdtemp(prefix="kvserve-test-builds-"))
        atexit.register(shutil.rmtree, _dir, True)
    return _dir


def env(flags: str) -> dict[str, str]:
    """Environment of a subprocess whose kernel libraries are the ``flags`` builds of the
    session folder (built there on first use if not built yet)."""
    e = dict(os.environ, KVSERVE_CACHE_DIR=str(cache_dir()), **{native_lib.EXTRA_CFLAGS_ENV: flags})
    e.pop("KVSERVE_NATIVE", None)
    e.pop("LD_PRELOAD", None)  # the compiler must not run under a sanitizer runtime
    return e


def build(flag_sets: Sequence[str], sources: Sequence[str] = ()) -> dict[str, list[str]]:
    """Compile ``sources`` (default: every library) under each of ``flag_sets``, all flag sets
    at once, each built once per session.

    Returns:
        flags -> the compiler errors (``"<source>:\\n<stderr tail>"``), empty when all built.

    Raises:
        subprocess.CalledProcessError: a build subprocess itself failed (no compiler, ...).
    """
    key_sources = tuple(sorted(sources))
    todo = [f for f in dict.fromkeys(flag_sets) if (f, key_sources) not in _built and (f, ()) not in _built]
    workers = max(1, -(-(os.cpu_count() or 2) // max(1, len(todo))))
    procs = {
        f: subprocess.Popen(
            [sys.executable, "-c", _BUILD, str(workers), *key_sources],
            env=env(f),
            cwd=REPO,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for f in todo
    }
    for f, p in procs.items():
        # generous: a sanitizer build of the largest source on a busy 2-core host took
        # over 120 s
        out, err = p.communicate(timeout=900)
        if p.returncode != 0:
            raise subprocess.CalledProcessError(p.returncode, p.args, out, err)
        _built[(f, key_sources)] = json.loads(out.strip().splitlines()[-1])
    return {f: _built.get((f, key_sources), _built.get((f, ()), [])) for f in flag_sets}
