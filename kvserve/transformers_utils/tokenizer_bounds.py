"""A bound on how much text one token can cover, so that a prompt can be proved too long from
its character count alone, before (and instead of) tokenizing it.

If no token of a tokenizer covers more than ``C`` characters of its input, a text of ``L``
characters has at least ``L / C`` tokens, and a prompt of more than ``max_model_len * C``
characters can never fit. That holds only when every input character ends up in some token: so
the bound is given only for tokenizers that cannot drop or merge away text (byte-level BPE, or
BPE with byte fallback; normalizers and pre-tokenizers that never shrink the text by more than a
known factor; no added token that swallows the whitespace around it; no truncation), and is
``None`` (no early refusal) for any other.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass

logger = logging.getLogger("kvserve.tokenizer")

# Unicode canonical (de)composition: a precomposed character decomposes to at most 4 code points
# (e.g. U+1F82), so NFC / NFKC can shrink a text at most 4-fold; NFD / NFKD only grow it.
_NORMALIZER_SHRINK = {"NFC": 4.0, "NFKC": 4.0, "NFD": 1.0, "NFKD": 1.0, "Lowercase": 1.0, "Prepend": 1.0}
# Pre-tokenizers that split (or map bytes to characters one to one) without removing text.
_SAFE_PRE_TOKENIZERS = {"ByteLevel", "Metaspace", "Digits", "Punctuation", "Split", "UnicodeScripts"}


@dataclass(frozen=True)
class TokenTextBound:
    """``max_chars_per_token``: no token covers more input characters than this (the longest
    vocabulary entry, times the most the normalizer can shrink a text)."""

    max_chars_per_token: float

    def min_tokens(self, num_chars: int) -> int:
        """The fewest tokens a text of ``num_chars`` characters can have (>= 0)."""
        return int(num_chars // self.max_chars_per_token)

    def proves_too_long(self, num_chars: int, max_tokens: int) -> bool:
        """True when a text of ``num_chars`` characters surely has more than ``max_tokens``
        tokens."""
        return num_chars > max_tokens * self.max_chars_per_token


def _shrink_factor(normalizer: dict | None) -> float | None:
    if normalizer is None:
        return 1.0
    kind = normalizer.get("type")
    if kind == "Sequence":
        factor = 1.0
        for part in normalizer.get("normalizers", []):
            f = _shrink_factor(part)
            if f is None:
                return None
            factor *= f
        return factor
    if kind == "Replace":
        pattern = normalizer.get("pattern", {})
        if "String" not in pattern:
            return None  # a regex can match (and remove) any run of text
        src, dst = pattern["String"], normalizer.get("content", "")
        if not src:
            return None
        return max(1.0, len(src) / max(1, len(dst))) if dst else None
    return _NORMALIZER_SHRINK.get(kind) if kind is not None else None


def _pre_tokenizer_safe(pre: dict | None) -> bool:
    if pre is None:
        return True
    kind = pre.get("type")
    if kind == "Sequence":
        return all(_pre_tokenizer_safe(p) for p in pre.get("pretokenizers", []))
    if kind == "Split":
        return pre.get("behavior") != "Removed"
    return kind in _SAFE_PRE_TOKENIZERS


def _is_byte_level(pre: dict | None) -> bool:
    if pre is None:
        return False
    if pre.get("type") == "Sequence":
        return any(_is_byte_level(p) for p in pre.get("pretokenizers", []))
    return pre.get("type") == "ByteLevel"


def token_text_bound(tokenizer) -> TokenTextBound | None:
    """The bound for a Hugging Face fast tokenizer, or None when it cannot be proved (a slow or
    unknown tokenizer, a model or normalizer that may drop or collapse text). Reads the whole
    vocabulary once; call it at start-up, not per request."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return None
    try:
        spec = json.loads(backend.to_str())
    except Exception as e:  # a tokenizer that cannot serialise itself: no bound
        logger.info("no prompt-length bound for this tokenizer: %r", e)
        return None
    why = _why_unbounded(spec)
    if why is not None:
        logger.info("no prompt-length bound for this tokenizer: %s", why)
        return None
    model = spec["model"]
    vocab = model.get("vocab") or {}
    longest = max((len(t) for t in vocab), default=0)
    for added in spec.get("added_tokens") or []:
        longest = max(longest, len(added.get("content", "")))
    if longest < 1:
        return None
    return TokenTextBound(longest * (_shrink_factor(spec.get("normalizer")) or 1.0))


def _why_unbounded(spec: dict) -> str | None:
    model = spec.get("model") or {}
    if model.get("type") != "BPE":
        return f"model type {model.get('type')!r} (only BPE is understood)"
    pre = spec.get("pre_tokenizer")
    if not (model.get("byte_fallback") or _is_byte_level(pre)):
        return "BPE without byte fallback or a byte-level pre-tokenizer (unknown text may collapse)"
    if not _pre_tokenizer_safe(pre):
        return f"pre-tokenizer {pre.get('type') if pre else None!r} may remove text"
    if _shrink_factor(spec.get("normalizer")) is None:
        return f"normalizer {spec['normalizer'].get('type')!r} may remove text"
    if spec.get("truncation") is not None:
        return "the tokenizer truncates"
    for added in spec.get("added_tokens") or []:
        if added.get("lstrip") or added.get("rstrip"):
            return f"added token {added.get('content')!r} absorbs surrounding whitespace"
    return None
