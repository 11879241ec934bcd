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


def test_a_copy_of_the_sources_elsewhere_reuses_the_build(tmp_path, monkeypatch):
    """A fresh clone (another folder, the same sources) finds the build already made: a server
    started from it must not wait for the compiler."""
    import shutil

    from kvserve.ops import library

    out = tmp_path / "native"
    lib = NativeLibrary("copy_key", elementwise._LIB.source, elementwise._LIB.signatures)
    first = lib.build(out)
    copy = tmp_path / "clone" / "csrc"
    shutil.copytree(library.CSRC_DIR, copy)
    monkeypatch.setattr(library, "CSRC_DIR", copy)
    mtime = first.stat().st_mtime_ns
    assert lib.build(out) == first and first.stat().st_mtime_ns == mtime
    (copy / lib.source).write_text((copy / lib.source).read_text() + "\n/* edited */\n")
    library._sources_digest.cache_clear()
    try:
        assert lib.build(out) != first  # other sources: another build
    finally:
        library._sources_digest.cache_clear()


def test_load_all_loads_every_library():
    from kvserve.ops import library

    assert library.load_all() == []
    assert all(lib.path is not None for lib in library.all_libraries())
