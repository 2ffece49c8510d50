"""Replay transcripts through a chat driver and record what each turn cost.

A turn is each point where the transcript has the assistant speak (and once more
if it ends on a user or tool message). Messages before it (system, user, tool)
enter the context first; then the model answers. With ``teacher_force`` the
transcript's own reply is kept instead of the generated one (no generation
variance; a generated replay keeps the transcript's tool calls and its second replies
in a row the same way, see ``kept_as_recorded``): the call computes the prompt, then the reply's tokens as a forced
continuation (``Engine.generate(forced_token_ids=...)``), which gives TTFT (the
prompt's last logits) and ``reply_nll`` (the reply's mean negative log-likelihood
given exactly the context the model saw) from the same forward; the reply's blocks
are stored, so the next turn reuses them. Generated replies get ``reply_flags``.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from clm_middleware.engine.penalties import check_penalties
from clm_middleware.engine.sampling import check_sampling_filters
from clm_middleware.errors import ClmError, ConfigError
from clm_middleware.replay.plain import (  # noqa: F401 -- re-exported: the drivers used to live here
    PlainChatDriver,
    forced_ids,
    plain_turn_record,
    reply_of,
    strip_stop_token,
)
from clm_middleware.replay.report import ON_ERROR, Failure, ReplayReport, TurnRecord
from clm_middleware.replay.transcript import Message, Transcript

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

    def discard_turn(self) -> None:
        """Forget the messages added since the last answer: a failed turn leaves nothing in the context."""

    def close(self) -> None:
        """Give back every pool reference the conversation holds."""


def replay(
    transcripts: Iterable[Transcript],
    make_driver: Callable[[Transcript], TurnDriver],
    report: ReplayReport,
    *,
    teacher_force: bool,
    on_turn: Callable[[TurnRecord], None] | None = None,
    on_error: str = "stop",
    on_failure: Callable[[Failure], None] | None = None,
) -> ReplayReport:
    """Replay every transcript in order, appending a record per turn to ``report``.

    If interrupted (Ctrl-C), the report keeps the finished turns, ``complete`` is
    False, and the interrupt propagates after every driver is closed. ``on_error``:
    see ``replay_interleaved``.
    """
    replay_interleaved(
        transcripts,
        {report.mode: make_driver},
        {report.mode: report},
        teacher_force=teacher_force,
        on_turn=(lambda _mode, record: on_turn(record)) if on_turn else None,
        on_error=on_error,
        on_failure=(lambda _mode, failure: on_failure(failure)) if on_failure else None,
    )
    return report


def replay_interleaved(
    transcripts: Iterable[Transcript],
    make_drivers: dict[str, Callable[[Transcript], TurnDriver]],
    reports: dict[str, ReplayReport],
    *,
    teacher_force: bool,
    on_turn: Callable[[str, TurnRecord], None] | None = None,
    on_error: str = "stop",
    on_failure: Callable[[str, Failure], None] | None = None,
) -> dict[str, ReplayReport]:
    """Replay the same transcripts under several modes, turn by turn.

    Each turn runs every mode once, and the order of the modes rotates from turn to
    turn, so a noisy machine slows all modes alike: ratios measured in one run are
    comparable even when absolute times are not.

    A turn whose messages or answer raise a ``ClmError`` (a message over the budget, a
    prompt over the context window, a message no entry point accepts; a conversation that
    cannot be set up, e.g. a protocol prompt over the budget, fails its every turn) stops the replay
    with ``on_error="stop"``: a ``ReplayTurnError`` naming the conversation and turn.
    With ``"skip"`` the mode's report records a ``Failure`` instead, the driver forgets
    that turn's messages (``discard_turn``) but its system messages (the first turn
    brings the system prompt), and the replay goes on with the next turn;
    the other modes are not affected. A failed turn keeps its turn number.
    """
    if on_error not in ON_ERROR:
        raise ConfigError("on_error", f"must be one of {', '.join(ON_ERROR)}, got {on_error!r}")
    modes = list(make_drivers)
    started = time.perf_counter()
    for report in reports.values():
        report.complete = False
    try:
        turn_index = 0
        for transcript in transcripts:
            drivers: dict[str, TurnDriver] = {}
            # system messages of failed turns: the next turn adds them first
            carried: dict[str, list[Message]] = {mode: [] for mode in modes}
            unset: dict[str, ClmError] = {}  # modes whose conversation could not be set up (its every turn fails)
            try:
                for mode in modes:
                    try:
                        drivers[mode] = make_drivers[mode](transcript)
                    except ClmError as error:  # e.g. a protocol prompt over the budget
                        unset[mode] = error
                plan = turn_plan(transcript)
                for context, answer in plan:
                    shift = turn_index % len(modes)
                    for mode in modes[shift:] + modes[:shift]:
                        report = reports[mode]
                        turn = next_turn(report)
                        added: list[Message] = []
                        pending, carried[mode] = carried[mode], []
                        try:
                            if mode in unset:
                                raise unset[mode]
                            driver = drivers[mode]
                            for message in [*pending, *context]:
                                driver.add(message)
                                added.append(message)
                            record = driver.respond(kept_as_recorded(answer, teacher_force, context))
                        except ClmError as error:
                            failure = Failure(str(error), turn, transcript.conversation_id)
                            report.failures.append(failure)  # stopping or not, the report says why
                            if mode in drivers:
                                drivers[mode].discard_turn()  # the context is the last answered turn's, as reported
                            # but for the system messages that came with the turn (or were carried to
                            # it): they set up the conversation (its first turn brings the system
                            # prompt), not this turn, so the next turn adds them first, and fails the same
                            # way while one cannot be added (a system block over the budget had been left
                            # out, and the turns after ran without the system prompt: a CLI sweep)
                            carried[mode] = [m for m in [*pending, *context] if m.role == "system"]
                            if on_error == "stop":
                                for other in modes:  # every report says why it stopped
                                    if other != mode:
                                        _record_stop(reports[other], mode, turn, transcript.conversation_id, error)
                                raise ReplayTurnError(transcript.conversation_id, turn, error) from error
                            if on_failure is not None:
                                on_failure(mode, failure)
                            continue
                        except BaseException:  # interrupted (Ctrl-C, SIGTERM): the store sees complete turns only
                            if mode in drivers and added:
                                drivers[mode].discard_turn()
                            raise
                        record.turn = turn
                        if teacher_force and answer is None:
                            # the transcript leaves it unanswered: its prompt is computed and one
                            # token decoded, not kept (an empty reply), and there is no reply to judge
                            record.reply_flags = []
                            record.extra["unanswered"] = True
                        elif teacher_force and not record.forced_tokens and not answer.tool_calls:
                            # the transcript's reply is empty: nothing to force, nothing to judge
                            record.reply_flags = []
                            record.extra["empty_reply"] = True
                        report.turns.append(record)
                        if on_turn is not None:
                            on_turn(mode, record)
                    turn_index += 1
                for mode, driver in drivers.items():  # what a failed last turn carried: the context holds it
                    for message in carried[mode]:
                        with contextlib.suppress(ClmError):  # one that cannot be added stays out, as reported
                            driver.add(message)
                for message in unanswerable_tail(transcript, plan):
                    for driver in drivers.values():  # no turn: the context holds them, as the transcript does
                        driver.add(message)
            finally:
                for driver in drivers.values():
                    driver.close()
        for report in reports.values():
            report.complete = True
    finally:
        for report in reports.values():
            report.wall_s = time.perf_counter() - started
    return reports


def _record_stop(report: ReplayReport, failed_mode: str, turn: int, conversation_id: str, error: ClmError) -> None:
    """A ``Failure`` in ``report`` for the turn it did not run because another mode's failed."""
    report.failures.append(
        Failure(
            f"not run: the replay stopped when the {failed_mode} mode failed at turn {turn}: {error}",
            next_turn(report),
            conversation_id,
        )
    )


