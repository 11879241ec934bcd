"""The C kernels in ``kvserve/csrc/`` as sources: every one compiles warning-free for the host,
the AVX2 fallback and the AMX paths; every library loads where a compiler exists; the kernel
tests pass with the libraries built under AddressSanitizer and UBSan, and on the AVX2 build
(the kernels of CPUs without AVX-512, run here)."""

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from kvserve.ops import cpu, library
from tests.ops import native_builds

CC = os.environ.get("CC", "cc")
pytestmark = pytest.mark.skipif(shutil.which(CC) is None, reason=f"no C compiler ({CC})")
SOURCES = sorted(p.name for p in library.CSRC_DIR.glob("*.c"))
REPO = Path(__file__).resolve().parents[2]


def test_every_c_file_is_a_kernel_library():
    """A new .c in csrc/ is built by a NativeLibrary (so these tests and ``kvserve doctor``
    cover it), and every library's source exists."""
    assert sorted(lib.source for lib in library.all_libraries()) == SOURCES


@pytest.mark.slow
def test_every_kernel_compiles_with_all_warnings_as_errors():
    """Every source builds with ``-Wall -Wextra -Werror`` for each ``native_builds.WERROR_FLAGS``
    target (those builds stay in the session folder for later tests)."""
    results = native_builds.build(list(native_builds.WERROR_FLAGS.values()))
    failed = [f"{flags}: {err}" for flags, errs in results.items() for err in errs]
    assert not failed, "\n\n".join(failed)


@pytest.mark.skipif(os.environ.get("KVSERVE_NATIVE") == "0", reason="KVSERVE_NATIVE=0")
def test_every_library_builds_and_loads_on_this_host():
    """Found when kernels moved to csrc/: a helper defined under the AMX guard but called on
    every host made the prefill-attention library fail to load on CPUs without AMX, and its
    tests skipped instead of failing. A compiler present means every library must load."""
    for lib in library.all_libraries():
        assert lib.available(), f"{lib.name}: {lib.failure_reason()}"


@pytest.mark.slow
@pytest.mark.skipif(
    native_builds.asan_preload() is None, reason="the compiler has no AddressSanitizer runtime"
)
def test_kernel_tests_pass_under_address_and_undefined_sanitizers():
    # Build without the ASan runtime preloaded (the compiler must not run under it) ...
    failed = native_builds.build([native_builds.SANITIZE])[native_builds.SANITIZE]
    assert not failed, "\n\n".join(failed)
    env = native_builds.env(native_builds.SANITIZE)
    # ... then load the instrumented libraries into a Python that has it first.
    env.update(
        LD_PRELOAD=native_builds.asan_preload(),
        ASAN_OPTIONS="detect_leaks=0",  # CPython and torch keep allocations until exit
        UBSAN_OPTIONS="print_stacktrace=1",
    )
    # The control: an out-of-bounds read (silu_and_mul told rows are 2 floats longer than the
    # buffer holds) must be reported, or the rest proves nothing.
    oob = (
        "import torch\nfrom kvserve.ops import elementwise as o\n"
        "x = torch.randn(3, 40); y = torch.empty(3, 21)\n"
        "o._LIB.fn('silu_and_mul_f32')(x.data_ptr(), y.data_ptr(), 3, 21, 1)\n"
    )
    r = subprocess.run(
        [sys.executable, "-c", oob], env=env, cwd=REPO, capture_output=True, text=True, timeout=120
    )
    assert r.returncode != 0 and "AddressSanitizer" in r.stderr, r.stderr[-2000:]
    tests = [
        # first: the instrumented libraries load (else the kernel tests would only skip)
        "tests/ops/test_csrc.py::test_every_library_builds_and_loads_on_this_host",
        "tests/ops/test_elementwise.py",
        "tests/ops/test_attention.py",
        "tests/ops/test_gemm.py",
        "tests/ops/test_gemm_bf16dot.py",
        "tests/ops/test_prefill_attention.py",
        "tests/adversarial/test_native_gemm_edges.py",
        "tests/ops/test_gemm_amx.py",
        "tests/ops/test_quant_gemm.py",
        "tests/ops/test_quant_act8.py",
        "tests/ops/test_quant_x4.py",
        "tests/ops/test_bitmask.py",
        "tests/lora/test_lora_native.py",
        "tests/model_executor/test_cpu_decode_step_fused.py",
        "tests/model_executor/test_cpu_decode_step_int8.py",
    ]
    r = subprocess.run(
        # -s: a sanitizer report goes to stderr as the process dies; under pytest's capture it
        # would be lost with the captured output
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-s",
            "-x",
            "-p",
            "no:cacheprovider",
            "-m",
            "",  # every test of these files, whatever its tier
            *tests,
        ],
        env=env,
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert r.returncode == 0, (r.stdout[-4000:], r.stderr[-4000:])
    assert " passed" in r.stdout, r.stdout[-2000:]


#: The kernel tests run on the AVX2 build: every library family with AVX2 code of its own (the
#: float GEMM panels, norms and activations, decode and prefill attention, the quantized
#: kernels' float and int8 paths, LoRA, the one-call step); the AVX-512-only kernels (VNNI,
#: AMX, the bfloat16 dot product) skip there, as on such a CPU.
AVX2_TESTS = [
    "tests/ops/test_elementwise.py",
    "tests/ops/test_gemm.py",
    "tests/ops/test_quant_gemm.py",
    "tests/ops/test_quant_x4.py",
    "tests/ops/test_attention.py",
    "tests/ops/test_prefill_attention.py",
    "tests/model_executor/test_cpu_decode_step_fused.py",
    "tests/model_executor/test_cpu_decode_step_int8.py",
    "tests/lora/test_lora_native.py",
]

_AVX2_PREMISE = """
from kvserve.ops import gemm_amx, gemm_bf16dot, library, quant
assert all(lib.available() for lib in library.all_libraries())
assert quant.act8_isa() == "avx2" and quant.activation_mode() == "float"
assert not gemm_amx.available() and not gemm_bf16dot.built()
print("ok")
"""


@pytest.mark.slow
@pytest.mark.skipif(not cpu.has_avx2, reason="needs AVX2 (the build's target)")
@pytest.mark.skipif(os.environ.get("KVSERVE_NATIVE") == "0", reason="KVSERVE_NATIVE=0")
def test_kernel_tests_pass_on_the_avx2_build():
    """CPUs with AVX2 and no AVX-512 (AMD Zen 1-3, Intel client cores) run other code than this
    host's build: kv_vec.h's two registers per vector, quant_gemm.c's AVX2 dequantization and
    dot products, the float-activation mode by default. The ``-Werror`` AVX2 build (reused)
    runs the kernel tests of ``AVX2_TESTS`` against their float references."""
    if os.environ.get(library.EXTRA_CFLAGS_ENV) or "asan" in os.environ.get("LD_PRELOAD", ""):
        pytest.skip("a sanitizer run (its own flags; the compiler must not run under ASan)")
    flags = native_builds.WERROR_FLAGS["x86-64-v3"]
    failed = native_builds.build([flags])[flags]
    assert not failed, "\n\n".join(failed)
    env = native_builds.env(flags)
    r = subprocess.run(
        [sys.executable, "-c", _AVX2_PREMISE], env=env, cwd=REPO, capture_output=True, text=True, timeout=300
    )
    assert r.returncode == 0 and "ok" in r.stdout, r.stderr[-3000:]
    r = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", "-m", "", *AVX2_TESTS],
        env=env,
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert r.returncode == 0, (r.stdout[-4000:], r.stderr[-4000:])
    assert " passed" in r.stdout, r.stdout[-2000:]
