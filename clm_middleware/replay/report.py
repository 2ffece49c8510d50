"""The replay report: one record per turn, totals, and its JSON form.

Field names are a contract (scripts and later issues read them): new fields may be
added, none is renamed or removed. ``docs/report.md`` documents each one.
"""

from __future__ import annotations

import json
import os
import statistics
import tempfile
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

# the disk tier's totals, as ``cache.disk.DiskStats.as_dict`` names them (that module loads torch)
DISK_TOTALS = ("disk_hits", "disk_writes", "disk_skipped_writes", "disk_corrupt", "disk_evicted_files", "disk_errors")
ON_ERROR = ("stop", "skip")  # what a failing turn does to a replay (``replay_interleaved``)


@dataclass(slots=True)
class TurnRecord:
    turn: int  # 1-based over the whole replay
    conversation_id: str
    prompt_tokens: int  # tokens in the prompt of this turn
    cached_tokens: int  # served from the block pool
    prefill_tokens: int  # computed this turn (prompt_tokens - cached_tokens)
    context_tokens: int  # what the model sees this turn (the prompt; after a compaction ahead, the compacted context)
    generated_tokens: int
    ttft_s: float
    turn_s: float
    bookkeeping_s: float  # pool overhead: hash + match + gather + store
    reply: str  # assistant text of the turn, generated or forced
    arena_s: float = 0.0  # allocating the turn's working cache (0 when a spare was reused)
    pool_blocks_in_use: int = 0
    kv_bytes: int = 0  # pool bytes holding data after the turn (in use + cached)
    working_kv_bytes: int = 0  # the turn's own attention cache at its end
    live_kv_bytes: int = 0  # pool bytes the conversation needs to continue at full speed
    decode_s: float = 0.0  # generated: seconds after the reply's first token (0 when teacher-forced)
    forced_tokens: int = 0  # teacher-forced: the transcript's reply, computed after the prompt
    approximate_tokens: int = 0  # of cached_tokens, reused approximately (--approximate-reuse)
    ahead_tokens: int = 0  # --compact-ahead: computed after the reply for the next turn (docs/report.md)
    ahead_prefill_tokens: int = 0  # of ahead_tokens, computed (the rest served from the pool)
    reply_nll: float | None = None  # teacher-forced: mean -log p per token of the reply given this prompt
    reply_flags: list[str] = field(default_factory=list)  # generated: protocol_artifact | repetition_loop | empty
    extra: dict[str, Any] = field(default_factory=dict)  # fields added by other modes

    def as_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data.update(data.pop("extra"))
        return data


@dataclass(frozen=True, slots=True)
class Failure:
    """A turn that failed under ``--on-error skip`` (``turn`` and ``conversation_id`` set),
    or a transcript record that could not be read (both ``None``; ``error`` says where)."""

    error: str
    turn: int | None = None
    conversation_id: str | None = None

    def as_dict(self) -> dict[str, Any]:
        return {"turn": self.turn, "conversation_id": self.conversation_id, "error": self.error}


