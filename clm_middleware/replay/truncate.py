"""The ``truncate`` baseline: keep the newest messages that fit the budget (and the system message).

What most chat wrappers do when a conversation outgrows the window. Prompts still go
through the block pool, but once the window starts to slide, the start of the prompt
changes every turn, so nearly every turn re-prefills the whole window.
"""

from __future__ import annotations

import time

from clm_middleware.engine import Engine, penalty_processors
from clm_middleware.errors import ConfigError
from clm_middleware.lifecycle.compaction import ContextBudgetError
from clm_middleware.render import ChatFormat
from clm_middleware.replay.plain import SystemHead, forced_ids, plain_turn_record, reply_of
from clm_middleware.replay.report import TurnRecord
from clm_middleware.replay.runner import ReplayOptions
from clm_middleware.replay.transcript import Message
from clm_middleware.replay.transcript_text import message_text


class TruncationDriver:
    def __init__(
        self,
        engine: Engine,
        chat_format: ChatFormat,
        options: ReplayOptions,
        conversation_id: str,
        budget: int,
        tools_section: str | None = None,
    ) -> None:
        if budget < 16:
            raise ConfigError("budget", f"truncation needs a budget of at least 16 tokens, got {budget}")
        self.engine, self.format, self.options = engine, chat_format, options
        self.conversation_id, self.budget = conversation_id, budget
        self.tools_section = chat_format.shown(tools_section) if tools_section else None  # as context shows it
        self.head = SystemHead(chat_format, tools_section)
        self.system: list[int] | None = None
        self.messages: list[tuple[str, list[int]]] = []  # (role, content ids) of each non-system message
        self.last_prompt: list[int] = []
        self.replies: list[str] = []  # the assistant's replies so far (``reply_flags`` compares against them)
        self._answered = 0  # len(messages) after the last reply
        self._replied = False

    def add(self, message: Message) -> None:
        role = message.role if self.format.supports_role(message.role) else "user"
        content = self.format.encode(message_text(message))
        if role == "system" and self.system is None and not self.messages:
            self.system = self.head.system_message(content)
        else:
            self.messages.append((role, content))

    def window(self) -> list[int]:
        """System message + the newest messages that fit, + the generation prompt.

        A newest message that alone is too long keeps its role's header and footer and
        the end of its content. A system message that leaves no room for even that is a
        ``ContextBudgetError``: the baseline keeps the system message whole, as clm does."""
        head = self.system if self.system is not None else self.head.before_first(None)
        room = self.budget - len(head) - len(self.format.generation_prompt_ids)
        kept: list[list[int]] = []
        for role, content in reversed(self.messages):  # rendered only as far back as the window reaches
            ids = self.format.message_ids(role, content)
            if len(ids) > room:
                break
            kept.append(ids)
            room -= len(ids)
        if not kept and self.messages:  # the newest message alone is too long: keep its tail
            role, content = self.messages[-1]
            glue = len(self.format.message_ids(role, []))
            keep = room - glue
            if keep < 1:
                needed = self.budget - room + glue + 1
                raise ContextBudgetError(
                    f"truncation needs {needed} tokens for the system message, the chat glue and one token "
                    f"of the newest message; the budget is {self.budget}",
                    hint="raise the budget, or shorten the system message",
                )
            kept.append(self.format.message_ids(role, content[-keep:]))
        prompt = list(head)
        for ids in reversed(kept):
            prompt.extend(ids)
        return prompt + list(self.format.generation_prompt_ids)

    def respond(self, forced: Message | None) -> TurnRecord:
        started = time.perf_counter()
        prompt = self.window()
        self.last_prompt = prompt
        generation = self.engine.generate(
            prompt,
            max_new_tokens=self.options.tokens_to_generate,
            **self.options.sampling,
            logits_processors=penalty_processors(self.options, self.engine.generation_defaults),
            forced_token_ids=forced_ids(forced, self.format),
        ).result()
        reply, reply_ids = reply_of(generation, forced, self.format, self.engine)
        self.messages.append(("assistant", list(reply_ids)))
        self._answered = len(self.messages)
        self._replied = True
        record = plain_turn_record(
            self.conversation_id, self.engine, generation, reply, started, self.replies, pooled=True
        )
        self.replies.append(reply)
        return record

    def discard_turn(self) -> None:
        del self.messages[self._answered :]
        if not self._replied:
            self.system = None  # it came with the failed turn

    @property
    def context_tokens(self) -> int:
        return len(self.window()) - len(self.format.generation_prompt_ids)

    @property
    def context_ids(self) -> list[int]:
        """The window the next turn would send, without its generation prompt."""
        window = self.window()
        return window[: len(window) - len(self.format.generation_prompt_ids)]

    @property
    def context(self) -> str:
        """What the model sees now: the window the next turn would send."""
        return self.format.tokenizer.decode(self.context_ids, skip_special_tokens=False)

    def close(self) -> None:
        """Holds no references."""
