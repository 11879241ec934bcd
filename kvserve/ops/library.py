"""Build-on-first-use C/OpenMP kernels for the CPU hot path, loaded with ``ctypes``.

The kernels are C sources in ``kvserve/csrc/`` (one ``.c`` per kernel family, shared headers
beside them; see the README there). Each ``NativeLibrary`` is one of those ``.c`` files,
compiled on first use for this host with the system C compiler (``$CC``, default ``cc``;
``CFLAGS`` below) into ``<cache root>/native/<hash>/``, the hash over the library name, every
file in ``csrc/``, the compiler, the flags and the CPU's feature flags. It is built in a
temporary folder and renamed into place, so concurrent processes never load a half-written
library. ctypes releases the GIL during a call. If there is no compiler, the build fails, or
``KVSERVE_NATIVE=0`` is set, ``load()`` returns ``None`` (``failure_reason()`` says why) and
callers use their torch path.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import shlex
import shutil
import subprocess
import sys
import tempfile
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from kvserve import envs
from kvserve.ops.cpu import cpuinfo_field

#: Storage dtype -> suffix of the kernel symbols ``csrc/kv_instantiate.h`` exports for it.
DTYPE_SUFFIX = {torch.float32: "f32", torch.bfloat16: "bf16"}

#: The C sources (package data).
CSRC_DIR = Path(__file__).resolve().parents[1] / "csrc"
#: Compiler flags of every build: tuned for the host; errno never set by math functions (lets
#: GCC inline ``sqrtf`` and friends). Tests add warnings (``-Wall -Wextra -Werror``) and
#: sanitizers to these.
CFLAGS = ("-O3", "-march=native", "-fopenmp", "-fno-math-errno")
#: Environment variable of flags appended to ``CFLAGS`` (e.g. ``-fsanitize=address,undefined``
#: for a sanitizer build; part of the build key, so such builds never mix with normal ones).
EXTRA_CFLAGS_ENV = "KVSERVE_NATIVE_CFLAGS"
#: The modules whose ``_LIB`` is a kernel library (``all_libraries``).
KERNEL_MODULES = (
    "gemm",
    "gemm_bf16dot",
    "gemm_amx",
    "attention",
    "elementwise",
    "prefill_attention",
    "quant",
    "bitmask",
    "lora",
    "decode_layers",
    "encoder_attention",
    "moe",
)


def compile_command(source: str, output: str | Path, extra_flags: Sequence[str] = ()) -> list[str]:
    """The compiler command line that builds ``csrc/<source>`` into the shared library
    ``output``: ``$CC`` (default ``cc``), ``CFLAGS``, then the flags of ``$KVSERVE_NATIVE_CFLAGS``,
    then ``extra_flags``."""
    env_flags = shlex.split(envs.KVSERVE_NATIVE_CFLAGS)
    return [
        os.environ.get("CC", "cc"),
        *CFLAGS,
        *env_flags,
        *extra_flags,
        "-shared",
        "-fPIC",
        f"-I{CSRC_DIR}",
        "-o",
        str(output),
        str(CSRC_DIR / source),
        "-lm",
    ]


@functools.cache
def _sources_digest() -> str:
    """sha256 over every file of ``csrc/`` (names and contents): any edit rebuilds. Read once
    per process (every library's key needs it)."""
    h = hashlib.sha256()
    for f in sorted(CSRC_DIR.rglob("*")):
        if f.is_file():
            h.update(str(f.relative_to(CSRC_DIR)).encode() + b"\0" + f.read_bytes() + b"\0")
    return h.hexdigest()


class NativeLibrary:
    """One lazily compiled C library.

    Args:
        name: file stem of the built ``.so``.
        source: the ``.c`` file of ``csrc/`` it is built from.
        signatures: exported symbol -> ctypes argument types.
        restypes: exported symbol -> ctypes result type, for the symbols that return a value
            (the others return ``void``).

    Attributes:
        path: the loaded ``.so`` once ``load()`` succeeded, else None.
    """

    def __init__(
        self,
        name: str,
        source: str,
        signatures: dict[str, list[Any]],
        restypes: dict[str, Any] | None = None,
    ):
        self.name = name
        self.source = source
        self.signatures = signatures
        self.restypes = restypes or {}
        self._lock = threading.Lock()
        self._lib: ctypes.CDLL | None = None
        self._failed: str | None = None
        self._fns: dict[str, Any] = {}
        self.path: Path | None = None

    def build(self, out_dir: Path | None = None) -> Path:
        """Compile the library (unless this exact build exists) and return the ``.so`` path,
        without loading it. ``out_dir`` defaults to ``<cache root>/native``.

        Raises:
            subprocess.CalledProcessError: the compiler failed (its stderr is attached).
            OSError: no compiler, or the cache folder cannot be written.
        """
        if out_dir is None:
            out_dir = envs.cache_root() / "native"
        lib_name = f"{self.name}.so"
        # the sources' digest, not their folder, in the key: every checkout of the same
        # sources (a clone, a CI run) shares one build
        command = [c.replace(str(CSRC_DIR), "<csrc>") for c in compile_command(self.source, lib_name)]
        # the name too: two libraries of one source must not share (and fight over) a folder
        key_text = "\0".join(
            [self.name, _sources_digest(), *command, (cpuinfo_field("flags") or sys.platform)]
        )
        final = out_dir / hashlib.sha256(key_text.encode()).hexdigest()[:16]
        lib = final / lib_name
        if lib.is_file():
            return lib
        out_dir.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=".tmp-native-", dir=out_dir))
        try:
            subprocess.run(
                compile_command(self.source, tmp / lib_name),
                check=True,
                capture_output=True,
                # generous: a sanitizer build of the largest source on a busy 2-core host
                # took over 120 s
                timeout=600,
            )
            try:
                os.rename(tmp, final)
            except OSError:
                if not lib.is_file():
                    raise
        finally:
            if tmp.exists():
                shutil.rmtree(tmp, ignore_errors=True)
        return lib

    def load(self) -> ctypes.CDLL | None:
        """The library, built on first use; ``None`` when unavailable (see ``failure_reason``)."""
        if self._lib is not None or self._failed is not None:
            return self._lib
        with self._lock:
            if self._lib is not None or self._failed is not None:
                return self._lib
            if not envs.KVSERVE_NATIVE:
                self._failed = "disabled by KVSERVE_NATIVE=0"
                return None
            try:
                path = self.build()
                lib = ctypes.CDLL(str(path))
                for sym, argtypes in self.signatures.items():
                    fn = getattr(lib, sym)
                    fn.argtypes = argtypes
                    fn.restype = self.restypes.get(sym)
                self._lib, self.path = lib, path
            except Exception as e:  # no compiler, compile error, load error: torch path
                detail = getattr(e, "stderr", b"") or b""
                self._failed = f"{type(e).__name__}: {e} {detail.decode(errors='replace')[:500]}".strip()
        return self._lib

    def available(self) -> bool:
        return self.load() is not None

    def fn(self, name: str) -> Any:
        """The exported function ``name`` (a ctypes function pointer, looked up once; the library
        must be available)."""
        f = self._fns.get(name)
        if f is None:
            f = self._fns[name] = getattr(self.load(), name)
        return f

    def call(self, name: str, *args: Any) -> Any:
        """Call the exported function ``name`` with ``args``: a tensor passes its ``data_ptr()``,
        ``None`` a NULL pointer, anything else as it is (ctypes converts it by the declared
        argument types). Returns the function's result (None for ``void``).

        The faces check shapes, dtypes and contiguity before calling: the C side trusts them.
        The tensors stay referenced (they are arguments) until the call returns.
        """
        return self.fn(name)(*[a.data_ptr() if isinstance(a, torch.Tensor) else a for a in args])

    def failure_reason(self) -> str | None:
        return self._failed


