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


def tokenizer_overflow(tokenizer, hf_config, model_dir) -> str | None:
    """A warning when the tokenizer's base vocabulary (``tokenizer.vocab_size``: its own
    tokens, not the added ones) is larger than the model's ``vocab_size`` (text would tokenize
    to ids the embedding has no row for; such prompts are refused per request, naming the
    range), else ``None``. Not refused at load: token-id prompts below ``vocab_size`` still run.
    """
    model_vocab = getattr(hf_config, "vocab_size", None)
    base = getattr(tokenizer, "vocab_size", None)
    if isinstance(model_vocab, int) and isinstance(base, int) and base > model_vocab:
        return (
            f"{Path(model_dir) / 'config.json'}: vocab_size={model_vocab} is smaller than the "
            f"tokenizer's vocabulary ({base} tokens): prompts holding ids past {model_vocab - 1} "
            "will be refused"
        )
    return None
