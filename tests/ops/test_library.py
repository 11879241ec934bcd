"""The build-on-first-use C libraries (``library.NativeLibrary``)."""

import pytest

from kvserve.ops import elementwise
from kvserve.ops.library import NativeLibrary

pytestmark = pytest.mark.skipif(not elementwise.available(), reason="no C compiler / native kernels")


def test_two_libraries_of_one_source_each_build_and_load(tmp_path, monkeypatch):
    """Found while benchmarking kernel variants: the build folder was keyed on the source only,
    so a second library of the same source (another name) failed to rename its build into the
    taken folder and came out unavailable."""
    monkeypatch.setenv("KVSERVE_CACHE_DIR", str(tmp_path))
    src, sigs = elementwise._LIB.source, elementwise._LIB.signatures
    a, b = NativeLibrary("dup_a", src, sigs), NativeLibrary("dup_b", src, sigs)
    assert a.available() and b.available(), (a.failure_reason(), b.failure_reason())
    assert a.fn("silu_and_mul_f32") is not None and b.fn("silu_and_mul_f32") is not None
