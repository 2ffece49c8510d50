"""Replay transcripts through a chat driver and record what each turn cost.

A turn is each point where the transcript has the assistant speak (and once more
if it ends on a user or tool message). Messages before it (system, user, tool)
enter the context first; then the model answers. With ``teacher_force`` the
transcript's own reply is kept instead of the generated one (no generation
variance): the call computes the prompt, then the reply's tokens as a forced
continuation (``Engine.generate(forced_token_ids=...)``), which gives TTFT (the
prompt's last logits) and ``reply_nll`` (the reply's mean negative log-likelihood
given exactly the context the model saw) from the same forward; the reply's blocks
are stored, so the next turn reuses them. Generated replies get ``reply_flags``.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, Protocol

from clm_middleware.engine import Engine, Generation
from clm_middleware.engine.penalties import check_penalties, penalty_processors
from clm_middleware.engine.sampling import check_sampling_filters
from clm_middleware.errors import ClmError, ConfigError
from clm_middleware.lifecycle.reply_quality import reply_flags
from clm_middleware.render import ChatFormat
from clm_middleware.replay.report import ReplayReport, TurnRecord
from clm_middleware.replay.transcript import Message, Transcript
from clm_middleware.replay.transcript_text import message_text

PLAIN_MODES = ("stateless", "prefix")


class ReplayTurnError(ClmError):
    """A turn of a replay failed; says which conversation and turn."""

    def __init__(self, conversation_id: str, turn: int, error: ClmError) -> None:
        super().__init__(f"conversation {conversation_id!r}, turn {turn}: {error.message}", hint=error.hint)
        self.cause = error


MODES = (*PLAIN_MODES, "truncate", "clm")


@dataclass(frozen=True, slots=True)
class ReplayOptions:
    mode: str = "prefix"
    max_new_tokens: int = 64
    teacher_force: bool = False
    # sampling (engine/sampling.py): greedy by default, so a replay is reproducible;
    # top_k / min_p None: the model's generation config
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int | None = None
    min_p: float | None = None
    seed: int | None = None
    # repetition controls, the same in every mode (engine/penalties.py)
    repetition_penalty: float | None = None
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    no_repeat_ngram_size: int | None = None

    def __post_init__(self) -> None:
        if self.max_new_tokens < 1:
            raise ConfigError("max_new_tokens", f"must be ≥ 1, got {self.max_new_tokens}")
        if not self.temperature >= 0:
            raise ConfigError("temperature", f"must be ≥ 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ConfigError("top_p", f"must be in (0, 1], got {self.top_p}")
        check_sampling_filters(self.top_k, self.min_p)
        check_penalties(self)

    @property
    def tokens_to_generate(self) -> int:
        return 1 if self.teacher_force else self.max_new_tokens

    @property
    def sampling(self) -> dict[str, Any]:
        """The sampling keywords of ``Engine.generate`` (and of ``Conversation``)."""
        return {
            "temperature": self.temperature,
            "top_p": self.top_p,
            "top_k": self.top_k,
            "min_p": self.min_p,
            "seed": self.seed,
        }


class TurnDriver(Protocol):
    """One conversation under replay."""

    def add(self, message: Message) -> None:
        """Put a non-assistant message into the context."""

    def respond(self, forced: Message | None) -> TurnRecord:
        """Answer now; with ``forced``, keep that reply instead of the generated one."""

    def close(self) -> None:
        """Give back every pool reference the conversation holds."""


class PlainChatDriver:
    """``stateless`` and ``prefix`` modes: the whole history, rendered append-only.

    ``stateless`` recomputes the whole prompt every turn, as a stateless chat-model
    wrapper does; ``prefix`` sends the same token ids through the block pool.
    """

    def __init__(self, engine: Engine, chat_format: ChatFormat, options: ReplayOptions, conversation_id: str) -> None:
        self.engine, self.format, self.options = engine, chat_format, options
        self.conversation_id = conversation_id
        self.history: list[int] | None = None
        self.replies: list[str] = []  # the assistant's replies so far, as the model saw them
        self.turn = 0

    def add(self, message: Message) -> None:
        role = message.role if self.format.supports_role(message.role) else "user"
        self._append(role, self.format.encode(message_text(message)))

    def respond(self, forced: Message | None) -> TurnRecord:
        started = time.perf_counter()
        if self.history is None:
            self.history = self.format.start_ids(None)
        prompt = self.history + list(self.format.generation_prompt_ids)
        generation = self.engine.generate(
            prompt,
            max_new_tokens=self.options.tokens_to_generate,
            **self.options.sampling,
            use_pool=self.options.mode == "prefix",
            logits_processors=penalty_processors(self.options, self.engine.generation_defaults),
            forced_token_ids=forced_ids(forced, self.format),
        ).result()
        reply, reply_ids = reply_of(generation, forced, self.format, self.engine)
        self._append("assistant", reply_ids)
        record = plain_turn_record(
            self.conversation_id,
            self.engine,
            generation,
            reply,
            started,
            self.replies,
            pooled=self.options.mode == "prefix",
        )
        self.replies.append(reply)
        return record

    @property
    def context_tokens(self) -> int:
        return len(self.history) if self.history is not None else 0

    @property
    def context_ids(self) -> list[int]:
        """The ids the next turn's prompt starts with (before its generation prompt): the whole history."""
        return list(self.history if self.history is not None else self.format.start_ids(None))

    @property
    def context(self) -> str:
        """What the model sees now: the whole history."""
        return self.format.tokenizer.decode(self.context_ids, skip_special_tokens=False)

    def close(self) -> None:
        """Holds no references: every call releases its blocks to the LRU queue."""

    def _append(self, role: str, content_ids: list[int]) -> None:
        if self.history is None:
            self.history = self.format.start_ids(role)
        self.history.extend(self.format.message_ids(role, content_ids))


