"""The converted-GGUF cache (``gguf_convert``): keyed on the whole file's content (a file
with another's name, size and first and last MiB never gets its conversion), the whole-file
hash remembered so an unchanged file is read once, and a failed conversion (a refused file, a
full disk) leaves no cache entry behind."""

from __future__ import annotations

import errno
import hashlib
import json
import os

import pytest

from kvserve.model_executor import gguf_convert
from kvserve.model_executor.model_loader import resolve_model_dir

MIB = 1 << 20


@pytest.fixture
def cache(tmp_path, monkeypatch):
    """A cache root of the test's own, sharing the usual one's native kernel builds (not
    rebuilt per test)."""
    native = gguf_convert.cache_root() / "native"
    native.mkdir(parents=True, exist_ok=True)
    root = tmp_path / "cache"
    root.mkdir()
    (root / "native").symlink_to(native, target_is_directory=True)
    monkeypatch.setenv("KVSERVE_CACHE_DIR", str(root))
    return root


@pytest.fixture
def fake_convert(monkeypatch):
    """A converter writing the sha256 of the file it read into ``config.json``: what a
    conversion holds tells which file it came from. Returns the list of files converted."""
    calls = []

    def convert(src, out):
        calls.append(src)
        (out / "config.json").write_text(json.dumps({"src": hashlib.sha256(src.read_bytes()).hexdigest()}))
        (out / "model.safetensors").write_bytes(b"")

    monkeypatch.setattr(gguf_convert, "convert_gguf", convert)
    return calls


def _file(path, middle: bytes):
    """3 MiB: the same first and last MiB whatever ``middle`` (one byte) is."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(b"GGUF" + b"a" * (MIB - 4) + middle + b"b" * (MIB - 1) + b"c" * MIB)
    return path


def _source(d):
    return json.loads((d / "config.json").read_text())["src"]


def test_files_alike_in_name_size_and_first_and_last_mib_get_their_own_conversions(
    tmp_path, cache, fake_convert
):
    one = _file(tmp_path / "a" / "Model.gguf", b"1")
    two = _file(tmp_path / "b" / "Model.gguf", b"2")
    assert one.stat().st_size == two.stat().st_size
    d1, d2 = gguf_convert.converted_dir(one), gguf_convert.converted_dir(two)
    assert d1 != d2 and len(fake_convert) == 2
    assert _source(d1) == hashlib.sha256(one.read_bytes()).hexdigest()
    assert _source(d2) == hashlib.sha256(two.read_bytes()).hexdigest()
    # the same path rewritten in place (same inode), its mtime set back: still a new key
    st = one.stat()
    with open(one, "r+b") as f:
        f.seek(MIB)
        f.write(b"3")
    os.utime(one, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert one.stat().st_ino == st.st_ino and one.stat().st_mtime_ns == st.st_mtime_ns
    d3 = gguf_convert.converted_dir(one)
    assert d3 not in (d1, d2) and _source(d3) == hashlib.sha256(one.read_bytes()).hexdigest()
    # copies of one content share one conversion, wherever they are
    copy = tmp_path / "c" / "Model.gguf"
    copy.parent.mkdir()
    copy.write_bytes(two.read_bytes())
    assert gguf_convert.converted_dir(copy) == d2 and len(fake_convert) == 3


def test_the_memo_hashes_an_unchanged_file_once(tmp_path, cache, fake_convert, monkeypatch):
    hashed = []
    real = hashlib.file_digest

    def counting(f, digest):
        hashed.append(f.name)
        return real(f, digest)

    monkeypatch.setattr(gguf_convert.hashlib, "file_digest", counting)
    path = _file(tmp_path / "Model.gguf", b"1")
    d = gguf_convert.converted_dir(path)
    for _ in range(3):
        assert gguf_convert.converted_dir(path) == d
        assert resolve_model_dir(str(path)) == d
    assert len(hashed) == 1
    memo = json.loads((cache / gguf_convert.HASH_MEMO).read_text())
    assert list(memo.values()) == [hashlib.sha256(path.read_bytes()).hexdigest()]
    os.utime(path, ns=(0, 10**18))  # touched: hashed again, same content, same entry
    assert gguf_convert.converted_dir(path) == d and len(hashed) == 2
    (cache / gguf_convert.HASH_MEMO).write_text("{not json")  # a broken memo is rebuilt
    assert gguf_convert.converted_dir(path) == d and len(hashed) == 3
    assert gguf_convert.converted_dir(path) == d and len(hashed) == 3
    assert len(fake_convert) == 1


def test_the_memo_is_bounded_and_a_failed_memo_write_is_harmless(tmp_path, cache, monkeypatch):
    monkeypatch.setattr(gguf_convert, "_HASH_MEMO_MAX", 3)
    paths = [_file(tmp_path / f"m{i}.gguf", bytes([i])) for i in range(5)]
    for p in paths:
        gguf_convert.file_sha256(p)
    memo = json.loads((cache / gguf_convert.HASH_MEMO).read_text())
    assert sorted(memo) == sorted(gguf_convert._memo_key(p, p.stat()) for p in paths[2:])

    def full(*a, **k):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(gguf_convert.json, "dump", full)
    extra = _file(tmp_path / "m9.gguf", b"9")
    assert gguf_convert.file_sha256(extra) == hashlib.sha256(extra.read_bytes()).hexdigest()
    assert _entries(cache) == [] and (cache / gguf_convert.HASH_MEMO).is_file()  # no temp file left


def _entries(cache):
    """The cache's entries (not the hash memo or the native builds)."""
    return sorted(p.name for p in cache.iterdir() if p.name not in (gguf_convert.HASH_MEMO, "native"))


