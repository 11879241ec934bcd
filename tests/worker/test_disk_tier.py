"""The disk tier's block files: written by a background thread, read back bit for bit; files
of another model/dtype/shape, truncated or corrupt ones are skipped with a log line; the
directory stays within its bound, least recently used files deleted first."""

import logging
import os
import threading

import pytest
import torch

from kvserve.worker.disk_tier import SUFFIX, DiskTier

SHAPE = (2, 2, 1, 4, 8)


def _tier(path, identity="m|bf16", max_blocks=8, dtype=torch.bfloat16):
    probe = DiskTier(path, identity, SHAPE, dtype, 1 << 30)
    probe.close()
    return DiskTier(path, identity, SHAPE, dtype, max_blocks * probe.file_bytes)


def _block(seed, dtype=torch.bfloat16):
    return torch.randn(SHAPE, generator=torch.Generator().manual_seed(seed)).to(dtype)


def test_round_trip_is_bit_exact_and_written_off_the_calling_thread(tmp_path):
    tier = _tier(tmp_path)
    writers = []
    orig = tier._write

    def spy(key, block):
        writers.append(threading.current_thread().name)
        orig(key, block)

    tier._write = spy
    blocks = {k: _block(k) for k in (3, 1 << 60, 12345)}
    for k, b in blocks.items():
        tier.save(k, b)
    tier.flush()
    assert writers and all(w == "kvserve-disk-tier" for w in writers)
    tier.close()
    loaded = dict(_tier(tmp_path).load(10))
    assert set(loaded) == set(blocks)
    for k, b in blocks.items():
        assert torch.equal(loaded[k].view(torch.int16), b.view(torch.int16))


def test_foreign_truncated_and_corrupt_files_are_ignored_with_a_log_line(tmp_path, caplog):
    tier = _tier(tmp_path)
    for k in range(4):
        tier.save(k, _block(k))
    tier.close()
    other = _tier(tmp_path, identity="another-model|bf16")
    other.save(9, _block(9))
    other.close()
    raw = tier.path(1).read_bytes()
    tier.path(1).write_bytes(raw[: len(raw) // 2])  # truncated
    raw = bytearray(tier.path(2).read_bytes())
    raw[-1] ^= 0xFF  # one flipped byte
    tier.path(2).write_bytes(bytes(raw))
    os.replace(tier.path(3), tier.path(7))  # a file under another key's name
    (tmp_path / "junk.kvb").write_bytes(b"x" * 10)
    with caplog.at_level(logging.WARNING, logger="kvserve.disk_tier"):
        loaded = dict(_tier(tmp_path).load(10))
    assert set(loaded) == {0}
    text = caplog.text
    for why in (
        "another model",
        "152 bytes, a block file has 304",  # truncated
        "10 bytes, a block file has 304",  # junk
        "checksum mismatch",
        "does not match its name",
    ):
        assert why in text, why


def test_directory_stays_within_its_bound_dropping_least_recently_used(tmp_path):
    tier = _tier(tmp_path, max_blocks=3)
    for k in range(5):
        tier.save(k, _block(k))
        tier.flush()
        os.utime(tier.path(k), ns=(k * 10**9, k * 10**9))  # distinct mtimes: write order
    tier.close()
    assert sorted(p.name for p in tmp_path.glob("*.kvb")) == [tier.path(k).name for k in (2, 3, 4)]
    # load keeps the most recently used when it may take fewer, returned oldest first
    assert [k for k, _ in _tier(tmp_path, max_blocks=3).load(2)] == [3, 4]


def test_bad_settings_are_errors(tmp_path):
    with pytest.raises(ValueError, match="kv_offload_disk_gib"):
        DiskTier(tmp_path, "m", SHAPE, torch.float32, 10)
    f = tmp_path / "file"
    f.write_text("")
    with pytest.raises(ValueError, match="not a directory"):
        DiskTier(f, "m", SHAPE, torch.float32, 1 << 20)


def test_a_directory_that_cannot_be_created_is_a_value_error_naming_it(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_bytes(b"x")
    with pytest.raises(ValueError, match="kv_offload_dir .* is not a writable directory"):
        DiskTier(blocker / "sub", "id", (2, 3), torch.float32, 1 << 20)


def test_files_of_another_size_are_skipped_unread(tmp_path, monkeypatch):
    tier = DiskTier(tmp_path, "id", (2, 3), torch.float32, 1 << 20)
    tier.save(7, torch.arange(6, dtype=torch.float32).reshape(2, 3))
    tier.flush()
    (tmp_path / f"{8:016x}{SUFFIX}").write_bytes(b"\0" * (tier.file_bytes * 1000))
    (tmp_path / f"{9:016x}{SUFFIX}").write_bytes(b"KVSTIER1")
    (tmp_path / f"{10:016x}{SUFFIX}").mkdir()
    read = []
    real_read = DiskTier._read
    monkeypatch.setattr(DiskTier, "_read", lambda self, p: read.append(p.name) or real_read(self, p))
    loaded = tier.load(10)
    assert [k for k, _ in loaded] == [7]
    assert read == [f"{7:016x}{SUFFIX}"]
    tier.close()