def forced_ids(forced: Message | None, chat_format: ChatFormat) -> list[int] | None:
    """The ids a teacher-forced turn feeds after its prompt (None: generate; an empty reply
    generates one token that is not kept)."""
    if forced is None:
        return None
    return chat_format.encode(message_text(forced)) or None


def reply_of(
    generation: Generation, forced: Message | None, chat_format: ChatFormat, engine: Engine
) -> tuple[str, list[int]]:
    """The turn's reply text and the ids the history keeps: the forced reply, or what was generated."""
    if forced is not None:
        reply = message_text(forced)
        return reply, list(generation.token_ids) if generation.request.forced else []
    reply_ids = strip_stop_token(generation.token_ids, engine.default_stop_ids)
    return chat_format.tokenizer.decode(reply_ids, skip_special_tokens=True), reply_ids


def plain_turn_record(
    conversation_id: str,
    engine: Engine,
    generation: Generation,
    reply: str,
    started: float,
    earlier_replies: list[str],
    *,
    pooled: bool,
) -> TurnRecord:
    """A turn record for drivers whose context is the prompt they sent (``earlier_replies``:
    the replies before this one, for ``reply_flags``)."""
    stats, pool = generation.stats, engine.pool.stats()
    forced = generation.request.forced is not None
    return TurnRecord(
        turn=0,
        conversation_id=conversation_id,
        prompt_tokens=stats.prompt_tokens,
        cached_tokens=stats.cached_tokens,
        prefill_tokens=stats.prefill_tokens,
        context_tokens=stats.prompt_tokens,
        generated_tokens=stats.generated_tokens,
        ttft_s=stats.ttft_s,
        turn_s=time.perf_counter() - started,
        bookkeeping_s=stats.bookkeeping_s,
        arena_s=stats.arena_s,
        reply=reply,
        forced_tokens=stats.forced_tokens,
        reply_nll=generation.forced_nll,
        reply_flags=[] if forced else reply_flags(reply, reply, earlier_replies),
        pool_blocks_in_use=pool.blocks_in_use,
        kv_bytes=pool.kv_bytes if pooled else 0,
        working_kv_bytes=(stats.prompt_tokens + stats.generated_tokens) * engine.layout.bytes_per_token,
        # the stored chain of this prompt and reply: what the next turn's hit depends on
        live_kv_bytes=(stats.prompt_tokens + stats.generated_tokens - 1) // engine.block_size * pool.block_bytes
        if pooled
        else 0,
    )


