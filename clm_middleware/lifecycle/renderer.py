"""Segments → prompt token ids, append-only, with the position of every segment.

Layout::

    system header | protocol prompt ⏎⏎ first system message | system footer
    system header | Notes from earlier turns: ⏎ line ⏎ line ... | system footer       the digest
    <role> header | [seg_i] ids(seg_i) sep [seg_j] ids(seg_j) ... | <role> footer     per message
    ...
    assistant header [seg_k]                                                          generation prompt

The digest holds the messages before ``fold`` (budget pressure folds the oldest ones,
condensed): one line per message with visible content, its segments joined by spaces
(by a newline before and after a fenced code block, which opens and closes a line of
its own, and a block a reply left open closed after it), no chat glue and no markers.
It only grows at its end, so folding more messages keeps the digest's own earlier lines
cached.

Separators (the whitespace before a segment, as written): a segment that a space
separated from the previous one usually carries that space in its first token (``ĠI``,
see ``ChatFormat.encode_after_space``); then only the rest of the separator (a second
space, the newline and indentation before ``- item``) is added, as its own ids. Those
ids, and a separator's ids before a segment that carries no space, are what the whole
message tokenizes them to (``\n\n`` before a word is two ``Ċ``), so a message shown whole
has the ids of the whole message tokenized at once, as the bare model would see it. A
message's leading whitespace is the first segment's separator, rendered only while that
segment is shown; its trailing whitespace ends its last segment.

Prefix stability: every piece is a cached token sequence (glue, separators, markers)
or a segment's own ids (tokenized once; a generated reply as its text tokenizes, which
the generated ids are unless the model spelled a word another way).
So the prompt of turn t+1 starts with the prompt of turn t plus its reply, unless a
segment changed; a change at segment i leaves every token before i untouched.
Markers appear only where the protocol needs them (tagging modes that ask the model
to label), and never in the system message, which is pinned. A message whose
segments are all dropped is left out whole; one sent empty (no segments at all) is an
empty turn, header and footer, as the chat template renders it.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

import regex

from clm_middleware.lifecycle.segmenter import has_code_block, unclosed_fence
from clm_middleware.lifecycle.segments import MessageRecord, Segment, SegmentId
from clm_middleware.render import ChatFormat
from clm_middleware.render.chat_format import FOLLOWING_READ

SYSTEM_JOIN = "\n\n"  # between a system block's preamble (tools section, protocol) and the system message
DIGEST_TITLE = "Notes from earlier turns:"


@dataclass(slots=True)
class RenderedContext:
    token_ids: list[int]
    spans: dict[SegmentId, tuple[int, int]] = field(default_factory=dict)  # visible content ids
    context_tokens: int = 0  # without the generation prompt
    message_spans: dict[int, tuple[int, int]] = field(default_factory=dict)
    digest_tokens: int = 0  # the digest message's, header to footer (0: no digest)

    def segment_blocks(self, segment: SegmentId, block_size: int) -> range:
        """Indices of the blocks that hold any of the segment's tokens."""
        start, end = self.spans[segment]
        return range(start // block_size, (end - 1) // block_size + 1) if end > start else range(0)


class ContextRenderer:
    def __init__(self, chat_format: ChatFormat, *, preamble: str | None, markers: bool) -> None:
        self.format = chat_format
        self.markers = markers
        self.preamble_ids = chat_format.encode(preamble) if preamble else []
        self._ids_cache: dict[str, list[int]] = {}
        self.tool_role = "tool" if chat_format.supports_role("tool") else "user"

    def marker_ids(self, segment: SegmentId) -> list[int]:
        return self._encoded(f"[{segment}] ")

    def render(
        self,
        messages: Sequence[MessageRecord],
        segments: dict[SegmentId, Segment],
        *,
        reply_id: SegmentId | None = None,
        for_generation: bool = True,
        fold: int = 0,
    ) -> RenderedContext:
        ids: list[int] = []
        rendered = RenderedContext(token_ids=ids)
        system_first = bool(messages) and messages[0].role == "system"
        visible = [segments[s] for s in messages[0].segment_ids if segments[s].visible] if system_first else []
        # a system message that left the context (forgotten) takes its turn with it, as any
        # message does: the start is the chat template's own without a system message; one
        # sent empty is an empty system turn, as the template renders it
        sent_empty = system_first and not messages[0].segment_ids
        if self.preamble_ids or visible or sent_empty:
            glue = self.format.glue["system"]
            ids.extend(glue.header_ids)
            ids.extend(self.preamble_ids)
            if visible:
                if self.preamble_ids:
                    shown = visible[0].visible_text  # after its separator, when the message's first shows
                    first = visible[0].separator + shown if visible[0].id == messages[0].segment_ids[0] else shown
                    ids.extend(system_join_ids(self.format, first))
                self._segments(ids, rendered, visible, messages[0].segment_ids[0])
            ids.extend(glue.footer_ids)
        else:
            ids.extend(self.format.start_ids(None))
        body = messages[1:] if system_first else messages
        folded = _folded(messages, fold)
        self._digest(ids, rendered, folded, segments)
        for message in body[len(folded) :]:
            visible = [segments[s] for s in message.segment_ids if segments[s].visible]
            if not visible and message.segment_ids:  # all of it left the context: so does its turn
                continue
            # a message sent empty (an assistant turn that only called tools, a tool that
            # printed nothing) is an empty turn, as the chat template renders it
            role = self.tool_role if message.role == "tool" else message.role
            glue = self.format.glue[role]
            begin = len(ids)
            ids.extend(glue.header_ids)
            self._segments(ids, rendered, visible, message.segment_ids[0] if visible else None)
            ids.extend(glue.footer_ids)
            rendered.message_spans[message.index] = (begin, len(ids))
        rendered.context_tokens = len(ids)
        if for_generation:
            ids.extend(self.format.generation_prompt_ids)
            if reply_id is not None and self.markers:
                ids.extend(self.marker_ids(reply_id))
        return rendered

    def _digest(
        self, ids: list[int], rendered: RenderedContext, folded: list[MessageRecord], segments: dict[SegmentId, Segment]
    ) -> None:
        lines = _digest_segments(folded, segments)
        if not lines:
            return
        glue = self.format.glue["system"]
        begin = len(ids)
        ids.extend(glue.header_ids)
        ids.extend(self._encoded(DIGEST_TITLE))
        for line in lines:
            ids.extend(self._encoded("\n"))
            for position, segment in enumerate(line):
                if position and (
                    has_code_block(segment.visible_text) or has_code_block(line[position - 1].visible_text)
                ):
                    ids.extend(self._encoded("\n"))  # a fence opens and closes a line of its own
                elif position and not self.format.leads_with_space(segment.visible_ids):
                    ids.extend(self._encoded(" "))
                start = len(ids)
                ids.extend(segment.visible_ids)
                rendered.spans[segment.id] = (start, len(ids))
                if (fence := unclosed_fence(segment.visible_text)) is not None:
                    ids.extend(self._encoded("\n" + fence))  # a reply cut inside its code: the next lines are no code
        ids.extend(glue.footer_ids)
        rendered.digest_tokens = len(ids) - begin

    def text(self, token_ids: Iterable[int]) -> str:
        return self.format.tokenizer.decode(list(token_ids), skip_special_tokens=False)

    def _segments(
        self, ids: list[int], rendered: RenderedContext, visible: list[Segment], first: SegmentId | None
    ) -> None:
        """``visible`` segments of one message; ``first`` is the message's first segment,
        whose separator (the message's leading whitespace) shows only while it does."""
        for position, segment in enumerate(visible):
            spaced = self.format.leads_with_space(segment.visible_ids)
            separator, merged = segment.separator, spaced  # merged: its last space is in the first token
            if not position:
                separator = separator if segment.id == first else ""
            elif self.markers:
                separator, merged = separator or " ", False  # whole, before the marker
            # no marker: a segment glued to the one before (Chinese "。然后", "pas.Bien") stays glued
            run, after = (separator[:-1], " a") if merged and separator.endswith(" ") else (separator, "a")
            marker = []
            if self.markers and segment.role != "system":
                marker = self._encoded(f"[{segment.id}]") if spaced else self.marker_ids(segment.id)
            if not position and ids and run:
                # a message's leading whitespace joins the newline before it, as in the template's text
                joined = self.format.whitespace_run_ids(ids[-1], run, [*marker, *segment.visible_ids[:FOLLOWING_READ]])
                if joined is not None:
                    ids[-1:] = joined
                    run = ""
            if run:  # with merged, the last space is inside the segment's first token
                ids.extend(self.format.separator_ids(run, after=after))
            ids.extend(marker)
            start = len(ids)
            ids.extend(segment.visible_ids)
            rendered.spans[segment.id] = (start, len(ids))

    def _encoded(self, text: str) -> list[int]:
        cached = self._ids_cache.get(text)
        if cached is None:
            cached = self._ids_cache[text] = self.format.encode(text)
        return cached


def system_join_ids(chat_format: ChatFormat, content: str) -> list[int]:
    """``SYSTEM_JOIN``'s ids before a system message's ``content``, as the template's one
    string tokenizes them (SmolLM2: ``Ċ`` ``Ċ`` before a word, not the ``ĊĊ`` it reads
    alone; ``ĊĊ`` ``Ċ`` before ``\nYou``): only the content's leading whitespace and
    first word can merge with it."""
    return chat_format.separator_ids(SYSTEM_JOIN, after=_HEAD.match(content).group() or "a")


_HEAD = regex.compile(r"\s*\S{0,16}")


def _digest_segments(folded: Sequence[MessageRecord], segments: Mapping[SegmentId, Segment]) -> list[list[Segment]]:
    """The digest's lines: per folded message, its visible segments (none: no line)."""
    lines = [[segments[s] for s in m.segment_ids if segments[s].visible] for m in folded]
    return [line for line in lines if line]


def digest_lines(messages: Sequence[MessageRecord], segments: Mapping[SegmentId, Segment], fold: int) -> list[str]:
    """The text of the digest's lines (``ContextRenderer.render`` with ``fold``): what a
    reply that reads the notes back copies."""
    lines = _digest_segments(_folded(messages, fold), segments)
    return [" ".join(s.visible_text.strip() for s in line) for line in lines]


def _folded(messages: Sequence[MessageRecord], fold: int) -> list[MessageRecord]:
    """The messages the digest holds: those before ``fold``, but a leading system message."""
    body = messages[1:] if messages and messages[0].role == "system" else messages
    return [m for m in body if m.index < fold]
