"""JSON grammars for one tokenizer, compiled by xgrammar, and the per-reply constraint.

Why xgrammar: it compiles JSON Schema (and plain JSON) into a pushdown automaton over
the tokenizer's vocabulary and gives, per step, a bitmask of the tokens that keep the
text a prefix of a valid document, in C++ (under 1 ms a token with the masking, for
SmolLM2's 49k vocabulary: about 1% of a decode step, see docs/lifecycle.md). It is the structured-output backend
of vLLM, SGLang and TensorRT-LLM, reads any Hugging Face tokenizer (byte-level BPE,
SentencePiece, tiktoken), and lets a stop token through only once the document is
complete. lm-format-enforcer (pure Python, a walk over a token trie per step) does not
import under transformers 5; outlines' JSON mode is a depth-limited regex.

Layout choice: ``any_whitespace=False``, so a reply is laid out as ``json.dumps``
writes it (``{"a": 1, "b": [2, 3]}``). A small model left free to place whitespace
writes newlines and indentation forever; a fixed layout still parses with any JSON
parser. With a schema, ``strict_mode=True``: properties the schema does not name are
not generated (a narrower set of documents, each still valid against the schema).
"""

from __future__ import annotations

import collections
import json
import re
import threading
from collections.abc import Sequence
from typing import Any

import torch
import xgrammar

from clm_middleware.errors import ConfigError
from clm_middleware.structured.array_watch import ARRAY_CLOSERS
from clm_middleware.structured.constraint import GrammarConstraint
from clm_middleware.structured.format import ResponseFormat
from clm_middleware.structured.keywords import for_grammar

ANY_OBJECT_SCHEMA = {"type": "object"}  # with strict_mode=False: any keys, any JSON values
MEMO_KEY = "structured.grammar_compiler"  # its slot in Engine.memo
INFO_KEY = "structured.tokenizer_info"  # the engine's vocabulary as xgrammar reads it, in Engine.memo
COMPILED_KEPT = 256  # compiled grammars an engine's compiler keeps (a few MB each at most)
_NUMBER_BYTES = frozenset(b"0123456789.eE+-")  # what a JSON number literal is written with
_CPP_PREFIX = re.compile(r"^\[[\d:]+\] \S+:\d+: ")  # xgrammar's "[15:54:05] /project/cpp/x.cc:42: "


class GrammarCompiler:
    """Compiles ``ResponseFormat``s for one tokenizer and hands out per-reply constraints.

    Thread-safe: xgrammar's compiler caches compiled grammars and may be called from
    several threads; each ``constraint`` owns its own matcher (the per-reply state).

    ``banned_ids``, never generated under a grammar:
    - special tokens other than the stop ids: ``<|im_start|>`` decodes to printable
      text, so the grammar alone would let it into a JSON string;
    - the model's padding rows beyond the tokenizer's vocabulary;
    - tokens holding a control character (bytes 0x00-0x1F): in the compact layout no
      document contains one (JSON escapes them inside strings), yet xgrammar 0.2.9's
      rule for a string with ``maxLength`` admits them raw (``[^"\\\r\n]``), which
      ``json.loads`` rejects. Banning them keeps every document strict JSON.
    """

    def __init__(
        self, tokenizer: Any, vocab_size: int, stop_ids: frozenset[int], info: xgrammar.TokenizerInfo | None = None
    ) -> None:
        check_vocabulary(tokenizer, stop_ids)
        self.vocab_size = vocab_size
        self.stop_ids = stop_ids
        info = info or xgrammar.TokenizerInfo.from_huggingface(
            tokenizer, vocab_size=vocab_size, stop_token_ids=sorted(stop_ids)
        )
        # xgrammar's own cache is unbounded by default: the LRU below is the only one kept
        self._compiler = xgrammar.GrammarCompiler(info, cache_enabled=False)
        special = {int(t) for t in getattr(tokenizer, "all_special_ids", ()) or ()}
        padding = set(range(len(tokenizer), vocab_size))
        vocab = info.decoded_vocab
        control = {i for i, text in enumerate(vocab) if any(byte < 0x20 for byte in text)}
        # tokens that can end a string: a '"' not escaped within the token (close_string)
        self.quote_ids = torch.tensor([i for i, text in enumerate(vocab) if _closes(text)], dtype=torch.long)
        # tokens that can follow a number without going on with it (close_number)
        self.number_end_ids = torch.tensor(
            [i for i, text in enumerate(vocab) if text and text[0] not in _NUMBER_BYTES], dtype=torch.long
        )
        # per closer of an open item ('"', "}", "]", or "" for none), the tokens that close
        # the item and its array, or the item alone (close_array)
        self.array_end_ids = {
            closer: torch.tensor([i for i, text in enumerate(vocab) if _ends_array(text, closer)], dtype=torch.long)
            for closer in ARRAY_CLOSERS
        }
        banned = sorted((special | padding | control) - set(stop_ids))
        self.banned_ids = torch.tensor([t for t in banned if 0 <= t < vocab_size], dtype=torch.long)
        self._lock = threading.Lock()
        # the formats compiled last, least recently used first: a server whose requests
        # bring ever new schemas holds at most COMPILED_KEPT of them
        self._compiled: collections.OrderedDict[ResponseFormat, xgrammar.CompiledGrammar] = collections.OrderedDict()

    def compile(
        self, fmt: ResponseFormat, *, field: str = "response_format.json_schema.schema"
    ) -> xgrammar.CompiledGrammar:
        """The grammar of ``fmt``; a ``ConfigError`` naming ``field`` for a schema xgrammar rejects."""
        key = _unnamed(fmt)  # the name does not change the grammar
        with self._lock:
            cached = self._compiled.get(key)
            if cached is not None:
                self._compiled.move_to_end(key)
                return cached
        try:
            grammar = _grammar(fmt)
            for call in fmt.calls:  # a tool call instead of the document
                grammar = xgrammar.Grammar.union(grammar, _grammar(call))
            compiled = self._compiler.compile_grammar(grammar)
        except (RuntimeError, ValueError) as error:
            problem = _CPP_PREFIX.sub("", str(error).strip().splitlines()[0] if str(error).strip() else "")
            raise ConfigError(field, f"cannot be used as a grammar: {problem}") from None
        with self._lock:
            kept = self._compiled.setdefault(key, compiled)  # two first users: one grammar wins
            self._compiled.move_to_end(key)
            while len(self._compiled) > COMPILED_KEPT:
                self._compiled.popitem(last=False)
            return kept

    def constraint(self, fmt: ResponseFormat, prefix_ids: Sequence[int] = ()) -> GrammarConstraint:
        """A fresh constraint for one reply that starts with ``prefix_ids`` (a forced
        ``reply_prefix`` such as ``{``): those are fed to the grammar first."""
        compiled = self.compile(fmt)
        return GrammarConstraint(
            compiled,
            self.vocab_size,
            self.banned_ids,
            list(prefix_ids),
            self.quote_ids,
            self.number_end_ids,
            self.array_end_ids,
        )