def strip_stop_token(token_ids: list[int], stop_ids: Iterable[int]) -> list[int]:
    """Generated ids without the final EOS: the template's footer puts it back."""
    if token_ids and token_ids[-1] in set(stop_ids):
        return token_ids[:-1]
    return list(token_ids)


def replay(
    transcripts: Iterable[Transcript],
    make_driver: Callable[[Transcript], TurnDriver],
    report: ReplayReport,
    *,
    teacher_force: bool,
    on_turn: Callable[[TurnRecord], None] | None = None,
) -> ReplayReport:
    """Replay every transcript in order, appending a record per turn to ``report``.

    If interrupted (Ctrl-C), the report keeps the finished turns, ``complete`` is
    False, and the interrupt propagates after every driver is closed.
    """
    replay_interleaved(
        transcripts,
        {report.mode: make_driver},
        {report.mode: report},
        teacher_force=teacher_force,
        on_turn=(lambda _mode, record: on_turn(record)) if on_turn else None,
    )
    return report


def replay_interleaved(
    transcripts: Iterable[Transcript],
    make_drivers: dict[str, Callable[[Transcript], TurnDriver]],
    reports: dict[str, ReplayReport],
    *,
    teacher_force: bool,
    on_turn: Callable[[str, TurnRecord], None] | None = None,
) -> dict[str, ReplayReport]:
    """Replay the same transcripts under several modes, turn by turn.

    Each turn runs every mode once, and the order of the modes rotates from turn to
    turn, so a noisy machine slows all modes alike: ratios measured in one run are
    comparable even when absolute times are not.
    """
    modes = list(make_drivers)
    started = time.perf_counter()
    for report in reports.values():
        report.complete = False
    try:
        turn_index = 0
        for transcript in transcripts:
            drivers: dict[str, TurnDriver] = {}
            try:
                for mode in modes:
                    drivers[mode] = make_drivers[mode](transcript)
                for context, answer in turn_plan(transcript):
                    shift = turn_index % len(modes)
                    for mode in modes[shift:] + modes[:shift]:
                        driver = drivers[mode]
                        for message in context:
                            driver.add(message)
                        try:
                            record = driver.respond(answer if teacher_force else None)
                        except ClmError as error:
                            turn = len(reports[mode].turns) + 1
                            raise ReplayTurnError(transcript.conversation_id, turn, error) from error
                        record.turn = len(reports[mode].turns) + 1
                        reports[mode].turns.append(record)
                        if on_turn is not None:
                            on_turn(mode, record)
                    turn_index += 1
            finally:
                for driver in drivers.values():
                    driver.close()
        for report in reports.values():
            report.complete = True
    finally:
        for report in reports.values():
            report.wall_s = time.perf_counter() - started
    return reports


def turn_plan(transcript: Transcript) -> list[tuple[list[Message], Message | None]]:
    """Split a transcript into turns: (messages that come first, the assistant's answer).

    The answer is None for a final turn the transcript leaves unanswered. Assistant
    messages before the first user or tool message (a bot's greeting) are context of
    the first turn, not turns: there is nothing yet for the model to answer.
    """
    plan: list[tuple[list[Message], Message | None]] = []
    context: list[Message] = []
    for message in transcript.messages:
        opening = not plan and all(m.role in ("system", "assistant") for m in context)
        if message.role == "assistant" and not opening:
            plan.append((context, message))
            context = []
        else:
            context.append(message)
    if any(message.role in ("user", "tool") for message in context):
        plan.append((context, None))
    return plan


def count_turns(transcripts: Iterable[Transcript]) -> int:
    return sum(len(turn_plan(transcript)) for transcript in transcripts)
