"""The disk under the model cache fills up while a GGUF file is converted (``LLM(model=x.gguf)``
caches a float HF directory): the caller gets a ``ValueError`` that says the disk is full and
names the cache directory, no partial entry stays in the cache (a later start would otherwise load it),
and once there is room again the same call converts and caches the model.

The disk is filled by patching the writers: Python's ``open`` for files under the cache (the
config and tokenizer JSON files) and ``safetensors``' ``save_file`` (its writer is native code):
each writes what fits and then raises ``OSError(ENOSPC)``, as a full disk does.
"""

from __future__ import annotations

import builtins
import errno
import os
from pathlib import Path

import pytest

from kvserve.model_executor import gguf_convert
from kvserve.model_executor.model_loader import resolve_model_dir


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory):
    from tests.model_executor.helpers import llama_config, save_tiny
    from tests.model_executor.test_quant_inputs import SMALL_VOCAB, write_tiny_gguf

    cfg = llama_config(hidden_size=64, intermediate_size=96, vocab_size=SMALL_VOCAB)
    hf = save_tiny(tmp_path_factory.mktemp("hf"), cfg).cpu()
    path = tmp_path_factory.mktemp("gguf") / "tiny.gguf"
    write_tiny_gguf(path, hf, cfg)
    return path


class _FullDisk:
    """Writes under ``root`` may store ``room`` more bytes in all; then ``ENOSPC``."""

    def __init__(self, root: Path, room: int):
        self.root = str(root)
        self.room = room
        self.hits = 0

    def take(self, n: int) -> int:
        """How many of ``n`` bytes fit (the caller writes those, then raises ``fail``)."""
        fit = max(0, min(n, self.room))
        self.room -= fit
        return fit

    def fail(self, name: str) -> OSError:
        self.hits += 1
        return OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), name)

    def install(self, monkeypatch) -> None:
        real_open = builtins.open
        disk = self

        class _File:
            def __init__(self, f, name):
                self._f, self._name = f, name

            def write(self, data):
                fit = disk.take(len(data))
                self._f.write(data[:fit])
                if fit < len(data):
                    raise disk.fail(self._name)
                return len(data)

            def __getattr__(self, attr):
                return getattr(self._f, attr)

            def __enter__(self):
                return self

            def __exit__(self, *exc):
                self._f.close()

        def fake_open(file, mode="r", *args, **kwargs):
            f = real_open(file, mode, *args, **kwargs)
            if any(c in mode for c in "wax+") and str(file).startswith(disk.root):
                return _File(f, str(file))
            return f

        monkeypatch.setattr(builtins, "open", fake_open)

        import safetensors.torch

        real_save = safetensors.torch.save_file

        def save_file(tensors, filename, metadata=None):
            real_save(tensors, filename, metadata=metadata)
            size = os.path.getsize(filename)
            fit = disk.take(size)
            if fit < size:
                os.truncate(filename, fit)  # what a full disk leaves: the part that fit
                raise disk.fail(filename)

        monkeypatch.setattr(safetensors.torch, "save_file", save_file)


def _entries(cache: Path) -> list[str]:
    """Cache entries (directories) and temporary files left in ``cache``."""
    if not cache.exists():
        return []
    return sorted(p.name for p in cache.iterdir() if p.is_dir() or p.name.startswith(".tmp-"))


# room for nothing; for part of the weights; for the weights but not the config and tokenizer
@pytest.mark.parametrize("room", [0, 1000, "weights"])
def test_disk_full_while_converting_a_gguf_is_a_clear_error_and_caches_nothing(
    tiny_gguf, tmp_path, monkeypatch, room
):
    cache = tmp_path / "cache"
    monkeypatch.setenv("KVSERVE_CACHE_DIR", str(cache))
    if room == "weights":
        # the weights file's size: convert once into a scratch cache
        monkeypatch.setenv("KVSERVE_CACHE_DIR", str(tmp_path / "scratch"))
        room = os.path.getsize(Path(gguf_convert.converted_dir(tiny_gguf)) / "model.safetensors") + 100
        monkeypatch.setenv("KVSERVE_CACHE_DIR", str(cache))
    disk = _FullDisk(cache, room)
    with monkeypatch.context() as mp:
        disk.install(mp)
        with pytest.raises(ValueError) as e:
            resolve_model_dir(str(tiny_gguf))
    assert disk.hits == 1
    msg = str(e.value)
    assert "no space left" in msg and repr(str(cache)) in msg and "KVSERVE_CACHE_DIR" in msg, msg
    # nothing a later start could mistake for a converted model, nothing half-written left
    assert _entries(cache) == [], _entries(cache)
    # with room again, the same call converts and caches it
    out = Path(resolve_model_dir(str(tiny_gguf)))
    assert out.parent == cache and gguf_convert.is_complete(out)
    assert _entries(cache) == [out.name]
