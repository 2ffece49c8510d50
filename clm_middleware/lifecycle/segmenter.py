"""Split a message into segments by rules, and give each a kind.

Rules, in order:
1. fenced code blocks (``` or ~~~) are one ``code`` segment each, never split;
2. the rest splits into paragraphs at blank lines;
3. a paragraph whose lines are list items (``1.``, ``2)``, ``-``, ``*``, ``•``) gives
   one ``step`` segment per item, and so do such lines ending a paragraph after the
   lines that introduce them;
4. any other paragraph splits into sentences;
5. fragments shorter than ``min_chars`` join their predecessor (or successor);
6. a whole message made only of content-free words ("ok thanks") is one ``ack``.

System and tool messages, and assistant replies, are one segment each: a reply keeps
the token ids the model generated, and a marker can only precede it as a whole.

Kinds come from user rules first (``add_rule(pattern, kind)``, first match wins),
then: ``system`` and ``tool`` by role, ``code``, ``step``, ``ack``, ``question``
(ends with "?"), ``reply`` for a whole assistant reply, else ``text``.
"""

from __future__ import annotations

import unicodedata
from dataclasses import dataclass, field

import regex

from clm_middleware.errors import ConfigError

# the scripts written without spaces between words (Chinese, Japanese): each character
# is a word wherever words are counted or kept (reply_quality, compressor, distinctive)
UNSPACED_SCRIPTS = r"\p{Han}\p{Hiragana}\p{Katakana}"
# a Markdown code block: from a fence (``` or ~~~) to the same fence or the text's end
_FENCE = regex.compile(r"(```|~~~).*?(?:\1|\Z)", regex.DOTALL)
_FENCE_MARK = regex.compile(r"```|~~~")  # what opens and closes a fenced block
_LIST_ITEM = regex.compile(r"^\s*(?:\d{1,3}[.)]|[-*•])\s+")
# A sentence ends at . ! ? … (Arabic ؟, Devanagari ।) followed by space and a capital, a
# letter of a script without case (Arabic, Hindi), a digit, quote or bracket; or at the
# full-width 。！？ of Chinese and Japanese, which need no space after them.
_SENTENCE_END = regex.compile(
    r"(?<=[.!?…؟।])[\"')\]]*\s+(?=[\p{Lu}\p{Lo}\p{N}\"'(\[])|(?<=[。！？])[」』”’）)\]]*\s*(?=\S)"
)
_ABBREVIATIONS = frozenset(
    [
        "mr",
        "mrs",
        "ms",
        "dr",
        "prof",
        "sr",
        "jr",
        "st",
        "vs",
        "etc",
        "e.g",
        "i.e",
        "no",
        "fig",
        "approx",
        "dept",
        "est",
        "inc",
        "ltd",
        "co",
        "corp",
    ]
)
# abbreviations that end no sentence when a number follows: "Jan. 5, 2025", "ext. 209",
# "Vol. 3" (but "I moved in Sept. It was cold." is two sentences)
_BEFORE_NUMBER = frozenset(
    [
        "jan",
        "feb",
        "mar",
        "apr",
        "jun",
        "jul",
        "aug",
        "sep",
        "sept",
        "oct",
        "nov",
        "dec",
        "ext",
        "tel",
        "vol",
        "apt",
        "ref",
        "nr",
    ]
)
ACK_WORDS = frozenset(
    [
        "ok",
        "okay",
        "k",
        "kk",
        "thanks",
        "thank",
        "thx",
        "ty",
        "cheers",
        "cool",
        "great",
        "nice",
        "perfect",
        "awesome",
        "lovely",
        "excellent",
        "brilliant",
        "wonderful",
        "fine",
        "alright",
        "sounds",
        "good",
        "got",
        "it",
        "sure",
        "hi",
        "hello",
        "hey",
        "bye",
        "goodbye",
        "welcome",
        "glad",
        "happy",
        "to",
        "help",
        "helps",
        "helped",
        "that's",
        "thats",
        "that",
        "you",
        "you're",
        "youre",
        "re",
        "so",
        "much",
        "very",
        "will",
        "do",
        "noted",
        "anytime",
        "np",
        "no",
        "problem",
        "appreciate",
        "appreciated",
        "understood",
        "are",
        "all",
        "set",
        "makes",
        "sense",
        "right",
        "indeed",
        "absolutely",
        "definitely",
        "of",
        "course",
    ]
)
MAX_ACK_WORDS = 6


@dataclass(frozen=True, slots=True)
class SegmentPiece:
    text: str
    kind: str
    separator: str  # the whitespace before it in the message, as written (the first: the message's leading)


