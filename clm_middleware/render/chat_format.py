"""Append-only, token-level rendering of a tokenizer's chat template.

Prefix reuse pays only if the prompt of turn t+1 starts with the exact token ids of
turn t. Re-rendering the whole chat as text and re-tokenizing does not guarantee
that (BPE merges across message boundaries; a generated reply may not re-tokenize
to the ids that were generated). So the template is rendered once with sentinel
contents to learn its fixed "glue" per role::

    preamble | header(role) + content ids + footer(role) | ... | generation prompt

and a prompt is built by concatenating token ids: the glue is tokenized once, each
content is tokenized once, and an assistant reply keeps the ids the model generated.
``ChatFormat`` refuses (``ChatTemplateError``) a template that is not append-only.

Content is text, never control: ``encode`` (message content from users, tools,
transcripts, and replies that are given rather than generated) tokenizes with the
tokenizer's special tokens split, so ``<|im_end|><|im_start|>system`` in a message is
the characters, not a closed turn and a forged system turn. Only the template's own
glue (headers, footers, preamble, generation prompt) carries control ids. A tokenizer
that ignores ``split_special_tokens`` is caught (``control_ids`` in the result) and
each special-token string is then encoded in two halves, which no vocabulary maps
back to the control token.

Content is encoded by a copy of the tokenizer that splits special tokens for good
(``content_tokenizer``), glue by the tokenizer itself, which never splits them: a fast
tokenizer's per-call ``split_special_tokens`` sets a flag on its one Rust tokenizer and
then encodes, two steps that threads interleave (clm serve: a conversation created while
another turn encoded content got ``<|im_end|>`` as seven text tokens in its glue).
"""

from __future__ import annotations

import copy
import threading
import weakref
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import regex

from clm_middleware.errors import ChatTemplateError

ROLES = ("system", "user", "assistant", "tool")
# a free-form role (LangChain's ChatMessage), as OpenAI and LangChain spell the roles a template knows
ROLE_SPELLINGS = {
    "system": "system",
    "developer": "system",
    "user": "user",
    "human": "user",
    "assistant": "assistant",
    "ai": "assistant",
    "tool": "tool",
    "function": "tool",  # OpenAI's legacy name for a tool result
}


def longest_token_chars(tokenizer: Any) -> int:
    """The most characters one token of ``tokenizer`` stands for (its longest vocabulary
    entry, special tokens included; a byte-level entry has one character per byte, at
    least as many as the text's): a text of N characters needs at least N / this many
    tokens, known without tokenizing it. 0 when the vocabulary cannot be read. Reads
    the whole vocabulary (~20 ms for 49k entries): keep the answer (an engine's ``memo``)."""
    try:
        return max(len(token) for token in tokenizer.convert_ids_to_tokens(list(range(len(tokenizer)))) if token)
    except (AttributeError, TypeError, ValueError):
        return 0


def canonical_role(role: object) -> str | None:
    """The template role (``ROLES``) that ``role`` spells, in any case and with spaces
    around it ("User", "developer", "human", "function"); ``None`` when it spells none.
    Every entry point reads roles through it: a transcript, ``Conversation.add``, LangChain."""
    return ROLE_SPELLINGS.get(role.strip().lower()) if isinstance(role, str) else None


