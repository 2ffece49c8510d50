"""Applying decisions to the context: pending labels first, then the token budget.

A compaction changes what the context shows, which costs a re-prefill from the first
changed segment on, so it runs only when needed (see ``LifecycleConfig``):

1. every pending label takes effect (with a budget, only once the prompt is over it,
   and only on messages already folded into the digest: the messages after the fold
   stay as said; without one, only the labels the model gave itself, its
   ``[LIFECYCLE]`` block or its logits over the labels, once they would free
   ``min_reclaim_tokens``; labels read from its signals or given by rules are no
   choice of the model's, and with no budget nothing needs the room, so they never
   apply: a signals drop of "Tell me a joke." had left its answer after "What is my
   name?"): drop → DROPPED; compress → the compressor's result replaces the
   segment (COMPRESSED), or, if compression fails, the segment is kept and the
   failure recorded. Fact guard: a drop label on a segment that holds
   distinctive tokens (numbers, codes, names) is applied as a compression, which
   keeps them verbatim; only budget pressure (step 2) can drop such a segment.
   Question guard: a drop label on a question the user asked waits for budget
   pressure too (a common question is predictable, never content-free: the
   reply after it answers it, and without it the context shows two replies in a row);
2. if the prompt was over the budget, the oldest messages (older than the last
   ``protect_turns`` exchanges: an exchange ends at an assistant message, so a history
   sent in one call has the exchanges it would have had turn by turn; while tool
   results come in, the exchange their user request opened is kept too, if it fits, and
   that request stays whole in any case: ``Compactor._fit_budget``) are folded, in
   order, into the digest (see renderer.py): a segment with facts (distinctive
   tokens), or a request of the user or a tool in plain words ("a cheap place in the
   north"), is condensed by a faithful compression;
   any other segment is dropped, and so is one every word of substance of which the
   digest already says, a condensed request left with no content word ("perfect,
   that works"), and a reply whose facts the digest already holds (unless the user
   accepted that reply, see acceptance.py), until the prompt is under the low-water
   mark or the messages after the fold hold ``recent_share`` of the budget. The
   messages after the fold are never touched: room comes from the digest, where a
   segment all of whose facts segments of no lower eviction value state is dropped
   (no fact is lost), then condensed segments are tightened to their facts
   (distinctive tokens and words the model found rare; a request in plain words to
   its ``REQUEST_WORDS`` most surprising words; the model's replies first, oldest
   first), and then segments without facts are dropped lowest eviction value first
   (replies rank below what the user and tools said, and the replies the user did not
   accept below those they did), oldest first among equals; requests in plain words
   count as facts here while they take at most ``request_share`` of the budget (the
   most surprising first: what the user said once in passing, "kiwi", "cheap"). If that is not
   enough, folding goes on until the messages after the fold hold half of
   ``recent_share``, the digest makes room again, and then gives up facts too, down to
   halfway between the low-water mark and the budget (a segment of facts at least
   ``MIN_TRIM_TOKENS`` long whose drop would free over twice what is still needed, a
   pasted log or email, is trimmed to what fits instead: its facts first, then the words
   the model found most surprising); only then does folding go on
   to the protected exchange. A reply dropped from between two user messages would
   show the model another conversation than the one it is in, and the next reply
   depends most on the last turns as they were said. Two exceptions: a tool's result
   among the verbatim messages is data, not wording, so folding goes on to the
   protected exchange before any fact is given up; and when the protected exchange
   alone outgrows the low-water mark (a long tool result), facts go only to fit the
   budget, since the next turn folds that exchange anyway. A tool exchange kept whole
   that does not fit after all is undone before it is folded (``_Snapshot``): what it
   dropped to make room for itself comes back;
3. if the newest exchange alone still outgrows the budget, its own long segments are
   cut by what is needed, fillers first, or condensed (faithfully) where a cut would
   keep less (``_shorten_newest``), as a last resort, and then a tool's result in it that
   condensing cannot shorten enough is trimmed to what fits (an agent cannot send a
   shorter result): JSON to its leading items, plain text to its leading whole lines
   or sentences (a tool's records, never condensed word by word: ``record_text``); if
   even that cannot fit the budget, ``ContextBudgetError`` says by how much. A newest
   exchange over ``budget × target_ratio`` tokens is refused at once, before any of
   this work (bounded cost).
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

from clm_middleware.errors import ContextBudgetError
from clm_middleware.lifecycle.acceptance import accepted_replies
from clm_middleware.lifecycle.checkpoint import TurnCheckpoint
from clm_middleware.lifecycle.compressor import (
    TIGHTENED,
    CompressionResult,
    Compressor,
    check_faithful,
    content_words,
    has_content_words,
)
from clm_middleware.lifecycle.config import LifecycleConfig
from clm_middleware.lifecycle.distinctive import distinctive_tokens, has_distinctive, missing_from
from clm_middleware.lifecycle.record_text import is_plain_records
from clm_middleware.lifecycle.rules import eviction_value
from clm_middleware.lifecycle.segments import DecidedBy, Decision, Label, MessageRecord, Segment, SegmentId, Status
from clm_middleware.render.tool_calls import OPEN as TOOL_CALL_OPEN

MODEL_DECIDED = frozenset({DecidedBy.MODEL, DecidedBy.CONSTRAINED})  # labels that apply without a budget

OVERHEAD_TOKENS_PER_SEGMENT = 8  # a marker, a separator, a share of message glue
# pass 4 trims a segment of facts instead of dropping it whole when it is this long and
# more than twice what is still needed: a pasted log or email keeps what fits
MIN_TRIM_TOKENS = 64
PACE_TURNS = 4  # the pace of a conversation: tokens per turn over its last complete turns
MIN_CONDENSE_TOKENS = 8  # shorter fact segments are kept whole: a compression would save next to nothing
DIGEST_GLUE_TOKENS = 1  # a digest line's newline, or the space between two segments of one message


def _carries_facts(segment: Segment) -> bool:
    return segment.kind != "ack" and segment.label is not Label.DROP and has_distinctive(segment.text)


def calls_a_tool(segment: Segment) -> bool:
    """A reply that calls a tool: dropped once folded, so it never vouches for a fact
    in pass 2 (the user's "my user ID is mia_li_3668" went as restated by a call)."""
    return segment.role == "assistant" and TOOL_CALL_OPEN in segment.text


def _plain_request(segment: Segment) -> bool:
    """A request in words of substance and no distinctive token ("a cheap place in the north")."""
    return _states_a_request(segment) and not _carries_facts(segment) and has_content_words(segment.visible_text)


def _states_a_request(segment: Segment) -> bool:
    """What the user or a tool said in words of substance, with no distinctive token
    ("a cheap place in the north"): condensed to its most informative words (or kept,
    when short) rather than dropped. Acknowledgements and what the labeller dropped
    as short and predictable are not requests."""
    return segment.role in ("user", "tool") and segment.kind != "ack" and segment.label is not Label.DROP


def _said_per_turn(
    history: Sequence[MessageRecord],
    segments: Mapping[SegmentId, Segment],
    first: int,
    last: int,
    roles: tuple[str, ...] | None = None,
) -> dict[int, tuple[int, int]]:
    """Turn → (tokens said in it as first said, each segment with its glue; messages),
    over turns ``first``..``last`` (from turn 1), of ``roles`` (None: every role).
    Walks back from the newest message and stops at the first older turn."""
    first = max(1, first)
    said: dict[int, tuple[int, int]] = {}
    for message in reversed(history):
        if message.turn < first:
            break
        if message.turn > last or (roles is not None and message.role not in roles):
            continue
        tokens, messages = said.get(message.turn, (0, 0))
        tokens += sum(len(segments[s].token_ids) + OVERHEAD_TOKENS_PER_SEGMENT for s in message.segment_ids)
        said[message.turn] = (tokens, messages + 1)
    return said


def condensable_tokens(budget: int, target_ratio: float) -> int:
    """The most tokens of a person's new message that can be condensed to fit ``budget``
    (extractive compression keeps at least 1/``target_ratio`` of a text)."""
    return int(budget * target_ratio)


def too_long_to_condense(size: str, budget: int, target_ratio: float) -> ContextBudgetError:
    """The refusal of a new message of ``size`` (its tokens, or what its characters
    show) over ``condensable_tokens``."""
    return ContextBudgetError(
        f"the new message has {size}; under a budget of {budget} none over {condensable_tokens(budget, target_ratio)} "
        f"(the budget × the compression target_ratio, {target_ratio:g}) is condensed (and one under it only as far "
        "as its facts allow: a log or code, all names and numbers, hardly shrinks)",
        hint="raise the budget, or send the text in parts",
    )


@dataclass(slots=True)
class CompactionResult:
    ran: bool = False
    reason: str = ""  # "pending" | "budget"
    removed: list[Segment] = field(default_factory=list)  # dropped or replaced this turn
    decisions: list[Decision] = field(default_factory=list)  # budget-forced
    dropped_tokens: int = 0
    compressed_tokens: int = 0  # tokens saved by compressions
    compressions: list[tuple[Segment, CompressionResult]] = field(default_factory=list)  # incl. tightenings
    compression_s: float = 0.0
    fold: int = 0  # messages before this index are rendered in the digest


@dataclass(frozen=True, slots=True)
class _Snapshot:
    """What a compaction attempt may change, to undo it: the live segments' state and the
    fold (``TurnCheckpoint``), and the lengths of the result's append-only records."""

    checkpoint: TurnCheckpoint
    removed: int
    decisions: int
    compressions: int
    dropped_tokens: int
    compressed_tokens: int

    @classmethod
    def of(
        cls,
        messages: Sequence[MessageRecord],
        segments: Mapping[SegmentId, Segment],
        fold: int,
        result: CompactionResult,
    ) -> _Snapshot:
        return cls(
            TurnCheckpoint.take((segments[s] for m in messages for s in m.segment_ids), fold),
            len(result.removed),
            len(result.decisions),
            len(result.compressions),
            result.dropped_tokens,
            result.compressed_tokens,
        )

    def restore(self, segments: Mapping[SegmentId, Segment], result: CompactionResult) -> int:
        """Put the segments and ``result`` back as they were; returns the fold then."""
        self.checkpoint.restore(segments)
        del result.removed[self.removed :], result.decisions[self.decisions :]
        del result.compressions[self.compressions :]
        result.dropped_tokens, result.compressed_tokens = self.dropped_tokens, self.compressed_tokens
        result.fold = self.checkpoint.fold
        return self.checkpoint.fold


class Compactor:
    def __init__(self, config: LifecycleConfig, compressor: Compressor, prompt_length: Callable[[int], int]) -> None:
        self.config = config
        self.compressor = compressor
        self._length = prompt_length  # renders the next prompt with a given fold and counts it
        self._fold = 0
        self._history: Sequence[MessageRecord] = []
        # the user request a running tool exchange answers (``_open_request``), and its
        # segments, which a budget compaction keeps whole even once folded, as pinned
        # ones; set per compaction
        self._request: MessageRecord | None = None
        self._kept: frozenset[SegmentId] = frozenset()

    def prompt_length(self) -> int:
        return self._length(self._fold)

    def run(
        self,
        messages: Sequence[MessageRecord],
        segments: Mapping[SegmentId, Segment],
        turn: int,
        fold: int,
        history: Sequence[MessageRecord] | None = None,
        headroom: int = 0,
    ) -> CompactionResult:
        """``messages``: the live messages, in order (``Conversation.live_messages``): a
        message with nothing shown, pending or removed within K rounds cannot change a
        compaction, so over a long history the work follows the context. ``history``:
        every message (whose ``index`` is its position), for what depends on neighbours
        (which reply the next message accepts); ``messages`` when None.

        ``headroom`` > 0: a compaction ahead of the next turn, run after a reply (see
        ``LifecycleConfig.compact_ahead``): the prompt counts as over the budget once it
        and ``headroom`` tokens are; it never condenses the newest exchange and never
        raises, since the next turn's own compaction still can."""
        self._fold = fold
        self._history = messages if history is None else history
        self._request = self._open_request(
            self._exchange_start(self.config.protect_turns, turn - self.config.protect_turns + 1)
        )
        self._kept = frozenset(self._request.segment_ids) if self._request is not None else frozenset()
        budget = self.config.budget
        ordered = [segments[s] for m in messages for s in m.segment_ids]
        newest = self._exchange_start(1, turn)
        ahead = headroom > 0
        if budget is not None and not ahead:
            self._check_condensable(ordered, newest, budget)
        length = self.prompt_length()
        over = budget is not None and length + headroom > budget
        pending = [s for s in ordered if s.pending and not s.pinned and s.id not in self._kept]
        if budget is None:  # the model's own labels only (module docstring)
            pending = [s for s in pending if s.decided_by in MODEL_DECIDED]
        if not over:  # question guard (module docstring): only budget pressure drops one
            pending = [s for s in pending if not (s.label is Label.DROP and asks(s))]
        else:  # the verbatim messages stay as said: their labels wait until they are folded
            pending = [s for s in pending if s.message_index < fold]
        # what applying them would free: their ids plus marker / separator / glue (estimate)
        pending_saving = sum(len(s.visible_ids) + OVERHEAD_TOKENS_PER_SEGMENT for s in pending)
        result = CompactionResult(fold=fold)
        # under a budget the context changes only when it must: until then the model sees
        # what the bare model would (no re-prefill, no lost turn); without one, the model's
        # own labels are the only way the context shrinks, so they apply once they free enough
        if not over and (budget is not None or not pending or pending_saving < self.config.min_reclaim_tokens):
            return result
        result.ran, result.reason = True, ("ahead" if ahead else "budget") if over else "pending"
        for segment in pending:
            if segment.label is Label.DROP and not has_distinctive(segment.text):
                self._drop(segment, result)
            elif segment.status is Status.ACTIVE:
                # fact guard: a labelled drop never loses a distinctive token; the segment
                # is compressed instead (extractive compression keeps them verbatim)
                self._compress(segment, result)
            else:
                segment.label = Label.KEEP  # already compressed: keep the faithful summary
        if over and not ahead and self._irreducible_length(messages, segments, newest) > budget:
            # the newest exchange alone outgrows the budget (a long tool result): it is made
            # to fit first, down to the low-water mark, so the user's facts keep their room
            # (dropped first, every one went for a result then trimmed far below the budget)
            self._condense_newest(ordered, newest, turn, budget, result)
            mark = self.low_water_mark(budget, segments, turn)
            self._trim_newest_tool_results(
                ordered,
                newest,
                turn,
                lambda: self._irreducible_length(messages, segments, newest) - mark,
                result,
            )
        if over:  # budget pressure: go down to the low-water mark, so the next turns fit too
            condense = None if ahead else lambda: self._condense_newest(ordered, newest, turn, budget, result)
            self._fit_budget(messages, segments, turn, budget, result, condense)
            if ahead:
                return result
            if self.prompt_length() > budget:
                self._condense_newest(ordered, newest, turn, budget, result)
            if self.prompt_length() > budget:
                self._trim_newest_tool_results(ordered, newest, turn, lambda: self.prompt_length() - budget, result)
            length = self.prompt_length()
            if length > budget:
                pinned = sum(len(s.token_ids) for s in ordered if s.pinned and s.visible and s.role != "system")
                held = f"; {pinned} of them are in pinned segments, which never leave" if pinned else ""
                raise ContextBudgetError(
                    f"the prompt needs {length} tokens after removing everything removable and condensing the newest "
                    f"messages as far as their facts allow{held}; the budget is {budget}",
                    hint="raise the budget, or send a shorter message"
                    + (", or forget() a pinned segment" if pinned else ""),
                )
        return result

    def _check_condensable(self, ordered: list[Segment], newest_from: int, budget: int) -> None:
        """Bounded cost for oversized input: a newest exchange (the messages from index
        ``newest_from`` on) longer than ``budget × target_ratio`` tokens cannot be
        condensed to fit (extractive compression keeps at least 1/``target_ratio`` of a
        text, plus its facts), so it is refused before any work: a 10,000-token paste
        never costs minutes of scoring only to fail. Counts what a person wrote: a tool's
        result, of any size, is trimmed to fit instead (``_trim_newest_tool_results``;
        an agent cannot send it in parts)."""
        newest = sum(
            len(s.token_ids)
            for s in ordered
            if s.message_index >= newest_from and s.visible and not s.pinned and s.role != "tool"
        )
        if newest > condensable_tokens(budget, self.config.target_ratio):
            raise too_long_to_condense(f"{newest} tokens", budget, self.config.target_ratio)

    def _fit_budget(
        self,
        messages: Sequence[MessageRecord],
        segments: Mapping[SegmentId, Segment],
        turn: int,
        budget: int,
        result: CompactionResult,
        condense_newest: Callable[[], None] | None = None,
    ) -> None:
        """Down to the low-water mark, keeping the newest exchanges verbatim. A tool result
        continues the exchange its user request opened: the request, the calls and the
        results before it stay verbatim (without them the model reads a result with no
        question, and answered "The tool is a tool that helps you find…"), the newest
        exchange condensed if need be (``condense_newest``), unless that exchange cannot
        fit the budget; then only the newest exchange is kept, as for any other message
        (a long agent loop folds its older calls and results), and the request stays whole
        as a line of the digest (folding oldest first, it went first: an agent loop kept
        its calls and results and lost "tell me where the otters sleep at night")."""
        protected_from = self._exchange_start(self.config.protect_turns, turn - self.config.protect_turns + 1)
        if self._request is not None:  # it opened the exchange: it comes before protected_from
            before = _Snapshot.of(messages, segments, self._fold, result)
            self._fold_down(messages, segments, turn, budget, self._request.index, result)
            if self.prompt_length() > budget and condense_newest is not None:
                condense_newest()
            if self.prompt_length() <= budget:
                return
            # the exchange does not fit: what this attempt dropped to make room for it
            # (the user's facts, down to fact_target) is given back before folding it
            self._fold = before.restore(segments, result)
        self._fold_down(messages, segments, turn, budget, protected_from, result)

    def _fold_down(
        self,
        messages: Sequence[MessageRecord],
        segments: Mapping[SegmentId, Segment],
        turn: int,
        budget: int,
        protected_from: int,
        result: CompactionResult,
    ) -> None:
        target = self.low_water_mark(budget, segments, turn)
        body = messages[1:] if messages and messages[0].role == "system" else messages
        accepted = accepted_replies(self._history, among=messages)
        # facts are dropped only down to halfway between the configured mark and the
        # budget, wherever the pace puts the target; and only to fit the budget when what
        # cannot go (the newest exchange: a long tool result) alone outgrows the mark: the
        # next turn folds that exchange anyway, so the room would buy nothing
        fact_target = (int(budget * self.config.low_water) + budget) // 2
        if self._irreducible_length(messages, segments, protected_from) > target:
            fact_target = budget
        # the messages after the fold stay verbatim, whole and in order (a reply dropped
        # from between two user messages reads as another conversation): room comes from
        # the digest (passes 2-4 over what is folded) while the verbatim messages hold
        # recent_share of the budget (or all of the target, if that is less), then half
        # of that, without losing a fact; then facts in the digest go, down to
        # fact_target; only then does folding go on to the protected exchange
        # — unless a tool's result is among the verbatim messages: it is data, not the
        # conversation's wording, and the digest condenses it without losing a fact, so
        # folding goes on before any fact is given up (a 384-token user record outlived
        # the user's own id, phone and date)
        wide = self._recent_floor(budget, segments, turn)
        no_fact_lost = sys.maxsize  # a prompt length never reached: pass 4 keeps every fact
        for step in range(4):  # floor None: no further folding this round
            floor, keep_facts_under = (
                (wide, no_fact_lost),
                (wide // 2, no_fact_lost),
                (0, no_fact_lost) if self._tool_result_unfolded(segments, protected_from) else (None, fact_target),
                (0, fact_target),
            )[step]
            if floor is not None:
                self._fold_oldest(body, segments, accepted, protected_from, target, floor, turn, result)
                if self.prompt_length() <= target:
                    return
            folded = self._older(body, segments, min(protected_from, self._fold))
            self._reduce(messages, segments, folded, protected_from, accepted, target, keep_facts_under, turn, result)
            if self.prompt_length() <= target:
                return

    def _tool_result_unfolded(self, segments: Mapping[SegmentId, Segment], protected_from: int) -> bool:
        """Whether a tool's result shows verbatim between the fold and ``protected_from``."""
        return any(
            message.role == "tool" and any(segments[s].visible for s in message.segment_ids)
            for message in self._history[self._fold :]
            if message.index < protected_from
        )

    def _irreducible_length(
        self, messages: Sequence[MessageRecord], segments: Mapping[SegmentId, Segment], protected_from: int
    ) -> int:
        """The prompt's length with everything a budget compaction may remove before
        ``protected_from`` gone (rendered, then put back)."""
        body = messages[1:] if messages and messages[0].role == "system" else messages
        removable = self._older(body, segments, protected_from)
        statuses = [segment.status for segment in removable]
        try:
            for segment in removable:
                segment.status = Status.DROPPED
            return self.prompt_length()
        finally:
            for segment, status in zip(removable, statuses, strict=True):
                segment.status = status

    def _recent_floor(self, budget: int, segments: Mapping[SegmentId, Segment], turn: int) -> int:
        """Tokens the verbatim window holds at least while the digest can make room."""
        return min(int(budget * self.config.recent_share), self.low_water_mark(budget, segments, turn))

    @staticmethod
    def _verbatim_tokens(message: MessageRecord, segments: Mapping[SegmentId, Segment]) -> int:
        """What ``message`` shows, plus its glue (estimate)."""
        shown = sum(len(segments[s].visible_ids) for s in message.segment_ids if segments[s].visible)
        return shown + OVERHEAD_TOKENS_PER_SEGMENT

    def low_water_mark(self, budget: int, segments: Mapping[SegmentId, Segment], turn: int) -> int:
        """Where a budget compaction brings the prompt: room for ``room_turns`` turns at
        the pace of the last ``PACE_TURNS`` complete ones, at most ``low_water`` of the
        budget and at least ``min_low_water`` of it (or ``low_water``, if lower); see
        ``LifecycleConfig``."""
        high = int(budget * self.config.low_water)
        if not self.config.room_turns:
            return high
        low = int(budget * min(self.config.min_low_water, self.config.low_water))
        return max(low, min(high, budget - self.config.room_turns * self._pace(segments, turn)))

    @staticmethod
    def next_messages_tokens(history: Sequence[MessageRecord], segments: Mapping[SegmentId, Segment], turn: int) -> int:
        """What the next turn will likely add before its reply: the most tokens the user
        and tools said in one of the last ``PACE_TURNS`` turns up to ``turn`` (plus
        glue). Reads the newest messages only."""
        said = _said_per_turn(history, segments, turn - PACE_TURNS + 1, turn, roles=("user", "tool"))
        return max((tokens + messages * OVERHEAD_TOKENS_PER_SEGMENT for tokens, messages in said.values()), default=0)

    def _pace(self, segments: Mapping[SegmentId, Segment], turn: int) -> int:
        """Tokens per turn said in the last ``PACE_TURNS`` complete turns (before
        ``turn``), as first said: what the next turns will likely add. Reads the newest
        messages only."""
        said = _said_per_turn(self._history, segments, turn - PACE_TURNS, turn - 1)
        return sum(tokens for tokens, _ in said.values()) // len(said) if said else 0

    def _exchange_start(self, exchanges: int, first_turn: int) -> int:
        """Index of the first message of the ``exchanges`` newest exchanges, the messages
        protected from compaction. An exchange ends at an assistant message, so a history
        added in one call (a client re-sending a whole chat to a fresh conversation, a
        few-shot prompt) is split into the exchanges it would have had sent turn by turn,
        and only its newest message(s) are protected, not all of it. Never before the
        first message of turn ``first_turn``: a conversation built turn by turn protects
        exactly its newest turns. Walks back over the protected messages only."""
        history = self._history
        start = history[0].index if history else 0
        seen = 0
        for position in range(len(history) - 1, 0, -1):
            if history[position - 1].role == "assistant":
                seen += 1
                if seen == exchanges:
                    start = history[position].index
                    break
        turn_start = history[-1].index + 1 if history else 0
        for message in reversed(history):
            if message.turn < first_turn:
                break
            turn_start = message.index
        return max(start, turn_start)

    def _open_request(self, protected_from: int) -> MessageRecord | None:
        """The user message whose exchange the message at ``protected_from`` (a tool result)
        continues: back over tool results and the assistant messages that called for
        them; None if that is no tool result or no user message opened it. Walks back
        from the newest message over the protected ones and the exchange only."""
        history = self._history
        position = len(history) - 1
        while position >= 0 and history[position].index > protected_from:
            position -= 1
        if position < 0 or history[position].index != protected_from or history[position].role != "tool":
            return None
        position -= 1
        while position >= 0 and (
            history[position].role == "tool"
            or (history[position].role == "assistant" and history[position + 1].role == "tool")
        ):
            position -= 1
        return history[position] if position >= 0 and history[position].role == "user" else None

    def _older(
        self, body: Sequence[MessageRecord], segments: Mapping[SegmentId, Segment], protected_from: int
    ) -> list[Segment]:
        """Visible, unpinned segments of the messages before index ``protected_from``, in
        order, but those kept whole (``_kept``)."""
        older = [segments[s] for m in body for s in m.segment_ids]
        return [
            s
            for s in older
            if s.visible and not s.pinned and s.id not in self._kept and s.message_index < protected_from
        ]

    def _reduce(
        self,
        messages: Sequence[MessageRecord],
        segments: Mapping[SegmentId, Segment],
        candidates: list[Segment],
        protected_from: int,
        accepted: frozenset[int],
        target: int,
        fact_target: int,
        turn: int,
        result: CompactionResult,
    ) -> None:
        """Passes 2-4 over ``candidates``, until the prompt is under ``target``; what
        carries facts only until it is under ``fact_target``."""
        visible = [segments[s] for m in messages for s in m.segment_ids if segments[s].visible]
        values = {
            s.id: (
                float("inf")  # stays whatever happens
                if s.message_index >= protected_from or s.pinned or s.id in self._kept
                else eviction_value(s, s.attention, accepted=s.message_index in accepted)
            )
            for s in visible
        }
        if self._drop_restated(candidates, visible, values, target, turn, result):
            return
        # Pass 3: tighten condensed segments to their facts, the model's own replies
        # first (they restate or invent), oldest first.
        for segment in sorted(candidates, key=lambda s: (s.role != "assistant", s.turn, s.index)):
            if self.prompt_length() <= target:
                return
            if segment.status is Status.COMPRESSED and segment.summary_method != TIGHTENED:
                self._tighten(segment, result)
        # Pass 4: real loss. Lowest eviction value first, oldest first among equals. A
        # segment that carries facts is dropped only down to fact_target: some slack is
        # kept, so the re-prefill after a compaction does not come back every turn, but
        # not at the price of every fact the mark would cost. So are the plain-word
        # requests within request_share of the budget, the model's most surprising first.
        requests = self._held_requests(candidates)
        for segment in sorted(candidates, key=lambda s: (values[s.id], s.turn, s.index)):
            length = self.prompt_length()
            if length <= target:
                return
            if length <= fact_target and (_carries_facts(segment) or segment.id in requests):
                continue
            if self._trimmed(segment, length - target, result, turn):
                continue
            self._drop(segment, result, turn)

    def _trimmed(self, segment: Segment, excess: int, result: CompactionResult, turn: int) -> bool:
        """Trim ``segment`` by ``excess`` tokens instead of dropping it, when it carries facts,
        is at least ``MIN_TRIM_TOKENS`` long and more than twice ``excess``: the prompt then
        lands at the mark, not hundreds of tokens under it with the whole text gone."""
        shown = len(segment.visible_ids)
        if not _carries_facts(segment) or shown < MIN_TRIM_TOKENS or shown <= 2 * excess:
            return False
        tick = time.perf_counter()
        outcome = self.compressor.trim(segment, shown - excess - OVERHEAD_TOKENS_PER_SEGMENT)
        result.compression_s += time.perf_counter() - tick
        if not outcome.ok:
            return False
        result.compressions.append((segment, outcome))
        self._apply_compression(segment, outcome, result, turn)
        return True

    def _held_requests(self, candidates: list[Segment]) -> set[SegmentId]:
        """The plain-word requests among ``candidates`` that pass 4 keeps like facts: the
        highest peak self-information first (what the model could not have guessed:
        "clarinet", "bishops stortford"; newest first among equals), while they take at
        most ``request_share`` of the budget. A user's preferences and plans are facts
        in plain words, but a long chat's every sentence is a "request" too: the share
        keeps their fragments from crowding out the verbatim messages."""
        room = int((self.config.budget or 0) * self.config.request_share)
        held: set[SegmentId] = set()
        for segment in sorted(
            (s for s in candidates if _plain_request(s)), key=lambda s: (-s.peak_surprisal, -s.turn, -s.index)
        ):
            cost = len(segment.visible_ids) + DIGEST_GLUE_TOKENS
            if cost <= room:
                held.add(segment.id)
                room -= cost
        return held

    def _fold_oldest(
        self,
        body: Sequence[MessageRecord],
        segments: Mapping[SegmentId, Segment],
        accepted: frozenset[int],
        protected_from: int,
        target: int,
        recent_floor: int,
        turn: int,
        result: CompactionResult,
    ) -> None:
        """Pass 1, oldest message first: fold it into the digest. What carries facts, and
        what the user or a tool asked for, is condensed by a faithful compression; the
        rest is dropped, and so is what the digest already says. Nothing that matters is
        lost yet, and the newest turns stay verbatim the longest: folding stops once the
        verbatim messages after the fold would hold fewer than ``recent_floor`` tokens."""
        # the messages not folded yet, dead ones included (the fold moves over them too);
        # over a long history they are few: what was folded is behind ``self._fold``
        first = 1 if self._history and self._history[0].role == "system" else 0
        unfolded = self._history[max(self._fold, first) :]
        tail_tokens = {}  # message index → verbatim tokens of it and every later message
        running = 0
        for message in reversed(unfolded):
            running += self._verbatim_tokens(message, segments)
            tail_tokens[message.index] = running
        digest_text = " ".join(
            segments[s].visible_text.casefold()
            for m in body
            if m.index < self._fold
            for s in m.segment_ids
            if segments[s].visible
        )
        digest_words = content_words(digest_text)
        for message in unfolded:
            if message.index >= protected_from or self.prompt_length() <= target:
                break
            later = tail_tokens.get(message.index + 1, 0)
            if later < recent_floor:
                break
            for segment in (segments[s] for s in message.segment_ids):
                if not segment.visible or segment.pinned or segment.id in self._kept:
                    continue
                if calls_a_tool(segment):
                    # machinery, not something said: a digest line of a raw call (one cut
                    # off at max_tokens too) is one more the model would imitate; its
                    # result, folded after it, holds what the call found
                    self._drop(segment, result, turn, reason="a tool call, folded")
                    continue
                facts = _carries_facts(segment)
                if not facts and not _states_a_request(segment):
                    self._drop(segment, result, turn)
                    continue
                if segment.status is Status.ACTIVE and len(segment.token_ids) >= MIN_CONDENSE_TOKENS:
                    self._compress(segment, result, turn)
                condensed = segment.visible_text.casefold()
                if segment.message_index in accepted:
                    digest_text += " " + condensed  # the agreed state: what it restates goes first
                    digest_words |= content_words(condensed)
                elif condensed in digest_text or not content_words(condensed) - digest_words:
                    # word for word, or every word of substance of it, the digest says already
                    self._drop(segment, result, turn, reason="duplicate of the digest")
                elif not facts and not has_content_words(segment.visible_text):
                    self._drop(segment, result, turn, reason="no content words")
                elif segment.role == "assistant" and not missing_from(
                    distinctive_tokens(segment.visible_text), digest_text
                ):
                    # a reply that only repeats facts the digest already holds
                    self._drop(segment, result, turn, reason="facts already in the digest")
                else:
                    digest_text += " " + condensed
                    digest_words |= content_words(condensed)
            self._fold = result.fold = message.index + 1

    def _drop_restated(
        self,
        candidates: list[Segment],
        visible: list[Segment],
        values: dict[SegmentId, float],
        target: int,
        turn: int,
        result: CompactionResult,
    ) -> bool:
        """Pass 2: drop what the rest of the context says already: a segment every fact of
        which segments of no lower eviction value state (an offer its confirmation
        repeats), oldest first. No fact is lost, now or when pass 4 goes on. True once
        the prompt is under ``target``; dropped segments leave ``candidates``."""
        for segment in list(candidates):
            facts = distinctive_tokens(segment.visible_text)
            floor = values[segment.id]
            rest = " ".join(
                s.visible_text
                for s in visible
                if s is not segment and s.visible and values[s.id] >= floor and not calls_a_tool(s)
            )
            if facts and not missing_from(facts, rest):
                self._drop(segment, result, turn, reason="facts stated elsewhere in the context")
                candidates.remove(segment)
                if self.prompt_length() <= target:
                    return True
        return False

    def _condense_newest(
        self, ordered: list[Segment], newest_from: int, turn: int, budget: int, result: CompactionResult
    ) -> None:
        """Last resort for a new message that alone outgrows the budget: condense it
        (faithfully: every distinctive token stays), longest segment first, a question the
        user asks last (it is what the reply must answer). The segments are scored in one
        forward, in order, before the first is condensed. A tool's records in plain text
        are left whole for ``_trim_newest_tool_results``: cut word by word, a timetable's
        times lose their flights."""
        limit = condensable_tokens(budget, self.config.target_ratio)  # a tool result past it is trimmed, not scored
        newest = [
            s
            for s in ordered
            if s.message_index >= newest_from
            and s.visible
            and s.status is Status.ACTIVE
            and not s.pinned
            # a tool's records in plain text are trimmed whole (record_text), not cut word by word
            and not (s.role == "tool" and (len(s.token_ids) > limit or is_plain_records(s.text)))
        ]
        self.compressor.score_in_order(newest)
        for segment in sorted(newest, key=lambda s: (asks(s), -len(s.token_ids))):
            excess = self.prompt_length() - budget
            if excess <= 0:
                return
            if len(segment.token_ids) >= MIN_CONDENSE_TOKENS:
                self._shorten_newest(segment, excess, result, turn)

    def _shorten_newest(self, segment: Segment, excess: int, result: CompactionResult, turn: int) -> None:
        """Cut a new message's ``segment`` by ``excess`` tokens, its least informative words
        first (``Compressor.trim``: facts, and the words that bound them, last), where that
        keeps more of it than condensing would, and every fact; else condense it. A
        message one token over the budget loses a filler, not "after" from "leaving after
        19:30" or "one child aged seven". Like ``_compress``, a failure keeps the original."""
        room = len(segment.visible_ids) - excess
        tick = time.perf_counter()
        framed = segment.role == "user"  # what the user asks of a paste goes last (framing.py)
        cut = self.compressor.trim(segment, room, framed=framed) if room > 0 else None
        if cut is not None and cut.ok and len(cut.token_ids) > room:  # words counted alone tokenize a little apart
            cut = self.compressor.trim(segment, 2 * room - len(cut.token_ids), framed=framed)
        condensed = self.compressor.compress(segment)
        result.compression_s += time.perf_counter() - tick
        usable = (
            cut is not None
            and cut.ok
            and len(cut.token_ids) <= room
            and not (condensed.ok and len(cut.token_ids) <= len(condensed.token_ids))
            and check_faithful(segment.text, cut.text).faithful  # every fact, as condensing keeps them
        )
        chosen = cut if usable and cut is not None else condensed
        result.compressions.append((segment, chosen))
        if not chosen.ok:
            segment.label = Label.KEEP  # nothing is lost: the original stays in the context
            return
        self._apply_compression(segment, chosen, result, turn)

    def _trim_newest_tool_results(
        self,
        ordered: list[Segment],
        newest_from: int,
        turn: int,
        excess_of: Callable[[], int],
        result: CompactionResult,
    ) -> None:
        """Very last resort: a tool's result in the newest exchange that condensing cannot
        bring under the budget (every token a fact: flight numbers, times, prices) is
        trimmed to what fits (``Compressor.trim``: its leading items or records whole),
        longest result first. Facts of it go; the alternative was no reply at all (an
        agent cannot send a shorter message, and a replay of its trace stopped there). A
        user's own message is never trimmed: its sender can shorten it, and the error
        says so."""
        results = [
            s for s in ordered if s.message_index >= newest_from and s.role == "tool" and s.visible and not s.pinned
        ]
        for segment in sorted(results, key=lambda s: -len(s.visible_ids)):
            excess = excess_of()  # tokens still to go
            if excess <= 0:
                return
            room = len(segment.visible_ids) - excess - OVERHEAD_TOKENS_PER_SEGMENT
            if room <= 0:
                continue
            tick = time.perf_counter()
            outcome = self.compressor.trim(segment, room)
            result.compression_s += time.perf_counter() - tick
            if outcome.ok:
                result.compressions.append((segment, outcome))
                self._apply_compression(segment, outcome, result, turn)

    def _drop(
        self, segment: Segment, result: CompactionResult, forced_at: int | None = None, reason: str = "budget"
    ) -> None:
        result.dropped_tokens += len(segment.visible_ids)
        segment.status = Status.DROPPED
        if forced_at is not None:
            self._record(segment, Label.DROP, forced_at, result, reason)
        if segment not in result.removed:
            result.removed.append(segment)

    def _compress(self, segment: Segment, result: CompactionResult, forced_at: int | None = None) -> bool:
        tick = time.perf_counter()
        outcome = self.compressor.compress(segment)
        result.compression_s += time.perf_counter() - tick
        result.compressions.append((segment, outcome))
        if not outcome.ok:
            segment.label = Label.KEEP  # nothing is lost: the original stays in the context
            return False
        self._apply_compression(segment, outcome, result, forced_at)
        return True

    def _apply_compression(
        self, segment: Segment, outcome: CompressionResult, result: CompactionResult, forced_at: int | None
    ) -> None:
        """Show ``outcome``, a compression or a trim that succeeded, in place of ``segment``."""
        result.compressed_tokens += outcome.saved_tokens
        segment.status = Status.COMPRESSED
        segment.summary, segment.summary_ids, segment.summary_method = (
            outcome.text,
            outcome.token_ids,
            outcome.method,
        )
        if forced_at is not None:
            self._record(segment, Label.COMPRESS, forced_at, result)
        if segment not in result.removed:
            result.removed.append(segment)

    def _tighten(self, segment: Segment, result: CompactionResult) -> None:
        tick = time.perf_counter()
        outcome = self.compressor.tighten(segment)
        result.compression_s += time.perf_counter() - tick
        if outcome.ok:
            result.compressed_tokens += outcome.saved_tokens
            segment.summary, segment.summary_ids, segment.summary_method = (
                outcome.text,
                outcome.token_ids,
                outcome.method,
            )
            result.compressions.append((segment, outcome))  # saved and reported like any compression

    @staticmethod
    def _record(segment: Segment, label: Label, turn: int, result: CompactionResult, reason: str = "budget") -> None:
        segment.label, segment.decided_by = label, DecidedBy.RULES
        result.decisions.append(Decision(turn, segment.id, label, DecidedBy.RULES, reason))


def asks(segment: Segment) -> bool:
    """A question the user asked (the segmenter's kind; see the question guard)."""
    return segment.role == "user" and segment.kind == "question"
