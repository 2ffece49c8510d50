"""Token ids from the bytes they stand for: the ids a llama.cpp stream withholds, put back.

llama.cpp's server (0.3.x) holds back a generated token that ends inside a UTF-8
character and sends it with the token that completes the character: one event whose
text is the whole character but whose ``logprobs.content[]`` (and ``tokens``) name only
the last token, while ``timings.predicted_n`` counts both. Read as they come, the ids
decode to U+FFFD, the reply is undercounted, and the text the client sends back is
broken. The ids left out are found from the bytes: the event's text less the named
tokens' bytes, split into as many vocabulary tokens as are missing.

Byte-level BPE vocabularies (GPT-2, Llama 3, Qwen, SmolLM) and SentencePiece byte
fallback (``<0xE3>``) say which bytes each token stands for; for any other vocabulary,
or bytes no split into that many tokens fits, ``withheld`` is ``None`` and the caller
re-tokenizes the text (right text; the ids may differ from the server's).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from functools import cache
from typing import Any


class TokenBytes:
    """Each vocabulary token's bytes, and back. Invariant: ``ids_of`` maps a byte string
    to one id that stands for exactly it (the lowest where several do)."""

    def __init__(self, tokenizer: Any) -> None:
        self._bytes_of: dict[int, bytes] = {}
        self.ids_of: dict[bytes, int] = {}
        decode = _decoder_for(tokenizer)
        if decode is None:
            return
        for token, token_id in tokenizer.get_vocab().items():
            data = decode(token)
            if data:
                self._bytes_of[token_id] = data
                self.ids_of.setdefault(data, token_id)
                if self.ids_of[data] > token_id:
                    self.ids_of[data] = token_id
        self._longest = max(map(len, self.ids_of), default=0)

    def withheld(self, text: str, named: Sequence[int], missing: int) -> list[int] | None:
        """The ``missing`` ids that come before ``named`` in an event whose text is
        ``text``, or ``None`` where the bytes say nothing certain."""
        if missing < 1 or not self.ids_of:
            return None
        data = text.encode("utf-8")
        tail = b"".join(self._bytes_of.get(token, b"") for token in named)
        if not data.endswith(tail) or len(data) == len(tail):
            return None
        return self._split(data[: len(data) - len(tail)], missing)

    def _split(self, data: bytes, parts: int) -> list[int] | None:
        """``data`` as exactly ``parts`` vocabulary tokens, longest first token first."""
        if parts == 1:
            token = self.ids_of.get(data)
            return None if token is None else [token]
        for size in range(min(self._longest, len(data) - parts + 1), 0, -1):
            head = self.ids_of.get(data[:size])
            if head is not None and (rest := self._split(data[size:], parts - 1)) is not None:
                return [head, *rest]
        return None


def _decoder_for(tokenizer: Any) -> Any:
    """``token string -> bytes`` for the tokenizer's vocabulary kind, or None."""
    kinds = _decoder_kinds(tokenizer)
    if "ByteLevel" in kinds:
        table = _byte_level_table()
        return lambda token: bytes(table[c] for c in token) if all(c in table for c in token) else None
    if "ByteFallback" in kinds:
        return _sentencepiece_bytes
    return None


def _decoder_kinds(tokenizer: Any) -> set[str]:
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return set()
    try:
        decoder = json.loads(backend.to_str()).get("decoder")
    except (ValueError, AttributeError):
        return set()
    kinds: set[str] = set()
    stack = [decoder]
    while stack:
        item = stack.pop()
        if isinstance(item, dict):
            if isinstance(item.get("type"), str):
                kinds.add(item["type"])
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)
    return kinds


def _sentencepiece_bytes(token: str) -> bytes | None:
    if len(token) == 6 and token.startswith("<0x") and token.endswith(">"):
        try:
            return bytes([int(token[3:5], 16)])
        except ValueError:
            return None
    if token.startswith("<") and token.endswith(">"):  # <s>, </s>, <unk>: no text
        return None
    return token.replace("\u2581", " ").encode("utf-8")


@cache
def _byte_level_table() -> dict[str, int]:
    """GPT-2's printable stand-in for each byte, inverted."""
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    return {char: byte for byte, char in bytes_to_unicode().items()}