@dataclass(slots=True)
class ReplayReport:
    mode: str
    model: str
    turns: list[TurnRecord] = field(default_factory=list)
    settings: dict[str, Any] = field(default_factory=dict)
    complete: bool = True  # False when the replay was interrupted
    wall_s: float = 0.0
    extra: dict[str, Any] = field(default_factory=dict)
    # the engine's ``DiskStats.as_dict``; zeros until they are read (a run that loaded no engine)
    disk_stats: dict[str, int] = field(default_factory=lambda: dict.fromkeys(DISK_TOTALS, 0))
    # what --on-error skip went past, in order; ``turns`` holds only the answered turns, so
    # every total and percentile is over turns that ran (turn numbers count failed turns too)
    failures: list[Failure] = field(default_factory=list)

    def totals(self) -> dict[str, Any]:
        """Token totals count every call of a turn: its prompt, and what it computed ahead
        for the next turn (``ahead_tokens``), so the hit rate is what the pool served of
        all the tokens the turns needed."""
        from clm_middleware.lifecycle.turn import token_totals

        turns = self.turns
        prompt, cached, prefill = token_totals(turns)
        turn_s = sum(t.turn_s for t in turns)
        bookkeeping = sum(t.bookkeeping_s for t in turns)
        arena = sum(t.arena_s for t in turns)
        ttfts = [t.ttft_s for t in turns]
        return {
            "turns": len(turns),
            "conversations": len({t.conversation_id for t in turns}),
            "prompt_tokens": prompt,
            "cached_tokens": cached,
            "approximate_tokens": sum(t.approximate_tokens for t in turns),
            "prefill_tokens": prefill,
            "ahead_tokens": sum(t.ahead_tokens for t in turns),
            "ahead_prefill_tokens": sum(t.ahead_prefill_tokens for t in turns),
            "generated_tokens": sum(t.generated_tokens for t in turns),
            "forced_tokens": sum(t.forced_tokens for t in turns),
            **quality_totals(turns),
            "hit_rate": cached / prompt if prompt else 0.0,
            "ttft_s": sum(ttfts),
            "ttft_p50_s": percentile(ttfts, 50),
            "ttft_p95_s": percentile(ttfts, 95),
            "decode_tokens_per_s": decode_rate(turns),
            "turn_s": turn_s,
            "bookkeeping_s": bookkeeping,
            "bookkeeping_share": bookkeeping / turn_s if turn_s else 0.0,
            "arena_s": arena,
            "arena_share": arena / turn_s if turn_s else 0.0,
            "peak_kv_bytes": max((t.live_kv_bytes + t.working_kv_bytes for t in turns), default=0),
            "peak_pool_bytes": max((t.kv_bytes for t in turns), default=0),
            "final_context_tokens": turns[-1].context_tokens if turns else 0,
            "max_context_tokens": max((t.context_tokens for t in turns), default=0),
            "max_pool_blocks_in_use": max((t.pool_blocks_in_use for t in turns), default=0),
            "wall_s": self.wall_s,
            "failed_turns": sum(f.turn is not None for f in self.failures),
            "skipped_records": sum(f.turn is None for f in self.failures),
            **self.disk_stats,
            **lifecycle_totals(turns, self.mode),
        }

    def as_dict(self) -> dict[str, Any]:
        data: dict[str, Any] = {
            "mode": self.mode,
            "model": self.model,
            "complete": self.complete,
            "settings": self.settings,
            "turns": [turn.as_dict() for turn in self.turns],
            "failures": [failure.as_dict() for failure in self.failures],
            "totals": self.totals(),
        }
        data["final_context"] = ""  # a run that set no conversation up: the model saw nothing
        data.update(self.extra)
        return data

    def write(self, path: str | Path) -> None:
        """Write the JSON atomically: a reader never sees half a report."""
        write_json_atomic(Path(path), self.as_dict())


def decode_rate(turns: list[TurnRecord]) -> float:
    """Generated tokens per second after each reply's first token, over the turns that
    generated more than one (0.0 when none did: teacher-forced replays decode nothing)."""
    decoding = [t for t in turns if t.generated_tokens > 1 and t.decode_s > 0]
    seconds = sum(t.decode_s for t in decoding)
    return sum(t.generated_tokens - 1 for t in decoding) / seconds if seconds else 0.0


