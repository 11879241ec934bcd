"""The prefix cache's disk tier: host-tier KV blocks written to a directory, so a restarted
engine starts with them in its host tier.

One file a block, ``<key as 16 hex digits>.kvb``: a 48-byte header then the block's bytes::

    magic  b"KVSTIER1"                    8 bytes
    identity digest (blake2b-128)        16 bytes  model and its checkpoint files, dtypes, block shape
    key                                   8 bytes  the block's stable chain key (little endian)
    payload length                        8 bytes
    payload crc32                         4 bytes
    reserved                              4 bytes

Writes run on one background thread (a step only snapshots the block: one host-memory copy)
and land atomically (a temporary file, then a rename). The directory is bounded to
``max_bytes``: after each write the least recently used files (oldest modification time; a file
read at start is touched) are deleted until it fits. A file whose header, identity, key, length
or checksum does not match is skipped with a log line, never loaded; so is a file whose size is
not a block file's, unread.
"""

from __future__ import annotations

import hashlib
import logging
import os
import queue
import struct
import tempfile
import threading
import zlib
from pathlib import Path

import torch

logger = logging.getLogger("kvserve.disk_tier")

MAGIC = b"KVSTIER1"
_HEADER = struct.Struct("<8s16sQQII")
SUFFIX = ".kvb"


def checkpoint_fingerprint(*paths: str | Path | None) -> str:
    """What identifies the checkpoint at ``paths`` (files, or directories whose top-level files
    are read): each file's name, size and modification time, sorted. A checkpoint rewritten in
    place (new weights, same path) gets another fingerprint, so blocks computed with the old
    weights are not loaded for the new ones. Missing paths and None are skipped."""
    parts: list[str] = []
    for path in paths:
        if path is None:
            continue
        p = Path(path)
        try:
            files = sorted(f for f in p.iterdir() if f.is_file()) if p.is_dir() else [p]
            for f in files:
                st = f.stat()
                parts.append(f"{f.resolve()}:{st.st_size}:{st.st_mtime_ns}")
        except OSError:
            continue
    return ";".join(parts)


def identity_digest(identity: str) -> bytes:
    """16-byte digest of an identity string (blake2b)."""
    return hashlib.blake2b(identity.encode(), digest_size=16).digest()


