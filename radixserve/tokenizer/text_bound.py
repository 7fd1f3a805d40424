"""A lower bound on the tokens a text needs, from its UTF-8 size, to refuse a too-long text before tokenizing.

One token covers at most `bytes_per_token` bytes, the largest UTF-8 size of a vocabulary piece (byte-level
BPE writes a byte as a 1-2 byte character; SentencePiece "▁" a space, `<0xNN>` a byte). Bytes a byte-level
BPE without an unknown token drops are not counted. None when the normalizer or pre-tokenizer may delete
or compose characters, or one token may stand for text of any length (WordPiece, fused unknowns)."""
from __future__ import annotations

import json
import logging
import math
from dataclasses import dataclass
from typing import Any

logger = logging.getLogger(__name__)

# Components that never shorten the text they pass on (Split and Replace checked further below).
_SAFE_TYPES = {"ByteLevel", "Metaspace", "Prepend", "Digits", "Punctuation", "Split", "Replace",
               "Sequence", "UnicodeScripts"}


@dataclass(frozen=True)
class TextBound:
    """bytes_per_token: the largest UTF-8 size of a vocabulary piece; dropped: byte values not counted."""

    bytes_per_token: int
    dropped: bytes = b""

    @classmethod
    def of(cls, hf: Any) -> TextBound | None:
        """The bound of `hf` (a transformers fast tokenizer), or None when it has no sound one."""
        backend = getattr(hf, "backend_tokenizer", None)
        if backend is None:
            return None
        try:
            spec = json.loads(backend.to_str())
        except (ValueError, RuntimeError, AttributeError) as exc:
            logger.warning("tokenizer not inspectable (%s); no bytes bound on prompt length", exc)
            return None
        model = spec.get("model") or {}
        if not _bounded_model(model):
            logger.info("a %s token may cover any length of text; no bytes bound", model.get("type"))
            return None
        for part in ("normalizer", "pre_tokenizer"):
            if not _never_shortens(spec.get(part)):
                logger.info("tokenizer %s %s may shorten text; no bytes bound on prompt length",
                            part, (spec.get(part) or {}).get("type"))
                return None
        vocab = hf.get_vocab()
        if not vocab:
            return None
        per_token = max(len(piece.encode("utf-8", "surrogatepass")) for piece in vocab)
        dropped = b""
        if _is_byte_level(spec.get("pre_tokenizer")) and not model.get("unk_token"):
            dropped = bytes(b for b, char in _byte_level_chars().items() if char not in vocab)
        return cls(per_token, dropped)

    def min_tokens(self, text: str) -> int:
        """The fewest tokens `text` can take."""
        data = text.encode("utf-8", "surrogatepass")   # JSON allows lone surrogates: 3 bytes each
        if self.dropped:
            data = data.translate(None, self.dropped)
        return math.ceil(len(data) / self.bytes_per_token)


def _bounded_model(model: dict) -> bool:
    kind = model.get("type")
    if kind == "BPE":
        return not model.get("fuse_unk")
    if kind == "Unigram":
        return bool(model.get("byte_fallback"))
    return False


def _never_shortens(component: dict | None) -> bool:
    if component is None:
        return True
    kind = component.get("type")
    if kind not in _SAFE_TYPES:
        return False
    if kind == "Sequence":
        parts = component.get("normalizers") or component.get("pretokenizers") or []
        return all(_never_shortens(p) for p in parts)
    if kind == "Split":
        return str(component.get("behavior", "")).lower() != "removed"
    if kind == "Replace":
        return bool(component.get("content"))
    return True


def _is_byte_level(component: dict | None) -> bool:
    if component is None:
        return False
    if component.get("type") == "Sequence":
        return any(_is_byte_level(p) for p in component.get("pretokenizers") or [])
    return component.get("type") == "ByteLevel"


def _byte_level_chars() -> dict[int, str]:
    """Byte value -> its byte-level BPE character (GPT-2's bytes_to_unicode)."""
    printable = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    chars = {b: chr(b) for b in printable}
    others = [b for b in range(256) if b not in chars]
    chars.update({b: chr(256 + i) for i, b in enumerate(others)})
    return chars
