"""``clm eval answers``: ask each probe of a variant's final context, and see what the model answers.

Retention (the answer string is still in the context) is a proxy; this measures what it
stands for. After a replay, each probe question is appended to the final context as a
user message, followed by the generation prompt::

    context ids | message_ids("user", question) | generation prompt | answer ...

and two things are read from that prompt:
- ``gold_mean_logprob``: the mean per-token log-probability of the gold answer as the
  start of the reply (the best over ``probe.answers``, so a shorter spelling is not
  penalised for its length);
- ``hit``: the greedy reply (``max_answer_tokens`` at most) contains an answer, ignoring
  case and runs of whitespace.

``gap_closed`` places a clm variant between the two baselines on mean gold log-likelihood:
0 is truncation, 1 is keeping everything.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from clm_middleware.engine import Engine
from clm_middleware.evaluation.probes import Probe, said_context
from clm_middleware.evaluation.retention import VariantResult
from clm_middleware.evaluation.retention import overall as replay_overall
from clm_middleware.render import ChatFormat

MAX_ANSWER_TOKENS = 32  # a planted fact fits in a sentence; longer replies only cost decode time
_FLAT_GAP = 1e-6  # nats: below this keep-all and truncate score alike, and a ratio means nothing


@dataclass(frozen=True, slots=True)
class ProbeAnswer:
    question: str
    answer: str
    gold_mean_logprob: float  # nats per token, best over the probe's spellings
    greedy_answer: str
    hit: bool  # the greedy answer contains an accepted spelling
    retained: bool  # an accepted spelling is in the final context (the retention proxy)

    def as_dict(self) -> dict[str, Any]:
        return {
            "question": self.question,
            "answer": self.answer,
            "gold_mean_logprob": self.gold_mean_logprob,
            "greedy_answer": self.greedy_answer,
            "hit": self.hit,
            "retained": self.retained,
        }


@dataclass(slots=True)
class AnswersResult:
    """One variant: its final context, every probe asked of it, and the replay's own
    figures (``replay``: retention, ``reply_nll``, lifecycle share, invented tokens), so a
    run reports the answers beside what they are a measure of."""

    name: str
    context_tokens: int
    answers: list[ProbeAnswer] = field(default_factory=list)
    gap_closed: float | None = None  # clm variants only; see close_gaps
    replay: VariantResult | None = None

    @property
    def probes(self) -> int:
        return len(self.answers)

    @property
    def hits(self) -> int:
        return sum(a.hit for a in self.answers)

    @property
    def retained(self) -> int:
        return sum(a.retained for a in self.answers)

    @property
    def mean_gold_logprob(self) -> float | None:
        if not self.answers:
            return None
        return sum(a.gold_mean_logprob for a in self.answers) / len(self.answers)

    def as_dict(self) -> dict[str, Any]:
        return {
            "variant": self.name,
            "context_tokens": self.context_tokens,
            "probes": self.probes,
            "retained": self.retained,
            "hits": self.hits,
            "mean_gold_logprob": self.mean_gold_logprob,
            "gap_closed": self.gap_closed,
            "replay": None if self.replay is None else self.replay.as_dict(),
            "answers": [a.as_dict() for a in self.answers],
        }


def question_prompt(chat_format: ChatFormat, context_ids: Sequence[int], question: str) -> list[int]:
    """``context | user question | generation prompt``: the prompt a next turn asking ``question`` sends."""
    return [
        *context_ids,
        *chat_format.message_ids("user", chat_format.encode(question)),
        *chat_format.generation_prompt_ids,
    ]


def gold_mean_logprob(engine: Engine, prompt: Sequence[int], answers_ids: Sequence[Sequence[int]]) -> float:
    """The best mean per-token log-probability of any of ``answers_ids`` right after ``prompt``."""
    spellings = [list(ids) for ids in answers_ids if ids]
    if not spellings:
        raise ValueError("answers_ids: every spelling encodes to no tokens")
    totals = engine.score(prompt, spellings)
    return max(total / len(ids) for total, ids in zip(totals, spellings, strict=True))


def contains_answer(text: str, answers: Sequence[str]) -> bool:
    """Any of ``answers`` occurs in ``text``, ignoring case and how whitespace runs."""
    folded = _fold(text)
    return any(needle and needle in folded for needle in map(_fold, answers))


def ask(
    engine: Engine,
    chat_format: ChatFormat,
    context_ids: Sequence[int],
    context_text: str,
    probe: Probe,
    *,
    max_answer_tokens: int = MAX_ANSWER_TOKENS,
) -> ProbeAnswer:
    prompt = question_prompt(chat_format, context_ids, probe.question)
    # Generate first: it stores the prompt's full blocks, so scoring then prefills only the tail.
    greedy = engine.generate(prompt, max_new_tokens=max_answer_tokens, use_pool=True).result()
    logprob = gold_mean_logprob(engine, prompt, [chat_format.encode(a) for a in probe.answers])
    return ProbeAnswer(
        question=probe.question,
        answer=probe.answer,
        gold_mean_logprob=logprob,
        greedy_answer=greedy.text.strip(),
        hit=contains_answer(greedy.text, probe.answers),
        retained=probe.retained_in(context_text),
    )


def answer_variant(
    name: str,
    engine: Engine,
    driver: Any,
    probes: Sequence[Probe],
    *,
    max_answer_tokens: int = MAX_ANSWER_TOKENS,
    replay: VariantResult | None = None,
) -> AnswersResult:
    """Ask every probe of ``driver``'s final context (any replay driver: it has ``context_ids``)."""
    chat_format = ChatFormat.from_tokenizer(engine.tokenizer)
    context_ids, context_text = driver.context_ids, said_context([driver])
    result = AnswersResult(name=name, context_tokens=len(context_ids), replay=replay)
    for probe in probes:
        result.answers.append(
            ask(engine, chat_format, context_ids, context_text, probe, max_answer_tokens=max_answer_tokens)
        )
    return result


