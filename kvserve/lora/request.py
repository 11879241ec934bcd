"""``kvserve.lora.request.LoRARequest``: the import path vLLM users know; the class lives in
``kvserve.lora_request`` so that ``sequence`` and ``core`` can name it without importing LoRA."""

from kvserve.lora_request import MAX_LORA_PATH_CHARS, LoRARequest

__all__ = ["MAX_LORA_PATH_CHARS", "LoRARequest"]