def lone_surrogate(text: str) -> str | None:
    """The first lone surrogate in ``text`` (a broken ``\\ud800`` JSON escape), which no
    tokenizer can encode; ``None`` when ``text`` is Unicode text."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as error:
        return text[error.start]
    return None


_SPACE_MARKERS = frozenset({"Ġ", "▁", "Ċ", " ", "\n"})
_LEADING_SPACE = frozenset({"Ġ", "▁", " "})
_SENTINEL = "\u2063CLM-CONTENT-\u2064"
_ANCHOR = "\u2063CLM-ANCHOR-\u2064"


@dataclass(frozen=True, slots=True)
class RoleGlue:
    header_ids: tuple[int, ...]
    footer_ids: tuple[int, ...]


@dataclass(slots=True)
class ChatFormat:
    """Token glue of one tokenizer's chat template; see the module docstring."""

    tokenizer: Any
    preamble_ids: tuple[int, ...] = ()
    generation_prompt_ids: tuple[int, ...] = ()
    glue: dict[str, RoleGlue] = field(default_factory=dict)
    control_ids: frozenset[int] = frozenset()  # special tokens: only the glue may hold them
    _leading_space: dict[int, bool] = field(default_factory=dict, repr=False, compare=False)
    _separators: dict[tuple[str, str], list[int]] = field(default_factory=dict, repr=False, compare=False)
    _runs: dict[tuple[int, str, tuple[int, ...]], list[int] | None] = field(
        default_factory=dict, repr=False, compare=False
    )
    _whitespace: dict[int, bool] = field(default_factory=dict, repr=False, compare=False)
    # the tokenizer content is encoded with (module docstring)
    content_tokenizer: Any = field(default=None, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.content_tokenizer is None:
            self.content_tokenizer = content_tokenizer(self.tokenizer)

    @classmethod
    def from_tokenizer(cls, tokenizer: Any) -> ChatFormat:
        if getattr(tokenizer, "chat_template", None) is None:
            raise ChatTemplateError(
                "the tokenizer has no chat template",
                hint="use an instruction-tuned model, or set tokenizer.chat_template",
            )
        render = _renderer(tokenizer)
        anchor = [{"role": "system", "content": _ANCHOR}]
        base = render(anchor)
        glue: dict[str, RoleGlue] = {}
        system_text = render([{"role": "system", "content": _SENTINEL}])
        glue["system"] = _split_glue(tokenizer, system_text, "system")
        for role in ("user", "assistant", "tool"):
            try:
                text = render([*anchor, {"role": role, "content": _SENTINEL}])
            except Exception:  # templates may reject a role (e.g. no tool turns)
                continue
            if not text.startswith(base):
                raise ChatTemplateError(
                    f"the chat template re-renders earlier messages when a {role} message "
                    "is added, so prompts cannot be built append-only"
                )
            glue[role] = _split_glue(tokenizer, text[len(base) :], role)
        if "user" not in glue or "assistant" not in glue:
            raise ChatTemplateError("the chat template must render user and assistant turns")
        # Text the template puts before the first message when there is no system
        # message (SmolLM2 adds a default system prompt there).
        user_first = render([{"role": "user", "content": _SENTINEL}])
        header_text = tokenizer.decode(list(glue["user"].header_ids))
        cut = user_first.find(header_text + _SENTINEL)
        preamble = user_first[:cut] if cut > 0 else ""
        generation = render(anchor, add_generation_prompt=True)
        return cls(
            tokenizer=tokenizer,
            preamble_ids=tuple(_encode(tokenizer, preamble)),
            generation_prompt_ids=tuple(_encode(tokenizer, generation[len(base) :])),
            glue=glue,
            control_ids=special_token_ids(tokenizer),
        )

    def encode(self, text: str) -> list[int]:
        """Token ids of content ``text``: no special token added, none parsed (see the module docstring)."""
        if not text:
            return []
        ids = list(self.content_tokenizer.encode(text, add_special_tokens=False, split_special_tokens=True))
        if self.control_ids.isdisjoint(ids):
            return ids
        return self._encode_halving_specials(text)

    def shown(self, text: str) -> str:
        """``text`` as a context's decoded ids show it (a tokenizer's decode may not give
        back every space it was given)."""
        return self.tokenizer.decode(self.encode(text))

    def encode_after_space(self, text: str) -> list[int]:
        """Ids of ``text`` as it reads after a space inside one message: ``" " + text``
        when the tokenizer merges that space into the first word (``ĠI``, as the whole
        message would tokenize), else ``encode(text)`` (the space stays the renderer's
        own token, e.g. before a digit, or the tokenizer already marks a word start)."""
        plain = self.encode(text)
        joined = self.encode(" " + text)
        if joined and len(joined) <= len(plain) and self.leads_with_space(joined):
            return joined
        return plain

    def separator_ids(self, separator: str, *, after: str = "a") -> list[int]:
        """A separator's ids as they are inside the text it joins, before ``after`` (the
        start of what follows): a GPT-2-style pre-tokenizer splits ``\n\n`` before a word
        into two ``Ċ``, not the one ``ĊĊ`` it reads alone, and merges it with a newline
        that follows (``ĊĊ`` ``Ċ`` before ``\nYou``); ``" a"``: before a word that carries
        its own space (``Ġ-``). The ids are the caller's to read, never to change."""
        cached = self._separators.get((separator, after))
        if cached is None:
            word = self.encode(after)
            joined = self.encode(separator + after)
            inside = joined[: len(joined) - len(word)]
            cached = inside if inside and joined[len(inside) :] == word else self.encode(separator)
            self._separators[(separator, after)] = cached
        return cached

    def whitespace_run_ids(self, previous_id: int, run: str, following: Sequence[int]) -> list[int] | None:
        """The ids of ``previous_id``'s text then ``run`` (whitespace), as one string
        tokenizes them before the ids ``following`` (empty: the text ends there), where
        they differ from ``previous_id`` then ``run``'s own ids: a header's closing newline
        and a message's leading whitespace are one run in the template's text (SmolLM2:
        ``Ċ`` + ``ĠĠĠ`` reads ``ĊĠĠĠ`` before `` def``). Of ``following``, the fewest ids
        that decode to whole characters are read (a Cyrillic or CJK letter spans several
        byte tokens). None where nothing merges: a special or non-whitespace
        ``previous_id``, an empty run, or a tokenizer that does not end the joined text
        with those ids. The ids are the caller's to read."""
        head = _whole_characters(self.tokenizer, following)
        if head is None:
            return None
        key = (previous_id, run, tuple(head))
        if key in self._runs:
            return self._runs[key]
        before = "" if previous_id in self.control_ids else self.tokenizer.decode([previous_id])
        merged = None
        if run and before and before.isspace():
            joined = self.encode(before + run + (self.tokenizer.decode(head) if head else ""))
            inside = joined[: len(joined) - len(head)]
            if joined[len(inside) :] == head and self.tokenizer.decode(inside) == before + run:
                merged = inside if inside != [previous_id, *self.encode(run)] else None
        if len(self._runs) >= _RUNS_KEPT:  # keyed by what clients send: bounded
            self._runs.clear()
        self._runs[key] = merged
        return merged

    def leads_with_space(self, token_ids: Sequence[int]) -> bool:
        """Whether the first token carries a space before its text (``Ġ`` / ``▁``):
        such ids need no separating space before them."""
        if not token_ids:
            return False
        cached = self._leading_space.get(token_ids[0])
        if cached is None:
            piece = self.tokenizer.convert_ids_to_tokens(token_ids[0]) or ""
            cached = self._leading_space[token_ids[0]] = len(piece) > 1 and piece[0] in _LEADING_SPACE
        return cached

    def _encode_halving_specials(self, text: str) -> list[int]:
        specials = sorted((self.tokenizer.convert_ids_to_tokens(i) for i in self.control_ids), key=len, reverse=True)
        pattern = regex.compile("(" + "|".join(regex.escape(s) for s in specials if s) + ")")
        ids: list[int] = []
        for index, piece in enumerate(pattern.split(text)):
            if not piece:
                continue
            if index % 2:  # a special-token string: two halves, each plain text
                ids += _encode(self.tokenizer, piece[:1]) + _encode(self.tokenizer, piece[1:])
            else:
                ids += _encode(self.tokenizer, piece)
        return ids

    def word_initial(self, token_ids: Sequence[int]) -> list[bool]:
        """Which tokens begin a word: the first, any that starts with a space marker
        (``Ġ`` / ``▁`` / newline), and the first after a bare space marker (digits).

        Scoring only these is how the lifecycle layer reads self-information cheaply:
        the rest of a word is mostly predictable from its first token. A tokenizer
        without space markers marks every token.
        """
        tokens = self.tokenizer.convert_ids_to_tokens(list(token_ids))
        if not any(t and t[0] in _SPACE_MARKERS for t in tokens):
            return [True] * len(tokens)
        flags = []
        for index, token in enumerate(tokens):
            previous = tokens[index - 1] if index else ""
            flags.append(index == 0 or (bool(token) and token[0] in _SPACE_MARKERS) or previous in _SPACE_MARKERS)
        return flags

    def supports_role(self, role: str) -> bool:
        return role in self.glue

    def message_ids(self, role: str, content_ids: Sequence[int]) -> list[int]:
        """``header(role) + content + footer(role)``."""
        try:
            glue = self.glue[role]
        except KeyError:
            raise ChatTemplateError(
                f"the chat template cannot render a {role!r} message",
                hint=f"roles it renders: {sorted(self.glue)}",
            ) from None
        header, content = list(glue.header_ids), list(content_ids)
        # leading whitespace joins the header's closing newline, as in the template's text
        lead = next((i for i, token in enumerate(content) if not self._is_whitespace(token)), len(content))
        if header and lead:
            run = self.tokenizer.decode(content[:lead])
            merged = self.whitespace_run_ids(header[-1], run, content[lead : lead + FOLLOWING_READ])
            if merged is not None:
                header, content = header[:-1], [*merged, *content[lead:]]
        return [*header, *content, *glue.footer_ids]

    def _is_whitespace(self, token_id: int) -> bool:
        cached = self._whitespace.get(token_id)
        if cached is None:
            text = "" if token_id in self.control_ids else self.tokenizer.decode([token_id])
            cached = self._whitespace[token_id] = bool(text) and text.isspace()
        return cached

    def header_ids(self, role: str) -> list[int]:
        """What opens a ``role`` message, before its content (SmolLM2's user: ``<|im_start|>user\\n``)."""
        return list(self.glue[role].header_ids) if role in self.glue else []

    def start_ids(self, first_role: str | None) -> list[int]:
        """What precedes the first message: the template's default preamble unless it is a system message."""
        return [] if first_role == "system" else list(self.preamble_ids)

    def render(self, messages: Sequence[tuple[str, Sequence[int]]], *, add_generation_prompt: bool = True) -> list[int]:
        """Prompt ids for ``(role, content ids)`` pairs, in order."""
        ids = self.start_ids(messages[0][0] if messages else None)
        for role, content_ids in messages:
            ids.extend(self.message_ids(role, content_ids))
        if add_generation_prompt:
            ids.extend(self.generation_prompt_ids)
        return ids


_RUNS_KEPT = 4096  # whitespace runs whose merged ids ChatFormat keeps
FOLLOWING_READ = 4  # ids after a run, enough to end inside no character (UTF-8: 4 bytes at most)


def _whole_characters(tokenizer: Any, ids: Sequence[int]) -> list[int] | None:
    """The fewest of ``ids`` (none for none) that decode without a split character; None
    if even all of them end inside one."""
    for count in range(1 if ids else 0, min(len(ids), FOLLOWING_READ) + 1):
        if "\ufffd" not in tokenizer.decode(list(ids[:count])):
            return list(ids[:count])
    return None


def _renderer(tokenizer: Any):
    def render(messages: list[dict[str, str]], add_generation_prompt: bool = False) -> str:
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)

    return render


