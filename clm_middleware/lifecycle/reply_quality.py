"""What a delivered reply must never carry, and what makes a reply worthless.

Machinery (``strip_artifacts``): segment markers (``[seg_12]``), lifecycle tags
(``[LIFECYCLE]``, ``[/LIFECYCLE]``) and block lines (``seg_3: keep``). A model shown
the protocol may copy them: they are removed from its replies, so no marker reaches a
user or, through the reply, the next turn's context. Where the context shows no
protocol they are removed too, unless the context itself holds such text
(``shows_machinery``): then the user, a tool or a document wrote it, and a reply that
quotes it is shown as written, as the bare model's would be.

Flags (``reply_flags``), one list per generated reply, in the report:
- ``protocol_artifact``: the model's answer held machinery (removed before delivery);
- ``repetition_loop``: at least ``LOOP_SHARE`` of the answer's word ``LOOP_NGRAM``-grams
  repeat an earlier one (``10:30am: 10:30am: ...``), over at least ``LOOP_MIN_TOKENS``
  words (punctuation marks between them not counted: markup repeats by nature): a
  degenerate greedy loop, not an answer;
- ``repeats_earlier_reply``: at least ``LOOP_SHARE`` of them stand in replies the model
  gave before (and can still see), or a shorter reply of ``SHORT_REPEAT_WORDS`` words or
  more is word for word one of them: the same loop across turns, where a small model
  copies its last answer instead of answering the new message;
- ``reads_back_notes``: the answer is the digest read back (``reads_back_notes``): each
  of its lines is, word for word, a line of the "Notes from earlier turns" the model was
  shown, or, long enough for n-grams, ``LOOP_SHARE`` of them stand in those lines. A
  small model at a small budget answered "Alec's Hotel,\narrive Friday." to "Something
  cheap in the north, please." and then to every message after it: the notes' clipped
  wording is machinery, not an answer;
- ``empty``: nothing visible was delivered.

Cut (``first_repeated_sentence``): a reply is cut where it starts to repeat itself, and
generation stops there (flag ``repetition_cut``): a repeated sentence tells the user
nothing, and a small greedy model that repeats one rarely stops on its own. A cut that
leaves the reply on a clause mark ends it with a full stop instead ("I'm sorry, I'm
sorry, I" is delivered "I'm sorry.", ``reply_filter.end_sentence``). Two kinds
of repeat cut, both counted in words (punctuation never counts):

- a complete **sentence** (ended by ``. ! ? …``, a newline or ``。！？``) that repeats an
  earlier sentence of the same reply (``I'm glad to help. I'm glad to help. ...``) is
  cut at once;
- a sentence that begins again with the first clause of an earlier sentence (split at
  ``, ; :`` and closing brackets too) is cut there at once: the model restarts what
  it said ("The weather can get quite hot, especially ... The weather can get quite
  hot,");
- but a **list item** (a sentence that opens with ``-``, ``*``, ``+``, ``•`` or ``1.``,
  ``1)``) is no such sentence: a plan or a recipe says "- Breakfast at the hotel." or
  "- 1 cup of milk" again under another heading (cut there, the user got "... Dinner in
  Shinjuku.\n\nDay 2:"); an item repeats only as part of a stretch (below), or right
  after itself; so is a line that opens with a short label (``Morning: ...``, ``**Q:**
  ...``) or is a table row, where a label and the rest of its line are one clause;
- any other **clause** that repeats an earlier one is cut only once the whole stretch
  from that earlier clause on has been said again right after itself (``you can add up
  the total, and you can add up the total, and you can add up the total``; ``A, B, C,
  A, B, C``): lists, schedules and table rows share clauses without looping ("1. Golden
  Wok, located in the north, serves Chinese food.\n2. Hakka, located in the north,
  serves Chinese food.", which the bare model copies whole, was cut to "... 2. Hakka,"
  before).

Clauses of fewer than ``REPEAT_MIN_WORDS`` words start no repeat: the same one
``REPEAT_RUN`` times in a row (``very, very, very, very, very, very, ...``) is cut before
its last; said up to five times ("No, no, no, no, no.") it stays. In Chinese and
Japanese, written without spaces, a word is one character and a full-width terminator
(。！？，；：) ends a clause. Lines of a fenced code block are never cut (``RepeatWatch``).

The patterns are also usable on partial text (``could_become_artifact``), so a stream
holds back a suffix that may still turn into a marker instead of showing half of one.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterable, Sequence

import regex

from clm_middleware.lifecycle.segmenter import UNSPACED_SCRIPTS, has_code_block, unclosed_fence

LOOP_NGRAM = 4  # word n-gram size: long enough that ordinary phrasing rarely repeats one
LOOP_SHARE = 0.5  # half the n-grams are repeats: the text says the same thing twice over
SHORT_REPEAT_WORDS = 3  # a shorter reply said again ("Sure.", "Thank you!") is not judged
MARKUP_HELD = 3  # marks with no word after them, held while streaming ("**", "|", "> *")
LOOP_MIN_TOKENS = 12  # shorter replies ("Yes. Yes.") are not judged

REPEAT_MIN_WORDS = 3  # "Yes. Yes." or "OK." twice is not a loop worth cutting
# ...but a short clause six times in a row is ("very, very, very, very, very, very, ..."): at
# four, "No, no, no, no, no. I'm sorry for the mix-up" was cut to "No, no, no," and ended
REPEAT_RUN = 6

_MARKER = r"\[\s*seg(?:ment)?[\s_#-]*\d{1,9}\s*\]"
_TAG = r"\[\s*/?\s*lifecycle\s*\]"
_BLOCK_LINE = (
    r"[ \t]*[-*•]?[ \t]*seg(?:ment)?[\s_#-]*\d{1,9}\s*[:=\-–—>]+"
    r"\s*[\*\"'`]*\s*(?:keep|compress|drop)\b[\*\"'`]*[ \t]*"
)
_ARTIFACT = regex.compile(rf"(?:{_MARKER}|{_TAG})[ \t]?", regex.IGNORECASE)
# machinery that opens the text takes the whitespace around it along: the reply starts
# where its words do ("[seg_5]\nYou can" is "You can", not "\nYou can")
_LEADING_ARTIFACTS = regex.compile(rf"(?:\s*(?:{_MARKER}|{_TAG}))+\s*", regex.IGNORECASE)
_ARTIFACT_PARTIAL = regex.compile(rf"{_MARKER}|{_TAG}", regex.IGNORECASE)
_BLOCK_LINE_FULL = regex.compile(_BLOCK_LINE, regex.IGNORECASE)
# a word: a run of word characters, but each character on its own in the scripts written
# without spaces between words (Chinese, Japanese), whose whole clause would else be one
# "word" and no reply of theirs long enough to judge; or a punctuation mark
_WORD = regex.compile(rf"[{UNSPACED_SCRIPTS}]|[^\W{UNSPACED_SCRIPTS}]+|[^\w\s]")
# a complete sentence, or clause of one: its terminator (. ! ? … , ; : or a closing
# bracket, "[Your Name] [Your Email]") is followed by space; one inside a word or number
# ("1,200", "10:30", "e.g") does not end it. The full-width ones (。！？，；：) need no
# space after them: anything but another one ends the run.
_TERMINATORS = r".!?…,;:\])"
_WIDE_TERMINATORS = "。！？，；："
# a sentence that opens with a list marker: an item of a list, whose lines recur in other
# sections ("Day 2:\n- Breakfast at the hotel."): cut only as a repeated stretch
_LIST_ITEM = regex.compile(r"(?:[-*+•]|\d{1,3}[.)])\s")
# a line that opens with a short label ("Morning: ...", "**Q:** ...", "English: ...") or
# is a table row: an entry of a structure whose lines recur under other labels ("Day 2:\n
# **Morning:** Breakfast at the hotel."): an item too, where it opens its line. A label is
# one clause with what follows it on its line, so a repeat that starts there is cut
# before the label ("Note: I'm sorry.\nNote: I'm sorry." ends after the first line)
_LABEL = r"[*_#> \t]*[\p{L}\p{N}][\p{L}\p{N}'’&/.-]*(?:[ \t]+[\p{L}\p{N}][\p{L}\p{N}'’&/.-]*){0,3}[*_]*:[*_]*"
_LABELLED_LINE = regex.compile(rf"{_LABEL}(?:\s|$)|\|")
_LABEL_ONLY = regex.compile(_LABEL)  # fullmatch: a label with nothing after it yet
_NUMBER_MARKER = regex.compile(r"\d{1,3}[.)]")  # "1." ends a clause of its own: the next sentence is the item
_SENTENCE_MARKS = ".!?…。！？\n"  # of these terminators, those that end a sentence, not only a clause
# where a sentence ends: the start of a terminator run followed by space, a full-width run
# followed by what cannot extend it, a newline (linear: the look-behind skips the
# inside of a run, and nothing else can backtrack), or a full stop glued to the next
# sentence's capital after a lower-case word that is not part of a dotted name
# ("misunderstanding.I'm sorry", as SmolLM2 loops; not "java.util.List", "U.S.Army")
_SENTENCE_END = regex.compile(
    rf"(?<![{_TERMINATORS}])[{_TERMINATORS}]++(?=\s)|[{_WIDE_TERMINATORS}]++(?=[^{_WIDE_TERMINATORS}])|\n"
    r"|(?<=(?:^|\s)[\p{L}'’]*\p{Ll})[.!?…]++(?=\p{Lu})"
)


def strip_artifacts(text: str) -> str:
    """``text`` without segment markers, lifecycle tags and block lines."""
    if "[" not in text and "seg" not in text.casefold():
        return text
    lines = text.split("\n")
    kept = [line for line in lines if not _BLOCK_LINE_FULL.fullmatch(line)]
    joined = "\n".join(kept)
    if (opening := _LEADING_ARTIFACTS.match(joined)) is not None:
        joined = joined[opening.end() :]
    return _ARTIFACT.sub("", joined)


def has_artifact(text: str) -> bool:
    return strip_artifacts(text) != text


def could_become_artifact(tail: str) -> bool:
    """Whether ``tail`` (text from a ``[`` on, or a last line) may still grow into machinery."""
    if not tail:
        return False
    if tail.startswith("["):
        return bool(_ARTIFACT_PARTIAL.fullmatch(tail, partial=True))
    return bool(_BLOCK_LINE_FULL.fullmatch(tail, partial=True)) and bool(tail.strip())


def _words(text: str) -> list[str]:
    return [w.casefold() for w in _WORD.findall(text)]


def _said(words: list[str]) -> list[str]:
    """The words of ``_words`` without the punctuation marks between them."""
    return [w for w in words if w[0].isalnum()]


def _grams(words: list[str], n: int) -> list[tuple[str, ...]]:
    return [tuple(words[i : i + n]) for i in range(len(words) - n + 1)]


def repeated_ngram_share(text: str, n: int = LOOP_NGRAM) -> float:
    """Share of the word n-grams of ``text`` that already occurred earlier in it."""
    return _repeated_share(_words(text), n)


def _repeated_share(words: list[str], n: int) -> float:
    grams = _grams(words, n)
    if not grams:
        return 0.0
    seen: set[tuple[str, ...]] = set()
    repeats = 0
    for gram in grams:
        repeats += gram in seen
        seen.add(gram)
    return repeats / len(grams)


def is_repetition_loop(text: str) -> bool:
    """Whether ``text`` says the same thing over and over. Its words are judged, without
    the punctuation marks between them, once there are ``LOOP_MIN_TOKENS`` of them: the
    brackets, quotes and keys of a JSON array, a table's bars or a list of tags repeat by
    nature (a well-formed array of five records with distinct values had counted as a
    loop, and left the context); a text of marks alone is judged by its marks."""
    words = _words(text)
    said = _said(words)
    judged = said if len(said) >= LOOP_MIN_TOKENS else words
    return len(words) >= LOOP_MIN_TOKENS and _repeated_share(judged, LOOP_NGRAM) >= LOOP_SHARE


def repeats_earlier(text: str, earlier: Iterable[str], n: int = LOOP_NGRAM) -> bool:
    """Whether at least ``LOOP_SHARE`` of the word n-grams of ``text`` occur in ``earlier``
    texts; a reply too short for n-grams, whether it says word for word what one of them
    says (at least ``SHORT_REPEAT_WORDS`` words): "I'm sorry for any other confusion."
    given as the answer to nearly every message of a 126-turn chat, each copy kept in the
    context and copied again (a helper's sweep)."""
    words = _words(text)
    if len(words) < LOOP_MIN_TOKENS:
        said = _said(words)
        return len(said) >= SHORT_REPEAT_WORDS and any(_clause_words(other) == said for other in earlier)
    seen = {gram for other in earlier for gram in _grams(_words(other), n)}
    grams = _grams(words, n)
    return bool(grams) and sum(gram in seen for gram in grams) / len(grams) >= LOOP_SHARE


def reads_back_notes(text: str, notes: Sequence[str]) -> bool:
    """Whether ``text`` is ``notes`` (the digest's lines) read back: every line of it,
    and at least ``SHORT_REPEAT_WORDS`` words in all, is word for word one of them; or,
    ``LOOP_MIN_TOKENS`` words or more, ``LOOP_SHARE`` of its word n-grams stand in them."""
    if not notes:
        return False
    words = _words(text)
    if len(words) >= LOOP_MIN_TOKENS:
        return repeats_earlier(text, ["\n".join(notes)])  # n-grams run on from one line to the next
    lines = [said for line in text.splitlines() if (said := _clause_words(line))]
    noted = {tuple(_clause_words(note)) for note in notes}
    return sum(map(len, lines)) >= SHORT_REPEAT_WORDS and all(tuple(line) in noted for line in lines)


def shows_machinery(protocol: bool, context_texts: Iterable[str]) -> bool:
    """Whether markers, tags and block lines in a reply are machinery, to cut and flag:
    the context shows the protocol, or none of its texts holds such a thing (a model
    that saw none quotes none; one that writes it anyway must not show it)."""
    return protocol or not any(has_artifact(text) for text in context_texts)


def reply_flags(
    answer: str,
    delivered: str,
    earlier: Iterable[str] = (),
    *,
    machinery: bool = True,
    notes: Sequence[str] = (),
) -> list[str]:
    """Flags of one generated reply: ``answer`` as the model wrote it (block cut off),
    ``delivered`` what the user got, ``earlier`` the replies before it that the model saw;
    ``machinery``: the context showed the protocol (elsewhere a marker in a reply quotes
    what the user wrote, and is no artifact); ``notes``: the digest's lines it saw."""
    flags = []
    if machinery and has_artifact(answer):
        flags.append("protocol_artifact")
    if is_repetition_loop(delivered):
        flags.append("repetition_loop")
    elif repeats_earlier(delivered, earlier):
        flags.append("repeats_earlier_reply")
    elif reads_back_notes(delivered, notes):
        flags.append("reads_back_notes")
    if not delivered.strip():
        flags.append("empty")
    return flags


def _clause_words(sentence: str) -> list[str]:
    return _said(_words(sentence))  # "the total," repeats "the total."


# a clause that opens with one of these says the rest again when the rest repeats: "I can
# help you with that, but I can help you with that." loops as "X, X" does
_LINKING_WORDS = frozenset({"and", "but", "or", "so", "yet", "then"})


def _unlinked(words: list[str]) -> list[str]:
    """A clause's words as repeats compare them: without a linking word it opens with."""
    return words[1:] if len(words) > 1 and words[0] in _LINKING_WORDS else words


def _key(words: list[str]) -> str | None:
    """A clause's words as the cut compares them; None under ``REPEAT_MIN_WORDS`` words."""
    return " ".join(words) if len(words) >= REPEAT_MIN_WORDS else None


def first_repeated_sentence(text: str) -> int | None:
    """Offset where the first repeat of ``text`` that is cut starts (see the module docstring)."""
    watch = RepeatWatch()
    watch.update(text)
    return watch.cut


def repeat_in_progress(text: str) -> int:
    """Characters at the end of ``text`` that may still be cut as a repeat (a clause that
    may still turn out to start a repeated stretch, a sentence whose words so far begin
    an earlier one): a stream holds them back until the text diverges."""
    watch = RepeatWatch()
    watch.update(text)
    return watch.in_progress(text)


class RepeatWatch:
    """``first_repeated_sentence`` and ``repeat_in_progress`` of a text that grows, fed the
    whole text so far after every token: each call scans only what was appended since
    the last complete clause, so a reply costs linear time in clauses said, not quadratic
    in characters.

    Code is not prose: a line of a fenced block (between ```` ``` ```` or ``~~~`` lines,
    the fence lines included) is never compared nor cut, since code repeats its lines by
    nature (a signature before and after a change, two fixtures alike) and a cut there
    leaves the block unclosed; it also ends the sentence and any repeat in progress.

    Invariant: ``_complete`` is the text through its last complete clause (an end that
    appending cannot move: its terminator is already followed by whitespace), or through
    the one that made the ``cut``; ``_clauses`` are the words of its prose clauses and
    ``_starts`` where each starts; ``_seen`` maps a clause key to the clauses that have
    it, ``_keys`` and ``_sentence_keys`` are the keys of the clauses and of the complete
    sentences, sorted, for prefix look-ups; ``_sentence`` holds the words of the
    sentence in progress; ``_pending`` holds each clause ``i`` that repeats an earlier
    clause ``j`` with how many clauses from ``i`` on have repeated those from ``j`` on
    so far (the stretch is repeated, and cut, once ``i - j`` have); ``_openers`` are
    the keyed clauses that open a sentence; ``_line_open`` says whether ``_complete`` ends
    a line (a label there opens an item, ``_opens_item``); ``_open_fence`` is
    the fence it leaves open (None: not inside a block). A text that does not start with
    ``_complete`` (a stop string cut it) starts over; ``_run`` is the last short clause
    and how many times in a row it ends ``_complete``."""

    def __init__(self) -> None:
        self._complete = ""
        self._clauses: list[str] = []
        self._starts: list[int] = []
        self._seen: dict[str, list[int]] = {}
        self._keys: list[str] = []
        self._sentence_keys: list[str] = []
        self._sentence: list[str] = []
        self._sentence_start: int | None = None
        self._sentence_item = False  # the sentence in progress is an item (_opens_item)
        self._line_open = True  # the next clause opens a line (the text so far ends one)
        self._after_marker = False  # the last clause was a number marker alone ("1.")
        self._pending: list[tuple[int, int, int]] = []
        self._openers: set[int] = set()
        self._run: tuple[str, int] = ("", 0)
        self._open_fence: str | None = None
        self.cut: int | None = None  # where the first repeat starts, once there is one

    def update(self, text: str) -> None:
        if not text.startswith(self._complete):
            self.__init__()  # type: ignore[misc]
        if self.cut is not None:
            return
        scanned = start = len(self._complete)
        for end in _SENTENCE_END.finditer(text, pos=start):
            unit = text[start : end.end()]
            line_start = self._line_open or "\n" in unit[: len(unit) - len(unit.lstrip())]
            if line_start and end.group() != "\n" and _LABEL_ONLY.fullmatch(unit.strip()):
                continue  # the label opens the clause that follows it on its line
            start = end.end()
            words_at = start - len(unit.lstrip())
            self._line_open = unit.rstrip(" \t").endswith("\n") or (line_start and not unit.strip())
            self.cut = self._take(unit, words_at, ends_sentence=_ends_sentence(end.group()), line_start=line_start)
            if self.cut is not None:
                break
        if start != scanned:  # copied only when a clause ended, not on every token
            self._complete = text[:start]

    def _take(self, unit: str, at: int, *, ends_sentence: bool, line_start: bool) -> int | None:
        """Count one complete clause (``unit``, its words starting at ``at``; ``line_start``:
        they open a line); where a repeat it completes starts, if it completes one."""
        in_code = self._open_fence is not None or has_code_block(unit)
        self._open_fence = unclosed_fence(unit, self._open_fence)
        if in_code:
            self._run, self._pending = ("", 0), []
            self._end_sentence()
            return None
        words = _clause_words(unit)
        cuts = []
        if words:
            opens = not self._sentence  # the first clause of its sentence
            if opens:
                self._sentence_item = self._after_marker or _opens_item(unit, line_start)
            self._after_marker = bool(_NUMBER_MARKER.fullmatch(unit.strip()))
            compared = _unlinked(words)
            clause, index = " ".join(compared), len(self._clauses)
            self._clauses.append(clause)
            self._starts.append(at)
            cuts += self._advance(clause)
            key = _key(compared)
            if key is None:
                if self._short_run(clause) >= REPEAT_RUN:
                    cuts.append(at)
            else:
                self._run = ("", 0)
                earlier = self._seen.setdefault(key, [])
                if not earlier:
                    bisect.insort(self._keys, key)
                for j in earlier:
                    if index - j == 1 or (opens and j in self._openers and not self._sentence_item):
                        cuts.append(at)  # said again right after itself, or a sentence begun again
                    else:
                        self._pending.append((index, j, 1))
                earlier.append(index)
                if opens:
                    self._openers.add(index)
            if self._sentence_start is None:
                self._sentence_start = at
            self._sentence.extend(words)
        if ends_sentence:
            cuts += self._end_sentence()
        return min(cuts, default=None)

    def _advance(self, clause: str) -> list[int]:
        """Extend each pending repeat by ``clause``: those it continues stay (or, once the
        whole stretch is said again, are where the cut starts); the others end."""
        cuts, pending = [], []
        for start, earlier, matched in self._pending:
            if self._clauses[earlier + matched] != clause:
                continue
            if matched + 1 == start - earlier:
                cuts.append(self._starts[start])
            else:
                pending.append((start, earlier, matched + 1))
        self._pending = pending
        return cuts

    def _end_sentence(self) -> list[int]:
        """Close the sentence in progress: where it starts if it repeats an earlier one."""
        key, start, item = _key(self._sentence), self._sentence_start, self._sentence_item
        self._sentence, self._sentence_start = [], None
        if key is None:
            return []
        at = bisect.bisect_left(self._sentence_keys, key)
        if at < len(self._sentence_keys) and self._sentence_keys[at] == key:
            return [start] if start is not None and not item else []
        self._sentence_keys.insert(at, key)
        return []

    def _short_run(self, clause: str) -> int:
        """Count ``clause`` (a short one) into the run of equal clauses in a row."""
        last, count = self._run
        self._run = (clause, count + 1 if clause == last else 1)
        return self._run[1]

    def in_progress(self, text: str) -> int:
        """``repeat_in_progress`` of ``text``, the text of the last ``update``."""
        tail = text[len(self._complete) :]
        if self._open_fence is not None or has_code_block(tail):
            return 0  # code is never cut, so never held back
        held = [self._starts[start] for start, _, _ in self._pending]
        said = _clause_words(tail)  # compared as the cut compares: words only
        tail_at = len(text) - len(tail.lstrip())
        if not said and 0 < len("".join(tail.split())) <= MARKUP_HELD:
            # markup with no word yet ("**", "|", "##" opening a line): the cut of a repeat
            # its words complete lands before it, so it waits for them; a longer run of
            # marks (emoji) is text of its own and streams
            held.append(tail_at)
        if said:
            # an earlier key that starts with it: its words, the last one begun (a linking
            # word alone may still open a repeat: "…, and" before "you can add up the total")
            begun = " ".join(_unlinked(said))
            clause, count = self._run  # or the clause that would complete a run
            linking = len(said) == 1 and bool(self._keys) and any(w.startswith(said[0]) for w in _LINKING_WORDS)
            if linking or _begins_one_of(self._keys, begun) or (count == REPEAT_RUN - 1 and clause.startswith(begun)):
                held.append(tail_at)
        sentence = " ".join(self._sentence + said)
        line_start = self._line_open or "\n" in tail[: len(tail) - len(tail.lstrip())]
        item = self._sentence_item if self._sentence else self._after_marker or _opens_item(tail, line_start)
        if sentence and not item and _begins_one_of(self._sentence_keys, sentence):
            held.append(self._sentence_start if self._sentence_start is not None else tail_at)
        return len(text) - min(held) if held else 0


def ends_on_a_label(text: str) -> bool:
    """Whether the last line of ``text`` is a label with nothing after it ("Day 2:",
    "**Waffles:**"): a heading whose content was cut, which keeps its colon."""
    return bool(_LABEL_ONLY.fullmatch(text.rstrip().rsplit("\n", 1)[-1].strip()))


def _opens_item(unit: str, line_start: bool) -> bool:
    """Whether a sentence that opens with ``unit`` is an item of a structure: after a list
    marker, or, at the start of a line, after a short label or as a table row."""
    opening = unit.lstrip()
    return bool(_LIST_ITEM.match(opening)) or (line_start and bool(_LABELLED_LINE.match(opening)))


def _begins_one_of(sorted_keys: list[str], begun: str) -> bool:
    at = bisect.bisect_left(sorted_keys, begun)
    return at < len(sorted_keys) and sorted_keys[at].startswith(begun)


def _ends_sentence(terminator: str) -> bool:
    """Whether a clause's terminator run (``.``, ``?)``, ``\n``, ``，``) ends its sentence too."""
    return any(mark in terminator for mark in _SENTENCE_MARKS)