def quality_totals(turns: list[TurnRecord]) -> dict[str, Any]:
    """Reply quality over the turns: ``reply_nll`` (token-weighted mean over teacher-forced
    turns, None without any), ``reply_flags`` (count per flag over generated turns),
    ``flagged_replies`` and ``generated_replies``."""
    scored = [t for t in turns if t.reply_nll is not None and t.forced_tokens]
    weight = sum(t.forced_tokens for t in scored)
    generated = [
        t
        for t in turns
        if not t.forced_tokens and t.reply_nll is None and not (t.extra.get("unanswered") or t.extra.get("empty_reply"))
    ]
    return {
        "reply_nll": sum(t.reply_nll * t.forced_tokens for t in scored) / weight if weight else None,
        "reply_flags": _count(flag for turn in generated for flag in turn.reply_flags),
        "flagged_replies": sum(bool(t.reply_flags) for t in generated),
        "generated_replies": len(generated),
    }


def lifecycle_totals(turns: list[TurnRecord], mode: str = "clm") -> dict[str, Any]:
    """Totals of the fields the ``clm`` mode adds (zeros when no turn ran: a report of the
    mode always has them); empty for other modes."""
    managed = [t.extra for t in turns if "decisions" in t.extra]
    if not managed and mode != "clm":
        return {}
    from clm_middleware.lifecycle.turn import PHASES, sum_decision_counts

    turn_s = sum(t.turn_s for t in turns)
    lifecycle_s = sum(e["lifecycle_s"] for e in managed)
    parsed = [e["parse_ok"] for e in managed if e.get("parse_ok") is not None]
    modes: dict[str, int] = {}
    for extra in managed:
        modes[extra["tagging_mode"]] = modes.get(extra["tagging_mode"], 0) + 1
    summaries = [s for e in managed for s in e["summaries"]]
    return {
        "decisions": sum_decision_counts([e["decisions"] for e in managed]),
        "dropped_tokens": sum(e["dropped_tokens"] for e in managed),
        "compressed_tokens": sum(e["compressed_tokens"] for e in managed),
        "summaries": len([s for s in summaries if s["ok"]]),
        "summaries_failed": len([s for s in summaries if not s["ok"]]),
        "summary_methods": _count(s["method"] for s in summaries if s["ok"]),
        "lifecycle_s": lifecycle_s,
        "lifecycle_share": lifecycle_s / turn_s if turn_s else 0.0,
        "lifecycle_phases": {p: sum(e["lifecycle_phases"].get(p, 0.0) for e in managed) for p in PHASES},
        "tagging_modes": modes,
        "parse_rate": sum(parsed) / len(parsed) if parsed else None,
        "parse_attempts": len(parsed),
        "compactions": _count(e["compaction"] for e in managed if e["compaction"]),
        # how often the context changed (each change re-prefills from its first changed token)
        "compactions_per_10_turns": 10 * sum(1 for e in managed if e["compaction"]) / len(managed) if managed else 0.0,
        # of the prompt tokens over the turns, the digest's (the rest: system block, verbatim messages)
        "digest_share": _digest_share(turns),
    }


def _digest_share(turns: list[TurnRecord]) -> float:
    prompt = sum(t.prompt_tokens for t in turns)
    return sum(t.extra.get("digest_tokens", 0) for t in turns) / prompt if prompt else 0.0


def _count(values: Any) -> dict[str, int]:
    counts: dict[str, int] = {}
    for value in values:
        counts[value] = counts.get(value, 0) + 1
    return counts


def percentile(values: list[float], q: float) -> float:
    if not values:
        return 0.0
    if len(values) == 1:
        return values[0]
    return statistics.quantiles(values, n=100, method="inclusive")[int(q) - 1]


def write_json_atomic(path: Path, data: Any) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    descriptor, temporary = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(descriptor, "w", encoding="utf-8") as handle:
            json.dump(data, handle, indent=2, ensure_ascii=False)
            handle.write("\n")
        os.chmod(temporary, 0o666 & ~_umask())  # as open() would create it: mkstemp's is owner-only
        os.replace(temporary, path)
    except BaseException:
        Path(temporary).unlink(missing_ok=True)
        raise


def _umask() -> int:
    mask = os.umask(0o022)  # reading the process's umask means setting it: put it back at once
    os.umask(mask)
    return mask
