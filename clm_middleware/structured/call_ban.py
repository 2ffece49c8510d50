"""A reply that cannot open a tool call: for a reply to a tool's result that may make no
call (``tool_choice="none"``, or no tools offered to it; ``chat_call.answers_a_result``).

A small model given a tool's result often copies the call it sees before it
(``<tool_call>{"name": "get_weather", ...``) instead of answering from the result, and
that text reaches the user. Banning only the opener's text lets it write a look-alike:
the copy is decided at its first character, and SmolLM2 went on with ``<tool-call>`` or
``<system_call>`` where ``<tool_call>`` or ``<tool`` was banned. So the ban is on that
first character: no line of the reply has ``<`` as its first non-blank character (the
reply's start counts as a line start), and the opener's head ``<tool`` is written
nowhere. Given the same three histories, SmolLM2 then answered from the result ("The
weather in Oslo is quite cold, with a temperature of -3°C.").

Invariants:
- ``CallOpeningBan(generated_ids, logits) -> logits``: ``-inf`` on every token after
  which the reply would break the rule; it reads only the ids it is given and keeps no
  state, so concurrent replies can share one.
- It never leaves every logit ``-inf``: where every remaining token is banned, the
  logits pass unchanged (as ``NoRepeatNgram``'s ban yields).
- It never writes into the tensor it is given (the engine reads log-probs from it).
- Token texts are the vocabulary's bytes as xgrammar decodes them (any tokenizer kind);
  the ban sets are built once per engine (``call_ban_for``) and kept in ``engine.memo``.
  Special tokens and the stop ids are never banned (``<|im_end|>`` ends a reply).

A remote engine samples on its server, where no processor runs: there the same tokens
are banned for the whole reply by OpenAI's ``logit_bias`` (``everywhere``), so no ``<``
opens a tag within a line either (SmolLM2: 7 tokens, ``<``, `` <``, ``</``, ``<<``...).
The ban is asked for only where the copy happens, right after a tool's result: a later
reply (an HTML page asked for) starts its lines with ``<`` freely.
"""

from __future__ import annotations

import re
from typing import Any

import torch

from clm_middleware.engine.penalties import MAX_LOGIT_BIAS
from clm_middleware.render.chat_format import special_token_ids
from clm_middleware.render.tool_calls import OPEN
from clm_middleware.structured.grammar import tokenizer_info

MEMO_KEY = "structured.call_ban"  # its slot in Engine.memo
HEAD = OPEN[: len("<tool")].encode()  # written nowhere: the opener is recognisable from here
_BLANK = b" \t"
_AT_LINE_START = re.compile(rb"[ \t]*<")  # a token whose text starts a line with '<'
_INSIDE = re.compile(rb"\n[ \t]*<")  # a token that starts a later line with '<'


class CallOpeningBan:
    """``exempt``: ids never banned, whatever their text (special tokens: ``<|im_end|>``
    reads as text starting with ``<``, and a reply must still be able to end)."""

    def __init__(self, token_texts: list[bytes], vocab_size: int, exempt: frozenset[int] = frozenset()) -> None:
        self._texts = token_texts

        def ids(rule) -> torch.Tensor:
            texts = token_texts[:vocab_size]
            return torch.tensor([i for i, text in enumerate(texts) if i not in exempt and rule(text)], dtype=torch.long)

        # the reply's text since its last newline is blank: a '<' next would start the line
        at_line_start = ids(lambda t: _AT_LINE_START.match(t) or _INSIDE.search(t) or HEAD in t)
        within_line = ids(lambda t: _INSIDE.search(t) or HEAD in t)
        # for a server, which samples where no processor runs: OpenAI's ``logit_bias``, -100
        # (a ban) on these for the whole reply; no '<' opens a tag within a line either
        self.everywhere = tuple((int(i), -MAX_LOGIT_BIAS) for i in at_line_start)
        # per length j of the head's start the text ends with: the tokens that complete the head
        completing = [ids(lambda t, j=j: HEAD in HEAD[:j] + t) for j in range(len(HEAD))]
        self._banned = {
            (start, j): torch.unique(torch.cat([at_line_start if start else within_line, completing[j]]))
            for start in (False, True)
            for j in range(len(HEAD))
        }

    def __call__(self, generated: list[int], logits: torch.Tensor) -> torch.Tensor:
        banned = self._banned[self._state(generated)].to(logits.device)
        shaped = logits.index_fill(0, banned, float("-inf"))
        if not bool((shaped > float("-inf")).any()):
            return logits  # banning would leave nothing to choose: the ban yields
        return shaped

    def _state(self, generated: list[int]) -> tuple[bool, int]:
        """(whether the reply's text since its last newline is blank, how many of the
        head's first bytes it ends with)."""
        tail = b""
        at = len(generated)
        # enough of the end to see the head's start and whether the line holds more than blanks
        while at > 0 and (len(tail) < len(HEAD) or (not tail.strip(_BLANK) and b"\n" not in tail)):
            at -= 1
            tail = self._texts[generated[at]] + tail
        line = tail.rsplit(b"\n", 1)[-1]
        start = (at == 0 or b"\n" in tail) and not line.strip(_BLANK)
        ends = next((j for j in range(len(HEAD) - 1, 0, -1) if tail.endswith(HEAD[:j])), 0)
        return start, ends


def call_ban_for(engine: Any) -> CallOpeningBan:
    """The engine's ban, built on first use (a pass over the vocabulary) and kept in
    ``engine.memo``: per engine, never global."""
    ban = engine.memo.get(MEMO_KEY)
    if ban is None:
        texts = list(tokenizer_info(engine).decoded_vocab)
        exempt = special_token_ids(engine.tokenizer) | engine.default_stop_ids
        # a special token that is itself an opener (a vocabulary's own <tool_call>) stays banned
        exempt = frozenset(i for i in exempt if i >= len(texts) or HEAD not in texts[i])
        built = CallOpeningBan(texts, engine.vocab_size, exempt)
        ban = engine.memo.setdefault(MEMO_KEY, built)
    return ban