@dataclass(slots=True)
class Segmenter:
    """Rules for splitting messages; see the module docstring."""

    min_chars: int = 16
    normalize: bool = False  # NFKC (full-width → ASCII) and collapse runs of spaces
    rules: list[tuple[regex.Pattern[str], str]] = field(default_factory=list)

    def __post_init__(self) -> None:
        if self.min_chars < 0:
            raise ConfigError("min_chars", f"must be ≥ 0, got {self.min_chars}")

    def add_rule(self, pattern: str, kind: str) -> None:
        """Segments matching ``pattern`` (a regex, searched) get ``kind``; earlier rules win."""
        try:
            compiled = regex.compile(pattern)
        except regex.error as error:
            raise ConfigError("pattern", f"invalid regular expression {pattern!r}: {error}") from None
        if not kind or not kind.isidentifier():
            raise ConfigError("kind", f"must be a short identifier, got {kind!r}")
        self.rules.append((compiled, kind))

    def normalise_text(self, text: str) -> str:
        if not self.normalize:
            return text
        text = unicodedata.normalize("NFKC", text)
        text = regex.sub(r"[ \t\u00a0]+", " ", text)
        return regex.sub(r" *\n *", "\n", text).strip()

    def split(self, text: str, role: str) -> list[SegmentPiece]:
        """Segments of one message, in order.

        Their separators and texts, joined in order, give the message back exactly: the
        whitespace between segments is kept as written (indentation, blank lines, CRLF,
        runs of spaces), the first separator is the message's leading whitespace and its
        trailing whitespace ends the last segment. A message of whitespace only has none.
        """
        if not text.strip():
            return []
        if role in ("system", "tool", "assistant"):
            stripped = text.strip()
            kind = {"system": "system", "tool": "tool"}.get(role) or ("ack" if is_ack(stripped) else "reply")
            return [_whole(text, self._kind(stripped, kind))]
        if is_ack(text):
            return [_whole(text, self._kind(text.strip(), "ack"))]
        pieces = self._merge_fragments(list(self._raw_pieces(text)))
        return [SegmentPiece(p.text, self._kind(p.text, p.kind), p.separator) for p in pieces]

    # -------------------------------------------------------------- internal

    def _raw_pieces(self, text: str) -> list[SegmentPiece]:
        spans: list[tuple[int, int, str]] = []
        position = 0
        for fence in _FENCE.finditer(text):
            spans += _prose_spans(text, position, fence.start())
            spans.append(_trimmed(text, fence.start(), fence.end(), "code"))
            position = fence.end()
        spans += _prose_spans(text, position, len(text))
        pieces, previous_end = [], 0
        for begin, end, kind in spans:
            pieces.append(SegmentPiece(text[begin:end], kind, text[previous_end:begin]))
            previous_end = end
        if pieces and previous_end < len(text):  # the message's trailing whitespace ends its last segment
            last = pieces[-1]
            pieces[-1] = SegmentPiece(last.text + text[previous_end:], last.kind, last.separator)
        return pieces

    def _merge_fragments(self, pieces: list[SegmentPiece]) -> list[SegmentPiece]:
        """Join short ``text`` fragments to the previous ``text`` piece of the same paragraph, else to the next."""
        merged: list[SegmentPiece] = []
        waiting: SegmentPiece | None = None  # a short fragment that opened a paragraph
        for piece in pieces:
            if waiting is not None:
                if piece.kind == "text":
                    piece = _join(waiting, piece)
                else:
                    merged.append(waiting)
                waiting = None
            if piece.kind == "text" and len(piece.text) < self.min_chars:
                if merged and merged[-1].kind == "text" and not is_paragraph_break(piece.separator):
                    merged[-1] = _join(merged[-1], piece)
                else:
                    waiting = piece
                continue
            merged.append(piece)
        if waiting is not None:
            merged.append(waiting)
        return merged

    def _kind(self, text: str, default: str) -> str:
        for pattern, kind in self.rules:
            if pattern.search(text):
                return kind
        if default == "text" and text.rstrip().endswith(("?", "？", "؟")):
            return "question"
        return default


