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
import signal
import subprocess
import sys
import tempfile
import threading
from collections.abc import Sequence
from pathlib import Path

from kvserve.ops import library

REPO = Path(__file__).resolve().parents[2]
WARNINGS = "-Wall -Wextra -Werror"
#: -march targets of the warnings-as-errors builds, each with its extra flags (appended to
#: ``library.CFLAGS``): the host; AVX2 only (the fallback of kv_vec.h, two registers per
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
from kvserve.ops import library

workers, sources = int(sys.argv[1]), set(sys.argv[2:])
libs = [lib for lib in library.all_libraries() if not sources or lib.source in sources]

def build(lib):
    try:
        lib.build()
    except subprocess.CalledProcessError as e:
        return lib.source + ":\\n" + (e.stderr or b"").decode(errors="replace")[-3000:]
    except subprocess.TimeoutExpired as e:
        return f"{lib.source}: the compiler took over {e.timeout:.0f} s"
    return None

with ThreadPoolExecutor(max_workers=workers) as pool:
    print(json.dumps([f for f in pool.map(build, libs) if f]))
"""

_dir: Path | None = None
_built: dict[tuple[str, tuple[str, ...]], list[str]] = {}
#: The background builds (``start_background``): the plan, the one running, and whether a test
#: waits for them (then they run at normal priority).
_plan: list[tuple[str, tuple[str, ...]]] = []
_failed: dict[tuple[str, tuple[str, ...]], BaseException] = {}
_running: list[subprocess.Popen] = []
_urgent = threading.Event()
_lock = threading.Lock()
_thread: threading.Thread | None = None


def cache_dir() -> Path:
    """The session's build folder (made on first use, removed when the interpreter exits)."""
    global _dir
    if _dir is None:
        _dir = Path(tempfile.mkdtemp(prefix="kvserve-test-builds-"))
        atexit.register(shutil.rmtree, _dir, True)
        atexit.register(_stop_background)  # runs first: no compiler writing into the folder
    return _dir


def asan_preload() -> str | None:
    """``LD_PRELOAD`` value for a Python that loads sanitizer-instrumented kernels: the compiler's
    AddressSanitizer runtime, then its C++ runtime, or None without an ASan runtime.

    The C++ runtime must be loaded before ASan initializes: ASan resolves the real
    ``__cxa_throw`` once at start-up, and without it the first C++ exception torch throws (even
    one torch catches itself) aborts the process."""
    cc = os.environ.get("CC", "cc")
    if shutil.which(cc) is None:
        return None
    libs = []
    for name in ("libasan.so", "libstdc++.so.6"):
        out = subprocess.run([cc, f"-print-file-name={name}"], capture_output=True, text=True).stdout.strip()
        if not (os.path.isabs(out) and os.path.exists(out)):
            return None
        libs.append(out)
    return " ".join(libs)


def env(flags: str) -> dict[str, str]:
    """Environment of a subprocess whose kernel libraries are the ``flags`` builds of the
    session folder (built there on first use if not built yet)."""
    e = dict(os.environ, KVSERVE_CACHE_DIR=str(cache_dir()), **{library.EXTRA_CFLAGS_ENV: flags})
    e.pop("KVSERVE_NATIVE", None)
    e.pop("LD_PRELOAD", None)  # the compiler must not run under a sanitizer runtime
    return e


def _spawn(flags: str, sources: tuple[str, ...], workers: int, nice: int) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-c", _BUILD, str(workers), *sources],
        env=env(flags),
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,  # its own process group: stopped as a whole at exit
        preexec_fn=(lambda: os.nice(nice)) if nice else None,
    )


def _collect(key: tuple[str, tuple[str, ...]], p: subprocess.Popen) -> None:
    # generous: a sanitizer build of the largest source on a busy 2-core host took over 120 s
    out, err = p.communicate(timeout=900)
    if p.returncode != 0:
        raise RuntimeError(f"the build subprocess for {key} exited {p.returncode}:\n{err[-3000:]}")
    _built[key] = json.loads(out.strip().splitlines()[-1])


def _renice(p: subprocess.Popen) -> None:
    """Back to normal priority, compilers included (where this user may lower it)."""
    try:
        import psutil

        for q in [psutil.Process(p.pid), *psutil.Process(p.pid).children(recursive=True)]:
            q.nice(0)
    except Exception:  # gone already, or not allowed: it finishes at low priority
        pass


def start_background(plan: Sequence[tuple[str, Sequence[str]]]) -> None:
    """Start building each ``(flags, sources)`` of ``plan`` (``sources`` empty: every library),
    one after another, at the lowest CPU priority, so that the compilers use cores the tests
    before theirs leave idle. ``build`` waits for a planned build instead of starting its own
    (and raises its priority). Only the first call of a session starts anything."""
    global _thread
    if _thread is not None:
        return
    cache_dir()
    _plan.extend((f, tuple(sorted(s))) for f, s in dict.fromkeys((f, tuple(s)) for f, s in plan))

    def run() -> None:
        for key in _plan:
            with _lock:
                p = _spawn(key[0], key[1], os.cpu_count() or 2, 0 if _urgent.is_set() else 19)
                _running[:] = [p]
            try:
                _collect(key, p)
            except BaseException as e:  # build() reports it, or retries in the foreground
                _failed[key] = e
            finally:
                _running.clear()

    _thread = threading.Thread(target=run, name="native-builds", daemon=True)
    _thread.start()


def _stop_background() -> None:
    for p in list(_running):
        try:
            os.killpg(p.pid, signal.SIGTERM)
        except OSError:
            pass


def _wait_background(key: tuple[str, tuple[str, ...]]) -> None:
    if _thread is None or key not in _plan:
        return
    with _lock:
        _urgent.set()
        for p in _running:
            _renice(p)
    while key not in _built and key not in _failed and _thread.is_alive():
        _thread.join(0.2)


def build(flag_sets: Sequence[str], sources: Sequence[str] = ()) -> dict[str, list[str]]:
    """Compile ``sources`` (default: every library) under each of ``flag_sets``, all flag sets
    at once, each built once per session (a build planned by ``start_background`` is waited
    for).

    Returns:
        flags -> the compiler errors (``"<source>:\\n<stderr tail>"``), empty when all built.

    Raises:
        RuntimeError: a build subprocess itself failed (no compiler, ...), with its stderr.
    """
    key_sources = tuple(sorted(sources))
    for f in flag_sets:
        _wait_background((f, ()))
        _wait_background((f, key_sources))
    todo = [f for f in dict.fromkeys(flag_sets) if (f, key_sources) not in _built and (f, ()) not in _built]
    workers = max(1, -(-(os.cpu_count() or 2) // max(1, len(todo))))
    procs = {f: _spawn(f, key_sources, workers, 0) for f in todo}
    for f, p in procs.items():
        _collect((f, key_sources), p)
    return {f: _built.get((f, key_sources), _built.get((f, ()), [])) for f in flag_sets}