@pytest.mark.parametrize(
    "error",
    [
        OSError(errno.ENOSPC, "No space left on device"),
        # how the safetensors writer reports it (its own exception type, the OS error inside)
        "safetensors",
    ],
)
def test_a_full_disk_mid_conversion_is_a_clear_error_and_leaves_no_entry(tmp_path, cache, monkeypatch, error):
    from safetensors import SafetensorError

    if error == "safetensors":
        error = SafetensorError(
            'Error while serializing: IoError(Os { code: 28, kind: StorageFull, message: "No space left on device" })'
        )

    def convert(src, out):
        (out / "config.json").write_text("{}")
        (out / "model.safetensors").write_bytes(b"\0" * 1000)  # part of the weights, then the disk is full
        raise error

    monkeypatch.setattr(gguf_convert, "convert_gguf", convert)
    path = _file(tmp_path / "Model.gguf", b"1")
    with pytest.raises(
        ValueError, match=r"cannot write the converted model into the cache directory .*no space left"
    ):
        resolve_model_dir(str(path))
    assert _entries(cache) == []


def test_an_unwritable_cache_is_a_clear_error(tmp_path, monkeypatch, fake_convert):
    blocker = tmp_path / "file"
    blocker.write_text("")
    monkeypatch.setenv("KVSERVE_CACHE_DIR", str(blocker / "cache"))  # under a file: cannot exist
    with pytest.raises(
        ValueError, match=r"cannot write the converted model into the cache directory .*file/cache"
    ):
        gguf_convert.converted_dir(_file(tmp_path / "Model.gguf", b"1"))


def test_a_gguf_with_a_zero_dimension_leaves_no_entry_on_either_path(tmp_path, cache):
    from tests.model_executor.helpers import llama_config, save_tiny
    from tests.model_executor.test_quant_inputs import TINY, T, write_tiny_gguf

    cfg = llama_config(**TINY)
    hf = save_tiny(tmp_path / "hf", cfg).cpu()

    class ZeroNorm:  # the final norm weight with no elements
        def state_dict(self):
            sd = dict(hf.state_dict())
            sd["model.norm.weight"] = sd["model.norm.weight"][:0]
            return sd

    path = tmp_path / "zero.gguf"
    write_tiny_gguf(path, ZeroNorm(), cfg, qtype=T.Q8_0)
    for quantization in (None, "gguf"):
        with pytest.raises(ValueError, match=r"zero\.gguf': tensor 'output_norm\.weight': .*shape \(0,\)"):
            resolve_model_dir(str(path), quantization)
        assert _entries(cache) == [], quantization
