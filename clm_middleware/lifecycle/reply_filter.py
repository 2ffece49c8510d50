"""What of a reply the user may see, computed on the whole text so far (streaming-safe).

The visible answer is the model's output before a ``[LIFECYCLE]`` block and before
any stop string, without the machinery ``reply_quality.strip_artifacts`` removes
(segment markers, stray tags, block lines), and right-stripped only where something
was cut from it (a stop string leaves the whitespace before it, as on OpenAI, vLLM and
llama.cpp). That holds unless
``machinery`` is off (``reply_quality.shows_machinery``): the context shows no protocol
and itself holds such text, which the user, a tool or a document wrote, so a
``[seg_3]`` or ``[LIFECYCLE]`` in the reply quotes it and is shown as written, as the
bare model's would be. While streaming, a suffix
that could still turn into a tag, a marker, a block line or a stop string is held
back, so the user never sees machinery, or half of it, even for a single delta; the
concatenated deltas equal the final answer. With ``cut_repeats`` the answer also ends
where it starts to repeat itself (``reply_quality.first_repeated_sentence``), and text
that may still be cut so is held back until it diverges.

A grammar-constrained reply (``verbatim``, see ``structured/``) is shown as written, cut
only at a stop string: the grammar already rules out a block, and cutting a marker or a
"repeated sentence" out of a JSON document could only break it.
"""

from __future__ import annotations

from collections.abc import Sequence

from clm_middleware.lifecycle.protocol import split_reply
from clm_middleware.lifecycle.reply import cut_at_stop
from clm_middleware.lifecycle.reply_quality import (
    RepeatWatch,
    could_become_artifact,
    ends_on_a_label,
    first_repeated_sentence,
    strip_artifacts,
)

_MAX_HELD_BRACKET = 32  # a "[" further back than this cannot still become a marker or a tag


def model_answer(raw: str, stops: Sequence[str], given: int = 0) -> str:
    """The model's answer as written: before a lifecycle block and the first stop string
    (``given``: characters of ``raw`` the model was given, where no stop string counts)."""
    return cut_at_stop(split_reply(raw)[0], stops, given)


def _written(raw: str, stops: Sequence[str], machinery: bool, given: int = 0) -> str:
    """What the model wrote of its answer: before the first stop string, and, where
    markers and blocks are machinery, before a lifecycle block (``model_answer``)."""
    return model_answer(raw, stops, given) if machinery else cut_at_stop(raw, stops, given)


# the zero-width joiner of an emoji sequence ("👨\u200d👩"): one that ends a reply joins
# nothing (the token cap cut the sequence), so it is held while streaming and left out
_JOINER = "\u200d"
_CLAUSE_MARKS = ",;:"  # end a clause, not a sentence: a cut reply does not end on one


def cut_repeat(written: str, *, final: bool = False) -> str:
    """``written`` before where it starts to repeat itself (see reply_quality.py);
    ``final``: the text is complete, so its last sentence is complete too."""
    cut = first_repeated_sentence(written + "\n" if final else written)
    return written if cut is None else written[:cut]


def end_sentence(kept: str) -> str:
    """A reply cut before a repeat, right-stripped, ending on a full stop where the cut
    left a clause mark (``"I'm sorry, I'm sorry, I"`` is delivered ``"I'm sorry."``, not
    ``"I'm sorry,"``), but for a label that ends it ("Day 2:" stays a heading, not "Day
    2."). A stream holds a trailing clause mark back until the text goes on
    (``ReplyFilter``), so the streamed text is the final one."""
    kept = kept.rstrip()
    return kept[:-1] + "." if _ends_on_clause_mark(kept) and not ends_on_a_label(kept) else kept


def _ends_on_clause_mark(text: str) -> bool:
    """Whether ``text``, right-stripped, ends on a comma, semicolon or colon."""
    stripped = text.rstrip()
    return bool(stripped) and stripped[-1] in _CLAUSE_MARKS


def cuts_a_repeat(raw: str, *, stops: Sequence[str], machinery: bool = True, given: int = 0) -> bool:
    """Whether ``visible_answer`` with ``cut_repeats`` ends ``raw`` before a repeat: also
    one that ended with the generation (a repeated last sentence, then end of text)."""
    written = _written(raw, stops, machinery, given)
    return cut_repeat(written, final=True) != written