def _unnamed(fmt: ResponseFormat) -> ResponseFormat:
    """``fmt`` without the names that never change a grammar (the cache's key)."""
    return ResponseFormat(fmt.schema_json, tags=fmt.tags, calls=tuple(_unnamed(c) for c in fmt.calls))


def _grammar(fmt: ResponseFormat) -> xgrammar.Grammar:
    """The document of ``fmt`` (any JSON object without a schema), between its tags if it has them."""
    schema = ANY_OBJECT_SCHEMA if fmt.schema is None else for_grammar(fmt.schema)
    document = _document_grammar(schema, strict=fmt.schema is not None)
    if fmt.tags is None:
        return document
    before, after = (xgrammar.Grammar.from_ebnf(f"root ::= {json.dumps(tag)}") for tag in fmt.tags)
    return xgrammar.Grammar.concat(before, document, after)


def _document_grammar(schema: dict[str, Any], *, strict: bool) -> xgrammar.Grammar:
    """The grammar of documents valid against ``schema``, strict where it can be.

    Strict mode (no property the schema does not list) refuses some valid schemas: an
    array with ``minItems`` and no ``items``, an object with ``minProperties`` and no
    ``properties`` ("additional items are not allowed"). Those compile without it: the
    documents are then the schema's own, unlisted properties included."""
    text = json.dumps(schema)
    try:
        return xgrammar.Grammar.from_json_schema(text, any_whitespace=False, strict_mode=strict)
    except (RuntimeError, ValueError):
        if not strict:
            raise
    return xgrammar.Grammar.from_json_schema(text, any_whitespace=False, strict_mode=False)


def _ends_array(text: bytes, closer: str) -> bool:
    """Whether ``text`` is ``closer`` then (whitespace and) the array's ``]``, or exactly
    ``closer`` (the ``]`` then comes next)."""
    opening = closer.encode()
    if closer and text == opening:
        return True
    return text.startswith(opening) and text[len(opening) :].lstrip().startswith(b"]")


def _closes(text: bytes) -> bool:
    """Whether ``text`` holds a ``"`` not preceded by a backslash inside it."""
    at = text.find(b'"')
    while at >= 0:
        if at == 0 or text[at - 1] != 0x5C:
            return True
        at = text.find(b'"', at + 1)
    return False


def check_vocabulary(tokenizer: Any, stop_ids: frozenset[int]) -> None:
    """``ConfigError`` where a grammar cannot be run: no tokenizer, or no stop token."""
    if tokenizer is None:
        raise ConfigError("response_format", "structured output needs an engine created with a tokenizer")
    if not stop_ids:
        raise ConfigError("response_format", "structured output needs a stop token (the model has no EOS id)")


def tokenizer_info(engine: Any) -> xgrammar.TokenizerInfo:
    """The engine's vocabulary as xgrammar reads it (``decoded_vocab``: each token's
    bytes, for any tokenizer kind), built on first use (~0.4 s for a 49k vocabulary) and
    kept in ``engine.memo``."""
    info = engine.memo.get(INFO_KEY)
    if info is None:
        check_vocabulary(engine.tokenizer, engine.default_stop_ids)
        built = xgrammar.TokenizerInfo.from_huggingface(
            engine.tokenizer, vocab_size=engine.vocab_size, stop_token_ids=sorted(engine.default_stop_ids)
        )
        info = engine.memo.setdefault(INFO_KEY, built)  # two first users: one wins
    return info


def compiler_for(engine: Any) -> GrammarCompiler:
    """The engine's compiler, built on first use and kept in ``engine.memo``: per engine,
    shared by its conversations, never global."""
    compiler = engine.memo.get(MEMO_KEY)
    if compiler is None:
        info = tokenizer_info(engine)
        built = GrammarCompiler(engine.tokenizer, engine.vocab_size, engine.default_stop_ids, info)
        compiler = engine.memo.setdefault(MEMO_KEY, built)  # two first users: one compiler wins
    return compiler