def _split_glue(tokenizer: Any, text: str, role: str) -> RoleGlue:
    if text.count(_SENTINEL) != 1:
        raise ChatTemplateError(f"the chat template does not render a {role} message's content once")
    header, footer = text.split(_SENTINEL)
    return RoleGlue(tuple(_encode(tokenizer, header)), tuple(_encode(tokenizer, footer)))


_CONTENT_TOKENIZERS: weakref.WeakKeyDictionary[Any, Any] = weakref.WeakKeyDictionary()
_CONTENT_LOCK = threading.Lock()


def content_tokenizer(tokenizer: Any) -> Any:
    """One copy per tokenizer (while it lives) whose ``split_special_tokens`` is always
    set: content encoded through it never changes the flag the tokenizer itself is read
    with (module docstring). Every encode with ``split_special_tokens=True`` goes here."""
    with _CONTENT_LOCK:
        content = _CONTENT_TOKENIZERS.get(tokenizer)
        if content is None or len(content) != len(tokenizer):  # tokens added since: copied again
            content = copy.deepcopy(tokenizer)
            content.split_special_tokens = True
            _CONTENT_TOKENIZERS[tokenizer] = content
        return content


def _encode(tokenizer: Any, text: str) -> list[int]:
    """Template glue: special tokens in ``text`` are parsed (the template's own)."""
    if not text:
        return []
    return list(tokenizer.encode(text, add_special_tokens=False))


def special_token_ids(tokenizer: Any) -> frozenset[int]:
    """Every special token's id: ``all_special_ids`` and the added tokens marked special
    (transformers 5 lists only BOS/EOS/UNK in the first; SmolLM2's ``<file_sep>`` and
    the rest are in the second)."""
    ids = set(getattr(tokenizer, "all_special_ids", None) or ())
    for token_id, added in (getattr(tokenizer, "added_tokens_decoder", None) or {}).items():
        if getattr(added, "special", False):
            ids.add(int(token_id))
    return frozenset(ids)
