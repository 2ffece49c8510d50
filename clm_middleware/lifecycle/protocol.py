"""The ``[LIFECYCLE]`` block: a forgiving parser (``reply_filter.py`` hides it from users).

Parsing rules (DESIGN.md, "The lifecycle protocol"):
- only the model's own output is parsed, never user text;
- the last ``[LIFECYCLE]`` opening in the output starts the block; a missing closing
  tag is tolerated (the block runs to the end of the output);
- a line ``seg_N: label`` (also ``seg N - label``, ``seg_N = LABEL``, bullets) sets a
  label; an id not in the context is ignored; a repeated id takes its last value;
- a block with no line understood is garbage, and the caller falls back.
Nothing here raises on any input.

Look-alikes (``neutralise``): where the model is shown the protocol, untrusted content
(user, tool and transcript text) is rendered with its protocol look-alikes defused, so
text can neither pose as one of the renderer's markers nor put a label next to an id
the model is asked about. Every id the parser would read (``seg_1``, ``Segment 4``, the
``seg 2`` of ``[seg 2]``) is written in fullwidth characters (``ｓｅｇ＿１``), and so are
the brackets of a lifecycle tag (``［LIFECYCLE］``): one character for one, so the
length and a person's reading stay. Changing the letters alone is not enough: SmolLM2
copied ``drop`` after ``_0:`` into the label of ``seg_0`` all the same, so the digits
the label follows change too. The invariant: ``neutralise(t)`` holds nothing
``parse_block``, a marker or a block line would match, and text without look-alikes is
returned unchanged.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

import regex

from clm_middleware.lifecycle.segments import Label, SegmentId

OPEN_TAG = "[LIFECYCLE]"
BLOCK_GRACE_TOKENS = 4  # past the answer cap, whitespace may precede a block for this many tokens
CLOSE_TAG = "[/LIFECYCLE]"
_OPEN = regex.compile(r"\[\s*lifecycle\s*\]", regex.IGNORECASE)
_CLOSE = regex.compile(r"\[\s*/\s*lifecycle\s*\]", regex.IGNORECASE)
# the first letter of an id the parser reads (see _LINE), and the brackets of a tag
_ID_LOOKALIKE = regex.compile(r"seg(?:ment)?[\s_#-]*\d{1,9}", regex.IGNORECASE)
_TAG_LOOKALIKE = regex.compile(r"\[(\s*/?\s*lifecycle\s*)\]", regex.IGNORECASE)
_LINE = regex.compile(
    r"seg(?:ment)?[\s_#-]*(\d{1,9})\s*[:=\-–—>]+\s*[\*\"'`]*\s*(keep|compress|drop)\b",
    regex.IGNORECASE,
)


@dataclass(frozen=True, slots=True)
class ParsedBlock:
    found: bool  # an opening tag was present
    closed: bool
    labels: dict[SegmentId, Label] = field(default_factory=dict)
    ignored: tuple[str, ...] = ()  # ids outside the context, kept for the record

    @property
    def ok(self) -> bool:
        """A parseable block: opened, and at least one label understood."""
        return self.found and bool(self.labels)


def split_reply(output: str) -> tuple[str, str | None]:
    """``(answer, block text or None)``: the answer is everything before the last opening tag."""
    opening = None
    for match in _OPEN.finditer(output):
        opening = match
    if opening is None:
        return output, None
    return output[: opening.start()].rstrip(), output[opening.start() :]


def parse_block(output: str, valid_ids: Iterable[SegmentId]) -> ParsedBlock:
    """Labels from the model output's lifecycle block; see the module docstring."""
    _, block = split_reply(output)
    if block is None:
        return ParsedBlock(found=False, closed=False)
    closing = _CLOSE.search(block)
    body = block[: closing.start()] if closing else block
    valid = set(valid_ids)
    labels: dict[SegmentId, Label] = {}
    ignored: list[str] = []
    for match in _LINE.finditer(body):
        segment = SegmentId(f"seg_{int(match.group(1))}")
        if segment in valid:
            labels[segment] = Label(match.group(2).lower())
        else:
            ignored.append(segment)
    return ParsedBlock(found=True, closed=closing is not None, labels=labels, ignored=tuple(ignored))


def could_open_block(text: str) -> bool:
    """Whether a continuation that starts with ``text`` can still be (or already is) a block."""
    compact = regex.sub(r"\s+", "", text).casefold()
    return "[lifecycle]".startswith(compact) or compact.startswith("[lifecycle]")


def block_may_follow(text: str, extra_tokens: int) -> bool:
    """Whether generation past the answer cap may still be a block: ``text`` is inside a
    block, or at the start of one, or (for at most ``BLOCK_GRACE_TOKENS`` extra tokens)
    in the whitespace a block would follow."""
    if split_reply(text)[1] is not None:
        return True
    bracket = text.rfind("[")
    if bracket >= 0 and could_open_block(text[bracket:]):
        return True
    return extra_tokens < BLOCK_GRACE_TOKENS and (not text.strip() or text[-1].isspace())


def neutralise(text: str) -> str:
    """``text`` with its protocol look-alikes defused; see the module docstring."""
    if "seg" not in text.casefold() and "[" not in text:
        return text
    text = _ID_LOOKALIKE.sub(lambda m: _fullwidth(m.group()), text)
    return _TAG_LOOKALIKE.sub(lambda m: f"\uff3b{m.group(1)}\uff3d", text)


def _fullwidth(text: str) -> str:
    """Printable ASCII as its fullwidth twin (U+FF01–FF5E); anything else (spaces, the
    long s that matches ``s`` case-insensitively) as the fullwidth s or unchanged."""
    return "".join(chr(ord(c) + 0xFEE0) if "!" <= c <= "~" else "\uff53" if c.casefold() == "s" else c for c in text)