def gap_closed(value: float | None, truncate: float | None, keep_all: float | None) -> float | None:
    """``(value - truncate) / (keep_all - truncate)``; None when undefined, when the baselines
    tie, or when keep-all scores below truncation (a small model can do worse on the long
    context): then there is no gap from truncation up to keep-all to close."""
    if value is None or truncate is None or keep_all is None or keep_all - truncate < _FLAT_GAP:
        return None
    return (value - truncate) / (keep_all - truncate)


def close_gaps(results: Sequence[AnswersResult], *, truncate: str, keep_all: str) -> None:
    """Set ``gap_closed`` on every ``clm:`` variant from the two baselines among ``results``;
    without both baselines (one failed) it stays None."""
    by_name = {r.name: r for r in results}
    if truncate not in by_name or keep_all not in by_name:
        return
    low, high = by_name[truncate].mean_gold_logprob, by_name[keep_all].mean_gold_logprob
    for result in results:
        if result.name.startswith("clm"):
            result.gap_closed = gap_closed(result.mean_gold_logprob, low, high)


def _fold(text: str) -> str:
    return " ".join(text.split()).casefold()


def overall(per_file: Sequence[Sequence[AnswersResult]], *, truncate: str, keep_all: str) -> list[AnswersResult]:
    """One result per variant over every file: all probes pooled (so the mean gold logp is a
    mean over probes, not over files), context tokens summed, and ``gap_closed`` computed
    from the pooled means, not averaged from the files' own ratios. The replay figures pool
    as ``clm eval retention`` pools them."""
    merged = [
        AnswersResult(
            name=column[0].name,
            context_tokens=sum(r.context_tokens for r in column),
            answers=[a for r in column for a in r.answers],
        )
        for column in zip(*per_file, strict=True)
    ]
    if all(r.replay is not None for results in per_file for r in results):
        replays = replay_overall([[r.replay for r in results if r.replay is not None] for results in per_file])
        for result, pooled in zip(merged, replays, strict=True):
            result.replay = pooled
    close_gaps(merged, truncate=truncate, keep_all=keep_all)
    return merged