class DiskTier:
    """Block files under ``directory`` for blocks of ``block_shape`` / ``dtype``.

    Args:
        directory: created if missing.
        identity: what must match for a file to be loaded (model, dtypes, shape).
        block_shape: one block's tensor shape; dtype: its dtype.
        max_bytes: bound of the directory's block files (>= one file).

    Raises:
        ValueError: ``max_bytes`` below one file, or ``directory`` is not a directory that can be
            created and written to.
    """

    def __init__(
        self,
        directory: str | Path,
        identity: str,
        block_shape: tuple[int, ...],
        dtype: torch.dtype,
        max_bytes: int,
    ) -> None:
        self.dir = Path(directory)
        if self.dir.exists() and not self.dir.is_dir():
            raise ValueError(f"kv_offload_dir {self.dir} exists and is not a directory")
        try:
            self.dir.mkdir(parents=True, exist_ok=True)
            # a directory the writer cannot write to would only fail later, block by block
            tempfile.TemporaryFile(dir=self.dir).close()
        except OSError as e:
            raise ValueError(
                f"kv_offload_dir {self.dir} is not a writable directory: {e.strerror or e}"
            ) from None
        self.identity = identity_digest(identity)
        self.block_shape = tuple(block_shape)
        self.dtype = dtype
        self.payload_bytes = (
            torch.empty(block_shape, dtype=dtype).numel() * torch.empty((), dtype=dtype).element_size()
        )
        self.file_bytes = _HEADER.size + self.payload_bytes
        if max_bytes < self.file_bytes:
            raise ValueError(
                f"kv_offload_disk_gib holds no block file ({max_bytes} bytes < {self.file_bytes} a block)"
            )
        self.max_bytes = max_bytes
        self.num_written = 0
        self._queue: queue.Queue[tuple[int, torch.Tensor] | None] = queue.Queue()
        self._thread = threading.Thread(target=self._run, name="kvserve-disk-tier", daemon=True)
        self._thread.start()

    def path(self, key: int) -> Path:
        return self.dir / f"{key:016x}{SUFFIX}"

    # ------------------------------------------------------------------ writing
    def save(self, key: int, block: torch.Tensor) -> None:
        """Queue ``block`` (a snapshot is taken now) to be written under ``key``; returns at
        once. Raises ValueError for a block of another shape or dtype."""
        if tuple(block.shape) != self.block_shape or block.dtype != self.dtype:
            raise ValueError(f"block {tuple(block.shape)} {block.dtype} != {self.block_shape} {self.dtype}")
        self._queue.put((key, block.detach().to("cpu", copy=True).contiguous()))

    def flush(self) -> None:
        """Wait until every queued block is written."""
        self._queue.join()

    def close(self) -> None:
        """Write what is queued, then stop the writer thread. Idempotent."""
        if self._thread.is_alive():
            self._queue.put(None)
            self._thread.join()

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            try:
                if item is None:
                    return
                self._write(*item)
            except Exception:  # a full disk must not end the engine: the block stays unsaved
                logger.exception("disk tier: writing a block to %s failed", self.dir)
            finally:
                self._queue.task_done()

    def _write(self, key: int, block: torch.Tensor) -> None:
        payload = block.reshape(-1).view(torch.uint8).numpy().tobytes()
        header = _HEADER.pack(MAGIC, self.identity, key, len(payload), zlib.crc32(payload), 0)
        dst = self.path(key)
        tmp = dst.with_suffix(f".tmp{threading.get_ident()}")
        with open(tmp, "wb") as f:
            f.write(header)
            f.write(payload)
        os.replace(tmp, dst)
        self.num_written += 1
        self._enforce_bound()

    def _enforce_bound(self) -> None:
        files = []
        for p in self.dir.glob(f"*{SUFFIX}"):
            try:
                st = p.stat()
            except FileNotFoundError:
                continue
            files.append((st.st_mtime_ns, st.st_size, p))
        total = sum(s for _, s, _ in files)
        for _, size, p in sorted(files, key=lambda f: f[0]):
            if total <= self.max_bytes:
                break
            p.unlink(missing_ok=True)
            total -= size

    # ------------------------------------------------------------------ reading
    def load(self, limit: int) -> list[tuple[int, torch.Tensor]]:
        """The valid block files, at most ``limit``, most recently used kept; returned least
        recently used first (the order to enter them in an LRU). Loaded files are touched."""
        entries = []
        for p in self.dir.glob(f"*{SUFFIX}"):
            try:
                st = p.stat()
            except OSError:
                continue
            entries.append((st.st_mtime_ns, st.st_size, p))
        entries.sort(key=lambda e: e[0], reverse=True)
        out: list[tuple[int, torch.Tensor]] = []
        for _, size, p in entries:
            if len(out) >= limit:
                break
            if size != self.file_bytes:  # not read: a stray file may be of any size
                logger.warning(
                    "disk tier: %s ignored: %d bytes, a block file has %d", p, size, self.file_bytes
                )
                continue
            block = self._read(p)
            if block is not None:
                out.append(block)
                os.utime(p)
        out.reverse()
        return out

    def _read(self, p: Path) -> tuple[int, torch.Tensor] | None:
        try:
            data = p.read_bytes()
        except OSError as e:
            logger.warning("disk tier: %s unreadable (%s); ignored", p, e)
            return None
        why = None
        if len(data) < _HEADER.size:
            why = "truncated header"
        else:
            magic, ident, key, n, crc, _ = _HEADER.unpack_from(data)
            payload = data[_HEADER.size :]
            if magic != MAGIC:
                why = "not a block file"
            elif ident != self.identity:
                why = "written for another model, dtype or block shape"
            elif p.name != f"{key:016x}{SUFFIX}":
                why = "its key does not match its name"
            elif n != self.payload_bytes or len(payload) != n:
                why = f"payload of {len(payload)} bytes, expected {self.payload_bytes}"
            elif zlib.crc32(payload) != crc:
                why = "checksum mismatch"
        if why is not None:
            logger.warning("disk tier: %s ignored: %s", p, why)
            return None
        flat = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
        return key, flat.view(self.dtype).reshape(self.block_shape)
