"""The ``clm`` replay mode: each transcript becomes a managed ``Conversation``."""

from __future__ import annotations

import time
from typing import Any

from clm_middleware.conversation import Conversation
from clm_middleware.replay.report import TurnRecord
from clm_middleware.replay.transcript import Message
from clm_middleware.replay.transcript_text import message_text


class ClmDriver:
    def __init__(self, conversation: Conversation) -> None:
        self.conversation = conversation
        self._answered = len(conversation.messages)  # messages after the last reply

    @property
    def tools_section(self) -> str | None:
        """The tools section as ``context`` shows it."""
        section = self.conversation.tools_prompt
        return self.conversation.chat_format.shown(section) if section else None

    def discard_turn(self) -> None:
        """The unanswered messages go (``Conversation.discard``); an assistant message
        that opened the transcript stays, since ``discard`` keeps answered history."""
        messages = self.conversation.messages
        start = len(messages)
        while start > self._answered and messages[start - 1].role != "assistant":
            start -= 1
        self.conversation.discard(start)

    def add(self, message: Message) -> None:
        self.conversation.add(message.role, message_text(message))

    def respond(self, forced: Message | None) -> TurnRecord:
        started = time.perf_counter()
        reply = self.conversation.respond(message_text(forced) if forced is not None else None)
        self._answered = len(self.conversation.messages)
        stats = reply.stats
        pool = self.conversation.engine.pool.stats()
        return TurnRecord(
            turn=0,
            conversation_id=self.conversation.id,
            prompt_tokens=stats.prompt_tokens,
            cached_tokens=stats.cached_tokens,
            approximate_tokens=stats.approximate_tokens,
            prefill_tokens=stats.prefill_tokens,
            ahead_tokens=stats.ahead_tokens,
            ahead_prefill_tokens=stats.ahead_prefill_tokens,
            context_tokens=stats.context_tokens,
            generated_tokens=stats.generated_tokens,
            ttft_s=stats.ttft_s,
            decode_s=stats.decode_s,
            turn_s=time.perf_counter() - started,
            bookkeeping_s=stats.bookkeeping_s,
            arena_s=stats.arena_s,
            reply=reply.text,
            forced_tokens=stats.forced_tokens,
            reply_nll=stats.reply_nll,
            reply_flags=list(stats.reply_flags),
            pool_blocks_in_use=stats.pool_blocks_in_use,
            kv_bytes=pool.kv_bytes,
            live_kv_bytes=(stats.conversation_blocks + stats.reclaimer_blocks) * pool.block_bytes,
            working_kv_bytes=self.conversation.engine.working_kv_bytes(
                stats.prompt_tokens + stats.generated_tokens + stats.forced_tokens
            ),
            extra=lifecycle_fields(stats),
        )

    @property
    def conversation_id(self) -> str:
        return self.conversation.id

    @property
    def context(self) -> str:
        return self.conversation.context

    @property
    def context_ids(self) -> list[int]:
        return self.conversation.context_ids

    @property
    def context_tokens(self) -> int:
        return self.conversation.context_tokens

    def close(self) -> None:
        self.conversation.close()


def lifecycle_fields(stats: Any) -> dict[str, Any]:
    """The per-turn report fields the lifecycle layer adds (see docs/report.md)."""
    return {
        "decisions": stats.decisions,
        "digest_tokens": stats.digest_tokens,
        "dropped_tokens": stats.dropped_tokens,
        "compressed_tokens": stats.compressed_tokens,
        "summaries": stats.summaries,
        "lifecycle_s": stats.lifecycle_s,
        "lifecycle_phases": stats.phases,
        "tagging_mode": stats.tagging_mode,
        "protocol_context": stats.protocol_context,
        "parse_ok": stats.parse_ok,
        "compaction": stats.compaction,
        "restored": stats.restored,
        "conversation_blocks": stats.conversation_blocks,
        "reclaimer_blocks": stats.reclaimer_blocks,
        "extra_calls": stats.extra_calls,
    }
