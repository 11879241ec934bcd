"""``LoRARequest``: which adapter a request runs with (vLLM's names)."""

from __future__ import annotations

from dataclasses import dataclass

from kvserve.field_limits import check_lora_name

#: Longest ``lora_path``, in characters (Linux's PATH_MAX).
MAX_LORA_PATH_CHARS = 4096


@dataclass(frozen=True)
class LoRARequest:
    """A request for one LoRA adapter of the base model.

    Attributes:
        lora_name: the adapter's public name (the server's ``"model"`` field chooses it).
        lora_int_id: a unique integer id >= 1 (0 means "no adapter" inside the engine); the
            scheduler counts distinct ids per step and the prefix cache keys blocks by it.
        lora_path: a local PEFT directory (``adapter_config.json`` +
            ``adapter_model.safetensors``).
        allowed_root: when set, every adapter file read (now, or again after a CPU-cache
            eviction) must resolve, symlinks followed, under this directory (the server's
            ``--allowed-lora-root``); None: no such bound.

    Raises:
        ValueError: a ``lora_name`` outside ``field_limits.LORA_NAME_RULE``, an empty
            ``lora_path``, one with control characters (NUL, newlines) or longer than
            ``MAX_LORA_PATH_CHARS``, or ``lora_int_id`` < 1.
    """

    lora_name: str
    lora_int_id: int
    lora_path: str
    allowed_root: str | None = None

    def __post_init__(self) -> None:
        check_lora_name("lora_request.lora_name", self.lora_name)
        if (
            not isinstance(self.lora_int_id, int)
            or isinstance(self.lora_int_id, bool)
            or self.lora_int_id < 1
        ):
            raise ValueError(f"lora_request.lora_int_id must be an integer >= 1, got {self.lora_int_id!r}.")
        if not isinstance(self.lora_path, str) or not self.lora_path:
            raise ValueError(f"lora_request.lora_path must be a non-empty path, got {self.lora_path!r}.")
        if len(self.lora_path) > MAX_LORA_PATH_CHARS or any(
            ord(ch) < 32 or ord(ch) == 127 for ch in self.lora_path
        ):
            raise ValueError(
                f"lora_request.lora_path must be at most {MAX_LORA_PATH_CHARS} characters without "
                f"control characters (NUL, newlines), got {self.lora_path[:64]!r}"
                f"{'...' if len(self.lora_path) > 64 else ''}."
            )

    @property
    def adapter_id(self) -> int:
        """``lora_int_id`` (vLLM's alias)."""
        return self.lora_int_id
