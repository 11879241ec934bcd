"""Tokenizer loading (Hugging Face transformers; never from a hub)."""

from __future__ import annotations

from pathlib import Path


def load_tokenizer(model_dir):
    """A transformers fast tokenizer from a local directory (``local_files_only``).

    Raises:
        ValueError: if the directory has no tokenizer files.
    """
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(str(Path(model_dir)), local_files_only=True)
    except (OSError, ValueError) as e:
        raise ValueError(f"could not load a tokenizer from {model_dir}: {e}") from e
