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


def check_tokenizer_fits(tokenizer, hf_config, model_dir) -> None:
    """Refuse a tokenizer whose base vocabulary (``tokenizer.vocab_size``: its own tokens, not
    the added ones) is larger than the model's ``vocab_size``: most text would tokenize to ids
    the embedding has no row for. (A model with extra added tokens past its vocabulary still
    loads; a prompt holding them is refused per request.)

    Raises:
        ValueError: naming ``model_dir``'s ``config.json`` ``vocab_size`` and the tokenizer's size.
    """
    model_vocab = getattr(hf_config, "vocab_size", None)
    base = getattr(tokenizer, "vocab_size", None)
    if isinstance(model_vocab, int) and isinstance(base, int) and base > model_vocab:
        raise ValueError(
            f"{Path(model_dir) / 'config.json'}: vocab_size={model_vocab} is smaller than the "
            f"tokenizer's vocabulary ({base} tokens): ids past {model_vocab - 1} have no embedding row"
        )