def _prose_spans(text: str, begin: int, end: int) -> list[tuple[int, int, str]]:
    """Spans of list items (``step``) and sentences (``text``) in ``text[begin:end]``."""
    spans: list[tuple[int, int, str]] = []
    for start, paragraph in _paragraphs(text[begin:end]):
        if not paragraph.strip():
            continue
        offset = begin + start
        lines = [m for m in regex.finditer(r"[^\n]+", paragraph) if m.group().strip()]
        # the list: the lines from the first list item on, when every one of them is an
        # item ("My checklist:" then "1. ...", "2. ..." with no blank line between)
        first = next((i for i, m in enumerate(lines) if _LIST_ITEM.match(m.group())), len(lines))
        items = lines[first:] if all(_LIST_ITEM.match(m.group()) for m in lines[first:]) else []
        prose_end = items[0].start() if items else len(paragraph)
        for sentence_start, sentence_end in _sentence_spans(paragraph[:prose_end]):
            spans.append(_trimmed(text, offset + sentence_start, offset + sentence_end, "text"))
        for line in items:
            spans.append(_trimmed(text, offset + line.start(), offset + line.end(), "step"))
    return [span for span in spans if span[1] > span[0]]


_PARAGRAPH_BREAK = regex.compile(r"\n(?=[ \t]*\n)")  # a newline that starts a blank line


def _paragraphs(text: str) -> list[tuple[int, str]]:
    """The maximal runs of ``text`` that hold no paragraph break (a newline followed by a
    blank line), each with where it starts. Linear in the text: a per-character
    look-ahead had raised MemoryError on an 8 MB message (a 500 from clm serve, under its
    16 MiB body limit)."""
    found, start = [], 0
    for stop in [*(cut.start() for cut in _PARAGRAPH_BREAK.finditer(text)), len(text)]:
        if stop > start:
            found.append((start, text[start:stop]))
        start = stop + 1
    return found


def _join(first: SegmentPiece, second: SegmentPiece) -> SegmentPiece:
    """The two as one piece, with what stood between them (nothing between two Chinese
    sentences: a space there had changed the message)."""
    return SegmentPiece(first.text + second.separator + second.text, "text", first.separator)


def has_code_block(text: str) -> bool:
    """True when ``text`` holds a fenced Markdown code block (``` or ~~~), closed or not."""
    return "```" in text or "~~~" in text


def unclosed_fence(text: str, open_fence: str | None = None) -> str | None:
    """The fence ``text`` leaves open (a reply cut inside its code block), or None;
    ``open_fence``: the one open before ``text`` (a text read piece by piece). A block
    closes only with the mark that opened it: a ~~~ block may hold ``` lines."""
    for mark in _FENCE_MARK.finditer(text):
        if open_fence is None:
            open_fence = mark.group()
        elif mark.group() == open_fence:
            open_fence = None
    return open_fence


def _whole(text: str, kind: str) -> SegmentPiece:
    """A message as one segment: its leading whitespace as the separator, the rest as written."""
    body = text.lstrip()
    return SegmentPiece(body, kind, text[: len(text) - len(body)])


def is_paragraph_break(separator: str) -> bool:
    """Whitespace with a blank line in it (two newlines, CRLF or not)."""
    return separator.count("\n") >= 2


def _trimmed(text: str, begin: int, end: int, kind: str) -> tuple[int, int, str]:
    while begin < end and text[begin].isspace():
        begin += 1
    while end > begin and text[end - 1].isspace():
        end -= 1
    return begin, end, kind


def casefolded_words(text: str) -> list[str]:
    """The words of ``text``, casefolded, apostrophes kept and made straight ("that's")."""
    return regex.findall(r"[\p{L}']+", text.casefold().replace("’", "'"))


def is_ack(text: str) -> bool:
    """True for a content-free message: a few words, all of them acknowledgements."""
    words = casefolded_words(text)
    if not words or len(words) > MAX_ACK_WORDS or regex.search(r"\p{N}", text):
        return False
    return all(word in ACK_WORDS or word.replace("'", "") in ACK_WORDS for word in words)


def _sentence_spans(paragraph: str) -> list[tuple[int, int]]:
    spans: list[tuple[int, int]] = []
    start = 0
    for match in _SENTENCE_END.finditer(paragraph):
        candidate = paragraph[start : match.start()].rstrip()
        last_word = regex.search(r"([\p{L}.]+)\.$", candidate)
        abbreviation = last_word.group(1).rstrip(".").casefold() if last_word else ""
        if abbreviation in _ABBREVIATIONS or (abbreviation in _BEFORE_NUMBER and paragraph[match.end()].isdigit()):
            continue  # "Dr. Smith", "e.g. this", "Jan. 5": not a sentence end
        spans.append((start, match.start() + len(match.group().rstrip())))  # keep closing quotes
        start = match.end()
    if paragraph[start:].strip():
        spans.append((start, len(paragraph)))
    return spans
