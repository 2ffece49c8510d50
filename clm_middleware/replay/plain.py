"""The ``stateless`` and ``prefix`` replay modes, and what every plain driver shares.

A plain driver's context is exactly the prompt it sends: the rendered history (or, for
``truncate``, a window of it), with no lifecycle in between.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from typing import TYPE_CHECKING

from clm_middleware.engine import Engine, Generation
from clm_middleware.engine.penalties import penalty_processors
from clm_middleware.lifecycle.renderer import system_join_ids
from clm_middleware.lifecycle.reply_quality import has_artifact, reply_flags, shows_machinery
from clm_middleware.render import ChatFormat
from clm_middleware.replay.report import TurnRecord
from clm_middleware.replay.transcript import Message
from clm_middleware.replay.transcript_text import message_text

if TYPE_CHECKING:
    from clm_middleware.replay.runner import ReplayOptions


class PlainChatDriver:
    """``stateless`` and ``prefix`` modes: the whole history, rendered append-only.

    ``stateless`` recomputes the whole prompt every turn, as a stateless chat-model
    wrapper does; ``prefix`` sends the same token ids through the block pool.
    """

    def __init__(
        self,
        engine: Engine,
        chat_format: ChatFormat,
        options: ReplayOptions,
        conversation_id: str,
        tools_section: str | None = None,
    ) -> None:
        self.engine, self.format, self.options = engine, chat_format, options
        self.conversation_id = conversation_id
        self.tools_section = chat_format.shown(tools_section) if tools_section else None  # as context shows it
        self.head = SystemHead(chat_format, tools_section)
        self.history: list[int] | None = None
        self.replies: list[str] = []  # the assistant's replies so far, as the model saw them
        self.turn = 0
        self._answered: int | None = None  # len(history) after the last reply (None: no reply yet)

    def add(self, message: Message) -> None:
        role = message.role if self.format.supports_role(message.role) else "user"
        content = self.format.encode(message_text(message))
        if role == "system" and self.history is None:
            self.history = self.head.system_message(content)
            return
        self._append(role, content)

    def respond(self, forced: Message | None) -> TurnRecord:
        started = time.perf_counter()
        if self.history is None:
            self.history = self.head.before_first(None)
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
        self._answered = len(self.history)
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
        return list(self.history if self.history is not None else self.head.before_first(None))

    @property
    def context(self) -> str:
        """What the model sees now: the whole history."""
        return self.format.tokenizer.decode(self.context_ids, skip_special_tokens=False)

    def discard_turn(self) -> None:
        if self._answered is None:
            self.history = None
        elif self.history is not None:
            del self.history[self._answered :]

    def close(self) -> None:
        """Holds no references: every call releases its blocks to the LRU queue."""

    def _append(self, role: str, content_ids: list[int]) -> None:
        if self.history is None:
            self.history = self.head.before_first(role)
        self.history.extend(self.format.message_ids(role, content_ids))


class SystemHead:
    """The start of a prompt with the transcript's tools shown, as a managed conversation
    renders its tools section (``lifecycle/renderer.py``): one system message holding the
    section, then ``SYSTEM_JOIN`` and the first system message's content, if any."""

    def __init__(self, chat_format: ChatFormat, tools_section: str | None) -> None:
        self.format = chat_format
        self.section = chat_format.encode(tools_section) if tools_section else []

    def system_message(self, content_ids: list[int]) -> list[int]:
        """The first system message, the tools section before its content."""
        if not (self.section and content_ids):
            return self.format.message_ids("system", self.section or content_ids)
        join = system_join_ids(self.format, self.format.tokenizer.decode(content_ids[:8]))
        return self.format.message_ids("system", [*self.section, *join, *content_ids])

    def before_first(self, first_role: str | None) -> list[int]:
        """What precedes a first message that is not a system message (or nothing yet)."""
        if self.section and first_role != "system":
            return self.format.message_ids("system", self.section)
        return self.format.start_ids(first_role)


def forced_ids(forced: Message | None, chat_format: ChatFormat) -> list[int] | None:
    """The ids a teacher-forced turn feeds after its prompt (None: generate; an empty reply
    generates one token that is not kept)."""
    if forced is None:
        return None
    return chat_format.encode(message_text(forced)) or None


def reply_of(
    generation: Generation, forced: Message | None, chat_format: ChatFormat, engine: Engine
) -> tuple[str, list[int]]:
    """The turn's reply text and the ids the history keeps: the forced reply, or what was
    generated, tokenized as its text (what a client re-sending the history sends: the
    generated ids, unless the model spelled a word in tokens the tokenizer would not use)."""
    if forced is not None:
        reply = message_text(forced)
        return reply, list(generation.token_ids) if generation.request.forced else []
    reply_ids = strip_stop_token(generation.token_ids, engine.default_stop_ids)
    # a token cap can end the reply inside a character: its first bytes decode to U+FFFD,
    # which no reader wants, nor a client re-sends
    reply = chat_format.tokenizer.decode(reply_ids, skip_special_tokens=True).rstrip("\ufffd")
    return reply, chat_format.encode(reply)


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
    positions = stats.prompt_tokens + stats.generated_tokens + stats.forced_tokens  # the last one is never fed
    # a marker in the reply is an artifact unless the prompt itself holds one (quoted)
    machinery = has_artifact(reply) and shows_machinery(False, [engine.tokenizer.decode(generation.request.prompt)])
    return TurnRecord(
        turn=0,
        conversation_id=conversation_id,
        prompt_tokens=stats.prompt_tokens,
        cached_tokens=stats.cached_tokens,
        approximate_tokens=stats.approximate_tokens,
        prefill_tokens=stats.prefill_tokens,
        context_tokens=stats.prompt_tokens,
        generated_tokens=stats.generated_tokens,
        ttft_s=stats.ttft_s,
        decode_s=stats.decode_s,
        turn_s=time.perf_counter() - started,
        bookkeeping_s=stats.bookkeeping_s,
        arena_s=stats.arena_s,
        reply=reply,
        forced_tokens=stats.forced_tokens,
        reply_nll=generation.forced_nll,
        reply_flags=[] if forced else reply_flags(reply, reply, earlier_replies, machinery=machinery),
        pool_blocks_in_use=pool.blocks_in_use,
        kv_bytes=pool.kv_bytes if pooled else 0,
        working_kv_bytes=engine.working_kv_bytes(positions, pooled=pooled),
        # the stored chain of this prompt and reply, its partial tail block included: what
        # the next turn's hit depends on
        live_kv_bytes=-(-(positions - 1) // engine.block_size) * pool.block_bytes if pooled else 0,
    )


def strip_stop_token(token_ids: list[int], stop_ids: Iterable[int]) -> list[int]:
    """Generated ids without the final EOS: the template's footer puts it back."""
    if token_ids and token_ids[-1] in set(stop_ids):
        return token_ids[:-1]
    return list(token_ids)
