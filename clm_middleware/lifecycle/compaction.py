"""Applying decisions to the context: pending labels first, then the token budget.

A compaction changes what the context shows, which costs a re-prefill from the first
changed segment on, so it runs only when needed (see ``LifecycleConfig``):

1. every pending label takes effect: drop → DROPPED; compress → the compressor's
   result replaces the segment (COMPRESSED), or, if compression fails, the segment is
   kept and the failure recorded. Fact guard: a drop label on a segment that holds
   distinctive tokens (numbers, codes, names) is applied as a compression, which
   keeps them verbatim; only budget pressure (step 2) can drop such a segment;
2. if the prompt is still over the budget, candidates (visible, not pinned, older than
   the last ``protect_turns`` turns) are taken lowest eviction value first, oldest
   first among equals: a segment worth keeping in substance (distinctive tokens, or
   labelled compress) and long enough is compressed, anything else dropped, until the
   prompt is under the low-water mark; then compressed segments are dropped the same
   way if that was not enough;
3. if even that cannot fit the budget, ``ContextBudgetError`` says by how much.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

from clm_middleware.errors import ClmError
from clm_middleware.lifecycle.compressor import CompressionResult, Compressor
from clm_middleware.lifecycle.config import LifecycleConfig
from clm_middleware.lifecycle.distinctive import has_distinctive
from clm_middleware.lifecycle.rules import eviction_value
from clm_middleware.lifecycle.segments import DecidedBy, Decision, Label, Segment, Status

OVERHEAD_TOKENS_PER_SEGMENT = 8  # a marker, a separator, a share of message glue


class ContextBudgetError(ClmError, ValueError):
    """The newest turn alone does not fit the context budget."""


@dataclass(slots=True)
class CompactionResult:
    ran: bool = False
    reason: str = ""  # "pending" | "budget"
    removed: list[Segment] = field(default_factory=list)  # dropped or replaced this turn
    decisions: list[Decision] = field(default_factory=list)  # budget-forced
    dropped_tokens: int = 0
    compressed_tokens: int = 0  # tokens saved by compressions
    compressions: list[tuple[Segment, CompressionResult]] = field(default_factory=list)
    compression_s: float = 0.0


class Compactor:
    def __init__(self, config: LifecycleConfig, compressor: Compressor, prompt_length: Callable[[], int]) -> None:
        self.config = config
        self.compressor = compressor
        self.prompt_length = prompt_length  # renders the next prompt and counts it

    def run(self, segments: list[Segment], turn: int) -> CompactionResult:
        budget = self.config.budget
        length = self.prompt_length()
        over = budget is not None and length > budget
        pending = [s for s in segments if s.pending and not s.pinned]
        # what applying them would free: their ids plus marker / separator / glue (estimate)
        pending_saving = sum(len(s.visible_ids) + OVERHEAD_TOKENS_PER_SEGMENT for s in pending)
        result = CompactionResult()
        if not over and (not pending or pending_saving < self.config.min_reclaim_tokens):
            return result
        result.ran, result.reason = True, "budget" if over else "pending"
        for segment in pending:
            if segment.label is Label.DROP and not has_distinctive(segment.text):
                self._drop(segment, result)
            elif segment.status is Status.ACTIVE:
                # fact guard: a labelled drop never loses a distinctive token; the segment
                # is compressed instead (extractive compression keeps them verbatim)
                self._compress(segment, result)
            else:
                segment.label = Label.KEEP  # already compressed: keep the faithful summary
        if over:  # budget pressure: go down to the low-water mark, so the next turns fit too
            self._fit_budget(segments, turn, int(budget * self.config.low_water), result)
            length = self.prompt_length()
            if length > budget:
                raise ContextBudgetError(
                    f"the prompt needs {length} tokens after removing everything removable; the budget is {budget}",
                    hint="raise the budget, or send a shorter message",
                )
        return result

    def _fit_budget(self, segments: list[Segment], turn: int, target: int, result: CompactionResult) -> None:
        protected_from = turn - self.config.protect_turns + 1
        candidates = [s for s in segments if s.visible and not s.pinned and s.turn < protected_from]
        order = sorted(candidates, key=lambda s: (eviction_value(s, s.attention), s.turn, s.index))
        for segment in order:
            if self.prompt_length() <= target:
                return
            worth_keeping = has_distinctive(segment.text) or segment.label is Label.COMPRESS
            long_enough = len(segment.token_ids) >= self.config.compress_min_tokens
            if (
                segment.status is Status.ACTIVE
                and worth_keeping
                and long_enough
                and self._compress(segment, result, turn)
            ):
                continue
            self._drop(segment, result, turn)
        for segment in order:
            if self.prompt_length() <= target:
                return
            if segment.visible:
                self._drop(segment, result, turn)

    def _drop(self, segment: Segment, result: CompactionResult, forced_at: int | None = None) -> None:
        result.dropped_tokens += len(segment.visible_ids)
        segment.status = Status.DROPPED
        if forced_at is not None:
            self._record(segment, Label.DROP, forced_at, result)
        result.removed.append(segment)

    def _compress(self, segment: Segment, result: CompactionResult, forced_at: int | None = None) -> bool:
        tick = time.perf_counter()
        outcome = self.compressor.compress(segment)
        result.compression_s += time.perf_counter() - tick
        result.compressions.append((segment, outcome))
        if not outcome.ok:
            segment.label = Label.KEEP  # nothing is lost: the original stays in the context
            return False
        result.compressed_tokens += outcome.saved_tokens
        segment.status = Status.COMPRESSED
        segment.summary, segment.summary_ids, segment.summary_method = (
            outcome.text,
            outcome.token_ids,
            outcome.method,
        )
        if forced_at is not None:
            self._record(segment, Label.COMPRESS, forced_at, result)
        result.removed.append(segment)
        return True

    @staticmethod
    def _record(segment: Segment, label: Label, turn: int, result: CompactionResult) -> None:
        segment.label, segment.decided_by = label, DecidedBy.RULES
        result.decisions.append(Decision(turn, segment.id, label, DecidedBy.RULES, "budget"))
