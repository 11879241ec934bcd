"""Incremental detokenization of generated tokens (text grows one token at a time)."""

from __future__ import annotations

from tokenizers.decoders import DecodeStream

from kvserve.sequence import Logprob, Sequence

#: Tokens of preceding context used to prime a stream, so the first generated token decodes
#: with the right leading space / byte merges (sentencepiece and byte-level BPE both need it).
_PRIME_TOKENS = 6
#: Most token texts ``decode_logprobs`` keeps (about a vocabulary).
_TOKEN_TEXT_CACHE = 262_144


class Detokenizer:
    """Turns each newly appended token of a ``Sequence`` into text.

    Uses ``tokenizers.decoders.DecodeStream`` (Hugging Face tokenizers), which buffers
    incomplete UTF-8 byte sequences, so multi-token characters are emitted whole.
    """

    def __init__(self, tokenizer):
        # transformers' fast tokenizers wrap a ``tokenizers.Tokenizer``.
        self._tokenizer = getattr(tokenizer, "_tokenizer", None) or tokenizer.backend_tokenizer
        self._token_text: dict[int, str] = {}

    def decode_logprobs(self, entries: dict[int, Logprob]) -> None:
        """Fill each entry's ``decoded_token`` (the text of that one token, special tokens
        included, as vLLM shows them) where it is still None; ids are decoded once each
        (a bounded cache)."""
        for tid, lp in entries.items():
            if lp.decoded_token is None:
                text = self._token_text.get(tid)
                if text is None:
                    text = self._tokenizer.decode([tid], skip_special_tokens=False)
                    if len(self._token_text) < _TOKEN_TEXT_CACHE:
                        self._token_text[tid] = text
                lp.decoded_token = text

    def decode_last_token(self, seq: Sequence, skip_special_tokens: bool = True) -> str:
        """Return the text added by ``seq``'s last output token ("" while a character is
        incomplete) and append it to ``seq.output_text``."""
        if seq.decode_stream is None:
            ids = seq.get_token_ids()
            context = ids[max(0, len(ids) - 1 - _PRIME_TOKENS) : len(ids) - 1]
            seq.decode_stream = DecodeStream(ids=context, skip_special_tokens=skip_special_tokens)
        piece = seq.decode_stream.step(self._tokenizer, seq.get_last_token_id()) or ""
        seq.output_text += piece
        return piece
