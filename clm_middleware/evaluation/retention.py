"""``clm eval retention``: which facts survive in the final context, under each way of fitting a budget.

Variants, each replaying the same file teacher-forced on its own pool (same weights):
- ``clm:<tagging>``: the lifecycle layer with that tagging mode and the budget;
- ``truncate``: the newest messages that fit the budget;
- ``keep-all``: everything (``prefix`` mode, no budget): the ceiling.
A probe is retained when its answer string is in the variant's final context.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from clm_middleware.engine import Engine
from clm_middleware.evaluation.probes import Probe, retention, said_context
from clm_middleware.lifecycle.compressor import check_faithful
from clm_middleware.replay.report import ReplayReport
from clm_middleware.replay.runner import ReplayOptions, replay
from clm_middleware.replay.transcript import Transcript

KEEP_ALL = "keep-all"
TRUNCATE = "truncate"


@dataclass(slots=True)
class VariantResult:
    name: str
    retained: int
    probes: int
    lost: list[str]
    context_tokens: int  # of the final context
    prefill_tokens: int  # over the whole replay
    turn_s: float
    lifecycle_share: float | None = None
    observation_share: float | None = None
    invented: int = 0  # distinctive tokens in a compressed segment that its original lacks
    compressed_segments: int = 0
    reply_nll: float | None = None  # token-weighted mean over the replay's teacher-forced replies
    scored_tokens: int = 0  # the reply tokens reply_nll is the mean over (its weight when pooled)
    report: ReplayReport | None = field(default=None, repr=False)

    @property
    def share(self) -> float:
        return self.retained / self.probes if self.probes else 0.0

    def as_dict(self) -> dict[str, Any]:
        return {
            "variant": self.name,
            "retained": self.retained,
            "probes": self.probes,
            "retention": self.share,
            "lost": self.lost,
            "context_tokens": self.context_tokens,
            "prefill_tokens": self.prefill_tokens,
            "turn_s": self.turn_s,
            "lifecycle_share": self.lifecycle_share,
            "observation_share": self.observation_share,
            "invented": self.invented,
            "compressed_segments": self.compressed_segments,
            "reply_nll": self.reply_nll,
            "scored_tokens": self.scored_tokens,
        }


def run_variant(
    name: str,
    engine: Engine,
    transcripts: list[Transcript],
    probes: list[Probe],
    make_factory: Callable[[Engine, ReplayOptions, Any], Callable[[Transcript], Any]],
    lifecycle: Any,
    mode: str,
) -> VariantResult:
    options = ReplayOptions(mode=mode, teacher_force=True)
    report = ReplayReport(mode=mode, model=engine.model_name, settings={"variant": name})
    replay(transcripts, make_factory(engine, options, lifecycle), report, teacher_force=True)
    drivers = lifecycle.drivers  # one per conversation of the file: a fact counts where its conversation kept it
    retained, lost = retention(probes, said_context(drivers))
    totals = report.totals()
    result = VariantResult(
        name=name,
        retained=retained,
        probes=len(probes),
        lost=[p.answer for p in lost],
        context_tokens=sum(d.context_tokens for d in drivers),
        prefill_tokens=totals["prefill_tokens"],
        turn_s=totals["turn_s"],
        reply_nll=totals.get("reply_nll"),
        scored_tokens=sum(t.forced_tokens for t in report.turns if t.reply_nll is not None),
        report=report,
    )
    if mode == "clm":
        result.lifecycle_share = totals.get("lifecycle_share")
        phases = totals.get("lifecycle_phases") or {}
        result.observation_share = phases.get("observation_s", 0.0) / totals["turn_s"] if totals["turn_s"] else 0.0
        compressed = [s for c in lifecycle.conversations for s in c.segments if s.summary is not None]
        result.compressed_segments = len(compressed)
        result.invented = sum(len(check_faithful(s.text, s.summary).invented) for s in compressed)
    return result


def overall(per_file: Sequence[Sequence[VariantResult]]) -> list[VariantResult]:
    """One result per variant over every file: probes retained and tokens summed; shares of
    turn time weighted by each file's turn time (a long file weighs more, as its time does).

    ``per_file[i]`` lists the same variants in the same order for every file.
    """
    names = [r.name for r in per_file[0]]
    if any([r.name for r in results] != names for results in per_file):
        raise RuntimeError("every file must list the same variants in the same order")
    merged = []
    for column in zip(*per_file, strict=True):
        turn_s = sum(r.turn_s for r in column)
        merged.append(
            VariantResult(
                name=column[0].name,
                retained=sum(r.retained for r in column),
                probes=sum(r.probes for r in column),
                lost=[answer for r in column for answer in r.lost],
                context_tokens=sum(r.context_tokens for r in column),
                prefill_tokens=sum(r.prefill_tokens for r in column),
                turn_s=turn_s,
                lifecycle_share=_weighted(column, "lifecycle_share", turn_s),
                observation_share=_weighted(column, "observation_share", turn_s),
                invented=sum(r.invented for r in column),
                compressed_segments=sum(r.compressed_segments for r in column),
                reply_nll=_pooled_nll(column),
                scored_tokens=sum(r.scored_tokens for r in column),
            )
        )
    return merged


def _pooled_nll(column: Sequence[VariantResult]) -> float | None:
    """reply_nll over every file's scored reply tokens, as one replay of them all would give."""
    scored = [(r.reply_nll, r.scored_tokens) for r in column if r.reply_nll is not None and r.scored_tokens]
    tokens = sum(n for _, n in scored)
    return sum(nll * n for nll, n in scored) / tokens if tokens else None


def _weighted(column: Sequence[VariantResult], name: str, turn_s: float) -> float | None:
    values = [(getattr(r, name), r.turn_s) for r in column]
    if any(value is None for value, _ in values):
        return None
    return sum(value * seconds for value, seconds in values) / turn_s if turn_s else 0.0
