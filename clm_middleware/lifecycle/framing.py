"""Which words of a long message frame it: the instruction around a pasted body.

People put what they want before or after what they paste: "Summarize this text:
<log>", "What is the most common word? <list>", "<email> Which date did she give?".
When the message alone outgrows the budget and is cut word by word
(``Compressor.trim``), these words go last: without them the model reads a paste and
no request (a cut had kept a 1,000-word list whole but its opening question, and the
reply was "You're an AI assistant designed to support").

The opening clause frames the message when it ends (``.`` ``?`` ``!`` ``:`` ``;`` or a
line break) within ``FRAME_WORDS`` words; the closing one when the message ends with a
question mark: its words back to the last clause end, or to the last word that starts
with a capital after one that does not (a question typed after a paste with no full
stop between), at most ``FRAME_WORDS`` of them.
"""

from __future__ import annotations

import regex

FRAME_WORDS = 32
_CLAUSE_END = regex.compile(r"[.?!:;](?=\s|$)|\n")


def framing_words(text: str, words: list[regex.Match[str]]) -> set[int]:
    """Indices into ``words`` (matches in ``text``, in order) of the message's framing words."""
    framing: set[int] = set()
    if not words:
        return framing
    end = _CLAUSE_END.search(text)
    if end is not None:
        opening = [i for i, word in enumerate(words) if word.start() < end.start()]
        if len(opening) <= FRAME_WORDS:
            framing.update(opening)
    if text.rstrip().endswith("?"):
        tail = text.rstrip()[:-1]
        ends = [m.end() for m in _CLAUSE_END.finditer(tail)]
        start = ends[-1] if ends else 0
        for i in range(len(words) - 1, 0, -1):  # a capital after a lowercase word opens a sentence
            if words[i].start() < start:
                break
            if words[i].group()[:1].isupper() and words[i - 1].group()[-1:].islower():
                start = words[i].start()
                break
        closing = [i for i, word in enumerate(words) if word.start() >= start]
        framing.update(closing[-FRAME_WORDS:])
    return framing
