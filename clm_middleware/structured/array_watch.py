"""Where a JSON document being written repeats the items of an array.

A small model under a grammar can write the same array item until ``max_new_tokens``
(SmolLM2: ``"ingredients": ["flour", "milk", "baking time", "baking time", "baking time",
...``, ``"tags": ["type", "string", "null", "string", "string", ...``): the grammar
allows it, and a reply cut by the token limit is no document at all. ``ArrayWatch`` reads
the text as it grows and says when the item being finished repeats one already in its
array (``closing``); the turn then lets only tokens that end the array follow it
(``GrammarConstraint.close_array``), so the document ends valid.

Invariants:
- ``update`` reads each character once (the text only grows; another text starts over),
  so watching a reply costs linear time in its length.
- An item is a loop when two earlier items of its array are the same: ``["a", "b", "a",
  "a"]`` ends there. A string item is judged when its text so far, closed, would be
  such a repeat (its closing quote may come fused with the comma that starts the next
  item: SmolLM2's ``",``), so an item whose text only begins like two earlier ones
  (``"business`` of ``"businesses"``) is ended early: a third copy is already a loop.
  Numbers and literals are not watched; distinct items never end an array.
- Only the text is read: the grammar, not this, decides what is valid.
"""

from __future__ import annotations

from dataclasses import dataclass, field

# what ends an item that is still open, by the character it opened with
_CLOSERS = {'"': '"', "{": "}", "[": "]"}
ARRAY_CLOSERS = ("", *_CLOSERS.values())  # what ``ArrayWatch.closing`` may answer


@dataclass(slots=True)
class _Frame:
    kind: str  # "[" or "{"
    item_start: int  # where the item being written starts (arrays)
    items: list[str] = field(default_factory=list)  # complete items, as written (arrays)


class ArrayWatch:
    def __init__(self) -> None:
        self._text = ""
        self._stack: list[_Frame] = []
        self._in_string = False
        self._escaped = False

    def update(self, text: str) -> None:
        if not text.startswith(self._text):
            self.__init__()  # type: ignore[misc]
        for at in range(len(self._text), len(text)):
            self._read(text, at)
        self._text = text

    def closing(self, text: str) -> str | None:
        """The text that would end the item being written as a repeat (``'"'``, ``"}"``,
        ``"]"``, or ``""`` when it is complete), when it is one (see the module
        docstring); ``None`` otherwise, or outside an array."""
        self.update(text)
        frame = self._array_frame()
        if frame is None:
            return None
        item = text[frame.item_start :].strip()
        if not item:
            return None
        if self._complete(item) and self._loops(frame, item):
            return ""
        closer = _CLOSERS.get(item[0])
        if closer is not None and not self._complete(item) and self._loops(frame, item + closer):
            return closer
        return None

    def _read(self, text: str, at: int) -> None:
        char = text[at]
        if self._in_string:
            if self._escaped:
                self._escaped = False
            elif char == "\\":
                self._escaped = True
            elif char == '"':
                self._in_string = False
            return
        if char == '"':
            self._in_string = True
        elif char in "[{":
            self._stack.append(_Frame(char, at + 1))
        elif char in "]}":
            if self._stack:
                self._stack.pop()
        elif char == "," and self._stack and self._stack[-1].kind == "[":
            frame = self._stack[-1]
            frame.items.append(text[frame.item_start : at].strip())
            frame.item_start = at + 1

    def _array_frame(self) -> _Frame | None:
        """The array whose item is being written: the innermost open container, or the
        one just outside an object being written as its item."""
        if not self._stack:
            return None
        if self._stack[-1].kind == "[":
            return self._stack[-1]
        if len(self._stack) > 1 and self._stack[-2].kind == "[":
            return self._stack[-2]
        return None

    def _complete(self, item: str) -> bool:
        """Whether ``item`` (the innermost array's item as written so far) is a whole
        value that cannot go on: a closed string, object or array (the array it belongs
        to is the innermost open container again). A number or a literal might go on."""
        closer = _CLOSERS.get(item[0])
        return (
            closer is not None
            and len(item) > 1
            and item.endswith(closer)
            and not self._in_string
            and bool(self._stack)
            and self._stack[-1].kind == "["
        )

    @staticmethod
    def _loops(frame: _Frame, item: str) -> bool:
        return frame.items.count(item) >= 2