def all_libraries() -> list[NativeLibrary]:
    """Every kernel library of kvserve (importing the wrapper modules of ``KERNEL_MODULES``)."""
    import importlib

    return [importlib.import_module(f"{__package__}.{m}")._LIB for m in KERNEL_MODULES]


def load_all() -> list[NativeLibrary]:
    """Build (or find in the cache) and load every kernel library now; returns the ones that
    are unavailable (each says why in ``failure_reason``; their callers use torch)."""
    return [lib for lib in all_libraries() if lib.load() is None]


def check_linear_inputs(
    x: torch.Tensor,
    bias: torch.Tensor | None,
    in_features: int,
    out_features: int,
    dtypes: tuple,
    what: str,
) -> None:
    """The argument check every native linear shares: ``x`` a 2-D CPU ``[T, in_features]``
    tensor of one of ``dtypes``, ``bias`` None or CPU ``[out_features]`` in ``x``'s dtype.

    Raises:
        ValueError: naming ``what`` (the kernel and its weight) and every argument's shape/dtype.
    """
    if (
        x.dim() == 2
        and x.shape[1] == in_features
        and x.dtype in dtypes
        and x.device.type == "cpu"
        and (
            bias is None
            or (bias.shape == (out_features,) and bias.dtype == x.dtype and bias.device.type == "cpu")
        )
    ):
        return
    raise ValueError(
        f"{what}: x {tuple(x.shape)} {x.dtype} on {x.device}, bias "
        f"{None if bias is None else (tuple(bias.shape), bias.dtype)} do not fit "
        f"(x must be a CPU {'/'.join(str(d).removeprefix('torch.') for d in dtypes)} [T, {in_features}] tensor)"
    )
