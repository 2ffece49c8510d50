"""What one turn returns: the reply, the decisions taken, and what the turn cost."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from typing import Any

from clm_middleware.lifecycle.segments import DecidedBy, Decision, Label, SegmentId

PHASES = ("tagging_s", "parsing_s", "compaction_s", "compression_s", "restore_s", "observation_s")


def decision_counts(decisions: list[Decision]) -> dict[str, Any]:
    """``{"keep": n, "compress": n, "drop": n, "by_source": {source: {label: n}}}``."""
    counts: dict[str, Any] = {label.value: 0 for label in Label}
    by_source = {source.value: {label.value: 0 for label in Label} for source in DecidedBy}
    for decision in decisions:
        counts[decision.label.value] += 1
        by_source[decision.decided_by.value][decision.label.value] += 1
    counts["by_source"] = by_source
    return counts


def token_totals(turns: Iterable[Any]) -> tuple[int, int, int]:
    """Prompt, cached and prefill tokens over ``turns`` (``TurnStats``, or the replay
    report's records): each turn's prompt and what it computed ahead for the next turn
    (``ahead_tokens``), so cached ÷ prompt is what the pool served of every token the
    turns needed."""
    prompt = cached = prefill = 0
    for turn in turns:
        prompt += turn.prompt_tokens + turn.ahead_tokens
        cached += turn.cached_tokens + turn.ahead_tokens - turn.ahead_prefill_tokens
        prefill += turn.prefill_tokens + turn.ahead_prefill_tokens
    return prompt, cached, prefill


def sum_decision_counts(counts: list[dict[str, Any]]) -> dict[str, Any]:
    """Add up ``decision_counts`` results."""
    total = decision_counts([])
    for count in counts:
        for label in Label:
            total[label.value] += count.get(label.value, 0)
        for source, labels in (count.get("by_source") or {}).items():
            for label, number in labels.items():
                total["by_source"][source][label] += number
    return total


@dataclass(slots=True)
class TurnStats:
    turn: int
    prompt_tokens: int = 0
    cached_tokens: int = 0
    approximate_tokens: int = 0  # of cached_tokens, reused approximately (Engine(blend=...))
    prefill_tokens: int = 0
    context_tokens: int = 0
    digest_tokens: int = 0  # of prompt_tokens, the digest message's (0 before anything is folded)
    generated_tokens: int = 0
    forced_tokens: int = 0  # teacher-forced: the given reply, computed after the prompt
    # of prompt_tokens, the reply's given opening (respond(reply_prefix=...): a required
    # tool call's head, a JSON object's "{"): part of the answer, not of the messages
    prefix_tokens: int = 0
    ttft_s: float = 0.0
    decode_s: float = 0.0  # generating the reply after its first token
    turn_s: float = 0.0
    bookkeeping_s: float = 0.0
    arena_s: float = 0.0
    tagging_mode: str = ""  # which source decided: free | constrained | signals | rules
    protocol_context: bool = False  # the prompt carried the protocol and segment markers
    parse_ok: bool | None = None
    decisions: dict[str, Any] = field(default_factory=dict)
    dropped_tokens: int = 0
    compressed_tokens: int = 0
    summaries: list[dict[str, Any]] = field(default_factory=list)
    restored: list[SegmentId] = field(default_factory=list)
    compaction: str = ""  # "" | "pending" | "budget" | "ahead" | "budget+ahead"
    # compact_ahead: what this turn computed into the pool after its reply for the next
    # one (the compacted context and the next message's opening after a compaction ahead,
    # else the opening alone; tokens, and of those computed rather than served); not in
    # prompt_tokens, which stay the reply's prompt; totals and hit rates count them
    ahead_tokens: int = 0
    ahead_prefill_tokens: int = 0
    lifecycle_s: float = 0.0
    phases: dict[str, float] = field(default_factory=lambda: dict.fromkeys(PHASES, 0.0))
    pool_blocks_in_use: int = 0
    conversation_blocks: int = 0  # blocks this conversation holds: its context chain
    reclaimer_blocks: int = 0  # blocks held for segments that left the context
    extra_calls: int = 0  # engine calls besides the reply (constrained labels, probes, summaries)
    reply_nll: float | None = None  # teacher-forced: mean -log p per token of the forced reply, given this prompt
    reply_flags: list[str] = field(default_factory=list)  # generated: protocol_artifact | repetition_loop | empty

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> TurnStats:
        """Stats as ``as_dict`` gave them (a store's row); fields this version does not
        know are left out, fields it added since take their defaults."""
        known = cls.__dataclass_fields__
        return cls(**{name: value for name, value in values.items() if name in known})


@dataclass(slots=True)
class Reply:
    """The answer of one turn. ``text`` never contains the lifecycle block."""

    text: str
    turn: int
    segment_id: SegmentId | None
    decisions: list[Decision]
    stats: TurnStats
    finish_reason: str | None = None