def next_turn(report: ReplayReport) -> int:
    """The number of the report's next turn: a failed turn keeps its number."""
    return len(report.turns) + sum(f.turn is not None for f in report.failures) + 1


def kept_as_recorded(answer: Message | None, teacher_force: bool, context: Sequence[Message] = ()) -> Message | None:
    """The transcript reply a turn keeps instead of generating one (None: generate).

    Teacher-forced, every reply, and an empty one for a final turn the transcript leaves
    unanswered (its prompt is computed; the one token decoded for TTFT is not kept).
    Generated, an assistant message that calls tools (a replay runs no tools and binds
    none, so a generated reply could not make the call, and the recorded results that
    follow would answer a call the context never made), and one that follows the previous
    answer with no user or tool message between (``context``, the turn's messages before
    it): the model, given nothing new to answer, would only say its last reply again.
    """
    if answer is None:
        return Message("assistant", "") if teacher_force else None
    follow_up = not any(m.role in ("user", "tool") for m in context)
    return answer if teacher_force or answer.tool_calls or follow_up else None


def turn_plan(transcript: Transcript) -> list[tuple[list[Message], Message | None]]:
    """Split a transcript into turns: (messages that come first, the assistant's answer).

    The answer is None for a final turn the transcript leaves unanswered. Assistant
    messages before the first user or tool message (a bot's greeting) are context of
    the first turn, not turns: there is nothing yet for the model to answer. A
    transcript with no assistant message at all is a script of what a user says: each
    user or tool message is a turn of its own, answered by the model (it had been one
    turn of every message joined: a sweep's 126-message script replayed as "1/1 turns").
    """
    if not any(message.role == "assistant" for message in transcript.messages):
        return _scripted_turns(transcript.messages)
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


def _scripted_turns(messages: Sequence[Message]) -> list[tuple[list[Message], Message | None]]:
    """One unanswered turn per user or tool message, the system messages before it with it."""
    plan: list[tuple[list[Message], Message | None]] = []
    context: list[Message] = []
    for message in messages:
        context.append(message)
        if message.role in ("user", "tool"):
            plan.append((context, None))
            context = []
    return plan


def unanswerable_tail(transcript: Transcript, plan: list[tuple[list[Message], Message | None]]) -> list[Message]:
    """The messages after the last turn of ``plan`` (``turn_plan(transcript)``) that start
    none: a transcript of only a system prompt (and a bot's greeting) has them all."""
    planned = sum(len(context) + (answer is not None) for context, answer in plan)
    return list(transcript.messages[planned:])


def count_turns(transcripts: Iterable[Transcript]) -> int:
    return sum(len(turn_plan(transcript)) for transcript in transcripts)