def visible_answer(
    raw: str,
    *,
    stops: Sequence[str],
    cut_repeats: bool = False,
    verbatim: bool = False,
    machinery: bool = True,
    given: int = 0,
) -> str:
    """The final answer: the model's text before a lifecycle block and the first stop
    string, as written (trailing whitespace included, as an OpenAI-compatible server
    returns it), but for what this library cuts, after which it is right-stripped:
    machinery (where the context shows it: ``machinery``), including a marker or block
    line left unfinished at the end; with ``cut_repeats``, everything from where the
    answer starts to repeat itself. ``verbatim``: only the stop strings cut. ``given``:
    the first characters of ``raw`` were given to the model (``reply_prefix``): a stop
    string there stops nothing."""
    if verbatim:
        return cut_at_stop(raw, stops, given)
    written = _written(raw, stops, machinery, given).removesuffix(_JOINER)
    if cut_repeats and (kept := cut_repeat(written, final=True)) != written:
        written = end_sentence(kept)
    if not machinery:
        return written
    held = trailing_machinery(written, final=True)
    cleaned = strip_artifacts(written[: len(written) - held])
    return written if not held and cleaned == written else cleaned.rstrip()


def trailing_machinery(written: str, *, final: bool = False) -> int:
    """Characters at the end of ``written`` that are, or may still become, machinery:
    from the last ``[`` (a marker or tag in the making) or, while streaming, the start
    of the last line (a block line in the making). In a ``final`` text an unfinished
    bracket is still cut (``[seg_1`` at the end of the output); an unfinished line is
    not: it is the text it is ("S" may be the start of "seg_3: keep", or just "S"), and
    a finished block line is cut by ``strip_artifacts``."""
    held = 0
    bracket = written.rfind("[")
    if bracket >= 0 and len(written) - bracket < _MAX_HELD_BRACKET and could_become_artifact(written[bracket:]):
        held = len(written) - bracket
    line_start = written.rfind("\n") + 1
    if not final and could_become_artifact(written[line_start:]):
        held = max(held, len(written) - line_start)
    return held


class ReplyFilter:
    def __init__(
        self,
        *,
        stops: Sequence[str],
        cut_repeats: bool = False,
        verbatim: bool = False,
        machinery: bool = True,
        given: int = 0,
    ) -> None:
        self.stops = tuple(s for s in stops if s)
        self.given = given  # the raw text's first characters were given to the model: no stop counts there
        self.cut_repeats = cut_repeats and not verbatim
        self.verbatim = verbatim
        self.machinery = machinery  # markers and blocks in the reply are machinery (reply_quality.shows_machinery)
        self._emitted = 0
        self._repeats = RepeatWatch()  # of the written answer, kept across deltas (linear per reply)

    @property
    def repeated(self) -> bool:
        """With ``cut_repeats``: the answer so far has a complete sentence that repeats an
        earlier one (the reply ends there; generation may stop)."""
        return self._repeats.cut is not None

    def delta(self, raw_so_far: str) -> str:
        """New visible text since the last call."""
        if self.verbatim:
            answer = cut_at_stop(raw_so_far, self.stops, self.given)
            return self._emit(answer, len(answer) - self._held_stop(answer))
        if self.machinery:
            written = model_answer(raw_so_far, self.stops, self.given)
            held_raw = trailing_machinery(written)
        else:
            written, held_raw = cut_at_stop(raw_so_far, self.stops, self.given), 0
        if self.cut_repeats:
            self._repeats.update(written)
            cut = self._repeats.cut
            held_raw = len(written) - cut if cut is not None else max(held_raw, self._repeats.in_progress(written))
        answer = written[: len(written) - held_raw]
        if self.machinery:
            answer = strip_artifacts(answer)
        safe = len(answer) - self._held_stop(answer) if not held_raw else len(answer.rstrip())
        if self.cut_repeats and _ends_on_clause_mark(answer[:safe]):
            safe = len(answer[:safe].rstrip()) - 1  # a cut here would end the sentence instead (end_sentence)
        if answer[:safe].endswith(_JOINER):
            safe -= 1  # it joins what comes next, or nothing
        return self._emit(answer, safe)

    def _emit(self, answer: str, safe: int) -> str:
        if safe <= self._emitted:
            return ""
        text, self._emitted = answer[self._emitted : safe], safe
        return text

    def finish(self, final_answer: str) -> str:
        """The rest of ``final_answer`` once the generation is over."""
        text = final_answer[self._emitted :] if len(final_answer) > self._emitted else ""
        self._emitted = max(self._emitted, len(final_answer))
        return text

    def _held_stop(self, answer: str) -> int:
        """Characters at the end that might still become a stop string, with the
        whitespace before them (a cut after it would strip that whitespace)."""
        cut = len(answer.rstrip())  # trailing whitespace is always held
        for stop in self.stops:
            for size in range(min(len(stop) - 1, len(answer)), 0, -1):
                if stop.startswith(answer[-size:]):
                    cut = min(cut, len(answer[:-size].rstrip()))
                    break
        return len(answer) - cut
